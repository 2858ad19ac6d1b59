"""Reading checkpoint files back part by part: a bounded fan-out on a pool (`for_each`), the
parts of a file, the error that names a part, and the check of a file read in order against
its manifest entry of either version (`Digester`: an SFTP copy, an import).

Stdlib only: this package travels in every bundle.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Executor, Future, wait
from typing import Any, Callable, Iterable, TypeVar

from .base import StoreError

T = TypeVar("T")
R = TypeVar("R")


def for_each(executor: Executor, items: Iterable[T], fn: Callable[[T], R], in_flight: int) -> list[R]:
    """fn(item) for every item on the pool, at most `in_flight` at a time; the results in order.
    The first failure (in item order) is raised once every started task has ended; after a
    failure no new task starts."""
    slots = threading.BoundedSemaphore(max(1, in_flight))
    futures: list[Future] = []
    failed = threading.Event()

    def run(item: T) -> R:
        try:
            if failed.is_set():
                raise _Skipped()
            return fn(item)
        except BaseException:
            failed.set()
            raise
        finally:
            slots.release()

    for item in items:
        slots.acquire()
        if failed.is_set():
            slots.release()
            break
        futures.append(executor.submit(run, item))
    wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    real = [e for e in errors if not isinstance(e, _Skipped)]
    if real:
        raise real[0]
    return [f.result() for f in futures]


class _Skipped(Exception):
    """A task not run because an earlier one failed."""


def part_ranges(nbytes: int, part_size: int) -> list[tuple[int, int, int]]:
    """(index, offset, length) of every part of a file."""
    return [(i, off, min(part_size, nbytes - off)) for i, off in enumerate(range(0, nbytes, part_size))]


def part_mismatch(uri: str, rel: str, where: str, index: int, count: int, offset: int, length: int) -> StoreError:
    return StoreError(f"checkpoint {uri}: file {rel}{where} part {index + 1} of {count} (bytes {offset}-"
                      f"{offset + length - 1}) does not match its manifest sha256; fix: do not use it, resume from "
                      "an older checkpoint")


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset` (fewer bytes only at the end of the file)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class Digester:
    """One file checked against its manifest entry (either version) as it is read in order,
    in chunks of any size, on one thread (an SFTP copy, an import): `update`, then `problem`."""

    def __init__(self, info: dict, version: int, part_size: int):
        self.info, self.version, self.part_size = info, version, int(part_size)
        self._h = hashlib.sha256()
        self._in_part = 0
        self.parts: list[str] = []
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self.version == 1:
            self._h.update(view)
            return
        while view:
            take = min(len(view), self.part_size - self._in_part)
            self._h.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == self.part_size:
                self.parts.append(self._h.hexdigest())
                self._h, self._in_part = hashlib.sha256(), 0

    def problem(self) -> str | None:
        """None when the bytes read are the manifest's; else what differs, in words."""
        if self.size != int(self.info["bytes"]):
            return f"{self.size} bytes, its manifest says {self.info['bytes']}"
        if self.version == 1:
            return None if self._h.hexdigest() == self.info["sha256"] else "does not match its manifest sha256"
        parts = self.parts + ([self._h.hexdigest()] if self._in_part else [])
        for i, (got, want) in enumerate(zip(parts, self.info["parts"])):
            if got != want:
                return f"part {i + 1} of {len(self.info['parts'])} does not match its manifest sha256"
        return None if len(parts) == len(self.info["parts"]) else "does not match its manifest's part count"


class Discard:
    """A binary sink that keeps nothing (a verify that reads without writing), as a context manager."""

    def write(self, data: bytes) -> None:
        pass

    def __enter__(self) -> "Discard":
        return self

    def __exit__(self, *exc) -> None:
        pass
