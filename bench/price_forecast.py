"""Price and reclaim-rate forecasts (policy/forecast.py) against the naive baselines, on held-back history.

    python bench/price_forecast.py [SHARED_DATA_DIR] [--quick] [--record docs/benchmarks.md] [--json FILE]

1. **Price**: every GCE machine type x region's spot $/h (the shipped price history, the one the
   embedded market's price feed replays), read weekly (the data's revision cadence), season 52
   weeks. The model's alpha and gamma are fitted on the weeks before 2025-01-01 of every
   series; the error is measured on the weeks from then on (held back): the mean absolute
   error of each forecast 1..4 weeks ahead, made at every week of the held-back part, in $/h
   and relative to the series' mean price there, beside the naive baselines `last` (the last
   price seen) and `mean` (the mean of every price seen).
2. **Reclaim rate** (needs SHARED_DATA_DIR's traces; skipped, saying so, without them): hourly
   up-time and reclaims of each trace, season 24 h, forecast 6 h ahead. Fitted on the
   reclaim model's training split (`catalog.fit_reclaims.TRAINING_TRACES`), measured on every
   other trace (the evaluation traces; a 16-node trace as its gang): the mean absolute error
   in reclaims over the next 6 hours, beside `last` (the last 24 hours' rate) and `mean` (the
   cumulative rate), all with the same prior (the fitted model's zone rate and weight).

Nothing is tuned by hand: the grid of alphas, gammas and shrinkages is `policy/forecast.py`'s.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from recording import recorded_command, replace_section  # noqa: E402

from orbit_dagster.catalog import gce  # noqa: E402
from orbit_dagster.catalog.fit_reclaims import SPLIT_NAME, split_traces  # noqa: E402
from orbit_dagster.catalog.reclaim_model import load_reclaim_model  # noqa: E402
from orbit_dagster.catalog.traces import load_traces, up_runs  # noqa: E402
from orbit_dagster.policy.forecast import (  # noqa: E402
    TrailingRate,
    fit_price_model,
    fit_rate_model,
    naive_errors,
    phase_of,
    rate_bins,
    rate_errors,
    step_series,
)

BEGIN, END = "<!-- price-forecast:begin -->", "<!-- price-forecast:end -->"
WEEK_S = 7 * 86400.0
PRICE_PERIOD, PRICE_HORIZON = 52, 4
SPLIT_AT = datetime(2025, 1, 1, tzinfo=timezone.utc).timestamp()
HOUR_S = 3600.0
RATE_PERIOD, RATE_HORIZON, RATE_WARMUP = 24, 6, 24


def price_series(quick: bool) -> tuple[list[tuple[list, int]], int]:
    """Distinct weekly spot $/h series of the GCE history, with their phase, and the split step."""
    changes = gce._changes()
    start = min(c.time for c in changes).timestamp()
    end = max(c.time for c in changes).timestamp()
    count = int((end - start) // WEEK_S) + 1
    by_key: dict[tuple[str, str], list] = {}
    for c in changes:
        by_key.setdefault((c.instance_type, c.region), []).append((c.time.timestamp(), c.usd_per_hour_spot))
    seen, out = set(), []
    for key in sorted(by_key):
        series = step_series(by_key[key], start_s=start, step_s=WEEK_S, count=count)
        if sum(v is not None for v in series) < PRICE_PERIOD or tuple(series) in seen:
            continue
        seen.add(tuple(series))
        out.append((series, phase_of(start, WEEK_S, PRICE_PERIOD)))
    if quick:
        out = out[::10]
    return out, int((SPLIT_AT - start) // WEEK_S)


def _mae(errors: list[float]) -> float:
    return sum(errors) / len(errors) if errors else float("nan")


def bench_prices(quick: bool) -> dict:
    series, split = price_series(quick)
    t0 = time.time()
    train = [(s[:split], p) for s, p in series]
    model, fit_mae = fit_price_model(train, horizon=PRICE_HORIZON, period=PRICE_PERIOD, start=PRICE_PERIOD)
    fit_s = time.time() - t0
    rows = {}
    held_mean = _mae([abs(v) for s, _ in series for v in s[split:] if v is not None])
    for name, errors in (
        ("seasonal EW", [e for s, p in series for e in model.rolling_errors(s, horizon=PRICE_HORIZON, start=split,
                                                                            phase0=p)]),
        ("last", [e for s, _ in series for e in naive_errors("last", s, horizon=PRICE_HORIZON, start=split)]),
        ("mean", [e for s, _ in series for e in naive_errors("mean", s, horizon=PRICE_HORIZON, start=split)]),
    ):
        rows[name] = {"mae_usd_per_hour": _mae(errors), "relative_mae": _mae(errors) / held_mean,
                      "forecasts": len(errors)}
    return {"series": len(series), "weeks": len(series[0][0]) if series else 0, "split_week": split,
            "fitted": {"alpha": model.alpha, "gamma": model.gamma, "period": model.period,
                       "training_mae": fit_mae, "fit_seconds": round(fit_s, 1)},
            "held_back_mean_usd_per_hour": held_mean, "results": rows}


def hourly_bins(trace) -> tuple[list[float], list[int]]:
    """A trace's hourly up-time and reclaims (a multi-node trace as its gang: all nodes up)."""
    nodes = max(trace.data) if trace.kind == "multinode" else 1
    count = int(math.ceil(trace.duration_s / HOUR_S))
    sessions = list(up_runs(trace, 0.0, trace.duration_s, nodes=nodes))
    return rate_bins(sessions, start_s=0.0, step_s=HOUR_S, count=count)


