"""A ledger with billed history, written the way the control plane writes it (for cost and advice tests).

`History.attempt(...)` records one training attempt on one instance: the job (once), the run
and its end state, the instance with its handle (the offer it was rented at) and its bill, the
cost lines `core.costs.attribute_instance` splits it into (as `control/billing.release` does),
and the host's `resumed` and `probe` records (as `control/attempt.py` notes them).
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

from orbit_dagster.core.costs import attribute_instance
from orbit_dagster.core.offers import Offer
from orbit_dagster.ledger import Ledger
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import InstanceHandle

T0 = 1_700_000_000.0


def offer(offer_id: str, *, usd_per_gpu_hour: float, gpu: str = "L4", gpu_count: int = 1, spot: bool = True,
          spec: float | None = 121.0, measured: float | None = None, instance_type: str = "g2-standard-4") -> Offer:
    provider = offer_id.split(":", 1)[0]
    return Offer(offer_id=offer_id, provider=provider, instance_type=instance_type, gpu=gpu, gpu_count=gpu_count,
                 region=offer_id.rsplit(":", 1)[-1], zone=offer_id.rsplit(":", 1)[-1],
                 usd_per_gpu_second_on_demand=usd_per_gpu_hour * 2 / 3600,
                 usd_per_gpu_second_spot=usd_per_gpu_hour / 3600, spec_tflops_bf16=spec, measured_tflops=measured,
                 spot=spot)


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


class History:
    def __init__(self, ledger: Ledger, experiment: str = "exp"):
        self.ledger, self.experiment = ledger, experiment
        self.jobs: set[str] = set()
        self.n = 0

    def job(self, job_id: str, state: str = "SUCCEEDED", attempt: int = 1) -> None:
        if job_id in self.jobs:
            with self.ledger.write() as tx:
                tx.execute("UPDATE jobs SET state = ?, attempt = ? WHERE job_id = ?", [state, attempt, job_id])
            return
        self.jobs.add(job_id)
        self.ledger.commit({"experiments": [{"experiment": self.experiment, "project": "p", "created_at": T0}],
                            "jobs": [{"job_id": job_id, "template": "charlm-finetune", "kind": "train",
                                      "experiment": self.experiment, "project": "p", "placement": "sim",
                                      "state": state, "attempt": attempt, "lineage": f"L-{job_id}",
                                      "created_at": T0}]})

    def attempt(self, job_id: str, o: Offer, *, start: float, stop: float, checkpoints: list[float] = (),
                lost: bool = False, last_progress: float | None = None, resumed_at: float | None = None,
                probe: tuple[float, str] | None = None, attempt: int = 1, purpose: str = "train",
                final_state: str | None = None) -> str:
        """One attempt of `job_id` on `o` from `start` to `stop` (seconds after T0); checkpoints
        durable at those seconds; `lost`: ended by a reclaim. Returns the instance id."""
        self.n += 1
        instance_id, run_id = f"i-{self.n:04d}", f"{job_id}:a{attempt}"
        state = "LOST" if lost else "SUCCEEDED"
        self.job(job_id, final_state or state, attempt)
        handle = InstanceHandle(provider=o.provider, instance_id=instance_id, offer=o, started_at=_dt(T0 + start))
        keys = [f"{job_id}/a{attempt}/step-{i}" for i, _ in enumerate(checkpoints, 1)]
        lines = attribute_instance(start=_dt(T0 + start), stop=_dt(T0 + stop), usd_per_second=o.usd_per_second,
                                   checkpoints=[(_dt(T0 + t), k) for t, k in zip(checkpoints, keys)], lost=lost,
                                   purpose=purpose,
                                   last_progress=None if last_progress is None else _dt(T0 + last_progress))
        events = []
        if resumed_at is not None:
            events.append(R.event("host_resumed", job_id=job_id, run_id=run_id, instance_id=instance_id,
                                  ts=T0 + resumed_at, uri="file:///x", step=1, tier="durable"))
        if probe is not None:
            events.append(R.event("host_probe", job_id=job_id, run_id=run_id, instance_id=instance_id,
                                  ts=T0 + start + 1, tflops=probe[0], device=probe[1], device_name="test"))
        self.ledger.commit({
            "runs": [{"run_id": run_id, "job_id": job_id, "attempt": attempt, "instance_id": instance_id,
                      "provider": o.provider, "offer_id": o.offer_id, "started_at": T0 + start, "state": state,
                      "failure_class": "reclaim" if lost else None, "experiment": self.experiment}],
            "instances": [{"instance_id": instance_id, "provider": o.provider, "offer_id": o.offer_id,
                           "instance_type": o.instance_type, "gpu": o.gpu, "gpu_count": o.gpu_count,
                           "usd_per_second": o.usd_per_second, "spot": int(o.spot), "purpose": purpose,
                           "job_id": job_id, "run_id": run_id, "handle": handle.model_dump_json(),
                           "started_at": T0 + start, "stopped_at": T0 + stop,
                           "billed_usd": (stop - start) * o.usd_per_second}],
            "costs": [{"cost_id": f"{instance_id}:{i}", "instance_id": instance_id, "job_id": job_id,
                       "run_id": run_id, "attempt": attempt, "checkpoint_key": line.checkpoint_key, "kind": line.kind,
                       "start_at": line.start, "end_at": line.end, "seconds": line.seconds,
                       "gpu_count": max(o.gpu_count, 1), "usd_per_second": o.usd_per_second, "usd": line.usd}
                      for i, line in enumerate(lines)],
            "events": events,
        })
        return instance_id


def detail(row: dict) -> dict:
    return json.loads(row["detail"] or "{}")
