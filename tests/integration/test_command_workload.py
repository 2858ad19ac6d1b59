"""Command workloads end to end on the host side: the real agent, as a process, on a bundle
of the shipped plain PyTorch script (and of small scripts written here for the odd cases)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template, typed_template
from orbit_dagster.runtime.agent import EXIT_INFRA, EXIT_OK, EXIT_PREEMPTED, EXIT_USER_ERROR
from tests.helpers import wait_for

JOB = "job-cmd"


def plain_bundle(root: Path, **overrides):
    t = apply_overrides(load_template("plain-script"), {"config.steps": 200, "checkpoint.settle_seconds": 0.5,
                                                         **overrides})
    return build_bundle(t, TaskSubmission(template=t.name), JOB, root / "bundles")


def script_bundle(root: Path, source: str, **fields):
    """A bundle of a one-file script (`run.py`) written by the test."""
    work = root / "workload"
    work.mkdir(exist_ok=True)
    (work / "run.py").write_text(source)
    raw = {"name": "scripted", "workload": str(work), "command": ["python", "run.py", "{checkpoint_dir}"],
           "checkpoint": {"settle_seconds": 0.5}, **fields}
    t = typed_template(raw, context="test template")
    return build_bundle(t, TaskSubmission(template=t.name), JOB, root / "bundles")


# The agent as `python -m orbit_dagster.runtime.agent ...`, in a process where `import torch` fails.
WITHOUT_TORCH = "import runpy, sys; sys.modules['torch'] = None; runpy.run_module('orbit_dagster.runtime.agent', run_name='__main__')"


def agent(bundle, workdir: Path, store: Path, *args: str, wait=True, without_torch=False):
    env = {**os.environ, "PYTHONPATH": str(bundle.path / "runtime"), "OMP_NUM_THREADS": "1"}
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "agent.log", "ab")  # a file: a pipe nobody reads would fill and block it
    launch = ["-c", WITHOUT_TORCH] if without_torch else ["-m", "orbit_dagster.runtime.agent"]
    proc = subprocess.Popen([sys.executable, *launch, str(bundle.path), "--workdir",
                             str(workdir), "--store", store.as_uri(), *args], env=env, stdout=log, stderr=log)
    log.close()
    if wait:
        proc.wait(240)
    return proc


def events(workdir: Path, kind: str | None = None) -> list[dict]:
    path = workdir / "artifacts" / "events.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [e for e in lines if kind is None or e["type"] == kind]


def log_of(workdir: Path) -> str:
    return (workdir / "agent.log").read_text(errors="replace")


def saved_state(uri: str) -> dict:
    (ckpt,) = [p for p in Path(uri.removeprefix("file://")).iterdir() if p.name != "manifest.json"]
    return torch.load(ckpt, map_location="cpu", weights_only=True)


def assert_same_tensors(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The plain script, 200 steps, uninterrupted (shared by the tests that compare with it)."""
    root = tmp_path_factory.mktemp("full")
    bundle = plain_bundle(root)
    proc = agent(bundle, root / "w", root / "s")
    return bundle, root, proc.returncode


def test_a_plain_script_runs_to_the_end_and_each_checkpoint_is_registered_once_with_its_loss(full_run):
    _bundle, root, code = full_run
    assert code == EXIT_OK, log_of(root / "w")
    ckpts = events(root / "w", "checkpoint")
    assert [c["step"] for c in ckpts] == [50, 100, 150, 200]
    assert all(c["tier"] == "durable" and c["attempt"] == 1 for c in ckpts)
    assert [c.get("parent") for c in ckpts] == [None] + [c["uri"] for c in ckpts[:-1]]
    losses = {m["step"]: m["values"]["train/loss"] for m in events(root / "w", "metrics")}
    assert sorted(losses) == list(range(1, 201))
    assert [c["train_loss"] for c in ckpts] == [losses[c["step"]] for c in ckpts]
    manifest = json.loads((Path(ckpts[0]["uri"].removeprefix("file://")) / "manifest.json").read_text())
    assert manifest["meta"]["layout"] == "file" and manifest["meta"]["name"] == "ckpt_50.pt"
    assert manifest["meta"]["format"] == "command"
    (exit_event,) = events(root / "w", "exit")
    assert exit_event["code"] == 0 and exit_event["last_step"] == 200
    assert '"train/loss"' in log_of(root / "w")  # the script's own lines are in the attempt's log


