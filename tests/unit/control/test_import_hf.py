"""The pieces of control/import_hf.py that read untrusted Hugging Face files: the safetensors
parser (checked against the safetensors library itself) and the log_history reader."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from orbit_dagster.control.import_hf import log_history_points, safetensors_tensors
from orbit_dagster.core.errors import OrbitError

D = Path("checkpoint-3")
TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
           "i": torch.tensor([[7]], dtype=torch.int64), "mask": torch.tensor([True, False]),
           "empty": torch.zeros(0, 5, dtype=torch.float16), "scalar": torch.tensor(3.25, dtype=torch.float64)}


def test_the_safetensors_parser_reads_what_the_safetensors_library_writes():
    got = safetensors_tensors(save(TENSORS, metadata={"format": "pt"}), "model.safetensors", D)
    assert set(got) == set(TENSORS)
    for k, t in TENSORS.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


@pytest.mark.parametrize("spoil, words", [
    (lambda b: b[:-3], "is truncated"),
    (lambda b: b[:5], "less than its 8-byte header length"),
    (lambda b: b + b"xx", "2 bytes after its last tensor"),
    (lambda b: (10 ** 9).to_bytes(8, "little") + b[8:], "header claims 1000000000 bytes"),
    (lambda b: b[:8] + b"[" + b[9:], "header is not JSON"),
])
def test_a_spoilt_safetensors_file_is_refused_naming_the_file(spoil, words):
    with pytest.raises(OrbitError) as err:
        safetensors_tensors(spoil(save(TENSORS)), "checkpoint-3/model.safetensors", D)
    assert words in str(err.value) and "checkpoint-3/model.safetensors" in str(err.value)


def test_log_history_of_a_later_trainer_state_wins_and_names_follow_the_callback():
    early = {"log_history": [{"loss": 2.0, "step": 1}, {"eval_loss": 3.0, "step": 1}]}
    late = {"log_history": [{"loss": 1.5, "step": 1, "epoch": 0.1}, {"loss": 1.0, "step": 2, "note": "x"}]}
    points = log_history_points([(Path("checkpoint-1"), early), (Path("checkpoint-2"), late)])
    assert points == {(1, "train/loss"): 1.5, (1, "eval/loss"): 3.0, (1, "train/epoch"): 0.1, (2, "train/loss"): 1.0}


@pytest.mark.parametrize("state", [{"log_history": {"step": 1}}, {"log_history": [{"loss": 1.0}]},
                                   {"log_history": [{"loss": 1.0, "step": "7"}]}, {"log_history": ["x"]}])
def test_a_malformed_log_history_is_refused(state):
    with pytest.raises(OrbitError) as err:
        log_history_points([(Path("checkpoint-1"), state)])
    assert "checkpoint-1/trainer_state.json" in str(err.value)
