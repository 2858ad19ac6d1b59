"""Issue 8, defects 7 and 9: evaluations are neither lost nor run (and billed) twice; reading
the best checkpoint writes nothing; the primary metric's project level applies; cost
tables sum to the bill; imported runs are listed.

One evaluated job is shared by the module (training and evaluating costs time): each test
uses its own checkpoint or its own suite name (a suite is its own claim), and the test that
deletes a checkpoint comes last.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math

import pytest

from orbit_dagster.cli.commands import main
from orbit_dagster.control.best import compute_best
from orbit_dagster.control.evaluate import (
    MAX_EVAL_TRIES,
    eval_run_key,
    evaluate_checkpoint,
    pending_evaluations,
    reconcile_evaluations,
)
from orbit_dagster.control.importer import import_run
from orbit_dagster.control.providers import provider_for
from orbit_dagster.core.errors import CheckpointIntegrityError, OrbitError, ProviderError
from orbit_dagster.ledger import records as R
from orbit_dagster.ledger import utcnow
from orbit_dagster.providers.base import InstanceHandle
from orbit_dagster.providers.sim.provider import SimProvider
from orbit_dagster.settings import Settings
from orbit_dagster.storage import store_of
from tests.conftest import kill_processes_under
from tests.helpers import wait_for
from tests.reliability import inject
from tests.reliability.conftest import opened, train

EXPERIMENT = "evals"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A job with checkpoints a1/4, a1/8 and a1/12, the first two evaluated; and an imported run."""
    home = tmp_path_factory.mktemp("evaluated") / "orbit-home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORBIT_HOME", str(home))
        mp.setenv("ORBIT_SIM_RECLAIMS", "none")
        settings = opened(Settings.from_env(home))
        job = train(settings, {"config.steps": 12, "checkpoint.every_steps": 4}, experiment=EXPERIMENT)
        keys = [f"{job}/a1/{s}" for s in (4, 8, 12)]
        for key in keys[:2]:
            assert evaluate_checkpoint(settings, key, poll_s=0.1)["state"] == "SUCCEEDED"
        src = home.parent / "outside-run"
        inject.tiny_state(src / "ckpt-5" / "state.pt", step=5)
        imported = import_run(settings, src, experiment="outside")["job_id"]
    yield settings, job, keys, imported
    kill_processes_under(home)


@pytest.fixture
def in_home(evaluated, monkeypatch):
    settings = evaluated[0]
    monkeypatch.setenv("ORBIT_HOME", str(settings.home))
    return evaluated


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def eval_instances(ledger, key: str, suite: str) -> list[dict]:
    return ledger.rows("SELECT * FROM instances WHERE purpose = 'eval' AND checkpoint_key = ? AND suite = ?",
                       [key, suite])


def assert_released_and_billed(settings, rows: list[dict]) -> None:
    provider = provider_for(settings, "sim_host_process")
    ledger = settings.ledger()
    for row in rows:
        assert row["stopped_at"] is not None and row["billed_usd"] > 0, row
        assert not provider.instance_alive(InstanceHandle.model_validate_json(row["handle"]))
        lines = ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [row["instance_id"]])
        assert lines == pytest.approx(row["billed_usd"], rel=1e-9)


EVALUATOR = """
import sys
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.settings import Settings

result = evaluate_checkpoint(Settings.from_env(sys.argv[1]), sys.argv[2], suite=sys.argv[3], dagster_run_id=sys.argv[4],
                             poll_s=0.1)
print("RESULT", result["state"], result["already"], flush=True)
"""


# ---- defect 7 ---------------------------------------------------------------------------------

@pytest.mark.fault("defect 7: the run evaluating a checkpoint is SIGKILLed mid-evaluation (its instance up)",
                   expect="claim given back, instance released and billed, evaluated on the next request")
