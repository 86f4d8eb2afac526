"""`memfit plan`: the fastest checkpoint plan under a memory budget (and, with --measure, its check).

``--policy P`` instead of ``--budget`` predicts a named policy's plan (``none``, ``all``, ``sqrt``,
``every:K``, ``selective:...``, ``offload``; :func:`memfit.plan.policies.parse_policy`) on the same
cost model, so the anchors users know can be compared with memfit's plans before running anything
(and measured with ``--measure``)."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.coverage import coverage_lines
from memfit.capture.step import StepSpec
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
    parse_dtype,
    step_from_args,
    tiling_from_args,
    workload_from_args,
    write_html_report,
)
from memfit.cli.estimate_states import check_floor
from memfit.cli.parallel import parallel_from_args, show_allocator, show_rank
from memfit.errors import SpecError
from memfit.estimation import DEFAULT_MFU, DEVICES, get_device, load_fake_workload, stats_fn
from memfit.estimation.calibrate_time import TimeCalibration, calibrate_mfu
from memfit.fitting.budget import plan_for_budget, plan_for_policy, policy_options
from memfit.fitting.compiled import plan_compiled
from memfit.fitting.report_inputs import gather_plan_report
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.policies import Selective, parse_policy
from memfit.profiling.side_by_side import measure_plan
from memfit.report import plan_report
from memfit.report.html import plan_report_data
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


def estimate_setup(
    args: argparse.Namespace, *, command: str, real_step_options: dict[str, bool]
) -> tuple[Any, Any] | None:
    """With ``--estimate``: the fake-built workload and its ``stats_fn``; None without it.

    Raises:
        SpecError: ``--target`` missing, unknown (the names are listed) or given without
            ``--estimate``, or an option that runs a real step given with ``--estimate``.
    """
    if not getattr(args, "estimate", False):
        if getattr(args, "target", None) is not None:
            raise SpecError(
                f"memfit {command}: --target names the GPU to estimate for; add --estimate (e.g. --estimate --target {args.target})."
            )
        if getattr(args, "calibrate", False):
            raise SpecError(
                f"memfit {command}: --calibrate fits the estimate's step time; add --estimate --target NAME (this machine's, e.g. --target cpu)."
            )
        return None
    if getattr(args, "target", None) is None:
        raise SpecError(
            f"memfit {command}: --estimate needs --target NAME, one of: {', '.join(d for d in DEVICES if d != 'cpu')}."
        )
    try:
        device = get_device(args.target)
    except SpecError:
        raise SpecError(
            f"memfit {command}: unknown --target {args.target!r}. Use one of: {', '.join(d for d in DEVICES if d != 'cpu')} (e.g. --target h100-sxm)."
        ) from None
    bad = [opt for opt, given in real_step_options.items() if given]
    if bad:
        raise SpecError(
            f"memfit {command}: {', '.join(bad)} run(s) the model for real; leave it out with --estimate (nothing runs then)."
        )
    cal = calibrate_from_args(args, device)
    seq_len = None if args.seq_len == "auto" else args.seq_len  # fit --seq-len auto: built at its own length
    wl = load_fake_workload(args.model, seq_len=seq_len, dtype=parse_dtype(args.dtype), seed=args.seed)
    # model states alone over the budget: refused here, before any fake step (memfit.estimation.states)
    check_floor(args, wl, command=command, budget_bytes=getattr(args, "budget", None))
    # FSDP2 MixedPrecisionPolicy: the blocks run in param_dtype
    step_dtype = parse_dtype(args.param_dtype) if getattr(args, "param_dtype", None) else None
    fn = stats_fn(
        wl, device=cal.device if cal else device, mfu=cal.mfu if cal else getattr(args, "mfu", None),
        activations=not getattr(args, "keep_activations", False),
        step=StepSpec(optimizer=getattr(args, "optimizer", "adamw"), seed=args.seed, dtype=step_dtype, states=getattr(args, "states", "device")),
        # a selective policy (selective:torchtitan, ...) is estimated as its own option
        options=policy_options(pol) if isinstance(pol := parse_policy(getattr(args, "policy", None) or "none"), Selective) else BASE_OPTIONS,
        # tiled, host-held and chunked-head options unless --no-tiling / --keep-head (none under a fixed --policy)
        heads=not getattr(args, "keep_head", False) and not getattr(args, "policy", None),
        **({"tiling": False} if getattr(args, "policy", None) else tiling_from_args(args)),
    )  # fmt: skip
    return wl, fn


def calibrate_from_args(args: argparse.Namespace, device: Any) -> TimeCalibration | None:
    """``--calibrate``: the mfu fitted to steps measured here (None without the flag); also kept as
    ``args.time_calibration`` for the report (:func:`show_calibration`)."""
    args.time_calibration = None
    if not getattr(args, "calibrate", False):
        return None
    args.time_calibration = calibrate_mfu(
        args.model, device, batch_size=getattr(args, "batch_size", None) or 1, seq_len=None if args.seq_len == "auto" else args.seq_len,
        dtype=parse_dtype(args.dtype), optimizer=getattr(args, "optimizer", "adamw"), mfu_before=getattr(args, "mfu", None) or DEFAULT_MFU,
        seed=args.seed,
    )  # fmt: skip
    return args.time_calibration


def show_calibration(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    """Print ``--calibrate``'s fit; its JSON (``{"calibrated": ...}``, empty without the flag)."""
    cal = getattr(args, "time_calibration", None)
    if cal is None:
        return {}
    out.print(
        f"calibrated on this machine ({cal.device.name}): measured step {cal.measured_step_s * 1e3:.3g} ms at micro-batch "
        f"{cal.batch_size} (median of {cal.repeats}); roofline {cal.predicted_step_s_before * 1e3:.3g} ms at mfu {cal.mfu_before:.2f} "
        f"-> {cal.predicted_step_s_after * 1e3:.3g} ms at the fitted mfu {cal.mfu:.3f}"
    )
    return {"calibrated": {k: v for k, v in cal.to_dict().items() if k not in ("device", "repeats")}}


