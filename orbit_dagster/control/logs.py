"""The workload log of an attempt: live from the host while it runs, collected after."""
from __future__ import annotations

from ..core.errors import NotFound
from ..ledger import records as R
from ..providers.base import RunHandle
from .context import bundle_and_provider
from .settings import Settings


def attempt_log(settings: Settings, job_id: str, attempt: int | None = None, tail: int = 200) -> str:
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    attempt = attempt or int(job["attempt"])
    collected = settings.artifacts_dir / job_id / f"attempt-{attempt}" / "agent.log"
    if collected.is_file():
        return "\n".join(collected.read_text(errors="replace").splitlines()[-tail:])
    run = R.run(ledger, R.run_id_for(job_id, attempt))
    if run is None or not run["handle"]:
        raise NotFound(f"job {job_id} has no attempt {attempt} with a log yet", field="--attempt", value=attempt,
                       fix=f"attempts so far: 1..{job['attempt']}; a queued attempt has no log until it runs")
    _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
    return provider.logs(RunHandle.model_validate_json(run["handle"]), tail)
