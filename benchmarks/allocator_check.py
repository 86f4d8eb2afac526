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

``--recorded FILE`` (on this CPU, no GPU): the allocator model against a GPU run recorded earlier by
benchmarks/gpu_check.py (``max_memory_allocated`` per model and plan) or
benchmarks/selective_frontier.py (the tracker's peaks only). Per recorded row: the fake-tensor
estimate of the same model, batch, dtype and plan for the recorded GPU (its step's allocations
replayed, plus cuBLAS workspaces), the model applied to the recorded tracker peak alone, and, for
the policies, the replay of the tracker stream of the same step run here (``--no-cpu-replay``
skips it). The workloads are rebuilt as the recorded run had them (NOTE [ The recorded workloads ]).

    python benchmarks/allocator_check.py --out allocator_check.json [--models hf:gpt2 hf:llama demo]
    python benchmarks/allocator_check.py --recorded benchmarks/results/gpu_check_2026-11-30.json \
        benchmarks/results/selective_frontier_cuda.json --out benchmarks/results/allocator_recorded.json

NOTE [ The recorded workloads ]
The GPU runs of 2026-11-30 (commit 5a5b7ce) ran ``hf:*`` workloads whose loss was
``F.cross_entropy`` of the model's logits in the training dtype, summed, with ``use_cache=False``;
today's built-in loss is transformers' own (logits upcast to float32, a key/value cache built). The
check rebuilds the model and batch from the spec and puts the recorded loss back, so that the
tensors match the run: the estimated tensor peak beside the recorded tracker peak says whether they
do. ``demo`` is unchanged since.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memfit import StepSpec
from memfit.apply import apply_plan, plan_applied, remove_plan
from memfit.capture.step import make_optimizer, training_step, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.estimation import estimate, stats_fn
from memfit.estimation.allocator import (
    STEP_WORKSPACES,
    AllocatorConfig,
    allocator_model,
    cublas_workspace_bytes,
    replay_step,
)
from memfit.estimation.calibrate_time import host_device
from memfit.estimation.devices import DeviceSpec, get_device
from memfit.estimation.parallel import estimate_plan_allocator
from memfit.estimation.stats import load_fake_workload
from memfit.fitting.budget import plan_for_budget
from memfit.models.hf import _next_token_targets
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.workload import Workload, cast_batch

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


# ------------------------------------------------------------ --reserved-budget: the budget as reserved memory


def reserved_budget_check(spec: str, dtype: torch.dtype, batch_size: int, steps: int) -> dict[str, Any]:
    """On a GPU: plan for a budget between the least plan's and store-all's predicted reserved memory, as live
    tensors and as reserved memory (``plan_for_budget(reserved_fn=...)``, the path `memfit plan` takes on CUDA),
    run each plan ``steps`` times after ``empty_cache`` and read ``max_memory_reserved``."""
    wl = load_workload(spec, dtype=dtype)
    wl.model.to("cuda")
    dev = host_device()
    stats = profile(wl, step=StepSpec(batch_size=batch_size, repeats=2), options=("keep", "recompute"))

    def reserved(plan: Plan, st: Any) -> int:
        return estimate_plan_allocator(spec, wl, st, plan, dev, dtype=dtype).predicted_reserved_bytes

    lo = plan_for_budget(wl, 2**50, stats=stats)  # store-all
    least = plan_for_budget(wl, lo.min_budget_bytes, stats=stats)
    # halfway between the least and the store-all plan's predicted reserved bytes, but not below the least plan's
    # live-tensor need (the profile on the GPU counts what the process holds already; the estimate does not)
    midpoint = (reserved(least.plan, stats) + reserved(lo.plan, stats)) // 2
    budget = max(midpoint, lo.min_budget_bytes)
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(batch_size), device="cuda")
    opt = make_optimizer(wl.model, "adamw", lr=1e-6)
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
    row: dict[str, Any] = {
        "model": spec,
        "batch_size": batch_size,
        "budget_bytes": budget,
        "reserved_midpoint_bytes": midpoint,
        "least_live_bytes": lo.min_budget_bytes,
    }
    for meaning, fn in (("live", None), ("reserved", reserved)):
        res = plan_for_budget(wl, budget, stats=stats, reserved_fn=fn)
        with plan_applied(wl.model, res.plan):
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(steps):
                training_step(wl.model, batch, wl.loss_fn, opt, seed=3)
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        row[meaning] = {
            "predicted_peak_bytes": res.plan.predicted_peak_bytes,
            "predicted_reserved_bytes": reserved(res.plan, stats),
            "reserved": res.reserved.to_dict() if res.reserved is not None else None,
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "reserved_within_budget": torch.cuda.max_memory_reserved() <= budget,
        }
        print(f"{spec:10s} budget {budget} as {meaning:8s} {row[meaning]}", flush=True)
    return row


