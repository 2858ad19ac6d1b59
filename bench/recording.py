"""`--record`: rewrite one benchmark's section of docs/benchmarks.md between its markers."""
from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, begin: str, end: str, section: str) -> None:
    """Put `section` between `begin` and `end` in `path`, or append the three when absent."""
    text = path.read_text(encoding="utf-8")
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    path.write_text(head + begin + section + end + tail, encoding="utf-8")


RECORDED_IN = "docs/benchmarks.md"


def recorded_command(script: str, argv: list[str], leave_out: tuple[str, ...] = ()) -> str:
    """The command a recorded section names: this run's own arguments, with the file given to
    `--record` written as docs/benchmarks.md, so that running it again rewrites that section.
    The options in `leave_out` (each with its value) are dropped: local outputs such as a file
    of raw clocks, not part of what makes the figures."""
    out, it = [], iter(argv)
    for arg in it:
        name = arg.split("=", 1)[0]
        if name in leave_out:
            if "=" not in arg:
                next(it, None)
            continue
        if arg == "--record":
            next(it, None)
            arg = f"--record {RECORDED_IN}"
        elif arg.startswith("--record="):
            arg = f"--record {RECORDED_IN}"
        out.append(arg)
    return " ".join([f"python bench/{script}.py", *out])


def _cpu_times() -> list[int] | None:
    """The machine's CPU time counters (Linux /proc/stat's first line), or None elsewhere."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


# Counted from the bench's start (this module is imported then): the share of CPU time a
# hypervisor took from this virtual machine while the bench ran, which load averages cannot show.
_CPU_AT_START = _cpu_times()
STEAL = 7  # /proc/stat's columns: user nice system idle iowait irq softirq steal ...


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    if not before or not after or len(before) <= STEAL or len(after) <= STEAL:
        return None
    total = sum(after[:STEAL + 1]) - sum(before[:STEAL + 1])
    return (after[STEAL] - before[STEAL]) / total if total > 0 else None


def measured_on(load_at_start: float | None = None) -> str:
    """The opening of a recorded section: when, on what, how loaded the machine was, and how
    much CPU time its hypervisor took (steal) since the bench started."""
    import os
    import platform
    from datetime import date

    start = "" if load_at_start is None else f"{load_at_start:.1f} at the start, "
    steal = steal_share(_CPU_AT_START, _cpu_times())
    stolen = "" if steal is None else f", {100 * steal:.1f}% of CPU time stolen by the hypervisor"
    return (f"Measured {date.today().isoformat()} on {platform.machine()} ({os.cpu_count()} cores, load average "
            f"{start}{os.getloadavg()[0]:.1f} at the end{stolen})")
