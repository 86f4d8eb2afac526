"""Model states placed, measured on this CPU: the least plan with every model state on the device
against the least plan with the optimizer step inside the backward (``step-in-backward``).

Section ``peaks``: for each placement, profile the model with that placement (keep and recompute per
block, the chunked head, fused activations, as ``memfit plan --budget`` does with ``--options block``
less the tiled options), take the planner's minimum budget, plan for it, then apply the plan and
measure one steady-state step with the placement's optimizer (the live-tensor tracker): predicted
against measured peak. Section ``equality``: from the same weights, 3 AdamW steps of (a) the
unmodified model with plain AdamW, (b) the step-in-backward plan's model with its optimizer, (c) the
same planned model with plain AdamW; parameters and optimizer state compared (b against c: the
placement alone, expected bitwise on the CPU; b against a: placement and plan together, the plan's
own reordered sums included).

    .venv/bin/python benchmarks/model_states.py [--model SPEC] [--batch-size 2] [--sections peaks equality]

Writes benchmarks/results/model_states.json (each section's key replaced, other keys kept: the estimate
section of another script may live there too); ``benchmarks/make_reports.py`` turns it into a report.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.apply.engine import apply_plan, remove_plan
from memfit.capture.step import StepSpec, make_optimizer, measure_step, training_step, warm_up
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.optim import ModelStates, release_optimizer
from memfit.plan.costmodel import ChainCosts
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import min_budget
from memfit.plan.types import Plan
from memfit.profiling.blocks import profile
from memfit.workload import Workload

RESULTS = Path(__file__).resolve().parent / "results" / "model_states.json"
MODEL = "hf:gpt2?n_layer=12&n_embd=768&n_head=12&vocab_size=50257&n_positions=1024&seq_len=512"
PLACEMENTS = (ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD)
STEPS = 3
LR = 1e-3


def least_plan(wl: Workload, states: ModelStates, batch_size: int, say: Callable[[str], None]) -> tuple[Plan, Any]:
    """The placement's profile and the plan at the planner's minimum budget."""
    step = StepSpec(batch_size=batch_size, states=states, repeats=1)
    t0 = time.perf_counter()
    stats = profile(wl, step=step, options=BASE_OPTIONS, heads=True, tiling=False, host_inputs=False, progress=say)
    say(f"profiled in {time.perf_counter() - t0:.0f} s")
    need, _ = min_budget(ChainCosts.from_stats(stats))
    return plan_for_budget(wl, need, step=step, stats=stats).plan, stats


def measured_peak(wl: Workload, plan: Plan, states: ModelStates, batch_size: int) -> dict[str, int]:
    """One steady-state step of the planned model with the placement's optimizer, tracked."""
    model = wl.model
    torch.manual_seed(0)
    batch = wl.make_batch(batch_size)
    apply_plan(model, plan, batch=batch)
    opt = make_optimizer(model, "adamw", lr=LR, states=states)
    try:
        warm_up(model, batch, wl.loss_fn, opt, seed=1)
        mem = measure_step(model, batch, wl.loss_fn, opt, seed=2)
    finally:
        release_optimizer(opt)
        remove_plan(model)
        model.zero_grad(set_to_none=True)
    return {
        "measured_peak_bytes": mem.peak_bytes,
        "params_bytes": mem.params_bytes,
        "grads_bytes_after_backward": mem.grads_bytes,
        "optimizer_bytes": mem.optimizer_bytes,
    }


def section_peaks(
    wl: Workload, batch_size: int, say: Callable[[str], None], placements: tuple[ModelStates, ...], save: Callable
) -> dict[str, Any]:
    """Per placement: the least plan's predicted and measured peak (``save(out)`` after each)."""
    out: dict[str, Any] = {}
    for states in placements:
        say(f"{states}: profiling")
        plan, stats = least_plan(wl, states, batch_size, lambda s, st=states: say(f"{st}: {s}"))
        row = {
            "min_budget_bytes": plan.min_budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "peak_event": plan.peak_event,
            "plan": plan.to_dict(),
            "profile_peak_bytes": stats.peak_bytes,
            "profile_grads_bytes": stats.grads_bytes,
        }
        say(f"{states}: measuring the least plan")
        row.update(measured_peak(wl, plan, states, batch_size))
        row["error"] = row["predicted_peak_bytes"] / row["measured_peak_bytes"] - 1
        out[str(states)] = row
        save(out)
        say(f"{states}: predicted {row['predicted_peak_bytes']:,} B, measured {row['measured_peak_bytes']:,} B")
    return out


