"""The catalog's listing (filters, observations, diffs) and the `orbit offers` output over it."""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import pytest

from orbit_dagster.catalog import CatalogError
from orbit_dagster.catalog.gce import gce_offers
from orbit_dagster.catalog.gpus import UnknownGpu
from orbit_dagster.catalog.listing import (
    MIN_EXPOSURE_HOURS,
    diff_catalogs,
    list_offers,
    offers_json,
    usd_per_effective_tflop_hour,
    usd_per_gpu_hour,
)
from orbit_dagster.cli.offers import offers_document, offers_table
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.offer_choice import SAVE_PRIOR_S


def orbit_offers_output(gpu, max_price, as_json, save_s=SAVE_PRIOR_S, **kw):
    """What `orbit offers` prints for a ledger that saw `observed`/`measured` (cli/commands.py)."""
    doc = offers_document(gpu=gpu, max_price=max_price, save_s=save_s, **kw)
    return json.dumps(doc) if as_json else offers_table(doc)

UTC = timezone.utc


@pytest.fixture(scope="module")
def catalog():
    return list_offers()


def test_a_listing_comes_in_offer_id_order(catalog):
    # A listing, not a ranking: the one ranking is dispatch's (control.placement.rank_placement).
    assert [o.offer_id for o in catalog] == sorted(o.offer_id for o in catalog)
    assert {o.provider for o in catalog} == {"gce", "aws"}
    assert len({o.offer_id for o in catalog}) == len(catalog) > 100


def test_dollars_per_effective_tflop_hour_is_price_over_tflops(catalog):
    o = next(x for x in catalog if usd_per_gpu_hour(x) is not None and x.spec_tflops_bf16)
    price = (o.usd_per_gpu_second_spot if o.spot else o.usd_per_gpu_second_on_demand) * 3600
    assert usd_per_gpu_hour(o) == pytest.approx(price)
    assert usd_per_effective_tflop_hour(o) == pytest.approx(price / o.spec_tflops_bf16)
    row = next(r for r in offers_json([o]))
    assert row["usd_per_effective_tflop_hour"] == pytest.approx(price / o.spec_tflops_bf16, rel=1e-5)


def test_gpu_filter_uses_families_and_aliases():
    assert {o.gpu for o in list_offers(gpu="A100")} == {"A100-40G", "A100-80G"}
    assert {o.gpu for o in list_offers(gpu="a100-80gb")} == {"A100-80G"}
    with pytest.raises(UnknownGpu) as e:
        list_offers(gpu="GTX 9090")
    assert "H100" in str(e.value) and "A100-80G" in str(e.value) and e.value.field == "gpu"


def test_max_price_keeps_known_prices_under_the_cap(catalog):
    cap = 1.5
    kept = list_offers(max_price_per_gpu_hour=cap)
    assert kept and all(usd_per_gpu_hour(o) <= cap for o in kept)
    expected = {o.offer_id for o in catalog if usd_per_gpu_hour(o) is not None and usd_per_gpu_hour(o) <= cap}
    assert {o.offer_id for o in kept} == expected


@pytest.mark.parametrize("bad", [0, -1, "cheap", float("nan")])
def test_bad_max_price_is_refused(bad):
    with pytest.raises(CatalogError) as e:
        list_offers(max_price_per_gpu_hour=bad)
    assert e.value.field == "max_price_per_gpu_hour"


def test_unknown_provider_is_refused():
    with pytest.raises(CatalogError, match="gce, aws"):
        list_offers(providers=("azure",))


def test_on_demand_offers_have_reliability_one():
    # in mid-2022 GCE sold several A100 machines without a spot price
    on_demand = [o for o in list_offers(providers=("gce",), at=datetime(2022, 6, 1)) if not o.spot]
    assert on_demand and all(o.reliability == 1.0 and o.usd_per_gpu_second_spot is None for o in on_demand)
    assert usd_per_gpu_hour(on_demand[0]) == pytest.approx(on_demand[0].usd_per_gpu_second_on_demand * 3600)


