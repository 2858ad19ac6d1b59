"""The import rules of docs/architecture.md ("Layers"), checked on the source: every import
statement of the package, function-local ones included, read with `ast` (nothing imported).

Each rule is a "never" of the architecture page; the last tests show the checker finds a
broken rule, so this test can fail.
"""
import ast
from pathlib import Path

import pytest

from orbit_dagster.core import bundle

PACKAGE = Path(__file__).resolve().parents[2] / "orbit_dagster"
DAGSTER = ("dagster", "dagster_postgres", "dagster_webserver", "dagster_graphql")
# The Dagster layer and the front door: nothing below them imports them.
DAGSTER_LAYER = ("assets", "resources", "sensors", "schedules", "ops", "jobs", "definitions", "deploy", "cli",
                 "run_coordinator", "run_launcher")
CONTROL_PLANE = ("control", "ledger", "catalog", "policy", "providers", "settings") + DAGSTER_LAYER

# (package, what it never imports, the rule as docs/architecture.md states it)
NEVER = [
    ("core", ("orbit_dagster",) + DAGSTER, "core imports nothing of orbit but core, and never Dagster"),
    ("policy", DAGSTER + ("control", "ledger", "providers", "storage", "runtime") + DAGSTER_LAYER,
     "policy is pure decisions: never Dagster, the ledger or a provider"),
    ("catalog", DAGSTER + ("providers", "control") + DAGSTER_LAYER, "catalog never calls providers, never Dagster"),
    ("control", DAGSTER + DAGSTER_LAYER, "control never imports Dagster"),
    ("ledger", DAGSTER + ("control", "providers") + DAGSTER_LAYER, "the ledger never imports control"),
    ("storage", ("orbit_dagster",) + DAGSTER, "storage travels in the bundle: it imports only itself"),
    ("providers", DAGSTER + ("control",) + DAGSTER_LAYER, "providers never import the control plane or Dagster"),
    ("runtime", DAGSTER + CONTROL_PLANE, "runtime never imports the control plane"),
    ("workloads", DAGSTER + CONTROL_PLANE + ("core", "storage"), "workloads reach orbit only through ctx"),
]
OWN_PREFIX = {"core": ("core",), "storage": ("storage",)}  # what "orbit_dagster" in NEVER still allows


def _module_of(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def imports_of(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative ones resolved."""
    module, is_pkg = _module_of(path, root)
    package = module if is_pkg else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            if not node.module:  # `from . import x`: x may be a module
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def _banned(target: str, package: str, never: tuple[str, ...]) -> bool:
    parts = target.split(".")
    own = OWN_PREFIX.get(package, ())
    for banned in never:
        if banned == "orbit_dagster":
            if parts[0] == "orbit_dagster" and (len(parts) < 2 or parts[1] not in own):
                return True
        elif banned in DAGSTER:
            if parts[0] == banned:
                return True
        elif parts[0] == "orbit_dagster" and len(parts) > 1 and parts[1] == banned:
            return True
    return False


def violations(root: Path = PACKAGE) -> list[str]:
    found = []
    for package, never, rule in NEVER:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []:
            for line, target in imports_of(path, root):
                if _banned(target, package, never):
                    found.append(f"{path.relative_to(root.parent)}:{line} imports {target} ({rule})")
    return found


def test_every_never_of_the_architecture_holds():
    assert violations() == []


def test_the_runtime_a_bundle_ships_imports_only_what_the_bundle_ships(tmp_path):
    """A host has Python and torch, and the runtime copied into the bundle: every orbit
    module the shipped code imports must be in that copy."""
    shipped = tmp_path / "runtime"
    bundle._copy_runtime(shipped)
    root = shipped / "orbit_dagster"
    missing = []
    for path in sorted(root.rglob("*.py")):
        for line, target in imports_of(path, root):
            if target.split(".")[0] != "orbit_dagster":
                continue
            rel = Path(*target.split("."))
            if not ((shipped / rel).with_suffix(".py").is_file() or (shipped / rel / "__init__.py").is_file()):
                missing.append(f"{path.relative_to(shipped)}:{line} imports {target}, not in the bundle")
    assert missing == []


@pytest.mark.parametrize("package, line, rule", [
    ("control", "import dagster as dg\n", "control never imports Dagster"),
    ("ledger", "from ..control import submit\n", "the ledger never imports control"),
    ("catalog", "def f():\n    from orbit_dagster.providers import base\n", "catalog never calls providers"),
    ("runtime", "from ..ledger import store\n", "runtime never imports the control plane"),
    ("core", "from ..settings import Settings\n", "core imports nothing of orbit but core"),
])
def test_a_broken_rule_is_found_with_its_file_and_line(tmp_path, package, line, rule):
    root = tmp_path / "orbit_dagster"
    (root / package).mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / package / "__init__.py").write_text("")
    (root / package / "bad.py").write_text("import os\n" + line)
    found = violations(root)
    assert len(found) == 1 and found[0].startswith(f"orbit_dagster/{package}/bad.py:") and rule in found[0], found
