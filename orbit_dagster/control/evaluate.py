"""Evaluate one checkpoint on a rented instance; results hang off the checkpoint."""
from __future__ import annotations

import time

from ..core.bundle import JobBundle
from ..core.errors import NotFound, OrbitError
from ..ledger import utcnow
from ..ledger import records as R
from ..providers.base import LaunchSpec
from .attempt import NullReporter, Reporter
from .billing import instance_row, release
from .dispatch import provision_first
from .offers import rank_for
from .providers import provider_for
from .settings import Settings

MAX_EVAL_TRIES = 3  # an evaluation reclaimed mid-way simply starts again elsewhere
MAX_EVAL_RUNS = 3  # runs per checkpoint before the sensor gives up on it (each tries MAX_EVAL_TRIES hosts)


def evaluate_checkpoint(settings: Settings, checkpoint_key: str, *, suite: str | None = None,
                        dagster_run_id: str | None = None, reporter: Reporter | None = None,
                        poll_s: float = 0.2) -> dict:
    reporter = reporter or NullReporter()
    ledger = settings.ledger()
    rows = ledger.rows("SELECT * EXCLUDE (_commit) FROM checkpoints WHERE checkpoint_key = ?", [checkpoint_key])
    if not rows:
        raise NotFound(f"no checkpoint {checkpoint_key!r}", field="checkpoint", value=checkpoint_key,
                       fix="list checkpoints with `orbit status JOB`")
    ckpt = rows[0]
    bundle = JobBundle.load(R.bundle_for(ledger, ckpt["job_id"], max(int(ckpt["attempt"] or 1), 1))["path"])
    template = bundle.spec.template
    if template.eval is None:
        raise OrbitError(f"template {template.name} defines no evaluation", field="eval", fix="add an eval: section")
    suite = suite or template.eval.suite
    provider = provider_for(settings, bundle.spec.execution_request.backend_key)
    last_error, reclaimed = "", set()
    for attempt in range(1, MAX_EVAL_TRIES + 1):
        ranked, _ = rank_for(ledger, provider, bundle.spec.execution_request, job_id=ckpt["job_id"], attempt=0,
                             notice_s=provider.notice_seconds, template=template.name, avoid=reclaimed)
        instance, _ = provision_first(provider, ranked, ckpt["job_id"], 0)
        ledger.commit({"instances": [instance_row(instance, "eval", ckpt["job_id"], None, checkpoint_key)]})
        t0 = time.time()
        handle = provider.launch(instance, bundle.path, LaunchSpec(
            task="eval", attempt=attempt,
            store_uri=provider.host_store_uri(instance, settings.store_uri_for(template.checkpoint.store)),
            eval_checkpoint=provider.stage_checkpoint(instance, ckpt["uri"]),
            env=dict(bundle.spec.execution_request.env), secret_env=tuple(bundle.spec.execution_request.secret_env)))
        offset, metrics = 0, None
        while True:
            events, offset = provider.read_events(handle, offset)
            for ev in events:
                if ev.get("type") == "evaluation":
                    metrics = ev.get("metrics")
            status = provider.status(handle)
            if status.state in ("exited", "lost"):
                events, offset = provider.read_events(handle, offset)
                metrics = next((e.get("metrics") for e in events if e.get("type") == "evaluation"), metrics)
                break
            time.sleep(poll_s)
        seconds = time.time() - t0
        extra = {}
        if status.state == "exited" and status.exit_code == 0 and metrics:
            now = utcnow()
            extra = {
                "evaluations": [{
                    "checkpoint_key": checkpoint_key, "suite": suite, "job_id": ckpt["job_id"],
                    "metrics": R.dumps(metrics), "instance_id": instance.instance_id,
                    "dagster_run_id": dagster_run_id, "seconds": seconds, "created_at": now,
                }],
                "metric_points": [{
                    "job_id": ckpt["job_id"], "run_id": f"eval:{checkpoint_key}:{suite}", "checkpoint_key": checkpoint_key,
                    "step": int(ckpt["step"]), "name": name, "value": float(value), "source": "eval", "ts": now,
                } for name, value in metrics.items()],
            }
        release(settings, ledger, provider, instance, job_id=ckpt["job_id"], run_id=None, attempt=0, checkpoints=[],
                 lost=False, last_progress=None, reason="evaluation done", purpose="eval",
                 eval_checkpoint=checkpoint_key, extra=extra)
        if extra:
            reporter.log(f"evaluated {checkpoint_key} ({suite}): {metrics}")
            return {"checkpoint_key": checkpoint_key, "suite": suite, "metrics": metrics, "seconds": seconds,
                    "instance_id": instance.instance_id}
        last_error = status.reason or f"exit code {status.exit_code}"
        if status.state != "lost" and status.failure_class != "reclaim":
            break
        reclaimed.add(instance.offer.offer_id)
        reporter.log(f"evaluation of {checkpoint_key} lost its instance ({last_error}); trying another offer")
    tail = provider.logs(handle, 20)
    ledger.commit({"events": [R.event("evaluation_failed", job_id=ckpt["job_id"], checkpoint=checkpoint_key,
                                      reason=last_error, dagster_run_id=dagster_run_id)]})
    raise OrbitError(f"evaluation of {checkpoint_key} failed: {last_error}\n{tail}", field="checkpoint",
                     value=checkpoint_key, fix="see the log above; `orbit logs JOB` has the whole of it")
