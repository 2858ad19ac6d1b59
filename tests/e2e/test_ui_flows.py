"""The Dagster UI flows a person uses, in a real headless Chromium, against one real
`dagster-webserver` and one real Dagster daemon over a fresh $ORBIT_HOME (embedded market,
no reclaims): launch a job from the launchpad and see it train and be evaluated; an invalid
launch refused; Terminate cancels the job; asset checks with results, one failing on a
corrupted checkpoint; a backfill of a subset of evaluations; the per-job loss table.

The flows run in file order and share the stack: later ones use the job the launch trained,
and the backfill evaluates some checkpoints of the job the cancel flow stopped (registered
while the evaluation sensor was stopped, so they wait). Two trainings in all: each Dagster
run costs seconds of process start on two cores.
Screenshots go to $ORBIT_UI_SHOTS (`docs/img` refreshes the pictures of docs/ui.md), else to
a temporary directory. A flow the product does not do yet is an `xfail(strict=True)` naming
what is missing.
"""
import os
import re
from pathlib import Path

import pytest

from orbit_dagster.control.providers import provider_for
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import InstanceHandle
from tests import helpers
from tests.e2e.ui_support import CHROMIUM, LOCATION, LONG, SECOND, SMALL, UI, chromium_page, orbit_stack, submit_config

pytest.importorskip("playwright", reason="needs playwright (pip install -e '.[dev]')")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it with apt-get "
                                                          "when it may)")]


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    home = tmp_path_factory.mktemp("ui-flows") / "orbit-home"
    shots = Path(os.environ.get("ORBIT_UI_SHOTS") or tmp_path_factory.mktemp("ui-shots"))
    shots.mkdir(parents=True, exist_ok=True)
    import dagster as dg

    with orbit_stack(home) as (url, settings), chromium_page() as page, \
            dg.DagsterInstance.from_config(str(home / "dagster")) as instance:
        yield UI(url=url, settings=settings, instance=instance, page=page, shots=shots)


def trained_job(ui: UI) -> str:
    job = ui.state.get("job")
    if job is None:
        pytest.skip("needs the job test_a_launch_from_the_launchpad_trains_and_is_evaluated trains")
    return job


def ledger(ui: UI):
    return ui.settings.ledger()


def test_an_invalid_launch_is_refused_and_writes_nothing(ui):
    led = ledger(ui)
    before = (led.scalar("SELECT count(*) FROM jobs"), led.scalar("SELECT count(*) FROM bundles"),
              sorted(ui.instance.get_dynamic_partitions("jobs")))

    # A template this code location does not know: the launchpad refuses before any run.
    ui.open_launchpad("submit_job")
    ui.write_config("ops:\n  submit_op:\n    config:\n      template: no_such_template\n")
    ui.see("not in enum type TemplateName")
    assert "ops:submit_op:config:template" in ui.text()
    assert not ui.page.get_by_role("button", name="Launch Run").is_enabled()

    # An override outside the template's whitelist: the submit run fails with one clear line.
    ui.write_config(submit_config(["config.lr=0.001", "config.bogus=1"], "ui-refused"))
    bad_submit = ui.launch()
    ui.open_launchpad("cancel_job")
    ui.write_config("ops:\n  cancel_op:\n    config:\n      job_id: no-such-job\n")
    bad_cancel = ui.launch()

    ui.wait_run(bad_submit, "FAILURE", timeout_s=180)
    ui.wait_run(bad_cancel, "FAILURE", timeout_s=180)
    assert "override 'config.bogus' is not allowed by template 'charlm-finetune'; fix: allowed overrides are:" \
        in ui.failure_of(bad_submit)
    assert "no job 'no-such-job' in the ledger; fix: list jobs with `orbit status`" in ui.failure_of(bad_cancel)
    ui.goto(f"/runs/{bad_submit}")
    ui.see("is not allowed by template 'charlm-finetune'", timeout_s=90)
    ui.see("Failure", exact=True)
    ui.shot("launch-refused.png")
    after = (led.scalar("SELECT count(*) FROM jobs"), led.scalar("SELECT count(*) FROM bundles"),
             sorted(ui.instance.get_dynamic_partitions("jobs")))
    assert after == before  # nothing written: no job, no bundle, no partition