def test_observed_reclaims_replace_the_prior():
    spot = next(o for o in list_offers(gpu="H100", providers=("gce",)) if o.spot)
    seen = list_offers(gpu="H100", providers=("gce",), observed={spot.offer_id: (3, 30.0)})
    o = next(x for x in seen if x.offer_id == spot.offer_id)
    assert o.reclaims_per_hour == pytest.approx(0.1) and o.reliability == pytest.approx(math.exp(-0.1))
    assert o.reliability_source.startswith("observed")
    short = list_offers(gpu="H100", providers=("gce",),
                        observed={spot.offer_id: (1, MIN_EXPOSURE_HOURS / 2)})
    assert next(x for x in short if x.offer_id == spot.offer_id).reliability == spot.reliability
    with pytest.raises(CatalogError) as e:
        list_offers(gpu="H100", providers=("gce",), observed={spot.offer_id: (-1, 5)})
    assert e.value.field == "observed"


def test_measured_tflops_replace_the_spec():
    offers = list_offers(gpu="L4", providers=("gce",))
    o = offers[-1]
    boosted = list_offers(gpu="L4", providers=("gce",), measured={o.offer_id: 1e6})
    assert next(x for x in boosted if x.offer_id == o.offer_id).effective_tflops == 1e6
    halved = list_offers(gpu="L4", providers=("gce",), measured={"L4": 60.5})
    assert all(o.measured_tflops == 60.5 for o in halved)
    with pytest.raises(CatalogError):
        list_offers(gpu="L4", measured={"L4": -3})


def test_measured_tflops_reorder_what_orbit_offers_shows():
    doc = offers_document(gpu="L4", save_s=SAVE_PRIOR_S)
    last = doc["offers"][-1]["offer_id"]
    boosted = offers_document(gpu="L4", save_s=SAVE_PRIOR_S, measured={last: 1e6})
    assert boosted["offers"][0]["offer_id"] == last and boosted["offers"][0]["measured_tflops"] == 1e6


def test_acceptance_orbit_offers_gpu_h100_json():
    doc = json.loads(orbit_offers_output("H100", None, True))
    gce = [r for r in doc["offers"] if r["provider"] == "gce"]
    assert gce and all(r["gpu"] == "H100" for r in doc["offers"])
    priced = [r for r in gce if r["usd_per_gpu_hour_spot"] is not None]
    assert priced
    for r in priced:
        assert r["usd_per_gpu_hour_on_demand"] > r["usd_per_gpu_hour_spot"] > 0
        assert 0 < r["reliability"] <= 1 and r["reliability_source"]
    assert doc["ranked_by"] == "usd_per_useful_pflop"
    assert [r["rank"] for r in doc["offers"]] == list(range(1, len(doc["offers"]) + 1))
    assert all(r["reason"] for r in doc["offers"] + doc["not_ranked"])


def test_json_rows_round_trip_the_offer_prices():
    offers = gce_offers(datetime(2025, 1, 1, tzinfo=UTC))[:20]
    for o, r in zip(offers, offers_json(offers)):
        assert r["usd_per_gpu_hour_on_demand"] == pytest.approx(o.usd_per_gpu_second_on_demand * 3600, rel=1e-5)
        assert r["offer_id"] == o.offer_id and r["gpu_count"] == o.gpu_count
    json.dumps(offers_json(offers))  # plain types only


def test_table_lists_the_ranking_in_order_with_a_legend():
    doc = offers_document(gpu="H100", save_s=SAVE_PRIOR_S)
    lines = offers_table(doc).splitlines()
    assert lines[0].split()[:3] == ["#", "offer", "gpu"]
    assert [ln.split()[1] for ln in lines[1:6]] == [r["offer_id"] for r in doc["offers"][:5]]
    assert f"{len(doc['offers'])} ranked" in lines[-1] and "ranked as dispatch ranks" in lines[-1]
    assert orbit_offers_output("H100", 0.0001, False) == "no offers match"


