"""Evaluate one Lightning checkpoint on a held-out set; prints one line {"eval/loss": ...}.

It needs torch only (not Lightning, whose import costs seconds per evaluated checkpoint).
The checkpoint is loaded with `torch.load(weights_only=True)`: a Lightning checkpoint of this
module holds tensors and plain data only (state_dict, optimizer state, loop counters, the
loader's position, hyper-parameters as a dict), so nothing in it is unpickled as code.
"""
from __future__ import annotations

import argparse
import json

import torch
from tiny_net import build_net, make_data

from orbit_dagster.integrations.env import eval_checkpoint

HELDOUT_SEED = 999  # a set no training run draws from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default=None, help="a step-N.ckpt (default: ORBIT_EVAL_CHECKPOINT)")
    args = parser.parse_args()
    path = args.checkpoint or eval_checkpoint()
    if not path:
        parser.error("--checkpoint is required (or ORBIT_EVAL_CHECKPOINT): the path of a step-N.ckpt to evaluate")
    torch.set_num_threads(1)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = build_net(int(ckpt.get("hyper_parameters", {}).get("hidden", 64)))
    # the LightningModule holds the network as `net`; no Lightning import needed to evaluate
    model.load_state_dict({k.removeprefix("net."): v for k, v in ckpt["state_dict"].items()})
    model.eval()
    x, y = make_data(1024, seed=HELDOUT_SEED)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    print(json.dumps({"eval/loss": loss, "eval/step": float(ckpt["global_step"])}), flush=True)


if __name__ == "__main__":
    main()