def test_defect_7_an_evaluation_whose_run_died_is_requested_again(in_home, tmp_path):
    """Old code: the evaluation stayed 'in flight' for good (never re-requested) and its
    instance stayed metered."""
    settings, job, keys, _ = in_home
    ledger, key = settings.ledger(), keys[2]
    pending = pending_evaluations(ledger, 10)
    assert [r["checkpoint_key"] for r in pending] == [key]
    suite = pending[0]["suite"]  # the template's suite, requested when the checkpoint was registered
    log = tmp_path / "evaluator.log"
    proc = inject.spawn(EVALUATOR, str(settings.home), key, suite, "run-killed", log=log)
    row = wait_for(lambda: next(iter(eval_instances(ledger, key, suite)), None) or proc.poll() is not None, 120,
                   every=0.05, what="the evaluation's instance")
    assert proc.poll() is None, log.read_text()
    inject.sigkill(proc)  # the rented host lives on, metered, as a real one would
    instance = InstanceHandle.model_validate_json(row["handle"])
    assert provider_for(settings, "sim_host_process").instance_alive(instance)
    claim = ledger.one("SELECT * FROM evaluations WHERE checkpoint_key = ? AND suite = ?", [key, suite])
    assert (claim["state"], claim["tries"], claim["dagster_run_id"]) == ("RUNNING", 1, "run-killed")

    given_back = reconcile_evaluations(settings, run_alive=lambda run_id: run_id != "run-killed")
    assert given_back == [f"{key} ({suite}): its run ended without finishing it; now PENDING"]
    assert_released_and_billed(settings, eval_instances(ledger, key, suite))
    row = ledger.one("SELECT * FROM evaluations WHERE checkpoint_key = ? AND suite = ?", [key, suite])
    assert (row["state"], row["tries"]) == ("PENDING", 1)
    again = pending_evaluations(ledger, 10)
    assert [r["checkpoint_key"] for r in again] == [key]
    # The re-request has a run key of its own (a run key already used is never launched twice).
    assert eval_run_key(key, suite, again[0]["tries"]) != eval_run_key(key, suite, 0)
    result = evaluate_checkpoint(settings, key, poll_s=0.1)
    assert result["state"] == "SUCCEEDED" and result["metrics"]["eval/step"] == 12.0
    assert ledger.one("SELECT state, tries FROM evaluations WHERE checkpoint_key = ? AND suite = ?",
                      [key, suite]) == {"state": "SUCCEEDED", "tries": 2}


@pytest.mark.fault("defect 7: the eval workload's launch fails after the instance is rented; an eval outlives "
                   "ORBIT_EVAL_TIMEOUT_S",
                   expect="every instance released and billed; the claim given back with the reason")
def test_defect_7_a_failed_launch_or_a_timeout_releases_the_instance(in_home, monkeypatch):
    """Old code: an instance provisioned before a failed launch was never released, and an
    evaluation had no timeout."""
    settings, job, keys, _ = in_home
    ledger, key = settings.ledger(), keys[0]

    def refuse(self, instance, bundle_dir, spec):  # the launch alone fails; the rental is real
        raise ProviderError("the host refused the workload", provider="sim", retryable=False)

    with monkeypatch.context() as m:
        m.setattr(SimProvider, "launch", refuse)
        with pytest.raises(ProviderError, match="refused the workload"):
            evaluate_checkpoint(settings, key, suite="launch-fails")
    rows = eval_instances(ledger, key, "launch-fails")
    assert len(rows) == 1
    assert_released_and_billed(settings, rows)
    claim = ledger.one("SELECT * FROM evaluations WHERE checkpoint_key = ? AND suite = 'launch-fails'", [key])
    assert claim["state"] == "PENDING" and "refused the workload" in claim["reason"]

    short = dataclasses.replace(settings, eval_timeout_s=0.5)  # ORBIT_EVAL_TIMEOUT_S=0.5
    with pytest.raises(OrbitError, match="timed out after 0 s|timed out after 1 s"):
        evaluate_checkpoint(short, key, suite="times-out", poll_s=0.1)
    rows = eval_instances(ledger, key, "times-out")
    assert 1 <= len(rows) <= MAX_EVAL_TRIES
    assert_released_and_billed(settings, rows)
    claim = ledger.one("SELECT * FROM evaluations WHERE checkpoint_key = ? AND suite = 'times-out'", [key])
    assert claim["state"] == "PENDING" and "timed out" in claim["reason"]


@pytest.mark.fault("defect 7: two runs (sensor and backfill) evaluate one checkpoint at the same moment",
                   expect="one run key for both; exactly one instance rented, one result")
