"""Several processes: the command under torchrun, and every process of a run found by its tag."""
import os
import subprocess
import sys
import time

import pytest

from orbit_dagster.core.errors import TemplateError
from orbit_dagster.core.process_tree import RUN_TAG, kill_tagged, tagged
from orbit_dagster.core.templates import load_template, typed_template
from orbit_dagster.runtime.command import torchrun_argv

LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_a_python_script_a_module_and_a_program_each_become_torchrun_entrypoints():
    assert torchrun_argv(["python", "train.py", "--x", "1"], 2) == [*LAUNCH, "train.py", "--x", "1"]
    assert torchrun_argv(["python", "-m", "pkg.train", "--x"], 2) == [*LAUNCH, "--module", "pkg.train", "--x"]
    assert torchrun_argv(["./trainer", "a"], 2) == [*LAUNCH, "--no-python", "./trainer", "a"]


def test_several_processes_are_for_command_workloads_only():
    raw = load_template("charlm-finetune").model_dump(mode="json")
    raw["resources"]["processes"] = 2
    with pytest.raises(TemplateError) as err:
        typed_template(raw, context="test")
    assert "resources" in str(err.value) and "torchrun" in str(err.value)
    assert load_template("ddp-script").resources.processes == 2


def test_a_process_that_left_the_group_is_found_and_killed_by_its_tag():
    tag = f"test-{os.getpid()}-{time.time_ns()}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env={**os.environ, RUN_TAG: tag})
    try:
        deadline = time.time() + 10
        while child.pid not in tagged(RUN_TAG, tag) and time.time() < deadline:
            time.sleep(0.05)
        assert tagged(RUN_TAG, tag) == [child.pid]
        assert tagged(RUN_TAG, tag + "x") == []  # the whole entry, not a prefix
        assert kill_tagged(RUN_TAG, tag) == 1
        assert child.wait(timeout=10) == -9
        assert kill_tagged(RUN_TAG, "") == 0
    finally:
        child.kill()
