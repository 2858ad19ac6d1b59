"""The runtime agent: `python -m orbit_dagster.runtime.agent BUNDLE_DIR [options]`.

Runs on the rented host: verifies the bundle, records a precheck, watches for reclaim
notices, runs the workload's `main(ctx)`, and reports everything through the event file
and an exit file. It needs neither the control plane nor the network to finish or to
checkpoint (beyond the checkpoint store itself).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from ..core.host_contract import Exit, Notice, Probe, Started
from .events import EVENTS_FILE, EventWriter
from .notices import NoticeWatcher

EXIT_OK = 0
EXIT_USER_ERROR = 1
EXIT_OOM = 3
EXIT_DIVERGED = 4
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on purpose after an emergency checkpoint
EXIT_BUNDLE = 65  # EX_DATAERR: the bundle does not match its manifest
EXIT_INFRA = 74  # EX_IOERR: disk full, I/O or network error, a checkpoint that fails its check

FAILURE_CLASS = {
    EXIT_OK: None,
    EXIT_USER_ERROR: "user_error",
    EXIT_OOM: "oom",
    EXIT_DIVERGED: "divergence",
    EXIT_PREEMPTED: "reclaim",
    EXIT_BUNDLE: "user_error",
    EXIT_INFRA: "infrastructure",
}
# errno values that mean the platform failed, not the workload (see core/failures.py).
INFRA_ERRNOS = {28, 122, 5, 30, 101, 104, 110, 113}  # ENOSPC EDQUOT EIO EROFS ENETUNREACH ECONNRESET ETIMEDOUT EHOSTUNREACH


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_bundle(bundle: Path) -> str:
    """Re-hash the bundle against manifest.json (stdlib only: the host has no control plane)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for rel, digest in manifest["files"].items():
        path = bundle / rel
        if not path.is_file() or _sha256(path) != digest:
            raise ValueError(f"bundle file {rel} is missing or changed")
    h = hashlib.sha256()
    for rel in sorted(manifest["files"]):
        h.update(f"{rel}\0{manifest['files'][rel]}\n".encode())
    if h.hexdigest() != manifest["bundle_sha256"]:
        raise ValueError("bundle hash does not match manifest")
    return manifest["bundle_sha256"]


def precheck(bundle: Path, artifacts: Path, bundle_hash: str) -> dict:
    import torch

    info = {
        "bundle_sha256": bundle_hash,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    (artifacts / "runtime-precheck.log").write_text("\n".join(f"{k}: {v}" for k, v in info.items()) + "\n")
    return info


def load_entrypoint(bundle: Path, name: str):
    scripts = bundle / "scripts"
    sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location(f"orbit_workload_{Path(name).stem}", scripts / name)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"entrypoint {name} not found in scripts/")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        raise AttributeError(f"entrypoint {name} defines no main(ctx)")
    return module


