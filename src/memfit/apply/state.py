"""State a recompute must leave as the forward left it: key/value caches (replayed by
:mod:`memfit.apply.kv_cache`), Python state, attributes, random generators and buffers (NOTE [
Buffers are updated once ] and NOTE [ State a recompute would change twice ] in
:mod:`memfit.apply.engine`).

Used by every recomputing wrapper: :mod:`memfit.apply.engine` (blocks, ``nn.Sequential``
segments), :mod:`memfit.apply.segments` (segments of any block list) and
:mod:`memfit.apply.selective` (which receives :func:`_buffer_contexts`).
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    _get_device_module,
    _infer_device_type,
    get_device_states,
    set_device_states,
)

from memfit.apply.kv_cache import (
    CacheDroppedWarning as CacheDroppedWarning,  # its home is kv_cache; engine and tests import it from here
)
from memfit.apply.kv_cache import (
    _CacheNotes,
    _caches_in,
    _note_cache,
    _replay_cache,
)
from memfit.apply.kv_cache import (
    _without_cache as _without_cache,
)
from memfit.capture.tracker import count_outside_dispatch
from memfit.errors import UnsupportedModelError

_MUTATED_ATTR = "_memfit_mutated_buffers"
_STATE_CHECKED_ATTR = "_memfit_state_checks"  # on a block: checkpointed forwards checked for Python state
_REASSIGNED_ATTR = "_memfit_reassigned_attrs"  # on a block: (module path, attribute) its forward reassigns
_CHECKING_ATTR = "_memfit_checking_state"  # on a block during a forward whose Python state is checked

# --- state a recompute would change twice (NOTE [ State a recompute would change twice ]) --------

_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"forward", "training"}  # nn.Module's own machinery
_STATE_CHECKS = 2  # checkpointed forwards per block whose Python state is checked


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
            "use_cache=False (or no cache object) to the model in training, or keep that block (option 'keep' "
            "in the plan)."
        )


_MISSING = object()


def _replaceable(value: Any) -> bool:
    """A value a forward replaces rather than changes in place (replayed, not refused)."""
    return (
        value is None
        or isinstance(value, bool | int | float | str)
        or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter))
    )


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
        if _caches_in(((value,), {})):  # filled once, replayed: NOTE [ A recomputed layer fills its cache once ]
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


# --- buffers are updated once (NOTE [ Buffers are updated once ]) ------------------------------


def _buffer_contexts(blocks: Sequence[nn.Module], inputs: Any) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` of memfit's checkpoints (called with ``preserve_rng_state=False``): (forward,
    recompute) contexts for buffers and RNG, torch's generators included (NOTE [ Generator states
    are counted ]); ``inputs`` are the checkpoint's arguments (their tensors' devices)."""
    tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    device_type = _infer_device_type(*tensors)
    torch_rng = _RngState.now(tensors)  # where torch's checkpoint takes it: context_fn runs just before
    note, replay = _note_and_replay(blocks, inputs)
    return note, EachTime(lambda: _both(_torch_rng_replayed(torch_rng, device_type), replay()))


class EachTime(AbstractContextManager):
    """A context made afresh each time it is entered: torch's checkpoint enters its recompute
    context once per recompute, and a graph kept with ``retain_graph=True`` is recomputed again on
    the next backward (a generator-based context can be entered only once)."""

    def __init__(self, make: Callable[[], AbstractContextManager]) -> None:
        self._make = make
        self._open: list[AbstractContextManager] = []

    def __enter__(self) -> None:
        cm = self._make()
        cm.__enter__()
        self._open.append(cm)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)


def _note_and_replay(
    blocks: Sequence[nn.Module], inputs: Any = None
) -> tuple[AbstractContextManager, Callable[[], AbstractContextManager]]:
    """The forward's noting context, and a factory of recompute contexts that replay what it noted
    (a segment's block may be recomputed more than once: in its segment's recompute and in an
    enclosing segment's); ``inputs``: the blocks' ``(args, kwargs)``, for the key/value caches among
    them (NOTE [ A recomputed layer fills its cache once ])."""
    rng: dict[str, Any] = {}
    attrs: list[dict[tuple[str, str], Any]] = []
    caches = _caches_in(inputs)
    notes = _CacheNotes(calls={}, is_updated={})
    note = _both(
        _note_mutated_buffers(blocks), _note_rng(rng), _note_attributes(blocks, attrs), _note_cache(caches, notes)
    )
    return note, functools.partial(_replay_noted, blocks, rng, attrs, caches, notes)


