"""`memfit fit`: micro-batch x accumulation steps x checkpoint plan for a budget and a global batch.

``--policy P`` keeps a named policy's plan (``none``, ``all``, ``sqrt``, ``every:K``,
``selective:...``, ``offload``) and chooses micro-batch and accumulation steps for it: the fastest
whose predicted window peak fits ``--budget`` (NOTE [ Auto-fit ] in :mod:`memfit.fitting.search`).
``--budget`` stays required with ``--policy``: the policy fixes the plan, the budget is what the
micro-batch is fitted to (:func:`require_budget` says why a machine's memory is not taken instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from memfit.cli.choice import (
    choose_for_fit,
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
from memfit.cli.estimated import estimate_fn, estimate_workload, show_calibration
from memfit.cli.fit_seq_len import run_seq_len
from memfit.cli.parallel import (
    network_of,
    parallel_from_args,
    reserved_fn_from_args,
    reserved_line,
    show_allocator,
    show_rank,
)
from memfit.cli.plan import no_steps_reason
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
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.estimation.states_choice import AUTO, StatesChoice, StatesContext
from memfit.fitting import autofit, stats_at
from memfit.fitting.budget import fit_reserved
from memfit.fitting.report_inputs import gather_fit_report
from memfit.fitting.window import measure_window
from memfit.optim.states import ModelStates
from memfit.plan.options import BASE_OPTIONS, DEFAULT_OPTIONS
from memfit.report import fit_report
from memfit.report.html import fit_report_data
from memfit.report.memviz import snapshot_line, write_snapshot


def require_budget(args: argparse.Namespace, *, command: str) -> None:
    """Refuse a fit without ``--budget``, also with ``--policy``.

    A policy fixes the plan, not the memory: the micro-batch is what is fitted, and to a budget.
    The machine's memory is not taken instead: on a GPU the budget counts live tensors while the
    device also holds the allocator's cache, cuBLAS workspaces and other processes (a fit to all of
    it would run out of memory), and a CPU has no such number. Without a budget the fastest set-up
    is almost always the whole global batch in one step, which ``memfit plan --policy P
    --batch-size G`` predicts.

    Raises:
        SpecError: no ``--budget``, with both fixes.
    """
    if getattr(args, "budget", None) is None:
        pol = getattr(args, "policy", None)
        raise SpecError(
            f"memfit {command}: --budget SIZE is required{f' with --policy {pol}' if pol is not None else ''}: "
            + (
                "the policy fixes the plan and the budget is what micro-batch and accumulation steps are fitted to "
                if pol is not None
                else ""
            )
            + "(e.g. --budget 20GiB: the live tensor memory a step may use, below the GPU's memory). To see a plan at one "
            f"batch size without a budget, run `memfit plan --policy {pol or 'P'} --batch-size {getattr(args, 'global_batch', 'G')}`."
        )


def fit_from_args(args: argparse.Namespace, out: Output, workload: Any = None) -> Any:
    """Run the auto-fit for CLI args (shared with ``memfit train --budget`` and ``memfit demo``)."""
    wl, res, _ = fit_with_states(args, out, workload)
    return wl, res


def fit_with_states(args: argparse.Namespace, out: Output, workload: Any = None) -> tuple[Any, Any, StatesChoice]:
    """:func:`fit_from_args`, and the model states' placement: ``--states``, or with ``auto`` the fastest
    that fits the budget (NOTE [ Choosing the model states' placement ] in :mod:`memfit.estimation.states_choice`)."""
    require_budget(args, command="fit")
    if getattr(args, "global_batch", None) is None:
        raise SpecError(
            "memfit fit: --global-batch G is required (samples per optimizer step), e.g. --global-batch 32; "
            "only --seq-len auto defaults it to the micro-batch."
        )
    policy = getattr(args, "policy", None)
    if policy is not None and getattr(args, "options", "block") != "block":
        raise SpecError(
            f"memfit fit: --options all chooses what memfit's plan search may use and --policy {policy} fixes the plan; give one of them."
        )
    refuse_host_params(args, command="fit")
    # A policy runs the model's own activations: estimated stats must be of them too.
    est_args = argparse.Namespace(**{**vars(args), "keep_activations": True}) if policy is not None else args
    est = estimate_workload(
        est_args,
        command="fit",
        real_step_options={
            "--report FILE.png": bool(getattr(args, "report", None)) and not is_html(args.report),
            "--options all": getattr(args, "options", "block") == "all",
        },
    )
    args.time_calibration = getattr(est_args, "time_calibration", None)  # for show_calibration
    parallel = parallel_from_args(args, command="fit") if hasattr(args, "world_size") else None
    # Each rank takes its share of the global batch (the first ranks one more when it does not divide).
    share = -(-args.global_batch // parallel.world_size) if parallel else args.global_batch
    wl = est[0] if est is not None else workload or workload_from_args(args)

    def attempt(states: ModelStates) -> Any:
        a = with_states(args, states)
        fn = estimate_fn(with_states(est_args, states), *est) if est is not None else None
        res = _fit_placed(a, out, wl, share, policy, est, fn, parallel)
        args.reserved_fit = a.reserved_fit  # the placement's reserved fit, for the JSON (NOTE in _fit_placed)
        return res

    most = getattr(args, "max_micro_batch", None)
    context = StatesContext(
        micro_steps=2
        if most is not None and most < share
        else None,  # the step inside the backward takes the whole share
        parallel=parallel.kind.value if parallel is not None else "local",
        buildable=ESTIMATED_STATES if est is not None else MEASURED_STATES,
    )
    res, choice = placement_for(
        args, attempt, lambda: sizes_for(wl, getattr(args, "optimizer", "adamw")), command="fit", context=context
    )
    args.states = choice.states.value  # what the measuring below runs with
    return wl, res, choice


def _fit_placed(
    args: argparse.Namespace, out: Output, wl: Any, share: int, policy: Any, est: Any, fn: Any, parallel: Any
) -> Any:
    """The auto-fit with ``args.states``' placement; on CUDA fitted to reserved memory."""
    fn = (
        functools.cache(fn) if fn is not None else None
    )  # once per micro-batch, also when the reserved fit solves again

    def fit_at(budget_bytes: int) -> Any:
        with out.console.status("auto-fit ...") as status:
            return _autofit(args, wl, budget_bytes, share, policy, est, fn, parallel, status)

    res = fit_at(args.budget)
    reserved = reserved_fn_from_args(args, wl)
    args.reserved_fit = None
    if reserved is not None:  # on CUDA the budget is reserved memory (NOTE [ On CUDA a budget is reserved memory ])

        def fit_or_explain(target: int) -> Any:
            try:
                return fit_at(target)
            except BudgetInfeasibleError as err:
                raise BudgetInfeasibleError(
                    f"memfit fit: on CUDA the budget is reserved memory: the fit for {mib(args.budget)} is predicted to "
                    f"reserve more, and at live tensors of {mib(target)} no candidate fits ({err}). Raise --budget."
                ) from None

        res, args.reserved_fit = fit_reserved(
            args.budget, res, fit_or_explain,
            lambda r: reserved(r.plan, stats_at(list(r.profiles.values()), r.micro_batch)),
            lambda r: round(r.predicted_peak_bytes * (1 + r.margin)), floor_bytes=0, subsystem="memfit fit",
        )  # fmt: skip
        res = dataclasses.replace(res, budget_bytes=args.budget, plan=res.plan.with_(budget_bytes=args.budget))
    return res


def _autofit(
    args: argparse.Namespace,
    wl: Any,
    budget_bytes: int,
    share: int,
    policy: Any,
    est: Any,
    fn: Any,
    parallel: Any,
    status: Any,
) -> Any:
    """One auto-fit for ``budget_bytes`` as the CLI args describe it."""
    return autofit(
        wl,
        budget_bytes,
        share,
        step=step_from_args(args, batch_size=None, device=None),  # autofit measures the model where it is: built there
        margin=getattr(args, "margin", 0.02),
        measure=not getattr(args, "no_measure", False) and est is None and parallel is None,
        max_micro_batch=getattr(args, "max_micro_batch", None),
        min_micro_batch=getattr(args, "min_micro_batch", None),
        options=None
        if policy is not None
        else DEFAULT_OPTIONS
        if getattr(args, "options", "block") == "all"
        else BASE_OPTIONS,
        heads=not getattr(args, "keep_head", False),
        activations=not getattr(args, "keep_activations", False),
        **({} if policy is not None else tiling_from_args(args)),
        progress=lambda s: status.update(f"auto-fit: {s}"),
        stats_fn=fn,
        parallel=parallel,
        policy=policy,
        # estimated for a device with links: candidates ranked with their exposed communication
        interconnect=network_of(args, args.target) if est is not None and parallel is not None else None,
    )


def show(out: Output, res: Any) -> None:
    rows = []
    comm = res.interconnect is not None  # ranked with exposed communication: one more column
    for c in res.candidates:
        chosen = "<-" if c.micro_batch == res.micro_batch else ""
        with_comm = (
            [_rate(c.predicted_samples_per_s_with_comm, comm) if c.predicted_samples_per_s_with_comm else "-"]
            if comm
            else []
        )
        if c.feasible:
            rows.append(
                (
                    c.micro_batch,
                    c.accumulation_steps,
                    c.recomputed_blocks,
                    mib(c.predicted_peak_bytes),
                    _rate(c.predicted_samples_per_s, comm),
                    *with_comm,
                    chosen,
                )
            )
        else:
            rows.append((c.micro_batch, c.accumulation_steps, "-", c.reason, "-", *(["-"] if comm else []), ""))
    cols = [
        "micro-batch",
        "steps",
        "recomputed",
        "predicted peak",
        "samples/s" + (" (compute)" if comm else ""),
        *(["with communication"] if comm else []),
        "",
    ]
    out.table(
        f"candidates for global batch {res.global_batch} within {mib(res.budget_bytes)}{f', policy {res.policy}' if res.policy is not None else ''} (profiled at micro-batches {list(res.profiled_batch_sizes)})",
        cols,
        rows[:16],
    )
    if res.min_micro_batch_reason:
        out.print(res.min_micro_batch_reason)
    for m in res.measurements:
        out.print(
            f"measured micro-batch {m.micro_batch}: peak {mib(m.peak_bytes)} ({'fits' if m.within_budget else 'OVER the budget'}), {m.samples_per_s:.1f} samples/s"
        )
    out.print(
        f"[bold]choice[/]: micro-batch {res.micro_batch} x {res.accumulation_steps} steps, "
        f"{f'policy {res.policy}, ' if res.policy is not None else ''}{len(res.plan.recomputed)} blocks recomputed"
        f"{', segments ' + str([(s.start, s.stop) for s in res.plan.segments]) if res.plan.segments else ''}; predicted {mib(res.predicted_peak_bytes)}, "
        f"{_rate(res.predicted_samples_per_s, res.interconnect is not None)} samples/s"
        + (_comm_text(res.chosen_candidate) if res.interconnect is not None else "")
        + (
            f"; measured {mib(res.measured_peak_bytes)}, {res.measured_samples_per_s:.1f} samples/s"
            if res.measured_peak_bytes is not None
            else ""
        )
    )
    if res.estimated is not None:
        e = res.estimated
        out.print(
            f"estimated for {e.device} from fake-tensor steps: nothing ran, no measured window (times: roofline at {e.mfu:.0%} of peak FLOP/s)"
        )


def _rate(samples_per_s: float, fine: bool) -> str:
    """Samples/s for the table; ``fine``: three digits below 100 (a rank's share of a large model
    runs a few samples/s, and communication changes the second digit)."""
    return f"{samples_per_s:.3g}" if fine and samples_per_s < 100 else f"{samples_per_s:.1f}"


def _comm_text(c: Any) -> str:
    """The chosen candidate's compute / communication split, as it was ranked."""
    ct = c.communication
    return (
        f" compute only, {_rate(c.predicted_samples_per_s_with_comm, True)} with communication (window {c.predicted_window_with_comm_s * 1e3:.0f} ms: "
        f"compute {c.predicted_window_s * 1e3:.0f} ms, collectives {ct.comm_s * 1e3:.0f} ms of which {ct.exposed_s * 1e3:.0f} ms exposed; "
        "candidates ranked by it)"
    )


def _write_snapshot(args: argparse.Namespace, out: Output, wl: Any, res: Any) -> str:
    """``--snapshot``: the chosen plan's window at the chosen micro-batch, run once more with its
    allocations recorded, as PyTorch's memory_viz reads them; its peak is the measured peak
    (the same window, tracked the same way). The path written."""
    chosen = dataclasses.replace(res.chosen_candidate, plan=res.plan)
    recorded: list[list[tuple[int, int]]] = []
    with out.console.status(f"snapshot: the window of micro-batch {res.micro_batch} x {res.accumulation_steps} ..."):
        measure_window(
            wl, chosen, args.global_batch, optimizer=args.optimizer, seed=args.seed, repeats=1, states=args.states,
            on_allocations=recorded.append,
        )  # fmt: skip
    device = next((p.device for p in wl.model.parameters()), "cpu")
    path = write_snapshot(args.snapshot, recorded[-1], device=str(device))
    out.print(snapshot_line(path))
    return path


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    if args.seq_len == "auto":
        require_budget(args, command="fit")
        refuse_host_params(args, command="fit")
        auto = args.states == AUTO
        if auto:  # the length search runs one placement
            args.states = ModelStates.DEVICE.value
        d = run_seq_len(args, out)
        if auto:
            reason = "device: --seq-len auto searches the length with every model state on the device"
            out.print(f"model states: {reason}")
            d |= {"states": args.states, "states_reason": reason}
        return d
    for flag, value in (("--seq-multiple", args.seq_multiple != 1), ("--max-seq-len", args.max_seq_len is not None)):
        if value:
            raise SpecError(
                f"memfit fit: {flag} shapes the search of --seq-len auto; add --seq-len auto or leave it out."
            )
    wl, res, states = fit_with_states(args, out)
    show(out, res)
    sizes = sizes_for(wl, args.optimizer)
    show_model_states(out, states, sizes)
    res, chosen = choose_for_fit(args, out, wl, res)  # --measure-choice: the fastest measured that fits
    d = res.to_dict() | show_calibration(args, out) | chosen | states_json(states, sizes)
    if (fitted := getattr(args, "reserved_fit", None)) is not None:
        out.print(reserved_line(fitted))
        d.update(fitted.to_dict())
    if not getattr(args, "estimate", False):  # a fake-built model runs no forward
        d.update(
            attention_json(out, wl, batch_size=res.micro_batch, seed=args.seed, peak_bytes=res.predicted_peak_bytes)
        )
    parallel = parallel_from_args(args, command="fit")
    alloc = None
    if res.estimated is not None and getattr(args, "target", None):  # on CUDA, what runs out is reserved memory
        st = stats_at(list(res.profiles.values()), res.micro_batch)
        alloc, alloc_json = show_allocator(out, args, wl, st, res.plan, args.target, fitted=fitted is not None)
        d.update(alloc_json)
    if parallel is not None:
        st = stats_at(list(res.profiles.values()), res.micro_batch)  # the rank's stats at the chosen micro-batch
        d.update(
            show_rank(
                out, args, parallel, st, res.plan, micro_batch=res.micro_batch, accumulation_steps=res.accumulation_steps,
                step_s=res.micro_batch / res.predicted_samples_per_s if res.predicted_samples_per_s else None,
                step_peak_bytes=res.predicted_peak_bytes,
                comm_window=(c.predicted_window_with_comm_s, c.communication) if (c := res.chosen_candidate).communication is not None else None,
                allocator=alloc if alloc is not None and alloc.method == "rank" else None,
            )
        )  # fmt: skip
        d["global_batch"] = args.global_batch
        d["rank_share"] = -(-args.global_batch // parallel.world_size)
    if args.out:
        save_plan(res.plan, args.out, workload=args.model, model_states=d["model_states"])
        d["plan_file"] = args.out
    if getattr(args, "snapshot", None):
        d["snapshot"] = _write_snapshot(args, out, wl, res)
    if getattr(args, "report", None) and is_html(args.report):
        no_steps = no_steps_reason(args, estimated=res.estimated is not None)
        with out.console.status(
            "report: profile at the chosen micro-batch, frontier, windows with and without the plan ..."
        ):
            inputs = (
                None if no_steps else gather_fit_report(wl, res, optimizer=args.optimizer, seed=args.seed, records=True)
            )
            write_html_report(
                args.report,
                d,
                fit_report_data(res, inputs, no_steps=no_steps),
                settled=getattr(args, "settled_json", None),
            )
        out.print(f"report: {d['report']}")
    elif getattr(args, "report", None):
        with out.console.status("report: profile at the chosen micro-batch, frontier, a recorded step ..."):
            d["report"] = fit_report(
                args.report, res, gather_fit_report(wl, res, optimizer=args.optimizer, seed=args.seed)
            )
        out.print(f"report: {d['report']}")
    return d
