"""The AWS bootstrap's pure parts: user-data as data, host keys, CIDRs, endpoints, addresses, settings."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from orbit_dagster.core.errors import OrbitError, ProviderError
from orbit_dagster.core.offers import Offer
from orbit_dagster.providers.aws.bootstrap import (
    HostKey,
    home_label,
    host_key_from_user_data,
    new_ed25519,
    opens_to_everyone,
    public_key_sha256,
    ssh_networks,
    user_data,
)
from orbit_dagster.providers.aws.host import SshHostTransport, parse_endpoint
from orbit_dagster.settings import Settings

SSH_KEYGEN = shutil.which("ssh-keygen")


def test_user_data_is_a_cloud_config_that_carries_the_host_key_and_starts_nothing():
    key = new_ed25519("orbit-host job-1")
    text = user_data(key)
    assert text.startswith("#cloud-config\n")
    config = yaml.safe_load(text)
    assert config["ssh_keys"] == {"ed25519_private": key.private_openssh, "ed25519_public": key.public_line}
    assert config["ssh_deletekeys"] is True and config["ssh_genkeytypes"] == []  # the AMI's keys are not trusted
    assert config["ssh_pwauth"] is False and config["disable_root"] is True
    assert not {"runcmd", "bootcmd", "packages"} & set(config)  # nothing runs until the control plane stages
    assert host_key_from_user_data(text) == key
    assert len(text.encode()) < 16 * 1024  # EC2's user-data limit


def test_a_hostile_comment_stays_one_yaml_string():
    """Values are dumped as data: a newline or YAML in a value cannot add a cloud-init key."""
    key = new_ed25519("x\nruncmd: [[touch, /tmp/pwned]]\n#")
    config = yaml.safe_load(user_data(key))
    assert set(config) == {"ssh_deletekeys", "ssh_genkeytypes", "ssh_keys", "ssh_pwauth", "disable_root"}
    assert config["ssh_keys"]["ed25519_public"] == key.public_line


def test_host_keys_are_fresh_per_instance():
    a, b = new_ed25519("a"), new_ed25519("b")
    assert a.public_line.split()[1] != b.public_line.split()[1]
    assert a.private_openssh.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    with pytest.raises(ValueError, match="cloud-config"):
        host_key_from_user_data("#!/bin/sh\necho hi\n")


@pytest.mark.skipif(SSH_KEYGEN is None, reason="needs ssh-keygen (openssh-client)")
def test_the_fingerprint_is_openssh_s_own(tmp_path):
    key = new_ed25519("c")
    (tmp_path / "k.pub").write_text(key.public_line + "\n")
    out = subprocess.run([SSH_KEYGEN, "-l", "-E", "sha256", "-f", str(tmp_path / "k.pub")], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[1] == "SHA256:" + public_key_sha256(key.public_line)
    # and OpenSSH reads the private key cloud-init would install
    (tmp_path / "k").write_text(key.private_openssh)
    (tmp_path / "k").chmod(0o600)
    derived = subprocess.run([SSH_KEYGEN, "-y", "-f", str(tmp_path / "k")], check=True, capture_output=True,
                             text=True).stdout.split()
    assert derived[:2] == key.public_line.split()[:2]


def test_ssh_cidrs_are_required_canonical_and_the_open_internet_only_as_written():
    assert [str(n) for n in ssh_networks(["198.51.100.7/32", "2001:db8::/32"])] == ["198.51.100.7/32", "2001:db8::/32"]
    with pytest.raises(ProviderError, match="no CIDR") as err:
        ssh_networks(())
    assert err.value.field == "ssh_cidr" and "0.0.0.0/0 only if you mean" in err.value.fix
    for bad in ("198.51.100.7/24", "10.0.0.300/32", "my-office"):
        with pytest.raises(ProviderError, match="not a CIDR") as err:
            ssh_networks([bad])
        assert (err.value.field, err.value.value) == ("ssh_cidr", bad)
    assert opens_to_everyone(("0.0.0.0/0",)) and opens_to_everyone(("::/0", "198.51.100.7/32"))
    assert not opens_to_everyone(("198.51.100.0/24",))


def test_names_are_per_orbit_home(tmp_path):
    assert home_label(tmp_path / "a") == home_label(tmp_path / "a" / ".." / "a") != home_label(tmp_path / "b")
    assert home_label(tmp_path / "a").startswith("orbit-")


def test_endpoints_parse_or_name_the_field():
    assert parse_endpoint("127.0.0.1:2222") == ("127.0.0.1", 2222)
    assert parse_endpoint("[::1]:22") == ("::1", 22)
    for bad in ("localhost", ":22", "host:0", "host:99999", "host:ssh"):
        with pytest.raises(ProviderError, match="not HOST:PORT") as err:
            parse_endpoint(bad)
        assert err.value.field == "ssh_endpoint"


def test_the_address_is_the_configured_ip_or_the_tunnel(tmp_path):
    inst = {"InstanceId": "i-1", "PublicIpAddress": "203.0.113.9", "PrivateIpAddress": "10.0.0.9"}
    assert SshHostTransport(tmp_path).address_of(inst) == ("203.0.113.9", 22)
    assert SshHostTransport(tmp_path, address="private").address_of(inst) == ("10.0.0.9", 22)
    assert SshHostTransport(tmp_path, endpoint="127.0.0.1:2200").address_of(inst) == ("127.0.0.1", 2200)
    with pytest.raises(ProviderError, match="no public IP") as err:
        SshHostTransport(tmp_path).address_of({"InstanceId": "i-2", "PrivateIpAddress": "10.0.0.9"})
    assert err.value.field == "address" and "ORBIT_AWS_ADDRESS=private" in err.value.fix


def test_an_instance_becomes_an_inventory_host_trusting_only_its_own_key(tmp_path):
    t = SshHostTransport(tmp_path, user="ubuntu", python="/opt/conda/bin/python", workdir="~/orbit")
    offer = Offer(offer_id="aws:g6.xlarge:use1-az1", provider="aws", instance_type="g6.xlarge", gpu="L4",
                  gpu_count=1, gpu_memory_gb=22.4, region="us-east-1", zone="use1-az1",
                  usd_per_gpu_second_spot=0.35 / 3600, spot=True)
    key = HostKey("unused", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPGOnfOxD5jaE0TcsP9ba0FRAM/SLRHqR5/KIwyQOlTP x")
    t.register({"InstanceId": "i-1", "PublicIpAddress": "203.0.113.9"}, offer, key.public_line, tmp_path / "k")
    t.register({"InstanceId": "i-2", "PublicIpAddress": "203.0.113.10"}, offer, key.public_line, tmp_path / "k",
               retire=("i-1",))
    hosts = t.ssh.inventory.hosts
    assert [h.name for h in hosts] == ["i-2"] and not (tmp_path / "known_hosts" / "i-1").exists()
    (h,) = hosts
    assert (h.host, h.port, h.user, h.python, h.trust_on_first_use) == ("203.0.113.10", 22, "ubuntu",
                                                                        "/opt/conda/bin/python", False)
    assert (h.gpus.model, h.gpus.count) == ("L4", 1) and h.usd_per_hour == pytest.approx(0.35)
    assert Path(h.known_hosts).read_text() == "203.0.113.10 " + " ".join(key.public_line.split()[:2]) + "\n"
    assert "unused" not in (tmp_path / "ssh_hosts.yaml").read_text()  # no private key material in the inventory


def test_aws_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ORBIT_AWS_SSH_CIDR", "198.51.100.7/32, 203.0.113.0/24")
    monkeypatch.setenv("ORBIT_AWS_SECURITY_GROUP_IDS", "sg-1 sg-2")
    monkeypatch.setenv("ORBIT_AWS_SSH_ENDPOINT", "127.0.0.1:2222")
    monkeypatch.setenv("ORBIT_AWS_BOOT_TIMEOUT_S", "900")
    s = Settings.from_env(tmp_path).aws
    assert s.ssh_cidrs == ("198.51.100.7/32", "203.0.113.0/24") and s.security_group_ids == ("sg-1", "sg-2")
    assert (s.ssh_endpoint, s.boot_timeout_s, s.ssh_user, s.address) == ("127.0.0.1:2222", 900.0, "ubuntu", "public")
    assert s.metadata_url == "http://169.254.169.254"
    monkeypatch.setenv("ORBIT_AWS_BOOT_TIMEOUT_S", "soon")
    with pytest.raises(OrbitError, match="ORBIT_AWS_BOOT_TIMEOUT_S") as err:
        Settings.from_env(tmp_path)
    assert err.value.value == "soon"
