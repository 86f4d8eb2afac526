"""Choosing micro-batch and plan for a run, and choosing again after running out of memory.

:func:`autofit_replanner` is the replanner ``memfit train --budget`` gives
:class:`~memfit.training.guard.OutOfMemoryGuard`: after an out-of-memory window it answers a
:class:`~memfit.training.guard.Choice` for the guard's tighter budget (NOTE [ Redo after out-of-memory ] in
:mod:`memfit.training.guard`), re-solving the start's auto-fit profiles when it has them (milliseconds: the
guard's redone window is the check, and a second failure tightens again), else running the
auto-fit again on a saved copy of the training state. A tighter budget never needs a larger
micro-batch, so the search stops at the current one.

Example (one process; under ``limit_bytes`` every window runs under the tracker with that limit,
the CPU stand-in for a GPU's out-of-memory; tests/test_training.py runs this)::

    from memfit.accumulate import Accumulator
    from memfit.apply import apply_plan
    from memfit.fitting import autofit
    from memfit.training.guard import OutOfMemoryGuard
    from memfit.training import autofit_replanner, fit_choice

    fit = autofit(wl, budget_bytes, G)                      # micro-batch and plan for the budget
    apply_plan(wl.model, fit.plan)
    acc = Accumulator(wl.model, torch.optim.AdamW(wl.model.parameters()), micro_batch=fit.micro_batch)
    guard = OutOfMemoryGuard(
        acc, model=wl.model, budget_bytes=budget_bytes, limit_bytes=budget_bytes, choice=fit_choice(fit, G),
        replan=autofit_replanner(wl, acc, window_samples=G, fit=fit),
    )
    for batch in batches:                                   # G samples each
        guard.step(batch, wl.loss_fn, count_fn=wl.count_fn)  # an out-of-memory window replans and is redone
    guard.replans                                           # what happened, as memfit.training.guard.Replan values
"""

from __future__ import annotations

from typing import Any

import memfit.fitting as fitting  # called as fitting.autofit: tests stand in for it
from memfit.accumulate import Accumulator
from memfit.capture.snapshot import preserved_state
from memfit.capture.step import StepSpec
from memfit.fitting import FitResult
from memfit.plan.parallel import Parallel
from memfit.plan.policies import Policy
from memfit.plan.types import Plan
from memfit.training.config import TrainConfig
from memfit.training.distributed import Ranks
from memfit.training.events import FitDone, FitProgress, FitStarted, Progress
from memfit.training.guard import Choice, Replanner
from memfit.workload import Workload


def fit_choice(fit: FitResult, window_samples: int) -> Choice:
    """The :class:`~memfit.training.guard.Choice` of an auto-fit, a window being ``window_samples`` samples.

    Args:
        fit: the auto-fit's result.
        window_samples: samples per optimizer step on this process (its share of the global batch).

    Returns:
        The fit's micro-batch and plan, with its predicted peak and seconds per window.
    """
    sps = fit.predicted_samples_per_s
    return Choice(
        micro_batch=fit.micro_batch,
        plan=fit.plan,
        predicted_peak_bytes=fit.predicted_peak_bytes,
        predicted_window_s=window_samples / sps if sps else None,
    )


def autofit_replanner(
    workload: Workload,
    acc: Accumulator,
    *,
    window_samples: int,
    fit: FitResult | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    heads: bool = True,
    activations: bool = True,
    policy: Policy | None = None,
    states: str = "device",
) -> Replanner:
    """``budget_bytes -> Choice``: the auto-fit's answer for a tighter budget, for an
    :class:`~memfit.training.guard.OutOfMemoryGuard`.

    With the start's :class:`~memfit.fitting.FitResult` this is the solver only
    (:meth:`~memfit.fitting.FitResult.resolve`, milliseconds). Without one (a policy plan or a
    fixed micro-batch) the auto-fit runs again on ``workload.model``: it profiles and measures on
    the model itself (its steps change the weights and draw random numbers), and
    :func:`memfit.training.guard.preserved_state` puts weights, optimizer state, RNG and plan back.

    Args:
        workload: the workload being trained; its ``model`` is the unwrapped model the guard redoes.
        acc: the run's Accumulator (its current micro-batch caps the new one).
        window_samples: samples per optimizer step on this process.
        fit: the start's auto-fit, whose profiles are re-solved.
        optimizer: the optimizer's name for a new auto-fit (``adamw``, ``adam``, ``sgd``).
        seed: seed of a new auto-fit's measurements.
        heads: a new plan may replace a causal LM's head (chunked loss).
        activations: a new plan may fuse activation modules.
        policy: a new auto-fit keeps this policy's plan and chooses the micro-batch only (a
            ``fit`` made with a policy keeps it by itself: :meth:`~memfit.fitting.FitResult.resolve`).
        states: the run's model-state placement (:class:`memfit.optim.ModelStates`): a new auto-fit
            measures its steps with it, as the run steps.

    Returns:
        The replanner; it raises :class:`~memfit.errors.BudgetInfeasibleError` when nothing fits.
    """

    def replan(budget_bytes: int) -> Choice:
        if fit is not None and fit.profiles:
            return fit_choice(fit.resolve(budget_bytes, max_micro_batch=acc.micro_batch), window_samples)
        with preserved_state(workload.model, acc.optimizer):
            res = fitting.autofit(
                workload, budget_bytes, window_samples, step=StepSpec(optimizer=optimizer, seed=seed, repeats=1, states=states),
                max_micro_batch=acc.micro_batch, heads=heads, activations=activations, policy=policy,
            )  # fmt: skip
        return fit_choice(res, window_samples)

    return replan


