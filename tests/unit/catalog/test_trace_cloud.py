"""A trace's cloud (and so its reclaim notice) is explicit: metadata.cloud or `--cloud`, never
guessed from a file name, except the shared data set's documented names, recorded at load."""
from __future__ import annotations

import json

import pytest

from orbit_dagster.catalog.traces import NAME_CONVENTION, TraceFormatError, load_trace, load_traces
from orbit_dagster.core.errors import OrbitError
from tests.helpers import run_cli

BITS = ([1] * 50 + [0] * 5) * 8  # 60 s ticks: up 50 min, down 5, eight times


def _write(path, **meta):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60, **meta}, "data": BITS}))
    return path


def _simulate(path, *extra):
    code, out, err = run_cli(["simulate", "--trace", str(path), "--job-hours", "2", "--starts", "2",
                              "--policy", "notice-only", "--json", *extra])
    return code, (json.loads(out) if code == 0 else None), err


def test_a_gcp_trace_with_any_name_replays_with_gcps_30_s_notice(tmp_path):
    code, res, err = _simulate(_write(tmp_path / "foo.json", cloud="gcp"))
    assert code == 0, err
    assert res["notice_seconds"] == 30.0 and res["market"]["cloud"] == "gcp"
    assert res["assumptions"]["notice"] == "GCP's reclaim notice"


def test_a_trace_without_a_cloud_is_refused_naming_the_flag_and_the_field(tmp_path):
    code, res, err = _simulate(_write(tmp_path / "foo.json"))
    assert code == 2 and res is None
    line = err.strip()
    assert "\n" not in line and "cloud" in line and "--cloud" in line and "metadata" in line, err


def test_a_cloud_is_never_guessed_from_the_name_of_an_arbitrary_file(tmp_path):
    # named like the shared data set, but not inside it: the name says nothing
    p = _write(tmp_path / "elsewhere" / "aws-2023-04-22_us-east-1c_v100_1.json")
    assert "cloud" not in load_trace(p).metadata
    code, _, err = _simulate(p)
    assert code == 2 and "--cloud" in err


def test_the_cloud_flag_gives_or_overrides_the_cloud(tmp_path):
    code, res, err = _simulate(_write(tmp_path / "foo.json"), "--cloud", "gcp")
    assert code == 0, err
    assert res["notice_seconds"] == 30.0 and res["market"]["sources"]["cloud"] == "given"
    code, res, err = _simulate(_write(tmp_path / "bar.json", cloud="gcp"), "--cloud", "aws")
    assert code == 0 and res["notice_seconds"] == 120.0 and res["market"]["cloud"] == "aws"
    code, res, err = _simulate(_write(tmp_path / "baz.json", cloud="gcp"), "--notice-seconds", "45")
    assert code == 0 and res["notice_seconds"] == 45.0 and res["assumptions"]["notice"] == "given"
    code, _, err = _simulate(_write(tmp_path / "qux.json", cloud="gcp"), "--cloud", "azure")
    assert code == 2 and "--cloud" in err


@pytest.mark.parametrize("meta, field", [({"cloud": "azure"}, "metadata.cloud"), ({"cloud": 3}, "metadata.cloud"),
                                         ({"cloud": "aws", "date": "2023-13-01"}, "metadata.date"),
                                         ({"cloud": "aws", "date": 20230101}, "metadata.date")])
def test_a_bad_cloud_or_date_in_the_metadata_names_the_field_and_the_fix(tmp_path, meta, field):
    p = _write(tmp_path / "foo.json", **meta)
    with pytest.raises(TraceFormatError) as err:
        load_trace(p)
    assert err.value.field == field and str(p) in str(err.value) and "fix:" in str(err.value)
    code, _, stderr = _simulate(p)
    assert code == 2 and field in stderr


def test_the_shared_data_sets_names_are_recorded_at_load_as_its_convention(tmp_path):
    """Inside a data set laid out as the shared one (SOURCES.md beside traces/), a file's name
    gives its cloud and day, and the trace records that it came from the name."""
    (tmp_path / "SOURCES.md").write_text("names: <cloud>-<YYYY-MM-DD>_<zone>_<tag>\n")
    gcp = _write(tmp_path / "traces" / "availability" / "gcp-2023-04-30_us-east1-b_c3-88.json")
    aws = _write(tmp_path / "traces" / "preemption" / "aws-2023-04-22_us-east-1c_v100_1.json")
    mine = _write(tmp_path / "traces" / "preemption" / "aws-2023-04-22_us-west-2b_v100_1.json", cloud="gcp")
    other = _write(tmp_path / "traces" / "preemption" / "my-own.json")
    by = {t.name: t for t in load_traces(tmp_path)}
    g = by[gcp.stem].metadata
    assert (g["cloud"], g["date"], g["dataset"], g["cloud_from"]) == ("gcp", "2023-04-30", "availability",
                                                                      NAME_CONVENTION)
    assert by[aws.stem].metadata["cloud"] == "aws"
    assert by[mine.stem].metadata["cloud"] == "gcp" and "cloud_from" not in by[mine.stem].metadata  # explicit wins
    assert "cloud" not in by[other.stem].metadata
    code, res, err = _simulate(gcp)
    assert code == 0 and res["notice_seconds"] == 30.0, err
    assert "SOURCES.md" in res["market"]["sources"]["cloud"]
    with pytest.raises(OrbitError) as refused:
        from orbit_dagster.policy.compare import simulate_trace
        simulate_trace(by[other.stem], job_hours=1, starts=1)
    assert refused.value.field == "cloud"
