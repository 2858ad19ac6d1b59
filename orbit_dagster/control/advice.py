"""Advice: which offer's share of the work to raise or lower, and what that would have saved.

For the last N finished training jobs (of one experiment, or all), grouped by GPU shape
(model x GPUs per instance), every offer of that shape the ledger has recorded availability
for (`recorded.py`: its billed spot instances laid end to end) is a candidate. The job size
is the mean useful work of those jobs (GPU-hours attributed to checkpoints, less restores:
the `cost_efficiency_instances` view), in market hours. Each candidate's recorded trace is
replayed with the policy production runs (`orbit`), the ledger's measured save and restore
times and the offer's provider's notice, through `orbit simulate`'s own code
(`cli.simulate.simulate_command`), so the printed `orbit simulate` command gives the same
figures. The counterfactual of the last N jobs is then: each job's work on each offer, at
that offer's replayed cost per job, against all of it on the cheapest offer whose replayed
jobs all finished.

Evidence and uncertainty: each offer's exposure and reclaims, with the exact 90% interval of
its reclaim rate (Poisson); the replayed cost per job at the ends of those intervals adds or
removes the reclaims a job would see there, each at the replay's own cost per reclaim (its
restarts after the first and its lost work; a restore and a save where it saw none), an
approximation that says how far the saving could move with the reclaim rates the history
allows. Where that range includes no saving, the recommendation says its confidence is low.

Refused (an OrbitError, exit 2 in the CLI) without enough history: `MIN_JOBS` finished jobs
of one shape, and at least two offers of that shape with `MIN_EXPOSURE_H` hours (and at
least one job's length) of recorded up-time each. Offers of the shape that the catalog
lists but the ledger never rented are named, unreplayed: there is nothing recorded to replay.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..catalog import PROVIDER_NOTICE_S
from ..catalog.listing import list_offers
from ..catalog.traces import load_trace
from ..core.errors import NotFound, OrbitError
from ..ledger import Ledger
from ..ledger.efficiency import literal
from ..ledger.queries import sql
from ..policy.compare import simulate_trace
from ..policy.offer_choice import RESTORE_PRIOR_S
from ..providers.sim.market import read_market
from ..providers.sim.provider import default_offers
from ..settings import Settings
from .discovery import read_catalog
from .placement import measured_save_seconds
from .recorded import OfferRecord, gamma_interval, offer_records, write_trace
from .trends import offer_trends

MIN_JOBS = 3
MIN_EXPOSURE_H = 2.0
STARTS = 8
POLICY = "orbit"
LEVEL = 0.9


class TooLittleHistory(OrbitError):
    """The ledger holds too little history for a counterfactual."""


def scale_of(settings: Settings):
    """provider -> its market's time scale (the embedded market's, else real time)."""
    market = read_market(settings.sim_dir)
    sim_scale = market.scale if market is not None else settings.sim.scale
    return lambda provider: float(sim_scale) if provider == "sim" else 1.0


def notice_of(settings: Settings, provider: str) -> float:
    """The reclaim notice in market seconds (the embedded market's own, else the provider's)."""
    if provider == "sim":
        market = read_market(settings.sim_dir)
        return float(market.notice_s if market is not None else settings.sim.notice_seconds)
    return float(PROVIDER_NOTICE_S.get(provider, 0.0))


def restore_seconds(ledger: Ledger, scale: float) -> float:
    """Median seconds from a resumed attempt's instance start to its `resumed` record, in market seconds."""
    rows = ledger.rows("""SELECT e.detail, i.started_at FROM events e JOIN instances i ON i.instance_id = e.instance_id
                          WHERE e.kind = 'host_resumed' ORDER BY e.ts DESC LIMIT 50""")
    values = [float(json.loads(r["detail"] or "{}").get("ts", 0)) - float(r["started_at"]) for r in rows]
    values = [v for v in values if v > 0]
    return statistics.median(values) * scale if values else RESTORE_PRIOR_S


def _jobs(ledger: Ledger, experiment: str | None, last: int) -> list[str]:
    return [r["job_id"] for r in ledger.rows(
        """SELECT j.job_id FROM jobs j
           WHERE j.state = 'SUCCEEDED' AND (? IS NULL OR j.experiment = ?)
             AND EXISTS (SELECT 1 FROM instances i WHERE i.job_id = j.job_id AND i.purpose = 'train'
                         AND i.stopped_at IS NOT NULL)
           ORDER BY j.created_at DESC, j.job_id DESC LIMIT ?""", [experiment, experiment, last])]


