"""The `aws` provider against moto's HTTP server, its instances reached over real SSH.

Real here: every EC2 and S3 call, tags, pagination, the catalog join, the key pair and
security group, the user-data, SSH with the host key from that user-data checked, the
agent on a real bundle, checkpoints over SFTP or into S3, the agent's IMDSv2 polling.
Stood in (moto has no machines): the instance is a loopback sshd that the `ec2_host`
fixture starts from the instance's user-data and key pair, as cloud-init would; the
metadata service is a loopback server whose notice the test schedules (AWS's reclaim).
"""
from __future__ import annotations

import json
import re
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from orbit_dagster.catalog.aws import SpotPrice
from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.errors import HostKeyMismatch, ProviderError
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.host_contract import Entry, Metrics, Notice
from orbit_dagster.core.offers import Offer
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.providers.aws.bootstrap import host_key_from_user_data
from orbit_dagster.providers.aws.errors import transition_time
from orbit_dagster.providers.aws.provider import AwsSpotProvider
from orbit_dagster.providers.base import LaunchSpec, RunHandle, RunStatus
from orbit_dagster.storage import open_store
from tests.helpers import wait_for
from tests.integration.moto_fixtures import REGION, ami, aws_env, client, ec2_host, moto_ami, moto_server, s3_bucket  # noqa: F401

PRICE_TS = datetime(2026, 1, 1, tzinfo=timezone.utc)
# An operator-supplied price (moto's are placeholders): g6.xlarge (1x L4) at $0.35/h in use1-az1.
PRICES = [SpotPrice("use1-az1", "g6.xlarge", "Linux/UNIX", 0.35, PRICE_TS)]
PRICES_TSV = "use1-az1\tg6.xlarge\tLinux/UNIX\t0.35\t2026-01-01T00:00:00Z\n"


@pytest.fixture
def provider(aws_env, ami, tmp_path):
    """EC2 only: offers, prices, look-ups (nothing it does needs a machine)."""
    return AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path / "aws", image_id=ami,
                           static_spot_prices=PRICES, api_poll_s=0)


@pytest.fixture
def hosted(aws_env, ami, tmp_path, ec2_host):
    """A provider whose instances come up as the stand-in machine."""
    return AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path / "aws", image_id=ami,
                           static_spot_prices=PRICES, api_poll_s=0, **ec2_host.provider_kwargs)


def _offer(provider):
    return next(o for o in provider.list_offers(Resources(gpu="L4")) if o.offer_id == "aws:g6.xlarge:use1-az1")


def _ec2_instance(url: str, instance_id: str) -> dict:
    return client("ec2", url).describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def _user_data(url: str, instance_id: str) -> str:
    import base64

    attr = client("ec2", url).describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(attr["UserData"]["Value"]).decode()


def small_bundle(root: Path, job_id: str, **extra):
    t = apply_overrides(load_template("charlm-finetune"),
                        {"config.steps": 12, "checkpoint.every_steps": 4, "placement": "aws_spot", **extra})
    cfg = {**t.config, "d_model": 32, "n_heads": 2, "n_layers": 1, "seq_len": 32, "micro_batch": 4, "grad_accum": 1}
    return build_bundle(t.model_copy(update={"config": cfg}), TaskSubmission(template=t.name), job_id, root / "bundles")


def follow(provider, run, timeout_s: float = 120) -> tuple[RunStatus, list[Entry]]:
    events, offset, deadline = [], 0, time.time() + timeout_s
    while time.time() < deadline:
        new, offset = provider.read_events(run, offset)
        events += new
        status = provider.status(run)
        if status.state in ("exited", "lost"):
            new, offset = provider.read_events(run, offset)
            return status, events + new
        time.sleep(0.1)
    raise AssertionError(f"run did not end in {timeout_s} s:\n{provider.logs(run, 40)}")


