"""A command workload's output: which lines are metrics, and what its exit code means."""
import math

import pytest

from orbit_dagster.core import placeholders
from orbit_dagster.runtime.agent import EXIT_DIVERGED, EXIT_INFRA, EXIT_OK, EXIT_OOM, EXIT_PREEMPTED, EXIT_USER_ERROR
from orbit_dagster.runtime.script_output import exit_code_for, metric_line


def test_a_json_object_with_a_step_and_numbers_is_a_metrics_line():
    assert metric_line('{"step": 120, "train/loss": 1.93, "lr": 3}\n') == (120, {"train/loss": 1.93, "lr": 3.0}, None)
    assert metric_line('{"eval/loss": 0.5}') == (None, {"eval/loss": 0.5}, None)  # eval lines need no step
    step, values, _ = metric_line('{"step": 3, "train/loss": NaN}')
    assert step == 3 and math.isnan(values["train/loss"])  # a divergence is reported, not hidden


@pytest.mark.parametrize("line", [
    "step 120 loss 1.93", "", "[1, 2]", '{"step": 1.5, "loss": 1}', '{"step": true, "loss": 1}',
    '{"step": "3", "loss": 1}', '{"step": -1, "loss": 1}', '{"step": 4}', '{"msg": "hello"}', '{"broken": ',
    '{"step": 2, "flag": true}', "{" * 5000 + "}" * 5000,
])
def test_anything_else_is_ordinary_log_output(line):
    assert metric_line(line) is None


def test_non_numeric_values_are_dropped_and_a_failure_line_names_its_class():
    assert metric_line('{"step": 2, "loss": 1, "note": "x", "ok": false}') == (2, {"loss": 1.0}, None)
    assert metric_line('{"orbit_failure": "oom"}') == (None, {}, "oom")
    assert metric_line('{"orbit_failure": "bogus"}') is None


@pytest.mark.parametrize("returncode, noticed, failure, stderr, code", [
    (0, False, None, "", EXIT_OK),
    (0, True, None, "", EXIT_PREEMPTED),  # saved on the notice and exited: a reclaim
    (-9, True, None, "", EXIT_PREEMPTED),  # killed at the end of the grace: still the reclaim
    (1, False, None, "Traceback ...\nValueError: bad", EXIT_USER_ERROR),
    (1, False, None, "RuntimeError: CUDA out of memory. Tried to allocate", EXIT_OOM),
    (2, False, "divergence", "", EXIT_DIVERGED),
    (2, False, "infrastructure", "CUDA out of memory", EXIT_INFRA),  # the script's own word wins
    (-11, False, None, "", EXIT_USER_ERROR),
])
def test_exit_codes_map_onto_the_agents_taxonomy(returncode, noticed, failure, stderr, code):
    assert exit_code_for(returncode, noticed=noticed, failure=failure, stderr_tail=stderr)[0] == code


def test_placeholders_are_filled_as_text():
    config = {"steps": 200, "lr": 0.003, "on": True, "layers": [1, 2]}
    element = "--x={checkpoint_dir}/{config.steps}:{config.lr}:{config.on}:{config.layers}:{{lit}}"
    assert placeholders.fill(element, {"checkpoint_dir": "/c"}, config) == "--x=/c/200:0.003:true:[1, 2]:{lit}"
