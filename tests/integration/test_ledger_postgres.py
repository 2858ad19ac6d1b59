"""The ledger and the `team` profile on a real PostgreSQL (a throwaway cluster, tests/postgres.py):
migrations under concurrency, many writers, compare-and-set, the DuckDB face, the databases
made on first use, errors that name the fix, and the profile switch both ways."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest
import yaml

from orbit_dagster.control.best import rank_best
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import Ledger, LedgerError
from orbit_dagster.ledger import queries as Q
from orbit_dagster.ledger import records as R
from orbit_dagster.ledger.face import SqlRefused
from orbit_dagster.ledger.migrations import LATEST
from orbit_dagster.settings import Settings
from tests.postgres import postgres, team_profile  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


def now():
    return datetime.now(timezone.utc)


def new_job(ledger, job_id="j", placement="sim"):
    with ledger.write() as tx:
        R.insert_job(tx, {"job_id": job_id, "experiment": "e", "project": "p", "placement": placement,
                          "created_at": now()},
                     [R.state_row(job_id, 1, JobState.CREATED), R.state_row(job_id, 1, JobState.QUEUED)])


def _open_at_once(url: str, go: str, out) -> None:
    while not os.path.exists(go):
        time.sleep(0.005)
    try:
        Ledger.open(url)
        out.put("ok")
    except Exception as exc:  # reported to the test, which fails naming it
        out.put(f"{type(exc).__name__}: {exc}")


def _writer_and_racer(url: str, worker: int, n: int, jobs: int, go: str, out) -> None:
    ledger = Ledger.open(url)
    while not os.path.exists(go):
        time.sleep(0.005)
    won = [j for j in range(jobs) if R.transition(ledger, f"race-{j}", JobState.DISPATCHING, attempt=1,
                                                  only_from={JobState.QUEUED})]
    for i in range(n):
        ledger.append("events", R.event("load", job_id=f"w{worker}", seq=i))
    out.put(won)


def spawn(target, *args):
    return mp.get_context("spawn").Process(target=target, args=args)


def test_processes_opening_a_new_ledger_together_migrate_it_once(postgres, tmp_path):
    url = postgres.url(postgres.create_database(), driver="psycopg")
    go, out = str(tmp_path / "go"), mp.get_context("spawn").Queue()
    procs = [spawn(_open_at_once, url, go, out) for _ in range(4)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # all four importing and waiting
    open(go, "w").close()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert results == ["ok"] * 4
    ledger = Ledger.open(url)
    assert ledger.rows("SELECT version FROM schema_migrations ORDER BY version") == \
        [{"version": v} for v in range(1, LATEST + 1)]


def test_writers_lose_nothing_and_each_race_has_one_winner(postgres, tmp_path):
    url = postgres.url(postgres.create_database(), driver="psycopg")
    ledger = Ledger.open(url)
    for j in range(20):
        new_job(ledger, f"race-{j}")
    go, out = str(tmp_path / "go"), mp.get_context("spawn").Queue()
    procs = [spawn(_writer_and_racer, url, w, 300, 20, go, out) for w in range(6)]
    for p in procs:
        p.start()
    time.sleep(2.0)
    open(go, "w").close()
    wins = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(j for won in wins for j in won) == list(range(20))  # each job moved exactly once
    assert ledger.scalar("SELECT count(*) FROM events") == 1800
    assert ledger.scalar("SELECT count(DISTINCT event_id) FROM events") == 1800
    assert ledger.scalar("SELECT count(*) FROM job_states WHERE state = 'DISPATCHING'") == 20


def test_transitions_views_and_the_duckdb_face(postgres):
    ledger = Ledger.open(postgres.url(postgres.create_database(), driver="psycopg"))
    new_job(ledger)
    assert R.transition(ledger, "j", JobState.DISPATCHING, attempt=1)
    assert not R.transition(ledger, "j", JobState.DISPATCHING, attempt=1)
    # A parameter whose type only its value tells (`? IS NULL`), the kind PostgreSQL refuses
    # with server-side binding.
    assert ledger.scalar("SELECT count(*) FROM jobs WHERE (? IS NULL OR placement = ?)", [None, None]) == 1
    assert ledger.scalar("SELECT count(*) FROM jobs WHERE (? IS NULL OR placement = ?)", ["sim", "sim"]) == 1
    ledger.commit({
        "instances": [{"instance_id": "i", "job_id": "j", "started_at": 0.0, "stopped_at": 5.75,
                       "usd_per_second": 1.0, "billed_usd": 5.75, "gpu_count": 2},
                      {"instance_id": "live", "job_id": "j", "started_at": time.time() - 10, "usd_per_second": 1.0}],
        "costs": [{"cost_id": f"i:{n}", "instance_id": "i", "job_id": "j", "attempt": 1, "kind": kind,
                   "checkpoint_key": key, "seconds": usd, "usd": usd, "gpu_count": 2}
                  for n, (kind, key, usd) in enumerate([("train", "j/a1/10", 5.0), ("wasted", None, 0.75)])],
    })
    assert ledger.one("SELECT usd, wasted_usd FROM cost_by_job") == {"usd": 5.75, "wasted_usd": 0.75}
    live = ledger.one("SELECT seconds, running FROM instance_usage WHERE instance_id = 'live'")
    assert live["running"] == 1 and 9 < live["seconds"] < 120  # now() on PostgreSQL, in epoch seconds
    # The people's face: DuckDB attaches the PostgreSQL store read-only.
    face = ledger.query("SELECT job_id, state FROM jobs")
    assert face.to_dict("records") == [{"job_id": "j", "state": "DISPATCHING"}]
    assert float(ledger.query("SELECT sum(usd) AS usd FROM cost_by_checkpoint")["usd"][0]) == pytest.approx(5.75)
    for statement in ("DELETE FROM jobs", "UPDATE store.jobs SET state = 'FAILED'",
                      "ATTACH 'dbname=postgres' AS other (TYPE postgres)", "COPY jobs TO '/tmp/x.csv'"):
        with pytest.raises(SqlRefused):
            ledger.query(statement)
    assert R.job(ledger, "j")["state"] == "DISPATCHING"
    # A follower that re-attaches re-reads the host's events: a metric point it already wrote is ignored.
    point = {"job_id": "j", "run_id": "j#1", "source": "train", "name": "train/loss", "step": 1, "value": 4.3,
             "ts": time.time()}
    assert ledger.commit({"metric_points": [point]}) == 1
    assert ledger.commit({"metric_points": [point, {**point, "step": 2}]}) == 1
    assert ledger.scalar("SELECT count(*) FROM metric_points") == 2
    # The read paths of `orbit status JOB`, `orbit best` and `orbit cost --job` on PostgreSQL
    # (round(double, int) and a 74-character index name once broke them there only).
    ledger.commit({"checkpoints": [{"checkpoint_key": f"j/a1/{s}", "job_id": "j", "experiment": "e", "lineage": None,
                                    "step": s, "train_loss": 1.0 / s} for s in (10, 20)],
                   "metric_points": [{"job_id": "j", "experiment": "e", "run_id": f"eval:j/a1/{s}", "source": "eval",
                                      "checkpoint_key": f"j/a1/{s}", "name": "eval/loss", "step": s,
                                      "value": v, "ts": time.time()} for s, v in ((10, 0.5), (20, float("nan")))]})
    assert Q.checkpoints(ledger, "j")["train_loss"].tolist() == [0.1, 0.05]
    best = rank_best(ledger, "e", "eval/loss", "min", lineage="all")
    assert (best.checkpoint_key, best.candidates) == ("j/a1/10", 1)  # NaN never competes, on PostgreSQL too
    assert Q.cost_table(ledger, "checkpoint", job="j")["usd"].sum() == pytest.approx(5.75)


def test_the_face_never_hands_duckdb_a_password():
    from orbit_dagster.ledger.face import _libpq_dsn

    dsn = _libpq_dsn("postgresql+psycopg://orbit:s3cret@db.example:5433/ledger")
    assert "s3cret" not in dsn and "host=db.example" in dsn and "port=5433" in dsn


def test_a_missing_database_is_made_and_a_role_that_may_not_gets_the_statement_to_ask_for(postgres):
    url = postgres.url("made_on_first_use", driver="psycopg")
    assert Ledger.open(url).scalar("SELECT count(*) FROM jobs") == 0
    assert postgres.sql("SELECT 1 FROM pg_database WHERE datname = 'made_on_first_use'") == [(1,)]
    postgres.sql("CREATE ROLE limited LOGIN NOCREATEDB")
    with pytest.raises(LedgerError) as err:
        Ledger.open(url.replace("orbit@", "limited@").replace("made_on_first_use", "not_allowed"))
    assert 'CREATE DATABASE "not_allowed" OWNER "limited"' in str(err.value)


def test_an_unreachable_server_is_one_line_without_the_password(tmp_path):
    env = {**os.environ, "ORBIT_HOME": str(tmp_path / "home"),
           "ORBIT_LEDGER_URL": "postgresql+psycopg://orbit:s3cret@127.0.0.1:9/ledger"}
    proc = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", "status"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the ledger's PostgreSQL at 127.0.0.1:9" in lines[0]
    assert "s3cret" not in proc.stderr and "fix:" in lines[0]


def orbit(*args, env=None):
    return subprocess.run([sys.executable, "-m", "orbit_dagster.cli", *args], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=180)


def test_team_profile_puts_dagster_and_the_ledger_on_postgres_and_one_setting_switches_back(team_profile, orbit_home):
    from orbit_dagster.deploy.instance import dagster_instance, ensure_dagster_home

    postgres, name = team_profile
    settings = Settings.from_env(orbit_home)
    home = ensure_dagster_home(settings)
    assert home == orbit_home / "dagster-team"
    cfg = yaml.safe_load((home / "dagster.yaml").read_text())
    assert cfg["storage"]["postgres"]["postgres_db"] == {"hostname": "127.0.0.1", "port": postgres.port,
                                                          "username": "orbit", "db_name": f"{name}_dagster",
                                                          "scheme": "postgresql+psycopg2"}
    assert cfg["run_retries"] == {"enabled": True, "max_retries": 1, "retry_on_asset_or_op_failure": False}
    with dagster_instance(settings) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.run_coordinator).__name__ == "OrbitRunCoordinator"
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
        assert {"key": "orbit/pool", "value": "sim", "limit": 4} in limits
        assert {"key": "orbit/train-pool", "value": "sim", "limit": 3} in limits
    assert postgres.sql("SELECT count(*) FROM runs", database=f"{name}_dagster") == [(0,)]  # Dagster's tables
    ledger = settings.ledger()
    assert ledger.dialect == "postgresql" and ledger.url == settings.profile.ledger_url
    new_job(ledger, "kept")
    report = json.loads(orbit("profile", "--json").stdout)
    assert report["profile"] == "team" and report["ledger_kind"] == "postgresql"
    assert report["pools"]["sim"] == {"limit": 4, "trainings": 3}
    assert report["dagster_yaml_state"] == "as orbit writes it for this profile"

    # Back to embedded: one setting; SQLite for both, the team's data untouched on PostgreSQL.
    embedded = {**os.environ, "ORBIT_PROFILE": "embedded"}
    report = json.loads(orbit("profile", "--json", env=embedded).stdout)
    assert report["dagster_home"] == str(orbit_home / "dagster") and report["ledger_kind"] == "sqlite"
    assert report["dagster_storage"] == "SQLite files in the Dagster home" and report["run_retries"] == 0
    assert "kept" not in orbit("status", env=embedded).stdout
    assert "kept" in orbit("status").stdout  # ORBIT_PROFILE=team again: the same PostgreSQL ledger


def test_dagster_yaml_is_written_once_and_never_overwritten(team_profile, orbit_home, monkeypatch):
    from orbit_dagster.deploy.instance import ensure_dagster_home

    settings = Settings.from_env(orbit_home)
    cfg = ensure_dagster_home(settings) / "dagster.yaml"
    edited = cfg.read_text().replace("limit: 4", "limit: 6", 1)
    cfg.write_text(edited)
    monkeypatch.setenv("ORBIT_POOLS", "sim=9")  # a different quota now: the operator's file still wins
    ensure_dagster_home(settings)
    assert cfg.read_text() == edited
    report = json.loads(orbit("profile", "--json").stdout)
    assert report["pools"]["sim"]["limit"] == 6 and report["dagster_yaml_state"].startswith("differs")
    assert "limit: 9" in orbit("profile", "--config").stdout  # what the profile would write now


def test_team_profile_without_a_server_is_refused_naming_the_setting(orbit_home, monkeypatch):
    monkeypatch.setenv("ORBIT_PROFILE", "team")
    monkeypatch.delenv("ORBIT_POSTGRES_URL", raising=False)
    proc = orbit("status")
    assert proc.returncode == 2 and "ORBIT_POSTGRES_URL" in proc.stderr and "Traceback" not in proc.stderr
    monkeypatch.setenv("ORBIT_POSTGRES_URL", "postgresql://orbit:pw@127.0.0.1:5432/orbit")
    proc = orbit("status")
    assert proc.returncode == 2 and "PGPASSWORD" in proc.stderr and "pw@" not in proc.stderr


# ---- the ledger's identity on a team's PostgreSQL (ledger/identity.py) ----------------------

def test_homes_sharing_a_team_ledger_record_its_one_id(postgres, tmp_path):
    from orbit_dagster.ledger.identity import read_id, read_record

    url = postgres.url(postgres.create_database(), driver="psycopg")
    first, second = tmp_path / "machine-1", tmp_path / "machine-2"
    ledger = Ledger.open(url, home=first)
    ledger_id = read_id(ledger)
    Ledger.open(url, home=second)  # the same process, another home: checked and recorded for it too
    key = f"postgresql://127.0.0.1:{postgres.port}/{url.rsplit('/', 1)[1]}"
    assert read_record(first)[key]["ledger_id"] == read_record(second)[key]["ledger_id"] == ledger_id
    assert postgres.sql("SELECT ledger_id FROM ledger_identity", database=url.rsplit("/", 1)[1]) == [(ledger_id,)]


def test_a_reset_team_database_is_refused_by_a_home_that_recorded_it_and_repair_takes_it(postgres, tmp_path):
    from orbit_dagster.control.ledger_care import check
    from orbit_dagster.control.ledger_repair import repair
    from orbit_dagster.ledger import LedgerIdentityError
    from orbit_dagster.ledger.identity import read_id, read_record

    name = postgres.create_database()
    url = postgres.url(name, driver="psycopg")
    home = tmp_path / "home"
    recorded = read_id(Ledger.reopen(url, home=home))
    postgres.sql(f'DROP DATABASE "{name}" WITH (FORCE)')
    with pytest.raises(LedgerIdentityError, match=f"not there .* recorded ledger {recorded}"):
        Ledger.reopen(url, home=home)  # a home that recorded it: the database is not made anew
    assert postgres.sql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'") == []
    postgres.create_database(name)  # a DBA made it again, empty
    with pytest.raises(LedgerIdentityError, match="not there"):
        Ledger.reopen(url, home=home)
    os.environ["ORBIT_LEDGER_URL"] = url
    try:
        settings = Settings.from_env(home)
        assert check(settings).verdict.state == "missing"
        report = repair(settings)
    finally:
        del os.environ["ORBIT_LEDGER_URL"]
    assert report.made_new and report.moved_to is None and report.ledger_id != recorded
    entry = read_record(home)[f"postgresql://127.0.0.1:{postgres.port}/{name}"]
    assert entry["ledger_id"] == report.ledger_id and entry["replaced"][0]["ledger_id"] == recorded
    assert read_id(Ledger.reopen(url, home=home)) == report.ledger_id


def test_backing_up_a_team_ledger_is_refused_naming_pg_dump(tmp_path):
    env = {**os.environ, "ORBIT_HOME": str(tmp_path / "home"),
           "ORBIT_LEDGER_URL": "postgresql+psycopg://orbit:s3cret@db.example:5433/orbit"}
    proc = orbit("ledger", "backup", env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "s3cret" not in proc.stderr
    assert "pg_dump --format=custom --file=orbit-ledger-$(date -u +%Y%m%dT%H%M%SZ).dump " \
           "'postgresql://orbit@db.example:5433/orbit'" in lines[0]
