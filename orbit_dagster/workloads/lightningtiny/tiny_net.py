"""The tiny regressor's network and data, torch only (eval.py loads a checkpoint without Lightning).

Everything is generated from fixed seeds, so two runs on one machine with one thread are
bit-identical. `SeededLoader` is resumable mid-epoch: Lightning saves its `state_dict` in
the checkpoint and gives it back before iterating on resume (a plain DataLoader would
restart the epoch from its first batch; Lightning warns about that).
"""
from __future__ import annotations

import math

import torch
from torch import nn

FEATURES = 16


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=gen)
    w = torch.linspace(-1.0, 1.0, FEATURES)
    y = torch.sin(x @ w).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=gen)
    return x, y


class SeededLoader:
    """Shuffled batches of (x, y); epoch e is shuffled by a generator seeded `seed + e`."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.epoch = -1  # the epoch being iterated
        self.served = 0  # batches of it handed out so far
        self._resume: tuple[int, int] | None = None

    def __len__(self) -> int:  # a known length also stops Lightning pre-fetching a batch
        return math.ceil(len(self.x) / self.batch_size)

    def __iter__(self):
        if self._resume is not None:
            self.epoch, start = self._resume
            self._resume = None
            if start >= len(self):  # saved after an epoch's last batch
                self.epoch, start = self.epoch + 1, 0
        else:
            self.epoch, start = self.epoch + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for i in range(start, len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            self.served = i + 1
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self._resume = (int(state["epoch"]), int(state["served"]))


def build_net(hidden: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1))
