"""Measured vs spec TFLOPS of this machine's device.

    python bench/tflops.py [--device cpu|cuda] [--seconds 2] [--size N] [--repeat N] [--json] [--record FILE]

Measures with `orbit_dagster.runtime.probe` (BF16 on a GPU, FP32 on a CPU) and looks the
device name up in the offer catalog for the spec figure (dense BF16, Epoch AI data).
`--record` writes the result into the file's `<!-- tflops:begin -->` ... `<!-- tflops:end -->`
section: one row per (device name, dtype), replaced on rerun, other rows and sections kept.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from orbit_dagster.catalog.gpus import UnknownGpu, gpu_spec  # noqa: E402
from orbit_dagster.runtime.probe import measure_matmul_tflops  # noqa: E402

BEGIN, END = "<!-- tflops:begin -->", "<!-- tflops:end -->"
HEADER = ("| device | dtype | size | iterations | seconds | measured TFLOPS | spec TFLOPS | measured/spec | date |\n"
          "|---|---|---|---|---|---|---|---|---|")


def spec_for(result: dict) -> tuple[float | None, str]:
    """(spec TFLOPS, why) for the probed device; CPUs have no spec in the catalog."""
    if not result["device"].startswith("cuda"):
        return None, "no spec: the catalog holds GPU specs only (this is a CPU, FP32)"
    try:
        spec = gpu_spec(result["device_name"])
    except UnknownGpu:
        return None, f"no spec: the catalog does not know {result['device_name']!r}"
    if spec.bf16_tflops is None:
        return None, f"no spec: {spec.source} has no dense BF16 figure for {spec.name}"
    return spec.bf16_tflops, f"{spec.name}, {spec.source}"


def _label(result: dict) -> str:
    threads = result.get("threads")
    return f"{result['device_name']} ({threads} threads)" if threads else result["device_name"]


def row(result: dict, spec: float | None) -> str:
    ratio = "-" if spec is None else f"{result['tflops'] / spec:.2f}"
    date = datetime.now(timezone.utc).date().isoformat()
    return (f"| {_label(result)} | {result['dtype']} | {result['size']} | {result['iterations']} | "
            f"{result['seconds']:.2f} | {result['tflops']:.4g} | {'-' if spec is None else f'{spec:g}'} | "
            f"{ratio} | {date} |")


def record(path: Path, result: dict, spec: float | None) -> None:
    """Insert or replace this device's row inside the tflops section; leave the rest alone."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    key = f"| {_label(result)} | {result['dtype']} |"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        body, tail = rest.split(END, 1)
        rows = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| device ")
                and not line.startswith(key)]
    else:
        head, tail, rows = text.rstrip("\n") + "\n\n", "\n", []
    rows = sorted([*rows, row(result, spec)])
    section = ("\n## Effective TFLOPS (bench/tflops.py)\n\n"
               "Square matmul, 2*n^3 FLOP per product, after warm-up; BF16 on GPUs, FP32 on CPUs. "
               "Spec = dense BF16 from the Epoch AI hardware data; CPUs have none. With `--repeat N` the row "
               "is the best of N runs (other work on a shared machine only slows a run down). Command: "
               "`python bench/tflops.py --record docs/benchmarks.md`, one row per device (a re-run on a device "
               "replaces its row; on a GPU host add `--device cuda --repeat 5`).\n\n"
               f"{HEADER}\n" + "\n".join(rows) + "\n")
    path.write_text(head + BEGIN + section + END + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measured vs spec TFLOPS")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure N times and keep the best: on a shared machine, other work only ever slows a run")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--record", type=Path, default=None, help="markdown file to record the result in")
    args = ap.parse_args(argv)
    runs = [measure_matmul_tflops(device=args.device, seconds=args.seconds, size=args.size)
            for _ in range(max(1, args.repeat))]
    result = max(runs, key=lambda r: r["tflops"])
    spec, why = spec_for(result)
    if args.json:
        print(json.dumps({**result, "spec_tflops": spec, "spec_note": why}, indent=2))
    else:
        print(f"device    {result['device_name']} ({result['device']}, {result['dtype']}, n={result['size']}, "
              f"{result['iterations']} products in {result['seconds']:.2f} s)")
        spread = "" if len(runs) == 1 else f"  (best of {len(runs)}; worst {min(r['tflops'] for r in runs):.4g})"
        print(f"measured  {result['tflops']:.4g} TFLOPS{spread}")
        print(f"spec      {'-' if spec is None else f'{spec:g} TFLOPS'}  ({why})")
        if spec:
            print(f"ratio     {result['tflops'] / spec:.2f} of spec")
    if args.record:
        record(args.record, result, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
