"""OrbitCallback in-process on a real (tiny) Lightning fit: metric mapping, the no-op outside
orbit, saves with their marker, the stop file, and the chained SIGTERM handler."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from orbit_dagster.integrations import env  # noqa: E402
from orbit_dagster.integrations.lightning import OrbitCallback, metrics_from  # noqa: E402

ORBIT_VARS = (env.JOB_ID, env.CHECKPOINT_DIR, env.METRICS_FILE, env.CHECKPOINT_EVERY, env.STOP_FILE,
              env.RESUME_FROM)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(batches: int):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * batches, 4)), batch_size=8)


def _fit(tmp_path, steps: int, callback: OrbitCallback) -> L.Trainer:
    torch.manual_seed(0)
    data = _loader(4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        default_root_dir=tmp_path / "root", callbacks=[callback])
    trainer.fit(Tiny(), train_dataloaders=data)
    return trainer


@pytest.fixture
def outside(monkeypatch):
    for name in ORBIT_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def orbit(monkeypatch, tmp_path, outside):
    (tmp_path / "ck").mkdir()
    values = {env.JOB_ID: "job-1", env.CHECKPOINT_DIR: str(tmp_path / "ck"), env.CHECKPOINT_EVERY: "3",
              env.METRICS_FILE: str(tmp_path / "metrics.jsonl"), env.STOP_FILE: str(tmp_path / "stop")}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return tmp_path


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_from_keeps_finite_scalars_and_maps_the_loss_output():
    logged = {"train/loss": torch.tensor(0.5), "lr": 0.01, "vector": torch.tensor([1.0, 2.0]),
              "bad": torch.tensor(float("nan")), "flag": True, "name": "x"}
    assert metrics_from(logged, {"loss": torch.tensor(0.7)}) == {"train/loss": 0.5, "lr": 0.01}
    assert metrics_from({}, {"loss": torch.tensor(0.25)}) == {"train/loss": 0.25}
    assert metrics_from({}, torch.tensor(0.125)) == {"train/loss": 0.125}
    assert metrics_from({"val/loss": torch.tensor(1.0), "train/loss": 2.0}, None, frozenset({"val/loss"})) == {
        "train/loss": 2.0}


def test_callback_is_a_noop_outside_orbit(outside, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    callback = OrbitCallback(every=1)
    assert not callback.active and signal.getsignal(signal.SIGTERM) is before
    _fit(tmp_path, 4, callback)
    assert callback.saved == [] and signal.getsignal(signal.SIGTERM) is before
    assert not any(p.suffix == ".ckpt" for p in tmp_path.rglob("*"))


def test_callback_saves_every_n_steps_with_a_marker_and_writes_metric_lines(orbit):
    callback = OrbitCallback()
    _fit(orbit, 7, callback)
    ck = orbit / "ck"
    assert sorted(p.name for p in ck.iterdir()) == [
        "step-3.ckpt", "step-3.ckpt.orbit-complete", "step-6.ckpt", "step-6.ckpt.orbit-complete"]
    saved = torch.load(ck / "step-6.ckpt", weights_only=True)
    assert saved["global_step"] == 6 and "optimizer_states" in saved and "loops" in saved
    lines = _lines(orbit / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 8))
    assert all(isinstance(line["train/loss"], float) for line in lines)


def test_the_stop_file_saves_at_the_current_step_and_stops_fit(orbit):
    class StopAt(L.Callback):  # the agent's side: the stop file appears during step 5
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 4:
                (orbit / "stop").touch()

    callback = OrbitCallback(every=100)
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=50, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StopAt(), callback])
    trainer.fit(Tiny(), train_dataloaders=_loader(20))
    assert trainer.global_step == 5
    assert (orbit / "ck" / "step-5.ckpt").is_file() and (orbit / "ck" / "step-5.ckpt.orbit-complete").is_file()
    assert _lines(orbit / "metrics.jsonl")[-1]["step"] == 5


def test_the_sigterm_handler_chains_the_previous_one_and_is_restored(orbit):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        callback = OrbitCallback()
        os.kill(os.getpid(), signal.SIGTERM)
        assert callback.signalled and calls == [signal.SIGTERM]
        callback.teardown(None, None, "fit")
        assert signal.getsignal(signal.SIGTERM) is not callback._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Val(Tiny):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())


class _SignalAt(L.Callback):
    """Sends this process SIGTERM at one hook and step, as the agent's notice would."""

    def __init__(self, hook: str, step: int) -> None:
        self.hook, self.step = hook, step

    def _maybe(self, trainer, hook):
        if hook == self.hook and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_start(self, trainer, *args):
        self._maybe(trainer, "train")

    def on_validation_batch_start(self, trainer, *args):
        self._maybe(trainer, "val")


