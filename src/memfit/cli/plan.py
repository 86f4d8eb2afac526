"""`memfit plan`: the fastest checkpoint plan under a memory budget (and, with --measure, its check).

``--policy P`` instead of ``--budget`` predicts a named policy's plan (``none``, ``all``, ``sqrt``,
``every:K``, ``selective:...``, ``offload``; :func:`memfit.plan.policies.parse_policy`) on the same
cost model, so the anchors users know can be compared with memfit's plans before running anything
(and measured with ``--measure``)."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.coverage import coverage_lines
from memfit.cli import parallel as cli_parallel
from memfit.cli.choice import (
    choose_for_plan,
    settle,  # noqa: F401  (memfit.cli.main calls it before run)
)
from memfit.cli.common import (
    Output,
    attention_json,
    is_html,
    mib,
    step_from_args,
    tiling_from_args,
    workload_from_args,
    write_html_report,
)
from memfit.cli.estimated import (  # noqa: F401  (estimate_setup, calibrate_from_args: fit's and estimate's, imported from here)
    calibrate_from_args,
    estimate_fn,
    estimate_setup,
    estimate_workload,
    profile_peak_fn,
    show_calibration,
)
from memfit.cli.parallel import parallel_from_args, show_allocator, show_rank
from memfit.cli.states import (
    ESTIMATED_STATES,
    MEASURED_STATES,
    placement_for,
    refuse_host_params,
    save_plan,
    show_model_states,
    sizes_for,
    states_json,
    with_states,
)
from memfit.errors import MemfitError, SpecError
from memfit.estimation.states_choice import StatesChoice, StatesContext
from memfit.fitting.budget import plan_for_budget, plan_for_policy
from memfit.fitting.compiled import plan_compiled
from memfit.fitting.report_inputs import gather_plan_report
from memfit.optim.states import ModelStates
from memfit.profiling.side_by_side import measure_plan
from memfit.report import plan_report
from memfit.report.html import plan_report_data
from memfit.report.memviz import snapshot_line, write_snapshot
from memfit.verification.plans import no_saving_note


def no_steps_reason(args: argparse.Namespace, *, estimated: bool) -> str:
    """Why ``--report FILE.html`` records no step (empty: it records them), one line for the page."""
    if estimated:
        return "--estimate: nothing ran, so no step was recorded."
    if getattr(args, "parallel", None):
        return (
            "--parallel: a step of one process here says nothing of a rank; rank 0's memory by part and phase is below."
        )
    return ""


def make_policy_plan(args: argparse.Namespace, out: Output) -> tuple[Any, Any]:
    """Load the workload and predict ``args.policy``'s plan on the measured (or, with
    ``--estimate``, estimated) cost model, per rank with ``--parallel``."""
    wl, res, _ = plan_policy_with_states(args, out)
    return wl, res


def plan_policy_with_states(args: argparse.Namespace, out: Output) -> tuple[Any, Any, StatesChoice]:
    """:func:`make_policy_plan`, and the model states' placement (``auto``: device, with no budget to fit)."""
    if getattr(args, "options", "block") != "block":
        raise SpecError(
            f"memfit plan: --options all chooses what memfit's plan search may use and --policy {args.policy} fixes the plan; give one of them."
        )
    refuse_host_params(args, command="plan")
    # A policy runs the model's own activations (no fused kernels): estimated stats must be of them too.
    est_args = argparse.Namespace(**{**vars(args), "keep_activations": True})
    est = estimate_workload(
        est_args,
        command="plan",
        real_step_options={
            "--measure": getattr(args, "measure", False),
            "--report FILE.png": bool(getattr(args, "report", None)) and not is_html(args.report),
        },
    )
    args.time_calibration = getattr(est_args, "time_calibration", None)  # for show_calibration
    parallel = parallel_from_args(args, command="plan") if hasattr(args, "world_size") else None
    wl = est[0] if est is not None else workload_from_args(args)

    def attempt(states: ModelStates) -> Any:
        a = with_states(args, states)
        fn = estimate_fn(with_states(est_args, states), *est) if est is not None else None
        with out.console.status("estimating the workload ..." if est else "measuring the workload ...") as status:
            return plan_for_policy(
                wl,
                a.policy,
                step=step_from_args(a),
                margin=a.margin,
                progress=lambda s: status.update(f"planning: {s}"),
                stats_fn=fn,
                parallel=parallel,
                accumulation_steps=getattr(a, "accumulation_steps", 1) if parallel is not None else 1,
            )

    res, choice = placement_for(
        args, attempt, lambda: sizes_for(wl, args.optimizer), command="plan", context=_states_context(args, parallel)
    )
    args.states = choice.states.value  # what the measuring below runs with
    return wl, res, choice


