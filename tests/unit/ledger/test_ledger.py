import multiprocessing as mp
import sqlite3
from datetime import datetime, timezone

import duckdb
import pytest

from orbit_dagster.core.errors import InvalidTransition, NotFound
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import Ledger, LedgerError
from orbit_dagster.ledger import records as R
from orbit_dagster.ledger.migrations import LATEST, current_version, upgrade_schema


def now():
    return datetime.now(timezone.utc)


def url(tmp_path):
    return f"sqlite:///{tmp_path / 'l' / 'ledger.sqlite'}"


def fresh(tmp_path) -> Ledger:
    ledger = Ledger(url(tmp_path))
    upgrade_schema(ledger)
    return ledger


def new_job(ledger, job_id="j", state=JobState.QUEUED):
    with ledger.write() as tx:
        R.insert_job(tx, {"job_id": job_id, "experiment": "e", "project": "p", "created_at": now()},
                     [R.state_row(job_id, 1, JobState.CREATED), R.state_row(job_id, 1, state)])


def _writer(db_url: str, worker: int, n: int) -> None:
    ledger = Ledger(db_url)
    for i in range(n):
        ledger.append("events", R.event("test", job_id=f"w{worker}", seq=i))


def test_commit_and_query(tmp_path):
    ledger = fresh(tmp_path)
    ledger.commit({"projects": [{"project": "p", "created_at": now()}],
                   "experiments": [{"experiment": "e", "project": "p", "created_at": now()}]})
    assert ledger.scalar("SELECT count(*) FROM experiments") == 1
    df = ledger.query("SELECT * FROM projects")
    assert list(df["project"]) == ["p"]


def test_times_are_stored_as_seconds_since_the_epoch(tmp_path):
    ledger = fresh(tmp_path)
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    ledger.commit({"projects": [{"project": "p", "created_at": t}]})
    assert ledger.scalar("SELECT created_at FROM projects") == t.timestamp()


def test_unknown_table_or_column_is_refused_and_nothing_is_written(tmp_path):
    ledger = fresh(tmp_path)
    with pytest.raises(LedgerError):
        ledger.commit({"nope": [{"a": 1}]})
    with pytest.raises(LedgerError):
        ledger.commit({"projects": [{"project": "ok", "created_at": now()}], "experiments": [{"colour": "red"}]})
    assert ledger.scalar("SELECT count(*) FROM projects") == 0  # the batch is one transaction


