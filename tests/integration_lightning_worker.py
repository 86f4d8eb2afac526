"""One rank of tests/test_integration_lightning.py's 2-process check (``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 tests/integration_lightning_worker.py OUT_DIR`` with
``OUT_DIR/fit.pt`` holding the plan, micro-batch and per-process accumulation steps. Lightning's DDP
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
from lightning_modules import LitLM
from test_integration_lightning import dataset, make_model
from tiny_models import token_count

from memfit import apply_plan
from memfit.integrations.lightning import ExactAccumulation
from memfit.plan.types import Plan


def main(out: Path) -> None:
    torch.set_num_threads(1)
    saved = torch.load(out / "fit.pt")
    model = make_model()
    apply_plan(model, Plan.from_dict(saved["plan"]))
    module = LitLM(model)
    # Every other sample, in order (Lightning's own DistributedSampler would shuffle them).
    sampler = torch.utils.data.DistributedSampler(
        dataset(), num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False
    )
    loader = torch.utils.data.DataLoader(dataset(), batch_size=saved["micro_batch"], sampler=sampler)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, accumulate_grad_batches=saved["k"],
        precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[ExactAccumulation(count_fn=token_count)], use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    if trainer.global_rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out / "weights.pt")
        facts = {"world_size": trainer.world_size, "global_step": trainer.global_step}
        (out / "rank0.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
