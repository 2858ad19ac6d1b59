"""Evaluate one checkpoint-<step> directory on the held-out tenth of the corpus.

    python eval.py --checkpoint out/checkpoint-100      # prints {"eval/loss": ...} as one JSON line

Every line but the last is ordinary log output; the last is the evaluation's result.
"""
from __future__ import annotations

import argparse
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is a local directory; nothing is downloaded

import torch  # noqa: E402
from tinygpt import corpus_text, splits  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint-<step> directory written by train.py")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, _, heldout = splits(corpus_text())
    model = GPT2LMHeadModel.from_pretrained(args.checkpoint, local_files_only=True)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(heldout), args.batch_size):
            batch = heldout.data[start:start + args.batch_size]
            n = batch.numel() - batch.shape[0]  # predicted positions: GPT-2 shifts the labels by one
            total += model(input_ids=batch, labels=batch).loss.item() * n
            count += n
    loss = total / count
    metrics = {"eval/loss": loss, "eval/perplexity": math.exp(loss)}
    print(json.dumps(metrics), flush=True)
    return metrics


if __name__ == "__main__":
    main()
