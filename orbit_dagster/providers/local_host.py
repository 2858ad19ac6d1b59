"""How the AWS provider reaches the machine it rented: the host transport.

The EC2 API rents and releases an instance; it does not run anything on it. Something
must copy the bundle over, start the runtime agent, and read its events back: on real
AWS that is SSH (the ssh provider's transport) to the instance's address. Under moto an
instance is only an API record, so `LocalHostTransport` plays the machine on this one,
exactly as the sim market does: one `sim_host` process per instance (its own workspace,
the AWS-compatible metadata endpoint, heartbeat, reclaim schedule), driven through the
sim provider's own code. Only the machine and its interruption are simulated; every EC2
and S3 call around it is real.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..core.errors import NoCapacity
from ..core.offers import Offer
from .base import InstanceHandle, LaunchSpec, Notice, RunHandle, RunStatus
from .sim import SimProvider, pid_alive
from .jsonfiles import write_json


@runtime_checkable
class HostTransport(Protocol):
    """The part of a provider that runs the workload on a rented machine."""

    # True when the host sees this machine's files (then an fs checkpoint store works).
    shares_filesystem: bool
    # True when the host may take AWS credential *names* from this process's environment
    # (a machine played locally); a real instance uses its instance role instead.
    forwards_local_credentials: bool

    def boot(self, instance_id: str, offer: Offer, tags: dict[str, str]) -> dict: ...

    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle: ...

    def status(self, run: RunHandle) -> RunStatus: ...

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[dict], int]: ...

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str: ...

    def collect(self, run: RunHandle, dest: Path) -> list[Path]: ...

    def notices(self, instance: InstanceHandle) -> list[Notice]: ...

    def alive(self, instance: InstanceHandle) -> bool: ...

    def knows(self, instance: InstanceHandle) -> bool: ...

    def stop(self, instance: InstanceHandle, reason: str) -> None: ...


class LocalHostTransport:
    """Plays each rented instance on this machine with `sim_host` (see the module docstring).

    The host's directory is named after the EC2 instance id, so the metadata endpoint
    answers `/latest/meta-data/instance-id` with the id EC2 gave, and a new control-plane
    process re-attaches by that id alone.
    """

    shares_filesystem = True
    forwards_local_credentials = True

    def __init__(self, root: Path, *, notice_seconds: float = 120.0, grace_seconds: float = 5.0,
                 boot_timeout_s: float = 20.0):
        self.root = Path(root).resolve()
        self.notice_seconds = notice_seconds
        self.grace_seconds = grace_seconds
        self.boot_timeout_s = boot_timeout_s
        # The sim provider's code drives the hosts; it finds each one by instance id.
        self._sim = SimProvider(self.root, offers=[], notice_seconds=notice_seconds, grace_seconds=grace_seconds)

    def _dir(self, instance_id: str) -> Path:
        return self._sim.instances / instance_id

    def boot(self, instance_id: str, offer: Offer, tags: dict[str, str]) -> dict:
        d = self._dir(instance_id)
        d.mkdir(parents=True, exist_ok=False)
        write_json(d / "instance.json", {
            "instance_id": instance_id, "offer": json.loads(offer.model_dump_json()),
            "usd_per_second": offer.usd_per_second, "reclaim_at": None, "notice_seconds": self.notice_seconds,
            "grace_seconds": self.grace_seconds, "tags": tags,
        })
        with open(d / "host.log", "ab") as log:
            # A session of its own: the machine outlives the Dagster run that rented it.
            subprocess.Popen([sys.executable, "-m", "orbit_dagster.providers.sim_host", str(d)],
                             start_new_session=True, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.time() + self.boot_timeout_s
        while time.time() < deadline:
            port = self._sim.host_state(instance_id).get("metadata_port")
            if port:
                return {"dir": str(d), "metadata_url": f"http://127.0.0.1:{port}", "transport": "local"}
            time.sleep(0.05)
        raise NoCapacity(f"local host for {instance_id} did not boot within {self.boot_timeout_s:g} s "
                         f"(see {d / 'host.log'})", provider="aws")

    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle:
        return self._sim.launch(instance, bundle_dir, spec).model_copy(update={"provider": instance.provider})

    def status(self, run: RunHandle) -> RunStatus:
        return self._sim.status(run)

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[dict], int]:
        return self._sim.read_events(run, offset)

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str:
        return self._sim.logs(run, tail_lines)

    def collect(self, run: RunHandle, dest: Path) -> list[Path]:
        return self._sim.collect(run, dest)

    def notices(self, instance: InstanceHandle) -> list[Notice]:
        return self._sim.notices(instance)

    def alive(self, instance: InstanceHandle) -> bool:
        return self._sim.instance_alive(instance)

    def knows(self, instance: InstanceHandle) -> bool:
        return (self._dir(instance.instance_id) / "instance.json").exists()

    def stop(self, instance: InstanceHandle, reason: str) -> None:
        """What EC2's terminate does to a machine: SIGTERM to the workload, then power off."""
        if self.knows(instance) and self.alive(instance):
            self._sim.terminate(instance, reason)

    def simulate_reclaim(self, instance: InstanceHandle, *, in_seconds: float,
                         notice_seconds: float | None = None) -> None:
        """The interruption EC2 would impose (moto has none): notice on the metadata endpoint,
        SIGTERM at `in_seconds`, local disk wiped, exactly as the sim market does it."""
        self._sim.inject_reclaim(instance, in_seconds=in_seconds, notice_seconds=notice_seconds)

    def kill(self, instance: InstanceHandle) -> None:
        """Chaos: the machine vanishes without a goodbye."""
        self._sim.kill(instance)

    def host_pid(self, instance_id: str) -> int | None:
        """The played machine's process id while it runs, else None."""
        pid = self._sim.host_state(instance_id).get("pid")
        return int(pid) if pid and pid_alive(int(pid)) else None

    def kill_all(self) -> list[str]:
        """Chaos / clean-up: every played machine under this root vanishes. Returns their ids."""
        killed = []
        for d in sorted(self._sim.instances.glob("*")):
            pid = self.host_pid(d.name)
            if pid is not None:
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                    killed.append(d.name)
                except ProcessLookupError:
                    pass
        return killed
