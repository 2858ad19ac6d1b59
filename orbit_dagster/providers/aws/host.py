"""How the aws provider reaches the machine it rented: SSH, with the ssh provider's own code.

The EC2 API rents and releases an instance; it runs nothing on it. Once EC2 says the
instance runs, it becomes one more host of an SSH inventory that this transport writes
(`<state_dir>/ssh_hosts.yaml`: name = the EC2 instance id, the address from
`describe_instances`, the key pair's private key file, and a known_hosts file holding
only the host key this instance got in its user-data). From there everything is the
`ssh_rental` path: the bundle staged over SFTP with sha256 checks, the agent started by
the helper on the host, events and logs read back, checkpoints copied across (fs store)
or written to S3 by the host, SIGTERM + grace before the machine is released.

A file, not memory: a later Dagster run or the daemon re-attaches to an instance by its
id alone, as it does to a rental host.
"""
from __future__ import annotations

import fcntl
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

import yaml

from ...core import safe_yaml
from ...core.errors import NetworkError, ProviderError
from ...core.host_contract import Checkpoint, Entry
from ...core.offers import Offer
from ...runtime.notices import parse_notice_time
from ..base import InstanceHandle, LaunchSpec, Notice, RunHandle, RunStatus
from ..ssh.inventory import InventoryError
from ..ssh.provider import SshProvider

IMDS_URL = "http://169.254.169.254"  # the instance metadata service, as seen from the instance
TORCH_CHECK = "import torch, sys; sys.stdout.write(torch.__version__)"
T = TypeVar("T")


