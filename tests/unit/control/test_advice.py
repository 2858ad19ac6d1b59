"""`orbit advise`: a counterfactual over the last jobs, replayed on each offer's recorded availability by the
code `orbit simulate` runs, so the printed command reproduces it; refused on too little history."""
import json
import shlex

import pytest

from orbit_dagster.catalog.traces import load_trace, up_runs
from orbit_dagster.control.advice import TooLittleHistory, advise
from orbit_dagster.settings import Settings
from tests.cost_ledger import History, offer
from tests.helpers import run_cli

# One A10G shape in two zones: the reliable one dearer, the other reclaimed about once an hour.
RELIABLE = offer("aws:g5.xlarge:use1-az1", usd_per_gpu_hour=0.50, gpu="A10G", spec=None, instance_type="g5.xlarge")
FLAKY = offer("aws:g5.xlarge:use1-az2", usd_per_gpu_hour=0.40, gpu="A10G", spec=None, instance_type="g5.xlarge")
HOUR = 3600.0


def reliable_job(h: History, job: str, t: float) -> float:
    """3 h of work in one attempt, a checkpoint every half hour; returns when it ended."""
    h.attempt(job, RELIABLE, start=t, stop=t + 3 * HOUR, checkpoints=[t + k * 1800 for k in range(1, 7)])
    return t + 3 * HOUR


def flaky_job(h: History, job: str, t: float) -> float:
    """The same work over four attempts: three reclaimed 50 min in (a checkpoint at 45 min, 5 min of work
    lost), each resumed 5 min after its instance started, 20 min until the zone gives one again."""
    done = 0.0
    for attempt in range(1, 5):
        start = t
        if attempt < 4:
            h.attempt(job, FLAKY, start=start, stop=start + 3000, checkpoints=[start + 2700], lost=True,
                      last_progress=start + 3000, resumed_at=start + 300 if attempt > 1 else None, attempt=attempt,
                      final_state="LOST")
            done += 2700 - (300 if attempt > 1 else 0)
            t = start + 3000 + 1200
        else:
            left = 3 * HOUR - done
            h.attempt(job, FLAKY, start=start, stop=start + 300 + left, checkpoints=[start + 300 + left],
                      resumed_at=start + 300, attempt=attempt)
            t = start + 300 + left
    return t


@pytest.fixture
def settings(orbit_home):
    return Settings.from_env(orbit_home)


def history_on_two_offers(settings) -> History:
    h = History(settings.ledger())
    t_r = t_f = 0.0
    for i in range(3):
        t_r = reliable_job(h, f"r{i}", t_r + 600)
        t_f = flaky_job(h, f"f{i}", t_f + 600)
    return h


def test_the_recorded_trace_holds_the_ledgers_up_time_and_reclaims(settings):
    history_on_two_offers(settings)
    doc = advise(settings)
    by = {o["offer_id"]: o for o in doc["offers"]}
    flaky = by[FLAKY.offer_id]
    trace = load_trace(flaky["trace"])
    runs = list(up_runs(trace, 0.0, trace.duration_s))
    assert sum(reclaimed for _, _, reclaimed in runs) == flaky["reclaims"] == 9
    assert sum(e - s for s, e, _ in runs) == pytest.approx(flaky["exposure_hours"] * HOUR, abs=trace.gap_seconds)
    assert by[RELIABLE.offer_id]["reclaims"] == 0
    assert set(trace.prices) == {0.4}  # the price each instance was billed at, per hour


