"""A sharded training script (FSDP2) whose checkpoints are torch.distributed.checkpoint (DCP)
directories, launched by torchrun or as one plain process (no orbit import).

    torchrun --standalone --nproc_per_node 2 train.py --output_dir out --steps 200
    python train.py --output_dir out --resume_from out/ckpt_100 --steps 200   # 2 ranks' save, 1 process
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py ...  # 2 hosts

Under torchrun every rank holds a shard of each parameter and of the optimiser state
(`fully_shard`) and saves only its shard: `ckpt_<step>/` holds one `__<rank>_0.distcp` per
rank and `.metadata`, which rank 0 writes last. A checkpoint is written under
`.tmp-ckpt_<step>` and renamed into place once complete, so a watcher never sees half of
one: on several hosts each holds its own ranks' shards (rank 0's host the `.metadata` too),
so the first rank of each host renames its host's directory (a DCP save returns on every
rank only once every shard and the metadata are written). Periodic saves are asynchronous
(`dcp.async_save`: the state is staged into host memory, then written by a thread while
training goes on, on a process group of its own when there are several ranks); the training
thread blocks only for the staging copy. One stager serves every save of the run, so the host
buffers are allocated once and reused (pinned where CUDA is there, so the device-to-host copy
runs at full speed; plain reused host memory on the CPU); a save waits for the previous one
to finish writing before it copies into the same buffers. A finished save is renamed into
place at the first step after its writer is done. The save on a stop (SIGTERM, agreed by all
ranks at a step boundary) and the last one are synchronous. `--resume_from` loads a
checkpoint written by any number of ranks into this run's layout (DCP reshards on load), one
plain process included.

`--batch` is the step's global batch, whatever the number of ranks: each rank takes its
share of it. `--micro_batch M` bounds what one rank puts through the model at once: a share
larger than M is split into micro-batches whose gradients accumulate (each loss weighted by
its rows x world size / batch, so that the ranks' averaged gradients are the global batch's
mean even when its rows do not divide evenly over the ranks) before the step, so fewer ranks
(an elastic job resumed on fewer hosts) take more micro-batches each and train on the same
global batch, the same optimisation problem (the sums round differently). A batch divisible
by every world size the job may run on (48: 1, 2 or 3 ranks) gives every rank the same work. Rank 0 prints the world size and the
accumulation it runs with, as metrics at the step it starts from.

`--reference_dir DIR` also writes, at every save and right after a resume, the whole state
(every shard gathered) as `DIR/full_<step>.pt` from rank 0: what a test compares a
resharded load with, tensor by tensor.
"""
import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

stop = False


def on_sigterm(signum, frame):
    global stop
    stop = True


def batch(seed: int, step: int, size: int, rank: int, world: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x[rank::world], y[rank::world]  # each rank its share of the step's global batch


def build(seed: int, lr: float, sharded: bool):
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    if sharded:
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def state_of(model, opt, step: int) -> dict:
    """The DCP state: sharded tensors stay sharded (each rank saves its own part)."""
    model_sd, optim_sd = get_state_dict(model, opt)  # creates the optimiser's state before its first step
    return {"model": model_sd, "optimizer": optim_sd, "step": torch.tensor(step)}


def full(value):
    """A tensor whole (a sharded one gathered from every rank), recursively."""
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def write_reference(directory: str, step: int, state: dict, rank: int) -> None:
    whole = full(state)  # a collective: every rank takes part
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        torch.save(whole, os.path.join(directory, f"full_{step}.pt"))


class KeptStager(BlockingAsyncStager):
    """A stager to keep for every async save of a run: the first save makes a host copy of the
    state (pinned where CUDA is there, so the device-to-host copy runs at full speed; plain host
    memory on the CPU) and each later one copies into it in place, tensor by tensor, with
    nothing else around the copies. DCP's own default builds a new stager, so new host memory,
    on every call; a DefaultStager kept for the run reuses its memory but still deep-copies the
    state dict's structure on every save, which measured 1.3x the bare copies with 8 MiB
    shards on a CPU (docs/benchmarks.md, async_save staging). Staging is synchronous: async_save
    returns once the copy is done, so the optimiser may change the parameters right after.

    The copy is `_copy_state_dict` into `_create_cpu_state_dict`'s buffers: what torch's
    BlockingAsyncStager does with `cache_staged_state_dict=True`, which pins unconditionally
    and so needs an accelerator; a private torch helper, hence this one place."""

    def __init__(self):
        super().__init__(cache_staged_state_dict=True)
        self.gpu = torch.cuda.is_available()

    def stage(self, state_dict: dict) -> dict:
        if self.state_dict_cache is not None:
            try:
                return self._refresh(state_dict)
            except CompanionMismatch:  # other keys than the first save's (an optimiser state made since): anew
                self.state_dict_cache = None
        self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self.gpu)
        return self._refresh(state_dict)

    def _refresh(self, state_dict: dict) -> dict:
        staged = _copy_state_dict(state_dict, self.state_dict_cache, non_blocking=self.gpu)
        if self.gpu:
            torch.cuda.synchronize()  # the copies queued without blocking are done before the writer reads
        return staged

    def close(self) -> None:
        self.state_dict_cache = None  # the host copy (pinned memory too) freed with it


