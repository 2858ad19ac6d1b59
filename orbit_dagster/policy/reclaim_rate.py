"""Online reclaim-rate estimate per offer or zone, starting from the spot-advisor band.

A Gamma-Poisson model: reclaims arrive at an unknown rate per hour of up-time; the prior
is a Gamma whose mean is the band's calibrated rate and whose shape (its weight, in
"pseudo-reclaims") is the zone-to-zone spread fitted by ``catalog.fit_reclaims``. Each
observation of ``reclaims`` over ``exposure_s`` seconds of instance time updates it
exactly; the estimate is the posterior mean. A zone that keeps its instances alive walks
away from the band's prior within a few reclaims' worth of exposure, which is the point.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from orbit_dagster.catalog.reclaim_model import ReclaimModel, band_code, load_reclaim_model
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer


def band_prior_rate(band: int | str, model: ReclaimModel | None = None) -> float:
    """Reclaims per hour of up-time for a spot-advisor band (code 0..4 or label like '>20%')."""
    return (model or load_reclaim_model()).band_rate(band_code(band))


@dataclass
class ReclaimRateEstimator:
    """Posterior Gamma(alpha, beta) over the reclaim rate per hour; ``observe`` updates it."""

    prior_rate_per_hour: float
    prior_strength: float = 1.0
    reclaims: int = 0
    exposure_s: float = 0.0
    source: str = "prior"
    _alpha0: float = field(init=False, repr=False)
    _beta0_h: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        r = self.prior_rate_per_hour
        if not isinstance(r, (int, float)) or math.isnan(r) or r <= 0:
            raise OrbitError("prior_rate_per_hour must be > 0", field="prior_rate_per_hour", value=r,
                             fix="pass the band's rate (band_prior_rate) or an observed rate")
        if not self.prior_strength > 0:
            raise OrbitError("prior_strength must be > 0", field="prior_strength", value=self.prior_strength,
                             fix="pass the prior's weight in pseudo-reclaims, e.g. the fitted zone_rate_alpha")
        self._alpha0 = float(self.prior_strength)
        self._beta0_h = self._alpha0 / float(r)

    @classmethod
    def from_band(cls, band: int | str, model: ReclaimModel | None = None) -> "ReclaimRateEstimator":
        m = model or load_reclaim_model()
        return cls(m.band_rate(band), prior_strength=m.zone_rate_alpha, source=f"band {band}")

    @classmethod
    def for_offer(cls, offer: Offer, model: ReclaimModel | None = None) -> "ReclaimRateEstimator":
        """Prior for an offer: its own rate, else its band, else its reliability, else the riskiest band.

        On-demand offers are never reclaimed by the market; they get a tiny rate (one reclaim
        in ~11 years) so that MTBF stays finite and the formulas stay well defined.
        """
        m = model or load_reclaim_model()
        if not offer.spot:
            return cls(1e-5, prior_strength=1e6, source="on-demand")
        if offer.reclaims_per_hour is not None and offer.reclaims_per_hour > 0:
            return cls(offer.reclaims_per_hour, prior_strength=m.zone_rate_alpha, source="offer.reclaims_per_hour")
        if offer.interruption_band:
            return cls.from_band(offer.interruption_band, m)
        if offer.reliability is not None and 0 < offer.reliability < 1:
            return cls(-math.log(offer.reliability), prior_strength=m.zone_rate_alpha, source="offer.reliability")
        return cls(m.band_rate(4), prior_strength=m.zone_rate_alpha, source="no risk data: riskiest band")

    def observe(self, reclaims: int, exposure_s: float) -> None:
        """Add ``reclaims`` seen over ``exposure_s`` seconds of instance up-time."""
        if isinstance(reclaims, bool) or not isinstance(reclaims, int) or reclaims < 0:
            raise OrbitError("reclaims must be an integer >= 0", field="reclaims", value=reclaims,
                             fix="count the reclaims in the observed window")
        if not isinstance(exposure_s, (int, float)) or math.isnan(exposure_s) or exposure_s < 0:
            raise OrbitError("exposure_s must be >= 0", field="exposure_s", value=exposure_s,
                             fix="pass the seconds of instance up-time observed")
        self.reclaims += reclaims
        self.exposure_s += float(exposure_s)

    @property
    def rate_per_hour(self) -> float:
        return (self._alpha0 + self.reclaims) / (self._beta0_h + self.exposure_s / 3600.0)

    @property
    def mtbf_s(self) -> float:
        """Mean seconds of up-time between reclaims (posterior mean rate inverted)."""
        return 3600.0 / self.rate_per_hour

    def as_record(self) -> dict:
        return {"rate_per_hour": round(self.rate_per_hour, 6), "mtbf_s": round(self.mtbf_s, 1),
                "reclaims": self.reclaims, "exposure_s": round(self.exposure_s, 1),
                "prior_rate_per_hour": self.prior_rate_per_hour, "prior_strength": self.prior_strength,
                "source": self.source}


@dataclass
class RateBook:
    """One estimator per key (offer id or zone), created from a prior on first use."""

    model: ReclaimModel | None = None
    estimators: dict[str, ReclaimRateEstimator] = field(default_factory=dict)

    def for_offer(self, offer: Offer, key: str | None = None) -> ReclaimRateEstimator:
        k = key or offer.offer_id
        if k not in self.estimators:
            self.estimators[k] = ReclaimRateEstimator.for_offer(offer, self.model)
        return self.estimators[k]

    def observe(self, key: str, reclaims: int, exposure_s: float) -> None:
        if key not in self.estimators:
            raise OrbitError(f"no estimator for {key!r}", field="key", value=key,
                             fix="call for_offer(offer) before observe(...)")
        self.estimators[key].observe(reclaims, exposure_s)


#: Prior share of reclaims that come without a usable notice (AWS documents its notice as
#: best effort; no public trace records notices). An assumption, not fitted: weak on purpose
#: (``NOTICE_PRIOR_WEIGHT`` reclaims' worth), so the fleet's own record overrides it quickly.
NOTICE_MISS_PRIOR = 0.05
NOTICE_PRIOR_WEIGHT = 2.0


@dataclass
class NoticeReliability:
    """Beta posterior of the share of reclaims whose notice never arrives (per cloud or zone).

    The control plane learns this from its own record: every reclaim of an instance it held
    either was preceded by a notice event or was not. ``miss_rate`` is the posterior mean.
    """

    prior_miss_rate: float = NOTICE_MISS_PRIOR
    prior_weight: float = NOTICE_PRIOR_WEIGHT
    reclaims: int = 0
    missed: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.prior_miss_rate < 1):
            raise OrbitError("prior_miss_rate must be in (0, 1)", field="prior_miss_rate",
                             value=self.prior_miss_rate, fix="pass the share of reclaims expected without notice")
        if not self.prior_weight > 0:
            raise OrbitError("prior_weight must be > 0", field="prior_weight", value=self.prior_weight,
                             fix="pass the prior's weight in reclaims, e.g. 2")

    def observe(self, reclaims: int, missed: int) -> None:
        """Add ``reclaims`` reclaims, ``missed`` of which came without a notice."""
        for name, v in (("reclaims", reclaims), ("missed", missed)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise OrbitError(f"{name} must be an integer >= 0", field=name, value=v, fix="count reclaims")
        if missed > reclaims:
            raise OrbitError("missed must be <= reclaims", field="missed", value=missed,
                             fix=f"pass at most {reclaims} missed notices")
        self.reclaims += reclaims
        self.missed += missed

    @property
    def miss_rate(self) -> float:
        return (self.prior_weight * self.prior_miss_rate + self.missed) / (self.prior_weight + self.reclaims)

    def as_record(self) -> dict:
        return {"miss_rate": round(self.miss_rate, 6), "reclaims": self.reclaims, "missed": self.missed,
                "prior_miss_rate": self.prior_miss_rate, "prior_weight": self.prior_weight}
