"""Step-time overhead of the checkpoint policy against none, side by side in one run.

    python bench/step_overhead.py [--models demo,100M] [--pairs 5] [--threads 2] [--record FILE]

The example workload (workloads/charlm/train.py, unchanged) runs through a real RunContext:
- "none": no checkpoint store (metrics only);
- "policy": the template's tiers: a memory snapshot every 5 steps (within its cost budget)
  and a durable checkpoint every 40 steps (`--every`), written to a filesystem store.
Models: "demo" is the template's config (d=128, 2 layers, ~0.43M parameters); "100M" is
d=768, 14 layers, 12 heads (~99M parameters, a 1.2 GB checkpoint with AdamW's moments).

A run measures the wall time from after step W (warm-up) to after step N, where the
window holds `--intervals` durable saves and ends half an interval after the last one, so
a save's background write has to fit in the window like it would in a long run; no final
checkpoint is taken. Runs alternate none/policy (pairs), each from the same seed on the
same data; the overhead is policy/none - 1 per pair: median and min-max over pairs. A
median whose min-max spread crosses zero is reported as "not resolved", not as a figure.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from orbit_dagster.core.templates import load_template  # noqa: E402
from orbit_dagster.runtime import device as devices  # noqa: E402
from orbit_dagster.runtime.events import EventWriter  # noqa: E402
from orbit_dagster.runtime.notices import NoticeWatcher  # noqa: E402
from orbit_dagster.runtime.sdk import RunContext  # noqa: E402
from orbit_dagster.storage import open_store  # noqa: E402

WORKLOAD = REPO / "orbit_dagster" / "workloads" / "charlm"
BEGIN, END = "<!-- step-overhead:begin -->", "<!-- step-overhead:end -->"
GOAL = 0.02
MODELS = {
    "demo": {},
    "100M": {"d_model": 768, "n_heads": 12, "n_layers": 14, "micro_batch": 2, "grad_accum": 1, "dropout": 0.0},
}
WARMUP = 5


class _Stop(Exception):
    pass


class TimedContext(RunContext):
    """A RunContext that notes when each step_done returns and stops the run after step `last`."""

    def __init__(self, *args, last: int, **kw):
        super().__init__(*args, **kw)
        self.last, self.times = last, {}

    def step_done(self, step, state_fn, metrics=None, *, final=False):
        super().step_done(step, state_fn, metrics, final=final)
        self.times[step] = time.perf_counter()
        if step >= self.last:
            raise _Stop


def load_train():
    sys.path.insert(0, str(WORKLOAD))
    spec = importlib.util.spec_from_file_location("bench_charlm_train", WORKLOAD / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_run(train, cfg: dict, root: Path, *, policy: bool, threads: int, every: int, memory_every: int,
            last: int) -> tuple[float, list[dict]]:
    """(seconds per step over the window, the checkpoint events)."""
    run_dir = Path(tempfile.mkdtemp(dir=root))
    (run_dir / "inputs").mkdir()
    shutil.copy(WORKLOAD / "corpus.txt", run_dir / "inputs" / "corpus.txt")
    job = {"job_id": "bench", "template_snapshot": {"config": {**cfg, "steps": last + 10},
                                                    "resources": {"cpu_threads": threads}}}
    events = EventWriter(run_dir / "events.jsonl")
    store = open_store((run_dir / "store").as_uri()) if policy else None
    ctx = TimedContext(job=job, bundle_dir=run_dir, workdir=run_dir, attempt=1, events=events, store=store,
                       watcher=NoticeWatcher(None), checkpoint_every=every, memory_every=memory_every,
                       metrics_every=10, last=last)
    try:
        train.main(ctx)
    except _Stop:
        pass
    ctx.close()
    per_step = (ctx.times[last] - ctx.times[WARMUP]) / (last - WARMUP)
    ckpts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"checkpoint"' in x]
    shutil.rmtree(run_dir, ignore_errors=True)
    return per_step, ckpts


def measure(name: str, args, train, root: Path) -> dict:
    template = load_template("charlm-finetune")
    cfg = {**template.config, **MODELS[name]}
    every = args.every_100m if name == "100M" else args.every
    last = args.intervals * every + every // 2  # saves at every, 2*every, ...; half an interval after the last
    out = {"none": [], "policy": [], "blocked": [], "bytes": None, "every": every, "steps": last - WARMUP}
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for policy in order:
            per_step, ckpts = one_run(train, cfg, root, policy=policy, threads=args.threads, every=every,
                                      memory_every=args.memory_every, last=last)
            out["policy" if policy else "none"].append(per_step)
            if policy:
                out["blocked"] += [c["blocked_seconds"] for c in ckpts if "blocked_seconds" in c]
                out["bytes"] = ckpts[-1]["bytes"] if ckpts else None
        print(f"{name} pair {pair + 1}: none {out['none'][-1]:.4f} s/step, policy {out['policy'][-1]:.4f} s/step",
              flush=True)
    return out


def row(name: str, m: dict) -> str:
    ratios = [p / n - 1 for p, n in zip(m["policy"], m["none"])]
    med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    resolved = lo > 0 or hi < 0
    verdict = ("yes" if hi <= GOAL else "**NO**") if resolved else ("yes (bound)" if hi <= GOAL else "not resolved")
    blocked = statistics.median(m["blocked"]) if m["blocked"] else None
    size = f"{m['bytes'] / 1e6:.1f} MB" if m["bytes"] else "-"
    return (f"| {name} | {size} | {m['every']} | {len(ratios)} x {m['steps']} | {statistics.median(m['none']):.4f} | "
            f"{statistics.median(m['policy']):.4f} | {med * 100:+.1f}% ({lo * 100:+.1f}% .. {hi * 100:+.1f}%) | "
            f"{'-' if blocked is None else f'{blocked:.3f}'} | {verdict} |")


HEADER = ("| model | checkpoint | durable every (steps) | pairs x steps | none s/step | policy s/step | "
          "overhead median (min .. max) | blocked s per durable save | <= 2% |\n|---|---|---|---|---|---|---|---|---|")


def record(path: Path, rows: list[str], command: str, seconds: float) -> None:
    text = path.read_text(encoding="utf-8")
    plan = devices.plan()
    section = (f"\n## Checkpoint step-time overhead (bench/step_overhead.py)\n\nMeasured {date.today().isoformat()} "
               f"on {platform.machine()} ({os.cpu_count()} cores, shared with other work), device {plan.device} "
               f"({plan.name}, {plan.precision}), torch {torch.__version__}, "
               f"in {seconds:.0f} s. Command: `{command}`. Memory snapshot every 5 steps (within its 1% cost "
               "budget). \"yes (bound)\": the spread crosses zero, but even its maximum is within the goal.\n\n"
               f"{HEADER}\n" + "\n".join(rows) + "\n")
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    path.write_text(head + BEGIN + section + END + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,100M")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", type=int, default=40, help="durable checkpoint interval, steps (template: 40)")
    ap.add_argument("--every-100m", type=int, default=40, help="the same for the 100M model")
    ap.add_argument("--memory-every", type=int, default=5)
    ap.add_argument("--intervals", type=int, default=3, help="durable saves inside each measured window")
    ap.add_argument("--record", type=Path, default=None)
    args = ap.parse_args(argv)
    train = load_train()
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix=".step-overhead-", dir=REPO / "bench") as tmp:
        for name in args.models.split(","):
            rows.append(row(name, measure(name, args, train, Path(tmp))))
            print(rows[-1], flush=True)
    print(HEADER + "\n" + "\n".join(rows))
    if args.record:
        argv_txt = " ".join(sys.argv[1:]).replace(str(args.record), "docs/benchmarks.md")
        record(args.record, rows, f"python bench/step_overhead.py {argv_txt}".strip(), time.time() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