def _work(ledger: Ledger, jobs: list[str], scale) -> dict[str, dict[str, dict]]:
    """job -> offer -> {hours of useful work (market hours, per instance), gpu, gpus, provider}."""
    frame = sql(ledger, f"""SELECT job_id, offer_id, provider, gpu, gpus, sum(useful_gpu_s / gpus) AS useful_s
                            FROM cost_efficiency_instances
                            WHERE purpose = 'train' AND job_id IN ({', '.join(map(literal, jobs))})
                            GROUP BY job_id, offer_id, provider, gpu, gpus""")
    out: dict[str, dict[str, dict]] = {}
    for r in frame.to_dict("records"):
        out.setdefault(r["job_id"], {})[r["offer_id"]] = {
            "hours": float(r["useful_s"]) * scale(r["provider"]) / 3600.0, "gpu": r["gpu"], "gpus": int(r["gpus"])}
    return out


def _refuse(message: str) -> TooLittleHistory:
    return TooLittleHistory(
        message, field="history", value=f"{MIN_JOBS} jobs, 2 offers x {MIN_EXPOSURE_H:g} h needed",
        fix=f"run more jobs (at least {MIN_JOBS} finished, of one GPU shape, on at least two offers with "
            f"{MIN_EXPOSURE_H:g} h or more of recorded spot up-time each), or widen the scope (no --experiment, "
            "a larger --last)")


def advise(settings: Settings, *, experiment: str | None = None, last: int = 10, starts: int = STARTS) -> dict:
    """The advice document (see the module's doc), or TooLittleHistory naming what is missing."""
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise OrbitError("--last must be a whole number of jobs >= 1", field="--last", value=last, fix="e.g. --last 10")
    ledger = settings.ledger()
    if experiment is not None and not ledger.scalar("SELECT count(*) FROM experiments WHERE experiment = ?",
                                                    [experiment]):
        raise NotFound(f"no experiment {experiment!r} in the ledger", field="experiment", value=experiment,
                       fix="list them with `orbit sql \"SELECT experiment FROM experiments\"`")
    jobs = _jobs(ledger, experiment, last)
    scope = f"experiment {experiment}" if experiment else "the ledger"
    if len(jobs) < MIN_JOBS:
        raise _refuse(f"too little history to advise on {scope}: {len(jobs)} finished training job(s) with a bill, "
                      f"{MIN_JOBS} needed")
    scale = scale_of(settings)
    work = _work(ledger, jobs, scale)
    shapes: dict[tuple[str, int], list[str]] = {}
    for job in jobs:
        offers = work.get(job) or {}
        if offers:
            main = max(offers.values(), key=lambda w: w["hours"])
            shapes.setdefault((main["gpu"], main["gpus"]), []).append(job)
    records = offer_records(ledger, scale)
    reasons = []
    for (gpu, gpus), members in sorted(shapes.items(), key=lambda kv: -len(kv[1])):
        if len(members) < MIN_JOBS:
            reasons.append(f"{gpu} x{gpus}: {len(members)} job(s), {MIN_JOBS} needed")
            continue
        mean_h = statistics.fmean(sum(w["hours"] for w in work[j].values()) for j in members)
        need = max(MIN_EXPOSURE_H, mean_h)
        same = {o: r for o, r in records.items() if r.gpu == gpu and r.gpu_count == gpus}
        eligible = {o: r for o, r in same.items() if r.exposure_h >= need}
        if len(eligible) < 2:
            have = ", ".join(f"{o} {r.exposure_h:.2f} h" for o, r in sorted(same.items())) or "none"
            reasons.append(f"{gpu} x{gpus}: {len(eligible)} offer(s) with {need:.2f} h or more of recorded spot "
                           f"up-time, 2 needed (recorded: {have})")
            continue
        return _advice(settings, ledger, scope, members, work, eligible, same, mean_h, starts, gpu, gpus)
    raise _refuse(f"too little history to advise on {scope}: " + "; ".join(reasons))