def test_offers_join_describe_instance_types_gpu_info_with_the_catalog(provider):
    types = provider.gpu_instance_types()
    assert types["g4dn.xlarge"] == (1, 16.0) and types["p4d.24xlarge"] == (8, 40.0)
    assert "p3.2xlarge" not in types  # moto, like a region that retired it, does not offer it
    offers = provider.list_offers()
    assert offers and all(o.region == REGION and o.provider == "aws" and o.instance_type in types for o in offers)
    by_id = {o.offer_id: o for o in offers}
    priced = by_id["aws:g6.xlarge:use1-az1"]
    assert (priced.gpu, priced.gpu_count, priced.zone) == ("L4", 1, "use1-az1")
    assert priced.gpu_memory_gb == types["g6.xlarge"][1] > 20  # EC2's GpuInfo, not the catalog's 24
    assert priced.usd_per_gpu_second_spot == pytest.approx(0.35 / 3600) and priced.spec_tflops_bf16 == 121.0
    assert priced.interruption_band is not None and 0 < priced.reliability < 1  # the advisor band, joined
    p4d = by_id["aws:p4d.24xlarge:us-east-1"]  # regional and unpriced: no real price for it here
    assert (p4d.gpu, p4d.gpu_count, p4d.gpu_memory_gb, p4d.usd_per_gpu_second_spot) == ("A100-40G", 8, 40.0, None)
    assert not any(o.instance_type == "p3.2xlarge" for o in offers)  # in the catalog, not in this EC2
    t4 = provider.list_offers(Resources(gpu="T4"))
    assert t4 and {o.gpu for o in t4} == {"T4"} and len(t4) < len(offers)


def test_spot_price_history_is_ingested_and_moto_prices_are_flagged_not_real(provider):
    ticks = provider.price_feed()
    assert len(ticks) >= 10
    assert all(re.fullmatch(r"aws:[a-z0-9]+\.[a-z0-9]+:use1-az\d+", t.offer_id) for t in ticks)
    assert {t.usd_per_hour_spot for t in ticks} == {0.00001}
    assert all(t.source.startswith("placeholder:") and "not a real price" in t.source for t in ticks)
    offers = provider.list_offers()
    assert [o.offer_id for o in offers if o.usd_per_gpu_second_spot is not None] == ["aws:g6.xlarge:use1-az1"]
    # Even a provider told the endpoint is real will not take a price dated before EC2 spot existed.
    trusting = AwsSpotProvider(region=REGION, endpoint_url=provider.endpoint_url, state_dir=provider.state_dir,
                               prices_are_real=True)
    assert all(t.source.startswith("placeholder:") for t in trusting.price_feed())