def make_plan(args: argparse.Namespace, out: Output) -> tuple[Any, Any]:
    """Load the workload and plan for ``args.budget`` (shared with ``memfit verify --budget``)."""
    wl, res, _ = plan_with_states(args, out)
    return wl, res


def plan_with_states(args: argparse.Namespace, out: Output) -> tuple[Any, Any, StatesChoice]:
    """:func:`make_plan`, and the model states' placement: ``--states``, or with ``auto`` the fastest
    that fits the budget (NOTE [ Choosing the model states' placement ] in :mod:`memfit.estimation.states_choice`)."""
    refuse_host_params(args, command="plan")
    est = estimate_workload(
        args,
        command="plan",
        real_step_options={
            "--measure": getattr(args, "measure", False),
            "--report FILE.png": bool(getattr(args, "report", None)) and not is_html(args.report),
            "--options all": getattr(args, "options", "block") == "all",
        },
    )
    parallel = parallel_from_args(args, command="plan") if hasattr(args, "world_size") else None
    wl = workload_from_args(args) if est is None else est[0]

    def attempt(states: ModelStates) -> Any:
        a = with_states(args, states)
        with out.console.status("estimating the workload ..." if est else "measuring the workload ...") as status:
            return plan_for_budget(
                wl,
                a.budget,
                step=step_from_args(a),
                margin=getattr(a, "margin", 0.02),
                options=getattr(a, "options", "block"),
                heads=not getattr(a, "keep_head", False),
                activations=not getattr(a, "keep_activations", False),
                **tiling_from_args(a),
                progress=lambda s: status.update(f"planning ({states.value}): {s}"),
                stats_fn=estimate_fn(a, *est) if est else None,
                parallel=parallel,
                # the window's peak fits the budget (memfit.plan.window.window_costs)
                accumulation_steps=getattr(a, "accumulation_steps", 1) if parallel is not None else 1,
                reserved_fn=cli_parallel.reserved_fn_from_args(a, wl),  # on CUDA the budget is reserved memory
                # the profile's keep-all step estimated on fake tensors first, as fit --seq-len auto's: one
                # predicted past the memory free here is not run; one the guard stops is scaled from smaller batches
                predict_profile_peak=_profile_peak_or_none(a, wl) if not est else None,
                bounded=not est,
            )

    res, choice = placement_for(
        args, attempt, lambda: sizes_for(wl, getattr(args, "optimizer", "adamw")), command="plan",
        context=_states_context(args, parallel),
    )  # fmt: skip
    args.states = choice.states.value  # what the measuring below runs with
    return wl, res, choice


def _profile_peak_or_none(args: argparse.Namespace, wl: Any) -> Any:
    """``batch size -> bytes | None``: the profile's keep-all step estimated on fake tensors
    (:func:`memfit.cli.estimated.profile_peak_fn`); None for a model fake tensors cannot run (an op
    that reads a tensor's values, say): the guard alone bounds that profile, as before."""
    estimate = profile_peak_fn(args, wl)

    def peak(batch_size: int) -> int | None:
        try:
            return int(estimate(batch_size))
        except (MemfitError, RuntimeError, NotImplementedError):
            return None

    return peak


def _states_context(args: argparse.Namespace, parallel: Any) -> StatesContext:
    """What a plan's step runs with that a placement may not support (a plan is one micro-step, or a
    rank's window of ``--accumulation-steps``)."""
    return StatesContext(
        micro_steps=getattr(args, "accumulation_steps", 1) if parallel is not None else 1,
        parallel=parallel.kind.value if parallel is not None else "local",
        buildable=ESTIMATED_STATES if getattr(args, "estimate", False) else MEASURED_STATES,
    )