def _advice(settings: Settings, ledger: Ledger, scope: str, jobs: list[str], work: dict, eligible: dict[str, OfferRecord],
            same: dict[str, OfferRecord], mean_h: float, starts: int, gpu: str, gpus: int) -> dict:
    total_work = {j: sum(w["hours"] for w in work[j].values()) for j in jobs}
    shares: dict[str, float] = {}  # job-equivalents of the last jobs' work on each offer
    for j in jobs:
        for offer_id, w in work[j].items():
            shares[offer_id] = shares.get(offer_id, 0.0) + (w["hours"] / total_work[j] if total_work[j] else 0.0)
    trends = offer_trends(ledger, eligible)
    offers = []
    for offer_id, rec in sorted(eligible.items()):
        offers.append(_replay(settings, ledger, rec, mean_h, starts, shares.get(offer_id, 0.0) / len(jobs)))
        offers[-1]["forecast"] = trends[offer_id]
    best = min((o for o in offers if o["simulated"]["finished"] == o["simulated"]["jobs"]),
               key=lambda o: (o["simulated"]["cost_usd"], o["offer_id"]), default=None)
    catalog = _unrecorded(settings, gpu, gpus, set(same), {r.provider for r in same.values()})
    doc = {
        "scope": {"of": scope, "jobs": len(jobs), "job_ids": jobs, "gpu": gpu, "gpus_per_instance": gpus,
                  "mean_job_hours": mean_h, "policy": POLICY, "starts": starts},
        "offers": offers,
        "other_work_share": round(max(1.0 - sum(o["share"] for o in offers), 0.0), 6),
        "not_replayed": catalog,
        "recommendations": [] if best is None else _recommend(offers, best, len(jobs)),
    }
    if best is None:
        doc["refused"] = "no offer's replayed jobs all finished within the replay: nothing to recommend"
    return doc


def _replay(settings: Settings, ledger: Ledger, rec: OfferRecord, job_hours: float, starts: int, share: float) -> dict:
    path = write_trace(settings.home, rec)
    save_s = measured_save_seconds(ledger, None, rec.scale)
    restore_s = restore_seconds(ledger, rec.scale)
    notice_s = notice_of(settings, rec.provider)
    # What `orbit simulate` runs (cli/simulate.py: load the file, simulate_trace with its options),
    # so the command below reproduces these figures.
    result = simulate_trace(load_trace(path), policy=POLICY, job_hours=job_hours, notice_seconds=notice_s,
                            save_seconds=save_s, restore_seconds=restore_s, starts=starts)
    row = result["results"][0]
    rate = rec.reclaims / rec.exposure_h
    low, high = gamma_interval(rec.reclaims, rec.exposure_h, LEVEL)
    per_reclaim = reclaim_cost(row, result["market"], rec.usd_per_hour, restore_s, save_s)
    held_h = row["paid_gpu_hours"] / _gpus(result["market"])  # instance-hours a replayed job held
    return {
        "offer_id": rec.offer_id, "provider": rec.provider, "share": round(share, 6),
        "usd_per_hour": round(rec.usd_per_hour, 6), "instances": len(rec.sessions),
        "exposure_hours": round(rec.exposure_h, 6), "reclaims": rec.reclaims,
        "reclaims_per_hour": round(rate, 6), "rate_interval": [round(low, 6), round(high, 6)],
        "trace": str(path),
        "simulate": simulate_line(path, job_hours, save_s, restore_s, notice_s, starts),
        "simulated": {k: row[k] for k in ("cost_usd", "overhead_usd", "goodput", "reclaims", "finished", "jobs",
                                          "wasted_gpu_hours")},
        # The replayed cost with as many reclaims as a job would see at the rate interval's ends.
        "cost_interval": [round(row["cost_usd"] + (r * held_h - row["reclaims"]) * per_reclaim, 6) for r in (low, high)],
        "usd_per_reclaim": round(per_reclaim, 6),
    }


def _gpus(market: dict) -> int:
    return int(market.get("nodes") or 1) * max(int(market.get("gpus_per_node") or 1), 1)


def reclaim_cost(row: dict, market: dict, usd_per_hour: float, restore_s: float, save_s: float) -> float:
    """What one more reclaim costs a replayed job: the replay's own restarts after the first and
    its lost work, per reclaim; a restore and a save at the offer's price where it saw none."""
    if row["reclaims"] > 0:
        hours = (row["restart_overhead_gpu_hours"] / _gpus(market) - restore_s / 3600.0
                 + row["wasted_gpu_hours"] / _gpus(market))
        return max(hours, 0.0) / row["reclaims"] * usd_per_hour
    return (restore_s + save_s) / 3600.0 * usd_per_hour