def test_a_launch_from_the_launchpad_trains_and_is_evaluated(ui):
    ui.open_launchpad("submit_job")
    ui.write_config(submit_config(["config.lr=0.001", *SMALL], "ui-launch"))
    ui.see("No errors")
    ui.shot("launchpad.png")
    submit_run = ui.launch()
    job = ui.wait_run(submit_run, "SUCCESS", timeout_s=180).tags.get("orbit/job")
    assert job, "the submit run names the job it queued in its orbit/job tag"
    led = ledger(ui)
    bundle = R.bundle_for(led, job, 1)
    from orbit_dagster.core.bundle import JobBundle

    assert JobBundle.load(bundle["path"]).spec.template.config["lr"] == 0.001

    # The queue sensor launches the job's training run; it trains to SUCCEEDED.
    train = helpers.wait_for(lambda: ui.runs(**{"dagster/partition": job, "orbit/kind": "train"}), timeout=180,
                             every=1.0, what=f"the training run of {job}")
    assert len(train) == 1 and train[0].tags.get("dagster/sensor_name") == "job_queue_sensor"
    ui.wait_run(train[0].run_id, "SUCCESS", timeout_s=420)
    assert R.require_job(led, job)["state"] == "SUCCEEDED"
    keys = [c["checkpoint_key"] for c in R.checkpoints(led, job)]
    assert sorted(keys) == sorted(f"{job}/a1/{s}" for s in (8, 16))
    ui.state["job"] = job

    # Each checkpoint is evaluated (the evaluation sensor's runs).
    def evaluated():
        rows = led.rows("SELECT state FROM evaluations WHERE job_id = ?", [job])
        return len(rows) == 2 and all(r["state"] == "SUCCEEDED" for r in rows)

    helpers.wait_for(evaluated, timeout=420, every=2.0, what=f"the evaluations of {job}")

    ui.goto(f"/runs/{train[0].run_id}")
    ui.see("Success", exact=True)
    ui.see("job_queue_sensor")
    ui.see(f"partition: {job}")
    ui.see("ASSET_MATERIALIZATION")
    ui.shot("training-run.png")

    ui.goto("/assets/evaluation?view=lineage&lineageDepth=2")
    ui.see("best_checkpoint", exact=True)
    ui.page.get_by_text("100% filled").nth(1).wait_for(timeout=90_000)
    ui.shot("asset-lineage.png")


def test_terminate_in_the_ui_cancels_the_job_and_releases_its_instance(ui):
    # First stop the sensor that evaluates every new checkpoint (Automation -> the sensor ->
    # its switch): the checkpoints this job registers before it is cancelled then wait for
    # the backfill flow below.
    ui.goto(f"/locations/{LOCATION}/sensors/checkpoint_evaluation_sensor")
    switch = ui.page.locator("input[type=checkbox]").first
    switch.wait_for(state="attached")
    assert switch.is_checked()
    # A click that lands before the page's handlers are attached (a loaded machine) does
    # nothing: click again while the switch still shows it running, never once it is off.
    for _ in range(4):
        if switch.is_checked():
            switch.locator("xpath=..").click()
        try:
            helpers.wait_for(lambda: ui.sensor_status("checkpoint_evaluation_sensor") == "STOPPED", timeout=30,
                             what="the evaluation sensor stopped")
            break
        except AssertionError:
            continue
    assert ui.sensor_status("checkpoint_evaluation_sensor") == "STOPPED", "the evaluation sensor did not stop"

    ui.open_launchpad("submit_job")
    ui.write_config(submit_config(LONG, "ui-cancel"))
    job = ui.wait_run(ui.launch(), "SUCCESS", timeout_s=180).tags["orbit/job"]
    led = ledger(ui)

    def training():
        inst = led.one("SELECT * FROM instances WHERE job_id = ? AND purpose = 'train'", [job])
        live = len(R.checkpoints(led, job)) >= 3
        return inst if inst and live and R.require_job(led, job)["state"] == "RUNNING" else None

    instance_row = helpers.wait_for(training, timeout=300, every=1.0, what=f"{job} training, three checkpoints in")
    run = ui.runs(**{"dagster/partition": job, "orbit/kind": "train"})[0]

    ui.goto(f"/runs/{run.run_id}")
    ui.page.get_by_role("button", name="Terminate").click()
    dialog = ui.page.get_by_role("dialog")
    dialog.get_by_text("1 run will be terminated").wait_for()
    dialog.get_by_role("button", name="Terminate 1 run").click()
    ui.wait_run(run.run_id, "CANCELED", timeout_s=120)
    ui.see("Canceled", exact=True, timeout_s=60)
    ui.shot("run-canceled.png")

    job_row = R.require_job(led, job)
    assert job_row["state"] == "CANCELLED" and "was terminated" in job_row["reason"]
    inst = led.one("SELECT * FROM instances WHERE instance_id = ?", [instance_row["instance_id"]])
    assert inst["stopped_at"] is not None and inst["stop_reason"] == "job cancelled"
    assert inst["billed_usd"] > 0
    handle = InstanceHandle.model_validate_json(inst["handle"])
    assert not provider_for(ui.settings, "sim_host_process").instance_alive(handle)  # released, workload stopped
    assert len(ui.runs(**{"dagster/partition": job, "orbit/kind": "train"})) == 1  # and not launched again
    ui.state["cancelled"] = job


