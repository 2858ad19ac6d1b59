"""Gang rental, all or none, on each provider (control/group.py `rent_group`): a group that
cannot be completed is released and billed at once, never left running; one that can is rented
whole, one shape in one zone, node 0 first.

- sim: the embedded market, whose zone refuses a second instance (a replay schedule with room
  for one), through the real dispatch of a 2-node job: the job is retried as an interruption;
- ssh: two inventory hosts of one shape and region on the loopback sshd, the second one's GPU
  leased by another job;
- aws: EC2 spot on moto's server; moto has no capacity to run out of, so the second node's
  `InsufficientInstanceCapacity` is what a stand-in answers for it, after the first instance
  was really rented (and is really terminated).
"""
from __future__ import annotations

import math
import sys

import pytest
import yaml

from orbit_dagster.control import providers as registry
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.group import rent_group
from orbit_dagster.control.recovery import recover_lost
from orbit_dagster.control.submit import submit
from orbit_dagster.core.errors import NoCapacity
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.process_tree import HOST_TAG, tagged
from orbit_dagster.ledger import records as R
from orbit_dagster.policy.offer_choice import MAX_OFFERS_TRIED
from orbit_dagster.providers.aws.provider import AwsSpotProvider
from orbit_dagster.providers.base import InstanceHandle
from orbit_dagster.providers.sim.provider import SimProvider, pid_alive
from orbit_dagster.providers.ssh.provider import SshProvider
from orbit_dagster.settings import Settings
from tests.integration.moto_fixtures import REGION, ami, aws_env, ec2_host, moto_ami, moto_server  # noqa: F401
from tests.integration.test_aws_provider import PRICES, _ec2_instance


@pytest.fixture
def settings(orbit_home):
    return Settings.from_env(orbit_home)


