"""`orbit ledger check`: the bundles and checkpoints on disk against the ledger.

The bundles (`$ORBIT_HOME/bundles/<sha256>`, content-addressed: core/bundle.py) and the
checkpoint store (a manifest with the sha256 of every file: storage/) are written before
the ledger rows that name them, so when the ledger loses rows (its write-ahead log
removed after a crash, an empty or damaged file, a swapped one) they are the evidence of
what it held. The check re-hashes every bundle and checkpoint it reads and names:

- bundles the ledger does not know, and bundles that do not verify;
- ledger jobs whose bundle is gone;
- checkpoints on disk the ledger does not register, and ones that do not verify;
- registered checkpoints whose files are gone or no longer match the ledger's sha256;
- the ledger itself when it is damaged, missing or not the one this home recorded
  (ledger/identity.py); the check then reads no ledger and says what on disk is in none.

It only reads (the ledger is opened without migrating or recording anything). Checked are
the bundles under this home and the checkpoints in this home's stores (the filesystem
store, and S3 when `ORBIT_S3_CHECKPOINT_STORE` is set): a team ledger's rows for other
homes' bundles are not this home's to judge. Exit codes: 0 consistent, 1 the ledger is
sound but disagrees with the disk, 3 the ledger is unusable (`EXIT_*` below).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.bundle import JobBundle
from ..core.errors import OrbitError
from ..ledger import Ledger, LedgerDamaged
from ..ledger.errors import RECOVERY_DOC
from ..ledger.identity import Verdict, inspect
from ..settings import Settings
from ..storage.base import CheckpointManifest, StoreError, check_name, parse_checkpoint_dir

EXIT_CONSISTENT, EXIT_DISAGREES, EXIT_UNUSABLE = 0, 1, 3


@dataclass
class DiskBundle:
    path: Path
    bundle: JobBundle | None  # None: it does not verify
    problem: str | None = None

    @property
    def job_id(self) -> str | None:
        return self.bundle.job_id if self.bundle else None


@dataclass
class DiskCheckpoint:
    uri: str
    job_id: str
    step: int
    attempt: int
    manifest: CheckpointManifest | None  # None: it does not verify
    problem: str | None = None


@dataclass
class Finding:
    kind: str  # ledger | bundle_unregistered | bundle_corrupt | bundle_missing | checkpoint_unregistered | ...
    subject: str  # a path, a job id or a checkpoint uri/key
    detail: str


@dataclass
class CheckReport:
    verdict: Verdict
    bundles: list[DiskBundle]
    checkpoints: list[DiskCheckpoint]
    ledger_rows: dict[str, list[dict]]
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if not self.verdict.usable:
            return EXIT_UNUSABLE
        return EXIT_DISAGREES if self.findings else EXIT_CONSISTENT

    def count(self, *kinds: str) -> int:
        return sum(1 for f in self.findings if f.kind in kinds)

    @property
    def summary(self) -> str:
        v, nb, nc = self.verdict, len(self.bundles), len(self.checkpoints)
        name = Path(v.where).name if v.where.startswith("/") else v.where
        if not v.usable:
            return (f"{name} is {v.problem}: {nb} bundle(s) and {nc} checkpoint(s) on disk are in no ledger; restore a "
                    f"backup ({RECOVERY_DOC}) or run `orbit ledger repair`")
        jobs = len(self.ledger_rows.get("jobs", []))
        if not self.findings:
            return (f"the ledger {v.where} agrees with the disk: {jobs} job(s), {nb} bundle(s), {nc} checkpoint(s)"
                    + ("" if v.state == "ok" else f" ({_state_words(v)})"))
        parts = [f"{n} {what}" for what, n in (
            ("bundle(s) in no ledger", self.count("bundle_unregistered")),
            ("bundle(s) that do not verify", self.count("bundle_corrupt")),
            ("job(s) whose bundle is gone", self.count("bundle_missing")),
            ("checkpoint(s) on disk not registered", self.count("checkpoint_unregistered")),
            ("checkpoint(s) that do not verify", self.count("checkpoint_corrupt", "checkpoint_unusable")),
            ("registered checkpoint(s) whose files are gone", self.count("checkpoint_missing")),
        ) if n]
        return (f"the ledger {v.where} disagrees with the disk: " + ", ".join(parts)
                + "; `orbit ledger repair` registers what verifies (what is gone stays gone)")

    def as_json(self) -> dict:
        v = self.verdict
        return {"consistent": self.exit_code == EXIT_CONSISTENT, "exit_code": self.exit_code, "summary": self.summary,
                "ledger": {"where": v.where, "location": v.location, "state": v.state, "ledger_id": v.ledger_id,
                           "recorded_id": v.recorded_id, "problem": v.problem},
                "counts": {"bundles_on_disk": len(self.bundles), "checkpoints_on_disk": len(self.checkpoints),
                           "jobs_in_ledger": len(self.ledger_rows.get("jobs", [])),
                           "checkpoints_in_ledger": len(self.ledger_rows.get("checkpoints", []))},
                "findings": [asdict(f) for f in self.findings]}


def _state_words(v: Verdict) -> str:
    return {"unrecorded": f"ledger {v.ledger_id}, recorded by this home the next time it is opened",
            "new": "no ledger yet: one is made on first use"}.get(v.state, v.state)


# ---- what is on disk ----------------------------------------------------------------------

def disk_bundles(settings: Settings) -> list[DiskBundle]:
    """Every bundle under the home, re-hashed (a `.tmp-*` one is a build in progress: skipped)."""
    root = settings.bundles_dir
    if not root.is_dir():
        return []
    found = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            bundle = JobBundle.load(path, verify=True)
            if bundle.bundle_hash != path.name:
                raise OrbitError(f"its manifest's hash {bundle.bundle_hash[:12]} is not its name")
            found.append(DiskBundle(path, bundle))
        except (OrbitError, OSError, ValueError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
            found.append(DiskBundle(path, None, " ".join(str(exc).split())[:300]))
    return found


def checkpoint_stores(settings: Settings) -> list[str]:
    """The store roots of this home: the filesystem store, and S3 when one is configured."""
    roots = [settings.store_uri]
    if settings.s3_configured:
        roots.append(settings.store_uri_for("s3"))
    return roots


def disk_checkpoints(settings: Settings, job_ids: set[str]) -> tuple[list[DiskCheckpoint], list[Finding]]:
    """Every complete checkpoint (manifest present) in this home's stores, re-hashed. The
    filesystem store is listed whole; an S3 store by the job ids the ledger and bundles name."""
    found: list[DiskCheckpoint] = []
    problems: list[Finding] = []
    for root in checkpoint_stores(settings):
        store = settings.open_store(root)
        jobs = set(job_ids)
        fs_root = getattr(store, "root", None)
        if isinstance(fs_root, Path) and fs_root.is_dir():
            jobs |= {p.name for p in fs_root.iterdir() if p.is_dir() and not p.name.startswith(".")}
        for job_id in sorted(jobs):
            try:
                check_name("job id", job_id)
                uris = list(store.list(job_id))
            except StoreError as exc:
                problems.append(Finding("store_unreadable", f"{root} {job_id}", str(exc)[:300]))
                continue
            for uri in uris:
                parsed = parse_checkpoint_dir(uri.rstrip("/").rsplit("/", 1)[-1])
                if parsed is None:
                    continue
                try:
                    manifest, problem = store.verify(uri), None
                    if (manifest.step, manifest.attempt) != parsed:
                        manifest, problem = None, "its manifest names another step or attempt than its folder"
                except StoreError as exc:
                    manifest, problem = None, str(exc)[:300]
                found.append(DiskCheckpoint(uri.rstrip("/"), job_id, parsed[0], parsed[1], manifest, problem))
    return found, problems


def ledger_rows(ledger: Ledger) -> dict[str, list[dict]]:
    """What the check compares, read in one snapshot (columns every schema version has)."""
    with ledger.read() as tx:
        return {
            "jobs": tx.rows("SELECT job_id, state, attempt, imported, lineage, experiment FROM jobs"),
            "bundles": tx.rows("SELECT job_id, attempt, bundle_hash, path FROM bundles"),
            "checkpoints": tx.rows("SELECT checkpoint_key, job_id, attempt, step, lineage, uri, sha256, deleted_at "
                                   "FROM checkpoints"),
            "runs": tx.rows("SELECT job_id, attempt, lineage FROM runs"),
        }


# ---- the check ----------------------------------------------------------------------------

def raw_ledger(settings: Settings) -> Ledger:
    """The ledger without the open-time checks: to look at one that may be refused."""
    return Ledger(settings.ledger_url, home=settings.home)


def check(settings: Settings) -> CheckReport:
    ledger = raw_ledger(settings)
    try:
        verdict = inspect(ledger, deep=True)
        rows: dict[str, list[dict]] = {}
        if verdict.usable and verdict.state != "new":
            try:
                rows = ledger_rows(ledger)
            except LedgerDamaged as exc:
                verdict = Verdict(verdict.location, verdict.where, "damaged", verdict.ledger_id, verdict.recorded_id,
                                  verdict.version, getattr(exc, "what", str(exc)), exc)
    finally:
        ledger.dispose()
    bundles = disk_bundles(settings)
    job_ids = {r["job_id"] for r in rows.get("jobs", [])} | {b.job_id for b in bundles if b.job_id}
    checkpoints, store_problems = disk_checkpoints(settings, job_ids)
    report = CheckReport(verdict, bundles, checkpoints, rows)
    if not verdict.usable:
        report.findings.append(Finding("ledger", verdict.where, verdict.problem or verdict.state))
    report.findings += store_problems
    report.findings += _bundle_findings(settings, bundles, rows)
    report.findings += _checkpoint_findings(settings, checkpoints, rows)
    return report


def _bundle_findings(settings: Settings, bundles: list[DiskBundle], rows: dict) -> list[Finding]:
    out = []
    known = {r["bundle_hash"] for r in rows.get("bundles", [])}
    for b in bundles:
        if b.bundle is None:
            out.append(Finding("bundle_corrupt", str(b.path), b.problem or "does not verify"))
        elif b.bundle.bundle_hash not in known:
            out.append(Finding("bundle_unregistered", str(b.path), f"job {b.job_id}: a bundle no ledger row names"))
    root = settings.bundles_dir.resolve()
    for r in rows.get("bundles", []):
        path = Path(r["path"] or "")
        if path.is_relative_to(root) and not (path / "manifest.json").is_file():
            out.append(Finding("bundle_missing", r["job_id"], f"attempt {r['attempt']}: its bundle {path} is gone"))
    return out


def _in_scope(uri: str, roots: list[str]) -> bool:
    return any(uri.startswith(root.rstrip("/") + "/") for root in roots)


def _checkpoint_findings(settings: Settings, checkpoints: list[DiskCheckpoint], rows: dict) -> list[Finding]:
    out = []
    registered = {(r["uri"] or "").rstrip("/"): r for r in rows.get("checkpoints", [])}
    for c in checkpoints:
        row = registered.get(c.uri)
        if c.manifest is None:
            kind = "checkpoint_corrupt" if row else "checkpoint_unusable"
            out.append(Finding(kind, c.uri, c.problem or "does not verify"))
        elif row is None:
            out.append(Finding("checkpoint_unregistered", c.uri, f"job {c.job_id}, attempt {c.attempt}, step {c.step}: "
                                                                 "complete and verified, but in no ledger"))
        elif row["deleted_at"] is None and row["sha256"] != c.manifest.digest:
            out.append(Finding("checkpoint_corrupt", row["checkpoint_key"],
                               f"its files verify against a manifest other than the one registered (sha256 "
                               f"{c.manifest.digest[:12]}, the ledger recorded {str(row['sha256'])[:12]})"))
    on_disk = {c.uri for c in checkpoints}
    roots = [settings.open_store(r).root_uri for r in checkpoint_stores(settings)]
    for uri, row in registered.items():
        if row["deleted_at"] is None and _in_scope(uri, roots) and uri not in on_disk:
            out.append(Finding("checkpoint_missing", row["checkpoint_key"], f"its files at {uri} are gone"))
    return out
