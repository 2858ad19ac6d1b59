"""Fuzzing `orbit submit` and `orbit retry` through the CLI's own entry point (`main`).

For every input: exit 0 or 2, never a traceback; a refusal is one short line on stderr and
leaves $ORBIT_HOME exactly as it was (no bundle, no ledger change); an acceptance froze a
template that passes the workload's schema. Seeded (derandomize) so a failure replays.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from orbit_dagster.control.validate import check_serviceable
from orbit_dagster.core.templates import load_template, typed_template
from orbit_dagster.settings import Settings
from tests.helpers import run_cli

ALLOWED = list(load_template("charlm-finetune").allow_overrides)
MIB = "x" * (1 << 20)
FUZZ = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

def num(lo, hi):
    return st.one_of(st.integers(max(lo, 1), hi).map(str), st.integers(lo, hi).map(str), st.floats(lo, hi).map(repr))


# Mostly values a person might type for each allowed key, so that a good share is accepted and
# the "what was accepted is valid" half of the test has cases; the rest is hostile.
PLAUSIBLE = {
    "config.steps": num(-10, 500), "config.lr": num(-1, 2), "config.seed": num(-5, 2**32),
    "config.micro_batch": num(-1, 64), "config.grad_accum": num(-1, 64), "config.dropout": num(-1, 2),
    "config.device_memory_mb": num(-1, 100), "config.trainable": st.sampled_from(["all", "head", "both", "true"]),
    "placement": st.sampled_from(["sim", "ssh_rental", "aws_spot", "local", "moon"]),
    "launch_mode": st.sampled_from(["host_process", "docker_image", "vm"]),
    "region": st.sampled_from(["us-east-1", "europe-west4", "null", "a b", "x" * 70]),
    "resources.gpu": st.sampled_from(["any", "H100", "h100", "L4", "A100", "A100-80G", "H900", "a100-80gb", ""]),
    "max_price_per_gpu_hour": num(-1, 50), "checkpoint.every_steps": num(-1, 100),
    "checkpoint.interval_policy": st.sampled_from(["orbit", "fixed", "young-daly", "daly"]),
    "checkpoint.on_rebalance": st.sampled_from(["checkpoint", "record", "migrate", "move"]),
    "checkpoint.store": st.sampled_from(["fs", "s3", "gcs"]), "max_interruptions": num(-1, 20),
    "deadline_hours": num(-1, 100),
}
assert set(PLAUSIBLE) == set(ALLOWED), "a new allowed key needs plausible values here"
plausible_pairs = st.sampled_from(sorted(PLAUSIBLE)).flatmap(lambda k: st.tuples(st.just(k), PLAUSIBLE[k]))
keys = st.one_of(
    st.sampled_from(ALLOWED),
    st.sampled_from(["config.d_model", "name", "config", "resources", "config.lr.x", "", "a..b", "workload",
                     "secret_env", "env.PATH", "checkpoint", "__class__", "config.__dict__", "-x"]),
    st.text(max_size=40),
)
values = st.one_of(
    st.sampled_from(["abc", "-5", "0", "2", "0.5", "1e-3", "true", "false", "null", "~", ".inf", "nan", "-0", "1e400",
                     "[1, 2]", "{a: 1}", "&a [*a]", "!!python/object/apply:os.system ['true']", "'quoted'", "H900",
                     "local", "docker_image", "s3", "banana", "", " ", "0.0001"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=30),
    st.just(MIB),
)
hostile_pairs = st.tuples(keys, values)
sets = st.lists(st.one_of(plausible_pairs, hostile_pairs), max_size=4)
plausible_sets = st.lists(plausible_pairs, max_size=4, unique_by=lambda kv: kv[0])
good_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", fullmatch=True)
names = st.one_of(good_names, st.sampled_from(["a" * 64, "-rf", "a b", "../x", "é", "", MIB]), st.text(max_size=70))
templates = st.one_of(st.just("charlm-finetune"),
                      st.sampled_from(["nope", "../../etc/passwd", "x.yaml", "/etc/passwd.yaml", "CHARLM", MIB]),
                      st.text(max_size=50))


run = run_cli  # `orbit ARGV` in this process: (exit code, stdout, stderr)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time: any write shows."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def assert_refusal_or_acceptance(code: int, out: str, err: str, before: dict, home: Path) -> None:
    assert "Traceback" not in err + out, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert len(err) < 4000, f"a refusal of {len(err)} characters"
        assert tree(home) == before, "a refused command changed $ORBIT_HOME"


def frozen_template(home: Path, job: str, attempt: int = 1) -> dict:
    bundles = [json.loads(p.read_text()) for p in (home / "bundles").glob("*/job.json")]
    return [b for b in bundles if b["job_id"] == job][-1 if attempt else 0]["template_snapshot"]


@pytest.fixture
def seeded_home(orbit_home):
    """A home with a ledger already in it, so that 'nothing changed' is a claim about real files."""
    code, out, err = run(["submit", "charlm-finetune", "--experiment", "seed"])
    assert code == 0, err
    return orbit_home


def submit_case(home: Path, template: str, pairs: list, experiment: str, project: str) -> int:
    argv = ["submit", template]
    for k, v in pairs:
        argv += ["--set", f"{k}={v}"]
    argv += ["--experiment", experiment, "--project", project]
    before = tree(home)
    code, out, err = run(argv)
    event(f"exit {code}")
    assert_refusal_or_acceptance(code, out, err, before, home)
    if code == 0:
        job = out.strip().splitlines()[0]
        snapshot = frozen_template(home, job)
        again = typed_template(snapshot, context="accepted job")  # what was accepted passes the schema
        assert again.model_dump(mode="json") == snapshot
        assert {k for k, _ in pairs} <= set(again.allow_overrides)
        check_serviceable(Settings.from_env(), again, {})  # and it can run here (GPU name, backend, store)
    return code


@FUZZ
@given(template=templates, pairs=sets, experiment=names, project=names)
def test_submit_of_hostile_input_never_tracebacks_and_a_refusal_writes_nothing(seeded_home, template, pairs,
                                                                               experiment, project):
    submit_case(seeded_home, template, pairs, experiment, project)


@FUZZ
@given(pairs=plausible_sets, experiment=good_names)
def test_submit_of_plausible_input_accepts_only_valid_jobs(seeded_home, pairs, experiment):
    # One project for every experiment here: an experiment belongs to one project.
    submit_case(seeded_home, "charlm-finetune", pairs, experiment, "fuzz")


@pytest.fixture
def finished_job(seeded_home):
    code, out, err = run(["submit", "charlm-finetune", "--experiment", "retry"])
    job = out.strip().splitlines()[0]
    assert code == 0 and run(["cancel", job])[0] == 0
    return job


@FUZZ
@given(pairs=st.one_of(plausible_sets, sets), job=st.one_of(st.none(), names))
def test_retry_never_tracebacks_and_a_refusal_writes_nothing(seeded_home, finished_job, pairs, job):
    argv = ["retry", finished_job if job is None else job]
    for k, v in pairs:
        argv += ["--set", f"{k}={v}"]
    before = tree(seeded_home)
    code, out, err = run(argv)
    event(f"exit {code}")
    assert_refusal_or_acceptance(code, out, err, before, seeded_home)
    if code == 0:
        assert run(["cancel", finished_job])[0] == 0  # finished again, for the next example
