"""Command workloads: the agent runs any script's argv (docs/bring-your-own.md, Route 2).

The script needs no orbit import. The agent gives it an environment (ORBIT_CHECKPOINT_DIR,
ORBIT_RESUME_FROM, ...) and placeholders in its argv, copies every line it prints to the
attempt's log (the agent's stdout), turns JSON metric lines (stdout or ORBIT_METRICS_FILE)
into `metrics` events, registers each complete checkpoint the watcher finds in the checkpoint
directory into the store, forwards a reclaim notice (the stop file, then `stop_signal`) and
waits within the grace for the script to exit and its last checkpoint to land. A checkpoint
written after the notice is reported as a `local_checkpoint` before its upload begins (single
instance only; see CommandRun). The exit code is the agent's one taxonomy (runtime/agent.py).

The script runs in the agent's process group (a sweep of the host's group reaches it) and
dies with the agent: it is killed if still alive when the agent returns, and the kernel kills
it if the agent itself is killed (PR_SET_PDEATHSIG, Linux).
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from ..core import placeholders, process_tree
from ..core.host_contract import Checkpoint, Evaluation, Loaded, LocalCheckpoint, Metrics, Resumed
from ..storage.base import MANIFEST, CheckpointManifest, StoreError, checkpoint_dir_name
from . import group
from .checkpoint_schedule import CheckpointSchedule
from .exits import EXIT_OK, EXIT_USER_ERROR, CheckpointMismatch
from .files import collect_files, store_files
from .group import NodeGroup
from .script_output import exit_code_for, metric_line
from .watcher import CheckpointWatcher, Found, shards_format

STDERR_TAIL_LINES = 50
MAX_LINE = 1 << 20  # bytes of one line read at a time: a longer one is log output in pieces
POLL_S = 0.25
KILL_MARGIN_S = 1.0  # before a notice's deadline: the script is killed this early, the agent reports
MTIME_MARGIN_S = 0.02  # a file's mtime may trail time.time() by a clock tick (see _after_notice)


class CommandError(Exception):
    """A checkpoint that cannot be used by a command workload (not one it wrote)."""


try:  # resolved here, not in the forked child (where another thread may have held a lock)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the agent's own kill on exit still holds
    _PRCTL = None


def _die_with_parent() -> None:  # in the child, before exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills the script when the agent dies


def _entry_name(value: object) -> str:
    """The name a script gave its checkpoint (from a manifest, i.e. from a host): one path component."""
    name = str(value or "")
    if not name or "/" in name or "\\" in name or name in (".", "..") or not name.isprintable() or len(name) > 255:
        raise CommandError(f"checkpoint name {name[:80]!r} is not a file name")
    return name


def torchrun_argv(argv: list[str], processes: int, group: NodeGroup | None = None) -> list[str]:
    """The command under torchrun on this instance, one rank a process: a Python script
    (`python train.py ...`, `python -m pkg ...`) as torchrun's own entrypoint, any other
    program with `--no-python`. torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT and forwards a SIGTERM to every rank. One node of a group meets the others at
    the group's c10d rendezvous instead of standing alone (runtime/group.py)."""
    where = group.launcher_args() if group is not None else ["--standalone"]
    launcher = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(processes)]
    if argv[0] != "python":
        return [*launcher, "--no-python", *argv]
    if len(argv) > 2 and argv[1] == "-m":
        return [*launcher, "--module", *argv[2:]]
    return [*launcher, *argv[1:]]


