"""No traceback reaches a person from the `orbit` CLI: the real CLI in a subprocess for the
issue's cases and a real full / read-only disk; `main()` in-process for the failure kinds
that no real input reaches today (a defect of ours, a pydantic error)."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from orbit_dagster.cli.commands import main

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


def orbit(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in AWS_VARS and k != "ORBIT_S3_CHECKPOINT_STORE"}
    base.update({"ORBIT_HOME": str(home), "AWS_SHARED_CREDENTIALS_FILE": str(home.parent / "no-aws-credentials"),
                 "AWS_CONFIG_FILE": str(home.parent / "no-aws-config"), "AWS_EC2_METADATA_DISABLED": "true", **env})
    return subprocess.run([sys.executable, "-m", "orbit_dagster.cli", *args], env=base, capture_output=True,
                          text=True, timeout=300)


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr)
    return lines[0]


BIG = "x" * (100 * 1024)  # a single argument may not exceed 128 KiB on Linux; 1 MiB is fuzzed in-process

ISSUE = [  # (arguments after `orbit submit charlm-finetune`, words the one line must hold)
    (["--set", "config.lr=abc"], "config.lr"),
    (["--set", "config.dropout=2"], "config.dropout"),
    (["--set", "config.steps=-5"], "config.steps"),
    (["--set", "config.steps=0"], "config.steps"),
    (["--set", "config.trainable=banana"], "config.trainable"),
    (["--set", "resources.gpu=H900"], "did you mean H200 or H100"),
    (["--set", "checkpoint.every_steps=true"], "checkpoint.every_steps"),
    (["--set", f"config.trainable={BIG}"], "at most 1024"),
    (["--experiment", "a b"], "--experiment"),
    (["--project", "x" * 5000], "--project"),
    (["--set", "checkpoint.store=s3"], "ORBIT_S3_CHECKPOINT_STORE"),
    (["--set", "launch_mode=docker_image"], "launch_mode"),
    (["--set", "placement=local"], "placement"),
    (["--set", "placement=aws_spot"], "no AWS credentials"),
    (["--set", "placement=ssh_rental"], "ssh_hosts.yaml"),
]


@pytest.mark.parametrize("args,words", ISSUE, ids=[" ".join(a)[:40] for a, _ in ISSUE])
def test_the_issue_cases_are_one_line_exit_2_and_write_nothing(orbit_home, args, words):
    line = one_line(orbit("submit", "charlm-finetune", *args, home=orbit_home))
    assert line.startswith("error: ") and words in line and "fix:" in line and len(line) < 1200, line
    assert not orbit_home.exists()  # not even the ledger was opened


def test_usage_errors_are_one_line(orbit_home):
    line = one_line(orbit("submit", home=orbit_home))
    assert "Missing argument 'TEMPLATE'" in line and "orbit submit --help" in line
    assert "No such command" in one_line(orbit("sbumit", home=orbit_home))
    line = one_line(orbit("offers", "--max-price", "cheap", home=orbit_home))
    assert "cheap" in line


def test_a_reader_that_goes_away_is_a_quiet_nonzero_exit(orbit_home):
    proc = subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", "templates"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "ORBIT_HOME": str(orbit_home)})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) != 0 and "Traceback" not in err


# ---- a real full disk and a real read-only one ------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: big enough for a ledger and a few bundles, small enough to fill in a moment."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a size-limited tmpfs (simulating a full disk)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", f"orbit-test-{uuid.uuid4().hex[:8]}", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"this machine does not allow mounting a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write until the file system refuses (ENOSPC): a disk that is really full."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 16)
    # Unbuffered: a buffered file keeps the part of the last chunk the disk refused and
    # raises ENOSPC again when closed, depending on how full the disk was to begin with.
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def files(root: Path) -> dict[str, int]:
    """Every file and its size; SQLite's own write-ahead log and index (-wal, -shm) are transient
    companions of the ledger that any opening process may create, not data."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def test_submit_and_retry_on_a_full_disk_say_so_in_one_line_and_lose_nothing(small_disk):
    home = small_disk / "home"
    job = orbit("submit", "charlm-finetune", "--set", "config.steps=8", home=home).stdout.strip()
    assert job and orbit("cancel", job, home=home).returncode == 0
    before = files(home)
    filler = fill(small_disk)

    line = one_line(orbit("submit", "charlm-finetune", home=home))
    assert "No space left on device" in line and str(small_disk) in line and "free space" in line, line
    line = one_line(orbit("retry", job, "--set", "config.steps=16", home=home))
    assert "No space left on device" in line, line
    assert files(home) == before  # no half-built bundle, no ledger change
    # Without overrides no bundle is built: the ledger's own write is what the disk refuses.
    assert "No space left on device" in one_line(orbit("retry", job, home=home))

    filler.unlink()  # with space again, the job is as it was and the retry goes through
    status = json.loads(orbit("status", "--json", home=home).stdout)
    assert [(r["job_id"], r["state"], r["attempt"]) for r in status] == [(job, "CANCELLED", 1)]
    assert orbit("retry", job, "--set", "config.steps=16", home=home).returncode == 0


