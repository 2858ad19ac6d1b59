"""Fine-tune the char transformer; deterministic and resumable from any checkpoint.

Every step draws its batch from a dedicated generator seeded by (seed, step) and seeds
dropout the same way, and the learning rate is a function of the step: the state to
resume is then only the weights, the optimiser and the step, and a resumed run is
bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from charlm_model import Corpus, activation_mb, build_model, deterministic, lr_at


def main(ctx) -> None:
    cfg = ctx.config
    deterministic(ctx.threads)
    seed = int(cfg.get("seed", 0))
    steps = int(cfg.get("steps", 200))
    micro, accum = int(cfg.get("micro_batch", 16)), int(cfg.get("grad_accum", 2))
    seq_len = int(cfg.get("seq_len", 64))
    budget = float(cfg.get("device_memory_mb", 0) or 0)
    if budget and activation_mb(cfg) > budget:
        # On a GPU this is where CUDA would fail to allocate; the limit makes it reproducible.
        raise torch.OutOfMemoryError(
            f"out of memory: micro_batch={micro} needs ~{activation_mb(cfg):.0f} MB of activations, device has {budget:.0f} MB"
        )

    corpus = Corpus(ctx.inputs / cfg.get("corpus", "corpus.txt"))
    torch.manual_seed(seed)
    model = build_model(cfg, len(corpus.vocab))
    if cfg.get("trainable", "all") == "head":  # fine-tune the output head only; the rest stays frozen
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("head."))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=float(cfg.get("lr", 3e-3)), weight_decay=float(cfg.get("weight_decay", 0.01)))
    start = 0
    state = ctx.resume_state()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])

    def snapshot() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step_count, "vocab": "".join(corpus.vocab)}

    model.train()
    step_count = start
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, float(cfg.get("lr", 3e-3)), float(cfg.get("warmup_frac", 0.1)))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        torch.manual_seed(seed * 7_919 + step)  # dropout masks
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            x, y = corpus.batch(corpus.train, micro, seq_len, gen)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step_count = step + 1
        ctx.step_done(step_count, snapshot, {"train/loss": total}, final=step_count == steps)
