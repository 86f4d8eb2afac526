"""`memfit explain`: per block, every tensor autograd saves and what a plan does with it, and why.

Parses the arguments, makes the plan (``--plan``, ``--budget`` or ``--policy``), runs
:func:`memfit.profiling.residuals.explain` and prints its tables (``--json``: the whole
:class:`memfit.profiling.residuals.Explanation`). What the decisions mean: :mod:`memfit.profiling.residuals`.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.step import StepSpec
from memfit.cli.common import (
    Output,
    mib,
    parse_dtype,
    step_from_args,
    workload_from_args,
)
from memfit.cli.device import settle  # noqa: F401  (memfit.cli.main calls it before run)
from memfit.cli.states import show_model_states, sizes_for
from memfit.errors import SpecError
from memfit.estimation.states_choice import StatesChoice, model_states_parts
from memfit.fitting.budget import plan_for_budget
from memfit.optim.states import ModelStates
from memfit.plan.policies import policy_plan
from memfit.plan.types import Plan
from memfit.profiling.residuals import explain, short_op
from memfit.workload import Workload


def resolve_plan(args: argparse.Namespace, wl: Workload, out: Output) -> Plan:
    """The plan ``--plan`` / ``--budget`` / ``--policy`` names."""
    if args.plan:
        return Plan.load(args.plan)
    if args.budget is not None:
        with out.console.status("planning ...") as status:
            return plan_for_budget(
                wl,
                args.budget,
                step=StepSpec(batch_size=args.batch_size, seed=args.seed),
                progress=lambda s: status.update(f"planning: {s}"),
            ).plan
    return policy_plan(wl.model, args.policy)


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    dtype = parse_dtype(args.dtype)
    wl = workload_from_args(args)
    plan = resolve_plan(args, wl, out)
    with out.console.status("capturing ops and saved tensors ..."):
        ex = explain(wl, plan, step=step_from_args(args, dtype=dtype))
    show = _parse_blocks(args.blocks, len(ex.blocks))
    out.table(
        f"{ex.model}, batch {ex.batch_size}, {ex.dtype} on {ex.device}: plan {plan.policy!r}",
        ["block", "option", "saved by autograd", "kept", "recomputed", "offloaded", "cached extra", "ms added"],
        [
            (
                b.name,
                b.option + (f" ({_short(b.policy)})" if b.policy else ""),
                mib(b.saved_bytes),
                mib(b.kept_bytes),
                mib(b.recomputed_bytes),
                mib(b.offloaded_bytes),
                mib(b.cached_extra_bytes),
                f"{b.seconds_added * 1e3:.1f}",
            )
            for b in ex.blocks
        ],
    )
    for i in show:
        b = ex.blocks[i]
        out.table(
            f"{b.name}: {b.option}" + (f" {b.policy}" if b.policy else ""),
            ["op", "shape", "dtype", "bytes", "decision", "ms added", "why"],
            [
                (
                    short_op(t.op),
                    "x".join(map(str, t.shape)),
                    t.dtype,
                    mib(t.bytes),
                    t.decision,
                    "-" if t.seconds_added is None else f"{t.seconds_added * 1e3:.2f}",
                    t.why,
                )
                for t in (*b.tensors, *b.cached)
            ],
        )
    if plan.head:
        out.print(
            f"head: {plan.head}: the loss is computed in chunks of rows with its gradients (memfit.apply.head); "
            "the logits are never materialised, so the loss and head hold about one chunk instead of several (N, V) tensors."
        )
    if plan.activations:
        out.print(
            f"activations: {plan.activations}: activation modules written out of elementary ops (GPT-2's gelu_new, ...) "
            "run their fused torch kernel, which saves only its input (memfit.apply.activations); the tensors above are "
            "those of the fused model."
        )
    if plan.states != "device":
        how = {
            "step-in-backward": ": the optimizer steps each parameter inside the backward as soon as its gradient "
            "is complete and frees that gradient (memfit.optim.in_backward)"
        }.get(str(plan.states), "")
        out.print(f"model states: {plan.states}{how}; the activations above are the same with every placement.")
    states = StatesChoice(states=ModelStates.parse(plan.states), reason=f"{plan.states}: the plan's", considered=())
    sizes = sizes_for(wl, "adamw")  # the optimizer explain's step runs
    show_model_states(out, states, sizes, table=True, line=False)
    return ex.to_dict() | {"states": str(plan.states), "model_states": model_states_parts(sizes, plan.states)}


def _short(policy: str) -> str:
    return policy if len(policy) <= 32 else policy[:29] + "..."


def _parse_blocks(text: str | None, n: int) -> list[int]:
    if text is None:
        return list(range(min(n, 1)))
    try:
        idx = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"memfit explain: --blocks {text!r} must be block indices, e.g. --blocks 0,3.") from None
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise SpecError(f"memfit explain: --blocks {bad} out of range; the chain has blocks 0..{n - 1}.")
    return idx