def test_diff_between_two_real_dates_reports_removals_and_moves():
    old = gce_offers(datetime(2023, 5, 1, tzinfo=UTC))
    new = gce_offers(datetime(2023, 5, 10, tzinfo=UTC))
    events = diff_catalogs(old, new)
    removed = {e["offer_id"] for e in events if e["kind"] == "offer_removed"}
    assert "gce:a2-ultragpu-2g:asia-east1" in removed
    assert {"kind": "type_removed", "provider": "gce", "instance_type": "a2-ultragpu-2g"} in events
    assert diff_catalogs(new, new) == []
    # a price move between two dates, against an independent comparison of the offers
    a, b = gce_offers(datetime(2024, 6, 1, tzinfo=UTC)), gce_offers(datetime(2025, 6, 1, tzinfo=UTC))
    moves = [e for e in diff_catalogs(a, b) if e["kind"] == "price_changed" and e["market"] == "spot"]
    bi = {o.offer_id: o for o in b}
    expected = {o.offer_id for o in a if o.offer_id in bi and o.usd_per_gpu_second_spot is not None
                and bi[o.offer_id].usd_per_gpu_second_spot is not None
                and round(o.usd_per_gpu_second_spot * 3600, 5) != round(bi[o.offer_id].usd_per_gpu_second_spot * 3600, 5)}
    assert expected and expected <= {e["offer_id"] for e in moves}
    big = diff_catalogs(a, b, min_change_pct=20)
    assert all(abs(e["change_pct"]) > 20 for e in big if e["kind"] == "price_changed" and e["change_pct"] is not None)
    assert diff_catalogs(offers_json(a), offers_json(b)) == diff_catalogs(a, b)  # persisted JSON works too
    with pytest.raises(CatalogError):
        diff_catalogs([{"provider": "gce"}], [])


def test_orbit_offers_shows_the_ranking_dispatch_uses():
    """The first offer `orbit offers` shows is the one rank_offers (dispatch) chooses from the same inputs."""
    from orbit_dagster.catalog import PROVIDER_NOTICE_S
    from orbit_dagster.policy.offer_choice import RESTORE_PRIOR_S, rank_offers
    from orbit_dagster.policy.reclaim_rate import RateBook

    offers = list_offers(gpu="H100")
    unseen = rank_offers(offers, gpu="any", save_s=60.0, restore_s=RESTORE_PRIOR_S, notice_s=PROVIDER_NOTICE_S)
    first = unseen.chosen.offer_id
    favourite = unseen.chosen
    observed = {first: (30, 10.0)}  # the ledger saw the catalog's favourite reclaimed 3 times an hour
    doc = json.loads(orbit_offers_output("H100", None, True, observed=observed, save_s=60.0))
    book = RateBook()
    book.for_offer(favourite).observe(30, 36000.0)
    d = rank_offers(offers, gpu="any", save_s=60.0, restore_s=RESTORE_PRIOR_S, notice_s=PROVIDER_NOTICE_S, rates=book)
    assert [r["offer_id"] for r in doc["offers"]] == [s.offer.offer_id for s in d.ranked]
    assert doc["offers"][0]["offer_id"] == d.chosen.offer_id != first
    mine = next(r for r in doc["offers"] if r["offer_id"] == first)
    assert mine["expected_reclaims_per_hour"] > 2 and "reclaims/h" in mine["reason"]
    table = orbit_offers_output("H100", None, False, observed=observed, save_s=60.0)
    assert table.splitlines()[1].split()[1] == d.chosen.offer_id and "ranked as dispatch ranks" in table


def test_orbit_offers_refuses_bad_inputs():
    with pytest.raises(OrbitError) as err:
        orbit_offers_output("H100", None, False, save_s=-1)
    assert err.value.field == "save_s"
    with pytest.raises(OrbitError) as err:
        orbit_offers_output("H100", None, False, gpu_count=0)
    assert err.value.field == "gpu_count"
