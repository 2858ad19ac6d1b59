"""The environment helpers a command workload's script may use: nothing outside orbit."""
import json

from orbit_dagster.integrations import env


def test_outside_orbit_every_helper_says_nothing(monkeypatch, tmp_path):
    for name in (env.JOB_ID, env.CHECKPOINT_DIR, env.RESUME_FROM, env.METRICS_FILE, env.STOP_FILE, env.CONFIG,
                 env.CHECKPOINT_EVERY, env.EVAL_CHECKPOINT):
        monkeypatch.delenv(name, raising=False)
    assert not env.under_orbit() and env.checkpoint_dir() is None and env.resume_from() is None
    assert env.metrics_file() is None and not env.stop_requested() and env.config() == {}
    assert env.checkpoint_every() is None and env.eval_checkpoint() is None
    env.write_metrics(1, {"loss": 1.0})  # a no-op, not an error
    assert list(tmp_path.iterdir()) == []


def test_under_orbit_the_helpers_read_the_agents_variables(monkeypatch, tmp_path):
    monkeypatch.setenv(env.JOB_ID, "job-1")
    monkeypatch.setenv(env.METRICS_FILE, str(tmp_path / "m.jsonl"))
    monkeypatch.setenv(env.STOP_FILE, str(tmp_path / "stop"))
    monkeypatch.setenv(env.CHECKPOINT_EVERY, "25")
    (tmp_path / "c.json").write_text(json.dumps({"lr": 0.1}))
    monkeypatch.setenv(env.CONFIG, str(tmp_path / "c.json"))
    env.write_metrics(7, {"train/loss": 2})
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 7, "train/loss": 2.0}
    assert env.under_orbit() and env.checkpoint_every() == 25 and env.config() == {"lr": 0.1}
    assert not env.stop_requested()
    (tmp_path / "stop").touch()
    assert env.stop_requested()


def test_checkpoint_due_follows_the_agents_schedule_once_per_decided_step(monkeypatch, tmp_path):
    monkeypatch.setenv(env.JOB_ID, "job-1")
    monkeypatch.setenv(env.CHECKPOINT_EVERY, "10")
    monkeypatch.delenv(env.CHECKPOINT_SCHEDULE, raising=False)
    assert [s for s in range(1, 31) if env.checkpoint_due(s)] == [10, 20, 30]  # the launch interval alone
    path = tmp_path / "schedule.json"
    monkeypatch.setenv(env.CHECKPOINT_SCHEDULE, str(path))
    assert env.checkpoint_due(20) is True  # no file yet: ORBIT_CHECKPOINT_EVERY holds
    path.write_text(json.dumps({"every": 7, "next_step": None}))
    assert [s for s in range(1, 22) if env.checkpoint_due(s)] == [7, 14, 21]  # the grid before a decision
    path.write_text(json.dumps({"every": 12, "next_step": 33}))
    # due once at 33 (or the first step after it), then not again until the agent decides anew
    assert [s for s in range(25, 45) if env.checkpoint_due(s)] == [33]
    path.write_text(json.dumps({"every": 15, "next_step": 48}))
    assert [s for s in range(45, 60) if env.checkpoint_due(s)] == [48]
    path.write_text("{torn")  # unreadable: the launch interval again, never an exception
    assert env.checkpoint_due(60) is True and env.checkpoint_due(61) is False
    monkeypatch.delenv(env.CHECKPOINT_EVERY)
    monkeypatch.delenv(env.CHECKPOINT_SCHEDULE)
    assert env.checkpoint_due(10) is None  # neither: not under orbit's schedule