def test_a_notice_mid_run_saves_at_the_last_step_and_the_resumed_run_is_bit_identical(tmp_path):
    steps = 600  # a few seconds of training: the notice lands mid-run
    bundle = plain_bundle(tmp_path, **{"config.steps": steps})
    store = tmp_path / "s"
    proc = agent(bundle, tmp_path / "w1", store, wait=False)
    wait_for(lambda: any(m["step"] >= 20 for m in events(tmp_path / "w1", "metrics")), what="training under way")
    proc.send_signal(signal.SIGTERM)  # the reclaim notice, as a host's shutdown delivers it
    assert proc.wait(120) == EXIT_PREEMPTED, log_of(tmp_path / "w1")
    last = max(m["step"] for m in events(tmp_path / "w1", "metrics"))
    newest = events(tmp_path / "w1", "checkpoint")[-1]
    assert 20 <= last < steps and newest["step"] == last  # nothing lost
    assert newest["tier"] == "emergency" and newest["source"] == "sigterm"
    assert len(events(tmp_path / "w1", "notice")) == 1
    assert (tmp_path / "w1" / "command" / "train-a1" / "stop").exists()  # the stop file, for code that polls

    resumed = agent(bundle, tmp_path / "w2", store, "--attempt", "2", "--resume-from", newest["uri"],
                    "--expect-sha256", newest["sha256"])
    assert resumed.returncode == EXIT_OK, log_of(tmp_path / "w2")
    (res,) = events(tmp_path / "w2", "resumed")
    assert res["step"] == last and res["uri"] == newest["uri"]
    second = events(tmp_path / "w2", "checkpoint")
    assert second[0]["parent"] == newest["uri"] and second[-1]["step"] == steps
    assert f"resumed from {tmp_path / 'w2' / 'command' / 'train-a2' / 'resume' / f'ckpt_{last}.pt'}" in log_of(
        tmp_path / "w2")

    straight = agent(bundle, tmp_path / "w3", tmp_path / "s3")
    assert straight.returncode == EXIT_OK
    assert_same_tensors(saved_state(second[-1]["uri"]), saved_state(events(tmp_path / "w3", "checkpoint")[-1]["uri"]))


def test_a_resume_from_other_bytes_than_the_ledger_recorded_is_refused(full_run, tmp_path):
    bundle, root, _ = full_run
    first = events(root / "w", "checkpoint")[0]
    proc = agent(bundle, tmp_path / "w", root / "s", "--attempt", "2", "--resume-from", first["uri"],
                 "--expect-sha256", "0" * 64)
    assert proc.returncode == EXIT_INFRA and events(tmp_path / "w", "checkpoint") == []