def _replay_noted(
    blocks: Sequence[nn.Module],
    rng: dict[str, Any],
    attrs: list[dict[tuple[str, str], Any]],
    caches: Sequence[Any],
    notes: _CacheNotes,
) -> AbstractContextManager:
    return _both(
        _restore_mutated_buffers(blocks),
        _replay_rng(rng),
        _replay_attributes(blocks, attrs),
        _replay_cache(caches, notes),
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


# NOTE [ Generator states are counted ]
# torch's non-reentrant checkpoint keeps the generators' states for its recompute:
# ``torch.get_rng_state()``, a 5,056-byte CPU tensor, and on CUDA ``torch.cuda.get_rng_state()`` per
# device of the arguments (16 bytes, also a CPU tensor: nothing on the device). They are made in C++
# without an op, so a dispatch tracker does not see them; the profiler does: memfit's measurements
# and predictions on CPU were 5,056 bytes per recomputed block below the allocator's. So memfit's
# wrappers call checkpoint with ``preserve_rng_state=False`` and keep the same states themselves
# (:class:`_RngState`: same generators, same devices, taken at the same moment), each handed to the
# active trackers when made (:func:`memfit.capture.tracker.count_outside_dispatch`). The recompute
# restores them inside a fork of the generators (:func:`_forked_rng`: ``torch.random.fork_rng``,
# whose own saved states are counted too), as torch's does. A block's state is released when its
# recompute ends (torch's lived until the block's backward ended); a segment's when its frame dies,
# after its backward (the cost model counts it there: ``ChainCosts.checkpoint_state_bytes``).
# Checked against the profiler in tests/test_exactness.py and tests/test_costmodel.py; replay in
# tests/test_engine.py and tests/test_segments.py (dropout masks and generators bitwise).


@dataclass(frozen=True, slots=True)
class _RngState:
    """torch's CPU generator and the generators of the devices a block's tensors are on."""

    cpu: torch.Tensor
    devices: tuple[int, ...]
    device_states: tuple[torch.Tensor, ...]

    @classmethod
    def now(cls, tensors: list[torch.Tensor]) -> _RngState:
        device_type = _infer_device_type(*tensors)
        if getattr(_get_device_module(device_type), "_initialized", False):  # never initialise a device
            devices, states = get_device_states(*tensors)
        else:
            devices, states = [], []
        # under a fake-tensor mode the state is read outside it: a real tensor, with values to compare
        with _disable_current_modes() if detect_fake_mode() is not None else nullcontext():
            cpu = torch.get_rng_state()
        state = cls(cpu=cpu, devices=tuple(devices), device_states=tuple(states))
        count_outside_dispatch(state.cpu, *state.device_states)  # NOTE [ Generator states are counted ]
        return state

    def same(self, other: _RngState) -> bool:
        # Compared outside the dispatch modes: under a fake-tensor mode (memfit.estimate of a plan with
        # segments) torch.equal would be dispatched to fake copies, which have no values. A state that is fake
        # itself (a device's, taken under the mode) has none either: it counts as moved (each block
        # keeps its own, the most a real step keeps).
        states = [(self.cpu, other.cpu), *zip(self.device_states, other.device_states, strict=True)]
        if any(isinstance(t, FakeTensor) for pair in states for t in pair):
            return False
        with _disable_current_modes():
            return self.devices == other.devices and all(torch.equal(a, b) for a, b in states)

    def restore(self, device_type: str) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            set_device_states(list(self.devices), list(self.device_states), device_type=device_type)


@contextmanager
def _forked_rng(devices: Sequence[int], device_type: str) -> Iterator[None]:
    """``torch.random.fork_rng(devices, device_type=...)`` with the states it keeps counted."""
    module = _get_device_module(device_type)
    saved = _RngState(
        cpu=torch.get_rng_state(), devices=tuple(devices), device_states=tuple(module.get_rng_state(d) for d in devices)
    )
    count_outside_dispatch(saved.cpu, *saved.device_states)
    try:
        yield
    finally:
        saved.restore(device_type)


@contextmanager
def _torch_rng_replayed(rng: _RngState, device_type: str) -> Iterator[None]:
    """A recompute's generators: those of its forward; afterwards, where backward found them."""
    with _forked_rng(rng.devices, device_type):
        rng.restore(device_type)
        yield


@contextmanager
def _note_rng(rng: dict[str, Any]) -> Iterator[None]:
    # torch's own generators: _RngState (NOTE [ Generator states are counted ]); these are the others.
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
        [
            (prefix, mod, [(n, b, b._version) for n, b in mod.named_buffers(recurse=False)])
            for prefix, mod in _modules_with_buffers(blk)
        ]
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
