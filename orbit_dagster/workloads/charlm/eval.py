"""Evaluate one checkpoint on the held-out split; prints {"metrics": {...}}."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from charlm_model import Corpus, build_model


def main(ctx) -> dict:
    cfg = ctx.config
    ctx.deterministic()
    dev = ctx.device
    corpus = Corpus(ctx.inputs / cfg.get("corpus", "corpus.txt"))
    state = ctx.load_eval_checkpoint()
    model = build_model(cfg, len(corpus.vocab)).to(dev)
    model.load_state_dict(state["model"])
    model.eval()
    gen = torch.Generator().manual_seed(int(cfg.get("eval_seed", 12345)))  # same windows for every checkpoint
    batches, seq_len = int(cfg.get("eval_batches", 8)), int(cfg.get("seq_len", 64))
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for _ in range(batches):
            x, y = (t.to(dev) for t in corpus.batch(corpus.heldout, 32, seq_len, gen))
            with ctx.autocast():
                logits = model(x)
            logits = logits.float()
            loss_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
    metrics = {"eval/loss": loss_sum / count, "eval/accuracy": correct / count, "eval/step": float(state["step"])}
    ctx.report_eval(metrics)
    print(json.dumps({"metrics": metrics}), flush=True)
    return {"metrics": metrics}
