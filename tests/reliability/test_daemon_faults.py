"""The daemon's own faults, on real `orbit daemon` processes: two daemons on one home, a
daemon elsewhere on the same storage, a new storage opened by several processes at once, a
full disk under a running daemon, a stop that must leave nothing behind, and (opt-in) CPUs
saturated by other processes."""
from __future__ import annotations

import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orbit_dagster.deploy.instance import Daemon, dagster_instance, running_daemon
from orbit_dagster.deploy.logs import DISK_ERROR
from orbit_dagster.settings import Settings
from tests.conftest import kill_processes_under
from tests.daemon_support import code_servers, descendants, ours_alive, sensor_ticks, start_orbit, stop, ticks_after, wait_text
from tests.helpers import wait_for

UP = "daemon up after"


STORAGES = ("history/runs.db", "history/runs/index.db", "schedules/schedules.db")


def schema_stamps(dagster_home: Path) -> dict[str, int]:
    """Rows of each SQLite storage's alembic_version (1 when whole), read-only. (Per-run event
    log files have no schema table of their own.)"""
    out = {}
    for db in [dagster_home / name for name in STORAGES if (dagster_home / name).exists()]:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            out[str(db.relative_to(dagster_home))] = con.execute("SELECT count(*) FROM alembic_version").fetchone()[0]
        finally:
            con.close()
    return out


@pytest.mark.fault("two `orbit daemon` started at the same moment on a fresh home; then the running one SIGKILLed "
                   "and another started at once",
                   expect="one runs, the other refuses in one line (exit 2, naming it); the storage is whole; the "
                          "next one starts over the killed one's lock file and ticks")
def test_two_daemons_at_once_one_runs_one_refuses_and_a_killed_one_blocks_nothing(orbit_home, tmp_path):
    settings = Settings.from_env(orbit_home)
    procs = [start_orbit(["daemon"], tmp_path / f"d{i}.out", tmp_path / f"d{i}.err") for i in (0, 1)]
    third = None
    try:
        ended = wait_for(lambda: [i for i, p in enumerate(procs) if p.poll() is not None], timeout=180, every=0.5,
                         what="one of the two daemons to end")
        assert len(ended) == 1, [p.returncode for p in procs]
        loser, winner = procs[ended[0]], procs[1 - ended[0]]
        refusal = (tmp_path / f"d{ended[0]}.err").read_text()
        assert loser.returncode == 2 and len(refusal.strip().splitlines()) == 1, refusal
        assert "a daemon already runs for this Dagster home" in refusal and f"pid {winner.pid}" in refusal, refusal
        assert (tmp_path / f"d{ended[0]}.out").read_text() == ""  # it started nothing
        wait_text(tmp_path / f"d{1 - ended[0]}.err", UP, 240, winner)

        said: list[str] = []
        assert not Daemon(settings, say=said.append).start().started  # the demo's and tests' way: use it
        assert "already runs" in said[0] and running_daemon(settings) is not None
        stamps = schema_stamps(orbit_home / "dagster")
        assert set(stamps.values()) == {1}, stamps

        os.kill(winner.pid, signal.SIGKILL)  # its lock file stays, naming a dead process
        winner.wait()
        killed_at = time.time()
        third = start_orbit(["daemon"], tmp_path / "d2.out", tmp_path / "d2.err")
        wait_text(tmp_path / "d2.err", UP, 240, third)
        wait_for(lambda: ticks_after(settings, killed_at), timeout=120, every=2, what="a tick of the next daemon")
        assert "Another SENSOR daemon" not in (tmp_path / "d2.out").read_text()
        assert stop(third) == 0
    finally:
        for p in [*procs, third]:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.fault("a daemon on another machine heartbeats to the same (shared) storage; `orbit daemon` starts here",
                   expect="refused in one line, exit 2, naming the other daemon; `Daemon().start()` uses it")
def test_a_daemon_elsewhere_on_the_same_storage_is_refused(orbit_home):
    from dagster._daemon.types import DaemonHeartbeat

    settings = Settings.from_env(orbit_home)
    with dagster_instance(settings) as instance:  # what a daemon on another machine writes
        instance.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", "elsewhere-5f0c", None))
    proc = subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", "daemon"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "another Dagster daemon heartbeats" in err and "elsewher" in err and "fix:" in err
    said: list[str] = []
    assert not Daemon(settings, say=said.append).start().started and "from elsewhere" in said[0]


@pytest.mark.fault("four processes open a new Dagster storage at the same moment (the CLI registering partitions "
                   "while a daemon starts)", expect="every one opens it; one schema stamp per storage")
