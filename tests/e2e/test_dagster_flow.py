"""End to end through a real Dagster instance: the daemon's sensors launch training, evaluate
every checkpoint and rank them; everything is visible as asset materialisations."""
import json
import math

import dagster as dg
import pytest

from orbit_dagster.assets.partitions import checkpoint_key_of
from orbit_dagster.deploy.instance import dagster_instance
from tests.e2e.conftest import E2E_OVERRIDES

pytestmark = pytest.mark.e2e


def materialized_partitions(instance, asset: str) -> dict[str, dict]:
    out = {}
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records
    for rec in records:
        mat = rec.asset_materialization
        key = checkpoint_key_of(mat.partition) if "|" in str(mat.partition) else mat.partition
        out.setdefault(key, {k: v.value for k, v in mat.metadata.items()})
    return out


def test_training_checkpoints_evaluations_and_best_are_materialised(demo_run):
    settings, result = demo_run
    job = result["job"]
    assert result["state"] == "SUCCEEDED"
    ledger = settings.ledger()
    keys = [r["checkpoint_key"] for r in ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE job_id = ? ORDER BY step", [job])]
    assert len(keys) == 4 and result["checkpoints"] == 4 and result["evaluations"] == 4
    with dagster_instance(settings) as instance:
        train = materialized_partitions(instance, "training_run")
        assert train[job]["outcome"] == "SUCCEEDED" and train[job]["checkpoints"] == 4
        ckpts = materialized_partitions(instance, "checkpoint")
        assert sorted(ckpts, key=lambda k: int(k.rsplit("/", 1)[1])) == keys
        assert all(m["tier"] == "durable" and m["bytes"] > 0 and len(m["sha256"]) == 64 and "train/loss" in m
                   for m in ckpts.values())
        evals = materialized_partitions(instance, "evaluation")
        assert sorted(evals) == sorted(keys)
        assert all(math.isfinite(m["eval/loss"]) and 0 <= m["eval/accuracy"] <= 1 for m in evals.values())
        best = materialized_partitions(instance, "best_checkpoint")["e2e"]
        losses = {k: m["eval/loss"] for k, m in evals.items()}
        assert best["checkpoint"] == min(losses, key=losses.get) == result["best_checkpoint"]
        assert best["metric"] == "eval/loss" and math.isclose(best["value"], min(losses.values()))
        assert set(instance.get_dynamic_partitions("checkpoint_steps")) == {k.split("/", 1)[1] for k in keys}
        runs = instance.get_run_records(dg.RunsFilter(tags={"orbit/job": job}))
        train_runs = [r for r in runs if r.dagster_run.job_name == "train_job"]
        assert len(train_runs) == 1 and train_runs[0].dagster_run.tags["orbit/attempt"] == "1"


def test_cost_of_the_demo_job_adds_up(demo_run):
    settings, result = demo_run
    assert math.isclose(result["cost_usd"], result["billed_usd"], rel_tol=0.01)
    assert result["cost_usd"] > 0 and result["wasted_gpu_seconds"] == 0


def test_every_durable_checkpoint_has_its_interval_decision_with_the_instance_age(demo_run):
    """The interval is decided at dispatch (age 0) and again by the agent at each durable save."""
    settings, result = demo_run
    ledger = settings.ledger()
    job = result["job"]
    for attempt in [r["attempt"] for r in ledger.rows("SELECT attempt FROM runs WHERE job_id = ?", [job])]:
        rows = [json.loads(r["inputs"]) | {"chosen": int(r["chosen"])} for r in ledger.rows(
            "SELECT chosen, inputs FROM decisions WHERE job_id = ? AND attempt = ? AND kind = 'checkpoint_interval'",
            [job, attempt])]
        at_dispatch = [d for d in rows if d.get("decided_on") != "host"]
        on_host = sorted((d for d in rows if d.get("decided_on") == "host"), key=lambda d: d["step"])
        assert len(at_dispatch) == 1 and at_dispatch[0]["age_s"] == 0.0
        durable = [r["step"] for r in ledger.rows(
            "SELECT step FROM checkpoints WHERE job_id = ? AND attempt = ? AND tier = 'durable' ORDER BY step",
            [job, attempt])]
        last = E2E_OVERRIDES["config.steps"]  # the final save decides nothing: no step is left
        assert durable and [d["step"] for d in on_host] == [s for s in durable if s != last]
        ages = [d["age_s"] for d in on_host]
        assert all(a > 0 for a in ages) and ages == sorted(ages)
        assert all(d["next_step"] == d["step"] + d["chosen"] for d in on_host)
