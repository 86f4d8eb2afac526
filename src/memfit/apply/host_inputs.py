"""Host-held checkpoint inputs: the kept input of a recomputed block lives in host memory until
its recompute.

A recomputed block keeps only its input (``(B, T, C)`` for a transformer layer); over ``L`` layers
that is ``L x B x T x C`` elements, what dominates a recomputed model's activations at long
sequences (transformers measured 36 GB for Qwen3-8B at 128k tokens). With ``host_input`` on a
``recompute`` block (:class:`memfit.plan.types.BlockDecision`), that input is copied to host memory
when the block's checkpoint saves it and copied back when backward recomputes the block, as
transformers' ``gradient_checkpointing_enable(offload=True)`` does with ``save_on_cpu``; here it is
planned per block, priced in the cost model at the measured bandwidth, and prefetched.

NOTE [ Host-held inputs ]
- *What moves*: torch's non-reentrant checkpoint saves its positional tensor arguments with
  ``torch.autograd.graph`` saved-tensor hooks active *outside* its own (``_CheckpointFrame.
  save_inputs``), and nothing else goes through them: :func:`held_on_host` installs hooks around the
  checkpoint call, so they see exactly the block's inputs. Keyword tensors (a mask, rotary
  tables) stay where they are: the model holds them for every layer anyway. Parameters, buffers
  and storages under ``min_bytes`` stay too.
- *CUDA*: the host buffer is pinned; the device-to-host copy runs on a side stream after the
  compute stream reaches the save, and the source storage is recorded on that stream so the
  allocator does not reuse it before the copy ends (as :mod:`memfit.apply.offload` does).
- *Prefetch one block ahead*: the inputs are registered in forward order per model
  (:class:`HostInputs`). When backward unpacks block ``k``'s input (its recompute starts), the
  host-to-device copy of the previous host-held block's input is started on the side stream, so it
  overlaps block ``k``'s recompute and backward; when that block's recompute starts, the compute
  stream waits for the copy's event (no host synchronisation). At most two inputs are on the
  device at once: the one in use and the one arriving. The cost model prices the option at
  ``2 x input bytes / bandwidth`` (:mod:`memfit.profiling.blocks`, the bandwidth ``offload``
  measures), scaled by the measured step like every other option (NOTE [ Cost model ]): the
  overlap shows as a scale below 1, floored at 0.5.
- *CPU*: host and device are the same memory: nothing is saved, and the profile does not offer the
  option (``Stats.calibration.dropped_options["recompute:host"]`` says why). A plan that has it still
  runs, for tests: the host copy is made with the dispatch modes off (a tracker does not count it,
  as it would not count pinned memory beside a GPU) and the copy back is counted.
- *Fake tensors* (an estimate, :mod:`memfit.estimation`): the host copy is shape-only (a meta
  tensor of the input's bytes) and the copy back a device allocation the tracker counts, at the
  same moments as above. The copy back is a view of that allocation (``as_strided``), not a
  ``set_`` onto its storage: FakeTensorMode's dispatch cache keys ``set_`` on the storage object
  and so keeps it alive, and the tracker, which counts a storage until it is freed, would see
  every block's copy back alive to the step's end (one layer's input per held block).

Known limitations:
    Segments keep their input on the device (the option is per block). Inside ``torch.compile``
    the hooks are not traced; the block keeps its input on the device there.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.apply.offload import DEFAULT_MIN_BYTES

__all__ = ["HostInputs", "held_on_host"]


class _HeldInput:
    """One input in host memory, and its device copy once fetched."""

    __slots__ = ("host", "event", "device", "dtype", "size", "stride", "offset", "fetched", "__weakref__")

    def __init__(self, host: torch.Tensor, event: Any, t: torch.Tensor) -> None:
        self.host = host  # (nbytes,) uint8, pinned on CUDA
        self.event = event  # CUDA event after the device-to-host copy, or None
        self.device = t.device
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.fetched: tuple[torch.Tensor, Any] | None = None  # (device bytes, event) once fetched

    def fetch(self, state: HostInputs) -> None:
        """Start the copy back to the device (on CUDA on the side stream)."""
        if self.fetched is not None:
            return
        if self.device.type == "cuda":
            stream = state.side_stream(self.device)
            stream.wait_event(self.event)
            with torch.cuda.stream(stream):
                flat = self.host.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            self.fetched = (flat, event)
        elif self.host.device.type == "meta":  # a fake tensor's shape-only copy: a device allocation, counted
            numel = -(-self.host.numel() // self.dtype.itemsize)  # the storage's bytes in the input's dtype
            self.fetched = (torch.empty(numel, dtype=self.dtype, device=self.device), None)
        else:
            self.fetched = (self.host.to(self.device, copy=True), None)  # counted: device memory

    def tensor(self, state: HostInputs) -> torch.Tensor:
        """The input on the device (waiting on the compute stream for a copy in flight)."""
        self.fetch(state)
        assert self.fetched is not None
        flat, event = self.fetched
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            flat.record_stream(torch.cuda.current_stream(self.device))
        self.fetched = None
        if isinstance(flat, FakeTensor):  # not set_: FakeTensorMode's dispatch cache would keep the storage alive
            return flat.as_strided(self.size, self.stride, self.offset)
        out = torch.empty(0, dtype=self.dtype, device=self.device)
        return out.set_(flat.untyped_storage(), self.offset, self.size, self.stride)


class HostInputs:
    """A model's host-held inputs in forward order (for the prefetch) and the side stream.

    Attributes:
        min_bytes: inputs smaller than this stay on the device.
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self.stream: Any = None
        self.order: list[weakref.ref[_HeldInput]] = []

    def __deepcopy__(self, memo: dict) -> HostInputs:  # a stream cannot be copied: start afresh
        return HostInputs(self.min_bytes)

    def __reduce__(self) -> tuple[Any, ...]:  # nor pickled (NOTE [ Saving applied models ])
        return (HostInputs, (self.min_bytes,))

    def side_stream(self, device: torch.device) -> Any:
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def pack(self, t: torch.Tensor) -> Any:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return t
        if st.nbytes() < self.min_bytes or t.device.type == "meta" or isinstance(t, torch.nn.Parameter):
            return t
        held = _copy_to_host(t, st, self)
        self.order = [r for r in self.order if r() is not None]
        self.order.append(weakref.ref(held))
        return held

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        alive = [h for r in self.order if (h := r()) is not None]
        if packed in alive:  # prefetch the input whose recompute comes next (the previous block's)
            k = alive.index(packed)
            if k > 0:
                alive[k - 1].fetch(self)
            self.order = [weakref.ref(h) for h in alive if h is not packed]
        return packed.tensor(self)

    def waiting(self) -> int:
        """Inputs held on the host, not yet unpacked (for tests)."""
        return sum(1 for r in self.order if r() is not None)

    def prefetched(self) -> int:
        """Held inputs whose copy back has started (for tests)."""
        return sum(1 for r in self.order if (h := r()) is not None and h.fetched is not None)


@contextmanager
def held_on_host(state: HostInputs | None) -> Iterator[None]:
    """Around a checkpoint call: its saved inputs go to host memory (NOTE [ Host-held inputs ]);
    ``None``: nothing changes."""
    if state is None or torch.compiler.is_compiling():
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
        yield


def _copy_to_host(t: torch.Tensor, st: torch.UntypedStorage, state: HostInputs) -> _HeldInput:
    n = st.nbytes()
    if isinstance(t, FakeTensor):  # an estimate (memfit.estimation): nothing to copy, the bytes leave the device
        with _disable_current_modes():
            return _HeldInput(torch.empty(n, dtype=torch.uint8, device="meta"), None, t)
    with _disable_current_modes():  # the host copy is not device memory (NOTE [ Host-held inputs ])
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (n,), (1,))
        if t.device.type == "cuda":
            stream = state.side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            flat.record_stream(stream)
            return _HeldInput(host, event, t)
        host = torch.empty(n, dtype=torch.uint8)
        host.copy_(flat)
        return _HeldInput(host, None, t)
