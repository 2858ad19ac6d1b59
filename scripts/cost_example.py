"""The embedded market's cost views and advice on jobs run here: the example of docs/cost.md.

    python scripts/cost_example.py [--jobs N] [--record docs/cost.md]

Runs 2N short `charlm-finetune` jobs (default N = 3) on the embedded market, in a fresh
`$ORBIT_HOME` under a temporary directory: real host processes and agents, market time
600 times the wall clock (`ORBIT_SIM_SCALE`), the market's own reclaims off. N jobs run on
one L4 offer left alone; N on another L4 offer, where the market's operator reclaims each job
twice, by training progress (`SimProvider.inject_reclaim(at_step=...)`, as `orbit demo`
does: the same story on a fast or a slow machine), each resumed on a new instance of that
offer. Then it runs, as a person would, `orbit cost --by provider` and `orbit advise`, and
prints both; `--record FILE` writes them into FILE's `cost-example` section (its
`$ORBIT_HOME` shown as such). The figures depend on the machine's speed (seconds billed).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from recording import replace_section  # noqa: E402

from orbit_dagster.control.attempt import run_attempt  # noqa: E402
from orbit_dagster.control.market_clock import schedule_for  # noqa: E402
from orbit_dagster.control.providers import using  # noqa: E402
from orbit_dagster.control.submit import submit  # noqa: E402
from orbit_dagster.ledger import records as R  # noqa: E402
from orbit_dagster.providers.base import RunHandle  # noqa: E402
from orbit_dagster.providers.sim.provider import SimProvider, default_offers  # noqa: E402
from orbit_dagster.settings import Settings  # noqa: E402

BEGIN, END = "<!-- cost-example:begin -->", "<!-- cost-example:end -->"
SCALE, NOTICE_MARKET_S = 600, 1200  # the notice: 2 wall seconds, enough for an emergency save here
STEPS, EVERY = 60, 20
RECLAIM_AT = (20, 40)  # training steps at which the flaky offer's instances are reclaimed


def two_l4_offers():
    """The two cheapest L4 spot offers of the embedded market (one GPU each)."""
    l4 = sorted((o for o in default_offers() if o.gpu == "L4" and o.gpu_count == 1),
                key=lambda o: (o.usd_per_gpu_second_spot, o.offer_id))
    return l4[0], l4[1]


def pinned(offer):
    """The embedded market offering this one offer only (how a job is placed on it here)."""
    def factory(settings: Settings) -> SimProvider:
        schedule, market = schedule_for(settings)
        return SimProvider(settings.sim_dir, offers=[offer], schedule=schedule, notice_seconds=market.notice_wall_s,
                           market=market)
    return {"sim_host_process": factory}


def run_job(settings: Settings, offer, experiment: str, reclaims: tuple[int, ...]) -> str:
    job = submit(settings, "charlm-finetune", {"config.steps": STEPS, "checkpoint.every_steps": EVERY},
                 experiment=experiment)
    ledger = settings.ledger()
    for attempt in range(1, len(reclaims) + 2):
        outcome: dict = {}

        def follow(outcome: dict = outcome) -> None:
            with using(pinned(offer)):
                outcome["o"] = run_attempt(settings, job, poll_s=0.1, hand_off=False)

        thread = threading.Thread(target=follow)
        thread.start()
        if attempt <= len(reclaims):
            run_id = R.run_id_for(job, attempt)
            deadline = time.time() + 300
            while time.time() < deadline and not ((R.run(ledger, run_id) or {}).get("state") == "RUNNING"
                                                  and R.run(ledger, run_id)["handle"]):
                time.sleep(0.1)
            handle = RunHandle.model_validate_json(R.run(ledger, run_id)["handle"])
            pinned(offer)["sim_host_process"](settings).inject_reclaim(handle.instance, at_step=reclaims[attempt - 1])
        thread.join(600)
        state = outcome["o"].state
        print(f"  {job} attempt {attempt} on {offer.offer_id}: {state}", file=sys.stderr)
        if state == "SUCCEEDED":
            return job
        if state != "LOST":
            raise SystemExit(f"error: {job} attempt {attempt} ended {state}: {outcome['o'].reason}")
    raise SystemExit(f"error: {job} did not finish in {len(reclaims) + 1} attempts")


def orbit(home: Path, *argv: str) -> str:
    env = {**os.environ, "ORBIT_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: orbit {' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout.replace(str(home), "$ORBIT_HOME").rstrip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3, help="jobs per offer")
    ap.add_argument("--record", type=Path, default=None, help="rewrite this file's cost-example section")
    args = ap.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="orbit-cost-example-") as tmp:
        home = Path(tmp) / "home"
        os.environ.update({"ORBIT_HOME": str(home), "ORBIT_SIM_RECLAIMS": "none", "ORBIT_SIM_SCALE": str(SCALE),
                           "ORBIT_SIM_NOTICE_SECONDS": str(NOTICE_MARKET_S)})
        settings = Settings.from_env(home)
        steady, flaky = two_l4_offers()
        for _ in range(args.jobs):
            run_job(settings, steady, "cost-example", ())
            run_job(settings, flaky, "cost-example", RECLAIM_AT)
        cost = orbit(home, "cost", "--by", "provider")
        advice = orbit(home, "advise", "--experiment", "cost-example")
    seconds = time.time() - t0
    command = "python scripts/cost_example.py" + (f" --jobs {args.jobs}" if args.jobs != 3 else "") \
        + (" --record docs/cost.md" if args.record else "")
    body = (f"\nWritten by `{command}` on {date.today().isoformat()} ({seconds:.0f} s on this machine): "
            f"{2 * args.jobs} jobs of {STEPS} steps, {args.jobs} on `{steady.offer_id}` (left alone) and "
            f"{args.jobs} on `{flaky.offer_id}` (reclaimed at steps {RECLAIM_AT[0]} and {RECLAIM_AT[1]} of each "
            f"job), market time {SCALE} x the wall clock.\n\n"
            f"```\n$ orbit cost --by provider\n{cost}\n```\n\n"
            f"```\n$ orbit advise --experiment cost-example\n{advice}\n```\n")
    print(body)
    if args.record:
        replace_section(args.record, BEGIN, END, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
