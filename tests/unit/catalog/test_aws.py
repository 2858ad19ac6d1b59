"""AWS tables on real rows: the spot advisor (JSON feed and flattened CSV) and the spot price history."""
from __future__ import annotations

import csv
import math
from datetime import datetime, timezone

import pytest

from orbit_dagster.catalog import CatalogError
from orbit_dagster.catalog.aws import (
    AWS_GPU_FAMILIES,
    HOURS_PER_MONTH,
    SpotPrice,
    advisor_snapshot,
    aws_offers,
    az_id_to_region,
    instance_gpus,
    is_gpu_instance_type,
    latest_spot_prices,
    load_advisor,
    parse_spot_price_history,
    read_spot_advisor_csv,
    read_spot_advisor_json,
    reliability_prior,
)

HISTORY = "aws_spot_price_history_gpu_2022-05-31.tsv"
NOT_CUDA = ("inf1", "inf2", "trn1", "trn1n", "dl1", "dl2q", "g2")  # Inferentia, Trainium, Gaudi, AI100, GRID K520


@pytest.mark.parametrize("itype, expected", [
    ("p4d.24xlarge", ("A100-40G", 8)), ("p4de.24xlarge", ("A100-80G", 8)), ("p3.2xlarge", ("V100", 1)),
    ("p3.16xlarge", ("V100", 8)), ("p3dn.24xlarge", ("V100-32G", 8)), ("g5.xlarge", ("A10G", 1)),
    ("g5.48xlarge", ("A10G", 8)), ("p5.48xlarge", ("H100", 8)), ("g4dn.12xlarge", ("T4", 4)), ("g6e.xlarge", ("L40S", 1)),
])
def test_instance_types_map_to_gpu_and_count(itype, expected):
    assert instance_gpus(itype) == expected


def test_every_cuda_type_in_the_real_advisor_is_mapped(prices_dir):
    rows = read_spot_advisor_csv(prices_dir / "aws_spot_advisor_accelerators.csv")
    families = {r.instance_type.split(".")[0] for r in rows}
    assert families - set(AWS_GPU_FAMILIES) <= set(NOT_CUDA)
    for r in rows:
        if r.instance_type.split(".")[0] not in NOT_CUDA:
            assert is_gpu_instance_type(r.instance_type), r.instance_type
    with pytest.raises(CatalogError) as e:
        instance_gpus("inf2.xlarge")
    assert e.value.field == "instance_type" and "p4d" in str(e.value)


def test_feed_and_flattened_csv_agree_on_real_rows(prices_dir):
    bands, feed = read_spot_advisor_json(prices_dir / "aws_spot_advisor_2025-06-28.json")
    flat = [r for r in read_spot_advisor_csv(prices_dir / "aws_spot_advisor_accelerators.csv")
            if r.snapshot == "2025-06-28"]
    feed_index = {(r.region, r.os, r.instance_type): r for r in feed}
    assert flat and all(feed_index[(r.region, r.os, r.instance_type)] == r for r in flat)
    with open(prices_dir / "aws_spot_advisor_accelerators.csv", newline="") as f:
        labels = {int(r["interruption_index_r"]): r["interruption_label"] for r in csv.DictReader(f)}
    assert {b.index: b.label for b in bands} == labels  # the CSV's labels match the feed's ranges


def test_shipped_advisor_is_the_linux_gpu_subset(prices_dir):
    flat = read_spot_advisor_csv(prices_dir / "aws_spot_advisor_accelerators.csv")
    expected = sorted(r for r in flat if r.os == "Linux" and is_gpu_instance_type(r.instance_type))
    bands, rows = load_advisor()
    assert sorted(rows) == expected
    assert bands == tuple(read_spot_advisor_json(prices_dir / "aws_spot_advisor_2025-06-28.json")[0])


def test_band_rates_rise_with_the_band_and_come_from_the_fitted_model():
    from orbit_dagster.catalog.reclaim_model import load_reclaim_model

    bands = load_advisor()[0]
    rates = [b.reclaims_per_hour for b in bands]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)
    model = load_reclaim_model()
    for b in bands:
        assert b.low_pct < b.midpoint_pct < b.high_pct
        assert b.reclaims_per_hour == model.band_rate(b.index)
        # The naive monthly reading of a band, kept for comparison, reproduces its midpoint ...
        assert 1 - math.exp(-b.naive_reclaims_per_hour * HOURS_PER_MONTH) == pytest.approx(b.midpoint_pct / 100)
        # ... and is far below what the traces measured.
        assert b.reclaims_per_hour > 10 * b.naive_reclaims_per_hour
    assert [b.low_pct for b in bands[1:]] == [b.high_pct for b in bands[:-1]]  # contiguous