def initial_choice(
    workload: Workload, config: TrainConfig, share: int, dist: Ranks, progress: Progress
) -> tuple[Choice, FitResult | None]:
    """Micro-batch and plan (with the fit's predictions when ``budget_bytes`` is given), and rank 0's fit.

    With a budget, rank 0 runs the auto-fit on its share of the global batch and sends the
    micro-batch, the plan and the predictions to the other ranks, so that every rank runs the same
    plan. The :class:`~memfit.fitting.FitResult` (rank 0 only, else None) keeps the profiles that a
    replan re-solves from.
    """
    if config.budget_bytes is None:
        return Choice(micro_batch=min(config.micro_batch or share, share), plan=None), None
    sent: Any = None
    res = None
    if dist.is_main:
        progress(FitStarted(budget_bytes=config.budget_bytes))
        res = fitting.autofit(
            workload, config.budget_bytes, share, step=StepSpec(optimizer=config.optimizer, seed=config.seed, states=config.states), heads=config.heads,
            activations=config.activations, progress=lambda s: progress(FitProgress(message=s)), policy=config.policy,
            min_micro_batch=config.min_micro_batch,
        )  # fmt: skip
        progress(FitDone(fit=res, budget_bytes=config.budget_bytes))
        sent = _choice_to_wire(fit_choice(res, share))
    return _choice_from_wire(dist.broadcast(sent)), res


def _choice_to_wire(c: Choice) -> tuple[Any, ...]:
    return (c.micro_batch, c.plan.to_dict() if c.plan else None, c.predicted_peak_bytes, c.predicted_window_s)


def _choice_from_wire(w: tuple[Any, ...]) -> Choice:
    micro, plan, peak, window_s = w
    return Choice(
        micro_batch=micro,
        plan=Plan.from_dict(plan) if plan else None,
        predicted_peak_bytes=peak,
        predicted_window_s=window_s,
    )


def planned_peak(
    plan: Plan, parallel: Parallel | None, *, micro_batch: int, accumulation_steps: int
) -> tuple[int | None, list[str]]:
    """The peak a plan file predicts for this run (per rank under ``parallel``), and why not when it does not.

    A plan predicts one micro-step at the batch size it was made for (its fingerprint's batch),
    for the layout in ``plan.parallel`` (``memfit plan --world-size N --parallel ...``) or
    one process; with ``--accumulation-steps K`` also a window of K micro-steps
    (``plan.accumulation_window``). Another micro-batch, layout or accumulation gives None and a
    warning (the run still trains; only the drift check has nothing to compare with).
    """
    if plan.predicted_peak_bytes is None:
        return None, []
    made_for = plan.parallel
    run_for = parallel.to_dict() if parallel is not None else None
    if (made_for or None) != (run_for or None):

        def say(layout: dict[str, Any] | None) -> str:
            return (
                "one process"
                if not layout
                else f"--parallel {layout['kind']} --world-size {layout['world_size']}"
                + ("" if layout.get("reshard_after_forward", True) else " --no-reshard-after-forward")
                + "".join(
                    f" --{k.replace('_', '-')} {layout[k]}" for k in ("param_dtype", "reduce_dtype") if layout.get(k)
                )
            )

        return None, [
            f"the plan predicts a peak for {say(made_for)} and this run is {say(run_for)}: its prediction does not apply "
            "(the plan itself does; make it with the run's layout for a per-rank prediction)"
        ]
    batch = (plan.fingerprint or {}).get("batch") or []
    planned_batch = batch[0]["shape"][0] if batch and batch[0].get("shape") else None
    if planned_batch is not None and planned_batch != micro_batch:
        return None, [
            f"the plan was made for micro-batch {planned_batch} and this run uses {micro_batch}: its predicted peak does not apply"
        ]
    if accumulation_steps == 1:
        return plan.predicted_peak_bytes, []
    acc = plan.accumulation_window
    if acc is not None and acc.steps == accumulation_steps:  # memfit plan --accumulation-steps K
        return acc.predicted_peak_bytes, []
    if plan.accumulation_steps == accumulation_steps:  # memfit fit: the plan's peak is its window's
        return plan.predicted_peak_bytes, []
    if made_for is None:
        return None, []  # one process: the window's peak is measured, as without a plan file
    return None, [
        f"the plan predicts one micro-step and this run accumulates {accumulation_steps}; make it with --accumulation-steps "
        f"{accumulation_steps} for the window's per-rank peak"
    ]
