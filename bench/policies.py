"""Checkpoint and deadline policies side by side on the held-out traces; `--record` rewrites their section.

    python bench/policies.py [SHARED_DATA_DIR] [--quick | --smoke] [--starts N] [--record docs/benchmarks.md] [--json FILE]

SHARED_DATA_DIR defaults to ../shared/data beside the repository. The split is by collection
(``catalog.fit_reclaims``: a trace's source and start date): the reclaim model is fitted here
on the training collections only and must be the shipped file (what production decides
with; the script refuses to run otherwise, or if the shipped model lists a held-out trace),
and only the **held-out** traces are replayed. Nothing is tuned on them.

1. Checkpointing, a grid: notice 120 s / 30 s / 0 s / 120 s with 5% of notices lost x save
   10 s / 60 s / 300 s (restore 300 s). Per policy: total overhead = wasted + checkpoint +
   restart (GPU-hours and $), goodput, unfinished jobs. Every policy gets the same notice
   handling (emergency checkpoint when it fits, release at the notice); ``hindsight`` is the
   best fixed interval for each trace and cell, chosen knowing the trace (and which notices
   are lost); ``young-daly-true`` is told the trace's true MTBF.
2. Deadlines: 24 h of work with 30 / 36 / 48 h deadlines, each cloud's own notice, save 60 s.

The report gives the held-out figures per cloud and node count, names the worst cell, lists
every cell where orbit loses (above 1.05 x hindsight, or above a non-hindsight baseline) and
says which of issue 19's goals are met. ``--quick``: 3 jobs per trace; ``--smoke``: 1 job per
trace on a reduced grid (notice 120 / 30 s x save 60 / 300 s, one deadline); neither is
recorded. All ratios are computed from figures measured in this one run.
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

from orbit_dagster.catalog.fit_reclaims import (  # noqa: E402
    SPLIT_NAME,
    advisor_rows,
    collection,
    describe_split,
    fit_from_traces,
    split_traces,
)
from orbit_dagster.catalog.reclaim_model import load_reclaim_model  # noqa: E402
from orbit_dagster.catalog.trace_market import CLOUD_NOTICE_S  # noqa: E402
from orbit_dagster.catalog.traces import load_traces  # noqa: E402
from orbit_dagster.policy.compare import simulate_trace  # noqa: E402

BEGIN, END = "<!-- policies:begin -->", "<!-- policies:end -->"
JOB_HOURS = 24.0
NOTICES = ((120.0, 0.0), (30.0, 0.0), (0.0, 0.0), (120.0, 0.05))  # (notice s, share of notices lost)
SAVES = (10.0, 60.0, 300.0)
RESTORE_S = 300.0
DEADLINES = (30.0, 36.0, 48.0)
SMOKE = {"notices": ((120.0, 0.0), (30.0, 0.0)), "saves": (60.0, 300.0), "deadlines": (36.0,)}
BASELINES = ("notice-only", "fixed-30m", "young-daly", "young-daly-true")
GOAL_RATIO, GOAL_SHARE, GOAL_MAX = 1.05, 0.90, 1.15  # issue 19's goals for the interval
LOST_SEEDS = 4  # draws of which notices are lost, per start, in the "5% lost" cells


def _by(rows: list[dict]) -> dict[str, dict]:
    return {r["policy"]: r for r in rows}


def _ratio(a: float, b: float) -> float:
    """a / b for overheads; both are > 0 whenever a job restores at least once."""
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def _cell_name(notice: float, lost: float) -> str:
    return f"{notice:g} s" + (f", {lost:.0%} lost" if lost else "")


def _group(res: dict) -> tuple[str, int]:
    """Where a result's trace was measured: its cloud and the instances a job holds there."""
    mk = res["market"]
    return mk.get("cloud") or "cloud unknown", int(mk.get("nodes") or 1)


def _group_name(g: tuple[str, int]) -> str:
    return f"{g[0].upper()}, {g[1]} node{'s' if g[1] > 1 else ''}"


