"""Issue 19, item 3, on the **training** traces only: does the interval carry a reclaim the notice cannot?

    python bench/interval_condition.py [SHARED_DATA_DIR]

Where no emergency save fits the notice (GCP's 30 s with a 60-300 s save, or no notice), every
reclaim loses the work since the last durable save, and the interval alone insures against
it. ``OrbitInterval`` solves Young's condition with the instance's age-dependent rate,
``tau * uncovered * N(age, tau) = 2 * save`` (N: the Weibull cumulative hazard over the next
tau), which takes the loss of a reclaim to be tau / 2. With a falling hazard (shape < 1) a
reclaim is likelier early in an interval, so the expected loss is smaller; the condition
that minimises the expected overhead per second of work over the next interval is

    uncovered * (tau^2 h(age + tau) - integral_0^tau u h(age + u) du) = save

(equal to Young's when the hazard is constant). This script replays both on the training
collection (``catalog.fit_reclaims``: what the model was fitted on; no held-out trace is
read) in the cells where the notice does not cover every reclaim, against the hindsight-best
fixed interval, and prints the ratios. It changes nothing: the shipped policy is whichever
condition these figures favour (docs/policies.md, section 3).
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orbit_dagster.catalog.fit_reclaims import split_traces  # noqa: E402
from orbit_dagster.catalog.reclaim_model import load_reclaim_model  # noqa: E402
from orbit_dagster.catalog.trace_market import trace_market  # noqa: E402
from orbit_dagster.catalog.traces import load_traces  # noqa: E402
from orbit_dagster.core.interval import weibull_scale  # noqa: E402
from orbit_dagster.policy.checkpointing import make_strategy  # noqa: E402
from orbit_dagster.policy.simulate import JobParams, hindsight, replay_jobs, start_offsets  # noqa: E402

# (notice s, share of notices lost, save s): the cells where a periodic save insures against reclaims
CELLS = ((30.0, 0.0, 60.0), (30.0, 0.0, 300.0), (0.0, 0.0, 10.0), (0.0, 0.0, 60.0), (0.0, 0.0, 300.0),
         (120.0, 0.05, 60.0))


def expected_loss_interval(age_s: float, mtbf_s: float, save_s: float, *, shape: float, uncovered: float,
                           min_s: float, max_s: float) -> float:
    """The root of the expected-loss condition above (bisection in log tau; its left side grows with tau)."""
    if math.isinf(mtbf_s) or uncovered == 0:
        return max_s
    k, lam, a = shape, weibull_scale(mtbf_s, shape), age_s

    def excess(tau: float) -> float:
        x = a + tau
        h = (k / lam) * (x / lam) ** (k - 1)
        cum = (x / lam) ** k - (a / lam) ** k
        area = lam / (k + 1) * ((x / lam) ** (k + 1) - (a / lam) ** (k + 1)) - tau * (a / lam) ** k
        return uncovered * (tau * tau * h - (tau * cum - area)) - save_s

    lo, hi = max(min_s, 1e-3), max_s if math.isfinite(max_s) else 1e10
    if excess(lo) >= 0:
        return lo
    if excess(hi) <= 0:
        return hi
    while hi - lo >= 0.5:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


class ExpectedLoss:
    """``OrbitInterval`` with the expected-loss condition: the same estimates, another root."""

    def __init__(self, inner):
        self.inner, self.name, self.uses_notice = inner, "orbit, expected loss", inner.uses_notice

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        r = self.inner.rule()
        tau = expected_loss_interval(age_s, r.mtbf_s, r.save_s, shape=r.shape, uncovered=r.uncovered,
                                     min_s=r.min_s, max_s=r.max_s)
        return work_left_s if work_left_s <= tau else tau

    def end_session(self, exposure_s: float, reclaimed: bool, noticed: bool | None = None) -> None:
        self.inner.end_session(exposure_s, reclaimed, noticed)


def main(argv: list[str] | None = None) -> int:
    data = Path((argv or sys.argv[1:] or [REPO.parent / "shared" / "data"])[0])
    model = load_reclaim_model()
    train, _ = split_traces(load_traces(data))
    ratios: dict[str, list[float]] = {"young (shipped)": [], "expected loss": []}
    print("| notice | save s | trace | hindsight interval | young / hindsight | expected loss / hindsight |")
    print("|---|---|---|---|---|---|")
    for notice, lost, save in CELLS:
        for t in train:
            market = trace_market(t, default_spot_usd_per_hour=model.spot_usd_per_hour,
                                  default_on_demand_usd_per_hour=model.on_demand_usd_per_hour)
            band = market.band if market.band is not None else 4
            jobs = [JobParams(work_s=24 * 3600.0, save_s=save, restore_s=300.0, notice_s=notice, start_s=s,
                              nodes=market.nodes, spot_usd_per_hour=market.spot_usd_per_hour, notice_miss_rate=lost,
                              seed=seed) for seed in range(2 if lost else 1) for s in start_offsets(t, 8)]
            tau, best = hindsight(t, jobs, uses_notice=True)
            base = statistics.fmean(r.overhead_s for r in best)

            def shipped():
                return make_strategy("orbit", model=model, band=band, save_s=save, notice_s=notice,
                                     nodes=market.nodes, true_mtbf_s=1e12)

            row = []
            for name, make in (("young (shipped)", shipped), ("expected loss", lambda: ExpectedLoss(shipped()))):
                rs = replay_jobs(t, make, jobs, warm=True)
                ratios[name].append(statistics.fmean(r.overhead_s for r in rs) / base)
                row.append(ratios[name][-1])
            cell = f"{notice:g} s" + (f", {lost:.0%} lost" if lost else "")
            print(f"| {cell} | {save:g} | {t.name} | {'never' if math.isinf(tau) else f'{tau:.0f} s'} "
                  f"| {row[0]:.3f} | {row[1]:.3f} |", flush=True)
    for name, v in ratios.items():
        print(f"{name}: mean {statistics.fmean(v):.3f}, worst {max(v):.3f}, <= 1.05 in {sum(x <= 1.05 for x in v)} "
              f"of {len(v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
