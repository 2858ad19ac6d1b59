from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from orbit_dagster.catalog.fit_reclaims import (
    TRAINING_COLLECTIONS,
    collection,
    fit_from_dir,
    main,
    parse_trace_name,
    split_traces,
)
from orbit_dagster.catalog.reclaim_model import (
    ReclaimModel,
    band_code,
    fit_reclaim_model,
    generate_trace,
    load_reclaim_model,
    trace_stats,
    weibull_shape_mle,
)
from orbit_dagster.catalog.traces import load_traces
from orbit_dagster.core.errors import OrbitError

from .helpers import model


def test_shipped_model_is_what_the_fitting_code_produces(shared_data):
    """The JSON in the package is reproducible from the data by the repo's code, not hand-edited."""
    shipped = Path(__file__).resolve().parents[3] / "orbit_dagster" / "data" / "reclaim_model.json"
    assert fit_from_dir(shared_data).to_json() == shipped.read_text()


def test_the_leave_out_split_is_really_left_out(shared_data):
    """Fails if an evaluation trace was used to fit the shipped model (or the split leaks)."""
    train, evaluation = split_traces(load_traces(shared_data))
    shipped = load_reclaim_model()
    assert {t.name for t in train} == set(shipped.fitted_from) and len(train) == 4
    assert {collection(t) for t in train} == set(TRAINING_COLLECTIONS)
    # whole collections on each side: no source and date both trained on and held out
    assert evaluation and not ({collection(t) for t in evaluation} & set(TRAINING_COLLECTIONS))
    assert not ({t.name for t in evaluation} & set(shipped.fitted_from))
    assert not ({t.name for t in evaluation} & {p["name"] for p in shipped.per_trace})
    # the bench refuses to report on a trace the model was fitted on
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_policies", Path(__file__).resolve().parents[3] / "bench" / "policies.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    leaky = ReclaimModel.from_dict({**json.loads(shipped.to_json()), "fitted_from": [evaluation[0].name]})
    bench.load_reclaim_model = lambda: leaky
    with pytest.raises(SystemExit, match="fitted on evaluation traces"):
        bench.run(shared_data, 1, True, log=lambda s: None)


def test_the_split_is_by_source_and_date_and_holds_out_what_it_cannot_place(tmp_path):
    """A trace trains the model only when its collection (source and start date) is a training
    one: the same zone collected on another day, another source, or no date at all is held out."""
    (tmp_path / "SOURCES.md").write_text("test data set\n")
    day = TRAINING_COLLECTIONS[0][1].isoformat()
    names = {"availability": [f"aws-{day}_us-east-1a_v100_1", "aws-2024-01-01_us-east-1a_v100_1"],
             "preemption": [f"aws-{day}_us-west-2b_v100_1"], "other": ["undated"]}
    for folder, files in names.items():
        (tmp_path / "traces" / folder).mkdir(parents=True)
        for name in files:
            meta = {"gap_seconds": 60, **({"cloud": "aws"} if name == "undated" else {})}
            (tmp_path / "traces" / folder / f"{name}.json").write_text(json.dumps({"metadata": meta, "data": [1, 0, 1]}))
    train, held = split_traces(load_traces(tmp_path))
    assert [t.name for t in train] == [f"aws-{day}_us-east-1a_v100_1"]
    assert sorted(t.name for t in held) == sorted(["aws-2024-01-01_us-east-1a_v100_1", f"aws-{day}_us-west-2b_v100_1",
                                                   "undated"])


def test_fit_cli_writes_a_loadable_model(shared_data, tmp_path):
    out = tmp_path / "m.json"
    assert main([str(shared_data), "--out", str(out)]) == 0
    m = ReclaimModel.from_dict(json.loads(out.read_text()))
    assert m.fitted_from and all("/" not in n for n in m.fitted_from)
    # calibrated band = the traces' mean rate; the others keep the nominal ratios
    rates = [p["rate_per_hour"] for p in m.per_trace]
    assert m.band_rates_per_hour["4"] == pytest.approx(np.mean(rates), rel=1e-4)
    assert m.band_rates_per_hour["0"] < m.band_rates_per_hour["2"] < m.band_rates_per_hour["4"]


def test_fit_cli_reports_a_bad_directory(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no training trace" in err and "fix:" in err


def test_weibull_mle_recovers_the_shape():
    rng = np.random.default_rng(7)
    for k in (0.5, 1.0, 2.0):
        x = rng.weibull(k, 4000) * 1234.0
        assert weibull_shape_mle(x) == pytest.approx(k, rel=0.06)


def test_generator_is_deterministic_per_seed_and_varies_across_seeds():
    m = model()
    a = generate_trace(m, 3, 86400 * 3, 60)
    assert a == generate_trace(m, 3, 86400 * 3, 60)
    assert a.data != generate_trace(m, 4, 86400 * 3, 60).data
    assert len(a.data) == 86400 * 3 // 60 and set(a.data) <= {0, 1}


def test_fit_on_generated_traces_recovers_the_generators_shapes():
    """Fit and generator agree: traces drawn from a model fit back to (about) that model."""
    m = model(up_shape=0.6, down_shape=0.9)
    traces = [generate_trace(m, s, 86400 * 20, 30) for s in range(12)]
    back = fit_reclaim_model(traces, on_demand_usd_per_hour=3.0)
    assert back.up_shape == pytest.approx(0.6, abs=0.12)
    assert back.down_shape == pytest.approx(0.9, abs=0.18)


def test_trace_stats_counts_edges():
    from .helpers import make_trace
    s = trace_stats(make_trace([1, 1, 0, 1, 0, 0, 1, 1, 1, 0], gap=10))
    assert s["reclaims"] == 3 and s["up_hours"] == pytest.approx(60 / 3600, abs=1e-4)
    assert s["mean_up_s"] == 20  # inner runs only (1 and 3 ticks): the first and last are censored
    assert s["mean_down_s"] == pytest.approx(15)


def test_band_codes_and_labels():
    assert band_code(">20%") == 4 and band_code("<5%") == 0 and band_code(2) == 2 and band_code("3") == 3
    with pytest.raises(OrbitError, match="band"):
        band_code("often")


def test_fit_needs_a_reclaim():
    from .helpers import make_trace
    with pytest.raises(OrbitError, match="reclaim"):
        fit_reclaim_model([make_trace([1, 1, 1])], on_demand_usd_per_hour=3.0)


def test_trace_names_parse():
    assert parse_trace_name("aws-2023-04-22_us-east-1c_v100_1")[1:] == ("us-east-1", "p3.2xlarge")
    assert parse_trace_name("whatever") is None


def test_shipped_model_loads():
    m = load_reclaim_model()
    assert 0 < m.up_shape and m.on_demand_usd_per_hour > m.spot_usd_per_hour > 0
    assert math.isfinite(m.prior_up_mean_s) and math.isfinite(m.prior_down_mean_s)
