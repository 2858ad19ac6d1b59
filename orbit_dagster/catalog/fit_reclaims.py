"""Fit the shipped reclaim model from the training split of a shared data directory.

    python -m orbit_dagster.catalog.fit_reclaims SHARED_DATA_DIR [--out FILE]

Reads the traces of the **training split** under ``SHARED_DATA_DIR/traces`` and the AWS
spot-advisor CSV under ``SHARED_DATA_DIR/prices`` (for each trace's interruption band), and
writes derived figures only (shapes, means, rates, prices) to
``orbit_dagster/data/reclaim_model.json``.

The split is by **collection**: a trace's source (``catalog.traces.trace_source``: its data
set directory and cloud) and start date (``trace_date``). The training split is the
collections in ``TRAINING_COLLECTIONS`` (the 1-node p3.2xlarge availability traces collected
from 2023-02-15, the earliest); every other trace -- another source, another date, a trace
without a date, any trace added to the directory -- is **held out**, whole collections at a
time, so that no zone of a collection is on both sides. The benchmark reports only on the
held-out traces (``split_traces``), so no figure is measured on data the model was fitted on.
"""
from __future__ import annotations

import argparse
import csv
import sys
from datetime import date
from pathlib import Path

from orbit_dagster.catalog.reclaim_model import MODEL_FILE, ReclaimModel, fit_reclaim_model, mean_trace_price
from orbit_dagster.catalog.trace_market import ON_DEMAND
from orbit_dagster.catalog.trace_market import parse_trace_name as _parse
from orbit_dagster.catalog.traces import Trace, load_traces, trace_date, trace_source
from orbit_dagster.core.errors import OrbitError

#: The split "by-collection": the model is fitted on the traces of these (source, start date)
#: collections only; every other trace is held out.
SPLIT_NAME = "by-collection"
TRAINING_COLLECTIONS = (("availability/aws", date(2023, 2, 15)),)

ADVISOR_CSV = Path("prices") / "aws_spot_advisor_accelerators.csv"


def collection(trace: Trace) -> tuple[str, date | None]:
    """The collection a trace belongs to: its source and its start date."""
    return trace_source(trace), trace_date(trace)


def split_traces(traces: list[Trace]) -> tuple[list[Trace], list[Trace]]:
    """(training, held out): the traces of the training collections, and every other one."""
    train = [t for t in traces if collection(t) in TRAINING_COLLECTIONS]
    return train, [t for t in traces if collection(t) not in TRAINING_COLLECTIONS]


def describe_split() -> str:
    """The training collections, for messages and reports."""
    return ", ".join(f"{src} {day.isoformat()}" for src, day in TRAINING_COLLECTIONS)


def parse_trace_name(name: str) -> tuple[date, str, str] | None:
    """(trace date, region, instance type) from a spot-traces file name, or None."""
    info = _parse(name)
    if not info or not info["instance_type"]:
        return None
    return info["day"], info["region"], info["instance_type"]


def advisor_rows(data_dir: Path) -> list[dict[str, str]]:
    path = data_dir / ADVISOR_CSV
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return [r for r in csv.DictReader(fh) if r.get("os") == "Linux"]


def advisor_entry(rows: list[dict[str, str]], when: date, region: str, itype: str) -> dict[str, str] | None:
    """The spot-advisor row for (region, type) from the snapshot nearest to ``when`` (earlier on ties)."""
    cands = [r for r in rows if r["region"] == region and r["instance_type"] == itype]
    if not cands:
        return None
    return min(cands, key=lambda r: (abs((date.fromisoformat(r["snapshot"]) - when).days), r["snapshot"]))


def fit_from_dir(data_dir: Path) -> ReclaimModel:
    """Fit from the training split under ``data_dir`` with the spot-advisor bands found there."""
    train, _ = split_traces(load_traces(data_dir))
    if not train:
        raise OrbitError(f"no training trace under {data_dir}", field="SHARED_DATA_DIR", value=str(data_dir),
                         fix="pass the shared data directory (traces/ must hold the collections " + describe_split()
                         + ")")
    return fit_from_traces(train, advisor_rows(data_dir))


def fit_from_traces(traces: list[Trace], rows: list[dict[str, str]]) -> ReclaimModel:
    """Fit from these traces (the benchmark's leave-one-out refits call this directly)."""
    bands: dict[str, int] = {}
    notes: dict[str, str] = {}
    itypes = set()
    savings_seen: list[float] = []
    spot = mean_trace_price(traces)
    for t in traces:
        parsed = parse_trace_name(t.name)
        if not parsed:
            continue
        when, region, itype = parsed
        itypes.add(itype)
        entry = advisor_entry(rows, when, region, itype)
        if entry is None:
            continue
        bands[t.name] = int(entry["interruption_index_r"])
        savings = float(entry["savings_pct_s"])
        savings_seen.append(savings)
        if spot is not None and savings < 100:
            notes[f"advisor {entry['snapshot']} {region} {itype}"] = (
                f"band {entry['interruption_label']}, savings {savings:.0f}% -> implied on-demand "
                f"{spot / (1 - savings / 100):.3f} $/h from the traces' mean spot price {spot:.3f} $/h")
    od = [ON_DEMAND[i][1] for i in sorted(itypes) if i in ON_DEMAND]
    if not od:
        raise OrbitError("no on-demand list price for the traced instance types", field="instance_type",
                         value=sorted(itypes), fix="add the type to catalog.trace_market.ON_DEMAND with its source")
    notes["on_demand"] = f"on-demand list price of {sorted(itypes)[0]}: {od[0]:g} $/h (catalog.trace_market.ON_DEMAND)"
    notes["split"] = (f"split {SPLIT_NAME}: fitted on the training collections only ({describe_split()}; "
                      "the traces in fitted_from)")
    notes["spot"] = "tick-weighted mean of the 'prices' field of the preemption traces"
    if spot is None and savings_seen:  # no priced trace: the advisor's savings against the list price
        spot = od[0] * (1 - sum(savings_seen) / len(savings_seen) / 100)
        notes["spot"] = "on-demand list price x (1 - mean spot-advisor savings) (no trace carried prices)"
    return fit_reclaim_model(traces, bands=bands, on_demand_usd_per_hour=od[0],
                             default_spot_usd_per_hour=spot, notes=notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orbit_dagster.catalog.fit_reclaims", description=__doc__.split("\n")[0])
    ap.add_argument("data_dir", type=Path, help="the shared data directory (holds traces/ and prices/)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / MODEL_FILE)
    args = ap.parse_args(argv)
    try:
        model = fit_from_dir(args.data_dir)
    except OrbitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(model.to_json())
    print(f"wrote {args.out.name}: up shape {model.up_shape:.3f}, down shape {model.down_shape:.3f}, "
          f"mean zone rate {model.mean_rate_per_hour:.3f}/h over {len(model.fitted_from)} traces")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