def test_key_pair_and_security_group_are_made_once_tagged_and_admit_only_the_configured_cidr(aws_env, tmp_path):
    ec2 = client("ec2", aws_env)
    kw = {"region": REGION, "endpoint_url": aws_env, "state_dir": tmp_path / "aws", "image_id": "ami-x"}
    p = AwsSpotProvider(**kw, ssh_cidrs=("198.51.100.7/32",))
    first = p.bootstrap.ensure()
    assert stat.S_IMODE(first.key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(first.key_file.parent.stat().st_mode) == 0o700
    assert "PRIVATE KEY" in first.key_file.read_text()
    pair = ec2.describe_key_pairs(KeyNames=[first.key_name], IncludePublicKey=True)["KeyPairs"][0]
    assert pair["PublicKey"].split()[:2] == first.key_file.with_suffix(".pub").read_text().split()[:2]
    assert {t["Key"]: t["Value"] for t in pair["Tags"]}["orbit/managed-by"] == "orbit-dagster"
    (gid,) = first.security_group_ids
    group = ec2.describe_security_groups(GroupIds=[gid])["SecurityGroups"][0]
    assert [(r["FromPort"], [c["CidrIp"] for c in r["IpRanges"]]) for r in group["IpPermissions"]] == [
        (22, ["198.51.100.7/32"])]
    assert {t["Key"]: t["Value"] for t in group["Tags"]}["orbit/managed-by"] == "orbit-dagster"
    # Again, from another provider object on the same home: the same key pair, key file and group.
    again = AwsSpotProvider(**kw, ssh_cidrs=("198.51.100.7/32",)).bootstrap.ensure()
    assert again == first and len(ec2.describe_security_groups(Filters=[
        {"Name": "group-name", "Values": [group["GroupName"]]}])["SecurityGroups"]) == 1
    # The operator changes the CIDR: the group admits the new one only.
    AwsSpotProvider(**kw, ssh_cidrs=("203.0.113.0/24",)).bootstrap.ensure()
    perms = ec2.describe_security_groups(GroupIds=[gid])["SecurityGroups"][0]["IpPermissions"]
    assert [c["CidrIp"] for r in perms for c in r["IpRanges"]] == ["203.0.113.0/24"]
    # Another home on the same account gets its own key pair; a key pair of that name holding
    # another key is refused rather than used.
    other = AwsSpotProvider(**{**kw, "state_dir": tmp_path / "other"}, ssh_cidrs=("203.0.113.0/24",))
    assert other.bootstrap.key_name != first.key_name
    clash = AwsSpotProvider(**{**kw, "state_dir": tmp_path / "other"}, key_name=first.key_name,
                            ssh_cidrs=("203.0.113.0/24",))
    with pytest.raises(ProviderError, match="holds another public key") as err:
        clash.bootstrap.ensure()
    assert err.value.field == "key_name" and err.value.value == first.key_name
    # No CIDR at all is refused before any call; the whole internet only when written out.
    with pytest.raises(ProviderError, match="no CIDR") as err:
        AwsSpotProvider(**kw).bootstrap.ensure()
    assert err.value.field == "ssh_cidr" and "ORBIT_AWS_SSH_CIDR" in err.value.fix
    opened = AwsSpotProvider(**kw, ssh_cidrs=("0.0.0.0/0",)).bootstrap.ensure()
    perms = ec2.describe_security_groups(GroupIds=list(opened.security_group_ids))["SecurityGroups"][0]["IpPermissions"]
    assert [c["CidrIp"] for r in perms for c in r["IpRanges"]] == ["0.0.0.0/0"]


def test_provision_reaches_the_instance_over_ssh_with_its_own_host_key_and_bills_from_launch_time(
        hosted, aws_env, ec2_host):
    offer = _offer(hosted)
    inst = hosted.provision(offer, tags={"orbit/job": "job-prov", "orbit/attempt": "1"})
    ec2 = _ec2_instance(aws_env, inst.instance_id)
    tags = {t["Key"]: t["Value"] for t in ec2["Tags"]}
    assert tags["orbit/job"] == "job-prov" and tags["orbit/attempt"] == "1" and tags["orbit/offer"] == offer.offer_id
    assert ec2["InstanceLifecycle"] == "spot" and ec2["InstanceType"] == "g6.xlarge"
    assert ec2["MetadataOptions"]["HttpTokens"] == "required"  # IMDSv2 only
    assert ec2["KeyName"] == inst.address["key_name"] == hosted.bootstrap.key_name
    assert [g["GroupId"] for g in ec2["SecurityGroups"]] == list(hosted.bootstrap.ensure().security_group_ids)
    zones = client("ec2", aws_env).describe_availability_zones()["AvailabilityZones"]
    assert {z["ZoneName"]: z["ZoneId"] for z in zones}[ec2["Placement"]["AvailabilityZone"]] == "use1-az1"
    # The host key orbit trusts for this instance is the one its user-data gave it, and nothing else.
    key = host_key_from_user_data(_user_data(aws_env, inst.instance_id))
    known = (hosted.state_dir / "known_hosts" / inst.instance_id).read_text().split()
    assert known == [f"[127.0.0.1]:{ec2_host.port}", *key.public_line.split()[:2]]
    assert ec2_host.serving == inst.instance_id and not ec2_host.errors
    assert (inst.address["hostname"], inst.address["port"]) == ("127.0.0.1", ec2_host.port)
    assert inst.address["run_root"].startswith(str(ec2_host.workdir)) and inst.gpu_slots == (0,)
    assert "PRIVATE" not in inst.model_dump_json()  # the handle goes to the ledger: no key material
    assert [i["InstanceId"] for i in hosted.find_instances({"orbit/job": "job-prov"})] == [inst.instance_id]
    assert hosted.instance_alive(inst) and hosted.notices(inst) == []
    # The metadata service announces a reclaim: orbit reads it over SSH, with an IMDSv2 token.
    notice = ec2_host.metadata.schedule(in_seconds=90)
    (seen,) = hosted.notices(inst)
    assert (seen.source, seen.action) == ("metadata", "terminate")
    assert seen.deadline.strftime("%Y-%m-%dT%H:%M:%SZ") == notice["time"] and ec2_host.metadata.refused == 0
    time.sleep(1.1)
    times = hosted.terminate(inst, "test over")
    assert _ec2_instance(aws_env, inst.instance_id)["State"]["Name"] == "terminated"
    assert times.started_at == ec2["LaunchTime"].astimezone(timezone.utc) == inst.started_at
    # Billed from the launch time (seconds to minutes ago on a loaded machine), not from the epoch.
    assert 1.0 <= (times.stopped_at - times.started_at).total_seconds() < 900 and times.reason == "test over"
    assert not hosted.instance_alive(inst)
    wait_for(lambda: ec2_host.serving is None, 10, what="the stand-in machine to go with its instance")
    assert hosted.terminate(inst, "again") == times  # idempotent: the first stop time stands


def test_a_host_presenting_another_key_is_refused_and_its_instance_terminated(hosted, aws_env, ec2_host):
    ec2_host.impostor = True  # whoever answers at the address does not hold the instance's host key
    with pytest.raises(HostKeyMismatch):
        hosted.provision(_offer(hosted), tags={"orbit/job": "job-mitm", "orbit/attempt": "1"})
    (iid,) = ec2_host.served
    assert _ec2_instance(aws_env, iid)["State"]["Name"] == "terminated"  # never left billed


def test_an_instance_ended_outside_orbit_makes_its_run_lost_and_bills_to_ec2s_stop_time(hosted, aws_env, ec2_host):
    inst = hosted.provision(_offer(hosted), tags={"orbit/job": "job-gone", "orbit/attempt": "1"})
    run = RunHandle(provider="aws", instance=inst, run_ref=inst.address["run_root"] + "/run",
                    launched_at=datetime.now(timezone.utc))
    assert hosted.status(run).state == "lost"  # nothing launched there: the run dir is absent
    client("ec2", aws_env).terminate_instances(InstanceIds=[inst.instance_id])  # the console, or AWS
    status = hosted.status(run)
    assert (status.state, status.failure_class) == ("lost", "reclaim")
    assert status.reason.startswith("aws instance terminated: ") and "UserInitiatedShutdown" in status.reason
    assert not hosted.instance_alive(inst) and hosted.reattach(run) is None
    wait_for(lambda: ec2_host.serving is None, 10, what="the stand-in machine to go with its instance")
    assert hosted.read_events(run, 0) == ([], 0)  # the machine is gone: no event will come, no hang
    times = hosted.instance_times(inst)  # nobody here stopped it: EC2's own transition time
    reason = _ec2_instance(aws_env, inst.instance_id)["StateTransitionReason"]
    assert times.stopped_at == transition_time(reason) and times.started_at <= times.stopped_at


def test_find_instances_pages_through_describe_instances(provider, aws_env, ami):
    ec2 = client("ec2", aws_env)
    mark = f"sweep-{time.time_ns()}"
    made = [ec2.run_instances(ImageId=ami, InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "orbit/sweep", "Value": mark}]}])["Instances"][0]["InstanceId"]
        for _ in range(5)]
    paged = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=provider.state_dir, page_size=2)
    pages = []
    paged.ec2.meta.events.register("after-call.ec2.DescribeInstances", lambda **kw: pages.append(1))
    assert sorted(i["InstanceId"] for i in paged.find_instances({"orbit/sweep": mark})) == sorted(made)
    assert len(pages) >= 3  # 5 instances, 2 a page
    ec2.terminate_instances(InstanceIds=made)


