"""Dispatch's one ranking of offers (`control.placement.rank_placement`), on the shipped catalog."""
from __future__ import annotations

import pytest

from orbit_dagster.catalog import PROVIDER_NOTICE_S
from orbit_dagster.catalog.listing import list_offers
from orbit_dagster.control.placement import rank_placement
from orbit_dagster.policy.offer_choice import RESTORE_PRIOR_S, SAVE_PRIOR_S, NoOfferMatches, rank_offers
from orbit_dagster.policy.reclaim_rate import RateBook


@pytest.fixture(scope="module")
def h100():
    return list_offers(gpu="H100")


def _order(decision) -> list[str]:
    return [s.offer.offer_id for s in decision.ranked]


def test_a_compressed_market_ranks_as_the_real_one_would(h100):
    """Ten wall minutes at 60x are ten market hours; a 2 s wall notice is 120 market seconds
    (saves are market seconds already: `measured_save_seconds` scales its measurement)."""
    save_s = 60.0
    unseen = rank_placement(h100, save_s=save_s, notice_s=120.0)
    spot = [s.offer for s in unseen.ranked if s.offer.spot][:3]  # the favourites, seen reclaimed
    wall = rank_placement(h100, save_s=save_s, notice_s=2.0, scale=60.0,
                          observed={o.offer_id: (5, 10.0 / 60.0) for o in spot})
    real = rank_placement(h100, save_s=save_s, notice_s=120.0, scale=1.0,
                          observed={o.offer_id: (5, 10.0) for o in spot})
    assert wall.as_record() == real.as_record()
    unscaled = rank_placement(h100, save_s=save_s, notice_s=2.0, scale=1.0,
                              observed={o.offer_id: (5, 10.0 / 60.0) for o in spot})
    assert _order(unscaled) != _order(real)  # wall figures read as market ones rank differently


def test_it_is_the_policy_ranking_with_what_the_ledger_saw(h100):
    favourite = rank_offers(h100, save_s=30.0, restore_s=RESTORE_PRIOR_S, notice_s=PROVIDER_NOTICE_S).chosen
    book = RateBook()
    book.for_offer(favourite).observe(30, 10 * 3600.0)
    expected = rank_offers(h100, save_s=30.0, restore_s=RESTORE_PRIOR_S, notice_s=PROVIDER_NOTICE_S, rates=book)
    got = rank_placement(h100, save_s=30.0, notice_s=PROVIDER_NOTICE_S, observed={favourite.offer_id: (30, 10.0)})
    assert _order(got) == _order(expected) and got.chosen.offer_id != favourite.offer_id


def test_measured_tflops_count_by_offer_id(h100):
    last = rank_placement(h100, save_s=SAVE_PRIOR_S, notice_s=PROVIDER_NOTICE_S).ranked[-1].offer
    boosted = rank_placement(h100, save_s=SAVE_PRIOR_S, notice_s=PROVIDER_NOTICE_S, measured={last.offer_id: 1e6})
    assert boosted.chosen.offer_id == last.offer_id and boosted.chosen.effective_tflops == 1e6


def test_a_request_nothing_meets_names_the_requirement(h100):
    with pytest.raises(NoOfferMatches) as err:
        rank_placement(h100, save_s=SAVE_PRIOR_S, notice_s=PROVIDER_NOTICE_S, gpu_count=4096)
    assert err.value.field == "gpu_count"
