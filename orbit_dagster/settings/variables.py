"""Every environment variable orbit's control plane reads, with its default and its meaning.

`Settings.from_env` reads only names declared here (`Env.get` refuses any other), and
docs/deploy.md's table of settings is made from this list (`python -m orbit_dagster.settings`;
a unit test keeps the two equal), so a setting cannot be read without being documented.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # as the table shows it ("" when unset means off / none)
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("ORBIT_HOME", "`./.orbit`", "where everything lives: ledger, bundles, checkpoints, Dagster's home"),
    # The deployment
    Variable("ORBIT_PROFILE", "`embedded`", "`embedded` (SQLite, one machine) or `team` (PostgreSQL, many people)"),
    Variable("ORBIT_POOLS", "`sim=4 ssh_rental=2 aws_spot=4`",
             "concurrent runs per provider (`NAME=LIMIT` pairs); `ssh_rental` defaults to the inventory's GPUs"),
    Variable("ORBIT_POSTGRES_URL", "", "the team profile's server, `postgresql://USER@HOST:PORT/DB` (password in "
                                       "PGPASSWORD or ~/.pgpass)"),
    Variable("ORBIT_LEDGER_URL", "SQLite under the home (team: its PostgreSQL)",
             "the ledger's database, `sqlite:///PATH` or `postgresql+psycopg://USER@HOST:PORT/DB`"),
    Variable("ORBIT_FOLLOW", "`run` (team: `daemon`)",
             "who follows a training attempt: its run, or the daemon after a hand-off"),
    Variable("ORBIT_HANDOFF_AFTER_S", "60", "with `daemon`: how long the launching run follows before it hands off"),
    Variable("ORBIT_FOLLOW_EVERY_S", "300",
             "with `daemon`: the longest a running attempt goes without a run collecting its events"),
    Variable("ORBIT_WORKER_TIMEOUT_S", "60", "a run worker on another machine is dead after this long without a "
                                             "heartbeat"),
    Variable("ORBIT_CODE_SERVER", "", "a code server run as a service (`unix:/path` or `HOST:PORT`); unset: "
                                      "`orbit daemon`/`ui` start their own"),
    Variable("ORBIT_WORKSPACE", "", "an operator's own `workspace.yaml` for the webserver and daemon"),
    # Templates, checkpoints, evaluations
    Variable("ORBIT_TEMPLATES", "`$ORBIT_HOME/templates` if it exists",
             "a directory of templates; one shadows a shipped template of its name"),
    Variable("ORBIT_CHECKPOINT_STORE", "`$ORBIT_HOME/checkpoints`", "the filesystem checkpoint store "
                                                                    "(`checkpoint.store: fs`), a `file://` URI"),
    Variable("ORBIT_FS_DIRECT", "1", "1: the filesystem store writes a checkpoint's whole parts with `O_DIRECT`, "
                                     "past the page cache (Linux; a file system that refuses it gets the page cache); "
                                     "0: through the page cache, for a file system where `O_DIRECT` is slow. Read "
                                     "where the store is opened: on a rented host, from its environment"),
    Variable("ORBIT_LOAD_MMAP", "1", "1: a checkpoint read where it lies (a filesystem store) is verified, then "
                                     "mapped (`torch.load(mmap=True)`, copy-on-write), not read again into new "
                                     "memory; 0: read into memory, for a network file system where another machine "
                                     "may delete a checkpoint that a run still has mapped. Read by the run, from "
                                     "the host's environment"),
    Variable("ORBIT_S3_CHECKPOINT_STORE", "", "the S3 checkpoint store (`checkpoint.store: s3`), `s3://BUCKET/PREFIX`"),
    Variable("ORBIT_S3_MULTIPART_THRESHOLD", "67108864 (64 MiB)", "a file of one part smaller than this goes as one "
                                                                  "PUT; any other by multipart upload"),
    Variable("ORBIT_S3_PART_SIZE", "16777216 (16 MiB)", "bytes per part of a checkpoint file (at least 5 MiB): each "
                                                        "part's sha256 is in the manifest and sent as its checksum"),
    Variable("ORBIT_S3_CONCURRENCY", "8", "parts of a checkpoint uploaded or downloaded at once"),
    Variable("ORBIT_BUNDLE_MAX_MB", "256", "the largest workload directory a bundle packages (its `.orbitignore` "
                                           "leaves data out)"),
    Variable("ORBIT_EVAL_TIMEOUT_S", "1800", "the longest one evaluation may run"),
    Variable("ORBIT_EVAL_SHARE", "8", "checkpoints one evaluation run evaluates on the instance it rented (its own, "
                                      "then its job's other pending ones of the suite); 1: an instance each"),
    Variable("ORBIT_MIGRATION_WINDOW_S", "600", "proactive migration compares offers' risk over windows this long"),
    Variable("ORBIT_DISCOVERY_PROVIDERS", "`catalog sim`, `ssh` with an inventory, `aws` with an endpoint or AMI",
             "what offer discovery asks for shapes: `catalog` (the shipped prices), `sim`, `ssh`, `aws`"),
    # The SQL face
    Variable("ORBIT_SQL_TIMEOUT_S", "60", "a query's time limit (`orbit sql --timeout SECONDS`)"),
    Variable("ORBIT_SQL_MEMORY", "`1GiB`", "a query's memory (at most this machine's)"),
    Variable("ORBIT_SQL_TEMP_SIZE", "`4GiB`", "what a query may spill under the ledger's `tmp/`"),
    Variable("ORBIT_SQL_MAX_QUERY_CHARS", "65536", "the longest SQL text"),
    # The sim market
    Variable("ORBIT_SIM_RECLAIMS", "`trace`", "`trace` (replay spot traces) or `none`"),
    Variable("ORBIT_SIM_TRACES", "generated from the fitted model", "a directory of preemption traces to replay"),
    Variable("ORBIT_SIM_SCALE", "1", "market seconds per wall second"),
    Variable("ORBIT_SIM_NOTICE_SECONDS", "120", "the reclaim notice, in market seconds"),
    # SSH rental hosts
    Variable("ORBIT_SSH_HOSTS", "`$ORBIT_HOME/ssh_hosts.yaml`", "the SSH inventory (docs/providers-ssh.md)"),
    # AWS spot (docs/providers-aws.md); credentials: boto3's chain, never a setting
    Variable("ORBIT_AWS_REGION", "`AWS_REGION`, else `us-east-1`", "the EC2 region"),
    Variable("ORBIT_AWS_ENDPOINT_URL", "`AWS_ENDPOINT_URL`", "an EC2 endpoint (moto, a VPC endpoint)"),
    Variable("ORBIT_AWS_IMAGE_ID", "", "the AMI hosts boot (required for real AWS)"),
    Variable("ORBIT_AWS_SSH_CIDR", "", "CIDRs that may reach the hosts' SSH port (required unless own security "
                                       "groups are given)"),
    Variable("ORBIT_AWS_SECURITY_GROUP_IDS", "", "security groups of your own instead of orbit's"),
    Variable("ORBIT_AWS_SUBNET_ID", "", "the subnet hosts are launched in"),
    Variable("ORBIT_AWS_KEY_NAME", "", "an EC2 key pair of your own instead of orbit's"),
    Variable("ORBIT_AWS_INSTANCE_PROFILE", "", "an instance profile for the hosts (S3 checkpoints by role)"),
    Variable("ORBIT_AWS_SSH_USER", "`ubuntu`", "the hosts' SSH user"),
    Variable("ORBIT_AWS_ADDRESS", "`public`", "how orbit reaches a host: `public` or `private` IP"),
    Variable("ORBIT_AWS_SSH_ENDPOINT", "", "a tunnel or bastion endpoint `host:port` instead of the address"),
    Variable("ORBIT_AWS_PYTHON", "`python3`", "the hosts' interpreter (with torch)"),
    Variable("ORBIT_AWS_WORKDIR", "`~/orbit`", "the hosts' working directory"),
    Variable("ORBIT_AWS_METADATA_URL", "`http://169.254.169.254`", "the metadata service the agent polls for notices"),
    Variable("ORBIT_AWS_BOOT_TIMEOUT_S", "600", "the longest a host may take to boot and answer SSH"),
    Variable("ORBIT_AWS_TERMINATE_GRACE_S", "60", "how long a stop may take before the instance is terminated"),
)

# Not settings: names the host side reads from its own environment, set by a launch
# (runtime/device.py, runtime/agent.py, runtime/command.py), and AWS's own, read by boto3's chain.
HOST_VARIABLES: dict[str, str] = {
    "ORBIT_DEVICE": "the host's device: `auto`, `cpu`, `cuda`, `cuda:N` (runtime/device.py)",
    "ORBIT_PRECISION": "the host's autocast dtype: `auto`, `fp32`, `bf16` (runtime/device.py)",
    "ORBIT_METADATA_URL": "the metadata service the host's agent polls for notices (set by the AWS launch)",
    "ORBIT_HOST_TAG": "set by the sim host for its agent: every process of the instance carries it (core/process_tree.py)",
    "ORBIT_RUN_TAG": "set by the agent for its script: every process of one run carries it, torchrun's ranks too",
}
# Set by the agent for a command workload's script (runtime/command.py, docs/bring-your-own.md),
# read by the script or a framework callback (integrations/env.py), never by the control plane.
SCRIPT_VARIABLES: dict[str, str] = {
    "ORBIT_JOB_ID": "the job id",
    "ORBIT_ATTEMPT": "the attempt number (1, 2, ...)",
    "ORBIT_TASK": "`train` or `eval`",
    "ORBIT_CHECKPOINT_DIR": "where the script writes its checkpoints (the agent watches it)",
    "ORBIT_RESUME_FROM": "the verified checkpoint to resume from, as the script wrote it, or empty",
    "ORBIT_METRICS_FILE": "a file the script may append JSON lines of metrics to",
    "ORBIT_CHECKPOINT_EVERY": "steps between periodic checkpoints",
    "ORBIT_CHECKPOINT_SCHEDULE": "the agent's re-decided checkpoint schedule (a JSON file a command workload reads)",
    "ORBIT_EVAL_CHECKPOINT": "eval only: the verified checkpoint to evaluate",
    "ORBIT_CONFIG": "a JSON file holding the template's `config`",
    "ORBIT_STOP_FILE": "created by the agent when a reclaim notice arrives",
}
HOST_VARIABLES.update(SCRIPT_VARIABLES)
AWS_VARIABLES = ("AWS_REGION", "AWS_ENDPOINT_URL")  # fallbacks of ORBIT_AWS_REGION / ORBIT_AWS_ENDPOINT_URL

NAMES = frozenset(v.name for v in VARIABLES)


class Env:
    """The environment as `Settings.from_env` read it: one snapshot, asked only for declared names."""

    def __init__(self, snapshot: Mapping[str, str]):
        self.snapshot = snapshot

    def get(self, name: str) -> str | None:
        if name not in NAMES and name not in AWS_VARIABLES:
            raise KeyError(f"{name} is not a declared setting (settings/variables.py)")
        return self.snapshot.get(name) or None


def markdown_table() -> str:
    """docs/deploy.md's table of settings."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default or 'unset'} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"
