"""GPU check: the planner's prediction accuracy and a small frontier on CUDA, bf16.

Run by benchmarks/gpu_check.sh on a lent GPU. For each model: profile (keep and recompute
calibrated), plan for budgets between the minimum and store-all, and for each plan and the
baselines (none, all, every:2, sqrt: segments over the model's block list) measure one
steady-state step: the allocator's peaks (`torch.cuda.max_memory_allocated` and
`max_memory_reserved`, after `empty_cache`, reset before the step), the live-tensor tracker's peak and
the median step time over interleaved rounds (CUDA synchronised). On CUDA the profile's prediction
counts what the process holds before the step, so it is compared with the allocator's peak; reserved
memory against the allocator model is `allocator_check.py`'s. Writes one JSON file.

Then a long-sequence case (`--long-model`, `--long-seq-len`; 0 skips it): a Llama-shaped model at a
long sequence with every block recomputed, the same with its inputs held in pinned host memory
(`recompute:host`, memfit.apply.host_inputs: side-stream copies, prefetch one block ahead), with its
MLPs tiled (`recompute:tiles-N`, memfit.apply.tiling), both, and memfit's plan at its least budget;
each measured as above, predicted where the profile measured its option, and the host-held and
tiled plans verified against the unmodified model (gradients, float32).

    python benchmarks/gpu_check.py --out gpu_check.json [--models hf:gpt2 hf:llama demo] [--long-seq-len 4096]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.capture.step import make_optimizer, measure_step, training_step, warm_up
from memfit.errors import BudgetInfeasibleError, MemfitError
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BlockOption
from memfit.plan.solve import min_budget
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify
from memfit.workload import cast_batch

LONG_MODEL = (
    "hf:llama?num_hidden_layers=4&hidden_size=512&intermediate_size=1408&num_attention_heads=8"
    "&num_key_value_heads=4&vocab_size=32000"
)


def measure(wl: Any, batch: Any, plan: Any, opt: Any, rounds: int) -> dict[str, Any]:
    model = wl.model
    apply_plan(model, plan)
    try:
        dev = next(model.parameters()).device
        cuda = dev.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
        opt.zero_grad(set_to_none=True)
        sync()
        if cuda:
            torch.cuda.empty_cache()  # each setup's reserve from its own step, not the ones before
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        training_step(model, batch, wl.loss_fn, opt, seed=3)
        sync()
        alloc_peak = torch.cuda.max_memory_allocated(dev) if cuda else -1
        reserved_peak = torch.cuda.max_memory_reserved(dev) if cuda else -1
        opt.zero_grad(set_to_none=True)
        mem = measure_step(model, batch, wl.loss_fn, opt, seed=3)
        opt.zero_grad(set_to_none=True)
        times = []
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            training_step(model, batch, wl.loss_fn, opt, seed=3)
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
    finally:
        remove_plan(model)
    return {
        "allocator_peak_bytes": alloc_peak,
        "allocator_reserved_peak_bytes": reserved_peak,
        "allocated_before_step_bytes": base,
        "tracker_peak_bytes": mem.peak_bytes,
        "step_s": statistics.median(times),
        "step_s_samples": times,
    }


def check_model(spec: str, budgets: int, rounds: int, dtype: torch.dtype, device: str) -> dict[str, Any]:
    t_start = time.perf_counter()
    wl = load_workload(spec, dtype=dtype)
    wl.model.to(device)
    stats = profile(wl, step=StepSpec(repeats=rounds), options=("keep", "recompute"))
    costs = ChainCosts.from_stats(stats)
    # a fixed policy runs the model's own activations: predicted from a profile of them, not the fused one
    own = ChainCosts.from_stats(
        profile(wl, step=StepSpec(repeats=rounds), options=("keep", "recompute"), activations=False)
    )
    lo, _ = min_budget(costs)
    hi = predict(own, policy_plan(wl.model, "none")).peak_with_margin_bytes
    plans: dict[str, Any] = {p: policy_plan(wl.model, p) for p in ("none", "all", "every:2", "sqrt")}
    predicted: dict[str, int] = {p: predict(own, plans[p]).peak_bytes for p in plans}
    budget_of: dict[str, int] = {}
    for k in range(budgets):
        b = int(lo + (hi - lo) * (k + 0.5) / budgets)
        try:
            res = plan_for_budget(wl, b, stats=stats)
        except BudgetInfeasibleError:
            continue
        name = f"memfit@{b}"
        plans[name] = res.plan
        predicted[name] = res.plan.predicted_peak_bytes
        budget_of[name] = b
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(stats.batch_size), device=device)
    opt = make_optimizer(wl.model, "adamw", lr=1e-6)
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
    results = {}
    for name, plan in plans.items():
        m = measure(wl, batch, plan, opt, rounds)
        m["predicted_peak_bytes"] = predicted[name]
        m["prediction_error_vs_tracker"] = (m["tracker_peak_bytes"] - predicted[name]) / m["tracker_peak_bytes"]
        m["prediction_error_vs_allocator"] = (m["allocator_peak_bytes"] - predicted[name]) / m["allocator_peak_bytes"]
        if name in budget_of:
            m["budget_bytes"] = budget_of[name]
            m["allocator_within_budget"] = m["allocator_peak_bytes"] <= budget_of[name]
            m["tracker_within_budget"] = m["tracker_peak_bytes"] <= budget_of[name]
        results[name] = m
    none_t = results["none"]["step_s"]
    for m in results.values():
        m["time_ratio"] = m["step_s"] / none_t
    print(f"{spec}: {len(plans)} setups in {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)
    return {
        "model": spec,
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": stats.batch_size,
        "min_budget_bytes": lo,
        "store_all_predicted_bytes": hi,
        "profile_peak_bytes": stats.peak_bytes,
        "policies_predicted_from": "a profile of the model's own activations",
        "results": results,
    }


def _every_block(costs: ChainCosts, option: str) -> Plan | None:
    """Every block in ``option`` (None when the profile did not measure it)."""
    if not all(option in o for o in costs.options):
        return None
    return Plan(policy=option, chain_path="", blocks=tuple(costs.decision(i, option) for i in range(len(costs))))


def check_long_sequence(spec: str, seq_len: int, rounds: int, dtype: torch.dtype, device: str) -> dict[str, Any]:
    """Host-held inputs and tiling at a long sequence (the module docstring)."""
    t_start = time.perf_counter()
    wl = load_workload(spec, seq_len=seq_len, dtype=dtype)
    wl.model.to(device)
    stats = profile(wl, step=StepSpec(batch_size=1, repeats=rounds), options=("keep", "recompute"))
    costs = ChainCosts.from_stats(stats)
    tiles = max((BlockOption.parse(k).tiles or 0 for k in costs.options[0]), default=0)
    base = policy_plan(wl.model, "all")
    plans: dict[str, Plan] = {"all": base}
    for name, option in (
        ("all+host", "recompute:host"),
        (f"all tiled x{tiles}", f"recompute:tiles-{tiles}"),
        (f"all tiled x{tiles}+host", f"recompute:tiles-{tiles}:host"),
    ):
        p = _every_block(costs, option)
        if p is not None:
            plans[name] = p.with_(chain_path=base.chain_path, fingerprint=base.fingerprint)
    lo, _ = min_budget(costs)
    plans["memfit@min"] = plan_for_budget(wl, lo, stats=stats).plan
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(1), device=device)
    opt = make_optimizer(wl.model, "adamw", lr=1e-6)
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
    results: dict[str, Any] = {}
    for name, plan in plans.items():
        m = measure(wl, batch, plan, opt, rounds)
        try:
            m["predicted_peak_bytes"] = predict(costs, plan).peak_bytes
            m["prediction_error_vs_allocator"] = (m["allocator_peak_bytes"] - m["predicted_peak_bytes"]) / m[
                "allocator_peak_bytes"
            ]
        except MemfitError as err:
            m["predicted_peak_bytes"] = None
            m["not_predicted"] = str(err)
        m["options"] = sorted({BlockOption(b.option, tiles=b.tiles, host=b.host_input).name for b in plan.blocks})
        results[name] = m
    for name in [n for n in plans if "host" in n or "tiled" in n]:
        v = verify(wl, plans[name], step=StepSpec(batch_size=1, repeats=0, dtype=torch.float32))
        results[name]["verify"] = {
            k: v.to_dict()[k] for k in ("ok", "max_grad_rel_err", "grad_rtol", "grad_rtol_reason")
        }
    all_t = results["all"]["step_s"]
    for m in results.values():
        m["time_ratio_vs_all"] = m["step_s"] / all_t
    print(
        f"{spec} @ {seq_len}: {len(plans)} setups in {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True
    )
    return {
        "model": spec,
        "seq_len": seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "input_bytes_per_block": stats.blocks[0].input_bytes,
        "blocks": len(stats.blocks),
        "min_budget_bytes": lo,
        "tiling": stats.calibration.tiling.to_dict() if stats.calibration.tiling else None,
        "dropped_options": dict(stats.calibration.dropped_options),
        "host_bandwidth_bytes_per_s": [
            stats.calibration.offload_d2h_bytes_per_s,
            stats.calibration.offload_h2d_bytes_per_s,
        ],
        "results": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["hf:gpt2", "hf:llama", "demo"])
    ap.add_argument("--budgets", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script")
    ap.add_argument("--long-model", default=LONG_MODEL, help="the long-sequence case's model")
    ap.add_argument("--long-seq-len", type=int, default=4096, help="its sequence length (0: skip the case)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    dtype = getattr(torch, args.dtype)
    report: dict[str, Any] = {
        "benchmark": "gpu_check",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "models": [],
    }
    out = Path(args.out)
    for spec in args.models:
        try:
            report["models"].append(check_model(spec, args.budgets, args.rounds, dtype, args.device))
        except Exception as err:  # keep what was measured for the other models
            traceback.print_exc()
            report["models"].append({"model": spec, "error": f"{type(err).__name__}: {err}"})
        out.write_text(json.dumps(report, indent=2) + "\n")
    if args.long_seq_len:
        try:
            report["long_sequence"] = check_long_sequence(
                args.long_model, args.long_seq_len, args.rounds, dtype, args.device
            )
        except Exception as err:  # keep the rest
            traceback.print_exc()
            report["long_sequence"] = {"model": args.long_model, "error": f"{type(err).__name__}: {err}"}
    out.write_text(json.dumps(report, indent=2) + "\n")
    long = report.get("long_sequence") or {}
    for name, r in (long.get("results") or {}).items():
        pred = r["predicted_peak_bytes"]
        print(
            f"long {name:24s} alloc {r['allocator_peak_bytes'] / 2**20:8.1f} MiB  pred "
            f"{pred / 2**20 if pred else float('nan'):8.1f}  time {r['time_ratio_vs_all']:.2f}x of all"
            + (f"  verify {'ok' if r['verify']['ok'] else 'FAILED'}" if "verify" in r else "")
        )
    if "error" in long:
        print("long-sequence case ERROR", long["error"])
    for m in report["models"]:
        if "error" in m:
            print(m["model"], "ERROR", m["error"])
            continue
        for name, r in m["results"].items():
            print(
                f"{m['model']:10s} {name:22s} alloc {r['allocator_peak_bytes'] / 2**20:8.1f} MiB  tracker {r['tracker_peak_bytes'] / 2**20:8.1f}  "
                f"pred {r['predicted_peak_bytes'] / 2**20:8.1f}  err {r['prediction_error_vs_allocator'] * 100:+5.1f}%  time {r['time_ratio']:.2f}x"
            )


if __name__ == "__main__":
    main()
