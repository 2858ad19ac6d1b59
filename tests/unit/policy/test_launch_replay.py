"""The replay of the control plane's protocol (tests/launch_replay.py) on hand-made traces; its
end-to-end comparison with the real control plane is tests/integration/test_policy_replay.py."""
import math

import pytest

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.checkpointing import OrbitInterval
from orbit_dagster.policy.reclaim_rate import NoticeReliability, RateBook
from tests.launch_replay import ControlJob, Launch, Move, Tick, replay_control

from .helpers import make_trace, model

OFFER = Offer(offer_id="sim:p3.2xlarge:z", provider="sim", instance_type="p3.2xlarge", gpu="V100", gpu_count=1,
              usd_per_gpu_second_spot=0.9 / 3600, usd_per_gpu_second_on_demand=3.0 / 3600, spec_tflops_bf16=125.0,
              interruption_band=">20%")
# up 100 minutes (reclaimed at 6000 s), down 10, then up for good; 60 s ticks
TRACE = make_trace([1] * 100 + [0] * 10 + [1] * 500, gap=60.0, prices=[0.9] * 610)
JOB = ControlJob(steps=1000, step_s=10.0, notice_s=120.0, submitted_at=0.0)


def two_attempts(**first):
    launches = [Launch(**{"dispatch_at": 0.0, "instance_at": 0.0, "work_at": 300.0, "save_s": 5.0, "step_s": 10.0,
                          **first}),
                Launch(dispatch_at=6600.0, instance_at=6600.0, work_at=6900.0, save_s=5.0, step_s=10.0)]
    return replay_control(TRACE, OFFER, JOB, launches, model=model())


