"""Snapshots: measuring never changes the user's model.

Profiling, planning, fitting, verifying and explaining run real training steps (forward, backward,
an optimizer step) and draw random numbers. :func:`leave_unchanged` lets them do that on the
user's model and puts back, bitwise, everything they may have touched; where the measurement
needs the model in another dtype or on another device it hands out a cast copy instead.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    >>> before = {k: v.clone() for k, v in model.state_dict().items()}
    >>> with leave_unchanged(model) as m:
    ...     opt = torch.optim.AdamW(m.parameters(), lr=1.0)
    ...     m(torch.randn(2, 4)).sum().backward()
    ...     opt.step()
    ...     _ = m.eval()
    >>> all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), model.training
    (True, True)

NOTE [ Measuring leaves the model as it was ]
What :class:`ModelSnapshot` and :class:`RngSnapshot` capture and put back:

- every parameter and buffer of every submodule: its values, dtype, device, shape and strides;
  which tensor object sits under each name (a buffer reassigned as an attribute,
  ``self.steps = self.steps + 1``, gets its original object back), and ``requires_grad``;
- every ``.grad`` (``None`` stays ``None``; a gradient the user had is restored bitwise);
- every module's ``training`` flag (a measurement may switch to ``eval()`` or to ``train()``);
- the random number generators: torch's CPU generator, every CUDA device's (when CUDA is
  initialised), Python's ``random`` and NumPy's global ``np.random`` state;
- and, in :func:`leave_unchanged`, a plan the user had applied (lifted for the measurement, which
  runs the plain model, and applied again afterwards: NOTE [ Lifting what is installed ]).

Why bitwise and not "close": a fine-tuning user who plans, verifies and trains expects to start
from their weights, and a reproducible run expects the same random numbers. A measuring step is
an AdamW step at lr 1e-3 (plan_for_budget moved GPT weights by 43 %, relative L2, before this),
and even a step at a tiny learning rate changes the last bits; BatchNorm running statistics move
in every training forward; dropout advances the RNG. Values are restored by ``copy_`` into the
original tensors, so a parameter keeps its storage (views of it, an optimizer's references and
tied weights stay valid); only a tensor whose dtype, device, shape or strides changed gets new
storage with the original values.

Where the snapshot lives, and what it costs: values are copied to host memory (``.to("cpu")``),
never kept on the accelerator, so on CUDA ``torch.cuda.max_memory_allocated`` during the
measurement sees the model, not the model twice, and the predictions made from it stay those of
a training run. The copies are made before any measuring tracker starts and are never passed to
one, so :class:`~memfit.capture.tracker.MemoryTracker` does not count them either (measured and
predicted peaks are unchanged, byte for byte). The cost is one copy of the parameters, buffers
and existing gradients in host memory and the time to copy them out and back: 17 ms and 10 ms
for the 45 MiB of ``hf:gpt2`` (d=256) on one CPU thread, against the seconds a profile takes.
Nested entry points (``autofit`` around its profiles and measured windows, ``explain`` around
``capture_ops``) each hold their own copy while they run; ``profile`` records its op-level capture
inside its own snapshot.

NOTE [ Lifting what is installed ]
Measuring runs the plain model, so a plan the user applied is taken off for the measurement and put
back afterwards, and a plan the measurement applied and left (it raised) is taken off. Plans live in
:mod:`memfit.apply`, a layer above capture, so capture does not call it: ``apply_plan`` stores, under
:data:`INSTALLED_ATTR` in the model's ``__dict__``, an object with ``remove(model)`` and
``reinstall(model)`` (:class:`Installed`), and :func:`leave_unchanged` calls those. The dependency
points down (apply implements what capture declares); every measuring entry point that goes
through :func:`leave_unchanged` (profile, capture_ops, verify, autofit, explain, ...) lifts plans
the same way, and ``tests/test_never_harm.py`` checks each one with a plan applied.

Casts are a copy, not a snapshot (:func:`cast_copy`): measuring in another dtype or on another
device runs on ``copy.deepcopy`` of the model made in the target dtype and device, and the user's
tensors are neither read back nor written. A cast in place and back would also restore the values
(from the snapshot), but every parameter would end with new storage, which breaks views and
references the user holds; the copy costs one model in the target dtype, which the in-place
cast needs too.

Known limitations:
    - Only state reachable as parameters, buffers, gradients and ``training`` flags is restored.
      Plain tensor attributes that are not buffers (caches a forward fills), optimizers the user
      holds, and other Python state a forward changes are left as the measurement leaves them.
    - The CUDA generators are captured only when CUDA is initialised at the start; a measurement
      that initialises CUDA (``profile(device="cuda")`` of a CPU model) leaves them seeded.
    - A cast copy on the CUDA device the user's model already occupies sits beside it: the
      allocator's peak (``torch.cuda.max_memory_allocated``) then includes the user's model.
      Cast the model yourself (``model.to(dtype)``) before measuring it on the GPU.

size: leave_unchanged and preserved_state share the private saved-tensor machinery of ModelSnapshot.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

__all__ = [
    "INSTALLED_ATTR",
    "Installed",
    "ModelSnapshot",
    "RngSnapshot",
    "cast_copy",
    "every_layer_runs",
    "leave_unchanged",
    "lift",
    "preserved_state",
    "seed_generators",
]


@contextmanager
def leave_unchanged(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[nn.Module]:
    """Measure on ``model`` (or a cast copy of it) and leave it as it was, bitwise.

    Lifts a plan applied to ``model`` (the measurement runs the plain model), takes a
    :class:`ModelSnapshot` and an :class:`RngSnapshot`, and on exit, exception or not, removes any
    plan the measurement left applied, restores both snapshots and applies the user's plan again
    (NOTE [ Measuring leaves the model as it was ]).

    Args:
        model: the user's model.
        device: the device to measure on (default: where the model is).
        dtype: the floating dtype to measure in (default: the model's).

    Yields:
        The module to measure: ``model`` itself, or, when ``device`` or ``dtype`` would change any
        parameter or buffer, a copy made by :func:`cast_copy` (the user's model is then not
        snapshotted: nothing writes to it).

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> with leave_unchanged(m, dtype=torch.float64) as measured:
        ...     measured is m, measured.weight.dtype
        (False, torch.float64)
        >>> m.weight.dtype
        torch.float32
    """
    installed = model.__dict__.get(INSTALLED_ATTR)
    rng = RngSnapshot.take()
    state = None
    lift(model)
    try:
        measured = cast_copy(model, device=device, dtype=dtype)
        state = ModelSnapshot.take(model) if measured is model else None
        yield measured
    finally:
        lift(model)  # whatever the measurement left installed
        if state is not None:
            state.restore()
        rng.restore()
        if installed is not None:
            installed.reinstall(model)


INSTALLED_ATTR = "_memfit_plan"
"""The attribute, in a model's ``__dict__``, that holds what memfit installed on it (an
:class:`Installed`; NOTE [ Lifting what is installed ])."""


class Installed(Protocol):
    """What memfit installed on a model (a plan: :func:`memfit.apply.engine.apply_plan`), as a
    measurement sees it: something to take off and to put back (NOTE [ Lifting what is installed ])."""

    def remove(self, model: nn.Module) -> None:
        """Take it off ``model``: the model's own forwards run again."""

    def reinstall(self, model: nn.Module) -> None:
        """Put it back on ``model``, as it was."""


