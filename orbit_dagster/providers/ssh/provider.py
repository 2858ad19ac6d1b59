"""The `ssh` provider: rental boxes the user describes in an inventory, reached with paramiko.

An "instance" here is a lease of GPU slots on a host, billed per second from provision to
terminate at the host's price x slots/total. Everything the control plane must be able to
re-attach to lives in files on the host (`<workdir>/<instance_id>/`: lease.json, bundle/,
run/, checkpoints/) and is guarded there by the helper `ssh_host.py`; the control plane keeps
only a cache in `state_dir`, used to bill a host that stopped answering. Every remote step
is idempotent, so a dropped connection costs one reconnect and one retry, never a second
launch. Rental boxes give no reclaim notice and have a fixed price: `notices()` and
`price_feed()` are empty.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
import stat
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import paramiko

from ...core.errors import NetworkError, NoCapacity, ProviderError, QuotaExceeded, ResourceNotFound
from ...core.execution import Resources
from ...core.host_contract import EVENTS_FILE, READ_MAX, Checkpoint, Entry, read_chunk
from ...core.offers import Offer
from ...settings import secrets as forwarded_secrets
from ..base import RENDEZVOUS_PORT, InstanceHandle, InstanceTimes, LaunchSpec, Notice, PriceTick, RunHandle, RunStatus
from ..common import agent_argv
from ..jsonfiles import read_json as _read_json
from ..jsonfiles import write_json as _write_json
from .checkpoints import fetch_checkpoint, mkdirs, push_checkpoint, remote_dir_of, rewrite_uri, uri_path
from .inventory import Inventory, InventoryError, SshHost
from .session import HostSessions

LAUNCH_WINDOW_S = 60.0  # a claimed run with no wrapper pid is starting for this long, then lost
EVENTS_READ_MAX = READ_MAX  # bytes per read_events call: bounded memory, the rest comes next poll


def _ts(x: float | None) -> datetime | None:
    return None if x is None else datetime.fromtimestamp(float(x), timezone.utc)


@dataclass
class StageReport:
    """What one staging of a bundle did (staging skips files already there and intact)."""

    sent: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    seconds: float = 0.0


def docker_argv(image: str, agent: list[str], *, gpu_slots: tuple[int, ...], mount: str, workdir: str,
                env: dict[str, str], secret_names: list[str], name: str) -> list[str]:
    """`docker run` for launch_mode docker_image: the lease's slots only, the lease dir mounted at the
    same path (so file:// uris and paths mean the same inside and out), secrets by name only
    (docker copies their values from the wrapper's environment; they never appear in argv)."""
    argv = ["docker", "run", "--rm", "--name", name, "-v", f"{mount}:{mount}", "-w", workdir]
    if gpu_slots:
        argv += ["--gpus", '"device=' + ",".join(map(str, gpu_slots)) + '"']
    for k, v in sorted(env.items()):
        argv += ["-e", f"{k}={v}"]
    for k in secret_names:
        argv += ["-e", k]
    return argv + [image] + agent


def run_status(snap: dict) -> RunStatus:
    """RunStatus from the helper's snapshot of a run dir (sim's semantics, see sim.status)."""
    if not snap.get("launched"):
        return RunStatus(state="lost", failure_class="reclaim", reason="the run directory on the host is gone")
    ex = snap.get("exit")
    if ex is not None:
        return RunStatus(state="exited", exit_code=int(ex["code"]), failure_class=ex.get("failure_class"),
                         reason=ex.get("reason", ""), last_step=ex.get("last_step"))
    wx = snap.get("wrapper_exit")
    if wx is not None:
        rc = int(wx["returncode"])
        if rc < 0 or rc >= 128:  # killed by a signal from outside before it could write exit.json
            sig = -rc if rc < 0 else rc - 128
            return RunStatus(state="lost", failure_class="reclaim",
                             reason=f"the agent was killed by signal {sig} from outside (no exit file)")
        why = wx.get("error") or f"rc {rc}"
        return RunStatus(state="exited", exit_code=rc, failure_class="infrastructure",
                         reason=f"agent ended without an exit file ({why})")
    if snap.get("wrapper_alive") or snap.get("agent_alive"):
        return RunStatus(state="running" if snap.get("agent_pid") else "starting")
    if snap.get("wrapper_pid") is None and snap.get("launch_age_s", LAUNCH_WINDOW_S) < LAUNCH_WINDOW_S:
        return RunStatus(state="starting")  # claimed, the wrapper's pid not written yet
    reason = ("the lease was terminated before the workload wrote an exit file" if snap.get("lease_stopped")
              else "the workload's processes are gone and left no exit file (killed, or the host rebooted)")
    return RunStatus(state="lost", failure_class="reclaim", reason=reason)


class SshProvider:
    name = "ssh"
    relaunch = False  # a lease runs one workload: a group's survivors are rented anew
    notice_seconds = 0.0  # a rental box gives no reclaim notice

    def __init__(self, inventory_path: Path, *, state_dir: Path, unreachable_grace_s: float = 60.0,
                 terminate_grace_s: float = 60.0, command_timeout_s: float = 120.0):
        # The inventory's path is the settings' (`settings.ssh_hosts`: ORBIT_SSH_HOSTS, else the home's).
        self.inventory_path = Path(inventory_path)
        self.state_dir = Path(state_dir)
        (self.state_dir / "leases").mkdir(parents=True, exist_ok=True)
        self.hosts = HostSessions(self.inventory_path, self.state_dir, command_timeout_s=command_timeout_s)
        self.unreachable_grace_s = unreachable_grace_s
        self.terminate_grace_s = terminate_grace_s
        self._final: dict[tuple[str, str], RunStatus] = {}

    @property
    def inventory(self) -> Inventory:
        return self.hosts.inventory

    def _host(self, instance: InstanceHandle) -> SshHost:
        return self.inventory.host(instance.address["host"])

    def _lease(self, instance: InstanceHandle, lease: dict | None = None) -> dict | None:
        path = self.state_dir / "leases" / f"{instance.instance_id}.json"
        if lease is not None:
            _write_json(path, lease)
        return _read_json(path)

    # ---- offers and leases --------------------------------------------------------
    def list_offers(self, resources: Resources | None = None) -> list[Offer]:
        """One offer per inventory host that fits (no network: free slots are checked at provision)."""
        hosts = self.inventory.hosts
        if resources is None:
            return [h.offer() for h in hosts]
        return [h.offer(resources.gpu_count) for h in hosts if h.fits(resources)]

    def group_offers(self, offer: Offer, count: int) -> list[Offer]:
        """A group's nodes are distinct hosts of the offer's host's shape and region, one lease each
        of the offer's GPU count (the inventory's order after the offer's own host)."""
        try:
            hosts = self.inventory.group_of(self.inventory.host(offer.offer_id.split(":", 1)[-1]))
        except InventoryError:
            return []
        return [h.offer(offer.gpu_count) for h in hosts[:count]]

    def provision(self, offer: Offer, *, tags: dict[str, str], instance_id: str | None = None) -> InstanceHandle:
        """A lease of the offer's slots; `instance_id` names it (the aws provider uses the EC2 id)."""
        name = offer.offer_id.split(":", 1)[-1]
        try:
            host = self.inventory.host(name)
        except InventoryError as exc:
            raise ResourceNotFound(str(exc), provider=self.name, fix=exc.fix) from None
        if offer.gpu_count > host.gpus.count:
            raise NoCapacity(f"ssh host {name!r} has {host.gpus.count} GPUs; the offer asks for {offer.gpu_count}",
                             provider=self.name, retryable=False, fix="ask for fewer GPUs or another host")
        instance_id = instance_id or f"ssh-{name}-{uuid.uuid4().hex[:10]}"
        root = self.hosts.root(name)
        lease = self.hosts.helper(name, "lease-open", {
            "root": root, "instance_id": instance_id, "need": offer.gpu_count, "total": host.gpus.count,
            "tags": tags, "usd_per_hour": host.usd_per_hour})
        handle = InstanceHandle(provider=self.name, instance_id=instance_id, offer=offer,
                                started_at=_ts(lease["started_at"]), gpu_slots=tuple(lease["slots"]),
                                address={"host": name, "hostname": host.host, "port": host.port, "user": host.user,
                                         "root": root, "run_root": posixpath.join(root, instance_id)})
        self._lease(handle, {**lease, "host": name})
        return handle

    def _lease_req(self, instance: InstanceHandle, **extra: Any) -> dict:
        return {"root": instance.address["root"], "instance_id": instance.instance_id, **extra}

    def instance_alive(self, instance: InstanceHandle) -> bool:
        """The heartbeat: one round trip. An unreachable host counts as alive for a grace period."""
        try:
            lease = self.hosts.helper(instance.address["host"], "lease-read", self._lease_req(instance))
        except NetworkError:
            return self.hosts.unreachable_for(instance.address["host"]) < self.unreachable_grace_s
        except ResourceNotFound:
            return False
        return lease.get("stopped_at") is None

    def instance_times(self, instance: InstanceHandle) -> InstanceTimes:
        name = instance.address["host"]
        try:
            lease = self._lease(instance, self.hosts.helper(name, "lease-read", self._lease_req(instance)))
        except NetworkError:
            lease = self._lease(instance)
            if lease is None or (lease.get("stopped_at") is None
                                 and self.hosts.unreachable_for(name) < self.unreachable_grace_s):
                raise
            if lease.get("stopped_at") is None:  # gone without a goodbye: the meter stopped when we last saw it
                last_ok = self.hosts.last_ok(name)
                stop = max(last_ok or 0.0, float(lease["started_at"]))
                lease = {**lease, "stopped_at": stop, "reason": "host unreachable"}
        return InstanceTimes(started_at=_ts(lease["started_at"]), stopped_at=_ts(lease.get("stopped_at")),
                             reason=lease.get("reason"))

    def terminate(self, instance: InstanceHandle, reason: str) -> InstanceTimes:
        """SIGTERM the workload (it checkpoints), SIGKILL after the grace, free the slots, stop the meter."""
        req = self._lease_req(instance, reason=reason, grace_s=self.terminate_grace_s)
        lease = self.hosts.helper(instance.address["host"], "lease-close", req, timeout=self.terminate_grace_s + 60)
        self._lease(instance, {**lease, "host": instance.address["host"]})
        return InstanceTimes(started_at=_ts(lease["started_at"]), stopped_at=_ts(lease["stopped_at"]),
                             reason=lease.get("reason"))

    def notices(self, instance: InstanceHandle) -> list[Notice]:  # noqa: ARG002
        return []  # a rental box vanishes without a metadata notice; LOST + resume covers it

    def price_feed(self, since: datetime | None = None,  # noqa: ARG002
                   offer_ids: list[str] | None = None) -> list[PriceTick]:  # noqa: ARG002
        return []  # fixed price from the inventory

    # ---- staging and launch -------------------------------------------------------
    def stage_bundle(self, instance: InstanceHandle, bundle_dir: Path) -> StageReport:
        """Upload the bundle to `<run_root>/bundle`, resumably, then verify every sha256 remotely."""
        t0, name = time.monotonic(), instance.address["host"]
        base = posixpath.join(instance.address["run_root"], "bundle")
        local = _listing(Path(bundle_dir))
        have = self.hosts.helper(name, "hash", {"base": base, "files": sorted(local)}, timeout=600)
        report = StageReport()
        for rel, (size, sha, _) in sorted(local.items()):
            (report.skipped if have["files"].get(rel) == [size, sha] else report.sent).append(rel)
        need = sum(local[rel][0] for rel in report.sent)
        if need > have["free_bytes"]:
            raise QuotaExceeded(f"ssh host {name!r}: the bundle needs {need} bytes, {have['free_bytes']} are free "
                                f"under {base}", provider=self.name, fix="free space on the host or move its workdir")

        def upload(c: paramiko.SSHClient) -> None:
            sftp, made = self.hosts.sftp(name, c), set()
            for rel in report.sent:
                parent = posixpath.dirname(posixpath.join(base, rel))
                if parent not in made:
                    mkdirs(sftp, parent)
                    made.add(parent)
                sftp.put(str(local[rel][2]), posixpath.join(base, rel), confirm=True)

        if report.sent:
            self.hosts.do(name, "stage bundle", upload)
            report.bytes_sent = need
            got = self.hosts.helper(name, "hash", {"base": base, "files": sorted(local)}, timeout=600)["files"]
            bad = [rel for rel, (size, sha, _) in local.items() if got.get(rel) != [size, sha]]
            if bad:
                raise NetworkError(f"ssh host {name!r}: {len(bad)} bundle files differ after upload: {bad[:3]}",
                                   provider=self.name, fix="staging again re-sends only those files")
        report.seconds = time.monotonic() - t0
        return report

    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle:
        job = json.loads((Path(bundle_dir) / "job.json").read_text())
        request = job.get("execution_request") or {}
        threads = int(job["template_snapshot"].get("resources", {}).get("cpu_threads", 1))
        host, run_root = self._host(instance), instance.address["run_root"]
        self.stage_bundle(instance, bundle_dir)
        bundle, run_dir = posixpath.join(run_root, "bundle"), posixpath.join(run_root, "run")
        env = {"PYTHONPATH": posixpath.join(bundle, "runtime"), "OMP_NUM_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1", **spec.env}
        secrets = forwarded_secrets(spec.secret_env)  # from the environment only, by pipe
        if request.get("launch_mode") == "docker_image":
            if not host.docker or not request.get("image"):
                raise ProviderError(f"ssh host {host.name!r} cannot run launch_mode docker_image "
                                    f"(docker: {host.docker}, image: {request.get('image')!r})", provider=self.name,
                                    fix="set docker: true for the host and execution_request.image, "
                                        "or use launch_mode host_process")
            agent = agent_argv("python", PurePosixPath(bundle), PurePosixPath(run_dir), spec, None)
            argv = docker_argv(request["image"], agent, gpu_slots=instance.gpu_slots, mount=run_root,
                               workdir=run_dir, env=env, secret_names=sorted(secrets),
                               name=f"orbit-{instance.instance_id}")
            env = {}
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, instance.gpu_slots))  # the lease's slots only
            argv = agent_argv(host.python, PurePosixPath(bundle), PurePosixPath(run_dir), spec, None)
        launch = {"argv": argv, "env": env, "cwd": run_dir, "task": spec.task, "attempt": spec.attempt,
                  "launched_at": time.time(), "secret_names": sorted(secrets)}
        out = self.hosts.helper(host.name, "launch", {"run_dir": run_dir, "launch": launch, "secrets": secrets})
        prev = out.get("launch") or launch
        if not out["new"] and (prev.get("task"), prev.get("attempt")) != (spec.task, spec.attempt):
            raise NoCapacity(f"ssh lease {instance.instance_id} already runs {prev.get('task')} attempt "
                             f"{prev.get('attempt')}", provider=self.name, retryable=False,
                             fix="provision a new lease for this workload")
        return RunHandle(provider=self.name, instance=instance, run_ref=run_dir, task=spec.task, attempt=spec.attempt,
                         launched_at=_ts(prev.get("launched_at") or time.time()))

    def rendezvous_endpoint(self, instance: InstanceHandle) -> str:
        """The inventory's address of the host (the one orbit reaches it at; a group's hosts share
        a region and a network) and torchrun's default c10d port."""
        return f"{self._host(instance).host}:{RENDEZVOUS_PORT}"

    # ---- following a run ----------------------------------------------------------
    def status(self, run: RunHandle) -> RunStatus:
        """From the run's files on the host. Unreachable: NetworkError (retryable) during the grace,
        then `lost` (reclaim), as sim reports a host that stopped its heartbeat."""
        name, key = run.instance.address["host"], (run.instance.instance_id, run.run_ref)
        if key in self._final:
            return self._final[key]  # an exit file never changes: no round trip per poll after the end
        try:
            status = run_status(self.hosts.helper(name, "status", {"run_dir": run.run_ref}))
            if status.state == "exited":
                self._final[key] = status
            return status
        except NetworkError:
            gone_s = self.hosts.unreachable_for(name)
            if gone_s < self.unreachable_grace_s:
                raise
            return RunStatus(state="lost", failure_class="reclaim", reason=f"host unreachable for {gone_s:.0f} s")

    def reattach(self, run: RunHandle) -> RunHandle | None:
        """A new connection and a look at the run's files; never a second launch."""
        self.hosts.disconnect(run.instance.address["host"])
        return run if self.status(run).state in ("starting", "running", "exited") else None

    def _read_tail(self, run: RunHandle, rel: str, offset: int | None, limit: int) -> tuple[bytes, int]:
        """Bytes of run_ref/rel from `offset` (None: the last `limit` bytes), and the start offset."""
        name = run.instance.address["host"]

        def read(c: paramiko.SSHClient) -> tuple[bytes, int]:
            try:
                fh = self.hosts.sftp(name, c).open(posixpath.join(run.run_ref, rel), "rb")
            except FileNotFoundError:
                return b"", offset or 0
            with fh:
                start = offset if offset is not None else max(0, fh.stat().st_size - limit)
                fh.seek(start)
                return fh.read(limit), start

        return self.hosts.do(name, f"read {rel}", read)

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[Entry], int]:
        # Whole lines only (a partial last line is read next time); a full read with no newline
        # is a line too long to be an event: refused and skipped (see host_contract.read_chunk).
        chunk, _ = self._read_tail(run, f"artifacts/{EVENTS_FILE}", offset, EVENTS_READ_MAX)
        return read_chunk(chunk, offset, limit=EVENTS_READ_MAX)

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str:
        chunk, _ = self._read_tail(run, "agent.log", None, 256 << 10)
        return "\n".join(chunk.decode("utf-8", errors="replace").splitlines()[-tail_lines:])

    def collect(self, run: RunHandle, dest: Path) -> list[Path]:
        name, dest = run.instance.address["host"], Path(dest)
        dest.mkdir(parents=True, exist_ok=True)

        def get_all(c: paramiko.SSHClient) -> list[Path]:
            sftp, copied = self.hosts.sftp(name, c), []
            art = posixpath.join(run.run_ref, "artifacts")
            try:
                names = [a.filename for a in sftp.listdir_attr(art) if _is_file(a)]
            except FileNotFoundError:
                names = []
            for remote in [posixpath.join(art, n) for n in names] + [posixpath.join(run.run_ref, "agent.log")]:
                try:
                    sftp.get(remote, str(dest / posixpath.basename(remote)))
                except FileNotFoundError:
                    continue
                copied.append(dest / posixpath.basename(remote))
            return copied

        return self.hosts.do(name, "collect artifacts", get_all)

    # ---- checkpoints across the host/control-plane boundary --------------------------
    def host_store_uri(self, instance: InstanceHandle, store_uri: str) -> str:
        """The host cannot see the control plane's disk: a file:// store becomes one on the host."""
        if store_uri.startswith("s3://"):
            return store_uri
        return PurePosixPath(instance.address["run_root"], "checkpoints").as_uri()

    def localize_checkpoint(self, run: RunHandle, event: Checkpoint, store_uri: str) -> Checkpoint:
        if store_uri.startswith("s3://") or event.uri.startswith("s3://"):
            return event
        name, host_store = run.instance.address["host"], self.host_store_uri(run.instance, store_uri)
        remote = remote_dir_of(event, host_store)
        local = self.hosts.do(name, "copy checkpoint",
                              lambda c: fetch_checkpoint(self.hosts.sftp(name, c), remote, store_uri))
        parent = rewrite_uri(event.parent, host_store, store_uri) if event.parent else event.parent
        return replace(event, uri=local, parent=parent)

    def stage_checkpoint(self, instance: InstanceHandle, uri: str) -> str:
        if uri.startswith("s3://"):
            return uri
        name = instance.address["host"]
        host_store = uri_path(self.host_store_uri(instance, uri))
        src = Path(uri_path(uri))
        remote = posixpath.join(host_store, src.parent.name, src.name)
        check = self.hosts.helper(name, "verify-checkpoint", {"dir": remote})
        if not check["ok"]:
            need = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
            if need > check.get("free_bytes", need):
                raise QuotaExceeded(f"ssh host {name!r}: checkpoint {src.name} needs {need} bytes, "
                                    f"{check['free_bytes']} are free", provider=self.name,
                                    fix="free space on the host or move its workdir")
            self.hosts.do(name, "stage checkpoint", lambda c: push_checkpoint(self.hosts.sftp(name, c), src, remote))
            check = self.hosts.helper(name, "verify-checkpoint", {"dir": remote})
            if not check["ok"]:
                raise NetworkError(f"ssh host {name!r}: staged checkpoint {remote} does not verify: {check['problem']}",
                                   provider=self.name, fix="staging again re-sends it")
        return PurePosixPath(remote).as_uri()


# ---- small helpers ------------------------------------------------------------------
def _is_file(attr: paramiko.SFTPAttributes) -> bool:
    return attr.st_mode is not None and stat.S_ISREG(attr.st_mode)


def _listing(bundle: Path) -> dict[str, tuple[int, str, Path]]:
    """rel -> (size, sha256, path) for every bundle file the host needs (not artifacts/)."""
    out = {}
    for p in sorted(bundle.rglob("*")):
        rel = p.relative_to(bundle).as_posix()
        if p.is_file() and not rel.startswith("artifacts/") and "__pycache__" not in rel:
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            out[rel] = (p.stat().st_size, h.hexdigest(), p)
    return out

