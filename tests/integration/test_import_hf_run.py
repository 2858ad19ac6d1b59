"""`orbit import-run` of a Hugging Face Trainer output directory: checkpoint-<step>/ directories
written by a real Trainer run (workloads/hftiny/train.py, outside orbit), imported with their
steps, weights and log_history; every kind of bad input refused with nothing registered."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from orbit_dagster.control.importer import import_run
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.runtime.checkpointing import weights_digest
from orbit_dagster.settings import Settings
from orbit_dagster.storage.base import MANIFEST, CheckpointManifest
from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "orbit_dagster" / "workloads" / "hftiny"


@pytest.fixture(scope="module")
def hf_output(tmp_path_factory) -> Path:
    """The output_dir of a plain Trainer run: checkpoint-5/ and checkpoint-10/, a log every step."""
    out = tmp_path_factory.mktemp("hf") / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORBIT_")}  # outside orbit
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "train.py", "--output_dir", str(out), "--steps", "10", "--save_steps", "5",
                           "--logging_steps", "1"], cwd=WORKLOAD, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def run_dir(hf_output, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(hf_output, copy)
    return copy


cli = run_cli  # `orbit ARGV` in this process: (exit code, stdout, stderr)


def store_files(home: Path) -> list[Path]:
    root = home / "checkpoints"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_outside_orbit_the_trainer_script_runs_as_before_without_markers(hf_output):
    assert sorted(p.name for p in hf_output.iterdir()) == ["checkpoint-10", "checkpoint-5"]
    assert not list(hf_output.rglob(".orbit-complete"))


def test_import_run_registers_hf_checkpoints_with_their_steps_weights_and_log_history(run_dir, orbit_home):
    code, out, err = cli(["import-run", str(run_dir), "--experiment", "hfimp"])
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    job = result["job_id"]
    assert result["checkpoints"] == [f"{job}/a1/5", f"{job}/a1/10"]
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    rows = ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    history = json.loads((run_dir / "checkpoint-10" / "trainer_state.json").read_text())["log_history"]
    loss_at = {h["step"]: h["loss"] for h in history if "loss" in h}
    assert sorted(loss_at) == list(range(1, 11))
    assert [r["train_loss"] for r in rows] == [loss_at[5], loss_at[10]]
    for r in rows:
        src = run_dir / f"checkpoint-{r['step']}"
        assert r["weights_sha256"] == weights_digest(load_file(src / "model.safetensors"))  # the same weights, exactly
        stored = Path(r["uri"].removeprefix("file://"))
        manifest = CheckpointManifest.from_json((stored / MANIFEST).read_text())
        assert manifest.meta["layout"] == "dir" and manifest.meta["format"] == "hf"
        assert manifest.meta["name"] == f"checkpoint-{r['step']}"
        assert set(manifest.files) == {p.name for p in src.iterdir()}  # optimizer, scheduler, RNG: resumable
        assert all((stored / rel).read_bytes() == (src / rel).read_bytes() for rel in manifest.files)
    points = ledger.rows("SELECT step, name, value, checkpoint_key FROM metric_points WHERE job_id = ? "
                         "AND name = 'train/loss' ORDER BY step", [job])
    assert [(p["step"], p["value"]) for p in points] == sorted(loss_at.items())  # every logged step, on its step
    assert {p["step"]: p["checkpoint_key"] for p in points if p["checkpoint_key"]} == {5: f"{job}/a1/5",
                                                                                       10: f"{job}/a1/10"}
    names = {r["name"] for r in ledger.rows("SELECT DISTINCT name FROM metric_points WHERE job_id = ?", [job])}
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/epoch"} <= names


def _truncated_safetensors(d: Path) -> None:
    w = d / "checkpoint-10" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def _not_json_trainer_state(d: Path) -> None:
    (d / "checkpoint-10" / "trainer_state.json").write_text('{"global_step": 10, "log_history": [')


def _step_mismatch(d: Path) -> None:
    (d / "checkpoint-10").rename(d / "checkpoint-11")


def _dotdot_shard(d: Path) -> None:
    c = d / "checkpoint-10"
    shutil.move(c / "model.safetensors", d / "outside.safetensors")
    keys = load_file(d / "outside.safetensors").keys()
    (c / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "../outside.safetensors"
                                                                                for k in keys}}))


def _symlinked_weights(d: Path) -> None:
    w = d / "checkpoint-10" / "model.safetensors"
    shutil.move(w, d.parent / "theirs.safetensors")
    w.symlink_to(d.parent / "theirs.safetensors")


def _symlinked_checkpoint_dir(d: Path) -> None:
    shutil.move(d / "checkpoint-10", d.parent / "theirs-10")
    (d / "checkpoint-10").symlink_to(d.parent / "theirs-10", target_is_directory=True)


def _no_weights(d: Path) -> None:
    (d / "checkpoint-10" / "model.safetensors").unlink()


def _no_trainer_state(d: Path) -> None:
    (d / "checkpoint-10" / "trainer_state.json").unlink()


def _no_checkpoints(d: Path) -> None:
    for c in list(d.iterdir()):
        shutil.rmtree(c)


BAD = {  # (how the directory is spoilt, words of the error); checkpoint-5 stays good: nothing of it may be kept
    "truncated-safetensors": (_truncated_safetensors, "truncated"),
    "trainer-state-not-json": (_not_json_trainer_state, "trainer_state.json is not JSON"),
    "step-mismatch": (_step_mismatch, "named for step 11 but its trainer_state.json says global_step 10"),
    "dotdot-in-a-shard-name": (_dotdot_shard, "'../outside.safetensors' is not allowed"),
    "weights-symlinked-out": (_symlinked_weights, "is a link"),
    "checkpoint-dir-symlinked-out": (_symlinked_checkpoint_dir, "is a link"),
    "no-weights": (_no_weights, "has no weights"),
    "no-trainer-state": (_no_trainer_state, "has no trainer_state.json"),
    "no-checkpoints": (_no_checkpoints, "pytorch_model.bin, trainer_state.json"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_hf_directory_is_a_clear_error_and_registers_nothing(run_dir, orbit_home, case):
    spoil, words = BAD[case]
    spoil(run_dir)
    settings = Settings.from_env(orbit_home)
    with pytest.raises(OrbitError) as err:
        import_run(settings, run_dir)
    assert words in str(err.value) and "fix:" in str(err.value), str(err.value)
    assert settings.ledger().scalar("SELECT count(*) FROM jobs") == 0
    assert settings.ledger().scalar("SELECT count(*) FROM checkpoints") == 0
    assert store_files(orbit_home) == []  # checkpoint-5, copied first, was removed again


def test_the_cli_refuses_a_bad_hf_directory_in_one_line_with_exit_2(run_dir, orbit_home):
    _truncated_safetensors(run_dir)
    code, out, err = cli(["import-run", str(run_dir)])
    errors = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "checkpoint-10/model.safetensors is truncated" in errors[0], err
    assert "Traceback" not in out + err
