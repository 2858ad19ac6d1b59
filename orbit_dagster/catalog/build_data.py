"""Rebuild the catalog tables shipped in `orbit_dagster/data/` from the shared public data.

    python -m orbit_dagster.catalog.build_data SHARED_DATA_DIR [--out DIR]

SHARED_DATA_DIR holds `prices/` and `hardware/` (see the data set's SOURCES.md). Only
files that may be redistributed are read, and only the columns the catalog uses are kept.
The output is byte-for-byte deterministic (sorted rows, gzip without a timestamp), so a
rebuild of unchanged sources leaves `git status` clean.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import sys
from pathlib import Path

from orbit_dagster.catalog import CatalogError
from orbit_dagster.catalog.aws import ADVISOR_FILE, is_gpu_instance_type, read_spot_advisor_csv, read_spot_advisor_json
from orbit_dagster.catalog.gce import PRICE_COLUMNS, PRICES_FILE, SNAPSHOTS_FILE, TIME_COLUMN, parse_time
from orbit_dagster.catalog.gpus import EPOCH_COLUMNS, EPOCH_FILE

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data"
SOURCES = {
    "gce_changes": "prices/gce_gpu_price_changes.csv",
    "gce_snapshots": "prices/gce_gpu_price_snapshots.csv",
    "advisor_json": "prices/aws_spot_advisor_2025-06-28.json",
    "advisor_csv": "prices/aws_spot_advisor_accelerators.csv",
    "epoch": "hardware/epoch_ml_hardware.csv",
}


def _csv_text(header: list[str], rows: list[list[str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def _read_dicts(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def build_epoch(src: Path) -> str:
    """All accelerators, only the spec columns (drops notes, links and derived columns)."""
    cols = list(EPOCH_COLUMNS.values())
    rows = sorted(([r[c] for c in cols] for r in _read_dicts(src)), key=lambda r: r[0])
    return _csv_text(cols, rows)


def _utc_text(text: str) -> str:
    return parse_time(text).isoformat()


def build_gce_prices(src: Path) -> bytes:
    """Every change point, times in UTC, without commit hashes; gzip'd with mtime 0."""
    rows = [[_utc_text(r[TIME_COLUMN]) if c == TIME_COLUMN else r[c] for c in PRICE_COLUMNS] for r in _read_dicts(src)]
    rows.sort(key=lambda r: (r[0], r[1], r[6]))
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(_csv_text(list(PRICE_COLUMNS), rows).encode("utf-8"))
    return buf.getvalue()


def build_gce_snapshots(src: Path) -> str:
    return _csv_text([TIME_COLUMN], [[t] for t in sorted(_utc_text(r[TIME_COLUMN]) for r in _read_dicts(src))])


def build_advisor(src_json: Path, src_csv: Path) -> str:
    """Linux rows of GPU instance types from every snapshot, plus the feed's band bounds.

    The CSV flattens both snapshots; the JSON is the feed itself. Where both cover a
    snapshot they must agree, otherwise the build stops rather than ship a guess.
    """
    ranges, feed_rows = read_spot_advisor_json(src_json)
    keep = lambda r: r.os == "Linux" and is_gpu_instance_type(r.instance_type)  # noqa: E731
    flat = [r for r in read_spot_advisor_csv(src_csv) if keep(r)]
    feed = [r for r in feed_rows if keep(r)]
    snap = feed[0].snapshot
    if sorted(r for r in flat if r.snapshot == snap) != sorted(feed):
        raise CatalogError(f"{src_csv.name} and {src_json.name} disagree on the {snap} GPU rows",
                           field="advisor rows", value=snap, fix="re-export the CSV from the same feed")
    columns = ["snapshot", "region", "os", "instance_type", "savings_pct", "band"]
    lines = [json.dumps([getattr(r, c) for c in columns]) for r in sorted(flat, key=lambda r: tuple(
        getattr(r, c) for c in columns))]
    head = {"source": "AWS Spot Instance Advisor via alexei-led/spotinfo (Apache-2.0)",
            "ranges": [{"index": b.index, "label": b.label, "max": b.high_pct} for b in ranges],
            "columns": columns}
    return json.dumps(head)[:-1] + ',\n "rows": [\n' + ",\n".join(lines) + "\n]}\n"


def build_all(shared: Path) -> dict[str, bytes]:
    """File name -> contents of every shipped catalog table."""
    src = {k: Path(shared) / v for k, v in SOURCES.items()}
    absent = [str(p) for p in src.values() if not p.is_file()]
    if absent:
        raise CatalogError(f"shared data files missing: {absent}", field="SHARED_DATA_DIR", value=str(shared),
                           fix="pass the directory that holds prices/ and hardware/")
    return {
        EPOCH_FILE: build_epoch(src["epoch"]).encode(),
        PRICES_FILE: build_gce_prices(src["gce_changes"]),
        SNAPSHOTS_FILE: build_gce_snapshots(src["gce_snapshots"]).encode(),
        ADVISOR_FILE: build_advisor(src["advisor_json"], src["advisor_csv"]).encode(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shared_data_dir", type=Path)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: the package's data/ folder")
    args = ap.parse_args(argv)
    files = build_all(args.shared_data_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).write_bytes(data)
        print(f"{name}: {len(data):,} bytes")
    print(f"total {sum(map(len, files.values())):,} bytes in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
