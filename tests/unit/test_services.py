"""The supervisor's parts that need no Dagster process: disk errors collapsed to a line a minute,
a log that cannot be written, code server addresses, the daemon lock and its refusal."""
import io
import json
import os
import threading

import pytest

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.deploy.code_server import CodeServerAddress
from orbit_dagster.deploy.locks import DaemonLock, foreign_heartbeats
from orbit_dagster.deploy.logs import DISK_ERROR, DiskNotices, LogPump, SafeWriter

TICK_FAILED = ["2026-12-01 21:40:23 +0000 - dagster.daemon.SensorDaemon - ERROR - Sensor tick caught an error\n",
               "Traceback (most recent call last):\n", '  File "sqlite_run_storage.py", line 112, in connect\n',
               "sqlite3.OperationalError: disk I/O error\n"]


def test_disk_errors_are_one_line_then_one_a_minute_then_a_line_when_they_stop():
    lines: list[str] = []
    notices = DiskNotices("/srv/orbit/home", lines.append)
    t0 = 1_000_000.0
    for i in range(150):  # one failed tick a second for 150 s, from two children
        notices.record("dagster-daemon" if i % 3 else "code server", "".join(TICK_FAILED), now=t0 + i)
    for s in range(150, 300):
        notices.tick(now=t0 + s)
    assert len(lines) == 5, lines  # the first, three a minute apart, the end
    assert "disk full or failing: 'sqlite3.OperationalError: disk I/O error'" in lines[0]
    assert "free space on the file system holding /srv/orbit/home (df -h /srv/orbit/home)" in lines[0]
    assert "disk errors go on: 60 in the last 60 s" in lines[1] and "code server 20, dagster-daemon 40" in lines[1]
    assert "disk errors go on: 60 in the last 60 s" in lines[2]
    assert "disk errors go on: 29 in the last 60 s" in lines[3]
    assert "no disk error for 91 s" in lines[4] and "150 disk errors since" in lines[4]


def test_the_log_pump_collapses_disk_failures_with_their_tracebacks_and_keeps_other_errors():
    out, lines = io.StringIO(), []
    pump = LogPump("dagster-daemon", -1, SafeWriter(out), DiskNotices("/h", lines.append), threading.Event())
    other = "2026-12-01 21:40:24 +0000 - dagster.daemon.SensorDaemon - ERROR - Sensor x failed: ValueError\n"
    for line in TICK_FAILED * 5 + [other]:
        pump.line(line)
    pump.flush()
    assert out.getvalue() == other and len(lines) == 1 and DISK_ERROR.search(lines[0])


def test_a_log_on_a_full_disk_counts_its_lost_lines_and_says_so_when_writable_again():
    class Full(io.StringIO):
        full = True

        def write(self, text):
            if self.full:
                raise OSError(28, "No space left on device")
            return super().write(text)

    out = Full()
    writer = SafeWriter(out)
    writer.write("a\n")
    writer.write("b\n")
    out.full = False
    writer.write("c\n")
    assert out.getvalue().endswith("2 log lines lost: this log could not be written (disk full?)\nc\n")


@pytest.mark.parametrize("text, want", [("unix:/run/orbit/cs.sock", "unix:/run/orbit/cs.sock"),
                                        ("/run/orbit/cs.sock", "unix:/run/orbit/cs.sock"),
                                        ("127.0.0.1:4000", "127.0.0.1:4000")])
def test_code_server_addresses_parse(text, want):
    address = CodeServerAddress.parse(text)
    assert str(address) == want and ("grpc_server:" in address.workspace_yaml())
    assert "location_name: orbit_dagster.definitions" in address.workspace_yaml()


@pytest.mark.parametrize("text", ["unix:relative.sock", "localhost", "host:port", "h:70000", "unix:/" + "x" * 120])
def test_a_bad_code_server_address_names_the_setting_and_the_fix(text):
    with pytest.raises(OrbitError) as err:
        CodeServerAddress.parse(text)
    assert err.value.field == "ORBIT_CODE_SERVER" and "fix:" in str(err.value)


def test_a_second_daemon_lock_is_refused_naming_the_holder_and_a_dead_holders_file_blocks_nothing(tmp_path):
    first = DaemonLock(tmp_path)
    first.acquire("orbit daemon")
    second = DaemonLock(tmp_path)
    with pytest.raises(OrbitError) as err:
        second.acquire("orbit daemon", wait_s=0)
    text = str(err.value)
    assert f"pid {os.getpid()}" in text and "since" in text and str(first.path) in text and "\n" not in text
    first.release()
    # What a SIGKILLed daemon leaves: the file, naming a process that is gone. Not the lock.
    first.path.write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "elsewhere", "daemon_ids": ["a"]}))
    second.acquire("orbit daemon", wait_s=0)
    assert second.record["pid"] == os.getpid() and second.known_ids() == {"a"}
    second.release()


def test_only_live_heartbeats_of_unknown_daemons_are_foreign():
    beats = {"SENSOR": (5.0, "theirs"), "SCHEDULER": (5.0, "ours"), "MONITORING": (300.0, "old")}
    assert foreign_heartbeats(beats, {"ours"}) == {"SENSOR": (5.0, "theirs")}


def test_a_killed_supervisors_private_directory_is_removed_by_the_next_one(tmp_path):
    from orbit_dagster.deploy.code_server import PRIVATE_PREFIX, sweep_stale

    dead = tmp_path / f"{PRIVATE_PREFIX}{2 ** 22 + 1}-abc"
    live = tmp_path / f"{PRIVATE_PREFIX}{os.getpid()}-def"
    for d in (dead, live):
        d.mkdir()
        (d / "workspace.yaml").write_text("x")
    sweep_stale(tmp_path)
    assert not dead.exists() and live.exists()
