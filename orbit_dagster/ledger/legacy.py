"""`orbit ledger upgrade`: convert a home written by the Parquet-commit ledger (before the
transactional one) into the current ledger, once.

The old ledger kept every table as Parquet files in commit folders (`segments/c-*/`), one
row per key (the first written, or the last for settings). DuckDB reads them with the old
rule, each table is written into the new store in one transaction, current states are
taken from the newest state rows, and the old folder is kept as `segments.bak`. Old
checkpoint keys (`<job>/<step>`) are kept as they were; their lineage is `L1-legacy`.
"""
from __future__ import annotations

from pathlib import Path

import duckdb

from ..core.errors import OrbitError
from .migrations import upgrade_schema
from .store import Ledger

# Old table -> (key columns, which row of a key wins).
OLD_TABLES = {
    "projects": (("project",), "last"), "experiments": (("experiment",), "last"), "jobs": (("job_id",), "first"),
    "job_states": (("job_id", "attempt", "state"), "first"), "bundles": (("bundle_hash", "job_id"), "first"),
    "runs": (("run_id",), "first"), "run_states": (("run_id", "state"), "first"),
    "instances": (("instance_id",), "first"), "instance_stops": (("instance_id",), "first"),
    "checkpoints": (("checkpoint_key",), "first"), "checkpoint_deletions": (("checkpoint_key",), "first"),
    "evaluations": (("checkpoint_key", "suite"), "last"),
    "metric_points": (("run_id", "source", "name", "step", "checkpoint_key"), "first"),
    "events": (("event_id",), "first"), "price_ticks": (("offer_id", "ts"), "first"), "costs": (("cost_id",), "first"),
    "best_checkpoints": (("experiment", "computed_at"), "first"), "decisions": (("decision_id",), "first"),
}
LEGACY_LINEAGE = "L1-legacy"


def _read(con: duckdb.DuckDBPyConnection, segments: Path, table: str) -> list[dict]:
    files = sorted(str(p) for p in segments.glob(f"c-*/{table}.parquet"))
    if not files:
        return []
    key, keep = OLD_TABLES[table]
    order = "ASC" if keep == "first" else "DESC"
    cur = con.execute(
        f"""SELECT * EXCLUDE (_c, filename) FROM (SELECT *, filename AS _c FROM read_parquet(?, union_by_name = true,
            filename = true)) QUALIFY row_number() OVER (PARTITION BY {', '.join(key)} ORDER BY _c {order}) = 1
            ORDER BY _c""", [files])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _latest(rows: list[dict], key: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: (r["ts"], r.get("attempt") or 0)):
        out[r[key]] = r
    return out


