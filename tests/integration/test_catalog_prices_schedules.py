"""Offer discovery, the price feed, the TFLOPS probe at first launch, and the schedules."""
import json
import subprocess
import sys
import threading
from datetime import datetime, timezone

import dagster as dg

from orbit_dagster.catalog.listing import list_offers
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.discovery import refresh_catalog
from orbit_dagster.control.placement import rank_for
from orbit_dagster.control.prices import ingest_prices
from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.core.execution import ExecutionRequest, Resources
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.sim.provider import SimProvider
from orbit_dagster.resources import OrbitResource
from orbit_dagster.schedules.backfill import eval_backfill_sensor
from orbit_dagster.settings import Settings
from tests.helpers import wait_for


def test_discovery_records_what_changed_between_two_refreshes(orbit_home):
    settings = Settings.from_env(orbit_home)
    first = refresh_catalog(settings, at=datetime(2024, 6, 1, tzinfo=timezone.utc))
    assert first["first_refresh"] and first["offers"] > 100 and not first["changes"]
    second = refresh_catalog(settings, at=datetime(2026, 7, 30, tzinfo=timezone.utc))
    assert second["changes"].get("price_changed", 0) > 0
    rows = settings.ledger().rows("SELECT * FROM catalog_changes WHERE refresh_id = ?", [second["refresh_id"]])
    kinds = {r["kind"] for r in rows}
    assert "price_changed" in kinds and sum(second["changes"].values()) == len(rows)
    assert {r["source"] for r in rows} == {"catalog"}  # the embedded market's shapes did not change
    # A g2-standard-4 spot price that fell over those two years, recorded with both figures.
    moves = rows
    g2 = [m for m in moves if m.get("offer_id") == "gce:g2-standard-4:europe-north1" and m.get("market") == "spot"]
    assert g2 and g2[0]["new_usd_per_gpu_hour"] < g2[0]["old_usd_per_gpu_hour"]


def test_price_feed_ingests_ticks_and_flags_a_job_over_its_max_price(orbit_home):
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    # Admitted at today's price ($0.0772/GPU-h for the cheapest L4), while the feed replays
    # the history from 2024, when it cost $0.2335: the job is flagged.
    job = submit(settings, "charlm-finetune", {"config.steps": 2000, "max_price_per_gpu_hour": 0.08})
    runner = threading.Thread(target=run_attempt, args=(settings, job), daemon=True)
    runner.start()
    wait_for(lambda: (R.job(ledger, job) or {}).get("state") == "RUNNING", what="the job running")
    report = ingest_prices(settings, None)
    offer = ledger.scalar("SELECT offer_id FROM runs WHERE job_id = ?", [job])
    assert report.ticks > 0 and ledger.scalar("SELECT count(*) FROM price_ticks WHERE offer_id = ?", [offer]) > 0
    assert [f["job_id"] for f in report.flagged] == [job]
    assert ingest_prices(settings, datetime.now(timezone.utc)).flagged == []  # flagged once per attempt
    # The first instance of the offer ran the TFLOPS probe; a CPU figure never ranks a GPU offer.
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM metric_points WHERE job_id = ?", [job]), what="training")
    probe = ledger.rows("SELECT detail FROM events WHERE kind = 'host_probe' AND job_id = ?", [job])
    assert probe and json.loads(probe[0]["detail"])["tflops"] > 0
    cancel(settings, job)
    runner.join(60)
    assert R.require_job(ledger, job)["state"] == "CANCELLED"
    assert ledger.scalar("SELECT count(*) FROM instance_usage WHERE job_id = ? AND running", [job]) == 0


def test_eval_backfill_launches_a_dagster_backfill_of_exactly_the_missing_pairs(orbit_home):
    import time

    from orbit_dagster.assets.partitions import checkpoint_key_of
    from orbit_dagster.control.backfill import plan_backfill
    from orbit_dagster.definitions import defs
    from orbit_dagster.deploy.instance import dagster_instance

    settings = Settings.from_env(orbit_home)
    job = submit(settings, "charlm-finetune", {"config.steps": 12, "checkpoint.every_steps": 4})
    assert run_attempt(settings, job).state == "SUCCEEDED"
    ledger = settings.ledger()
    keys = [r["checkpoint_key"] for r in ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE job_id = ? "
                                                      "ORDER BY step", [job])]
    assert plan_backfill(settings) == {}  # PENDING: the evaluation sensor's, not the backfill's
    # One failed hours ago (retried by the backfill), one never asked for (a suite added later),
    # one evaluated already (left alone).
    with ledger.write() as tx:
        tx.execute("UPDATE evaluations SET state = 'FAILED', finished_at = ? WHERE checkpoint_key = ?",
                   [time.time() - 7 * 3600, keys[0]])
        tx.execute("DELETE FROM evaluations WHERE checkpoint_key = ?", [keys[1]])
        tx.execute("UPDATE evaluations SET state = 'SUCCEEDED' WHERE checkpoint_key = ?", [keys[2]])
    with dagster_instance(settings) as instance:
        with dg.build_sensor_context(instance=instance, repository_def=defs.get_repository_def(),
                                     resources={"orbit": OrbitResource(home=str(orbit_home))}) as context:
            result = eval_backfill_sensor(context)
    [request] = result.run_requests
    assert request.requires_backfill_daemon() and request.tags["orbit/suite"] == "heldout@v1"
    subset = request.asset_graph_subset
    [(asset, partitions)] = subset.partitions_subsets_by_asset_key.items()
    assert asset == dg.AssetKey("evaluation")
    assert sorted(checkpoint_key_of(p) for p in partitions.get_partition_keys()) == sorted(keys[:2])
    states = {r["checkpoint_key"]: r["state"] for r in ledger.rows("SELECT checkpoint_key, state FROM evaluations")}
    assert states == {keys[0]: "BACKFILL", keys[1]: "BACKFILL", keys[2]: "SUCCEEDED"}