def make_policy_plan(args: argparse.Namespace, out: Output) -> tuple[Any, Any]:
    """Load the workload and predict ``args.policy``'s plan on the measured (or, with
    ``--estimate``, estimated) cost model, per rank with ``--parallel``."""
    if getattr(args, "options", "block") != "block":
        raise SpecError(
            f"memfit plan: --options all chooses what memfit's plan search may use and --policy {args.policy} fixes the plan; give one of them."
        )
    # A policy runs the model's own activations (no fused kernels): estimated stats must be of them too.
    est_args = argparse.Namespace(**{**vars(args), "keep_activations": True})
    est = estimate_setup(
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
    with out.console.status("estimating the workload ..." if est else "measuring the workload ...") as status:
        res = plan_for_policy(
            wl,
            args.policy,
            step=step_from_args(args),
            margin=args.margin,
            progress=lambda s: status.update(f"planning: {s}"),
            stats_fn=est[1] if est is not None else None,
            parallel=parallel,
            accumulation_steps=getattr(args, "accumulation_steps", 1) if parallel is not None else 1,
        )
    return wl, res


def make_plan(args: argparse.Namespace, out: Output) -> tuple[Any, Any]:
    """Load the workload and plan for ``args.budget`` (shared with ``memfit verify --budget``)."""
    est = estimate_setup(
        args,
        command="plan",
        real_step_options={
            "--measure": getattr(args, "measure", False),
            "--report FILE.png": bool(getattr(args, "report", None)) and not is_html(args.report),
            "--options all": getattr(args, "options", "block") == "all",
        },
    )
    parallel = parallel_from_args(args, command="plan") if hasattr(args, "world_size") else None
    if est is None:
        wl = workload_from_args(args)
    else:
        wl = est[0]
    with out.console.status("estimating the workload ..." if est else "measuring the workload ...") as status:
        res = plan_for_budget(
            wl,
            args.budget,
            step=step_from_args(args),
            margin=getattr(args, "margin", 0.02),
            options=getattr(args, "options", "block"),
            heads=not getattr(args, "keep_head", False),
            activations=not getattr(args, "keep_activations", False),
            **tiling_from_args(args),
            progress=lambda s: status.update(f"planning: {s}"),
            stats_fn=est[1] if est else None,
            parallel=parallel,
            # the window's peak fits the budget (memfit.plan.window.window_costs)
            accumulation_steps=getattr(args, "accumulation_steps", 1) if parallel is not None else 1,
            reserved_fn=cli_parallel.reserved_fn_from_args(args, wl),  # on CUDA the budget is reserved memory
        )
    return wl, res


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
        return run_compiled(args, out)
    wl, res = make_policy_plan(args, out) if getattr(args, "policy", None) else make_plan(args, out)
    res, chosen = choose_for_plan(args, out, wl, res)  # --measure-choice: the fastest measured that fits
    plan = res.plan
    k = getattr(args, "accumulation_steps", 1)
    if k > 1 and res.stats.calibration.parallel is None:
        raise SpecError(
            f"memfit plan: --accumulation-steps {k} sizes the window of a --parallel job's launch command; give --world-size N --parallel ddp|fsdp2 too."
        )
    window = plan.accumulation_window  # the window's per-rank peak (plan_for_budget/plan_for_policy), for memfit train
    if window is not None and args.budget is not None and window.predicted_peak_bytes > args.budget:
        out.warn(
            f"with {k} micro-steps a rank peaks at {mib(window.predicted_peak_bytes)}, over the budget {mib(args.budget)} "
            "(gradients are kept between micro-steps); lower --batch-size or --accumulation-steps, or raise --budget."
        )
    result = res.to_dict() | chosen
    if not args.estimate:  # a fake-built model runs no forward
        result.update(
            attention_json(out, wl, batch_size=res.stats.batch_size, seed=args.seed, peak_bytes=res.stats.peak_bytes)
        )
    if args.out:
        plan.with_(workload=args.model).save(args.out)
        result["plan_file"] = args.out
    if args.measure:
        with out.console.status("measuring side by side ...") as status:
            measured = measure_plan(
                wl, plan, budget_bytes=args.budget, step=step_from_args(args, batch_size=res.stats.batch_size, device=None), progress=lambda s: status.update(f"measuring: {s}"),
            )  # fmt: skip
        result.update(measured.to_dict())
    short = "".join({"recompute": "R", "selective": "S", "offload": "O"}.get(b.option.value, ".") for b in plan.blocks)
    out.print(
        f"[bold]{wl.name}[/], batch {res.stats.batch_size}: "
        + (f"policy {args.policy}" if getattr(args, "policy", None) else f"budget {mib(args.budget)}")
        + f"; minimum {mib(res.min_budget_bytes)}, "
        f"no checkpointing {mib(result['baseline_peak_bytes'])}"
        + (" (measured)" if args.measure else " (with the plan's fused activations)" if plan.activations else "")
    )
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
        (
            "peak memory",
            mib(plan.predicted_peak_bytes),
            mib(result.get("measured_peak_bytes")),
            mib(result["baseline_peak_bytes"]),
        ),
        (
            "step time",
            secs(plan.predicted_step_s),
            f"{result['measured_step_s'] * 1e3:.0f} ms" if "measured_step_s" in result else "-",
            secs(result["baseline_step_s"]),
        ),
    ]
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
    if res.stats.calibration.parallel is not None:
        result.update(
            show_rank(
                out, args, parallel_from_args(args, command="plan"), res.stats, plan,
                micro_batch=res.stats.batch_size, accumulation_steps=k, step_s=plan.predicted_step_s,
                allocator=alloc if "estimated" in result and alloc.method == "rank" else None,
            )
        )  # fmt: skip
    chain, *left_out = coverage_lines(
        res.stats.chain_path,
        len(res.stats.blocks),
        res.stats.chain_coverage,
        res.stats.chain_left_out,
        res.stats.lists_as_run,
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
    if args.out:
        out.print(f"wrote {args.out}")
    if getattr(args, "report", None) and is_html(args.report):
        measured = (result["measured_peak_bytes"], result["measured_step_s"]) if args.measure else None
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
        out.print(f"report: {result['report']}")
    elif getattr(args, "report", None):
        measured = (result["measured_peak_bytes"], result["measured_step_s"]) if args.measure else None
        with out.console.status("report: frontier and a recorded step ..."):
            result["report"] = plan_report(
                args.report,
                res,
                gather_plan_report(wl, res, optimizer=args.optimizer, seed=args.seed),
                measured=measured,
            )
        out.print(f"report: {result['report']}")
    return result
