"""The environment contract of a command workload, read from the script's side (stdlib only).

The agent sets these variables before it starts the script (docs/bring-your-own.md); outside
orbit none is set, every helper returns None (or False), and a script or callback that uses
them runs as it would without orbit.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

JOB_ID = "ORBIT_JOB_ID"
ATTEMPT = "ORBIT_ATTEMPT"
TASK = "ORBIT_TASK"
CHECKPOINT_DIR = "ORBIT_CHECKPOINT_DIR"
RESUME_FROM = "ORBIT_RESUME_FROM"
METRICS_FILE = "ORBIT_METRICS_FILE"
CHECKPOINT_EVERY = "ORBIT_CHECKPOINT_EVERY"
CHECKPOINT_SCHEDULE = "ORBIT_CHECKPOINT_SCHEDULE"
EVAL_CHECKPOINT = "ORBIT_EVAL_CHECKPOINT"
CONFIG = "ORBIT_CONFIG"
STOP_FILE = "ORBIT_STOP_FILE"
COMPLETE_MARKER = ".orbit-complete"  # written last into a saved checkpoint directory by a callback


def _path(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value) if value else None


def under_orbit() -> bool:
    """True when the script runs as an orbit command workload."""
    return bool(os.environ.get(JOB_ID))


def checkpoint_dir() -> Path | None:
    """Where the script writes its checkpoints (the agent watches it)."""
    return _path(CHECKPOINT_DIR)


def resume_from() -> Path | None:
    """The verified checkpoint to resume from, as the script wrote it (file or directory), or None."""
    return _path(RESUME_FROM)


def eval_checkpoint() -> Path | None:
    """Eval task: the verified checkpoint to evaluate."""
    return _path(EVAL_CHECKPOINT)


def metrics_file() -> Path | None:
    """Where JSON lines of metrics may be appended."""
    return _path(METRICS_FILE)


def checkpoint_every() -> int | None:
    value = os.environ.get(CHECKPOINT_EVERY, "")
    return int(value) if value.isdigit() else None


_schedule_cache: dict = {}  # path -> (mtime_ns, size, schedule): read again only when the agent rewrote it
_answered: dict = {}  # the next_step a save was already due for


def checkpoint_schedule() -> dict | None:
    """The agent's current schedule `{"every": N, "next_step": K or null}`: the interval it
    re-decides after each durable save as the instance ages (None outside orbit, or when
    the file is missing or unreadable: then ORBIT_CHECKPOINT_EVERY alone holds)."""
    path = _path(CHECKPOINT_SCHEDULE)
    if path is None:
        return None
    try:
        st = path.stat()
        cached = _schedule_cache.get(str(path))
        if cached is not None and cached[:2] == (st.st_mtime_ns, st.st_size):
            return cached[2]
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("every"), int) or value["every"] < 1:
        return None
    _schedule_cache[str(path)] = (st.st_mtime_ns, st.st_size, value)
    return value


def checkpoint_due(step: int) -> bool | None:
    """Is a periodic checkpoint due at `step`? The agent's schedule first (the next save step
    it decided; before its first decision, multiples of the launch interval), else multiples
    of ORBIT_CHECKPOINT_EVERY; None when neither is set (outside orbit)."""
    schedule = checkpoint_schedule()
    if schedule is not None:
        nxt = schedule.get("next_step")
        if isinstance(nxt, int):
            # Once per decided step: the agent rewrites the schedule only after it has registered
            # that save (seconds later); the steps until then are not due again.
            if step < nxt or _answered.get(CHECKPOINT_SCHEDULE) == nxt:
                return False
            _answered[CHECKPOINT_SCHEDULE] = nxt
            return True
        return step > 0 and step % schedule["every"] == 0
    every = checkpoint_every()
    return None if every is None else step > 0 and step % every == 0


def config() -> dict:
    """The template's `config` (empty outside orbit)."""
    path = _path(CONFIG)
    return json.loads(path.read_text()) if path else {}


def stop_requested() -> bool:
    """True once the agent has received a reclaim notice (it creates the stop file)."""
    path = _path(STOP_FILE)
    return path is not None and path.exists()


def write_metrics(step: int, values: dict[str, float]) -> None:
    """Append one metrics line (`{"step": N, ...}`) to the metrics file; nothing outside orbit."""
    path = metrics_file()
    if path is None:
        return
    line = json.dumps({"step": int(step), **{k: float(v) for k, v in values.items()}})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


# ---- metric names of the frameworks' logs (shared by the HF callback and `orbit import-run`) ----
HF_SPLITS = {"eval_": "eval/", "test_": "test/", "train_": "train/"}
HF_RENAMED = {"loss": "train/loss", "train_loss": "train/mean_loss"}  # train_loss: the run's mean, logged at its end


def hf_metric_name(key: str) -> str:
    """orbit's name of one Hugging Face log key: `loss` -> `train/loss`, `train_loss` (the mean
    over a whole `train()` call, logged at its end) -> `train/mean_loss`, `eval_X` -> `eval/X`,
    `test_X` -> `test/X`, `train_X` -> `train/X`, a key with a `/` as it is, any other key
    (`grad_norm`, `learning_rate`, `epoch`, ...) -> `train/<key>`."""
    if key in HF_RENAMED:
        return HF_RENAMED[key]
    if "/" in key:
        return key
    for prefix, namespace in HF_SPLITS.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            return namespace + key[len(prefix):]
    return "train/" + key


def hf_metric_values(logs: dict) -> dict[str, float]:
    """The numeric, finite values of a Hugging Face log record under orbit's names (strings,
    booleans, None, NaN and infinities are left out: a metrics line carries finite numbers)."""
    out = {}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[hf_metric_name(str(key))] = float(value)
    return out
