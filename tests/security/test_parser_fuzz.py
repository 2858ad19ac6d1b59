"""Fuzzing what orbit parses from outside: spot trace files, price rows (an operator's spot
price file, GCE's change points, EC2's price history), evaluation outputs (the agent's eval
path and `valid_metrics`), and the event lines a host writes.

The property, every time: a result whose numbers are all real and in range, or the
module's own error (an OrbitError naming the field) - never a traceback of another kind,
never a silent NaN, infinity or negative price. Seeded (derandomize) so a failure replays.
A parser that fails the property today is marked xfail(strict) naming the defect, with
its smallest failing inputs as explicit examples (run first, so the marker stays true).
"""
from __future__ import annotations

import csv
import io
import json
import math
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orbit_dagster.catalog import CatalogError
from orbit_dagster.catalog.aws import SpotPrice, parse_spot_price_history
from orbit_dagster.catalog.gce import PRICE_COLUMNS, read_price_changes
from orbit_dagster.catalog.traces import Trace, TraceFormatError, load_trace, trace_from_dict
from orbit_dagster.control.evaluate import valid_metrics
from orbit_dagster.core.errors import OrbitError

FUZZ = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
SLOW_FUZZ = settings(FUZZ, max_examples=40)

HUGE = 10 ** 400  # a JSON integer no float can hold
numbers = st.one_of(st.integers(-5, 5), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=False, allow_infinity=False))
hostile = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=8), st.just([]), st.just({}))
finite_only = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=8))


def real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- spot trace files -------------------------------------------------------------------------

def trace_docs(values):
    meta = st.one_of(st.fixed_dictionaries({"gap_seconds": st.one_of(st.integers(1, 600), values)},
                                           optional={"cloud": st.sampled_from(["aws", "gcp", 3]),
                                                     "nodes": values}),
                     values)
    data = st.lists(st.one_of(st.integers(0, 1), st.integers(0, 16), values), max_size=30)
    prices = st.lists(st.one_of(st.floats(0, 40, allow_nan=False), values), max_size=30)
    return st.fixed_dictionaries({"data": data}, optional={"metadata": meta, "prices": prices})


def assert_trace_or_refusal(build) -> None:
    try:
        t = build()
    except TraceFormatError as exc:
        assert exc.field and "fix:" in str(exc)
        return
    assert isinstance(t, Trace) and real(t.gap_seconds) and t.gap_seconds > 0 and math.isfinite(t.duration_s)
    assert t.data and all(isinstance(v, int) and v >= 0 for v in t.data)
    assert t.prices is None or (len(t.prices) == len(t.data) and all(real(p) and p >= 0 for p in t.prices))


@pytest.mark.fault("hypothesis: spot trace files (JSON documents, raw bytes)",
                   expect="a valid Trace or TraceFormatError naming the field")
@FUZZ
@given(doc=trace_docs(hostile), raw=st.binary(max_size=200))
@example(doc={"metadata": {"gap_seconds": 32}, "data": [math.inf]}, raw=b"{}")
@example(doc={"metadata": {"gap_seconds": 32}, "data": [math.nan]}, raw=b"{}")
@example(doc={"metadata": {"gap_seconds": HUGE}, "data": [1]}, raw=b"{}")
@example(doc={"data": [1]}, raw=b"[" * 100_000)
def test_trace_files_load_or_are_refused_naming_the_field(tmp_path_factory, doc, raw):
    assert_trace_or_refusal(lambda: trace_from_dict(doc, name="fuzz"))
    path = tmp_path_factory.mktemp("trace") / "t.json"
    path.write_text(json.dumps(doc))
    assert_trace_or_refusal(lambda: load_trace(path))
    path.write_bytes(raw)
    assert_trace_or_refusal(lambda: load_trace(path))


@pytest.mark.fault("hypothesis: spot trace files with finite values only (the part that holds today)",
                   expect="a valid Trace or TraceFormatError naming the field")
@FUZZ
@given(doc=trace_docs(finite_only))
def test_trace_files_with_finite_values_load_or_are_refused(doc):
    assert_trace_or_refusal(lambda: trace_from_dict(doc, name="fuzz"))


# ---- price rows -------------------------------------------------------------------------------

price_text = st.one_of(st.floats(0, 100, allow_nan=False).map(repr), st.sampled_from(
    ["nan", "NaN", "inf", "-inf", "-3", "-0.0", "1e999", "1_0", "0x10", " 2 ", "", "abc", "3,5"]), st.text(max_size=6))