SLOW_WRITER = """
import os, signal, sys, time
out = sys.argv[1]
with open(os.path.join(out, "ckpt_1.pt"), "wb") as fh:  # complete, then left alone: registered
    fh.write(b"a" * 1000)
time.sleep(2.5)
with open(os.path.join(out, "ckpt_2.pt"), "wb") as fh:  # written in place, slowly, and killed mid-write
    for _ in range(8):
        fh.write(b"b" * 1000)
        fh.flush()
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_checkpoint_being_written_when_the_script_is_killed_is_never_registered(tmp_path):
    bundle = script_bundle(tmp_path, SLOW_WRITER)
    proc = agent(bundle, tmp_path / "w", tmp_path / "s")
    assert proc.returncode == EXIT_USER_ERROR, log_of(tmp_path / "w")
    assert [c["step"] for c in events(tmp_path / "w", "checkpoint")] == [1]
    assert [p.name for p in (tmp_path / "s" / JOB).iterdir()] == ["step-000000001-a1"]
    assert "killed by signal 9" in events(tmp_path / "w", "exit")[0]["reason"]


def test_eval_of_a_checkpoint_reports_an_evaluation(full_run, tmp_path):
    bundle, root, _ = full_run
    last = events(root / "w", "checkpoint")[-1]
    proc = agent(bundle, tmp_path / "w", root / "s", "--task", "eval", "--checkpoint", last["uri"],
                 "--expect-sha256", last["sha256"])
    assert proc.returncode == EXIT_OK, log_of(tmp_path / "w")
    (loaded,) = events(tmp_path / "w", "loaded")
    assert loaded["uri"] == last["uri"] and loaded["step"] == 200
    (ev,) = events(tmp_path / "w", "evaluation")
    assert ev["checkpoint"] == last["uri"] and set(ev["metrics"]) == {"eval/loss"} and ev["metrics"]["eval/loss"] > 0


def test_collect_stores_what_the_script_wrote_as_artifacts_not_checkpoints(tmp_path):
    source = ("import os, sys\n"
              "os.makedirs(os.path.join(sys.argv[1], 'shards'))\n"
              "open(os.path.join(sys.argv[1], 'shards', 'part-0.jsonl'), 'w').write('{}\\n')\n"
              "open(os.path.join(sys.argv[1], 'summary_3.json'), 'w').write('{}')\n")
    bundle = script_bundle(tmp_path, source, kind="collect")
    assert agent(bundle, tmp_path / "w", tmp_path / "s").returncode == EXIT_OK, log_of(tmp_path / "w")
    assert events(tmp_path / "w", "checkpoint") == []  # summary_3.json looks like one: a collect has none
    record = json.loads((tmp_path / "w" / "artifacts" / "collected.json").read_text())
    assert set(record["files"]) == {"shards/part-0.jsonl", "summary_3.json"}
    stored = Path(record["uri"].removeprefix("file://"))
    assert (stored / "shards" / "part-0.jsonl").read_text() == "{}\n"


def test_custom_records_the_exit_code_and_the_log_only(tmp_path):
    source = "import json\nprint(json.dumps({'step': 1, 'loss': 2.0}))\nprint('hello from custom')\nraise SystemExit(3)\n"
    bundle = script_bundle(tmp_path, source, kind="custom")
    assert agent(bundle, tmp_path / "w", tmp_path / "s").returncode == EXIT_USER_ERROR
    assert events(tmp_path / "w", "metrics") == [] and "hello from custom" in log_of(tmp_path / "w")
    assert events(tmp_path / "w", "exit")[0]["reason"] == "the script's exit 3"


def test_no_script_outlives_its_agent_even_a_killed_one(tmp_path):
    source = "import os, sys, time\nopen(sys.argv[1] + '/../pid', 'w').write(str(os.getpid()))\ntime.sleep(120)\n"
    bundle = script_bundle(tmp_path, source, kind="custom")
    proc = agent(bundle, tmp_path / "w", tmp_path / "s", wait=False)
    pid_file = tmp_path / "w" / "command" / "train-a1" / "pid"
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="the script's pid"))
    proc.kill()  # SIGKILL: the agent cannot clean up; the kernel ends the script (PR_SET_PDEATHSIG)
    proc.wait(30)

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie until its (dead) parent's reaper collects it: dead all the same.
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"

    wait_for(gone, timeout=30, what="the script to die with its agent")


ENV_USER = """
import json, os, signal, sys, time
from orbit_dagster.integrations import env
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # code that cannot take a signal: it polls the stop file
assert env.under_orbit() and env.checkpoint_dir().is_dir() and env.config() == {"steps": 3}
for step in range(1, 4):
    env.write_metrics(step, {"train/loss": 1.0 / step})
print("ready", flush=True)
while not env.stop_requested():
    time.sleep(0.05)