def test_request_spot_instances_path_tags_the_instance_and_requires_imdsv2(aws_env, ami, tmp_path, ec2_host):
    p = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path / "aws", image_id=ami,
                        static_spot_prices=PRICES, api_poll_s=0, spot_api="request_spot_instances",
                        **ec2_host.provider_kwargs)
    inst = p.provision(_offer(p), tags={"orbit/job": "job-req", "orbit/attempt": "2"})
    assert inst.address["spot_request_id"].startswith("sir-") and ec2_host.serving == inst.instance_id
    ec2 = _ec2_instance(aws_env, inst.instance_id)
    tags = {t["Key"]: t["Value"] for t in ec2["Tags"]}
    assert tags["orbit/job"] == "job-req" and tags["orbit/attempt"] == "2"
    assert ec2["MetadataOptions"]["HttpTokens"] == "required"
    assert host_key_from_user_data(_user_data(aws_env, inst.instance_id)).public_line.startswith("ssh-ed25519 ")
    assert p.spot_request(inst)["Status"]["Code"] == "fulfilled"
    assert p.notices(inst) == []
    p.terminate(inst, "done")
    assert _ec2_instance(aws_env, inst.instance_id)["State"]["Name"] == "terminated"


def test_a_metadata_notice_makes_the_agent_save_an_emergency_checkpoint_into_s3(hosted, aws_env, ec2_host, s3_bucket,
                                                                                tmp_path):
    bundle = small_bundle(tmp_path, "job-rec", **{"config.steps": 100000, "checkpoint.every_steps": 1000})
    inst = hosted.provision(_offer(hosted), tags={"orbit/job": "job-rec", "orbit/attempt": "1"})
    store_uri = f"s3://{s3_bucket}/rec"
    assert hosted.host_store_uri(inst, store_uri) == store_uri  # the host writes to S3 itself
    run = hosted.launch(inst, bundle.path, LaunchSpec(store_uri=store_uri))
    offset, events = 0, []
    while not any(isinstance(e, Metrics) for e in events):  # training runs
        new, offset = hosted.read_events(run, offset)
        events += new
        assert hosted.status(run).state in ("starting", "running"), hosted.logs(run, 40)
        time.sleep(0.1)
    # Another process (a new provider object on the same state dir) re-attaches by the handle alone.
    other = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=hosted.state_dir, api_poll_s=0,
                            **ec2_host.provider_kwargs)
    assert other.reattach(run) == run and other.status(run).state == "running"
    ec2_host.metadata.schedule(in_seconds=120)  # what AWS serves two minutes before a reclaim
    status, events = follow(hosted, run, timeout_s=60)
    assert (status.state, status.exit_code, status.failure_class) == ("exited", 75, "reclaim"), status
    notice = next(e for e in events if isinstance(e, Notice))
    assert notice.source == "metadata" and notice.deadline > time.time()
    store = open_store(store_uri)
    saved = [store.verify(u) for u in store.list("job-rec")]
    assert [m.tier for m in saved] == ["emergency"]
    launch = json.loads((Path(run.run_ref) / "launch.json").read_text())  # the stand-in's disk
    assert "testing" not in json.dumps(launch)  # credentials travel by name, their values by pipe
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(launch["secret_names"])
    assert launch["env"]["ORBIT_METADATA_URL"] == ec2_host.metadata.url
    assert hosted.instance_alive(inst)  # EC2 still bills it: the control plane must terminate it
    hosted.terminate(inst, "reclaimed")
    assert _ec2_instance(aws_env, inst.instance_id)["State"]["Name"] == "terminated"