def bench_rates(data_dir: Path | None) -> dict:
    if data_dir is None or not (data_dir / "traces").is_dir():
        return {"skipped": f"no traces under {data_dir}/traces: pass SHARED_DATA_DIR (the shared data set)"}
    train, evaluation = split_traces(load_traces(data_dir))
    m = load_reclaim_model()
    prior = dict(prior_rate_per_hour=m.mean_rate_per_hour, prior_strength=m.zone_rate_alpha)
    train_bins = [(*hourly_bins(t), 0) for t in train]
    model, fit_mae = fit_rate_model(train_bins, horizon=RATE_HORIZON, period=RATE_PERIOD, start=RATE_WARMUP, **prior)
    a0, b0 = model.prior_reclaims, model.prior_hours
    per_trace, totals = [], {"seasonal EW": [], "last": [], "mean": []}
    for t in evaluation:
        exposure, reclaims = hourly_bins(t)
        errs = {
            "seasonal EW": model.rolling_errors(exposure, reclaims, horizon=RATE_HORIZON, start=RATE_WARMUP),
            "last": rate_errors(lambda: TrailingRate(24, a0, b0), exposure, reclaims, horizon=RATE_HORIZON,
                                start=RATE_WARMUP),
            "mean": rate_errors(lambda: TrailingRate(None, a0, b0), exposure, reclaims, horizon=RATE_HORIZON,
                                start=RATE_WARMUP),
        }
        for k, v in errs.items():
            totals[k] += v
        per_trace.append({"trace": t.name, "hours": len(exposure), "reclaims": sum(reclaims),
                          **{k: _mae(v) for k, v in errs.items()}})
    return {"split": SPLIT_NAME, "training": [t.name for t in train],
            "fitted": {"alpha": model.alpha, "shrink_h": model.shrink_h, "period": model.period,
                       "training_mae": fit_mae},
            "results": {k: {"mae_reclaims": _mae(v), "forecasts": len(v)} for k, v in totals.items()},
            "per_trace": per_trace}


def _f(x: float, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def render(result: dict, argv: list[str]) -> str:
    p = result["prices"]
    lines = [
        f"Command: `{recorded_command('price_forecast', argv)}` ({result['seconds']:.0f} s on this machine).", "",
        f"**Price**, GCE spot $/h ({p['series']} distinct machine type x region series, weekly, season "
        f"{PRICE_PERIOD} weeks; fitted before 2025-01-01: alpha {p['fitted']['alpha']:g}, gamma "
        f"{p['fitted']['gamma']:g}; measured from then on, {PRICE_HORIZON} weeks ahead):", "",
        "| forecast | MAE $/h | MAE / mean price | forecasts |", "|---|---|---|---|",
    ]
    for name, r in p["results"].items():
        lines.append(f"| {name} | {_f(r['mae_usd_per_hour'])} | {_f(r['relative_mae'])} | {r['forecasts']} |")
    r = result["rates"]
    lines.append("")
    if "skipped" in r:
        lines.append(f"**Reclaim rate**: skipped ({r['skipped']}).")
    else:
        lines += [f"**Reclaim rate**, reclaims in the next {RATE_HORIZON} h (hourly, season {RATE_PERIOD} h; "
                  f"fitted on {r['split']}: alpha {r['fitted']['alpha']:g}, shrink {r['fitted']['shrink_h']:g} h; "
                  "measured on the evaluation traces):", "",
                  "| trace | hours | reclaims | MAE seasonal EW | MAE last 24 h | MAE mean |", "|---|---|---|---|---|---|"]
        for t in r["per_trace"]:
            lines.append(f"| {t['trace']} | {t['hours']} | {t['reclaims']} | {_f(t['seasonal EW'])} | "
                         f"{_f(t['last'])} | {_f(t['mean'])} |")
        lines.append(f"| all | | | {_f(r['results']['seasonal EW']['mae_reclaims'])} | "
                     f"{_f(r['results']['last']['mae_reclaims'])} | {_f(r['results']['mean']['mae_reclaims'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir", nargs="?", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--quick", action="store_true", help="a tenth of the price series (never recorded)")
    ap.add_argument("--record", type=Path, default=None, help="rewrite this file's price-forecast section")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    result = {"prices": bench_prices(args.quick),
              "rates": bench_rates(args.data_dir if args.data_dir.is_dir() else None)}
    result["seconds"] = time.time() - t0
    body = render(result, argv)
    print(body)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.record and args.quick:
        print("price_forecast: --record is for a full run; a --quick run only prints", file=sys.stderr)
    elif args.record:
        replace_section(args.record, BEGIN, END, f"\n## Price and reclaim-rate forecasts (bench/price_forecast.py)\n\n"
                                                 f"{body}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
