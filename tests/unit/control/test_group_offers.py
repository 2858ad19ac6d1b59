"""Which offers can hold a group of nodes (one shape, one zone), and the refusal, before
anything is rented, when none can (control/dispatch.py `offers_for_group`)."""
from __future__ import annotations

import pytest
import yaml

from orbit_dagster.control.dispatch import offers_for_group
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.execution import Resources
from orbit_dagster.providers.sim.provider import SimProvider
from orbit_dagster.providers.ssh.provider import SshProvider


def ssh(tmp_path, *hosts: tuple[str, str, str]) -> SshProvider:
    rows = [{"name": n, "host": "203.0.113.7", "user": "u", "key_file": "~/.ssh/k", "known_hosts": "~/.ssh/kh",
             "gpus": {"model": m, "count": 1}, "usd_per_hour": 1.0, "region": r} for n, m, r in hosts]
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump({"hosts": rows}))
    return SshProvider(tmp_path / "inv.yaml", state_dir=tmp_path / "state")


def test_an_ssh_group_is_hosts_of_the_offer_hosts_shape_and_region(tmp_path):
    p = ssh(tmp_path, ("a", "L4", "eu"), ("b", "L4", "us"), ("c", "L4", "eu"), ("d", "T4", "eu"), ("e", "L4", "eu"))
    offers = {o.offer_id: o for o in p.list_offers(Resources(gpu="L4"))}
    assert [o.offer_id for o in p.group_offers(offers["ssh:a"], 2)] == ["ssh:a", "ssh:c"]
    assert [o.offer_id for o in p.group_offers(offers["ssh:c"], 5)] == ["ssh:c", "ssh:a", "ssh:e"]
    assert [o.offer_id for o in p.group_offers(offers["ssh:b"], 2)] == ["ssh:b"]
    ranked = [offers["ssh:b"], offers["ssh:a"], offers["ssh:c"]]
    assert [o.offer_id for o in offers_for_group(p, ranked, 3)] == ["ssh:a", "ssh:c"]  # b's region has one host
    with pytest.raises(OrbitError) as err:
        offers_for_group(p, ranked, 4)
    assert (err.value.field, err.value.value) == ("resources.nodes", 4)
    assert "can be rented 4 times in one zone (at most 3)" in str(err.value)
    assert "resources.nodes to at most 3" in err.value.fix
    assert list((tmp_path / "state" / "leases").glob("*")) == []  # nothing rented


def test_the_sim_market_rents_any_group_in_a_zone(tmp_path):
    p = SimProvider(tmp_path / "sim")
    offer = p.list_offers(Resources(gpu="L4"))[0]
    assert p.group_offers(offer, 3) == [offer] * 3
    assert offers_for_group(p, [offer], 3) == [offer]
    assert offers_for_group(p, [], 3) == []  # no offer fits at all: dispatch's own error says so
