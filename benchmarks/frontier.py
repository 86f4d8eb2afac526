"""Memory/time frontier: memfit's plans at budgets from the minimum to store-all, against anchors.

For each model: profile once, plan for N budgets evenly spaced between the smallest feasible
budget and the no-checkpointing peak, then measure every plan and every anchor side by side in one
process (times from interleaved rounds: a setup's ratio to no checkpointing is the median over
rounds of its step time over no checkpointing's in the same round, and memfit against an anchor the
same; a compiled set-up of memfit's that compiles to an anchor's graphs is that anchor's program,
timed once). Anchors: HF `gradient_checkpointing_enable()` and its `every_n_layers=2` (HF models),
sqrt(N) segments through memfit's policy (where memfit can segment the chain), `every:K` for K in
1..4, torch's selective policy saving matmul and attention outputs
(`create_selective_checkpoint_contexts`), every block recomputed with the loss computed in chunks of
the sequence (the Liger / TRL style; Liger's fused kernel itself is Triton, GPU only), and torch.compile (inductor, whole model) with
`torch._functorch.config.activation_memory_budget` at several fractions; memfit's plans run eager
and compiled (plan applied, then the whole model compiled), and memfit's compiled planning mode
(`memfit plan --compile model`, :func:`memfit.fitting.compiled.plan_compiled`: the fastest of the
compiler's fraction, memfit's block plan and both whose *compiled* peak fits) at some budgets,
its chosen set-up measured side by side with the rest.

Peaks: eager rows with the live-tensor tracker (`peak_bytes`) and with the profiler
(`profiler_peak_bytes`); compiled rows with the profiler only, because the tracker is a dispatch
mode and compiled code run under one falls back to eager (memfit.capture.compiled). Comparisons
across eager and compiled rows use the profiler's peaks. Compile time (the first step, which
compiles) is reported apart (`compile_s`) and never enters the timed rounds; a recompile during
the timed rounds is counted (`recompiles`).

    .venv/bin/python benchmarks/frontier.py [--models demo hf:gpt2] [--budgets 8] [--repeats 5]
        [--fractions 0.1 0.3 0.5 1.0] [--compiled-plans 8] [--compiled-mode 3] [--no-compile]
        [--batch-size N]

Writes benchmarks/results/frontier.json and benchmarks/results/frontier.png. ``make bench-real-shapes``
runs it at shapes where compute dominates (GPT-2 small at 512 tokens, a Llama-shaped 8 x 1024 model
with a 32000 vocabulary at 1024 tokens, one row per step).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import functools
import importlib.util
import json
import platform
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.apply.compiled import MemoryBudgetBackend, compile_applied
from memfit.apply.head import head_unsupported_reason
from memfit.capture.chain import discover_chain
from memfit.capture.compiled import profiled_step_peak_bytes
from memfit.capture.step import make_optimizer, measure_step, training_step, warm_up
from memfit.errors import BudgetInfeasibleError, UnsupportedModelError
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.compiled import plan_compiled
from memfit.models.registry import load_workload
from memfit.plan import Plan, policy_plan
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import min_budget
from memfit.profiling.blocks import profile
from memfit.profiling.side_by_side import (
    Setup,
    hf_gradient_checkpointing_setup,
    paired_ratio,
    plan_setup,
)
from memfit.units import format_bytes
from memfit.workload import Workload, cast_batch

RESULTS = Path(__file__).parent / "results"
aten = torch.ops.aten
# memfit's fixed policies run as anchors (--policies; the real shapes run sqrt only: every:1 and
# every:2 are what HF's gradient_checkpointing_enable and every_n_layers=2 run).
POLICY_ANCHORS = ("sqrt", "every:1", "every:2", "every:3", "every:4")
LIGER_STYLE = "every block recomputed + chunked loss (Liger-style)"

# The ops torch's documentation and torchtitan save in their selective policy: matmuls and attention.
SAVE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
}


def _save_matmul_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def torch_selective_setup(model: nn.Module) -> Any:
    """Every block checkpointed with torch's selective policy (the anchor, without memfit)."""
    chain = discover_chain(model)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmul_and_attention)

    def fwd(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        orig = types.MethodType(type(self).forward, self)
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    for b in chain.blocks:
        b.forward = types.MethodType(fwd, b)
    # A recomputed transformers layer would fill its key/value cache twice: switch the cache off, as
    # HF's own checkpointing does in training.
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False

    def undo() -> None:
        for b in chain.blocks:
            del b.forward
        if use_cache:
            config.use_cache = use_cache

    return undo


def hf_every_n_layers_setup(n: int) -> Setup:
    """HF's own checkpointing of every n-th decoder layer (transformers 5: ``every_n_layers``)."""

    def setup(model: nn.Module) -> Callable[[], None]:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=n
        )
        return model.activation_checkpointing_disable

    return setup


