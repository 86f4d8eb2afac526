"""One rank of tests/test_integration_lightning.py's 2-process check (``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 tests/integration_lightning_worker.py OUT_DIR [BUDGET_BYTES]``
with ``OUT_DIR/fit.pt`` holding the plan, micro-batch and per-process accumulation steps, or with a
budget: ``memfit.integrations.lightning.fit`` then runs here, in a process group started before the
Trainer (rank 0 plans one DDP rank), and rank 0's peak over a second epoch, plus DDP's buckets, is
written too. Lightning's DDP
strategy runs on each rank every other sample (a DistributedSampler without shuffling), so a window of ``k``
micro-batches per rank covers the same samples as one process's window of ``2 k``. Rank 0 writes the
trained weights to ``OUT_DIR/weights.pt`` and facts to ``OUT_DIR/rank0.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning_modules import LitLM
from test_integration_lightning import GLOBAL_BATCH, dataset, make_batch, make_model
from tiny_models import token_count, token_loss

from memfit import apply_plan
from memfit.capture.tracker import MemoryTracker
from memfit.integrations.lightning import ExactAccumulation
from memfit.integrations.lightning import fit as fit_lightning
from memfit.plan.types import Plan


class _SecondEpochPeak(L.Callback):
    """The live-tensor peak of the second epoch: DDP rebuilds its buckets at the second iteration
    (new tensors, which a tracker running then would count on top of the buckets added after)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            self.tracker = MemoryTracker(device="cpu").track(pl_module, trainer.optimizers[0])
            self.tracker.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self.tracker.__exit__(None, None, None)
        # DDP's buckets come from its C++ reducer, outside the tracker (read before Lightning unwraps)
        sizes = trainer.strategy.model._get_ddp_logging_data()["bucket_sizes"]
        self.buckets_bytes = sum(map(int, sizes.split(", ")))


def main(out: Path, budget_bytes: int | None) -> None:
    torch.set_num_threads(1)
    model = make_model()
    facts = {}
    if budget_bytes is None:
        saved = torch.load(out / "fit.pt")
        apply_plan(model, Plan.from_dict(saved["plan"]))
        micro_batch, k = saved["micro_batch"], saved["k"]
    else:  # fitted here, in the process group Lightning then uses: rank 0 plans one DDP rank
        dist.init_process_group("gloo")
        fit = fit_lightning(
            model, budget_bytes, global_batch=GLOBAL_BATCH // 2, make_batch=make_batch, loss_fn=token_loss,
            count_fn=token_count, optimizer="sgd",
        )  # fmt: skip
        micro_batch, k = fit.micro_batch, fit.accumulation_steps
        facts.update(micro_batch=micro_batch, predicted_peak_bytes=fit.predicted_peak_bytes)
    module = LitLM(model)
    # Every other sample, in order (Lightning's own DistributedSampler would shuffle them).
    sampler = torch.utils.data.DistributedSampler(
        dataset(), num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False
    )
    loader = torch.utils.data.DataLoader(dataset(), batch_size=micro_batch, sampler=sampler)
    peak = _SecondEpochPeak()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1 if budget_bytes is None else 2,
        accumulate_grad_batches=k, precision="64-true", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
        callbacks=[ExactAccumulation(count_fn=token_count), *([peak] if budget_bytes is not None else [])],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    if trainer.global_rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out / "weights.pt")
        facts.update(world_size=trainer.world_size, global_step=trainer.global_step)
        if budget_bytes is not None:
            buckets = peak.buckets_bytes
            facts.update(rank_peak_bytes=peak.tracker.peak_bytes + buckets, buckets_bytes=buckets)
        (out / "rank0.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