def test_many_writer_processes_lose_nothing_and_duplicate_nothing(tmp_path):
    ledger = fresh(tmp_path)
    procs = [mp.get_context("spawn").Process(target=_writer, args=(url(tmp_path), w, 60)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert ledger.scalar("SELECT count(*) FROM events") == 240
    assert ledger.scalar("SELECT count(DISTINCT event_id) FROM events") == 240
    assert ledger.scalar("SELECT count(DISTINCT job_id) FROM events") == 4


def test_durable_and_concurrent_settings_are_on(tmp_path):
    ledger = fresh(tmp_path)
    with ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL


def test_transitions_follow_the_lifecycle_and_are_idempotent(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    assert R.transition(ledger, "j", JobState.DISPATCHING, attempt=1)
    assert not R.transition(ledger, "j", JobState.DISPATCHING, attempt=1)  # a retried write: nothing new
    with pytest.raises(InvalidTransition):
        R.transition(ledger, "j", JobState.SUCCEEDED, attempt=1)  # DISPATCHING -> SUCCEEDED is not an edge
    assert R.job(ledger, "j")["state"] == "DISPATCHING"
    assert ledger.scalar("SELECT count(*) FROM job_states WHERE job_id = 'j'") == 3
    with pytest.raises(NotFound):
        R.transition(ledger, "nobody", JobState.QUEUED, attempt=1)


def test_compare_and_set_lets_one_of_two_racers_win(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    wins = [R.transition(ledger, "j", JobState.DISPATCHING, attempt=1, only_from={JobState.QUEUED}) for _ in range(2)]
    assert wins == [True, False]


def test_a_writer_about_an_older_attempt_never_moves_the_job(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    R.transition(ledger, "j", JobState.DISPATCHING, attempt=1)
    R.transition(ledger, "j", JobState.LOST, attempt=1)
    R.transition(ledger, "j", JobState.QUEUED, attempt=2)
    assert not R.transition(ledger, "j", JobState.FAILED, attempt=1)
    assert R.job(ledger, "j")["state"] == "QUEUED"


def test_a_repeated_key_keeps_the_first_row_unless_the_table_updates(tmp_path):
    ledger = fresh(tmp_path)
    row = {"checkpoint_key": "j/a1/1", "job_id": "j", "sha256": "a", "created_at": now()}
    ledger.commit({"checkpoints": [row]})
    ledger.commit({"checkpoints": [{**row, "sha256": "b"}]})
    assert ledger.rows("SELECT sha256 FROM checkpoints") == [{"sha256": "a"}]


def test_migrations_are_versioned_and_a_newer_ledger_is_refused(tmp_path):
    ledger = fresh(tmp_path)
    assert current_version(ledger) == LATEST
    assert upgrade_schema(ledger) == LATEST  # nothing to do the second time
    con = sqlite3.connect(tmp_path / "l" / "ledger.sqlite")
    con.execute("INSERT INTO schema_migrations VALUES (?, 'from the future', 0)", [LATEST + 1])
    con.commit()
    with pytest.raises(LedgerError, match="newer than this orbit-dagster"):
        upgrade_schema(Ledger(url(tmp_path)))


def test_migration_4_gives_an_older_ledgers_runs_the_hand_off_columns(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    ledger.commit({"runs": [{"run_id": "j/1", "job_id": "j", "attempt": 1, "state": "RUNNING"}]})
    con = sqlite3.connect(tmp_path / "l" / "ledger.sqlite")  # the runs table as version 3 left it
    for column in ("handed_off_at", "follow_offset", "follow_step", "follow_progress_at"):
        con.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    con.execute("DELETE FROM schema_migrations WHERE version >= 4")
    con.commit()
    con.close()
    reopened = Ledger(url(tmp_path))
    assert upgrade_schema(reopened) == 3 and current_version(reopened) == LATEST
    assert reopened.one("SELECT run_id, state, handed_off_at, follow_offset FROM runs") == {
        "run_id": "j/1", "state": "RUNNING", "handed_off_at": None, "follow_offset": None}


def test_a_home_of_the_parquet_ledger_is_refused_with_the_fix(tmp_path):
    (tmp_path / "l" / "segments" / "c-1").mkdir(parents=True)
    with pytest.raises(LedgerError, match="orbit ledger upgrade"):
        upgrade_schema(Ledger(url(tmp_path)))


def test_catalog_file_is_usable_by_a_person_with_duckdb(tmp_path):
    ledger = Ledger.open(url(tmp_path))
    ledger.append("events", R.event("hello", job_id="j"))
    assert list(ledger.query("SELECT kind FROM events")["kind"]) == ["hello"]  # the face writes ledger.duckdb
    con = duckdb.connect(str(tmp_path / "l" / "ledger.duckdb"), read_only=True)
    assert con.execute("SELECT kind FROM events").fetchall() == [("hello",)]
    assert con.execute("SELECT count(*) FROM cost_by_job").fetchone() == (0,)


def test_cost_views_sum_to_the_bill_with_waste_and_overhead_lines(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    lines = [("train", "j/a1/10", 3.0), ("train", "j/a1/20", 2.0), ("wasted", None, 0.5), ("overhead", None, 0.25)]
    ledger.commit({
        "instances": [{"instance_id": "i", "job_id": "j", "started_at": 0.0, "stopped_at": 5.75, "usd_per_second": 1.0,
                       "billed_usd": 5.75, "gpu_count": 2}],
        "costs": [{"cost_id": f"i:{n}", "instance_id": "i", "job_id": "j", "attempt": 1, "kind": kind,
                   "checkpoint_key": key, "seconds": usd, "usd": usd, "gpu_count": 2}
                  for n, (kind, key, usd) in enumerate(lines)],
    })
    by_ckpt = ledger.rows("SELECT line, usd FROM cost_by_checkpoint ORDER BY line")
    assert sum(r["usd"] for r in by_ckpt) == pytest.approx(5.75)
    assert {r["line"] for r in by_ckpt} == {"j/a1/10", "j/a1/20", "(wasted)", "(overhead)"}
    job = ledger.one("SELECT * FROM cost_by_job")
    assert job["usd"] == pytest.approx(5.75) and job["wasted_usd"] == 0.5 and job["overhead_usd"] == 0.25
    assert job["wasted_gpu_seconds"] == 1.0 and job["eval_usd"] == 0  # never NULL (NaN in pandas)


def test_cost_by_job_sets_eval_dollars_beside_train_dollars_and_their_ratio(tmp_path):
    from orbit_dagster.ledger.queries import cost_table

    ledger = fresh(tmp_path)
    new_job(ledger)
    new_job(ledger, "imported")
    lines = [("j", "train", "j/a1/10", 4.0), ("j", "eval", "j/a1/10", 1.0), ("imported", "eval", "imported/a1/5", 0.5)]
    ledger.commit({"costs": [{"cost_id": f"i:{n}", "instance_id": "i", "job_id": job, "attempt": 1, "kind": kind,
                              "checkpoint_key": key, "seconds": usd, "usd": usd, "gpu_count": 1}
                             for n, (job, kind, key, usd) in enumerate(lines)]})
    rows = {r["job_id"]: r for r in ledger.rows("SELECT job_id, train_usd, eval_usd, eval_per_train FROM cost_by_job")}
    assert rows["j"] == {"job_id": "j", "train_usd": 4.0, "eval_usd": 1.0, "eval_per_train": 0.25}
    assert rows["imported"]["eval_per_train"] is None  # no training bill: no ratio
    table = cost_table(ledger, "job")  # what `orbit cost --by job` prints
    assert list(table.columns[3:7]) == ["usd", "train_usd", "eval_usd", "eval_per_train"]
    # The same view in the DuckDB face (`orbit sql`, `duckdb ledger.duckdb`).
    assert ledger.query("SELECT eval_per_train FROM cost_by_job WHERE job_id = 'j'")["eval_per_train"][0] == 0.25


def test_a_metric_read_twice_is_recorded_once(tmp_path):
    ledger = fresh(tmp_path)
    point = {"job_id": "j", "run_id": "j#1", "step": 5, "name": "train/loss", "value": 2.5, "source": "train", "ts": now()}
    ledger.commit({"metric_points": [point]})
    ledger.commit({"metric_points": [point, {**point, "step": 6}]})  # a re-attached run reads from the start
    assert ledger.scalar("SELECT count(*) FROM metric_points") == 2


def test_a_parquet_ledger_home_is_upgraded_once_and_kept(tmp_path):
    """A home written by the old Parquet-commit ledger: refused until upgraded, then whole."""
    from orbit_dagster.ledger.legacy import upgrade

    segments = tmp_path / "l" / "segments"
    con = duckdb.connect()
    t = "TIMESTAMPTZ '2026-01-01 00:00:00+00'"
    tables = {
        "jobs": f"SELECT 'j' AS job_id, 'charlm-finetune' AS template, 1 AS template_version, 'train' AS kind, "
                f"'e' AS experiment, 'p' AS project, 'sim' AS placement, 5 AS max_interruptions, {t} AS created_at",
        "job_states": f"SELECT 'j' AS job_id, 1 AS attempt, s AS state, '' AS reason, NULL AS failure_class, '{{}}' AS "
                      f"detail, {t} + to_seconds(i) AS ts FROM (VALUES ('CREATED', 0), ('QUEUED', 1), ('SUCCEEDED', 2)) v(s, i)",
        "checkpoints": f"SELECT 'j/40' AS checkpoint_key, 'j' AS job_id, 'j#1' AS run_id, 1 AS attempt, 40 AS step, "
                       f"'durable' AS tier, NULL AS parent_key, 'file:///x' AS uri, 'ab' AS sha256, 10 AS bytes, "
                       f"'cd' AS weights_sha256, 2.5::DOUBLE AS train_loss, 0.1::DOUBLE AS save_seconds, {t} AS created_at, "
                       f"{t} AS registered_at",
        "costs": f"SELECT 'i:0' AS cost_id, 'i' AS instance_id, 'j' AS job_id, 'j#1' AS run_id, 1 AS attempt, "
                 f"'j/40' AS checkpoint_key, 'train' AS kind, {t} AS start_ts, {t} + to_seconds(10) AS end_ts, "
                 f"10.0::DOUBLE AS seconds, 0.5::DOUBLE AS usd_per_second, 5.0::DOUBLE AS usd",
    }
    for n, (table, sql) in enumerate(tables.items()):
        folder = segments / f"c-{n:019d}-1-aa"
        folder.mkdir(parents=True, exist_ok=True)
        con.execute(f"COPY ({sql}) TO '{folder / (table + '.parquet')}' (FORMAT parquet)")
    with pytest.raises(LedgerError, match="orbit ledger upgrade"):
        upgrade_schema(Ledger(url(tmp_path)))
    counts = upgrade(tmp_path / "l", url(tmp_path))
    assert counts["jobs"] == 1 and counts["checkpoints"] == 1 and counts["costs"] == 1
    ledger = Ledger(url(tmp_path))
    upgrade_schema(ledger)  # no longer refused
    job = R.job(ledger, "j")
    assert (job["state"], job["attempt"], job["lineage"]) == ("SUCCEEDED", 1, "L1-legacy")
    assert ledger.one("SELECT checkpoint_key, experiment FROM checkpoints") == {"checkpoint_key": "j/40", "experiment": "e"}
    assert ledger.scalar("SELECT sum(usd) FROM cost_by_job") == 5.0
    assert (tmp_path / "l" / "segments.bak").is_dir() and not segments.exists()


def test_migration_6_gives_an_older_ledger_the_run_workers_table(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    con = sqlite3.connect(tmp_path / "l" / "ledger.sqlite")  # as version 4 left it
    con.execute("DROP TABLE run_workers")
    con.execute("DELETE FROM schema_migrations WHERE version >= 6")
    con.commit()
    con.close()
    reopened = Ledger(url(tmp_path))
    assert upgrade_schema(reopened) < 6 and current_version(reopened) == LATEST
    assert reopened.scalar("SELECT count(*) FROM run_workers") == 0
    assert reopened.scalar("SELECT count(*) FROM jobs") == 1


def test_migration_10_gives_an_older_ledgers_checkpoints_the_trained_at_column(tmp_path):
    ledger = fresh(tmp_path)
    new_job(ledger)
    ledger.commit({"checkpoints": [{"checkpoint_key": "j/a1/40", "job_id": "j", "step": 40, "created_at": 5.0}]})
    con = sqlite3.connect(tmp_path / "l" / "ledger.sqlite")  # the checkpoints table as version 9 left it
    con.execute("ALTER TABLE checkpoints DROP COLUMN trained_at")
    con.execute("DELETE FROM schema_migrations WHERE version >= 10")
    con.commit()
    con.close()
    reopened = Ledger(url(tmp_path))
    assert upgrade_schema(reopened) == 9 and current_version(reopened) == LATEST
    assert reopened.one("SELECT checkpoint_key, trained_at FROM checkpoints") == {
        "checkpoint_key": "j/a1/40", "trained_at": None}  # not known: its waste is cut at its durable time
