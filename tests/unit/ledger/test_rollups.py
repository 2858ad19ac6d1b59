"""The totals the ledger keeps on write agree with its facts: best checkpoint and cost views."""
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbit_dagster.control.best import rank_best
from orbit_dagster.core.metrics import Candidate, pick_best
from orbit_dagster.ledger import Ledger
from orbit_dagster.ledger.migrations import LATEST, upgrade_schema

# The cost views as they were: grouping every cost line on each call.
GROUPED_BY_JOB = """
    SELECT c.job_id, coalesce(sum(c.usd), 0) AS usd,
           coalesce(sum(CASE WHEN c.kind = 'wasted' THEN c.usd END), 0) AS wasted_usd,
           coalesce(sum(CASE WHEN c.kind = 'overhead' THEN c.usd END), 0) AS overhead_usd,
           coalesce(sum(CASE WHEN c.kind = 'wasted' THEN c.seconds * c.gpu_count END), 0) AS wasted_gpu_seconds,
           count(DISTINCT CASE WHEN c.kind <> 'eval' THEN c.attempt END) AS attempts
    FROM costs c GROUP BY c.job_id ORDER BY c.job_id"""
GROUPED_BY_LINE = """
    SELECT c.job_id, coalesce(c.checkpoint_key, '(' || c.kind || ')') AS line, coalesce(sum(c.usd), 0) AS usd
    FROM costs c GROUP BY c.job_id, coalesce(c.checkpoint_key, '(' || c.kind || ')') ORDER BY 1, 2"""

VALUES = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.5, 0.5, 1.0]))  # ties are common in practice
CHECKPOINT = st.fixed_dictionaries({
    "job": st.sampled_from(["ja", "jb", "jc"]), "step": st.integers(1, 6), "old_lineage": st.booleans(),
    "deleted": st.booleans(), "train_loss": VALUES,
    "evals": st.lists(st.tuples(st.integers(0, 3), VALUES), max_size=3),  # (ts, value) points
})


def fresh(tmp_path) -> Ledger:
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    upgrade_schema(ledger)
    return ledger


def finite(v):
    return v is not None and math.isfinite(v)


def write(ledger: Ledger, checkpoints: list[dict]) -> dict[str, dict]:
    """Jobs ja/jb/jc in experiment e (current lineage L-<job>); returns the facts by key."""
    jobs = [{"job_id": j, "experiment": "e", "project": "p", "lineage": f"L-{j}", "state": "RUNNING", "attempt": 1}
            for j in ("ja", "jb", "jc")]
    rows, points, facts = [], [], {}
    for i, c in enumerate(checkpoints):
        key = f"{c['job']}/a1/step-{c['step']}-{i}"
        lineage = f"old-{c['job']}" if c["old_lineage"] else f"L-{c['job']}"
        rows.append({"checkpoint_key": key, "job_id": c["job"], "experiment": "e", "lineage": lineage,
                     "step": c["step"], "train_loss": c["train_loss"], "deleted_at": 1.0 if c["deleted"] else None})
        for n, (ts, value) in enumerate(c["evals"]):
            points.append({"job_id": c["job"], "experiment": "e", "run_id": f"eval:{key}:{n}", "checkpoint_key": key,
                           "step": c["step"], "name": "eval/loss", "value": value, "source": "eval", "ts": float(ts)})
        facts[key] = dict(c, lineage=lineage)
    ledger.commit({"jobs": jobs, "checkpoints": rows})
    for p in points:  # one evaluation at a time, as they finish
        ledger.commit({"metric_points": [p]})
    return facts


def expected(ledger: Ledger, facts: dict, mode: str, scope: str):
    """pick_best over each candidate's latest point, read from the facts themselves."""
    latest = {}
    for p in ledger.rows("SELECT checkpoint_key, value, ts, id FROM metric_points ORDER BY ts, id"):
        latest[p["checkpoint_key"]] = p["value"]
    cands = [Candidate(k, f["step"], latest.get(k), f["train_loss"]) for k, f in facts.items()
             if not f["deleted"] and (scope == "all" or f["lineage"] == f"L-{f['job']}")]
    return pick_best(cands, mode)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(checkpoints=st.lists(CHECKPOINT, max_size=12), mode=st.sampled_from(["min", "max"]),
       scope=st.sampled_from(["current", "all"]))