def test_the_interval_is_decided_at_dispatch_then_again_at_each_durable_save_as_the_instance_ages():
    out = two_attempts()
    first, second = out["attempts"]
    # dispatch's question, asked by hand: age 0, the work left from the resume step
    m = model()
    policy = OrbitInterval.for_offer(OFFER, save_s=5.0, notice_s=120.0, model=m, rates=RateBook(model=m),
                                     notices=NoticeReliability())
    expect = policy.decide(age_s=0.0, work_left_s=10000.0)
    assert first["interval_s"] == expect["interval_s"]
    n = first["interval_steps"]
    assert n == round(expect["interval_s"] / 10.0)
    durable = [c["step"] for c in first["checkpoints"] if c["tier"] == "durable"]
    # the first save on the launch interval's grid; each later one where the agent's decision at
    # the save before put it: the policy asked again for the instance's age at that step
    want, k = [], n
    while k < 558:
        want.append(k)
        tau = policy.interval(300.0 + k * 10.0, (1000 - k) * 10.0)
        k += max(1, round(tau / 10.0))
    assert durable == want and len(durable) >= 3
    gaps = [b - a for a, b in zip(durable, durable[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > n  # older instances save less often
    assert [d["step"] for d in first["decisions"]] == durable
    # the notice comes at 5880 s, when step 558 ends: the agent saves there and stops
    assert first["checkpoints"][-1] == {"step": 558, "at": 300.0 + 558 * 10.0, "tier": "emergency"}
    assert (first["end"], first["caught"], first["lost_steps"], first["reclaim_at"]) == ("reclaim", True, 0, 6000.0)
    # the second attempt learnt the reclaim, resumed from the emergency checkpoint, and saves
    # first at the next multiple of its own interval (absolute step numbers)
    assert second["resumed_step"] == 558 and second["rate"]["reclaims"] == 1 and second["notices"]["reclaims"] == 1
    assert second["rate"]["exposure_s"] == pytest.approx(300.0 + 558 * 10.0)  # released after its emergency save
    n2 = second["interval_steps"]
    steps = [c["step"] for c in second["checkpoints"]]
    assert steps[0] == (558 // n2 + 1) * n2 and steps[-1] == 1000 and second["end"] == "finished"
    assert out["finished"] and out["migrations"] == 0 and out["switches"] == []


def test_the_ages_the_agent_measured_replace_the_modelled_ones():
    n = two_attempts()["attempts"][0]["interval_steps"]
    first = two_attempts(decision_ages={n: 4000.0})["attempts"][0]
    assert first["decisions"][0]["age_s"] == 4000.0 and first["decisions"][0]["model_age_s"] == 300.0 + n * 10.0


def test_a_notice_before_the_workload_leaves_nothing_to_save():
    out = two_attempts(work_at=None)
    first, second = out["attempts"]
    assert first["checkpoints"] == [] and first["caught"] is False and first["lost_steps"] == 0
    assert first["release_at"] == 5880.0  # the agent stops at the notice
    assert second["resumed_step"] == 0 and second["notices"] == NoticeReliability(reclaims=1, missed=0).as_record()


def test_the_measured_stop_step_is_used_and_the_model_kept_beside_it():
    first = two_attempts(stopped_step=556)["attempts"][0]
    assert first["checkpoints"][-1]["step"] == 556 and first["stop_step_model"] == 558


def test_a_tick_that_says_on_demand_moves_the_job_make_before_break():
    job = ControlJob(steps=100, step_s=10.0, notice_s=120.0, submitted_at=0.0, deadline_s=1500.0)
    launch = Launch(dispatch_at=0.0, instance_at=0.0, work_at=100.0, save_s=5.0, step_s=10.0)
    ticks = (Tick(at=180.0, known_step=5, step_s=10.0, save_s=5.0), Tick(at=900.0, known_step=70, step_s=10.0,
                                                                        save_s=5.0))
    move = Move(emergency_after_s=25.0, instance_after_s=10.0, work_after_s=60.0, dispatch_after_s=40.0)
    out = replay_control(TRACE, OFFER, job, [launch], ticks=ticks, move=move, model=model())
    first, second = out["attempts"]
    assert out["switches"][0]["action"] == "spot" and out["switches"][0]["by"] == "dispatch"
    tick = out["switches"][1]
    # 950 s of work left (7 decision ticks with the changeover) and 1320 s to go: no slack for spot
    assert (tick["by"], tick["at"], tick["done_steps"], tick["work_left_s"]) == ("tick", 180.0, 5, 950.0)
    assert first["end"] == "migration" and first["caught"] is None
    # SIGTERM at 205 s: the first step boundary after it is step 11 (110 s of work at 10 s a step)
    assert first["checkpoints"] == [{"step": 11, "at": 210.0, "tier": "emergency"}]
    assert (second["spot"], second["instance_at"], second["work_at"], second["resumed_step"]) == (False, 190.0, 240.0, 11)
    # its dispatch asks again (recorded), but runs on the replacement the move provisioned
    assert second["dispatch_market"]["work_left_s"] == 890.0 and second["dispatch_market"]["time_left_s"] == 1280.0
    assert second["checkpoints"][-1] == {"step": 100, "at": 240.0 + 89 * 10.0, "tier": "durable"}
    assert out["migrations"] == 1 and out["finished"]


def test_a_spot_launch_where_the_trace_has_no_capacity_is_refused():
    bad = Launch(dispatch_at=6100.0, instance_at=6100.0, work_at=6200.0, save_s=5.0, step_s=10.0)
    with pytest.raises(OrbitError) as err:
        replay_control(TRACE, OFFER, JOB, [bad], model=model())
    assert err.value.field == "instance_at"
    assert math.isclose(err.value.value, 6100.0)


def test_an_emergency_save_not_durable_by_the_reclaim_saves_nothing_and_the_ledger_counts_a_missed_notice():
    """A host too slow to finish its emergency save before the reclaim (a loaded machine): the
    agent stopped at the notice, the work since the newest durable checkpoint is lost, the
    instance is held to the reclaim, and with no notice event either the ledger counts a
    reclaim without a notice, which the next dispatch's policy is told."""
    caught = two_attempts()["attempts"][0]
    out = two_attempts(emergency_durable=False, notice_recorded=False)
    first, second = out["attempts"]
    assert first["checkpoints"] == [c for c in caught["checkpoints"] if c["tier"] == "durable"]
    newest = first["checkpoints"][-1]["step"]
    assert (first["end"], first["caught"], first["release_at"]) == ("reclaim", False, 6000.0)
    assert first["stop_step_model"] == 558 and first["lost_steps"] == 558 - newest > 0
    assert second["resumed_step"] == newest
    assert second["notices"] == NoticeReliability(reclaims=1, missed=1).as_record()
    assert second["rate"]["exposure_s"] == pytest.approx(6000.0)  # held to the reclaim
    # its notice event reached the ledger: a reclaim with a notice, though nothing was saved
    recorded = two_attempts(emergency_durable=False, notice_recorded=True)["attempts"][1]
    assert recorded["resumed_step"] == newest
    assert recorded["notices"] == NoticeReliability(reclaims=1, missed=0).as_record()


def test_unmeasured_the_emergency_save_counts_only_if_its_save_time_fits_before_the_reclaim():
    # the agent stops at step 558 (5880 s): a 100 s save is durable at 5980 s, a 130 s one too late
    fits = two_attempts(save_s=100.0)["attempts"][0]
    assert fits["caught"] is True and fits["checkpoints"][-1]["tier"] == "emergency"
    late = two_attempts(save_s=130.0)["attempts"][0]
    assert late["caught"] is False and late["lost_steps"] > 0
    assert all(c["tier"] == "durable" for c in late["checkpoints"])


def test_a_move_whose_emergency_save_was_not_durable_resumes_from_the_newest_durable_checkpoint():
    job = ControlJob(steps=100, step_s=10.0, notice_s=120.0, submitted_at=0.0, deadline_s=1500.0)
    launch = Launch(dispatch_at=0.0, instance_at=0.0, work_at=100.0, save_s=5.0, step_s=10.0, emergency_durable=False)
    ticks = (Tick(at=180.0, known_step=5, step_s=10.0, save_s=5.0),)
    move = Move(emergency_after_s=25.0, instance_after_s=10.0, work_after_s=60.0, dispatch_after_s=40.0)
    first, second = replay_control(TRACE, OFFER, job, [launch], ticks=ticks, move=move, model=model())["attempts"]
    assert first["end"] == "migration" and first["checkpoints"] == [] and first["stop_step_model"] == 11
    assert second["resumed_step"] == 0 and second["checkpoints"][-1]["step"] == 100
