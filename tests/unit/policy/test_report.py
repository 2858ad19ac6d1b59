from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orbit_dagster.catalog.reclaim_model import generate_trace
from orbit_dagster.catalog.traces import load_trace
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.report import (
    CHECKPOINT_POLICIES, DEADLINE_POLICIES, format_result_table, run_simulate_cli, simulate_command, simulate_trace,
)

from .helpers import model

M = model()


@pytest.fixture
def trace_file(tmp_path):
    t = generate_trace(M, 21, 3 * 86400, 60)
    p = tmp_path / "synthetic.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": t.gap_seconds}, "data": list(t.data), "prices": list(t.prices)}))
    return p


def test_checkpoint_mode_reports_every_policy_and_is_deterministic(trace_file):
    a = simulate_command(trace_file, job_hours=4, starts=3, model=M)
    assert [r["policy"] for r in a["results"]] == list(CHECKPOINT_POLICIES)
    assert a == simulate_command(trace_file, job_hours=4, starts=3, model=M)
    json.dumps(a)
    for r in a["results"]:
        assert {"goodput", "cost_usd", "missed_deadlines", "checkpoint_overhead_gpu_hours", "wasted_gpu_hours"} <= set(r)
    table = format_result_table(a)
    assert all(p in table for p in CHECKPOINT_POLICIES) and "wasted GPU-h" in table


def test_deadline_mode_reports_every_policy(trace_file):
    a = simulate_command(trace_file, job_hours=4, deadline_hours=6, starts=2, model=M)
    rows = {r["policy"]: r for r in a["results"]}
    assert list(rows) == list(DEADLINE_POLICIES)
    assert all(r["missed_feasible_deadlines"] == 0 for r in rows.values())
    assert rows["optimal"]["cost_usd"] <= min(r["cost_usd"] for r in rows.values()) + 1e-9
    assert "vs optimal" in format_result_table(a)


def test_one_policy_and_bad_arguments(trace_file):
    a = simulate_command(trace_file, policy="orbit", job_hours=2, starts=1, model=M)
    assert [r["policy"] for r in a["results"]] == ["orbit"]
    with pytest.raises(OrbitError) as err:
        simulate_command(trace_file, policy="greedy", model=M)
    assert err.value.field == "policy" and "other mode" in str(err.value)
    with pytest.raises(OrbitError) as err:
        simulate_command(trace_file, job_hours=-1, model=M)
    assert err.value.field == "job_hours"


def test_cli_helper_returns_text_and_exit_code(trace_file, tmp_path):
    text, code = run_simulate_cli(str(tmp_path / "nope.json"))
    assert code == 2 and text.startswith("error:") and "\n" not in text
    text, code = run_simulate_cli(str(trace_file), policy="fixed-30m", job_hours=1, as_json=True)
    assert code == 0 and json.loads(text)["results"][0]["policy"] == "fixed-30m"


def test_policy_layer_imports_no_dagster_boto3_or_paramiko():
    code = ("import sys, orbit_dagster.policy.report, orbit_dagster.policy.offer_choice, "
            "orbit_dagster.policy.migration, orbit_dagster.catalog.traces, orbit_dagster.catalog.fit_reclaims; "
            "bad = [m for m in ('dagster', 'boto3', 'paramiko') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- the acceptance bars, on real traces
# (smaller than bench/policies.py, which runs the full set and writes docs/benchmarks.md)

def test_waste_bars_on_the_shared_preemption_traces(shared_data):
    files = sorted((shared_data / "traces" / "preemption").glob("*.json"))
    assert files
    for f in files:
        res = simulate_trace(load_trace(f), job_hours=12, starts=3)
        r = {x["policy"]: x for x in res["results"]}
        o, h, fx = (r[p]["wasted_gpu_hours"] for p in ("orbit", "hindsight", "fixed-30m"))
        assert o <= 1.1 * h + 1e-9, (f.name, o, h)
        assert 3 * o <= fx, (f.name, o, fx)
        assert r["orbit"]["finished"] == r["orbit"]["jobs"]


def test_deadline_bars_on_the_shared_availability_traces(shared_data):
    files = sorted((shared_data / "traces" / "availability").glob("*.json"))
    assert files
    for f in files:
        res = simulate_trace(load_trace(f), job_hours=12, deadline_hours=18, starts=2)
        r = {x["policy"]: x for x in res["results"]}
        assert all(x["missed_feasible_deadlines"] == 0 for x in r.values()), f.name
        assert r["orbit"]["cost_usd"] <= r["uniform-progress"]["cost_usd"] + 1e-9, (f.name, r)
