"""One simulated spot instance: `python -m orbit_dagster.providers.sim.host INSTANCE_DIR`.

A real local process that plays the machine: it serves the AWS-compatible metadata endpoint
on loopback, runs the workload it is asked to launch (launch.json) as its child, keeps a
heartbeat for billing, and carries out its reclaim schedule: notice at `reclaim_at -
notice_seconds`, SIGTERM at `reclaim_at`, SIGKILL `grace_seconds` later, then its local
disk (`work/`) is wiped, as a reclaimed VM's would be. The market's operator may also have
it serve AWS's rebalance recommendation, now or once the workload reaches a training step.
Everything it knows is in files in INSTANCE_DIR, so a new control-plane process can
re-attach at any time.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ...core.host_contract import EVENTS_FILE, STEP_EVENTS, read_file
from ...core.process_tree import HOST_TAG, kill_tagged
from ..jsonfiles import read_json as _read_json
from ..jsonfiles import write_json

TICK_S = 0.05
HEARTBEAT_S = 0.5



def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class Host:
    def __init__(self, root: Path):
        self.root = root
        self.spec = json.loads((root / "instance.json").read_text())
        self.work = root / "work"
        self.work.mkdir(exist_ok=True)
        self.child: subprocess.Popen | None = None
        self.launched = 0  # the `seq` of the last workload started (a kept node takes several)
        self.cwd = ""
        self._log = None
        self.started_at = time.time()
        self.notice_at: float | None = None
        self.reclaim_step: tuple[int, float] | None = None  # (training step, notice seconds)
        self.rebalance_step: int | None = None  # the training step that brings the recommendation
        self._progress_files: list[Path] = []  # whose steps count (a group's nodes'); default its own
        self._events_offsets: dict[Path, int] = {}
        self._step_seen = -1  # the highest training step read from the progress files so far
        reclaim_at = self.spec.get("reclaim_at")
        self.reclaim_at: float | None = float(reclaim_at) if reclaim_at is not None else None
        if self.reclaim_at is not None:
            self.notice_at = self.reclaim_at - float(self.spec.get("notice_seconds", 120))
        self.state = {
            "status": "running",
            "pid": os.getpid(),
            "started_at": self.started_at,
            "heartbeat_at": self.started_at,
            "metadata_port": None,
        }

    # ---- metadata endpoint --------------------------------------------------------
    def serve_metadata(self) -> int:
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.rstrip("/") == "/latest/meta-data/spot/instance-action":
                    if host.notice_at is not None and time.time() >= host.notice_at:
                        body = json.dumps({"action": "terminate", "time": iso(host.reclaim_at)}).encode()
                        return self._send(200, body, "application/json")
                    return self._send(404, b"Not Found", "text/plain")
                if self.path.rstrip("/") == "/latest/meta-data/events/recommendations/rebalance":
                    # Written once the operator's order (`SimProvider.inject_rebalance`) is due
                    # (`serve_rebalance`): AWS's recommendation, 404 until then, as EC2 serves it.
                    try:
                        return self._send(200, (host.root / "rebalance.json").read_bytes(), "application/json")
                    except OSError:
                        return self._send(404, b"Not Found", "text/plain")
                if self.path.rstrip("/") == "/latest/meta-data/instance-id":
                    return self._send(200, host.spec["instance_id"].encode(), "text/plain")
                return self._send(404, b"Not Found", "text/plain")

            def do_PUT(self):  # noqa: N802 - IMDSv2: a session token, as EC2 hands out
                if self.path.rstrip("/") == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(200, f"sim-{host.spec['instance_id']}".encode(), "text/plain")
                return self._send(400, b"Bad Request", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                return

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server.server_address[1]

    # ---- lifecycle ----------------------------------------------------------------
    def save_state(self, **changes) -> None:
        self.state.update(changes)
        try:
            write_json(self.root / "state.json", self.state)
        except OSError:
            # A full disk does not stop a machine: the file is written again at the next
            # heartbeat (a real VM's meter runs on whatever its disk holds).
            (self.root / f"state.json.tmp{os.getpid()}").unlink(missing_ok=True)

    def maybe_launch(self) -> None:
        req = self.root / "launch.json"
        if not req.exists() or self.child is not None and self.child.poll() is None:
            return
        launch = json.loads(req.read_text())
        if self.child is not None:  # the last workload ended: a new one only when asked for (a kept node)
            ended = (_read_json(self.root / "child_exit.json") or {}).get("seq")
            if int(launch.get("seq", 1)) <= self.launched or ended != self.launched:
                return
        self.launched = int(launch.get("seq", 1))
        env = {k: v for k, v in os.environ.items() if k in set(launch.get("forward_env", []))}
        env.update(launch["env"])
        env["PATH"] = os.environ.get("PATH", "")
        env[HOST_TAG] = str(self.root)  # inherited by everything the agent starts (core/process_tree.py)
        self.cwd = launch["cwd"]
        if self._log is not None:
            self._log.close()
        self._log = open(Path(launch["cwd"]) / "agent.log", "ab")
        self.child = subprocess.Popen(  # argv list, never a shell string
            launch["argv"], cwd=launch["cwd"], env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        write_json(self.root / "child.json", {"pid": self.child.pid, "launched_at": time.time(), "cwd": launch["cwd"],
                                              "seq": self.launched})

    def reap(self) -> None:
        if self.child is not None and self.child.poll() is not None and (
                _read_json(self.root / "child_exit.json") or {}).get("seq", 0) != self.launched:
            # The agent is gone: so is everything it started (a rank in its own session, a
            # script whose agent was killed), as on a machine whose workload ended.
            kill_tagged(HOST_TAG, str(self.root))
            try:
                write_json(self.root / "child_exit.json", {"returncode": self.child.returncode, "at": time.time(),
                                                           "cwd": self.cwd, "seq": self.launched})
            except OSError:  # a full disk: tried again at the next tick
                (self.root / f"child_exit.json.tmp{os.getpid()}").unlink(missing_ok=True)

    def stop_child(self, grace_s: float) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        self.child.send_signal(signal.SIGTERM)
        try:
            self.child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        kill_tagged(HOST_TAG, str(self.root))
        self.reap()

    def shutdown(self, status: str, reason: str, *, wipe: bool) -> None:
        # Announce the end before it happens: whoever watches sees "reclaiming", never a
        # workload killed by a signal on a host that still looks healthy.
        self.save_state(status={"reclaimed": "reclaiming"}.get(status, "terminating"), reason=reason)
        self.stop_child(float(self.spec.get("grace_seconds", 5)))
        if wipe:
            shutil.rmtree(self.work, ignore_errors=True)  # a reclaimed VM's local disk is gone
        now = time.time()
        self.save_state(status=status, stopped_at=now, heartbeat_at=now, reason=reason)

    def maybe_schedule_reclaim(self) -> None:
        """An injected reclaim (the market's operator, or a test) in `reclaim.json`."""
        req = self.root / "reclaim.json"
        if not req.exists():
            return
        spec = json.loads(req.read_text())
        notice = float(spec.get("notice_seconds", self.spec.get("notice_seconds", 120)))
        if "at_step" in spec:  # when the workload reaches a step: see maybe_reclaim_at_step
            self.reclaim_step = (int(spec["at_step"]), notice)
            self._progress_files = [Path(f) for f in spec.get("progress_files", [])]
        else:
            self._reclaim(float(spec["reclaim_at"]), notice)
        req.rename(self.root / f"reclaim-applied-{time.time_ns()}.json")

    def _reclaim(self, at: float, notice_s: float) -> None:
        if self.reclaim_at is None or at < self.reclaim_at:
            self.reclaim_at = at
            self.notice_at = at - notice_s

    def progress_step(self) -> int:
        """The highest training step the workload's event stream shows (on a group, any of its
        nodes' streams: `progress_files`), read incrementally, every tick, while a trigger waits."""
        for path in self._progress_files or [self.work / "artifacts" / EVENTS_FILE]:
            try:  # a line still being written waits for the next tick
                entries, self._events_offsets[path] = read_file(path, self._events_offsets.get(path, 0))
            except OSError:
                continue
            self._step_seen = max([self._step_seen, *(ev.step for ev in entries if isinstance(ev, STEP_EVENTS))])
        return self._step_seen

    def maybe_reclaim_at_step(self) -> None:
        """A reclaim set by training progress: the notice as soon as the workload reports the step."""
        if self.reclaim_step is None:
            return
        step, notice = self.reclaim_step
        if self.progress_step() >= step:
            now = time.time()
            self._reclaim(now + notice, notice)
            self.reclaim_step = None

    def maybe_schedule_rebalance(self) -> None:
        """An injected rebalance recommendation (the market's operator, or a test) in
        `rebalance-order.json`: served now, or once the workload reports `at_step`."""
        req = self.root / "rebalance-order.json"
        if not req.exists():
            return
        spec = json.loads(req.read_text())
        if "at_step" in spec:
            self.rebalance_step = int(spec["at_step"])
            self._progress_files = [Path(f) for f in spec.get("progress_files", [])] or self._progress_files
        else:
            self.serve_rebalance()
        req.rename(self.root / f"rebalance-order-applied-{time.time_ns()}.json")

    def maybe_rebalance_at_step(self) -> None:
        """A recommendation set by training progress: served from the tick that reads the step,
        so what follows it (the agent's poll, its early checkpoint, the control plane's
        decision) starts at the same step on a fast machine or a slow one."""
        if self.rebalance_step is not None and self.progress_step() >= self.rebalance_step:
            self.rebalance_step = None
            self.serve_rebalance()

    def serve_rebalance(self) -> None:
        """From now on the metadata endpoint serves the recommendation, stamped now, as EC2 does."""
        if not (self.root / "rebalance.json").exists():
            write_json(self.root / "rebalance.json",
                       {"noticeTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})

    def run(self) -> None:
        port = self.serve_metadata()
        self.save_state(metadata_port=port)
        last_beat = 0.0
        while True:
            now = time.time()
            self.maybe_launch()
            self.maybe_schedule_reclaim()
            self.maybe_reclaim_at_step()
            self.maybe_schedule_rebalance()
            self.maybe_rebalance_at_step()
            self.reap()
            term = self.root / "terminate.json"
            if term.exists():
                reason = json.loads(term.read_text()).get("reason", "terminated")
                return self.shutdown("terminated", reason, wipe=False)
            if self.reclaim_at is not None and now >= self.reclaim_at:
                return self.shutdown("reclaimed", "spot reclaim", wipe=True)
            if now - last_beat >= HEARTBEAT_S:
                self.save_state(heartbeat_at=now)
                last_beat = now
            time.sleep(TICK_S)


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    host = Host(root)
    # Terminating the supervisor politely (SIGTERM) is a termination, not a crash.
    signal.signal(signal.SIGTERM, lambda *_: (host.shutdown("terminated", "sigterm", wipe=False), sys.exit(0)))
    host.run()


if __name__ == "__main__":
    main()
