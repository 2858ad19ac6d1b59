"""Issue 8, defects 4 and 5: what comes from outside (an imported run, a checkpoint in the
store, a submission through any door) is checked before it is used, and a refusal loses
nothing and writes nothing."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.checkpoints import newest_complete
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.control.importer import import_run
from orbit_dagster.control.submit import retry, submit
from orbit_dagster.core.errors import CheckpointIntegrityError, OrbitError
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from orbit_dagster.storage.base import MANIFEST, CheckpointManifest
from tests.helpers import run_cli
from tests.reliability import inject
from tests.reliability.conftest import train


@pytest.fixture
def settings(orbit_home) -> Settings:
    return Settings.from_env(orbit_home)


run = run_cli  # `orbit ARGV` in this process: (exit code, stdout, stderr)


def refusal(code: int, out: str, err: str) -> str:
    """The one error line of a refusal (the import's progress label may precede it on stderr)."""
    lines = err.strip().splitlines()
    errors = [x for x in lines if x.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and lines[-1] == errors[0], (code, err)
    assert "Traceback" not in out + err
    return errors[0]


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))} if root.exists() else {}


# ---- defect 4: import-run writes only inside the store -----------------------------------------

def manifest_naming(d: Path, rel: str, data: bytes) -> None:
    """A checkpoint directory whose manifest lists a file under a hostile name."""
    import hashlib

    d.mkdir(parents=True, exist_ok=True)
    inject.tiny_state(d / "state.pt")
    files = {"state.pt": {"sha256": hashlib.sha256((d / "state.pt").read_bytes()).hexdigest(),
                          "bytes": (d / "state.pt").stat().st_size},
             rel: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    (d / MANIFEST).write_text(CheckpointManifest(job_id="x", step=1, tier="durable", files=files, attempt=1).to_json())


def hostile_layouts(src: Path, outside: Path) -> dict[str, callable]:
    escape = "../" * 40 + str(outside / "escaped")[1:]  # from any depth, up to / and down to `outside`

    def traversal():
        manifest_naming(src / "ckpt-1", escape, b"payload")

    def absolute():
        manifest_naming(src / "ckpt-1", str(outside / "escaped"), b"payload")

    def linked_state():
        (src / "ckpt-1").mkdir(parents=True)
        secret = inject.tiny_state(outside / "their.pt")
        (src / "ckpt-1" / "state.pt").symlink_to(secret)

    def linked_metrics():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "metrics.jsonl").symlink_to("/etc/passwd")

    def linked_checkpoint_dir():
        inject.tiny_state(outside / "theirs-1" / "state.pt")
        (src / "ckpt-1").symlink_to(outside / "theirs-1", target_is_directory=True)

    return {"manifest-names-../../../": traversal, "manifest-names-an-absolute-path": absolute,
            "state.pt-is-a-symlink-out": linked_state, "metrics.jsonl-is-a-symlink-to-/etc/passwd": linked_metrics,
            "checkpoint-dir-is-a-symlink-out": linked_checkpoint_dir}


LAYOUTS = list(hostile_layouts(Path("/x"), Path("/y")))


@pytest.mark.fault("defect 4: `orbit import-run DIR` with a manifest naming ../../../x or /abs, symlinks out of DIR",
                   expect="one line, exit 2; nothing written outside the store, nothing registered")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_defect_4_import_run_writes_nothing_outside_the_store(orbit_home, tmp_path, layout):
    """Old code (49321ab): a manifest file name `../../../tmp/x` was joined to the store path
    and written there: `orbit import-run` wrote anywhere the user could."""
    src, outside = tmp_path / "run", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    hostile_layouts(src, outside)[layout]()
    Settings.from_env(orbit_home).ledger()
    before, outside_before = tree(orbit_home), tree(outside)
    code, out, err = run(["import-run", str(src)])
    refusal(code, out, err)
    assert "root:" not in out + err
    assert tree(outside) == outside_before and not (outside / "escaped").exists()
    assert tree(orbit_home) == before  # no checkpoint copied, no ledger row
    assert Settings.from_env(orbit_home).ledger().scalar("SELECT count(*) FROM jobs") == 0