def _submit(settings, overrides: dict, experiment: str) -> str:
    """`orbit submit charlm-finetune --set placement=aws_spot --set ...`, the CLI itself."""
    from click.testing import CliRunner

    from orbit_dagster.cli.commands import cli

    args = ["submit", "charlm-finetune", "--experiment", experiment]
    for k, v in {"placement": "aws_spot", **overrides}.items():
        args += ["--set", f"{k}={v}"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()[-1]


def _aws_settings(orbit_home, aws_env, ami, ec2_host, monkeypatch):
    from orbit_dagster.settings import Settings

    orbit_home.mkdir(parents=True, exist_ok=True)
    (orbit_home / "aws_spot_prices.tsv").write_text(PRICES_TSV)
    monkeypatch.setenv("ORBIT_AWS_ENDPOINT_URL", aws_env)
    monkeypatch.setenv("ORBIT_AWS_IMAGE_ID", ami)
    for k, v in ec2_host.environment().items():
        monkeypatch.setenv(k, v)
    return Settings.from_env()


def _billed_from_launch_time(ledger, aws_env, instance_id: str) -> float:
    ec2 = _ec2_instance(aws_env, instance_id)
    assert ec2["State"]["Name"] == "terminated"
    stop = ledger.scalar("SELECT stopped_at FROM instances WHERE instance_id = ?", [instance_id])
    seconds = stop - ec2["LaunchTime"].astimezone(timezone.utc).timestamp()
    billed = ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [instance_id])
    assert billed == pytest.approx(seconds * 0.35 / 3600, rel=0.05) and billed > 0
    return billed


