"""Fine-tune a tiny GPT-2 with the Hugging Face Trainer: a plain Trainer script plus orbit's callback.

    python train.py --output_dir out --steps 100 --save_steps 20 [--resume_from out/checkpoint-40]

Runs as it is outside orbit. The lines orbit adds are marked `# orbit`; the template
(templates/hf-tiny-gpt2.yaml) fills --output_dir, --resume_from and --save_steps.
Deterministic on CPU: a resumed run ends with the weights of an uninterrupted one
(docs/bring-your-own-hf.md says what that takes).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built from a config

import torch  # noqa: E402
from tinygpt import build_model, corpus_text, splits  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from orbit_dagster.integrations.hf import OrbitCallback  # noqa: E402  # orbit


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume_from", default="", help="a checkpoint-<step> directory; empty: start fresh")  # orbit
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save_steps", type=int, default=20)
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)  # a fixed thread count: the reduction order, hence the bits, depend on it
    tok, train_set, eval_set = splits(corpus_text())
    model = build_model(len(tok.vocab), args.seed)
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, save_strategy="steps", save_steps=args.save_steps,
        logging_steps=args.logging_steps, learning_rate=args.lr, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, warmup_steps=max(1, args.steps // 10), weight_decay=0.01,
        seed=args.seed, data_seed=args.seed, full_determinism=True, dataloader_num_workers=0,
        use_cpu=True, report_to="none", disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=train_set, eval_dataset=eval_set,
                      callbacks=[OrbitCallback()])  # orbit
    trainer.train(resume_from_checkpoint=args.resume_from or None)  # orbit: resume where the last run stopped


if __name__ == "__main__":
    main()
