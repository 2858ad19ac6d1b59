"""Concurrent writes to the ledger: writer processes, readers querying all the while.

W writer processes each append E events through `Ledger.commit` (one transaction per event,
as the control plane writes them, or `--batch` events per transaction), while R reader
processes count them through the store (`Ledger.scalar`) and through the DuckDB face
(`Ledger.query`). Afterwards every event id is checked: none lost, none twice. Per-write
wait = the wall time of one `commit` call, from the writer's side.

Variants, each on a fresh ledger, in one run:
- `store`: the store as shipped (SQLite WAL, synchronous=FULL, BEGIN IMMEDIATE,
  busy_timeout 30 s: SQLite's own busy handler sleeps and retries);
- `batched`: the same store, `--batch` events per transaction;
- `retry`: busy_timeout 0 and our own retry (1-4 ms jittered sleeps, capped at 30 s);
- `queued`: writers of one SQLite file queue on a blocking `flock` of a lock file beside
  it before `BEGIN IMMEDIATE`, so a waiting writer is woken when the lock frees instead
  of sleeping through SQLite's back-off.

    python bench/ledger_writes.py [--quick] [--writers 8] [--events 5000] [--record docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import sqlalchemy as sa  # noqa: E402

from orbit_dagster.ledger import Ledger  # noqa: E402
from orbit_dagster.ledger import records as R  # noqa: E402
from orbit_dagster.ledger.migrations import ledger_url_for  # noqa: E402

VARIANTS = ("store", "batched", "retry", "queued")
GOAL_P99_S = 1.0


def open_variant(home: Path, variant: str) -> tuple[Ledger, callable]:
    """The ledger and a `commit(rows)` with the variant's busy behaviour."""
    ledger = Ledger.open(ledger_url_for(home), home=home)
    if variant == "retry":
        @sa.event.listens_for(ledger.engine, "connect")
        def _no_wait(dbapi_con, _record) -> None:  # runs after the store's own listener
            dbapi_con.execute("PRAGMA busy_timeout=0")

        ledger.engine.dispose()
        rng = random.Random(os.getpid())

        def commit(rows):
            deadline = time.monotonic() + 30.0
            while True:
                try:
                    return ledger.commit(rows)
                except sa.exc.OperationalError as exc:
                    if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(rng.uniform(0.001, 0.004))

        return ledger, commit
    if variant == "queued":
        lock_path = str(ledger.path) + ".writelock"

        @contextmanager
        def queued():
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks; the kernel wakes us when it is free
                yield
            finally:
                os.close(fd)  # closing releases the lock

        def commit(rows):
            with queued():
                return ledger.commit(rows)

        return ledger, commit
    return ledger, ledger.commit


def writer(home: str, variant: str, w: int, events: int, batch: int, out: str, start_at: float) -> None:
    ledger, commit = open_variant(Path(home), variant)
    waits = []
    rows = [R.event("bench_write", event_id=f"w{w:02d}-{i:06d}", job_id=f"job-{w}", n=i) for i in range(events)]
    while time.time() < start_at:
        time.sleep(0.001)
    for i in range(0, events, batch):
        t = time.perf_counter()
        commit({"events": rows[i:i + batch]})
        waits.append(time.perf_counter() - t)
    Path(out).write_text(json.dumps(waits))


def reader(home: str, stop_path: str, out: str) -> None:
    store_n, face_n, errors, backwards, lat = 0, 0, [], 0, []
    try:
        _read_until(home, stop_path, errors, lat, counts := {"store": 0, "face": 0, "backwards": 0})
        store_n, face_n, backwards = counts["store"], counts["face"], counts["backwards"]
    except Exception as exc:  # noqa: BLE001 - a reader that died is reported, not lost
        errors.append(f"reader died: {type(exc).__name__}: {str(exc)[:200]}")
    Path(out).write_text(json.dumps({"store_queries": store_n, "face_queries": face_n, "errors": errors,
                                     "backwards": backwards, "store_latency": lat}))