def lift(model: nn.Module) -> None:
    """Take off ``model`` what memfit installed on it, if anything (NOTE [ Lifting what is installed ])."""
    installed = model.__dict__.get(INSTALLED_ATTR)
    if installed is not None:
        installed.remove(model)


def cast_copy(
    model: nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """``model`` itself when ``device`` and ``dtype`` change nothing, else a deep copy in them.

    The copy is made with ``copy.deepcopy`` whose parameters and buffers are created directly in
    the target device and dtype (floating tensors only take ``dtype``, as ``Module.to`` does), so
    the model is never duplicated in its own dtype on the target device. Gradients are not copied.
    Why a copy: NOTE [ Measuring leaves the model as it was ].

    Args:
        model: the model (not modified).
        device: the target device, or None for each tensor's own.
        dtype: the target floating dtype, or None for each tensor's own.

    Returns:
        ``model``, or its cast copy.
    """
    dev = None if device is None else torch.device(device)
    tensors: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                tensors.setdefault(id(t), t)

    def target(t: torch.Tensor) -> tuple[torch.device, torch.dtype]:
        d = t.device if dev is None or _same_device(t.device, dev) else dev
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return d, dt

    if all(target(t) == (t.device, t.dtype) for t in tensors.values()):
        return model
    memo: dict[int, Any] = {}
    for key, t in tensors.items():
        d, dt = target(t)
        new = t.detach().to(device=d, dtype=dt, copy=True)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        elif t.requires_grad:
            new.requires_grad_(True)
        if t.__dict__:  # attributes libraries set on parameters (HF's _is_hf_initialized, ...)
            new.__dict__.update(copy.deepcopy(t.__dict__, memo))
        memo[key] = new
    return copy.deepcopy(model, _detached_state(model, memo))


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also of a model that keeps a tensor of its last forward's graph.

    A module may keep state of its last forward in a plain attribute (RecurrentGemma's recurrent
    and convolution states): after a training forward that tensor is part of the autograd graph,
    and ``copy.deepcopy`` refuses it ("Only Tensors created explicitly by the user (graph leaves)
    support the deepcopy protocol"). The copy holds it detached (same values, no graph).
    """
    return copy.deepcopy(model, _detached_state(model, {}))


def _detached_state(model: nn.Module, memo: dict[int, Any]) -> dict[int, Any]:
    """``memo`` for deepcopy, with detached copies of the non-leaf tensors held in module attributes."""
    for m in model.modules():
        for value in m.__dict__.values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return memo


@contextmanager
def every_layer_runs(model: nn.Module) -> Iterator[tuple[str, ...]]:
    """Switch LayerDrop off while measuring ``model``; yields where it was on, as
    ``"Wav2Vec2Config.layerdrop 0.1"`` (empty: nothing to switch off).

    NOTE [ LayerDrop is measured with every layer running ]
    LayerDrop skips whole layers at random in training (a draw from torch, NumPy or ``random`` in
    the model's loop over its layers, outside the layer). A profile needs every block to run (it
    measures each block's costs), and the step where every block runs is the largest one: the
    budget holds for every step when it holds for that one. So the measuring entry points set every
    LayerDrop probability to 0 while they measure and put it back afterwards. Planned training with
    LayerDrop on is exact: a recomputed block replays its own generators, and a skipped block is
    simply not called (nothing to recompute). A segment (several blocks recomputed as one unit)
    needs its blocks to run once each, so a profile of a model with LayerDrop offers no segments.
    What is switched off: floats above 0 whose names end in ``layerdrop`` (transformers' convention:
    ``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``, ``speech_encoder_layerdrop``) on the
    model's modules and on their ``config`` objects.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> m.layerdrop = 0.1
        >>> with every_layer_runs(m) as where:
        ...     where, m.layerdrop
        (('Linear.layerdrop 0.1',), 0.0)
        >>> m.layerdrop
        0.1
    """
    found: dict[tuple[int, str], tuple[Any, str, float]] = {}
    for mod in model.modules():
        for owner in (mod, getattr(mod, "config", None)):
            if owner is None or isinstance(owner, torch.Tensor):
                continue
            for key, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
                if key.endswith("layerdrop") and isinstance(value, float) and value > 0.0:
                    found.setdefault((id(owner), key), (owner, key, value))
    try:
        for owner, key, _ in found.values():
            setattr(owner, key, 0.0)
        yield tuple(dict.fromkeys(f"{type(owner).__name__}.{key} {value:g}" for owner, key, value in found.values()))
    finally:
        for owner, key, value in found.values():
            setattr(owner, key, value)


def seed_generators(seed: int) -> None:
    """Seed every global generator a forward may draw from: torch's (CPU and every CUDA device),
    Python's ``random`` and NumPy's ``np.random``.

    Two runs that a measurement compares (verify's reference and planned steps, profile's repeats)
    start from this, so a model that draws from NumPy or ``random`` in its forward (Wav2Vec2's
    SpecAugment masks, LayerDrop's layer skips) draws the same numbers in both. The measuring entry
    points run inside :func:`leave_unchanged`, which puts the user's generators back afterwards.

    Example:
        >>> seed_generators(0); a = (torch.rand(1), random.random(), np.random.rand())
        >>> seed_generators(0); a == (torch.rand(1), random.random(), np.random.rand())
        True
    """
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@dataclass(frozen=True, slots=True)
class RngSnapshot:
    """The global random number generators' states: torch CPU, CUDA (when initialised), Python, NumPy.

    Example:
        >>> s = RngSnapshot.take()
        >>> a = torch.rand(3)
        >>> s.restore()
        >>> torch.equal(torch.rand(3), a)
        True
    """

    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None
    python: Any
    numpy: Any

    @classmethod
    def take(cls) -> RngSnapshot:
        """Capture every global generator now."""
        cuda = (
            tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        np_state = np.random.get_state()
        return cls(torch_cpu=torch.get_rng_state(), cuda=cuda, python=random.getstate(), numpy=np_state)

    def restore(self) -> None:
        """Put every generator back to its captured state (may be called more than once)."""
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(list(self.cuda))
        random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)

    def to_dict(self) -> dict[str, Any]:
        """The states as tensors and plain numbers, loadable with ``torch.load(..., weights_only=True)``.

        The ``rng`` part of an Accumulator's saved state (format ``memfit.accumulate/1``): keys
        ``torch``, ``python`` (``version``, ``internal``, ``gauss_next``), ``cuda`` (when captured)
        and ``numpy`` (``name``, ``keys`` as int64, ``pos``, ``has_gauss``, ``cached_gaussian``).
        """
        version, internal, gauss = self.python
        state: dict[str, Any] = {
            "torch": self.torch_cpu,
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        }
        if self.cuda is not None:
            state["cuda"] = list(self.cuda)
        if self.numpy is not None:
            name, keys, pos, has_gauss, cached = self.numpy
            state["numpy"] = {
                "name": str(name),
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> RngSnapshot:
        """The snapshot :meth:`to_dict` wrote (CUDA states only restored where CUDA is available)."""
        py = state["python"]
        cuda = tuple(state["cuda"]) if "cuda" in state and torch.cuda.is_available() else None
        np_state = None
        if "numpy" in state:
            s = state["numpy"]
            np_state = (s["name"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached_gaussian"])
        return cls(
            torch_cpu=state["torch"],
            cuda=cuda,
            python=(py["version"], tuple(py["internal"]), py["gauss_next"]),
            numpy=np_state,
        )


@dataclass(slots=True)
class _SavedTensor:
    """One parameter or buffer as it was: the object, its values on the host, its metadata."""

    tensor: torch.Tensor
    value: torch.Tensor | None  # None: nothing to restore (meta device, uninitialised lazy parameter)
    device: torch.device
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    requires_grad: bool
    grad: torch.Tensor | None
    grad_device: torch.device | None


@dataclass(slots=True)
class _SavedModule:
    module: nn.Module
    training: bool
    parameters: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor | None]
    non_persistent: set[str]


class ModelSnapshot:
    """Parameters, buffers, gradients, ``requires_grad`` and ``training`` flags of a model, on the
    host, restored bitwise by :meth:`restore` (NOTE [ Measuring leaves the model as it was ]).

    Use :func:`leave_unchanged` around a measurement; this class is the piece it is built from
    (and the one :mod:`memfit.training.guard` uses directly).
    """

    __slots__ = ("_modules", "_tensors")

    def __init__(self, modules: list[_SavedModule], tensors: list[_SavedTensor]) -> None:
        self._modules = modules
        self._tensors = tensors

    @classmethod
    def take(cls, model: nn.Module) -> ModelSnapshot:
        """Copy ``model``'s state to host memory (take it outside any memory tracker)."""
        modules = []
        tensors: dict[int, _SavedTensor] = {}
        for m in model.modules():
            modules.append(
                _SavedModule(m, m.training, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
            )
            for t in [*m._parameters.values(), *m._buffers.values()]:
                if t is not None and id(t) not in tensors:
                    tensors[id(t)] = _save(t)
        return cls(modules, list(tensors.values()))

    def restore(self) -> None:
        """Put the captured state back (may be called more than once)."""
        for s in self._modules:
            m = s.module
            m.training = s.training
            for d, saved in ((m._parameters, s.parameters), (m._buffers, s.buffers)):
                if d.keys() != saved.keys() or any(d[k] is not v for k, v in saved.items()):
                    d.clear()
                    d.update(saved)
            if m._non_persistent_buffers_set != s.non_persistent:
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(s.non_persistent)
        with torch.no_grad():
            for s in self._tensors:
                _restore(s)


def _save(t: torch.Tensor) -> _SavedTensor:
    skip = t.device.type == "meta" or isinstance(t, UninitializedTensorMixin)
    g = None if skip or not t.is_leaf else t.grad
    return _SavedTensor(
        tensor=t,
        value=None if skip else _to_host(t),
        device=t.device,
        dtype=t.dtype,
        shape=t.shape,
        stride=() if skip else t.stride(),
        requires_grad=t.requires_grad,
        grad=None if g is None else _to_host(g),
        grad_device=None if g is None else g.device,
    )


def _restore(s: _SavedTensor) -> None:
    t = s.tensor
    if t.is_leaf and t.requires_grad != s.requires_grad:
        t.requires_grad_(s.requires_grad)
    if s.value is None:
        return
    grad = t.grad if t.is_leaf else None
    if not _write_back(t, s):  # cast, moved or reshaped: new storage with the original values
        t.grad = grad = None
        t.data = s.value.to(s.device, copy=True)
    if s.grad is None:
        if grad is not None:
            t.grad = None
    elif (
        grad is not None and grad.device == s.grad_device and grad.dtype == s.grad.dtype and grad.shape == s.grad.shape
    ):
        grad.copy_(s.grad)
    else:
        t.grad = s.grad.to(s.grad_device, copy=True)


def _write_back(t: torch.Tensor, s: _SavedTensor) -> bool:
    """Copy the saved values into ``t`` itself (same storage); False when ``t`` no longer fits them."""
    if not (t.device == s.device and t.dtype == s.dtype and t.shape == s.shape and t.stride() == s.stride):
        return False
    try:
        t.copy_(s.value)
    except RuntimeError:  # overlapping memory (a buffer expanded along a dimension): not writable
        return torch.equal(t.cpu(), s.value)
    return True


def _to_host(t: torch.Tensor) -> torch.Tensor:
    # Host memory, even for CUDA tensors: NOTE [ Measuring leaves the model as it was ].
    return t.detach().to("cpu", copy=True)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` (no index) names the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a.index == b.index
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


@contextmanager
def preserved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Run code that trains on ``model`` (profiling, auto-fit) and put everything back afterwards.

    :func:`memfit.capture.snapshot.leave_unchanged`: the model's parameters, buffers, gradients,
    ``requires_grad`` and ``training`` flags, its applied plan (lifted meanwhile) and every RNG
    (torch CPU and CUDA, Python, NumPy) are restored bitwise, also after an exception. On CUDA the
    optimizer's state is moved to CPU meanwhile, so that the code inside has the device memory
    training had (the model, its gradients and the code's own optimizer state).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> w = model.weight.detach().clone()
        >>> with preserved_state(model):
        ...     with torch.no_grad():
        ...         _ = model.weight.add_(1.0)
        >>> bool(torch.equal(model.weight, w))
        True
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    moved = (
        _move_optimizer_state(optimizer, torch.device("cpu"))
        if optimizer is not None and device.type == "cuda"
        else None
    )
    try:
        with leave_unchanged(model):
            yield
    finally:
        if moved is not None:
            _move_optimizer_state(optimizer, device, only=moved)


def _move_optimizer_state(
    opt: torch.optim.Optimizer | None, device: torch.device, *, only: set[tuple[int, str]] | None = None
) -> set[tuple[int, str]]:
    """Move optimizer state tensors to ``device``; return the (param id, key) pairs moved."""
    moved: set[tuple[int, str]] = set()
    if opt is None:
        return moved
    for p, st in opt.state.items():
        for k, v in list(st.items()):
            if not isinstance(v, torch.Tensor) or v.device == device:
                continue
            if only is not None and (id(p), k) not in only:
                continue
            st[k] = v.to(device)
            moved.add((id(p), k))
    return moved
