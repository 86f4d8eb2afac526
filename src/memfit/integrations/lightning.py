"""memfit in Lightning: a plan fitted to a budget, and exact accumulation under automatic optimisation.

Lightning's ``accumulate_grad_batches=k`` divides every micro-batch's loss by ``k``: with token
means over uneven lengths the gradient is off by 23-77 % against the big batch, and a short last
window (the end of an epoch) is scaled by ``n / k`` (``benchmarks/reports/accumulation_gpt2-demo_cpu_2026-12-01.md``). :class:`ExactAccumulation` is a callback that makes the accumulated gradient the big
batch's, with Lightning's own loop, optimizer step, scheduler, logging and checkpoints unchanged::

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model()
            fit = memfit_lightning.fit(self.model, "20GiB", global_batch=32,      # measures,
                                       make_batch=make_batch, loss_fn=loss_fn)    # plan applied
            self.micro_batch, self.accumulation_steps = fit.micro_batch, fit.accumulation_steps

        def training_step(self, batch, batch_idx):
            loss_sum, count = loss_fn(self.model, batch)
            return loss_sum / count                      # this micro-batch's token mean, as usual

    module = LitLM()
    trainer = L.Trainer(accumulate_grad_batches=module.accumulation_steps,
                        callbacks=[memfit_lightning.ExactAccumulation(count_fn=count_tokens)])
    trainer.fit(module, DataLoader(data, batch_size=module.micro_batch))

NOTE [ What ExactAccumulation normalises, and when ]
Lightning forms the windows: ``accumulate_grad_batches`` loader batches, or fewer at the end of an
epoch. For each micro-batch ``i`` the callback counts its valid tokens ``c_i = count_fn(batch)``
(``on_train_batch_start``) and, in ``on_before_backward``, multiplies the loss Lightning is about to
backpropagate (``training_step``'s loss ``/ k``) in place by ``k * W * c_i`` (``loss="mean"``:
``training_step`` returns the micro-batch's token mean ``s_i / c_i``) or by ``k * W``
(``loss="sum"``: it returns ``s_i``), so that micro-step ``i`` backpropagates ``s_i * W``. In
``on_before_optimizer_step`` (after the last backward of the window, after AMP's unscale and before
Lightning's gradient clipping and the step) it sums the counts of the window's micro-steps over all
``W`` processes (one all-reduce of one number) and divides the gradients by that total ``N``. DDP
averages gradients over processes, so the result is ``sum(s_i over the window and processes) / N``:
the big batch's token-mean gradient, exact up to rounding for any lengths, for the short last window
(``N`` counts the micro-steps that ran), and for windows where ``training_step`` returned None
(skipped micro-steps are not counted). This is memfit's deferred normalisation (NOTE [ Normalisation ]
in :mod:`memfit.accumulate`, the path without ``count_fn``), because Lightning gives a callback
no way to read a window's batches before its first backward.

What stays as without memfit: ``global_step`` (one per window), ``max_steps``, LR schedulers,
gradient clipping, the loss Lightning logs and shows (it is cloned before ``on_before_backward``),
and checkpoints (a plan changes forwards only: ``state_dict`` keys are the plain model's).

Known limitations:
    - Callbacks listed before this one that read gradients in ``on_before_optimizer_step`` see them
      before the division (the module's own hook runs after every callback and sees them divided).
    - ``loss="mean"`` with a micro-batch without valid tokens: its mean is 0/0; the callback raises
      unless the loss is finite (return ``s / max(c, 1)`` or use ``loss="sum"``).
    - fp16 with a GradScaler: backward carries loss sums rather than means, so the scaler may back
      off once or twice more at the start.
    - Strategies that average gradients over a data-parallel group smaller than the world
      (``ModelParallelStrategy``) and DeepSpeed (its engine owns backward) are refused. DDP on 2
      processes (gloo) is tested; Lightning's FSDP strategy is expected to work the same way
      (it averages over the world too) but was not run (no GPU).
    - Lightning's own DistributedSampler shuffles a training loader even when it was built with
      ``shuffle=False``; that is Lightning's choice, not memfit's, and changes which samples share
      a window (not the exactness of each window).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit.errors import MemfitError, SpecError
from memfit.integrations._fit import fit_and_apply
from memfit.plan.parallel import Parallel, ParallelKind
from memfit.plan.policies import Policy
from memfit.workload import Batch, LossOutput

# Importing Lightning draws from Python's global `random` (a user's seeded sequence moved on by
# importing memfit's integration); the state is put back. The environment variables its import sets
# (PYTORCH_NVML_BASED_CUDA_CHECK, TORCHINDUCTOR_CACHE_DIR) stay: Lightning's Trainer relies on them.
_random_state = random.getstate()
try:
    from lightning.pytorch import Callback
except ImportError as err:  # the optional extra
    raise MemfitError(
        "memfit.integrations.lightning: lightning is not installed (the `lightning` package, 2.2 or "
        "newer). Install it with `pip install memfit[lightning]`."
    ) from err
finally:
    random.setstate(_random_state)
    del _random_state

__all__ = ["ExactAccumulation", "fit"]

_NOT_PLACED = (
    "Lightning builds and steps the optimizer of configure_optimizers after the backward, and clips the device "
    "gradients"
)


def fit(
    model: nn.Module,
    budget: int | str,
    *,
    global_batch: int,
    make_batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Batch], LossOutput],
    count_fn: Callable[[Batch], Any] | None = None,
    blocks: str | None = None,
    device: torch.device | str | None = None,
    max_micro_batch: int | None = None,
    min_micro_batch: int | None = None,
    optimizer: str = "adamw",
    policy: Policy | str | None = None,
    states: str = "auto",
) -> Any:
    """Choose micro-batch, accumulation steps and checkpoint plan for a budget; apply the plan.

    Call it where the model is built (``LightningModule.__init__`` or ``configure_model``). It
    measures ``model`` (on ``device``, default where the model is; a copy when it must move), leaves
    its weights, buffers and RNGs bitwise as they were, and applies the plan
    to ``model`` in place: forwards only, ``state_dict`` keys unchanged, so checkpoints load into
    the plain model. Use ``fit.micro_batch`` as the loader's batch size and
    ``fit.accumulation_steps`` as ``Trainer(accumulate_grad_batches=...)``; Lightning's window is
    then ``micro_batch * accumulation_steps`` samples (``global_batch`` rounded up when
    ``micro_batch`` does not divide it).

    Under several processes the choice must be the same on every rank (it depends on measured
    times). Called where ``torch.distributed`` is initialised (``configure_model`` under DDP, or
    after ``torch.distributed.init_process_group`` before building the Trainer, which then uses
    that group), rank 0 measures and broadcasts its result, planned for one DDP rank: its step
    plus DDP's gradient buckets (the trainable parameters' bytes; NOTE [ Per-rank accounting ] in
    :mod:`memfit.plan.parallel`), ``budget`` per process (under FSDP an overestimate). In ``__init__`` (before Lightning starts the process
    group) each process would measure on its own: there, fit once (one process, or before
    launching) and give every process the same plan (``memfit.apply_plan(model,
    Plan.from_dict(saved))``) and micro-batch, as ``tests/integration_lightning_worker.py`` does.

    Args:
        model: the ``nn.Module`` whose blocks to plan (e.g. ``self.model``; a LightningModule
            itself works when ``loss_fn`` calls it).
        budget: peak memory of a training step per device: bytes or a size such as ``"20GiB"``.
        global_batch: samples per optimizer step per device.
        make_batch: ``batch_size -> batch`` of representative samples (lengths as in training).
        loss_fn: ``(model, batch) -> (loss_sum, count)`` or a mean loss.
        count_fn: ``batch -> valid tokens`` (optional).
        blocks: dotted path of the module list holding the blocks (default: discovered).
        device: where to measure (default: where ``model`` is).
        max_micro_batch: largest micro-batch considered.
        min_micro_batch: smallest micro-batch considered (default: the smallest the model runs in
            train mode; BatchNorm refuses 1).
        optimizer: optimizer whose state the budget holds (``adamw``, ``adam``, ``sgd``).
        policy: keep this checkpoint policy's plan (``"all"``, ``"every:2"``, ``Sqrt()``, ...:
            :mod:`memfit.plan.policies`) and fit only micro-batch and accumulation steps to the budget.
        states: ``"auto"`` (default) or ``"device"``: the model states stay on the device, where
            Lightning's optimizer step, clipping and precision plugin read them; when they do not fit
            the refusal names every placement and why Lightning's loop cannot use it
            (NOTE [ Model states in a framework's loop ] in :mod:`memfit.integrations._fit`).

    Returns:
        The :class:`memfit.fitting.FitResult` (``plan`` applied to ``model``).

    Raises:
        BudgetInfeasibleError: no plan fits (the message names each placement of the model states and why).
    """
    return fit_and_apply(
        model,
        budget,
        global_batch=global_batch,
        make_batch=make_batch,
        loss_fn=loss_fn,
        count_fn=count_fn,
        blocks=blocks,
        device=device,
        max_micro_batch=max_micro_batch,
        min_micro_batch=min_micro_batch,
        optimizer=optimizer,
        policy=policy,
        parallel=_ddp_rank(),
        states=states,
        framework=("memfit.integrations.lightning", _NOT_PLACED),
    )


def _ddp_rank() -> Parallel | None:
    """One DDP rank of the initialised process group (Lightning's ``strategy="ddp"``), if any."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return Parallel(kind=ParallelKind.DDP, world_size=dist.get_world_size())


class ExactAccumulation(Callback):
    """A Lightning ``Callback``: exact token-normalised accumulation under automatic optimisation.

    See NOTE [ What ExactAccumulation normalises, and when ] in this module.

    Args:
        count_fn: ``batch -> number of valid tokens`` of a micro-batch: exactly what
            ``training_step``'s loss averages (``loss="mean"``) or sums (``loss="sum"``) over, e.g.
            the shifted labels that are not -100 for a causal LM.
        loss: what ``training_step`` returns: ``"mean"``, the micro-batch's token mean (default,
            what HF models' ``.loss`` is), or ``"sum"``, the summed token loss.

    Attributes:
        last_count: valid tokens of the last window over all processes (the normaliser).

    Raises:
        SpecError: ``loss`` is neither ``"mean"`` nor ``"sum"``.
        MemfitError: at ``setup``: manual optimisation, DeepSpeed or ``ModelParallelStrategy``.
    """

    def __init__(self, count_fn: Callable[[Batch], Any], *, loss: str = "mean") -> None:
        if loss not in ("mean", "sum"):
            raise SpecError(
                f"memfit.integrations.lightning: loss={loss!r}; use 'mean' or 'sum' (what training_step returns)."
            )
        super().__init__()
        self.count_fn = count_fn
        self.loss = loss
        self._pending: float | None = None  # the count of the micro-batch about to run
        self._window_count = 0.0  # valid tokens of the window's backpropagated micro-steps
        self.last_count: float | None = None  # the last window's count over all processes

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise MemfitError(
                "memfit.integrations.lightning: ExactAccumulation works with automatic "
                "optimisation, and this module sets automatic_optimization = False. Drop the "
                "callback and use memfit.Accumulator(model, self.optimizers(), ...) in "
                "training_step (pass self.optimizers(), not the raw optimizer, or global_step stays 0)."
            )
        name = type(trainer.strategy).__name__
        if "DeepSpeed" in name or name == "ModelParallelStrategy":
            raise MemfitError(
                f"memfit.integrations.lightning: strategy {name} is not supported by "
                "ExactAccumulation (DeepSpeed runs backward in its engine; ModelParallelStrategy "
                "averages gradients over a data-parallel group smaller than the world). Use DDP "
                "or FSDP, or drop the callback."
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._pending = float(self.count_fn(batch))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._pending is None:
            raise MemfitError(
                "memfit.integrations.lightning: a backward ran without on_train_batch_start "
                "counting its batch; ExactAccumulation supports the training loop's backward "
                "only (automatic optimisation)."
            )
        count, self._pending = self._pending, None
        if self.loss == "mean" and count == 0 and not bool(torch.isfinite(loss.detach())):
            raise MemfitError(
                "memfit.integrations.lightning: a micro-batch has no valid tokens, so its token "
                "mean is 0/0 (the loss is not finite). Return loss_sum / max(count, 1) from "
                "training_step, or the summed loss with ExactAccumulation(..., loss='sum')."
            )
        # Lightning divides by accumulate_grad_batches; make this micro-step's loss s_i * W.
        factor = trainer.accumulate_grad_batches * trainer.world_size
        if self.loss == "mean":
            factor *= count
        # In place and recorded by autograd: Lightning backpropagates this very tensor (its logged
        # copy was cloned before this hook).
        loss.mul_(factor)
        self._window_count += count

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        total = torch.tensor(self._window_count, dtype=torch.float64, device=pl_module.device)
        total = float(trainer.strategy.reduce(total, reduce_op="sum"))
        self._window_count = 0.0
        self.last_count = total
        factor = 1.0 / max(total, 1.0)  # a window without valid tokens has a zero gradient
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)