@pytest.mark.fault("defect 4 + torn file + flipped byte: a registered checkpoint's weights replaced and its manifest "
                   "rewritten to match; another's byte flipped; another's state.pt cut in half",
                   expect="never evaluated (nothing rented) nor resumed from; resume takes the last good one")
def test_defect_4_a_forged_checkpoint_is_never_resumed_from_or_evaluated(settings, tmp_path):
    """Old code: resume and evaluation checked a checkpoint against its own manifest only, so
    one whose manifest was rewritten to match tampered weights was resumed from and
    evaluated silently."""
    job = train(settings, {"config.steps": 8, "checkpoint.every_steps": 2}, experiment="tamper")
    ledger = settings.ledger()
    rows = {r["step"]: r for r in R.checkpoints(ledger, job)}
    assert sorted(rows) == [2, 4, 6, 8]
    forged_digest = inject.forge_checkpoint(rows[8]["uri"])  # verifies against its own manifest ...
    assert forged_digest != rows[8]["sha256"]  # ... but not against the ledger
    inject.flip_byte(inject.path_of(rows[6]["uri"]) / "state.pt")
    inject.truncate(inject.path_of(rows[4]["uri"]) / "state.pt", keep=0.5)

    for step, words in ((8, "changed after registration"), (6, "does not match"), (4, "does not match")):
        with pytest.raises(CheckpointIntegrityError, match=words):
            evaluate_checkpoint(settings, rows[step]["checkpoint_key"])
    assert ledger.scalar("SELECT count(*) FROM instances WHERE purpose = 'eval'") == 0  # nothing rented
    states = {r["checkpoint_key"]: r for r in ledger.rows("SELECT * FROM evaluations WHERE job_id = ?", [job])}
    assert all(states[rows[s]["checkpoint_key"]]["state"] == "PENDING" and states[rows[s]["checkpoint_key"]]["reason"]
               for s in (4, 6, 8))

    assert newest_complete(ledger, settings.store_uri, job, lineage=R.require_job(ledger, job)["lineage"],
                           eval_suite=None)["step"] == 2
    unusable = {r["checkpoint_key"] for r in ledger.rows(
        "SELECT checkpoint_key FROM events WHERE job_id = ? AND kind = 'checkpoint_unusable'", [job])}
    assert unusable == {rows[s]["checkpoint_key"] for s in (4, 6, 8)}
    # Training longer continues the lineage: from the newest checkpoint that is still what was registered.
    assert retry(settings, job, {"config.steps": 10}) == 2
    out = run_attempt(settings, job, poll_s=0.1)
    assert out.state == "SUCCEEDED"
    assert R.run(ledger, R.run_id_for(job, 2))["resume_from"] == rows[2]["checkpoint_key"]
    # Were the control plane's check skipped, the agent on the host refuses the forged weights too.
    from tests.unit.runtime.test_agent import agent

    bundle = Path(R.bundle_for(ledger, job, 2)["path"])
    proc = agent(bundle, tmp_path / "w", Path(settings.store_uri[len("file://"):]), "--attempt", "9",
                 "--resume-from", rows[8]["uri"], "--expect-sha256", rows[8]["sha256"])
    exit_info = json.loads((tmp_path / "w" / "artifacts" / "exit.json").read_text())
    assert proc.returncode != 0 and "CheckpointMismatch" in exit_info["reason"], exit_info


# ---- defect 5: bad input is refused before anything is rented or written -----------------------

