"""Run the `orbit` CLI in a process of its own and measure it: exit code, output, wall time
and the peak RSS of the process tree (the CLI and the face's worker it starts)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# A fresh interpreter runs the CLI and reports getrusage(RUSAGE_CHILDREN) of its own
# children only: the test process's earlier children do not count.
_WRAPPER = r"""
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(json.dumps({"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr,
                             "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


@dataclass
class Measured:
    rc: int
    out: str
    err: str
    seconds: float
    peak_rss: int  # bytes, the largest process of the tree

    @property
    def line(self) -> str:
        lines = self.err.strip().splitlines()
        return lines[-1] if lines else ""


def orbit(args: list[str], *, home: Path, env: dict | None = None, cwd: Path | None = None,
          timeout: float = 240) -> Measured:
    """`orbit ARGS` in a subprocess; a regression that hangs fails at `timeout`, never stalls the suite."""
    full_env = {**os.environ, "ORBIT_HOME": str(home), **(env or {})}
    start = time.monotonic()
    # Its own process group: at the timeout the whole tree is killed (the CLI and its workers).
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, sys.executable, "-m", "orbit_dagster.cli", *args],
                            env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"`orbit {' '.join(a[:80] for a in args)}` ran past {timeout} s") from None
    seconds = time.monotonic() - start
    report = json.loads(stdout)
    return Measured(report["rc"], report["out"], report["err"], seconds, report["peak_rss"])
