"""What an instance needs before orbit can reach it: key pair, security group, host key, user-data.

- **Key pair**: an ed25519 key generated here (the private half never leaves this
  machine: it is written mode 0600 under the provider's state dir and never logged), its
  public half imported into EC2 under a name derived from the orbit home, tagged with
  the key's sha256 so a second run (or another process) recognises it.
- **Security group**: one per orbit home and VPC, tagged, admitting TCP 22 only from the
  CIDRs the operator configured. No CIDR configured is an error, never a silent
  0.0.0.0/0: the whole internet is allowed only when the operator writes it.
- **Host key**: a fresh ed25519 host key per instance, handed to cloud-init in user-data
  (`ssh_keys`); its public half is the only key the control plane trusts for that
  instance, so the first connection is checked like every later one (no trust on first use).
- **User-data**: a cloud-config document built as data (`yaml.safe_dump` of a dict), so
  no value is ever spliced into a shell line. It starts nothing: the control plane stages
  the bundle and starts the agent over SSH, exactly as on an SSH rental host.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization as S
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ...core.errors import ProviderError
from .ec2 import Ec2Api

MANAGED = {"orbit/managed-by": "orbit-dagster"}
KEY_SHA_TAG = "orbit/public-key-sha256"
OPEN = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def home_label(state_dir: Path) -> str:
    """A short stable name for one orbit home: its state dir's path, hashed."""
    return "orbit-" + hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:10]


def _tags(resource: str, name: str) -> list[dict]:
    tags = [{"Key": k, "Value": v} for k, v in MANAGED.items()] + [{"Key": "Name", "Value": name}]
    return [{"ResourceType": resource, "Tags": tags}]


def _code(err: ProviderError) -> str:
    return str(err.value or "")  # aws_errors puts AWS's error code in `value`


# ---- host keys ----------------------------------------------------------------------
@dataclass(frozen=True)
class HostKey:
    private_openssh: str  # goes into user-data only; never written to disk here
    public_line: str  # "ssh-ed25519 AAAA... comment"


def new_ed25519(comment: str) -> HostKey:
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(S.Encoding.PEM, S.PrivateFormat.OpenSSH, S.NoEncryption()).decode()
    public = key.public_key().public_bytes(S.Encoding.OpenSSH, S.PublicFormat.OpenSSH).decode()
    return HostKey(private, f"{public} {comment}")


