"""The SSH host helper's wrapper: when the agent exits, every process it started ends with it,
even one in a session of its own (as torchrun starts each rank)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orbit_dagster.providers.ssh.host as ssh_host

# An "agent" that starts a long sleeper in its own session, records its pid, and exits.
AGENT = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(p.pid))
time.sleep(0.5)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_a_process_that_left_the_wrappers_session_dies_when_the_agent_exits(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid_file = tmp_path / "sleeper.pid"
    (run_dir / "launch.json").write_text(json.dumps({"argv": [sys.executable, "-c", AGENT, str(pid_file)],
                                                     "cwd": str(tmp_path), "env": {}}))
    wrapper = subprocess.run([sys.executable, "-S", ssh_host.__file__, "run", str(run_dir)], input=b"{}",
                             timeout=60)
    assert wrapper.returncode == 0
    sleeper = int(pid_file.read_text())
    deadline = time.time() + 10
    while alive(sleeper) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(sleeper), "a process the agent started outlived it"
    assert json.loads((run_dir / "wrapper_exit.json").read_text())["returncode"] == 0
