"""`orbit import-run`: a run trained outside the platform becomes checkpoints like any other."""
import json
import os
import shutil
import subprocess
import sys

import dagster as dg
import pytest

from orbit_dagster.control.best import compute_best
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.deploy.instance import dagster_instance
from orbit_dagster.settings import Settings


@pytest.fixture(scope="module")
def outside_run(tmp_path_factory):
    """Checkpoints of the example model trained by hand, laid out as a user would export them."""
    root = tmp_path_factory.mktemp("outside")
    t = apply_overrides(load_template("charlm-finetune"), {"config.steps": 8, "checkpoint.every_steps": 4})
    b = build_bundle(t, TaskSubmission(template=t.name), "elsewhere", root / "bundles")
    env = {**os.environ, "PYTHONPATH": str(b.path / "runtime"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "orbit_dagster.runtime.agent", str(b.path), "--workdir", str(root / "w"),
                    "--store", (root / "store").as_uri()], env=env, check=True, capture_output=True, timeout=300)
    export = root / "export"
    for step in (4, 8):
        (export / f"ckpt-{step}").mkdir(parents=True)
        shutil.copy(root / "store" / "elsewhere" / f"step-{step:09d}-a1" / "state.pt", export / f"ckpt-{step}" / "state.pt")
    (export / "metrics.jsonl").write_text('{"step": 4, "train/loss": 3.1}\n{"step": 8, "train/loss": 2.9}\n')
    (export / "run.json").write_text(json.dumps({"name": "my run", "experiment": "imp", "template": "charlm-finetune"}))
    return export


def orbit(*args, home):
    return subprocess.run([sys.executable, "-m", "orbit_dagster.cli", *args], env={**os.environ, "ORBIT_HOME": str(home)},
                          capture_output=True, text=True, timeout=300)


def test_import_registers_verified_checkpoints_that_evaluate_and_rank(outside_run, orbit_home):
    proc = orbit("import-run", str(outside_run), home=orbit_home)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    job = result["job_id"]
    assert result["checkpoints"] == [f"{job}/a1/4", f"{job}/a1/8"] and result["evaluable"]
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    rows = ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    assert [r["parent_key"] for r in rows] == [None, f"{job}/a1/4"]
    assert [r["train_loss"] for r in rows] == [3.1, 2.9]
    assert ledger.rows("SELECT imported, experiment FROM runs WHERE job_id = ?", [job]) == [{"imported": 1, "experiment": "imp"}]
    # An imported run is a job like any other: `orbit status` lists it.
    listed = orbit("status", "--json", home=orbit_home)
    assert listed.returncode == 0 and job in {r["job_id"] for r in json.loads(listed.stdout)}
    with dagster_instance(settings) as instance:  # partitions of the `checkpoint` asset, with materialisations
        assert set(instance.get_dynamic_partitions("jobs")) == {job}
        assert set(instance.get_dynamic_partitions("checkpoint_steps")) == {"a1/4", "a1/8"}
        assert instance.get_latest_materialization_event(dg.AssetKey("checkpoint")) is not None
    # Training metrics rank the run until an evaluation exists; then evaluations do.
    assert compute_best(settings, "imp")["metric_source"] == "train"
    for key in result["checkpoints"]:
        assert evaluate_checkpoint(settings, key)["metrics"]["eval/loss"] > 0
    best = compute_best(settings, "imp")
    assert best["metric_source"] == "eval" and best["checkpoint_key"] in result["checkpoints"]
    again = orbit("import-run", str(outside_run), home=orbit_home)
    assert again.returncode == 2 and "already imported" in again.stderr


def test_import_of_a_directory_without_checkpoints_is_a_clear_error(tmp_path, orbit_home):
    from orbit_dagster.control.importer import import_run

    with pytest.raises(OrbitError) as err:
        import_run(Settings.from_env(orbit_home), tmp_path)
    assert "no checkpoints" in str(err.value)
    assert Settings.from_env(orbit_home).ledger().scalar("SELECT count(*) FROM runs") == 0
