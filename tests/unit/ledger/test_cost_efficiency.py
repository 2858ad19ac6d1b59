"""`cost_efficiency` (the DuckDB face) and `orbit cost --by provider`: per provider, offer and GPU model,
what was paid, wasted and recovered, and what it bought in effective compute; the rows sum to the bill."""
import json
import math

import pytest

from orbit_dagster.core.errors import NotFound
from orbit_dagster.ledger import queries as Q
from orbit_dagster.settings import Settings
from tests.cost_ledger import History, offer
from tests.helpers import run_cli

A = offer("sim:g2-standard-4:us-central1", usd_per_gpu_hour=0.30, spec=121.0)
B = offer("aws:g5.xlarge:use1-az1", usd_per_gpu_hour=0.40, gpu="A10G", spec=None, instance_type="g5.xlarge")
C = offer("ssh:box1:", usd_per_gpu_hour=1.00, gpu="RTX-4090", spec=None, spot=False, instance_type="box1")
D = offer("aws:p3.8xlarge:use1-az2", usd_per_gpu_hour=0.90, gpu="V100", gpu_count=4, spec=125.0, measured=100.0,
          instance_type="p3.8xlarge")


@pytest.fixture
def history(orbit_home):
    settings = Settings.from_env(orbit_home)
    h = History(settings.ledger())
    # j1 on A: reclaimed after checkpoints at 1000 s and 2000 s, progress until 3000 s (1000 s
    # wasted, 600 s of overhead), then resumed on a second instance (restored by 4300 s).
    h.attempt("j1", A, start=0, stop=3600, checkpoints=[1000, 2000], lost=True, last_progress=3000)
    h.attempt("j1", A, start=4000, stop=7000, checkpoints=[5000, 7000], resumed_at=4300, attempt=2)
    # j2 on B: no catalog figure, but the probe measured its GPU; j3 on C: only a CPU probe.
    h.attempt("j2", B, start=0, stop=1800, checkpoints=[900, 1800], probe=(70.0, "cuda"))
    h.attempt("j3", C, start=0, stop=600, checkpoints=[600], probe=(0.2, "cpu"))
    # j4 on D: 4 GPUs, an earlier probe's figure in the catalog (100) over the spec (125).
    h.attempt("j4", D, start=0, stop=3600, checkpoints=[3600])
    # Still running: not billed yet, so in no row.
    h.ledger.commit({"instances": [{"instance_id": "i-running", "provider": "sim", "offer_id": A.offer_id,
                                    "gpu": "L4", "gpu_count": 1, "usd_per_second": A.usd_per_second, "spot": 1,
                                    "purpose": "train", "job_id": "j1", "started_at": 1.0}]})
    return h


def rows_by_offer(frame) -> dict[str, dict]:
    return {r["offer_id"]: r for r in frame.to_dict("records")}


