"""A LightningModule with memfit: a plan fitted to a budget, and exact accumulation as a callback.

``python examples/lightning_module.py`` (CPU, a few seconds). Needs ``pip install memfit[lightning]``.

The memfit lines: ``memfit_lightning.fit(...)`` where the model is built (plans, weights left as
they were, applies the plan; gives the micro-batch and the accumulation steps for the budget), and
``memfit_lightning.ExactAccumulation(count_fn=...)`` in the Trainer's callbacks. Everything else is
plain Lightning with automatic optimisation: ``training_step`` returns its micro-batch's token mean,
``accumulate_grad_batches`` forms the windows, and ``global_step``, the scheduler, logging and
checkpoints behave as without memfit, while every step's gradient is the big batch's (token mean
over the whole window, the short last window of the epoch too).
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from memfit.integrations import lightning as memfit_lightning

VOCAB, SEQ_LEN, D_MODEL, N_LAYER = 64, 64, 32, 4
EPOCHS = 4
GLOBAL_BATCH, SAMPLES, BUDGET = 8, 36, "1.2MiB"  # 36 samples: a short last window of 4
MIN_MICRO_BATCH = 4  # micro-batches of at least 4 samples: at 1.2 MiB that takes recomputing blocks


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, VOCAB)``; blocks in an ``nn.ModuleList``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL) for _ in range(N_LAYER))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1, device=ids.device)[None, :, None]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    """Counting sequences (start and stride random) of random lengths in [8, SEQ_LEN], right-padded."""
    lengths = torch.randint(8, SEQ_LEN + 1, (n,))
    mask = torch.arange(SEQ_LEN)[None, :] < lengths[:, None]
    start, stride = torch.randint(1, VOCAB, (n, 1)), torch.randint(1, 4, (n, 1))
    ids = ((start + stride * torch.arange(SEQ_LEN)) % (VOCAB - 1) + 1).masked_fill(~mask, 0)
    return {"ids": ids, "labels": ids.masked_fill(~mask, -100)}


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of valid (shifted) labels."""
    logits = model(batch["ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    s = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return s, (labels != -100).sum()


def without_checkpointing(fit) -> str:
    """The peak of a step with every block kept, as the fit measured it (its profile nearest the chosen
    micro-batch; on other processes than the main one, which measured, nothing)."""
    if not fit.profiles:
        return "-"
    kept = fit.profiles[min(fit.profiles, key=lambda b: abs(b - fit.micro_batch))]
    return f"{kept.peak_bytes / 2**20:.2f} MiB (micro-batch {kept.batch_size})"


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


class LitLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()
        fit = memfit_lightning.fit(
            self.model, BUDGET, global_batch=GLOBAL_BATCH, make_batch=make_batch, loss_fn=loss_fn,
            count_fn=count_tokens, min_micro_batch=MIN_MICRO_BATCH,
        )  # fmt: skip
        self.micro_batch, self.accumulation_steps = fit.micro_batch, fit.accumulation_steps
        recomputed = len({*fit.plan.recomputed, *(i for s in fit.plan.segments for i in range(s.start, s.stop))})
        kept = without_checkpointing(fit)
        print(
            f"memfit: micro-batch {fit.micro_batch} x {fit.accumulation_steps} (Lightning's window: "
            f"{fit.micro_batch * fit.accumulation_steps} samples), {recomputed} of {len(fit.plan.blocks)} blocks recomputed, "
            f"peak {fit.measured_peak_bytes / 2**20:.2f} MiB with the plan, {kept} "
            f"without checkpointing (budget {BUDGET})"
        )

    def training_step(self, batch, batch_idx):
        s, c = loss_fn(self.model, batch)
        loss = s / c  # this micro-batch's token mean, as usual; memfit rescales it exactly
        self.log("loss", loss, prog_bar=True, batch_size=batch["ids"].shape[0])
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=EPOCHS * -(-SAMPLES // GLOBAL_BATCH))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # shapes this small: one thread is as fast, and a busy machine does not stall it
    module = LitLM()
    data = make_batch(SAMPLES)
    samples = [{k: v[i] for k, v in data.items()} for i in range(SAMPLES)]
    # Lightning's window is accumulate_grad_batches loader batches of micro_batch samples.
    loader = torch.utils.data.DataLoader(samples, batch_size=module.micro_batch, shuffle=True)
    exact = memfit_lightning.ExactAccumulation(count_fn=count_tokens)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, accumulate_grad_batches=module.accumulation_steps,
        gradient_clip_val=1.0, callbacks=[exact], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, loader)
    print(
        f"global_step {trainer.global_step}, loss {float(trainer.callback_metrics['loss']):.3f} nats/token, "
        f"last window {int(exact.last_count)} tokens"
    )


if __name__ == "__main__":
    main()
