"""Small helpers the integration and end-to-end tests share."""
from __future__ import annotations

import threading
import time


def wait_for(predicate, timeout: float = 120, every: float = 0.2, what: str = "condition"):
    """Poll until `predicate()` is truthy; return its value, or fail naming `what`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


class Background:
    """Run a function in a thread; `join()` returns its result or raises its error."""

    def __init__(self, fn):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def join(self, timeout: float = 300):
        self.thread.join(timeout)
        if self.error:
            raise self.error
        return self.result


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`orbit ARGV` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from orbit_dagster.cli.commands import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def same_tensors(a, b, where="state") -> int:
    """Every tensor equal (exactly), every other value equal; the number of tensors compared.
    (torch imported here: most users of this module never need it.)"""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
        return 1
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        return sum(same_tensors(a[k], b[k], f"{where}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(same_tensors(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, where
    return 0
