"""A training loop paced to a fixed step time, for tests that compare the control plane
with the trace replay: a real (tiny) model and optimiser state, checkpointed and resumed by
the real agent, but every step lasts `step_seconds` of wall time whatever the machine's
load, so the step time both drivers are given is the one the workload keeps.

Steps end on an absolute schedule from the first step of the attempt (a late step is
caught up by the next), so the pace does not drift.

After the last step the script waits `tail_seconds` before it returns: a user's export or
upload, work that is not a training step.
"""
from __future__ import annotations

import time

import torch


def main(ctx) -> None:
    cfg = ctx.config
    steps, pace, seed = int(cfg["steps"]), float(cfg["step_seconds"]), int(cfg["seed"])
    torch.manual_seed(seed)
    w = torch.zeros(16)
    momentum = torch.zeros(16)
    start = 0
    state = ctx.resume_state()
    if state is not None:
        w, momentum, start = state["model"]["w"].clone(), state["optim"]["m"].clone(), int(state["step"])
    done = start

    def snapshot() -> dict:
        return {"model": {"w": w.clone()}, "optim": {"m": momentum.clone()}, "step": done}

    t0 = time.monotonic()
    for step in range(start, steps):
        x = torch.randn(16, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))
        grad = w - x  # one step of fitting the mean of the draws: deterministic, resumable
        momentum.mul_(0.9).add_(grad)
        w.sub_(0.01 * momentum)
        done = step + 1
        delay = t0 + (done - start) * pace - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        ctx.step_done(done, snapshot, {"train/loss": float(grad.pow(2).mean())}, final=done == steps)
    time.sleep(float(cfg.get("tail_seconds", 0.0)))
