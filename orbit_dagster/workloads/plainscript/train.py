"""A plain PyTorch training script: argparse, no orbit import.

Fits a small MLP to a synthetic regression set. Written the way a script for spot hosts is
written anyway: it saves model, optimizer, RNG and step every --save_every steps (to a
temporary name, then renamed), resumes from --resume_from, draws each step's batch from a
generator seeded by the step (so a resumed run sees the same batches), and on SIGTERM saves
once more and exits. Metrics are printed as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from torch import nn

N_TRAIN, N_FEATURES = 2048, 16


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N_FEATURES, 1, generator=torch.Generator().manual_seed(7))  # the same task for every split
    x = torch.randn(n, N_FEATURES, generator=g)
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(N_FEATURES, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))


def save(path: str, model, optimizer, step: int) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(), "step": step}, tmp)
    os.replace(tmp, path)  # never a half-written file under the final name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume_from", default="")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))  # finish the step, save, exit

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    x, y = make_data(args.seed, N_TRAIN)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    if args.resume_from:
        state = torch.load(args.resume_from, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step = int(state["step"])
        print(f"resumed from {args.resume_from} at step {step}", flush=True)
    os.makedirs(args.output_dir, exist_ok=True)

    while step < args.steps and not stop["asked"]:
        order = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        idx = torch.randint(0, N_TRAIN, (args.batch_size,), generator=order)
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        print(json.dumps({"step": step, "train/loss": loss.item()}), flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save(os.path.join(args.output_dir, f"ckpt_{step}.pt"), model, optimizer, step)
    if stop["asked"] and step % args.save_every != 0:
        save(os.path.join(args.output_dir, f"ckpt_{step}.pt"), model, optimizer, step)
        print(f"SIGTERM: saved step {step}, exiting", flush=True)


if __name__ == "__main__":
    main()