def test_defect_7_one_checkpoint_is_never_evaluated_twice_at_once(in_home, tmp_path):
    """Old code: the backfill schedule and the sensor used different run keys and nothing
    claimed the evaluation, so one checkpoint could be evaluated (and billed) twice at once."""
    from orbit_dagster.sensors.evaluations import eval_request

    settings, job, keys, _ = in_home
    ledger, key, suite = settings.ledger(), keys[1], "race"
    row = {"checkpoint_key": key, "suite": suite, "job_id": job, "tries": 0}
    assert eval_request(row).run_key == eval_request(row, **{"orbit/backfill": "2026-01-01"}).run_key
    logs = [tmp_path / f"racer-{i}.log" for i in range(2)]
    procs = [inject.spawn(EVALUATOR, str(settings.home), key, suite, f"racer-{i}", log=logs[i]) for i in range(2)]
    for proc in procs:
        proc.wait(300)
    results = sorted(log.read_text().split("RESULT", 1)[-1].split() for log in logs)
    assert [p.returncode for p in procs] == [0, 0], [log.read_text()[-500:] for log in logs]
    fresh = [r for r in results if r[1] == "False"]
    assert len(fresh) == 1 and fresh[0][0] == "SUCCEEDED", results  # one evaluated, the other saw its claim
    assert len(eval_instances(ledger, key, suite)) == 1
    assert ledger.scalar("SELECT count(*) FROM metric_points WHERE checkpoint_key = ? AND suite = ? AND name = "
                         "'eval/loss'", [key, suite]) == 1


# ---- defect 9 ---------------------------------------------------------------------------------

@pytest.mark.fault("defect 9: `orbit best EXP` (a read)", expect="the answer; the ledger unchanged")
def test_defect_9_orbit_best_only_reads(in_home):
    """Old code: `orbit best` recorded a best_checkpoints row each time it was asked."""
    settings, job, keys, _ = in_home
    db = inject.sqlite_path(settings.home)
    before = inject.snapshot(db)
    code, out, err = cli("best", EXPERIMENT, "--json")
    assert code == 0, err
    assert json.loads(out)["checkpoint_key"] in keys
    code, _, err = cli("best", EXPERIMENT)
    assert code == 0, err
    assert inject.snapshot(db) == before


@pytest.mark.fault("defect 9: a primary metric set for the project (`orbit metric set NAME min --project P`)",
                   expect="it ranks the experiment until the experiment sets its own")
def test_defect_9_the_project_primary_metric_applies(in_home):
    """Old code: the template's metric was stored on the experiment, which always won: the
    project level could never apply."""
    settings, job, keys, _ = in_home
    assert compute_best(settings, EXPERIMENT)["resolved_from"] == "template"
    code, _, err = cli("metric", "set", "eval/step", "max", "--project", "default")
    assert code == 0, err
    best = compute_best(settings, EXPERIMENT)
    assert (best["resolved_from"], best["metric_name"], best["metric_mode"]) == ("project", "eval/step", "max")
    evaluated = {r["checkpoint_key"] for r in settings.ledger().rows(
        "SELECT checkpoint_key FROM evaluations WHERE experiment = ? AND state = 'SUCCEEDED'", [EXPERIMENT])}
    assert best["checkpoint_key"] == max(evaluated, key=lambda k: int(k.rsplit("/", 1)[1]))
    code, _, err = cli("metric", "set", "eval/step", "min", "--experiment", EXPERIMENT)
    assert code == 0, err
    best = compute_best(settings, EXPERIMENT)
    assert (best["resolved_from"], best["metric_mode"]) == ("experiment", "min")
    assert best["checkpoint_key"] == min(evaluated, key=lambda k: int(k.rsplit("/", 1)[1]))


@pytest.mark.fault("defect 9: `orbit cost --by checkpoint` (and by job, by experiment) after training, evaluations, kills",
                   expect="every table sums to the providers' bill; no NaN")
def test_defect_9_cost_by_checkpoint_sums_to_the_bill(in_home):
    """Old code: the per-checkpoint table left evaluation and waste out (did not sum to the
    bill) and showed NaN for checkpoints without evaluations."""
    settings, *_ = in_home
    ledger = settings.ledger()
    assert ledger.scalar("SELECT count(*) FROM instances WHERE stopped_at IS NULL") == 0
    bill = ledger.scalar("SELECT sum(billed_usd) FROM instances")
    assert bill > 0
    for by in ("checkpoint", "job", "experiment"):
        code, out, err = cli("cost", "--by", by, "--json")
        assert code == 0, err
        rows = json.loads(out)
        assert all(v is not None and not (isinstance(v, float) and math.isnan(v))
                   for r in rows for k, v in r.items() if k.endswith("usd")), rows
        # (--json writes 10 decimals: a rounding of at most 5e-11 USD per row)
        assert sum(r["usd"] for r in rows) == pytest.approx(bill, abs=1e-10 * len(rows)), by
        assert "NaN" not in cli("cost", "--by", by)[1]
    # One job's or experiment's lines sum to the bill of its own instances (evaluations included).
    settings, job, *_ = in_home
    experiment = ledger.scalar("SELECT experiment FROM jobs WHERE job_id = ?", [job])
    job_bill = ledger.scalar("SELECT sum(billed_usd) FROM instances WHERE job_id = ?", [job])
    assert 0 < job_bill <= bill
    for flags in (["--job", job], ["--experiment", experiment]):
        code, out, err = cli("cost", "--by", "checkpoint", *flags, "--json")
        assert code == 0, err
        rows = json.loads(out)
        assert rows and {r["job_id"] for r in rows} <= {r["job_id"] for r in ledger.rows(
            "SELECT job_id FROM jobs WHERE experiment = ?", [experiment])}
        want = job_bill if flags[0] == "--job" else ledger.scalar(
            "SELECT sum(billed_usd) FROM instances WHERE job_id IN (SELECT job_id FROM jobs WHERE experiment = ?)",
            [experiment])
        assert sum(r["usd"] for r in rows) == pytest.approx(want, abs=1e-10 * len(rows)), flags
        code, out, err = cli("cost", *flags)
        assert code == 0 and f"= billed ${want:.6f}" in out, out
    code, out, err = cli("cost", "--job", "no-such-job")
    assert code == 2 and "no-such-job" in err and "Traceback" not in err


