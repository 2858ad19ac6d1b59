"""The `aws` provider against moto's HTTP server; the machine itself is played locally (sim_host).

Real here: every EC2 and S3 call, tags, pagination, the catalog join, the agent on a real
bundle writing checkpoints to S3. Simulated: the machine and its reclaim (moto has neither).
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest

from orbit_dagster.catalog.aws import SpotPrice
from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.providers.aws import AwsSpotProvider
from orbit_dagster.providers.aws_errors import transition_time
from orbit_dagster.providers.base import LaunchSpec, RunHandle, RunStatus
from orbit_dagster.storage import open_store
from tests.integration.moto_fixtures import REGION, ami, aws_env, client, moto_ami, moto_server, s3_bucket  # noqa: F401

PRICE_TS = datetime(2026, 1, 1, tzinfo=timezone.utc)
# An operator-supplied price (moto's are placeholders): g6.xlarge (1x L4) at $0.35/h in use1-az1.
PRICES = [SpotPrice("use1-az1", "g6.xlarge", "Linux/UNIX", 0.35, PRICE_TS)]


@pytest.fixture
def provider(aws_env, ami, tmp_path):
    p = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path / "aws", image_id=ami,
                        static_spot_prices=PRICES, api_poll_s=0, boot_timeout_s=30)
    yield p
    p.transport.kill_all()  # no played machine outlives its test


def _offer(provider):
    return next(o for o in provider.list_offers(Resources(gpu="L4")) if o.offer_id == "aws:g6.xlarge:use1-az1")


def _ec2_instance(url: str, instance_id: str) -> dict:
    return client("ec2", url).describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def host_gone(provider, instance_id: str, within_s: float = 10.0) -> bool:
    """The played machine's process has exited (it records its end just before it does)."""
    deadline = time.time() + within_s
    while provider.transport.host_pid(instance_id) is not None and time.time() < deadline:
        time.sleep(0.05)
    return provider.transport.host_pid(instance_id) is None


def small_bundle(root: Path, job_id: str, **extra):
    t = apply_overrides(load_template("charlm-finetune"),
                        {"config.steps": 12, "checkpoint.every_steps": 4, "placement": "aws_spot", **extra})
    cfg = {**t.config, "d_model": 32, "n_heads": 2, "n_layers": 1, "seq_len": 32, "micro_batch": 4, "grad_accum": 1}
    return build_bundle(t.model_copy(update={"config": cfg}), TaskSubmission(template=t.name), job_id, root / "bundles")


def follow(provider, run, timeout_s: float = 120) -> tuple[RunStatus, list[dict]]:
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


def test_provision_tags_terminate_and_bill_from_launch_time(provider, aws_env):
    offer = _offer(provider)
    inst = provider.provision(offer, tags={"orbit/job": "job-prov", "orbit/attempt": "1"})
    ec2 = _ec2_instance(aws_env, inst.instance_id)
    tags = {t["Key"]: t["Value"] for t in ec2["Tags"]}
    assert tags["orbit/job"] == "job-prov" and tags["orbit/attempt"] == "1" and tags["orbit/offer"] == offer.offer_id
    assert ec2["InstanceLifecycle"] == "spot" and ec2["InstanceType"] == "g6.xlarge"
    zones = client("ec2", aws_env).describe_availability_zones()["AvailabilityZones"]
    assert {z["ZoneName"]: z["ZoneId"] for z in zones}[ec2["Placement"]["AvailabilityZone"]] == "use1-az1"
    assert [i["InstanceId"] for i in provider.find_instances({"orbit/job": "job-prov"})] == [inst.instance_id]
    assert provider.instance_alive(inst)
    with urllib.request.urlopen(inst.address["metadata_url"] + "/latest/meta-data/instance-id", timeout=5) as r:
        assert r.read().decode() == inst.instance_id  # the played machine answers as the EC2 instance
    assert provider.notices(inst) == []
    time.sleep(1.1)
    times = provider.terminate(inst, "test over")
    assert _ec2_instance(aws_env, inst.instance_id)["State"]["Name"] == "terminated"
    assert times.started_at == ec2["LaunchTime"].astimezone(timezone.utc) == inst.started_at
    assert times.started_at + (times.stopped_at - times.started_at) <= datetime.now(timezone.utc)
    assert 1.0 <= (times.stopped_at - times.started_at).total_seconds() < 60 and times.reason == "test over"
    assert not provider.instance_alive(inst) and host_gone(provider, inst.instance_id)
    assert provider.terminate(inst, "again") == times  # idempotent: the first stop time stands


