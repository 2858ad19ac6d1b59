"""A small char-level transformer and its data, shared by train.py and eval.py."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class Corpus:
    """Characters of a text file: a vocabulary and a train / held-out split (last 10%)."""

    def __init__(self, path: Path, heldout_frac: float = 0.1):
        text = Path(path).read_text(encoding="utf-8")
        self.vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.vocab)}
        data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        cut = int(len(data) * (1 - heldout_frac))
        self.train, self.heldout = data[:cut], data[cut:]

    def batch(self, split: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
        starts = torch.randint(0, len(split) - seq_len - 1, (batch_size,), generator=generator)
        x = torch.stack([split[s : s + seq_len] for s in starts.tolist()])
        y = torch.stack([split[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        return x, y


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.n_heads, c // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharTransformer(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, seq_len: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(cfg: dict, vocab_size: int) -> CharTransformer:
    return CharTransformer(
        vocab_size,
        int(cfg.get("d_model", 128)),
        int(cfg.get("n_heads", 4)),
        int(cfg.get("n_layers", 2)),
        int(cfg.get("seq_len", 64)),
        float(cfg.get("dropout", 0.1)),
    )


def activation_mb(cfg: dict) -> float:
    """Rough activation memory of one micro-batch (forward + backward), in MB: the CPU
    stand-in for a device memory limit (a CPU has no allocator cap to hit)."""
    mb, t, d, h, n = (int(cfg.get(k, v)) for k, v in (("micro_batch", 16), ("seq_len", 64), ("d_model", 128), ("n_heads", 4), ("n_layers", 2)))
    per_layer = mb * t * d * 4 * 16 + mb * h * t * t * 4 * 3
    return n * per_layer / 2**20


def lr_at(step: int, total: int, base: float, warmup_frac: float) -> float:
    """Warm-up then cosine decay, a function of the step alone (so resume needs no state)."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
