"""`orbit export`: the best checkpoint's weights as safetensors, on a job trained on the sim
market: the same tensors, no pickle, its sha256 in the ledger; tampered or unknown inputs refused."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from orbit_dagster.cli.commands import main
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.export import _load, export_weights
from orbit_dagster.control.submit import submit
from orbit_dagster.ledger import records as R
from orbit_dagster.runtime.checkpointing import weights_digest
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest


@pytest.fixture
def trained(orbit_home):
    settings = Settings.from_env(orbit_home)
    settings.ledger().dispose()
    job = submit(settings, "charlm-finetune", {"config.steps": 8, "checkpoint.every_steps": 4}, experiment="exp-x")
    assert run_attempt(settings, job, poll_s=0.1).state == "SUCCEEDED"
    return settings, job


def cli(*args: str) -> tuple[int, str]:
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0), ""
    return 0, ""


def test_the_best_checkpoint_exports_as_safetensors_with_its_sha256_in_the_ledger(trained, tmp_path, capsys):
    settings, job = trained
    ledger = settings.ledger()
    code, _ = cli("export", "exp-x", "--format", "safetensors", str(tmp_path / "best.safetensors"), "--json")
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = R.checkpoint(ledger, record["checkpoint_key"])
    assert row["job_id"] == job
    out = tmp_path / "best.safetensors"
    assert record["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() and record["bytes"] == out.stat().st_size
    weights = load_file(out)  # no pickle involved
    path = Path(row["uri"][len("file://"):]) / "state.pt"
    saved = torch.load(path, map_location="cpu", weights_only=True)["model"]
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)
    assert weights_digest(weights) == row["weights_sha256"] == record["weights_sha256"]
    with safe_open(str(out), "pt") as fh:
        assert fh.metadata()["orbit_checkpoint"] == row["checkpoint_key"]
    (event,) = ledger.rows("SELECT * FROM events WHERE kind = 'checkpoint_export'")
    detail = json.loads(event["detail"])
    assert event["checkpoint_key"] == row["checkpoint_key"] and detail["sha256"] == record["sha256"]
    assert detail["dest"] == str(out.resolve())

    # By key, into a directory; then the refusals, one line each, nothing written.
    first = R.checkpoints(ledger, job)[0]
    got = export_weights(settings, first["checkpoint_key"], tmp_path)
    assert Path(got["dest"]).name == f"{first['checkpoint_key'].replace('/', '-')}.safetensors"
    with pytest.raises(Exception, match="exists; fix: name a new file"):
        export_weights(settings, first["checkpoint_key"], Path(got["dest"]))
    with pytest.raises(Exception, match="neither a checkpoint key nor an experiment"):
        export_weights(settings, "no-such-experiment", tmp_path / "x.safetensors")
    with pytest.raises(Exception, match="export format 'onnx' is not supported"):
        export_weights(settings, "exp-x", tmp_path / "x.onnx", fmt="onnx")
    blob = path.read_bytes()
    path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))  # one flipped byte
    with pytest.raises(Exception, match="cannot be used"):
        export_weights(settings, row["checkpoint_key"], tmp_path / "tampered.safetensors")
    assert not (tmp_path / "tampered.safetensors").exists() and not list(tmp_path.glob(".*tmp*"))


def test_a_sharded_checkpoint_exports_its_weights_whole(tmp_path):
    """A DCP directory (any number of ranks) is made whole for the export, without a process group."""
    import torch.distributed.checkpoint as dcp

    model = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    dcp.save({"model": model, "optimizer": {"lr": torch.tensor(0.1)}}, checkpoint_id=tmp_path / "ckpt_3")
    store = open_store((tmp_path / "s").as_uri())
    files = {p.name: p.read_bytes() for p in (tmp_path / "ckpt_3").iterdir()}
    uri = store.put("j", "step-000000003-a1", files, CheckpointManifest(job_id="j", step=3, tier="durable", files={},
                                                                        format="dcp"))
    state = _load(uri, tmp_path / "scratch")
    assert state["model"].keys() == model.keys() and all(torch.equal(state["model"][k], model[k]) for k in model)
