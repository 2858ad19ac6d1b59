"""What a command workload's script says: its metric lines, and what its exit means.

A metrics line is one JSON object on stdout or in ORBIT_METRICS_FILE (docs/bring-your-own.md);
the exit maps onto the agent's one taxonomy (runtime/exits.py). Stdlib only.
"""
from __future__ import annotations

import json

from .exits import EXIT_DIVERGED, EXIT_INFRA, EXIT_OK, EXIT_OOM, EXIT_PREEMPTED, EXIT_USER_ERROR, OOM_MESSAGES

FAILURE_CODES = {"oom": EXIT_OOM, "divergence": EXIT_DIVERGED, "user_error": EXIT_USER_ERROR,
                 "infrastructure": EXIT_INFRA}
FAILURE_KEY = "orbit_failure"


# ---- metric lines -------------------------------------------------------------------
def metric_line(text: str) -> tuple[int | None, dict[str, float], str | None] | None:
    """(step, metrics, failure class) of a metrics line, or None for ordinary log output.

    A metrics line is a JSON object whose `step` (if any) is an integer and that holds at
    least one numeric value or an `orbit_failure` naming a failure class."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    step = obj.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= 2**62):
        return None
    failure = obj.get(FAILURE_KEY)
    failure = failure if failure in FAILURE_CODES else None
    values: dict[str, float] = {}
    for k, v in obj.items():
        if k in ("step", FAILURE_KEY) or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < len(k) <= 200:
            continue
        try:
            values[k] = float(v)
        except OverflowError:
            continue
    if not values and failure is None:
        return None
    return step, values, failure


def exit_code_for(returncode: int, *, noticed: bool, failure: str | None, stderr_tail: str) -> tuple[int, str]:
    """The agent's exit code for a script's return code (runtime/agent.py's taxonomy)."""
    if noticed:
        return EXIT_PREEMPTED, f"reclaim notice; the script exited with {returncode}"
    if returncode == 0:
        return EXIT_OK, "completed"
    what = f"exit {returncode}" if returncode > 0 else f"killed by signal {-returncode}"
    if failure is not None:
        return FAILURE_CODES[failure], f"the script's {what}, reported as {failure}"
    if any(m in stderr_tail.lower() for m in OOM_MESSAGES):
        return EXIT_OOM, f"the script's {what}: out of memory"
    return EXIT_USER_ERROR, f"the script's {what}"