def test_an_instance_ended_outside_orbit_makes_its_run_lost_and_bills_to_ec2s_stop_time(provider, aws_env, tmp_path):
    inst = provider.provision(_offer(provider), tags={"orbit/job": "job-gone", "orbit/attempt": "1"})
    run = RunHandle(provider="aws", instance=inst, run_ref=str(tmp_path / "not-launched"),
                    launched_at=datetime.now(timezone.utc))
    assert provider.status(run).state == "starting"
    client("ec2", aws_env).terminate_instances(InstanceIds=[inst.instance_id])  # the console, or AWS
    status = provider.status(run)
    assert (status.state, status.failure_class) == ("lost", "reclaim")
    assert status.reason.startswith("aws instance terminated: ") and "UserInitiatedShutdown" in status.reason
    assert not provider.instance_alive(inst) and host_gone(provider, inst.instance_id)
    times = provider.instance_times(inst)  # nobody here stopped it: EC2's own transition time
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


def test_request_spot_instances_path_tags_the_instance_and_reads_the_request_status(aws_env, ami, tmp_path):
    p = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path / "aws", image_id=ami,
                        static_spot_prices=PRICES, api_poll_s=0, spot_api="request_spot_instances")
    try:
        inst = p.provision(_offer(p), tags={"orbit/job": "job-req", "orbit/attempt": "2"})
        assert inst.address["spot_request_id"].startswith("sir-")
        tags = {t["Key"]: t["Value"] for t in _ec2_instance(aws_env, inst.instance_id)["Tags"]}
        assert tags["orbit/job"] == "job-req" and tags["orbit/attempt"] == "2"
        assert p.spot_request(inst)["Status"]["Code"] == "fulfilled"
        assert p.notices(inst) == []
        p.terminate(inst, "done")
        assert _ec2_instance(aws_env, inst.instance_id)["State"]["Name"] == "terminated"
    finally:
        p.transport.kill_all()


def test_a_simulated_reclaim_gives_a_metadata_notice_and_an_emergency_checkpoint_in_s3(provider, aws_env, s3_bucket,
                                                                                      tmp_path):
    bundle = small_bundle(tmp_path, "job-rec", **{"config.steps": 100000, "checkpoint.every_steps": 1000})
    inst = provider.provision(_offer(provider), tags={"orbit/job": "job-rec", "orbit/attempt": "1"})
    store_uri = f"s3://{s3_bucket}/rec"
    run = provider.launch(inst, bundle.path, LaunchSpec(store_uri=store_uri))
    offset, deadline = 0, time.time() + 90
    while time.time() < deadline:  # wait for training to run
        events, offset = provider.read_events(run, offset)
        if any(e["type"] == "metrics" for e in events):
            break
        time.sleep(0.1)
    # Another process (a new provider object on the same state dir) re-attaches by the handle alone.
    other = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=provider.state_dir, api_poll_s=0)
    assert other.reattach(run) == run and other.status(run).state == "running"
    provider.simulate_reclaim(inst, in_seconds=4, notice_seconds=3)
    notices, deadline = [], time.time() + 10
    while not notices and time.time() < deadline:
        notices = provider.notices(inst)
        time.sleep(0.1)
    assert notices and notices[0].source == "metadata" and notices[0].action == "terminate"
    assert 0 < (notices[0].deadline - notices[0].received_at).total_seconds() <= 3.5
    status, _ = follow(provider, run, timeout_s=30)
    # The agent saves and exits as preempted (75) inside the notice window, or the reclaim lands first.
    assert status.failure_class == "reclaim" and (status.state, status.exit_code) in (("exited", 75), ("lost", None))
    store = open_store(store_uri)
    saved = [store.verify(u) for u in store.list("job-rec")]
    assert [m.tier for m in saved] == ["emergency"]
    assert provider.instance_alive(inst)  # EC2 (moto) still bills it: the control plane must terminate it
    provider.terminate(inst, "reclaimed")
    assert _ec2_instance(aws_env, inst.instance_id)["State"]["Name"] == "terminated"


