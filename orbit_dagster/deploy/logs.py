"""What the supervisor of `orbit daemon` / `orbit ui` writes of its children's output.

- No colour codes, and none of the lines every sensor tick and run-monitoring pass print
  (errors and warnings always stay).
- A full or failing disk under the storage makes every tick fail with the same error and
  its traceback (a SQLite "disk I/O error" per tick: hundreds a day of the same lines). Such
  records are collapsed: the first one is said in one line with the fix, then one line a
  minute counts the rest, and one line says when a minute passed without any
  (`DiskNotices`).
- The log itself may sit on the full disk: a line that cannot be written is counted, and
  the count is written once writing works again; the child's pipe is always drained, so a
  child never blocks on its own output.
"""
from __future__ import annotations

import os
import re
import select
import sys
import threading
import time
from typing import IO, Callable

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# INFO lines that every tick repeats (Dagster 1.13's sensor, schedule, monitoring and
# queue daemons): dropped from the logs. Anything that launches, fails or warns stays.
TICK_NOISE = re.compile(
    r" - (?:DEBUG|INFO) - (?:"
    r"Checking for new runs for (?:sensor|the following schedules)|Not checking for new runs for sensor"
    r"|Sensor \S+ skipped|No run requests returned|No new tick times to evaluate"
    r"|Collected \d+ runs? for monitoring|Checking run [0-9a-f-]+"
    r"|Retrieved \d+ queued runs?|Poll(?:ing)? for new runs"
    r"|No backfill jobs|No (?:new )?asset backfills"
    r"|Priority sorting and checking tag concurrency limits|Skipping \d+ runs? for sensor"
    r")"
    # Runs' DEBUG events (step starts, resources, captured logs): each run's page in the UI
    # has them; their INFO lines and anything worse stay here.
    r"| - dagster - DEBUG - "
)
# The webserver's access log: the UI polls every few seconds. Errors (4xx, 5xx) stay.
ACCESS_OK = re.compile(r'^INFO:\s+\S+ - "[A-Z]+ [^"]*" [23]\d\d\b')
# Once asked to stop, dagster-daemon tears its workspace down while sensor ticks already
# handed to its threads are still running; each then logs "tick caught an error" and a
# traceback. Ticks cut off by the stop, not failures: after the stop begins, those lines
# (and any line that is not a log record, i.e. a traceback's) are counted in one line.
CUT_OFF_TICK = re.compile(r" - ERROR - (?:(?:Sensor|Schedule) tick caught an error|Sensor daemon caught an error for)")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
# What a full or failing disk looks like from SQLite, PostgreSQL and the OS.
DISK_ERROR = re.compile(r"disk I/O error|database or disk is full|No space left on device|\[Errno 28\]"
                        r"|could not extend file|DiskFull")
NOTICE_EVERY_S = 60.0
RECORD_IDLE_S = 0.5  # a record (a line and its traceback) is complete after this long without a line


def clean_line(line: str) -> str | None:
    """A log line without colour codes; None for per-tick noise."""
    text = ANSI.sub("", line)
    return None if TICK_NOISE.search(text) or ACCESS_OK.search(text) else text


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class SafeWriter:
    """Writes lines to `out`; a line the file system refuses is counted, not raised."""

    def __init__(self, out: IO[str]):
        self.out = out
        self.lost = 0
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            try:
                if self.lost:
                    self.out.write(f"{_stamp()} orbit: {self.lost} log lines lost: this log could not be written "
                                   "(disk full?)\n")
                    self.lost = 0
                self.out.write(text)
                self.out.flush()
            except (OSError, ValueError):
                self.lost += text.count("\n") or 1


class DiskNotices:
    """Disk errors from any child, said once, then counted one line a minute."""

    def __init__(self, where: str, write: Callable[[str], None]):
        self.where = where
        self.write = write
        self.lock = threading.Lock()
        self.first_at: float | None = None  # the current episode's first error
        self.last_at = 0.0
        self.window_at = 0.0
        self.counts: dict[str, int] = {}
        self.total = 0
        self.last_error = ""

    @property
    def fix(self) -> str:
        return (f"fix: free space on the file system holding {self.where} (df -h {self.where}); "
                "ticks resume by themselves once it has room")

    def record(self, child: str, text: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        error = _error_line(text)
        with self.lock:
            self.last_at, self.last_error, self.total = now, error, self.total + 1
            if self.first_at is None:
                self.first_at = self.window_at = now
                self.write(f"{_stamp()} orbit: {child}: disk full or failing: {error!r}; further disk errors are "
                           f"counted, one line a minute; {self.fix}\n")
                return
            self.counts[child] = self.counts.get(child, 0) + 1
        self.tick(now)

    def tick(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self.lock:
            if self.first_at is None or now - self.window_at < NOTICE_EVERY_S:
                return
            if self.counts:
                n = sum(self.counts.values())
                who = ", ".join(f"{name} {count}" for name, count in sorted(self.counts.items()))
                self.write(f"{_stamp()} orbit: disk errors go on: {n} in the last {now - self.window_at:.0f} s "
                           f"({who}; last: {self.last_error!r}); {self.fix}\n")
                self.counts = {}
                self.window_at = now
            elif now - self.last_at >= NOTICE_EVERY_S:
                self.write(f"{_stamp()} orbit: no disk error for {now - self.last_at:.0f} s: the storage is "
                           f"writable again ({self.total} disk errors since "
                           f"{time.strftime('%H:%M:%S', time.localtime(self.first_at))})\n")
                self.first_at, self.total = None, 0


def _error_line(text: str) -> str:
    """The line of a record that names the disk error (a traceback's last such line)."""
    hits = [line.strip() for line in text.splitlines() if DISK_ERROR.search(line)]
    line = hits[-1] if hits else text.strip().splitlines()[0]
    return line[:240]


class LogPump:
    """Reads one child's output (a pipe of bytes), groups it into records, writes what stays."""

    def __init__(self, name: str, fd: int, writer: SafeWriter, notices: DiskNotices | None,
                 stopping: threading.Event):
        self.name, self.fd, self.writer, self.notices, self.stopping = name, fd, writer, notices, stopping
        self.cut_off = 0
        self.record: list[str] = []
        self.record_at = 0.0

    def run(self) -> None:
        buf = b""
        while True:
            ready, _, _ = select.select([self.fd], [], [], RECORD_IDLE_S)
            if ready:
                try:
                    data = os.read(self.fd, 1 << 16)
                except OSError:
                    data = b""
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    self.line(raw.decode(errors="replace") + "\n")
            elif self.record and time.time() - self.record_at >= RECORD_IDLE_S:
                self.flush()
        if buf:
            self.line(buf.decode(errors="replace") + "\n")
        self.flush()

    def line(self, line: str) -> None:
        text = ANSI.sub("", line)
        if LOG_LINE.match(text) or not self.record:
            self.flush()
        self.record.append(text)
        self.record_at = time.time()

    def flush(self) -> None:
        record, self.record = self.record, []
        if not record:
            return
        if self.notices is not None and DISK_ERROR.search("".join(record)):
            self.notices.record(self.name, "".join(record))
            return
        if TICK_NOISE.search(record[0]):
            return
        for text in record:
            if ACCESS_OK.search(text):
                continue
            if self.stopping.is_set() and (CUT_OFF_TICK.search(text) or not LOG_LINE.match(text)):
                self.cut_off += 1
                continue
            self.writer.write(text)


def say(line: str) -> None:
    """A status line of orbit's own, on stderr, with the time (the children's logs carry theirs)."""
    try:
        print(f"{_stamp()} orbit: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr on a full disk: the services go on
        pass
