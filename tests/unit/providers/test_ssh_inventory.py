"""The SSH host inventory: what a valid one gives, and errors that name the field and the fix."""
from __future__ import annotations

import io
from datetime import datetime, timezone

import paramiko
import pytest
import yaml

from orbit_dagster.core.errors import AuthError
from orbit_dagster.core.execution import Resources
from orbit_dagster.providers.base import InstanceHandle, Provider
from orbit_dagster.providers.ssh.inventory import InventoryError, load_inventory
from orbit_dagster.providers.ssh.provider import SshProvider
from orbit_dagster.providers.ssh.session import load_private_key

HOST = {"name": "box1", "host": "203.0.113.7", "user": "ubuntu", "key_file": "~/.ssh/id_rental",
        "known_hosts": "~/.ssh/known_hosts", "gpus": {"model": "A100-80G", "count": 4, "memory_gb": 80},
        "usd_per_hour": 7.2, "workdir": "/data/orbit"}


def write(tmp_path, *hosts, raw=None):
    path = tmp_path / "ssh_hosts.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump({"hosts": list(hosts)}))
    return path


def test_hosts_become_offers_priced_pro_rata_without_touching_the_network(tmp_path):
    small = {**HOST, "name": "box2", "gpus": {"model": "L4", "count": 1, "memory_gb": 24}, "usd_per_hour": 0.9}
    p = SshProvider(write(tmp_path, HOST, small), state_dir=tmp_path / "state")
    offers = {o.offer_id: o for o in p.list_offers()}
    assert set(offers) == {"ssh:box1", "ssh:box2"}
    box1 = offers["ssh:box1"]
    assert (box1.provider, box1.gpu, box1.gpu_count, box1.spot) == ("ssh", "A100-80G", 4, False)
    assert box1.usd_per_second == pytest.approx(7.2 / 3600)
    two = p.list_offers(Resources(gpu="A100-80G", gpu_count=2))
    assert [o.offer_id for o in two] == ["ssh:box1"] and two[0].usd_per_second == pytest.approx(7.2 / 2 / 3600)
    assert [o.offer_id for o in p.list_offers(Resources(gpu="any", gpu_count=1, gpu_memory_gb=40))] == ["ssh:box1"]
    assert p.list_offers(Resources(gpu_count=8)) == []
    assert box1.spec_tflops_bf16 == 312.0 and offers["ssh:box2"].spec_tflops_bf16 == 121.0  # the catalog's specs
    assert isinstance(p, Provider) and p.notice_seconds == 0
    lease = InstanceHandle(provider="ssh", instance_id="ssh-box1-x", offer=box1, started_at=datetime.now(timezone.utc))
    assert p.notices(lease) == [] and p.price_feed(None, ["ssh:box1"]) == []  # no notice, fixed price


def test_gpu_names_are_normalised_and_a_model_the_catalog_lacks_needs_its_tflops(tmp_path):
    alias = {**HOST, "gpus": {"model": "a100-80gb", "count": 2}}
    consumer = {**HOST, "name": "rig", "gpus": {"model": "RTX-4090", "count": 1, "memory_gb": 24, "tflops_bf16": 165}}
    bare = {**HOST, "name": "bare", "gpus": {"model": "RTX-3090", "count": 1}}
    p = SshProvider(write(tmp_path, alias, consumer, bare), state_dir=tmp_path / "state")
    offers = {o.offer_id: o for o in p.list_offers()}
    assert (offers["ssh:box1"].gpu, offers["ssh:box1"].gpu_memory_gb) == ("A100-80G", 80.0)
    assert [o.offer_id for o in p.list_offers(Resources(gpu="A100-80G"))] == ["ssh:box1"]
    assert (offers["ssh:rig"].gpu, offers["ssh:rig"].spec_tflops_bf16, offers["ssh:rig"].gpu_memory_gb) == (
        "RTX-4090", 165.0, 24.0)
    assert offers["ssh:bare"].effective_tflops is None  # the offer policy asks for the probe


@pytest.mark.parametrize("change,field", [
    ({"port": 70000}, "hosts[0].port"),
    ({"workdir": "orbit"}, "hosts[0].workdir"),
    ({"usd_per_hour": -1}, "hosts[0].usd_per_hour"),
    ({"gpus": {"model": "L4", "count": -1}}, "hosts[0].gpus.count"),
    ({"name": "bad name"}, "hosts[0].name"),
    ({"key_env": "RENTAL_KEY"}, "hosts[0]"),  # both key_file and key_env
    ({"password": "hunter2"}, "hosts[0].password"),  # unknown field: no passwords in the inventory
])
def test_a_bad_field_is_named_with_its_value_and_a_fix(tmp_path, change, field):
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, {**HOST, **change}))
    assert err.value.field == field and f"field {field!r}" in str(err.value)
    assert "docs/providers-ssh.md" in str(err.value)


def test_missing_not_a_mapping_and_duplicate_inventories(tmp_path):
    with pytest.raises(InventoryError, match="does not exist"):
        load_inventory(tmp_path / "nope.yaml")
    with pytest.raises(InventoryError, match="must be a mapping"):
        load_inventory(write(tmp_path, raw="- a\n- b\n"))
    with pytest.raises(InventoryError, match="repeated: box1"):
        load_inventory(write(tmp_path, HOST, HOST))
    with pytest.raises(InventoryError, match="no SSH host named 'box9'"):
        load_inventory(write(tmp_path, HOST)).host("box9")


def test_a_private_key_comes_from_a_file_or_an_environment_variable_only(tmp_path, monkeypatch):
    key = paramiko.ECDSAKey.generate()
    buf = io.StringIO()
    key.write_private_key(buf)
    inv = load_inventory(write(tmp_path, {**HOST, "key_file": None, "key_env": "ORBIT_TEST_KEY"}))
    monkeypatch.setenv("ORBIT_TEST_KEY", buf.getvalue())
    assert load_private_key(inv.hosts[0]).get_base64() == key.get_base64()
    monkeypatch.setenv("ORBIT_TEST_KEY", "not a key")
    with pytest.raises(AuthError, match="holds no"):
        load_private_key(inv.hosts[0])
    monkeypatch.delenv("ORBIT_TEST_KEY")
    with pytest.raises(AuthError, match="ORBIT_TEST_KEY is unset") as err:
        load_private_key(inv.hosts[0])
    assert err.value.retryable is False
    missing = load_inventory(write(tmp_path, {**HOST, "key_file": str(tmp_path / "absent")})).hosts[0]
    with pytest.raises(AuthError, match="does not exist"):
        load_private_key(missing)
