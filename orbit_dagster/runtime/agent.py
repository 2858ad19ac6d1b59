"""The runtime agent: `python -m orbit_dagster.runtime.agent BUNDLE_DIR [options]`.

Runs on the rented host: verifies the bundle, records a precheck, watches for reclaim
notices, runs the workload (an SDK entrypoint's `main(ctx)`, or a template's `command`
through runtime/command.py), and reports everything through the event file and an exit file. It needs neither the control plane nor the network to finish or to
checkpoint (beyond the checkpoint store itself).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from ..core.host_contract import Exit, Notice, Probe, Rebalance, Started
from ..storage import open_store
from ..storage.base import StoreError
from .command import CommandRun, is_command
from .events import EVENTS_FILE, EventWriter
from .exits import (  # re-exported: the agent's exit codes are its interface
    EXIT_BUNDLE,
    EXIT_DIVERGED,
    EXIT_INFRA,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    FAILURE_CLASS,
    INFRA_ERRNOS,
    CheckpointMismatch,
    Diverged,
    Preempted,
    is_out_of_memory,
)
from .group import NodeGroup
from .notices import NOTICE_GRACE_S, NoticeWatcher


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


def precheck(bundle: Path, artifacts: Path, bundle_hash: str, *, with_torch: bool = True) -> dict:
    """What this host runs the task with. `with_torch`: import torch and ask it for the devices
    and threads (the SDK path, which trains in this process). Without it (a command workload,
    whose script runs in a process of its own and may not use torch at all), torch's installed
    version is read from its package metadata and torch is never imported: that would cost
    about 2 s of CPU and 220 MB of the host's memory for nothing (docs/bring-your-own.md)."""
    info: dict = {
        "bundle_sha256": bundle_hash,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }
    if with_torch:
        import torch  # lazy: torch costs 3 s; a bundle that fails its check is reported without it

        info.update(torch=torch.__version__, cuda_available=torch.cuda.is_available(),
                    devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    threads=torch.get_num_threads())
    else:
        try:
            info["torch"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            info["torch"] = None
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


def classify_exception(exc: BaseException) -> tuple[int, str]:
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


def seconds_arg(text: str) -> float:
    """An argparse type: a finite, non-negative number of seconds (the agent's and the bench's --notice-grace)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number of seconds >= 0 is needed")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {type(value).__name__}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orbit-agent", description=__doc__)
    p.add_argument("bundle", type=Path)
    p.add_argument("--task", choices=("train", "eval"), default="train")
    p.add_argument("--workdir", type=Path, default=None, help="where artifacts/ is written (default: the bundle)")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--store", default=None, help="checkpoint store root uri (default: WORKDIR/checkpoints)")
    p.add_argument("--resume-from", default=None, help="checkpoint uri to continue from")
    p.add_argument("--checkpoint", default=None, help="checkpoint uri to evaluate (--task eval)")
    p.add_argument("--also-evaluate", nargs=2, action="append", default=[], metavar=("URI", "SHA256"),
                   help="another checkpoint (and its recorded digest) to evaluate after --checkpoint, in this "
                        "process: one rented instance evaluates several (--task eval; repeatable)")
    p.add_argument("--expect-sha256", default=None,
                   help="the digest the control plane recorded for the checkpoint to load; other bytes are refused")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--memory-every", type=int, default=None)
    p.add_argument("--interval-plan", type=_json_object, default=None,
                   help="JSON: the plan behind --checkpoint-every, re-asked after each durable save "
                        "(runtime/checkpoint_schedule.py; dispatch writes it)")
    p.add_argument("--metadata-url", default=os.environ.get("ORBIT_METADATA_URL"))
    p.add_argument("--notice-poll", type=float, default=1.0)
    p.add_argument("--notice-grace", type=seconds_arg, default=NOTICE_GRACE_S, help="seconds to wait for a step boundary after a notice")
    p.add_argument("--stop-after-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help="measure effective TFLOPS before the workload")
    g = p.add_argument_group("one node of a group (runtime/group.py)")
    g.add_argument("--nnodes", type=int, default=1, help="the group's size (1: a single instance)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's node in the group (0 hosts the rendezvous)")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the group's c10d rendezvous, on node 0's host")
    g.add_argument("--rdzv-id", default=None, help="the rendezvous id (the attempt's run)")
    g.add_argument("--group-wait", type=float, default=120.0,
                   help="node 0: seconds it waits for the other nodes' parts of a checkpoint")
    args = p.parse_args(argv)
    if args.nnodes > 1 and not (0 <= args.node_rank < args.nnodes and args.rdzv_endpoint and args.rdzv_id):
        p.error("--nnodes > 1 needs --node-rank in [0, nnodes), --rdzv-endpoint and --rdzv-id")
    return args


def node_group(args: argparse.Namespace) -> NodeGroup | None:
    if args.nnodes <= 1:
        return None
    return NodeGroup(nnodes=args.nnodes, node_rank=args.node_rank, endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                     wait_s=args.group_wait)


def run(args: argparse.Namespace) -> int:
    bundle = args.bundle.resolve()
    workdir = (args.workdir or bundle).resolve()
    artifacts = workdir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    events = EventWriter(artifacts / EVENTS_FILE)
    code, reason, ctx, last_step = EXIT_USER_ERROR, "", None, None
    t0 = time.time()
    # Watch for the reclaim from the first instant: a SIGTERM during start-up is a notice too.
    watcher = NoticeWatcher(args.metadata_url, poll_s=args.notice_poll)
    watcher.on_notice = lambda notice: events.emit(Notice(**notice))
    # Before the workload runs there is nothing to save: a rebalance recommendation is recorded.
    watcher.on_rebalance = lambda r: events.emit(Rebalance(**r, action="record"))
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
        command = is_command(template, args.task)  # any script's argv (runtime/command.py), not main(ctx)
        if not command:  # the SDK path trains here; a command's script is a process of its own
            import torch  # lazy: 3 s, and only once the bundle is verified

            torch.set_num_threads(int(template.get("resources", {}).get("cpu_threads", 1)))  # 1 and 2 threads give different weights
        info = precheck(bundle, artifacts, bundle_hash, with_torch=not command)
        events.emit(Started(task=args.task, attempt=args.attempt, precheck=info, pid=os.getpid()))
        if args.probe:
            from .probe import measure_matmul_tflops  # lazy: imports torch (3 s)

            events.emit(Probe(**measure_matmul_tflops(seconds=0.5)))

        store = open_store(args.store or (workdir / "checkpoints").as_uri(), env=os.environ)  # the host's S3 tuning
        ck = template.get("checkpoint", {})
        if command:
            code, reason, last_step = _run_command(args, job, bundle, workdir, events, store, watcher, ck)
            return code
        from .sdk import RunContext  # lazy: sdk imports torch (3 s)

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
            interval_plan=args.interval_plan,
            notice_grace=args.notice_grace,
        )
        if watcher.pending:  # reclaimed before any work: nothing to save
            raise Preempted("reclaim notice before the workload started")
        watcher.on_notice = lambda notice: (events.emit(Notice(**notice)), ctx.on_notice_timeout())
        _on_rebalance(watcher, events, ck, ctx.request_durable, "checkpoint")
        entry = template["entrypoint"] if args.task == "train" else (template.get("eval") or {}).get("entrypoint", "eval.py")
        module = load_entrypoint(bundle, entry)
        _main_once(module, ctx, args.task)
        for uri, sha256 in args.also_evaluate if args.task == "eval" else ():
            if watcher.pending:  # reclaimed between two evaluations: the rest are evaluated elsewhere
                raise Preempted("reclaim notice between evaluations")
            ctx.eval_checkpoint, ctx.expect_sha256, ctx.eval_metrics = uri, sha256, None
            _main_once(module, ctx, args.task)
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
            last_step = ctx.last_step
        if last_step is not None:
            exit_info["last_step"] = last_step
        # On a full disk these writes may fail too: the exit code alone then carries the
        # failure class to the host (74: infrastructure), so it must still be the one returned.
        _best_effort(lambda: events.emit(Exit(**exit_info)))
        _best_effort(lambda: _write_exit(artifacts, exit_info))
    return code


def _run_command(args, job, bundle, workdir, events, store, watcher, ck) -> tuple[int, str, int | None]:
    """The command once (train), or once per checkpoint to evaluate (eval: `--checkpoint`, then
    each `--also-evaluate`, on this instance in turn)."""
    targets = [(args.checkpoint, args.expect_sha256)]
    if args.task == "eval":
        targets += [tuple(pair) for pair in args.also_evaluate]
    code, reason, last_step = EXIT_OK, "completed", None
    for checkpoint, sha256 in targets:
        if watcher.pending:  # reclaimed between two evaluations: the rest are evaluated elsewhere
            return EXIT_PREEMPTED, "reclaim notice between evaluations", last_step
        run_ = CommandRun(job=job, bundle=bundle, workdir=workdir, task=args.task, attempt=args.attempt, events=events,
                          store=store, notices=watcher,
                          checkpoint_every=args.checkpoint_every or ck.get("every_steps", 50),
                          resume_from=args.resume_from, eval_checkpoint=checkpoint, expect_sha256=sha256,
                          notice_grace=args.notice_grace, interval_plan=args.interval_plan, group=node_group(args))
        watcher.on_notice = lambda notice, r=run_: (events.emit(Notice(**notice)), r.on_notice(notice))
        _on_rebalance(watcher, events, ck, run_.request_durable, "schedule")
        try:
            code, reason = run_.run()
        finally:
            run_.kill()  # whatever ended the run, the script does not outlive it
        last_step = run_.last_step
        if code != EXIT_OK:
            break
    return code, reason, last_step


def _on_rebalance(watcher, events, ck: dict, ask, action: str) -> None:
    """What the agent does on a rebalance recommendation from now on: record it in the event
    stream and, unless the template says `checkpoint.on_rebalance: record`, ask for an early
    durable save (`action`: `checkpoint`, the SDK's; `schedule`, a command's published schedule).
    With `migrate` the save is asked for too: it is the answer when the control plane decides
    not to move, and the newest durable state on the old host if it moves."""
    act = ck.get("on_rebalance", "checkpoint") in ("checkpoint", "migrate")

    def on_rebalance(r: dict) -> None:
        events.emit(Rebalance(**r, action=action if act else "record"))
        if act:
            ask()

    watcher.on_rebalance = on_rebalance


def _main_once(module, ctx, task: str) -> None:
    """The workload's `main(ctx)`; an evaluation that returns its metrics instead of reporting
    them has them reported (one `evaluation` record per evaluated checkpoint)."""
    result = module.main(ctx)
    if task == "eval" and ctx.eval_metrics is None and isinstance(result, dict):
        ctx.report_eval(result.get("metrics", result))


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
