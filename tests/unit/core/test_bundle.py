import json
import os
import subprocess
import sys

import pytest

from orbit_dagster.core.bundle import JobBundle, build_bundle, verify_bundle
from orbit_dagster.core.errors import BundleIntegrityError, TemplateError
from orbit_dagster.core.submission import TaskSubmission
from orbit_dagster.core.templates import load_template


@pytest.fixture
def bundle(tmp_path):
    t = load_template("charlm-finetune")
    return build_bundle(t, TaskSubmission(template=t.name), "job-1", tmp_path / "bundles")


def test_layout_and_manifest(bundle):
    p = bundle.path
    for name in ("job.json", "inputs/corpus.txt", "scripts/train.py", "scripts/eval.py",
                 "runtime/orbit_dagster/runtime/agent.py", "runtime/orbit_dagster/storage/fs.py", "manifest.json"):
        assert (p / name).is_file(), name
    assert (p / "artifacts").is_dir()
    manifest = json.loads((p / "manifest.json").read_text())
    assert manifest["bundle_sha256"] == bundle.bundle_hash == p.name
    assert "artifacts" not in " ".join(manifest["files"])


def test_the_host_contract_and_the_interval_rule_travel_in_the_bundle_and_nothing_else_of_core(bundle):
    core = bundle.path / "runtime" / "orbit_dagster" / "core"
    assert sorted(f.name for f in core.iterdir()) == ["__init__.py", "errors.py", "host_contract.py", "interval.py",
                                                       "placeholders.py", "process_tree.py"]
    assert "runtime/orbit_dagster/core/host_contract.py" in json.loads((bundle.path / "manifest.json").read_text())["files"]


def test_the_command_runner_and_the_integrations_import_from_the_bundle_alone(bundle):
    """What a host runs for a command workload (the runner, its core parts, the script's
    stdlib helpers) is in the bundle: imported from there, not from this checkout."""
    runtime = bundle.path / "runtime"
    code = ("import orbit_dagster.runtime.command as c, orbit_dagster.integrations.env as e, "
            "orbit_dagster.core.placeholders as p; print(c.__file__, e.__file__, p.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(runtime)},
                         capture_output=True, text=True, cwd=bundle.path)
    assert out.returncode == 0, out.stderr
    assert all(path.startswith(str(runtime)) for path in out.stdout.split())


def test_job_json_freezes_template_request_and_provenance(bundle):
    spec = JobBundle.load(bundle.path).spec
    assert spec.template_snapshot["name"] == "charlm-finetune"
    assert spec.execution_request.backend_key == "sim_host_process"
    prov = spec.provenance
    assert prov["python"] and prov["packages"]["torch"]
    assert set(prov["workload_git"]) == {"commit", "dirty", "path"}


def test_tampering_is_detected(bundle):
    (bundle.path / "scripts" / "train.py").write_text("print('evil')\n")
    with pytest.raises(BundleIntegrityError) as err:
        verify_bundle(bundle.path)
    assert "scripts/train.py" in str(err.value)


def test_host_outputs_do_not_change_the_hash(bundle):
    (bundle.path / "artifacts" / "events.jsonl").write_text("{}\n")
    assert verify_bundle(bundle.path) == bundle.bundle_hash


def test_secrets_are_never_frozen(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value")
    t = load_template("charlm-finetune").model_copy(update={"secret_env": ("MY_TOKEN",)})
    b = build_bundle(t, TaskSubmission(template=t.name), "job-2", tmp_path / "b")
    blob = b"".join(f.read_bytes() for f in b.path.rglob("*") if f.is_file())
    assert b"s3cr3t-value" not in blob
    assert b.spec.execution_request.secret_env == ("MY_TOKEN",)


def test_no_half_built_bundle_is_left_on_failure(tmp_path):
    t = load_template("charlm-finetune").model_copy(update={"inputs": ("missing.txt",)})
    with pytest.raises(TemplateError):
        build_bundle(t, TaskSubmission(template=t.name), "job-3", tmp_path / "b")
    assert list((tmp_path / "b").iterdir()) == []