class Saver:
    """One save in flight at a time; a finished one renamed into place by each host's first rank."""

    def __init__(self, out: str, local_rank: int, distributed: bool):
        self.out, self.local_rank, self.distributed = out, local_rank, distributed
        # Async saves talk between ranks from a background thread: on a group of their own,
        # never interleaved with the training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.pending = None
        self.stager = KeptStager()

    def _publish(self, step: int) -> None:
        if self.local_rank == 0:
            os.replace(os.path.join(self.out, f".tmp-ckpt_{step}"), os.path.join(self.out, f"ckpt_{step}"))

    def publish_if_written(self) -> None:
        """Called at every step: a save whose writer is done appears at once, not when the next
        save begins an interval later (a host lost meanwhile would lose it with the interval)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            future, step = self.pending
            self.pending = None
            future.result()
            self._publish(step)

    def save(self, state: dict, step: int, *, sync: bool) -> None:
        # Before anything else: the previous save's writer reads the stager's buffers until it
        # is done, and this save's staging overwrites them.
        self.wait()
        tmp = os.path.join(self.out, f".tmp-ckpt_{step}")
        if sync:
            dcp.save(state, checkpoint_id=tmp, process_group=self.group)
            self._publish(step)
        else:
            self.pending = (dcp.async_save(state, checkpoint_id=tmp, process_group=self.group,
                                           async_stager=self.stager), step)

    def close(self) -> None:
        """The last save finished and published; the stager's host buffers (pinned ones too) freed."""
        self.wait()
        self.stager.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume_from", default="")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--batch", type=int, default=64, help="the step's global batch, over every rank")
    p.add_argument("--micro_batch", type=int, default=0, help="most samples one rank puts through at once "
                   "(0: its whole share); more are accumulated")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--reference_dir", default="")
    args = p.parse_args()

    signal.signal(signal.SIGTERM, on_sigterm)
    distributed = "RANK" in os.environ  # under torchrun; else one plain process, no group at all
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if distributed else 0
    share = len(range(rank, args.batch, world))  # this rank's rows of the global batch
    micro = args.micro_batch or share
    accum = -(-share // micro)
    torch.set_num_threads(1)
    model, opt = build(args.seed, args.lr, distributed)
    start = 0
    if args.resume_from:
        state = state_of(model, opt, 0)
        dcp.load(state, checkpoint_id=args.resume_from)  # into this run's shards, whatever wrote it
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        start = int(state["step"])
        if args.reference_dir:
            write_reference(args.reference_dir, start, state_of(model, opt, start), rank)
    os.makedirs(args.output_dir, exist_ok=True)
    saver = Saver(args.output_dir, local_rank, distributed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    if rank == 0:
        print(json.dumps({"step": start, "world_size": world, "grad_accum": accum}), flush=True)
    for step in range(start + 1, args.steps + 1):
        x, y = batch(args.seed, step, args.batch, rank, world)
        opt.zero_grad()
        loss = torch.zeros(())
        for i in range(0, share, micro):
            # Each micro-batch's mean weighted by its rows x world / batch: the ranks' gradients,
            # averaged by FSDP, are then the global batch's mean even where its rows do not split
            # evenly over the ranks (64 over 3: 22, 21, 21), so any world size trains the same problem.
            part = loss_fn(model(x[i:i + micro]), y[i:i + micro]) * (len(x[i:i + micro]) * world / args.batch)
            part.backward()
            loss += part.detach()
        opt.step()
        saver.publish_if_written()
        flag = torch.tensor([1 if stop else 0])
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        last = step == args.steps
        if rank == 0:
            print(json.dumps({"step": step, "train/loss": round(loss.item(), 6)}), flush=True)
        if flag.item() or last or step % args.save_every == 0:
            state = state_of(model, opt, step)
            if args.reference_dir:
                write_reference(args.reference_dir, step, state, rank)
            saver.save(state, step, sync=bool(flag.item()) or last)
        if flag.item():
            break
    saver.close()
    if distributed:
        dist.barrier()  # every save published before any rank exits
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