def _read_until(home: str, stop_path: str, errors: list, lat: list, counts: dict) -> None:
    ledger = Ledger.open(ledger_url_for(Path(home)), home=Path(home))
    last_store = last_face = -1
    while not os.path.exists(stop_path):
        try:
            t = time.perf_counter()
            n = int(ledger.scalar("SELECT count(*) FROM events WHERE kind = 'bench_write'"))
            lat.append(time.perf_counter() - t)
            counts["store"] += 1
            counts["backwards"] += n < last_store
            last_store = n
            m = int(ledger.query("SELECT count(*) AS n FROM events WHERE kind = 'bench_write'")["n"][0])
            counts["face"] += 1
            counts["backwards"] += m < last_face
            last_face = m
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        time.sleep(0.01)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def run_variant(variant: str, writers: int, events: int, batch: int, readers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"ledger-writes-{variant}-") as tmp:
        home = Path(tmp) / "home"
        Ledger.open(ledger_url_for(home), home=home).dispose()  # migrated once, before the race
        ctx = mp.get_context("spawn")
        stop = Path(tmp) / "stop"
        start_at = time.time() + 3.0  # every writer imported and connected before the start
        rs = [ctx.Process(target=reader, args=(str(home), str(stop), f"{tmp}/r{i}.json")) for i in range(readers)]
        ws = [ctx.Process(target=writer, args=(str(home), variant, w, events, batch, f"{tmp}/w{w}.json", start_at))
              for w in range(writers)]
        for p in rs + ws:
            p.start()
        for p in ws:
            p.join()
        elapsed = time.time() - start_at
        stop.touch()
        for p in rs:
            p.join()  # a reader stops after its current query
        waits = [x for w in range(writers) for x in json.loads(Path(f"{tmp}/w{w}.json").read_text())]
        reads = [json.loads(Path(f"{tmp}/r{i}.json").read_text()) for i in range(readers)]
        ledger = Ledger.open(ledger_url_for(home), home=home)
        ids = [r["event_id"] for r in ledger.rows("SELECT event_id FROM events WHERE kind = 'bench_write'")]
        expected = {f"w{w:02d}-{i:06d}" for w in range(writers) for i in range(events)}
        ledger.dispose()
    return {
        "variant": variant, "writers": writers, "events": events, "batch": batch, "elapsed_s": elapsed,
        "rows_per_s": writers * events / elapsed, "commits": len(waits),
        "lost": len(expected - set(ids)), "duplicated": len(ids) - len(set(ids)), "unexpected": len(set(ids) - expected),
        "p50": statistics.median(waits), "p99": pct(waits, 0.99), "max": max(waits),
        "over_1s": sum(1 for x in waits if x > 1.0),
        "store_queries": sum(r["store_queries"] for r in reads), "face_queries": sum(r["face_queries"] for r in reads),
        "read_errors": [e for r in reads for e in r["errors"]][:5], "read_error_count": sum(len(r["errors"]) for r in reads),
        "backwards": sum(r["backwards"] for r in reads),
        "read_p99": pct([x for r in reads for x in r["store_latency"]] or [0.0], 0.99),
    }


def report(results: list[dict], args) -> str:
    lines = [
        f"Measured {date.today().isoformat()} on {platform.machine()} ({os.cpu_count()} cores, shared with other work: "
        f"{args.writers} writers + {args.readers} readers oversubscribe them), command: `{args.command}`. "
        f"{args.writers} writer processes x {args.events:,} events; {args.readers} reader processes counting through "
        "the store and the DuckDB face all the while. Wait = one `commit` call (ms). Goal: p99 < 1 s.",
        "",
        "| variant | events/tx | rows/s | commit p50 ms | p99 ms | max ms | commits > 1 s | lost | duplicated "
        "| store / face queries | read errors | count went back | goal p99 < 1 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['batch']} | {r['rows_per_s']:,.0f} | {r['p50'] * 1e3:.1f} | {r['p99'] * 1e3:.1f} | "
            f"{r['max'] * 1e3:.0f} | {r['over_1s']} of {r['commits']:,} | {r['lost']} | {r['duplicated']} | "
            f"{r['store_queries']:,} / {r['face_queries']:,} | {r['read_error_count']} | {r['backwards']} | "
            f"{'met' if r['p99'] < GOAL_P99_S else '**missed**'} |")
    errs = [e for r in results for e in r["read_errors"]]
    if errs:
        lines += ["", "Read errors (first): " + "; ".join(errs[:3])]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 writers x 300 events")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--events", type=int, default=5000)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--batch", type=int, default=50, help="events per transaction in the batched variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--record", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.writers, args.events = 4, 300
    sys.path.insert(0, str(REPO / "bench"))
    from recording import recorded_command

    args.command = recorded_command("ledger_writes", sys.argv[1:])
    results = []
    for v in args.variants.split(","):
        r = run_variant(v, args.writers, args.events, args.batch if v == "batched" else 1, args.readers)
        print(json.dumps({k: v for k, v in r.items() if k != "read_errors"}), flush=True)
        results.append(r)
    text = report(results, args)
    print(text)
    if args.record:
        from ledger_scale import record

        record(args.record, text, "ledger-writes", "Ledger writes under concurrency (bench/ledger_writes.py)")


if __name__ == "__main__":
    main()
