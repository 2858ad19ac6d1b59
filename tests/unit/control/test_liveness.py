"""A run worker's liveness: judged by its process on this machine, by its heartbeat elsewhere."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from orbit_dagster.control import liveness
from orbit_dagster.control.liveness import Worker
from orbit_dagster.settings import Settings


def _worker(**kw) -> Worker:
    me = os.getpid()
    base = dict(dagster_run_id="r1", host=liveness.host_name(), boot=liveness.boot_id(), pid=me,
                pid_start=liveness.process_start(me), heartbeat_at=time.time(), ended_at=None)
    return Worker(**{**base, **kw})


def test_a_live_process_on_this_machine_is_alive_whatever_its_heartbeat_says():
    assert _worker(heartbeat_at=0.0).working()


def test_a_dead_pid_on_this_machine_is_dead_at_once_with_a_fresh_heartbeat():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = liveness.process_start(proc.pid)
    proc.wait()
    dead = _worker(pid=proc.pid, pid_start=start)
    assert not dead.process_alive() and "is gone" in dead.why_dead()


def test_a_reused_pid_is_another_process():
    assert not _worker(pid_start=(liveness.process_start(os.getpid()) or 0) + 1).process_alive()


def test_a_record_of_an_earlier_boot_is_dead():
    old = _worker(boot="an-earlier-boot")
    assert not old.process_alive() and "earlier boot" in old.why_dead()


def test_a_worker_elsewhere_is_judged_by_its_heartbeat():
    now = time.time()
    far = _worker(host="another-machine", pid=1, pid_start=1, heartbeat_at=now - 30)
    assert far.process_alive(timeout_s=60, now=now)
    assert not far.process_alive(timeout_s=60, now=now + 31)
    assert "no heartbeat" in far.why_dead()


def test_an_ended_worker_lives_but_works_no_more():
    ended = _worker(ended_at=time.time())
    assert ended.process_alive() and not ended.working()


def test_the_heartbeat_records_this_process_and_marks_its_end(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    beat = liveness.Heartbeat(ledger, "run-a", every_s=0.05).start()
    first = liveness.workers(ledger, ["run-a"])["run-a"]
    assert first.pid == os.getpid() and first.working()
    time.sleep(0.3)
    assert liveness.workers(ledger, ["run-a"])["run-a"].heartbeat_at > first.heartbeat_at
    beat.stop()
    assert not liveness.workers(ledger, ["run-a"])["run-a"].working()
    # The same run in a new worker (a resumed run) takes the record over.
    liveness.Heartbeat(ledger, "run-a", every_s=60).start().stop()
    assert ledger.scalar("SELECT count(*) FROM run_workers WHERE dagster_run_id = 'run-a'") == 1


def test_a_heartbeat_the_ledger_refuses_is_retried_and_never_kills_the_run(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    beat = liveness.Heartbeat(ledger, "run-b", every_s=0.05).start()
    ledger.dispose()
    real = ledger.write

    def refusing():
        raise OSError("disk I/O error")

    ledger.write = refusing
    time.sleep(0.3)
    assert beat.failures >= 1 and beat._thread.is_alive()
    ledger.write = real
    beat.stop()


def test_the_worker_timeout_is_a_setting(monkeypatch, orbit_home):
    monkeypatch.setenv("ORBIT_WORKER_TIMEOUT_S", "90")
    assert Settings.from_env(orbit_home).worker_timeout_s == 90.0
