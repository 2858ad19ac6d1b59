"""`orbit import-run` of a Hugging Face Trainer output directory (control/importer.py calls it).

A Hugging Face checkpoint is a directory `checkpoint-<step>/` (any `...-<step>` name) holding
the weights, `model.safetensors` (or shards named by `model.safetensors.index.json`) or
`pytorch_model.bin`, and `trainer_state.json`. Every file of it is imported (optimizer,
scheduler and RNG state too, so it can be resumed from); only the weights are read as tensors:
safetensors parsed here (its header checked against the file's length), a `.bin` loaded with
`weights_only=True`; nothing else of the directory is unpickled (`training_args.bin` stays
bytes). Its step is the name's, and must be `global_step` of its trainer_state.json; the
`log_history` of the trainer states become the run's metrics, at their steps, named as the
HF callback names them (integrations/env.py).
"""
from __future__ import annotations

import io
import json
import math
import pickle
import warnings
from pathlib import Path

from ..core.errors import OrbitError
from ..integrations.env import hf_metric_values
from ..storage.base import StoreError, check_rel

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN)
MAX_TRAINER_STATE_BYTES = 64 << 20  # log_history grows with the run: 64 MiB is some 400k log records
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on its JSON header
MAX_FILES = 10_000
FIX_CORRUPT = "re-export the checkpoint from the run (Trainer.save_model / the run's checkpoint-<step>); a corrupt one is never imported"


def _dtypes() -> dict:
    import torch  # lazy: 1.5 s or more; only an import of an HF run reaches here

    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
             "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
    return {k: getattr(torch, v) for k, v in names.items() if hasattr(torch, v)}


def is_hf_checkpoint(d: Path) -> bool:
    return any((d / name).is_file() or (d / name).is_symlink() for name in (*WEIGHT_FILES, TRAINER_STATE))


def _refuse(message: str, d: Path, fix: str = FIX_CORRUPT, value: object = None) -> OrbitError:
    return OrbitError(message, field=d.name, value=value, fix=fix)


def safetensors_tensors(blob: bytes, where: str, d: Path) -> dict:
    """The tensors of one safetensors file; a truncated or malformed one is an OrbitError."""
    import torch  # lazy: 1.5 s or more; only an import of an HF run reaches here

    if len(blob) < 8:
        raise _refuse(f"{where} is truncated: {len(blob)} bytes, less than its 8-byte header length", d)
    n = int.from_bytes(blob[:8], "little")
    if n > min(len(blob) - 8, MAX_HEADER_BYTES):
        raise _refuse(f"{where} is truncated or not safetensors: its header claims {n} bytes, the file holds "
                      f"{len(blob) - 8} after the length", d)
    try:
        header = json.loads(blob[8:8 + n])
    except (ValueError, RecursionError) as exc:
        raise _refuse(f"{where}: its header is not JSON ({' '.join(str(exc).split())[:120]})", d) from None
    if not isinstance(header, dict):
        raise _refuse(f"{where}: its header is not a JSON object", d)
    data, dtypes, out, end = len(blob) - 8 - n, _dtypes(), {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        info = info if isinstance(info, dict) else {}
        dtype, shape, offsets = dtypes.get(info.get("dtype")), info.get("shape"), info.get("data_offsets")
        if (dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)):
            raise _refuse(f"{where}: tensor {name[:80]!r} has no known dtype, shape and data_offsets", d)
        begin, stop = offsets
        if stop > data:
            raise _refuse(f"{where} is truncated: tensor {name[:80]!r} ends at byte {stop} of the data, the file "
                          f"holds {data}", d)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= stop or stop - begin != size:
            raise _refuse(f"{where}: tensor {name[:80]!r} spans bytes {begin}..{stop}, its shape needs {size}", d)
        chunk = bytearray(blob[8 + n + begin:8 + n + stop])  # a copy: aligned and writable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(chunk, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(shape)
        end = max(end, stop)
    if end != data:
        raise _refuse(f"{where}: {data - end} bytes after its last tensor (a torn or appended file)", d)
    return out


def _torch_bin(blob: bytes, where: str, d: Path) -> dict:
    import torch  # lazy: 1.5 s or more; only an import of an HF run reaches here

    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)  # data, never code
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError, KeyError, IndexError,
            RecursionError, OverflowError) as exc:
        raise _refuse(f"{where} is not a weights-only torch state dict ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", d) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise _refuse(f"{where} is not a state dict of names to tensors", d)
    return state


