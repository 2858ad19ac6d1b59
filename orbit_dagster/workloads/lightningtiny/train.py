"""Train the tiny regressor with Lightning; orbit's callback adds checkpoints, metrics, stop.

Outside orbit this is a plain Lightning script (the callback does nothing). The orbit lines
are marked `# orbit`.
"""
from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from tiny_model import TinyRegressor
from tiny_net import SeededLoader, make_data

from orbit_dagster.integrations.env import resume_from  # orbit
from orbit_dagster.integrations.lightning import OrbitCallback  # orbit


class Pace(L.Callback):
    """Slows training down by a fixed sleep per step; changes nothing it computes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        if self.seconds > 0:
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--pace_ms", type=float, default=0.0, help="sleep after each step (to demo a reclaim)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: bit-identical runs (and resumes) on a CPU
    L.seed_everything(args.seed, verbose=False)
    model = TinyRegressor(lr=args.lr)
    train = SeededLoader(*make_data(2048, seed=args.seed), batch_size=args.batch_size, seed=args.seed)
    val = SeededLoader(*make_data(256, seed=args.seed + 1), batch_size=256, seed=0)  # one held-out batch
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, deterministic=True,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=10, num_sanity_val_steps=0,
                        callbacks=[Pace(args.pace_ms / 1000.0), OrbitCallback()])  # orbit: OrbitCallback(), last
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val,
                ckpt_path=resume_from() or None, weights_only=True)  # orbit: resume (tensors and plain data only)


if __name__ == "__main__":
    main()
