"""Submission and retry validation: names, overrides, schema, GPU name, and what can serve the
job here. Each rejection is one OrbitError naming field, value and fix; nothing is written."""
from __future__ import annotations

import socket

import pytest
import yaml

from orbit_dagster.control import providers
from orbit_dagster.control.validate import NotServedHere, aws_credential_source, validate_retry, validate_submission
from orbit_dagster.core.errors import InvalidOverride, OrbitError, TemplateError
from orbit_dagster.core.templates import load_template
from orbit_dagster.providers.ssh.inventory import InventoryError
from orbit_dagster.settings import Settings

T = "charlm-finetune"
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE")


@pytest.fixture
def settings(orbit_home):
    return Settings.from_env(orbit_home)


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test, even one the code under test would swallow:
    validation must not reach the network (boto3's chain alone asks the EC2 metadata server)."""
    attempts = []

    def refuse(*args, **_kw):
        attempts.append(args[1:] if len(args) > 1 else args)
        raise OSError("network disabled in this test")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield attempts
    assert attempts == [], f"network connections attempted: {attempts}"


def submit_check(settings, overrides=None, **kw):
    kw.setdefault("experiment", "exp")
    kw.setdefault("project", "proj")
    return validate_submission(settings, kw.pop("template", T), overrides or {}, **kw)


def test_a_valid_submission_returns_template_and_submission_and_writes_nothing(settings, orbit_home):
    template, sub = submit_check(settings, {"config.steps": 10, "resources.gpu": "H100"})
    assert template.config["steps"] == 10 and template.resources.gpu == "H100"
    assert (sub.template, sub.experiment, sub.project, sub.overrides) == (
        T, "exp", "proj", {"config.steps": 10, "resources.gpu": "H100"})
    assert not orbit_home.exists()  # no ledger opened, no bundle, no provider state


@pytest.mark.parametrize("overrides,field,words", [
    ({"config.lr": "abc"}, "config.lr", "number > 0"),
    ({"config.steps": -5}, "config.steps", ">= 1"),
    ({"resources.gpu": "H900"}, "resources.gpu", "did you mean H200 or H100"),
    ({"resources.gpu": "A100"}, "resources.gpu", "A100-40G or A100-80G"),
    ({"resources.gpu": "a100-80gb"}, "resources.gpu", "write 'A100-80G'"),
    ({"checkpoint.store": "s3"}, "checkpoint.store", "ORBIT_S3_CHECKPOINT_STORE"),
    ({"launch_mode": "docker_image"}, "launch_mode", "use launch_mode host_process with placement sim"),
    ({"placement": "local"}, "placement", "'sim', 'ssh_rental', 'aws_spot'"),
    ({"config.d_model": 64}, "config.d_model", "allowed overrides are"),
])
def test_each_rejection_names_field_value_and_fix(settings, orbit_home, overrides, field, words):
    with pytest.raises(OrbitError) as err:
        submit_check(settings, overrides)
    e = err.value
    assert e.field == field and words in str(e), str(e)
    assert e.value == next(iter(overrides.values()))
    assert not orbit_home.exists()


def test_gpu_names_of_the_catalog_pass_in_any_case(settings):
    for gpu in ("any", "ANY", "H100", "h100", "A100-80G", "l4"):
        assert submit_check(settings, {"resources.gpu": gpu})[0].resources.gpu == gpu


def test_s3_store_passes_once_configured(settings, monkeypatch):
    monkeypatch.setenv("ORBIT_S3_CHECKPOINT_STORE", "s3://bucket/prefix")
    settings = Settings.from_env(settings.home)  # the settings read the environment once
    assert submit_check(settings, {"checkpoint.store": "s3"})[0].checkpoint.store == "s3"
    monkeypatch.setenv("ORBIT_S3_CHECKPOINT_STORE", "/not/s3")
    with pytest.raises(InvalidOverride):
        submit_check(Settings.from_env(settings.home), {"checkpoint.store": "s3"})


def test_a_template_that_asks_for_what_is_missing_is_blamed_not_an_override(settings, tmp_path, monkeypatch):
    (tmp_path / "s3.yaml").write_text("name: s3job\nworkload: charlm\ncheckpoint: {store: s3}\n")
    with pytest.raises(NotServedHere) as err:
        validate_submission(settings, str(tmp_path / "s3.yaml"), {}, experiment="e", project="p")
    assert err.value.field == "checkpoint.store"
    (tmp_path / "docker.yaml").write_text("name: d\nworkload: charlm\nplacement: ssh_rental\nlaunch_mode: docker_image\n")
    with pytest.raises(NotServedHere) as err:
        validate_submission(settings, str(tmp_path / "docker.yaml"), {}, experiment="e", project="p")
    assert err.value.field == "launch_mode" and "image" in str(err.value)


def test_aws_spot_needs_credentials_from_the_chain_without_a_network_call(settings, no_aws, no_network, monkeypatch):
    assert aws_credential_source() is None
    with pytest.raises(InvalidOverride) as err:
        submit_check(settings, {"placement": "aws_spot"})
    assert err.value.field == "placement" and "AWS_ACCESS_KEY_ID" in err.value.fix
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    assert aws_credential_source() == "env"
    template, _ = submit_check(settings, {"placement": "aws_spot"})
    assert template.placement == "aws_spot"


def test_aws_credentials_from_a_shared_file_and_a_bad_region(settings, no_aws, no_network, monkeypatch, tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = AKIDEXAMPLE\naws_secret_access_key = x\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    assert aws_credential_source() == "shared-credentials-file"
    bad = settings.override("aws", region="mars-1")
    with pytest.raises(InvalidOverride) as err:
        submit_check(bad, {"placement": "aws_spot"})
    assert "mars-1" in str(err.value) and "ORBIT_AWS_REGION" in err.value.fix


def inventory(tmp_path, **gpus):
    host = {"name": "box1", "host": "203.0.113.7", "user": "u", "key_file": "~/.ssh/k", "known_hosts": "~/.ssh/kh",
            "gpus": gpus or {"model": "A100-80G", "count": 2}, "usd_per_hour": 3.0}
    path = tmp_path / "ssh_hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": [host]}))
    return Settings(home=tmp_path / "home", ssh_inventory=str(path))