def test_best_from_the_kept_latest_values_is_pick_best_over_the_facts(tmp_path_factory, checkpoints, mode, scope):
    ledger = fresh(tmp_path_factory.mktemp("best"))
    facts = write(ledger, checkpoints)
    want = expected(ledger, facts, mode, scope)
    got = rank_best(ledger, "e", "eval/loss", mode, lineage=scope)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert (got.checkpoint_key, got.source, got.candidates) == (want.checkpoint_key, want.source, want.candidates)
        assert math.isclose(got.value, want.value, rel_tol=1e-6)
    ledger.dispose()


def test_a_later_evaluation_replaces_the_kept_value_and_an_older_one_does_not(tmp_path):
    ledger = fresh(tmp_path)
    write(ledger, [{"job": "ja", "step": 1, "old_lineage": False, "deleted": False, "train_loss": None,
                    "evals": [(2, 0.9)]}])
    key = ledger.scalar("SELECT checkpoint_key FROM checkpoints")

    def point(run, ts, value):
        ledger.commit({"metric_points": [{"job_id": "ja", "experiment": "e", "run_id": run, "checkpoint_key": key,
                                          "step": 1, "name": "eval/loss", "value": value, "source": "eval", "ts": ts}]})

    point("r-old", 1.0, 0.1)  # an older evaluation arriving late does not win
    assert ledger.scalar("SELECT value FROM eval_latest") == 0.9
    point("r-new", 3.0, 0.4)
    assert ledger.scalar("SELECT value FROM eval_latest") == 0.4
    point("r-new", 3.0, 0.0)  # the same point again (a re-read event) changes nothing
    assert ledger.rows("SELECT checkpoint_key, value FROM eval_latest") == [{"checkpoint_key": key, "value": 0.4}]


def cost(i, job, kind, usd, *, key=None, attempt=1, seconds=10.0):
    return {"cost_id": f"i{i}", "instance_id": f"inst-{job}-{attempt}", "job_id": job, "attempt": attempt,
            "checkpoint_key": key, "kind": kind, "seconds": seconds, "gpu_count": 2, "usd_per_second": 0.001,
            "usd": usd}


def test_cost_views_read_totals_equal_to_grouping_every_line(tmp_path):
    ledger = fresh(tmp_path)
    ledger.commit({"jobs": [{"job_id": j, "experiment": "e", "project": "p"} for j in ("ja", "jb")]})
    batches = [
        [cost(1, "ja", "overhead", 0.01), cost(2, "ja", "train", 0.02, key="ja/a1/step-1"),
         cost(3, "ja", "wasted", 0.005)],
        [cost(4, "jb", "train", 0.03, key="jb/a1/step-1"), cost(5, "jb", "eval", 0.001, key="jb/a1/step-1")],
        [cost(6, "ja", "train", 0.02, key="ja/a2/step-2", attempt=2), cost(7, "ja", "wasted", 0.004, attempt=2)],
        [cost(6, "ja", "train", 99.0, key="ja/a2/step-2", attempt=2)],  # a retried write: the same line again
    ]
    for batch in batches:  # one instance's bill per transaction, as billing writes them
        ledger.commit({"costs": batch})
        by_job = ledger.rows("SELECT job_id, usd, wasted_usd, overhead_usd, wasted_gpu_seconds, attempts "
                             "FROM cost_by_job ORDER BY job_id")
        assert by_job == ledger.rows(GROUPED_BY_JOB)
        assert ledger.rows("SELECT job_id, line, usd FROM cost_by_checkpoint ORDER BY 1, 2") == ledger.rows(GROUPED_BY_LINE)
    total = ledger.scalar("SELECT sum(usd) FROM costs")
    for view in ("cost_by_job", "cost_by_experiment", "cost_by_checkpoint"):
        assert math.isclose(ledger.scalar(f"SELECT sum(usd) FROM {view}"), total)
    ja = ledger.one("SELECT attempts, wasted_usd FROM cost_by_job WHERE job_id = 'ja'")
    assert ja["attempts"] == 2 and math.isclose(ja["wasted_usd"], 0.009)
    # The DuckDB face shows the same totals.
    assert math.isclose(float(ledger.query("SELECT sum(usd) AS s FROM cost_by_checkpoint")["s"][0]), total)


