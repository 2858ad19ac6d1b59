"""Deployment profiles and the services' log filter, one function at a time."""
import pytest
import yaml

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.deploy.profiles import Pool, PostgresServer, parse_pools, pool_tags, render_dagster_yaml
from orbit_dagster.deploy.services import clean_line
from orbit_dagster.settings import Settings


def test_pools_leave_evaluations_a_quarter_of_each_provider():
    assert [(p.limit, p.train_limit, p.eval_reserve) for p in map(lambda n: Pool("sim", n), (1, 2, 4, 8, 9))] == \
        [(1, 1, 0), (2, 1, 1), (4, 3, 1), (8, 6, 2), (9, 7, 2)]
    assert pool_tags("aws_spot", "train") == {"orbit/pool": "aws_spot", "orbit/train-pool": "aws_spot",
                                              "dagster/priority": "10"}  # ahead of evaluations in Dagster's queue
    assert pool_tags("aws_spot", "eval") == {"orbit/pool": "aws_spot"}
    assert pool_tags(None, "train") == {}


@pytest.mark.parametrize("text, fix", [("sim=0", "whole number >= 1"), ("gpu=4", "does not name a provider"),
                                       ("sim", "does not name a provider"), ("sim=four", "whole number >= 1")])
def test_a_bad_pools_setting_names_itself(text, fix):
    with pytest.raises(OrbitError) as err:
        parse_pools(text)
    assert err.value.field == "ORBIT_POOLS" and err.value.value == text and fix in str(err.value)


def test_pools_override_the_defaults():
    assert {p.name: p.limit for p in parse_pools("sim=6, aws_spot=8")} == {"sim": 6, "ssh_rental": 2, "aws_spot": 8}


def test_the_team_server_url_is_checked_and_never_carries_a_password():
    pg = PostgresServer.parse("postgresql://orbit@db.internal:5433/ledger")
    assert (pg.host, pg.port, pg.database, pg.dagster_database) == ("db.internal", 5433, "ledger", "ledger_dagster")
    assert pg.ledger_url == "postgresql+psycopg://orbit@db.internal:5433/ledger"
    assert PostgresServer.parse("postgresql://orbit@db").database == "orbit"
    for bad in (None, "", "mysql://orbit@db/x", "postgresql:///x", "not a url"):
        with pytest.raises(OrbitError, match="ORBIT_POSTGRES_URL"):
            PostgresServer.parse(bad)
    with pytest.raises(OrbitError) as err:
        PostgresServer.parse("postgresql://orbit:hunter2@db/x")
    assert "hunter2" not in str(err.value) and "PGPASSWORD" in str(err.value)


def test_profiles_are_one_setting(monkeypatch, tmp_path):
    embedded = Settings.from_env(tmp_path).profile
    assert embedded.name == "embedded" and embedded.ledger_url is None and not embedded.chosen
    monkeypatch.setenv("ORBIT_PROFILE", "team")
    monkeypatch.setenv("ORBIT_POSTGRES_URL", "postgresql://orbit@127.0.0.1:5432/orbit")
    team = Settings.from_env(tmp_path).profile
    assert team.dagster_dir == "dagster-team" and team.ledger_url.startswith("postgresql+psycopg://") and team.chosen
    assert Settings.from_env(tmp_path).ledger_url == team.ledger_url  # the team's ledger is its PostgreSQL
    monkeypatch.setenv("ORBIT_PROFILE", "teams")
    with pytest.raises(OrbitError, match="ORBIT_PROFILE=embedded"):
        Settings.from_env(tmp_path)


def test_who_follows_a_training_is_one_setting_with_a_default_per_profile(monkeypatch, tmp_path):
    assert Settings.from_env(tmp_path).follow == "run"
    monkeypatch.setenv("ORBIT_PROFILE", "team")
    monkeypatch.setenv("ORBIT_POSTGRES_URL", "postgresql://orbit@127.0.0.1:5432/orbit")
    assert Settings.from_env(tmp_path).follow == "daemon"
    monkeypatch.setenv("ORBIT_FOLLOW", "run")
    assert Settings.from_env(tmp_path).follow == "run"
    monkeypatch.setenv("ORBIT_FOLLOW", "sensor")
    with pytest.raises(OrbitError, match="ORBIT_FOLLOW=run") as err:
        Settings.from_env(tmp_path)
    assert err.value.field == "ORBIT_FOLLOW" and err.value.value == "sensor"
    monkeypatch.setenv("ORBIT_FOLLOW", "daemon")
    monkeypatch.setenv("ORBIT_HANDOFF_AFTER_S", "0")
    assert Settings.from_env(tmp_path).handoff_after_s == 0.0
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv("ORBIT_HANDOFF_AFTER_S", bad)
        with pytest.raises(OrbitError, match="ORBIT_HANDOFF_AFTER_S"):
            Settings.from_env(tmp_path)
    monkeypatch.setenv("ORBIT_HANDOFF_AFTER_S", "60")
    monkeypatch.setenv("ORBIT_FOLLOW_EVERY_S", "0")  # 0 would wake a run at every tick
    with pytest.raises(OrbitError, match="ORBIT_FOLLOW_EVERY_S"):
        Settings.from_env(tmp_path)