@pytest.mark.fault("defect 9: a run imported with `orbit import-run`", expect="listed by `orbit status` as imported")
def test_defect_9_imported_runs_are_in_orbit_status(in_home):
    """Old code: `orbit status` listed jobs only; an imported run (a Run without a Job) was missing."""
    settings, job, keys, imported = in_home
    code, out, err = cli("status", "--json")
    assert code == 0, err
    rows = {r["job_id"]: r for r in json.loads(out)}
    assert rows[imported]["source"] == "imported" and rows[imported]["checkpoints"] == 1
    assert rows[job]["state"] == "SUCCEEDED"
    code, out, err = cli("status", imported)
    assert code == 0 and f"{imported}/a1/5" in out, err


# ---- last: a deleted checkpoint -----------------------------------------------------------------

@pytest.mark.fault("defect 7: evaluation requested for a checkpoint that retention deleted",
                   expect="refused before renting; the request skipped, never re-requested")
def test_defect_7_evaluating_a_deleted_checkpoint_rents_nothing(in_home):
    """Old code: the evaluation rented an instance, which then failed to fetch the checkpoint."""
    settings, job, keys, _ = in_home
    ledger, key = settings.ledger(), keys[0]
    row = R.checkpoint(ledger, key)
    ledger.commit({"evaluations": [{"checkpoint_key": key, "suite": "queued-earlier", "job_id": job,
                                    "experiment": EXPERIMENT, "state": "PENDING", "tries": 0, "requested_at": utcnow()}]})
    assert store_of(row["uri"]).delete(row["uri"])  # what retention does: the files, then the ledger
    with ledger.write() as tx:
        tx.execute("UPDATE checkpoints SET deleted_at = ?, deleted_reason = 'retention' WHERE checkpoint_key = ?",
                   [utcnow(), key])
    rented = ledger.scalar("SELECT count(*) FROM instances")
    with pytest.raises(CheckpointIntegrityError, match="deleted"):
        evaluate_checkpoint(settings, key, suite="after-delete")
    with pytest.raises(CheckpointIntegrityError, match="deleted"):
        evaluate_checkpoint(settings, key, suite="queued-earlier")
    assert ledger.scalar("SELECT count(*) FROM instances") == rented
    assert key not in {r["checkpoint_key"] for r in pending_evaluations(ledger, 100)}
    reconcile_evaluations(settings, run_alive=lambda run_id: True)
    assert ledger.one("SELECT state FROM evaluations WHERE checkpoint_key = ? AND suite = 'queued-earlier'",
                      [key])["state"] == "SKIPPED"


@pytest.mark.fault("defect 7 (found here): evaluate_checkpoint of a deleted checkpoint",
                   expect="the request recorded SKIPPED at once, as claim() intends")
def test_defect_7_a_refused_deleted_checkpoint_is_recorded_skipped(in_home):
    settings, job, keys, _ = in_home
    ledger = settings.ledger()
    assert R.checkpoint(ledger, keys[0])["deleted_at"] is not None  # (deleted by the test above)
    with pytest.raises(CheckpointIntegrityError):
        evaluate_checkpoint(settings, keys[0], suite="asked-after-delete")
    row = ledger.one("SELECT state FROM evaluations WHERE checkpoint_key = ? AND suite = 'asked-after-delete'",
                     [keys[0]])
    assert row is not None and row["state"] == "SKIPPED"