def parse_endpoint(text: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) -> (host, port), one clear error otherwise."""
    host, sep, port = str(text).strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProviderError(f"ssh_endpoint {text!r} is not HOST:PORT", provider="aws", field="ssh_endpoint",
                            value=text, fix="e.g. 127.0.0.1:2222 for a tunnel to the instance's port 22")
    return host, int(port)


class SshHostTransport:
    """Runs the workload on EC2 instances over SSH (see the module docstring)."""

    shares_filesystem = False  # the instance has its own disk: an fs store's files cross over SFTP

    def __init__(self, state_dir: Path, *, user: str = "ubuntu", python: str = "python3", workdir: str = "~/orbit",
                 address: str = "public", endpoint: str | None = None, metadata_url: str = IMDS_URL,
                 boot_timeout_s: float = 600.0, connect_timeout_s: float = 10.0, terminate_grace_s: float = 60.0,
                 unreachable_grace_s: float = 60.0):
        if address not in ("public", "private"):
            raise ProviderError(f"address {address!r} is neither public nor private", provider="aws",
                                field="address", value=address, fix="ORBIT_AWS_ADDRESS=public or private")
        self.state_dir = Path(state_dir)
        self.user, self.python, self.workdir, self.address = user, python, workdir, address
        self.endpoint = parse_endpoint(endpoint) if endpoint else None
        self.metadata_url = metadata_url
        self.boot_timeout_s, self.connect_timeout_s = boot_timeout_s, connect_timeout_s
        self.inventory_path = self.state_dir / "ssh_hosts.yaml"
        self.ssh = SshProvider(self.inventory_path, state_dir=self.state_dir / "ssh",
                               unreachable_grace_s=unreachable_grace_s, terminate_grace_s=terminate_grace_s)

    # ---- the inventory of rented instances ---------------------------------------------
    def address_of(self, inst: dict) -> tuple[str, int]:
        """Where to connect: the tunnel/bastion endpoint if one is set, else the instance's IP."""
        if self.endpoint:
            return self.endpoint
        ip = inst.get("PublicIpAddress" if self.address == "public" else "PrivateIpAddress")
        if not ip:
            raise ProviderError(f"aws instance {inst['InstanceId']} has no {self.address} IP address",
                                provider="aws", field="address", value=self.address,
                                fix="use a subnet that assigns public IPs, set ORBIT_AWS_ADDRESS=private when the "
                                    "control plane runs in the VPC, or reach it through ORBIT_AWS_SSH_ENDPOINT")
        return ip, 22

    def register(self, inst: dict, offer: Offer, host_public_line: str, key_file: Path,
                 retire: tuple[str, ...] = ()) -> None:
        """Add the instance to the inventory, trusting only `host_public_line` for it; drop `retire`."""
        iid = inst["InstanceId"]
        host, port = self.address_of(inst)
        known = self.state_dir / "known_hosts" / iid
        known.parent.mkdir(parents=True, exist_ok=True)
        # paramiko looks a non-22 port up as [host]:port, exactly as OpenSSH writes it.
        name = host if port == 22 else f"[{host}]:{port}"
        known.write_text(f"{name} {' '.join(host_public_line.split()[:2])}\n")
        entry = {"name": iid, "host": host, "port": port, "user": self.user, "key_file": str(key_file),
                 "known_hosts": str(known), "trust_on_first_use": False, "workdir": self.workdir,
                 "python": self.python, "connect_timeout_s": self.connect_timeout_s, "region": offer.region,
                 "gpus": {"model": offer.gpu, "count": offer.gpu_count, "memory_gb": offer.gpu_memory_gb},
                 "usd_per_hour": round(offer.usd_per_second * 3600, 6)}
        drop = {iid, *retire}
        self._edit(lambda hosts: [h for h in hosts if h.get("name") not in drop] + [entry])
        for gone in retire:
            (self.state_dir / "known_hosts" / gone).unlink(missing_ok=True)

    def _edit(self, change: Callable[[list[dict]], list[dict]]) -> None:
        """Read-modify-write under a lock, replaced atomically: readers see the old file or the new."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "ssh_hosts.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            raw = safe_yaml.load(self.inventory_path.read_text()) if self.inventory_path.exists() else None
            hosts = change(list((raw or {}).get("hosts") or []))
            tmp = self.inventory_path.with_name(f".{self.inventory_path.name}.{os.getpid()}")
            tmp.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=True))
            tmp.replace(self.inventory_path)

    def knows(self, instance: InstanceHandle) -> bool:
        try:
            return any(h.name == instance.instance_id for h in self.ssh.inventory.hosts)
        except InventoryError:
            return False

    # ---- boot --------------------------------------------------------------------------
    def _until(self, deadline: float, what: str, fn: Callable[[], T]) -> T:
        """fn() until it stops raising NetworkError (sshd not up yet), or the boot deadline."""
        while True:
            try:
                return fn()
            except NetworkError as exc:
                if time.time() > deadline:
                    raise NetworkError(f"{what}: no answer within the boot timeout of {self.boot_timeout_s:g} s: "
                                       f"{exc}", provider="aws", field="boot_timeout_s", value=self.boot_timeout_s,
                                       fix="check the security group's CIDR and the address orbit connects to; "
                                           "raise ORBIT_AWS_BOOT_TIMEOUT_S for a slow AMI") from exc
                time.sleep(min(2.0, max(0.2, self.connect_timeout_s / 10)))

    def boot(self, instance_id: str, offer: Offer, tags: dict[str, str]) -> tuple[dict, tuple[int, ...]]:
        """Wait for sshd (host key checked), check the interpreter, open the lease of all GPUs."""
        deadline = time.time() + self.boot_timeout_s
        hosts = self.ssh.hosts
        # A wrong host key or a refused login is final: it is raised, never retried.
        self._until(deadline, f"ssh to {instance_id}", lambda: hosts.do(instance_id, "connect", lambda c: None))
        python = hosts.inventory.host(instance_id).python
        while True:
            rc, out, err = self._until(deadline, f"ssh to {instance_id}", lambda: hosts.do(
                instance_id, "check python", lambda c: hosts.exec(c, [python, "-c", TORCH_CHECK], timeout=300)))
            if rc == 0:
                break
            if time.time() > deadline:  # cloud-init may still be installing: only the deadline is final
                raise ProviderError(f"aws instance {instance_id}: {python} cannot import torch: "
                                    f"{err.decode(errors='replace').strip()[-300:]}", provider="aws",
                                    retryable=False, field="python", value=python,
                                    fix="use an AMI with torch (an AWS Deep Learning AMI) and set ORBIT_AWS_PYTHON "
                                        "to its interpreter")
            time.sleep(2.0)
        lease = self.ssh.provision(hosts.inventory.host(instance_id).offer(offer.gpu_count), tags=tags,
                                   instance_id=instance_id)
        return {**lease.address, "transport": "ssh", "torch": out.decode(errors="replace").strip()}, lease.gpu_slots

    # ---- the workload: the ssh provider's own code -----------------------------------
    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle:
        return self.ssh.launch(instance, bundle_dir, spec)

    def status(self, run: RunHandle) -> RunStatus:
        return self.ssh.status(run)

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[Entry], int]:
        return self.ssh.read_events(run, offset)

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str:
        return self.ssh.logs(run, tail_lines)

    def collect(self, run: RunHandle, dest: Path) -> list[Path]:
        return self.ssh.collect(run, dest)

    def reattach(self, run: RunHandle) -> RunHandle | None:
        return self.ssh.reattach(run)

    def localize_checkpoint(self, run: RunHandle, event: Checkpoint, store_uri: str) -> Checkpoint:
        return self.ssh.localize_checkpoint(run, event, store_uri)

    def stage_checkpoint(self, instance: InstanceHandle, uri: str) -> str:
        return self.ssh.stage_checkpoint(instance, uri)

    def host_store_uri(self, instance: InstanceHandle, store_uri: str) -> str:
        return self.ssh.host_store_uri(instance, store_uri)

    def notices(self, instance: InstanceHandle) -> list[Notice]:
        """The instance's metadata service, asked over SSH (the agent polls the same endpoint)."""
        try:
            got = self.ssh.hosts.helper(instance.instance_id, "imds-notice", {"url": self.metadata_url}, timeout=15)
        except ProviderError:
            return []  # unreachable now: the spot request status is the provider's second source
        if not got:
            return []
        at = parse_notice_time(str(got.get("time", "")))
        return [Notice(instance_id=instance.instance_id, action=got["action"], received_at=datetime.now(timezone.utc),
                       deadline=datetime.fromtimestamp(at, timezone.utc) if at else None, source="metadata")]

    def stop(self, instance: InstanceHandle, reason: str) -> None:
        """What precedes EC2's terminate: SIGTERM to the workload (it checkpoints), SIGKILL after the grace."""
        self.ssh.terminate(instance, reason)
