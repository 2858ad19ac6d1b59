"""The workload directory travels as a tree: packages, sub-folders and data files, minus
what `.orbitignore` and the always-ignored names leave out, within a size limit."""
import json
import shutil
from pathlib import Path

import pytest

import orbit_dagster.workloads as shipped
from orbit_dagster.core.bundle import build_bundle, verify_bundle
from orbit_dagster.core.errors import TemplateError
from orbit_dagster.core.submission import TaskSubmission
from orbit_dagster.core.templates import load_template

CHARLM = Path(shipped.__file__).parent / "charlm"


@pytest.fixture
def workload(tmp_path) -> Path:
    wl = tmp_path / "mywork"
    shutil.copytree(CHARLM, wl, ignore=shutil.ignore_patterns("__pycache__"))
    (wl / "mypkg").mkdir()
    (wl / "mypkg" / "__init__.py").write_text("")
    (wl / "mypkg" / "layers.py").write_text("WIDTH = 3\n")
    (wl / "data").mkdir()
    (wl / "data" / "vocab.json").write_text('{"a": 1}\n')
    (wl / "runs").mkdir()
    (wl / "runs" / "ckpt_100.pt").write_bytes(b"\0" * 1000)
    (wl / "table.csv").write_text("x\n1\n")
    (wl / "__pycache__").mkdir(exist_ok=True)
    (wl / "__pycache__" / "train.cpython-312.pyc").write_bytes(b"\0")
    (wl / ".orbitignore").write_text("# outputs and raw data stay home\nruns/\n*.csv\n")
    return wl


def build(workload: Path, root: Path, **kw):
    t = load_template("charlm-finetune").model_copy(update={"workload": str(workload)})
    return build_bundle(t, TaskSubmission(template=t.name), "job-tree", root / "bundles", **kw)


def test_packages_subfolders_and_data_files_travel_and_ignored_ones_do_not(workload, tmp_path):
    b = build(workload, tmp_path)
    scripts = {p.relative_to(b.path / "scripts").as_posix() for p in (b.path / "scripts").rglob("*") if p.is_file()}
    assert {"train.py", "eval.py", "config.py", "charlm_model.py", "mypkg/__init__.py", "mypkg/layers.py",
            "data/vocab.json", ".orbitignore", "CORPUS.md"} <= scripts
    assert not {s for s in scripts if s.startswith(("runs/", "__pycache__/")) or s.endswith(".csv")}
    assert "corpus.txt" not in scripts and (b.path / "inputs" / "corpus.txt").is_file()  # inputs go to inputs/
    files = json.loads((b.path / "manifest.json").read_text())["files"]
    assert "scripts/mypkg/layers.py" in files and "scripts/data/vocab.json" in files  # hashed like the rest
    assert verify_bundle(b.path) == b.bundle_hash
    # A change in a sub-folder is a different bundle.
    (workload / "data" / "vocab.json").write_text('{"a": 2}\n')
    assert build(workload, tmp_path).bundle_hash != b.bundle_hash


def test_a_tree_over_the_limit_is_refused_naming_its_biggest_files_and_leaves_nothing(workload, tmp_path):
    (workload / "data" / "big.bin").write_bytes(b"\1" * (3 << 20))
    (workload / "data" / "medium.bin").write_bytes(b"\1" * (1 << 20))
    with pytest.raises(TemplateError) as err:
        build(workload, tmp_path, max_bytes=2 << 20)
    text = str(err.value)
    assert "over the bundle limit of 2 MiB" in text and text.index("data/big.bin") < text.index("data/medium.bin")
    assert ".orbitignore" in err.value.fix and "ORBIT_BUNDLE_MAX_MB" in err.value.fix
    assert list((tmp_path / "bundles").iterdir()) == []


def test_a_link_out_of_the_workload_directory_is_refused(workload, tmp_path):
    secret = tmp_path / "outside.txt"
    secret.write_text("not the workload's")
    (workload / "data" / "leak.txt").symlink_to(secret)
    with pytest.raises(TemplateError) as err:
        build(workload, tmp_path)
    assert "data/leak.txt links outside the workload directory" in str(err.value)
    assert list((tmp_path / "bundles").iterdir()) == []


def test_a_link_inside_the_directory_travels_as_the_file(workload, tmp_path):
    (workload / "data" / "alias.json").symlink_to(workload / "data" / "vocab.json")
    b = build(workload, tmp_path)
    copied = b.path / "scripts" / "data" / "alias.json"
    assert copied.is_file() and not copied.is_symlink() and copied.read_text() == '{"a": 1}\n'


@pytest.mark.parametrize("line", ["!keep.csv", "bad\0name"])
def test_an_ignore_line_it_cannot_honour_is_refused_naming_the_line(workload, tmp_path, line):
    (workload / ".orbitignore").write_text(f"runs/\n{line}\n")
    with pytest.raises(TemplateError) as err:
        build(workload, tmp_path)
    assert ".orbitignore line 2" in str(err.value) and err.value.field == ".orbitignore"
