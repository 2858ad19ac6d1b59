"""A rented host running a command workload, for tests/integration/test_command_local_tier.py:

    python -m tests.integration.command_local_tier_host MB_PER_S BUNDLE [AGENT OPTIONS...]

The real agent (`orbit_dagster.runtime.agent.main`, from the bundle's own runtime copy when
that comes first on PYTHONPATH) runs the bundle's script, with its checkpoint store (`--store`)
writing at MB_PER_S: a slow network store. The files are real, only their pace is set
(local_tier_host.ThrottledStore), so that a test can SIGKILL this process's group, agent and
script together (the instance going), while an upload is under way.
"""
from __future__ import annotations

import sys

from orbit_dagster.runtime import agent
from orbit_dagster.storage import open_store
from tests.integration.local_tier_host import ThrottledStore


def main(mb_per_s: float, argv: list[str]) -> None:
    rate = mb_per_s * 1e6
    # The agent opens its store by this name (runtime/agent.py): the same store, paced.
    agent.open_store = lambda uri, **kw: ThrottledStore(open_store(uri, **kw), rate)
    agent.main(argv)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2:])