def simulate_line(path: Path, job_hours: float, save_s: float, restore_s: float, notice_s: float, starts: int) -> str:
    """The `orbit simulate` command that replays what the advice replayed (floats written exactly)."""
    return (f"orbit simulate --trace {path} --policy {POLICY} --job-hours {job_hours!r} --save-seconds {save_s!r} "
            f"--restore-seconds {restore_s!r} --notice-seconds {notice_s!r} --starts {starts} --json")


def _recommend(offers: list[dict], best: dict, jobs: int) -> list[dict]:
    cost = best["simulated"]["cost_usd"]
    low_best, high_best = best["cost_interval"]
    recs, total, total_low, total_high = [], 0.0, 0.0, 0.0
    for o in offers:
        if o is best or o["share"] <= 0:
            continue
        w = o["share"] * jobs  # job-equivalents of work done on it
        saved = w * (o["simulated"]["cost_usd"] - cost)
        low, high = w * (o["cost_interval"][0] - high_best), w * (o["cost_interval"][1] - low_best)
        total, total_low, total_high = total + saved, total_low + low, total_high + high
        recs.append(_rec("lower", o, best, saved, low, high, jobs))
    head = _rec("raise" if best["share"] < 1 else "keep", best, best, total, total_low, total_high, jobs)
    return [head, *recs]


def _rec(action: str, o: dict, best: dict, saved: float, low: float, high: float, jobs: int) -> dict:
    sim = o["simulated"]
    evidence = (f"{o['offer_id']}: {o['reclaims']} reclaim(s) in {o['exposure_hours']:.2f} h of recorded spot up-time "
                f"({o['instances']} instance(s)); replayed with the {POLICY} policy on that record: "
                f"{_usd(sim['cost_usd'])} per job, goodput {sim['goodput']:.3f}, {sim['finished']}/{sim['jobs']} "
                f"finished; reproduce: {o['simulate']}")
    lo_r, hi_r = o["rate_interval"]
    uncertainty = (f"reclaim rate {o['reclaims_per_hour']:.3g}/h, {LEVEL:.0%} interval {lo_r:.3g}-{hi_r:.3g}/h "
                   f"(Poisson, from {o['reclaims']} reclaim(s)); with as many reclaims per job as each offer's "
                   f"interval's ends give, each at its replay's cost per reclaim (an approximation), the saving is "
                   f"{_usd(low)} to {_usd(high)}")
    confident = low > 0 if action != "keep" else True
    target = 1.0 if o is best else 0.0
    return {"action": action, "offer_id": o["offer_id"], "share": o["share"], "to_share": target,
            "saved_usd": round(saved, 6), "saved_interval": [round(low, 6), round(high, 6)], "jobs": jobs,
            "evidence": evidence, "uncertainty": uncertainty,
            "confidence": "high" if confident else "low: the saving is within the uncertainty; more history settles it"}


def _usd(x: float) -> str:
    return f"{'-' if x < 0 else ''}${abs(x):.3g}"


def _unrecorded(settings: Settings, gpu: str, gpus: int, recorded: set[str], providers: set[str]) -> list[dict]:
    """Offers of the shape, from the same providers, that the ledger never rented (cheapest first,
    at most 5): from the stored catalog that discovery keeps (control/discovery.py), else the
    embedded market's own offers and the shipped catalog's."""
    stored = read_catalog(settings)
    if stored is not None:
        candidates = [(r["offer_id"], r["provider"], r["gpu"], r["gpu_count"], r.get("usd_per_gpu_hour_spot"))
                      for r in stored["offers"]]
    else:
        offers = [*(default_offers() if "sim" in providers else ()), *list_offers()]
        candidates = [(o.offer_id, o.provider, o.gpu, o.gpu_count,
                       None if o.usd_per_gpu_second_spot is None else o.usd_per_gpu_second_spot * 3600) for o in offers]
    rows = [{"offer_id": offer_id, "usd_per_gpu_hour_spot": round(price, 6),
             "reason": "no recorded availability in the ledger: rent it to learn its reclaims"}
            for offer_id, provider, g, n, price in candidates
            if provider in providers and g == gpu and n == gpus and offer_id not in recorded and price]
    return sorted(rows, key=lambda r: (r["usd_per_gpu_hour_spot"], r["offer_id"]))[:5]
