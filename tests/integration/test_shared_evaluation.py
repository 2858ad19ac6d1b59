"""Evaluations that share one rented instance: a run evaluates its job's pending checkpoints in
turn on the instance it rented (the control plane without Dagster, on the real sim market)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

import orbit_dagster
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.evaluate import evaluate_checkpoint, reconcile_evaluations
from orbit_dagster.control.submit import submit
from orbit_dagster.core.bundle import workload_dir
from orbit_dagster.settings import Settings
from tests.helpers import wait_for
from tests.reliability import inject

SIX = {"config.steps": 24, "checkpoint.every_steps": 4}  # checkpoints at steps 4, 8, ..., 24


def slow_template(root: Path, name: str, *, sleep_s: float = 0.0, fail_at_step: int | None = None) -> None:
    """The example's template and workload under another name, its eval script slowed down
    (so a test can act between two evaluations) or failing on one checkpoint's step."""
    work = root / f"{name}-workload"
    shutil.copytree(workload_dir("charlm"), work)
    original = (work / "eval.py").read_text()
    (work / "eval.py").write_text(original.replace("    state = ctx.load_eval_checkpoint()\n", f"""\
    import time
    time.sleep({sleep_s!r})
    state = ctx.load_eval_checkpoint()
    if {fail_at_step!r} is not None and int(state["step"]) == {fail_at_step!r}:
        raise ValueError("this eval script fails on step {fail_at_step}")
"""))
    spec = yaml.safe_load((Path(orbit_dagster.__file__).parent / "templates" / "charlm-finetune.yaml").read_text())
    spec.update(name=name, workload=str(work))
    (root / "templates").mkdir(exist_ok=True)
    (root / "templates" / f"{name}.yaml").write_text(yaml.safe_dump(spec))


@pytest.fixture
def settings(orbit_home, tmp_path, monkeypatch):
    slow_template(tmp_path, "charlm-slow-eval", sleep_s=1.5)
    slow_template(tmp_path, "charlm-fails-at-12", fail_at_step=12)
    monkeypatch.setenv("ORBIT_TEMPLATES", str(tmp_path / "templates"))
    return Settings.from_env(orbit_home)


def trained(settings, template: str = "charlm-finetune") -> tuple[str, list[str]]:
    job = submit(settings, template, SIX, experiment="shared")
    assert run_attempt(settings, job, poll_s=0.1).state == "SUCCEEDED"
    keys = [f"{job}/a1/{s}" for s in (4, 8, 12, 16, 20, 24)]
    return job, keys


def evaluations(ledger, job: str) -> dict[str, dict]:
    return {r["checkpoint_key"]: r for r in ledger.rows("SELECT * FROM evaluations WHERE job_id = ?", [job])}


def eval_instances(ledger, job: str) -> list[dict]:
    return ledger.rows("SELECT * FROM instances WHERE purpose = 'eval' AND job_id = ?", [job])


def test_one_run_evaluates_the_six_checkpoints_of_a_job_on_one_rented_instance(settings):
    job, keys = trained(settings)
    ledger = settings.ledger()
    assert {r["state"] for r in evaluations(ledger, job).values()} == {"PENDING"}

    result = evaluate_checkpoint(settings, keys[0], poll_s=0.1, share=8, dagster_run_id="run-shared")

    assert result["state"] == "SUCCEEDED" and [r["checkpoint_key"] for r in result["shared"]] == keys[1:]
    instances = eval_instances(ledger, job)
    assert len(instances) == 1 and instances[0]["stopped_at"] is not None  # one rental, released
    rows = evaluations(ledger, job)
    assert {k: r["state"] for k, r in rows.items()} == {k: "SUCCEEDED" for k in keys}
    assert {r["instance_id"] for r in rows.values()} == {instances[0]["instance_id"]}
    assert all(r["tries"] == 1 and r["dagster_run_id"] == "run-shared" for r in rows.values())
    # Each evaluation its own metrics, recorded once: eval/step is the checkpoint's step.
    for key in keys:
        assert json.loads(rows[key]["metrics"])["eval/step"] == float(key.rsplit("/", 1)[1])
        points = ledger.rows("SELECT name FROM metric_points WHERE checkpoint_key = ? AND source = 'eval'", [key])
        assert sorted(p["name"] for p in points) == ["eval/accuracy", "eval/loss", "eval/step"]
    # The one bill is split over the six checkpoints and sums to it.
    lines = {r["checkpoint_key"]: r["usd"] for r in ledger.rows(
        "SELECT checkpoint_key, sum(usd) AS usd FROM costs WHERE kind = 'eval' AND job_id = ? GROUP BY checkpoint_key",
        [job])}
    assert set(lines) == set(keys) and all(v > 0 for v in lines.values())
    assert math.isclose(sum(lines.values()), instances[0]["billed_usd"], rel_tol=1e-9)


