"""`memfit train`: real training with exact gradient accumulation, also under ``torchrun``.

``--plan PLAN.json`` applies a plan file (refused when made for another model), ``--parallel
ddp|fsdp2`` (with ``--bucket-cap-mb``, ``--[no-]reshard-after-forward``, ``--fsdp-units``,
``--param-dtype`` / ``--reduce-dtype`` (FSDP2's ``MixedPrecisionPolicy``; default: the plan's), as
``memfit plan/fit --parallel`` print them) chooses how the ranks hold the model under
``torchrun``: the line ``memfit plan --world-size N --parallel ... --out PLAN.json`` prints.

Parses the arguments into a :class:`memfit.training.TrainConfig`, runs
:func:`memfit.training.train` and draws what it reports: the auto-fit's spinner, the run's header,
a progress bar (loss, samples/s, peak memory), warnings, the summary table and ``--json``. What a
run does (accumulation, out-of-memory replans, drift checks, saving, resuming, signals) is
documented in :mod:`memfit.training` and its NOTEs. Only rank 0 prints (warnings: every rank).

Exit codes beyond :mod:`memfit.cli.main`'s: 3 when the run diverged (``--max-skips`` consecutive
non-finite windows), 130 / 143 when SIGINT / SIGTERM stopped it (after finishing the window and
saving), 75 under ``torchrun`` when another rank stopped answering within ``--collective-timeout``
(NOTE [ Bounded collectives ] in :mod:`memfit.training.distributed`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

import torch
from rich.markup import escape

from memfit.accumulate import Normalize
from memfit.cli.common import (
    Output,
    mib,
    parse_dtype,
    settle_model,
)
from memfit.cli.parallel import parallel_from_args
from memfit.cli.states import (
    MEASURED_STATES,
    placement_for,
    refuse_host_params,
    show_model_states,
    sizes_for,
    states_json,
    with_states,
)
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.estimation import load_fake_workload
from memfit.estimation.states_choice import AUTO, StatesChoice, StatesContext
from memfit.optim.states import ModelStates
from memfit.plan.types import Plan
from memfit.training import (
    FitDone,
    FitProgress,
    FitStarted,
    LoopEnded,
    RunStarted,
    Signalled,
    StepDone,
    TrainConfig,
    TrainEvent,
    Warned,
    train,
)
from memfit.training.distributed import world_size_from_env
from memfit.training.watch import DRIFT_WARN

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`~memfit.training.TrainConfig` that ``memfit train``'s arguments describe."""
    plan = Plan.load(args.plan) if args.plan else None
    if args.parallel is None and args.world_size is not None:
        raise SpecError(
            f"memfit train: --world-size {args.world_size} describes a --parallel layout; give --parallel ddp|fsdp2 too (without it torchrun runs get DDP)."
        )
    if args.parallel is not None and args.world_size is None:
        args = argparse.Namespace(**{**vars(args), "world_size": world_size_from_env()})  # torchrun's
    made_for = (plan.parallel or {}) if isinstance(plan, Plan) else {}
    if args.parallel is not None and made_for:
        # The plan's MixedPrecisionPolicy unless given here: the launch line of a plan made with it carries it too.
        args = argparse.Namespace(
            **{
                **vars(args),
                **{k: made_for.get(k) for k in ("param_dtype", "reduce_dtype") if getattr(args, k) is None},
            }
        )
    return TrainConfig(
        global_batch=args.global_batch,
        steps=args.steps,
        micro_batch=args.micro_batch,
        budget_bytes=args.budget,
        min_micro_batch=args.min_micro_batch,
        guard=args.guard,
        heads=not args.keep_head,
        activations=not args.keep_activations,
        max_replans=args.max_replans,
        plan=plan,
        policy=args.policy,
        parallel=parallel_from_args(args, command="train"),
        lr=args.lr,
        optimizer=args.optimizer,
        states=args.states,
        normalize=Normalize(args.normalize),
        max_grad_norm=args.max_grad_norm,
        autocast_dtype=AMP_DTYPES.get(args.amp or ""),
        device=args.device,
        dtype=parse_dtype(args.dtype),
        seq_len=args.seq_len,
        seed=args.seed,
        resume=args.resume,
        save=args.save,
        save_every=args.save_every,
        max_skips=args.max_skips,
        progress_jsonl=args.progress_jsonl,
        collective_timeout_s=args.collective_timeout,
    )


def settle(args: argparse.Namespace, out: Output, *, command: str) -> dict[str, Any]:
    """``--model``: given, or the ``--plan`` file's workload (:func:`memfit.cli.common.settle_model`);
    :mod:`memfit.cli.main` calls it before :func:`run`."""
    settle_model(args)
    return {}


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    refuse_host_params(args, command="train")
    result, states = train_with_states(args, out)
    r = result.to_dict()
    if result.rank == 0:
        sizes = sizes_for(
            load_fake_workload(args.model, seq_len=args.seq_len, dtype=parse_dtype(args.dtype), seed=args.seed),
            args.optimizer,
        )
        show_model_states(out, states, sizes)
        r |= states_json(states, sizes)
        out.table(f"trained {result.model}", ["quantity", "value"], _summary_rows(r, result.start_step, args))
        if result.error is not None:
            out.error(result.error)
    else:
        # Only rank 0 prints the JSON that `memfit --json` writes after run() returns.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    return r


