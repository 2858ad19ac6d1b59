"""Reclaim-notice watcher: the cloud's metadata endpoint, and SIGTERM; and AWS's rebalance recommendation.

AWS publishes `GET /latest/meta-data/spot/instance-action` (404 until a reclaim is
scheduled, then `{"action": "terminate", "time": ISO8601}`) about two minutes before the
end; GCP gives 30 s and sends ACPI shutdown (SIGTERM to us). The simulated market serves
the same endpoint on loopback, so this code path is the one production uses.

AWS also publishes `GET /latest/meta-data/events/recommendations/rebalance` (404, then
`{"noticeTime": ISO8601}`) when the instance is at elevated risk of a reclaim, often well
before the notice. It is polled at the same cadence, with the same IMDSv2 token, after the
instance-action (a notice is never delayed by it); the first one seen calls `on_rebalance`
once. It is not a notice: the workload goes on (the agent may take a durable checkpoint).
"""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Callable

INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_S = 21600
# How long the SDK waits for a step boundary after a notice before it writes the in-memory
# snapshot instead (the agent's --notice-grace).
NOTICE_GRACE_S = 5.0


def parse_notice_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


class NoticeWatcher:
    """Sets `notice` (a dict with source, deadline, received_at) once; calls `on_notice`."""

    def __init__(self, metadata_url: str | None, *, poll_s: float = 1.0, on_notice: Callable[[dict], None] | None = None,
                 on_rebalance: Callable[[dict], None] | None = None):
        self.metadata_url = metadata_url.rstrip("/") if metadata_url else None
        self.poll_s = poll_s
        self.on_notice = on_notice
        self.on_rebalance = on_rebalance
        self.notice: dict | None = None
        self.rebalance: dict | None = None  # {source, notice_time, received_at} once one was seen
        self._event = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._imds_token: tuple[str, float] | None = None
        self._sigterm_at: float | None = None

    @property
    def pending(self) -> bool:
        return self._sigterm_at is not None or self._event.is_set()

    @property
    def source(self) -> str:
        return (self.notice or {}).get("source") or ("sigterm" if self._sigterm_at is not None else "unknown")

    @property
    def current(self) -> dict | None:
        """The notice (source, deadline, received_at); a SIGTERM's before its thread recorded it."""
        if self.notice is not None:
            return self.notice
        if self._sigterm_at is not None:
            return {"source": "sigterm", "deadline": None, "received_at": self._sigterm_at}
        return None

    def _fire(self, source: str, deadline: float | None) -> None:
        if self._event.is_set():
            return
        self.notice = {"source": source, "deadline": deadline, "received_at": time.time()}
        self._event.set()
        if self.on_notice:
            self.on_notice(self.notice)

    def install_sigterm(self) -> None:
        def handler(signum, frame):  # noqa: ARG001
            # A signal handler runs on the main thread between two bytecodes, possibly while
            # that thread holds a lock the notice's bookkeeping needs (the event writer's):
            # so it only sets a flag and hands the rest to a thread of its own.
            if self._sigterm_at is None:
                self._sigterm_at = time.time()
                threading.Thread(target=self._fire, args=("sigterm", None), name="sigterm", daemon=True).start()

        signal.signal(signal.SIGTERM, handler)

    def _token(self) -> str | None:
        """An IMDSv2 session token (required on current AMIs); None where only v1 is served."""
        if self._imds_token and time.time() < self._imds_token[1]:
            return self._imds_token[0]
        req = urllib.request.Request(self.metadata_url + TOKEN_PATH, method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                token = resp.read().decode().strip()
        except (urllib.error.URLError, OSError):
            return None
        self._imds_token = (token, time.time() + TOKEN_TTL_S / 2)
        return token

    def _get(self, path: str, headers: dict) -> dict | None:
        """The endpoint's JSON object, or None (404: nothing yet; unreachable; not JSON)."""
        try:
            req = urllib.request.Request(self.metadata_url + path, headers=headers)
            with urllib.request.urlopen(req, timeout=2) as resp:
                body = json.loads(resp.read().decode() or "{}")
        except (urllib.error.URLError, OSError, ValueError):  # HTTPError (404 included) is a URLError
            return None
        return body if isinstance(body, dict) else None

    def poll_once(self) -> bool:
        if not self.metadata_url or self._event.is_set():
            return self._event.is_set()
        token = self._token()
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        body = self._get(INSTANCE_ACTION_PATH, headers)
        if body is not None and body.get("action") in ("terminate", "stop", "hibernate"):
            self._fire("metadata", parse_notice_time(body.get("time", "")))
            return True
        if self.rebalance is None:
            recommendation = self._get(REBALANCE_PATH, headers)
            if recommendation is not None and "noticeTime" in recommendation:
                self.rebalance = {"source": "metadata", "received_at": time.time(),
                                  "notice_time": parse_notice_time(str(recommendation["noticeTime"]))}
                if self.on_rebalance:
                    self.on_rebalance(dict(self.rebalance))
        return self._event.is_set()

    def start(self) -> "NoticeWatcher":
        if self.metadata_url and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="notice-watcher", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and not self._event.is_set():
            self.poll_once()
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()
