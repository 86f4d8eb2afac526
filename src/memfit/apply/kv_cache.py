"""Key/value caches under recompute: a recomputed transformers layer fills its cache once (NOTE [ A
recomputed layer fills its cache once ]), or, for a cache memfit cannot replay, runs without it.

Used by :mod:`memfit.apply.state` (the recompute contexts every recomputing wrapper enters) and by
the wrappers that call a block (:mod:`memfit.apply.engine`, :mod:`memfit.apply.segments`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import UnsupportedModelError

_CACHE_ARGS = ("cache", "past_key_value", "past_key_values", "layer_past")  # transformers' names
_MISSING = object()


class CacheDroppedWarning(UserWarning):
    """A recomputed transformers layer is called without its key/value cache (as HF's own
    gradient checkpointing does)."""


def _without_cache(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, compiled: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args, kwargs`` without a key/value cache, for a transformers layer that writes a cache
    memfit cannot replay (NOTE [ A recomputed layer fills its cache once ]), or that runs compiled
    (traced now, or ``compiled``: a compiled forward called from here); otherwise with a stand-in for
    each cache (:func:`_stand_in`)."""
    cls = type(block)
    # Also in eval mode: transformers checkpoints only in training, memfit wherever gradients are on.
    if getattr(block, "_can_checkpoint_with_cache", True):
        # Not a transformers GradientCheckpointingLayer, or one that only reads the cache.
        return (args, kwargs) if torch.compiler.is_compiling() else _standing_in(args, kwargs)
    positions = _cache_positions(cls)
    found = [
        kwargs[name] if name in kwargs else args[pos] if pos is not None and pos < len(args) else None
        for name, pos in positions.items()
        if name != "use_cache"
    ]
    caches = [c for c in found if c is not None and c is not False]
    if not torch.compiler.is_compiling() and not compiled and all(_replayable_cache(c) for c in caches):
        return _standing_in(args, kwargs)  # the forward fills it, the recompute replays it (_note_cache, _replay_cache)
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
    if dropped and not torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn (a graph break)
        kinds = sorted({type(c).__name__ for c in caches if not _replayable_cache(c)})
        warnings.warn(
            f"memfit.apply: recomputed {cls.__name__} layers run without their key/value cache while "
            f"gradients are on ({', '.join(sorted(set(dropped)))} off; memfit replays only transformers' dynamic "
            f"caches, this is {', '.join(kinds) or 'a compiled forward'}): the cache this forward returns misses "
            f"those layers, do not decode from it. Pass use_cache=False in training{', or a DynamicCache' if kinds else ''}.",
            CacheDroppedWarning,
            stacklevel=3,
        )
    return tuple(args), kwargs


# NOTE [ A recomputed layer fills its cache once ]
# A transformers layer given a key/value cache calls ``cache.update(keys, values, layer_idx)``, which
# appends the new keys and values to the cache's layer ``layer_idx`` and returns the ones to attend
# to (the past and the new). Run again in backward it would append them twice; called without the
# cache (transformers' own gradient checkpointing) it leaves its layer of the cache empty, and
# decoding from that half cache gives wrong logits. memfit calls a recomputed layer with the cache
# in the forward, so the cache fills exactly as without a plan, and notes, at each ``update`` call
# (:func:`_noting_update`), a shallow copy of the cache layer as the call found it (references to
# its past tensors and its counters: no tensor is copied, and in training, where the cache starts
# empty, nothing is held). The recompute runs with a list of layers built from those copies (a copy
# of each, each time), so the layer reads its past length and attends to the keys and values the
# forward did, and its update writes into the copy. An ``EncoderDecoderCache`` also gets its
# ``is_updated`` flags as the forward found them (the recompute then projects the cross-attention
# keys again, as the forward did).
#
# The layer is called with a stand-in for the cache (:func:`_stand_in`), never the cache itself:
# an object of the cache's class whose ``layers`` list (and flags) is the cache's own while the
# layer's forward runs, and an empty list once it returns. A recompute's arguments (torch's
# checkpoint, a segment's record) hold the stand-in, which holds the cache only weakly: a caller
# that drops the cache after the forward (``loss = model(**batch).loss``, the usual training step,
# with ``use_cache=True`` transformers' default) frees its keys and values then, as without a plan,
# instead of keeping every layer's until the backward reaches the first recomputed layer (which the
# cost model does not count: GPT-2, 16 layers with segments, measured 20.8 % over the prediction
# before, equal to it after). The recompute never touches the caller's cache.
# Replayed: caches whose layers are transformers' ``DynamicLayer`` and ``DynamicSlidingWindowLayer``
# (they replace their tensors by concatenation, never in place; what ``use_cache=True`` creates),
# and encoder-decoder caches of them; static, quantized, offloaded and linear-attention caches
# update in place and are dropped as transformers' checkpointing does, with a warning that the
# cache returned is incomplete. Known limitation: a layer that reads a part of the cache it does
# not update in that forward (another layer's, or cross-attention keys an earlier forward stored)
# reads, in the recompute, what the cache holds after the forward; if nothing holds the cache by
# then, the read raises an error that says so (:class:`_ReleasedLayer`).