def checkpoint_grid(traces, model, starts: int, log, notices=NOTICES, saves=SAVES) -> list[dict]:
    out = []
    for notice, lost in notices:
        for save in saves:
            t0 = time.time()
            for t in traces:
                res = simulate_trace(t, job_hours=JOB_HOURS, notice_seconds=notice, save_seconds=save,
                                     restore_seconds=RESTORE_S, starts=starts, model=model, notice_miss_rate=lost,
                                     seeds=LOST_SEEDS)
                out.append({"notice": notice, "lost": lost, "save": save, "trace": t.name, "group": _group(res),
                            "res": res})
            log(f"  cell notice {_cell_name(notice, lost)}, save {save:g} s: {time.time() - t0:.0f} s")
    return out


def trace_ratios(r: dict) -> dict[str, float]:
    """Each policy's overhead over hindsight's on one trace and cell (and orbit over hindsight's grid neighbours)."""
    by = _by(r["res"]["results"])
    h = by["hindsight"]["overhead_gpu_hours"]
    out = {p: _ratio(by[p]["overhead_gpu_hours"], h) for p in BASELINES + ("orbit",)}
    out["neighbours"] = _ratio(by["orbit"]["overhead_gpu_hours"], by["hindsight"]["neighbours_overhead_gpu_hours"])
    return out