def public_key_sha256(public_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a public key line (without the `SHA256:` prefix)."""
    blob = base64.b64decode(public_line.split()[1])
    return base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# ---- user-data ----------------------------------------------------------------------
def user_data(host_key: HostKey) -> str:
    """The instance's cloud-config: our host key, password logins off, nothing started.

    The AMI supplies Python + torch (an AWS Deep Learning AMI; see docs/providers-aws.md):
    installing a multi-GB CUDA build at every boot would bill minutes of GPU time, and the
    control plane checks the interpreter over SSH before it stages anything.
    """
    config = {
        "ssh_deletekeys": True,  # drop host keys baked into the AMI: they are not this instance's
        "ssh_genkeytypes": [],  # and generate none: the only host key is the one we know
        "ssh_keys": {"ed25519_private": host_key.private_openssh, "ed25519_public": host_key.public_line},
        "ssh_pwauth": False,
        "disable_root": True,
    }
    return "#cloud-config\n" + yaml.safe_dump(config, sort_keys=True, default_flow_style=False)


def host_key_from_user_data(text: str) -> HostKey:
    """The host key a cloud-config from `user_data` carries (what cloud-init installs)."""
    if not text.startswith("#cloud-config\n"):
        raise ValueError("not a cloud-config document")
    keys = (yaml.safe_load(text) or {}).get("ssh_keys") or {}
    return HostKey(keys["ed25519_private"], keys["ed25519_public"])


# ---- CIDRs ---------------------------------------------------------------------------
def ssh_networks(cidrs: tuple[str, ...] | list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The networks allowed to reach port 22; one clear error for a missing or malformed one."""
    if not cidrs:
        raise ProviderError("no CIDR may reach the instances' SSH port, so orbit cannot reach them either",
                            provider="aws", field="ssh_cidr", value=None,
                            fix="set ORBIT_AWS_SSH_CIDR to the address the control plane connects from, "
                                "e.g. 203.0.113.7/32 (0.0.0.0/0 only if you mean the whole internet)")
    out = []
    for text in cidrs:
        try:
            out.append(ipaddress.ip_network(str(text).strip(), strict=True))
        except ValueError as exc:
            raise ProviderError(f"ssh_cidr {text!r} is not a CIDR block: {exc}", provider="aws", field="ssh_cidr",
                                value=text, fix="write it as ADDRESS/PREFIX with the host bits zero, "
                                                "e.g. 203.0.113.7/32 or 198.51.100.0/24") from None
    return out


@dataclass(frozen=True)
class Access:
    key_name: str
    key_file: Path
    security_group_ids: tuple[str, ...]


class Bootstrap:
    """Idempotent set-up of the key pair and security group for one orbit home."""

    def __init__(self, api: Ec2Api, state_dir: Path, *, key_name: str | None = None,
                 ssh_cidrs: tuple[str, ...] = (), security_group_ids: tuple[str, ...] = (),
                 subnet_id: str | None = None):
        self.api, self.state_dir = api, Path(state_dir)
        self.label = home_label(self.state_dir)
        self.key_name = key_name or self.label
        if not _NAME.match(self.key_name):
            raise ProviderError(f"key name {self.key_name!r} is not a valid EC2 key pair name", provider="aws",
                                field="key_name", value=self.key_name, fix="letters, digits, . _ - (<= 200)")
        self.ssh_cidrs, self.security_group_ids, self.subnet_id = tuple(ssh_cidrs), tuple(security_group_ids), subnet_id

    def check(self) -> None:
        """Everything that can be refused without an API call (called before renting anything)."""
        if not self.security_group_ids:
            ssh_networks(self.ssh_cidrs)

    def ensure(self) -> Access:
        self.check()
        key_file = self.ensure_key_pair()
        groups = self.security_group_ids or (self.ensure_security_group(),)
        return Access(self.key_name, key_file, groups)

    # ---- key pair ----------------------------------------------------------------
    @property
    def key_file(self) -> Path:
        return self.state_dir / "keys" / f"{self.key_name}.ed25519"

    def _local_key(self) -> str:
        """The public line of our private key, generated (mode 0600, dir 0700) on first use."""
        keys = self.key_file.parent
        keys.mkdir(parents=True, exist_ok=True)
        os.chmod(keys, 0o700)
        with open(keys / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two processes must not write two different keys
            pub = self.key_file.with_suffix(".pub")
            if not self.key_file.exists():
                key = new_ed25519(self.key_name)
                fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(key.private_openssh)
                pub.write_text(key.public_line + "\n")
            os.chmod(self.key_file, 0o600)
            return pub.read_text().strip()

    def ensure_key_pair(self) -> Path:
        public = self._local_key()
        sha = public_key_sha256(public)
        pair = self._describe_key_pair()
        if pair is None:
            try:
                self.api.call("import_key_pair", KeyName=self.key_name, PublicKeyMaterial=public.encode(),
                              TagSpecifications=[{"ResourceType": "key-pair", "Tags": [
                                  *_tags("key-pair", self.key_name)[0]["Tags"], {"Key": KEY_SHA_TAG, "Value": sha}]}])
                return self.key_file
            except ProviderError as err:
                if _code(err) != "InvalidKeyPair.Duplicate":
                    raise
                pair = self._describe_key_pair()  # another process imported it meanwhile
        tags = {t["Key"]: t["Value"] for t in (pair or {}).get("Tags", [])}
        theirs = (pair or {}).get("PublicKey")
        if tags.get(KEY_SHA_TAG) != sha and not (theirs and public_key_sha256(theirs) == sha):
            raise ProviderError(f"EC2 key pair {self.key_name!r} holds another public key than {self.key_file}",
                                provider="aws", field="key_name", value=self.key_name,
                                fix="delete that key pair in EC2 (orbit imports its own again), or set "
                                    "ORBIT_AWS_KEY_NAME to a new name")
        return self.key_file

    def _describe_key_pair(self) -> dict | None:
        try:
            pairs = self.api.call("describe_key_pairs", KeyNames=[self.key_name], IncludePublicKey=True)["KeyPairs"]
        except ProviderError as err:
            if _code(err) == "InvalidKeyPair.NotFound":
                return None
            raise
        return pairs[0] if pairs else None

    # ---- security group ------------------------------------------------------------
    def vpc_id(self) -> str:
        if self.subnet_id:
            return self.api.call("describe_subnets", SubnetIds=[self.subnet_id])["Subnets"][0]["VpcId"]
        vpcs = self.api.call("describe_vpcs", Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            raise ProviderError(f"region {self.api.region} has no default VPC to launch into", provider="aws",
                                field="subnet_id", value=None, fix="set ORBIT_AWS_SUBNET_ID to a subnet of your VPC")
        return vpcs[0]["VpcId"]

    def _find_group(self, vpc: str) -> dict | None:
        groups = self.api.call("describe_security_groups", Filters=[
            {"Name": "group-name", "Values": [self.label + "-ssh"]}, {"Name": "vpc-id", "Values": [vpc]}])
        return (groups["SecurityGroups"] or [None])[0]

    def ensure_security_group(self) -> str:
        """Our group in the launch VPC, its port-22 rules set to exactly the configured CIDRs."""
        wanted = {str(n) for n in ssh_networks(self.ssh_cidrs)}
        vpc, name = self.vpc_id(), self.label + "-ssh"
        group = self._find_group(vpc)
        if group is None:
            try:
                gid = self.api.call("create_security_group", GroupName=name, VpcId=vpc,
                                    Description="orbit-dagster: SSH from the control plane only",
                                    TagSpecifications=_tags("security-group", name))["GroupId"]
                group = {"GroupId": gid, "IpPermissions": []}
            except ProviderError as err:
                if _code(err) != "InvalidGroup.Duplicate":
                    raise
                group = self._find_group(vpc)  # created by another process meanwhile
        gid = group["GroupId"]
        have = {r["CidrIp"] for p in group.get("IpPermissions", []) if _is_ssh(p) for r in p.get("IpRanges", [])}
        have |= {r["CidrIpv6"] for p in group.get("IpPermissions", []) if _is_ssh(p)
                 for r in p.get("Ipv6Ranges", [])}
        if wanted - have:
            self._rules("authorize_security_group_ingress", gid, wanted - have, "InvalidPermission.Duplicate")
        if have - wanted:  # our group: a CIDR the operator removed is closed again
            self._rules("revoke_security_group_ingress", gid, have - wanted, "InvalidPermission.NotFound")
        return gid

    def _rules(self, operation: str, gid: str, cidrs: set[str], benign: str) -> None:
        v4 = [{"CidrIp": c, "Description": "orbit control plane"} for c in sorted(cidrs) if ":" not in c]
        v6 = [{"CidrIpv6": c, "Description": "orbit control plane"} for c in sorted(cidrs) if ":" in c]
        perm = {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": v4, "Ipv6Ranges": v6}
        try:
            self.api.call(operation, GroupId=gid, IpPermissions=[perm])
        except ProviderError as err:
            if _code(err) != benign:  # another process made the same change first
                raise


def _is_ssh(perm: dict) -> bool:
    return perm.get("IpProtocol") == "tcp" and perm.get("FromPort") == 22 and perm.get("ToPort") == 22


def opens_to_everyone(cidrs: tuple[str, ...]) -> bool:
    """True when the configured CIDRs admit the whole internet (allowed, but only as written)."""
    return any(n in OPEN for n in ssh_networks(cidrs))
