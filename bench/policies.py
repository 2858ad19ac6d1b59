"""Checkpoint and deadline policies side by side on the evaluation traces; `--record` rewrites their section.

    python bench/policies.py [SHARED_DATA_DIR] [--quick] [--starts N] [--record docs/benchmarks.md] [--json FILE]

SHARED_DATA_DIR defaults to ../shared/data beside the repository. Only the **evaluation**
traces are replayed: every trace outside the leave-out split's training set
(``catalog.fit_reclaims.TRAINING_TRACES``), which is all the shipped reclaim model was
fitted on (the script refuses to run if the model lists an evaluation trace).

1. Checkpointing, a grid: notice 120 s / 30 s / 0 s / 120 s with 5% of notices lost x save
   10 s / 60 s / 300 s (restore 300 s). Per policy: total overhead = wasted + checkpoint +
   restart (GPU-hours and $), goodput, unfinished jobs. Every policy gets the same notice
   handling (emergency checkpoint when it fits, release at the notice); ``hindsight`` is the
   best fixed interval for each trace and cell, chosen knowing the trace (and which notices
   are lost); ``young-daly-true`` is told the trace's true MTBF.
2. Deadlines: 24 h of work with 30 / 36 / 48 h deadlines, each cloud's own notice, save 60 s.

All ratios are computed from figures measured in this one run; nothing is tuned here.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orbit_dagster.catalog.fit_reclaims import SPLIT_NAME, TRAINING_TRACES, split_traces  # noqa: E402
from orbit_dagster.catalog.reclaim_model import load_reclaim_model  # noqa: E402
from orbit_dagster.catalog.traces import load_traces  # noqa: E402
from orbit_dagster.policy.compare import simulate_trace  # noqa: E402

BEGIN, END = "<!-- policies:begin -->", "<!-- policies:end -->"
JOB_HOURS = 24.0
NOTICES = ((120.0, 0.0), (30.0, 0.0), (0.0, 0.0), (120.0, 0.05))  # (notice s, share of notices lost)
SAVES = (10.0, 60.0, 300.0)
RESTORE_S = 300.0
DEADLINES = (30.0, 36.0, 48.0)
BASELINES = ("notice-only", "fixed-30m", "young-daly", "young-daly-true")
GOAL_RATIO = 1.05
LOST_SEEDS = 4  # draws of which notices are lost, per start, in the "5% lost" cells


def _by(rows: list[dict]) -> dict[str, dict]:
    return {r["policy"]: r for r in rows}


def _ratio(a: float, b: float) -> float:
    """a / b for overheads; both are > 0 whenever a job restores at least once."""
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def _cell_name(notice: float, lost: float) -> str:
    return f"{notice:g} s" + (f", {lost:.0%} lost" if lost else "")


def checkpoint_grid(traces, model, starts: int, log) -> list[dict]:
    out = []
    for notice, lost in NOTICES:
        for save in SAVES:
            t0 = time.time()
            for t in traces:
                res = simulate_trace(t, job_hours=JOB_HOURS, notice_seconds=notice, save_seconds=save,
                                     restore_seconds=RESTORE_S, starts=starts, model=model, notice_miss_rate=lost,
                                     seeds=LOST_SEEDS)
                out.append({"notice": notice, "lost": lost, "save": save, "trace": t.name, "res": res})
            log(f"  cell notice {_cell_name(notice, lost)}, save {save:g} s: {time.time() - t0:.0f} s")
    return out


def cell_summary(rows: list[dict]) -> list[dict]:
    """Per cell: each policy's mean overhead ratio to hindsight over the traces, orbit's worst."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["notice"], r["lost"], r["save"]), []).append(r)
    out = []
    for (notice, lost, save), rs in cells.items():
        ratios = {p: [] for p in BASELINES + ("orbit",)}
        near = []
        for r in rs:
            by = _by(r["res"]["results"])
            h = by["hindsight"]["overhead_gpu_hours"]
            for p in ratios:
                ratios[p].append(_ratio(by[p]["overhead_gpu_hours"], h))
            near.append(_ratio(by["orbit"]["overhead_gpu_hours"], by["hindsight"]["neighbours_overhead_gpu_hours"]))
        mean = {p: statistics.fmean(v) for p, v in ratios.items()}
        out.append({"notice": notice, "lost": lost, "save": save, "traces": len(rs), "mean": mean,
                    "orbit_vs_neighbours_max": max(near),
                    "orbit_max": max(ratios["orbit"]), "orbit_min": min(ratios["orbit"]),
                    "within_goal": all(x <= GOAL_RATIO + 1e-9 for x in ratios["orbit"]),
                    "beats_baselines": all(mean["orbit"] < mean[p] for p in BASELINES)})
    return out


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def summary_table(cells: list[dict]) -> list[str]:
    head = " / ".join(BASELINES)
    out = [f"| notice | save s | orbit / hindsight (min-max) | <= {GOAL_RATIO} on every trace "
           f"| orbit / hindsight's grid neighbours (max) | mean ratio to hindsight: {head} | orbit "
           "| orbit lowest on the mean |",
           "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        means = " / ".join(_f(c["mean"][p], 2) for p in BASELINES)
        out.append(f"| {_cell_name(c['notice'], c['lost'])} | {c['save']:g} | {_f(c['orbit_min'])}-{_f(c['orbit_max'])} "
                   f"| {'yes' if c['within_goal'] else '**no**'} | {_f(c['orbit_vs_neighbours_max'])} | {means} "
                   f"| **{_f(c['mean']['orbit'], 2)}** | {'yes' if c['beats_baselines'] else '**no**'} |")
    return out


def detail_table(rows: list[dict]) -> list[str]:
    out = ["| trace | notice | save s | hindsight overhead GPU-h (interval) | orbit GPU-h | orbit / hindsight "
           "| notice-only | fixed-30m | young-daly | young-daly-true | orbit $ | hindsight $ | orbit goodput | unfinished (orbit) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = _by(r["res"]["results"])
        h, o = by["hindsight"], by["orbit"]
        iv = h.get("interval_s")
        ivs = "never" if iv is None else f"{iv:.0f} s"
        base = " | ".join(_f(by[p]["overhead_gpu_hours"]) for p in BASELINES)
        out.append(f"| {r['trace']} | {_cell_name(r['notice'], r['lost'])} | {r['save']:g} "
                   f"| {_f(h['overhead_gpu_hours'])} ({ivs}) | {_f(o['overhead_gpu_hours'])} "
                   f"| {_f(_ratio(o['overhead_gpu_hours'], h['overhead_gpu_hours']))} | {base} "
                   f"| {_f(o['overhead_usd'], 2)} | {_f(h['overhead_usd'], 2)} | {_f(o['goodput'])} "
                   f"| {o['jobs'] - o['finished']} |")
    return out


def deadline_runs(traces, model, starts: int, log) -> list[dict]:
    t0 = time.time()
    out = [simulate_trace(t, job_hours=JOB_HOURS, deadline_hours=d, starts=starts, model=model)
           for t in traces for d in DEADLINES]
    log(f"  deadlines: {time.time() - t0:.0f} s")
    return out


def deadline_table(results: list[dict]) -> list[str]:
    out = ["| trace | notice s | deadline h | greedy $ | uniform-progress $ | orbit $ | optimal $ | orbit vs optimal "
           "| missed (any policy) | orbit <= UP | orbit <= greedy |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        r = _by(res["results"])
        misses = sum(x["missed_feasible_deadlines"] for x in r.values())
        o = r["orbit"]["cost_usd"]
        out.append(f"| {res['trace']} | {res['notice_seconds']:g} | {res['deadline_hours']:g} "
                   f"| {r['greedy']['cost_usd']:.2f} | {r['uniform-progress']['cost_usd']:.2f} | {o:.2f} "
                   f"| {r['optimal']['cost_usd']:.2f} | +{r['orbit']['gap_to_optimal_pct']:.1f}% | {misses} "
                   f"| {'yes' if o <= r['uniform-progress']['cost_usd'] + 1e-9 else '**no**'} "
                   f"| {'yes' if o <= r['greedy']['cost_usd'] + 1e-9 else 'no'} |")
    return out


def run(data_dir: Path, starts: int, quick: bool, log=print) -> tuple[str, dict]:
    traces = load_traces(data_dir)
    model = load_reclaim_model()
    _, evaluation = split_traces(traces)
    leaked = sorted({t.name for t in evaluation} & set(model.fitted_from))
    if leaked:
        raise SystemExit(f"error: the shipped model was fitted on evaluation traces {leaked}; refit it with "
                         "python -m orbit_dagster.catalog.fit_reclaims SHARED_DATA_DIR")
    if not evaluation:
        raise SystemExit(f"error: no evaluation trace under {data_dir} (only the training split)")
    t0 = time.time()
    log(f"{len(evaluation)} evaluation traces, {starts} jobs each")
    grid = checkpoint_grid(evaluation, model, starts, log)
    cells = cell_summary(grid)
    dl = deadline_runs(evaluation, model, starts, log)
    seconds = time.time() - t0
    grid_mean = {p: statistics.fmean(c["mean"][p] for c in cells) for p in BASELINES + ("orbit",)}
    dl_rows = [_by(r["results"]) for r in dl]
    # The section's command: a --quick run is never recorded, a full one only with --record.
    cmd = "python bench/policies.py" + (" --quick" if quick else (
        ("" if starts == 8 else f" --starts {starts}") + " --record docs/benchmarks.md"))
    lines = [
        f"Command: `{cmd}` (run {dt.date.today().isoformat()}, {seconds:.0f} s on 2 cores shared with other work). "
        f"Leave-out split `{SPLIT_NAME}`: the shipped reclaim model is fitted on {len(model.fitted_from)} training "
        f"traces ({', '.join(TRAINING_TRACES)}); every figure below is measured on the {len(evaluation)} other traces "
        f"({', '.join(t.name for t in evaluation)}). Each figure is a mean per job over {starts} jobs of "
        f"{JOB_HOURS:g} h of work started at evenly spaced points of the trace (replayed cyclically); restore "
        f"{RESTORE_S:g} s. N-node traces need all N instances; each trace is priced at its own instance type. "
        "Definitions: docs/policies.md.", "",
        "### Checkpoint interval: total overhead against the hindsight-best fixed interval", "",
        "Total overhead = wasted + checkpoint + restart GPU-hours per job. Ratios are each policy's overhead divided "
        "by hindsight's on the same trace and cell, then averaged over the traces. Hindsight picks the best of 49 "
        "fixed intervals on the realised trace, so part of its edge is the luck of that choice: the column "
        "\"grid neighbours\" divides orbit's overhead by the mean overhead of the two intervals beside hindsight's "
        "choice (13% shorter and longer).", "",
        *summary_table(cells), "",
        "Mean over the whole grid of the ratio to hindsight: " + ", ".join(
            f"{p} {grid_mean[p]:.3f}" for p in BASELINES + ("orbit",)) + ".", "",
        "Per trace (overhead GPU-hours per job; $ = overhead dollars per job):", "", *detail_table(grid), "",
        "### Deadlines (24 h of work; each cloud's notice; save 60 s)", "", *deadline_table(dl), "",
        f"Missed feasible deadlines, all policies: {sum(x['missed_feasible_deadlines'] for r in dl_rows for x in r.values())}; "
        f"orbit <= uniform-progress in {sum(r['orbit']['cost_usd'] <= r['uniform-progress']['cost_usd'] + 1e-9 for r in dl_rows)}"
        f" of {len(dl_rows)} cells; orbit <= greedy in "
        f"{sum(r['orbit']['cost_usd'] <= r['greedy']['cost_usd'] + 1e-9 for r in dl_rows)} of {len(dl_rows)}.",
    ]
    raw = {"split": SPLIT_NAME, "training": list(TRAINING_TRACES), "evaluation": [t.name for t in evaluation],
           "starts": starts, "seconds": round(seconds, 1), "cells": cells, "grid_mean": grid_mean,
           "checkpoint": [{k: v for k, v in r.items()} for r in grid], "deadline": dl}
    return "\n".join(lines), raw


def write_section(doc: Path, body: str) -> None:
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n## Policies (bench/policies.py)\n\n{body}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data_dir", nargs="?", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--starts", type=int, default=None, help="jobs per trace, evenly spaced (default 8; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="3 jobs per trace; prints only (never recorded)")
    ap.add_argument("--record", type=Path, default=None,
                    help="markdown file whose policies section is rewritten (docs/benchmarks.md); without it, print only")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure as JSON here")
    args = ap.parse_args(argv)
    if not (args.data_dir / "traces").is_dir():
        print(f"error: no traces/ under {args.data_dir}; pass the shared data directory", file=sys.stderr)
        return 2
    starts = args.starts or (3 if args.quick else 8)
    body, raw = run(args.data_dir, starts, args.quick, log=lambda s: print(s, file=sys.stderr))
    print(body)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1, default=str))
    if args.record and args.quick:
        print("policies: --record is for a full run; a --quick run only prints", file=sys.stderr)
    elif args.record:
        write_section(args.record, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
