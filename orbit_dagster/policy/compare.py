"""Compare the policies on a trace: overhead, goodput, cost and missed deadlines, as data.

``orbit simulate`` (``cli/simulate.py``, which loads the trace and prints the table), the
benchmark and the tests call ``simulate_trace``. Every figure is a mean per job over ``starts`` jobs started at evenly
spaced points of the trace (replayed cyclically), so a single lucky or unlucky phase does
not decide a comparison. The replay is faithful to the trace (``catalog.trace_market``):
an N-node trace needs N instances, prices are the trace's instance type's, and the notice
is the trace's cloud's unless ``notice_seconds`` says otherwise. The cloud is the trace's
``metadata.cloud`` or the caller's ``cloud``, never guessed from a file name.
``simulate_group`` replays an N-node trace as a group whose partial reclaims the group policy
decides (``policy.group_replay``).
"""
from __future__ import annotations

import math
from typing import Any

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model
from orbit_dagster.catalog.trace_market import TraceMarket, trace_market
from orbit_dagster.catalog.traces import Trace
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.checkpointing import CHECKPOINT_STRATEGIES, make_strategy
from orbit_dagster.policy.deadline import Greedy, UniformProgress, run_deadline, setup_from_trace
from orbit_dagster.policy.deadline_plan import OrbitDeadline, optimal
from orbit_dagster.policy.group_replay import replay_group
from orbit_dagster.policy.offers_replay import TraceOffer, replay_offers
from orbit_dagster.policy.simulate import JobParams, hindsight, replay, replay_jobs, start_offsets, trace_mtbf_s, warm_up

#: The checkpoint policies ``orbit simulate`` reports by default (``none`` -- no checkpoint,
#: no notice handling -- may still be asked for by name).
CHECKPOINT_POLICIES = ("notice-only", "fixed-30m", "young-daly", "young-daly-true", "hindsight", "orbit")
DEADLINE_POLICIES = ("greedy", "uniform-progress", "orbit", "optimal")
DEFAULTS = {"job_hours": 24.0, "save_seconds": 60.0, "restore_seconds": 300.0, "starts": 8}


def _policies(policy: str | None, deadline: bool) -> tuple[str, ...]:
    allowed = DEADLINE_POLICIES if deadline else CHECKPOINT_POLICIES
    known = DEADLINE_POLICIES if deadline else CHECKPOINT_POLICIES + ("none",)
    if policy in (None, "", "all"):
        return allowed
    if policy not in known:
        mode = "with --deadline-hours" if deadline else "without --deadline-hours"
        other = CHECKPOINT_STRATEGIES + ("hindsight",) if deadline else DEADLINE_POLICIES
        hint = f" ({policy!r} is a policy for the other mode)" if policy in other else ""
        raise OrbitError(f"unknown policy {policy!r} {mode}{hint}", field="policy", value=policy,
                         fix="use one of: " + ", ".join(known + ("all",)))
    return (policy,)


