"""The ledger is never lost or replaced silently: a damaged, emptied, swapped or partly lost
ledger is refused in one line (or found by `orbit ledger check`), `orbit ledger repair`
brings back what the bundles and checkpoints on disk prove, and a backup taken under
load is whole. Everything through the real CLI in subprocesses, the ledger read back with
plain sqlite3 (tests/reliability/inject.py)."""
from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.checkpoints import register
from orbit_dagster.control.submit import submit
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from orbit_dagster.storage import CheckpointManifest, checkpoint_dir_name, open_store
from orbit_dagster.storage.base import sha256_bytes
from tests.helpers import wait_for
from tests.reliability import inject
from tests.reliability.conftest import opened, train
from tests.security.test_cli_errors import one_line, orbit

LIGHT = {"config.steps": 8, "checkpoint.every_steps": 4}


def settle(settings: Settings) -> None:
    """This process lets go of the ledger: its write-ahead log is folded into the file."""
    settings.ledger().dispose()


def orbit_all(commands: list[list[str]], home: Path) -> list[subprocess.CompletedProcess]:
    """Run CLI commands side by side (each a real `orbit` process), in order of the list."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda args: orbit(*args, home=home), commands))


def a_checkpoint(settings: Settings, job: str, step: int = 4) -> str:
    """A complete checkpoint in the job's store, registered (what a host's agent leaves)."""
    files = {"state.pt": f"weights at {step}".encode()}
    manifest = CheckpointManifest(job_id=job, step=step, tier="durable", attempt=1,
                                  files={k: {"sha256": sha256_bytes(v), "bytes": len(v)} for k, v in files.items()})
    uri = open_store(settings.store_uri).put(job, checkpoint_dir_name(step, 1), files, manifest)
    register(settings.ledger(), [{"checkpoint_key": R.checkpoint_key(job, 1, step), "job_id": job, "attempt": 1,
                                  "step": step, "uri": uri, "sha256": manifest.digest, "bytes": manifest.total_bytes}],
             eval_suite=None)
    return uri


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.fault("ledger.sqlite cut to 0 bytes, then every orbit command",
                   expect="each refuses in one line naming the file and the fix (exit 2); nothing written; "
                          "`orbit ledger check` names the bundles and checkpoints in no ledger")
def test_a_zero_byte_ledger_is_refused_by_every_command_and_check_names_what_is_missing(settings, orbit_home,
                                                                                        tmp_path):
    job = submit(settings, "charlm-finetune", LIGHT)
    uri = a_checkpoint(settings, job)
    settle(settings)
    db = inject.sqlite_path(orbit_home)
    db.write_bytes(b"")
    run_dir = inject.tiny_state(tmp_path / "elsewhere" / "ckpt-10" / "state.pt").parent.parent
    before = tree(orbit_home)
    commands = [["status"], ["status", job], ["submit", "charlm-finetune"], ["best", "default"], ["cost"],
                ["sql", "SELECT count(*) FROM jobs"], ["retry", job], ["cancel", job], ["logs", job],
                ["import-run", str(run_dir)], ["metric", "set", "eval/loss", "min", "--experiment", "x"], ["offers"],
                ["ledger", "backup"]]
    for args, proc in zip(commands, orbit_all(commands, orbit_home)):
        line = one_line(proc)
        assert f"the ledger {db} is empty (0 bytes)" in line and "orbit ledger repair" in line, (args, line)
    assert tree(orbit_home) == before  # no ledger re-created, no bundle built, no checkpoint copied

    proc = orbit("ledger", "check", home=orbit_home)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ledger.sqlite is empty (0 bytes): 1 bundle(s) and 1 checkpoint(s) on disk are in no "
                               "ledger; restore a backup (docs/reliability.md"), lines[0]
    assert "`orbit ledger repair`" in lines[0]
    assert any(f"job {job}" in line and "bundle_unregistered" in line for line in lines[1:])
    assert any(uri in line and "checkpoint_unregistered" in line for line in lines[1:])
    report = json.loads(orbit("ledger", "check", "--json", home=orbit_home).stdout)
    assert report["ledger"]["state"] == "damaged" and report["exit_code"] == 3 and not report["consistent"]
    assert report["counts"] == {"bundles_on_disk": 1, "checkpoints_on_disk": 1, "jobs_in_ledger": 0,
                                "checkpoints_in_ledger": 0}
    assert tree(orbit_home) == before  # the check only reads


SUBMIT_AND_HANG = """
import sys, time
from orbit_dagster.settings import Settings
from orbit_dagster.control.submit import submit
job = submit(Settings.from_env(sys.argv[1]), "charlm-finetune", {"config.steps": 8})
print(job, flush=True)
time.sleep(3600)  # killed here: the commit is in the write-ahead log, never checkpointed into the file
"""


@pytest.mark.fault("`orbit submit` committed, its process SIGKILLed before the WAL was checkpointed, then "
                   "ledger.sqlite-wal removed",
                   expect="`orbit ledger check` names the orphaned bundle; `orbit ledger repair` brings the job "
                          "back QUEUED; nothing else lost; a second repair changes nothing")
def test_a_removed_wal_after_a_crash_is_found_by_check_and_mended_by_repair(settings, orbit_home, tmp_path):
    kept = submit(settings, "charlm-finetune", LIGHT)
    a_checkpoint(settings, kept)
    settle(settings)
    db = inject.sqlite_path(orbit_home)
    wal = db.with_name("ledger.sqlite-wal")
    assert not wal.exists()  # the kept job is in the file itself
    before = inject.snapshot(db)
    log = tmp_path / "submit.log"
    proc = inject.spawn(SUBMIT_AND_HANG, str(orbit_home), log=log)
    lost = wait_for(lambda: log.read_text().strip() or proc.poll() is not None, 120, what="the submission")
    assert proc.poll() is None, log.read_text()
    inject.sigkill(proc)
    assert wal.stat().st_size > 0 and inject.count(db, "SELECT count(*) FROM jobs WHERE job_id = ?", (lost,)) == 1
    wal.unlink()  # what the operator did after the crash

    status = orbit("status", "--json", home=orbit_home)
    assert status.returncode == 0 and [r["job_id"] for r in json.loads(status.stdout)] == [kept]  # it vanished
    check = orbit("ledger", "check", home=orbit_home)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "1 bundle(s) in no ledger" in check.stdout.splitlines()[0]
    orphan = [line for line in check.stdout.splitlines() if "bundle_unregistered" in line]
    assert len(orphan) == 1 and f"job {lost}" in orphan[0]

    repair = orbit("ledger", "repair", home=orbit_home)
    assert repair.returncode == 0, repair.stdout + repair.stderr
    assert f"job {lost}: QUEUED at attempt 1" in repair.stdout and "moved" not in repair.stdout
    rows = {r["job_id"]: r for r in json.loads(orbit("status", "--json", home=orbit_home).stdout)}
    assert set(rows) == {kept, lost} and (rows[lost]["state"], rows[lost]["attempt"]) == ("QUEUED", 1)
    after = inject.snapshot(db)
    for table, table_rows in before.items():  # nothing else lost: every row from before is still there
        assert set(table_rows) <= set(after[table]), table
    assert inject.count(db, "SELECT count(*) FROM bundles WHERE job_id = ?", (lost,)) == 1
    assert orbit("ledger", "check", home=orbit_home).returncode == 0

    again = orbit("ledger", "repair", home=orbit_home)
    assert again.returncode == 0 and "re-registered 0 job(s), 0 bundle(s), 0 checkpoint(s)" in again.stdout
    assert inject.snapshot(db) == after  # idempotent


@pytest.mark.fault("another home's ledger.sqlite copied over this home's",
                   expect="every command refuses in one line naming both ledger ids (exit 2)")
def test_a_swapped_ledger_is_refused_naming_both_ids(settings, orbit_home, tmp_path):
    mine = submit(settings, "charlm-finetune", LIGHT)
    other = opened(Settings.from_env(tmp_path / "other-home"))
    theirs = submit(other, "charlm-finetune", LIGHT)
    ids = {}
    for s in (settings, other):
        settle(s)
        con = sqlite3.connect(f"file:{inject.sqlite_path(s.home)}?mode=ro", uri=True)
        ids[s.home] = con.execute("SELECT ledger_id FROM ledger_identity").fetchone()[0]
        con.close()
    assert ids[settings.home] != ids[other.home]
    shutil.copyfile(inject.sqlite_path(other.home), inject.sqlite_path(orbit_home))
    for proc in orbit_all([["status"], ["submit", "charlm-finetune"], ["retry", mine]], orbit_home):
        line = one_line(proc)
        assert ids[settings.home] in line and ids[other.home] in line and "swapped" in line, line
    assert theirs not in orbit("ledger", "check", home=orbit_home).stdout.splitlines()[0]
    assert orbit("ledger", "check", home=orbit_home).returncode == 3

    repair = orbit("ledger", "repair", home=orbit_home)
    assert repair.returncode == 0 and "moved the swapped ledger aside" in repair.stdout, repair.stdout + repair.stderr
    rows = json.loads(orbit("status", "--json", home=orbit_home).stdout)
    assert [r["job_id"] for r in rows] == [mine]  # this home's job back, the other home's not adopted


def corrupt_header(db: Path) -> None:
    data = bytearray(db.read_bytes())
    data[16:18] = b"\x00\x07"  # a page size SQLite cannot have
    db.write_bytes(bytes(data))


def corrupt_jobs_page(db: Path) -> None:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
    page = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    data = bytearray(db.read_bytes())
    data[(root - 1) * page] = 0  # the b-tree page's type byte: malformed
    db.write_bytes(bytes(data))


DAMAGE = {"half-truncated": lambda db: inject.truncate(db, 0.5), "header-byte": corrupt_header,
          "page-byte": corrupt_jobs_page}


@pytest.mark.fault("ledger.sqlite half-truncated, or a byte of its header or of a table's page corrupted",
                   expect="one line naming the file and the fix (exit 2); the file byte for byte as it was until "
                          "`orbit ledger repair` moves it aside")
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_truncated_or_corrupted_ledger_is_refused_and_left_as_it_was(settings, orbit_home, damage):
    job = submit(settings, "charlm-finetune", LIGHT)
    settle(settings)
    db = inject.sqlite_path(orbit_home)
    DAMAGE[damage](db)
    damaged = db.read_bytes()
    for proc in orbit_all([["status"], ["status", job], ["cancel", job]], orbit_home):
        line = one_line(proc)
        assert f"the ledger {db} is " in line and "orbit ledger repair" in line, line
    assert db.read_bytes() == damaged
    assert orbit("ledger", "check", home=orbit_home).returncode == 3
    assert db.read_bytes() == damaged

    repair = orbit("ledger", "repair", home=orbit_home)
    assert repair.returncode == 0, repair.stdout + repair.stderr
    moved = Path(repair.stdout.split("moved the damaged ledger aside to ", 1)[1].split(" ", 1)[0])
    assert moved.read_bytes() == damaged and moved.parent.parent == db.parent / "set-aside"
    rows = json.loads(orbit("status", "--json", home=orbit_home).stdout)
    assert [(r["job_id"], r["state"]) for r in rows] == [(job, "QUEUED")]


WRITER = """
import sys
from orbit_dagster.settings import Settings
from orbit_dagster.ledger import records as R
ledger = Settings.from_env(sys.argv[1]).ledger()
n = 0
while True:
    ledger.append("events", R.event("load", job_id="writer", seq=n))
    n += 1
    if n % 25 == 0:
        print(n, flush=True)