def test_the_demo_template_runs_through_the_aws_path_of_the_control_plane(aws_env, ami, s3_bucket, monkeypatch):
    """submit -> run_attempt on `aws_spot`: provision on EC2 (moto), the agent on the played
    instance checkpoints into S3 (moto), the control plane verifies and registers, bills, terminates."""
    from orbit_dagster.control import providers as registry
    from orbit_dagster.control.attempt import run_attempt
    from orbit_dagster.control.settings import Settings
    from orbit_dagster.control.submit import submit

    def factory(settings):
        return AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=settings.home / "aws", image_id=ami,
                               static_spot_prices=PRICES, api_poll_s=0,
                               host_env={"ORBIT_S3_MULTIPART_THRESHOLD": "65536"})

    monkeypatch.setitem(registry.REGISTRY, "aws_spot_host_process", factory)
    store_uri = f"s3://{s3_bucket}/demo"
    monkeypatch.setenv("ORBIT_CHECKPOINT_STORE", store_uri)
    settings = Settings.from_env()
    job = submit(settings, "charlm-finetune", {"placement": "aws_spot", "config.steps": 8, "config.micro_batch": 4,
                                               "config.grad_accum": 1, "checkpoint.every_steps": 4},
                 experiment="aws-demo")
    provider = registry.provider_for(settings, "aws_spot_host_process")
    try:
        out = run_attempt(settings, job, poll_s=0.1)
    finally:
        provider.transport.kill_all()
    assert out.state == "SUCCEEDED" and out.last_step == 8 and out.exit_code == 0, out.reason
    ledger = settings.ledger()
    ckpts = ledger.rows("SELECT step, uri, sha256 FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    assert [c["step"] for c in ckpts] == [4, 8]
    assert [c["uri"] for c in ckpts] == list(open_store(store_uri).list(job))
    assert all(open_store(store_uri).verify(c["uri"]).digest == c["sha256"] for c in ckpts)
    head = client("s3", aws_env).head_object(Bucket=s3_bucket, Key=f"demo/{job}/step-000000008/state.pt",
                                             PartNumber=1)
    assert head["PartsCount"] >= 1  # the host uploaded by multipart (threshold 64 KiB)
    launch = (provider.transport.root / "instances" / out.instance_id / "launch.json").read_text()
    assert "testing" not in launch  # credentials travel by name only
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(json.loads(launch)["forward_env"])
    assert (settings.artifacts_dir / job / "attempt-1" / "events.jsonl").is_file()  # collected
    ec2 = _ec2_instance(aws_env, out.instance_id)
    assert ec2["State"]["Name"] == "terminated"
    assert {t["Key"]: t["Value"] for t in ec2["Tags"]}["orbit/job"] == job
    stop = ledger.rows("SELECT stopped_at FROM instance_stops WHERE instance_id = ?", [out.instance_id])[0]
    seconds = (stop["stopped_at"].replace(tzinfo=timezone.utc) - ec2["LaunchTime"].astimezone(timezone.utc))
    billed = ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [out.instance_id])
    assert billed == pytest.approx(seconds.total_seconds() * 0.35 / 3600, rel=0.05) and billed > 0
    assert out.usd == pytest.approx(billed)


def test_real_aws_without_a_transport_refuses_to_provision_and_an_fs_store_is_refused(tmp_path):
    from orbit_dagster.core.errors import ProviderError
    from orbit_dagster.core.offers import Offer
    from orbit_dagster.providers.base import InstanceHandle

    p = AwsSpotProvider(region=REGION, state_dir=tmp_path, image_id="ami-0123")  # no endpoint: AWS itself
    assert p.transport is None and p.prices_are_real
    offer = Offer(offer_id="aws:g6.xlarge:use1-az1", provider="aws", instance_type="g6.xlarge", gpu="L4",
                  gpu_count=1, region=REGION, zone="use1-az1")
    with pytest.raises(ProviderError, match="no host transport") as err:
        p.provision(offer, tags={"orbit/job": "j"})  # refused before any API call
    assert err.value.field == "transport"
    with pytest.raises(ProviderError, match="not an aws offer in us-east-1"):
        p.provision(offer.model_copy(update={"region": "eu-west-1"}), tags={})
    handle = InstanceHandle(provider="aws", instance_id="i-1", offer=offer, started_at=PRICE_TS)
    assert p.host_store_uri(handle, "s3://bucket/ckpt") == "s3://bucket/ckpt"
    with pytest.raises(ProviderError, match="ORBIT_CHECKPOINT_STORE=s3://") as err:
        p.host_store_uri(handle, "file:///home/me/checkpoints")
    assert err.value.field == "checkpoint.store" and err.value.retryable is False
