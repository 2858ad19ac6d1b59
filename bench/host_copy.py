"""What a durable save's host copy costs on this machine, by how long its memory sat idle.

    python bench/host_copy.py [--gb 1.2] [--idle 0,10,60,150] [--threads 2] [--record FILE]

A checkpoint's first step on the training thread is a host copy of the state (runtime/encoding.py
`stage`). Its cost is not only the copy: memory the copy lands in must be mapped, page by page,
and on a virtual machine whose kernel pages out memory left idle (DAMON's pageout) or hands freed
pages back to the hypervisor (free page reporting), memory the process still holds may have to
come back too. This measures, side by side after each idle time (seconds between one copy and the
next, as between two durable saves):

- "held": a copy into buffers the process kept since the last copy (what `stage` does with the
  `spare` buffers of the last durable copy);
- "fresh": a copy into newly allocated tensors (what `stage` did on a CPU before it kept them);
- "floor": the same copy again at once into the buffers just written (nothing to map);
- "stage": the same copy through `stage` itself (runtime/encoding.py), the code a durable save
  runs, into the held buffers, again at once: at `--threads 1` (a job pinned to one torch
  thread) it spreads the copy over the cores, so "floor / stage" is what that gains; at torch's
  default of a thread per core, torch shares each copy out itself and `stage` copies as the
  loop does.

The state is float32 tensors of 9.4 MB each, the size of the 100M model's large matrices
(bench/step_overhead.py). The figures are the machine's, not orbit's: they say what an interval
between saves costs on this host, which the step-overhead record needs to be read.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from recording import measured_on, recorded_command, replace_section  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orbit_dagster.runtime.encoding import copy_threads, stage  # noqa: E402

BEGIN, END = "<!-- host-copy:begin -->", "<!-- host-copy:end -->"
TENSOR_FLOATS = 2_359_296  # 768 x 3072: one of the 100M model's MLP matrices


def copy_into(buffers: list[torch.Tensor], source: list[torch.Tensor]) -> float:
    began = time.perf_counter()
    for b, s in zip(buffers, source):
        b.copy_(s)
    return time.perf_counter() - began


def fresh_copy(source: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    began = time.perf_counter()
    out = [torch.empty_like(s).copy_(s) for s in source]
    return time.perf_counter() - began, out


def measure(gb: float, idles: list[float]) -> list[dict]:
    n = max(1, int(gb * 1e9 / (TENSOR_FLOATS * 4)))
    g = torch.Generator().manual_seed(0)
    source = [torch.randn(TENSOR_FLOATS, generator=g) for _ in range(n)]
    _, held = fresh_copy(source)
    rows = []
    for idle in idles:
        for s in source:
            s.add_(1.0)  # a training step: the source is hot, as the live state is
        time.sleep(idle)
        held_s = copy_into(held, source)
        floor_s = copy_into(held, source)
        began = time.perf_counter()
        staged = stage({str(i): s for i, s in enumerate(source)}, spare={f'["{i}"]': b for i, b in enumerate(held)})
        stage_s = time.perf_counter() - began
        assert all(staged[str(i)].data_ptr() == b.data_ptr() for i, b in enumerate(held))  # into the held buffers
        fresh_s, fresh = fresh_copy(source)
        del fresh  # freed, as the copy of a written checkpoint was
        rows.append({"idle": idle, "held": held_s, "fresh": fresh_s, "floor": floor_s, "stage": stage_s,
                     "bytes": n * TENSOR_FLOATS * 4})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--idle", default="0,10,60,150", help="seconds idle before each copy, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.time()
    rows = measure(args.gb, [float(x) for x in args.idle.split(",")])
    table = ("| idle before the copy (s) | into held buffers (s) | into fresh memory (s) | again at once (floor, s) "
             "| held / floor | fresh / floor | again through `stage` (s) | floor / stage |\n"
             "|---|---|---|---|---|---|---|---|\n")
    table += "\n".join(f"| {r['idle']:.0f} | {r['held']:.3f} | {r['fresh']:.3f} | {r['floor']:.3f} | "
                       f"{r['held'] / r['floor']:.1f} | {r['fresh'] / r['floor']:.1f} | {r['stage']:.3f} | "
                       f"{r['floor'] / r['stage']:.2f} |" for r in rows)
    print(table)
    if args.record:
        section = (f"\n## A host copy by the idle time before it (bench/host_copy.py)\n\n{measured_on()}, "
                   f"torch {torch.__version__}, {rows[0]['bytes'] / 1e9:.2f} GB in 9.4 MB float32 tensors, "
                   f"torch threads {args.threads}, copy threads {copy_threads()}, in {time.time() - began:.0f} s. Command: "
                   f"`{recorded_command('host_copy', sys.argv[1:] if argv is None else argv)}`.\n\n{table}\n")
        replace_section(args.record, BEGIN, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
