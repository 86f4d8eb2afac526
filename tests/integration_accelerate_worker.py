"""One rank of tests/test_integration_accelerate.py's 2-process check (``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 tests/integration_accelerate_worker.py OUT_DIR`` with
``OUT_DIR/fit.pt`` holding the plan and micro-batch the test fitted. Every rank builds the same model
and loader; accelerate (``split_batches=True``) gives each rank half of every global batch, wraps
the model in DDP and ExactAccumulation normalises by the token count of both ranks. Rank 0 writes
the trained weights to ``OUT_DIR/weights.pt`` and facts to ``OUT_DIR/rank0.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from test_integration_accelerate import GLOBAL_BATCH, LR, loader, make_model
from tiny_models import token_count, token_loss

from memfit import apply_plan
from memfit.integrations.accelerate import ExactAccumulation
from memfit.plan.types import Plan


def main(out: Path) -> None:
    torch.set_num_threads(1)
    saved = torch.load(out / "fit.pt")
    model = make_model()
    apply_plan(model, Plan.from_dict(saved["plan"]))
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False)
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    prepared, opt, dl = accelerator.prepare(model, opt, loader(GLOBAL_BATCH))
    acc = ExactAccumulation(accelerator, prepared, micro_batch=saved["micro_batch"])
    for batch in dl:
        for micro in acc.window(batch, count_fn=token_count):
            micro.backward(token_loss(prepared, micro.batch))
        opt.step()
        opt.zero_grad()
    if accelerator.process_index == 0:
        from torch.nn.parallel import DistributedDataParallel

        torch.save([p.detach().clone() for p in model.parameters()], out / "weights.pt")
        facts = {"world_size": accelerator.num_processes, "ddp": isinstance(prepared, DistributedDataParallel)}
        (out / "rank0.json").write_text(json.dumps(facts))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
