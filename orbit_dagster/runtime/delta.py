"""Delta checkpoints: only the parts of a state that changed since a base checkpoint.

An emergency checkpoint must land before the reclaim deadline. When most of the state did
not change since the last durable checkpoint (frozen layers, adapters, a head-only
fine-tune), writing just the changed tensors is measurably smaller and faster; when
everything changed (a full fine-tune with Adam), a delta would be the full state plus
bookkeeping, so the full state is written instead. The rule is the measured fraction of
changed bytes.

What changed is decided by comparing bytes with the base's host copy (kept by the
checkpointer), not by hashing: the durable save then hashes nothing for the delta's sake,
and the comparison is exact (a tensor that went from 0.0 to -0.0, or to a NaN with another
payload, counts as changed) and runs at memory speed, where a digest of every tensor cost
one more pass over the whole state on every durable save.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import torch

DELTA_KEY = "__orbit_delta__"
MAX_CHANGED_FRACTION = 0.5


def leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) for every tensor or plain value of a nested state."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))
    else:
        yield path, obj


def path_key(path: tuple) -> str:
    return json.dumps(list(path))


def flatten(state: Any) -> dict[str, Any]:
    return {path_key(p): v for p, v in leaves(state)}


def nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: Any, b: Any) -> bool:
    """True when both are dense tensors of one dtype and shape holding identical bytes."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.layout != torch.strided or b.layout != torch.strided:
        return False  # sparse/quantised layouts: always saved, never compared
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    return bool(torch.equal(_raw(a), _raw(b)))


def make_delta(state: Any, base: dict[str, Any], base_uri: str,
               max_fraction: float = MAX_CHANGED_FRACTION) -> tuple[dict | None, float]:
    """(delta payload or None when a full save is better, fraction of bytes changed).

    `base` is the flattened base state (`flatten`), on the same host as `state`; a delta of
    more than `max_fraction` of the bytes is None (the emergency planner asks for any size:
    when the full state does not fit a notice, a larger delta may).
    """
    flat = flatten(state)
    total = sum(nbytes(v) for v in flat.values()) or 1
    changed = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor) or not same_bytes(v, base.get(k))}
    fraction = sum(nbytes(v) for v in changed.values()) / total
    if fraction > max_fraction:
        return None, fraction
    return {DELTA_KEY: {"base": base_uri, "changed": changed, "paths": list(flat)}}, fraction


def delta_bytes(delta: dict) -> int:
    """Tensor bytes a delta carries (what its save writes, give or take the bookkeeping)."""
    return sum(nbytes(v) for v in delta[DELTA_KEY]["changed"].values())


def is_delta(state: Any) -> bool:
    return isinstance(state, dict) and DELTA_KEY in state


def apply_delta(base_state: Any, delta: dict) -> Any:
    """The full state: the base with the delta's changed leaves put in place."""
    spec = delta[DELTA_KEY]
    for key in spec["paths"]:
        if key not in spec["changed"]:
            continue
        node, path = base_state, json.loads(key)
        for part in path[:-1]:
            node = node[part] if not isinstance(node, dict) or part in node else node.setdefault(part, {})
        node[path[-1]] = spec["changed"][key]
    return base_state