"""


@pytest.mark.fault("`orbit ledger backup` while another process commits in a loop",
                   expect="the copy opens, passes integrity_check, keeps the ledger's id and holds every row "
                          "committed before the backup began, with no gap")
def test_a_backup_while_another_process_writes_is_whole(settings, orbit_home, tmp_path):
    db = inject.sqlite_path(orbit_home)
    settle(settings)
    log = tmp_path / "writer.log"
    writer = inject.spawn(WRITER, str(orbit_home), log=log)
    try:
        wait_for(lambda: len(log.read_text().split()) >= 4 or writer.poll() is not None, 120, what="the writer")
        assert writer.poll() is None, log.read_text()
        committed = inject.count(db, "SELECT count(*) FROM events WHERE kind = 'load'")
        (tmp_path / "copies").mkdir()
        proc = orbit("ledger", "backup", str(tmp_path / "copies"), home=orbit_home)
        assert proc.returncode == 0, proc.stderr
        written = inject.count(db, "SELECT count(*) FROM events WHERE kind = 'load'")
    finally:
        inject.sigkill(writer)
    copy = Path(proc.stdout.strip())
    assert copy.parent == tmp_path / "copies" and copy.name.startswith("ledger-") and "integrity ok" in proc.stderr
    assert inject.integrity(copy) == "ok" and not copy.with_name(copy.name + "-wal").exists()
    seqs = sorted(int(json.loads(d)["seq"]) for d, in sqlite3.connect(copy).execute(
        "SELECT detail FROM events WHERE kind = 'load'"))
    assert committed <= len(seqs) <= written and seqs == list(range(len(seqs)))  # a snapshot: a prefix, whole
    assert written > committed  # the writer went on during the backup
    same = "SELECT ledger_id FROM ledger_identity"
    assert sqlite3.connect(copy).execute(same).fetchone() == sqlite3.connect(db).execute(same).fetchone()
    assert one_line(orbit("ledger", "backup", str(copy), home=orbit_home)).find("never overwrites") > 0

    # The documented restore: the daemon (here: the writer) stopped, the copy put back, then a check.
    for name in ("ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"):
        db.with_name(name).unlink(missing_ok=True)
    shutil.copyfile(copy, db)
    assert orbit("ledger", "check", home=orbit_home).returncode == 0
    assert inject.count(db, "SELECT count(*) FROM events WHERE kind = 'load'") == len(seqs)


@pytest.mark.fault("a trained job: one checkpoint's row lost, one's files removed, one's bytes flipped; then the "
                   "whole ledger emptied",
                   expect="check names each; repair registers what verifies (twice = the same); the job comes "
                          "back FAILED and `orbit retry` resumes from its newest verified checkpoint")
def test_repair_brings_back_a_trained_job_whose_retry_resumes_from_its_newest_checkpoint(settings, orbit_home):
    job = train(settings, {"config.steps": 12, "checkpoint.every_steps": 4})
    keys = [R.checkpoint_key(job, 1, s) for s in (4, 8, 12)]
    uris = {r["checkpoint_key"]: r["uri"] for r in R.checkpoints(settings.ledger(), job)}
    lineage = R.job(settings.ledger(), job)["lineage"]
    settle(settings)
    db = inject.sqlite_path(orbit_home)
    shutil.rmtree(inject.path_of(uris[keys[0]]))  # gone
    inject.flip_byte(inject.path_of(uris[keys[1]]) / "state.pt")  # rotten
    con = sqlite3.connect(db)
    con.execute("DELETE FROM checkpoints WHERE checkpoint_key = ?", [keys[2]])  # its row lost
    con.commit()
    con.close()

    report = json.loads(orbit("ledger", "check", "--json", home=orbit_home).stdout)
    found = {(f["kind"], f["subject"]) for f in report["findings"]}
    assert report["exit_code"] == 1 and found == {("checkpoint_missing", keys[0]), ("checkpoint_corrupt", uris[keys[1]]),
                                                  ("checkpoint_unregistered", uris[keys[2]])}, found
    first = orbit("ledger", "repair", home=orbit_home)
    assert first.returncode == 1 and "re-registered 0 job(s), 0 bundle(s), 1 checkpoint(s)" in first.stdout
    snapshot = inject.snapshot(db)
    second = orbit("ledger", "repair", home=orbit_home)
    assert second.returncode == 1 and "re-registered 0 job(s), 0 bundle(s), 0 checkpoint(s)" in second.stdout
    assert inject.snapshot(db) == snapshot and second.stdout.count("checkpoint_") == first.stdout.count("checkpoint_")
    assert inject.count(db, "SELECT count(*) FROM checkpoints WHERE checkpoint_key = ? AND lineage = ?",
                        (keys[2], lineage)) == 1

    db.write_bytes(b"")  # now the whole ledger
    repair = orbit("ledger", "repair", home=orbit_home)
    assert f"job {job}: FAILED at attempt 1; `orbit retry {job}` resumes from {keys[2]}" in repair.stdout, repair.stdout
    assert "not recoverable: bills" in repair.stdout
    row = R.job(settings.ledger(), job)
    assert (row["state"], row["attempt"], row["lineage"]) == ("FAILED", 1, lineage)
    assert "history" in row["reason"] and "orbit retry JOB" in row["reason"]
    assert [r["checkpoint_key"] for r in R.checkpoints(settings.ledger(), job)] == [keys[2]]
    assert orbit("retry", job, home=orbit_home).returncode == 0
    out = run_attempt(settings, job, poll_s=0.1)
    assert out.state == "SUCCEEDED", out.reason
    assert R.run(settings.ledger(), R.run_id_for(job, 2))["resume_from"] == keys[2]



def test_sqlite_damage_that_reaches_the_cli_unwrapped_names_the_ledger_only_when_it_is_the_ledger(
        settings, orbit_home, monkeypatch):
    """A defect of ours that lets SQLite's own error through, in-process (a mock of one function)."""
    import orbit_dagster.control.submit as submit_module
    from tests.security.test_cli_errors import run_main

    def boom(*_a, **_k):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(submit_module, "submit", boom)
    code, err = run_main(["submit", "charlm-finetune"])  # the ledger is whole: some other SQLite file
    assert code == 1 and err.startswith("internal error (DatabaseError)"), err
    settle(settings)
    db = inject.sqlite_path(orbit_home)
    corrupt_jobs_page(db)
    code, err = run_main(["submit", "charlm-finetune"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the ledger {db} is damaged" in err and "orbit ledger repair" in err
