"""A workload directory, packaged as a tree: what goes into a bundle's `scripts/`.

Everything under the workload directory travels (packages, sub-folders, data files), except
what its `.orbitignore` names and what is never code or data of the workload (caches,
version-control and virtual-environment folders). The files listed under the template's
`inputs` go to `inputs/` instead. The tree is bounded (`ORBIT_BUNDLE_MAX_MB`): a bigger one is
refused naming its biggest files, so a forgotten dataset or checkpoint folder never reaches
a host unnoticed.

`.orbitignore` holds one pattern a line (`#` comments, blank lines ignored), a subset of
gitignore's: `NAME` or a glob (`*.csv`) matches a file or folder of that name at any depth,
a pattern with a `/` inside (`data/raw/*`) matches the path from the workload directory, and
a trailing `/` (`runs/`) matches folders only. Negation (`!pattern`) is refused rather than
half-supported. Data from outside is never executed: the ignore file is only matched.
"""
from __future__ import annotations

import fnmatch
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import TemplateError

IGNORE_FILE = ".orbitignore"
ALWAYS_IGNORED = ("__pycache__/", "*.pyc", ".git/", ".hg/", ".svn/", ".venv/", "venv/", ".orbit/", "*.egg-info/",
                  ".ipynb_checkpoints/", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/", ".DS_Store")
DEFAULT_MAX_BYTES = 256 << 20
MAX_PATTERNS = 1000
SHOWN_BIGGEST = 5


@dataclass(frozen=True)
class _Pattern:
    glob: str
    dirs_only: bool
    anchored: bool  # matched against the whole relative path, not one name

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dirs_only and not is_dir:
            return False
        if self.anchored:
            return fnmatch.fnmatchcase(rel, self.glob)
        return fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], self.glob)


def _parse(lines: list[str], source: str) -> list[_Pattern]:
    patterns = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!") or "\0" in line:
            raise TemplateError(f"{source} line {number}: {line[:80]!r} is not supported", field=IGNORE_FILE,
                                value=line[:80], fix="list what to leave out; negation (!) and NUL are not supported")
        dirs_only = line.endswith("/")
        glob = line.strip("/")
        if not glob:
            continue
        patterns.append(_Pattern(glob, dirs_only, "/" in glob))
    return patterns


def ignore_patterns(src: Path) -> list[_Pattern]:
    """The always-ignored patterns, then the workload's `.orbitignore`."""
    patterns = _parse(list(ALWAYS_IGNORED), "orbit's own list")
    ignore = src / IGNORE_FILE
    if ignore.is_file():
        text = ignore.read_text(encoding="utf-8", errors="replace").splitlines()
        if len(text) > MAX_PATTERNS:
            raise TemplateError(f"{ignore.name} of workload {src.name!r} has {len(text)} lines", field=IGNORE_FILE,
                                value=len(text), fix=f"at most {MAX_PATTERNS} patterns")
        patterns += _parse(text, IGNORE_FILE)
    return patterns


def workload_files(src: Path, *, exclude: set[str] = frozenset()) -> list[tuple[str, Path]]:
    """(relative path, file) of every file the tree packages, sorted; `exclude`: relative
    paths that go elsewhere (the template's inputs). A link that leads out of the
    directory is refused: its target is not the workload's."""
    src = src.resolve()
    patterns = ignore_patterns(src)
    found: list[tuple[str, Path]] = []

    def walk(folder: Path) -> None:
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            rel = entry.relative_to(src).as_posix()
            is_dir = entry.is_dir()
            if any(p.matches(rel, is_dir) for p in patterns) or rel in exclude:
                continue
            if entry.is_symlink():
                target = entry.resolve()
                if not target.is_relative_to(src):
                    raise TemplateError(f"workload {src.name!r}: {rel} links outside the workload directory",
                                        field="workload", value=rel,
                                        fix=f"copy the file into the workload directory, or list it in {IGNORE_FILE}")
                if target.is_dir():  # a folder reached twice would be packaged twice: refused the same way
                    raise TemplateError(f"workload {src.name!r}: {rel} is a link to a folder", field="workload",
                                        value=rel, fix=f"replace the link by the folder, or list it in {IGNORE_FILE}")
            if is_dir:
                walk(entry)
            elif entry.is_file():
                found.append((rel, entry))

    walk(src)
    return found


def copy_tree(src: Path, dest: Path, *, exclude: set[str] = frozenset(), max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Copy the workload's tree into `dest`; returns its size in bytes."""
    files = workload_files(src, exclude=exclude)
    sizes = [(f.stat().st_size, rel) for rel, f in files]
    total = sum(size for size, _ in sizes)
    if total > max_bytes:
        biggest = ", ".join(f"{rel} ({size / 2**20:.1f} MiB)" for size, rel in sorted(sizes, reverse=True)[:SHOWN_BIGGEST])
        raise TemplateError(f"workload {src.name!r} is {total / 2**20:.1f} MiB, over the bundle limit of "
                            f"{max_bytes / 2**20:.0f} MiB; biggest: {biggest}", field="workload", value=src.name,
                            fix=f"list data and outputs in {IGNORE_FILE} (store datasets outside the bundle), or "
                                "raise ORBIT_BUNDLE_MAX_MB")
    for rel, f in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    return total
