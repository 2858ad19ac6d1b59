"""The filesystem store's write of one checkpoint file, past the page cache against through it.

    python bench/direct_write.py [--gb 1.2] [--repeat 3] [--dir DIR] [--record FILE]

The store's writer (storage/fs.py, the production path: parts hashed and written on the
pool, the file fsynced, the manifest last) writes the same bytes, in the 64 MiB writes a
large tensor gives torch.save, once with O_DIRECT (`FsStore(direct=True)`, ORBIT_FS_DIRECT=1:
whole parts copied into page-aligned buffers and written past the page cache) and once through
the page cache (`direct=False`, ORBIT_FS_DIRECT=0), the two in turn, the order swapped every repeat. Reported: the wall
seconds and this process's CPU seconds (all threads) of each, medians with their range. A
buffered write allocates a page-cache page for every 4 KiB; what that costs depends on the
machine (on a virtual machine that hands freed pages back to its host, a lot, and not the
same from one run to the next), which is what this measures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from recording import measured_on, recorded_command, replace_section  # noqa: E402

from orbit_dagster.storage.base import CheckpointManifest  # noqa: E402
from orbit_dagster.storage.fs import FsStore  # noqa: E402

BEGIN, END = "<!-- direct-write:begin -->", "<!-- direct-write:end -->"
WRITE = 64 << 20  # one large tensor's bytes per write call
MODES = {"O_DIRECT": True, "page cache": False}


def write_once(store: FsStore, blob: memoryview, name: str) -> tuple[float, float]:
    """(wall s, CPU s) of one checkpoint file through the store's writer, manifest included."""
    t, c = time.perf_counter(), time.process_time()
    with store.writer("bench", name) as w:
        with w.open("state.pt") as fh:
            for i in range(0, len(blob), WRITE):
                fh.write(blob[i:i + WRITE])
        w.commit(CheckpointManifest(job_id="bench", step=1, tier="durable", files={}, attempt=1))
    return time.perf_counter() - t, time.process_time() - c


def measure(gb: float, repeat: int, root: Path) -> dict[str, list[tuple[float, float]]]:
    blob = memoryview(os.urandom(int(gb * 1e9)))
    stores = {mode: FsStore(root.as_uri(), direct=direct) for mode, direct in MODES.items()}
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    order = list(MODES)
    for r in range(repeat + 1):  # the first round warms up (threads, the first allocations)
        for mode in order:
            store = stores[mode]
            name = f"step-{r + 1:09d}-a{1 + list(MODES).index(mode)}"
            result = write_once(store, blob, name)
            store.delete(store.uri_for("bench", name))
            if r:
                out[mode].append(result)
        order.reverse()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir under bench/)")
    ap.add_argument("--record", type=Path, default=None)
    args = ap.parse_args(argv)
    began, load = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=".direct-write-", dir=args.dir or REPO / "bench") as tmp:
        res = measure(args.gb, args.repeat, Path(tmp))

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    table = "| write | wall s, median (min-max) | GB/s | CPU s, median (min-max) |\n|---|---|---|---|\n"
    for mode, rows in res.items():
        wall, cpu = [w for w, _ in rows], [c for _, c in rows]
        table += f"| {mode} | {cell(wall)} | {args.gb / statistics.median(wall):.2f} | {cell(cpu)} |\n"
    print(table)
    if args.record:
        section = (f"\n## One checkpoint file past the page cache and through it (bench/direct_write.py)\n\n"
                   f"{measured_on(load)}, {args.gb:g} GB through the "
                   f"filesystem store's writer (hashing included), {args.repeat} repeats after a warm-up, in "
                   f"{time.time() - began:.0f} s. Command: "
                   f"`{recorded_command('direct_write', sys.argv[1:] if argv is None else argv)}`.\n\n{table}")
        replace_section(args.record, BEGIN, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
