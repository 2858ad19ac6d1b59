"""What background checkpoint hashing costs a CPU-bound training, by the hashing threads' priority.

    python bench/cpu_contention.py [--threads 2] [--hashers N] [--nice 0,10,19] [--seconds 6]
                                   [--repeat 3] [--record FILE]

A durable save's bytes are hashed (sha256) and written by the store's pool threads
(storage/parts.py, one per core) while training goes on. Where the training keeps every core
busy (the CPU benchmark machine; a GPU host whose data loading is heavy), those threads take
CPU from it. This measures, side by side in one run, the training's steps per second alone and
with `--hashers` threads hashing 16 MiB parts (hashlib, as the store does) at each nice value
(Linux: a thread's own nice, `setpriority` on its thread id), alone and contended windows taken
in turn so that both see the same machine load. Reported per nice value: the training's speed
against alone, the CPU seconds the hashers got, and the training's core-seconds lost per
hashing CPU-second: 1 is a fair trade; above 1 the training loses more than the hashing used
(its OpenMP threads wait for a descheduled partner); below 1 the hashing used time the training
left idle.

The training step is an MLP with the 100M model's matrix shapes (768 x 3072 and back, 4
blocks, AdamW), forward and backward on 256 rows, `--threads` torch threads. The figures are
the machine's scheduling, not a checkpoint: they say whether running the save's threads at a
lower priority would make a save cheaper for the training (docs/benchmarks.md: it spreads the
cost, it does not clearly shrink it, so orbit does not do it).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from recording import measured_on, recorded_command, replace_section  # noqa: E402

from orbit_dagster.storage.parts import PART_SIZE, threads  # noqa: E402

BEGIN, END = "<!-- cpu-contention:begin -->", "<!-- cpu-contention:end -->"


def model_and_step(n_threads: int):
    torch.set_num_threads(n_threads)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768))
              for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 768)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    return step


def train_for(step, seconds: float) -> tuple[float, float]:
    """(steps per second, this process's CPU seconds) over about `seconds` of training."""
    n, began, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - began < seconds:
        step()
        n += 1
    return n / (time.perf_counter() - began), time.process_time() - cpu


def hasher(stop: threading.Event, nice: int, part: bytes, used: list[float]) -> None:
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # this thread only (Linux)
    began = time.thread_time()
    while not stop.is_set():
        hashlib.sha256(part).digest()
    used.append(time.thread_time() - began)


def contended(step, seconds: float, nice: int, hashers: int, part: bytes) -> tuple[float, float, float]:
    """(steps per second, process CPU seconds, the hashers' CPU seconds) with `hashers` threads hashing."""
    stop, used = threading.Event(), []
    pool = [threading.Thread(target=hasher, args=(stop, nice, part, used)) for _ in range(hashers)]
    for t in pool:
        t.start()
    rate, cpu = train_for(step, seconds)
    stop.set()
    for t in pool:
        t.join()
    return rate, cpu, sum(used)


def measure(args) -> list[dict]:
    step = model_and_step(args.threads)
    part = os.urandom(PART_SIZE)
    train_for(step, 2.0)  # warm-up: first allocations, thread start
    rows = []
    for nice in args.nice:
        alone, with_bg = [], []
        for _ in range(args.repeat):
            alone.append(train_for(step, args.seconds))
            with_bg.append(contended(step, args.seconds, nice, args.hashers, part))
        base = statistics.median(r for r, _ in alone)
        base_cpu_per_s = statistics.median(c / args.seconds for _, c in alone)  # the training's cores in use
        speed = [r / a for (r, _, _), (a, _) in zip(with_bg, alone)]
        hashing = statistics.median(h for _, _, h in with_bg)
        lost = statistics.median((1 - r / a) * base_cpu_per_s * args.seconds for (r, _, _), (a, _) in zip(with_bg, alone))
        rows.append({"nice": nice, "alone": base, "speed": statistics.median(speed), "speed_min": min(speed),
                     "speed_max": max(speed), "hashing_s": hashing, "lost_s": lost,
                     "lost_per_hash_s": lost / hashing if hashing > 0 else float("nan")})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the training")
    ap.add_argument("--hashers", type=int, default=threads(), help="hashing threads (default: the store's pool size)")
    ap.add_argument("--nice", default="0,10,19", help="nice values of the hashing threads, comma-separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each alone and contended window")
    ap.add_argument("--repeat", type=int, default=3, help="alone/contended window pairs per nice value")
    ap.add_argument("--record", type=Path, default=None)
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("a thread's own nice value needs Linux (setpriority on a thread id); nothing measured")
        return 0
    args.nice = [int(x) for x in args.nice.split(",")]
    began, load = time.time(), os.getloadavg()[0]
    rows = measure(args)
    table = ("| hashers' nice | training alone (steps/s) | training with the hashers / alone, median (min-max) "
             "| hashers' CPU s per window | training core-s lost per window | lost per hashing CPU-s |\n"
             "|---|---|---|---|---|---|\n")
    table += "\n".join(f"| {r['nice']} | {r['alone']:.2f} | {r['speed']:.2f} ({r['speed_min']:.2f}-{r['speed_max']:.2f}) "
                       f"| {r['hashing_s']:.2f} | {r['lost_s']:.2f} | {r['lost_per_hash_s']:.2f} |" for r in rows)
    print(table)
    if args.record:
        section = (f"\n## Background hashing against a CPU-bound training, by priority (bench/cpu_contention.py)\n\n"
                   f"{measured_on(load)}, torch {torch.__version__}, "
                   f"{args.threads} training threads, {args.hashers} hashing threads, {args.repeat} pairs of "
                   f"{args.seconds:.0f} s windows per row, in {time.time() - began:.0f} s. Command: "
                   f"`{recorded_command('cpu_contention', sys.argv[1:] if argv is None else argv)}`.\n\n{table}\n")
        replace_section(args.record, BEGIN, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