time_text = st.one_of(
    st.datetimes(min_value=datetime(2015, 1, 1), max_value=datetime(2030, 1, 1)).map(
        lambda d: d.replace(tzinfo=timezone.utc).isoformat()),
    st.sampled_from(["2022-05-31T00:00:00Z", "2022-05-31", "yesterday", "", "2022-13-40T00:00:00Z"]),
    st.text(max_size=8))


def spot_lines():
    az = st.one_of(st.sampled_from(["use1-az2", "usw2-az1", "apne1-az4", "euc1-az3"]), st.text(max_size=6))
    itype = st.one_of(st.sampled_from(["p3.2xlarge", "g5.xlarge", "p4d.24xlarge"]), st.text(max_size=6))
    product = st.sampled_from(["Linux/UNIX", "Windows", "Linux/UNIX (Amazon VPC)", ""])
    fields = st.tuples(az, itype, product, price_text, time_text).map(list)
    return st.lists(st.one_of(fields, st.lists(st.text(max_size=5), max_size=7)), min_size=1, max_size=5)


def check_spot_rows(rows: list[SpotPrice]) -> None:
    for r in rows:
        assert real(r.usd_per_hour) and r.usd_per_hour >= 0, r
        assert r.timestamp.tzinfo is not None and r.region


@pytest.mark.fault("hypothesis: an operator's spot price file (aws_spot_prices.tsv: az, type, product, $/h, time)",
                   expect="rows with real, non-negative prices, or CatalogError naming the line")
@FUZZ
@given(lines=spot_lines(), tail=st.binary(max_size=20))
@example(lines=[["use1-az2", "p3.2xlarge", "Linux/UNIX", "nan", "2022-05-31T00:00:00Z"]], tail=b"")
@example(lines=[["use1-az2", "p3.2xlarge", "Linux/UNIX", "-3", "2022-05-31T00:00:00Z"]], tail=b"")
@example(lines=[["use1-az2", "p3.2xlarge", "Linux/UNIX", "1", "2022-05-31T00:00:00Z"]], tail=b"\xff\n")
def test_spot_price_rows_parse_or_are_refused_naming_the_line(tmp_path_factory, lines, tail):
    path = tmp_path_factory.mktemp("spot") / "prices.tsv"
    path.write_bytes("".join("\t".join(f) + "\n" for f in lines).encode() + tail)
    try:
        rows = parse_spot_price_history(path)
    except CatalogError as exc:
        assert exc.field and "line" in str(exc)
        return
    check_spot_rows(rows)


def gce_rows():
    row = st.fixed_dictionaries({
        "snapshot_commit_time_utc": time_text, "instance_type": st.sampled_from(["a3-highgpu-8g", "g2-standard-4", "x"]),
        "gpu_model": st.sampled_from(["h100", "l4", ""]), "gpu_count": price_text, "vcpus": price_text,
        "ram_gb": price_text, "region": st.sampled_from(["us-central1", "europe-west4"]),
        "hour": price_text, "hour_spot": price_text, "event": st.sampled_from(["first", "change", "removed", "gone"])})
    return st.lists(row, min_size=1, max_size=4)


@pytest.mark.fault("hypothesis: GCE price change points (the catalog's CSV)",
                   expect="rows with real, non-negative prices and UTC times, or CatalogError naming the line")
@FUZZ
@given(rows=gce_rows())
@example(rows=[{"snapshot_commit_time_utc": "yesterday", "instance_type": "a3-highgpu-8g", "gpu_model": "h100",
                "gpu_count": "8", "vcpus": "208", "ram_gb": "1872", "region": "us-central1", "hour": "88.49",
                "hour_spot": "20.42", "event": "first"}])
@example(rows=[{"snapshot_commit_time_utc": "2024-01-01T00:00:00+00:00", "instance_type": "a3-highgpu-8g",
                "gpu_model": "h100", "gpu_count": "8", "vcpus": "208", "ram_gb": "1872", "region": "us-central1",
                "hour": "nan", "hour_spot": "-5", "event": "first"}])