def test_prior_is_the_median_band_of_the_same_gpu():
    rows = [r for r in load_advisor()[1] if r.snapshot == advisor_snapshot()]
    h100 = sorted(r.band for r in rows if instance_gpus(r.instance_type)[0] == "H100")
    band, label = reliability_prior("H100")
    assert band.index == h100[(len(h100) - 1) // 2] and label.startswith("prior") and str(len(h100)) in label
    everything = sorted(r.band for r in rows)
    assert reliability_prior("RTX-PRO-6000")[0].index == everything[(len(everything) - 1) // 2]


def test_snapshot_follows_at():
    assert advisor_snapshot(datetime(2022, 5, 31)) == "2021-02-10"
    assert advisor_snapshot(datetime(2019, 1, 1)) == "2021-02-10"
    assert advisor_snapshot() == "2025-06-28"


def test_history_parser_reads_every_real_row(prices_dir):
    path = prices_dir / HISTORY
    rows = parse_spot_price_history(path)
    lines = [ln.split("\t") for ln in path.read_text().splitlines() if ln.strip()]
    assert len(rows) == len(lines)
    for r, ln in zip(rows, lines):
        assert (r.az_id, r.instance_type, r.usd_per_hour) == (ln[0], ln[1], float(ln[3]))
        assert r.timestamp.tzinfo == timezone.utc
    advisor_regions = {r.region for r in load_advisor()[1]}
    assert {r.region for r in rows} <= advisor_regions  # every AZ id decodes to a real region


@pytest.mark.parametrize("az, region", [("use1-az2", "us-east-1"), ("apne1-az4", "ap-northeast-1"),
                                        ("cac1-az1", "ca-central-1"), ("apse2-az3", "ap-southeast-2"),
                                        ("euw3-az2", "eu-west-3"), ("sae1-az1", "sa-east-1")])
def test_az_ids_decode(az, region):
    assert az_id_to_region(az) == region


def test_history_parser_names_the_bad_line(tmp_path):
    p = tmp_path / "h.tsv"
    p.write_text("use1-az1\tp3.2xlarge\tLinux/UNIX\t0.9\t2022-05-31T18:00:00+00:00\nuse1-az1\tp3.2xlarge\tLinux\n")
    with pytest.raises(CatalogError, match="line 2"):
        parse_spot_price_history(p)
    p.write_text("use1-az1\tp3.2xlarge\tLinux/UNIX\tcheap\t2022-05-31T18:00:00+00:00\n")
    with pytest.raises(CatalogError, match="line 1"):
        parse_spot_price_history(p)


def test_real_spot_prices_become_per_gpu_offers(prices_dir):
    rows = parse_spot_price_history(prices_dir / HISTORY)
    offers = {o.offer_id: o for o in aws_offers(spot_prices=rows)}
    priced = [r for r in latest_spot_prices(rows).values() if is_gpu_instance_type(r.instance_type)]
    assert priced
    for r in priced:
        o = offers[f"aws:{r.instance_type}:{r.az_id}"]
        assert o.usd_per_gpu_second_spot * 3600 * o.gpu_count == pytest.approx(r.usd_per_hour)
        assert o.region == r.region and o.zone == r.az_id and o.price_as_of == r.timestamp
        assert 0 < o.reliability < 1
    # a priced (region, type) is split by AZ: no regional offer left for it
    assert not any(f"aws:{r.instance_type}:{r.region}" in offers for r in priced)
    assert not any(o.instance_type.startswith("inf1") for o in offers.values())


def test_latest_price_wins_and_at_cuts_the_future():
    t1, t2 = datetime(2022, 5, 31, 18, tzinfo=timezone.utc), datetime(2022, 5, 31, 20, tzinfo=timezone.utc)
    rows = [SpotPrice("use1-az1", "p3.2xlarge", "Linux/UNIX", 0.9, t1),
            SpotPrice("use1-az1", "p3.2xlarge", "Linux/UNIX", 1.1, t2),
            SpotPrice("use1-az1", "p3.2xlarge", "Windows", 5.0, t2)]
    assert latest_spot_prices(rows)[("use1-az1", "p3.2xlarge")].usd_per_hour == 1.1
    assert latest_spot_prices(rows, datetime(2022, 5, 31, 19))[("use1-az1", "p3.2xlarge")].usd_per_hour == 0.9


def test_unpriced_aws_offers_carry_the_advisor_band():
    rows = [r for r in load_advisor()[1] if r.snapshot == advisor_snapshot()]
    offers = {o.offer_id: o for o in aws_offers()}
    r = next(r for r in rows if r.instance_type == "p5.48xlarge")
    o = offers[f"aws:p5.48xlarge:{r.region}"]
    assert o.usd_per_gpu_second_spot is None and o.gpu == "H100" and o.gpu_count == 8
    assert o.interruption_band == load_advisor()[0][r.band].label
    assert o.reliability == pytest.approx(math.exp(-load_advisor()[0][r.band].reclaims_per_hour))
    od = aws_offers(on_demand_usd_per_hour={(r.region, "p5.48xlarge"): 98.32})
    assert next(x for x in od if x.offer_id == o.offer_id).usd_per_gpu_second_on_demand * 3600 == pytest.approx(98.32 / 8)
