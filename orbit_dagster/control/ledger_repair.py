"""`orbit ledger repair`: put back into the ledger what the disk proves it held.

First the ledger itself: a SQLite file that is damaged (empty, cut short, malformed) or is
not the one this home recorded is moved aside into `ledger/set-aside/<UTC time>/` (never
deleted) and a new ledger made; a missing one is made anew; the home's record then names
the new ledger's id. A PostgreSQL ledger is never moved: a reset or other database is taken
as the home's ledger from now on, and this home's bundles and checkpoints are registered in it.

Then what verifies, from what `ledger_care.check` found:

- a bundle whose job the ledger does not know becomes that job again, by its content hash:
  the submission it froze gives the job's template, experiment and project; a job with
  several bundles (retries with overrides) gets them as attempts 1, 2, ... in the order
  they were built. Its state: with no sign that an attempt ever ran (no checkpoint, no
  collected artifacts) it is QUEUED, because its submission was acknowledged; otherwise
  FAILED (class `infrastructure`) at the newest attempt seen, with a reason that says its
  history was lost and that `orbit retry JOB` resumes from its newest checkpoint;
- a verified checkpoint the ledger does not register is registered (its manifest's sha256)
  in the lineage its resume chain shows: its parent's, else the attempt's run's, else the
  lineage its attempt would have started; an imported run's checkpoints (their manifest
  says `imported_from`) bring back their imported job, in experiment `imported`.

Not recoverable, and said so: bills and cost lines, metric history, evaluation results
(the evaluation backfill asks for them again, at a new cost), events, Dagster run links.
Repair is idempotent: what it registered is found registered the next time, and what it
cannot register (files that do not verify, files that are gone) is reported each time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

from ..core.bundle import JobBundle
from ..core.host_contract import Checkpoint
from ..core.lifecycle import JobState
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..ledger.health import move_aside
from ..ledger.identity import inspect, read_id
from ..ledger.store import Tx
from ..settings import Settings
from .checkpoints import row_from_event
from .ledger_care import CheckReport, DiskCheckpoint, Finding, check, raw_ledger
from .lineage import lineage_id
from .submit import _bundle_row, ensure_experiment

LOST = "re-registered by `orbit ledger repair`: the ledger lost this job"
FIXED_KINDS = ("bundle_unregistered", "checkpoint_unregistered")
NOT_RECOVERABLE = ("bills and cost lines, metric history, evaluation results (the evaluation backfill asks for them "
                   "again, at a new cost), events and links to Dagster runs of what the ledger lost")


@dataclass
class RepairReport:
    before: str  # the ledger's state before: ok | damaged | swapped | missing | ...
    moved_to: Path | None = None
    ledger_id: str | None = None
    made_new: bool = False
    jobs: list[dict] = field(default_factory=list)  # {job_id, state, attempt, checkpoint}
    bundles: int = 0
    checkpoints: int = 0
    remaining: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.remaining else 0

    def lines(self, where: str) -> list[str]:
        out = []
        if self.moved_to:
            out.append(f"moved the {self.before} ledger aside to {self.moved_to} (kept as it was, never deleted)")
        if self.made_new:
            out.append(f"made a new ledger {self.ledger_id} at {where}; this home now records it")
        out.append(f"re-registered {len(self.jobs)} job(s), {self.bundles} bundle(s), {self.checkpoints} checkpoint(s)")
        for j in self.jobs:
            then = (f"`orbit retry {j['job_id']}` resumes from {j['checkpoint']}" if j["checkpoint"]
                    else "the daemon's job_queue_sensor dispatches it" if j["state"] == "QUEUED" else f"`orbit retry {j['job_id']}`")
            out.append(f"  job {j['job_id']}: {j['state']} at attempt {j['attempt']}; {then}")
        if self.jobs or self.checkpoints or self.made_new:
            out.append(f"not recoverable: {NOT_RECOVERABLE}")
        if self.remaining:
            out.append(f"still {len(self.remaining)} finding(s) repair cannot mend (files that do not verify or are "
                       "gone, checkpoints of a job no bundle names, or a bundle of a job the ledger knows, for an "
                       "attempt it cannot tell):")
            out += [f"  {f.kind}: {f.subject}: {f.detail}" for f in self.remaining]
        else:
            out.append("the ledger and the disk agree (`orbit ledger check` exits 0)")
        return out


def repair(settings: Settings, *, before_moving: Callable[[], None] | None = None) -> RepairReport:
    """Repair the ledger of `settings.home`; `before_moving` may refuse (e.g. a daemon is running)."""
    probe_ledger = raw_ledger(settings)
    try:
        verdict = inspect(probe_ledger, deep=True)  # a page damaged deep inside is set aside too
    finally:
        probe_ledger.dispose()
    report = RepairReport(before=verdict.state)
    if verdict.state in ("damaged", "swapped") and probe_ledger.path is not None:
        if before_moving is not None:
            before_moving()
        report.moved_to = move_aside(probe_ledger.path)
    accept = not verdict.usable
    note = f"orbit ledger repair: {verdict.problem or verdict.state}" + (
        f"; set aside at {report.moved_to}" if report.moved_to else "")
    ledger = Ledger.reopen(settings.ledger_url, home=settings.home, accept=accept, note=note)
    report.made_new = accept and (probe_ledger.path is not None or verdict.state == "missing")
    report.ledger_id = read_id(ledger)
    found = check(settings)
    fixed = _register(settings, ledger, found, report)
    report.remaining = [f for f in found.findings if f.kind != "ledger" and f.subject not in fixed]
    return report


def _register(settings: Settings, ledger: Ledger, found: CheckReport, report: RepairReport) -> set[str]:
    """Register what verifies; returns the subjects of the findings that are now mended."""
    rows = found.ledger_rows
    known_jobs = {r["job_id"]: r for r in rows.get("jobs", [])}
    known_hashes = {r["bundle_hash"] for r in rows.get("bundles", [])}
    registered = {(r["uri"] or "").rstrip("/") for r in rows.get("checkpoints", [])}
    orphans: dict[str, list[JobBundle]] = {}
    for b in found.bundles:
        if b.bundle is not None and b.bundle.bundle_hash not in known_hashes and b.job_id not in known_jobs:
            orphans.setdefault(b.job_id, []).append(b.bundle)
    loose: dict[str, list[DiskCheckpoint]] = {}
    for c in found.checkpoints:
        if c.manifest is not None and c.uri not in registered:
            loose.setdefault(c.job_id, []).append(c)
    fixed: set[str] = set()
    for job_id in sorted(set(orphans) | set(loose)):
        bundles = sorted(orphans.get(job_id, []), key=lambda b: b.spec.created_at)
        ckpts = sorted(loose.get(job_id, []), key=lambda c: (c.attempt, c.step))
        with ledger.write() as tx:
            job = known_jobs.get(job_id) or tx.one("SELECT * FROM jobs WHERE job_id = ?", [job_id])
            if job is None and not bundles and not _imported(ckpts):
                continue  # no bundle and no ledger row name this job: nothing to hang them on
            if job is None:
                job = _recover_job(settings, tx, job_id, bundles, ckpts) if bundles else _recover_import(tx, job_id, ckpts)
                report.bundles += len(bundles)
                fixed |= {str(b.path) for b in bundles}
            added = _register_checkpoints(tx, job, ckpts)
            report.checkpoints += len(added)
            fixed |= {c.uri for c in added}
            if job.get("_recovered"):
                newest = max(added, key=lambda c: (c.attempt, c.step), default=None)
                report.jobs.append({"job_id": job_id, "state": job["state"], "attempt": job["attempt"],
                                    "checkpoint": R.checkpoint_key(job_id, newest.attempt, newest.step) if newest else None})
    return fixed


def _imported(ckpts: list[DiskCheckpoint]) -> bool:
    return bool(ckpts) and all((c.manifest.meta or {}).get("imported_from") for c in ckpts)


def _attempts_collected(settings: Settings, job_id: str) -> set[int]:
    """Attempts whose artifacts were collected (`artifacts/<job>/attempt-N`): they ran."""
    base = settings.artifacts_dir / job_id
    out = set()
    if base.is_dir():
        for p in base.iterdir():
            if p.name.startswith("attempt-") and p.name[8:].isdigit():
                out.add(int(p.name[8:]))
    return out


def _ts(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None


def _recover_job(settings: Settings, tx: Tx, job_id: str, bundles: list[JobBundle],
                 ckpts: list[DiskCheckpoint]) -> dict:
    first, newest = bundles[0], bundles[-1]
    template, sub = first.spec.template, first.spec.submission
    ran = _attempts_collected(settings, job_id)
    attempt = max([len(bundles), *(c.attempt for c in ckpts), *ran])
    lineages = _chain_lineages(ckpts, {}, {}, lambda a: bundles[min(a, len(bundles)) - 1].spec.template)
    lineage = lineages[max(ckpts, key=lambda c: (c.attempt, c.step)).uri] if ckpts else lineage_id(1, template)
    job_row = {"job_id": job_id, "template": template.name, "template_version": template.version,
               "kind": template.kind, "experiment": sub.experiment, "project": sub.project,
               "placement": template.placement, "max_interruptions": template.max_interruptions, "imported": 0,
               "created_at": _ts(first.spec.created_at) or utcnow(), "lineage": lineage}
    states = [R.state_row(job_id, 1, JobState.CREATED, reason=LOST)]
    if ckpts or ran:
        resume = "`orbit retry JOB` resumes from its newest checkpoint" if ckpts else "`orbit retry JOB` runs it again"
        states.append(R.state_row(job_id, attempt, JobState.FAILED, failure_class="infrastructure",
                                  reason=f"{LOST}'s history (attempts, metrics, costs); {resume}"))
    else:
        states.append(R.state_row(job_id, 1, JobState.QUEUED, reason=f"{LOST}; its submission was acknowledged: "
                                  "queued again", detail={"resume": "latest"}))
    ensure_experiment(tx, sub.experiment, sub.project, template)
    R.insert_job(tx, job_row, states)
    tx.insert("bundles", [_bundle_row(b, n) for n, b in enumerate(bundles, 1)])
    tx.insert("events", [R.event("recovered_by_repair", job_id=job_id, bundles=[b.bundle_hash for b in bundles],
                                 checkpoints=len(ckpts), state=states[-1]["state"], newest_template=newest.spec.template
                                 .template_id)])
    return {**job_row, "state": states[-1]["state"], "attempt": states[-1]["attempt"], "_recovered": True,
            "_template": lambda a: bundles[min(a, len(bundles)) - 1].spec.template}


def _recover_import(tx: Tx, job_id: str, ckpts: list[DiskCheckpoint]) -> dict:
    """An imported run (control/importer.py) brought back from its checkpoints' manifests."""
    digest = job_id.rsplit("-", 1)[-1]
    lineage, experiment, now = f"L1-import-{digest}", "imported", utcnow()
    source = ckpts[0].manifest.meta.get("imported_from")
    job_row = {"job_id": job_id, "template": None, "template_version": None, "kind": "imported",
               "experiment": experiment, "project": "default", "placement": "external", "max_interruptions": 0,
               "imported": 1, "created_at": now, "lineage": lineage}
    ensure_experiment(tx, experiment, "default", None)
    R.insert_job(tx, job_row, [R.state_row(job_id, 1, JobState.CREATED, reason=LOST),
                               R.state_row(job_id, 1, JobState.SUCCEEDED, reason=f"{LOST} (imported from {source}); "
                                           "its experiment and metrics were lost")])
    tx.insert("runs", [{"run_id": R.run_id_for(job_id, 1), "job_id": job_id, "attempt": 1, "lineage": lineage,
                        "provider": "external", "imported": 1, "experiment": experiment, "project": "default",
                        "started_at": now, "state": "SUCCEEDED", "exit_code": 0, "reason": LOST, "state_at": now}])
    tx.insert("events", [R.event("recovered_by_repair", job_id=job_id, imported_from=source, checkpoints=len(ckpts))])
    return {**job_row, "state": "SUCCEEDED", "attempt": 1, "_recovered": True, "_template": None}


