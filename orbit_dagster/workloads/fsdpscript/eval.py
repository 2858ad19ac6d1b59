"""Evaluate a sharded checkpoint of train.py in one process (however many ranks wrote it: DCP
reshards on load); prints one JSON line of metrics."""
import argparse
import json

import torch
import torch.distributed.checkpoint as dcp
from train import batch, build, state_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    model, opt = build(args.seed, 0.0, sharded=False)
    state = state_of(model, opt, 0)
    state.pop("optimizer")  # the weights only
    dcp.load(state, checkpoint_id=args.checkpoint)
    model.load_state_dict(state["model"])
    losses = []
    with torch.no_grad():
        for i in range(8):  # steps far beyond training's: data it never saw
            x, y = batch(args.seed, 10_000_000 + i, 256, 0, 1)
            losses.append(torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).item())
    print(json.dumps({"eval/loss": sum(losses) / len(losses)}))


if __name__ == "__main__":
    main()
