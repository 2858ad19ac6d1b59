"""A plain DistributedDataParallel training script, launched by torchrun (no orbit import).

    torchrun --standalone --nproc_per_node 2 train.py --output_dir out --steps 200

What a script written for spot hosts does anyway, and all orbit needs: it saves
`ckpt_<step>.pt` (written to a temporary name, then renamed) every --save_every steps and
when asked to stop (SIGTERM: torchrun forwards it to every rank), resumes from --resume_from,
and prints metrics as JSON lines. A stop is agreed by all ranks at a step boundary (an
all-reduce of the flag), so no rank is left waiting in a collective for one that exited.
Each step's batch comes from a generator seeded with the step, so a resumed run sees the
same data as an uninterrupted one, and its final weights are identical.
"""
import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

stop = False


def on_sigterm(signum, frame):
    global stop
    stop = True


def batch(seed: int, step: int, size: int, rank: int, world: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x[rank::world], y[rank::world]  # each rank its share of the step's global batch


def save(path: str, step: int, model, opt) -> None:
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")
    torch.save({"step": step, "model": model.module.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume_from", default="")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.resume_from:
        state = torch.load(args.resume_from, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    os.makedirs(args.output_dir, exist_ok=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(start + 1, args.steps + 1):
        x, y = batch(args.seed, step, args.batch, rank, world)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        flag = torch.tensor([1 if stop else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        last = step == args.steps
        if rank == 0:
            print(json.dumps({"step": step, "train/loss": round(loss.item(), 6)}), flush=True)
            if flag.item() or last or step % args.save_every == 0:
                save(os.path.join(args.output_dir, f"ckpt_{step}.pt"), step, model, opt)
        dist.barrier()  # the checkpoint is written before any rank goes on or exits
        if flag.item():
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