def _train(model: nn.Module, wl: Workload, opt: torch.optim.Optimizer, batches: list[Any]) -> None:
    for k, batch in enumerate(batches):
        training_step(model, batch, wl.loss_fn, opt, seed=10 + k)
        opt.zero_grad(set_to_none=True)


def _compare(a: nn.Module, b: nn.Module, opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters and optimizer state of two runs: bitwise or not, largest relative difference."""
    worst, equal, param_abs = 0.0, True, 0.0
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for i, (pa, pb) in enumerate(pairs):
        param_abs = max(param_abs, float((pa.detach() - pb.detach()).abs().max()))
        tensors = [(pa.detach(), pb.detach())]
        tensors += [(sa[i][k], sb[i][k]) for k in ("exp_avg", "exp_avg_sq") if i in sa and i in sb]
        for x, y in tensors:
            equal = equal and torch.equal(x, y)
            scale = float(y.abs().max().clamp_min(1e-12))
            worst = max(worst, float((x - y).abs().max()) / scale)
    return {
        "bitwise_equal": equal,
        "max_rel_err": worst,
        "max_param_abs_err": param_abs,
        "tensors_compared": "parameters, exp_avg, exp_avg_sq",
    }


def section_equality(wl: Workload, batch_size: int, plan: Plan, say: Callable[[str], None]) -> dict[str, Any]:
    """3 AdamW steps: plain, the planned model stepping in the backward, the planned model plain."""
    torch.manual_seed(3)
    batches = [wl.make_batch(batch_size) for _ in range(STEPS)]
    plain, planned_sib, planned_dev = (copy.deepcopy(wl.model) for _ in range(3))
    apply_plan(planned_sib, plan, batch=batches[0])
    apply_plan(planned_dev, plan, batch=batches[0])
    opts = {
        "plain": make_optimizer(plain, "adamw", lr=LR),
        "sib": make_optimizer(planned_sib, "adamw", lr=LR, states=ModelStates.STEP_IN_BACKWARD),
        "dev": make_optimizer(planned_dev, "adamw", lr=LR),
    }
    for name, model in (("plain", plain), ("sib", planned_sib), ("dev", planned_dev)):
        say(f"equality: {STEPS} steps ({name})")
        _train(model, wl, opts[name], batches)
    release_optimizer(opts["sib"])
    return {
        "steps": STEPS,
        "lr": LR,
        "placement_alone": _compare(planned_sib, planned_dev, opts["sib"], opts["dev"]),
        "against_plain": _compare(planned_sib, plain, opts["sib"], opts["plain"]),
        "plan_head": plan.head,
        "plan_activations": plan.activations,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--sections", nargs="+", default=["peaks", "equality"], choices=["peaks", "equality"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--placements", nargs="+", default=[str(m) for m in PLACEMENTS], choices=[str(m) for m in PLACEMENTS]
    )
    args = ap.parse_args()
    t0 = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {text}", flush=True)

    wl = load_workload(args.model)
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.update(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {torch.get_num_threads()} thread(s), CPU",
        torch=torch.__version__,
        transformers=_transformers_version(),
        command=f"python benchmarks/model_states.py --model {args.model} --batch-size {args.batch_size}",
        model=args.model,
        batch_size=args.batch_size,
        optimizer="adamw",
    )

    def save(peaks: dict[str, Any]) -> None:
        data["peaks"] = {**data.get("peaks", {}), **peaks}
        args.out.write_text(json.dumps(data, indent=2) + "\n")

    if "peaks" in args.sections:
        placements = tuple(ModelStates(p) for p in args.placements)
        section_peaks(wl, args.batch_size, say, placements, save)
    if "equality" in args.sections:
        plan = Plan.from_dict(data["peaks"][str(ModelStates.STEP_IN_BACKWARD)]["plan"])
        data["equality"] = section_equality(wl, args.batch_size, plan, say)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    say(f"wrote {args.out}")


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


if __name__ == "__main__":
    main()