def _chain_lineages(ckpts: list[DiskCheckpoint], known: dict[str, str], runs: dict[int, str],
                    template_for: Callable | None, job_lineage: tuple[int, str] | None = None) -> dict[str, str]:
    """uri -> lineage for checkpoints in (attempt, step) order: the parent's lineage (registered
    or assigned here), else the attempt's run's, else the job's for its current attempt, else
    the lineage an attempt starting here would have (`lineage.lineage_id`)."""
    out: dict[str, str] = {}
    by_uri = dict(known)
    for c in ckpts:
        parent = (c.manifest.parent or "").rstrip("/")
        lineage = by_uri.get(parent) or runs.get(c.attempt)
        if lineage is None and job_lineage and job_lineage[0] == c.attempt:
            lineage = job_lineage[1]
        if lineage is None:
            lineage = lineage_id(c.attempt, template_for(c.attempt)) if template_for else f"L{c.attempt}-recovered"
        out[c.uri] = by_uri[c.uri] = lineage
    return out


def _register_checkpoints(tx: Tx, job: dict, ckpts: list[DiskCheckpoint]) -> list[DiskCheckpoint]:
    if not ckpts:
        return []
    job_id = job["job_id"]
    known = {r["uri"].rstrip("/"): r["lineage"] for r in tx.rows(
        "SELECT uri, lineage FROM checkpoints WHERE job_id = ? AND uri IS NOT NULL", [job_id])}
    runs = {int(r["attempt"]): r["lineage"] for r in tx.rows(
        "SELECT attempt, lineage FROM runs WHERE job_id = ? AND lineage IS NOT NULL", [job_id])}
    template_for = job.get("_template")
    if template_for is None and not job.get("imported"):
        template_for = _templates_of(tx, job_id)
    current = None if job.get("_recovered") else (int(job["attempt"]), job["lineage"])
    lineages = _chain_lineages(ckpts, known, runs, template_for, current)
    rows = []
    for c in ckpts:
        m = c.manifest
        # The record the host would have written for it (the host contract's), from its manifest.
        ev = Checkpoint(step=m.step, tier=m.tier, uri=c.uri, sha256=m.digest, bytes=m.total_bytes,
                        weights_sha256=m.weights_sha256, parent=m.parent, attempt=m.attempt,
                        train_loss=(m.meta.get("metrics") or {}).get("train/loss"), ts=_ts(m.created_at))
        rows.append(row_from_event(ev, job_id=job_id, run_id=R.run_id_for(job_id, c.attempt),
                                   lineage=lineages[c.uri], experiment=job["experiment"]))
    tx.insert("checkpoints", rows)
    tx.insert("events", [R.event("checkpoints_recovered_by_repair", job_id=job_id,
                                 keys=[r["checkpoint_key"] for r in rows])])
    return ckpts


def _templates_of(tx: Tx, job_id: str) -> Callable | None:
    """attempt -> the template of the bundle that attempt ran (the newest up to it)."""
    bundles = tx.rows("SELECT attempt, path FROM bundles WHERE job_id = ? ORDER BY attempt", [job_id])
    if not bundles:
        return None

    def template_for(attempt: int):
        row = [b for b in bundles if int(b["attempt"]) <= attempt] or bundles[:1]
        return JobBundle.load(row[-1]["path"], verify=False).spec.template

    return template_for
