"""Evaluate a checkpoint of train.py on held-out batches; prints one JSON line of metrics."""
import argparse
import json

import torch
from train import batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model.load_state_dict(state["model"])
    losses = []
    with torch.no_grad():
        for i in range(8):  # steps far beyond training's: data it never saw
            x, y = batch(args.seed, 10_000_000 + i, 256, 0, 1)
            losses.append(torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).item())
    print(json.dumps({"eval/loss": sum(losses) / len(losses)}))


if __name__ == "__main__":
    main()
