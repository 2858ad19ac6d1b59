"""Operating the instance: `workspace.yaml` validates; `orbit daemon` and `orbit ui` say what they
wait for, log without colour codes or per-tick lines, listen on 127.0.0.1 only, share one code
server and stop on SIGTERM even when started with SIGTERM/SIGINT ignored (a shell's background
job); `orbit code-server` serves a daemon pointed at it; on the
team profile, a run worker killed outright is retried and the job finishes on its first
attempt, launched once."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import dagster as dg
import pytest

from orbit_dagster.control.submit import submit
from orbit_dagster.deploy.instance import Daemon, dagster_instance, ensure_dagster_home, wait_for_daemon
from orbit_dagster.deploy.services import ANSI, TICK_NOISE
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from tests.daemon_support import code_servers
from tests.helpers import wait_for
from tests.postgres import postgres, team_profile  # noqa: F401 - fixtures

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ignore_stop_signals() -> None:
    # What `cmd &` from a script does to its job: SIGINT (and here SIGTERM too) ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.setsid()


def start(args, out: Path, err: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", *args], stdout=open(out, "w"),
                            stderr=open(err, "w"), stdin=subprocess.DEVNULL, preexec_fn=ignore_stop_signals)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def control_plane(pids: set[int]) -> dict[int, str]:
    """The live ones among `pids`, without the sim market's hosts and their workloads: those
    are rented machines, which outlive the control plane by design."""
    out = {}
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("Z", "X"):  # exited, waiting for the init process to reap it: not running
            continue
        if "orbit_dagster.providers.sim.host" not in cmd and "orbit_dagster.runtime.agent" not in cmd:
            out[pid] = cmd[:200]
    return out


def stop_and_time(proc: subprocess.Popen) -> float:
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return time.time() - t


def assert_clean_log(text: str) -> None:
    assert not ANSI.search(text), "colour codes in the log"
    noisy = [line for line in text.splitlines() if TICK_NOISE.search(line)]
    assert not noisy, noisy[:3]
    # A warning of a Dagster API we use on purpose is filtered where we use it; one that is not
    # is said once, not on every tick or reload.
    warned = Counter(re.sub(r"^[\d:,. -]+", "", line) for line in text.splitlines() if "Warning" in line)
    repeated = [line for line, n in warned.items() if n > 1]
    assert not repeated, repeated[:3]


def test_workspace_yaml_validates(orbit_home):
    env = {**os.environ, "DAGSTER_HOME": str(ensure_dagster_home(Settings.from_env(orbit_home)))}
    proc = subprocess.run([str(Path(sys.executable).with_name("dagster")), "definitions", "validate",
                           "-w", str(REPO / "workspace.yaml")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "orbit_dagster.definitions" in proc.stdout + proc.stderr


def test_orbit_daemon_says_what_it_waits_for_logs_cleanly_and_stops_on_sigterm(orbit_home, tmp_path):
    out, err = tmp_path / "daemon.out", tmp_path / "daemon.err"
    proc = start(["daemon"], out, err)
    try:
        wait_for(lambda: "daemon up after" in err.read_text(), timeout=180, every=1, what="the daemon's heartbeat")
        lines_up = len(out.read_text().splitlines())
        # A job: its launch is worth a line; the idle ticks around it are not.
        settings = Settings.from_env(orbit_home)
        job = submit(settings, "charlm-finetune", {"config.steps": 8, "checkpoint.every_steps": 8}, experiment="op")
        wait_for(lambda: R.require_job(settings.ledger(), job)["state"] == "SUCCEEDED", timeout=240, every=1,
                 what="the job")
        time.sleep(15)  # a few more idle ticks of every sensor
        children = descendants(proc.pid)
        assert children, "the supervisor runs dagster-daemon as its child"
        took = stop_and_time(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # Stopped politely (a hang would take the supervisor's SIGKILL after STOP_TIMEOUT_S, and say so).
    assert proc.returncode == 0 and took < 120, (proc.returncode, took)
    alive = control_plane(children)
    assert not alive, f"left running after SIGTERM: {alive}"
    status = err.read_text()
    assert "waiting for the Dagster daemon's first heartbeat" in status and "SIGTERM: stopping" in status
    log = out.read_text()
    assert_clean_log(log)
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:1500]  # the stop included
    assert "Creating new run for job_queue_sensor" in log or "Launching run for job_queue_sensor" in log
    # (a bound, not a tick budget: on a loaded machine the code server reloads and logs its warnings more)
    assert lines_up < 20 and len(log.splitlines()) < 400, len(log.splitlines())


def test_orbit_ui_listens_on_loopback_only_and_stops_with_its_daemon(orbit_home, tmp_path):
    port = free_port()
    out, err = tmp_path / "ui.out", tmp_path / "ui.err"
    proc = start(["ui", "--port", str(port)], out, err)
    try:
        wait_for(lambda: "UI ready at" in err.read_text(), timeout=240, every=1, what="the UI")
        wait_for(lambda: "daemon up after" in err.read_text(), timeout=180, every=1, what="its daemon")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as resp:
            assert resp.status == 200
        for _ in range(5):  # the UI's polling would fill an access log
            urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10).close()
        listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        ours = [f[1] for f in listening if f[3] == "0A" and f[1].endswith(f":{port:04X}")]
        assert ours == [f"0100007F:{port:04X}"], ours  # 127.0.0.1 only
        assert not [f for f in Path("/proc/net/tcp6").read_text().splitlines()[1:] if f":{port:04X}" in f.split()[1]]
        # One code server, shared by the webserver and the daemon (each used to start its own).
        assert len(code_servers(orbit_home)) == 1, code_servers(orbit_home)
        children = descendants(proc.pid)
        took = stop_and_time(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # Stopped politely (a hang would take the supervisor's SIGKILL after STOP_TIMEOUT_S, and say so).
    assert proc.returncode == 0 and took < 120, (proc.returncode, took)
    assert not control_plane(children)
    web, daemon_log = out.read_text(), (orbit_home / "dagster" / "daemon.log").read_text()
    assert_clean_log(web)
    assert_clean_log(daemon_log)
    assert "/server_info" not in web  # 200s of the access log are dropped
    assert re.search(r"Serving dagster-webserver on http://127\.0\.0\.1:\d+", web)


def test_orbit_code_server_serves_a_daemon_pointed_at_it_and_outlives_its_stop(orbit_home, tmp_path):
    """The code server as a service of its own (systemd, docs/deploy.md): `orbit daemon` with
    ORBIT_CODE_SERVER starts none, uses that one, and leaves it running when stopped."""
    socket = tmp_path / "cs.sock"
    server = start(["code-server", "--socket", str(socket)], tmp_path / "cs.out", tmp_path / "cs.err")
    daemon = None
    try:
        wait_for(lambda: "code server answers at" in (tmp_path / "cs.err").read_text(), timeout=240, every=1,
                 what="the code server")
        env = {**os.environ, "ORBIT_CODE_SERVER": f"unix:{socket}"}
        daemon = subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", "daemon"], env=env,
                                  stdout=open(tmp_path / "d.out", "w"), stderr=open(tmp_path / "d.err", "w"),
                                  stdin=subprocess.DEVNULL, preexec_fn=ignore_stop_signals)
        wait_for(lambda: "daemon up after" in (tmp_path / "d.err").read_text(), timeout=180, every=1,
                 what="the daemon's heartbeat")
        assert code_servers(orbit_home) == [server_pid(server)]
        assert stop_and_time(daemon) < 30 and daemon.returncode == 0
        assert server.poll() is None and code_servers(orbit_home) == [server_pid(server)]
        status = (tmp_path / "d.err").read_text()
        assert "started code server" not in status and f"using the code server at unix:{socket}" in status
        assert stop_and_time(server) < 30 and server.returncode == 0
    finally:
        for p in (server, daemon):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def server_pid(supervisor: subprocess.Popen) -> int:
    (pid,) = [p for p in descendants(supervisor.pid) if b"api\0grpc" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


@pytest.mark.slow  # minutes of a whole machine: `make test-all`
def test_a_killed_run_worker_is_retried_and_the_attempt_launches_once(team_profile, orbit_home, monkeypatch):
    monkeypatch.setenv("ORBIT_FOLLOW", "run")  # a run follows the attempt: it is that run's worker that dies
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    daemon = Daemon(settings).start()
    try:
        wait_for_daemon(settings, timeout_s=180)
        job = submit(settings, "charlm-finetune", {"config.steps": 600, "config.micro_batch": 4,
                                                   "config.grad_accum": 1, "checkpoint.every_steps": 300},
                     experiment="crash")

        def step() -> int:
            return ledger.scalar("SELECT coalesce(max(step), 0) FROM metric_points WHERE job_id = ?", [job]) or 0

        wait_for(lambda: step() >= 30, timeout=300, every=1, what="the attempt training")
        first = R.run(ledger, R.run_id_for(job, 1))
        with dagster_instance(settings) as instance:
            starts = instance.all_logs(first["dagster_run_id"], of_type=dg.DagsterEventType.STEP_START)
        worker = starts[0].dagster_event.pid
        os.kill(worker, signal.SIGKILL)  # the run worker dies; the host and its workload do not
        before = step()
        wait_for(lambda: R.require_job(ledger, job)["state"] == "SUCCEEDED", timeout=480, every=2,
                 what="the job to finish after its run worker was killed")
        with dagster_instance(settings) as instance:
            def ended() -> list:
                records = instance.get_run_records(dg.RunsFilter(job_name="train_job", tags={"orbit/job": job}))
                return [r.dagster_run for r in records] if all(r.dagster_run.is_finished for r in records) else []

            runs = wait_for(ended, timeout=120, every=2, what="the job's training runs to end")
            dead = instance.get_run_by_id(first["dagster_run_id"])
    finally:
        daemon.stop()
    # Dagster saw the worker die and ran the run again; that retry re-attached and finished the
    # attempt, and orbit's own re-attach stood back (no second follower).
    assert dead.status == dg.DagsterRunStatus.FAILURE and dead.tags.get("dagster/will_retry") == "true"
    retries = [r for r in runs if r.tags.get("dagster/parent_run_id") == dead.run_id]
    assert [r.status for r in retries] == [dg.DagsterRunStatus.SUCCESS]
    assert not [r for r in runs if "orbit/reattach" in r.tags]
    # The attempt was launched once: one ledger run, one training host, and it kept its steps.
    assert ledger.rows("SELECT attempt, state FROM runs WHERE job_id = ?", [job]) == [{"attempt": 1,
                                                                                        "state": "SUCCEEDED"}]
    assert ledger.scalar("SELECT count(*) FROM instances WHERE job_id = ? AND purpose = 'train'", [job]) == 1
    assert R.interruptions(ledger, job) == 0 and before >= 30
    print("runs after the kill:", [(r.run_id[:8], r.status.value, r.tags.get("dagster/parent_run_id", "")[:8],
                                    r.tags.get("orbit/reattach")) for r in runs])
