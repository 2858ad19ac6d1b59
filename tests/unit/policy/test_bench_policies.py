"""bench/policies.py: the split by collection, the model checked to be the training split's fit,
the held-out report per cloud and node count, and `--record` rewriting only its section."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_policies_report", REPO / "bench" / "policies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(bench, tmp_path_factory):
    from tests.conftest import shared_data_dir  # (a fixture cannot be module-scoped from a function one)

    data = shared_data_dir()
    if data is None:
        pytest.skip("needs the shared public data set (../shared/data or $ORBIT_SHARED_DATA); absent on this machine")
    body, raw = bench.run(data, 1, False, log=lambda s: None, smoke=True)
    return data, body, raw


def test_the_smoke_report_is_held_out_grouped_and_plain_about_losses(smoke):
    _, body, raw = smoke
    assert "--smoke" in body.splitlines()[0] and "Split `by-collection`" in body
    assert set(raw["evaluation"]).isdisjoint(raw["training"]) and set(raw["training"]) == set(
        load_reclaim_model().fitted_from)
    groups = {tuple(c["group"]) for c in raw["by_group"]}
    assert groups == {("aws", 1), ("aws", 16)}  # the held-out traces here: 1-node and 16-node AWS
    assert "| AWS, 1 node |" in body and "| AWS, 16 nodes |" in body
    assert "No held-out trace of GCP here" in body
    # the worst (trace, cell) is named, with its ratio, and it is the largest in the grid
    worst = max(r["res"]["results"][-1]["overhead_gpu_hours"] / next(
        x for x in r["res"]["results"] if x["policy"] == "hindsight")["overhead_gpu_hours"] for r in raw["checkpoint"])
    line = next(s for s in body.splitlines() if s.startswith("Worst cell: "))
    assert f"{worst:.3f} x" in line
    # every cell where orbit is above 1.05 x hindsight or above a baseline is listed
    losing = [c for c in raw["by_group"] if c["mean"]["orbit"] > 1.05 or not c["beats_baselines"]]
    listed = [s for s in body.split("Where orbit loses")[1].split("Issue 19's goals")[0].splitlines()
              if s.startswith("- ")]
    assert len(listed) == len(losing) or (not losing and "none" in listed[0])
    assert sum("met" in s or "missed" in s for s in body.split("Issue 19's goals")[1].splitlines()[:6]) == 4


def test_the_bench_refuses_a_shipped_model_that_is_not_the_training_fit(bench, smoke, monkeypatch):
    data = smoke[0]
    shipped = load_reclaim_model()
    other = ReclaimModel.from_dict({**json.loads(shipped.to_json()), "up_shape": shipped.up_shape * 1.1})
    monkeypatch.setattr(bench, "load_reclaim_model", lambda: other)
    with pytest.raises(SystemExit, match="not the fit of this data set's training split"):
        bench.run(data, 1, False, log=lambda s: None, smoke=True)


def test_record_rewrites_only_its_section(bench, tmp_path, capsys, monkeypatch):
    body, raw = "Command: `python bench/policies.py --record docs/benchmarks.md`\n\n| a |\n|---|\n| 1 |", {}
    (tmp_path / "data" / "traces").mkdir(parents=True)
    data = tmp_path / "data"
    doc = tmp_path / "benchmarks.md"
    orig = (f"# Benchmarks\n\n## Before\n\nkept\n\n{bench.BEGIN}\n## Policies (bench/policies.py)\n\nold\n"
            f"{bench.END}\n\n## After\n\nkept too\n")
    doc.write_text(orig)
    bench.write_section(doc, body)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Before\n\nkept\n\n") and text.endswith("\n\n## After\n\nkept too\n")
    assert "old" not in text and text.count(bench.BEGIN) == text.count(bench.END) == 1
    assert text.split(bench.BEGIN)[1].split(bench.END)[0] == f"\n## Policies (bench/policies.py)\n\n{body}\n"
    bench.write_section(doc, body)  # again: the same file
    assert doc.read_text() == text
    # a smoke run is never recorded
    monkeypatch.setattr(bench, "run", lambda *a, **kw: (body, raw))  # (main's choice, not the replays again)
    capsys.readouterr()
    doc.write_text(orig)
    assert bench.main([str(data), "--smoke", "--record", str(doc)]) == 0
    assert doc.read_text() == orig and "only prints" in capsys.readouterr().err
    assert bench.main([str(data), "--starts", "1", "--record", str(doc)]) == 0  # a full run is
    assert doc.read_text() == text