def test_ssh_rental_needs_an_inventory_host_that_fits(settings, tmp_path):
    with pytest.raises(InventoryError):
        submit_check(settings, {"placement": "ssh_rental"})
    s = inventory(tmp_path)
    assert submit_check(s, {"placement": "ssh_rental", "resources.gpu": "A100-80G"})[0].placement == "ssh_rental"
    with pytest.raises(InvalidOverride) as err:
        submit_check(s, {"placement": "ssh_rental", "resources.gpu": "H100"})
    assert "box1: 2x A100-80G" in err.value.fix
    with pytest.raises(OrbitError):  # docker_image: no image in the template, and the host has no docker
        submit_check(s, {"placement": "ssh_rental", "launch_mode": "docker_image"})


def test_ssh_rental_accepts_a_gpu_model_only_the_inventory_knows(tmp_path):
    s = inventory(tmp_path, model="RTX-4090", count=1, memory_gb=24, tflops_bf16=165)
    assert submit_check(s, {"placement": "ssh_rental", "resources.gpu": "RTX-4090"})[0].resources.gpu == "RTX-4090"
    with pytest.raises(InvalidOverride):
        submit_check(s, {"resources.gpu": "RTX-4090"})  # the sim market has no such model


def test_a_registered_backend_is_accepted(settings, monkeypatch, tmp_path):
    (tmp_path / "img.yaml").write_text("name: img\nworkload: charlm\nlaunch_mode: docker_image\nimage: reg.example/x:1\n")
    with pytest.raises(NotServedHere) as err:
        validate_submission(settings, str(tmp_path / "img.yaml"), {}, experiment="e", project="p")
    assert err.value.field == "launch_mode"
    monkeypatch.setitem(providers.REGISTRY, "sim_docker_image", providers.REGISTRY["sim_host_process"])
    template, _ = validate_submission(settings, str(tmp_path / "img.yaml"), {}, experiment="e", project="p")
    assert (template.launch_mode, template.image) == ("docker_image", "reg.example/x:1")


@pytest.mark.parametrize("kw,field", [
    ({"experiment": "a b"}, "experiment"), ({"project": "x" * 64}, "project"), ({"experiment": ""}, "experiment"),
    ({"template": "../../etc/passwd"}, "template"), ({"template": "nope"}, "template"),
])
def test_names_are_checked_first(settings, kw, field):
    with pytest.raises(OrbitError) as err:
        submit_check(settings, {"config.lr": "abc"}, **kw)
    assert err.value.field == field


