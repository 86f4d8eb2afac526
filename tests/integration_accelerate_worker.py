"""One rank of tests/test_integration_accelerate.py's 2-process check (``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 tests/integration_accelerate_worker.py OUT_DIR [BUDGET_BYTES]``
with ``OUT_DIR/fit.pt`` holding the plan and micro-batch the test fitted, or with a budget: then
``memfit.integrations.accelerate.fit`` runs here, under torchrun (rank 0 plans one DDP rank). Every rank builds the same model
and loader; accelerate (``split_batches=True``) gives each rank half of every global batch, wraps
the model in DDP and ExactAccumulation normalises by the token count of both ranks. Rank 0 writes
the trained weights to ``OUT_DIR/weights.pt`` and facts to ``OUT_DIR/rank0.json`` (its peak: the
tracker's over the loop plus DDP's buckets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from test_integration_accelerate import GLOBAL_BATCH, LR, loader, make_batch, make_model
from tiny_models import token_count, token_loss

from memfit import apply_plan
from memfit.capture.tracker import MemoryTracker
from memfit.integrations.accelerate import ExactAccumulation
from memfit.integrations.accelerate import fit as fit_accelerate
from memfit.plan.types import Plan


def main(out: Path, budget_bytes: int | None) -> None:
    torch.set_num_threads(1)
    model = make_model()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False)
    )
    facts = {}
    if budget_bytes is None:
        saved = torch.load(out / "fit.pt")
        apply_plan(model, Plan.from_dict(saved["plan"]))
        micro_batch = saved["micro_batch"]
    else:  # fitted here: rank 0 plans one DDP rank of this job (its share of each global batch)
        fit = fit_accelerate(
            accelerator, model, budget_bytes, global_batch=GLOBAL_BATCH // accelerator.num_processes,
            make_batch=make_batch, loss_fn=token_loss, count_fn=token_count, optimizer="sgd",
        )  # fmt: skip
        micro_batch = fit.micro_batch
        facts.update(micro_batch=micro_batch, predicted_peak_bytes=fit.predicted_peak_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    prepared, opt, dl = accelerator.prepare(model, opt, loader(GLOBAL_BATCH))
    acc = ExactAccumulation(accelerator, prepared, micro_batch=micro_batch)

    def epoch() -> None:
        for batch in dl:
            for micro in acc.window(batch, count_fn=token_count):
                micro.backward(token_loss(prepared, micro.batch))
            opt.step()
            opt.zero_grad()

    if budget_bytes is not None:
        # DDP rebuilds its buckets at the second iteration (new tensors, which a tracker running then
        # would count on top of the buckets added below): measure a second epoch.
        epoch()
    tracker = MemoryTracker(device="cpu").track(prepared, opt)  # after the warm-up: its optimizer state too
    with tracker:
        epoch()
    if accelerator.process_index == 0:
        from torch.nn.parallel import DistributedDataParallel

        torch.save([p.detach().clone() for p in model.parameters()], out / "weights.pt")
        # DDP's gradient buckets are allocated by its C++ reducer, which the tracker does not see
        buckets = sum(map(int, prepared._get_ddp_logging_data()["bucket_sizes"].split(", ")))
        facts.update(
            world_size=accelerator.num_processes,
            ddp=isinstance(prepared, DistributedDataParallel),
            rank_peak_bytes=tracker.peak_bytes + buckets,
            buckets_bytes=buckets,
        )
        (out / "rank0.json").write_text(json.dumps(facts))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
