"""One rank of the per-rank memory checks run by tests/test_parallel_estimate.py (gloo, CPU).

Usage: ``python tests/parallel_worker.py RANK WORLD STORE_FILE OUT_DIR CONFIGS_JSON`` (a list of
configs). For each: builds the workload, applies the plan, wraps the model in DDP or FSDP2
(``fully_shard`` on every block, then on the root with torch's default) and runs two warm-up steps
and one measured step. Writes ``OUT_DIR/rank{RANK}.json``: one result per config.

The measured peak is taken by ``torch.profiler`` (``profile_memory=True``) over the whole session:
the model copy, the wrapping (DDP's buckets, FSDP2's shards), the optimizer state, the batch and the
steps are all allocated inside it, so the running sum of allocation events from zero is the rank's
live memory, and its maximum inside the measured step is the rank's peak. The allocator sees what
no tensor-level view does (``UntypedStorage.resize_``, which FSDP2 frees and re-allocates its
unsharded parameters with; DDP's buckets allocated in C++). Every rank then measures one more step
with a live-tensor tracker: torch's ``FSDPMemTracker`` under FSDP2 (it follows FSDP2's storage
resizes; measured again while gloo's threads held a buffer at the peak), memfit's ``MemoryTracker``
under DDP (which does not see DDP's buckets: their sizes as DDP reports them are returned beside it).

The profiler misses frees that happen on gloo's threads (a collective's buffer released when gloo's
work object dies there): an address handed out again is taken as freed, but a buffer never reused
stays counted, so under FSDP2 the profiler's peak can exceed the true one by a gathered unit.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from memfit.apply.engine import apply_plan
from memfit.capture.step import make_optimizer, training_step
from memfit.models.registry import load_workload
from memfit.plan.types import Plan
from memfit.training.distributed import fsdp2_peak

STEP_RANGE = "memfit_measured_step"


def _profiled_peaks(prof) -> tuple[int, int]:
    """(peak of live bytes inside the measured step, live bytes when it starts) from the profile."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int]] = []
    window = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        kind, fields = ev.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            allocs.append((ev.start_time_ns, fields.ptr, fields.alloc_size))
        elif ev.name == STEP_RANGE:
            window = (ev.start_time_ns, ev.end_time_ns)
    assert window is not None, "the measured step's range was not recorded"
    allocs.sort(key=lambda e: e[0])
    live: dict[int, int] = {}
    cur = peak = 0
    start = None
    for ts, ptr, size in allocs:
        if size > 0:
            cur += size - live.get(ptr, 0)  # an address handed out again was freed (on another thread)
            live[ptr] = size
        elif ptr in live:
            cur -= live.pop(ptr)
        if ts < window[0]:
            continue
        if start is None:
            start = cur - (size if size > 0 else 0)
        if ts <= window[1]:
            peak = max(peak, cur)
    return peak, start or 0


def _wrap(model, cfg: dict):
    if cfg["parallel"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
    from torch.distributed.fsdp import fully_shard

    raf = cfg.get("reshard_after_forward", True)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=raf)
    fully_shard(model)  # the root: torch's default (not resharded after forward)
    return model


def run(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    wl = load_workload(cfg["model"])
    plan = Plan.from_dict(cfg["plan"])
    out: dict = {"rank": rank}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model = copy.deepcopy(wl.model)
        apply_plan(model, plan)
        model = _wrap(model, cfg)
        opt = make_optimizer(model, cfg.get("optimizer", "adamw"))
        torch.manual_seed(100)  # the same shapes on every rank
        batch = wl.make_batch(cfg["micro_batch"])
        for i in range(2):
            training_step(model, batch, wl.loss_fn, opt, seed=i)
            opt.zero_grad(set_to_none=True)
        with torch.profiler.record_function(STEP_RANGE):
            training_step(model, batch, wl.loss_fn, opt, seed=7)
            opt.zero_grad(set_to_none=True)
    out["profiler_peak_bytes"], out["profiler_start_bytes"] = _profiled_peaks(prof)
    out.update(_second_method(model, wl, batch, opt, cfg))  # every rank: the step's collectives need all
    return out


def _second_method(model, wl, batch, opt, cfg: dict) -> dict:
    if cfg["parallel"] == "fsdp2":
        # torch's FSDPMemTracker through memfit.training.distributed.fsdp2_peak, which also says what gloo's
        # threads still held at the peak (NOTE [ Buffers a collective's thread frees ]): the step is measured
        # again, up to 3 times, until no rank's peak includes such a buffer.
        attempts = 0
        while attempts < 3:
            attempts += 1
            with fsdp2_peak(model, opt, batch, torch.device("cpu")) as peak:
                training_step(model, batch, wl.loss_fn, opt, seed=7)
                opt.zero_grad(set_to_none=True)
            late = torch.tensor([peak.collective_held_bytes], dtype=torch.int64)
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
            if int(late) == 0:
                break
        return {
            "fsdp_mem_tracker_peak_bytes": peak.peak_bytes,
            "collective_held_bytes": peak.collective_held_bytes,
            "attempts": attempts,
        }
    from memfit.capture.step import measure_step

    mem = measure_step(model, batch, wl.loss_fn, opt, seed=7)
    opt.zero_grad(set_to_none=True)
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return {"tracker_peak_bytes": mem.peak_bytes, "ddp_bucket_sizes": sizes}


def main() -> None:
    rank, world, store, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfgs = json.loads(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = [run(rank, world, cfg) for cfg in cfgs]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
        f.flush()
    os._exit(0)  # gloo's threads sometimes abort at exit after FSDP2 (see dist_worker.py)


if __name__ == "__main__":
    main()
