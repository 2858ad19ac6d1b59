"""What each provider's pool holds now, so sensors ask for no more instances than it allows.

Dagster's tag concurrency limits (dagster.yaml, `orbit/pool` and `orbit/train-pool`) bound
runs. A training handed off to the daemon (control/handoff.py) holds its GPU without holding
a run, so before the queue and evaluation sensors request runs they count what is held,
from both records:
- trainings: jobs DISPATCHING or RUNNING in the ledger, and jobs with a training run queued
  or in progress in Dagster (about to dispatch);
- evaluations: evaluations RUNNING in the ledger, and evaluation runs queued or in progress.
A training may start while its provider's trainings are under the train limit and all its
work under the pool's limit. An evaluation may start while all its work is under the pool's
limit and it leaves the slots that waiting trainings could take now: jobs QUEUED in the
ledger without a run yet, and jobs LOST (about to be queued again, resuming), as many as
the train limit lets start. So an evaluation never takes the slot a queued or recovering
training is about to need, and trainings never wait behind evaluations. A provider
without a limit in dagster.yaml is not capped here.

In Dagster's own queue trainings go first (`dagster/priority`, `run_priority`): a resumed
attempt highest, then a first attempt, then evaluations. When a training run follows
its attempt (ORBIT_FOLLOW=run) the count is the one Dagster's limits already keep; the
sensors then only stop handing Dagster runs it would hold in its queue.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..ledger import Ledger

# The run tags Dagster's tag concurrency limits count (deploy/profiles.py renders the limits).
POOL_TAG = "orbit/pool"  # every run that rents from a provider: its placement
TRAIN_POOL_TAG = "orbit/train-pool"  # training runs only: the share trainings may take
PRIORITY_TAG = "dagster/priority"  # Dagster's run queue dequeues higher first (default 0)
TRAIN_PRIORITY, RESUME_PRIORITY = 10, 20  # evaluations keep the default, 0


def run_priority(kind: str, attempt: int = 1) -> int:
    """Where a run stands in Dagster's queue: a resumed attempt (work already paid for, its
    checkpoint waiting) first, then a first attempt, then evaluations."""
    if kind != "train":
        return 0
    return RESUME_PRIORITY if int(attempt) > 1 else TRAIN_PRIORITY


@dataclass
class Capacity:
    limits: dict[str, int]  # provider -> instances at once (its pool)
    train_limits: dict[str, int]  # provider -> trainings at once
    trains: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # provider -> job ids
    evals: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # provider -> "checkpoint|suite"
    waiting: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # provider -> job ids to start
    eval_groups: set[str] = field(default_factory=set)  # "job|suite" with an evaluation run at work

    def held(self, provider: str) -> int:
        return len(self.trains[provider]) + len(self.evals[provider])

    def may_train(self, provider: str) -> bool:
        if provider in self.train_limits and len(self.trains[provider]) >= self.train_limits[provider]:
            return False
        return provider not in self.limits or self.held(provider) < self.limits[provider]

    def may_eval(self, provider: str) -> bool:
        if provider not in self.limits:
            return True
        return self.limits[provider] - self.held(provider) > self.train_room(provider)

    def train_room(self, provider: str) -> int:
        """Slots the provider's waiting trainings could take now (the train limit allowing)."""
        waiting = len(self.waiting[provider] - self.trains[provider])
        if provider in self.train_limits:
            waiting = min(waiting, max(self.train_limits[provider] - len(self.trains[provider]), 0))
        return waiting

    def evaluating_job(self, job_id: str, suite: str) -> bool:
        """Whether a run evaluates (or is queued to evaluate) this job's checkpoints with `suite`:
        it takes up the job's pending ones of that suite on the instance it rents."""
        return f"{job_id}|{suite}" in self.eval_groups

    def training(self, job_id: str) -> bool:
        """Whether this job already holds (or is about to dispatch) a training."""
        return any(job_id in jobs for jobs in self.trains.values())

    def evaluating(self, checkpoint_key: str, suite: str) -> bool:
        key = f"{checkpoint_key}|{suite}"
        return any(key in keys for keys in self.evals.values())


def limits_from_tags(tag_limits: list[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """The pools' limits from Dagster's tag concurrency limits (as dagster.yaml holds them)."""
    pools: dict[str, int] = {}
    trains: dict[str, int] = {}
    for item in tag_limits:
        value = item.get("value")
        if not isinstance(value, str):
            continue
        if item.get("key") == POOL_TAG:
            pools[value] = int(item["limit"])
        elif item.get("key") == TRAIN_POOL_TAG:
            trains[value] = int(item["limit"])
    return pools, trains


def capacity(ledger: Ledger, tag_limits: list[dict], in_flight: list[dict[str, str]]) -> Capacity:
    """What is held now; `in_flight` is the tags of every Dagster run queued or in progress."""
    pools, trains = limits_from_tags(tag_limits)
    cap = Capacity(pools, trains)
    for row in ledger.rows("SELECT job_id, placement FROM jobs WHERE state IN ('DISPATCHING', 'RUNNING')"):
        cap.trains[row["placement"] or "sim"].add(row["job_id"])
    for row in ledger.rows("SELECT job_id, placement FROM jobs WHERE state IN ('QUEUED', 'LOST')"):
        cap.waiting[row["placement"] or "sim"].add(row["job_id"])
    for row in ledger.rows("""SELECT e.checkpoint_key, e.suite, e.job_id, j.placement FROM evaluations e
                              JOIN jobs j ON j.job_id = e.job_id WHERE e.state = 'RUNNING'"""):
        cap.evals[row["placement"] or "sim"].add(f"{row['checkpoint_key']}|{row['suite']}")
        cap.eval_groups.add(f"{row['job_id']}|{row['suite']}")
    for tags in in_flight:
        provider = tags.get(POOL_TAG)
        if not provider:
            continue
        if TRAIN_POOL_TAG in tags:
            job = tags.get("orbit/job") or tags.get("dagster/partition")
            if job:
                cap.trains[provider].add(job)
        elif tags.get("orbit/kind") == "eval" and tags.get("orbit/checkpoint"):
            cap.evals[provider].add(f"{tags['orbit/checkpoint']}|{tags.get('orbit/suite', '')}")
            job = tags.get("orbit/job") or tags["orbit/checkpoint"].split("/", 1)[0]
            cap.eval_groups.add(f"{job}|{tags.get('orbit/suite', '')}")
    return cap