class Payload:
    """Unpickling this runs code: what a malicious state.pt carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.fault("defect 5: `orbit import-run` of a state.pt that is a malicious pickle (os.system on load)",
                   expect="refused in one line naming the file; the code never runs; nothing registered")
def test_defect_5_a_malicious_pickle_on_import_is_refused_and_never_runs(orbit_home, tmp_path):
    """Old code: torch.load(weights_only=True) refused it, but the UnpicklingError escaped as a
    traceback (exit 1) instead of a refusal naming the file."""
    marker = tmp_path / "pwned"
    src = tmp_path / "run"
    (src / "ckpt-3").mkdir(parents=True)
    (src / "ckpt-3" / "state.pt").write_bytes(pickle.dumps({"model": Payload(marker), "step": 3}))
    proc = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", "import-run", str(src)],
                          env={**os.environ, "ORBIT_HOME": str(orbit_home)}, capture_output=True, text=True, timeout=300)
    line = refusal(proc.returncode, proc.stdout, proc.stderr)
    assert "ckpt-3/state.pt" in line and "weights-only" in line, line
    assert not marker.exists()
    assert Settings.from_env(orbit_home).ledger().scalar("SELECT count(*) FROM jobs") == 0
    assert not any((orbit_home / "checkpoints").rglob("*")) if (orbit_home / "checkpoints").exists() else True


ISSUE_VALUES = [  # the issue's list, through the control plane's own doors (the CLI's: test_cli_errors.py)
    ({"config.lr": "abc"}, "config.lr"), ({"config.dropout": 2}, "config.dropout"),
    ({"config.steps": -5}, "config.steps"), ({"config.steps": 0}, "config.steps"),
    ({"config.trainable": "banana"}, "config.trainable"), ({"resources.gpu": "H900"}, "resources.gpu"),
    ({"checkpoint.every_steps": True}, "checkpoint.every_steps"), ({"config.trainable": "x" * (1 << 20)}, "1024"),
]


@pytest.mark.fault("defect 5: invalid values (lr=abc, dropout=2, steps=-5/0, trainable=banana, gpu=H900, "
                   "every_steps=true, 1 MiB strings, bad names) via submit(), retry() and import-run's run.json",
                   expect="one OrbitError naming the field; no row, no bundle, no instance")
def test_defect_5_invalid_jobs_are_refused_at_every_door_before_anything_is_billed(settings, orbit_home, tmp_path):
    """Old code: these were accepted, queued, dispatched and billed; the workload then failed
    (or, for dropout=2 and steps=0, 'succeeded') on a rented instance."""
    finished = submit(settings, "charlm-finetune", {"config.steps": 8}, experiment="doors")
    from orbit_dagster.control.submit import cancel

    cancel(settings, finished)
    db = inject.sqlite_path(orbit_home)
    src = tmp_path / "run"
    inject.tiny_state(src / "ckpt-1" / "state.pt")
    doors = []
    for overrides, words in ISSUE_VALUES:
        doors.append(("submit", lambda o=overrides: submit(settings, "charlm-finetune", o, experiment="doors"), words))
        doors.append(("retry", lambda o=overrides: retry(settings, finished, o), words))
        doors.append(("import-run", lambda o=overrides: _import_with(settings, src, {"template": "charlm-finetune",
                                                                                  "overrides": o}), words))
    for name, field in (("experiment", "a b"), ("project", "x" * 5000), ("experiment", "../../etc")):
        doors.append(("submit", lambda n=name, f=field: submit(settings, "charlm-finetune", {}, **{n: f}), name))
        doors.append(("import-run", lambda n=name, f=field: _import_with(settings, src, {n: f}), name))
    before, bundles = inject.snapshot(db), tree(settings.bundles_dir)
    for door, call, words in doors:
        with pytest.raises(OrbitError) as err:
            call()
        assert words in str(err.value) and "fix:" in str(err.value), (door, str(err.value)[:300])
        assert len(str(err.value)) < 2000, (door, len(str(err.value)))
    assert inject.snapshot(db) == before and tree(settings.bundles_dir) == bundles
    assert not (orbit_home / "checkpoints").exists() or not any((orbit_home / "checkpoints").rglob("*"))


def _import_with(settings, src: Path, meta: dict):
    (src / "run.json").write_text(json.dumps(meta))
    return import_run(settings, src)
