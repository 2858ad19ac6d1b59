"""The agent's checkpoint schedule: the interval re-asked after each durable save, as the instance ages."""
import math

import pytest

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.checkpointing import OrbitInterval
from orbit_dagster.runtime.checkpoint_schedule import CheckpointSchedule

STEP_S = 4.8  # market seconds a step
SCALE = 240.0


class Clock:
    def __init__(self, t: float = 1_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def policy() -> OrbitInterval:
    offer = Offer(offer_id="sim:p3.2xlarge:z", provider="sim", instance_type="p3.2xlarge", gpu="V100", gpu_count=1,
                  usd_per_gpu_second_spot=0.9 / 3600, usd_per_gpu_second_on_demand=3.0 / 3600, spec_tflops_bf16=125.0,
                  interruption_band=">20%")
    # no emergency save fits a 0 s notice: every reclaim is insured against, the age matters
    return OrbitInterval.for_offer(offer, save_s=30.0, notice_s=0.0)


def plan(p: OrbitInterval, **over) -> dict:
    return {"policy": "orbit", "rule": p.rule().as_record(), "cadence_steps": 10_000, "steps": 100_000,
            "step_s": STEP_S, "time_scale": SCALE, "instance_started_at": 1_000.0, **over}


def test_without_a_plan_the_launch_interval_is_kept_on_its_grid():
    s = CheckpointSchedule(8)
    assert [k for k in range(1, 30) if s.due(k)] == [8, 16, 24]
    assert s.after_save(8) is None and s.every == 8


def test_each_save_asks_the_policy_again_for_the_instance_age_and_the_intervals_lengthen():
    p, clock = policy(), Clock()
    s = CheckpointSchedule(5, plan(p), clock=clock)
    decided, step = [], 0
    for wall_age in (30.0, 120.0, 600.0, 3000.0):  # wall seconds since the instance came up
        clock.t = 1_000.0 + wall_age
        step += s.every
        ev = s.after_save(step)
        age = wall_age * SCALE
        want = p.interval(age, (100_000 - step) * STEP_S)  # the very object simulate asks
        assert ev.age_s == pytest.approx(age) and ev.interval_s == pytest.approx(want, abs=1e-3)
        assert ev.steps == max(1, round(want / STEP_S)) and ev.next_step == step + ev.steps
        assert s.due(ev.next_step) and not s.due(ev.next_step - 1)
        decided.append(ev.steps)
    assert decided == sorted(decided) and decided[-1] > decided[0]  # older instances save less often


def test_the_cadence_caps_the_interval_and_the_end_of_the_job_is_run_to():
    p, clock = policy(), Clock(1_000.0 + 3600.0)
    capped = CheckpointSchedule(5, plan(p, cadence_steps=7), clock=clock).after_save(10)
    assert capped.steps == 7 and capped.policy_steps > 7 and "cadence" in capped.reason
    near_end = CheckpointSchedule(5, plan(p, steps=103), clock=clock).after_save(100)
    assert near_end.steps == 3 and near_end.work_left_s == pytest.approx(3 * STEP_S)
    assert CheckpointSchedule(5, plan(p, steps=100), clock=clock).after_save(100) is None  # nothing left


def test_without_a_measured_step_time_the_attempt_measures_its_own():
    p, clock = policy(), Clock()
    s = CheckpointSchedule(5, plan(p, step_s=None), clock=clock)
    s.due(0)
    clock.t += 10 * STEP_S / SCALE  # ten steps at 4.8 market seconds each
    ev = s.after_save(10)
    assert ev.step_s == pytest.approx(STEP_S) and ev.steps == max(1, round(ev.interval_s / STEP_S))


def test_a_policy_without_a_rule_keeps_its_interval_and_still_records_each_decision():
    s = CheckpointSchedule(6, {"policy": "young-daly", "rule": None, "cadence_steps": 50, "steps": 100,
                               "step_s": 1.0, "time_scale": 1.0, "instance_started_at": 0.0}, clock=Clock())
    ev = s.after_save(6)
    assert ev.steps == 6 and ev.next_step == 12 and ev.policy == "young-daly" and ev.interval_s is None


@pytest.mark.parametrize("bad, field", [({"rule": {"mtbf_s": "x"}}, "mtbf_s"), ({"surprise": 1}, "interval_plan"),
                                        ({"rule": {"mtbf_s": 1.0, "save_s": 1.0, "shape": math.nan,
                                                   "uncovered": 1.0}}, "shape")])
def test_a_malformed_plan_is_refused_naming_the_field(bad, field):
    with pytest.raises(OrbitError) as err:
        CheckpointSchedule(5, {**plan(policy()), **bad})
    assert err.value.field == field
