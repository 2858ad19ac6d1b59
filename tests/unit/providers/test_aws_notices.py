"""Spot request status codes (AWS's own strings) -> notices, lost instances, holding requests."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from orbit_dagster.providers.aws.errors import notice_from_spot_request, spot_status, transition_time

MARKED = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
NOW = MARKED + timedelta(seconds=5)


def request(code: str) -> dict:
    return {"SpotInstanceRequestId": "sir-1", "InstanceId": "i-1",
            "Status": {"Code": code, "Message": "...", "UpdateTime": MARKED}}


@pytest.mark.parametrize(("code", "kind"), [
    ("pending-evaluation", "pending"), ("pending-fulfillment", "pending"),
    ("capacity-not-available", "holding"), ("price-too-low", "holding"), ("capacity-oversubscribed", "holding"),
    ("fulfilled", "running"), ("request-canceled-and-instance-running", "running"),
    ("marked-for-termination", "notice"), ("marked-for-stop", "notice"), ("marked-for-hibernation", "notice"),
    ("marked-for-stop-by-experiment", "notice"),
    ("instance-terminated-by-price", "lost"), ("instance-terminated-no-capacity", "lost"),
    ("instance-terminated-capacity-oversubscribed", "lost"), ("instance-terminated-launch-group-constraint", "lost"),
    ("instance-terminated-by-experiment", "lost"), ("instance-stopped-by-price", "lost"),
    ("instance-stopped-no-capacity", "lost"),
    ("instance-terminated-by-user", "ended"), ("instance-stopped-by-user", "ended"),
    ("bad-parameters", "closed"), ("canceled-before-fulfillment", "closed"), ("system-error", "closed"),
    ("something-new-from-aws", "unknown"),
])
def test_status_codes_are_classified(code, kind):
    assert spot_status(code).kind == kind


@pytest.mark.parametrize(("code", "action"), [
    ("marked-for-termination", "terminate"), ("marked-for-stop", "stop"), ("marked-for-hibernation", "hibernate"),
    ("marked-for-stop-by-experiment", "stop")])
def test_a_marked_for_code_is_a_notice_two_minutes_ahead(code, action):
    notice = notice_from_spot_request("i-1", request(code), instance_state="running", now=NOW)
    assert notice.instance_id == "i-1" and notice.action == action
    assert notice.deadline == MARKED + timedelta(seconds=120) and notice.received_at == NOW
    assert notice.source == f"spot-request-status:{code}"


@pytest.mark.parametrize("code", ["instance-terminated-no-capacity", "instance-terminated-by-price",
                                  "instance-terminated-capacity-oversubscribed", "instance-stopped-by-price"])
def test_a_reclaim_code_on_a_running_instance_is_its_notice_and_on_a_gone_one_is_none(code):
    # AWS sets these at once and keeps the instance running through the two-minute warning.
    running = notice_from_spot_request("i-1", request(code), instance_state="running", now=NOW)
    assert running is not None and running.deadline == MARKED + timedelta(seconds=120)
    assert running.action == ("stop" if "stopped" in code else "terminate")
    assert notice_from_spot_request("i-1", request(code), instance_state="terminated", now=NOW) is None


@pytest.mark.parametrize("code", ["fulfilled", "instance-terminated-by-user", "pending-fulfillment",
                                  "capacity-not-available", "something-new-from-aws", ""])
def test_other_codes_are_no_notice(code):
    assert notice_from_spot_request("i-1", request(code), instance_state="running", now=NOW) is None


def test_a_naive_or_missing_update_time_still_gives_a_utc_deadline():
    naive = request("marked-for-termination")
    naive["Status"]["UpdateTime"] = MARKED.replace(tzinfo=None)
    assert notice_from_spot_request("i-1", naive, now=NOW).deadline == MARKED + timedelta(seconds=120)
    missing = {"Status": {"Code": "marked-for-termination"}}
    assert notice_from_spot_request("i-1", missing, now=NOW).deadline == NOW + timedelta(seconds=120)


def test_ec2_transition_reasons_give_the_stop_time():
    assert transition_time("User initiated (2026-11-29 10:41:38 UTC)") == datetime(2026, 11, 29, 10, 41, 38,
                                                                                    tzinfo=timezone.utc)
    assert transition_time("Service initiated (2024-05-01 12:00:00 GMT)") == datetime(2024, 5, 1, 12,
                                                                                       tzinfo=timezone.utc)
    assert transition_time("") is None and transition_time("running") is None
