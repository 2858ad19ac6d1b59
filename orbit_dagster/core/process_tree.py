"""Every process an attempt started, found by a tag in its environment, and killed (stdlib).

A process group does not hold a workload's whole tree: torchrun starts each rank in a session
of its own, and a script may daemonise a helper. What they all keep is the environment they
inherited, so the agent tags its script (`ORBIT_RUN_TAG`) and the sim host its agent
(`ORBIT_HOST_TAG`); whoever ends the attempt kills every process carrying the tag, wherever
its group. Linux (`/proc`); elsewhere nothing is found and the direct kills are all there is.
Shipped in the bundle (core/bundle.py): the agent uses it on the host.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

RUN_TAG = "ORBIT_RUN_TAG"  # set by the agent for its script: one attempt's run of a command
HOST_TAG = "ORBIT_HOST_TAG"  # set by the sim host for its agent: everything on one instance
PROC = Path("/proc")


def tagged(name: str, value: str) -> list[int]:
    """Pids of the live processes (not this one) whose environment holds `name=value`."""
    entry = f"{name}={value}".encode()
    found = []
    for proc in PROC.iterdir() if PROC.is_dir() else ():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if entry in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill_tagged(name: str, value: str) -> int:
    """SIGKILL every process tagged `name=value`; how many were signalled."""
    if not value:
        return 0
    killed = 0
    for pid in tagged(name, value):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            continue
    return killed


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid` (torchrun's ranks are its children)."""
    found = []
    for proc in PROC.iterdir() if PROC.is_dir() else ():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return found
