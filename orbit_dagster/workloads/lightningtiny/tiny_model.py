"""A tiny LightningModule: an MLP (tiny_net.py) regressing a fixed smooth function."""
from __future__ import annotations

import lightning as L
import torch
from tiny_net import build_net
from torch import nn


class TinyRegressor(L.LightningModule):
    def __init__(self, lr: float = 3e-3, hidden: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_net(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