# What allocators say when they run out, as torch surfaces it: the caching allocator raises
# torch.OutOfMemoryError, but an allocation outside it (cuBLAS/cuDNN workspaces, a kernel
# launch, the CPU allocator) arrives as a RuntimeError with one of these in its message.
OOM_MESSAGES = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "hip out of memory",
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure, here or anywhere in the chain of causes (a workload may wrap it)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(cur).__mro__):
            return True
        text = str(cur).lower()
        if any(m in text for m in OOM_MESSAGES):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def classify_exception(exc: BaseException) -> tuple[int, str]:
    from ..storage.base import StoreError
    from .sdk import CheckpointMismatch, Diverged, Preempted

    if isinstance(exc, Preempted):
        return EXIT_PREEMPTED, str(exc)
    if isinstance(exc, (StoreError, CheckpointMismatch)) or (isinstance(exc, OSError) and exc.errno in INFRA_ERRNOS):
        return EXIT_INFRA, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, Diverged):
        return EXIT_DIVERGED, str(exc)
    text = f"{type(exc).__name__}: {exc}"
    if is_out_of_memory(exc):
        return EXIT_OOM, text
    return EXIT_USER_ERROR, text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orbit-agent", description=__doc__)
    p.add_argument("bundle", type=Path)
    p.add_argument("--task", choices=("train", "eval"), default="train")
    p.add_argument("--workdir", type=Path, default=None, help="where artifacts/ is written (default: the bundle)")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--store", default=None, help="checkpoint store root uri (default: WORKDIR/checkpoints)")
    p.add_argument("--resume-from", default=None, help="checkpoint uri to continue from")
    p.add_argument("--checkpoint", default=None, help="checkpoint uri to evaluate (--task eval)")
    p.add_argument("--expect-sha256", default=None,
                   help="the digest the control plane recorded for the checkpoint to load; other bytes are refused")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--memory-every", type=int, default=None)
    p.add_argument("--metadata-url", default=os.environ.get("ORBIT_METADATA_URL"))
    p.add_argument("--notice-poll", type=float, default=1.0)
    p.add_argument("--notice-grace", type=float, default=5.0, help="seconds to wait for a step boundary after a notice")
    p.add_argument("--stop-after-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help="measure effective TFLOPS before the workload")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    bundle = args.bundle.resolve()
    workdir = (args.workdir or bundle).resolve()
    artifacts = workdir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    events = EventWriter(artifacts / EVENTS_FILE)
    code, reason, ctx = EXIT_USER_ERROR, "", None
    t0 = time.time()
    # Watch for the reclaim from the first instant: a SIGTERM during start-up is a notice too.
    watcher = NoticeWatcher(args.metadata_url, poll_s=args.notice_poll)
    watcher.on_notice = lambda notice: events.emit(Notice(**notice))
    watcher.install_sigterm()
    watcher.start()
    try:
        try:
            bundle_hash = verify_bundle(bundle)
        except (OSError, ValueError, KeyError) as exc:
            code, reason = EXIT_BUNDLE, f"bundle check failed: {exc}"
            return code
        job = json.loads((bundle / "job.json").read_text())
        template = job["template_snapshot"]
        import torch

        threads = int(template.get("resources", {}).get("cpu_threads", 1))
        torch.set_num_threads(threads)  # pinned: 1 and 2 threads give different weights
        info = precheck(bundle, artifacts, bundle_hash)
        events.emit(Started(task=args.task, attempt=args.attempt, precheck=info, pid=os.getpid()))
        if args.probe:
            from .probe import measure_matmul_tflops

            events.emit(Probe(**measure_matmul_tflops(seconds=0.5)))

        from ..storage import open_store
        from .sdk import RunContext

        store = open_store(args.store or (workdir / "checkpoints").as_uri(), env=os.environ)  # the host's S3 tuning
        ck = template.get("checkpoint", {})
        ctx = RunContext(
            job=job,
            bundle_dir=bundle,
            workdir=workdir,
            attempt=args.attempt,
            events=events,
            store=store,
            watcher=watcher,
            checkpoint_every=args.checkpoint_every or ck.get("every_steps", 50),
            memory_every=args.memory_every or ck.get("memory_every_steps", 5),
            resume_from=args.resume_from,
            eval_checkpoint=args.checkpoint,
            expect_sha256=args.expect_sha256,
            stop_after_step=args.stop_after_step,
        )
        if watcher.pending:  # reclaimed before any work: nothing to save
            from .sdk import Preempted

            raise Preempted("reclaim notice before the workload started")
        watcher.on_notice = lambda notice: (events.emit(Notice(**notice)), ctx.on_notice_timeout(args.notice_grace))
        entry = template["entrypoint"] if args.task == "train" else (template.get("eval") or {}).get("entrypoint", "eval.py")
        module = load_entrypoint(bundle, entry)
        result = module.main(ctx)
        if args.task == "eval" and ctx.eval_metrics is None and isinstance(result, dict):
            ctx.report_eval(result.get("metrics", result))
        ctx.close()
        code, reason = EXIT_OK, "completed"
    except SystemExit as exc:
        code = int(exc.code) if isinstance(exc.code, int) else EXIT_USER_ERROR
        reason = f"exit {code}"
    except BaseException as exc:  # noqa: BLE001 - every failure is classified and reported
        code, reason = classify_exception(exc)
        _best_effort(lambda: (artifacts / "traceback.txt").write_text(traceback.format_exc()))
        if code == EXIT_PREEMPTED and ctx is not None:
            try:
                ctx.close()
            except BaseException:  # noqa: BLE001
                pass
    finally:
        failure_class = FAILURE_CLASS.get(code, "user_error")
        exit_info = {"code": code, "failure_class": failure_class, "reason": reason, "seconds": round(time.time() - t0, 3)}
        if ctx is not None:
            exit_info["last_step"] = ctx.last_step
        # On a full disk these writes may fail too: the exit code alone then carries the
        # failure class to the host (74: infrastructure), so it must still be the one returned.
        _best_effort(lambda: events.emit(Exit(**exit_info)))
        _best_effort(lambda: _write_exit(artifacts, exit_info))
    return code


def _write_exit(artifacts: Path, exit_info: dict) -> None:
    tmp = artifacts / "exit.json.tmp"
    tmp.write_text(json.dumps(exit_info))
    tmp.rename(artifacts / "exit.json")
    (artifacts / "exit_code").write_text(f"{exit_info['code']}\n")


def _best_effort(write) -> None:
    try:
        write()
    except (OSError, ValueError) as exc:  # ValueError: a record the host contract refuses
        print(f"orbit agent: could not write its exit record ({exc}); the exit code still says it", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    code = run(parse_args(argv))
    # Everything the control plane reads is written and closed by now (events, exit.json,
    # checkpoints: run() waited for the writer). Skip the interpreter's teardown of torch's
    # modules, seconds of CPU on a small host, during which the instance is still billed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
