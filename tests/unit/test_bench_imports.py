"""The benches run from a checkout without the test suite's modules: none imports `tests`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_no_bench_script_imports_the_tests(script):
    bad = sorted(n for n in _imported(BENCH / script) if n == "tests" or n.startswith("tests."))
    assert not bad, f"bench/{script} imports {bad}: move what it needs into the package or bench/"
