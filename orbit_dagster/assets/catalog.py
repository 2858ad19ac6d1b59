"""`offer_catalog`: every source's offers (the providers' shapes and the shipped price catalog), the change set
since the last refresh, and the check that no unfinished job relies on an offer that is gone."""
import dagster as dg

from ..control.discovery import refresh_catalog
from ..resources import OrbitResource
from .metadata import table

IN_USE_CHECK = dg.AssetCheckSpec(
    "offers_in_use_listed", asset="offer_catalog",
    description="Every offer an unfinished job or a running instance relies on is still listed by its provider.")
CHANGE_COLUMNS = [("kind", "string", "type_added/removed, offer_added/removed, price_changed"),
                  ("source", "string", "who was asked: catalog, sim, ssh, aws"), ("offer_id", "string", ""),
                  ("instance_type", "string", ""), ("market", "string", "on_demand or spot (price changes)"),
                  ("old_usd_per_gpu_hour", "float", ""), ("new_usd_per_gpu_hour", "float", ""),
                  ("change_pct", "float", "")]


@dg.asset(group_name="catalog", kinds={"python"}, check_specs=[IN_USE_CHECK],
          description="Each provider asked for its shapes (the embedded market's catalog, the SSH inventory, EC2's "
                      "describe_instance_types) and the shipped price catalog, diffed against the stored catalog; "
                      "the change set is recorded in the ledger (catalog_changes) and shown here.")
def offer_catalog(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:
    report = refresh_catalog(orbit.settings())
    for source, answer in report["sources"].items():
        if answer["status"] == "failed":
            context.log.warning(f"offer discovery: {source} did not answer ({answer['error']}); its previous "
                                f"{answer['offers']} offers are kept")
    missing = report["missing_in_use"]
    return dg.MaterializeResult(
        metadata={
            "offers": report["offers"],
            "cheapest": report["cheapest"] or "",
            "changes": dg.MetadataValue.json(report["changes"]),
            "sources": dg.MetadataValue.json(report["sources"]),
            "first_refresh": report["first_refresh"],
            "refresh_id": report["refresh_id"],
            "change_set": table(report["change_set"][:500], CHANGE_COLUMNS),
        },
        check_results=[dg.AssetCheckResult(
            check_name=IN_USE_CHECK.name, passed=not missing, severity=dg.AssetCheckSeverity.ERROR,
            metadata={"in_use": len(report["in_use"]),
                      "missing": dg.MetadataValue.json(missing),
                      "detail": "; ".join(f"job {m['job_id']} relies on {m['offer_id']}, no longer listed"
                                          for m in missing) or "every offer in use is listed"})],
    )
