from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.reclaim_rate import RateBook, ReclaimRateEstimator, band_prior_rate

from .helpers import model


def test_prior_comes_from_the_band():
    m = model()
    est = ReclaimRateEstimator.from_band(">20%", m)
    assert est.rate_per_hour == pytest.approx(m.band_rates_per_hour["4"])
    assert est.mtbf_s == pytest.approx(3600 / m.band_rates_per_hour["4"])
    assert band_prior_rate(0, m) < band_prior_rate(4, m)


@settings(max_examples=100)
@given(st.integers(0, 50), st.integers(0, 50), st.floats(min_value=60, max_value=1e6))
def test_more_reclaims_over_the_same_exposure_means_a_higher_rate(r1, r2, exposure):
    a, b = ReclaimRateEstimator(0.5), ReclaimRateEstimator(0.5)
    lo, hi = sorted((r1, r2))
    a.observe(lo, exposure)
    b.observe(hi, exposure)
    assert a.rate_per_hour <= b.rate_per_hour
    assert a.mtbf_s >= b.mtbf_s > 0


@pytest.mark.parametrize("true_rate", [0.05, 0.5, 3.0])
def test_estimate_converges_to_the_true_rate(true_rate):
    rng = np.random.default_rng(11)
    est = ReclaimRateEstimator(0.49, prior_strength=1.1)
    for _ in range(400):  # 400 sessions of up-time, each ended by a reclaim
        est.observe(1, float(rng.exponential(3600 / true_rate)))
    assert est.rate_per_hour == pytest.approx(true_rate, rel=0.15)


def test_offer_priors_and_book():
    m = model()
    base = dict(provider="sim", instance_type="p3.2xlarge", gpu="V100", gpu_count=1)
    own = Offer(offer_id="a", reclaims_per_hour=2.0, **base)
    band = Offer(offer_id="b", interruption_band="<5%", **base)
    rel = Offer(offer_id="c", reliability=0.9, **base)
    unknown = Offer(offer_id="d", **base)
    od = Offer(offer_id="e", spot=False, **base)
    assert ReclaimRateEstimator.for_offer(own, m).rate_per_hour == pytest.approx(2.0)
    assert ReclaimRateEstimator.for_offer(band, m).rate_per_hour == pytest.approx(m.band_rate(0))
    assert ReclaimRateEstimator.for_offer(rel, m).rate_per_hour == pytest.approx(-np.log(0.9))
    assert ReclaimRateEstimator.for_offer(unknown, m).rate_per_hour == pytest.approx(m.band_rate(4))
    assert ReclaimRateEstimator.for_offer(od, m).rate_per_hour < 1e-4
    book = RateBook(model=m)
    book.for_offer(own)
    book.observe("a", 3, 3600)
    assert book.for_offer(own).reclaims == 3
    with pytest.raises(OrbitError, match="for_offer"):
        book.observe("zzz", 1, 1)


@pytest.mark.parametrize("args, field", [((-1, 10), "reclaims"), ((1, -10), "exposure_s"), ((1.5, 10), "reclaims")])
def test_bad_observations(args, field):
    with pytest.raises(OrbitError) as err:
        ReclaimRateEstimator(0.5).observe(*args)
    assert err.value.field == field


def test_bad_prior():
    with pytest.raises(OrbitError) as err:
        ReclaimRateEstimator(0.0)
    assert err.value.field == "prior_rate_per_hour"


def test_notice_reliability_is_a_beta_posterior_with_clear_errors():
    from orbit_dagster.policy.reclaim_rate import NOTICE_MISS_PRIOR, NoticeReliability
    n = NoticeReliability()
    assert n.miss_rate == pytest.approx(NOTICE_MISS_PRIOR)
    n.observe(98, 2)
    assert n.miss_rate == pytest.approx((2 * NOTICE_MISS_PRIOR + 2) / 100)
    assert n.as_record()["reclaims"] == 98
    for kw, field in ((dict(reclaims=-1, missed=0), "reclaims"), (dict(reclaims=1, missed=2), "missed"),
                      (dict(reclaims=True, missed=0), "reclaims")):
        with pytest.raises(OrbitError) as err:
            n.observe(**kw)
        assert err.value.field == field
    with pytest.raises(OrbitError) as err:
        NoticeReliability(prior_miss_rate=0.0)
    assert err.value.field == "prior_miss_rate"