def _json_of(blob: bytes, where: str, d: Path):
    try:
        return json.loads(blob.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _refuse(f"{where} is not JSON: {' '.join(str(exc).split())[:160]}", d) from None


def _names(d: Path, root: Path) -> list[str]:
    """Every file of the checkpoint directory, relative to it; a link or odd name is refused."""
    names = []
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if p.is_symlink() or not p.resolve().is_relative_to(root):
            raise _refuse(f"{d.name}/{rel} is a link; imported files must be regular files inside DIR", d,
                          fix="copy the files instead of linking them", value=str(p))
        if p.is_dir():
            continue
        if not p.is_file():
            raise _refuse(f"{d.name}/{rel} is not a regular file", d, fix="remove it from the checkpoint directory")
        try:
            check_rel(rel, d.name)
        except StoreError as exc:
            raise _refuse(str(exc).split("; fix: ")[0], d, fix="rename the file", value=rel) from None
        names.append(rel)
        if len(names) > MAX_FILES:
            raise _refuse(f"checkpoint {d.name} holds more than {MAX_FILES} files", d, fix="import the checkpoint alone")
    return names


def hf_files(d: Path, root: Path, step: int, cap: int, read) -> tuple[dict[str, bytes], dict, dict]:
    """(files, weights state dict, trainer state) of one HF checkpoint directory, every name,
    size and byte checked; `read(path, cap)` is the importer's bounded reader."""
    names = _names(d, root)
    total = sum((d / rel).stat().st_size for rel in names)
    if total > cap:
        raise _refuse(f"checkpoint {d.name} holds {total} bytes, more than the {cap} this machine can check "
                      "(a quarter of its memory)", d, fix="import it on a machine with more memory")
    if TRAINER_STATE not in names:
        raise _refuse(f"checkpoint {d.name} has no {TRAINER_STATE}", d,
                      fix="import the Trainer's checkpoint-<step> directories as saved (they hold trainer_state.json)")
    if (d / TRAINER_STATE).stat().st_size > MAX_TRAINER_STATE_BYTES:
        raise _refuse(f"{d.name}/{TRAINER_STATE} is larger than {MAX_TRAINER_STATE_BYTES >> 20} MiB", d,
                      fix="log less often (logging_steps), or drop log_history from the file")
    files = {rel: read(d / rel, cap) for rel in names}
    state = _json_of(files[TRAINER_STATE], f"{d.name}/{TRAINER_STATE}", d)
    if not isinstance(state, dict):
        raise _refuse(f"{d.name}/{TRAINER_STATE} is not a JSON object", d)
    global_step = state.get("global_step")
    if type(global_step) is not int or global_step != step:
        raise _refuse(f"checkpoint {d.name} is named for step {step} but its {TRAINER_STATE} says global_step "
                      f"{global_step!r}", d, value=global_step,
                      fix="import the directories as the Trainer named them (checkpoint-<global_step>)")
    return files, _weights(files, d), state


def _weights(files: dict[str, bytes], d: Path) -> dict:
    if SAFETENSORS in files:
        return safetensors_tensors(files[SAFETENSORS], f"{d.name}/{SAFETENSORS}", d)
    if SAFETENSORS_INDEX in files:
        index = _json_of(files[SAFETENSORS_INDEX], f"{d.name}/{SAFETENSORS_INDEX}", d)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise _refuse(f"{d.name}/{SAFETENSORS_INDEX} has no weight_map of tensor names to files", d)
        out = {}
        for shard in sorted(set(weight_map.values())):
            try:
                check_rel(shard, d.name)
            except StoreError as exc:
                raise _refuse(str(exc).split("; fix: ")[0] + f" (in {SAFETENSORS_INDEX})", d, value=shard,
                              fix="name each shard by its file name inside the checkpoint directory: no '..', "
                                  "no absolute path") from None
            if shard not in files:
                raise _refuse(f"{d.name}/{SAFETENSORS_INDEX} names shard {shard}, which is not in the directory", d,
                              value=shard)
            out.update(safetensors_tensors(files[shard], f"{d.name}/{shard}", d))
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise _refuse(f"{d.name}: tensor {missing[0][:80]!r} of {SAFETENSORS_INDEX} is in none of its shards", d)
        return out
    if TORCH_BIN in files:
        return _torch_bin(files[TORCH_BIN], f"{d.name}/{TORCH_BIN}", d)
    raise _refuse(f"checkpoint {d.name} has no weights ({SAFETENSORS} or {TORCH_BIN})", d,
                  fix="import the Trainer's checkpoint-<step> directories as saved (save_only_model or not, they hold "
                      "the weights)")


def log_history_points(states: list[tuple[Path, dict]]) -> dict[tuple[int, str], float]:
    """{(step, metric): value} of the trainer states' log_history, a later checkpoint's record
    winning (a resumed run's later states repeat the earlier records)."""
    points: dict[tuple[int, str], float] = {}
    for d, state in states:
        history = state.get("log_history", [])
        if not isinstance(history, list):
            raise _refuse(f"{d.name}/{TRAINER_STATE}: log_history is not a list", d)
        for n, record in enumerate(history):
            step = record.get("step") if isinstance(record, dict) else None
            if type(step) is not int or step < 0:
                raise _refuse(f"{d.name}/{TRAINER_STATE}: log_history[{n}] has no integer step", d, value=n)
            for name, value in hf_metric_values({k: v for k, v in record.items() if k != "step"}).items():
                points[(step, name)] = value
    return points