def test_migration_2_fills_the_totals_from_an_existing_ledgers_facts(tmp_path):
    ledger = fresh(tmp_path)
    ledger.commit({"jobs": [{"job_id": "ja", "experiment": "e", "project": "p", "lineage": "L-ja"}],
                   "checkpoints": [{"checkpoint_key": "ja/1", "job_id": "ja", "experiment": "e", "lineage": "L-ja",
                                    "step": 1}],
                   "costs": [cost(1, "ja", "train", 0.02, key="ja/1"), cost(2, "ja", "overhead", 0.01)],
                   "metric_points": [{"job_id": "ja", "experiment": "e", "run_id": "r", "checkpoint_key": "ja/1",
                                      "step": 1, "name": "eval/loss", "value": 0.3, "source": "eval", "ts": 1.0}]})
    with ledger.write() as tx:  # a ledger at version 1: facts, no totals
        for table in ("cost_lines", "cost_jobs", "eval_latest"):
            tx.execute(f"DELETE FROM {table}")
        tx.execute("DELETE FROM schema_migrations WHERE version >= 2")
    assert upgrade_schema(ledger) == 1 and LATEST >= 2
    assert ledger.scalar("SELECT usd FROM cost_by_job") == 0.03
    assert ledger.scalar("SELECT count(*) FROM cost_by_checkpoint") == 2
    assert rank_best(ledger, "e", "eval/loss", "min").checkpoint_key == "ja/1"


def test_cost_lines_written_before_their_job_get_its_experiment_when_it_arrives(tmp_path):
    ledger = fresh(tmp_path)
    ledger.commit({"costs": [cost(1, "ja", "train", 0.02, key="ja/1")]})
    assert ledger.one("SELECT experiment, usd FROM cost_by_job") == {"experiment": None, "usd": 0.02}
    ledger.commit({"jobs": [{"job_id": "ja", "experiment": "e", "project": "p"}]})
    assert ledger.rows("SELECT experiment, usd FROM cost_by_experiment") == [{"experiment": "e", "usd": 0.02}]
    assert ledger.scalar("SELECT experiment FROM cost_by_checkpoint") == "e"


def test_a_checkpoint_deleted_by_retention_no_longer_competes(tmp_path):
    from orbit_dagster.ledger import rollups

    ledger = fresh(tmp_path)
    write(ledger, [{"job": "ja", "step": s, "old_lineage": False, "deleted": False, "train_loss": None,
                    "evals": [(1, v)]} for s, v in ((1, 0.2), (2, 0.5))])
    best = rank_best(ledger, "e", "eval/loss", "min")
    assert (best.candidates, best.value) == (2, 0.2)
    with ledger.write() as tx:  # what control.retention does for each checkpoint it deletes
        tx.execute("UPDATE checkpoints SET deleted_at = 1.0 WHERE checkpoint_key = ?", [best.checkpoint_key])
        rollups.checkpoint_deleted(tx, best.checkpoint_key)
    after = rank_best(ledger, "e", "eval/loss", "min")
    assert (after.candidates, after.value) == (1, 0.5)


def test_every_ledger_identifier_fits_postgresql():
    """PostgreSQL refuses identifiers over 63 bytes (an index of eval_latest was 74 once)."""
    from orbit_dagster.ledger.schema import MAX_IDENTIFIER, metadata

    names = [t.name for t in metadata.tables.values()]
    names += [ix.name for t in metadata.tables.values() for ix in t.indexes]
    names += [c.name for t in metadata.tables.values() for c in t.constraints if c.name]
    assert names and max(len(n) for n in names) <= MAX_IDENTIFIER, [n for n in names if len(n) > MAX_IDENTIFIER]


def test_a_ledger_whose_eval_latest_predates_lineage_is_rebuilt_by_migration_3(tmp_path):
    ledger = fresh(tmp_path)
    write(ledger, [{"job": "ja", "step": 1, "old_lineage": False, "deleted": False, "train_loss": None,
                    "evals": [(1, 0.3)]}])
    with ledger.write() as tx:  # eval_latest as version 2 first made it
        tx.execute("DROP TABLE eval_latest")
        tx.execute("CREATE TABLE eval_latest (checkpoint_key TEXT, name TEXT, experiment TEXT, job_id TEXT, "
                   "value FLOAT, ts FLOAT, point_id INTEGER, PRIMARY KEY (checkpoint_key, name))")
        tx.execute("DELETE FROM schema_migrations WHERE version >= 3")
    assert upgrade_schema(ledger) == 2
    assert rank_best(ledger, "e", "eval/loss", "min").value == 0.3
    assert ledger.scalar("SELECT lineage FROM eval_latest") == "L-ja"