(env.checkpoint_dir() / "ckpt_3.pt").write_bytes(b"saved on the stop file")
"""


def test_a_script_using_the_env_helpers_reports_through_the_metrics_file_and_stops_on_the_stop_file(tmp_path):
    bundle = script_bundle(tmp_path, ENV_USER, config={"steps": 3})
    proc = agent(bundle, tmp_path / "w", tmp_path / "s", wait=False)
    wait_for(lambda: "ready" in log_of(tmp_path / "w") and len(events(tmp_path / "w", "metrics")) == 3,
             what="the metrics file read")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == EXIT_PREEMPTED, log_of(tmp_path / "w")
    assert [m["step"] for m in events(tmp_path / "w", "metrics")] == [1, 2, 3]
    (ckpt,) = events(tmp_path / "w", "checkpoint")
    assert (ckpt["step"], ckpt["tier"], ckpt["train_loss"]) == (3, "emergency", pytest.approx(1 / 3))


def test_a_script_that_ignores_the_notice_is_killed_at_the_end_of_the_grace(tmp_path):
    source = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(120)\n"
    bundle = script_bundle(tmp_path, source)
    proc = agent(bundle, tmp_path / "w", tmp_path / "s", "--notice-grace", "1", wait=False)
    wait_for(lambda: "ready" in log_of(tmp_path / "w"), what="the script running")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == EXIT_PREEMPTED
    assert "did not exit within the notice's grace" in log_of(tmp_path / "w")


DIR_WRITER = """
import os, sys
from pathlib import Path
from orbit_dagster.integrations import env
resume = env.resume_from()
if resume:  # the directory as it was written, under resume/<name>
    files = sorted(str(p.relative_to(resume)) for p in resume.rglob("*") if p.is_file())
    assert resume.name == "checkpoint-2" and resume.parent.name == "resume", resume
    assert files == [".orbit-complete", "model.bin", "sub/opt.bin"], files
    assert (resume / "sub" / "opt.bin").read_bytes() == b"o" * 10
    print("resumed from the directory", flush=True)
else:
    d = env.checkpoint_dir() / "checkpoint-2"
    (d / "sub").mkdir(parents=True)
    (d / "model.bin").write_bytes(b"m" * 10)
    (d / "sub" / "opt.bin").write_bytes(b"o" * 10)
    (d / ".orbit-complete").write_text("")  # what a framework callback writes last
"""


def test_a_directory_checkpoint_is_registered_with_its_marker_and_resumed_as_written(tmp_path):
    bundle = script_bundle(tmp_path, DIR_WRITER, checkpoint={"settle_seconds": 0.5, "complete_marker": ".orbit-complete"})
    assert agent(bundle, tmp_path / "w1", tmp_path / "s").returncode == EXIT_OK, log_of(tmp_path / "w1")
    (ckpt,) = events(tmp_path / "w1", "checkpoint")
    manifest = json.loads((Path(ckpt["uri"].removeprefix("file://")) / "manifest.json").read_text())
    assert manifest["meta"]["layout"] == "dir" and manifest["meta"]["name"] == "checkpoint-2"
    resumed = agent(bundle, tmp_path / "w2", tmp_path / "s", "--attempt", "2", "--resume-from", ckpt["uri"],
                    "--expect-sha256", ckpt["sha256"])
    assert resumed.returncode == EXIT_OK, log_of(tmp_path / "w2")
    assert "resumed from the directory" in log_of(tmp_path / "w2")


SCHEDULED = """
import json, os, sys, time
from orbit_dagster.integrations import env
out = sys.argv[1]
for step in range(1, 121):
    time.sleep(0.08)
    print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    if env.checkpoint_due(step) or step == 120:
        tmp = os.path.join(out, f".ckpt_{step}.pt.partial")  # a name the watcher never registers
        with open(tmp, "wb") as fh:
            fh.write(b"x" * 100)
        os.replace(tmp, os.path.join(out, f"ckpt_{step}.pt"))
