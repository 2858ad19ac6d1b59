"""The checkpoint watcher of a command workload: which entries of its checkpoint directory
are complete checkpoints, each found once.

A script saves however it saves (`torch.save`, a framework's directory of shards). An entry
directly under the directory whose name matches the pattern is a candidate; it is complete
once every file in it kept its size and mtime for `settle_seconds` (the debounce) and, when
the template names a `complete_marker`, the marker is present (inside a directory, or beside
a file as `<name><marker>`). Temporary names (a leading `.` or `tmp`, a `.tmp` or `.partial`
suffix) are never checkpoints. A step is reported at most once.

Without a marker, a writer that pauses longer than `settle_seconds` mid-file looks complete:
that is what the marker is for. A torch.distributed.checkpoint directory (`*.distcp` shards)
has one of its own: it is complete only once its `.metadata` is written. A file that had not settled when its writer was killed is
never reported (`settle_after_exit(killed=True)`).

Polling, not inotify: it works on every filesystem a rented host mounts, and a test drives it
with its own clock.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_PATTERN = r"^.*[-_](?P<step>\d+)(\.(pt|pth|ckpt|bin|safetensors))?$"
TEMP_PREFIXES = (".", "tmp")
TEMP_SUFFIXES = (".tmp", ".partial")

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint: written last, by the coordinator rank
DCP_SHARD = ".distcp"  # its shard files

Fingerprint = tuple[tuple[str, int, int], ...]


class PatternError(ValueError):
    """A checkpoint pattern without a named group `step`."""


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: where it is, its step, and whether it is a file or a directory."""

    path: Path
    step: int
    layout: str  # "file" | "dir"

    @property
    def name(self) -> str:
        return self.path.name


def shards_format(found: Found, files: dict[str, Path] | None = None) -> str:
    """What a checkpoint's files are, for its manifest: `dcp` for a torch.distributed.checkpoint
    directory (shards loadable into another world size, docs/bring-your-own.md), else `files`.
    `files`: what it holds when it is more than the directory found (a group's nodes' parts)."""
    if found.layout != "dir":
        return "files"
    return "dcp" if (DCP_METADATA in files if files is not None else (found.path / DCP_METADATA).is_file()) else "files"


def compile_pattern(pattern: str | None) -> re.Pattern:
    compiled = re.compile(pattern or DEFAULT_PATTERN)
    if "step" not in compiled.groupindex:
        raise PatternError(f"checkpoint pattern {compiled.pattern!r} has no named group `step`")
    return compiled


def fingerprint(path: Path) -> Fingerprint | None:
    """(relative name, size, mtime_ns) of every file of an entry; None while it is unreadable or empty."""
    try:
        if path.is_file():
            st = path.stat()
            return (("", st.st_size, st.st_mtime_ns),)
        files = []
        for root, _dirs, names in os.walk(path):
            for n in names:
                f = Path(root) / n
                st = f.stat()
                files.append((str(f.relative_to(path)), st.st_size, st.st_mtime_ns))
        return tuple(sorted(files)) or None
    except OSError:  # removed or renamed while we looked: next poll
        return None


class CheckpointWatcher:
    def __init__(self, directory: Path, *, pattern: str | None = None, complete_marker: str | None = None,
                 settle_seconds: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda msg: print(f"orbit agent: {msg}", flush=True),
                 metadata_elsewhere: bool = False):
        self.directory = Path(directory)
        # One node of a group: its DCP directories hold its own ranks' shards, the `.metadata` may
        # be on another node's (runtime/group.py), so settled is complete here.
        self.metadata_elsewhere = metadata_elsewhere
        self.pattern = compile_pattern(pattern)
        self.marker = complete_marker
        self.settle_seconds = float(settle_seconds)
        self.clock = clock
        self.log = log
        self._seen: dict[str, tuple[Fingerprint, float]] = {}  # name -> (fingerprint, since when unchanged)
        self._done: set[str] = set()  # names reported or refused for good
        self.steps: set[int] = set()

    def _candidate(self, name: str) -> int | None:
        if name.startswith(TEMP_PREFIXES) or name.endswith(TEMP_SUFFIXES):
            return None
        if self.marker and name.endswith(self.marker):
            return None  # the marker beside a file checkpoint
        m = self.pattern.match(name)
        if not m or m.group("step") is None or not m.group("step").isdigit():
            return None
        return int(m.group("step"))

    def _marked(self, path: Path) -> bool:
        if (path.is_dir() and not self.metadata_elsewhere and not (path / DCP_METADATA).is_file()
                and any(path.glob(f"*{DCP_SHARD}"))):
            # torch.distributed.checkpoint shards without their metadata: the coordinator
            # writes `.metadata` once every rank's shards are written; until then, torn.
            return False
        if not self.marker:
            return True
        if path.is_dir():
            return (path / self.marker).is_file()
        return path.with_name(path.name + self.marker).is_file()

    def poll(self, *, settle: float | None = None) -> list[Found]:
        """The entries complete now (each reported once, in step order)."""
        settle = self.settle_seconds if settle is None else settle
        now = self.clock()
        found: list[Found] = []
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return []
        for name in names:
            if name in self._done:
                continue
            step = self._candidate(name)
            if step is None:
                continue
            path = self.directory / name
            fp = fingerprint(path)
            if fp is None:
                self._seen.pop(name, None)
                continue
            before = self._seen.get(name)
            if before is None or before[0] != fp:
                self._seen[name] = (fp, now)  # new or changed: the debounce starts again
                if settle > 0:
                    continue
            elif now - before[1] < settle:
                continue
            if not self._marked(path):
                continue
            self._done.add(name)
            self._seen.pop(name, None)
            if step in self.steps:
                self.log(f"checkpoint {name}: step {step} is registered already; this save is ignored")
                continue
            self.steps.add(step)
            found.append(Found(path=path, step=step, layout="dir" if path.is_dir() else "file"))
        return sorted(found, key=lambda f: f.step)

    def settle_after_exit(self, *, killed: bool, recheck_s: float = 0.2) -> list[Found]:
        """The last poll, once the script has exited. Its writes are over, so an entry unchanged
        over a short re-check is complete, unless the script was killed: then only what had
        settled while it ran counts (a file it was writing may be torn)."""
        if killed:
            return []
        found = self.poll(settle=recheck_s)
        time.sleep(recheck_s)
        return found + self.poll(settle=recheck_s)
