"""`advice`: which offers' share of the work to raise or lower, with the counterfactual behind it (docs/cost.md)."""
import dagster as dg

from ..control.advice import TooLittleHistory, advise
from ..resources import OrbitResource
from .metadata import table

OFFER_COLUMNS = [
    ("offer_id", "string", "the offer"), ("share", "float", "its share of the last jobs' work"),
    ("exposure_hours", "float", "recorded spot up-time (market hours)"), ("reclaims", "int", "reclaims recorded"),
    ("reclaims_per_hour", "float", "reclaims per hour of up-time"),
    ("rate_low", "float", "90% interval, low"), ("rate_high", "float", "90% interval, high"),
    ("usd_per_hour", "float", "instance price last paid"),
    ("usd_per_job", "float", "replayed cost of one job of the mean size"),
    ("finished", "string", "replayed jobs finished"), ("simulate", "string", "the orbit simulate command reproducing it"),
]
REC_COLUMNS = [
    ("action", "string", "raise, lower or keep"), ("offer_id", "string", "the offer"),
    ("share", "float", "its share of the last jobs' work"), ("to_share", "float", "the share advised"),
    ("saved_usd", "float", "what that would have saved on the last jobs"),
    ("saved_low", "float", "the saving with the reclaim rates at their interval's ends, low"),
    ("saved_high", "float", "... high"), ("confidence", "string", "high, or low with why"),
]


@dg.asset(
    deps=["cost_efficiency"],
    group_name="cost",
    kinds={"python"},
    description="Per GPU shape: the offers the last jobs could have used, each replayed on its recorded spot "
                "availability with the policy production runs; which share to raise or lower and what it would have "
                "saved, with evidence and uncertainty; none on too little history (docs/cost.md).",
)
def advice(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:
    try:
        doc = advise(orbit.settings())
    except TooLittleHistory as exc:
        context.log.info(f"no advice: {exc}")
        return dg.MaterializeResult(metadata={"advised": False, "refused": str(exc)})
    offers = [{**o, "rate_low": o["rate_interval"][0], "rate_high": o["rate_interval"][1],
               "usd_per_job": o["simulated"]["cost_usd"],
               "finished": f"{o['simulated']['finished']}/{o['simulated']['jobs']}"} for o in doc["offers"]]
    recs = [{**r, "saved_low": r["saved_interval"][0], "saved_high": r["saved_interval"][1]}
            for r in doc["recommendations"]]
    s = doc["scope"]
    return dg.MaterializeResult(metadata={
        "advised": bool(recs),
        "scope": f"{s['of']}: the last {s['jobs']} jobs on {s['gpu']} x{s['gpus_per_instance']}, "
                 f"{s['mean_job_hours']:.3g} h of work each on average",
        "saved_usd": dg.MetadataValue.float(recs[0]["saved_usd"] if recs else 0.0),
        "recommendations": table(recs, REC_COLUMNS),
        "offers": table(offers, OFFER_COLUMNS),
        "evidence": dg.MetadataValue.md("\n".join(f"- **{r['action']} {r['offer_id']}**: {r['evidence']}; "
                                                  f"{r['uncertainty']}" for r in recs) or doc.get("refused", "")),
    })
