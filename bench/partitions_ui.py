"""Checkpoint partitions at 100,000 checkpoints: adding them, and the UI's `checkpoint` page over them.

1. On a SQLite Dagster instance (orbit's own `dagster.yaml`): `add_checkpoint_partitions`
   (both dynamic dimensions, job and checkpoint within it) with all N checkpoints in one
   call, against one call per checkpoint (timed on `--per-key` keys, on an
   empty instance and on top of the N keys, so the per-key figure is measured, not assumed;
   the per-key time for all N is that rate times N, and is labelled as such).
2. `dagster-webserver` on 127.0.0.1 over that instance (orbit's code location), and
   headless Chromium (Playwright, the system's /usr/bin/chromium): time from navigation to
   the `checkpoint` asset page until its partition count is visible, on a fresh page each
   time; the same page with `--small` partitions in another instance for comparison.

    python bench/partitions_ui.py [--quick] [--keys 100000] [--record docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def keys(n: int, offset: int = 0) -> list[str]:
    # Realistic checkpoint keys: `<job>/a<attempt>/<step>`, 100 per job.
    return [f"charlm-finetune-{(i // 100):06x}/a1/{(i % 100 + 1) * 40}" for i in range(offset, offset + n)]


def add_partitions(home: Path, n: int, per_key: int) -> dict:
    """Checkpoint partitions are (job, checkpoint within the job): `add_checkpoint_partitions`
    adds the missing keys of both dimensions, in one call for many checkpoints or one per
    checkpoint (what a sensor registering checkpoints one at a time would do)."""
    from dagster import DagsterInstance
    from dagster._core.definitions.partitions.context import partition_loading_context

    from orbit_dagster.assets.partitions import add_checkpoint_partitions, checkpoints_partitions
    from orbit_dagster.deploy.instance import ensure_dagster_home
    from orbit_dagster.settings import Settings

    settings = Settings.from_env(home)
    out = {}
    with DagsterInstance.from_config(str(ensure_dagster_home(settings))) as instance:
        sample = keys(per_key, offset=10 * n)
        t = time.perf_counter()
        for k in sample:
            add_checkpoint_partitions(instance, [k])
        out["per_key_empty_s"] = (time.perf_counter() - t) / per_key
        t = time.perf_counter()
        add_checkpoint_partitions(instance, keys(n))
        out["one_call_s"] = time.perf_counter() - t
        sample = keys(per_key, offset=20 * n)
        t = time.perf_counter()
        for k in sample:
            add_checkpoint_partitions(instance, [k])
        out["per_key_full_s"] = (time.perf_counter() - t) / per_key
        t = time.perf_counter()
        with partition_loading_context(dynamic_partitions_store=instance):
            out["count"] = len(checkpoints_partitions.get_partition_keys())
        out["read_all_s"] = time.perf_counter() - t
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def webserver(home: Path):
    from orbit_dagster.deploy.instance import environment
    from orbit_dagster.settings import Settings

    port = free_port()
    exe = str(Path(sys.executable).with_name("dagster-webserver"))
    proc = subprocess.Popen([exe, "-h", "127.0.0.1", "-p", str(port), "-m", "orbit_dagster.definitions"],
                            env=environment(Settings.from_env(home)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/server_info", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("dagster-webserver did not answer within 120 s")


def page_loads(url: str, count: int, repeats: int, shot: Path | None) -> list[float]:
    """Seconds from navigation to the partition count of the checkpoint asset being visible."""
    from playwright.sync_api import sync_playwright

    number = f"{count:,}".replace(",", "[,\u202f]?")
    text = re.compile(rf"\b{number}\s+(?:partitions?|of\b)", re.I)
    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for i in range(repeats + 1):  # the first load warms the server's caches and is not counted
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            t = time.perf_counter()
            page.goto(f"{url}/assets/checkpoint?view=partitions")
            try:
                page.get_by_text(text).first.wait_for(timeout=180_000)
            except Exception:
                fail = Path(tempfile.gettempdir()) / "partitions-ui-failed.png"
                page.screenshot(path=str(fail))
                raise SystemExit(f"no partition count of {count:,} on the page within 180 s (screenshot: {fail})") from None
            if i:
                out.append(time.perf_counter() - t)
            if shot and i == repeats:
                page.screenshot(path=str(shot))
            page.close()
        browser.close()
    return out


def ui(home: Path, count: int, repeats: int, shot: Path | None) -> list[float]:
    proc, url = webserver(home)
    try:
        return page_loads(url, count, repeats, shot)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run(args) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="partitions-ui-"))
    big, small = tmp / "big", tmp / "small"
    adds = add_partitions(big, args.keys, args.per_key)
    print(adds, flush=True)
    small_adds = add_partitions(small, args.small, min(args.per_key, 10))
    ui_small = ui(small, small_adds["count"], args.repeats, None)
    ui_big = ui(big, adds["count"], args.repeats, args.screenshot)
    print(ui_small, ui_big, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return report(adds, small_adds, ui_small, ui_big, args)


def report(adds: dict, small_adds: dict, ui_small: list[float], ui_big: list[float], args) -> str:
    n, k = args.keys, args.per_key
    projected = adds["per_key_full_s"] * n
    return "\n".join([
        f"Measured {date.today().isoformat()} on {platform.machine()} ({os.cpu_count()} cores, shared with other work), "
        f"command: `{args.command}`. SQLite Dagster instance (orbit's dagster.yaml). A checkpoint's partition is "
        f"(job, checkpoint within the job): {n:,} checkpoints of 100 each per job make two dynamic dimensions of "
        f"{n // 100:,} and 100 keys; the page shows their product.",
        "",
        "| figure | seconds |",
        "|---|---|",
        f"| one `add_checkpoint_partitions` call with {n:,} checkpoints | {adds['one_call_s']:.2f} |",
        f"| one call per checkpoint, per checkpoint, empty instance (mean of {k:,}) | "
        f"{adds['per_key_empty_s'] * 1e3:.1f} ms |",
        f"| one call per checkpoint, per checkpoint, on top of {n:,} (mean of {k:,}) | "
        f"{adds['per_key_full_s'] * 1e3:.1f} ms |",
        f"| one call per key for {n:,} keys: the rate above x {n:,} (a projection, not timed) | {projected:.0f} "
        f"({projected / adds['one_call_s']:.0f}x the single call) |",
        f"| all {adds['count']:,} checkpoint partition keys read back | {adds['read_all_s']:.2f} |",
        f"| UI: `checkpoint` page, navigation -> partition count visible, {adds['count']:,} partitions "
        f"(median of {len(ui_big)}, min-max) | {statistics.median(ui_big):.2f} ({min(ui_big):.2f}-{max(ui_big):.2f}) |",
        f"| UI: the same page with {small_adds['count']:,} partitions (median of {len(ui_small)}, min-max) | "
        f"{statistics.median(ui_small):.2f} ({min(ui_small):.2f}-{max(ui_small):.2f}) |",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2,000 keys, 50 per key, 1 page load")
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--per-key", type=int, default=500, help="keys added one call each (timed)")
    p.add_argument("--small", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--screenshot", type=Path, default=None)
    p.add_argument("--record", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.keys, args.per_key, args.repeats = 2000, 50, 1
    sys.path.insert(0, str(REPO / "bench"))
    from recording import recorded_command

    args.command = recorded_command("partitions_ui", sys.argv[1:])
    text = run(args)
    print(text)
    if args.record:
        from ledger_scale import record

        record(args.record, text, "partitions-ui", "100,000 dynamic partitions and the UI (bench/partitions_ui.py)")


if __name__ == "__main__":
    main()
