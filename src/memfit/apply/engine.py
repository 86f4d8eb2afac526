"""Applying a plan: wrap blocks so autograd keeps only what the plan says.

``apply_plan(model, plan)`` changes forwards, never the module tree: parameter names and
``state_dict()`` keys stay the same while a plan is applied, so a checkpoint saved with memfit
applied loads into the plain model. ``remove_plan(model)`` restores the original forwards.

Underneath is non-reentrant ``torch.utils.checkpoint`` (reentrant checkpoint silently drops the
gradients of inner parameters when the inputs do not require grad). RNG state is saved and replayed,
so dropout masks in the recompute equal the forward's.

NOTE [ Buffers are updated once ]
A recomputed block runs its forward twice: once in the forward pass and once during backward.
BatchNorm in train mode (and any module that updates running buffers in forward) would update its
statistics twice: ``num_batches_tracked`` goes up by 2 and the running mean moves 0.19*mu instead of
0.1*mu; torch's checkpoint and HF gradient checkpointing do this today. memfit notes, during the
forward, which buffers of the block the forward changed (their version counters moved), and while
the block is recomputed it snapshots those buffers and writes them back afterwards. The recompute
runs the same ops, so autograd sees the same saved tensors (torch raises ``CheckpointError`` when the
count differs). In train mode BatchNorm normalises with batch statistics, so the recomputed
activations are exactly the forward's.

A buffer updated by reassignment (``self.ema = 0.9 * self.ema + x``, a new tensor object) counts as
changed too: during the recompute the block's original buffer objects are put back by name and their
values restored, so the module holds after backward what its forward left.

NOTE [ State a recompute would change twice ]
Besides buffers, a forward can change state that autograd does not see:

- Random numbers. torch's checkpoint replays torch's CPU and device generators; memfit also replays
  Python's ``random`` and NumPy's global generator (when NumPy is imported): the forward notes their
  states, the recompute runs from them and leaves the generators where they were.
- Key/value caches. A transformers layer given a cache appends its keys and values to it; run again
  it would append them again (``The size of tensor a (96) must match the size of tensor b (48)``,
  or ``CheckpointError`` for T5's cross-attention cache), and called without it (what transformers'
  own ``GradientCheckpointingLayer`` does) it leaves its layer of the cache empty: decoding from
  that half cache gives wrong logits. memfit calls a recomputed layer with the cache, so the cache
  a forward with gradients returns equals the unplanned model's, and replays the cache in the
  recompute: the layer finds its cache layer as its forward did, and what it writes goes to a copy
  (NOTE [ A recomputed layer fills its cache once ] in :mod:`memfit.apply.kv_cache`). Caches memfit
  cannot replay (static, quantized, offloaded) are dropped for recomputed layers as transformers
  does, with a warning that the cache returned is incomplete; a compiled forward drops them too.
  Without gradients nothing is recomputed and every layer fills its cache (generation).
- Attributes a forward reassigns. A module attribute the forward sets to another number, string,
  tensor or None (a counter bumped, ``self.state = new_state``: RecurrentGemma's recurrent and
  convolution states) is replayed like a buffer updated by reassignment: the forward notes the
  values it started from, the recompute runs from them, and afterwards the attributes hold again
  what backward found (what the forward left). Found around a block's first checkpointed forwards
  (below); a block is checked for them only then.
- Other Python state. For any other block memfit compares, around its first checkpointed forwards, the
  Python attributes of the block's modules and the non-tensor objects passed in (lengths of lists and
  dicts, numbers, the tensors they refer to): a forward that changed them in place (a list appended
  to, a cache object filled) would change them again in the recompute, so it is refused with the fix
  (pass ``use_cache=False`` or no cache object in training, or keep that block).

Selective blocks (:mod:`memfit.apply.selective`) run under the same checkpoint with torch's
selective-checkpoint contexts composed with these buffer contexts; offloaded blocks
(:mod:`memfit.apply.offload`) are not recomputed and need neither.

NOTE [ Saving applied models ]
``pickle``, ``torch.save`` / ``torch.load(..., weights_only=False)`` and ``copy.deepcopy`` of a model
with a plan applied give a model with the plan still applied: the same forwards and memory
behaviour, ``applied_plan`` returns the plan, a second ``apply_plan`` is refused, and
``remove_plan`` restores the plain forwards. Every forward memfit installs on an instance is a
``functools.partial`` of a module-level function and the module: pickle stores a bound method as
``getattr(module, name)``, which fails at load for a function the class does not have, while a
partial stores the function by name and the module by reference (the module's own pickling
resolves the cycle). Per-module state drops what is transient or cannot travel: a save policy's
op lookups, an offload CUDA stream, the head's state of a call in progress. Loading needs memfit
importable (as it needs the module that defines the model's class); a plain file to share is
``state_dict()`` (its keys are unchanged) or a model saved after ``remove_plan``.

Known limitations:
- The check for changed Python state looks one level deep (an object's attributes, a container's
  length, a transformers cache's token count) and at a block's first two checkpointed forwards
  after ``apply_plan``: a change deeper inside a nested object, or one that starts later, is not seen.
- A module whose forward *reads* a buffer it also updated in the same forward sees the updated value
  during the recompute (BatchNorm does not do this in train mode).
- An attribute a forward reassigns keeps the value the forward started from alive until the block is
  recomputed (a tensor from the previous step, for a module that stores one: RecurrentGemma's state
  is (batch, width), small next to the block's activations).
- Selective and offloaded blocks cannot be inside a segment (the plan is refused).
- Segments (several blocks recomputed as one unit, :mod:`memfit.apply.segments`) lie within one
  container of a multi-container chain, and need its blocks run once each, in order, each taking
  the one before's output (NOTE [ Segments over any block list ]).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.apply.activations import (
    check_activations_option,
    install_fused_activations,
    remove_fused_activations,
)
from memfit.apply.head import head_unsupported_reason, install_chunked_head, remove_chunked_head
from memfit.apply.host_inputs import HostInputs, held_on_host
from memfit.apply.offload import OffloadState, offloaded
from memfit.apply.segments import install_segments, remove_segments
from memfit.apply.selective import compiled_selective_contexts, selective_contexts
from memfit.apply.state import (
    _MUTATED_ATTR,
    _REASSIGNED_ATTR,
    _STATE_CHECKED_ATTR,
    _buffer_contexts,
    _refuse_changed_state,
    _without_cache,
)
from memfit.apply.state import (
    CacheDroppedWarning as CacheDroppedWarning,  # its home before the split
)
from memfit.apply.tiling import install_tiling, remove_tiling
from memfit.capture.chain import Chain, discover_chain
from memfit.capture.snapshot import INSTALLED_ATTR
from memfit.errors import MemfitError, PlanMismatchError, UnsupportedModelError
from memfit.plan.policies import check_fingerprint
from memfit.plan.savepolicy import parse_save_policy
from memfit.plan.types import Option, Plan, Segment, validate_nesting, validate_segments

_PLAN_ATTR = (
    INSTALLED_ATTR  # on the model: its _AppliedPlan (NOTE [ Lifting what is installed ] in memfit.capture.snapshot)
)
_ACTIVATIONS_ATTR = "_memfit_plan_fused_activations"  # on the model: this plan fused its activations
_ACTION_ATTR = "_memfit_action"  # on a block whose forward memfit replaced
_ORIG_FWD_ATTR = "_memfit_orig_forward"  # an instance-level forward that was there before
_POLICY_ATTR = "_memfit_save_policy"  # on a selective block: its parsed SavePolicy
_OFFLOAD_ATTR = "_memfit_offload"  # on an offloaded block: its OffloadState
_HOST_ATTR = "_memfit_host_inputs"  # on a recomputed block whose input is held on the host: the model's HostInputs


def apply_plan(model: nn.Module, plan: Plan, *, batch: Any = None) -> nn.Module:
    """Apply a checkpoint plan to ``model`` in place (and return it).

    Args:
        model: the model the plan was made for.
        plan: the plan (see :mod:`memfit.plan`).
        batch: optional example batch; when given, its shapes are checked against the plan's.

    Returns:
        ``model``, with the planned blocks' forwards wrapped.

    Raises:
        PlanMismatchError: the plan was made for another model or batch shape (the message says
            what differs), segments on a chain that cannot run them, a selective or offload block
            inside a segment, or a selective policy naming an op this torch does not have.
        MemfitError: a plan is already applied, or HF gradient checkpointing is enabled on blocks.
            Nothing is changed when any error is raised.

    Example:
        >>> import torch.nn as nn
        >>> from memfit.plan import policy_plan
        >>> m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        >>> apply_plan(m, policy_plan(m, "all")) is m
        True
        >>> remove_plan(m)
    """
    chain, policies = _checked(model, plan, batch)
    # Everything is checked: from here on nothing can fail half-way.
    in_place = _install(model, plan, chain, policies)
    if in_place:
        warnings.warn(
            f"memfit.apply: {', '.join(in_place[:3])}{', ...' if len(in_place) > 3 else ''} overwrite their input "
            "(inplace=True) and are kept, not recomputed: a recompute needs the input they overwrite, and they hold "
            "no activations of their own.",
            InPlaceBlockWarning,
            stacklevel=2,
        )
    return model


def _checked(model: nn.Module, plan: Plan, batch: Any) -> tuple[Chain, dict[int, Any]]:
    """Check everything :func:`apply_plan` needs before it changes anything: the model's chain
    (returned), the fingerprint, segments, nesting, the selective policies (returned, by block),
    HF gradient checkpointing, the head, activations and tiling options."""
    if is_applied(model):
        raise MemfitError("memfit.apply: this model already has a plan applied. Call memfit.remove_plan(model) first.")
    try:
        chain = discover_chain(model, plan.chain_path)
    except UnsupportedModelError as err:
        made_for = (plan.fingerprint.get("model") or {}).get("class", "another model")
        raise PlanMismatchError(
            f"memfit.apply: this plan was made for {made_for} with its blocks in {plan.chain_path or 'the model itself'!r}, "
            f"and {type(model).__name__} has no such block container ({err}). Make a plan for this model: "
            "`memfit plan --model SPEC --budget SIZE --out PLAN.json`."
        ) from None
    check_fingerprint(plan, model, chain, batch)
    if plan.segments:
        validate_segments(plan.segments, len(chain), error=lambda m: PlanMismatchError(f"memfit.apply: {m}."))
        for s in plan.segments:
            if not any(a <= s.start and s.stop <= b for a, b in chain.segment_spans):
                raise PlanMismatchError(
                    f"memfit.apply: the plan groups blocks {chain.names[s.start]} .. {chain.names[s.stop - 1]} into a "
                    f"segment, but a segment's blocks must lie in one container and they are in {chain.describe()}. "
                    "Use a plan whose segments end at each container's end (policy 'sqrt', or `memfit plan`)."
                )
    validate_nesting(plan, error=lambda m: PlanMismatchError(f"memfit.apply: {m}."))
    policies = _parse_policies(plan)
    hf_gc = [n for n, b in zip(chain.names, chain.blocks, strict=True) if getattr(b, "gradient_checkpointing", False)]
    if hf_gc:
        raise MemfitError(
            f"memfit.apply: HF gradient checkpointing is enabled on {len(hf_gc)} blocks ({hf_gc[0]}, ...); "
            "with a memfit plan too, blocks would be checkpointed twice. Call "
            "model.gradient_checkpointing_disable() first, or use memfit's policy 'all' instead."
        )
    if plan.head is not None:
        why = head_unsupported_reason(model)
        if why is not None:
            raise PlanMismatchError(
                f"memfit.apply: the plan's head option {plan.head!r} cannot be applied: {why}. Make a plan "
                "for this model (`memfit plan`), which offers head options only where they apply."
            )
    if plan.activations is not None:
        check_activations_option(model, plan.activations)
    _check_tiled(chain, plan)
    return chain, policies


def _install(model: nn.Module, plan: Plan, chain: Chain, policies: dict[int, Any]) -> list[str]:
    """Install the checked plan on ``model``: the blocks' wrappers and tiling, the segments, the
    head and activations, and the plan itself; returns the blocks kept because they overwrite their
    input (:class:`InPlaceBlockWarning`)."""
    host = HostInputs() if any(d.host_input for d in plan.blocks) else None
    in_place: list[str] = []
    for i, (block, decision) in enumerate(zip(chain.blocks, plan.blocks, strict=True)):
        if decision.tiles is not None:
            install_tiling(block, decision.tiled, decision.tiles)
        if decision.option in (Option.RECOMPUTE, Option.SELECTIVE) and _overwrites_its_input(block):
            in_place.append(chain.names[i])
        elif decision.option is Option.RECOMPUTE:
            if decision.host_input:
                block.__dict__[_HOST_ATTR] = host
            _wrap_block(block, decision.option, _recompute_forward)
        elif decision.option is Option.SELECTIVE:
            block.__dict__[_POLICY_ATTR] = policies[i]
            _wrap_block(block, decision.option, _selective_forward)
        elif decision.option is Option.OFFLOAD:
            block.__dict__[_OFFLOAD_ATTR] = OffloadState()
            _wrap_block(block, decision.option, _offload_forward)
    for (a, b), container in zip(chain.spans, chain.containers, strict=True):
        inside = [Segment(start=s.start - a, stop=s.stop - a) for s in plan.segments if a <= s.start and s.stop <= b]
        if inside:
            recomputed = frozenset(i - a for i in range(a, b) if plan.blocks[i].option is Option.RECOMPUTE)
            install_segments(container, inside, recomputed)
    if plan.head is not None:
        install_chunked_head(model)
    if plan.activations is not None:
        # Fused already (memfit.profiling.blocks.profile runs its passes so): leave them to whoever fused them.
        if install_fused_activations(model):
            model.__dict__[_ACTIVATIONS_ATTR] = True
    object.__setattr__(model, _PLAN_ATTR, _AppliedPlan(plan))
    return in_place


class InPlaceBlockWarning(UserWarning):
    """A block the plan recomputes overwrites its input (an activation module built with ``inplace=True``) and is kept."""


def _overwrites_its_input(block: nn.Module) -> bool:
    """A parameterless module built with ``inplace=True`` (torchvision's ``relu0``): torch's checkpoint saves the
    block's input, which the block then overwrites, and the recompute in backward fails on its version."""
    return getattr(block, "inplace", False) is True and next(block.parameters(), None) is None


def remove_plan(model: nn.Module) -> None:
    """Restore the model's original forwards (a no-op on a model without a plan)."""
    remove_chunked_head(model)
    remove_tiling(model)
    if model.__dict__.pop(_ACTIVATIONS_ATTR, False):
        remove_fused_activations(model)
    for mod in model.modules():
        d = mod.__dict__
        remove_segments(mod)
        if _ACTION_ATTR in d:
            d.pop("forward", None)
            if _ORIG_FWD_ATTR in d:
                d["forward"] = d.pop(_ORIG_FWD_ATTR)
            d.pop(_ACTION_ATTR, None)
            d.pop(_POLICY_ATTR, None)
            d.pop(_OFFLOAD_ATTR, None)
            d.pop(_HOST_ATTR, None)
        d.pop(_MUTATED_ATTR, None)
        d.pop(_STATE_CHECKED_ATTR, None)
        d.pop(_REASSIGNED_ATTR, None)
    model.__dict__.pop(_PLAN_ATTR, None)


def is_applied(model: nn.Module) -> bool:
    """True when a memfit plan is applied to ``model``."""
    return _PLAN_ATTR in model.__dict__


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model``, if any."""
    applied = model.__dict__.get(_PLAN_ATTR)
    return None if applied is None else applied.plan


@dataclass(frozen=True, slots=True)
class _AppliedPlan:
    """What :func:`apply_plan` leaves on the model: the plan, and how a measurement takes it off and
    puts it back (:class:`memfit.capture.snapshot.Installed`)."""

    plan: Plan

    def remove(self, model: nn.Module) -> None:
        remove_plan(model)

    def reinstall(self, model: nn.Module) -> None:
        apply_plan(model, self.plan)


@contextmanager
def plan_applied(model: nn.Module, plan: Plan, *, batch: Any = None) -> Iterator[nn.Module]:
    """``with plan_applied(model, plan): ...`` applies the plan and removes it afterwards."""
    apply_plan(model, plan, batch=batch)
    try:
        yield model
    finally:
        remove_plan(model)


# --- block wrappers --------------------------------------------------------------------------

# NOTE [ Compiled plans ]
# A plan composes with torch.compile, per block (each wrapped block compiled: torchtitan's order)
# or whole-model (memfit.apply.compiled.compile_applied). While dynamo traces
# (torch.compiler.is_compiling()), the wrappers call torch's non-reentrant checkpoint with the
# block's forward and nothing else. Dynamo turns it into the tag_activation_checkpoint operator and
# AOTAutograd's partitioner recomputes the tagged ops inside the compiled backward, from the
# functional graph: the block's Python forward never runs twice. What memfit adds in eager mode
# guards against that second run and is left out, because it has nothing to do and would break
# the graph: the buffer and RNG contexts (a context_fn is entered while tracing only; buffers a
# forward updates, BatchNorm's, are functionalised and written once by the forward graph), the
# Python-state check (its walk over attributes is not traceable), the marker a segment sets on its
# first block (a side effect dynamo refuses inside the checkpoint; the eager forwards check), and
# the warning for a dropped cache (warnings.warn is a graph break; the cache is still dropped).
# Segments compose too, per block and whole (NOTE [ Compiled segments ] in
# memfit.apply.compiled_segments).
# Selective blocks pass torch's selective-checkpoint contexts alone, as a partial of the policy's
# text (dynamo accepts a context_fn only as a function or a partial of constants). Checked in
# tests/test_compile.py: no graph break, float64 gradients and buffers equal to the unmodified model
# run eagerly.
# What does not compose (torch 2.13):
# - offload: saved_tensors_hooks entered inside compiled code are not traced (dynamo marks
#   saved_tensors_hooks.__init__ as skipped): a graph break at each offloaded block, which then runs
#   eagerly (gradients stay equal). pytorch/pytorch#113263; AOTAutograd supports hooks entered
#   outside the compiled region only (pytorch/pytorch#150032).
# - dropout under inductor draws its masks from inductor's own generator, not the eager ones (a
#   recomputed or plain model alike): torch._inductor.config.fallback_random=True gives eager's
#   masks, and memfit verify --compile sets it to compare gradients.
# - a container whose forward loops over its nn.Sequential itself is refused on an eager forward
#   only (NOTE [ A container whose forward does not run its blocks ]).
# - a block of a segment, compiled per block, whose compiled forward recompiles between its forward
#   and its recompute (a guard on a Python value the forward changes) recomputes with another graph:
#   torch's CheckpointError, pytorch/pytorch#166926 (NOTE [ Compiled segments ]).


def _parse_policies(plan: Plan) -> dict[int, Any]:
    """Parsed save policies of the selective blocks (before anything changes)."""
    out = {}
    for i, d in enumerate(plan.blocks):
        if d.option is Option.SELECTIVE:
            try:
                out[i] = parse_save_policy(d.policy or "")
            except MemfitError as err:
                raise PlanMismatchError(f"memfit.apply: block {d.name}: {err}") from None
    return out


def _check_tiled(chain: Any, plan: Plan) -> None:
    """Every tiled block's submodules exist (before anything changes)."""
    for block, d in zip(chain.blocks, plan.blocks, strict=True):
        for name in d.tiled if d.tiles is not None else ():
            try:
                block.get_submodule(name)
            except AttributeError:
                raise PlanMismatchError(
                    f"memfit.apply: block {d.name} is tiled over its submodule {name!r}, which "
                    f"{type(block).__name__} does not have. Make a plan for this model (`memfit plan`)."
                ) from None


def _wrap_block(block: nn.Module, action: Option, forward: Callable[..., Any]) -> None:
    d = block.__dict__
    if "forward" in d:  # e.g. a hook library replaced forward on the instance: call through it
        d[_ORIG_FWD_ATTR] = d["forward"]
    d[_ACTION_ATTR] = action.value
    d["forward"] = functools.partial(forward, block)  # NOTE [ Saving applied models ]


def _original_forward(block: nn.Module) -> Callable[..., Any]:
    orig = block.__dict__.get(_ORIG_FWD_ATTR)
    # A partial, not types.MethodType: torch.compile traces through a partial (NOTE [ Compiled plans ]).
    return orig if orig is not None else functools.partial(type(block).forward, block)


def _as_called(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block's arguments as it was called with them, for its recompute: lists and dicts among
    them copied (one level; the tensors are the same objects), so that a model appending to a list
    it passed does not change what the recompute runs on (a DenseNet layer takes the list of the
    earlier layers' outputs, which the loop then appends the layer's output to)."""

    def copied(x: Any) -> Any:
        return list(x) if type(x) is list else dict(x) if type(x) is dict else x

    return tuple(copied(a) for a in args), {k: copied(v) for k, v in kwargs.items()}


def _recompute_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _original_forward(self)
    if not torch.is_grad_enabled():  # nothing will be saved: run as is
        return fwd(*args, **kwargs)
    args, kwargs = _as_called(*_without_cache(self, args, kwargs))
    if torch.compiler.is_compiling():  # NOTE [ Compiled plans ]
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)
    # NOTE [ Host-held inputs ] in memfit.apply.host_inputs: its hooks see the checkpoint's inputs only
    with _refuse_changed_state((self,), args, kwargs), held_on_host(self.__dict__.get(_HOST_ATTR)):
        return checkpoint(
            fwd,
            *args,
            use_reentrant=False,
            preserve_rng_state=False,  # kept by the context instead (NOTE [ Generator states are counted ])
            context_fn=functools.partial(_buffer_contexts, (self,), (args, kwargs)),
            **kwargs,
        )


def _selective_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _original_forward(self)
    if not torch.is_grad_enabled():
        return fwd(*args, **kwargs)
    args, kwargs = _as_called(*_without_cache(self, args, kwargs))
    if torch.compiler.is_compiling():  # NOTE [ Compiled plans ]: torch's own contexts, named by text
        context_fn = functools.partial(compiled_selective_contexts, self.__dict__[_POLICY_ATTR].text)
        return checkpoint(fwd, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    with _refuse_changed_state((self,), args, kwargs):
        return checkpoint(
            fwd,
            *args,
            use_reentrant=False,
            preserve_rng_state=False,  # kept by the context instead (NOTE [ Generator states are counted ])
            context_fn=functools.partial(
                selective_contexts,
                self,
                self.__dict__[_POLICY_ATTR],
                functools.partial(_buffer_contexts, inputs=(args, kwargs)),
            ),
            **kwargs,
        )


def _offload_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _original_forward(self)
    if not torch.is_grad_enabled():
        return fwd(*args, **kwargs)
    with offloaded(self, (args, kwargs), self.__dict__[_OFFLOAD_ATTR]):
        return fwd(*args, **kwargs)
