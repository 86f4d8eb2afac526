"""Live tensor memory of a training step, counted op by op.

Two independent ways to measure the peak of live tensor memory on a device:

- :class:`MemoryTracker`, a ``TorchDispatchMode`` that sees every op's outputs and counts each new
  storage once, with weak references to notice frees. Works on CPU, CUDA and fake tensors (a fake
  step measures without allocating anything), gives per-phase peaks, a timeline and a budget
  guard.
- :func:`profiler_peak_bytes`, the allocator's view through ``torch.profiler`` with
  ``profile_memory=True``. Slower and CPU/CUDA only, but it does not depend on the tracker's
  bookkeeping: tests use it as the reference.

Size: about 720 lines, over the ~500 of other modules, because the two methods are one concern (the
peak of live memory) and the second exists to check the first; the tracker's NOTE blocks and Known
limitations take a third of it.

Example:
    >>> model = torch.nn.Linear(64, 64)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> x = torch.randn(32, 64)
    >>> with MemoryTracker(device="cpu").track(model, opt) as tracker:
    ...     with tracker.phase("forward"):
    ...         loss = model(x).square().mean()
    ...     with tracker.phase("backward"):
    ...         loss.backward()
    ...     with tracker.phase("optimizer"):
    ...         opt.step()
    >>> tracker.peak_bytes >= tracker.peak_bytes_by_phase["forward"]
    True
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from memfit.errors import MemfitError, SpecError
from memfit.units import format_bytes

__all__ = [
    "BudgetExceededError",
    "MemoryTracker",
    "TimelineSample",
    "count_outside_dispatch",
    "generator_state_bytes",
    "profiler_peak_bytes",
]

# NOTE [ Counting storages through weak references ]
#
# Memory belongs to storages, not tensors. A view (``x[1:]``, ``x.t()``, ``detach()``), an in-place
# op (``add_``) or an ``out=`` op returns a tensor whose storage already exists; counting tensors
# would count a parameter again each time ``aten.t(weight)`` runs inside ``F.linear``. So each op
# output is reduced to its ``untyped_storage()`` and counted only when that storage is new: not
# already tracked, and not the storage of one of the op's inputs (which covers pre-existing,
# untracked tensors such as a parameter the user chose not to ``track``). The only exception is
# ``aten.lift_fresh``: ``torch.tensor(data)`` builds its tensor outside dispatch and then "lifts"
# it, so the output aliases an input that nobody has seen; it is new memory and counted.
#
# Frees are noticed through a weak reference (with a callback) to the ``UntypedStorage`` object.
# That works because PyTorch 2.x preserves a storage's PyObject: when Python drops its last
# reference while C++ still owns the storage (a tensor, the autograd graph's saved tensors, a
# view), the PyObject is kept alive by the ``StorageImpl`` instead of being deallocated, and
# ``t.untyped_storage()`` keeps returning the same object. It is deallocated, and the callback
# runs, exactly when the ``StorageImpl`` dies, i.e. when the memory goes back to the allocator.
# tests/test_tracker.py checks this (a storage held only by the autograd graph stays counted until
# backward frees the graph). We use ``weakref.ref`` subclasses with a callback rather than
# ``weakref.finalize``: same trigger, but one object per storage that carries its own bookkeeping
# (key, bytes, device), no global registry and no at-exit calls. No tensor or storage is ever held
# strongly, so tracking never extends a lifetime.
#
# The key of a storage is ``id()`` of its (preserved, hence stable) PyObject; the callback removes
# the key before the object's memory can be reused, so keys never collide. Storages grow in place
# (``resize_``, ``out=`` ops on a too-small tensor): every output whose storage is already tracked
# has its ``nbytes()`` compared with the recorded size, and the difference is counted.
#
# Per op the work is proportional to the op's outputs (and, for outputs not yet tracked, its
# inputs), never to the number of live storages: a few microseconds on top of the dispatch mode's
# own cost.


class BudgetExceededError(MemfitError):
    """Live tensor memory went over ``MemoryTracker(budget_bytes=...)``: a simulated out-of-memory.

    Attributes:
        budget_bytes: the budget given to the tracker.
        live_bytes: live tensor bytes on the tracked device right after the op.
        phase: the innermost ``tracker.phase(...)`` at the time, or ``None``.
        op: the name of the op whose outputs crossed the budget.
    """

    def __init__(self, message: str, *, budget_bytes: int, live_bytes: int, phase: str | None, op: str) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.live_bytes = live_bytes
        self.phase = phase
        self.op = op


class TimelineSample(NamedTuple):
    """One change of live memory, recorded when ``record_timeline=True``.

    Attributes:
        op_index: how many ops the tracker had seen when the change happened (1-based after the
            first op; frees between ops carry the index of the last op).
        current_bytes: live bytes on the tracked device after the change.
        phase: the innermost active phase, or ``None``.
    """

    op_index: int
    current_bytes: int
    phase: str | None


class _StorageRef(weakref.ref):
    """A weak reference to an ``UntypedStorage`` carrying what was counted for it."""

    __slots__ = ("key", "nbytes", "device", "host")

    key: int
    nbytes: int
    device: torch.device
    host: bool

    def __new__(cls, storage: torch.UntypedStorage, callback: Callable[[_StorageRef], None], *_: Any) -> _StorageRef:
        return super().__new__(cls, storage, callback)

    def __init__(
        self,
        storage: torch.UntypedStorage,
        callback: Callable[[_StorageRef], None],
        key: int,
        nbytes: int,
        device: torch.device,
        host: bool = False,
    ) -> None:
        super().__init__(storage, callback)
        self.key = key
        self.nbytes = nbytes
        self.device = device
        self.host = host


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor bytes on one device while active: peak, per-phase peaks, timeline.

    Enter it around a whole training step (forward, backward, optimizer step). Every op's new
    output storages are counted by ``storage.nbytes()`` and subtracted when the storage dies (see
    ``NOTE [ Counting storages through weak references ]``). Memory that exists before the tracker
    (parameters, gradients, optimizer state, the batch) counts only once registered with
    :meth:`track`; gradients and optimizer state created inside the tracker are counted on their
    own.

    Args:
        device: the device whose memory is counted (``current_bytes``, ``peak_bytes``, phases,
            timeline, budget). ``None`` takes the device of the first tensor the tracker meets,
            through :meth:`track` or as an op output, and ``cpu`` until then. Give it explicitly
            when a step mixes devices (a CUDA step also creates small CPU tensors, such as
            AdamW's ``step`` counters). Storages on other devices are still counted in
            ``current_bytes_by_device`` / ``peak_bytes_by_device``.
        budget_bytes: when set, an op after which live bytes on ``device`` exceed it raises
            :class:`BudgetExceededError`; used to simulate running out of memory on CPU.
        record_timeline: keep a :class:`TimelineSample` at every change of live bytes on
            ``device`` (in ``timeline``, with when in ``timeline_times_s``), for plots.
        record_allocations: keep the ordered stream of allocations and frees on ``device`` (in
            ``allocations``: ``(storage key, bytes)``, negative bytes for a free), which
            :mod:`memfit.estimation.allocator` replays through a model of CUDA's caching allocator.

    Raises:
        SpecError: ``budget_bytes`` is negative.
        BudgetExceededError: from inside the step, when ``budget_bytes`` is exceeded.

    Example:
        >>> with MemoryTracker(device="cpu") as tracker:
        ...     x = torch.empty(1024, dtype=torch.float32)
        ...     y = x.view(32, 32)  # a view: no new memory
        >>> tracker.current_bytes, tracker.peak_bytes
        (4096, 4096)

    Known limitations:
        - Only tensors produced by dispatched ops while the tracker is active, and those passed to
          :meth:`track` or :func:`count_outside_dispatch`, are counted. (torch's own checkpoint
          keeps a CPU generator state per call, made outside the dispatcher; memfit's wrappers keep
          theirs instead and count it.) Memory a kernel allocates and frees internally (workspaces),
          allocator rounding and caching (CUDA rounds blocks to 512 bytes), and
          ``UntypedStorage.resize_`` called directly on a storage (FSDP does this) are not seen.
          The tracker is therefore a lower bound of the allocator's peak. Where it matters: on
          CPU (torch 2.13, oneDNN) the backward of a *strided* convolution allocates two
          grad-input-sized buffers inside the kernel, so for a small stride-2 conv net the
          tracker reports 27 % less than the profiler; stride-1 convs, linear layers, attention
          and the optimizer agree to a few bytes. cuDNN workspaces on CUDA are the same kind.
          A kernel that computes in another dtype than an input's casts that input inside itself
          (a bool mask times floats), and ``torch.logsumexp`` on CPU allocates ``exp(x - max)``:
          code measured for exactness avoids both (memfit's chunked head does). Python numbers
          passed to ops become 0-d tensors outside the dispatcher (8 bytes each, freed at once):
          on a transformers training step the tracker's peak is a few hundred bytes below the
          profiler's (72 B on tests/test_exactness.py's GPT-2, 288 B on hf:gpt2).
        - Sparse, MKLDNN and nested tensors without an untyped storage are ignored; tensor
          subclasses that wrap other tensors (DTensor) count only what their inner ops show.
        - Under fake tensors, prefer entering the tracker *inside* ``FakeTensorMode`` (``with
          FakeTensorMode(): with MemoryTracker(): ...``): the tracker then sees each op once,
          first. The other order also measures the same in torch 2.13 (the fake mode hands its
          ops on to the modes below it), but that is an implementation detail.
        - ``torch.compile``d code run under a dispatch mode runs eagerly and stays eager: do not
          measure compiled modules with the tracker (use :func:`profiler_peak_bytes`).
        - Frees are accounted from weak-reference callbacks, which run on the thread that frees
          the storage. Bookkeeping takes no lock: on CPU, backward runs on the calling thread, so
          this is exact; a CUDA backward runs on an autograd device thread while the caller
          waits, which is fine as long as no other thread runs tensor code at the same time.
        - After the tracker exits, frees are still subtracted from ``current_bytes`` (so that a
          re-entered tracker stays consistent), but nothing new is counted.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        budget_bytes: int | None = None,
        record_timeline: bool = False,
        record_allocations: bool = False,
    ) -> None:
        super().__init__()
        if budget_bytes is not None and budget_bytes < 0:
            raise SpecError(
                f"memfit.capture: budget_bytes={budget_bytes} is negative. Give a byte count >= 0, "
                "or None for no budget."
            )
        self._device: torch.device | None = None if device is None else _with_index(torch.device(device))
        self._budget_bytes = budget_bytes
        self._records: dict[int, _StorageRef] = {}
        self._current_bytes = 0
        self._peak_bytes = 0
        self._bytes_by_device: dict[torch.device, int] = {}
        self._peak_by_device: dict[torch.device, int] = {}
        self._phases: list[str] = []
        self._peak_by_phase: dict[str, int] = {}
        self._timeline: list[TimelineSample] | None = [] if record_timeline else None
        self._timeline_times_s: list[float] = []  # time.perf_counter() of each timeline sample
        self._allocations: list[tuple[int, int]] | None = [] if record_allocations else None
        self._op_index = 0
        self._host_depth = 0  # inside host_scope(): new CPU storages are host bytes
        self._host_bytes = 0
        self._peak_host_bytes = 0

    # ---------------------------------------------------------------- public API

    @property
    def device(self) -> torch.device:
        """The device whose memory is counted (``cpu`` while still unresolved)."""
        return self._device if self._device is not None else torch.device("cpu")

    @property
    def current_bytes(self) -> int:
        """Live tensor bytes on ``device`` counted by this tracker now."""
        return self._current_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since construction or the last :meth:`reset_peak`."""
        return self._peak_bytes

    @property
    def peak_bytes_by_phase(self) -> dict[str, int]:
        """Per phase name, the highest ``current_bytes`` seen while that phase was active.

        A phase entered several times (one forward per micro-batch) keeps the highest of all its
        entries. The bytes live when the phase starts count as part of it.
        """
        return dict(self._peak_by_phase)

    @property
    def current_bytes_by_device(self) -> dict[torch.device, int]:
        """Live counted bytes for every device the tracker has seen a storage on."""
        return dict(self._bytes_by_device)

    @property
    def peak_bytes_by_device(self) -> dict[torch.device, int]:
        """Per device, the highest live counted bytes (reset by :meth:`reset_peak`)."""
        return dict(self._peak_by_device)

    @property
    def timeline(self) -> list[TimelineSample]:
        """The samples recorded so far (empty unless ``record_timeline=True``)."""
        return list(self._timeline) if self._timeline is not None else []

    @property
    def timeline_times_s(self) -> list[float]:
        """When each :attr:`timeline` sample was recorded (``time.perf_counter()`` seconds, one per
        sample). Under the tracker each op runs slower (its bookkeeping), so these times stretch a
        step: they place samples in time, they do not time the step."""
        return list(self._timeline_times_s)

    @property
    def allocations(self) -> list[tuple[int, int]]:
        """The allocations and frees on ``device`` so far, in order: ``(key, bytes)``, bytes negative
        for a free (empty unless ``record_allocations=True``). A key is the storage's, unique among
        live storages; it can come back after its storage is freed."""
        return list(self._allocations) if self._allocations is not None else []

    @property
    def allocation_count(self) -> int:
        """Entries in :attr:`allocations` so far (a position in that stream, without copying it)."""
        return len(self._allocations) if self._allocations is not None else 0

    @property
    def op_count(self) -> int:
        """Number of ops the tracker has seen."""
        return self._op_index

    def track(self, *objs: Any) -> MemoryTracker:
        """Count tensors that exist already, so that they are part of the live bytes.

        A storage is counted once however many times it is passed (a tied weight, a parameter
        given both directly and through its module); it is subtracted when it dies.

        Args:
            *objs: tensors; ``nn.Module`` (its parameters, buffers and their existing ``.grad``);
                ``torch.optim.Optimizer`` (the tensors in its ``state``); or lists, tuples, sets,
                iterators and mappings (their values) of those, such as a batch. Plain values
                among them (numbers, strings, ``None``) are skipped.

        Returns:
            The tracker itself, so that ``MemoryTracker().track(model, opt)`` reads as one.

        Raises:
            TypeError: an object is none of the above (a NumPy array, say).
        """
        for t in _iter_tensors(objs):
            self._track_tensor(t)
        for obj in objs:
            host_tensors = getattr(obj, "host_tensors", None)
            if callable(host_tensors):  # an optimizer keeping its state on the host (memfit.optim.host)
                self.track_host(host_tensors())
        return self

    # NOTE [ Host bytes ]
    # A placement that keeps model states in host memory (memfit.optim.host) makes and changes its
    # host tensors inside ``host_scope()``, and lists the ones that exist already through a
    # ``host_tensors()`` method. Their storages are counted in ``host_bytes`` / ``peak_host_bytes``
    # and nowhere else (not in ``current_bytes``, not per device), so that a step measured with the
    # host being the device itself (the CPU) reports the device bytes this placement has on a GPU,
    # and the host bytes apart.

    def track_host(self, *objs: Any) -> MemoryTracker:
        """Count existing tensors (as :meth:`track` takes them) as host bytes (NOTE [ Host bytes ])."""
        for t in _iter_tensors(objs):
            self._track_tensor(t, host=True)
        return self

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        """CPU storages made inside count as host bytes, not device bytes (NOTE [ Host bytes ])."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    @property
    def host_bytes(self) -> int:
        """Live host-placed bytes now (NOTE [ Host bytes ])."""
        return self._host_bytes

    @property
    def peak_host_bytes(self) -> int:
        """Highest :attr:`host_bytes` since construction or the last :meth:`reset_peak`."""
        return self._peak_host_bytes

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the memory of a region to ``name`` in ``peak_bytes_by_phase``.

        Phases may nest: a change inside an inner phase counts for every enclosing phase too.

        Args:
            name: the phase name, such as ``"forward"``, ``"backward"`` or ``"optimizer"``.

        Example:
            >>> tracker = MemoryTracker()
            >>> with tracker, tracker.phase("forward"):
            ...     y = torch.zeros(256)
            >>> tracker.peak_bytes_by_phase
            {'forward': 1024}
        """
        self._phases.append(name)
        if self._current_bytes > self._peak_by_phase.get(name, -1):
            self._peak_by_phase[name] = self._current_bytes
        try:
            yield
        finally:
            self._phases.pop()

    def reset_peak(self) -> None:
        """Start the peaks again from now: ``peak_bytes = current_bytes``.

        The per-device peaks restart from each device's live bytes; the per-phase peaks are
        cleared, except active phases, which restart from ``current_bytes``. The timeline and the
        live bytes are kept.
        """
        self._peak_bytes = self._current_bytes
        self._peak_by_device = dict(self._bytes_by_device)
        self._peak_by_phase = {name: self._current_bytes for name in self._phases}
        self._peak_host_bytes = self._host_bytes

    # ---------------------------------------------------------------- dispatch

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        self._op_index += 1
        if isinstance(out, torch.Tensor):
            self._record_output(out, func, args, kwargs, None)
        elif isinstance(out, (tuple, list)):
            input_keys = None
            for o in out:
                if isinstance(o, torch.Tensor):
                    input_keys = self._record_output(o, func, args, kwargs, input_keys)
                elif isinstance(o, (tuple, list)):
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            input_keys = self._record_output(p, func, args, kwargs, input_keys)
        budget = self._budget_bytes
        if budget is not None and self._current_bytes > budget:
            self._raise_budget_exceeded(str(func))
        return out

    # ---------------------------------------------------------------- private machinery

    def _record_output(
        self,
        t: torch.Tensor,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        input_keys: set[int] | None,
    ) -> set[int] | None:
        """Count ``t``'s storage if new, or a change of its size; returns the inputs' keys."""
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, mkldnn, nested: no storage
            return input_keys
        key = id(storage)
        rec = self._records.get(key)
        if rec is not None:
            nbytes = storage.nbytes()
            if nbytes != rec.nbytes:  # resized in place: resize_, a growing out= op
                delta = nbytes - rec.nbytes
                rec.nbytes = nbytes
                self._change(delta, rec.device, rec.host)
            return input_keys
        if func is not _LIFT_FRESH:
            if input_keys is None:
                input_keys = _storage_keys(args, kwargs)
            if key in input_keys:  # an alias of an untracked input (a view of a parameter, ...)
                return input_keys
        self._add_storage(storage, key, t.device)
        return input_keys

    def _track_tensor(self, t: torch.Tensor, *, host: bool = False) -> None:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        key = id(storage)
        rec = self._records.get(key)
        if rec is None:
            self._add_storage(storage, key, t.device, host=host)
        elif host and not rec.host:  # counted on the device before it was named a host tensor
            if self._allocations is not None and rec.device == self._device and rec.nbytes > 0:
                self._allocations.append((key, -rec.nbytes))
            self._change(-rec.nbytes, rec.device)
            rec.host = True
            self._change(rec.nbytes, rec.device, True)

    def _add_storage(
        self, storage: torch.UntypedStorage, key: int, device: torch.device, *, host: bool = False
    ) -> None:
        nbytes = storage.nbytes()
        host = host or (self._host_depth > 0 and device.type == "cpu")
        self._records[key] = _StorageRef(storage, self._on_free, key, nbytes, device, host)
        if host:
            self._change(nbytes, device, True)
            return
        if self._device is None:
            self._device = device
        if self._allocations is not None and device == self._device and nbytes > 0:
            self._allocations.append((key, nbytes))
        self._change(nbytes, device)

    def _on_free(self, ref: _StorageRef) -> None:
        # Weak-reference callback: the storage is being deallocated (may run from GC or from
        # another thread; see Known limitations). Only remove our own record.
        if self._records.get(ref.key) is ref:
            del self._records[ref.key]
            if self._allocations is not None and ref.device == self._device and ref.nbytes > 0 and not ref.host:
                self._allocations.append((ref.key, -ref.nbytes))
            self._change(-ref.nbytes, ref.device, ref.host)

    def _change(self, delta: int, device: torch.device, host: bool = False) -> None:
        # Each counter is updated in one statement, so that a free callback triggered in between
        # (by cyclic GC) cannot lose an update.
        if host:  # NOTE [ Host bytes ]
            self._host_bytes += delta
            if self._host_bytes > self._peak_host_bytes:
                self._peak_host_bytes = self._host_bytes
            return
        by_device = self._bytes_by_device
        by_device[device] = by_device.get(device, 0) + delta
        if by_device[device] > self._peak_by_device.get(device, 0):
            self._peak_by_device[device] = by_device[device]
        if device != self._device or delta == 0:
            return
        self._current_bytes += delta
        current = self._current_bytes
        if delta > 0:
            if current > self._peak_bytes:
                self._peak_bytes = current
            for name in self._phases:
                if current > self._peak_by_phase[name]:
                    self._peak_by_phase[name] = current
        if self._timeline is not None:
            self._timeline.append(TimelineSample(self._op_index, current, self._phases[-1] if self._phases else None))
            self._timeline_times_s.append(time.perf_counter())

    def _raise_budget_exceeded(self, op: str) -> None:
        phase = self._phases[-1] if self._phases else None
        where = f"in phase {phase!r}" if phase is not None else "outside any phase"
        raise BudgetExceededError(
            f"memfit.capture: live tensor memory on {self.device} reached "
            f"{format_bytes(self._current_bytes)} ({self._current_bytes} bytes) after {op} "
            f"(op #{self._op_index}) {where}, over the budget of "
            f"{format_bytes(self._budget_bytes)} ({self._budget_bytes} bytes). Raise the budget, "
            "lower the batch size, or checkpoint (or offload) more activations.",
            budget_bytes=self._budget_bytes,
            live_bytes=self._current_bytes,
            phase=phase,
            op=op,
        )