class CommandRun:
    """One run of a command (train, eval, custom or collect).

    A checkpoint the script wrote after the notice (tier "emergency") already lies on the
    instance's own disk, in the checkpoint directory: that is the local tier of the save
    (docs/recovery.md). Before its upload begins the agent reports it as a `local_checkpoint`
    record, so that a host gone mid-upload leaves the ledger saying what was lost
    (`emergency_upload_missed`), as an SDK job's save through the local disk does:

    - `uri`: the file URI of the checkpoint file or directory the watcher found;
    - `bytes`: the sum of its files' sizes;
    - `seconds`: from the notice (the moment the agent passed it on: stop file, then signal)
      to the newest file's mtime: the script's save, the end of the step it was in included,
      since the agent cannot tell the two apart;
    - `time_left_s`: from that mtime to the notice's deadline, when the notice gave one;
    - `sha256`: left out. Hashing the files before the upload would delay the one thing that
      makes the save durable by a pass over every byte; the digest comes with the `checkpoint`
      record, which follows once the upload's manifest commits and carries `plan_tier`
      "local", `local_seconds` (the same `seconds`) and `upload_seconds` (the upload's own).

    In a group (`group` set), node 0 reports it once it holds every node's part (fetched from
    the store into its staging directory beside its own files): the union it then uploads lies
    on its disk. `uri` is node 0's own checkpoint directory, `bytes` the union's, `seconds` from
    the group's first notice (any node's, carried in its part's manifest) to the newest file of
    the union (a fetched part's mtime is when node 0 got it), `time_left_s` to the earliest
    deadline any node was given. A group gone while node 0 still gathers leaves no record: the
    parts that came are dropped at the attempt's end (`group_parts_dropped`).
    """

    def __init__(self, *, job: dict, bundle: Path, workdir: Path, task: str, attempt: int, events, store, notices,
                 checkpoint_every: int, resume_from: str | None, eval_checkpoint: str | None,
                 expect_sha256: str | None, notice_grace: float, interval_plan: dict | None = None,
                 group: NodeGroup | None = None):
        self.job, self.template = job, job["template_snapshot"]
        self.job_id: str = job["job_id"]
        self.bundle, self.task, self.attempt = bundle, task, attempt
        self.kind = self.template.get("kind", "train") if task == "train" else "eval"
        self.events, self.store, self.notices = events, store, notices
        self.checkpoint_every, self.notice_grace = checkpoint_every, notice_grace
        self.resume_from, self.eval_checkpoint, self.expect_sha256 = resume_from, eval_checkpoint, expect_sha256
        self.workdir = workdir
        self.home = workdir / "command" / f"{task}-a{attempt}"
        shutil.rmtree(self.home, ignore_errors=True)  # never a file an earlier run left
        self.checkpoint_dir = self.home / "checkpoints"
        self.checkpoint_dir.mkdir(parents=True)
        self.metrics_file = self.home / "metrics.jsonl"
        self.metrics_file.touch()
        self.stop_file = self.home / "stop"
        self.config_file = self.home / "config.json"
        self.config_file.write_text(json.dumps(self.template.get("config", {})))
        self.schedule = CheckpointSchedule(checkpoint_every, interval_plan)  # re-decided at each durable save
        self.schedule_file = self.home / "schedule.json"
        self.schedule.publish(self.schedule_file)
        ck = self.template.get("checkpoint", {})
        self.group = group if task == "train" else None  # one node of several (runtime/group.py)
        self.watcher = CheckpointWatcher(self.checkpoint_dir, pattern=ck.get("pattern"),
                                         complete_marker=ck.get("complete_marker"),
                                         settle_seconds=float(ck.get("settle_seconds", 2.0)),
                                         metadata_elsewhere=self.group is not None)
        self.proc: subprocess.Popen | None = None
        self.tag = f"{self.job_id}.{task}-a{attempt}.{uuid.uuid4().hex[:12]}"  # in every process the run starts
        self.last_step: int | None = None
        self.failure: str | None = None
        self.eval_metrics: dict[str, float] = {}
        self._losses: dict[int, float] = {}
        self._stderr = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._lock = threading.Lock()
        self._parent = resume_from
        self._notice_at: float | None = None
        self._deadline: float | None = None  # the notice's, when it gave one (a metadata notice)
        self._kill_at: float | None = None
        self._stopped = threading.Event()
        # Metric events are written (fsynced) by a thread of their own: a chatty script never
        # waits on the disk, its pipe is read as fast as it writes.
        self._outbox: queue.Queue = queue.Queue()

    # ---- argv and environment ---------------------------------------------------------
    def argv(self, extra: dict[str, str]) -> list[str]:
        argv = self.template["command"] if self.task == "train" else self.template["eval"]["command"]
        values = {"checkpoint_dir": str(self.checkpoint_dir), "metrics_file": str(self.metrics_file),
                  "job_id": self.job_id, "attempt": str(self.attempt), "checkpoint_every": str(self.checkpoint_every),
                  "resume_from": "", **extra}
        out = [placeholders.fill(a, values, self.template.get("config", {})) for a in argv]
        processes = int(self.template.get("resources", {}).get("processes", 1))
        if self.task == "train" and (processes > 1 or self.group is not None):
            return torchrun_argv(out, processes, self.group)
        return [sys.executable if out[0] == "python" else out[0], *out[1:]]

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        runtime = str(self.bundle / "runtime")
        env["PYTHONPATH"] = runtime + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update({"ORBIT_JOB_ID": self.job_id, "ORBIT_ATTEMPT": str(self.attempt), "ORBIT_TASK": self.task,
                    "ORBIT_CHECKPOINT_DIR": str(self.checkpoint_dir), "ORBIT_RESUME_FROM": "",
                    "ORBIT_METRICS_FILE": str(self.metrics_file), "ORBIT_CHECKPOINT_EVERY": str(self.checkpoint_every),
                    "ORBIT_CONFIG": str(self.config_file), "ORBIT_STOP_FILE": str(self.stop_file),
                    "ORBIT_CHECKPOINT_SCHEDULE": str(self.schedule_file),
                    process_tree.RUN_TAG: self.tag})
        env.update(extra)
        return env

    # ---- checkpoints in and out ---------------------------------------------------------
    def _rebuild(self, uri: str, purpose: str) -> Path:
        """Fetch and verify a registered checkpoint; lay it out as the script wrote it."""
        staging = self.home / f"{purpose}-fetch"
        manifest = self.store.fetch(uri, staging)  # every file against its sha256
        if self.expect_sha256 and manifest.digest != self.expect_sha256:
            raise CheckpointMismatch(f"checkpoint {uri} has digest {manifest.digest[:12]}, the ledger recorded "
                                     f"{self.expect_sha256[:12]}")
        meta = manifest.meta or {}
        # "command": written by a command workload; "hf": a Hugging Face directory imported with
        # `orbit import-run` (control/import_hf.py), laid out the same way.
        if meta.get("format") not in ("command", "hf") or meta.get("layout") not in ("file", "dir"):
            raise CommandError(f"checkpoint {uri} was not written by a command workload (format "
                               f"{meta.get('format')!r}); it cannot be handed to this script")
        name = _entry_name(meta.get("name"))
        (staging / MANIFEST).unlink()
        dest = self.checkpoint_dir.parent / purpose / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging / name) if meta["layout"] == "file" else str(staging), str(dest))
        shutil.rmtree(staging, ignore_errors=True)
        kind = Resumed if purpose == "resume" else Loaded
        self.events.emit(kind(uri=uri, step=manifest.step, tier=manifest.tier))
        return dest

    def _files_of(self, found: Found) -> dict[str, Path]:
        if found.layout == "file":
            return {found.name: found.path}
        return {str(f.relative_to(found.path)): f for f in sorted(found.path.rglob("*")) if f.is_file()}

    def _train_loss(self, step: int) -> float | None:
        with self._lock:
            steps = [s for s in self._losses if s <= step]
            return self._losses[max(steps)] if steps else None

    def _after_notice(self, written: float) -> bool:
        """Whether the script wrote this checkpoint after the notice came: a periodic save it
        finished just before is registered after the notice (the watcher waits for files to
        settle) but is a durable one. The kernel stamps mtimes from a coarse clock (a tick,
        up to 10 ms, behind), hence the margin: a save written in the tick after the notice
        is never taken for one written before it. `written`: the files' newest mtime, when the
        script finished writing them."""
        return self._notice_at is not None and written >= self._notice_at - MTIME_MARGIN_S

    def _report_local(self, found: Found, files: dict[str, Path], written: float,
                      notice: tuple[float | None, float | None]) -> float | None:
        """The `local_checkpoint` record of an emergency save, `files` being its copy on this
        disk (see the class docstring), `written` their newest mtime and `notice` (when it came,
        its deadline) the notice it answers; returns its `seconds`, or None where the record
        could not be written. Stats only: no byte is read before the upload."""
        notice_at, deadline = notice
        seconds = round(max(0.0, written - (notice_at or written)), 6)  # an mtime may trail by a tick
        left = round(max(0.0, deadline - written), 3) if deadline else None
        try:
            self.events.emit(LocalCheckpoint(step=found.step, attempt=self.attempt, uri=found.path.absolute().as_uri(),
                                             bytes=sum(f.stat().st_size for f in files.values()), seconds=seconds,
                                             time_left_s=left))
        except OSError as exc:  # the upload matters more than its announcement: it goes on
            print(f"orbit agent: the local copy of checkpoint {found.name} was not reported: {exc}", flush=True)
            return None
        return seconds

    def register(self, found: Found) -> None:
        began = time.perf_counter()
        staging = self.home / f"parts-{found.step}"
        try:
            files = self._files_of(found)
            written = max((f.stat().st_mtime for f in files.values()), default=time.time())
            tier = "emergency" if self._after_notice(written) else "durable"
            source = self.notices.source if tier == "emergency" else None
            notice = (self._notice_at, self._deadline)
            if self.group is not None and self.group.node_rank > 0:  # its part; node 0 reports the checkpoint
                return group.store_part(self.store, self.job_id, self.attempt, self.group, found, files, tier, source,
                                        notice)
            if self.group is not None:
                parts = group.gather(self.store, self.job_id, self.attempt, found.step, self.group, staging)
                if parts is None:
                    return  # torn: a node's part never came (gather said so)
                files, tier, source = group.union(files, parts, tier, source)
                # Node 0 now holds every node's part on its own disk: the copy the upload is of.
                written = max((f.stat().st_mtime for f in files.values()), default=written)
                notice = group.earliest_notice(parts, notice)
            local_s = self._report_local(found, files, written, notice) if tier == "emergency" else None
            name = checkpoint_dir_name(found.step, self.attempt)
            upload_began = time.perf_counter()
            manifest = store_files(self.store, self.job_id, name, files, CheckpointManifest(
                job_id=self.job_id, step=found.step, tier=tier, files={}, format=shards_format(found, files),
                parent=self._parent, created_at=datetime.now(timezone.utc).isoformat(), attempt=self.attempt,
                meta={"layout": found.layout, "name": found.name, "format": "command",
                      "metrics": {k: v for k, v in [("train/loss", self._train_loss(found.step))] if v is not None}}))
            upload_s = time.perf_counter() - upload_began
            uri = self.store.uri_for(self.job_id, name)
        except (OSError, StoreError) as exc:  # the script's files, not ours: logged, the run goes on
            print(f"orbit agent: checkpoint {found.name} (step {found.step}) was not stored: {exc}", flush=True)
            return
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if self.group is not None:
            group.drop_parts(self.store, self.job_id, self.attempt, found.step, self.group)
        parent, self._parent = self._parent, uri
        self.events.emit(Checkpoint(
            step=found.step, tier=tier, uri=uri, sha256=manifest.digest, bytes=manifest.total_bytes,
            attempt=self.attempt, parent=parent, train_loss=self._train_loss(found.step),
            write_seconds=round(time.perf_counter() - began, 6), source=source,
            **({"plan_tier": "local", "local_seconds": local_s, "upload_seconds": round(upload_s, 6)}
               if local_s is not None else {})))
        decided = self.schedule.after_save(found.step) if tier == "durable" else None
        if decided is not None:
            self.events.emit(decided)
            self.schedule.publish(self.schedule_file)

    # ---- output ---------------------------------------------------------------------
    def on_line(self, text: str) -> None:
        parsed = metric_line(text)
        if parsed is None:
            return
        step, values, failure = parsed
        with self._lock:
            if failure:
                self.failure = failure
            if self.kind == "eval":
                self.eval_metrics.update(values)  # the last value of each name wins
                return
            if step is None:
                step = self.last_step
            if step is None or not values or self.kind == "custom":
                return
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self.schedule.saw_step(step)
            loss = values.get("train/loss", values.get("loss"))
            if loss is not None:
                self._losses[step] = loss
                if len(self._losses) > 10_000:
                    del self._losses[min(self._losses)]
        self._outbox.put(Metrics(step=step, values=values))

    def _emit_metrics(self) -> None:
        while (event := self._outbox.get()) is not None:
            self.events.emit(event)
    def _pump(self, stream, sink, keep: bool) -> None:
        for raw in iter(lambda: stream.readline(MAX_LINE), b""):
            text = raw.decode("utf-8", errors="replace")
            sink.write(text if text.endswith("\n") else text + "\n")
            sink.flush()
            if keep:
                self._stderr.append(text)
            else:
                self.on_line(text)

    def _tail_metrics(self) -> None:
        offset = 0
        while True:
            stopping = self._stopped.is_set()  # then one last read: whatever the script appended
            try:
                with open(self.metrics_file, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read(4 << 20)
            except OSError:
                chunk = b""
            end = chunk.rfind(b"\n") + 1
            for line in chunk[:end].splitlines():
                self.on_line(line.decode("utf-8", errors="replace"))
            offset += end
            if stopping:
                return
            self._stopped.wait(POLL_S)

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            for found in self.watcher.poll():
                self.register(found)

    # ---- notice ---------------------------------------------------------------------
    def request_durable(self) -> None:
        """An early durable save (a rebalance recommendation): the published schedule's next save
        becomes the next step, for the scripts that read it (the HF and Lightning callbacks,
        `integrations.env.checkpoint_due`); a script that keeps its own cadence is not asked."""
        with self._lock:
            self.schedule.next_step = (self.last_step or 0) + 1
            self.schedule.publish(self.schedule_file)

    def on_notice(self, notice: dict) -> None:
        """Tell the script (stop file, then its stop signal) and set the kill time."""
        self._notice_at = time.time()
        deadline = self._deadline = notice.get("deadline")
        grace = (deadline - time.time() - KILL_MARGIN_S) if deadline else self.notice_grace
        self._kill_at = time.time() + max(grace, 1.0)
        try:
            self.stop_file.touch()
        except OSError:
            pass
        proc = self.proc
        if proc is not None and proc.poll() is None:
            sig = getattr(signal, self.template.get("stop_signal", "SIGTERM"))
            try:
                if self.group is not None:  # the ranks here, not torchrun: see runtime/group.py
                    group.signal_ranks(proc, sig)
                else:
                    proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # ---- the run --------------------------------------------------------------------
    def run(self) -> tuple[int, str]:
        extra: dict[str, str] = {}
        if self.task == "eval":
            if not self.eval_checkpoint:
                return EXIT_USER_ERROR, "an eval task needs --checkpoint"
            path = str(self._rebuild(self.eval_checkpoint, "eval"))
            extra = {"checkpoint_path": path}
            env_extra = {"ORBIT_EVAL_CHECKPOINT": path}
        elif self.resume_from:
            path = str(self._rebuild(self.resume_from, "resume"))
            extra = {"resume_from": path}
            env_extra = {"ORBIT_RESUME_FROM": path}
        else:
            env_extra = {}
        argv = self.argv(extra)
        print(f"orbit agent: running {argv!r} in {self.bundle / 'scripts'}", flush=True)
        try:
            self.proc = subprocess.Popen(argv, cwd=self.bundle / "scripts", env=self.env(env_extra),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         preexec_fn=_die_with_parent)
        except OSError as exc:
            return EXIT_USER_ERROR, f"the command {argv[0]!r} cannot be started: {exc.strerror or exc}"
        if self.notices.pending:  # a notice before the script started: tell it now
            self.on_notice(self.notices.notice or {})
        threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, False), daemon=True),
                   threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, True), daemon=True)]
        if self.kind != "custom":
            threads.append(threading.Thread(target=self._tail_metrics, daemon=True))
        watch = threading.Thread(target=self._watch, daemon=True) if self.kind == "train" else None
        emitter = threading.Thread(target=self._emit_metrics, daemon=True)
        for t in threads + ([watch] if watch else []) + [emitter]:
            t.start()
        try:
            returncode, killed_by_us = self._wait()
        finally:
            self.kill()
        self._stopped.set()
        for t in threads:
            t.join(10)  # a child of the script may hold the pipes open: never wait for ever
        if watch:  # node 0 of a group may be waiting for the other nodes' parts of a checkpoint
            watch.join(10 + (self.group.wait_s if self.group is not None else 0))
        self._outbox.put(None)
        emitter.join()
        if self.kind == "train":
            for found in self.watcher.settle_after_exit(killed=returncode < 0 or killed_by_us):
                self.register(found)
        code, reason = exit_code_for(returncode, noticed=self._notice_at is not None, failure=self.failure,
                                     stderr_tail="".join(self._stderr))
        if code == EXIT_OK and self.kind == "eval":
            if not self.eval_metrics:
                return EXIT_USER_ERROR, "the eval command printed no metrics (a JSON line such as {\"eval/loss\": 1.2})"
            self.events.emit(Evaluation(metrics=self.eval_metrics, checkpoint=self.eval_checkpoint))
        if code == EXIT_OK and self.kind == "collect":
            self.collect()
        return code, reason

    def _wait(self) -> tuple[int, bool]:
        killed = False
        while True:
            try:
                return self.proc.wait(timeout=POLL_S), killed
            except subprocess.TimeoutExpired:
                if self._kill_at is not None and time.time() >= self._kill_at and not killed:
                    print("orbit agent: the script did not exit within the notice's grace; killed", flush=True)
                    self.proc.kill()
                    killed = True

    def kill(self) -> None:
        """No script outlives its attempt: nor any process it started, in whatever session
        (torchrun starts each rank in one of its own): all carry the run's tag."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        process_tree.kill_tagged(process_tree.RUN_TAG, self.tag)

    def collect(self) -> None:
        """`kind: collect`: what the script wrote, stored as one artifact set (runtime/files.py)."""
        collect_files(self.store, self.job_id, self.attempt, self.checkpoint_dir, self.last_step,
                      self.workdir / "artifacts" / "collected.json")


def is_command(template: dict, task: str) -> bool:
    if task == "eval":
        return bool((template.get("eval") or {}).get("command"))
    return template.get("command") is not None

