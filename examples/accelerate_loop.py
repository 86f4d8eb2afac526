"""An accelerate training loop with memfit: a plan fitted to a budget, and exact accumulation.

``python examples/accelerate_loop.py`` (CPU, a few seconds; also ``accelerate launch`` /
``torchrun --nproc_per_node=2`` on gloo). Needs ``pip install memfit[accelerate]``.

The memfit lines: ``memfit_accelerate.fit(...)`` before ``accelerator.prepare`` (plans, leaving the
weights as they were, and applies the plan), and ``acc.window(batch)`` / ``micro.backward(...)`` instead of
``with accelerator.accumulate(model):`` / ``accelerator.backward(loss)``. The loader yields the
global batch; memfit splits it into micro-batches that fit the budget and normalises by the
window's valid tokens over all processes, so every step is the big batch's.

``split_batches=True`` makes the loader's batch the global batch (split over processes);
``even_batches=False`` keeps accelerate from filling the last, short batch with samples from the
start of the epoch (those would be trained twice in that step). Every process must get at least one
sample of the last batch (here 6 samples: 4 + 2), or use ``drop_last=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn

from memfit.integrations import accelerate as memfit_accelerate

VOCAB, SEQ_LEN, D_MODEL, N_LAYER = 64, 64, 32, 4
EPOCHS = 4
GLOBAL_BATCH, SAMPLES, BUDGET = 8, 38, "1.2MiB"  # 38 samples: a short last window of 6 (4 + 2 on 2 processes)
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
        x = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]  # causal mix
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


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # shapes this small: one thread is as fast, and a busy machine does not stall it
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False)
    )
    model = TinyLM()
    fit = memfit_accelerate.fit(
        accelerator, model, BUDGET, global_batch=GLOBAL_BATCH // accelerator.num_processes,
        make_batch=make_batch, loss_fn=loss_fn, count_fn=count_tokens, min_micro_batch=MIN_MICRO_BATCH,
    )  # fmt: skip
    recomputed = len({*fit.plan.recomputed, *(i for s in fit.plan.segments for i in range(s.start, s.stop))})
    kept = without_checkpointing(fit)
    accelerator.print(
        f"memfit: micro-batch {fit.micro_batch} x {fit.accumulation_steps}, {recomputed} of {len(fit.plan.blocks)} blocks "
        f"recomputed, peak {fit.measured_peak_bytes / 2**20:.2f} MiB with the plan, {kept} "
        f"without checkpointing (budget {BUDGET})"
    )
    data = make_batch(SAMPLES)
    samples = [{k: v[i] for k, v in data.items()} for i in range(SAMPLES)]
    loader = torch.utils.data.DataLoader(samples, batch_size=GLOBAL_BATCH, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=EPOCHS * len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    acc = memfit_accelerate.ExactAccumulation(accelerator, model, micro_batch=fit.micro_batch)
    for epoch in range(EPOCHS):
        for batch in loader:
            for micro in acc.window(batch, count_fn=count_tokens):
                micro.backward(loss_fn(model, micro.batch))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        r = acc.last_result
        accelerator.print(f"epoch {epoch}: loss {r.loss:.3f} nats/token over {int(r.count)} tokens (last window)")


if __name__ == "__main__":
    main()