def test_asset_checks_have_results_and_a_corrupted_checkpoint_fails_its_check(ui):
    job = trained_job(ui)
    led = ledger(ui)

    ui.goto("/assets/checkpoint?view=checks")
    ui.see("Latest execution")
    for name in ("checkpoint_integrity", "checkpoint_present"):
        ui.see(name)
    helpers.wait_for(lambda: ui.page.get_by_text("Succeeded", exact=True).count() == 2, timeout=30,
                     what="both checkpoint checks listed as Succeeded")
    ui.goto("/assets/evaluation?view=checks")
    ui.see("Latest execution")
    for name in ("evaluation_metrics_valid", "every_checkpoint_evaluated"):
        ui.see(name)
    # cost_summary is refreshed by its sensor once the evaluations are in: its check passes.
    helpers.wait_for(lambda: _check_passed(ui, "cost_summary", "cost_equals_bill"), timeout=300, every=2.0,
                     what="a result of cost_equals_bill")
    ui.goto("/assets/cost_summary?view=checks")
    ui.see("cost_equals_bill")
    ui.see("Passed", exact=True)

    # Flip one byte of a checkpoint's weights in the store, then evaluate it from the UI.
    key = f"{job}/a1/16"
    state = Path(R.checkpoint(led, key)["uri"].removeprefix("file://")) / "state.pt"
    with open(state, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    rented = led.scalar("SELECT count(*) FROM instances WHERE purpose = 'eval'")
    partition = f"a1/16|{job}"
    ui.open_launchpad("eval_job")
    ui.choose_partition(partition)
    run_id = ui.launch()
    ui.wait_run(run_id, "FAILURE", timeout_s=240)
    assert "1 blocking asset check failed" in ui.failure_of(run_id)
    ui.see("Dependencies for step evaluation failed", timeout_s=90)  # the evaluation did not run
    assert led.scalar("SELECT count(*) FROM instances WHERE purpose = 'eval'") == rented  # nothing rented
    assert led.one("SELECT state FROM evaluations WHERE checkpoint_key = ?", [key])["state"] == "SUCCEEDED"

    ui.goto("/assets/checkpoint?view=checks")
    ui.see("Latest execution")
    ui.see("does not match its manifest sha256")
    ui.see(partition)
    assert ui.page.get_by_text("Failed", exact=True).count() >= 2  # in the list and as the latest result
    ui.shot("checks-failed.png")
    ui.page.get_by_text("Partitions", exact=True).last.click()
    ui.see("Failed (1)")


def _check_passed(ui: UI, asset: str, check: str) -> bool:
    import dagster as dg

    records = ui.instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey(asset), check), limit=1)
    return bool(records) and records[0].status.value == "SUCCEEDED"


def test_the_training_run_shows_its_loss_by_step(ui):
    job = trained_job(ui)
    points = ledger(ui).rows("""SELECT step, value FROM metric_points WHERE job_id = ? AND source = 'train'
                                AND name = 'train/loss' ORDER BY step""", [job])
    # The workload logs the loss on a time cadence and at every checkpoint: how many points a
    # short job has depends on the machine's speed; a curve needs a few.
    assert len(points) >= 3
    ui.goto(f"/assets/training_run?view=partitions&partition={job}")
    ui.see("train/loss by step")
    table = ui.page.locator("table", has_text="train_loss").last
    table.wait_for()
    rows = [re.split(r"\s+", line.strip()) for line in table.inner_text().splitlines()[1:] if line.strip()]
    assert [(int(r[0]), float(r[2])) for r in rows] == [(p["step"], float(p["value"])) for p in points]
    table.evaluate("e => e.scrollIntoView({block: 'center'})")
    ui.shot("loss-table.png")

    # Dagster's own plots: numeric metadata per partition. The checkpoints' train/loss, one
    # point per checkpoint, is the nearest to a per-job curve the UI draws today.
    ui.goto("/assets/checkpoint?view=overview")
    ui.page.get_by_role("button", name="Plots").first.click()
    ui.see("When graphing values by partition")
    assert ui.page.locator("canvas").count() >= 4  # attempt, bytes, step, train/loss
    ui.page.get_by_text("train/loss", exact=True).first.scroll_into_view_if_needed()
    ui.shot("loss-plot.png")


