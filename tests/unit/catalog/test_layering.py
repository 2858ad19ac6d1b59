"""The catalog stays pure and the probe stays host-side: checked on the import statements."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import orbit_dagster

PKG = Path(orbit_dagster.__file__).parent
CATALOG = ["__init__.py", "gpus.py", "gce.py", "aws.py", "listing.py", "build_data.py"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("name", CATALOG)
def test_catalog_imports_no_orchestrator_or_vendor_sdk(name):
    roots = {n.split(".")[0] for n in _imports(PKG / "catalog" / name)}
    assert not roots & {"dagster", "boto3", "botocore", "paramiko"}


def test_probe_imports_only_stdlib_and_torch():
    imported = {n.split(".")[0] for n in _imports(PKG / "runtime" / "probe.py")}
    # `device` is the runtime's own device module (relative import), itself stdlib + torch.
    assert imported <= {"__future__", "platform", "time", "torch", "device"}
    device = {n.split(".")[0] for n in _imports(PKG / "runtime" / "device.py")}
    assert device <= {"__future__", "contextlib", "os", "dataclasses", "typing", "torch"}


@pytest.mark.parametrize("name", CATALOG)
def test_no_machine_paths_in_committed_files(name):
    assert "/" + "work/" not in (PKG / "catalog" / name).read_text(encoding="utf-8")  # split: this file is checked too