def _check_positive(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0
    if bad or (value == 0 and not allow_zero) or math.isinf(value):
        raise OrbitError(f"{name} must be {'>= 0' if allow_zero else '> 0'}", field=name, value=value,
                         fix=f"pass a finite number {'>= 0' if allow_zero else '> 0'}")


def simulate_trace(trace: Trace, *, policy: str | None = None, job_hours: float = 24.0,
                   deadline_hours: float | None = None, notice_seconds: float | None = None,
                   save_seconds: float = 60.0, restore_seconds: float = 300.0, starts: int = 8,
                   band: int | None = None, model: ReclaimModel | None = None, notice_miss_rate: float = 0.0,
                   seeds: int = 1, cloud: str | None = None) -> dict[str, Any]:
    """Replay ``trace`` and return a JSON-ready dict of per-policy figures.

    ``cloud`` (``aws``/``gcp``) overrides the trace's ``metadata.cloud``; a trace with neither is
    refused (``catalog.trace_market.trace_cloud``). ``notice_seconds`` None: that cloud's notice. ``band`` None: the spot-advisor band
    of the trace's instance type and region, else the riskiest band (4). With
    ``notice_miss_rate`` > 0, ``seeds`` draws of which notices are lost are replayed for
    every start (figures are means over all of them), so that a handful of unlucky
    reclaims does not decide the comparison.
    """
    for name, v in (("job_hours", job_hours), ("deadline_hours", deadline_hours), ("save_seconds", save_seconds)):
        _check_positive(name, v)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise OrbitError("seeds must be an integer >= 1", field="seeds", value=seeds, fix="pass 1 or more draws")
    _check_positive("notice_seconds", notice_seconds, allow_zero=True)
    _check_positive("restore_seconds", restore_seconds, allow_zero=True)
    if not (isinstance(notice_miss_rate, (int, float)) and 0 <= notice_miss_rate <= 1):
        raise OrbitError("notice_miss_rate must be in [0, 1]", field="notice_miss_rate", value=notice_miss_rate,
                         fix="pass the share of notices lost, e.g. 0.05")
    m = model or load_reclaim_model()
    market = trace_market(trace, default_spot_usd_per_hour=m.spot_usd_per_hour,
                          default_on_demand_usd_per_hour=m.on_demand_usd_per_hour, cloud=cloud)
    notice = market.notice_s if notice_seconds is None else float(notice_seconds)
    band = (market.band if market.band is not None else 4) if band is None else band
    names = _policies(policy, deadline_hours is not None)
    out: dict[str, Any] = {
        "trace": trace.name, "kind": trace.kind, "gap_seconds": trace.gap_seconds,
        "trace_hours": round(trace.duration_s / 3600, 3),
        "mode": "deadline" if deadline_hours is not None else "checkpoint",
        "job_hours": job_hours, "deadline_hours": deadline_hours, "notice_seconds": notice,
        "starts": starts, "notice_miss_rate": notice_miss_rate, "notice_seeds": seeds if notice_miss_rate > 0 else 1,
        "market": market.as_dict(),
        "assumptions": {"save_seconds": save_seconds, "emergency_save_seconds": save_seconds,
                        "restore_seconds": restore_seconds, "interruption_band": band,
                        "notice": "given" if notice_seconds is not None else market.sources["notice"]},
    }
    if deadline_hours is None:
        jobs = [JobParams(work_s=job_hours * 3600, save_s=save_seconds, restore_s=restore_seconds, notice_s=notice,
                          start_s=s, nodes=market.nodes, gpus_per_node=max(market.gpus_per_node, 1),
                          spot_usd_per_hour=market.spot_usd_per_hour, notice_miss_rate=notice_miss_rate, seed=seed)
                for seed in range(seeds if notice_miss_rate > 0 else 1) for s in start_offsets(trace, starts)]
        out["results"] = _checkpoint_results(trace, names, jobs, band, m, market)
    else:
        out["results"] = _deadline_results(trace, names, job_hours, deadline_hours, notice, save_seconds,
                                           restore_seconds, starts, band, m, market)
    return out


def _checkpoint_results(trace: Trace, names, jobs: list[JobParams], band: int, m: ReclaimModel,
                        market: TraceMarket) -> list[dict]:
    job = jobs[0]
    true_mtbf = trace_mtbf_s(trace, market.nodes)
    rows = []
    for name in names:
        extra: dict[str, Any] = {}
        if name == "hindsight":
            curve: dict[float, float] = {}
            tau, rs = hindsight(trace, jobs, uses_notice=True, curve=curve)
            extra["interval_s"] = None if math.isinf(tau) else tau
            taus = list(curve)
            i = taus.index(tau)
            near = [curve[taus[j]] for j in (i - 1, i + 1) if 0 <= j < len(taus)]
            # the mean of the two grid intervals beside the best (13% shorter and longer)
            extra["neighbours_overhead_gpu_hours"] = round(sum(near) / len(near) * market.gpus / 3600, 4)
        else:
            def make(name=name):
                return make_strategy(name, model=m, band=band, save_s=job.save_s, notice_s=job.notice_s,
                                     nodes=market.nodes, true_mtbf_s=true_mtbf if math.isfinite(true_mtbf) else 1e12)
            rs = replay_jobs(trace, make, jobs, warm=(name == "orbit"))
        rows.append({"policy": name, **summarise(rs, market.gpus), **extra})
    return rows


def summarise(rs: list, gpus: int) -> dict[str, Any]:
    """Means per job of a list of ``ReplayResult`` (GPU-hours = gang seconds x ``gpus``)."""
    n = len(rs)
    paid = sum(r.paid_s for r in rs)

    def gpu_h(attr: str) -> float:
        return round(sum(getattr(r, attr) for r in rs) * gpus / n / 3600, 4)

    return {
        "jobs": n, "finished": sum(r.finished for r in rs),
        "goodput": round(sum(r.useful_s for r in rs) / paid, 6) if paid else 0.0,
        "overhead_gpu_hours": gpu_h("overhead_s"),
        "overhead_usd": round(sum(r.overhead_usd for r in rs) / n, 4),
        "cost_usd": round(sum(r.cost_usd for r in rs) / n, 4),
        "missed_deadlines": None,
        "wasted_gpu_hours": gpu_h("wasted_s"),
        "checkpoint_overhead_gpu_hours": gpu_h("checkpoint_s"),
        "restart_overhead_gpu_hours": gpu_h("restart_s"),
        "paid_gpu_hours": gpu_h("paid_s"),
        "wall_hours": round(sum(r.wall_s for r in rs) / n / 3600, 3),
        "reclaims": round(sum(r.reclaims for r in rs) / n, 2),
        "emergency_checkpoints": round(sum(r.emergency_checkpoints for r in rs) / n, 2),
    }


def _deadline_results(trace, names, job_hours, deadline_hours, notice, save, restore, starts, band, m,
                      market: TraceMarket) -> list[dict]:
    n = len(trace.data)
    setups = [setup_from_trace(trace, start_tick=int(i * n / starts), work_s=job_hours * 3600,
                               deadline_s=deadline_hours * 3600, changeover_s=restore, notice_s=notice, save_s=save,
                               emergency_save_s=None, mtbf_s=3600.0 / (m.band_rate(band) * market.nodes),
                               spot_usd_per_hour=market.spot_usd_per_hour,
                               od_usd_per_hour=market.on_demand_usd_per_hour, nodes=market.nodes)
              for i in range(starts)]
    makers = {"greedy": Greedy, "uniform-progress": UniformProgress, "orbit": lambda: OrbitDeadline(m)}
    per: dict[str, list] = {}
    for name in dict.fromkeys(tuple(names) + ("optimal",)):
        per[name] = [optimal(s) if name == "optimal" else run_deadline(s, makers[name]()) for s in setups]
    best = sum(r.cost_usd for r in per["optimal"])
    od_only = sum(s.od_cost * (s.work_ticks + s.changeover_ticks) for s in setups)
    gpus = market.gpus
    rows = []
    for name in names:
        rs = per[name]
        gap = setups[0].gap_s
        paid = sum(r.spot_ticks + r.od_ticks for r in rs)
        useful = sum(s.work_ticks for s, r in zip(setups, rs) if r.finished)
        cost = sum(r.cost_usd for r in rs)
        rows.append({
            "policy": name, "jobs": len(rs), "feasible": sum(s.feasible for s in setups),
            "goodput": round(useful / paid, 6) if paid else 0.0,
            "cost_usd": round(cost / len(rs), 4),
            "missed_deadlines": sum(r.missed for r in rs),
            "missed_feasible_deadlines": sum(r.missed and s.feasible for s, r in zip(setups, rs)),
            "overhead_gpu_hours": round((paid - useful) * gap * gpus / 3600 / len(rs), 4),
            "wasted_gpu_hours": round((paid - useful) * gap * gpus / 3600 / len(rs), 4),
            "checkpoint_overhead_gpu_hours": None,
            "spot_hours": round(sum(r.spot_ticks for r in rs) * gap / 3600 / len(rs), 3),
            "on_demand_hours": round(sum(r.od_ticks for r in rs) * gap / 3600 / len(rs), 3),
            "gap_to_optimal_pct": round((cost / best - 1) * 100, 2) if best > 0 else None,
            "savings_vs_on_demand_pct": round((1 - cost / od_only) * 100, 2) if od_only > 0 else None,
        })
    return rows


def simulate_offers(traces: list[Trace], *, job_hours: float = 24.0, notice_seconds: float | None = None,
                    save_seconds: float = 60.0, restore_seconds: float = 300.0, starts: int = 8,
                    notice_miss_rate: float = 0.0, cloud: str | None = None,
                    model: ReclaimModel | None = None) -> dict[str, Any]:
    """Replay jobs over several traces as offers (``policy.offers_replay``): the ``orbit`` policy
    with every placement rule, with each rule switched off in turn, and on each offer alone.
    Jobs start at ``starts`` evenly spaced points of the shortest trace."""
    for name, v in (("job_hours", job_hours), ("save_seconds", save_seconds)):
        _check_positive(name, v)
    _check_positive("notice_seconds", notice_seconds, allow_zero=True)
    _check_positive("restore_seconds", restore_seconds, allow_zero=True)
    m = model or load_reclaim_model()
    offers = [TraceOffer.of(t, model=m, cloud=cloud) for t in traces]
    shortest = min(offers, key=lambda o: o.trace.duration_s).trace
    jobs = [JobParams(work_s=job_hours * 3600, save_s=save_seconds, restore_s=restore_seconds, start_s=s,
                      notice_miss_rate=notice_miss_rate) for s in start_offsets(shortest, starts)]
    variants = [("orbit", offers, {}), ("orbit, no avoid rule", offers, {"avoid": False}),
                ("orbit, no migration", offers, {"migrate": False})]
    variants += [(f"orbit on {o.trace.name} only", [o], {}) for o in offers] if len(offers) > 1 else []
    rows = []
    for name, which, kw in variants:
        rs = [replay_offers(which, j, model=m, notice_s=notice_seconds, **kw) for j in jobs]
        rows.append({"policy": name, **summarise(rs, offers[0].market.gpus),
                     "moves": round(sum(len(r.extra["moves"]) for r in rs) / len(rs), 2),
                     "avoided_dispatches": round(sum(sum(d["offer"] != d["first"] and d["first"] in d["avoided"]
                                                         for d in r.extra["dispatches"]) for r in rs) / len(rs), 2)})
    return {"mode": "offers", "traces": [o.trace.name for o in offers], "job_hours": job_hours, "starts": starts,
            "notice_miss_rate": notice_miss_rate,
            "offers": [{"offer": o.offer.offer_id, **o.market.as_dict()} for o in offers],
            "assumptions": {"save_seconds": save_seconds, "restore_seconds": restore_seconds,
                            "notice": "given" if notice_seconds is not None else "each trace's cloud's"},
            "results": rows}


def simulate_group(trace: Trace, *, min_nodes: int | None, job_hours: float = 24.0,
                   notice_seconds: float | None = None, save_seconds: float = 60.0, restore_seconds: float = 300.0,
                   starts: int = 8, notice_miss_rate: float = 0.0, cloud: str | None = None,
                   model: ReclaimModel | None = None) -> dict[str, Any]:
    """An N-node trace as a group of N nodes (``policy.group_replay``): each reclaim of some of its
    nodes decided by the group policy production runs (``min_nodes``: the template's elastic
    floor, None: not elastic), beside the gang replay (any drop stops the whole gang). The orbit
    interval policy, warmed up on the trace's past as ``simulate_trace`` does; every decision listed."""
    for name, v in (("job_hours", job_hours), ("save_seconds", save_seconds)):
        _check_positive(name, v)
    _check_positive("notice_seconds", notice_seconds, allow_zero=True)
    _check_positive("restore_seconds", restore_seconds, allow_zero=True)
    m = model or load_reclaim_model()
    market = trace_market(trace, default_spot_usd_per_hour=m.spot_usd_per_hour,
                          default_on_demand_usd_per_hour=m.on_demand_usd_per_hour, cloud=cloud)
    if market.nodes < 2 or (min_nodes is not None and not 1 <= min_nodes <= market.nodes):
        raise OrbitError(f"a group replay needs an N-node trace (this one holds {market.nodes}) and 1 <= min_nodes "
                         f"<= N (min_nodes {min_nodes})", field="min_nodes", value=min_nodes,
                         fix="pass a trace of a group of nodes, and --min-nodes between 1 and its node count")
    notice = market.notice_s if notice_seconds is None else float(notice_seconds)
    band = market.band if market.band is not None else 4
    jobs = [JobParams(work_s=job_hours * 3600, save_s=save_seconds, restore_s=restore_seconds, notice_s=notice,
                      start_s=s, nodes=market.nodes, gpus_per_node=max(market.gpus_per_node, 1),
                      spot_usd_per_hour=market.spot_usd_per_hour, notice_miss_rate=notice_miss_rate)
            for s in start_offsets(trace, starts)]
    rows, decisions = [], []
    for name, run in (("orbit, group policy", lambda st, j: replay_group(trace, st, j, min_nodes=min_nodes)),
                      ("orbit, whole gang", lambda st, j: replay(trace, st, j))):
        rs = []
        for job in jobs:
            strategy = make_strategy("orbit", model=m, band=band, save_s=job.save_s, notice_s=job.notice_s,
                                     nodes=market.nodes)
            warm_up(strategy, trace, job.start_s, job.nodes, job)
            rs.append(run(strategy, job))
        rows.append({"policy": name, **summarise(rs, market.gpus)})
        if name.endswith("group policy"):
            decisions = [{"job": i, **d} for i, r in enumerate(rs) for d in r.extra["group_decisions"]]
    return {"mode": "group", "trace": trace.name, "kind": trace.kind, "gap_seconds": trace.gap_seconds,
            "job_hours": job_hours, "starts": starts, "notice_seconds": notice, "min_nodes": min_nodes,
            "notice_miss_rate": notice_miss_rate, "deadline_hours": None, "market": market.as_dict(),
            "assumptions": {"save_seconds": save_seconds, "restore_seconds": restore_seconds,
                            "notice": "given" if notice_seconds is not None else market.sources["notice"]},
            "results": rows, "decisions": decisions}
