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
  it appends them again (``The size of tensor a (96) must match the size of tensor b (48)``, or
  ``CheckpointError`` for T5's cross-attention cache). memfit does what transformers' own
  ``GradientCheckpointingLayer`` does when it checkpoints: a recomputed layer is called without a
  cache (``cache``/``past_key_value(s)``/``layer_past`` set to None, ``use_cache=False``), unless the
  layer class says it only reads the cache (``_can_checkpoint_with_cache``). It warns once. This
  holds whenever memfit checkpoints (gradients enabled, training or eval mode); without gradients
  nothing is recomputed and the layer keeps its cache (generation). Kept and offloaded layers still
  fill the cache; nothing changes once the plan is removed.
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
- Segments (several blocks recomputed as one unit) need blocks of one plain ``nn.Sequential``
  container run by its own forward (NOTE [ A container whose forward does not run its blocks ]);
  blocks in an ``nn.ModuleList`` are kept or recomputed one by one, and a segment never spans two
  containers of a multi-container chain.
"""

from __future__ import annotations

import functools
import inspect
import random
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from memfit.apply.activations import (
    check_activations_option,
    install_fused_activations,
    remove_fused_activations,
)
from memfit.apply.head import head_unsupported_reason, install_chunked_head, remove_chunked_head
from memfit.apply.offload import OffloadState, offloaded
from memfit.apply.selective import selective_contexts
from memfit.capture.chain import discover_chain
from memfit.capture.snapshot import INSTALLED_ATTR
from memfit.errors import MemfitError, PlanMismatchError, UnsupportedModelError
from memfit.plan.policies import check_fingerprint
from memfit.plan.savepolicy import parse_save_policy
from memfit.plan.segments import SegmentTree, segment_tree
from memfit.plan.types import Action, Plan, Segment, validate_nesting, validate_segments

_PLAN_ATTR = INSTALLED_ATTR  # on the model: its _AppliedPlan (NOTE [ Lifting what is installed ] in memfit.capture.snapshot)
_ACTIVATIONS_ATTR = "_memfit_plan_fused_activations"  # on the model: this plan fused its activations
_ACTION_ATTR = "_memfit_action"  # on a block whose forward memfit replaced
_ORIG_FWD_ATTR = "_memfit_orig_forward"  # an instance-level forward that was there before
_SEGMENTS_ATTR = "_memfit_segments"  # on an nn.Sequential container: its segment tree
_MUTATED_ATTR = "_memfit_mutated_buffers"
_POLICY_ATTR = "_memfit_save_policy"  # on a selective block: its parsed SavePolicy
_OFFLOAD_ATTR = "_memfit_offload"  # on an offloaded block: its OffloadState
_STATE_CHECKED_ATTR = "_memfit_state_checks"  # on a block: checkpointed forwards checked for Python state
_SEGMENT_HOOK_ATTR = "_memfit_segment_hook"  # on a segment's first block: id of its checking pre-hook
_VIA_SEGMENT_ATTR = "_memfit_via_segment"  # on a segment's first block while its segment runs it
_REASSIGNED_ATTR = "_memfit_reassigned_attrs"  # on a block: (module path, attribute) its forward reassigns
_CHECKING_ATTR = "_memfit_checking_state"  # on a block during a forward whose Python state is checked


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
    if is_applied(model):
        raise MemfitError(
            "memfit.apply: this model already has a plan applied. Call memfit.remove_plan(model) first."
        )
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
                    f"segment, but segments need blocks of one nn.Sequential container run by its own forward; the "
                    f"blocks are in {chain.describe()}, run by {type(model).__name__}.forward. Use a plan without "
                    "segments (policy 'all' or 'every:K', or `memfit plan`)."
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

    # Everything is checked: from here on nothing can fail half-way.
    for i, (block, decision) in enumerate(zip(chain.blocks, plan.blocks, strict=True)):
        if decision.action is Action.RECOMPUTE:
            _wrap_block(block, decision.action, _recompute_forward)
        elif decision.action is Action.SELECTIVE:
            block.__dict__[_POLICY_ATTR] = policies[i]
            _wrap_block(block, decision.action, _selective_forward)
        elif decision.action is Action.OFFLOAD:
            block.__dict__[_OFFLOAD_ATTR] = OffloadState()
            _wrap_block(block, decision.action, _offload_forward)
    for (a, b), container in zip(chain.spans, chain.containers, strict=True):
        inside = [Segment(start=s.start - a, stop=s.stop - a) for s in plan.segments if a <= s.start and s.stop <= b]
        if inside:
            _install_segments(container, inside)
    if plan.head is not None:
        install_chunked_head(model)
    if plan.activations is not None:
        # Fused already (memfit.profiling.profile runs its passes so): leave them to whoever fused them.
        if install_fused_activations(model):
            model.__dict__[_ACTIVATIONS_ATTR] = True
    object.__setattr__(model, _PLAN_ATTR, _AppliedPlan(plan))
    return model


def remove_plan(model: nn.Module) -> None:
    """Restore the model's original forwards (a no-op on a model without a plan)."""
    remove_chunked_head(model)
    if model.__dict__.pop(_ACTIVATIONS_ATTR, False):
        remove_fused_activations(model)
    for mod in model.modules():
        d = mod.__dict__
        if _SEGMENT_HOOK_ATTR in d:
            mod._forward_pre_hooks.pop(d.pop(_SEGMENT_HOOK_ATTR), None)
            d.pop(_VIA_SEGMENT_ATTR, None)
        if _ACTION_ATTR in d or _SEGMENTS_ATTR in d:
            d.pop("forward", None)
            if _ORIG_FWD_ATTR in d:
                d["forward"] = d.pop(_ORIG_FWD_ATTR)
            d.pop(_ACTION_ATTR, None)
            d.pop(_SEGMENTS_ATTR, None)
            d.pop(_POLICY_ATTR, None)
            d.pop(_OFFLOAD_ATTR, None)
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


def _parse_policies(plan: Plan) -> dict[int, Any]:
    """Parsed save policies of the selective blocks (before anything changes)."""
    out = {}
    for i, d in enumerate(plan.blocks):
        if d.action is Action.SELECTIVE:
            try:
                out[i] = parse_save_policy(d.policy or "")
            except MemfitError as err:
                raise PlanMismatchError(f"memfit.apply: block {d.name}: {err}") from None
    return out


def _wrap_block(block: nn.Module, action: Action, forward: Callable[..., Any]) -> None:
    d = block.__dict__
    if "forward" in d:  # e.g. a hook library replaced forward on the instance: call through it
        d[_ORIG_FWD_ATTR] = d["forward"]
    d[_ACTION_ATTR] = action.value
    d["forward"] = functools.partial(forward, block)  # NOTE [ Saving applied models ]


def _original_forward(block: nn.Module) -> Callable[..., Any]:
    orig = block.__dict__.get(_ORIG_FWD_ATTR)
    return orig if orig is not None else types.MethodType(type(block).forward, block)


def _recompute_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _original_forward(self)
    if not torch.is_grad_enabled():  # nothing will be saved: run as is
        return fwd(*args, **kwargs)
    args, kwargs = _without_cache(self, args, kwargs)
    with _refuse_changed_state((self,), args, kwargs):
        return checkpoint(
            fwd,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(_buffer_contexts, (self,)),
            **kwargs,
        )


def _selective_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _original_forward(self)
    if not torch.is_grad_enabled():
        return fwd(*args, **kwargs)
    args, kwargs = _without_cache(self, args, kwargs)
    with _refuse_changed_state((self,), args, kwargs):
        return checkpoint(
            fwd,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(selective_contexts, self, self.__dict__[_POLICY_ATTR], _buffer_contexts),
            **kwargs,
        )


def _offload_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _original_forward(self)
    if not torch.is_grad_enabled():
        return fwd(*args, **kwargs)
    with offloaded(self, (args, kwargs), self.__dict__[_OFFLOAD_ATTR]):
        return fwd(*args, **kwargs)


# --- state a recompute would change twice (NOTE [ State a recompute would change twice ]) --------

_CACHE_ARGS = ("cache", "past_key_value", "past_key_values", "layer_past")  # transformers' names
_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"forward", "training"}  # nn.Module's own machinery
_STATE_CHECKS = 2  # checkpointed forwards per block whose Python state is checked