def test_gce_price_changes_parse_or_are_refused_naming_the_line(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("gce") / "changes.csv"
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=PRICE_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(buf.getvalue())
    try:
        changes = read_price_changes(path)
    except CatalogError as exc:
        assert exc.field
        return
    for c in changes:
        assert c.time.tzinfo is not None
        for v in (c.usd_per_hour, c.usd_per_hour_spot, c.gpu_count):
            assert v is None or (real(v) and v >= 0), c


class Ec2Stub:
    """EC2's answer to describe_spot_price_history, as the fuzzer writes it (a unit test of one
    function: AwsCatalog.price_feed's reading of the rows)."""

    region, endpoint_url = "us-east-1", None

    def __init__(self, rows):
        self.rows = rows

    def zone_names(self):
        return {"use1-az1": "us-east-1a", "use1-az2": "us-east-1b"}

    def pages(self, method, key, **_):
        if method == "describe_instance_types":
            return [{"InstanceType": "p3.2xlarge", "GpuInfo": {"Gpus": [{"Count": 1, "MemoryInfo": {"SizeInMiB": 16384}}]}}]
        return self.rows


def ec2_rows():
    when = st.datetimes(min_value=datetime(2008, 1, 1), max_value=datetime(2030, 1, 1)).map(
        lambda d: d.replace(tzinfo=timezone.utc))
    row = st.fixed_dictionaries({"InstanceType": st.just("p3.2xlarge"), "Timestamp": when,
                                 "SpotPrice": price_text, "AvailabilityZone": st.sampled_from(["us-east-1a", "nope"])})
    return st.lists(row, max_size=4)


@pytest.mark.fault("hypothesis: EC2 spot price history rows (SpotPrice strings) read by the AWS catalog's price feed",
                   expect="ticks with real, non-negative prices, or a ProviderError")
@FUZZ
@given(rows=ec2_rows())
@example(rows=[{"InstanceType": "p3.2xlarge", "Timestamp": datetime(2024, 1, 1, tzinfo=timezone.utc),
                "SpotPrice": "nan", "AvailabilityZone": "us-east-1a"}])
@example(rows=[{"InstanceType": "p3.2xlarge", "Timestamp": datetime(2024, 1, 1, tzinfo=timezone.utc),
                "SpotPrice": "abc", "AvailabilityZone": "us-east-1a"}])
def test_ec2_price_history_rows_become_real_prices_or_an_error(rows):
    from orbit_dagster.providers.aws.ec2_catalog import AwsCatalog

    catalog = AwsCatalog(Ec2Stub(rows), prices_are_real=True)
    try:
        ticks = catalog.price_feed(since=datetime(2008, 1, 1, tzinfo=timezone.utc))
    except OrbitError:
        return
    assert all(real(t.usd_per_hour_spot) and t.usd_per_hour_spot >= 0 for t in ticks), ticks
    for offer in catalog.list_offers():
        assert offer.usd_per_gpu_second_spot is None or (real(offer.usd_per_gpu_second_spot)
                                                          and offer.usd_per_gpu_second_spot >= 0)


# ---- evaluation outputs -----------------------------------------------------------------------

json_leaf = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=10),
                      st.sampled_from([math.nan, math.inf, -math.inf, HUGE]))
json_values = st.recursive(json_leaf, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                             st.dictionaries(st.text(max_size=8), kids, max_size=3)),
                           max_leaves=8)
metric_maps = st.one_of(st.dictionaries(st.one_of(st.text(max_size=12), st.just("x" * 300)), json_leaf, max_size=5),
                        json_values)


def check_metrics(reported, out: dict) -> None:
    assert out and all(isinstance(k, str) and 0 < len(k) <= 200 and real(v) for k, v in out.items())
    assert out == {k: float(v) for k, v in reported.items()}  # exactly what was reported, as floats


@pytest.mark.fault("hypothesis: evaluation outputs given to valid_metrics (the control plane's check)",
                   expect="finite metrics exactly as reported, or OrbitError naming the metric")
@FUZZ
@given(metrics=metric_maps)
@example(metrics={"eval/loss": HUGE})
def test_valid_metrics_accepts_real_numbers_only(metrics):
    try:
        out = valid_metrics(metrics)
    except OrbitError as exc:
        assert exc.field and "fix:" in str(exc)
        return
    check_metrics(metrics, out)


@pytest.mark.fault("hypothesis: what an eval script returns, through the agent's eval path (RunContext.report_eval, "
                   "the events file) to the control plane's reading and check",
                   expect="the agent fails as user_error, or the control plane gets finite metrics or refuses")