def test_retry_validates_the_snapshot_and_the_overrides(settings, orbit_home, monkeypatch):
    snapshot = load_template(T)
    assert validate_retry(settings, snapshot, {"config.steps": 400}).config["steps"] == 400
    with pytest.raises(InvalidOverride) as err:
        validate_retry(settings, snapshot, {"config.dropout": 2})
    assert err.value.field == "config.dropout"
    # A job accepted before the schema existed (steps=-5) is refused on retry, naming the field.
    old = snapshot.model_copy(update={"config": {**snapshot.config, "steps": -5}})
    with pytest.raises(InvalidOverride) as err:
        validate_retry(settings, old, {})
    assert err.value.field == "config.steps"
    # S3 configured at submission, gone now: the retry says so before anything is queued.
    monkeypatch.setenv("ORBIT_S3_CHECKPOINT_STORE", "s3://b/p")
    s3 = validate_retry(Settings.from_env(settings.home), snapshot, {"checkpoint.store": "s3"})
    monkeypatch.delenv("ORBIT_S3_CHECKPOINT_STORE")
    with pytest.raises(NotServedHere):
        validate_retry(Settings.from_env(settings.home), s3, {})
    assert not orbit_home.exists()


def test_a_template_error_is_raised_for_a_broken_template_file(settings, tmp_path):
    (tmp_path / "bad.yaml").write_text("name: bad\nworkload: charlm\nconfig: {steps: banana}\n")
    with pytest.raises(TemplateError) as err:
        validate_submission(settings, str(tmp_path / "bad.yaml"), {}, experiment="e", project="p")
    assert err.value.field == "config.steps"


def group_inventory(tmp_path, monkeypatch, *hosts: tuple[str, str, int, str]):
    """Hosts (name, GPU model, GPU count, region) on an inventory, and an S3 store configured."""
    rows = [{"name": n, "host": "203.0.113.7", "user": "u", "key_file": "~/.ssh/k", "known_hosts": "~/.ssh/kh",
             "gpus": {"model": m, "count": c}, "usd_per_hour": 3.0, "region": r} for n, m, c, r in hosts]
    path = tmp_path / "ssh_hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": rows}))
    monkeypatch.setenv("ORBIT_SSH_HOSTS", str(path))
    monkeypatch.setenv("ORBIT_S3_CHECKPOINT_STORE", "s3://bucket/prefix")
    return Settings.from_env(tmp_path / "home")


GROUP = {"placement": "ssh_rental", "resources.gpu": "L4", "checkpoint.store": "s3"}


def test_a_group_needs_that_many_hosts_of_one_shape_in_one_region(tmp_path, monkeypatch):
    s = group_inventory(tmp_path, monkeypatch, ("a", "L4", 1, "eu"), ("b", "L4", 1, "us"), ("c", "L4", 2, "eu"),
                        ("d", "A100-80G", 1, "eu"))
    with pytest.raises(NotServedHere) as err:  # no two hosts share model, count and region
        submit_check(s, GROUP, template="fsdp-multinode")
    assert (err.value.field, err.value.value) == ("resources.nodes", 2)
    assert "at most 1 host of one shape in one region" in str(err.value) and "at most 1" in err.value.fix
    s = group_inventory(tmp_path, monkeypatch, ("a", "L4", 1, "eu"), ("b", "L4", 1, "us"), ("e", "l4", 1, "eu"))
    assert submit_check(s, GROUP, template="fsdp-multinode")[0].resources.nodes == 2
    assert submit_check(s, {**GROUP, "resources.nodes": 1}, template="fsdp-multinode")[0].resources.nodes == 1


def test_a_group_off_the_sim_market_needs_a_store_every_node_writes_into(tmp_path, monkeypatch):
    s = group_inventory(tmp_path, monkeypatch, ("a", "L4", 1, "eu"), ("e", "L4", 1, "eu"))
    with pytest.raises(InvalidOverride) as err:
        submit_check(s, {**GROUP, "checkpoint.store": "fs"}, template="fsdp-multinode")
    assert (err.value.field, err.value.value) == ("checkpoint.store", "fs") and "checkpoint.store: s3" in err.value.fix
    assert submit_check(s, {}, template="fsdp-multinode")[0].checkpoint.store == "fs"  # sim hosts share the store
