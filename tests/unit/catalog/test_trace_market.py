"""What each trace replays: its instance type, gang size, prices and cloud notice."""
from __future__ import annotations

import json

import pytest

from orbit_dagster.catalog.trace_market import CLOUD_NOTICE_S, parse_trace_name, trace_market
from orbit_dagster.catalog.traces import Trace, load_trace, record_name_convention
from orbit_dagster.core.errors import OrbitError


def _trace(name, data=(1, 1, 0, 1), prices=None, metadata=None) -> Trace:
    """A trace of the shared data set (its name convention recorded, as loading it there does)."""
    kind = "multinode" if max(data) > 1 else ("preemption" if prices else "availability")
    return record_name_convention(Trace(name=name, gap_seconds=60.0, data=tuple(data), prices=prices, kind=kind,
                                        metadata=metadata or {}))


def _market(t: Trace, cloud: str | None = None):
    return trace_market(t, default_spot_usd_per_hour=0.5, default_on_demand_usd_per_hour=2.0, cloud=cloud)


@pytest.mark.parametrize("name, cloud, itype, nodes", [
    ("aws-2023-04-22_us-east-1c_v100_1", "aws", "p3.2xlarge", None),
    ("aws-2022-10-26_us-west-2a_v100_8", "aws", "p3.16xlarge", None),
    ("aws-2022-10-26_us-west-2b_k80_1", "aws", "p2.xlarge", None),
    ("aws-2023-04-19_us-east-1b_intel_64", "aws", "r5.16xlarge", None),
    ("gcp-2023-04-30_us-central1-c_c3-88", "gcp", "c3-highcpu-88", None),
    ("aws-2023-08-27_us-west-2a_v100_16node", "aws", "p3.2xlarge", 16),
])
def test_trace_names_say_cloud_instance_and_nodes(name, cloud, itype, nodes):
    info = parse_trace_name(name)
    assert (info["cloud"], info["instance_type"], info["nodes"]) == (cloud, itype, nodes)
    assert parse_trace_name("synthetic-seed3") is None


def test_each_cloud_gets_its_own_notice_and_prices():
    gcp = _market(_trace("gcp-2023-04-30_us-east1-b_c3-88"))
    assert gcp.notice_s == CLOUD_NOTICE_S["gcp"] == 30.0 and gcp.region == "us-east1"
    assert gcp.spot_usd_per_hour == pytest.approx(0.344256) and gcp.on_demand_usd_per_hour == pytest.approx(3.792096)
    r5 = _market(_trace("aws-2023-04-19_us-east-1b_intel_64"))
    assert r5.notice_s == 120.0 and r5.on_demand_usd_per_hour == 4.032
    assert r5.spot_usd_per_hour == pytest.approx(4.032 * 0.24)  # the advisor's 76% savings in us-east-1
    p3 = _market(_trace("aws-2023-02-15_us-east-1a_v100_1"))
    # nearest advisor snapshot to Feb 2023 is Feb 2021: 70% savings on the 3.06 $/h list price
    assert p3.spot_usd_per_hour == pytest.approx(0.918) and p3.band == 4
    v8 = _market(_trace("aws-2022-10-26_us-west-2a_v100_8"))
    assert v8.gpus_per_node == 8 and v8.on_demand_usd_per_hour == 24.48


def test_a_multi_node_trace_is_a_gang_of_all_its_nodes():
    m = _market(_trace("aws-2023-08-27_us-west-2a_v100_16node", data=(16, 15, 16, 0)))
    assert m.nodes == 16 and m.gpus == 16
    # unnamed multi-node traces: the largest count seen
    assert _market(_trace("x", data=(4, 3, 4, 0)), cloud="aws").nodes == 4
    assert _market(_trace("x", data=(4, 3), metadata={"nodes": 2}), cloud="aws").nodes == 2
    with pytest.raises(OrbitError) as err:
        _market(_trace("x", metadata={"nodes": 0}), cloud="aws")
    assert err.value.field == "metadata.nodes"


def test_unknown_traces_are_replayed_with_labelled_assumptions():
    m = _market(_trace("synthetic-seed1", prices=(0.7, 0.7, 0.7, 0.7), metadata={"cloud": "aws"}))
    assert m.cloud == "aws" and m.notice_s == 120.0 and m.sources["cloud"] == "the trace's metadata.cloud"
    assert "assumed" in m.sources["on_demand"] and m.sources["spot"] == "the trace's own prices field"
    assert m.spot_from_trace and m.spot_price(_trace("s", prices=(0.7, 0.8, 0.7, 0.7)), 1) == 0.8


def test_metadata_from_the_file_overrides_the_name(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 30, "cloud": "gcp", "instance_type": "c3-highcpu-88",
                                          "nodes": 2, "ignored": 1}, "data": [2, 2, 1, 2]}))
    t = load_trace(p)
    assert t.metadata == {"cloud": "gcp", "instance_type": "c3-highcpu-88", "nodes": 2, "dataset": tmp_path.name}
    m = _market(t)
    assert (m.cloud, m.notice_s, m.nodes, m.instance_type) == ("gcp", 30.0, 2, "c3-highcpu-88")