def cell_summary(rows: list[dict], by_group: bool = False) -> list[dict]:
    """Per cell (and per cloud and node count with ``by_group``): each policy's mean overhead
    ratio to hindsight over the cell's traces, orbit's best and worst trace."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault(((r["group"],) if by_group else ()) + (r["notice"], r["lost"], r["save"]), []).append(r)
    out = []
    for key, rs in cells.items():
        ratios = [trace_ratios(r) for r in rs]
        mean = {p: statistics.fmean(x[p] for x in ratios) for p in BASELINES + ("orbit",)}
        worst = max(zip(rs, ratios), key=lambda rx: rx[1]["orbit"])
        out.append({"group": key[0] if by_group else None, "notice": key[-3], "lost": key[-2], "save": key[-1],
                    "traces": len(rs), "mean": mean, "orbit_vs_neighbours_max": max(x["neighbours"] for x in ratios),
                    "orbit_max": worst[1]["orbit"], "orbit_min": min(x["orbit"] for x in ratios),
                    "worst_trace": worst[0]["trace"],
                    "within_goal": all(x["orbit"] <= GOAL_RATIO + 1e-9 for x in ratios),
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


def group_table(grid: list[dict], cells: list[dict]) -> list[str]:
    """The held-out figures per cloud and node count: one row each."""
    out = ["| cloud, nodes | held-out traces | cells | orbit / hindsight, mean of cells | worst cell (orbit / hindsight) "
           f"| cells <= {GOAL_RATIO} on every trace | orbit lowest of the non-hindsight policies |",
           "|---|---|---|---|---|---|---|"]
    for g in sorted({c["group"] for c in cells}):
        cs = [c for c in cells if c["group"] == g]
        worst = max(cs, key=lambda c: c["mean"]["orbit"])
        traces = sorted({r["trace"] for r in grid if r["group"] == g})
        out.append(f"| {_group_name(g)} | {len(traces)} ({', '.join(traces)}) | {len(cs)} "
                   f"| {statistics.fmean(c['mean']['orbit'] for c in cs):.3f} "
                   f"| notice {_cell_name(worst['notice'], worst['lost'])}, save {worst['save']:g} s "
                   f"({worst['mean']['orbit']:.3f}) | {sum(c['within_goal'] for c in cs)} of {len(cs)} "
                   f"| {sum(c['beats_baselines'] for c in cs)} of {len(cs)} |")
    return out


def unmeasured(cells: list[dict]) -> list[str]:
    """The clouds the trace market knows that no held-out trace here comes from, said so."""
    missing = sorted(set(CLOUD_NOTICE_S) - {c["group"][0] for c in cells})
    return [f"No held-out trace of {', '.join(c.upper() for c in missing)} here: no figure above is "
            f"measured on {'that cloud' if len(missing) == 1 else 'those clouds'}.", ""] if missing else []


def worst_cell(grid: list[dict]) -> str:
    """The one trace and cell where orbit is furthest above hindsight, with what it cost."""
    r = max(grid, key=lambda r: trace_ratios(r)["orbit"])
    by = _by(r["res"]["results"])
    iv = by["hindsight"].get("interval_s")
    return (f"Worst cell: {r['trace']} ({_group_name(r['group'])}), notice {_cell_name(r['notice'], r['lost'])}, "
            f"save {r['save']:g} s: orbit {by['orbit']['overhead_gpu_hours']:.3f} GPU-h of overhead per job against "
            f"hindsight's {by['hindsight']['overhead_gpu_hours']:.3f} (interval "
            f"{'never' if iv is None else f'{iv:.0f} s'}), {trace_ratios(r)['orbit']:.3f} x.")


def losses(cells: list[dict]) -> list[str]:
    """Every cell (per cloud and node count) where orbit loses, said plainly."""
    out = []
    for c in cells:
        lower = [p for p in BASELINES if c["mean"][p] < c["mean"]["orbit"]]
        if c["mean"]["orbit"] <= GOAL_RATIO and not lower:
            continue
        why = []
        if c["mean"]["orbit"] > GOAL_RATIO:
            why.append(f"{c['mean']['orbit']:.3f} x hindsight (above {GOAL_RATIO})")
        if lower:
            why.append("above " + ", ".join(f"{p} ({c['mean'][p]:.3f})" for p in lower)
                       + f" against orbit's {c['mean']['orbit']:.3f}")
        out.append(f"- {_group_name(c['group'])}, notice {_cell_name(c['notice'], c['lost'])}, save {c['save']:g} s: "
                   + "; ".join(why) + ".")
    return out or ["- none: in every cell orbit is within 1.05 x hindsight and below every other policy."]


def goals(grid: list[dict], cells: list[dict], dl_rows: list[dict]) -> list[str]:
    """Issue 19's goals, each met or missed with the measured figure."""
    ratios = [trace_ratios(r)["orbit"] for r in grid]
    share = sum(x <= GOAL_RATIO + 1e-9 for x in ratios) / len(ratios)
    lowest = sum(c["beats_baselines"] for c in cells)
    misses = sum(x["missed_feasible_deadlines"] for r in dl_rows for x in r.values())
    up = sum(r["orbit"]["cost_usd"] <= r["uniform-progress"]["cost_usd"] + 1e-9 for r in dl_rows)
    gap = statistics.fmean(r["orbit"]["gap_to_optimal_pct"] for r in dl_rows) if dl_rows else 0.0

    def mark(ok: bool) -> str:
        return "met" if ok else "**missed**"

    return [
        f"- orbit <= {GOAL_RATIO} x hindsight in >= {GOAL_SHARE:.0%} of (trace, cell) pairs: "
        f"{mark(share >= GOAL_SHARE)} ({share:.0%} of {len(ratios)}).",
        f"- orbit <= {GOAL_MAX} x hindsight in every pair: {mark(max(ratios) <= GOAL_MAX + 1e-9)} "
        f"(worst {max(ratios):.3f}).",
        f"- orbit lowest of the non-hindsight policies on the mean of every cell: {mark(lowest == len(cells))} "
        f"({lowest} of {len(cells)} cells per cloud and node count).",
        f"- deadlines: no missed feasible deadline {mark(misses == 0)} ({misses}); orbit <= uniform-progress in "
        f"every cell {mark(up == len(dl_rows))} ({up} of {len(dl_rows)}); mean <= 5% over the optimum "
        f"{mark(gap <= 5.0)} ({gap:.1f}%).",
    ]


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


def deadline_runs(traces, model, starts: int, log, deadlines=DEADLINES) -> list[dict]:
    t0 = time.time()
    out = [simulate_trace(t, job_hours=JOB_HOURS, deadline_hours=d, starts=starts, model=model)
           for t in traces for d in deadlines]
    log(f"  deadlines: {time.time() - t0:.0f} s")
    return out