_DYNAMIC_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def _sub_caches(cache: Any) -> list[Any]:
    """The caches whose ``update`` a layer calls: ``cache``, or an encoder-decoder cache's two."""
    subs = [getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)]
    return [c for c in subs if c is not None] or [cache]


def _replayable_cache(cache: Any) -> bool:
    """A transformers cache memfit replays in a recompute (NOTE [ A recomputed layer fills its cache once ])."""
    if not type(cache).__module__.startswith("transformers"):
        return False
    for c in _sub_caches(cache):
        layers = getattr(c, "layers", None)
        if not callable(getattr(c, "update", None)) or not isinstance(layers, list) or getattr(c, "offloading", False):
            return False
        grow = getattr(c, "layer_class_to_replicate", None)
        classes = [type(layer) for layer in layers if not isinstance(layer, _ReleasedLayer)]
        classes += [grow] if grow is not None else []
        if any(k.__name__ not in _DYNAMIC_LAYERS or k.__module__ != "transformers.cache_utils" for k in classes):
            return False
    return True


def _caches_in(inputs: Any) -> list[Any]:
    """The replayable caches among a block's arguments ``(args, kwargs)`` (top level)."""
    if inputs is None:
        return []
    args, kwargs = inputs
    out: list[Any] = []
    for value in (*args, *kwargs.values()):
        if (
            value is not None
            and not isinstance(value, torch.Tensor | bool | int | float | str)
            and callable(getattr(value, "update", None))
            and _replayable_cache(value)
            and all(value is not c for c in out)
        ):
            out.append(value)
    return out


@dataclass(eq=False, slots=True)
class _CacheNotes:
    """What a forward's calls of ``update`` found, per cache: ``(layer_idx, shallow copy of the layer
    before the call, or None for a layer the call created)``; and the ``is_updated`` flags."""

    calls: dict[int, list[tuple[int, Any]]]
    is_updated: dict[int, dict[int, bool]]


_CACHE_OF_ATTR = "_memfit_stands_for"  # on a stand-in: a weak reference to the caller's cache


def _standing_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args, kwargs`` with each replayable cache among them (top level) replaced by a stand-in."""
    made: dict[int, Any] = {}

    def swap(value: Any) -> Any:
        if not _caches_in(((value,), {})) or _CACHE_OF_ATTR in value.__dict__:
            return value  # not a cache, or a stand-in already (a segment's block recomputed alone)
        if id(value) not in made:
            made[id(value)] = _stand_in(value)
        return made[id(value)]

    if not any(_caches_in(((v,), {})) for v in (*args, *kwargs.values())):
        return args, kwargs
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def _stand_in(cache: Any) -> Any:
    """A stand-in for ``cache`` (NOTE [ A recomputed layer fills its cache once ]): a shallow copy
    sharing its ``layers`` list and ``is_updated`` flags until :func:`_release` empties them."""
    s = copy.copy(cache)
    d = s.__dict__
    d[_CACHE_OF_ATTR] = weakref.ref(cache)
    for name in ("self_attention_cache", "cross_attention_cache"):
        if name in d:
            d[name] = _stand_in(d[name])
    return s


def _release(stand_in: Any) -> None:
    """Empty a stand-in: it holds none of the cache's layers (nor keys and values) any more."""
    d = stand_in.__dict__
    if isinstance(d.get("is_updated"), dict):
        d["is_updated"] = {}
    for c in _sub_caches(stand_in):
        if c is not stand_in or isinstance(d.get("layers"), list):
            c.__dict__["layers"] = []