def test_dagster_yaml_of_each_profile_loads_as_a_dagster_instance_config(monkeypatch, tmp_path):
    from dagster._core.instance.config import dagster_instance_config

    monkeypatch.setenv("ORBIT_POOLS", "sim=5")
    for profile, url in (("embedded", None), ("team", "postgresql://orbit@127.0.0.1:5432/orbit")):
        monkeypatch.setenv("ORBIT_PROFILE", profile)
        if url:
            monkeypatch.setenv("ORBIT_POSTGRES_URL", url)
        text = render_dagster_yaml(Settings.from_env(tmp_path).profile)
        (tmp_path / profile).mkdir()
        (tmp_path / profile / "dagster.yaml").write_text(text)
        config, _ = dagster_instance_config(str(tmp_path / profile))
        limits = config["concurrency"]["runs"]["tag_concurrency_limits"]
        assert {"key": "orbit/pool", "value": "sim", "limit": 5} in limits
        assert {"key": "orbit/train-pool", "value": "sim", "limit": 4} in limits
        assert config["concurrency"]["runs"]["max_concurrent_runs"] == 5 + 2 + 4 + 2
        # orbit's coordinator, which puts runs launched from the UI into their pools.
        assert {k: config["run_coordinator"][k] for k in ("module", "class")} == \
            {"module": "orbit_dagster.deploy.run_coordinator", "class": "OrbitRunCoordinator"}
        assert ("run_retries" in config) == (profile == "team")
        assert ("storage" in config) == (profile == "team")
        assert "password" not in yaml.safe_load(text).get("storage", {}).get("postgres", {}).get("postgres_db", {})


def test_log_lines_lose_colour_codes_and_per_tick_noise():
    coloured = "\x1b[32m2026-11-30 14:15:06 +0000\x1b[0m - dagster.daemon.SensorDaemon - \x1b[34mINFO\x1b[0m - "
    assert clean_line(coloured + "Launching run for job_queue_sensor\n") == \
        "2026-11-30 14:15:06 +0000 - dagster.daemon.SensorDaemon - INFO - Launching run for job_queue_sensor\n"
    for noise in ("Checking for new runs for sensor: job_queue_sensor", "Sensor cost_summary_sensor skipped: x",
                  "Priority sorting and checking tag concurrency limits for queued runs."):
        assert clean_line(coloured + noise + "\n") is None
    assert clean_line("2026 - dagster.daemon.SensorDaemon - ERROR - Sensor x skipped: y\n") is not None
    assert clean_line('INFO:     127.0.0.1:41120 - "GET /server_info HTTP/1.1" 200 OK\n') is None
    assert clean_line('INFO:     127.0.0.1:41120 - "POST /graphql HTTP/1.1" 500 Internal Server Error\n')
    assert clean_line("2026 - dagster - DEBUG - train_job - 1 - 2 - STEP_START - x\n") is None
    assert clean_line("2026 - dagster - INFO - eval_job - 1 - evaluation - evaluated k (heldout)\n")


def test_ticks_cut_off_by_a_stop_are_one_count_while_running_errors_stay_whole():
    import io

    tick_error = ["2026-11-30 20:18:26 +0000 - dagster.daemon.SensorDaemon - ERROR - Sensor tick caught an error\n",
                  "Traceback (most recent call last):\n", '  File "sensor.py", line 649\n',
                  "dagster._core.errors.DagsterCodeLocationNotFoundError: Location x does not exist in workspace\n"]
    tick_error += ["2026-11-30 20:18:26 +0000 - dagster.daemon.SensorDaemon - ERROR - Sensor daemon caught an error "
                   "for sensor job_queue_sensor\n"]
    after = "2026-11-30 20:18:27 +0000 - dagster.daemon - INFO - Daemon threads shut down.\n"

    def pumped(stopping: bool) -> tuple[str, int]:
        import threading

        from orbit_dagster.deploy.services import LogPump, SafeWriter

        out, flag = io.StringIO(), threading.Event()
        pump = LogPump("dagster-daemon", -1, SafeWriter(out), None, flag)
        if stopping:
            flag.set()
        for line in tick_error * 2 + [after]:
            pump.line(line)
        pump.flush()
        return out.getvalue(), pump.cut_off

    text, cut = pumped(stopping=True)
    assert (text, cut) == (after, 10)
    text, cut = pumped(stopping=False)  # a sensor failing while the daemon runs: kept, traceback and all
    assert text == "".join(tick_error * 2) + after and cut == 0
