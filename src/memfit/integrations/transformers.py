"""memfit for HF ``Trainer``, TRL's trainers (``SFTTrainer``) and PEFT models: one call before ``train()``.

Example:
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)  # doctest: +SKIP
    >>> fitted = memfit.integrations.transformers.fit(trainer, budget="20GiB")           # doctest: +SKIP
    >>> trainer.train()                                                                    # doctest: +SKIP
    >>> fitted.remove()   # plain forwards and the model's use_cache again (e.g. to generate) # doctest: +SKIP

:func:`fit` translates Trainer's knobs into memfit's library calls and holds no planning or
accumulation logic of its own (NOTE [ What fit changes ]). With ``budget=`` it plans with
:func:`memfit.fitting.autofit`, which leaves the model's weights bitwise as they were (micro-batch x
accumulation steps x checkpoint plan, the per-device global batch ``per_device_train_batch_size * gradient_accumulation_steps`` kept) and
sets Trainer's two batch arguments from it; with ``plan=`` or ``policy=`` it applies that plan and
leaves the batch arguments alone.

NOTE [ What fit changes ]
- ``args.per_device_train_batch_size`` and ``args.gradient_accumulation_steps`` (budget only): the
  fit's micro-batch ``b`` and steps ``k`` with ``b * k`` equal to the per-device global batch
  before (auto-fit is asked for micro-batches that divide it: Trainer's data loader cannot make a
  short last micro-batch).
- Trainer's own activation checkpointing (``gradient_checkpointing`` /
  ``activation_checkpointing``, on by default in TRL's configs) is turned off, on the arguments and
  on the model, with a warning: memfit's plan replaces it (both would checkpoint every block twice).
- ``config.use_cache`` is set to False on the model's configs while the plan is applied (a cache
  filled in the forward is appended to again by a recompute) and restored by :meth:`TrainerFit.remove`.
- Exact loss (NOTE [ Exact loss in Trainer ]): Trainer's ``num_items_in_batch`` is made to count the
  tokens the loss sums over, ``average_tokens_across_devices`` is set to True, and a self-check
  compares Trainer's count with the batch's on one batch before training.
- ``remove_unused_columns``: Trainer's signature columns are read from the model's own forward before
  the plan is applied (a chunked head installs a ``forward(*args, **kwargs)``, and Trainer would then
  drop ``input_ids``); Trainer caches them in ``trainer._signature_columns`` for the whole run.
- Nothing for a subclass's ``compute_loss``: a wrong normalisation is refused (NOTE [ A compute_loss
  of the user's ]).
- DDP: ``find_unused_parameters=False`` unless the user set it (Trainer's default turns it on for a
  model without HF checkpointing, an extra graph walk per step; memfit's non-reentrant recompute
  needs no unused-parameter search, and works with it too when set).
- The model's forwards (:func:`memfit.apply_plan`; ``state_dict`` keys unchanged, so checkpoints
  saved by Trainer load into the plain model).

NOTE [ Exact loss in Trainer ]
For each optimizer step Trainer fetches the ``k`` micro-batches of the window, counts
``num_items_in_batch`` (valid labels of the whole window, summed over ranks when
``average_tokens_across_devices``) and passes it to the model's loss, which then returns
``sum / num_items``; ``compute_loss`` multiplies by the number of processes (DDP averages). The sum
over micro-steps and ranks is the big batch's loss, exactly, when the count is the number of terms
the loss sums over. transformers 5.24 counts ``labels[..., 1:]`` only when the model's ``loss_type``
maps to ``ForCausalLMLoss``; ``GPT2LMHeadModel`` has ``loss_type=None`` (its ``loss_function`` falls
back to ``ForCausalLMLoss``, which shifts), so Trainer counted one label per row too many: the
gradient came out scaled by 0.940 (benchmarks/accumulation.py). TRL's fused LM head shifts labels
too. :func:`fit` sets Trainer's rule from the loss function the model actually resolves
(``trainer._loss_shifts_labels``) and checks the result on a real batch; a model whose forward
takes no ``**kwargs`` gets no ``num_items_in_batch`` and Trainer averages per micro-batch means
(warned: inexact with variable lengths).

NOTE [ The step fit plans ]
With ``budget=`` the step measured is the one Trainer runs: its collator's batches, the model as
Trainer holds it (PEFT adapters included, HF checkpointing off as memfit replaces it), Trainer's own
``compute_loss`` (a subclass's, TRL's fused LM head and its metrics) under Trainer's autocast
(``bf16=True``, TRL's default: a step planned in float32 is larger than the one TRL runs). What
``compute_loss`` logs while planning (TRL's token and metric tallies) is put back. Under several
processes rank 0 plans one DDP rank: its step plus DDP's gradient buckets (the trainable parameters'
bytes, NOTE [ Per-rank accounting ] in :mod:`memfit.plan.parallel`), and since ``compute_loss`` may
gather metrics over ranks (TRL's does), rank 0 runs the model's loss (or ``compute_loss_func``)
itself, under the same autocast.

NOTE [ A compute_loss of the user's ]
Trainer divides a micro-batch's loss by ``gradient_accumulation_steps`` unless it counts as
normalised by ``num_items_in_batch`` (``loss_is_scaled_for_ga``, or by default when the model takes
``**kwargs`` or a ``compute_loss_func`` is given). A subclass whose ``compute_loss`` returns its own
mean under that default trains with gradients about ``k`` times too large; one that normalises
by ``num_items_in_batch`` with ``loss_is_scaled_for_ga = False``, ``k`` times too small. :func:`fit` calls such a ``compute_loss`` twice on one batch, with ``num_items_in_batch``
``n`` and ``2 n`` (eval mode, no gradients, model and RNGs left as they were): a loss that halves
honours it, one that stays is a mean of its own. It refuses the two cases above with the fix and
warns when the window's gradient is a mean of micro-batch means (not the big batch's with
variable-length batches). Trainer's and TRL's own ``compute_loss`` are not probed (their count is
checked by NOTE [ Exact loss in Trainer ]).

Known limitations:
    - Planning (``budget=``) builds its example batches from the first 256 samples of
      ``trainer.train_dataset`` through Trainer's collator, longest first: a longer sample later in
      the data set is not planned for. Pass ``make_batch=`` to plan for other shapes.
    - Under several processes rank 0 plans (on its own device, for its own budget) and broadcasts
      the result: every rank runs the same micro-batch, steps and plan. The run that checks the
      choice (``fit.measured_peak_bytes``) is rank 0's step without DDP, so without its buckets
      (the prediction has them).
    - The probe of a subclass's ``compute_loss`` cannot tell whether it multiplies by the number of
      processes as ``Trainer.compute_loss`` does (DDP averages gradients over ranks).
    - DeepSpeed, FSDP (use FSDP's own checkpointing), ``nn.DataParallel`` and
      ``auto_find_batch_size`` are refused.
    - The budget covers AdamW's state unless Trainer's optimizer is Adam or SGD.

size: the Trainer, TRL and PEFT adapters share one callback and its NOTE.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.apply import apply_plan, is_applied, remove_plan
from memfit.capture.snapshot import leave_unchanged
from memfit.errors import MemfitError, SpecError
from memfit.fitting.result import FitResult
from memfit.integrations._fit import ddp_layout, fit_and_apply
from memfit.integrations._tokens import base_model as _base_model
from memfit.integrations._tokens import loss_shifts_labels
from memfit.plan import Plan, policy_plan
from memfit.plan.policies import Policy, parse_policy
from memfit.units import format_bytes, parse_size
from memfit.workload import Batch

__all__ = ["MemfitTrainerWarning", "TrainerFit", "fit"]

_EXTRA_HINT = "pip install 'memfit[transformers]'"
_SAMPLES_SCANNED = 256
_LOGGED = ("_metrics", "_total_train_tokens")  # what TRL's compute_loss adds to as it runs


class MemfitTrainerWarning(UserWarning):
    """fit() changed a Trainer setting, or the run will not be exact (the message says which)."""


@dataclass
class TrainerFit:
    """What :func:`fit` did to a Trainer; :meth:`remove` undoes the model side.

    Attributes:
        plan: the applied plan.
        micro_batch: ``per_device_train_batch_size`` now.
        accumulation_steps: ``gradient_accumulation_steps`` now.
        global_batch: samples per optimizer step on this process (``micro_batch * accumulation_steps``).
        fit: the auto-fit result (``budget=`` only), with predicted and measured peak bytes.
        notes: every setting fit changed, one line each (also given as warnings).
    """

    plan: Plan
    micro_batch: int
    accumulation_steps: int
    global_batch: int
    fit: Any = None
    notes: list[str] = field(default_factory=list)
    _trainer: Any = field(default=None, repr=False)
    _use_cache: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    _callback: Any = field(default=None, repr=False)

    def remove(self) -> None:
        """Remove the plan and restore the model's ``use_cache``; Trainer's arguments stay as set."""
        model = self._trainer.model
        remove_plan(model)
        for cfg, value in self._use_cache:
            cfg.use_cache = value
        self._use_cache.clear()
        if self._callback is not None:
            self._trainer.remove_callback(self._callback)
            self._callback = None


def fit(
    trainer: Any,
    *,
    budget: str | int | None = None,
    plan: Plan | None = None,
    policy: Policy | str | None = None,
    make_batch: Callable[[int], Batch] | None = None,
    heads: bool | None = None,
    measure: bool = True,
    repeats: int = 2,
    margin: float = 0.02,
    progress: Callable[[str], None] | None = None,
    states: str = "auto",
) -> TrainerFit:
    """Plan (or take) a checkpoint plan for a Trainer's model and set the Trainer up for it.

    Call it after building the Trainer and before ``trainer.train()``. Give ``budget`` (with or
    without ``policy``), ``plan`` or ``policy``.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass: TRL's ``SFTTrainer``), whose model may
            be a PEFT model.
        budget: peak memory of a whole training step per device (``"20GiB"`` or bytes): micro-batch,
            accumulation steps and plan are chosen for it by :func:`memfit.fitting.autofit` (the
            model's weights, buffers and RNGs are left bitwise as they were), keeping
            ``per_device_train_batch_size * gradient_accumulation_steps``.
        plan: a plan to apply as it is (e.g. from ``memfit plan --out``); batch arguments unchanged.
        policy: ``"all"``, ``"every:K"``, ``Sqrt()``, ...: :func:`memfit.policy_plan` for the
            model; with ``budget`` the fit keeps that plan and chooses only micro-batch and
            accumulation steps for it.
        make_batch: ``batch_size -> batch`` as the collator makes it, for planning (default: the
            longest samples of the training set through Trainer's collator).
        heads: let the planner use memfit's chunked LM head (default: when the loss is the
            model's own and nothing else replaced the model's forward, e.g. TRL's fused LM head).
        measure: run the fit's choice for real before accepting it (``budget`` only).
        repeats: timed repeats while profiling (``budget`` only).
        states: ``"auto"`` (default) or ``"device"`` (``budget`` only): the model states stay on the
            device, where Trainer's optimizer steps them; when they do not fit the refusal names every
            placement and why Trainer cannot use it (NOTE [ Model states in a framework's loop ] in
            :mod:`memfit.integrations._fit`).
        margin: the planner's safety margin on predicted peaks.
        progress: called with a short text as planning advances.

    Returns:
        A :class:`TrainerFit`; its :meth:`~TrainerFit.remove` restores the model.

    Raises:
        SpecError: none of budget/plan/policy, ``plan`` with another, or a setting memfit
            cannot work with (the message gives the fix).
        BudgetInfeasibleError: no micro-batch fits the budget.
        MemfitError: the Trainer is already training, its token count is not the loss's, or its
            ``compute_loss`` would scale the gradients by the accumulation steps (NOTE [ A
            compute_loss of the user's ]).
    """
    transformers = _import_transformers()
    policy = _checked_request(trainer, transformers, budget, plan, policy, states)
    model: nn.Module = trainer.model
    args = trainer.args
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)

    # Model side first, so that the copy planned on is the model as it will train.
    _take_over_checkpointing(trainer, note)
    use_cache = _disable_use_cache(model)
    if use_cache:
        note(
            "config.use_cache set to False while the plan is applied (a recompute would append to the cache); TrainerFit.remove() restores it."
        )
    # Columns from the model's own forward, before a plan can install forward(*args, **kwargs).
    if hasattr(trainer, "_set_signature_columns_if_needed"):
        trainer._set_signature_columns_if_needed()
    make = make_batch or _dataset_batches(trainer)
    shifts = _loss_shifts_labels(trainer)
    batch_args = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    try:
        fitted = None
        if budget is not None:
            plan, fitted = _autofit(
                trainer,
                parse_size(budget),
                make,
                heads=heads,
                measure=measure,
                repeats=repeats,
                margin=margin,
                progress=progress,
                policy=policy,
                states=states,
            )
            _set_batch(trainer, fitted, note)
        elif policy is not None:
            plan = policy_plan(model, policy)
        assert plan is not None
        apply_plan(model, plan)  # first: a plan made for another model is refused before more changes
        _exact_loss(trainer, make, shifts, note)
        _check_compute_loss(trainer, make, note)
        _ddp_settings(trainer, note)
    except BaseException:
        _undo(trainer, use_cache, batch_args)
        raise
    result = TrainerFit(
        plan=plan,
        micro_batch=args.per_device_train_batch_size,
        accumulation_steps=args.gradient_accumulation_steps,
        global_batch=args.per_device_train_batch_size * args.gradient_accumulation_steps,
        fit=fitted,
        notes=notes,
        _trainer=trainer,
        _use_cache=use_cache,
    )
    result._callback = _guard_callback(transformers)(result)
    trainer.add_callback(result._callback)
    for text in notes:  # raised here, so that they point at the caller's fit() line
        warnings.warn(f"memfit.integrations.transformers: {text}", MemfitTrainerWarning, stacklevel=2)
    return result


# --- the steps of fit ------------------------------------------------------------------------------


def _checked_request(
    trainer: Any, transformers: Any, budget: Any, plan: Plan | None, policy: Policy | str | None, states: str
) -> Policy | None:
    """fit()'s arguments and the Trainer checked before anything changes; the policy parsed."""
    if (budget, plan, policy) == (None, None, None) or (plan is not None and (budget, policy) != (None, None)):
        raise SpecError(
            "memfit.integrations.transformers: pass budget= (with policy= to keep a policy's plan), plan= (applied as it is) "
            "or policy= to fit(); plan= takes neither of the others."
        )
    parsed = parse_policy(policy) if policy is not None else None  # a bad text fails before the Trainer is changed
    if states != "auto" and budget is None:
        raise SpecError(
            f"memfit.integrations.transformers: states={states!r} places the model states for a budget; add "
            "budget=, or leave out states=."
        )
    if not isinstance(trainer, transformers.Trainer):
        raise SpecError(
            f"memfit.integrations.transformers: fit() takes a transformers.Trainer, got {type(trainer).__name__}."
        )
    _check_setup(trainer)
    return parsed


def _set_batch(trainer: Any, fitted: FitResult, note: Callable[[str], None]) -> None:
    """The Trainer's micro-batch and accumulation steps set to the fit's, said when they change."""
    args = trainer.args
    old = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    args.per_device_train_batch_size = fitted.micro_batch
    args.gradient_accumulation_steps = fitted.accumulation_steps
    trainer._train_batch_size = args.train_batch_size  # Trainer's copy, read by its data loader
    if old != (fitted.micro_batch, fitted.accumulation_steps):
        note(
            f"per_device_train_batch_size x gradient_accumulation_steps {old[0]} x {old[1]} -> "
            f"{fitted.micro_batch} x {fitted.accumulation_steps} for {format_bytes(fitted.budget_bytes)} "
            f"(predicted peak {format_bytes(fitted.predicted_peak_bytes)}"
            + (f", measured {format_bytes(fitted.measured_peak_bytes)}" if fitted.measured_peak_bytes else "")
            + ")."
        )


def _undo(trainer: Any, use_cache: Any, batch_args: tuple[int, int]) -> None:
    """What fit() changed, put back after a failure: the plan, use_cache, the batch arguments."""
    if is_applied(trainer.model):
        remove_plan(trainer.model)
    for cfg, value in use_cache:
        cfg.use_cache = value
    args = trainer.args
    args.per_device_train_batch_size, args.gradient_accumulation_steps = batch_args
    trainer._train_batch_size = args.train_batch_size


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise MemfitError(
            f"memfit.integrations.transformers needs transformers ({err}). Install it: {_EXTRA_HINT}."
        ) from None
    return transformers


def _check_setup(trainer: Any) -> None:
    args = trainer.args
    model = trainer.model
    if is_applied(model):
        raise MemfitError(
            "memfit.integrations.transformers: the Trainer's model already has a memfit plan. Call fit() once per Trainer, or TrainerFit.remove() first."
        )
    if trainer.model_wrapped is not model:
        raise MemfitError(
            f"memfit.integrations.transformers: the Trainer's model is already wrapped ({type(trainer.model_wrapped).__name__}): "
            "fit() must run before trainer.train()."
        )
    refused = {
        "DeepSpeed": getattr(trainer, "is_deepspeed_enabled", False),
        "FSDP (use fsdp_config['activation_checkpointing'])": getattr(trainer, "is_fsdp_enabled", False),
        "nn.DataParallel (several GPUs in one process; launch with torchrun)": getattr(args, "n_gpu", 1) > 1,
        "auto_find_batch_size=True (memfit chooses the batch; set it to False)": getattr(
            args, "auto_find_batch_size", False
        ),
        "model_init= (train() builds a new model; pass model= instead)": getattr(trainer, "model_init", None)
        is not None,
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise SpecError(f"memfit.integrations.transformers: fit() does not support {', '.join(bad)}.")


def _take_over_checkpointing(trainer: Any, note: Callable[[str], None]) -> None:
    args = trainer.args
    flags = [n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, False)]
    if flags:
        for n in flags:
            setattr(args, n, False)
        note(
            f"TrainingArguments.{flags[0]}=True turned off: memfit's plan replaces HF checkpointing (both would checkpoint blocks twice)."
        )
    base = _base_model(trainer.model)
    if _hf_checkpointing(base):
        disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
        disable()
        note("the model's HF gradient checkpointing was enabled and is now disabled: memfit's plan replaces it.")


def _hf_checkpointing(model: nn.Module) -> bool:
    """True when HF's own activation checkpointing is on (``is_gradient_checkpointing`` before 5.x)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def _disable_use_cache(model: nn.Module) -> list[tuple[Any, Any]]:
    """Set ``use_cache=False`` on every config in the model (T5 keeps a copy per stack); return what to restore."""
    changed: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen or not getattr(cfg, "use_cache", False):
            continue
        seen.add(id(cfg))
        changed.append((cfg, cfg.use_cache))
        cfg.use_cache = False
    return changed


def _trl_fused_head(model: nn.Module) -> bool:
    """True when TRL's fused LM head replaced the model's forward (it takes ``fused_lm_head=``)."""
    fwd = _base_model(model).__dict__.get("forward")
    code = getattr(getattr(fwd, "__func__", fwd), "__code__", None)
    return code is not None and "fused_lm_head" in code.co_varnames


def _loss_shifts_labels(trainer: Any) -> bool:
    """Whether the loss Trainer will run predicts ``labels[:, t + 1]`` at position ``t``."""
    return _trl_fused_head(trainer.model) or bool(loss_shifts_labels(trainer.model))


def _loss_fn(trainer: Any) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """The loss of one batch as the Trainer computes it, for planning (NOTE [ The step fit plans ])."""
    fused = _trl_fused_head(trainer.model)
    loss_func = getattr(trainer, "compute_loss_func", None)
    own = trainer.args.world_size == 1

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs = dict(batch)
        with trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            if own:
                return trainer.compute_loss(model, inputs)
            if fused:
                inputs.update(fused_lm_head=True, use_cache=False)
            if loss_func is not None and "labels" in inputs:
                labels = inputs.pop("labels")
                return loss_func(model(**inputs), labels)
            out = model(**inputs)
        return out["loss"] if isinstance(out, Mapping) else out[0]

    return loss_fn


@contextmanager
def _logs_kept(trainer: Any) -> Iterator[None]:
    """Undo what planning's calls of ``compute_loss`` logged (TRL's token and metric tallies)."""
    kept = {k: copy.deepcopy(getattr(trainer, k)) for k in _LOGGED if hasattr(trainer, k)}
    try:
        yield
    finally:
        for k, v in kept.items():
            setattr(trainer, k, v)


def _own_compute_loss(trainer: Any) -> bool:
    """True when ``compute_loss`` is transformers' or TRL's, not one of the user's subclass."""
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    return owner.__module__.split(".")[0] in ("transformers", "trl")


def _dataset_batches(trainer: Any) -> Callable[[int], Batch]:
    """``make_batch`` from the training set: the longest of the first samples, through the collator."""
    ds = trainer.train_dataset
    if ds is None:
        raise SpecError(
            "memfit.integrations.transformers: the Trainer has no train_dataset to plan with; pass make_batch= to fit()."
        )
    if hasattr(ds, "__len__") and hasattr(ds, "__getitem__"):
        samples = [ds[i] for i in range(min(len(ds), _SAMPLES_SCANNED))]
    else:
        samples = list(itertools.islice(iter(ds), _SAMPLES_SCANNED))
    if not samples:
        raise SpecError("memfit.integrations.transformers: the training set is empty.")
    samples.sort(key=_sample_length, reverse=True)
    get_collator = getattr(trainer, "_get_collator_with_removed_columns", None)
    collate = get_collator(trainer.data_collator, "training") if get_collator else trainer.data_collator

    def make_batch(batch_size: int) -> Batch:
        return collate([samples[i % len(samples)] for i in range(batch_size)])

    return make_batch


def _sample_length(sample: Any) -> int:
    values = sample.values() if isinstance(sample, Mapping) else [sample]
    return max((len(v) for v in values if hasattr(v, "__len__") and not isinstance(v, str)), default=0)


def _optimizer_name(trainer: Any) -> str:
    opt = trainer.optimizer
    if opt is not None:
        return {torch.optim.SGD: "sgd", torch.optim.Adam: "adam"}.get(type(opt), "adamw")
    optim = trainer.args.optim
    return "sgd" if str(getattr(optim, "value", optim)).startswith("sgd") else "adamw"


def _autofit(
    trainer: Any,
    budget_bytes: int,
    make_batch: Callable[[int], Batch],
    *,
    heads: bool | None,
    measure: bool,
    repeats: int,
    margin: float,
    progress: Callable[[str], None] | None,
    policy: Policy | None = None,
    states: str = "auto",
) -> tuple[Plan, Any]:
    args = trainer.args
    model = trainer.model
    if heads is None:
        # memfit's chunked head replaces the model's loss path: only where the loss is the model's
        # own and the forward is the class's (TRL's fused LM head already chunks the loss).
        heads = (
            getattr(trainer, "compute_loss_func", None) is None
            and getattr(trainer, "label_smoother", None) is None
            and _own_compute_loss(trainer)
            and "forward" not in _base_model(model).__dict__
        )
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    # Under several processes rank 0 plans and the others take its choice (_fit): every rank must
    # run the same micro-batch and accumulation steps. autofit measures the model itself and leaves
    # it bitwise as it was: no copy of the model on the device Trainer placed it on.
    with _logs_kept(trainer):
        result = fit_and_apply(
            model,
            budget_bytes,
            global_batch=global_batch,
            make_batch=make_batch,
            loss_fn=_loss_fn(trainer),
            apply=False,
            name=f"trainer:{type(_base_model(model)).__name__}",
            optimizer=_optimizer_name(trainer),
            seed=args.seed,
            repeats=repeats,
            margin=margin,
            measure=measure,
            even=True,
            heads=heads,
            progress=progress,
            policy=policy,
            parallel=ddp_layout(trainer.accelerator),
            states=states,
            framework=(
                "memfit.integrations.transformers",
                "Trainer builds its own optimizer and steps it after the backward (its gradient clipping reads "
                "the device gradients)",
            ),
        )
    assert result is not None
    return result.plan, result


def _exact_loss(trainer: Any, make_batch: Callable[[int], Batch], shifts: bool, note: Callable[[str], None]) -> None:
    args = trainer.args
    if hasattr(trainer, "_loss_shifts_labels") and trainer._loss_shifts_labels != shifts:
        trainer._loss_shifts_labels = shifts
        note(
            f"Trainer counted num_items_in_batch over {'all' if shifts else 'shifted'} labels, but "
            f"{type(_base_model(trainer.model)).__name__}'s loss {'shifts' if shifts else 'does not shift'} them; "
            "now counted as the loss sums (NOTE [ Exact loss in Trainer ])."
        )
    if not getattr(args, "average_tokens_across_devices", True):
        args.average_tokens_across_devices = True
        note("average_tokens_across_devices set to True: the loss is normalised by the tokens of all ranks.")
    # Self-check on a real batch: Trainer's count against the batch's.
    batch = make_batch(2)
    _, counted = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    if counted is None:
        note(
            f"{type(_base_model(trainer.model)).__name__}.forward takes no **kwargs, so Trainer passes it no "
            "num_items_in_batch and averages each micro-batch's mean loss: not the big batch's gradient with "
            "variable-length batches. Pass compute_loss_func= (it receives num_items_in_batch)."
        )
        return
    labels = batch.get("shift_labels") if "shift_labels" in batch else batch.get("labels")
    if labels is None:
        return
    if "shift_labels" not in batch and shifts:
        labels = labels[..., 1:]
    want = float((labels != -100).sum()) * (args.world_size if args.average_tokens_across_devices else 1)
    got = float(counted.sum() if torch.is_tensor(counted) else counted)
    if got != want:
        raise MemfitError(
            f"memfit.integrations.transformers: Trainer counts {got:g} tokens in a batch where the loss sums over "
            f"{want:g}: gradients would be scaled by {want / max(got, 1):.4f}. This transformers version counts "
            "num_items_in_batch differently; pass compute_loss_func= that normalises by num_items_in_batch, or "
            f"report it with your transformers version ({_import_transformers().__version__})."
        )


def _check_compute_loss(trainer: Any, make_batch: Callable[[int], Batch], note: Callable[[str], None]) -> None:
    """NOTE [ A compute_loss of the user's ]: probe how it uses ``num_items_in_batch``; refuse a run
    whose gradients Trainer would scale by the accumulation steps (or their inverse)."""
    if _own_compute_loss(trainer):
        return
    args = trainer.args
    k = args.gradient_accumulation_steps
    name = type(trainer).__name__
    batch = make_batch(1)
    _, counted = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    scaled = (
        flag
        if flag is not None
        else (trainer.model_accepts_loss_kwargs and counted is not None) or trainer.compute_loss_func is not None
    )
    if counted is None or k == 1:
        if k > 1 and not scaled:
            note(
                f"{name}.compute_loss gets no num_items_in_batch, so Trainer divides each micro-batch's loss by "
                f"gradient_accumulation_steps={k}: the big batch's gradient only for means over samples, not "
                "over tokens of variable-length batches."
            )
        return
    model = trainer.model
    inputs = trainer._prepare_inputs(batch)
    with _logs_kept(trainer), leave_unchanged(model), torch.no_grad():
        model.eval()  # no dropout: both calls see the same forward (flags restored on exit)
        with trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            one = float(trainer.compute_loss(model, dict(inputs), num_items_in_batch=counted))
            two = float(trainer.compute_loss(model, dict(inputs), num_items_in_batch=counted * 2))
    if not (math.isfinite(one) and math.isfinite(two)) or one == 0.0:
        return  # nothing to read off a zero or non-finite loss
    honours, ignores = math.isclose(two, one / 2, rel_tol=1e-3), math.isclose(two, one, rel_tol=1e-3)
    if honours and not scaled:
        raise MemfitError(
            f"memfit.integrations.transformers: {name}.compute_loss divides by num_items_in_batch (the "
            f"window's tokens) and loss_is_scaled_for_ga is False, so Trainer divides it again by "
            f"gradient_accumulation_steps={k}: gradients would be {k} times too small. Set "
            f"{name}.loss_is_scaled_for_ga = True (or leave it None)."
        )
    if ignores and scaled:
        raise MemfitError(
            f"memfit.integrations.transformers: {name}.compute_loss ignores num_items_in_batch (its loss is "
            f"the same for {float(counted):g} and {2 * float(counted):g} items), but Trainer treats it as "
            f"normalised over the window and does not divide by gradient_accumulation_steps={k}: gradients "
            f"would be about {k} times too large. Divide the summed loss by num_items_in_batch (Trainer passes "
            f"the valid tokens of the window, of all ranks) and multiply by the number of processes as "
            f"Trainer.compute_loss does, or set {name}.loss_is_scaled_for_ga = False (each micro-batch's mean "
            f"divided by the steps: not the big batch's gradient with variable-length batches)."
        )
    if ignores:
        note(
            f"{name}.compute_loss returns each micro-batch's mean and Trainer divides it by "
            f"gradient_accumulation_steps={k}: not the big batch's gradient with variable-length batches. "
            "Divide the summed loss by num_items_in_batch instead (and set loss_is_scaled_for_ga = True)."
        )
    elif not honours:
        note(
            f"{name}.compute_loss changes with num_items_in_batch, but not as 1 / num_items_in_batch "
            f"({one:.6g} for {float(counted):g} items, {two:.6g} for twice as many): memfit cannot tell "
            "whether the accumulated gradient is the big batch's."
        )


def _ddp_settings(trainer: Any, note: Callable[[str], None]) -> None:
    args = trainer.args
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    if args.ddp_find_unused_parameters is None:
        args.ddp_find_unused_parameters = False
        if handler is not None and handler.find_unused_parameters:
            handler.find_unused_parameters = False
            if args.world_size > 1:
                note(
                    "DDP find_unused_parameters set to False (memfit's recompute is non-reentrant; no unused-parameter search needed)."
                )


def _guard_callback(transformers: Any) -> type:
    class MemfitGuard(transformers.TrainerCallback):
        """Refuses to train when Trainer's checkpointing was turned back on after fit()."""

        def __init__(self, fitted: TrainerFit) -> None:
            self.fitted = fitted

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            on = [n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, False)]
            if on or _hf_checkpointing(_base_model(self.fitted._trainer.model)):
                raise MemfitError(
                    "memfit.integrations.transformers: HF gradient checkpointing was turned on after fit(); with "
                    "memfit's plan blocks would be checkpointed twice. Leave it off (the plan replaces it)."
                )

    return MemfitGuard
