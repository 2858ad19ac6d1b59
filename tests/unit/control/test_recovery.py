"""Dispatch's rules that the offers replay drives too (tests/unit/policy/test_offers_replay.py):
an offer that keeps reclaiming a job (`control.recovery.offers_to_avoid`: the ledger's count of
this job's reclaims per offer, the policy's threshold), and the group size it plans for."""
import json

import pytest

from orbit_dagster.catalog.listing import list_offers
from orbit_dagster.control.dispatch import checkpoint_plan
from orbit_dagster.control.recovery import offers_to_avoid
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.templates import load_template, typed_template
from orbit_dagster.policy.offer_choice import AVOID_AFTER_RECLAIMS, rank_offers
from orbit_dagster.settings import Settings
from tests.launch_replay import ControlJob


def test_offers_that_reclaimed_this_job_twice_are_avoided_and_moves_do_not_count(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    ends = [("j", "a", "LOST", "reclaim"), ("j", "a", "LOST", "reclaim"), ("j", "b", "LOST", "reclaim"),
            ("j", "c", "LOST", "migration"), ("j", "c", "LOST", "migration"), ("j", "b", "SUCCEEDED", None),
            ("other", "b", "LOST", "reclaim"), ("other", "b", "LOST", "reclaim")]
    ledger.commit({"runs": [{"run_id": f"{job}/{i}", "job_id": job, "attempt": i, "offer_id": offer, "state": state,
                             "failure_class": cls, "provider": "sim"}
                            for i, (job, offer, state, cls) in enumerate(ends, 1)]})
    assert AVOID_AFTER_RECLAIMS == 2
    # "b": once for this job (another job's reclaims are in its rate, not this rule); "c": moves
    assert offers_to_avoid(ledger, "j") == {"a"}
    assert offers_to_avoid(ledger, "other") == {"b"}
    assert offers_to_avoid(ledger, "nobody") == set()


class _Provider:
    """What `checkpoint_plan` asks of a provider: its name, its notice, its (real-time) market."""

    name = "sim"
    notice_seconds = 120.0


def test_dispatch_takes_the_group_size_from_the_template_resources(orbit_home):
    """Not a literal: the interval policy's group size is the template's `resources.nodes`, the
    one place the launch replay reads too."""
    ledger = Settings.from_env(orbit_home).ledger()
    template = load_template("charlm-finetune")
    offer = next(s.offer for s in rank_offers(list_offers(gpu="H100"), notice_s=120.0).ranked if s.offer.spot)
    assert template.resources.nodes == Resources().nodes == ControlJob(1, 1.0, 120.0, 0.0).nodes == 1
    _, one, _ = checkpoint_plan(ledger, _Provider(), template, offer, job_id="j", attempt=1)
    group = load_template("fsdp-script").model_dump(mode="json")
    group["resources"]["nodes"], group["checkpoint"]["interval_policy"] = 4, "orbit"
    _, four, _ = checkpoint_plan(ledger, _Provider(), typed_template(group, context="test"), offer, job_id="j",
                                 attempt=1)
    rate = {n: json.loads(row["inputs"])["policy_inputs"]["rate"] for n, row in ((1, one), (4, four))}
    assert "x 4 nodes" in rate[4]["source"] and "nodes" not in rate[1]["source"]
    assert rate[4]["rate_per_hour"] == pytest.approx(4 * rate[1]["rate_per_hour"])
