"""MLflow as the baseline for "which checkpoint of this experiment is best?".

Runs in MLflow's own environment (`bench/mlflow-venv.sh` builds bench/.venv-mlflow); it
imports nothing of orbit-dagster and reads the orbit ledger's SQLite file with the stdlib.

The same data in MLflow's own SQLite backend: one MLflow experiment per orbit experiment,
one run per checkpoint (tag `checkpoint_key`, run name = the key), the checkpoint's latest
evaluation value of each metric logged on it (plus its train/loss), at the checkpoint's
step. A checkpoint that orbit would not rank (deleted, or of a superseded lineage) is a
deleted run, so MLflow's default search (active runs only) answers the same question.

Loading 100,000 runs through the tracking API costs minutes of per-run transactions, so
the store is created by MLflow (its own migrations), experiments through its API, and
runs, tags and metrics are bulk-inserted into MLflow's tables exactly as `create_run` /
`log_batch` write them (checked at start-up against a run logged through the API).

Then it serves timing requests on stdin, one JSON object a line, so the caller can
interleave rounds of orbit and MLflow in one run on warm caches:
    {"op": "best", "experiments": ["exp-001", ...], "metric": "eval/loss", "mode": "min"}
answers {"seconds": [...], "best": {"exp-001": "job-.../a1/900", ...}} with the time of
`MlflowClient.search_runs(experiment_ids=[id], order_by=[metric], max_results=1)` for each.

    bench/.venv-mlflow/bin/python bench/mlflow_baseline.py --ledger LEDGER.sqlite --store DIR
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
import uuid
from pathlib import Path


def _check_layout(store_dir: Path, uri: str) -> None:
    """One run logged through the API: the bulk rows below must look the same."""
    from mlflow.entities import Metric, RunTag
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(uri, str(store_dir / "artifacts"))
    eid = store.create_experiment("layout-check")
    run = store.create_run(eid, user_id="orbit-bench", start_time=1000, tags=[RunTag("checkpoint_key", "k")],
                           run_name="k")
    store.log_batch(run.info.run_id, metrics=[Metric("eval/loss", 1.0, 1000, 7)], params=[], tags=[])
    store.update_run_info(run.info.run_id, run_status=3, end_time=2000, run_name="k")  # FINISHED
    con = sqlite3.connect(store_dir / "mlflow.db")
    row = con.execute("SELECT source_type, source_name, entry_point_name, status, source_version, lifecycle_stage "
                      "FROM runs WHERE run_uuid = ?", [run.info.run_id]).fetchone()
    assert row == ("UNKNOWN", "", "", "FINISHED", "", "active"), row
    tags = sorted(r[0] for r in con.execute("SELECT key FROM tags WHERE run_uuid = ?", [run.info.run_id]))
    assert tags == ["checkpoint_key", "mlflow.runName"], tags
    assert con.execute("SELECT count(*) FROM latest_metrics WHERE run_uuid = ?", [run.info.run_id]).fetchone()[0] == 1
    store.delete_experiment(eid)
    con.close()


def build(ledger_path: Path, store_dir: Path) -> dict:
    """MLflow's store holding the ledger's checkpoints as runs; built once per ledger."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    done = store_dir / "built.json"
    if done.exists():
        return json.loads(done.read_text())
    store_dir.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{store_dir / 'mlflow.db'}"
    t0 = time.time()
    _check_layout(store_dir, uri)
    store = SqlAlchemyStore(uri, str(store_dir / "artifacts"))
    src = sqlite3.connect(f"file:{ledger_path}?mode=ro", uri=True)
    exp_ids = {e: store.create_experiment(e) for (e,) in src.execute("SELECT experiment FROM experiments ORDER BY 1")}
    # Each checkpoint's latest evaluation value per metric (what orbit ranks on).
    latest: dict[str, dict[str, tuple[float, float]]] = {}
    for key, name, value, ts in src.execute(
            "SELECT checkpoint_key, name, value, ts FROM metric_points WHERE source = 'eval' ORDER BY ts, id"):
        latest.setdefault(key, {})[name] = (value, ts)
    dst = sqlite3.connect(store_dir / "mlflow.db")
    runs, tags, metrics = [], [], []
    for key, exp, step, train_loss, created, deleted_at, live_lineage in src.execute(
            """SELECT c.checkpoint_key, c.experiment, c.step, c.train_loss, c.created_at, c.deleted_at,
                      c.lineage = j.lineage FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id"""):
        run_uuid = uuid.uuid5(uuid.NAMESPACE_URL, key).hex
        start_ms = int(created * 1000)
        ranked = deleted_at is None and bool(live_lineage)
        runs.append((run_uuid, key, "UNKNOWN", "", "", "orbit-bench", "FINISHED", start_ms, start_ms + 1000, "",
                     "active" if ranked else "deleted", f"{store_dir}/artifacts/{exp_ids[exp]}/{run_uuid}/artifacts",
                     int(exp_ids[exp]), None if ranked else start_ms + 2000))
        tags += [("checkpoint_key", key, run_uuid), ("mlflow.runName", key, run_uuid)]
        values = dict(latest.get(key, {}))
        if train_loss is not None:
            values["train/loss"] = (train_loss, created)
        for name, (value, ts) in values.items():
            metrics.append((name, float(value), int(ts * 1000), int(step), 0, run_uuid))
    with dst:
        dst.executemany("INSERT INTO runs (run_uuid, name, source_type, source_name, entry_point_name, user_id, status, "
                        "start_time, end_time, source_version, lifecycle_stage, artifact_uri, experiment_id, "
                        "deleted_time) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", runs)
        dst.executemany("INSERT INTO tags (key, value, run_uuid) VALUES (?,?,?)", tags)
        dst.executemany("INSERT INTO metrics (key, value, timestamp, step, is_nan, run_uuid) VALUES (?,?,?,?,?,?)",
                        metrics)
        dst.executemany("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                        "VALUES (?,?,?,?,?,?)", metrics)
    info = {"runs": len(runs), "metrics": len(metrics), "experiments": len(exp_ids), "seconds": round(time.time() - t0, 1)}
    done.write_text(json.dumps(info))
    return info


def serve(store_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store_dir / 'mlflow.db'}")
    ids: dict[str, str] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") != "best":
            print(json.dumps({"error": f"unknown op {req.get('op')!r}"}), flush=True)
            continue
        order = "ASC" if req.get("mode", "min") == "min" else "DESC"
        order_by = [f"metrics.`{req['metric']}` {order}"]
        seconds, best = [], {}
        for exp in req["experiments"]:
            if exp not in ids:
                ids[exp] = client.get_experiment_by_name(exp).experiment_id
            t = time.perf_counter()
            found = client.search_runs(experiment_ids=[ids[exp]], order_by=order_by, max_results=1)
            seconds.append(time.perf_counter() - t)
            best[exp] = found[0].data.tags.get("checkpoint_key") if found else None
        print(json.dumps({"seconds": seconds, "best": best}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ledger", type=Path, required=True, help="the orbit ledger's SQLite file")
    p.add_argument("--store", type=Path, required=True, help="directory of MLflow's SQLite store (built once)")
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args()
    info = build(args.ledger, args.store)
    print(json.dumps({"built": info}), file=sys.stderr, flush=True)
    if not args.build_only:
        serve(args.store)


if __name__ == "__main__":
    main()