def test_a_batch_whose_run_is_killed_keeps_its_results_and_reconcile_gives_back_the_rest(settings, tmp_path):
    job, keys = trained(settings, "charlm-slow-eval")
    ledger = settings.ledger()
    log = tmp_path / "evaluator.log"
    proc = inject.spawn("""
import sys
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.settings import Settings
evaluate_checkpoint(Settings.from_env(sys.argv[1]), sys.argv[2], dagster_run_id="run-killed", poll_s=0.1, share=8)
""", str(settings.home), keys[0], log=log)
    wait_for(lambda: sum(r["state"] == "SUCCEEDED" for r in evaluations(ledger, job).values()) >= 2
             or proc.poll() is not None, 180, every=0.05, what="two evaluations of the batch")
    assert proc.poll() is None, log.read_text()
    inject.sigkill(proc)  # the run dies mid-batch; its rented host lives on, metered

    before = evaluations(ledger, job)
    done = [k for k in keys if before[k]["state"] == "SUCCEEDED"]
    held = [k for k in keys if before[k]["state"] == "RUNNING"]
    assert len(done) >= 2 and held and len(done) + len(held) == 6
    given_back = reconcile_evaluations(settings, run_alive=lambda run_id: run_id != "run-killed")
    assert len(given_back) == len(held)

    after = evaluations(ledger, job)
    assert {k: after[k]["state"] for k in done} == {k: "SUCCEEDED" for k in done}  # kept, recorded once
    assert {k: after[k]["state"] for k in held} == {k: "PENDING" for k in held}
    instances = eval_instances(ledger, job)
    assert len(instances) == 1 and instances[0]["stopped_at"] is not None  # released (and billed) once
    billed = ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [instances[0]["instance_id"]])
    assert math.isclose(billed, instances[0]["billed_usd"], rel_tol=1e-9)

    # The next run takes up exactly what is left, on one more instance.
    rest = evaluate_checkpoint(settings, held[0], poll_s=0.1, share=8)
    assert sorted([rest["checkpoint_key"], *(r["checkpoint_key"] for r in rest["shared"])]) == sorted(held)
    assert {r["state"] for r in evaluations(ledger, job).values()} == {"SUCCEEDED"}
    assert len(eval_instances(ledger, job)) == 2


def test_a_checkpoint_whose_eval_fails_is_given_back_and_the_ones_after_it_were_never_tried(settings):
    job, keys = trained(settings, "charlm-fails-at-12")
    ledger = settings.ledger()
    result = evaluate_checkpoint(settings, keys[0], poll_s=0.1, share=8)
    assert [r["checkpoint_key"] for r in result["shared"]] == keys[1:2]
    assert list(result["shared_failed"]) == [keys[2]] and "fails on step 12" in result["shared_failed"][keys[2]]
    rows = evaluations(ledger, job)
    assert [(rows[k]["state"], rows[k]["tries"]) for k in keys] == [
        ("SUCCEEDED", 1), ("SUCCEEDED", 1), ("PENDING", 1), ("PENDING", 0), ("PENDING", 0), ("PENDING", 0)]
    assert len(eval_instances(ledger, job)) == 1


def test_share_one_keeps_one_instance_per_evaluation(settings):
    job, keys = trained(settings)
    ledger = settings.ledger()
    result = evaluate_checkpoint(settings, keys[0], poll_s=0.1)
    assert result["shared"] == [] and len(eval_instances(ledger, job)) == 1
    assert [evaluations(ledger, job)[k]["state"] for k in keys] == ["SUCCEEDED"] + ["PENDING"] * 5