"""


def test_a_script_that_asks_the_schedule_saves_where_the_agent_re_decides_as_the_instance_ages(tmp_path):
    """The agent asks the interval rule again at each durable checkpoint it registers and
    publishes the next save step; a script (or a framework callback) asking
    `env.checkpoint_due` follows it: the intervals lengthen as the instance ages."""
    import time

    from orbit_dagster.core.interval import IntervalRule

    bundle = script_bundle(tmp_path, SCHEDULED)
    rule = IntervalRule(mtbf_s=3600.0, save_s=0.5, shape=0.5, uncovered=1.0, min_s=1.0)
    plan = {"policy": "orbit", "rule": rule.as_record(), "cadence_steps": 1000, "steps": 120, "step_s": 1.0,
            "time_scale": 10.0, "instance_started_at": time.time()}
    proc = agent(bundle, tmp_path / "w", tmp_path / "s", "--checkpoint-every", "10", "--interval-plan",
                 json.dumps(plan))
    assert proc.returncode == EXIT_OK, log_of(tmp_path / "w")
    saved = [c["step"] for c in events(tmp_path / "w", "checkpoint")]
    decided = events(tmp_path / "w", "interval")
    assert saved[0] == 10 and saved[-1] == 120  # the launch interval's grid first, the end last
    assert [d["step"] for d in decided] == saved[:-1]  # one decision per durable save but the last
    for d, later in zip(decided, saved[1:]):
        assert later >= d["next_step"] == d["step"] + d["steps"]
        assert d["interval_s"] == pytest.approx(rule.interval(d["age_s"], d["work_left_s"]), abs=2e-3)
    gaps = [d["steps"] for d in decided if d["interval_s"] < d["work_left_s"]]  # (not: run to the end)
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0] > 10, decided


NO_TORCH = """
import json, os, signal, sys, time
out, resume = sys.argv[1], os.environ["ORBIT_RESUME_FROM"]
step = int(open(resume).read()) if resume else 0
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

def save(step):
    tmp = os.path.join(out, ".partial")
    with open(tmp, "w") as fh:
        fh.write(str(step))
    os.replace(tmp, os.path.join(out, f"ckpt_{step}.bin"))

while step < 400 and not stop:
    step += 1
    time.sleep(0.02)
    print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    if step % 100 == 0:
        save(step)
if stop:
    save(step)
    sys.exit(75)
"""


def test_an_agent_running_a_command_workload_never_imports_torch(tmp_path):
    """A command's script runs in a process of its own and may not use torch at all (JAX, a
    shell script): its agent trains nothing itself, so it must run, save on a notice, resume and
    refuse a checkpoint with other bytes on a host where `import torch` fails."""
    bundle = script_bundle(tmp_path, NO_TORCH, checkpoint={"settle_seconds": 0.3, "every_steps": 100})
    store = tmp_path / "s"
    first = agent(bundle, tmp_path / "w1", store, wait=False, without_torch=True)
    wait_for(lambda: first.poll() is not None or any(c["step"] == 100 for c in events(tmp_path / "w1", "checkpoint")),
             what="the step-100 checkpoint")
    assert first.poll() is None, log_of(tmp_path / "w1")
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == EXIT_PREEMPTED, log_of(tmp_path / "w1")
    (started,) = events(tmp_path / "w1", "started")
    assert started["precheck"]["torch"] == torch.__version__  # read from the package's metadata
    assert "cuda_available" not in started["precheck"]  # not probed: that needs torch imported
    newest = events(tmp_path / "w1", "checkpoint")[-1]
    assert newest["tier"] == "emergency" and newest["step"] > 100

    refused = agent(bundle, tmp_path / "w2", store, "--attempt", "2", "--resume-from", newest["uri"],
                    "--expect-sha256", "0" * 64, without_torch=True)
    assert refused.returncode == EXIT_INFRA, log_of(tmp_path / "w2")
    assert "CheckpointMismatch" in events(tmp_path / "w2", "exit")[0]["reason"]

    resumed = agent(bundle, tmp_path / "w3", store, "--attempt", "3", "--resume-from", newest["uri"],
                    "--expect-sha256", newest["sha256"], without_torch=True)
    assert resumed.returncode == EXIT_OK, log_of(tmp_path / "w3")
    assert min(m["step"] for m in events(tmp_path / "w3", "metrics")) == newest["step"] + 1
    assert events(tmp_path / "w3", "checkpoint")[-1]["step"] == 400
    assert "No module named 'torch'" not in log_of(tmp_path / "w1") + log_of(tmp_path / "w3")
