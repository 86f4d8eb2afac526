"""HF Trainer with memfit: micro-batch, accumulation and checkpoint plan for a memory budget.

Runs on CPU in seconds (a tiny GPT-2 built from its config, random variable-length token rows):

    PYTHONPATH=src python examples/hf_trainer.py

The memfit part is the one ``fit`` call before ``trainer.train()``; everything else is a plain
Trainer script.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import memfit.integrations.transformers as memfit_hf


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded token batch; labels -100 on padding."""
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # shapes this small: one thread is as fast, and a busy machine does not stall it
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=1, eos_token_id=2)
    )
    rows = [{"input_ids": torch.randint(3, 256, (int(n),)).tolist()} for n in torch.randint(8, 65, (64,))]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=4,
            learning_rate=1e-3, logging_steps=2, save_strategy="no", report_to=[], use_cpu=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)

        # 1.6 MiB is below a step of one sample with every block kept: the plan recomputes blocks.
        fitted = memfit_hf.fit(trainer, budget="1.6MiB")  # plans (weights left as they were); sets batch x accumulation
        fit = fitted.fit
        recomputed = len({*fit.plan.recomputed, *(i for s in fit.plan.segments for i in range(s.start, s.stop))})
        kept = fit.profiles[min(fit.profiles, key=lambda b: abs(b - fit.micro_batch))]  # every block kept, measured
        print(
            f"memfit: {fitted.micro_batch} x {fitted.accumulation_steps} per step, "
            f"{recomputed} of {len(fitted.plan.blocks)} blocks recomputed, "
            f"peak {fit.measured_peak_bytes / 2**20:.2f} MiB with the plan (predicted {fit.predicted_peak_bytes / 2**20:.2f}), "
            f"{kept.peak_bytes / 2**20:.2f} MiB (micro-batch {kept.batch_size}) without checkpointing"
        )
        trainer.train()
        fitted.remove()  # plain forwards and use_cache again (e.g. before generate)


if __name__ == "__main__":
    main()
