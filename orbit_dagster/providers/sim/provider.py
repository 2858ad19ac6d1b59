"""The embedded default provider: a simulated spot market on this machine.

Offers are real GCE GPU prices; each instance is a real local process (sim_host) with its
own workspace, metadata endpoint and heartbeat, billed per second at its offer's price.
Reclaims come from a schedule (none, a replayed trace, an N-node trace node by node, or an
injected one).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from ...catalog.gce import gce_offers
from ...core.errors import NoCapacity, ResourceNotFound
from ...core.execution import MAX_NODES, Resources
from ...core.host_contract import Checkpoint, Entry
from ...core.offers import Offer
from ...core.process_tree import HOST_TAG, kill_tagged
from ..base import InstanceHandle, InstanceTimes, LaunchSpec, Notice, PriceTick, RunHandle, RunStatus
from ..common import agent_argv, offer_fits, read_event_file
from ..jsonfiles import read_json as _read_json
from ..jsonfiles import write_json
from .market import price_feed

HEARTBEAT_STALE_S = 10.0


def _ts(x: float | None) -> datetime | None:
    return None if x is None else datetime.fromtimestamp(float(x), timezone.utc)


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (kill -0 alone counts zombies)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class ReclaimSchedule(Protocol):
    def reclaim_at(self, offer: Offer, start_wall: float) -> float | None:
        """Wall-clock time at which an instance of `offer` started at `start_wall` is reclaimed
        (None: never; NoCapacity: the market has none to rent now). A schedule with `by_node`
        set is also given the instance's node rank (`node=`): node_trace.NodeTraceReclaims."""


class NoReclaims:
    def reclaim_at(self, offer: Offer, start_wall: float) -> float | None:  # noqa: ARG002
        return None


@lru_cache(maxsize=1)
def default_offers() -> tuple[Offer, ...]:
    """GCE GPU offers at the latest shipped price, relabelled as the sim market's."""
    out = []
    for o in gce_offers():
        if o.usd_per_gpu_second_spot is None:
            continue
        out.append(o.model_copy(update={"provider": "sim", "offer_id": "sim:" + o.offer_id.split(":", 1)[-1]}))
    return tuple(out)


