"""A ``--model path.py:NAME`` workload for tests/test_train_parallel.py: the demo GPT sharded with
``fully_shard`` over a one-process gloo group under a ``MixedPrecisionPolicy`` (bf16 parameters,
fp32 reduce), blocks then the root as ``memfit train --parallel fsdp2`` wraps them. One process
running the same policy: the reference the 2-rank run's losses are compared with."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from memfit.models.registry import load_workload

SPEC = os.environ.get("MEMFIT_TEST_SPEC", "demo?n_layer=4&n_embd=63&n_head=3&dropout=0")


def demo_bf16():
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    wl = load_workload(SPEC, seq_len=32, dtype=torch.float32, seed=0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in wl.model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(wl.model, mp_policy=mp)
    return wl.model, wl.make_batch, wl.loss_fn