def test_the_training_run_partition_draws_a_loss_curve(ui):
    job = trained_job(ui)
    ui.goto(f"/assets/training_run?view=partitions&partition={job}")
    ui.see("train/loss by step")  # the table's label: it may come before the curve's markdown
    # The curve is an image in markdown; wait_for fails the test if it never comes.
    ui.page.locator("img[src^='data:image']").first.wait_for(state="attached", timeout=60 * SECOND)


def test_asset_descriptions_show_the_partition_format(ui):
    ui.goto("/assets/evaluation?view=overview")
    ui.see("Held-out evaluation of one checkpoint")
    assert "a<attempt>/<step>" in ui.text()


def test_execute_all_checks_without_a_partition_says_what_to_do(ui):
    trained_job(ui)
    before = {r.run_id for r in ui.runs()}
    ui.goto("/assets/checkpoint?view=checks")
    ui.see("Latest execution")
    ui.page.get_by_role("button", name="Execute all").click()
    run = helpers.wait_for(lambda: [r for r in ui.runs() if r.run_id not in before], timeout=60, every=1.0,
                           what="the checks' run")[0]
    ui.wait_run(run.run_id, "FAILURE", timeout_s=240)
    message = ui.failure_of(run.run_id)
    assert "partition" in message and "fix" in message and "DagsterInvariantViolationError" not in message


def test_a_backfill_of_a_subset_of_evaluations(ui):
    job = ui.state.get("cancelled")
    if job is None or ui.sensor_status("checkpoint_evaluation_sensor") != "STOPPED":
        pytest.skip("needs the cancelled job's unevaluated checkpoints (the Terminate flow)")
    led = ledger(ui)

    def states() -> dict:  # checkpoint within the job -> its evaluation's state
        return {r["checkpoint_key"].split("/", 1)[1]: r["state"] for r in
                led.rows("SELECT checkpoint_key, state FROM evaluations WHERE job_id = ?", [job])}

    before = states()
    assert {"a1/8", "a1/16", "a1/24"} <= set(before) and set(before.values()) == {"PENDING"}

    ui.goto("/assets/evaluation?view=partitions")
    ui.page.get_by_role("button", name="Materialize…").first.click()
    dialog = ui.page.get_by_role("dialog").first
    dialog.get_by_role("button", name="Launch backfill").wait_for()
    for values in (["a1/8", "a1/16"], [job]):  # the checkpoint dimension, then the job dimension
        dialog.get_by_text("Select a partition or create one").first.click()
        menu = ui.page.locator("[role=dialog].dagster-popover").last
        for value in values:
            menu.get_by_text(value, exact=True).first.click()
        ui.page.keyboard.press("Escape")
        menu.wait_for(state="hidden")
    dialog.get_by_text("2 partitions", exact=True).wait_for()
    ui.shot("backfill.png")
    dialog.get_by_role("button", name="Launch backfill").click()
    ui.see("Created backfill")
    backfill = [b for b in ui.instance.get_backfills() if b.tags.get("dagster/from_ui")][0]  # newest first
    helpers.wait_for(lambda: ui.instance.get_backfill(backfill.backfill_id).status.value
                     not in ("REQUESTED", "CANCELING", "FAILING"), timeout=420, every=2.0,
                     what=f"backfill {backfill.backfill_id} to finish")
    assert ui.instance.get_backfill(backfill.backfill_id).status.value == "COMPLETED_SUCCESS"

    runs = ui.runs(**{"dagster/backfill": backfill.backfill_id})
    assert sorted(r.tags["dagster/partition"] for r in runs) == sorted([f"a1/8|{job}", f"a1/16|{job}"])
    # Launched with Dagster's tags only, yet in the job's provider pool (the run coordinator's).
    assert {r.tags.get("orbit/pool") for r in runs} == {led.scalar("SELECT placement FROM jobs WHERE job_id = ?",
                                                                   [job])} == {"sim"}
    assert states() == {**before, "a1/8": "SUCCEEDED", "a1/16": "SUCCEEDED"}  # exactly the subset
    evaluated_by = {r["dagster_run_id"] for r in led.rows(
        "SELECT dagster_run_id FROM evaluations WHERE job_id = ? AND state = 'SUCCEEDED'", [job])}
    assert evaluated_by == {r.run_id for r in runs}
    ui.goto(f"/runs/b/{backfill.backfill_id}")
    ui.see("Succeeded", exact=True)
    ui.see(f"a1/8|{job}")
