"""`offer_catalog`: every provider's offers in $ per effective TFLOP-hour; changes as events."""
import dagster as dg

from ..control.discovery import refresh_catalog
from ..resources import OrbitResource


@dg.asset(group_name="catalog", kinds={"python"},
          description="Offers from real prices and GPU specs, ranked by $ per effective TFLOP-hour; "
                      "new/removed types and price moves since the last refresh are ledger events.")
def offer_catalog(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:  # noqa: ARG001
    report = refresh_catalog(orbit.settings())
    return dg.MaterializeResult(metadata={
        "offers": report["offers"],
        "cheapest": report["cheapest"] or "",
        "changes": dg.MetadataValue.json(report["changes"]),
        "first_refresh": report["first_refresh"],
    })