@SLOW_FUZZ
@given(result=st.one_of(st.fixed_dictionaries({"metrics": metric_maps}), metric_maps))
def test_the_agents_eval_path_reports_real_metrics_or_fails_as_a_user_error(tmp_path_factory, result):
    from orbit_dagster.providers.common import read_event_file
    from orbit_dagster.runtime.agent import FAILURE_CLASS, classify_exception
    from orbit_dagster.runtime.events import EventWriter
    from orbit_dagster.runtime.notices import NoticeWatcher
    from orbit_dagster.runtime.sdk import RunContext

    work = tmp_path_factory.mktemp("eval")
    ctx = RunContext(job={"job_id": "j", "template_snapshot": {}}, bundle_dir=work, workdir=work, attempt=1,
                     events=EventWriter(work / "events.jsonl"), store=None, watcher=NoticeWatcher(None),
                     checkpoint_every=1, memory_every=1)
    try:  # what runtime/agent.py::run does with the eval entrypoint's return value
        if isinstance(result, dict):
            ctx.report_eval(result.get("metrics", result))
    except BaseException as exc:  # noqa: BLE001 - the agent classifies every failure
        assert FAILURE_CLASS[classify_exception(exc)[0]] == "user_error"
        return
    from orbit_dagster.core.host_contract import Evaluation

    events, _ = read_event_file(work / "events.jsonl", 0)
    reported = next((e.metrics for e in reversed(events) if isinstance(e, Evaluation)), None)
    try:  # what control/eval_host.py (its recorder of `evaluation` records) does with it
        out = valid_metrics(reported)
    except OrbitError:
        return
    assert out and all(real(v) for v in out.values())


# ---- the event lines a host writes -------------------------------------------------------------

event_kinds = st.sampled_from(["metrics", "progress", "checkpoint", "exit", "started", "notice", "evaluation", None, 3])
host_events = st.lists(st.dictionaries(
    st.sampled_from(["type", "step", "values", "ts", "attempt", "uri", "sha256", "bytes", "train_loss"]),
    st.one_of(json_leaf, st.dictionaries(st.text(max_size=6), json_leaf, max_size=3)), max_size=6).flatmap(
        lambda d: st.builds(lambda k: {**d, "type": k}, event_kinds)), max_size=4)


@pytest.mark.fault("hypothesis: event lines a rented host writes (metrics, progress, checkpoints) read by the "
                   "run that follows the attempt",
                   expect="bad lines are refused by the host contract and recorded; the run never dies of them; "
                          "no NaN stored")
@SLOW_FUZZ
@given(events=host_events)
@example(events=[{"type": "metrics", "step": "x", "values": {"train/loss": 1.0}}])
@example(events=[{"type": "metrics", "step": 1, "values": {"train/loss": math.nan}}])
@example(events=[{"type": "metrics", "step": HUGE, "values": {"train/loss": 1.0}}])
def test_host_event_lines_never_kill_the_run_following_the_attempt(tmp_path_factory, events):
    from orbit_dagster.control.attempt import AttemptMonitor
    from orbit_dagster.control.context import NullReporter
    from orbit_dagster.core.host_contract import read_chunk
    from orbit_dagster.settings import Settings

    class Host:  # the provider's side is not under test: the files are where the events say
        def localize_checkpoint(self, handle, ev, store_uri):
            return ev

    class Handle:
        nodes = ()  # a single instance (a group's other nodes: RunHandle.nodes)

        class instance:
            instance_id = "sim-fuzz"

        @property
        def members(self):
            return (self,)

    home = tmp_path_factory.mktemp("events") / "orbit-home"
    settings = Settings.from_env(home)
    ledger = settings.ledger()
    monitor = AttemptMonitor(settings, ledger, Host(), Handle(), NullReporter(), job_id="job-fuzz", run_id="job-fuzz#1",
                             store_uri=settings.store_uri, lineage="L1-fuzz", experiment="fuzz", eval_suite=None)
    try:
        # The lines as a host writes them, through the reader every provider uses.
        chunk = "".join(json.dumps(e) + "\n" for e in events).encode()
        entries, offset = read_chunk(chunk, 0)
        assert offset == len(chunk) and len(entries) == len(events)
        monitor._on_events(entries)
        monitor.flush_metrics()
    except OrbitError:
        pass
    values = [r["value"] for r in ledger.rows("SELECT value FROM metric_points")]
    assert all(real(v) for v in values), values
    ledger.dispose()
