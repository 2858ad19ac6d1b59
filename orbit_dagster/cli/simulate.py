"""`orbit simulate`: load a spot trace, compare the policies on it (`policy.compare`), print the figures."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..catalog.traces import load_trace
from ..core.errors import OrbitError
from ..policy.compare import DEFAULTS, simulate_group, simulate_offers, simulate_trace


def simulate_command(trace_path: str | Path | tuple, policy: str | None = None, job_hours: float | None = None,
                     deadline_hours: float | None = None, notice_seconds: float | None = None, *, group: bool = False,
                     min_nodes: int | None = None, **kw: Any) -> dict:
    """What ``orbit simulate`` runs: load the trace, replay it, return the figures. Several
    traces are several offers of one job (``simulate_offers``: the orbit policy and dispatch's
    and the price sensor's placement rules, no deadline). ``group`` (or ``min_nodes``, the
    elastic floor): an N-node trace's partial reclaims decided by the group policy
    (``simulate_group``)."""
    paths = [trace_path] if isinstance(trace_path, (str, Path)) else list(trace_path)
    if group or min_nodes is not None:
        if len(paths) > 1 or deadline_hours is not None or policy not in (None, "", "all", "orbit"):
            raise OrbitError("--group replays one N-node trace with the orbit policy, no deadline", field="group",
                             value=True, fix="pass one --trace, without --deadline-hours or another --policy")
        kw.pop("seeds", None)
        return simulate_group(load_trace(paths[0]), min_nodes=min_nodes, job_hours=DEFAULTS["job_hours"]
                              if job_hours is None else job_hours, notice_seconds=notice_seconds, **kw)
    if len(paths) > 1:
        if deadline_hours is not None:
            raise OrbitError("--deadline-hours replays one trace", field="deadline_hours", value=deadline_hours,
                             fix="pass one --trace with --deadline-hours, or drop it to replay the offers")
        if policy not in (None, "", "all", "orbit"):
            raise OrbitError(f"several traces replay the orbit policy only, not {policy!r}", field="policy",
                             value=policy, fix="drop --policy, or pass one --trace")
        kw.pop("seeds", None)
        return simulate_offers([load_trace(p) for p in paths], job_hours=DEFAULTS["job_hours"] if job_hours is None
                               else job_hours, notice_seconds=notice_seconds, **kw)
    trace = load_trace(paths[0])
    return simulate_trace(trace, policy=policy, job_hours=DEFAULTS["job_hours"] if job_hours is None else job_hours,
                          deadline_hours=deadline_hours, notice_seconds=notice_seconds, **kw)


_COLUMNS = {
    "checkpoint": [("policy", "policy"), ("finished", "done"), ("overhead_gpu_hours", "overhead GPU-h"),
                   ("overhead_usd", "overhead $"), ("wasted_gpu_hours", "wasted GPU-h"),
                   ("checkpoint_overhead_gpu_hours", "ckpt GPU-h"), ("restart_overhead_gpu_hours", "restart GPU-h"),
                   ("goodput", "goodput"), ("cost_usd", "cost $"), ("wall_hours", "wall h"), ("reclaims", "reclaims")],
    "offers": [("policy", "policy"), ("finished", "done"), ("overhead_gpu_hours", "overhead GPU-h"),
               ("overhead_usd", "overhead $"), ("cost_usd", "cost $"), ("reclaims", "reclaims"), ("moves", "moves"),
               ("avoided_dispatches", "avoided"), ("wall_hours", "wall h")],
    "group": [("policy", "policy"), ("finished", "done"), ("overhead_gpu_hours", "overhead GPU-h"),
              ("overhead_usd", "overhead $"), ("wasted_gpu_hours", "wasted GPU-h"), ("cost_usd", "cost $"),
              ("wall_hours", "wall h"), ("reclaims", "reclaims")],
    "deadline": [("policy", "policy"), ("missed_deadlines", "missed"), ("goodput", "goodput"),
                 ("cost_usd", "cost $"), ("wasted_gpu_hours", "wasted GPU-h"), ("spot_hours", "spot h"),
                 ("on_demand_hours", "on-demand h"), ("gap_to_optimal_pct", "vs optimal %"),
                 ("savings_vs_on_demand_pct", "saved vs OD %")],
}


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_result_table(results: dict) -> str:
    """A plain-text table of one ``simulate_trace`` or ``simulate_offers`` result (means per job)."""
    if results["mode"] == "offers":
        return _offers_table(results)
    if results["mode"] == "group":
        return _group_table(results)
    cols = _COLUMNS[results["mode"]]
    head = (f"{results['trace']} ({results['kind']}, {results['gap_seconds']:g} s ticks): "
            f"{results['jobs'] if 'jobs' in results else results['starts']} jobs of {results['job_hours']:g} h"
            + (f", deadline {results['deadline_hours']:g} h" if results["deadline_hours"] is not None else "")
            + f", notice {results['notice_seconds']:g} s; means per job")
    mk = results.get("market") or {}
    spot = mk.get("spot_usd_per_hour_per_node")
    lines = [head, (f"market: {mk.get('instance_type') or 'unknown type'} x {mk.get('nodes', 1)} node(s)"
                    f" ({mk.get('cloud') or 'cloud unknown'} {mk.get('zone') or ''}); spot "
                    + (spot if isinstance(spot, str) else f"{spot:g} $/h") + " per node; on-demand "
                    f"{mk.get('on_demand_usd_per_hour_per_node', 0):g} $/h per node; "
                    f"notice: {results['assumptions']['notice']}")] + _rows(cols, results)
    for r in results["results"]:
        if r.get("interval_s") is not None or (r["policy"] == "hindsight" and "interval_s" in r):
            iv = r.get("interval_s")
            lines.append(f"hindsight's interval: {'never' if iv is None else f'{iv:.0f} s'}")
    return "\n".join(lines)


def _rows(cols: list, results: dict) -> list[str]:
    rows = [[label for _, label in cols]] + [[_cell(r.get(k)) for k, _ in cols] for r in results["results"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _offers_table(results: dict) -> str:
    head = (f"{len(results['traces'])} offers, {results['starts']} jobs of {results['job_hours']:g} h; "
            f"notice: {results['assumptions']['notice']}; means per job")
    offers = [f"  {o['offer']}: {o.get('instance_type') or 'unknown type'} x {o.get('nodes', 1)} "
              f"({o.get('cloud')} {o.get('zone') or ''}), notice {o['notice_seconds']:g} s" for o in results["offers"]]
    return "\n".join([head, *offers, *_rows(_COLUMNS["offers"], results)])


def _group_table(results: dict) -> str:
    mk = results["market"]
    floor = results["min_nodes"]
    head = (f"{results['trace']}: a group of {mk.get('nodes')} node(s), "
            + (f"elastic down to {floor}" if floor is not None else "not elastic")
            + f"; {results['starts']} jobs of {results['job_hours']:g} h, notice {results['notice_seconds']:g} s; "
            "means per job")
    decisions = [f"  job {d['job']} at {d['at_s']:.0f} s: {d['size']} -> lost {d['lost']}: {d['mode']}"
                 + (f" (planned {d['planned']})" if d["planned"] != d["mode"] else "")
                 + f", next {d['next_size']} node(s); {d['reason']}" for d in results["decisions"]]
    return "\n".join([head, *_rows(_COLUMNS["group"], results), "decisions:", *(decisions or ["  none"])])
