"""The fault table: every reliability test names the fault it injects and the outcome it
expects (`@pytest.mark.fault(...)`); at the end of the session one row per test says what
happened. The rows of earlier suites that cover the same faults (the CLI's one-line errors,
the submission fuzzing) are listed too, under the fault they cover, when they ran.

Both `tests/reliability/conftest.py` and `tests/security/conftest.py` hand these hooks to
pytest; the state is this module's, so a session that loads both prints one table.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

MARK = "fault"

# Tests written before this suite that cover faults of the same issue: (fault, expected outcome).
EARLIER = {
    "tests/security/test_cli_errors.py::test_the_issue_cases_are_one_line_exit_2_and_write_nothing":
        ("defect 5/6: invalid job values, bad names, unservable placement/store (CLI)",
         "one line naming the field, exit 2, $ORBIT_HOME untouched"),
    "tests/security/test_cli_errors.py::test_submit_and_retry_on_a_full_disk_say_so_in_one_line_and_lose_nothing":
        ("defect 5: full disk (16 MiB tmpfs) under `orbit submit` and `orbit retry`", "one line, nothing half-written"),
    "tests/security/test_cli_errors.py::test_a_read_only_disk_is_one_line_naming_the_fix":
        ("read-only disk under `orbit submit`", "one line naming the fix"),
    "tests/security/test_submission_fuzz.py::test_submit_of_hostile_input_never_tracebacks_and_a_refusal_writes_nothing":
        ("hypothesis: hostile overrides and names (submit)", "exit 0 or 2, no traceback, refusal writes nothing"),
    "tests/security/test_submission_fuzz.py::test_submit_of_plausible_input_accepts_only_valid_jobs":
        ("hypothesis: plausible overrides (submit)", "accepted jobs pass the schema and can run here"),
    "tests/security/test_submission_fuzz.py::test_retry_never_tracebacks_and_a_refusal_writes_nothing":
        ("hypothesis: hostile overrides (retry)", "exit 0 or 2, no traceback, refusal writes nothing"),
}

_rows: "OrderedDict[str, dict]" = OrderedDict()
_printed = False


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", f"{MARK}(what, expect): the fault a reliability test injects and the outcome "
                                       "it expects (printed in the fault table)")


def _key(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]  # parametrised cases share one row


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        mark = item.get_closest_marker(MARK)
        key = _key(item.nodeid)
        if mark is not None:
            what = mark.args[0] if mark.args else mark.kwargs.get("what", "")
            expect = mark.kwargs.get("expect", mark.args[1] if len(mark.args) > 1 else "")
            _rows.setdefault(key, {"fault": what, "expect": expect, "results": []})
        elif key in EARLIER:
            what, expect = EARLIER[key]
            _rows.setdefault(key, {"fault": what, "expect": expect, "results": []})


def _outcome(report) -> str | None:
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            return "xpassed" if report.passed else "xfail"
        return {"passed": "passed", "failed": "FAILED", "skipped": "skipped"}[report.outcome]
    if report.when == "teardown" and report.failed:
        return "FAILED"
    return None


def pytest_runtest_logreport(report) -> None:
    row = _rows.get(_key(report.nodeid))
    outcome = _outcome(report)
    if row is None or outcome is None:
        return
    if outcome == "FAILED" and row["results"] and report.when == "teardown":
        row["results"][-1] = outcome
    else:
        row["results"].append(outcome)
    if outcome in ("xfail", "skipped"):
        reason = getattr(report, "wasxfail", "") or (report.longrepr[2] if isinstance(report.longrepr, tuple) else "")
        row["note"] = str(reason).replace("Skipped: ", "")


def _summary(results: list[str]) -> str:
    counts: "OrderedDict[str, int]" = OrderedDict()
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return ", ".join(f"{n} {r}" if n > 1 else r for r, n in counts.items())


def table_lines() -> list[str]:
    """The table, one row per test, in Markdown (docs/reliability.md records one)."""
    rows = [(k, r) for k, r in _rows.items() if r["results"]]
    if not rows:
        return []
    out = ["| test | fault | expected outcome | result |", "|---|---|---|---|"]
    for key, r in rows:
        result = _summary(r["results"])
        if r.get("note"):
            note = " ".join(r["note"].split())
            result += f": {note[:140]}{'...' if len(note) > 140 else ''}"
        cells = [f"`{key.rsplit('::', 1)[-1]}`", r["fault"], r["expect"], result]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return out


def pytest_terminal_summary(terminalreporter) -> None:
    global _printed
    lines = table_lines()
    if _printed or not lines:
        return
    _printed = True
    terminalreporter.section("reliability: faults and outcomes")
    for line in lines:
        terminalreporter.write_line(line)
    target = os.environ.get("ORBIT_FAULT_TABLE")
    if target:  # e.g. to paste into docs/reliability.md
        Path(target).write_text("\n".join(lines) + "\n")
