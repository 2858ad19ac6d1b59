"""Evaluate a checkpoint of train.py on a held-out split; prints {"eval/loss": ...}."""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from train import build_model, make_data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--seed", type=int, default=99)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"])
    model.eval()
    x, y = make_data(args.seed, 512)
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y).item()
    print(json.dumps({"eval/loss": loss}), flush=True)


if __name__ == "__main__":
    main()
