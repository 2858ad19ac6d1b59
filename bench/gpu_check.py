"""The GPU actually used: probe, step time, checkpoint saves from GPU memory, determinism, OOM.

    python bench/gpu_check.py [--record docs/benchmarks.md] [--save-size 1G] [--json]

On a host where torch sees a CUDA device, in one run (about 2-4 minutes on one GPU):
1. effective TFLOPS (runtime.probe, BF16) against the catalog's dense BF16 spec;
2. one training step of the example workload on the GPU (the runtime's device choice and
   bf16 autocast, through a real RunContext), demo model and ~100M-parameter model,
   seconds per step over a window after warm-up;
3. checkpoint saves of a ~1 GB model-shaped state held in GPU memory: durable (copy to
   pinned host buffers, then torch.save streamed into the store, parts hashed and written on
   its threads, in the background) and emergency,
   against a raw device-to-host copy + write + fsync of the same bytes on the same disk;
4. determinism: the workload run to step 2K, and again resumed from its step-K checkpoint,
   must end with the same weights digest;
5. a real CUDA OOM (an allocation larger than the device, and the workload under
   `device_memory_mb`, which caps the CUDA allocator) is classed `oom` by the agent;
6. durable saves of a GPU state reuse their pinned host buffers.
Without CUDA it prints why and exits 2: nothing is measured, nothing is recorded.
`--device cpu` runs the same checks on the CPU with small sizes, to test this script.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from recording import replace_section  # noqa: E402

BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
EXIT_NO_GPU = 2


def probe_row(device: str, seconds: float) -> dict:
    from tflops import spec_for

    from orbit_dagster.runtime.probe import measure_matmul_tflops

    result = measure_matmul_tflops(device=device, seconds=seconds, size=None if device != "cpu" else 512)
    spec, why = spec_for(result)
    return {"tflops": result["tflops"], "dtype": result["dtype"], "size": result["size"], "spec_tflops": spec,
            "spec_note": why, "ratio": None if not spec else result["tflops"] / spec}


def step_times(quick: bool, root: Path) -> dict:
    import step_overhead as S

    from orbit_dagster.core.templates import load_template

    train, base = S.load_train(), load_template("charlm-finetune").config
    out = {}
    for name in ("demo", "100M"):
        cfg = {**base, **S.MODELS[name]}
        if quick and name == "100M":
            cfg.update(d_model=128, n_heads=4, n_layers=2)
        last = 15 if quick else 60
        per_step, _ = S.one_run(train, cfg, root, policy=False, threads=1, every=10**9, memory_every=10**9, last=last)
        out[name] = {"seconds_per_step": per_step, "steps": last - S.WARMUP}
    return out


def save_throughput(device: str, nbytes: int, repeat: int, root: Path) -> dict:
    import checkpoint_io as IO

    state = IO.model_state(nbytes)
    state = {"model": {k: v.to(device) for k, v in state["model"].items()},
             "optim": {"state": {i: {k: v.to(device) for k, v in s.items()} for i, s in state["optim"]["state"].items()},
                       "param_groups": state["optim"]["param_groups"]}, "step": state["step"]}
    root.mkdir(parents=True, exist_ok=True)
    ours = IO.Ours((root / "store").as_uri(), root / "work")
    ours.warm_up(state)
    res: dict[str, list] = {k: [] for k in ("durable", "emergency", "raw", "blocked", "write")}
    size, reused = 0, []
    for _ in range(repeat):
        before = {k: v.data_ptr() for k, v in (ours.ck._spare or {}).items()}
        seconds, ev = ours.durable(state)
        reused.append(bool(before) and before == {k: v.data_ptr() for k, v in (ours.ck._spare or {}).items()})
        res["durable"].append(seconds)
        res["blocked"].append(ev["blocked_seconds"])
        res["write"].append(ev["write_seconds"])
        size = ev["bytes"]
        ours.delete(ev["uri"])
        seconds, ev = ours.emergency(state)
        res["emergency"].append(seconds)
        ours.delete(ev["uri"])
        t0 = time.perf_counter()  # raw: the same tensors to host memory, then the same number of bytes to disk
        host = [t.to("cpu") for g in (state["model"], *state["optim"]["state"].values()) for t in g.values()]
        with open(root / "raw.bin", "wb") as fh:
            for t in host:
                fh.write(t.numpy().data)
            fh.write(b"\0" * max(0, size - sum(t.numel() * t.element_size() for t in host)))
            fh.flush()
            os.fsync(fh.fileno())
        res["raw"].append(time.perf_counter() - t0)
        (root / "raw.bin").unlink()
        del host
    ours.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    gb = size / 1e9
    return {"bytes": size, "pinned_buffers_reused": all(reused), **{f"{k}_s": v for k, v in med.items()},
            "durable_gbps": gb / med["durable"], "emergency_gbps": gb / med["emergency"], "raw_gbps": gb / med["raw"],
            "durable_vs_raw": med["raw"] / med["durable"], "emergency_vs_raw": med["raw"] / med["emergency"]}


def resume_is_bit_identical(quick: bool, root: Path) -> dict:
    import step_overhead as S

    from orbit_dagster.core.templates import load_template

    train, cfg = S.load_train(), dict(load_template("charlm-finetune").config)
    k = 5 if quick else 20

    def run(resume_from: str | None, store_dir: Path) -> dict[int, str]:
        run_dir = Path(tempfile.mkdtemp(dir=root))
        (run_dir / "inputs").mkdir()
        (run_dir / "inputs" / "corpus.txt").write_bytes((S.WORKLOAD / "corpus.txt").read_bytes())
        job = {"job_id": "gpu-check", "template_snapshot": {"config": {**cfg, "steps": 2 * k},
                                                            "resources": {"cpu_threads": 1}}}
        ctx = S.RunContext(job=job, bundle_dir=run_dir, workdir=run_dir, attempt=2 if resume_from else 1,
                           events=S.EventWriter(run_dir / "events.jsonl"), store=S.open_store(store_dir.as_uri()),
                           watcher=S.NoticeWatcher(None), checkpoint_every=k, memory_every=10**9,
                           resume_from=resume_from)
        train.main(ctx)
        ctx.close()
        evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        return {e["step"]: (e["weights_sha256"], e["uri"]) for e in evs if e["type"] == "checkpoint"}

    first = run(None, root / "det-store-1")
    resumed = run(first[k][1], root / "det-store-2")
    again = run(None, root / "det-store-3")
    return {"steps": 2 * k, "resumed_equal": resumed[2 * k][0] == first[2 * k][0],
            "rerun_equal": again[2 * k][0] == first[2 * k][0]}


def oom_is_classified(device: str, quick: bool, root: Path) -> dict:
    import step_overhead as S

    from orbit_dagster.core.templates import load_template
    from orbit_dagster.runtime.agent import EXIT_OOM, classify_exception

    out = {}
    try:
        too_big = torch.cuda.get_device_properties(device).total_memory * 2 if device != "cpu" else 1 << 60
        torch.empty(too_big, dtype=torch.uint8, device=device)
        out["allocation"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        out["allocation"] = "oom" if classify_exception(exc)[0] == EXIT_OOM else f"NOT oom: {exc!r}"
    # The workload under a device memory cap: CUDA's allocator refuses (a CPU has the estimate).
    cfg = {**load_template("charlm-finetune").config, "device_memory_mb": 8, "micro_batch": 256}
    if device != "cpu":
        torch.cuda.empty_cache()  # cached blocks from the checks above would let the capped workload fit
    try:
        S.one_run(S.load_train(), cfg, root, policy=False, threads=1, every=10**9, memory_every=10**9, last=10)
        out["workload"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        out["workload"] = "oom" if classify_exception(exc)[0] == EXIT_OOM else f"NOT oom: {exc!r}"
    finally:
        if device != "cpu":
            torch.cuda.set_per_process_memory_fraction(1.0, torch.device(device))
            torch.cuda.empty_cache()
    return out


def render(r: dict) -> str:
    p, s, io_ = r["probe"], r["steps"], r["save"]
    spec = "-" if p["spec_tflops"] is None else f"{p['spec_tflops']:g}"
    of_spec = "-" if p["ratio"] is None else f"{p['ratio']:.2f}"
    lines = [
        f"Measured {r['date']} on **{r['gpu']}** ({r['gpu_memory_gb']:.0f} GB), {r['host_cpus']} host CPUs, "
        f"torch {r['torch']}, CUDA {r['cuda']}, precision {r['precision']}. Command: `{r['command']}`.",
        "",
        "| check | figure |",
        "|---|---|",
        f"| effective TFLOPS ({p['dtype']}, n={p['size']}) | {p['tflops']:.1f} (spec {spec}, {of_spec} of spec) |",
        f"| step, demo model (s/step, {s['demo']['steps']} steps) | {s['demo']['seconds_per_step']:.4f} |",
        f"| step, ~100M-parameter model (s/step, {s['100M']['steps']} steps) | {s['100M']['seconds_per_step']:.4f} |",
        f"| durable save from GPU memory, {io_['bytes'] / 1e9:.2f} GB (s, GB/s) | {io_['durable_s']:.3f}, "
        f"{io_['durable_gbps']:.2f} (training blocked {io_['blocked_s']:.3f} s) |",
        f"| emergency save from GPU memory (s, GB/s) | {io_['emergency_s']:.3f}, {io_['emergency_gbps']:.2f} |",
        f"| raw: device-to-host + write + fsync (s, GB/s) | {io_['raw_s']:.3f}, {io_['raw_gbps']:.2f} |",
        f"| durable / emergency vs raw (raw s / ours s; goal >= 0.8) | {io_['durable_vs_raw']:.2f} / "
        f"{io_['emergency_vs_raw']:.2f} |",
        f"| durable saves reuse their pinned host buffers | {io_['pinned_buffers_reused']} |",
        f"| resume from step {r['determinism']['steps'] // 2} bit-identical at step {r['determinism']['steps']}; "
        f"rerun identical | {r['determinism']['resumed_equal']}; {r['determinism']['rerun_equal']} |",
        f"| real CUDA OOM classed `oom`: oversized allocation; workload under a memory cap | "
        f"{r['oom']['allocation']}; {r['oom']['workload']} |",
    ]
    return "\n".join(lines)


def record(path: Path, body: str) -> None:
    section = f"\n## The GPU (bench/gpu_check.py)\n\n{body}\n"
    replace_section(path, BEGIN, END, section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cuda:N; cpu only to test this script")
    ap.add_argument("--save-size", default="1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--record", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    quick = args.device == "cpu"
    if not quick and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device on this host "
              f"(CUDA build: {torch.version.cuda or 'none'}); nothing measured, nothing recorded. "
              "Run it on a GPU host: python bench/gpu_check.py --record docs/benchmarks.md", file=sys.stderr)
        return EXIT_NO_GPU
    if quick and args.record:
        print("gpu_check: --record is for GPU figures; a --device cpu run only tests the script", file=sys.stderr)
        return 1
    os.environ["ORBIT_DEVICE"] = args.device  # the workload runs where the runtime is told
    import checkpoint_io as IO

    from orbit_dagster.runtime import device as devices

    plan = devices.plan()
    props = torch.cuda.get_device_properties(plan.device) if plan.device.type == "cuda" else None
    failures = []
    with tempfile.TemporaryDirectory(prefix=".gpu-check-", dir=REPO / "bench") as tmp:
        root = Path(tmp)
        result = {
            "date": date.today().isoformat(), "gpu": plan.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu_memory_gb": props.total_memory / 1e9 if props else 0.0, "host_cpus": os.cpu_count(),
            "precision": plan.precision, "command": "python bench/gpu_check.py" + (
                " --record docs/benchmarks.md" if args.record else ""),
            "probe": probe_row(str(plan.device), 0.3 if quick else 2.0),
            "steps": step_times(quick, root),
            "save": save_throughput(str(plan.device), IO.parse_size("16M" if quick else args.save_size),
                                    1 if quick else args.repeat, root / "save"),
            "determinism": resume_is_bit_identical(quick, root),
            "oom": oom_is_classified(str(plan.device), quick, root),
        }
    if not (result["determinism"]["resumed_equal"] and result["determinism"]["rerun_equal"]):
        failures.append("determinism")
    if result["oom"]["allocation"] != "oom" or result["oom"]["workload"] != "oom":
        failures.append("oom classification")
    if not quick and not result["save"]["pinned_buffers_reused"]:
        failures.append("pinned buffer reuse")
    print(json.dumps(result, indent=1, default=str) if args.json else render(result))
    if args.record:
        record(args.record, render(result))
    if failures:
        print(f"gpu_check: FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
