"""`memfit verify`: the planned model against the unmodified one, from the same weights and data."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from memfit.apply.compiled import MemoryBudgetBackend
from memfit.capture.step import StepSpec
from memfit.cli.common import (
    Output,
    mib,
    parse_dtype,
    step_from_args,
    workload_from_args,
    write_html_report,
)
from memfit.cli.device import settle  # noqa: F401  (memfit.cli.main calls it before run)
from memfit.cli.plan import make_plan
from memfit.errors import SpecError
from memfit.fitting.report_inputs import gather_step_records
from memfit.plan import Plan, RecomputeAll, policy_plan
from memfit.report.html import verify_report_data
from memfit.report.memviz import snapshot_line, write_snapshot
from memfit.verification.accumulation import verify_accumulation
from memfit.verification.plans import verify
from memfit.workload import Workload


def resolve_plan(args: argparse.Namespace, model: Any, out: Output) -> Plan:
    """The plan named by --plan / --policy / --budget (default: policy 'all')."""
    if args.plan:
        return Plan.load(args.plan)
    if getattr(args, "budget", None) is not None:
        return make_plan(args, out)[1].plan
    return policy_plan(model, args.policy or RecomputeAll())


def hub_kernels_note(reasons: Sequence[str]) -> str | None:
    """The note for graph breaks inside the ``kernels`` package's layer wrappers (docs/compile.md,
    "transformers 5.25 and newer"), or None when none of ``reasons`` is one."""
    n = sum(("/kernels/" in r.replace("\\", "/")) for r in reasons)
    if not n:
        return None
    return (
        f"{n} graph break(s) come from the `kernels` package's layer wrappers, which transformers 5.25 and newer "
        "put on its layers whenever `kernels` is installed, hub kernels used or not (USE_HUB_KERNELS=0 leaves "
        "them): `pip uninstall kernels` (transformers then runs its own forwards) or transformers<5.25 removes them"
    )


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    dtype = parse_dtype(args.dtype)
    _check_args(args)
    wl = workload_from_args(args)
    plan = resolve_plan(args, wl.model, out)
    res = _run_check(args, wl, plan, dtype, out)
    ok = bool(res["ok"])
    out.table(f"verify {wl.name}, plan {plan.policy!r}: {'OK' if ok else 'FAILED'}", ["check", "result"], _rows(res))
    if res.get("reason"):
        out.print(f"why: {res['reason']}")
    kernels = hub_kernels_note(res.get("graph_break_reasons") or ())
    if kernels is not None:
        res["notes"] = [*(res.get("notes") or ()), kernels]
    for note in res.get("notes") or ():
        out.warn(note)
    if res.get("snapshot"):
        out.print(snapshot_line(res["snapshot"]))
    if args.report:
        _write_report(args, wl, plan, res, out)
    res["exit_code"] = 0 if ok else 1
    return res


def _check_args(args: argparse.Namespace) -> None:
    """Refuse options that cannot go together, each with the fix."""
    if (args.global_batch is None) != (args.micro_batch is None):
        raise SpecError(
            "memfit verify: give --global-batch and --micro-batch together, e.g. --global-batch 16 --micro-batch 4."
        )
    if args.compile is not None and args.global_batch is not None:
        raise SpecError(
            "memfit verify: --compile checks one step of the whole batch; accumulation over micro-batches "
            "(--global-batch) is verified eagerly. Run the two checks separately."
        )
    if args.snapshot and (args.global_batch is not None or args.compile is not None):
        raise SpecError(
            "memfit verify: --snapshot records the planned model's one step of the whole batch, measured eagerly; "
            f"with {'--global-batch' if args.global_batch is not None else '--compile'} no such step is tracked. "
            "Leave out --snapshot, or run it in a check without that option."
        )


def _run_check(
    args: argparse.Namespace, wl: Workload, plan: Plan, dtype: torch.dtype | None, out: Output
) -> dict[str, Any]:
    """The check the options ask for: accumulation against the whole batch (--global-batch), or the
    planned model against the unmodified one (compiled as a plan from ``memfit plan --compile`` was
    planned); its result as JSON-ready fields, with the snapshot written (--snapshot)."""
    backend: Any = args.compile_backend
    recorded_steps: list[list[tuple[int, int]]] = []  # --snapshot: the planned model's measured step
    recorded = plan.compile_settings
    if recorded is not None and args.compile is None and args.global_batch is None:
        # a plan from `memfit plan --compile`: verify it compiled as it was planned
        args.compile = recorded.mode
        backend = MemoryBudgetBackend(recorded.activation_memory_budget, recorded.backend)
    if args.global_batch is not None:
        with out.console.status("verifying accumulation ..."):
            result = verify_accumulation(
                wl,
                global_batch=args.global_batch,
                micro_batch=args.micro_batch,
                plan=plan,
                step=StepSpec(dtype=dtype, seed=args.seed),
                bn=getattr(args, "bn", "ghost"),
            )
        return dict(result if isinstance(result, dict) else result.to_dict())
    with out.console.status(
        "verifying: plan and unmodified model side by side"
        + (f", compiled per {args.compile} ..." if args.compile else " ...")
    ):
        res = verify(
            wl,
            plan,
            step=step_from_args(args),
            budget_bytes=getattr(args, "budget", None),
            compile=args.compile,
            compile_backend=backend,
            on_allocations=recorded_steps.append if args.snapshot else None,
        ).to_dict()
    if args.snapshot:
        res["snapshot"] = write_snapshot(
            args.snapshot, recorded_steps[-1], device=str(getattr(args, "device", None) or "cpu")
        )
    return res


def _rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows: gradients, buffers, model states after steps, peaks, budget, prediction,
    compiling and step time, each where the check gave it."""
    rows = [
        (
            "gradients",
            f"max relative error {res['max_grad_rel_err']:.3g}"
            + (f" (tolerance {res['grad_rtol']:.0e})" if "grad_rtol" in res else ""),
        ),
        (
            "buffers",
            "equal" if res.get("buffers_equal", True) else f"DIFFER: {', '.join(res.get('unequal_buffers', ()))}",
        ),
    ]
    if res.get("after_steps"):  # a placement of the model states: parameters and state after the steps
        a = res["after_steps"]
        kind = "abs" if a["params_tolerance_kind"] == "absolute" else "rel"
        err = a[f"params_after_steps_max_{kind}_err"]
        rows.append(
            (
                f"model states {res['states']}",
                f"parameters and {', '.join(a['states_compared'])} after {a['optimizer_steps']} steps: "
                f"{a['params_tolerance_kind']} error {err:.3g} (tolerance {a['params_tolerance']:.0e})",
            )
        )
    if "measured_peak_bytes" in res and "baseline_peak_bytes" in res:
        rows.append(
            ("peak memory", f"{mib(res['measured_peak_bytes'])} vs {mib(res['baseline_peak_bytes'])} without memfit")
        )
    if res.get("budget_bytes") is not None:
        rows.append(("budget", mib(res["budget_bytes"])))
    if res.get("predicted_peak_bytes") is not None and "measured_peak_bytes" in res:
        over = res["measured_peak_bytes"] / res["predicted_peak_bytes"] - 1
        rows.append(
            (
                "prediction",
                f"{mib(res['predicted_peak_bytes'])}, measured {over:+.1%}"
                + (f" (tolerance +{res['peak_rtol']:.0%})" if res.get("peak_rtol") is not None else " (not checked)"),
            )
        )
    if res.get("compile"):
        rows.append(
            (
                "torch.compile",
                f"{res['compile']}: {res['graph_breaks']} graph breaks ({res['memfit_graph_breaks']} in memfit), compiled in {res['compile_s']:.1f} s; peaks by the profiler",
            )
        )
    if res.get("measured_step_s") and res.get("baseline_step_s"):
        rows.append(
            (
                "step time",
                f"{res['measured_step_s'] * 1e3:.0f} ms vs {res['baseline_step_s'] * 1e3:.0f} ms ({res['measured_step_s'] / res['baseline_step_s']:.2f}x)",
            )
        )
    return rows


def _write_report(args: argparse.Namespace, wl: Workload, plan: Plan, res: dict[str, Any], out: Output) -> None:
    """The HTML report (--report): a step with no checkpointing and one with the plan, explained."""
    with out.console.status("report: a step with no checkpointing and one with the plan, the plan explained ..."):
        records = gather_step_records(
            wl, plan, batch_size=args.global_batch or args.batch_size or wl.default_batch_size,
            micro_batch=args.micro_batch, optimizer=args.optimizer, seed=args.seed,
        )  # fmt: skip
        data = verify_report_data(
            wl.name, plan, records, res, budget_bytes=getattr(args, "budget", None), accumulation=args.global_batch is not None
        )  # fmt: skip
        write_html_report(args.report, res, data, settled=getattr(args, "settled_json", None))
    out.print(f"report: {args.report}")