def compiled_setup(plan: Plan | None, backend: MemoryBudgetBackend) -> Setup:
    """The whole model compiled with ``backend`` (after applying ``plan``, when one is given): one
    backend object per setup, so no setup reuses graphs partitioned under another fraction."""

    def setup(model: nn.Module) -> Callable[[], None]:
        if plan is not None:
            apply_plan(model, plan)
        undo = compile_applied(model, "model", backend=backend)

        def undo_all() -> None:
            undo()
            if plan is not None:
                remove_plan(model)

        return undo_all

    return setup


def measure(
    wl: Workload,
    setups: dict[str, Setup],
    backends: dict[str, MemoryBudgetBackend],
    *,
    batch_size: int,
    repeats: int,
    progress: Callable[[str], None],
    twins_of: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every setup's peak and step time, side by side (memfit.profiling.side_by_side.measure_setups' method).

    Eager setups are applied to the one model and undone, round after round. A compiled setup gets
    its own copy of the model (same weights, its own optimizer), set up and compiled once and kept:
    applying and undoing it every round would recompile in the timed rounds. Its first step
    compiles (``compile_s``); its peak is measured with the profiler only. A compiled setup listed
    in ``twins_of`` whose graphs (``MemoryBudgetBackend.digest``) are those of one of its listed
    setups, compiled before it, is the same program (``same_program_as``): timed once, its samples
    are that setup's. ``time_ratio`` is the median over rounds of the step time over no
    checkpointing's in the same round.
    """
    model = wl.model
    dev = next(p.device for p in model.parameters())
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(batch_size), device=dev)
    opt = make_optimizer(model, "adamw", lr=1e-6)
    warm_up(model, batch, wl.loss_fn, opt, seed=0)
    kept: dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]] = {}
    rows: dict[str, dict[str, Any]] = {}
    try:
        for name, setup in setups.items():
            progress(f"memory: {name}")
            row: dict[str, Any] = {"name": name}
            try:
                if name in backends:
                    cm = copy.deepcopy(model)
                    copt = make_optimizer(cm, "adamw", lr=1e-6)
                    warm_up(cm, batch, wl.loss_fn, copt, seed=0)
                    kept[name] = (cm, copt, setup(cm))
                    t0 = time.perf_counter()
                    training_step(cm, batch, wl.loss_fn, copt, seed=0)  # compiles
                    row["compile_s"] = time.perf_counter() - t0
                    row["graphs"], row["digest"] = backends[name].compiles, backends[name].digest
                    copt.zero_grad(set_to_none=True)
                    row["peak_method"] = "profiler"
                    row["profiler_peak_bytes"] = row["peak_bytes"] = profiled_step_peak_bytes(
                        cm, batch, wl.loss_fn, copt, seed=0
                    )
                    copt.zero_grad(set_to_none=True)
                    twin = next(
                        (
                            t
                            for t in (twins_of or {}).get(name, [])
                            if row["digest"] and rows.get(t, {}).get("digest") == row["digest"]
                        ),
                        None,
                    )
                    if twin is not None:  # the same compiled graphs from the same (unmodified) model: one program
                        row["same_program_as"] = twin
                        kept.pop(name)[2]()
                    continue
                undo = setup(model)
                try:
                    mem = measure_step(model, batch, wl.loss_fn, opt, seed=0)
                    row["peak_bytes"], row["activations_peak_bytes"], row["loss"] = (
                        mem.peak_bytes,
                        mem.activations_peak_bytes,
                        mem.loss,
                    )
                    row["peak_method"] = "tracker"
                    opt.zero_grad(set_to_none=True)
                    row["profiler_peak_bytes"] = profiled_step_peak_bytes(model, batch, wl.loss_fn, opt, seed=0)
                finally:
                    opt.zero_grad(set_to_none=True)
                    undo()
            except Exception as err:
                raise RuntimeError(f"{wl.name}: setup {name!r} failed: {err}") from err
            finally:
                rows[name] = row
        compiles_before = {n: b.compiles for n, b in backends.items()}
        samples: dict[str, list[float]] = {name: [] for name in setups}
        timed = {name: setup for name, setup in setups.items() if "same_program_as" not in rows[name]}
        for r in range(repeats + 1):  # round 0 warms up every setup
            for name, setup in timed.items():
                progress(f"time: round {r}/{repeats}, {name}")
                if name in kept:
                    cm, copt, _ = kept[name]
                    t0 = time.perf_counter()
                    training_step(cm, batch, wl.loss_fn, copt, seed=0)
                    copt.zero_grad(set_to_none=True)
                    dt = time.perf_counter() - t0
                else:
                    undo = setup(model)
                    try:
                        t0 = time.perf_counter()
                        training_step(model, batch, wl.loss_fn, opt, seed=0)
                        opt.zero_grad(set_to_none=True)
                        dt = time.perf_counter() - t0
                    finally:
                        undo()
                if r > 0:
                    samples[name].append(dt)
    finally:
        for _cm, _copt, undo in kept.values():
            undo()
    for name, row in rows.items():
        if "same_program_as" in row:
            samples[name] = samples[row["same_program_as"]]
        row["step_s"] = statistics.median(samples[name])
        row["step_s_samples"] = samples[name]
        row["time_ratio"] = paired_ratio(samples[name], samples["none"])
        row["peak_ratio"] = row["peak_bytes"] / rows["none"]["peak_bytes"]
        if name in backends:
            row["recompiles"] = backends[name].compiles - compiles_before[name]
    return rows


def _spread(names: list[str], k: int) -> list[str]:
    """``k`` of ``names`` evenly spaced, first and last included (one: the middle one)."""
    k = min(k, len(names))
    if k == 1:
        return [names[(len(names) - 1) // 2]]
    return list(dict.fromkeys(names[round(i * (len(names) - 1) / max(k - 1, 1))] for i in range(k))) if k else []


def bench(
    spec: str,
    n_budgets: int,
    repeats: int,
    console: Console,
    *,
    fractions: list[float],
    compiled_plans: int,
    compile_anchors: bool,
    compiled_mode: int = 0,
    compiled_mode_at: list[int] | None = None,
    fraction_steps: int = 2,
    batch_size: int | None = None,
    policies: tuple[str, ...] = POLICY_ANCHORS,
) -> dict[str, Any]:
    wl = load_workload(spec)
    if batch_size is not None:
        wl = dataclasses.replace(wl, default_batch_size=batch_size)
    with console.status(f"{spec}: profiling") as status:
        # Block-level options, the planner's default (selective: benchmarks/selective_frontier.py).
        stats = profile(
            wl,
            step=StepSpec(repeats=repeats),
            options=BASE_OPTIONS,
            progress=lambda s: status.update(f"{spec}: profiling: {s}"),
        )
    costs = ChainCosts.from_stats(stats)
    lo, _ = min_budget(costs)
    hi = predict(costs, policy_plan(wl.model, "none")).peak_with_margin_bytes
    budgets = [int(lo + (hi - lo) * k / (n_budgets - 1)) for k in range(n_budgets)]
    setups: dict[str, Any] = {"none": plan_setup(policy_plan(wl.model, "none"))}
    backends: dict[str, MemoryBudgetBackend] = {}
    plans = {}
    memfit_plans: dict[str, Plan] = {}
    for b in budgets:
        try:
            res = plan_for_budget(wl, b, stats=stats)
        except BudgetInfeasibleError:
            continue
        name = f"memfit@{format_bytes(b)}"
        plans[name] = {
            "budget_bytes": b,
            "predicted_peak_bytes": res.plan.predicted_peak_bytes,
            "predicted_step_s": res.plan.predicted_step_s,
            "plan": res.plan.to_dict(),
        }
        setups[name] = plan_setup(res.plan)
        memfit_plans[name] = res.plan
    anchors = []
    not_run: dict[str, str] = {}
    if hasattr(wl.model, "gradient_checkpointing_enable"):
        setups["HF gradient_checkpointing_enable"] = hf_gradient_checkpointing_setup
        anchors.append("HF gradient_checkpointing_enable")
        if hasattr(wl.model, "activation_checkpointing_enable"):
            setups["HF every_n_layers=2"] = hf_every_n_layers_setup(2)
            anchors.append("HF every_n_layers=2")
        else:
            not_run["HF every_n_layers=2"] = (
                "this transformers has no activation_checkpointing_enable(every_n_layers=...)"
            )
    for pol in policies:
        try:
            setups[f"policy {pol}"] = plan_setup(policy_plan(wl.model, pol))
            anchors.append(f"policy {pol}")
        except UnsupportedModelError as err:
            not_run[f"policy {pol}"] = f"memfit refuses it on this model ({str(err)[:160]})"
    setups["torch selective (save matmul+attention)"] = torch_selective_setup
    anchors.append("torch selective (save matmul+attention)")
    # The Liger / TRL style: every block recomputed and the loss computed in chunks of the sequence.
    # Liger's own fused kernel is Triton (GPU only); where it is not installed this row stands for it.
    head_reason = head_unsupported_reason(wl.model)
    if head_reason is not None:
        not_run[LIGER_STYLE] = f"no chunked loss for this model: {head_reason}"
    else:
        try:
            setups[LIGER_STYLE] = plan_setup(policy_plan(wl.model, "all").with_(head="chunked"))
            anchors.append(LIGER_STYLE)
        except UnsupportedModelError as err:
            not_run[LIGER_STYLE] = f"memfit refuses it on this model ({str(err)[:160]})"
    if importlib.util.find_spec("liger_kernel") is None:
        not_run["Liger fused linear cross-entropy"] = (
            "liger-kernel is not installed here (its kernels are Triton, GPU only); "
            f"'{LIGER_STYLE}' is the same memory pattern"
        )
    compiled: list[str] = []
    if compile_anchors:
        for f in fractions:
            name = f"torch.compile budget={f:g}"
            backends[name] = MemoryBudgetBackend(f)
            setups[name] = compiled_setup(None, backends[name])
            anchors.append(name)
        for name in _spread(list(memfit_plans), compiled_plans):
            cname = f"{name} compiled"
            backends[cname] = MemoryBudgetBackend(1.0)  # the compiler's default partitioning, the plan decides
            setups[cname] = compiled_setup(memfit_plans[name], backends[cname])
            compiled.append(cname)
            plans[cname] = {**plans[name], "compiled_from": name}
    mode_rows: list[str] = []
    twins_of: dict[str, list[str]] = {}
    if compile_anchors and (compiled_mode or compiled_mode_at):
        at = (
            [n for i, n in enumerate(memfit_plans) if i in compiled_mode_at]
            if compiled_mode_at
            else _spread(list(memfit_plans), compiled_mode)
        )
        for name in at:
            b = plans[name]["budget_bytes"]
            mname = f"memfit compiled-mode@{format_bytes(b)}"
            with console.status(f"{spec}: compiled planning for {format_bytes(b)}") as status:
                try:
                    cres = plan_compiled(
                        wl,
                        b,
                        stats=stats,
                        step=StepSpec(repeats=repeats),
                        fraction_steps=fraction_steps,
                        replans=1,
                        progress=lambda s, mname=mname, status=status: status.update(f"{spec}: {mname}: {s}"),
                    )
                except BudgetInfeasibleError as err:
                    not_run[mname] = str(err)
                    continue
            cfg = cres.plan.compile_settings
            assert cfg is not None  # plan_compiled records them
            backends[mname] = MemoryBudgetBackend(cfg.activation_memory_budget)
            setups[mname] = compiled_setup(cres.plan, backends[mname])
            mode_rows.append(mname)
            if cres.plan.is_plain:  # the compiler's own set-up (memfit changes nothing): maybe an anchor's program
                twins_of[mname] = [a for a in anchors if a in backends]
            summary = {k: v for k, v in cres.to_dict().items() if k not in ("blocks",)}
            plans[mname] = {
                "budget_bytes": b, "predicted_peak_bytes": cres.plan.predicted_peak_bytes, "predicted_step_s": cres.plan.predicted_step_s,
                "plan": cres.plan.to_dict(), "compiled_plan": summary, "eager_row": name,
            }  # fmt: skip
    with console.status(f"{spec}: measuring") as status:
        by = measure(
            wl,
            setups,
            backends,
            batch_size=stats.batch_size,
            repeats=repeats,
            progress=lambda s: status.update(f"{spec}: {s}"),
            twins_of=twins_of,
        )
    for name, info in plans.items():
        by[name].update(info)
        # One method across eager and compiled rows: the profiler's peaks.
        fitting = [a for a in anchors if by[a]["profiler_peak_bytes"] <= info["budget_bytes"]]
        best = min(fitting, key=lambda a: by[a]["time_ratio"], default=None)
        by[name]["best_anchor_within_budget"] = best
        by[name]["best_anchor_time_ratio"] = by[best]["time_ratio"] if best else None
        by[name]["within_budget"] = by[name]["peak_bytes"] <= info["budget_bytes"]
        by[name]["prediction_error"] = (by[name]["peak_bytes"] - info["predicted_peak_bytes"]) / by[name]["peak_bytes"]
    # The target, per budget: memfit's fastest way to run it (eager plan, or the compiled mode)
    # against the fastest anchor that fits (compiled anchors included), all on the profiler's peaks;
    # the verdict from the two's times round by round (the same program: equal).
    targets = []
    for mname in mode_rows:
        r, e = by[mname], by[plans[mname]["eager_row"]]
        ours = [x for x in (r, e) if x["profiler_peak_bytes"] <= r["budget_bytes"]]
        best_ours = min(ours, key=lambda x: x["time_ratio"], default=None)
        anchor = r["best_anchor_within_budget"]
        vs = paired_ratio(best_ours["step_s_samples"], by[anchor]["step_s_samples"]) if best_ours and anchor else None
        per_round = (
            [x / y for x, y in zip(best_ours["step_s_samples"], by[anchor]["step_s_samples"], strict=True)]
            if vs
            else []
        )
        targets.append({
            "budget_bytes": r["budget_bytes"], "compiled_mode": mname, "eager": plans[mname]["eager_row"],
            "memfit_best": best_ours["name"] if best_ours else None, "memfit_best_time_ratio": best_ours["time_ratio"] if best_ours else None,
            "best_anchor": r["best_anchor_within_budget"], "best_anchor_time_ratio": r["best_anchor_time_ratio"],
            "memfit_vs_anchor": vs, "memfit_vs_anchor_range": [min(per_round), max(per_round)] if per_round else None, "same_program": bool(best_ours and anchor and best_ours.get("same_program_as") == anchor),
            "memfit_wins": None if best_ours is None else vs is None or vs <= 1.0,
        })  # fmt: skip
    # Noise: spread of the no-checkpointing step times around their median.
    none_s = by["none"]["step_s_samples"]
    noise = (max(none_s) - min(none_s)) / by["none"]["step_s"] if none_s else None
    eager = [n for n in by if n not in backends]
    return {
        "model": spec,
        "n_blocks": len(stats.blocks),
        "batch_size": stats.batch_size,
        "min_budget_bytes": lo,
        "store_all_bytes": hi,
        "time_noise": noise,
        # The tracker against the profiler on every eager row: the largest relative difference.
        "tracker_vs_profiler_max_rel": max(
            abs(by[n]["peak_bytes"] - by[n]["profiler_peak_bytes"]) / by[n]["profiler_peak_bytes"] for n in eager
        ),
        "results": by,
        "memfit": [n for n in plans if n not in compiled and n not in mode_rows],
        "memfit_compiled": compiled,
        "memfit_compiled_mode": mode_rows,
        "targets": targets,
        "anchors": anchors,
        "not_run": not_run,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in report["models"] if "error" not in m]
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.4), squeeze=False)
    markers = "osD^v<>p*h"
    for ax, m in zip(axes[0], models, strict=True):
        res = m["results"]
        xs = [res[n]["peak_bytes"] / 2**20 for n in m["memfit"]]
        ys = [res[n]["time_ratio"] for n in m["memfit"]]
        ax.plot(xs, ys, "-o", color="#3b7dd8", label="memfit (budgets min..store-all)", zorder=3)
        if m.get("memfit_compiled"):
            xs = [res[n]["profiler_peak_bytes"] / 2**20 for n in m["memfit_compiled"]]
            ys = [res[n]["time_ratio"] for n in m["memfit_compiled"]]
            ax.plot(xs, ys, "--s", color="#d8563b", label="memfit compiled (profiler peak)", zorder=3)
        if m.get("memfit_compiled_mode"):
            xs = [res[n]["profiler_peak_bytes"] / 2**20 for n in m["memfit_compiled_mode"]]
            ys = [res[n]["time_ratio"] for n in m["memfit_compiled_mode"]]
            ax.plot(xs, ys, ":D", color="#2a9d4b", label="memfit compiled mode (plan --compile)", zorder=3)
        for k, a in enumerate(m["anchors"]):
            ax.scatter(
                [res[a]["peak_bytes"] / 2**20],
                [res[a]["time_ratio"]],
                marker=markers[k % len(markers)],
                s=60,
                label=a,
                zorder=4,
            )
        ax.scatter(
            [res["none"]["peak_bytes"] / 2**20], [1.0], marker="x", color="k", s=60, label="no checkpointing", zorder=4
        )
        ax.set_xlabel("measured peak of a training step (MiB)")
        ax.set_ylabel("step time / no checkpointing")
        ax.set_title(f"{m['model']} (batch {m['batch_size']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "hf:gpt2"])
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.1, 0.3, 0.5, 1.0],
        help="torch.compile activation_memory_budget anchors",
    )
    ap.add_argument(
        "--compiled-plans",
        type=int,
        default=8,
        help="memfit plans also measured compiled (evenly spaced over the budgets)",
    )
    ap.add_argument(
        "--compiled-mode",
        type=int,
        default=3,
        help="budgets (evenly spaced) at which memfit's compiled planning mode plans and is measured",
    )
    ap.add_argument(
        "--compiled-mode-at",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="instead of --compiled-mode: the budgets' indices (0 = the minimum)",
    )
    ap.add_argument(
        "--fraction-steps", type=int, default=2, help="compiled mode: bisection steps over activation_memory_budget"
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled anchors and plans")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per step (default: the workload's)")
    ap.add_argument(
        "--policies",
        nargs="*",
        default=list(POLICY_ANCHORS),
        help="memfit's fixed policies measured as anchors (default: %(default)s)",
    )
    ap.add_argument("--out", default=str(RESULTS / "frontier.json"))
    args = ap.parse_args()
    console = Console()
    # Every compiled setup keeps its own graphs (MemoryBudgetBackend): more cache entries per code
    # object than dynamo's default limit of 8, past which it would silently run eagerly.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    report = {
        "benchmark": "frontier",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "transformers": _transformers_version(),
        "command": (
            f"python benchmarks/frontier.py --models {' '.join(repr(m) for m in args.models)} --budgets {args.budgets} --repeats {args.repeats}"
            + (f" --batch-size {args.batch_size}" if args.batch_size else "")
            + (f" --policies {' '.join(args.policies)}" if tuple(args.policies) != POLICY_ANCHORS else "")
            + (
                " --no-compile"
                if args.no_compile
                else f" --fractions {' '.join(f'{f:g}' for f in args.fractions)} --compiled-plans {args.compiled_plans}"
                + (
                    f" --compiled-mode-at {' '.join(map(str, args.compiled_mode_at))}"
                    if args.compiled_mode_at
                    else f" --compiled-mode {args.compiled_mode}"
                )
                + f" --fraction-steps {args.fraction_steps}"
            )
        ),
        "models": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.models:
        try:
            report["models"].append(
                bench(
                    spec,
                    args.budgets,
                    args.repeats,
                    console,
                    fractions=args.fractions,
                    compiled_plans=args.compiled_plans,
                    compile_anchors=not args.no_compile,
                    compiled_mode=args.compiled_mode,
                    compiled_mode_at=args.compiled_mode_at,
                    fraction_steps=args.fraction_steps,
                    batch_size=args.batch_size,
                    policies=tuple(args.policies),
                )
            )
        except Exception as err:  # one model's failure must not lose the others' measurements
            console.print(f"[red]{spec}: {type(err).__name__}: {err}")
            report["models"].append({"model": spec, "error": f"{type(err).__name__}: {err}"})
        out.write_text(
            json.dumps(report, indent=2) + "\n"
        )  # after each model: a long run stopped early keeps what it measured
    for m in report["models"]:
        if "error" in m:
            continue
        t = Table(
            title=f"{m['model']}: memfit vs anchors (time noise ±{(m['time_noise'] or 0) * 50:.0f}%)",
            title_justify="left",
        )
        for c in (
            "setup",
            "budget",
            "peak (tracker)",
            "peak (profiler)",
            "predicted",
            "time vs none",
            "compile",
            "best anchor within budget",
        ):
            t.add_column(c, justify="left" if c in ("setup", "best anchor within budget") else "right")
        res = m["results"]
        for n in ["none", *m["memfit"], *m["memfit_compiled"], *m["memfit_compiled_mode"], *m["anchors"]]:
            r = res[n]
            t.add_row(
                n,
                format_bytes(r["budget_bytes"]) if "budget_bytes" in r else "",
                format_bytes(r["peak_bytes"]) if r["peak_method"] == "tracker" else "",
                format_bytes(r["profiler_peak_bytes"]),
                format_bytes(r["predicted_peak_bytes"]) if "predicted_peak_bytes" in r else "",
                f"{r['time_ratio']:.2f}x",
                f"{r['compile_s']:.0f} s" if "compile_s" in r else "",
                f"{r['best_anchor_within_budget']} {r['best_anchor_time_ratio']:.2f}x"
                if r.get("best_anchor_within_budget")
                else "",
            )
        for n, why in m["not_run"].items():
            t.add_row(n, "not run: " + why[:100], "", "", "", "", "", "")
        console.print(t)
        for tg in m.get("targets", []):
            verdict = (
                "memfit wins"
                if tg["memfit_wins"]
                else "an anchor wins"
                if tg["memfit_wins"] is False
                else "memfit does not fit"
            )
            vs = (
                f" (round by round {tg['memfit_vs_anchor']:.3f}x{', the same program' if tg['same_program'] else ''})"
                if tg["memfit_vs_anchor"]
                else ""
            )
            console.print(
                f"  {format_bytes(tg['budget_bytes'])}: memfit's best {tg['memfit_best']} {tg['memfit_best_time_ratio'] or 0:.2f}x, "
                f"best anchor {tg['best_anchor']} {tg['best_anchor_time_ratio'] or 0:.2f}x: {verdict}{vs}"
            )
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