def count_outside_dispatch(*tensors: torch.Tensor) -> None:
    """Count tensors made outside the dispatcher in every :class:`MemoryTracker` active now.

    Some tensors are built in C++ without an op, so no dispatch mode sees them: the generator
    states of ``torch.get_rng_state()`` and ``torch.cuda.get_rng_state()`` (a 5,056-byte CPU
    tensor for the CPU generator; 16 bytes, also on the CPU, for a CUDA one). Code that keeps such
    a tensor while a step runs (memfit's recomputed blocks keep one per block until backward) passes
    it here right after making it; each active tracker then counts it as if an op had returned it,
    until it dies; torch's ``MemTracker``/``FSDPMemTracker``, when active, get them through their
    ``track_external``. Outside any tracker this does nothing.

    Args:
        *tensors: the tensors just made.
    """
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemoryTracker):
            mode.track(*tensors)
        elif hasattr(mode, "_update_and_maybe_create_winfos") and hasattr(mode, "_ref_class"):
            # torch's MemTracker and FSDPMemTracker (torch.distributed._tools; memfit train measures
            # FSDP2 ranks on the CPU with the latter) count a tensor made outside the dispatcher only
            # when registered with them (FSDPMemTracker's track_external is a no-op): as an
            # activation, what a recomputed block keeps until its backward. Private torch API, so
            # guarded: a torch without it leaves these bytes uncounted there, as before.
            for t in tensors:
                mode._update_and_maybe_create_winfos(t, mode._ref_class.ACT)


