"""The `orbit` CLI as a user runs it (a subprocess), against a temporary $ORBIT_HOME."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def orbit(*args: str, home: Path, check: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "ORBIT_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode:
        raise AssertionError(proc.stderr)
    return proc


def test_override_outside_whitelist_is_one_clear_error_and_leaves_no_trace(orbit_home):
    proc = orbit("submit", "charlm-finetune", "--set", "config.d_model=512", home=orbit_home)
    assert proc.returncode == 2
    assert "config.d_model" in proc.stderr and "config.lr" in proc.stderr  # the field and the allowed ones
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    jobs = orbit("sql", "SELECT count(*) AS n FROM jobs", "--json", home=orbit_home, check=True)
    assert json.loads(jobs.stdout) == [{"n": 0}]
    assert not (orbit_home / "bundles").exists() or not any((orbit_home / "bundles").iterdir())


def test_submit_status_sql_and_errors(orbit_home):
    job = orbit("submit", "charlm-finetune", "--set", "config.steps=8", "--experiment", "cli", home=orbit_home,
                check=True).stdout.strip()
    status = json.loads(orbit("status", "--json", home=orbit_home, check=True).stdout)
    assert [(r["job_id"], r["state"], r["experiment"]) for r in status] == [(job, "QUEUED", "cli")]
    bad = orbit("sql", "SELEKT 1", home=orbit_home)
    assert bad.returncode == 2 and "does not parse" in bad.stderr and "Traceback" not in bad.stderr
    missing = orbit("status", "no-such-job", home=orbit_home)
    assert missing.returncode == 2 and "no-such-job" in missing.stderr
    cost = orbit("cost", "--by", "planet", home=orbit_home)
    assert cost.returncode == 2 and "planet" in cost.stderr


@pytest.mark.parametrize("args", [["retry", "nope"], ["logs", "nope"], ["best", "nope"]])
def test_unknown_names_fail_cleanly(orbit_home, args):
    proc = orbit(*args, home=orbit_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nope" in proc.stderr
