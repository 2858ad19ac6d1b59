"""Replay one job over several offers, each a spot trace: the placement rules the control plane
applies at every dispatch and every decision tick, driven on traces (``orbit simulate --trace A
--trace B ...``).

``simulate.replay`` follows one job on one trace, whose offer is given. Here the job has
several (each trace an offer: its zone, instance type, prices and its cloud's notice) and the
replay decides as dispatch and the price sensor do, with the same functions:

- **at every dispatch** (the start, and after each reclaim): ``rank_offers`` over every offer,
  each at its trace's price then, from the record of what happened to each offer so far (a
  ``RateBook``: the offer's prior updated with every lifetime and reclaim its trace shows
  before then, as the ledger's record of the zone's instances would; ``simulate.warm_up``'s
  convention, kept up to date as time passes); the offers on which this job was reclaimed
  ``AVOID_AFTER_RECLAIMS`` times go last (``offers_to_avoid``, ``avoided_last``); the first of the
  best ``MAX_OFFERS_TRIED`` whose trace has capacity then is rented; when none has, the job
  waits for the first that comes up (a dispatch that finds no capacity is tried again);
- **on it**: ``OrbitInterval.for_offer`` with that book, the fleet's record of notices and
  the group size, re-decided after every save from the instance's age (``simulate._session``);
- **every decision window** (``window_s``, the price sensor's ``ORBIT_MIGRATION_WINDOW_S``) while
  it runs: the offer's risk history (``migration.risk_history``) and ``decide_move`` (the
  ranking with the current offer last, the work left as the sensor reads it: the work done so
  far, saves not counted). A move is make-before-break: the target is rented at the tick
  (when its trace has no capacity the provision fails and the job stays), the old instance
  saves an emergency checkpoint and is released once it is durable, and the job resumes on
  the target, which boots while that save is written.

Traces are laid side by side from their first ticks (second s of the replay is second s of
every trace) and replayed cyclically (``catalog.traces.up_runs``). The accounting is
``simulate.replay``'s, each instance at its own trace's price; a move's overlap is paid on
both. Offers must share one shape (GPU model and count, group size): the job's work is in
seconds of that shape.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model
from orbit_dagster.catalog.trace_market import TraceMarket, trace_market, trace_offer
from orbit_dagster.catalog.traces import Trace, cyclic_time, next_available, up_runs
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.interval import EMERGENCY_MARGIN
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.checkpointing import OrbitInterval
from orbit_dagster.policy.migration import decide_move, risk_history
from orbit_dagster.policy.offer_choice import MAX_OFFERS_TRIED, avoided_last, offers_to_avoid, rank_offers
from orbit_dagster.policy.reclaim_rate import NoticeReliability, RateBook
from orbit_dagster.policy.simulate import JobParams, ReplayResult, _Book, _PriceClock, _session, notice_missed

#: The price sensor's decision window (settings' ``ORBIT_MIGRATION_WINDOW_S`` default), market seconds.
WINDOW_S = 600.0


@dataclass(frozen=True)
class TraceOffer:
    """One offer of the replay: a trace and the market it was measured in."""

    trace: Trace
    market: TraceMarket
    offer: Offer

    @classmethod
    def of(cls, trace: Trace, *, model: ReclaimModel | None = None, cloud: str | None = None) -> "TraceOffer":
        m = model or load_reclaim_model()
        market = trace_market(trace, default_spot_usd_per_hour=m.spot_usd_per_hour,
                              default_on_demand_usd_per_hour=m.on_demand_usd_per_hour, cloud=cloud)
        return cls(trace, market, trace_offer(trace, market))

    def at(self, t: float) -> Offer:
        """The offer at second ``t`` of the replay: its spot price then."""
        tick = int(cyclic_time(self.trace, t, self.market.nodes) // self.trace.gap_seconds)
        usd_h = self.market.spot_price(self.trace, min(tick, len(self.trace.data) - 1))
        return self.offer.model_copy(update={"usd_per_gpu_second_spot": usd_h / 3600.0 / self.offer.gpu_count})


@dataclass
class _Record:
    """What happened to one offer's zone: its up-runs, known up to any time (bisect)."""

    runs: list[tuple[float, float, bool]]
    starts: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = [s for s, _, _ in self.runs]

    def until(self, t: float) -> tuple[list[tuple[float, float | None]], list[float]]:
        """(spans, reclaim times) seen by ``t``: a run still up at ``t`` is open."""
        seen = self.runs[:bisect.bisect_left(self.starts, t)]
        spans = [(s, e if e <= t else None) for s, e, _ in seen]
        return spans, [e for _, e, lost in seen if lost and e <= t]

    def first_run_from(self, t: float) -> tuple[float, bool] | None:
        """The end of the up-run holding ``t`` and whether it ends in a reclaim (None: down at ``t``)."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and self.runs[i][0] <= t < self.runs[i][1]:
            return self.runs[i][1], self.runs[i][2]
        return None


def _check_shapes(offers: list[TraceOffer]) -> None:
    if not offers:
        raise OrbitError("the offers replay needs at least one trace", field="traces", value=0,
                         fix="pass --trace once per offer")
    first = offers[0]
    for o in offers[1:]:
        same = (o.offer.gpu, o.offer.gpu_count, o.market.nodes) == (first.offer.gpu, first.offer.gpu_count,
                                                                    first.market.nodes)
        if not same:
            raise OrbitError(f"trace {o.trace.name} is {o.market.nodes} x {o.offer.gpu_count} {o.offer.gpu}, "
                             f"{first.trace.name} {first.market.nodes} x {first.offer.gpu_count} {first.offer.gpu}",
                             field="traces", value=[o.trace.name, first.trace.name],
                             fix="replay offers of one shape together (a job's work is seconds of one shape)")
    ids = [o.offer.offer_id for o in offers]
    if len(set(ids)) != len(ids):
        raise OrbitError("two traces make the same offer", field="traces", value=ids, fix="pass each trace once")


def replay_offers(offers: list[TraceOffer], job: JobParams, *, model: ReclaimModel | None = None,
                  window_s: float = WINDOW_S, avoid: bool = True, migrate: bool = True,
                  notice_s: float | None = None) -> ReplayResult:
    """Run ``job`` (its ``work_s``, ``save_s``, ``restore_s``, ``start_s``, ``horizon_s``,
    ``notice_miss_rate`` and ``seed``; group size and prices come from the offers) over the
    offers. ``notice_s`` None: each offer's cloud's. ``avoid``/``migrate`` False switch a rule
    off, to measure what it does. ``extra`` holds each dispatch and move."""
    _check_shapes(offers)
    m = model or load_reclaim_model()
    nodes = offers[0].market.nodes
    span = 2 * max(o.trace.duration_s for o in offers)
    horizon = job.start_s + (job.horizon_s if job.horizon_s is not None else span)
    records = {o.offer.offer_id: _Record(list(up_runs(o.trace, 0.0, horizon, nodes=nodes, cyclic=True)))
               for o in offers}
    notice = {o.offer.offer_id: o.market.notice_s if notice_s is None else notice_s for o in offers}
    res = ReplayResult(policy="orbit", finished=False, work_s=job.work_s, wall_s=horizon - job.start_s,
                       extra={"dispatches": [], "moves": []})
    books = {o.offer.offer_id: _Book(res, _PriceClock(o.trace, o.market.spot_usd_per_hour, nodes)) for o in offers}
    reclaims_here: dict[str, int] = {}
    t, durable, standby = job.start_s, 0.0, None
    while t < horizon:
        book, notices = _known(offers, records, notice, job, t, m)
        chosen = standby or _dispatch(offers, records, book, notice, job, t, reclaims_here if avoid else {}, m, res)
        standby = None
        if chosen is None:  # no capacity: tried again when the first offer comes up (at least a tick on)
            up = min(next_available(o.trace, t, nodes=nodes, cyclic=True) or horizon for o in offers)
            t = max(up, t + min(o.trace.gap_seconds for o in offers))
            continue
        oid = chosen.offer.offer_id
        e, reclaimed = records[oid].first_run_from(t) or (t, False)
        sj = replace(job, notice_s=notice[oid], nodes=nodes, spot_usd_per_hour=chosen.market.spot_usd_per_hour)
        strategy = OrbitInterval.for_offer(chosen.at(t), save_s=job.save_s, notice_s=notice[oid], model=m, rates=book,
                                           notices=notices, nodes=nodes, emergency_save_s=job.emergency_save_s)
        move = _first_move(chosen, offers, records, notice, job, sj, t, min(e, horizon), durable, window_s, m) \
            if migrate and len(offers) > 1 else None
        res.sessions += 1
        if move is not None:  # make-before-break: an emergency save at the tick, released once durable
            at, target = move
            end_by = at + (1.0 + EMERGENCY_MARGIN) * sj.esave
            mj = replace(sj, notice_s=math.inf, notice_miss_rate=0.0)  # (the end is known: it is ours)
            end, durable, done = _session(t, end_by, True, durable, _Moving(strategy), mj, books[oid])
            res.extra["moves"].append({"at": at, "from": oid, "to": target.offer.offer_id})
        else:
            end, durable, done = _session(t, min(e, horizon), reclaimed and e <= horizon, durable, strategy, sj,
                                          books[oid])
        res.paid_s += end - t
        res.cost_usd += books[oid].prices.cost(t, end)
        if done:
            res.finished, res.wall_s = True, end - job.start_s
            break
        if move is not None:
            t, standby = move[0], move[1]
        elif reclaimed and e <= horizon:
            res.reclaims += 1
            reclaims_here[oid] = reclaims_here.get(oid, 0) + 1
            t = e
        else:
            break  # the horizon
    res.useful_s = durable
    return res


def _known(offers: list[TraceOffer], records: dict[str, _Record], notice: dict[str, float], job: JobParams,
           t: float, m: ReclaimModel) -> tuple[RateBook, NoticeReliability]:
    """The fleet's record at ``t``: every offer's rate from its trace's past, and the notices
    of every reclaim so far (those ``notice_miss_rate`` loses, seeded by the reclaim's time)."""
    book, notices = RateBook(model=m), NoticeReliability()
    for o in offers:
        oid = o.offer.offer_id
        spans, lost = records[oid].until(t)
        exposure = sum((stop if stop is not None else t) - start for start, stop in spans)
        book.for_offer(o.offer).observe(len(lost), exposure)
        if notice[oid] > 0 and lost:
            missed = sum(notice_missed(replace(job, notice_s=notice[oid]), e) for e in lost)
            notices.observe(len(lost), missed)
    return book, notices


def _dispatch(offers: list[TraceOffer], records: dict[str, _Record], book: RateBook, notice: dict[str, float],
              job: JobParams, t: float, reclaims_here: dict[str, int], m: ReclaimModel,
              res: ReplayResult) -> TraceOffer | None:
    """Dispatch's choice at ``t``: the ranking, this job's avoided offers last, the first with capacity."""
    now = [o.at(t) for o in offers]
    decision = rank_offers(now, gpu_count=now[0].gpu_count, save_s=job.save_s, restore_s=job.restore_s,
                           notice_s={o.offer.provider: notice[o.offer.offer_id] for o in offers},
                           emergency_save_s=job.emergency_save_s, rates=book, model=m)
    avoid = offers_to_avoid(reclaims_here)
    ranked = avoided_last([s.offer for s in decision.ranked], avoid)
    by_id = {o.offer.offer_id: o for o in offers}
    for offer in ranked[:MAX_OFFERS_TRIED]:
        if records[offer.offer_id].first_run_from(t) is not None:
            res.extra["dispatches"].append({"at": t, "offer": offer.offer_id, "first": decision.chosen.offer_id,
                                            "avoided": sorted(avoid)})
            return by_id[offer.offer_id]
    return None


class _Moving:
    """The session's interval policy, with the end of the session known (a move's SIGTERM is
    ours, whatever notice the cloud gives): ``_session`` then saves the newest state at it."""

    uses_notice = True

    def __init__(self, inner: OrbitInterval):
        self.inner = inner

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        return self.inner.interval(age_s, work_left_s)


def _first_move(current: TraceOffer, offers: list[TraceOffer], records: dict[str, _Record],
                notice: dict[str, float], job: JobParams, sj: JobParams, s0: float, e: float, durable: float,
                window_s: float, m: ReclaimModel) -> tuple[float, TraceOffer] | None:
    """The first decision tick in the session ``[s0, e)`` at which the price sensor's rule moves
    the job, and its target (which must have capacity then)."""
    oid = current.offer.offer_id
    by_id = {o.offer.offer_id: o for o in offers}
    tick = (math.floor(s0 / window_s) + 1) * window_s
    while tick < e - (1.0 + EMERGENCY_MARGIN) * sj.esave:
        spans, lost = records[oid].until(tick)
        history = risk_history(current.offer, lost, spans, now=tick, window_s=window_s, model=m)
        if history[-1] > history[0]:  # (cheap test first: three rises put the last above the first)
            book, _ = _known(offers, records, notice, job, tick, m)
            now = [o.at(tick) for o in offers]
            ranked = avoided_last([s.offer for s in rank_offers(
                now, gpu_count=now[0].gpu_count, save_s=job.save_s, restore_s=job.restore_s,
                notice_s={o.offer.provider: notice[o.offer.offer_id] for o in offers}, rates=book, model=m).ranked],
                {oid})
            done_s = durable + max(tick - s0 - job.restore_s, 0.0)
            asked = decide_move(history, current=current.at(tick), ranked=ranked,
                                remaining_work_s=max(job.work_s - done_s, 0.0), save_s=job.save_s,
                                restore_s=job.restore_s, notice_s=sj.notice_s, model=m)
            if asked is not None and asked[1].migrate:
                target = by_id[asked[0].offer_id]
                if records[target.offer.offer_id].first_run_from(tick) is not None:
                    return tick, target
        tick += window_s
    return None