def deadline_table(results: list[dict]) -> list[str]:
    out = ["| trace | cloud, nodes | notice s | deadline h | greedy $ | uniform-progress $ | orbit $ | optimal $ "
           "| orbit vs optimal | missed (any policy) | orbit <= UP | orbit <= greedy |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        r = _by(res["results"])
        misses = sum(x["missed_feasible_deadlines"] for x in r.values())
        o = r["orbit"]["cost_usd"]
        out.append(f"| {res['trace']} | {_group_name(_group(res))} | {res['notice_seconds']:g} | {res['deadline_hours']:g} "
                   f"| {r['greedy']['cost_usd']:.2f} | {r['uniform-progress']['cost_usd']:.2f} | {o:.2f} "
                   f"| {r['optimal']['cost_usd']:.2f} | +{r['orbit']['gap_to_optimal_pct']:.1f}% | {misses} "
                   f"| {'yes' if o <= r['uniform-progress']['cost_usd'] + 1e-9 else '**no**'} "
                   f"| {'yes' if o <= r['greedy']['cost_usd'] + 1e-9 else 'no'} |")
    return out


def deadline_groups(results: list[dict]) -> list[str]:
    """Deadlines per cloud and node count: misses, orbit against uniform-progress and the optimum."""
    out = ["| cloud, nodes | cells | missed feasible deadlines | orbit <= uniform-progress | orbit vs optimal: mean (worst) |",
           "|---|---|---|---|---|"]
    for g in sorted({_group(r) for r in results}):
        rs = [_by(r["results"]) for r in results if _group(r) == g]
        gaps = [r["orbit"]["gap_to_optimal_pct"] for r in rs]
        up = sum(r["orbit"]["cost_usd"] <= r["uniform-progress"]["cost_usd"] + 1e-9 for r in rs)
        out.append(f"| {_group_name(g)} | {len(rs)} | {sum(x['missed_feasible_deadlines'] for r in rs for x in r.values())} "
                   f"| {up} of {len(rs)} | +{statistics.fmean(gaps):.1f}% (+{max(gaps):.1f}%) |")
    return out


def checked_model(data_dir: Path, train: list, held_out: list):
    """The model production decides with, once it is shown to be the training split's fit only."""
    model = load_reclaim_model()
    leaked = sorted({t.name for t in held_out} & set(model.fitted_from))
    if leaked:
        raise SystemExit(f"error: the shipped model was fitted on evaluation traces {leaked}; refit it with "
                         "python -m orbit_dagster.catalog.fit_reclaims SHARED_DATA_DIR")
    if not train or fit_from_traces(train, advisor_rows(data_dir)).to_json() != model.to_json():
        raise SystemExit("error: the shipped reclaim model is not the fit of this data set's training split "
                         f"({describe_split()}); refit it with python -m orbit_dagster.catalog.fit_reclaims "
                         "SHARED_DATA_DIR")
    return model


def run(data_dir: Path, starts: int, quick: bool, log=print, smoke: bool = False) -> tuple[str, dict]:
    traces = load_traces(data_dir)
    train, evaluation = split_traces(traces)
    model = checked_model(data_dir, train, evaluation)
    if not evaluation:
        raise SystemExit(f"error: no held-out trace under {data_dir} (only the training split)")
    grid_kw = {"notices": SMOKE["notices"], "saves": SMOKE["saves"]} if smoke else {}
    t0 = time.time()
    log(f"{len(evaluation)} held-out traces, {starts} jobs each" + (" (smoke grid)" if smoke else ""))
    grid = checkpoint_grid(evaluation, model, starts, log, **grid_kw)
    cells, by_group = cell_summary(grid), cell_summary(grid, by_group=True)
    dl = deadline_runs(evaluation, model, starts, log, **({"deadlines": SMOKE["deadlines"]} if smoke else {}))
    seconds = time.time() - t0
    grid_mean = {p: statistics.fmean(c["mean"][p] for c in cells) for p in BASELINES + ("orbit",)}
    dl_rows = [_by(r["results"]) for r in dl]
    held = sorted({collection(t) for t in evaluation}, key=lambda c: (c[0], str(c[1])))
    # The section's command: a --quick or --smoke run is never recorded, a full one only with --record.
    cmd = "python bench/policies.py" + (" --smoke" if smoke else " --quick" if quick else (
        ("" if starts == 8 else f" --starts {starts}") + " --record docs/benchmarks.md"))
    lines = [
        f"Command: `{cmd}` (run {dt.date.today().isoformat()}, {seconds:.0f} s on 2 cores shared with other work). "
        f"Split `{SPLIT_NAME}` (by trace source and start date, `catalog.fit_reclaims`): the reclaim model is fitted "
        f"on the training collection{'s' if len(train) > 1 else ''} only ({describe_split()}: {len(train)} traces, "
        f"{', '.join(t.name for t in train)}), and the shipped model is that fit (checked on every run); every figure "
        f"below is measured on the {len(evaluation)} held-out traces of "
        f"{', '.join(f'{src} {day}' for src, day in held)} ({', '.join(t.name for t in evaluation)}). Nothing was "
        f"tuned on them. Each figure is a mean per job over {starts} jobs of {JOB_HOURS:g} h of work started at "
        f"evenly spaced points of the trace (replayed cyclically); restore {RESTORE_S:g} s. N-node traces need all N "
        "instances; each trace is priced at its own instance type. Definitions: docs/policies.md.", "",
        "### Held out, per cloud and node count", "",
        *group_table(grid, by_group), "", *unmeasured(by_group), worst_cell(grid), "",
        "Where orbit loses (per cloud and node count, mean over the cell's traces):", "", *losses(by_group), "",
        "Issue 19's goals, on these held-out traces:", "", *goals(grid, by_group, dl_rows), "",
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
        "### Deadlines (24 h of work; each cloud's notice; save 60 s)", "", *deadline_groups(dl), "",
        *deadline_table(dl), "",
        f"Missed feasible deadlines, all policies: {sum(x['missed_feasible_deadlines'] for r in dl_rows for x in r.values())}; "
        f"orbit <= uniform-progress in {sum(r['orbit']['cost_usd'] <= r['uniform-progress']['cost_usd'] + 1e-9 for r in dl_rows)}"
        f" of {len(dl_rows)} cells; orbit <= greedy in "
        f"{sum(r['orbit']['cost_usd'] <= r['greedy']['cost_usd'] + 1e-9 for r in dl_rows)} of {len(dl_rows)}.",
    ]
    raw = {"split": SPLIT_NAME, "training": [t.name for t in train], "evaluation": [t.name for t in evaluation],
           "starts": starts, "smoke": smoke, "seconds": round(seconds, 1), "cells": cells, "by_group": by_group,
           "grid_mean": grid_mean, "checkpoint": [{k: v for k, v in r.items()} for r in grid], "deadline": dl}
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
    ap.add_argument("--smoke", action="store_true", help="1 job per trace, a reduced grid; prints only (never recorded)")
    ap.add_argument("--record", type=Path, default=None,
                    help="markdown file whose policies section is rewritten (docs/benchmarks.md); without it, print only")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure as JSON here")
    args = ap.parse_args(argv)
    if not (args.data_dir / "traces").is_dir():
        print(f"error: no traces/ under {args.data_dir}; pass the shared data directory", file=sys.stderr)
        return 2
    starts = args.starts or (1 if args.smoke else 3 if args.quick else 8)
    body, raw = run(args.data_dir, starts, args.quick, log=lambda s: print(s, file=sys.stderr), smoke=args.smoke)
    print(body)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1, default=str))
    if args.record and (args.quick or args.smoke):
        print("policies: --record is for a full run; a --quick or --smoke run only prints", file=sys.stderr)
    elif args.record:
        write_section(args.record, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
