"""How much of a provider's pool is held: counted from the ledger and Dagster's runs in flight."""
import pytest

from orbit_dagster.control.capacity import capacity, limits_from_tags
from orbit_dagster.deploy.profiles import POOL_TAG, TRAIN_POOL_TAG, Profile, parse_pools, render_dagster_yaml
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings

LIMITS = [{"key": POOL_TAG, "value": "sim", "limit": 4}, {"key": TRAIN_POOL_TAG, "value": "sim", "limit": 3},
          {"key": POOL_TAG, "value": "aws_spot", "limit": 1}, {"key": "other", "value": "x", "limit": 9}]


@pytest.fixture
def ledger(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    for i, (state, placement) in enumerate([("RUNNING", "sim"), ("DISPATCHING", "sim"), ("QUEUED", "sim"),
                                             ("SUCCEEDED", "sim"), ("RUNNING", "aws_spot")]):
        with ledger.write() as tx:
            R.insert_job(tx, {"job_id": f"j{i}", "experiment": "e", "project": "p", "created_at": 1.0,
                              "placement": placement}, [R.state_row(f"j{i}", 1, state)])
            tx.execute("UPDATE jobs SET state = ? WHERE job_id = ?", [state, f"j{i}"])
    return ledger


def test_the_limits_are_read_from_dagsters_tag_limits():
    assert limits_from_tags(LIMITS) == ({"sim": 4, "aws_spot": 1}, {"sim": 3})
    # ... as orbit writes them into dagster.yaml for ORBIT_POOLS.
    import yaml

    text = render_dagster_yaml(Profile("embedded", parse_pools("sim=6 aws_spot=1")))
    tags = yaml.safe_load(text)["concurrency"]["runs"]["tag_concurrency_limits"]
    pools, trains = limits_from_tags(tags)
    assert pools["sim"] == 6 and trains["sim"] == 5 and pools["aws_spot"] == 1 and "aws_spot" not in trains


def test_trainings_and_evaluations_held_count_once_each(ledger):
    in_flight = [
        {POOL_TAG: "sim", TRAIN_POOL_TAG: "sim", "orbit/job": "j0"},  # re-attach run of a RUNNING job: no new host
        {POOL_TAG: "sim", TRAIN_POOL_TAG: "sim", "dagster/partition": "j2"},  # queued job's run, about to dispatch
        {POOL_TAG: "sim", "orbit/kind": "eval", "orbit/checkpoint": "j3/a1/10", "orbit/suite": "s"},
        {"orbit/kind": "best"},  # rents nothing
    ]
    room = capacity(ledger, LIMITS, in_flight)
    assert room.trains["sim"] == {"j0", "j1", "j2"} and room.evals["sim"] == {"j3/a1/10|s"}
    assert room.held("sim") == 4
    assert not room.may_train("sim") and not room.may_eval("sim")  # the pool is full
    assert room.training("j2") and not room.training("j3") and room.evaluating("j3/a1/10", "s")
    assert not room.may_train("aws_spot")  # its one instance is j4's
    assert room.may_train("ssh_rental") and room.may_eval("ssh_rental")  # no limit in dagster.yaml


def test_trainings_leave_the_reserve_to_evaluations(ledger):
    room = capacity(ledger, LIMITS, [])
    assert room.held("sim") == 2 and room.may_train("sim")
    room.trains["sim"].add("new")
    assert not room.may_train("sim")  # 3 trainings: the train limit
    assert room.may_eval("sim")  # the fourth instance is the evaluations'
    room.evals["sim"].add("c|s")
    assert not room.may_eval("sim")


def test_an_evaluation_leaves_the_slot_a_queued_training_needs(ledger):
    room = capacity(ledger, LIMITS, [])  # j0, j1 train; j2 is QUEUED with no run yet
    assert room.held("sim") == 2 and room.train_room("sim") == 1
    assert room.may_eval("sim")  # two free slots, one is j2's
    room.evals["sim"].add("c|s")
    assert not room.may_eval("sim") and room.may_train("sim")  # the last free slot waits for j2
    room.trains["sim"].add("j2")  # j2 got its run: nothing waits, the pool is full
    assert room.train_room("sim") == 0 and not room.may_eval("sim")


def test_a_lost_attempt_about_to_resume_keeps_its_slot_from_evaluations(ledger):
    with ledger.write() as tx:
        tx.execute("UPDATE jobs SET state = 'LOST' WHERE job_id = 'j1'")  # reclaimed: it resumes next
    room = capacity(ledger, LIMITS, [{POOL_TAG: "sim", "orbit/kind": "eval", "orbit/checkpoint": "j3/a1/4",
                                      "orbit/suite": "s", "orbit/job": "j3"}])
    assert room.held("sim") == 2 and room.train_room("sim") == 2  # j1 (LOST) and j2 (QUEUED)
    assert not room.may_eval("sim") and room.may_train("sim")
    assert room.evaluating_job("j3", "s") and not room.evaluating_job("j3", "other")


def test_trainings_go_ahead_of_evaluations_in_dagsters_queue():
    from orbit_dagster.control.capacity import run_priority

    assert run_priority("train", 2) > run_priority("train", 1) > run_priority("eval") == 0