def bill_adds_up(ledger, job_id: str) -> list[dict]:
    """Every instance of the job stopped, and its cost lines summing to its bill."""
    rows = ledger.rows("SELECT instance_id, handle, stopped_at, started_at, billed_usd, usd_per_second "
                       "FROM instances WHERE job_id = ?", [job_id])
    for row in rows:
        assert row["stopped_at"] is not None, f"{row['instance_id']} left running"
        lines = ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [row["instance_id"]])
        assert math.isclose(lines, row["billed_usd"], rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(row["billed_usd"], (row["stopped_at"] - row["started_at"]) * row["usd_per_second"],
                            rel_tol=1e-6, abs_tol=1e-9)
    return rows


class RoomFor:
    """Sim market zones with room for `n` instances each (the market's own NoCapacity), never reclaimed."""

    def __init__(self, n: int):
        self.n, self.rented = n, {}

    def reclaim_at(self, offer, start_wall):  # noqa: ARG002
        if self.rented.get(offer.offer_id, 0) >= self.n:
            raise NoCapacity(f"sim market: no spot capacity for {offer.offer_id} now", provider="sim")
        self.rented[offer.offer_id] = self.rented.get(offer.offer_id, 0) + 1
        return None


@pytest.mark.timeout(120)
def test_sim_a_group_the_zone_cannot_hold_is_released_billed_and_retried(settings, monkeypatch):
    market = RoomFor(1)
    monkeypatch.setitem(registry.REGISTRY, "sim_host_process", lambda s: SimProvider(s.sim_dir, schedule=market))
    ledger = settings.ledger()
    job = submit(settings, "fsdp-multinode", {"config.steps": 20}, experiment="gang")
    with pytest.raises(NoCapacity):  # within the dispatch: nothing outlives it
        run_attempt(settings, job)
    row = R.require_job(ledger, job)
    assert (row["state"], row["failure_class"]) == ("LOST", "infrastructure")
    assert "can rent a group of 2 now" in row["reason"]
    rows = bill_adds_up(ledger, job)
    tried = min(MAX_OFFERS_TRIED, len(SimProvider(settings.sim_dir).list_offers(Resources())))
    assert len(rows) == tried == sum(market.rented.values())  # one instance of each offer tried, released at once
    incomplete = ledger.rows("SELECT detail FROM events WHERE job_id = ? AND kind = 'group_incomplete'", [job])
    assert len(incomplete) == tried and all('"rented": ["sim-' in r["detail"] for r in incomplete)
    for row in rows:  # nothing left running on any host
        state = SimProvider(settings.sim_dir).host_state(row["instance_id"])
        assert state["status"] == "terminated" and not pid_alive(int(state["pid"]))
        assert tagged(HOST_TAG, str(settings.sim_dir.resolve() / "instances" / row["instance_id"])) == []
    assert recover_lost(settings, job)["action"] == "requeued"  # retried: the next attempt tries again

    # Room for 2 in the second zone only: the first zone's instance is released before the
    # second zone is tried, and the whole group is of one offer, node 0 first.
    provider = SimProvider(settings.sim_dir, schedule=market)
    ranked = provider.list_offers(Resources())
    market.n, market.rented = 2, {ranked[0].offer_id: 1}
    provisioned: list = []
    group, tried = rent_group(settings, ledger, provider, ranked, 2, job_id="j2", attempt=1, provisioned=provisioned)
    assert [t["offer"] for t in tried] == [ranked[0].offer_id] and tried[0]["rented"] == 1
    assert len(group) == 2 and {i.offer.offer_id for i in group} == {ranked[1].offer_id} and provisioned == group
    (first,) = bill_adds_up(ledger, "j2")  # only the first zone's is recorded yet: stopped and billed
    assert InstanceHandle.model_validate_json(first["handle"]).offer.offer_id == ranked[0].offer_id
    for instance in group:
        provider.terminate(instance, "test over")


def ssh_inventory(sshd, tmp_path) -> SshProvider:
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts_line())
    hosts = [{"name": name, "host": "127.0.0.1", "port": sshd.port, "user": sshd.user, "key_file": str(sshd.user_key),
              "known_hosts": str(known), "gpus": {"model": "L4", "count": 1, "memory_gb": 24}, "usd_per_hour": 1.8,
              "region": "lo", "workdir": str(tmp_path / "remote" / name), "python": sys.executable,
              "connect_timeout_s": 5} for name in ("box", "box2")]
    (tmp_path / "ssh_hosts.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
    return SshProvider(tmp_path / "ssh_hosts.yaml", state_dir=tmp_path / "ssh-state")


@pytest.mark.timeout(180)
def test_ssh_a_group_is_two_hosts_of_one_shape_and_never_half_of_one(settings, sshd, tmp_path):
    provider, ledger = ssh_inventory(sshd, tmp_path), settings.ledger()
    offers = {o.offer_id: o for o in provider.list_offers(Resources(gpu="L4"))}
    blocker = provider.provision(offers["ssh:box2"], tags={"orbit/job": "other"})  # box2's one GPU is taken
    with pytest.raises(NoCapacity) as err:
        rent_group(settings, ledger, provider, [offers["ssh:box"]], 2, job_id="j", attempt=1, provisioned=[])
    assert "can rent a group of 2" in str(err.value)
    (row,) = bill_adds_up(ledger, "j")  # box was leased, then released and billed
    box = InstanceHandle.model_validate_json(row["handle"])
    assert box.address["host"] == "box" and not provider.instance_alive(box)
    provider.terminate(blocker, "the other job is done")
    provisioned: list = []
    group, _ = rent_group(settings, ledger, provider, [offers["ssh:box"]], 2, job_id="j", attempt=2,
                          provisioned=provisioned)
    assert [i.address["host"] for i in group] == ["box", "box2"] and provisioned == group
    assert provider.rendezvous_endpoint(group[0]) == "127.0.0.1:29400"
    for instance in group:
        provider.terminate(instance, "test over")


class SecondNodeRefused(AwsSpotProvider):
    """EC2 as it answers when a zone runs out after the first instance of a group."""

    def provision(self, offer, *, tags):
        if tags.get("orbit/node") == "1":
            raise NoCapacity("aws: InsufficientInstanceCapacity: there is not enough capacity in use1-az1 "
                             "(stand-in: moto never runs out)", provider="aws")
        return super().provision(offer, tags=tags)


@pytest.mark.timeout(240)
def test_aws_the_first_spot_instance_of_a_group_the_zone_cannot_complete_is_terminated_and_billed(
        settings, aws_env, ami, ec2_host, tmp_path):
    provider = SecondNodeRefused(region=REGION, endpoint_url=aws_env, state_dir=tmp_path / "aws", image_id=ami,
                                 static_spot_prices=PRICES, api_poll_s=0, **ec2_host.provider_kwargs)
    ledger = settings.ledger()
    offer = next(o for o in provider.list_offers(Resources(gpu="L4")) if o.offer_id == "aws:g6.xlarge:use1-az1")
    assert provider.group_offers(offer, 2) == [offer, offer]  # a zonal offer: the group in its zone
    regional = next(o for o in provider.list_offers(Resources(gpu="A100-40G")) if not o.zone)
    assert provider.group_offers(regional, 2) == [regional]  # may land in several zones: never a group
    with pytest.raises(NoCapacity):
        rent_group(settings, ledger, provider, [offer], 2, job_id="j", attempt=1, provisioned=[])
    (row,) = bill_adds_up(ledger, "j")
    assert _ec2_instance(aws_env, row["instance_id"])["State"]["Name"] in ("shutting-down", "terminated")
    assert ledger.scalar("SELECT count(*) FROM events WHERE kind = 'group_incomplete' AND job_id = 'j'") == 1