@pytest.mark.parametrize("hook, saved_at", [("train", 5), ("val", 4)])
def test_sigterm_saves_at_the_current_step_then_lightning_exits_with_code_0(orbit, hook, saved_at):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    before = signal.getsignal(signal.SIGTERM)
    callback = OrbitCallback(every=100)
    torch.manual_seed(0)
    # validation every 4 steps on 3 batches: a signal in its first batch is raised there,
    # before any train batch end (the callback saves from on_exception)
    trainer = L.Trainer(max_steps=50, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=4,
                        num_sanity_val_steps=0, callbacks=[_SignalAt(hook, 4), callback])
    try:
        with pytest.raises(SIGTERMException) as raised:  # fit does not return: Lightning raises SystemExit()
            trainer.fit(_Val(), train_dataloaders=_loader(20), val_dataloaders=_loader(3))
    finally:
        signal.signal(signal.SIGTERM, before)
    assert raised.value.code is None  # SystemExit without a code: the process exits 0
    assert callback.signalled and trainer.global_step == saved_at
    steps = sorted(p.name for p in (orbit / "ck").glob("*.ckpt"))
    assert steps == [f"step-{saved_at}.ckpt"] and (orbit / "ck" / f"step-{saved_at}.ckpt.orbit-complete").is_file()


def test_periodic_saves_follow_the_agents_schedule_unless_every_is_given(orbit, monkeypatch):
    schedule = orbit / "schedule.json"
    schedule.write_text(json.dumps({"every": 3, "next_step": 5}))  # the agent decided: next save at 5
    monkeypatch.setenv(env.CHECKPOINT_SCHEDULE, str(schedule))
    callback = OrbitCallback()
    _fit(orbit, 8, callback)
    assert [p.name for p in callback.saved] == ["step-5.ckpt"]  # not 3 and 6: the launch grid
    fixed = OrbitCallback(every=2)
    _fit(orbit / "fixed", 4, fixed)
    assert [p.name for p in fixed.saved] == ["step-2.ckpt", "step-4.ckpt"]


def _async_fit(tmp_path, io, steps: int = 7) -> L.Trainer:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        default_root_dir=tmp_path / "root", plugins=[AsyncCheckpointIO(io)], callbacks=[OrbitCallback()])
    trainer.fit(Tiny(), train_dataloaders=_loader(4))
    return trainer


def test_with_async_checkpoint_io_a_save_is_published_only_once_its_write_is_done(orbit):
    """Lightning's AsyncCheckpointIO writes in its thread after `save_checkpoint` returns: the
    file and its marker must appear only once the write is whole (a slow write here)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    marked_early = []

    class SlowIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            time.sleep(0.3)
            super().save_checkpoint(checkpoint, path, storage_options)
            step = checkpoint["global_step"]
            marked_early.append((step, (orbit / "ck" / f"step-{step}.ckpt.orbit-complete").exists()))

    _async_fit(orbit, SlowIO())
    ck = orbit / "ck"
    assert marked_early == [(3, False), (6, False)]
    assert sorted(p.name for p in ck.iterdir()) == [
        "step-3.ckpt", "step-3.ckpt.orbit-complete", "step-6.ckpt", "step-6.ckpt.orbit-complete"]
    for step in (3, 6):
        assert torch.load(ck / f"step-{step}.ckpt", weights_only=True)["global_step"] == step


def test_with_async_checkpoint_io_a_failed_write_publishes_nothing_and_fit_raises_it(orbit):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class FullDisk(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        _async_fit(orbit, FullDisk())
    assert not [p.name for p in (orbit / "ck").iterdir() if not p.name.startswith(".")]
