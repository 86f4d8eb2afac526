"""Offload: keep what a block saves for backward in host memory instead of on the device.

A block in option ``offload`` runs its forward under ``torch.autograd.graph.saved_tensors_hooks``:
each tensor autograd saves, except parameters, buffers and the block's own inputs, is copied to
host memory when it is saved and copied back when backward needs it. Nothing is recomputed, so
gradients are exactly those of plain training.

NOTE [ Offload ]
- *Per storage*: memory belongs to storages, and autograd often saves several views of one
  storage (``q, k, v`` of one projection). The first time a storage is saved in a forward it is
  copied whole (as raw bytes) to the host; later views of it reuse that copy. Backward copies a
  storage back once and rebuilds each view with its dtype, size, stride and offset, so the device
  holds what keeping the block would have held, no more.
- *Inputs stay*: the block's inputs (and parameters, buffers) are not offloaded: the previous
  block's output is alive anyway (as the recompute and selective options keep it), so copying it
  would cost transfer time and save no memory.
- *CUDA*: host buffers are pinned; the device-to-host copy runs on a side stream (after the
  compute stream reaches the save) and the source storage is recorded on that stream, so the
  allocator does not reuse it before the copy ends. The host-to-device copy in backward runs on
  the compute stream after waiting for the copy's event: no host synchronisation, and the
  backward kernels that follow wait for it in stream order. There is no prefetch: each block's
  activations arrive when its backward asks for them (that time is the option's cost).
- *CPU*: host and device are the same memory, so offloading cannot save anything and the planner
  never offers it. It still runs (tests check it gives the same gradients and that activations
  leave the count): the host copy is made with the Python dispatch modes disabled
  (``torch.utils._python_dispatch._disable_current_modes``), so :class:`MemoryTracker`, which
  counts storages that dispatched ops create on its device, does not count the host copies,
  exactly as it would not count pinned host memory next to a GPU; the device copy made in
  backward is counted as usual. Process RSS does not drop on CPU, by construction.

Known limitations:
    Tensors below ``min_bytes`` stay on the device (tiny transfers cost more than they save).
    A forward that saves the same storage after mutating it in place offloads the first version;
    autograd's own version check raises in that case, as it does without offload.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from memfit.workload import iter_tensors

__all__ = ["DEFAULT_MIN_BYTES", "OffloadState", "measure_bandwidth", "offloaded"]

DEFAULT_MIN_BYTES = 64 * 1024  # smaller saved storages stay on the device


class _HostCopy:
    """One storage's bytes in host memory, and its device copy while backward uses it."""

    __slots__ = ("host", "event", "device", "dev_ref", "src_ref", "__weakref__")

    def __init__(self, host: torch.Tensor, event: Any, device: torch.device, src: torch.UntypedStorage) -> None:
        self.host = host  # (nbytes,) uint8 on the host
        self.event = event  # CUDA event recorded after the copy, or None
        self.device = device
        self.dev_ref: Any = None  # weakref to the device copy's storage while it is alive
        self.src_ref = weakref.ref(src)  # the source storage, to tell a reused id from the same storage

    def to_device(self) -> torch.UntypedStorage:
        dev = self.dev_ref() if self.dev_ref is not None else None
        if dev is not None:
            return dev
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self.event)
            flat = self.host.to(self.device, non_blocking=True)
        else:
            flat = self.host.to(self.device, copy=True)  # counted by a tracker: it is device memory
        dev = flat.untyped_storage()
        self.dev_ref = weakref.ref(dev)
        return dev


@dataclass(slots=True)
class OffloadState:
    """Per-block offload settings and the side stream (made on first use on CUDA).

    Attributes:
        min_bytes: saved storages smaller than this stay on the device.
    """

    min_bytes: int = DEFAULT_MIN_BYTES
    stream: Any = None

    def __deepcopy__(self, memo: dict) -> OffloadState:  # a stream cannot be copied: start afresh
        return OffloadState(min_bytes=self.min_bytes)

    def __reduce__(self) -> tuple[Any, ...]:  # nor pickled (a saved model makes its own on first use)
        return (OffloadState, (self.min_bytes,))

    def side_stream(self, device: torch.device) -> Any:
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        return self.stream


@contextmanager
def offloaded(block: nn.Module, args: Any, state: OffloadState) -> Iterator[None]:
    """Run a block's forward with what it saves moved to host memory (NOTE [ Offload ]).

    Args:
        block: the block (its parameters and buffers stay where they are).
        args: the forward's arguments (tensors among them stay where they are).
        state: the block's :class:`OffloadState`.
    """
    keep = {id(t.untyped_storage()) for t in iter_tensors((list(block.parameters()), list(block.buffers()), args))}
    copies: dict[int, _HostCopy] = {}  # this forward's storages already copied

    def pack(t: torch.Tensor) -> Any:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return t
        key = id(st)
        if key in keep or st.nbytes() < state.min_bytes or t.device.type == "meta":
            return t
        hc = copies.get(key)
        if hc is None or hc.src_ref() is not st:
            hc = copies[key] = _copy_to_host(st, t.device, state)
        return (hc, t.dtype, t.size(), t.stride(), t.storage_offset())

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        hc, dtype, size, stride, offset = packed
        dev = hc.to_device()
        return torch.empty(0, dtype=dtype, device=hc.device).set_(dev, offset, size, stride)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _copy_to_host(st: torch.UntypedStorage, device: torch.device, state: OffloadState) -> _HostCopy:
    n = st.nbytes()
    with _disable_current_modes():  # the host copy is not device memory (NOTE [ Offload ])
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (n,), (1,))
        if device.type == "cuda":
            stream = state.side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            flat.record_stream(stream)
            return _HostCopy(host, event, device, st)
        host = torch.empty(n, dtype=torch.uint8)
        host.copy_(flat)
        return _HostCopy(host, None, device, st)


def measure_bandwidth(device: torch.device | str, *, nbytes: int = 64 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """Measured copy bandwidth between ``device`` and pinned host memory (bytes per second).

    Returns:
        ``(device_to_host, host_to_device)``, medians of ``repeats`` copies of ``nbytes``. On the
        CPU, memory-copy bandwidth both ways.
    """
    dev = torch.device(device)
    pin = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    sync = (lambda: torch.cuda.synchronize(dev)) if pin else (lambda: None)

    def rate(dst: torch.Tensor, s: torch.Tensor) -> float:
        times = []
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            dst.copy_(s, non_blocking=pin)
            sync()
            times.append(time.perf_counter() - t0)
        return nbytes / max(1e-9, statistics.median(times[1:]))

    return rate(host, src), rate(src, host)