class _ReleasedLayer:
    """In a recompute, a layer of a cache nothing holds any more, that the layer did not update in
    its forward: reading it raises (NOTE [ A recomputed layer fills its cache once ])."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __getattr__(self, name: str) -> Any:
        raise UnsupportedModelError(
            f"memfit.apply: the recompute of a layer read layer {self.index} of its key/value cache ({name}), which "
            "it did not update in its forward, and the cache was dropped after the forward; keep the model's output "
            "(its past_key_values) until backward, or pass use_cache=False in training."
        )


@contextmanager
def _note_cache(caches: Sequence[Any], notes: _CacheNotes) -> Iterator[None]:
    patches = []
    for cache in caches:
        flags = getattr(cache, "is_updated", None)
        if isinstance(flags, dict):
            notes.is_updated[id(cache)] = dict(flags)
        for c in _sub_caches(cache):
            patches.append(_patch_update(c, _noting_update(c, notes.calls.setdefault(id(c), []))))
    try:
        yield
    finally:
        for undo in reversed(patches):
            undo()
        for cache in caches:
            if _CACHE_OF_ATTR in cache.__dict__:
                _release(cache)


@contextmanager
def _replay_cache(caches: Sequence[Any], notes: _CacheNotes) -> Iterator[None]:
    restore = []  # (object's __dict__, attribute, value to put back)
    for cache in caches:
        flags = getattr(cache, "is_updated", None)
        if isinstance(flags, dict) and id(cache) in notes.is_updated:
            restore.append((cache.__dict__, "is_updated", flags))
            cache.__dict__["is_updated"] = dict(notes.is_updated[id(cache)])
        for c in _sub_caches(cache):
            d = c.__dict__
            restore.append((d, "layers", d["layers"]))
            d["layers"] = _replayed_layers(c, notes.calls.get(id(c), ()))
    try:
        yield
    finally:
        for d, name, value in reversed(restore):
            d[name] = value


def _replayed_layers(c: Any, calls: Sequence[tuple[int, Any]]) -> list[Any]:
    """The layers a recompute runs with: a copy of each layer the forward updated, as the forward
    found it; the others as the cache holds them now (the caller's, while alive)."""
    ref = c.__dict__.get(_CACHE_OF_ATTR)
    held = ref() if ref is not None else c  # not a stand-in: the cache itself
    layers = list(held.layers) if held is not None else []
    for idx, before in reversed(calls):  # the first call's wins: the recompute repeats the later ones
        layers.extend(_ReleasedLayer(i) for i in range(len(layers), idx + 1))
        layers[idx] = copy.copy(before) if before is not None else c.layer_class_to_replicate()
    return layers


def _noting_update(cache: Any, calls: list[tuple[int, Any]]) -> Callable[..., Any]:
    """``cache.update`` for a forward: notes the layer each call finds, then updates the cache."""
    orig = cache.update

    def update(key: torch.Tensor, value: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> Any:
        calls.append((layer_idx, copy.copy(cache.layers[layer_idx]) if layer_idx < len(cache.layers) else None))
        return orig(key, value, layer_idx, *a, **kw)

    return update


def _patch_update(cache: Any, update: Callable[..., Any]) -> Callable[[], None]:
    """Set ``cache.update`` on the instance; returns the undo (what was there before comes back)."""
    d = cache.__dict__
    prev = d.get("update", _MISSING)
    d["update"] = update

    def undo() -> None:
        if prev is _MISSING:
            d.pop("update", None)
        else:
            d["update"] = prev

    return undo


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
