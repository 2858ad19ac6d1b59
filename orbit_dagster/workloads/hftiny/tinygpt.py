"""What train.py and eval.py share: the char-level tokenizer, the datasets and the model.

Nothing is downloaded: the tokenizer is the sorted set of the corpus's characters, the model a
GPT-2 built from a config and initialised from a seed.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
BLOCK = 32  # characters per example
HELDOUT = 0.1  # the last tenth of the corpus is held out for eval.py


class CharTokenizer:
    def __init__(self, text: str):
        self.vocab = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text]


def corpus_text(path: Path = CORPUS) -> str:
    return path.read_text(encoding="utf-8")


class Blocks(torch.utils.data.Dataset):
    """Non-overlapping BLOCK-character examples; GPT-2 shifts the labels itself."""

    def __init__(self, ids: list[int], block: int = BLOCK):
        n = len(ids) // block
        self.data = torch.tensor(ids[: n * block], dtype=torch.long).view(n, block)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> dict:
        x = self.data[i]
        return {"input_ids": x, "labels": x}


def splits(text: str) -> tuple[CharTokenizer, Blocks, Blocks]:
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    cut = int(len(ids) * (1 - HELDOUT))
    return tok, Blocks(ids[:cut]), Blocks(ids[cut:])


def build_model(vocab_size: int, seed: int) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=vocab_size, n_positions=BLOCK,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)  # the random initialisation is the seed's
    return GPT2LMHeadModel(config)