def test_the_demo_template_runs_through_the_aws_path_of_the_control_plane(orbit_home, aws_env, ami, ec2_host,
                                                                          s3_bucket, monkeypatch):
    """`orbit submit --set placement=aws_spot` with ORBIT_AWS_* settings, then the attempt:
    EC2 (moto) rents, SSH stages and launches, the host checkpoints into S3 (moto) by
    multipart, the control plane verifies and registers, collects, terminates, bills."""
    from orbit_dagster.control.attempt import run_attempt

    store_uri = f"s3://{s3_bucket}/demo"
    monkeypatch.setenv("ORBIT_CHECKPOINT_STORE", store_uri)
    settings = _aws_settings(orbit_home, aws_env, ami, ec2_host, monkeypatch)
    job = _submit(settings, {"config.steps": 8, "config.micro_batch": 4, "config.grad_accum": 1,
                             "checkpoint.every_steps": 4}, "aws-demo")
    out = run_attempt(settings, job, poll_s=0.1)
    assert out.state == "SUCCEEDED" and out.last_step == 8 and out.exit_code == 0, out.reason
    assert ec2_host.served == [out.instance_id] and not ec2_host.errors
    ledger = settings.ledger()
    assert ledger.scalar("SELECT provider FROM runs WHERE job_id = ?", [job]) == "aws"
    ckpts = ledger.rows("SELECT step, uri, sha256 FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    assert [c["step"] for c in ckpts] == [4, 8]
    assert [c["uri"] for c in ckpts] == list(open_store(store_uri).list(job))
    assert all(open_store(store_uri).verify(c["uri"]).digest == c["sha256"] for c in ckpts)
    assert (settings.artifacts_dir / job / "attempt-1" / "events.jsonl").is_file()  # collected over SFTP
    assert {t["Key"]: t["Value"] for t in _ec2_instance(aws_env, out.instance_id)["Tags"]}["orbit/job"] == job
    assert out.usd == pytest.approx(_billed_from_launch_time(ledger, aws_env, out.instance_id))


def test_a_reclaim_notice_on_aws_gives_an_emergency_checkpoint_and_the_next_attempt_resumes_from_it(
        orbit_home, aws_env, ami, ec2_host, monkeypatch):
    """fs store: every checkpoint crosses over SFTP (copied in on its event, staged out for the resume)."""
    from orbit_dagster.control.attempt import run_attempt
    from orbit_dagster.ledger import records as R

    settings = _aws_settings(orbit_home, aws_env, ami, ec2_host, monkeypatch)
    job = _submit(settings, {"config.steps": 400, "config.micro_batch": 4, "config.grad_accum": 1,
                             "checkpoint.every_steps": 100000}, "aws-reclaim")
    ledger = settings.ledger()
    first: dict = {}
    runner = threading.Thread(target=lambda: first.update(out=run_attempt(settings, job, poll_s=0.1)), daemon=True)
    runner.start()
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM metric_points WHERE job_id = ?", [job]), 120,
             what="training metrics from the instance")
    ec2_host.metadata.schedule(in_seconds=120)
    runner.join(120)
    out = first["out"]
    assert (out.state, out.failure_class) == ("LOST", "reclaim"), out.reason
    (ckpt,) = ledger.rows("SELECT checkpoint_key, uri, tier, step FROM checkpoints WHERE job_id = ?", [job])
    assert ckpt["tier"] == "emergency" and ckpt["uri"].startswith(settings.store_uri)  # copied in over SFTP
    assert open_store(settings.store_uri).verify(ckpt["uri"])
    assert ledger.scalar("SELECT count(*) FROM events WHERE kind = 'host_notice' AND job_id = ?", [job]) == 1
    first_usd = _billed_from_launch_time(ledger, aws_env, out.instance_id)
    assert (R.require_job(ledger, job)["state"], R.require_job(ledger, job)["attempt"]) == ("QUEUED", 2)
    second = run_attempt(settings, job, poll_s=0.1)  # a new instance, the checkpoint staged to it over SFTP
    assert second.state == "SUCCEEDED" and second.last_step == 400, second.reason
    assert second.instance_id != out.instance_id and ec2_host.served == [out.instance_id, second.instance_id]
    assert R.run(ledger, R.run_id_for(job, 2))["resume_from"] == ckpt["checkpoint_key"]
    _billed_from_launch_time(ledger, aws_env, second.instance_id)
    assert ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]) == pytest.approx(first_usd + second.usd)