class CacheDroppedWarning(UserWarning):
    """A recomputed transformers layer is called without its key/value cache (as HF's own
    gradient checkpointing does)."""


def _without_cache(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args, kwargs`` without a key/value cache, for a transformers layer that writes its cache."""
    cls = type(block)
    # Also in eval mode: transformers checkpoints only in training, memfit wherever gradients are on.
    if getattr(block, "_can_checkpoint_with_cache", True):
        return args, kwargs  # not a transformers GradientCheckpointingLayer, or one that only reads the cache
    positions = _cache_positions(cls)
    args = list(args)
    dropped = []
    for name, pos in positions.items():
        off = False if name == "use_cache" else None
        if name in kwargs and kwargs[name] is not None and kwargs[name] is not False:
            kwargs = {**kwargs, name: off}
            dropped.append(name)
        elif pos is not None and pos < len(args) and args[pos] is not None and args[pos] is not False:
            args[pos] = off
            dropped.append(name)
    if dropped:
        warnings.warn(
            f"memfit.apply: recomputed {cls.__name__} layers run without their key/value cache while "
            f"gradients are on ({', '.join(sorted(set(dropped)))} off), as transformers' gradient checkpointing does: run again in "
            "backward, a layer would write its cache twice. Kept layers still fill it.",
            CacheDroppedWarning,
            stacklevel=3,
        )
    return tuple(args), kwargs


@functools.cache
def _cache_positions(cls: type) -> dict[str, int | None]:
    """The forward's cache parameters (and ``use_cache``) -> their positional index (None: keyword only)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return {}
    out: dict[str, int | None] = {}
    for i, p in enumerate(params):
        if p.name in (*_CACHE_ARGS, "use_cache"):
            out[p.name] = i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
    for name in (*_CACHE_ARGS, "use_cache"):  # passed through **kwargs
        out.setdefault(name, None)
    return out


@contextmanager
def _refuse_changed_state(blocks: Sequence[nn.Module], args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[None]:
    """Refuse a checkpointed forward that changed Python state its recompute would change again.

    Checked on the first ``_STATE_CHECKS`` checkpointed forwards of each block after apply_plan
    (memfit's profile runs them): the look costs ~0.1-0.3 ms per block, too much for every step.
    """
    counts = [blk.__dict__.get(_STATE_CHECKED_ATTR, 0) for blk in blocks]
    if min(counts) >= _STATE_CHECKS:
        yield
        return
    for blk, n in zip(blocks, counts, strict=True):
        blk.__dict__[_STATE_CHECKED_ATTR] = n + 1
        blk.__dict__[_CHECKING_ATTR] = True  # _note_attributes notes every candidate attribute
    values = [_attribute_values(blk) for blk in blocks]
    before = _python_state(blocks, args, kwargs)
    try:
        yield
    finally:
        for blk in blocks:
            blk.__dict__.pop(_CHECKING_ATTR, None)
    after = _python_state(blocks, args, kwargs)
    replayed: set[str] = set()  # NOTE [ State a recompute would change twice ]: attributes a forward reassigns
    for blk, old in zip(blocks, values, strict=True):
        new = _attribute_values(blk)
        moved = {k for k in old.keys() | new.keys() if not _same(old.get(k, _MISSING), new.get(k, _MISSING))}
        if moved:
            blk.__dict__[_REASSIGNED_ATTR] = tuple(sorted(moved | set(blk.__dict__.get(_REASSIGNED_ATTR, ()))))
            replayed.update(f"{path}.{key}" if path else f"{type(blk).__name__}.{key}" for path, key in moved)
    changed = [
        f"{where}: {_show(value)} -> {_show(after[where])}"
        for where, value in before.items()
        if after.get(where, value) != value and where not in replayed
    ]
    if changed:
        raise UnsupportedModelError(
            f"memfit.apply: the forward of {type(blocks[0]).__name__} changes Python state that autograd does not "
            f"track ({'; '.join(changed[:3])}); recomputed in backward it would change it twice. Pass "
            "use_cache=False (or no cache object) to the model in training, or keep that block (action 'keep' "
            "in the plan)."
        )


_MISSING = object()


def _replaceable(value: Any) -> bool:
    """A value a forward replaces rather than changes in place (replayed, not refused)."""
    return value is None or isinstance(value, bool | int | float | str) or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


def _attribute_values(block: nn.Module) -> dict[tuple[str, str], Any]:
    """``(module path, attribute) -> value`` of the block's modules' attributes a forward could
    reassign (numbers, strings, tensors that are not parameters or buffers, None)."""
    out = {}
    for path, mod in block.named_modules():
        for key, value in mod.__dict__.items():
            if key not in _MODULE_KEYS and not key.startswith("_memfit") and _replaceable(value):
                out[(path, key)] = value
    return out


def _show(fingerprint: Any) -> str:
    if isinstance(fingerprint, tuple):
        return "another tensor" if fingerprint[0] == "tensor" else f"{fingerprint[0]} {fingerprint[1]}"
    return repr(fingerprint)


def _python_state(blocks: Sequence[nn.Module], args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A one-level fingerprint of the blocks' Python attributes and the non-tensor objects passed in."""
    state: dict[str, Any] = {}
    for blk in blocks:
        for name, mod in blk.named_modules():
            for key, value in mod.__dict__.items():
                if key in _MODULE_KEYS or key.startswith("_memfit"):
                    continue
                fp = _fingerprint(value)
                if fp is not None:
                    state[f"{type(mod).__name__}.{key}" if not name else f"{name}.{key}"] = fp
    for i, value in enumerate((*args, *kwargs.values())):
        if isinstance(value, torch.Tensor | nn.Module) or value is None:
            continue
        inner = vars(value) if hasattr(value, "__dict__") and not isinstance(value, type) else {}
        fp = _fingerprint(value)
        if fp is None and callable(getattr(value, "get_seq_length", None)):  # a transformers Cache
            fp = ("cached tokens", value.get_seq_length())
        if fp is not None:
            state[f"argument {i} ({type(value).__name__})"] = fp
        for key, v in inner.items():
            fp = _fingerprint(v)
            if fp is not None:
                state[f"argument {i} ({type(value).__name__}).{key}"] = fp
    return state


def _fingerprint(value: Any) -> Any:
    """What a forward could change in ``value`` without autograd seeing it (None: nothing memfit checks)."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | dict | set | bytearray) or type(value).__name__ == "deque":
        return ("length", len(value))
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return ("tensor", id(value))
    return None


# --- segments (nn.Sequential chains) -----------------------------------------------------------


def _install_segments(container: nn.Module, segments: Sequence[Segment]) -> None:
    d = container.__dict__
    if "forward" in d:
        d[_ORIG_FWD_ATTR] = d["forward"]
    d[_SEGMENTS_ATTR] = segment_tree(segments, 0, len(container))
    d["forward"] = functools.partial(_segmented_sequential_forward, container)  # NOTE [ Saving applied models ]
    # NOTE [ A container whose forward does not run its blocks ]
    # A model may keep its blocks in an nn.Sequential and loop over them in its own forward (HF
    # ResNetStage does): the segmented forward installed above then never runs, and the plan's
    # segments silently keep everything. The first block of each segment checks, in a training
    # forward, that the segmented forward is what called it, and refuses the plan otherwise.
    for start in sorted({s.start for s in segments}):
        block = container[start]
        block.__dict__[_SEGMENT_HOOK_ATTR] = block.register_forward_pre_hook(_check_run_by_segment).id


def _check_run_by_segment(block: nn.Module, _args: Any) -> None:
    if block.__dict__.pop(_VIA_SEGMENT_ATTR, False) or not torch.is_grad_enabled():
        return
    raise UnsupportedModelError(
        f"memfit.apply: the plan recomputes a segment of blocks starting at this {type(block).__name__}, "
        "but the model's forward runs the blocks of their nn.Sequential itself (it loops over them) "
        "instead of calling the container, so the segment would never be recomputed and the plan's "
        "memory would not be saved. Use a plan without segments: `memfit plan` (its profile finds this "
        "and plans such containers block by block), or policy 'all' or 'every:K'."
    )


def _segmented_sequential_forward(self: nn.Sequential, input: Any) -> Any:
    return _run_items(self, self.__dict__[_SEGMENTS_ATTR], input)


def _run_items(seq: nn.Sequential, items: SegmentTree, x: Any) -> Any:
    for item in items:
        if isinstance(item, int):
            x = seq[item](x)
        elif not torch.is_grad_enabled():
            x = _run_segment(seq, item, x)
        else:
            blocks = tuple(seq[i] for i in range(item[0], item[1]))
            with _refuse_changed_state(blocks, (x,), {}):
                x = checkpoint(
                    _run_segment,
                    seq,
                    item,
                    x,
                    use_reentrant=False,
                    context_fn=functools.partial(_buffer_contexts, blocks),
                )
    return x


def _run_segment(seq: nn.Sequential, item: tuple[int, int, SegmentTree], x: Any) -> Any:
    start, _stop, children = item
    seq[start].__dict__[_VIA_SEGMENT_ATTR] = True  # for _check_run_by_segment
    try:
        return _run_items(seq, children, x)
    finally:
        seq[start].__dict__.pop(_VIA_SEGMENT_ATTR, None)


# --- buffers are updated once (NOTE [ Buffers are updated once ]) ------------------------------


def _buffer_contexts(blocks: Sequence[nn.Module]) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` of memfit's checkpoints: (forward, recompute) contexts for buffers and RNG."""
    rng: dict[str, Any] = {}
    attrs: list[dict[tuple[str, str], Any]] = []
    return (
        _both(_note_mutated_buffers(blocks), _note_rng(rng), _note_attributes(blocks, attrs)),
        _both(_restore_mutated_buffers(blocks), _replay_rng(rng), _replay_attributes(blocks, attrs)),
    )


@contextmanager
def _both(*contexts: AbstractContextManager) -> Iterator[None]:
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


@contextmanager
def _note_attributes(blocks: Sequence[nn.Module], attrs: list[dict[tuple[str, str], Any]]) -> Iterator[None]:
    # The values the forward starts from: of every candidate while the block's state is checked (the
    # reassigned ones are known only afterwards), else of those found reassigned then.
    for blk in blocks:
        if blk.__dict__.get(_CHECKING_ATTR):
            attrs.append(_attribute_values(blk))
        else:
            attrs.append({k: _get_attribute(blk, k) for k in blk.__dict__.get(_REASSIGNED_ATTR, ())})
    yield


@contextmanager
def _replay_attributes(blocks: Sequence[nn.Module], attrs: list[dict[tuple[str, str], Any]]) -> Iterator[None]:
    now = []
    for blk, noted in zip(blocks, attrs, strict=True):
        for k in blk.__dict__.get(_REASSIGNED_ATTR, ()):
            if k in noted:
                now.append((blk, k, _get_attribute(blk, k)))
                _set_attribute(blk, k, noted[k])
    try:
        yield
    finally:  # the recompute leaves the attributes as backward found them
        for blk, k, value in now:
            _set_attribute(blk, k, value)


def _get_attribute(block: nn.Module, where: tuple[str, str]) -> Any:
    path, key = where
    return (block.get_submodule(path) if path else block).__dict__.get(key, _MISSING)


def _set_attribute(block: nn.Module, where: tuple[str, str], value: Any) -> None:
    path, key = where
    d = (block.get_submodule(path) if path else block).__dict__
    if value is _MISSING:
        d.pop(key, None)
    else:
        d[key] = value


@contextmanager
def _note_rng(rng: dict[str, Any]) -> Iterator[None]:
    # torch's own generators are replayed by checkpoint (preserve_rng_state); these are the others.
    rng["python"] = random.getstate()
    np = sys.modules.get("numpy")
    if np is not None:
        rng["numpy"] = np.random.get_state()
    yield


@contextmanager
def _replay_rng(rng: dict[str, Any]) -> Iterator[None]:
    np = sys.modules.get("numpy")
    now_python = random.getstate()
    now_numpy = np.random.get_state() if np is not None and "numpy" in rng else None
    random.setstate(rng["python"])
    if now_numpy is not None:
        np.random.set_state(rng["numpy"])
    try:
        yield
    finally:  # the recompute leaves the generators where backward found them
        random.setstate(now_python)
        if now_numpy is not None:
            np.random.set_state(now_numpy)


@contextmanager
def _note_mutated_buffers(blocks: Sequence[nn.Module]) -> Iterator[None]:
    # Granularity is the submodule: BatchNorm's kernel updates running_mean/var without bumping
    # their version counters (only num_batches_tracked.add_ does), so a submodule with any buffer
    # whose version moved or that was replaced by another tensor, or a norm layer tracking running
    # stats in train mode, has all of its buffers restored.
    before = [
        [(prefix, mod, [(n, b, b._version) for n, b in mod.named_buffers(recurse=False)]) for prefix, mod in _modules_with_buffers(blk)]
        for blk in blocks
    ]
    yield
    for blk, mods in zip(blocks, before, strict=True):
        mutated: list[str] = []
        for prefix, mod, versions in mods:
            bufs = dict(mod.named_buffers(recurse=False))
            stats = isinstance(mod, _NormBase) and mod.training and mod.track_running_stats
            if stats or any(bufs.get(n) is not b or b._version != v for n, b, v in versions):
                mutated.extend(f"{prefix}{n}" for n in bufs)
        if mutated or _MUTATED_ATTR in blk.__dict__:
            blk.__dict__[_MUTATED_ATTR] = tuple(mutated)


def _modules_with_buffers(block: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{name}." if name else "", mod) for name, mod in block.named_modules() if mod._buffers]


@contextmanager
def _restore_mutated_buffers(blocks: Sequence[nn.Module]) -> Iterator[None]:
    with ExitStack() as stack:
        for blk in blocks:
            names = blk.__dict__.get(_MUTATED_ATTR, ())
            if names:
                stack.enter_context(_restored(blk, names))
        yield


@contextmanager
def _restored(block: nn.Module, names: Sequence[str]) -> Iterator[None]:
    saved = []
    for name in names:
        prefix, _, key = name.rpartition(".")
        mod = block.get_submodule(prefix) if prefix else block
        buf = mod._buffers.get(key)
        if buf is not None:
            saved.append((mod, key, buf, buf.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for mod, key, buf, value in saved:
                mod._buffers[key] = buf  # the forward's object, also when the recompute reassigned it
                buf.copy_(value)