# ------------------------------------------------------------ --recorded: GPU runs recorded earlier

RECORDED_DEVICES = {"NVIDIA H200": "h200"}  # the recorded GPU's name -> memfit's device table


def recorded_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal-LM loss of the recorded runs (NOTE [ The recorded workloads ])."""
    targets = _next_token_targets(batch["input_ids"], batch["attention_mask"])  # (B, T)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (targets != -100).sum()


def recorded_workload(spec: str, dtype: torch.dtype, *, fake: bool) -> Workload:
    wl = load_fake_workload(spec, dtype=dtype) if fake else load_workload(spec, dtype=dtype)
    return dataclasses.replace(wl, loss_fn=recorded_loss) if spec.startswith("hf:") else wl


def recorded_plan(wl: Workload, name: str, dev: DeviceSpec, batch_size: int, dtype: torch.dtype) -> Plan:
    """The plan of a recorded row: a policy, or ``memfit@BUDGET`` solved again here on estimated stats
    (the recorded run solved on its own measured stats: the tensor peaks say whether the plans agree)."""
    if not name.startswith("memfit@"):
        return policy_plan(wl.model, name)
    stats = stats_fn(wl, device=dev, step=StepSpec(dtype=dtype), activations=False)(batch_size)
    # the planner of the recorded run: keep or recompute per block, no segments, tiles or head
    blocks = tuple(
        dataclasses.replace(b, options={k: v for k, v in b.options.items() if k in ("keep", "recompute")})
        for b in stats.blocks
    )
    stats = dataclasses.replace(stats, blocks=blocks, head_peak_bytes_by_option={})
    return plan_for_budget(wl, int(name.removeprefix("memfit@")), stats=stats, segments=False).plan


def cpu_replay(wl: Workload, plan: Plan, batch_size: int, dev: DeviceSpec, steps: int) -> dict[str, Any]:
    """The step run here (CPU), its tracker stream replayed through the allocator model for ``dev``."""
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(batch_size), device="cpu")
    opt = make_optimizer(wl.model, "adamw", lr=1e-6)
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
    apply_plan(wl.model, plan, batch=batch)
    try:
        opt.zero_grad(set_to_none=True)
        tracker = MemoryTracker(device="cpu", record_allocations=True)
        tracker.track(wl.model, [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        tracker.track(batch)
        start = len(tracker.allocations)
        with tracker:
            training_step(wl.model, batch, wl.loss_fn, opt, seed=3)
    finally:
        remove_plan(wl.model)
        opt.zero_grad(set_to_none=True)
    ws = [cublas_workspace_bytes(dev)] * STEP_WORKSPACES
    rep = replay_step(tracker.allocations, step_start=start, steps=steps, extra_blocks=ws)
    return {"tracker_peak_bytes": tracker.peak_bytes, **rep.to_dict()}


def recorded_rows(path: Path, steps: int, cpu: bool) -> list[dict[str, Any]]:
    """One row per recorded (model, plan): what was recorded and what the model predicts."""
    rec = json.loads(path.read_text())
    gpu = rec.get("device") or rec.get("machine", "").rsplit(", ", 1)[-1]
    dev = get_device(RECORDED_DEVICES[gpu])
    rows = []
    for m in rec["models"]:
        dtype = getattr(torch, m["dtype"])
        wl = recorded_workload(m["model"], dtype, fake=True)
        real = recorded_workload(m["model"], dtype, fake=False) if cpu else None
        runs = m.get("results") or {
            name: {"tracker_peak_bytes": a["peak_bytes"]} for name, a in m.get("anchors", {}).items()
        }
        for name, r in runs.items():
            if name == "sqrt":  # segments over the block list: not estimated by the fake step
                continue
            plan = recorded_plan(wl, name, dev, m["batch_size"], dtype)
            est = estimate(wl, device=dev, plan=plan, step=StepSpec(batch_size=m["batch_size"], dtype=dtype))
            alloc = est.breakdown["allocator"]
            row: dict[str, Any] = {
                "source": path.name,
                "model": m["model"],
                "plan": name,
                "dtype": m["dtype"],
                "batch_size": m["batch_size"],
                "device": dev.name,
                "recorded": {
                    "max_memory_allocated": r.get("allocator_peak_bytes"),
                    "allocated_before_step_bytes": r.get("allocated_before_step_bytes"),
                    "tracker_peak_bytes": r["tracker_peak_bytes"],
                },
                "estimate": {
                    "tensor_peak_bytes": est.peak_bytes,
                    "start_bytes": est.breakdown["start_bytes"],
                    "optimizer_temp_bytes": est.breakdown["optimizer_temp_bytes"],
                    "predicted_allocated_bytes": est.predicted_allocated_bytes,
                    "predicted_reserved_bytes": est.predicted_reserved_bytes,
                    "workspace_bytes": alloc["workspace_bytes"],
                },
                "from_recorded_tracker_peak": allocator_model(r["tracker_peak_bytes"], dev).to_dict(),
            }
            if real is not None and not name.startswith("memfit@"):
                row["cpu_replay"] = cpu_replay(real, policy_plan(real.model, name), m["batch_size"], dev, steps)
            rows.append(row)
            print(
                f"{m['model']:10s} {name:20s} recorded alloc {r.get('allocator_peak_bytes')} tracker {r['tracker_peak_bytes']}  "
                f"estimate peak {est.peak_bytes} alloc {est.predicted_allocated_bytes} reserved {est.predicted_reserved_bytes}",
                flush=True,
            )
    return rows


def main_recorded(args: argparse.Namespace) -> None:
    report: dict[str, Any] = {
        "benchmark": "allocator_recorded",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), no GPU",
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
        "sources": [str(p) for p in args.recorded],
        "models": " ".join(
            dict.fromkeys(m["model"] for p in args.recorded for m in json.loads(p.read_text())["models"])
        ),
        "rows": [],
    }
    for path in args.recorded:
        report["rows"].extend(recorded_rows(path, args.steps, not args.no_cpu_replay))
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["hf:gpt2", "hf:llama", "demo"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recorded", type=Path, nargs="+", help="recorded GPU runs to check the model against, here")
    ap.add_argument("--no-cpu-replay", action="store_true", help="--recorded: skip the steps run here")
    ap.add_argument(
        "--reserved-budget", action="store_true", help="on a GPU: a plan for a budget as reserved memory, run"
    )
    args = ap.parse_args()
    if args.recorded:
        return main_recorded(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("allocator_check: no CUDA device")
    if args.reserved_budget:
        rows = []
        for spec in args.models:
            try:
                rows.append(reserved_budget_check(spec, getattr(torch, args.dtype), args.batch_size, args.steps))
            except Exception as err:  # keep the other rows
                traceback.print_exc()
                rows.append({"model": spec, "error": f"{type(err).__name__}: {err}"})
            args.out.write_text(
                json.dumps({"benchmark": "allocator_reserved_budget", "date": datetime.date.today().isoformat(),
                            "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
                            "device": torch.cuda.get_device_name(0),
                            "command": " ".join(["python", *sys.argv]), "rows": rows}, indent=1) + "\n"
            )  # fmt: skip
        return None
    report: dict[str, Any] = {
        "benchmark": "allocator_check",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
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
                traceback.print_exc()
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