def test_what_is_refused_before_anything_is_rented(tmp_path):
    """A closed port as the endpoint: any API call would fail with a network error, so each
    refusal below provably came first."""
    from tests.integration.moto_fixtures import closed_port

    url = f"http://127.0.0.1:{closed_port()}"
    offer = Offer(offer_id="aws:g6.xlarge:use1-az1", provider="aws", instance_type="g6.xlarge", gpu="L4",
                  gpu_count=1, region=REGION, zone="use1-az1")

    def refused(match: str, of: Offer = offer, **kw) -> ProviderError:
        with pytest.raises(ProviderError, match=match) as err:
            base = {"region": REGION, "endpoint_url": url, "state_dir": tmp_path, "image_id": "ami-0123",
                    "ssh_endpoint": "127.0.0.1:22", "ssh_cidrs": ("198.51.100.7/32",)}
            AwsSpotProvider(**{**base, **kw}).provision(of, tags={"orbit/job": "j"})
        return err.value

    assert refused("no AMI", image_id=None).field == "image_id"
    assert refused("is not AWS", ssh_endpoint=None).field == "ssh_endpoint"  # moto's addresses lead nowhere
    assert refused("no CIDR", ssh_cidrs=()).field == "ssh_cidr"
    assert refused("not a CIDR", ssh_cidrs=("198.51.100.7/24",)).value == "198.51.100.7/24"
    assert refused("not HOST:PORT", ssh_endpoint="localhost").field == "ssh_endpoint"
    assert refused("neither public nor private", address="elastic").field == "address"
    assert refused("not an aws offer in us-east-1", of=offer.model_copy(update={"region": "eu-west-1"})).field == "offer"
    p = AwsSpotProvider(region=REGION, state_dir=tmp_path, image_id="ami-0123")  # AWS itself: no override needed
    assert p.real_aws and p.transport.endpoint is None
    with pytest.raises(ProviderError, match="no CIDR"):
        p.check()
