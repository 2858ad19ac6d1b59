"""Fine-tune the char transformer; deterministic and resumable from any checkpoint.

Every step draws its batch from a dedicated generator seeded by (seed, step) and seeds
dropout the same way, and the learning rate is a function of the step: the state to
resume is then only the weights, the optimiser and the step, and a resumed run is
bit-identical to an uninterrupted one (on the same kind of device; see runtime.device).

Runs where the runtime says (`ctx.device`: CUDA when present, else the CPU), in bf16
autocast on GPUs that support it. Batches are drawn on the CPU, so a GPU run sees the
same tokens as a CPU run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from charlm_model import Corpus, activation_mb, build_model, lr_at


def limit_device_memory(ctx, budget_mb: float) -> None:
    """`config.device_memory_mb`: a smaller device, for reproducing an OOM and its retry.

    On a GPU the CUDA caching allocator is capped, so the OOM is CUDA's own; a CPU has no
    allocator cap, so there the activation estimate stands in for it.
    """
    cfg, dev = ctx.config, ctx.device
    if dev.type == "cuda":
        total_mb = torch.cuda.get_device_properties(dev).total_memory / 2**20
        torch.cuda.empty_cache()  # the cap applies to reserved memory; start from none
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_mb / total_mb), dev)
    elif activation_mb(cfg) > budget_mb:
        raise torch.OutOfMemoryError(
            f"out of memory: micro_batch={cfg.get('micro_batch', 16)} needs ~{activation_mb(cfg):.0f} MB of "
            f"activations, device has {budget_mb:.0f} MB")


def main(ctx) -> None:
    cfg = ctx.config
    ctx.deterministic()
    dev = ctx.device
    seed = int(cfg.get("seed", 0))
    steps = int(cfg.get("steps", 200))
    micro, accum = int(cfg.get("micro_batch", 16)), int(cfg.get("grad_accum", 2))
    seq_len = int(cfg.get("seq_len", 64))
    budget = float(cfg.get("device_memory_mb", 0) or 0)
    if budget:
        limit_device_memory(ctx, budget)

    corpus = Corpus(ctx.inputs / cfg.get("corpus", "corpus.txt"))
    torch.manual_seed(seed)
    model = build_model(cfg, len(corpus.vocab)).to(dev)
    if cfg.get("trainable", "all") == "head":  # fine-tune the output head only; the rest stays frozen
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("head."))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=float(cfg.get("lr", 3e-3)), weight_decay=float(cfg.get("weight_decay", 0.01)))
    start = 0
    state = ctx.resume_state()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])  # moves the moments to the parameters' device
        start = int(state["step"])

    def snapshot() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step_count, "vocab": "".join(corpus.vocab)}

    model.train()
    step_count = start
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, float(cfg.get("lr", 3e-3)), float(cfg.get("warmup_frac", 0.1)))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        torch.manual_seed(seed * 7_919 + step)  # dropout masks (every device's generator)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            x, y = (t.to(dev, non_blocking=True) for t in corpus.batch(corpus.train, micro, seq_len, gen))
            with ctx.autocast():
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)) / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step_count = step + 1
        ctx.step_done(step_count, snapshot, {"train/loss": total}, final=step_count == steps)
