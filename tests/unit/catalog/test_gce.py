"""GCE change points -> offers and price histories, checked on real rows of both GCE files."""
from __future__ import annotations

import csv
from datetime import datetime, timezone

import pytest

from orbit_dagster.catalog import CatalogError, shipped_file
from orbit_dagster.catalog.gce import (
    PRICES_FILE,
    SNAPSHOTS_FILE,
    gce_gpu,
    gce_offers,
    parse_time,
    price_at,
    price_history,
    read_price_changes,
    read_snapshots,
)

UTC = timezone.utc


def _raw_rows(prices_dir):
    with open(prices_dir / "gce_gpu_price_changes.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_shipped_change_points_equal_the_raw_file(prices_dir):
    raw = read_price_changes(prices_dir / "gce_gpu_price_changes.csv")
    assert read_price_changes(shipped_file(PRICES_FILE)) == raw
    assert len(raw) == len(_raw_rows(prices_dir))


def test_snapshot_times_are_utc_and_cover_every_change(prices_dir):
    snaps = read_snapshots(prices_dir / "gce_gpu_price_snapshots.csv")
    assert read_snapshots(shipped_file(SNAPSHOTS_FILE)) == snaps
    assert all(t.tzinfo == UTC for t in snaps)
    assert {c.time for c in read_price_changes(shipped_file(PRICES_FILE))} <= set(snaps)


def test_mixed_offsets_become_utc(prices_dir):
    row = next(r for r in _raw_rows(prices_dir) if r["snapshot_commit_time_utc"].endswith("+02:00"))
    local = datetime.fromisoformat(row["snapshot_commit_time_utc"])
    assert parse_time(row["snapshot_commit_time_utc"]) == local
    assert parse_time(row["snapshot_commit_time_utc"]).utcoffset().total_seconds() == 0


def test_gpu_comes_from_the_machine_family(prices_dir):
    rows = _raw_rows(prices_dir)
    mislabelled = [r for r in rows if r["instance_type"].startswith("a2-ultragpu") and r["gpu_model"] == "a100"]
    assert mislabelled, "the 2022 rows that call a2-ultragpu 'a100' are the reason for the family rule"
    assert {gce_gpu(r["instance_type"], r["gpu_model"]) for r in mislabelled} == {"A100-80G"}
    by_key = {"a100-80gb": "A100-80G", "h100-80gb": "H100", "h100-80gb-mega": "H100", "l4": "L4",
              "rtx6000": "RTX-PRO-6000"}
    for r in rows:
        if r["gpu_model"] in by_key:
            assert gce_gpu(r["instance_type"], r["gpu_model"]) == by_key[r["gpu_model"]], r["instance_type"]


def test_sources_example_a3_highgpu_8g_us_central1():
    """SOURCES.md: spot $61.95 (2024-05) -> $35.59 (2024-10) -> $20.42 (2025-03), on-demand $88.49."""
    hist = price_history("a3-highgpu-8g", "us-central1")
    at = {t.strftime("%Y-%m"): (od, spot) for t, od, spot in hist}
    assert round(at["2024-05"][1], 2) in (61.95, 62.41)  # several May points; the first is 61.95
    assert round(hist[0][2], 2) == 61.95
    assert round(at["2024-10"][1], 2) == 35.59 and round(at["2025-03"][1], 2) == 20.42
    assert round(at["2025-03"][0], 2) == 88.49
    assert [t for t, _, _ in hist] == sorted(t for t, _, _ in hist)


def _replay(rows, at):
    """Independent replay of the raw CSV: the last row per (type, region) at or before `at`."""
    state = {}
    for r in sorted(rows, key=lambda r: parse_time(r["snapshot_commit_time_utc"])):
        if parse_time(r["snapshot_commit_time_utc"]) <= at:
            state[(r["instance_type"], r["region"])] = r
    return state


@pytest.mark.parametrize("at", [datetime(2023, 1, 1, tzinfo=UTC), datetime(2025, 6, 1, tzinfo=UTC), None])
def test_offers_are_per_gpu_second_prices_of_the_rows_in_force(prices_dir, at):
    rows = _raw_rows(prices_dir)
    state = _replay(rows, at or datetime(2100, 1, 1, tzinfo=UTC))
    offers = {o.offer_id: o for o in gce_offers(at)}
    expected = {k: r for k, r in state.items() if r["event"] != "removed" and float(r["gpu_count"]) >= 1}
    assert set(offers) == {f"gce:{t}:{reg}" for t, reg in expected}
    for (itype, region), r in expected.items():
        o, n = offers[f"gce:{itype}:{region}"], int(float(r["gpu_count"]))
        assert o.gpu_count == n
        assert o.usd_per_gpu_second_on_demand * 3600 * n == pytest.approx(float(r["hour"]), rel=1e-12)
        if r["hour_spot"]:
            assert o.spot and o.usd_per_gpu_second_spot * 3600 * n == pytest.approx(float(r["hour_spot"]), rel=1e-12)
            assert 0 < o.reliability < 1 and o.reliability_source.startswith("prior")
        else:
            assert not o.spot and o.usd_per_gpu_second_spot is None and o.reliability == 1.0


def test_removed_machines_leave_the_catalog():
    removed_at = datetime(2023, 5, 9, 12, 8, 30, tzinfo=UTC)
    before = {o.instance_type for o in gce_offers(datetime(2023, 5, 1, tzinfo=UTC))}
    after = {o.instance_type for o in gce_offers(removed_at)}
    assert "a2-ultragpu-2g" in before and "a2-ultragpu-2g" not in after
    hist = price_history("a2-ultragpu-2g", "asia-east1")
    assert (removed_at, None, None) in hist  # a gap in the step function (the type came back later)


def test_fractional_gpu_shapes_are_history_only():
    assert not [o for o in gce_offers() if o.instance_type in ("g4-standard-6", "g4-standard-12", "g4-standard-24")]
    assert price_history("g4-standard-6", next(o.region for o in gce_offers() if o.instance_type == "g4-standard-48"))


def test_naive_at_is_utc_and_early_at_is_refused():
    assert gce_offers(datetime(2024, 6, 1)) == gce_offers(datetime(2024, 6, 1, tzinfo=UTC))
    with pytest.raises(CatalogError, match="precedes") as e:
        gce_offers(datetime(2020, 1, 1))
    assert e.value.field == "at"


def test_unknown_history_names_the_field():
    with pytest.raises(CatalogError) as e:
        price_history("n1-standard-1", "us-central1")
    assert e.value.field == "instance_type" and "a3-highgpu-8g" in str(e.value)
    with pytest.raises(CatalogError) as e:
        price_history("a3-highgpu-8g", "mars-north1")
    assert e.value.field == "region" and "us-central1" in str(e.value)


def test_price_at_evaluates_the_step_function():
    hist = price_history("a3-highgpu-8g", "us-central1")
    (t0, od0, sp0), (t1, od1, sp1) = hist[0], hist[1]
    assert price_at("a3-highgpu-8g", "us-central1", t0) == (od0, sp0)
    assert price_at("a3-highgpu-8g", "us-central1", t1 - (t1 - t0) / 2) == (od0, sp0)
    assert price_at("a3-highgpu-8g", "us-central1", t1) == (od1, sp1)
    assert price_at("a3-highgpu-8g", "us-central1", t0.replace(year=2020)) == (None, None)
    offer = next(o for o in gce_offers(t1) if o.offer_id == "gce:a3-highgpu-8g:us-central1")
    assert offer.usd_per_gpu_second_spot * 3600 * 8 == pytest.approx(sp1)
