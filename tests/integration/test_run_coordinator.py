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


def test_with_the_pool_full_of_evaluations_the_next_dequeue_starts_the_resumed_attempt(orbit_home):
    """Dagster's own queue (its run-queue daemon, one iteration at a time) with orbit's pool
    limits and the tags orbit's sensors give their runs: evaluations queued first, a resumed
    training queued last; when an evaluation ends, the training is the run dequeued."""
    import yaml
    from dagster._core.test_utils import MockedRunLauncher, create_run_for_test, instance_for_test
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import EmptyWorkspaceTarget
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

    from orbit_dagster.deploy.profiles import Profile, parse_pools, render_dagster_yaml
    from orbit_dagster.sensors.evaluations import eval_request
    from orbit_dagster.sensors.queue import train_request

    limits = yaml.safe_load(render_dagster_yaml(Profile("embedded", parse_pools("sim=2"))))["concurrency"]
    overrides = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator",
                                     "config": {"dequeue_use_threads": False}},
                 "concurrency": limits,
                 "run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}}

    from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

    location = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name="orbit_dagster.definitions"))

    def run_of(request: dg.RunRequest, status: dg.DagsterRunStatus, job_name: str) -> dg.DagsterRun:
        origin = RemoteJobOrigin(repository_origin=RemoteRepositoryOrigin(location, "__repository__"), job_name=job_name)
        return create_run_for_test(instance, job_name=job_name, status=status, tags=request.tags,
                                   remote_job_origin=origin)

    evals = [eval_request({"checkpoint_key": f"j{i}/a1/8", "suite": "heldout", "job_id": f"j{i}", "tries": 0,
                           "placement": "sim"}) for i in range(5)]
    with instance_for_test(overrides=overrides) as instance, \
            WorkspaceProcessContext(instance, EmptyWorkspaceTarget()) as context:
        launcher = instance.run_launcher
        assert isinstance(launcher, MockedRunLauncher)
        working = [run_of(r, dg.DagsterRunStatus.STARTED, "eval_job") for r in evals[:2]]  # the pool is full
        waiting = [run_of(r, dg.DagsterRunStatus.QUEUED, "eval_job") for r in evals[2:]]
        resumed = run_of(train_request({"job_id": "jr", "attempt": 2, "experiment": "e", "placement": "sim"}),
                         dg.DagsterRunStatus.QUEUED, "train_job")
        daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)
        list(daemon.run_iteration(context))
        assert launcher.queue() == []  # nothing fits
        instance.report_run_canceled(working[0])  # an evaluation ends: one slot
        list(daemon.run_iteration(context))
        assert [r.run_id for r in launcher.queue()] == [resumed.run_id]
        assert all(instance.get_run_by_id(r.run_id).status == dg.DagsterRunStatus.QUEUED for r in waiting)