def generator_state_bytes(device: torch.device | str) -> int:
    """Bytes on ``device`` of the generator state one checkpoint keeps for its recompute.

    The CPU generator's state (``torch.get_rng_state()``, 5,056 bytes in torch 2.13) on the CPU;
    0 on other devices, whose generator states (16 bytes on CUDA) are CPU tensors too. memfit's
    recomputing wrappers keep one and count it (:func:`count_outside_dispatch`).

    Args:
        device: a device, or a device name as ``Stats.device`` holds it (``cpu``, ``cuda:0``, or
            an estimate's GPU name such as ``h100-sxm``: not the CPU).
    """
    return torch.get_rng_state().nbytes if str(device).split(":")[0] == "cpu" else 0


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device): tensors report their device with an index."""
    if device.index is None and device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "current_device") and mod.is_available():
            return torch.device(device.type, mod.current_device())
    return device


def _storage_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """Keys (``id`` of the storage object) of the storages of an op's tensor arguments."""
    keys: set[int] = set()
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                _add_key(keys, a)
            elif isinstance(a, (tuple, list)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        _add_key(keys, b)
    return keys


def _add_key(keys: set[int], t: torch.Tensor) -> None:
    try:
        keys.add(id(t.untyped_storage()))
    except (NotImplementedError, RuntimeError):
        pass


def _iter_tensors(objs: Iterable[Any]) -> Iterator[torch.Tensor]:
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from _iter_tensors(state.values())
        elif isinstance(obj, Mapping):
            yield from _iter_tensors(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, Iterator)):
            yield from _iter_tensors(obj)
        elif obj is None or isinstance(obj, (str, bytes, int, float, complex)):
            continue  # plain values next to tensors: optimizer state, batch metadata
        else:
            raise TypeError(
                f"memfit.capture: MemoryTracker.track() cannot count a {type(obj).__name__}. "
                "Pass tensors, nn.Module, torch.optim.Optimizer, or lists/tuples/dicts/iterators "
                "of those."
            )