def convert(old: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The old tables' rows as rows of the current tables."""
    jobs = {r["job_id"]: r for r in old["jobs"]}
    job_now = _latest(old["job_states"], "job_id")
    run_now = _latest(old["run_states"], "run_id")
    stops = {r["instance_id"]: r for r in old["instance_stops"]}
    deleted = {r["checkpoint_key"]: r for r in old["checkpoint_deletions"]}
    billed: dict[str, float] = {}
    for c in old["costs"]:
        billed[c["instance_id"]] = billed.get(c["instance_id"], 0.0) + float(c["usd"] or 0.0)
    gpus = {r["instance_id"]: r.get("gpu_count") or 1 for r in old["instances"]}
    exp_of = {j: r["experiment"] for j, r in jobs.items()}
    exp_of.update({r["job_id"]: r["experiment"] for r in old["runs"] if r.get("imported")})
    out: dict[str, list[dict]] = {
        "projects": [{**r, "updated_at": r["created_at"]} for r in old["projects"]],
        "experiments": [{"experiment": r["experiment"], "project": r["project"], "template_metric": r["primary_metric"],
                         "template_mode": r["primary_mode"], "created_at": r["created_at"], "updated_at": r["created_at"]}
                        for r in old["experiments"]],
        "jobs": [], "job_states": [{k: v for k, v in r.items()} for r in old["job_states"]],
        "bundles": [{k: r[k] for k in ("job_id", "attempt", "bundle_hash", "path", "template_id", "provenance",
                                       "created_at")} for r in old["bundles"]],
        "runs": [], "run_states": [dict(r) for r in old["run_states"]], "instances": [], "checkpoints": [],
        "evaluations": [], "metric_points": [], "events": [dict(r, checkpoint_key=None) for r in old["events"]],
        "price_ticks": [dict(r) for r in old["price_ticks"]], "best_checkpoints": [], "decisions": old["decisions"],
        "costs": [{**{k: v for k, v in r.items() if k not in ("start_ts", "end_ts")}, "start_at": r["start_ts"],
                   "end_at": r["end_ts"], "suite": None, "gpu_count": gpus.get(r["instance_id"], 1)}
                  for r in old["costs"]],
    }
    for job_id, r in jobs.items():
        s = job_now.get(job_id, {})
        out["jobs"].append({**r, "imported": 0, "lineage": LEGACY_LINEAGE, "state": s.get("state"),
                            "attempt": s.get("attempt"), "reason": s.get("reason"), "failure_class": s.get("failure_class"),
                            "detail": s.get("detail"), "state_at": s.get("ts")})
    for r in old["runs"]:
        s = run_now.get(r["run_id"], {})
        out["runs"].append({**r, "imported": int(bool(r.get("imported"))), "lineage": LEGACY_LINEAGE,
                            "state": s.get("state"), "exit_code": s.get("exit_code"),
                            "failure_class": s.get("failure_class"), "reason": s.get("reason"), "state_at": s.get("ts")})
    for r in old["instances"]:
        stop = stops.get(r["instance_id"])
        out["instances"].append({**r, "spot": int(bool(r.get("spot"))), "suite": None, "dagster_run_id": None,
                                 "stopped_at": stop["stopped_at"] if stop else None,
                                 "stop_reason": stop["reason"] if stop else None,
                                 "billed_usd": billed.get(r["instance_id"]) if stop else None})
    for r in old["checkpoints"]:
        d = deleted.get(r["checkpoint_key"])
        out["checkpoints"].append({**r, "experiment": exp_of.get(r["job_id"]), "lineage": LEGACY_LINEAGE,
                                   "deleted_at": d["ts"] if d else None, "deleted_reason": d["reason"] if d else None})
    for r in old["evaluations"]:
        out["evaluations"].append({"checkpoint_key": r["checkpoint_key"], "suite": r["suite"], "job_id": r["job_id"],
                                   "experiment": exp_of.get(r["job_id"]), "state": "SUCCEEDED", "tries": 1,
                                   "metrics": r["metrics"], "instance_id": r["instance_id"],
                                   "dagster_run_id": r["dagster_run_id"], "seconds": r["seconds"],
                                   "requested_at": r["created_at"], "started_at": r["created_at"],
                                   "finished_at": r["created_at"]})
    for r in old["metric_points"]:
        out["metric_points"].append({**r, "experiment": exp_of.get(r["job_id"]), "suite": None})
    for r in old["best_checkpoints"]:
        out["best_checkpoints"].append({**r, "resolved_from": None})
    return out


def upgrade(ledger_dir: Path, url: str) -> dict[str, int]:
    """Convert `ledger_dir/segments` into the ledger at `url`; returns rows per table."""
    segments = Path(ledger_dir) / "segments"
    if not segments.is_dir():
        raise OrbitError(f"{ledger_dir} holds no Parquet-commit ledger (no segments/)", field="ORBIT_HOME",
                         value=str(ledger_dir.parent), fix="nothing to upgrade")
    con = duckdb.connect(":memory:")
    try:
        old = {t: _read(con, segments, t) for t in OLD_TABLES}
    finally:
        con.close()
    rows = convert(old)
    target = segments.with_name("segments.bak")
    segments.rename(target)  # the new ledger may now open; the old one is kept, untouched
    try:
        ledger = Ledger(url)
        upgrade_schema(ledger)
        if ledger.scalar("SELECT count(*) FROM jobs"):
            raise OrbitError(f"the ledger at {ledger.display} already holds jobs", field="ledger",
                             fix="upgrade into an empty ledger")
        with ledger.write() as tx:
            for table, batch in rows.items():
                tx.insert(table, batch)
    except BaseException:
        target.rename(segments)
        raise
    return {t: len(b) for t, b in rows.items()}
