"""The run coordinator `dagster.yaml` names puts a run launched from the UI into its provider's pool:
a real Dagster instance from the rendered `dagster.yaml`, a real ledger, the code location
loaded as a workspace, runs created and submitted as the webserver and the backfill daemon
do (the implicit asset job, an asset selection, Dagster's partition tags)."""
from datetime import datetime, timezone

import dagster as dg
import pytest
from dagster._core.test_utils import in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings

pytestmark = pytest.mark.integration


def new_job(ledger, job_id: str, placement: str) -> None:
    with ledger.write() as tx:
        R.insert_job(tx, {"job_id": job_id, "experiment": "e", "project": "p", "placement": placement,
                          "created_at": datetime.now(timezone.utc)},
                     [R.state_row(job_id, 1, JobState.CREATED), R.state_row(job_id, 1, JobState.QUEUED)])


def test_a_run_launched_from_the_ui_is_put_in_its_jobs_pool(orbit_home, monkeypatch, caplog):
    from orbit_dagster.definitions import defs
    from orbit_dagster.deploy.instance import dagster_instance

    settings = Settings.from_env(orbit_home)
    new_job(settings.ledger(), "jsim", "sim")
    new_job(settings.ledger(), "jaws", "aws_spot")
    asset_job = defs.get_implicit_global_asset_job_def()

    with dagster_instance(settings) as instance, in_process_test_workspace(
            instance, LoadableTargetOrigin(module_name="orbit_dagster.definitions")) as workspace:
        [location] = workspace.code_location_names
        remote_job = workspace.get_code_location(location).get_repository("__repository__").get_full_job(
            asset_job.name)

        def submit(asset: str, partition: str, **tags: str) -> dg.DagsterRun:
            """A run as the UI's Materialize (or its backfill) makes it, through the coordinator."""
            run = instance.create_run_for_job(asset_job, asset_selection={dg.AssetKey(asset)},
                                              tags={"dagster/partition": partition, **tags},
                                              remote_job_origin=remote_job.get_remote_origin(),
                                              job_code_origin=remote_job.get_python_origin())
            stored = instance.submit_run(run.run_id, workspace)
            assert stored.status == dg.DagsterRunStatus.QUEUED
            return stored

        evaluation = submit("evaluation", "a1/8|jsim", **{"dagster/backfill": "b1"})
        assert evaluation.tags["orbit/pool"] == "sim" and "orbit/train-pool" not in evaluation.tags
        training = submit("training_run", "jaws")
        assert (training.tags["orbit/pool"], training.tags["orbit/train-pool"]) == ("aws_spot", "aws_spot")
        # A job the ledger does not know, a ledger out of reach: queued all the same, untagged
        # (the run then fails or succeeds on its own), with one warning line each.
        assert "orbit/pool" not in submit("evaluation", "a1/8|nosuchjob").tags
        monkeypatch.setenv("ORBIT_LEDGER_URL", "postgresql+psycopg://orbit@127.0.0.1:9/orbit")
        assert "orbit/pool" not in submit("training_run", "jsim").tags
        monkeypatch.delenv("ORBIT_LEDGER_URL")
        warnings = [r.getMessage() for r in caplog.records if "no pool tag" in r.getMessage()]
        assert len(warnings) == 2 and "'nosuchjob' is not in the ledger" in warnings[0]
        # A run that already names its pool (a sensor's) keeps it.
        assert submit("evaluation", "a1/8|jsim", **{"orbit/pool": "ssh_rental"}).tags["orbit/pool"] == "ssh_rental"