def run_compiled(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    """``--compile``: the fastest plan whose compiled step fits (:func:`memfit.fitting.compiled.plan_compiled`)."""
    given = {
        "--policy": getattr(args, "policy", None) is not None, "--estimate": args.estimate, "--parallel": bool(getattr(args, "parallel", None)),
        "--options all": args.options != "block", "--report": bool(args.report),
    }  # fmt: skip
    bad = [k for k, v in given.items() if v]
    if bad or args.budget is None:
        raise SpecError(
            f"memfit plan: --compile measures compiled candidates for a --budget on this machine; "
            f"{'leave out ' + ', '.join(bad) if bad else 'give --budget SIZE'} (e.g. memfit plan --model M --budget 300MiB --compile model)."
        )
    wl = workload_from_args(args)
    with out.console.status("measuring the workload ...") as status:
        res = plan_compiled(
            wl, args.budget, mode=args.compile, backend=args.compile_backend, step=step_from_args(args, device=None), fraction_steps=args.fraction_steps, min_gain=args.min_gain, progress=lambda s: status.update(f"planning: {s}"),
        )  # fmt: skip
    result = res.to_dict()
    if args.out:
        res.plan.with_(workload=args.model).save(args.out)
        result["plan_file"] = args.out
    plan, c = res.plan, res.plan.compile_settings
    assert c is not None and c.measured_peak_bytes is not None and c.measured_step_s is not None  # plan_compiled's
    out.print(
        f"[bold]{wl.name}[/], batch {res.eager.stats.batch_size}: budget {mib(args.budget)} for the step compiled per {args.compile} "
        f"({args.compile_backend}); eager: no checkpointing {mib(res.eager.stats.peak_bytes)}, memfit's minimum {mib(res.eager.min_budget_bytes)}"
    )
    rows = [
        (
            cand.name, cand.kind, f"{cand.activation_memory_budget:g}", str(len(cand.plan.recomputed)),
            mib(cand.peak_bytes) if cand.peak_bytes is not None else (cand.error or "")[:40],
            f"{cand.step_s * 1e3:.0f} ms" if cand.step_s is not None else "-",
            f"{cand.time_vs_compiler:.3f}x" if cand.time_vs_compiler is not None else "-",
            f"{cand.compile_s:.1f} s" if cand.compile_s is not None else "-", f"same program as {cand.same_as}" if cand.same_as else "",
        )
        for cand in res.candidates
    ]  # fmt: skip
    out.table(
        "compiled candidates (peaks by the profiler; vs compiler: median over rounds of the step time over the compiler's own in the same round)",
        ["candidate", "kind", "fraction", "recomputed", "peak", "step", "vs compiler", "compile", ""], rows,
    )  # fmt: skip
    short = "".join({"recompute": "R", "selective": "S", "offload": "O"}.get(b.option.value, ".") for b in plan.blocks)
    spread = f"; timing spread {res.time_spread:.0%}" if res.time_spread is not None else ""
    out.print(
        f"chosen: {c.candidate}: plan {short} (R = recompute, . = keep), activation_memory_budget {c.activation_memory_budget:g}; "
        f"measured compiled: {mib(c.measured_peak_bytes)}, {c.measured_step_s * 1e3:.0f} ms{spread}"
    )
    for note in res.notes:
        out.print(note)
    if args.out:
        out.print(f"wrote {args.out} (apply: memfit.apply.compiled.compile_plan(model, Plan.load(path)))")
    return result


def tiled_summary(plan: Any) -> str:
    """``"; tiled: 3 blocks (mlp, 4 tiles); inputs on the host: 2 blocks"``, or ``""``."""
    tiled = [b for b in plan.blocks if b.tiles is not None]
    host = sum(b.host_input for b in plan.blocks)
    text = ""
    if tiled:
        names = ", ".join(sorted({t for b in tiled for t in b.tiled}))
        counts = "/".join(str(n) for n in sorted({b.tiles for b in tiled}))
        text += f"; tiled: {len(tiled)} blocks ({names}, {counts} tiles)"
    if host:
        text += f"; inputs on the host: {host} blocks"
    return text


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    if getattr(args, "compile", None):
        refuse_host_params(args, command="plan")
        if args.states == "auto":  # compiled candidates are measured with the states as given
            args.states = ModelStates.DEVICE.value
        return run_compiled(args, out)
    plan_fn = plan_policy_with_states if getattr(args, "policy", None) else plan_with_states
    wl, res, states = plan_fn(args, out)
    res, chosen = choose_for_plan(args, out, wl, res)  # --measure-choice: the fastest measured that fits
    _check_window(args, out, res)
    sizes = sizes_for(wl, args.optimizer)
    result = res.to_dict() | chosen | states_json(states, sizes)
    if not args.estimate:  # a fake-built model runs no forward
        result.update(
            attention_json(out, wl, batch_size=res.stats.batch_size, seed=args.seed, peak_bytes=res.stats.peak_bytes)
        )
    if args.out:
        save_plan(res.plan, args.out, workload=args.model, model_states=result["model_states"])
        result["plan_file"] = args.out
    if args.measure:
        with out.console.status("measuring side by side ...") as status:
            tracked: list[list[tuple[int, int]]] = []  # --snapshot: the plan's tracked step
            measured = measure_plan(
                wl, res.plan, budget_bytes=args.budget, step=step_from_args(args, batch_size=res.stats.batch_size, device=None), progress=lambda s: status.update(f"measuring: {s}"),
                on_allocations=tracked.append if getattr(args, "snapshot", None) else None,
            )  # fmt: skip
        result.update(measured.to_dict())
        if tracked:
            result["snapshot"] = write_snapshot(args.snapshot, tracked[-1], device=res.stats.device)
            out.print(snapshot_line(result["snapshot"]))
    alloc = _show_plan(args, out, wl, res, result)
    show_model_states(out, states, sizes)
    _show_rank_and_coverage(args, out, res, result, alloc)
    if args.out:
        out.print(f"wrote {args.out}")
    _write_report(args, out, wl, res, result)
    return result


def _check_window(args: argparse.Namespace, out: Output, res: Any) -> None:
    """``--accumulation-steps`` needs ``--parallel``; warn when its window's peak is over the budget."""
    k = getattr(args, "accumulation_steps", 1)
    if k > 1 and res.stats.calibration.parallel is None:
        raise SpecError(
            f"memfit plan: --accumulation-steps {k} sizes the window of a --parallel job's launch command; give --world-size N --parallel ddp|fsdp2 too."
        )
    window = (
        res.plan.accumulation_window
    )  # the window's per-rank peak (plan_for_budget/plan_for_policy), for memfit train
    if window is not None and args.budget is not None and window.predicted_peak_bytes > args.budget:
        out.warn(
            f"with {k} micro-steps a rank peaks at {mib(window.predicted_peak_bytes)}, over the budget {mib(args.budget)} "
            "(gradients are kept between micro-steps); lower --batch-size or --accumulation-steps, or raise --budget."
        )


def _show_plan(args: argparse.Namespace, out: Output, wl: Any, res: Any, result: dict[str, Any]) -> Any:
    """The headline, the estimate's notes, the plan and its table (predicted, measured, no
    checkpointing); the allocator's view of an estimate (returned, else None)."""
    plan = res.plan
    short = "".join({"recompute": "R", "selective": "S", "offload": "O"}.get(b.option.value, ".") for b in plan.blocks)
    out.print(
        f"[bold]{wl.name}[/], batch {res.stats.batch_size}: "
        + (f"policy {args.policy}" if getattr(args, "policy", None) else f"budget {mib(args.budget)}")
        + f"; minimum {mib(res.min_budget_bytes)}, "
        f"no checkpointing {mib(result['baseline_peak_bytes'])}"
        + (" (measured)" if args.measure else " (with the plan's fused activations)" if plan.activations else "")
    )
    alloc = None
    if "estimated" in result:
        e = result["estimated"]
        result.update(show_calibration(args, out))
        ran = "the steps above ran for calibration" if "calibrated" in result else "no step ran"
        out.print(
            f"estimated for {e['device']} from fake-tensor steps ({ran}; times: roofline at {e['mfu']:.0%} of peak FLOP/s)"
        )
        alloc, alloc_json = show_allocator(out, args, wl, res.stats, plan, e["device"], fitted=res.reserved is not None)
        result.update(alloc_json)
    if (line := cli_parallel.reserved_line(res.reserved)) is not None:
        out.print(line)
    out.print(
        f"plan: {short}  (R = recompute, S = selective, O = offload, . = keep){'  segments ' + str([(s.start, s.stop) for s in plan.segments]) if plan.segments else ''}"
        + (f"; head: {plan.head} (fused, chunked cross-entropy)" if plan.head else "")
        + ("; activations: fused (one torch kernel each)" if plan.activations else "")
        + tiled_summary(plan)
    )

    def secs(s: float) -> str:
        return f"{s * 1e3:.3g} ms" if "estimated" in result else f"{s * 1e3:.0f} ms"

    rows = [
        ("peak memory", mib(plan.predicted_peak_bytes), mib(result.get("measured_peak_bytes")), mib(result["baseline_peak_bytes"])),
        (
            "step time", secs(plan.predicted_step_s),
            f"{result['measured_step_s'] * 1e3:.0f} ms" if "measured_step_s" in result else "-", secs(result["baseline_step_s"]),
        ),
    ]  # fmt: skip
    out.table("plan", ["", "estimated" if "estimated" in result else "predicted", "measured", "no checkpointing"], rows)
    if args.measure:
        out.print(
            f"policy 'all' for comparison: {mib(result['all_peak_bytes'])}, {result['all_step_s'] * 1e3:.0f} ms"
            + (
                ""
                if result["within_budget"] is None
                else f"; memfit {'fits' if result['within_budget'] else 'DOES NOT FIT'} the budget"
            )
        )
    return alloc


def _show_rank_and_coverage(
    args: argparse.Namespace, out: Output, res: Any, result: dict[str, Any], alloc: Any
) -> None:
    """A ``--parallel`` rank's view, the chain's coverage, the notes, and the measured verdict's exit status."""
    plan = res.plan
    if res.stats.calibration.parallel is not None:
        result.update(
            show_rank(
                out, args, parallel_from_args(args, command="plan"), res.stats, plan,
                micro_batch=res.stats.batch_size, accumulation_steps=getattr(args, "accumulation_steps", 1),
                step_s=plan.predicted_step_s, allocator=alloc if "estimated" in result and alloc.method == "rank" else None,
            )
        )  # fmt: skip
    chain, *left_out = coverage_lines(
        res.stats.chain_path,
        len(res.stats.blocks),
        res.stats.chain_coverage,
        res.stats.chain_left_out,
        res.stats.lists_as_run,
        res.stats.suggested_blocks,
    ) or [None]
    result["chain_coverage"], result["chain_left_out"] = res.stats.chain_coverage, dict(res.stats.chain_left_out)
    if chain is not None:
        out.print(chain)
    for note in [*left_out, *res.notes]:
        out.warn(note)
    if args.measure and result["within_budget"] is False:
        result["exit_code"] = 1  # the measured plan does not fit: say so in the exit status too
    if (
        args.measure
        and result["measured_peak_bytes"] >= result["baseline_peak_bytes"]
        and plan.blocks
        and any(b.option.value != "keep" for b in plan.blocks)
    ):
        out.warn(no_saving_note(result["measured_peak_bytes"], result["baseline_peak_bytes"]))


def _write_report(args: argparse.Namespace, out: Output, wl: Any, res: Any, result: dict[str, Any]) -> None:
    """``--report FILE.html`` or ``FILE.png``."""
    if not getattr(args, "report", None):
        return
    measured = (result["measured_peak_bytes"], result["measured_step_s"]) if args.measure else None
    if is_html(args.report):
        no_steps = no_steps_reason(args, estimated=res.stats.calibration.estimated is not None)
        with out.console.status("report: the frontier, a step with no checkpointing and one with the plan ..."):
            inputs = (
                None
                if no_steps
                else gather_plan_report(wl, res, optimizer=args.optimizer, seed=args.seed, records=True)
            )
            baseline = (result["baseline_peak_bytes"], result["baseline_step_s"]) if args.measure else None
            data = plan_report_data(res, inputs, measured=measured, baseline=baseline, no_steps=no_steps)
            write_html_report(args.report, result, data, settled=getattr(args, "settled_json", None))
    else:
        with out.console.status("report: frontier and a recorded step ..."):
            result["report"] = plan_report(
                args.report,
                res,
                gather_plan_report(wl, res, optimizer=args.optimizer, seed=args.seed),
                measured=measured,
            )
    out.print(f"report: {result['report']}")