# ---------------------------------------------------------------- profiler cross-check


def profiler_peak_bytes(fn: Callable[[], Any], *, device: torch.device | str = "cpu") -> int:
    """Peak of the bytes ``fn`` allocates on ``device``, as the allocator reports them.

    Runs ``fn()`` under ``torch.profiler.profile(profile_memory=True)`` (CPU activity, plus CUDA
    on a CUDA device) and walks the profiler's allocation events in time order: allocations add
    their size, frees subtract it, starting from zero; the result is the highest running sum. A
    free is counted only when its allocation happened inside ``fn``: the CPU allocator remembers
    the sizes of blocks allocated under an earlier profiling session and reports their frees in
    the next one, which would otherwise pull the sum down. This is also why the profiler's own
    "Total Allocated" column is not used: it is the allocator's running total across sessions.

    How the events are read (torch 2.x): ``prof.profiler.kineto_results`` is the
    ``_ProfilerResult``; ``experimental_event_tree()`` returns the event tree, in which
    allocation events are those whose ``typed[0]`` is ``_EventType.Allocation`` with extra fields
    ``ptr``, ``alloc_size`` (negative for a free), ``total_allocated`` and ``device``. The
    ``[memory]`` entries of ``prof.events()`` / ``kineto_results.events()`` carry the same sizes
    (``cpu_memory_usage``, ``nbytes()``) but no address, so frees cannot be paired with
    allocations there. (``prof._memory_profile()`` builds a categorised timeline from the same
    tree but needs ``record_shapes``, ``with_stack`` and is far slower.)

    Args:
        fn: the code to measure, called once with no arguments; its return value is dropped
            after profiling stops.
        device: the device whose allocations are summed; ``cuda`` means any CUDA index unless
            one is given.

    Returns:
        The peak, in bytes, of memory allocated by ``fn`` and still live (0 when nothing was
        allocated). Memory that existed before ``fn`` is not part of it.

    Example:
        >>> profiler_peak_bytes(lambda: torch.empty(1024, dtype=torch.float32))
        4096
    """
    want = torch.device(device)
    activities = [ProfilerActivity.CPU]
    if want.type == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    del result
    kineto_results = prof.profiler.kineto_results if prof.profiler is not None else None
    if kineto_results is None:
        return 0

    events: list[tuple[int, int, int]] = []  # (start ns, ptr, signed bytes)
    stack = list(reversed(kineto_results.experimental_event_tree()))
    while stack:  # pre-order walk: siblings stay in time order
        ev = stack.pop()
        stack.extend(reversed(ev.children))
        kind, fields = ev.typed
        if kind != _EventType.Allocation:
            continue
        dev = fields.device
        if dev.type != want.type or (want.index is not None and dev.index != want.index):
            continue
        events.append((ev.start_time_ns, fields.ptr, fields.alloc_size))
    events.sort(key=lambda e: e[0])

    live: dict[int, int] = {}  # ptr -> bytes allocated inside fn and not yet freed
    current = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            live[ptr] = live.get(ptr, 0) + nbytes
            current += nbytes
            peak = max(peak, current)
        elif nbytes < 0 and ptr in live:
            freed = min(-nbytes, live.pop(ptr))
            current -= freed
    return peak
