"""`memfit demo`: the main job on the built-in GPT and corpus.

1. Measure one training step of the whole global batch without memfit (the memory it needs).
2. Auto-fit to a budget (default: half of that): micro-batch, accumulation steps and checkpoint
   plan, predicted and then measured.
3. Verify the plan: same gradients and buffers as the unmodified model.
4. Train with the fitted plan and exact gradient accumulation, with a progress bar.
5. Print predicted against measured memory and speed, write a plot and, beside it, the HTML
   report of the fit (:mod:`memfit.report.html`: the window with no checkpointing and with the
   plan, what is alive at the peak, the blocks, the frontier and the candidates).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from memfit.capture.step import StepSpec
from memfit.cli.common import (
    Output,
    check_output_path,
    mib,
    to_jsonable,
)
from memfit.errors import SpecError
from memfit.fitting import autofit
from memfit.fitting.report_inputs import gather_fit_report
from memfit.models.registry import load_workload
from memfit.plan.options import BASE_OPTIONS, DEFAULT_OPTIONS
from memfit.report.demo import demo_plot
from memfit.report.html import fit_report_data, write_html
from memfit.training.demo import any_batch, baseline_peak_bytes, train_fitted
from memfit.units import format_bytes
from memfit.verification.plans import verify

_LINE_EVERY = 10  # off a terminal, a progress line every this many training steps


def _training_lines(out: Output, steps: int) -> Any:
    """Off a terminal (output piped or redirected) the bar draws only its last frame: the training
    phase says so in its own line, then a line every few steps (:mod:`memfit.cli.lines`); None on
    a terminal, where the bar draws, and under ``--json``."""
    if out.json_mode or out.console.is_terminal:
        return None
    return out.console.status(f"training {steps} steps ...")  # off a terminal: prints its line, draws nothing


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    t_all = time.perf_counter()
    if args.policy is not None and args.all_options:
        raise SpecError(
            f"memfit demo: --all-options chooses what memfit's plan search may use and --policy {args.policy} fixes the plan; give one of them."
        )
    if args.report:
        check_output_path(args.report, create_dir=True)  # before the work, not after 50 steps
    with out.console.status(f"building {args.model} (model and corpus) ..."):  # the first line, before heavy work
        wl = load_workload(args.model, seed=args.seed)
    g = args.global_batch
    n_params = sum(p.numel() for p in wl.model.parameters())
    out.print(f"[bold]memfit demo[/]: {wl.name}, {n_params / 1e6:.2f} M parameters, global batch {g}")

    with out.console.status("measuring a plain step of the global batch ..."):
        need = baseline_peak_bytes(wl, g, seed=args.seed)
    budget = args.budget if args.budget is not None else need // 2
    out.print(f"a training step of {g} samples needs {mib(need)} without memfit; budget {mib(budget)}")

    options = None if args.policy is not None else DEFAULT_OPTIONS if args.all_options else BASE_OPTIONS
    with out.console.status("auto-fit ...") as status:
        fit = autofit(
            wl,
            budget,
            g,
            step=StepSpec(seed=args.seed, repeats=2),
            options=options,
            progress=lambda s: status.update(f"auto-fit: {s}"),
            policy=args.policy,
        )
    plan = fit.plan
    out.print(
        f"auto-fit: micro-batch {fit.micro_batch} x {fit.accumulation_steps} micro-steps, "
        f"{f'policy {fit.policy}, ' if fit.policy is not None else ''}{len(plan.recomputed)} of {len(plan.blocks)} blocks recomputed"
        + (f", segments {[(s.start, s.stop) for s in plan.segments]}" if plan.segments else "")
    )

    with out.console.status("verifying the plan against the unmodified model ..."):
        check = verify(wl, any_batch(plan), step=StepSpec(batch_size=fit.micro_batch, seed=args.seed, repeats=0))

    # Train from fresh weights with the fitted plan and exact accumulation.
    lines = _training_lines(out, args.steps)
    with out.progress() as bar:
        task = bar.add_task("training", total=args.steps, info="")

        def on_step(step: int, loss: float, rate: float) -> None:
            bar.update(task, advance=1, info=f"loss {loss:.3f}  {rate:.1f} samples/s")
            if lines is not None and ((step + 1) % _LINE_EVERY == 0 or step + 1 == args.steps):
                lines.update(f"training: step {step + 1} of {args.steps}, loss {loss:.3f}, {rate:.1f} samples/s")

        trained = train_fitted(
            args.model,
            plan,
            micro_batch=fit.micro_batch,
            global_batch=g,
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            on_step=on_step,
        )
    losses, train_peak, samples_per_s = list(trained.losses), trained.measured_peak_bytes, trained.samples_per_s
    k, first, last = trained.loss_means()

    _print_summary(out, fit, check, need, budget, g, train_peak, samples_per_s, (k, first, last), t_all)
    report = demo_plot(args.report, trained, baseline_bytes=need, budget_bytes=budget, fit=fit) if args.report else None
    if report:
        out.print(f"plot: {report}")
    result = {
        "model": wl.name,
        "global_batch": g,
        "budget_bytes": budget,
        "baseline_peak_bytes": need,
        "micro_batch": fit.micro_batch,
        "accumulation_steps": fit.accumulation_steps,
        "predicted_peak_bytes": fit.predicted_peak_bytes,
        "measured_peak_bytes": train_peak,
        "predicted_samples_per_s": fit.predicted_samples_per_s,
        "measured_samples_per_s": samples_per_s,
        "fit": fit.to_dict(),
        "verify": check.to_dict(),
        "steps": args.steps,
        "loss_first": first,
        "loss_last": last,
        "losses": losses,
        "report": report,
        "total_s": time.perf_counter() - t_all,
    }
    if args.report:
        _write_report(args, out, wl, fit, options, result)
    return result


def _print_summary(
    out: Output, fit: Any, check: Any, need: int, budget: int, g: int, train_peak: int | None,
    samples_per_s: float, losses: tuple[int, float, float], t_all: float,
) -> None:  # fmt: skip
    """The table of predicted against measured, and the loss and peak line."""
    k, first, last = losses
    out.table(
        f"memfit demo: budget {mib(budget)}, global batch {g}",
        ["", "predicted", "measured"],
        [
            ("peak memory of a training step", mib(fit.predicted_peak_bytes), mib(train_peak)),
            ("samples/s", f"{fit.predicted_samples_per_s:.1f}", f"{samples_per_s:.1f}"),
            ("without memfit (one step of the global batch)", "", mib(need)),
            (
                "gradients vs unmodified model",
                "",
                f"max rel. error {check.max_grad_rel_err:.1g}, buffers {'equal' if check.buffers_equal else 'DIFFER'}",
            ),
        ],
    )
    out.print(
        f"loss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps); peak "
        f"{format_bytes(train_peak or 0)} instead of {format_bytes(need)} "
        f"({(train_peak or 0) / need:.0%}); {time.perf_counter() - t_all:.0f} s in all"
    )


def _write_report(
    args: argparse.Namespace, out: Output, wl: Any, fit: Any, options: Any, result: dict[str, Any]
) -> None:
    """The HTML report beside the plot (its path into ``result``): the fit's profile at the chosen
    micro-batch, the frontier and the windows with and without the plan."""
    html = str(Path(args.report).with_suffix(".html"))
    with out.console.status(
        "report: profile at the chosen micro-batch, frontier, windows with and without the plan ..."
    ):
        # the frontier on the options the fit chose from (with --policy, the ones a plan of the budget takes)
        inputs = gather_fit_report(
            wl, fit, seed=args.seed, records=True, options=options or BASE_OPTIONS,
            stats=fit.profiles.get(fit.micro_batch) if args.policy is None else None,  # the fit's own profile
        )  # fmt: skip
        result["report_html"] = html
        write_html(html, to_jsonable(result), fit_report_data(fit, inputs, command="demo", fit_json="fit."))
    out.print(f"report: {html}")
