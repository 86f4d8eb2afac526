"""GPU check of the CUDA caching-allocator model (memfit.estimation.allocator).

Per model and policy, on a lent GPU: release the cache (``torch.cuda.empty_cache``), reset the
peaks, run ``--steps`` training steps (the first with memfit's tracker recording its allocations
and frees) and read ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``. Beside them:

- ``replay_of_measured_stream``: the recorded stream of the real step replayed through the model
  (the allocator model alone, on the real allocation order);
- ``fake_step_estimate``: ``memfit.estimate`` for the same model, batch, dtype and policy (the fake
  step's stream replayed: what a user gets without a GPU).

``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is read and replayed with the same setting. Run
by benchmarks/gpu_check.sh (both settings); ``--device cpu`` tries the script (no allocator numbers).

    python benchmarks/allocator_check.py --out allocator_check.json [--models hf:gpt2 hf:llama demo]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.capture.step import make_optimizer, training_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.estimation import estimate
from memfit.estimation.allocator import AllocatorConfig, cublas_workspace_bytes, replay_step
from memfit.estimation.calibrate_time import host_device
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.workload import cast_batch

POLICIES = ("none", "all", "selective:save_matmuls")


def check(spec: str, policy: str, batch_size: int, dtype: torch.dtype, device: str, steps: int) -> dict[str, Any]:
    wl = load_workload(spec, dtype=dtype)
    wl.model.to(device)
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(batch_size), device=device)
    opt = make_optimizer(wl.model, "adamw", lr=1e-6)
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)  # optimizer state allocated
    plan = policy_plan(wl.model, policy)
    apply_plan(wl.model, plan, batch=batch)
    cuda = device == "cuda"
    try:
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        tracker = MemoryTracker(device=device, record_allocations=True)
        tracker.track(wl.model, [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        tracker.track(batch)
        start = len(tracker.allocations)
        with tracker:
            training_step(wl.model, batch, wl.loss_fn, opt, seed=3)
        for _ in range(steps - 1):
            opt.zero_grad(set_to_none=True)
            training_step(wl.model, batch, wl.loss_fn, opt, seed=3)
        if cuda:
            torch.cuda.synchronize()
        measured = {
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None,
            "tracker_peak_bytes": tracker.peak_bytes,
        }
    finally:
        remove_plan(wl.model)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    config = AllocatorConfig(expandable_segments="expandable_segments:True" in conf)
    row: dict[str, Any] = {
        "model": spec,
        "policy": policy,
        "batch_size": batch_size,
        "steps": steps,
        "measured": measured,
    }
    dev = host_device() if cuda else None
    ws = [cublas_workspace_bytes(dev)] * 2 if dev is not None else []
    rep = replay_step(tracker.allocations, step_start=start, steps=steps, config=config, extra_blocks=ws)
    row["replay_of_measured_stream"] = rep.to_dict()
    if dev is not None:
        est = estimate(spec, device=dev, policy=policy, step=StepSpec(batch_size=batch_size, dtype=dtype))
        row["fake_step_estimate"] = {
            "peak_bytes": est.peak_bytes,
            "predicted_allocated_bytes": est.predicted_allocated_bytes,
            "predicted_reserved_bytes": est.predicted_reserved_bytes,
        }
        for key, pred in (("replay", rep.max_reserved_bytes), ("estimate", est.predicted_reserved_bytes)):
            row[f"reserved_error_{key}"] = pred / measured["max_memory_reserved"] - 1
    wl.model.to("cpu")
    del opt, wl
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["hf:gpt2", "hf:llama", "demo"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("allocator_check: no CUDA device")
    report: dict[str, Any] = {
        "benchmark": "allocator_check",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "python": platform.python_version(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "command": " ".join(["python", *sys.argv]),
        "rows": [],
    }
    for spec in args.models:
        for policy in args.policies:
            try:
                row = check(spec, policy, args.batch_size, getattr(torch, args.dtype), args.device, args.steps)
            except Exception as err:  # keep the other rows
                row = {"model": spec, "policy": policy, "error": f"{type(err).__name__}: {err}"}
            report["rows"].append(row)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            m = row.get("measured", {})
            print(
                f"{spec:10s} {policy:24s} reserved {m.get('max_memory_reserved')}  replay "
                f"{row.get('replay_of_measured_stream', {}).get('max_reserved_bytes')}  estimate "
                f"{row.get('fake_step_estimate', {}).get('predicted_reserved_bytes')}  {row.get('error', '')}",
                flush=True,
            )


if __name__ == "__main__":
    main()