def test_a_new_storage_opened_by_four_processes_at_once_is_made_once(orbit_home):
    code = ("from orbit_dagster.settings import Settings\n"
            "from orbit_dagster.deploy.instance import dagster_instance\n"
            "with dagster_instance(Settings.from_env()) as i:\n"
            "    i.get_run_records(limit=1)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-400:] for e in errors]
    stamps = schema_stamps(orbit_home / "dagster")
    assert len(stamps) == 3 and set(stamps.values()) == {1}, stamps


FULL_S = 65.0  # over a minute: the per-minute count must show


@pytest.mark.fault("the disk under a running daemon's storage and ledger fills up for over a minute (16 MiB "
                   "tmpfs), then is freed; then the daemon is stopped",
                   expect="one line naming the fix, then at most one a minute; ticks resume without a restart; "
                          "the stop leaves no process of ours")
def test_a_full_disk_under_the_daemon_is_one_line_a_minute_and_ticks_resume(small_disk, tmp_path, monkeypatch):
    from tests.security.test_cli_errors import fill

    home = small_disk / "home"
    monkeypatch.setenv("ORBIT_HOME", str(home))
    settings = Settings.from_env(home)
    out, err = tmp_path / "daemon.out", tmp_path / "daemon.err"  # off the full disk, as a journal would be
    proc = start_orbit(["daemon"], out, err)
    try:
        wait_text(err, UP, 240, proc)
        pids = descendants(proc.pid)
        filler = fill(small_disk)
        full_at = time.time()
        wait_for(lambda: "disk full or failing" in out.read_text(), timeout=120, every=1, what="the disk line")
        time.sleep(max(0.0, FULL_S - (time.time() - full_at)))
        filler.unlink()
        full_s = time.time() - full_at
        freed_at = time.time()
        wait_for(lambda: ticks_after(settings, freed_at) >= 2, timeout=180, every=2,
                 what="sensor ticks after the disk was freed")
        assert proc.poll() is None, "the daemon died of the full disk"
        pids |= descendants(proc.pid)
        socket_dir = Path(re.search(r"answer on unix:(\S+)/code-server\.sock", err.read_text()).group(1))
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_processes_under(home)
    log = out.read_text()
    disk = [line for line in log.splitlines() if DISK_ERROR.search(line)]
    assert 1 <= len(disk) <= 1 + math.ceil(full_s / 60), disk[:5]
    assert "disk full or failing" in disk[0] and f"free space on the file system holding {home}" in disk[0]
    assert "Traceback" not in log
    deadline = time.time() + 30  # a process signalled by the stop may take a moment to go
    while ours_alive(pids, home) and time.time() < deadline:
        time.sleep(1)
    assert not ours_alive(pids, home), ours_alive(pids, home)
    assert not socket_dir.exists()
    print(f"full for {full_s:.0f} s: {len(disk)} disk lines in a {len(log.splitlines())}-line log")


HOG_S = 90.0


@pytest.mark.slow  # 90 s of every CPU taken, which slows whatever else runs: `make test-all`
@pytest.mark.fault("the CPUs saturated for 90 s by 12 busy-loop processes per core, each in a session of its own "
                   "(the kernel shares CPU between sessions), beside a running daemon",
                   expect="the code server that answered before serves throughout (none shut down or started); "
                          "sensors tick at least once a minute, and again within 30 s after")
def test_sensors_keep_ticking_while_other_processes_saturate_the_cpus(orbit_home, tmp_path):
    settings = Settings.from_env(orbit_home)
    proc = start_orbit(["daemon"], tmp_path / "daemon.out", tmp_path / "daemon.err")
    hogs: list[subprocess.Popen] = []
    try:
        wait_text(tmp_path / "daemon.err", UP, 240, proc)
        before = code_servers(orbit_home)
        seen = set(before)
        start = time.time()
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(12 * (os.cpu_count() or 1))]
        while time.time() - start < HOG_S:
            time.sleep(5)
            seen |= set(code_servers(orbit_home))
        for h in hogs:
            h.kill()
        end = time.time()
        wait_for(lambda: ticks_after(settings, end), timeout=60, every=2, what="a tick after the hog")
        after = code_servers(orbit_home)
        ticks = [t for t, _ in sensor_ticks(settings) if t >= start - 30]
    finally:
        for h in hogs:
            if h.poll() is None:
                h.kill()
        stop(proc)
    assert before and after == before and seen == set(before), (before, sorted(seen), after)
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if b > start]
    during = [t for t in ticks if start <= t <= end]
    assert during and max(gaps) < 60, gaps
    assert "No heartbeat received" not in (tmp_path / "daemon.out").read_text()
    print(f"{len(hogs)} hogs for {end - start:.0f} s: {len(during)} ticks, longest gap {max(gaps):.0f} s")