def test_the_evaluation_asset_materialises_each_shared_checkpoints_own_partition(settings):
    """Through Dagster (the eval job in process): one run, one rental, six partitions materialised."""
    import dagster as dg

    from orbit_dagster.assets.partitions import add_checkpoint_partitions, checkpoint_key_of, partition_of
    from orbit_dagster.definitions import defs

    job, keys = trained(settings)
    with dg.DagsterInstance.ephemeral() as instance:
        add_checkpoint_partitions(instance, keys)
        result = defs.resolve_job_def("eval_job").execute_in_process(
            instance=instance, partition_key=str(partition_of(keys[0])))  # the suite: the template's
        assert result.success
        records = instance.fetch_materializations(dg.AssetKey("evaluation"), limit=100).records
        by_key = {checkpoint_key_of(r.asset_materialization.partition): r for r in records}
        assert sorted(by_key) == sorted(keys) and {r.run_id for r in records} == {result.run_id}
        for key, rec in by_key.items():
            meta = rec.asset_materialization.metadata
            assert meta["checkpoint"].value == key and meta["eval/step"].value == float(key.rsplit("/", 1)[1])
    assert len(eval_instances(settings.ledger(), job)) == 1


def test_a_backfill_run_evaluates_only_its_own_partition(settings):
    """A backfill is a selection: its run leaves the job's other pending checkpoints PENDING."""
    import dagster as dg

    from orbit_dagster.assets.partitions import add_checkpoint_partitions, partition_of
    from orbit_dagster.definitions import defs

    job, keys = trained(settings)
    with dg.DagsterInstance.ephemeral() as instance:
        add_checkpoint_partitions(instance, keys)
        result = defs.resolve_job_def("eval_job").execute_in_process(
            instance=instance, partition_key=str(partition_of(keys[0])), tags={"dagster/backfill": "subset"})
        assert result.success
    states = {k: r["state"] for k, r in evaluations(settings.ledger(), job).items()}
    assert states == {keys[0]: "SUCCEEDED", **{k: "PENDING" for k in keys[1:]}}
    assert len(eval_instances(settings.ledger(), job)) == 1


def test_the_eval_sensor_requests_one_run_per_job_and_suite(orbit_home, monkeypatch):
    import dagster as dg

    from orbit_dagster.ledger import records as R
    from orbit_dagster.ledger import utcnow
    from orbit_dagster.resources import OrbitResource
    from orbit_dagster.sensors.evaluations import checkpoint_evaluation_sensor

    ledger = Settings.from_env(orbit_home).ledger()
    with ledger.write() as tx:
        for job, state in (("ja", "SUCCEEDED"), ("jb", "SUCCEEDED")):
            R.insert_job(tx, {"job_id": job, "experiment": "e", "project": "p", "placement": "sim",
                              "created_at": 1.0}, [R.state_row(job, 1, state)])
            tx.execute("UPDATE jobs SET state = ? WHERE job_id = ?", [state, job])
            for step in (4, 8, 12):
                key = f"{job}/a1/{step}"
                tx.insert("checkpoints", [{"checkpoint_key": key, "job_id": job, "experiment": "e", "attempt": 1,
                                           "step": step, "uri": f"file:///x/{key}", "created_at": utcnow()}])
                tx.insert("evaluations", [{"checkpoint_key": key, "suite": "s@v1", "job_id": job, "experiment": "e",
                                           "state": "PENDING", "tries": 0, "requested_at": float(step)}])

    def requested() -> list[str]:
        with dg.DagsterInstance.ephemeral() as instance, dg.build_sensor_context(
                instance=instance, resources={"orbit": OrbitResource(home=str(orbit_home))}) as context:
            return sorted(r.tags["orbit/checkpoint"] for r in checkpoint_evaluation_sensor(context).run_requests)

    assert requested() == ["ja/a1/4", "jb/a1/4"]  # one run per job: it takes up the job's other two
    monkeypatch.setenv("ORBIT_EVAL_SHARE", "1")
    assert requested() == sorted(f"{j}/a1/{s}" for j in ("ja", "jb") for s in (4, 8, 12))  # a run each, as before
