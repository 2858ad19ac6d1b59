"""Shared fixtures. Real data from the shared data set is read in place, never copied."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

REPO = Path(__file__).resolve().parents[1]

# Property tests: `ci` (the default, `make test`) draws the same examples on every run, so a
# found counterexample is a regression test to write, never a lottery; `random`
# (`make test-all`, HYPOTHESIS_PROFILE=random) explores new ones. Each test's own
# max_examples and deadline still apply.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis_settings.register_profile("random", derandomize=False, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def shared_data_dir() -> Path | None:
    """`$ORBIT_SHARED_DATA`, else `../shared/data` beside the checkout; None when absent."""
    explicit = os.environ.get("ORBIT_SHARED_DATA")
    candidates = [Path(explicit)] if explicit else []
    candidates.append(REPO.parent / "shared" / "data")
    for c in candidates:
        if c.is_dir():
            return c
    return None


@pytest.fixture
def shared_data() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("needs the shared public data set (../shared/data or $ORBIT_SHARED_DATA); absent on this machine")
    return d


@pytest.fixture(autouse=True)
def signal_handlers():
    """Each test starts with the handlers the session had and leaves them so: Dagster's
    in-process execution (`materialize`) turns SIGTERM into KeyboardInterrupt and does not
    put the old handler back, which changed how later tests that signal themselves ran."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in kept.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def orbit_home(tmp_path, monkeypatch) -> Path:
    """Every test gets its own $ORBIT_HOME: nothing leaks between tests or into the checkout."""
    home = tmp_path / "orbit-home"
    monkeypatch.setenv("ORBIT_HOME", str(home))
    monkeypatch.delenv("ORBIT_CHECKPOINT_STORE", raising=False)
    monkeypatch.delenv("ORBIT_TEMPLATES", raising=False)
    # Tests that want reclaims ask for them; the rest get a market that never reclaims.
    monkeypatch.setenv("ORBIT_SIM_RECLAIMS", "none")
    for var in ("ORBIT_SIM_TRACES", "ORBIT_SIM_SCALE", "ORBIT_SIM_NOTICE_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    # The embedded profile unless a test asks for another (tests/postgres.py: team_profile).
    for var in ("ORBIT_PROFILE", "ORBIT_POSTGRES_URL", "ORBIT_POOLS", "ORBIT_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)
    yield home
    kill_processes_under(home)


def kill_processes_under(root: Path) -> None:
    """End what a test left running under its home (sim hosts and their workloads, which
    by design outlive the process that rented them), by process group."""
    import signal

    token = str(root).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if token in (proc / "cmdline").read_bytes():
                os.killpg(os.getpgid(int(proc.name)), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
