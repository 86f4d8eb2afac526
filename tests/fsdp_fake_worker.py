"""Rank 0 of an FSDP2 job on torch's fake process group, measured by torch's ``FSDPMemTracker``
(one process plays rank 0 of ``world``; collectives do nothing), for tests/test_parallel_estimate.py.

Usage: ``python tests/fsdp_fake_worker.py CONFIG_JSON`` with ``model`` (a workload spec),
``micro_batch``, ``plan`` (a plan's dict), ``world``, and optionally ``param_dtype`` /
``reduce_dtype`` (a ``MixedPrecisionPolicy``) and ``reshard_after_forward`` (the blocks'; default on). Wraps as memfit's accounting assumes (``fully_shard``
on every block of the chain, then the root with torch's default), runs two steps and measures the
second (AdamW state allocated). Prints one JSON line: the tracker's peak and its parts.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memfit.apply.engine import apply_plan
    from memfit.capture.chain import discover_chain
    from memfit.capture.step import make_optimizer, training_step
    from memfit.models.registry import load_workload
    from memfit.plan.types import Plan

    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=cfg["world"], store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (cfg["world"],))
        torch.manual_seed(0)
        wl = load_workload(cfg["model"])
        model = wl.model
        chain = discover_chain(model, wl.blocks)
        apply_plan(model, Plan.from_dict(cfg["plan"]))
        mp = MixedPrecisionPolicy(
            param_dtype=getattr(torch, cfg["param_dtype"]) if cfg.get("param_dtype") else None,
            reduce_dtype=getattr(torch, cfg["reduce_dtype"]) if cfg.get("reduce_dtype") else None,
        )
        for block in chain.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.get("reshard_after_forward", True))
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = make_optimizer(model, "adamw")
        batch = wl.make_batch(cfg["micro_batch"])
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(tuple(t for t in batch.values() if isinstance(t, torch.Tensor)))
        with tracker:
            for i in range(2):
                training_step(model, batch, wl.loss_fn, opt, seed=i)
                opt.zero_grad(set_to_none=True)
                if i == 0:
                    tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    finally:
        dist.destroy_process_group()
    parts = {str(k).rsplit(".", 1)[-1]: int(v) for k, v in snap.items() if k != "Total"}
    print(json.dumps({"peak_bytes": int(snap["Total"]), "parts": parts}))


if __name__ == "__main__":
    main()