def test_advice_on_two_offers_is_reproduced_by_orbit_simulate(settings):
    history_on_two_offers(settings)
    doc = advise(settings)
    assert doc["scope"]["jobs"] == 6 and doc["scope"]["gpu"] == "A10G"
    # Useful work: checkpointed time less restores; 3 h in every job, however many attempts it took.
    assert doc["scope"]["mean_job_hours"] == pytest.approx(3.0)
    by = {o["offer_id"]: o for o in doc["offers"]}
    assert set(by) == {RELIABLE.offer_id, FLAKY.offer_id}
    assert by[RELIABLE.offer_id]["share"] == pytest.approx(0.5) and by[FLAKY.offer_id]["share"] == pytest.approx(0.5)
    for o in doc["offers"]:  # the command the advice prints gives the figures it used
        code, out, err = run_cli(shlex.split(o["simulate"])[1:])
        assert code == 0, err
        [row] = json.loads(out)["results"]
        assert row["policy"] == "orbit"
        assert row["cost_usd"] == o["simulated"]["cost_usd"] and row["finished"] == o["simulated"]["finished"]
        assert o["rate_interval"][0] <= o["reclaims_per_hour"] <= o["rate_interval"][1]
    # The flaky zone is cheaper per job even with its reclaims (the notice covers them): raise it.
    costs = {k: v["simulated"]["cost_usd"] for k, v in by.items()}
    best = min(costs, key=costs.get)
    head, *rest = doc["recommendations"]
    assert head["action"] == "raise" and head["offer_id"] == best == FLAKY.offer_id
    other = RELIABLE.offer_id
    assert [(r["action"], r["offer_id"]) for r in rest] == [("lower", other)]
    saved = by[other]["share"] * 6 * (costs[other] - costs[best])
    assert rest[0]["saved_usd"] == pytest.approx(saved, abs=1e-6) and head["saved_usd"] == pytest.approx(saved, abs=1e-6)
    assert saved > 0
    low, high = head["saved_interval"]
    assert low <= saved <= high
    assert "reproduce: orbit simulate --trace" in head["evidence"] and "interval" in head["uncertainty"]
    # and the report, as a person reads it
    code, out, err = run_cli(["advise"])
    assert code == 0, err
    assert f"raise {FLAKY.offer_id}" in out and f"lower {RELIABLE.offer_id}" in out and "forecast" in out


def test_too_little_history_is_refused_saying_how_much_is_needed(settings):
    h = History(settings.ledger())
    reliable_job(h, "r0", 0.0)
    reliable_job(h, "r1", 4 * HOUR)
    # 50 minutes on the other zone, reclaimed: a record, but shorter than a job.
    h.attempt("f0", FLAKY, start=0.0, stop=3000.0, checkpoints=[2700.0], lost=True, last_progress=3000.0)
    with pytest.raises(TooLittleHistory, match="2 finished training job"):
        advise(settings)
    code, out, err = run_cli(["advise"])
    assert code == 2 and err.count("\n") == 1 and "3 needed" in err and "fix:" in err
    # Enough jobs, but only one offer with a job's length of record: nothing to compare it with.
    reliable_job(h, "r2", 8 * HOUR)
    with pytest.raises(TooLittleHistory, match=r"A10G x1: 1 offer\(s\) with 3.00 h or more .* 2 needed \(recorded: "
                                               r"aws:g5.xlarge:use1-az1 9.00 h, aws:g5.xlarge:use1-az2 0.83 h\)"):
        advise(settings)
    code, out, err = run_cli(["advise", "--experiment", "nope"])
    assert code == 2 and "no experiment 'nope'" in err


def test_the_advice_asset_reports_the_recommendations_or_why_there_are_none(settings):
    import dagster as dg

    from orbit_dagster.definitions import defs

    h = History(settings.ledger())
    reliable_job(h, "r0", 0.0)
    with dg.DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("cost_insight_job").execute_in_process(instance=instance)
        assert result.success
        [mat] = result.asset_materializations_for_node("advice")
        assert mat.metadata["advised"].value is False and "3 needed" in mat.metadata["refused"].value
    for i in range(3):
        flaky_job(h, f"f{i}", 20 * HOUR * (i + 1))
        reliable_job(h, f"r{i + 1}", 20 * HOUR * (i + 1))
    with dg.DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("cost_insight_job").execute_in_process(instance=instance)
        [mat] = result.asset_materializations_for_node("advice")
        meta = mat.metadata
        assert meta["advised"].value is True
        recs = [r.data for r in meta["recommendations"].records]
        assert recs[0]["action"] == "raise" and recs[0]["offer_id"] == FLAKY.offer_id
        assert {r.data["offer_id"] for r in meta["offers"].records} == {RELIABLE.offer_id, FLAKY.offer_id}
        assert "orbit simulate --trace" in meta["evidence"].value
