"""Step-time overhead of the checkpoint policy against none, side by side in one run.

    python bench/step_overhead.py [--models demo,100M] [--pairs 12] [--threads 2] [--every-100m 20,N] [--record FILE]
                                  [--section NAME]

The example workload (workloads/charlm/train.py, unchanged) runs through a real RunContext
with a filesystem checkpoint store and the template's tiers: a memory snapshot every 5
steps (within its cost budget, and only once a gap between step boundaries has reached the
notice grace: `--notice-grace 0` takes them whatever the steps' length, as before that
rule) and a durable checkpoint every 40 steps (`--every`; a comma
list measures each interval in turn, e.g. `--every-100m 20,<the interval the orbit policy
chose in the replay test>`). The durable save is the production path: the training thread
stages the state, a background thread streams torch.save into the store's writer, whose
threads hash and write its parts; "blocked s per GB" is the training thread's share per GB
of checkpoint.
Models: "demo" is the template's config (d=128, 2 layers, ~0.43M parameters); "100M" is
d=768, 14 layers, 12 heads (~99M parameters, a 1.2 GB checkpoint with AdamW's moments).

Each (model, interval) is measured in a process of its own, as production runs each
training: a run measured before it in the same process would leave its heap and threads
behind. One training run is cut into blocks of one durable interval, each centred on a durable
save's step; the checkpoint policy is switched on and off block by block (on/off, then
off/on, ...), so that both halves of a pair see the same machine load, which on a shared
machine comes in bursts that a run-against-run comparison cannot tell from the effect.
An "on" block holds its durable save in the middle and waits for its background write at
its end (so the write is counted in full, half an interval after the save, as it would
overlap training in a long run); its memory snapshots are counted too. The overhead is
on/off - 1 per pair: median, and the interquartile range over pairs as the spread; a
median whose spread crosses zero is reported as "not resolved", not as a figure. The
first pair is warm-up (first allocations, thread start) and not counted.

A second estimate looks at each save where it happens: the seconds the save's step and the
20 after it (the write lands within a few steps) took beyond the pace of the 40 steps just
before it. It compares steps a minute apart rather than blocks minutes apart: on this
machine the same 99 steps took 60.7-76.1 s in different blocks of one run, far more than a
save costs. The same window in the off blocks shows the estimate's own noise. What it
misses is any cost spread beyond those 20 steps, which only the block comparison sees.

Both clocks are reported: wall time (the goal's measure, but other processes on a shared
machine swing it by more than the effect) and this process's CPU time (all threads, the
background writer's included), which other processes barely move. With the training using
every core, CPU time spent on checkpoints is training time lost; on a GPU host, where the
CPU mostly waits for the GPU, it is an upper bound of it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from recording import measured_on, recorded_command, replace_section  # noqa: E402

from orbit_dagster.core.templates import load_template  # noqa: E402
from orbit_dagster.runtime import device as devices  # noqa: E402
from orbit_dagster.runtime.agent import seconds_arg  # noqa: E402
from orbit_dagster.runtime.events import EventWriter  # noqa: E402
from orbit_dagster.runtime.notices import NOTICE_GRACE_S, NoticeWatcher  # noqa: E402
from orbit_dagster.runtime.sdk import MEMORY_GAP_SHARE, RunContext  # noqa: E402
from orbit_dagster.storage import open_store  # noqa: E402

WORKLOAD = REPO / "orbit_dagster" / "workloads" / "charlm"
SECTION = "step-overhead"
# The record's sections in docs/benchmarks.md: the main one, and the policy's interval measured
# apart (most of an hour), so that neither run replaces the other's rows.
SECTIONS = {SECTION: ("<!-- step-overhead:begin -->", "<!-- step-overhead:end -->"),
            "step-overhead-policy": ("<!-- step-overhead-policy:begin -->", "<!-- step-overhead-policy:end -->")}
GOAL = 0.02
LOAD_AT_START = os.getloadavg()[0]  # other processes' load, recorded with the figures
MODELS = {
    "demo": {},
    "100M": {"d_model": 768, "n_heads": 12, "n_layers": 14, "micro_batch": 1, "grad_accum": 1, "dropout": 0.0},
}
WARMUP = 5
RESULT = "step-overhead-result: "  # the line a measurement's own process reports on


class _Stop(Exception):
    pass


class TimedContext(RunContext):
    """A RunContext that notes when each step_done returns and stops the run after step `last`.

    With `blocks`, the checkpointer is attached only in "on" blocks: `blocks(step)` says
    whether the block holding `step` is on, and `block_end(step)` whether it ends there."""

    def __init__(self, *args, last: int, blocks=None, block_end=None, **kw):
        super().__init__(*args, **kw)
        self.last, self.times, self.cpu = last, {}, {}
        self.blocks, self.block_end = blocks, block_end
        self._ck = self.checkpointer

    def step_done(self, step, state_fn, metrics=None, *, final=False):
        if self.blocks is not None:
            self.checkpointer = self._ck if self.blocks(step) else None
        super().step_done(step, state_fn, metrics, final=final)
        if self.blocks is not None and self.checkpointer is not None and self.block_end(step):
            self.checkpointer.flush()  # the on block pays for its whole write
            # That wait is the bench's, not the workload's (a run overlaps the write with its
            # next steps): not a step gap that would turn the memory tier on (runtime/sdk.py).
            self._returned_at = time.perf_counter()
        self.times[step] = time.perf_counter()
        self.cpu[step] = time.process_time()  # all threads of this process: the writer's work too
        if step >= self.last:
            raise _Stop

    def close(self):
        self.checkpointer = self._ck
        super().close()


def load_train():
    sys.path.insert(0, str(WORKLOAD))
    spec = importlib.util.spec_from_file_location("bench_charlm_train", WORKLOAD / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job_dir(root: Path, cfg: dict, steps: int, threads: int) -> tuple[Path, dict]:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    (run_dir / "inputs").mkdir()
    shutil.copy(WORKLOAD / "corpus.txt", run_dir / "inputs" / "corpus.txt")
    return run_dir, {"job_id": "bench", "template_snapshot": {"config": {**cfg, "steps": steps},
                                                              "resources": {"cpu_threads": threads}}}


def one_run(train, cfg: dict, root: Path, *, policy: bool, threads: int, every: int, memory_every: int,
            last: int) -> tuple[float, list[dict]]:
    """One plain run to step `last`: (seconds per step after warm-up, the checkpoint events)."""
    run_dir, job = _job_dir(root, cfg, last + 10, threads)
    store = open_store((run_dir / "store").as_uri()) if policy else None
    ctx = TimedContext(job=job, bundle_dir=run_dir, workdir=run_dir, attempt=1,
                       events=EventWriter(run_dir / "events.jsonl"), store=store, watcher=NoticeWatcher(None),
                       checkpoint_every=every, memory_every=memory_every, metrics_every=10, last=last)
    try:
        train.main(ctx)
    except _Stop:
        pass
    ctx.close()
    per_step = (ctx.times[last] - ctx.times[WARMUP]) / (last - WARMUP)
    ckpts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"checkpoint"' in x]
    shutil.rmtree(run_dir, ignore_errors=True)
    return per_step, ckpts


def blocked_run(train, cfg: dict, root: Path, *, threads: int, every: int, memory_every: int, pairs: int,
                notice_grace: float = NOTICE_GRACE_S, steps_out: Path | None = None) -> dict:
    """One run of 2 x `pairs` blocks; block b spans steps (b*E - E/2, b*E + E/2]."""
    half = every // 2
    n_blocks = 2 * pairs

    def block_of(step: int) -> int:
        return (step + half - 1) // every

    def is_on(step: int) -> bool:
        b = block_of(step)
        if b == 0:
            return False  # the first half interval: no save falls in it
        pair, second = divmod(b - 1, 2)
        return second == pair % 2  # pairs of blocks: on/off, off/on, on/off, ...

    first = every - half  # block 1 starts after step E/2 (rounded down)
    last = first + n_blocks * every  # an odd interval's blocks too end on a step
    run_dir, job = _job_dir(root, cfg, last + 10, threads)
    ctx = TimedContext(job=job, bundle_dir=run_dir, workdir=run_dir, attempt=1,
                       events=EventWriter(run_dir / "events.jsonl"), store=open_store((run_dir / "store").as_uri()),
                       watcher=NoticeWatcher(None), checkpoint_every=every, memory_every=memory_every,
                       metrics_every=10, last=last, blocks=is_on, block_end=lambda s: (s + half) % every == 0,
                       notice_grace=notice_grace)
    try:
        train.main(ctx)
    except _Stop:
        pass
    ctx.close()
    ends = [first + b * every for b in range(n_blocks + 1)]  # block b+1 = (ends[b], ends[b+1]]
    on = [is_on(ends[b] + 1) for b in range(n_blocks)]

    def pairs_of(clock: dict) -> list[tuple[float, float]]:
        per_block = [(clock[ends[b + 1]] - clock[ends[b]]) / every for b in range(n_blocks)]
        return [(per_block[i], per_block[i + 1]) if on[i] else (per_block[i + 1], per_block[i])
                for i in range(2, n_blocks, 2)]  # pair 0 (blocks 1, 2): warm-up

    ckpts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"checkpoint"' in x]
    shutil.rmtree(run_dir, ignore_errors=True)
    local = [(on[b], *(_local_excess(clock, ends[b] + half, every) for clock in (ctx.times, ctx.cpu)))
             for b in range(2, n_blocks)]  # blocks 1, 2: the warm-up pair
    ck, on_blocks = ctx._ck, sum(on)
    if steps_out is not None:  # every step's clocks, to see where in a block the time went
        steps_out.write_text(json.dumps({"every": every, "ends": ends, "on": on, "wall": ctx.times, "cpu": ctx.cpu,
                                         "checkpoints": ckpts}))
    return {"wall": pairs_of(ctx.times), "cpu": pairs_of(ctx.cpu), "checkpoints": ckpts, "local": local,
            "memory": (ck.memory_copies / on_blocks, ck.memory_seconds / on_blocks)}


LOCAL_BEFORE, LOCAL_AFTER = 40, 20  # steps: the local baseline before a save, and the window after it


def _local_excess(clock: dict, save: int, every: int) -> float:
    """Seconds that steps `save` .. `save` + LOCAL_AFTER took beyond as many steps at the median
    pace of the LOCAL_BEFORE steps just before: the save's own cost (its staging, and its write
    on the background threads, done within a few steps) measured against the training's pace
    of the last minute or so, not against another block minutes away. In an off block, the
    same window at the same position: this estimate's own noise."""
    before, after = min(LOCAL_BEFORE, every // 2 - 1), min(LOCAL_AFTER, every - every // 2 - 1)
    pace = statistics.median(clock[k] - clock[k - 1] for k in range(save - before, save))
    return clock[save + after] - clock[save - 1] - (after + 1) * pace


def measure(name: str, args, train, root: Path, every: int) -> dict:
    cfg = {**load_template("charlm-finetune").config, **MODELS[name]}
    pairs = args.pairs_100m if name == "100M" else args.pairs
    res = blocked_run(train, cfg, root, threads=args.threads, every=every, memory_every=args.memory_every,
                      pairs=pairs + 1, notice_grace=args.notice_grace,
                      steps_out=args.steps_out and args.steps_out.with_suffix(f".{name}-{every}.json"))
    ckpts = res["checkpoints"]
    return {"wall": res["wall"], "cpu": res["cpu"], "every": every, "memory": res["memory"], "local": res["local"],
            "blocked": [c["blocked_seconds"] for c in ckpts[1:]], "bytes": ckpts[-1]["bytes"] if ckpts else None}


def measure_apart(name: str, every: str, argv: list[str]) -> dict:
    """`measure` in a process of its own, as production runs each training (one RunContext, in
    the process the agent starts): what one measured run leaves in the process (its allocator's
    heap, its threads) never reaches the next."""
    out = subprocess.run([sys.executable, __file__, *argv, "--one", f"{name}:{every}"], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith(RESULT)]
    return json.loads(line[len(RESULT):])


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def overhead(pairs: list[tuple[float, float]]) -> dict:
    ratios = [on / off - 1 for on, off in pairs]
    lo, hi = _quartiles(ratios)
    med = statistics.median(ratios)
    if hi < 0:
        verdict = "not resolved (drift: on blocks faster)"  # a checkpoint cannot speed training up
    elif lo > 0:
        verdict = "yes" if med <= GOAL else "**NO**"
    else:
        verdict = "yes (bound)" if hi <= GOAL else "not resolved"
    return {"median": med, "lo": lo, "hi": hi, "min": min(ratios), "max": max(ratios), "verdict": verdict}


def row(name: str, m: dict) -> str:
    wall, cpu = overhead(m["wall"]), overhead(m["cpu"])
    lost = statistics.median([(on - off) * m["every"] for on, off in m["wall"]])
    cpu_lost = statistics.median([(on - off) * m["every"] for on, off in m["cpu"]])
    blocked = statistics.median(m["blocked"]) if m["blocked"] else None
    size = f"{m['bytes'] / 1e6:.1f} MB" if m["bytes"] else "-"
    per_gb = "-" if blocked is None or not m["bytes"] else f"{blocked / (m['bytes'] / 1e9):.3f}"

    def pct(o: dict) -> str:
        return f"{o['median'] * 100:+.2f}% ({o['lo'] * 100:+.2f}% .. {o['hi'] * 100:+.2f}%)"

    off_step = statistics.median([p[1] for p in m["wall"]])
    on_local = [x for x in m["local"] if x[0]]
    control = [x for x in m["local"] if not x[0]]

    def local(xs: list, i: int) -> str:
        return f"{statistics.median(x[i] for x in xs):.2f} ({min(x[i] for x in xs):.2f} .. {max(x[i] for x in xs):.2f})"

    share = statistics.median(x[1] for x in on_local) / (m["every"] * off_step)
    return (f"| {name} | {size} | {m['every']} | {len(m['wall'])} | {off_step:.4f} | "
            f"{pct(wall)} | {wall['verdict']} | {pct(cpu)} | {cpu['verdict']} | {lost:.3f} | {cpu_lost:.3f} | "
            f"{'-' if blocked is None else f'{blocked:.3f}'} | {per_gb} | {m['memory'][0]:.1f} ({m['memory'][1]:.2f} s) | "
            f"{local(on_local, 1)} | {local(on_local, 2)} | {share * 100:+.2f}% | {local(control, 1)} |")


HEADER = ("| model | checkpoint | durable every (steps) | pairs | off s/step (wall) | wall overhead median "
          "(interquartile) | <= 2% | CPU-time overhead median (interquartile) | <= 2% | wall s lost per interval | "
          "CPU s spent per interval | blocked s per durable save | blocked s per GB | memory snapshots per on block "
          "(their seconds) | a save's local cost, wall s median (min .. max) | its CPU s | local cost / interval | "
          "the same window in off blocks, wall s (the estimate's noise) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def record(path: Path, rows: list[str], command: str, seconds: float, name: str = SECTION, *,
           memory_every: int = 5, notice_grace: float = NOTICE_GRACE_S) -> None:
    plan = devices.plan()
    title = "bench/step_overhead.py" + ("" if name == SECTION else f", section {name}")
    section = (f"\n## Checkpoint step-time overhead ({title})\n\n{measured_on(LOAD_AT_START)}, device {plan.device} "
               f"({plan.name}, {plan.precision}), torch {torch.__version__}, "
               f"in {seconds:.0f} s. Command: `{command}`. Memory snapshots: every {memory_every} steps, within "
               f"their 1% cost budget, once a gap between step boundaries has reached {MEMORY_GAP_SHARE:g} x the "
               f"{notice_grace:g} s notice grace (runtime/sdk.py). \"yes (bound)\": the interquartile range crosses zero, and its top is within the goal; "
               f"\"not resolved (drift: on blocks faster)\": the range lies wholly below zero, the machine's pace changed. "
               "\"s lost per interval\": wall seconds one on block lost against its off partner (\"CPU s\": CPU "
               "seconds it spent more); the overhead at another durable interval is about this / that interval's "
               "length in seconds. \"A save's local cost\": the seconds the save's step and the "
               f"{LOCAL_AFTER} after it took beyond as many steps at the median pace of the {LOCAL_BEFORE} steps "
               "before it, per counted on block (the same window of the off blocks gives the estimate's noise); "
               "\"local cost / interval\": its median over the interval's length at the off blocks' pace; a cost "
               "spread further than those steps is not in it.\n\n"
               f"{HEADER}\n" + "\n".join(rows) + "\n")
    replace_section(path, *SECTIONS[name], section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,100M")
    ap.add_argument("--pairs", type=int, default=12, help="on/off block pairs for the demo model")
    ap.add_argument("--pairs-100m", type=int, default=3, help="the same for the 100M model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", default="40", help="durable checkpoint interval(s), steps, comma-separated (template: 40)")
    ap.add_argument("--every-100m", default="40", help="the same for the 100M model, e.g. 20,N")
    ap.add_argument("--memory-every", type=int, default=5)
    ap.add_argument("--notice-grace", type=seconds_arg, default=NOTICE_GRACE_S,
                    help="the agent's --notice-grace; 0 takes memory snapshots whatever the steps' length")
    ap.add_argument("--record", type=Path, default=None)
    ap.add_argument("--steps-out", type=Path, default=None,
                    help="also write every step's wall and CPU clock, per (model, interval), to FILE.MODEL-EVERY.json")
    ap.add_argument("--section", default=SECTION, choices=sorted(SECTIONS), help="the section of --record to write")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODEL:EVERY, one measurement (measure_apart)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.one:
        name, every = args.one.split(":")
        with tempfile.TemporaryDirectory(prefix=".step-overhead-", dir=REPO / "bench") as tmp:
            print(RESULT + json.dumps(measure(name, args, load_train(), Path(tmp), int(every))), flush=True)
        return 0
    t0 = time.time()
    rows = []
    for name in args.models.split(","):
        for every in (args.every_100m if name == "100M" else args.every).split(","):
            rows.append(row(name, measure_apart(name, every, argv)))
            print(rows[-1], flush=True)
    print(HEADER + "\n" + "\n".join(rows))
    if args.record:
        record(args.record, rows, recorded_command("step_overhead", argv, leave_out=("--steps-out",)),
               time.time() - t0,
               args.section, memory_every=args.memory_every, notice_grace=args.notice_grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