def train_with_states(args: argparse.Namespace, out: Output) -> tuple[Any, StatesChoice]:
    """Train with the placement ``--states`` names, or with ``auto``: the plan file's placement with
    ``--plan``, else the fastest that fits ``--budget`` (NOTE [ Choosing the model states' placement ]
    in :mod:`memfit.estimation.states_choice`; without a budget or under data parallelism: device). A
    placement whose auto-fit finds nothing within the budget is left for the next before any step runs;
    a refusal after the fit (a replan that found nothing) ends the run as it would with that placement."""
    if args.states == AUTO and args.plan:
        placed = ModelStates.parse(Plan.load(args.plan).states)
        args.states = placed.value
        reason = f"{placed.value}: the plan file's placement (the plan was made for it)"
        return _train_once(args, out, placed), StatesChoice(states=placed, reason=reason, considered=())
    world = world_size_from_env()
    context = StatesContext(
        micro_steps=2 if args.micro_batch is not None and args.micro_batch < args.global_batch else None,
        max_grad_norm=args.max_grad_norm,
        scaler=args.amp == "fp16",
        parallel=args.parallel or ("ddp" if world > 1 else "local"),  # torchrun without --parallel: DDP
        buildable=MEASURED_STATES,
    )

    def sizes() -> Any:
        wl = load_fake_workload(args.model, seq_len=args.seq_len, dtype=parse_dtype(args.dtype), seed=args.seed)
        return sizes_for(wl, args.optimizer)

    try:
        result, choice = placement_for(
            args, lambda m: _train_once(args, out, m), sizes, command="train", context=context
        )
    except _AfterFit as err:
        raise err.original from None
    args.states = choice.states.value
    return result, choice


