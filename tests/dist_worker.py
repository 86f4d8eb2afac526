"""One rank of the 2-process accumulation checks run by tests/test_distributed.py (gloo, CPU).

Usage: ``python tests/dist_worker.py RANK WORLD_SIZE STORE_FILE OUT_DIR``. Writes
``OUT_DIR/rank{RANK}.json`` with communication counts and gradient errors; the test asserts on them.
Every rank builds the same model and the same global batch from the same seed and takes its
share of the batch; the reference is one single-process pass over the whole global batch.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_models import (
    TinyRegressor,
    TinyTokenLM,
    max_rel_err,
    mse_mean,
    regression_batch,
    token_batch,
    token_count,
    token_loss,
)
from torch import nn

from memfit.accumulate import Accumulator
from memfit.workload import split_batch

F64 = torch.float64
GLOBAL_BATCH = 13  # uneven split over ranks (7 + 6) and over micro-batches of 2 (4 and 3 steps)
MICRO_BATCH = 2


def shard(batch, rank: int, world: int):
    sizes = [GLOBAL_BATCH // world + (1 if r < GLOBAL_BATCH % world else 0) for r in range(world)]
    return split_batch(batch, sizes)[rank]


def reference_grads(model: nn.Module, batch) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    s, c = token_loss(ref, batch)
    (s / c).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_ddp(rank: int, world: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = TinyTokenLM(n_layer=3).to(F64)
    batch = token_batch(GLOBAL_BATCH, sort=True)  # sorted: rank 0 gets the short rows
    want = reference_grads(base, batch)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.004)  # ~1000 floats: several buckets
    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, counting_hook)
    mine = shard(batch, rank, world)
    out: dict = {}

    # Warm-up: DDP rebuilds its buckets after the first iteration; then count one synced backward.
    for _ in range(2):
        calls[0] = 0
        model.zero_grad(set_to_none=True)
        s, c = token_loss(model, mine)
        (s / c).backward()
    out["buckets"] = calls[0]

    # Naive loop without no_sync: one all-reduce per bucket per micro-step (2 here).
    calls[0] = 0
    model.zero_grad(set_to_none=True)
    for piece in split_batch(mine, [MICRO_BATCH, len(mine["idx"]) - MICRO_BATCH]):
        token_loss(model, piece)[0].backward()
    out["naive_allreduces"] = calls[0]

    for name, count_fn in (("count_fn", token_count), ("deferred", None)):
        calls[0] = 0
        model.zero_grad(set_to_none=True)
        acc = Accumulator(model, None, micro_batch=MICRO_BATCH, normalize="tokens")
        res = acc.step(mine, token_loss, count_fn=count_fn)
        out[f"allreduces_{name}"] = calls[0]
        out[f"micro_steps_{name}"] = res.micro_steps
        out[f"count_{name}"] = res.count
        out[f"grad_err_{name}"] = max_rel_err([p.grad for p in model.parameters()], want)

    # Optimizer steps: 2 windows, all-reduces per step, parameters equal a single-process run.
    single = copy.deepcopy(base)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.5)
    acc_single = Accumulator(single, opt_single, micro_batch=GLOBAL_BATCH)
    model.module.load_state_dict(base.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = Accumulator(model, opt, micro_batch=MICRO_BATCH)
    calls[0] = 0
    for step in range(2):
        torch.manual_seed(100 + step)
        b = token_batch(GLOBAL_BATCH)
        acc_single.step(b, token_loss, count_fn=token_count)
        acc.step(shard(b, rank, world), token_loss, count_fn=token_count)
    out["allreduces_2_steps"] = calls[0]
    out["param_err_after_2_steps"] = max(
        float((p - q).detach().abs().max()) for p, q in zip(model.module.parameters(), single.parameters(), strict=True)
    )
    out["samples_seen"] = acc.samples_seen

    # A mean-over-samples loss with unequal shares (7 and 6 samples): weights use the global count.
    torch.manual_seed(2)
    reg = TinyRegressor().to(F64)
    xy = tuple(t.to(F64) for t in regression_batch(GLOBAL_BATCH))
    ref = copy.deepcopy(reg)
    mse_mean(ref, xy).backward()
    ddp_reg = DDP(reg)
    Accumulator(ddp_reg, None, micro_batch=MICRO_BATCH, normalize="mean").step(shard(xy, rank, world), mse_mean)
    out["grad_err_mean"] = max_rel_err([p.grad for p in ddp_reg.parameters()], [p.grad for p in ref.parameters()])
    return out


def check_fsdp2(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    base = TinyTokenLM(n_layer=3).to(F64)
    batch = token_batch(GLOBAL_BATCH)
    want = reference_grads(base, batch)
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    groups = len(model.blocks) + 1
    calls = [0]
    originals = {}
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def counted(*a, _fn=fn, **k):
            calls[0] += 1
            return _fn(*a, **k)

        setattr(dist, name, counted)
    mine = shard(batch, rank, world)
    out: dict = {"fsdp_groups": groups}
    try:
        # Naive: every micro-step reduce-scatters.
        model.zero_grad(set_to_none=True)
        calls[0] = 0
        for piece in split_batch(mine, [MICRO_BATCH, len(mine["idx"]) - MICRO_BATCH]):
            token_loss(model, piece)[0].backward()
        out["naive_reduce_scatters_2_micro"] = calls[0]

        model.zero_grad(set_to_none=True)
        calls[0] = 0
        acc = Accumulator(model, None, micro_batch=MICRO_BATCH)
        res = acc.step(mine, token_loss, count_fn=token_count)
        out["reduce_scatters"] = calls[0]
        out["micro_steps"] = res.micro_steps
        out["grad_err"] = max_rel_err([full(p.grad) for p in model.parameters()], want)

        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        acc = Accumulator(model, opt, micro_batch=MICRO_BATCH, max_grad_norm=0.1)
        calls[0] = 0
        res = acc.step(mine, token_loss, count_fn=token_count)
        out["reduce_scatters_with_step"] = calls[0]
        single = copy.deepcopy(base)
        s, c = token_loss(single, batch)
        (s / c).backward()
        norm = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.1)
        torch.optim.SGD(single.parameters(), lr=0.5).step()
        out["grad_norm_rel_err"] = abs(res.grad_norm - float(norm)) / float(norm)
        out["param_err_after_step"] = max(
            float((full(p.detach()) - q.detach()).abs().max())
            for p, q in zip(model.parameters(), single.parameters(), strict=True)
        )
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


def main() -> None:
    rank, world, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = {"ddp": check_ddp(rank, world), "fsdp2": check_fsdp2(rank, world)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
        f.flush()
    # gloo's threads sometimes abort at interpreter exit after FSDP2 ("terminate called without an
    # active exception"); the results are written, so leave without running the finalisers.
    os._exit(0)


if __name__ == "__main__":
    main()