class SimProvider:
    name = "sim"
    # An instance takes another workload once its last one ended: a group's surviving nodes go
    # on into the next attempt (control/group_recovery.py).
    relaunch = True

    def __init__(
        self,
        root: Path,
        *,
        offers: list[Offer] | None = None,
        schedule: ReclaimSchedule | None = None,
        notice_seconds: float = 120.0,
        grace_seconds: float = 5.0,
        market=None,
    ):
        self.root = Path(root).resolve()
        self.instances = self.root / "instances"
        self.instances.mkdir(parents=True, exist_ok=True)
        self._offers = offers
        self.schedule = schedule or NoReclaims()
        self.notice_seconds = notice_seconds
        self.grace_seconds = grace_seconds
        self.market = market  # providers.sim.market.MarketConfig: the clock prices replay on

    # ---- offers -------------------------------------------------------------------
    def list_offers(self, resources: Resources | None = None) -> list[Offer]:
        offers = list(self._offers if self._offers is not None else default_offers())
        if resources is not None:
            offers = [o for o in offers if offer_fits(o, resources)]
        return offers

    def group_offers(self, offer: Offer, count: int) -> list[Offer]:
        # The embedded market's zones have room for any group (its traces decide reclaims).
        return [offer] * min(count, MAX_NODES)

    # ---- instances ----------------------------------------------------------------
    def _dir(self, instance_id: str) -> Path:
        return self.instances / instance_id

    def host_state(self, instance_id: str) -> dict:
        try:
            return json.loads((self._dir(instance_id) / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def provision(self, offer: Offer, *, tags: dict[str, str]) -> InstanceHandle:
        instance_id = f"sim-{uuid.uuid4().hex[:10]}"
        d = self._dir(instance_id)
        d.mkdir(parents=True)
        start = time.time()
        spec = {
            "instance_id": instance_id,
            "offer": json.loads(offer.model_dump_json()),
            "usd_per_second": offer.usd_per_second,
            "reclaim_at": self._reclaim_at(offer, start, tags),
            "notice_seconds": self.notice_seconds,
            "grace_seconds": self.grace_seconds,
            "tags": tags,
        }
        write_json(d / "instance.json", spec)
        with open(d / "host.log", "ab") as log:
            # A session of its own: the host outlives the Dagster run that rented it.
            subprocess.Popen(
                [sys.executable, "-m", "orbit_dagster.providers.sim.host", str(d)],
                start_new_session=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.time() + 20
        while time.time() < deadline:
            state = self.host_state(instance_id)
            if state.get("metadata_port"):
                return InstanceHandle(
                    provider=self.name,
                    instance_id=instance_id,
                    offer=offer,
                    started_at=_ts(state["started_at"]),
                    address={"dir": str(d), "metadata_url": f"http://127.0.0.1:{state['metadata_port']}"},
                )
            time.sleep(0.05)
        raise NoCapacity(f"sim instance {instance_id} did not boot within 20 s", provider=self.name)

    def _reclaim_at(self, offer: Offer, start: float, tags: dict[str, str]) -> float | None:
        # A schedule that replays an N-node trace node by node (node_trace.py) follows the
        # instance's own node: its rank in the group it is rented for (0 outside a group).
        if getattr(self.schedule, "by_node", False):
            return self.schedule.reclaim_at(offer, start, node=int(tags.get("orbit/node", 0)))
        return self.schedule.reclaim_at(offer, start)

    def instance_alive(self, instance: InstanceHandle) -> bool:
        state = self.host_state(instance.instance_id)
        if state.get("status") not in ("running", "terminating"):
            return False
        if not pid_alive(int(state["pid"])):
            return False
        return time.time() - float(state.get("heartbeat_at", 0)) < HEARTBEAT_STALE_S

    def instance_times(self, instance: InstanceHandle) -> InstanceTimes:
        state = self.host_state(instance.instance_id)
        if not state:
            raise ResourceNotFound(f"sim instance {instance.instance_id} is unknown", provider=self.name)
        stopped = state.get("stopped_at")
        reason = state.get("reason")
        if stopped is None and not self.instance_alive(instance):
            # Vanished without a goodbye: the meter stopped at its last heartbeat, and a
            # vanished machine takes its processes with it (a host process killed alone
            # would leave its workload training into the store for an attempt that is over).
            stopped, reason = state.get("heartbeat_at"), "host lost"
            self._sweep(instance.instance_id, state)
        return InstanceTimes(started_at=_ts(state["started_at"]), stopped_at=_ts(stopped), reason=reason)

    def terminate(self, instance: InstanceHandle, reason: str) -> InstanceTimes:
        d = self._dir(instance.instance_id)
        if not d.exists():
            raise ResourceNotFound(f"sim instance {instance.instance_id} is unknown", provider=self.name)
        if self.instance_alive(instance):
            write_json(d / "terminate.json", {"reason": reason, "at": time.time()})
            deadline = time.time() + self.grace_seconds + 15
            # Until the host process is gone, not only until it writes its last status: it
            # writes that just before it exits, and on a loaded machine its exit took long
            # enough for a caller's look at the process table right after to find it.
            pid = int(self.host_state(instance.instance_id)["pid"])
            while time.time() < deadline and pid_alive(pid):
                time.sleep(0.05)
        return self.instance_times(instance)

    def _sweep(self, instance_id: str, state: dict) -> None:
        """SIGKILL what is left of a vanished host: its process group's members that run
        from its directory (the group outlives a host process killed on its own)."""
        pgid, token = state.get("pid"), str(self._dir(instance_id)).encode()
        kill_tagged(HOST_TAG, str(self._dir(instance_id)))  # what left the group (torchrun's ranks): by its tag
        if not pgid:
            return
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if os.getpgid(int(proc.name)) == int(pgid) and token in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    def kill(self, instance: InstanceHandle) -> None:
        """Chaos: the machine vanishes with no notice (SIGKILL to the host and its workload)."""
        state = self.host_state(instance.instance_id)
        try:
            os.killpg(os.getpgid(int(state["pid"])), signal.SIGKILL)
        except (ProcessLookupError, KeyError):
            pass

    def inject_reclaim(self, instance: InstanceHandle, *, in_seconds: float | None = None,
                       notice_seconds: float | None = None, at_step: int | None = None,
                       progress_of: list[RunHandle] | None = None) -> None:
        """Schedule a reclaim (the market operator's override): `in_seconds` from now, or, with
        `at_step`, once the workload on the instance (on any of `progress_of`'s instances: a
        group's nodes) has reported that training step (the notice then, the reclaim
        `notice_seconds` later): the same story on a fast or a slow machine."""
        if (in_seconds is None) == (at_step is None):
            raise ValueError("inject_reclaim takes in_seconds or at_step")
        spec = {"notice_seconds": notice_seconds or self.notice_seconds}
        spec.update({"at_step": int(at_step)} if at_step is not None else {"reclaim_at": time.time() + in_seconds})
        if progress_of:
            spec["progress_files"] = [str(Path(r.run_ref) / "artifacts" / "events.jsonl") for r in progress_of]
        write_json(self._dir(instance.instance_id) / "reclaim.json", spec)

    def inject_rebalance(self, instance: InstanceHandle, *, at_step: int | None = None,
                         progress_of: list[RunHandle] | None = None) -> None:
        """Serve AWS's rebalance recommendation on the instance's metadata endpoint (the market
        operator's override; no reclaim follows unless one is injected too): now, or, with
        `at_step`, once the workload on the instance (on any of `progress_of`'s instances: a
        group's nodes) has reported that training step, as `inject_reclaim` does."""
        spec: dict = {} if at_step is None else {"at_step": int(at_step)}
        if progress_of:
            spec["progress_files"] = [str(Path(r.run_ref) / "artifacts" / "events.jsonl") for r in progress_of]
        write_json(self._dir(instance.instance_id) / "rebalance-order.json", spec)

    def notices(self, instance: InstanceHandle) -> list[Notice]:
        url = instance.address.get("metadata_url")
        if not url or not self.instance_alive(instance):
            return []
        try:
            with urllib.request.urlopen(url + "/latest/meta-data/spot/instance-action", timeout=2) as resp:
                body = json.loads(resp.read().decode())
        except (urllib.error.URLError, OSError, ValueError):
            return []
        deadline = datetime.fromisoformat(body["time"].replace("Z", "+00:00"))
        return [Notice(instance_id=instance.instance_id, action=body.get("action", "terminate"), deadline=deadline,
                       received_at=datetime.now(timezone.utc), source="metadata")]

    # ---- workloads ----------------------------------------------------------------
    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle:
        d = self._dir(instance.instance_id)
        work, seq = d / "work", 1
        if (d / "launch.json").exists():
            # Another workload on a kept instance once the last one ended, in a workspace of its own.
            last = _read_json(d / "launch.json") or {}
            if _read_json(d / "child_exit.json") is None or (_read_json(d / "child_exit.json") or {}).get(
                    "seq", 1) != last.get("seq", 1):
                raise NoCapacity(f"sim instance {instance.instance_id} already runs a workload", provider=self.name,
                                 retryable=False)
            seq = int(last.get("seq", 1)) + 1
            work = d / "work" / f"launch-{seq}"
        staged = work / "bundle"
        shutil.copytree(bundle_dir, staged, ignore=shutil.ignore_patterns("artifacts"))
        (staged / "artifacts").mkdir(exist_ok=True)
        argv = agent_argv(sys.executable, staged, work, spec, instance.address.get("metadata_url"))
        # Poll the metadata endpoint often enough to leave most of the (scaled) notice window.
        argv += ["--notice-poll", f"{min(1.0, max(0.05, self.notice_seconds / 10)):.3f}"]
        env = {
            "PYTHONPATH": str(staged / "runtime"),
            "OMP_NUM_THREADS": str(_threads(staged)),
            "PYTHONUNBUFFERED": "1",
            **spec.env,
        }
        write_json(d / "launch.json", {"argv": argv, "cwd": str(work), "env": env, "forward_env": list(spec.secret_env),
                                       "seq": seq})
        return RunHandle(
            provider=self.name,
            instance=instance,
            run_ref=str(work),
            task=spec.task,
            attempt=spec.attempt,
            launched_at=datetime.now(timezone.utc),
        )

    def rendezvous_endpoint(self, instance: InstanceHandle) -> str:  # noqa: ARG002
        # Every sim host is this machine: a port free here now (the OS's pick), on loopback.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def status(self, run: RunHandle) -> RunStatus:
        d = self._dir(run.instance.instance_id)
        state = self.host_state(run.instance.instance_id)
        exit_info = _read_json(Path(run.run_ref) / "artifacts" / "exit.json")
        child_exit = _read_json(d / "child_exit.json")
        if child_exit is not None and child_exit.get("cwd", run.run_ref) != run.run_ref:
            child_exit = None  # an earlier workload's, on a kept instance
        child = _read_json(d / "child.json")
        started = child is not None and child.get("cwd", run.run_ref) == run.run_ref
        if state.get("status") in ("reclaiming", "reclaimed"):
            return RunStatus(state="lost", failure_class="reclaim", reason="spot instance reclaimed")
        if child_exit is not None or exit_info is not None:
            if exit_info is not None:
                return RunStatus(
                    state="exited",
                    exit_code=int(exit_info["code"]),
                    failure_class=exit_info.get("failure_class"),
                    reason=exit_info.get("reason", ""),
                    last_step=exit_info.get("last_step"),
                )
            rc = int(child_exit["returncode"])
            if rc < 0 or rc >= 128:  # killed by a signal from outside before it could write exit.json
                sig = -rc if rc < 0 else rc - 128
                return RunStatus(state="lost", failure_class="reclaim",
                                 reason=f"the agent was killed by signal {sig} from outside (no exit file)")
            return RunStatus(state="exited", exit_code=rc, failure_class="infrastructure",
                             reason=f"agent ended without an exit file (rc {rc})")
        if not self.instance_alive(run.instance):
            self._sweep(run.instance.instance_id, state)  # before anyone scans its store: nothing more lands
            return RunStatus(state="lost", failure_class="reclaim", reason=state.get("reason") or "host lost (no heartbeat)")
        return RunStatus(state="running" if started else "starting")

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[Entry], int]:
        return read_event_file(Path(run.run_ref) / "artifacts" / "events.jsonl", offset)

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str:
        path = Path(run.run_ref) / "agent.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-tail_lines:])
        except FileNotFoundError:
            return ""

    def collect(self, run: RunHandle, dest: Path) -> list[Path]:
        src = Path(run.run_ref) / "artifacts"
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        copied = []
        for f in [*(src.glob("*") if src.is_dir() else []), Path(run.run_ref) / "agent.log"]:
            if f.is_file():
                shutil.copy2(f, dest / f.name)
                copied.append(dest / f.name)
        return copied

    def price_feed(self, since: datetime | None = None, offer_ids: list[str] | None = None) -> list[PriceTick]:
        """The real GCE price history of the offers, replayed on the market clock."""
        if self.market is None:
            return []
        wanted = set(offer_ids) if offer_ids is not None else None
        offers = [o for o in self.list_offers() if wanted is None or o.offer_id in wanted]
        ticks = price_feed(self.market, offers, since.timestamp() if since else None, time.time())
        return [PriceTick(offer_id=t["offer_id"], ts=_ts(t["wall"]), usd_per_hour_spot=t["usd_per_hour_spot"],
                          usd_per_hour_on_demand=t["usd_per_hour_on_demand"], source=f"gce history {t['history_time'][:10]}")
                for t in ticks]

    def reattach(self, run: RunHandle) -> RunHandle | None:
        if not self._dir(run.instance.instance_id).exists():
            return None
        return run if self.status(run).state in ("starting", "running", "exited") else None

    # Sim hosts share this machine's filesystem: they write straight into the store.
    def localize_checkpoint(self, run: RunHandle, event: Checkpoint, store_uri: str) -> Checkpoint:  # noqa: ARG002
        return event

    def stage_checkpoint(self, instance: InstanceHandle, uri: str) -> str:  # noqa: ARG002
        return uri

    def host_store_uri(self, instance: InstanceHandle, store_uri: str) -> str:  # noqa: ARG002
        return store_uri



def _threads(bundle: Path) -> int:
    job = json.loads((bundle / "job.json").read_text())
    return int(job["template_snapshot"].get("resources", {}).get("cpu_threads", 1))