def test_a_read_only_disk_is_one_line_naming_the_fix(small_disk):
    home = small_disk / "home"
    assert orbit("submit", "charlm-finetune", home=home).returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    line = one_line(orbit("submit", "charlm-finetune", home=home))
    assert "Read-only file system" in line and "writable directory" in line, line


# ---- main() in-process: failure kinds no real input reaches today ------------------------------

def run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
    return exit_.value.code, err.getvalue()


@pytest.fixture
def submit_raises(monkeypatch):
    """Make `orbit submit` raise what the test gives (a mock of one function, for main's handlers)."""
    import orbit_dagster.control.submit as submit_module

    def arm(exc: BaseException) -> None:
        def boom(*_a, **_k):
            raise exc
        monkeypatch.setattr(submit_module, "submit", boom)
    return arm


def test_an_internal_error_is_one_line_and_its_traceback_goes_to_the_log(orbit_home, submit_raises):
    submit_raises(RuntimeError("boom\nsecond line"))
    code, err = run_main(["submit", "charlm-finetune", "--set", "config.lr=0.1"])
    log = orbit_home / "logs" / "cli-errors.log"
    assert code == 1 and err.strip() == f"internal error (RuntimeError): boom second line; details in {log}"
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: boom" in text and "orbit submit" in text
    assert "config.lr=0.1" not in text  # arguments are not logged


def test_an_internal_error_where_the_log_cannot_be_written(tmp_path, monkeypatch, submit_raises):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("ORBIT_HOME", str(blocked / "home"))  # mkdir under a file fails
    submit_raises(KeyError("x"))
    code, err = run_main(["submit", "charlm-finetune"])
    assert code == 1 and err.startswith("internal error (KeyError)") and "could not be written" in err
    assert len(err.strip().splitlines()) == 1


def test_a_pydantic_error_names_the_field(submit_raises):
    class Probe(BaseModel):
        count: int

    try:
        Probe.model_validate({"count": "many"})
    except ValidationError as exc:
        submit_raises(exc)
    code, err = run_main(["submit", "charlm-finetune"])
    assert code == 2 and "'count'" in err and "'many'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("exc,words", [
    (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/data/orbit/bundles"), "quota"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/orbit/ledger"), "access"),
    (OSError(errno.EROFS, os.strerror(errno.EROFS), "/data/orbit"), "writable directory"),
    (sqlite3.OperationalError("database or disk is full"), "No space left on device"),
    (RuntimeError("IO Error: could not write file: No space left on device"), "free space"),
])
def test_disk_refusals_in_any_wrapping_are_exit_2_with_the_fix(submit_raises, exc, words):
    submit_raises(exc)
    code, err = run_main(["submit", "charlm-finetune"])
    assert code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if getattr(exc, "filename", None):
        assert exc.filename in err
