import multiprocessing as mp
from datetime import datetime, timezone

import duckdb
import pytest

from orbit_dagster.core.errors import InvalidTransition
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import Ledger, LedgerError
from orbit_dagster.ledger import records as R


def now():
    return datetime.now(timezone.utc)


def _writer(root: str, worker: int, n: int) -> None:
    ledger = Ledger(root).init()
    for i in range(n):
        ledger.append("events", R.event("test", job_id=f"w{worker}", seq=i))


def test_commit_and_query(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    ledger.commit({"projects": [{"project": "p", "created_at": now()}],
                   "experiments": [{"experiment": "e", "project": "p", "created_at": now()}]})
    assert ledger.scalar("SELECT count(*) FROM experiments") == 1
    df = ledger.query("SELECT * FROM projects")
    assert list(df["project"]) == ["p"]


def test_unknown_table_or_column_is_refused(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    with pytest.raises(LedgerError):
        ledger.commit({"nope": [{"a": 1}]})
    with pytest.raises(LedgerError):
        ledger.commit({"projects": [{"project": "p", "colour": "red"}]})
    assert ledger.segment_count() == 1  # only the schema commit


def test_many_writer_processes_lose_nothing(tmp_path):
    root = str(tmp_path / "l")
    Ledger(root).init()
    procs = [mp.get_context("spawn").Process(target=_writer, args=(root, w, 60)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ledger = Ledger(root).init()
    assert ledger.scalar("SELECT count(*) FROM events") == 240
    assert ledger.scalar("SELECT count(DISTINCT job_id) FROM events") == 4


def test_catalog_file_is_usable_by_a_person_with_duckdb(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    ledger.append("events", R.event("hello", job_id="j"))
    con = duckdb.connect(str(ledger.catalog_path), read_only=True)
    assert con.execute("SELECT kind FROM events").fetchall() == [("hello",)]
    assert con.execute("SELECT count(*) FROM job_status").fetchone() == (0,)
    con.close()


def test_transitions_are_checked_and_idempotent(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    ledger.commit({"jobs": [{"job_id": "j", "experiment": "e", "project": "p", "created_at": now()}],
                   "job_states": [R.state_row("j", 1, JobState.CREATED)]})
    assert R.transition(ledger, "j", JobState.QUEUED, attempt=1)
    assert not R.transition(ledger, "j", JobState.QUEUED, attempt=1)  # a retried write makes no second row
    with pytest.raises(InvalidTransition):
        R.transition(ledger, "j", JobState.SUCCEEDED, attempt=1)
    R.transition(ledger, "j", JobState.DISPATCHING, attempt=1)
    assert R.job(ledger, "j")["state"] == "DISPATCHING"
    assert ledger.scalar("SELECT count(*) FROM job_states WHERE job_id = 'j'") == 3


def test_a_writer_about_an_older_attempt_never_moves_the_job(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    ledger.commit({"jobs": [{"job_id": "j", "created_at": now()}],
                   "job_states": [R.state_row("j", 1, JobState.CREATED), R.state_row("j", 2, JobState.QUEUED)]})
    assert not R.transition(ledger, "j", JobState.LOST, attempt=1)
    assert R.job(ledger, "j")["state"] == "QUEUED"


def test_views_keep_one_row_per_key(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    row = {"checkpoint_key": "j/1", "job_id": "j", "step": 1, "sha256": "a", "created_at": now()}
    ledger.append("checkpoints", row)
    ledger.append("checkpoints", {**row, "sha256": "b"})
    assert ledger.rows("SELECT sha256 FROM checkpoints") == [{"sha256": "a"}]  # first wins
    ledger.append("experiments", {"experiment": "e", "primary_metric": "eval/loss", "created_at": now()})
    ledger.append("experiments", {"experiment": "e", "primary_metric": "eval/acc", "created_at": now()})
    assert ledger.scalar("SELECT primary_metric FROM experiments") == "eval/acc"  # settings: last wins


def test_compaction_keeps_every_row(tmp_path):
    ledger = Ledger(tmp_path / "l").init()
    for i in range(30):
        ledger.append("events", R.event("e", job_id=str(i)))
    before = ledger.query("SELECT event_id FROM events ORDER BY event_id")
    merged = ledger.compact()
    assert merged == 30 and ledger.segment_count() == 2
    after = Ledger(tmp_path / "l").init().query("SELECT event_id FROM events ORDER BY event_id")
    assert before.equals(after)