class _AfterFit(Exception):
    """A refusal that came after the auto-fit (steps may have run): not a reason to try another placement."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def _train_once(args: argparse.Namespace, out: Output, states: ModelStates) -> Any:
    """One run of :func:`memfit.training.train` with ``states``; a budget refusal after the fit is wrapped
    in :class:`_AfterFit` (only the fit's refusal lets ``auto`` try another placement)."""
    config = config_from_args(with_states(args, states))
    display = _Display(out)
    try:
        with display:
            return train(args.model, config, progress=display)
    except BudgetInfeasibleError as err:
        if display.fit_done:
            raise _AfterFit(err) from err
        raise


class _Aborted(Exception):
    """Stands for a second signal at the progress bar, which then leaves no frame (as on an error)."""


class _Display:
    """Draws :func:`~memfit.training.train`'s events: the auto-fit's spinner, the header, the
    progress bar and warnings (above the bar while it runs). An exception leaving ``train`` clears
    what is open, as ``with`` blocks would."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self._status: Any = None  # the auto-fit's spinner, while it runs
        self._bar_cm: Any = None  # the progress bar's context manager, while the loop runs
        self._bar: Any = None
        self._task: Any = None
        self._console: Any = None  # the bar's console: warnings go there once it existed
        self.fit_done = False  # the auto-fit ended (what follows may have stepped)

    def __enter__(self) -> _Display:
        return self

    def __exit__(self, *exc: Any) -> None:
        for cm in (self._bar_cm, self._status):
            if cm is not None:
                cm.__exit__(*exc)
        self._bar_cm = self._status = None

    def __call__(self, event: TrainEvent) -> None:
        out = self.out
        if isinstance(event, FitStarted):
            self._status = out.console.status("auto-fit ...")
            self._status.__enter__()
        elif isinstance(event, FitProgress):
            if self._status is not None:
                self._status.update(f"auto-fit: {event.message}")
        elif isinstance(event, FitDone):
            self.fit_done = True
            if self._status is not None:
                self._status.__exit__(None, None, None)
                self._status = None
            res = event.fit
            out.print(
                f"auto-fit: micro-batch {res.micro_batch} x {res.accumulation_steps}, {f'policy {res.policy}, ' if res.policy is not None else ''}"
                f"{len(res.plan.recomputed)} blocks recomputed; "
                f"predicted peak {mib(res.predicted_peak_bytes)}, measured {mib(res.measured_peak_bytes)} (budget {mib(event.budget_bytes)})"
            )
            if res.min_micro_batch_reason:
                out.print(f"auto-fit: {res.min_micro_batch_reason}")
        elif isinstance(event, RunStarted):
            out.print(_header(event))
            self._bar_cm = out.progress()
            self._bar = self._bar_cm.__enter__()
            self._console = self._bar.console
            self._task = self._bar.add_task("train", total=event.steps, completed=event.start_step, info="")
        elif isinstance(event, StepDone):
            self._bar.update(
                self._task,
                advance=1,
                info=f"loss {event.result.loss:.4f}  "
                + (f"{event.samples_per_s:.1f} samples/s  " if event.samples_per_s else "")
                + f"peak {mib(event.peak_bytes)}"
                + (f"  skipped {event.skipped_steps}" if event.skipped_steps else "")
                + (f"  replans {event.replans}" if event.replans else ""),
            )
        elif isinstance(event, LoopEnded):
            if self._bar_cm is not None:
                stand_in = _Aborted() if event.aborted else None
                self._bar_cm.__exit__(type(stand_in) if stand_in else None, stand_in, None)
                self._bar_cm = self._bar = None
        elif isinstance(event, Warned):
            if out.json_mode or self._console is None:
                out.warn(event.message)
            else:
                self._console.print(f"[yellow]warning:[/] {escape(event.message)}", soft_wrap=True)
        elif isinstance(event, Signalled):  # inside the signal handler: write the line, nothing more
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"\n{event.message}\n")
                sys.stderr.flush()


def _header(e: RunStarted) -> str:
    return (
        f"[bold]memfit train[/] {e.model}: global batch {e.global_batch} = {e.world_size} rank(s) x "
        f"{e.share} = {e.accumulation_steps} micro-step(s) of {e.micro_batch}"
        + (f", policy {e.policy!r}" if e.policy is not None else "")
        + (f", resumed at step {e.start_step}" if e.resumed else "")
        + (f", lr {e.lr_saved:g} -> {e.lr:g} (--lr)" if e.lr_saved is not None else "")
        + (
            f"; guard: every step under the memory tracker with a limit of {mib(e.guard_limit_bytes)}"
            if e.guard_limit_bytes is not None
            else ""
        )
    )


def _summary_rows(r: dict[str, Any], start: int, args: argparse.Namespace) -> list[tuple[str, str]]:
    def drift(x: float | None) -> str:
        return "" if x is None else f" ({x:+.0%}{', over 10 %' if abs(x) > DRIFT_WARN else ''})"

    def held_late(r: dict[str, Any]) -> str:
        held = (r["collective_held_bytes_by_rank"] or [None])[0]
        return f"; {mib(held)} of it collective buffers gloo's threads freed late" if held else ""

    rows = [
        (
            "steps",
            f"{start} -> {r['end_step']} of {args.steps} ({r['skipped_steps']} windows skipped"
            + "".join(f", {n} {why}" for why, n in r["skip_reasons"].items())
            + ")",
        ),
        (
            "learning rate",
            f"{r['lr']:g}"
            + (
                f" (--lr; the saved state had {r['lr_saved']:g})"
                if r["lr_saved"] is not None and r["lr_saved"] != r["lr"]
                else ""
            ),
        ),
        (
            "replans after out-of-memory",
            str(r["replans"])
            + "".join(
                f"\n window {e['window']}: {mib(e['failed_budget_bytes'])} -> {mib(e['budget_bytes'])}, micro-batch {e['micro_batch_before']} -> {e['micro_batch']}"
                for e in r["replan_events"]
            ),
        ),
        (
            "micro-batch x steps",
            f"{r['micro_batch']} x {r['accumulation_steps']}"
            + (f", policy {r['policy']!r}" if r["policy"] else "")
            + (f", {r['recomputed_blocks']} blocks recomputed" if r["policy"] else "")
            + (f", {r['head']} head" if r["head"] else "")
            + (f", {r['activations']} activations" if r["activations"] else ""),
        ),
        ("final loss", f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-"),
        (
            "samples/s",
            f"{r['samples_per_s']:.1f} (median over timed steps{', guard included' if r['guard'] else ''})"
            if r["samples_per_s"]
            else "-",
        ),
        (
            "peak memory",
            f"{mib(r['measured_peak_bytes'])} measured ({r['peak_measured_by']}), {mib(r['predicted_peak_bytes'])} predicted"
            + drift(r["peak_drift"])
            + held_late(r),
        ),
        (
            "step time",
            (f"{r['measured_step_s'] * 1e3:.0f} ms measured" if r["measured_step_s"] else "- measured")
            + (f", {r['predicted_step_s'] * 1e3:.0f} ms predicted" if r["predicted_step_s"] else "")
            + drift(r["time_drift"])
            + (" (guard included)" if r["guard"] and r["time_drift"] is not None else ""),
        ),
    ]
    if r["guard"]:
        ops = r.get("guard_ops_per_step")
        rows.append(
            (
                "guard",
                f"limit {mib(r['budget_bytes'])}, memory tracker on every step"
                + (f" ({ops} ops per step, ~10 us each: ~{ops * 1e-5 * 1e3:.0f} ms)" if ops else ""),
            )
        )
    if r["warnings"]:
        rows.append(("warnings", str(len(r["warnings"]))))
    return rows