def test_orbit_offers_json_lists_gce_h100_with_prices_and_reliability(orbit_home):
    out = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", "offers", "--gpu", "H100", "--json"],
                         capture_output=True, text=True, env={"ORBIT_HOME": str(orbit_home), "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    offers = json.loads(out.stdout)["offers"]
    gce = [o for o in offers if o["provider"] == "gce"]
    assert gce and all(o["gpu"].startswith("H100") for o in offers)
    assert all(o["usd_per_gpu_hour_on_demand"] and o["usd_per_gpu_hour_spot"] and 0 < o["reliability"] <= 1 for o in gce)
    ranked = [o["usd_per_useful_pflop"] for o in offers]  # dispatch's order (policy.offer_choice.rank_offers)
    assert ranked == sorted(ranked) and all(o["reason"] for o in offers)


def _seen_reclaimed(ledger, offers, *, reclaims: int, hours: float, save_s: float) -> None:
    """The ledger's record of `offers` each reclaimed `reclaims` times in `hours` of spot up-time,
    and of a durable save of `save_s` (what dispatch and `orbit offers` read from it)."""
    instances, runs, t0 = [], [], 1.7e9
    for o in offers:
        for i in range(reclaims):
            iid = f"{o.offer_id}/i{i}"
            instances.append({"instance_id": iid, "provider": o.provider, "offer_id": o.offer_id, "spot": 1,
                              "gpu": o.gpu, "gpu_count": o.gpu_count, "usd_per_second": o.usd_per_second,
                              "purpose": "train", "job_id": "seen", "started_at": t0,
                              "stopped_at": t0 + hours * 3600.0 / reclaims})
            runs.append({"run_id": f"seen#{iid}", "job_id": "seen", "attempt": i, "instance_id": iid,
                         "offer_id": o.offer_id, "state": "LOST", "failure_class": "reclaim"})
    ledger.commit({"jobs": [{"job_id": "seen", "template": "charlm-finetune", "state": "FAILED"}],
                   "instances": instances, "runs": runs,
                   "checkpoints": [{"checkpoint_key": "seen/a0/1", "job_id": "seen", "step": 1,
                                    "save_seconds": save_s, "registered_at": t0}]})


def test_orbit_offers_json_lists_offers_in_the_order_dispatch_chooses_them(orbit_home):
    """The same request (2 x H100, a 30 s notice) over the shipped catalog: `orbit offers --json`
    lists exactly the order dispatch's `rank_for` tries, with what the ledger saw folded in."""
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    provider = SimProvider(orbit_home / "catalog-market", offers=list_offers(gpu="H100"), notice_seconds=30.0)
    request = ExecutionRequest(resources=Resources(gpu="H100", gpu_count=2))

    def dispatch_order() -> list[str]:
        ranked, _ = rank_for(ledger, provider, request, job_id="j", attempt=1, notice_s=provider.notice_seconds,
                             template="charlm-finetune")
        return [o.offer_id for o in ranked]

    def orbit_offers() -> dict:
        out = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", "offers", "--gpu", "H100", "--gpu-count", "2",
                              "--notice-seconds", "30", "--json"], capture_output=True, text=True,
                             env={"ORBIT_HOME": str(orbit_home), "PATH": ""}, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    unseen = dispatch_order()
    favourites = [o for o in provider.list_offers() if o.offer_id in unseen[:6] and o.spot][:2]
    assert len(favourites) == 2
    _seen_reclaimed(ledger, favourites, reclaims=20, hours=10.0, save_s=45.0)
    order = dispatch_order()
    assert order != unseen and order[0] not in {o.offer_id for o in favourites}  # what the ledger saw counts
    doc = orbit_offers()
    assert [r["offer_id"] for r in doc["offers"]] == order
    assert doc["inputs"]["save_s"] == 45.0 and doc["inputs"]["gpu_count"] == 2