def test_each_offer_row_from_its_instances_and_the_rows_sum_to_the_bill(history):
    ledger = history.ledger
    frame = Q.cost_efficiency(ledger)
    rows = rows_by_offer(frame)
    assert set(rows) == {A.offer_id, B.offer_id, C.offer_id, D.offer_id}
    price = A.usd_per_second
    a = rows[A.offer_id]
    assert a["provider"] == "sim" and a["gpu"] == "L4" and a["instances"] == 2
    assert a["instance_hours"] == pytest.approx(6600 / 3600)
    assert a["usd"] == pytest.approx(6600 * price)
    assert a["wasted_usd"] == pytest.approx(1000 * price)
    # Useful: the checkpoint lines (2000 s + 3000 s) less the resumed attempt's 300 s restore.
    assert a["useful_gpu_hours"] == pytest.approx(4700 / 3600)
    assert a["tflops_source"] == "catalog spec" and a["tflops_per_gpu"] == pytest.approx(121.0)
    assert a["effective_tflop_hours"] == pytest.approx(4700 / 3600 * 121.0)
    assert a["usd_per_effective_tflop_hour"] == pytest.approx(6600 * price / (4700 / 3600 * 121.0))
    assert a["interruptions"] == 1 and a["interruptions_per_hour"] == pytest.approx(1 / (6600 / 3600))
    assert a["recovery_usd"] == pytest.approx((1000 + 300) * price)
    assert a["recovery_share"] == pytest.approx(1300 / 6600)
    b = rows[B.offer_id]
    assert b["tflops_source"] == "probe" and b["effective_tflop_hours"] == pytest.approx(0.5 * 70.0)
    assert b["interruptions"] == 0 and b["recovery_usd"] == 0
    c = rows[C.offer_id]  # a CPU probe never stands for a GPU: no figure, no $ per TFLOP-hour
    assert c["tflops_source"] == "unknown"
    assert c["usd_per_effective_tflop_hour"] is None or math.isnan(c["usd_per_effective_tflop_hour"])
    d = rows[D.offer_id]
    assert d["gpu_hours"] == pytest.approx(4.0) and d["tflops_source"] == "catalog measured"
    assert d["effective_tflop_hours"] == pytest.approx(4 * 100.0)
    assert d["usd"] == pytest.approx(3600 * D.usd_per_second)
    # Cheapest effective compute first; the unknown last.
    assert list(frame["offer_id"])[-1] == C.offer_id
    known = [r for r in frame.to_dict("records") if r["offer_id"] != C.offer_id]
    assert [r["usd_per_effective_tflop_hour"] for r in known] == sorted(r["usd_per_effective_tflop_hour"]
                                                                        for r in known)
    assert float(frame["usd"].sum()) == pytest.approx(Q.billed_usd(ledger), rel=1e-12)
    assert float(frame["wasted_usd"].sum()) == pytest.approx(float(Q.cost_table(ledger, "job")["wasted_usd"].sum()))


def test_filtered_by_job_or_experiment_it_sums_to_that_bill(history):
    ledger = history.ledger
    one = Q.cost_table(ledger, "provider", job="j1")
    assert list(one["offer_id"]) == [A.offer_id]
    assert float(one["usd"].sum()) == pytest.approx(Q.billed_usd(ledger, job="j1"))
    exp = Q.cost_table(ledger, "provider", experiment="exp")
    assert float(exp["usd"].sum()) == pytest.approx(Q.billed_usd(ledger, experiment="exp"))
    with pytest.raises(NotFound, match="no job_id 'nope'"):
        Q.cost_table(ledger, "provider", job="nope")


def test_the_view_is_in_the_read_only_sql_face(history):
    frame = Q.sql(history.ledger, "SELECT offer_id, usd FROM cost_efficiency ORDER BY offer_id")
    assert list(frame["offer_id"]) == sorted([A.offer_id, B.offer_id, C.offer_id, D.offer_id])
    per_instance = Q.sql(history.ledger, "SELECT count(*) AS n FROM cost_efficiency_instances")
    assert int(per_instance["n"][0]) == 5  # the running instance is not billed yet


def test_orbit_cost_by_provider_prints_the_rows_and_the_bill(history):
    code, out, err = run_cli(["cost", "--by", "provider"])
    assert code == 0, err
    assert "usd_per_effective_tflop_hour" in out and A.offer_id in out
    billed = Q.billed_usd(history.ledger)
    assert f"= billed ${billed:.6f}" in out and "1 instance(s) still running" in out
    code, out, err = run_cli(["cost", "--by", "provider", "--json"])
    assert code == 0, err
    assert sum(r["usd"] for r in json.loads(out)) == pytest.approx(billed)


def test_the_cost_efficiency_asset_reports_the_table_a_plot_and_a_passing_check(history):
    import dagster as dg

    from orbit_dagster.definitions import defs

    with dg.DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("cost_insight_job").execute_in_process(instance=instance)
        assert result.success
        [mat] = result.asset_materializations_for_node("cost_efficiency")
        meta = mat.metadata
        assert meta["offers"].value == 4
        assert meta["billed_usd"].value == pytest.approx(Q.billed_usd(history.ledger))
        rows = meta["by_offer"].records
        assert {r.data["offer_id"] for r in rows} == {A.offer_id, B.offer_id, C.offer_id, D.offer_id}
        assert "data:image/svg+xml;base64," in meta["usd_per_effective_tflop_hour"].value
        [check] = result.get_asset_check_evaluations()
        assert check.check_name == "efficiency_equals_bill" and check.passed
