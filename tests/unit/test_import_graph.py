"""No import circles in the package (docs/architecture.md, "The rules the suite enforces").

The graph is read from the source with `ast` (nothing imported): one node per module of
orbit_dagster, one edge per import statement, module-level AND function-local, because a
function-local import that closes a circle is still a circle: it only moves the failure from
import time to the first call. `if TYPE_CHECKING:` blocks never run, so they make no edge.
`from P import name` points at the module `P.name` when there is one, else at `P` (whose
`__init__` must then have defined `name`).

With no circle left, a function-local import is never needed to break one: it is there only to
keep an import lazy (torch, dagster, pandas, duckdb, boto3, paramiko ... kept off a start-up
path), and it says so in a `# lazy:` comment on its line or on the lines just above its group
(what it costs, and who would pay). `cli/` is left out of that rule: each command imports its
body when it runs, so that one command's imports never slow another's start.

The tests after each rule show its checker finds a breach, so each test can fail.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "orbit_dagster"


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def _targets(node, module: str, is_pkg: bool, modules: dict[str, Path]) -> list[str]:
    """The orbit modules one import statement runs."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            package = module if is_pkg else module.rpartition(".")[0]
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = []
    for name in names:
        while name and name not in modules:  # `import a.b.c` of a name inside a module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import statement}."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_nodes(tree):
            for target in _targets(node, module, path.name == "__init__.py", modules):
                edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module (breadth-first)."""
    members = set(component)
    start = component[0]
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return list(reversed(path)) + [start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in {component}")


def circles(root: Path = PACKAGE) -> list[str]:
    """One line per circle: each step with the line of the import that makes it."""
    graph = import_graph(root)
    lines = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        more = f" [{len(component)} modules in this knot: {', '.join(component)}]" if len(component) > len(cycle) - 1 else ""
        lines.append(" -> ".join(steps + [cycle[-1]]) + more)
    return lines


def _local_imports(tree: ast.AST):
    """Import statements inside a function (at any depth)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner


LAZY_EXEMPT = ("cli",)  # see the module docstring


def unexplained_local_imports(root: Path = PACKAGE) -> list[str]:
    """`file:line statement` of every function-local import without its `# lazy:` reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if len(rel.parts) > 2 and rel.parts[1] in LAZY_EXEMPT:
            continue
        lines = path.read_text().splitlines()
        nodes = sorted({n.lineno: n for n in _local_imports(ast.parse("\n".join(lines)))}.values(), key=lambda n: n.lineno)
        import_lines = {i for n in nodes for i in range(n.lineno, n.end_lineno + 1)}
        for node in nodes:
            if any("# lazy:" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
                continue
            i = node.lineno - 1
            while i in import_lines:  # up over the rest of its group
                i -= 1
            reason = False
            while i >= 1 and lines[i - 1].strip().startswith("#"):
                reason = reason or "lazy:" in lines[i - 1]
                i -= 1
            if not reason:
                found.append(f"{rel}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return found


def test_the_package_has_no_import_circle():
    found = circles()
    assert found == [], "import circles (function-local imports count):\n" + "\n".join(found)


def test_every_function_local_import_says_why_it_is_lazy():
    found = unexplained_local_imports()
    assert found == [], ("function-local imports without a `# lazy:` reason (hoist them, or say what they cost "
                         "and who would pay):\n" + "\n".join(found))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "orbit_dagster"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("closing", [
    "from .a import f\n",                        # module level
    "def g():\n    from .a import f\n",          # hidden in a function: still a circle
    "def g():\n    from orbit_dagster.pkg import a\n",
])
def test_a_circle_is_found_and_printed_with_its_lines(tmp_path, closing):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom .b import g\n",
        "pkg/b.py": closing,
    })
    found = circles(root)
    assert len(found) == 1, found
    assert found[0].startswith("orbit_dagster.pkg.a (line 2) -> orbit_dagster.pkg.b (line ") and found[0].endswith(
        "-> orbit_dagster.pkg.a"), found


def test_a_package_that_imports_its_module_which_imports_the_package_is_a_circle(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "from .store import Store\ndef open():\n    return Store()\n",
        "pkg/store.py": "def make():\n    from . import open\n    return open()\n",
    })
    assert circles(root) == ["orbit_dagster.pkg (line 1) -> orbit_dagster.pkg.store (line 2) -> orbit_dagster.pkg"]


def test_no_false_circles(tmp_path):
    """A sibling imported through its package, a name inside a module, and an import only a
    type checker runs make no circle."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "from .store import Store\n",
        "pkg/store.py": "from . import schema\nfrom orbit_dagster.pkg.schema import TABLE\n",
        "pkg/schema.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .store import Store\nTABLE = 1\n",
    })
    assert circles(root) == []


def test_a_local_import_without_its_reason_is_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "",
        "pkg/a.py": (
            "def slow():\n"
            "    # lazy: torch costs 3 s at start-up\n"
            "    import torch\n"
            "    import numpy  # lazy: 0.2 s\n"
            "    return torch, numpy\n"
            "\n"
            "def fast():\n"
            "    # the sum of the parts\n"
            "    import math\n"
            "    return math\n"
        ),
        "cli/__init__.py": "",
        "cli/commands.py": "def run():\n    import json\n    return json\n",
    })
    assert unexplained_local_imports(root) == ["orbit_dagster/pkg/a.py:9 import math"]
