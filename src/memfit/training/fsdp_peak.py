"""The peak of an FSDP2 step on CPU, measured by torch's ``FSDPMemTracker``.

A module of its own because importing torch's tracker loads ``torch.distributed._tools``, DTensor,
``torch._inductor`` and ``torch._dynamo`` (~1.5 s of CPU): only a measured FSDP2 step imports it,
through :func:`memfit.training.distributed.fsdp2_peak`.

Peaks on CPU: memfit's tracker does not see FSDP2's parameter storage being freed and allocated
again (``UntypedStorage.resize_``), so under FSDP2 the measured steps run under torch's
``FSDPMemTracker`` (:func:`fsdp2_peak`), which follows them (tests/test_parallel_estimate.py agrees
with it to ~100 bytes per rank).

NOTE [ Buffers a collective's thread frees ]
gloo runs a collective on its own worker threads, and the work object that holds the collective's
tensors (a reduce-scatter's scratch copy, an all-gather's output) is destroyed by the worker after
it has woken the waiting main thread. Until the worker is scheduled again (and gets the GIL to free
the tensors' Python objects) those buffers stay allocated while the main thread goes on, so a
measured peak can include them: on 2 gloo ranks of a 4-block demo GPT under bf16 mixed precision,
rank 0's peak was the prediction's +0.06 % in most runs and up to +7.1 % on a loaded 2-core CI
machine. :func:`fsdp2_peak` reports the measured peak as torch's tracker has it, plus
``collective_held_bytes``: the bytes of every buffer alive at the peak that a thread other than the
main one freed (0 when every collective's buffers were gone by the peak). On a GPU the collectives
run on streams and the caching allocator reuses blocks by stream order, which this does not model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

__all__ = ["Fsdp2Peak", "fsdp2_peak"]


@contextlib.contextmanager
def fsdp2_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, device: torch.device
) -> Iterator[Fsdp2Peak]:
    """Measure one FSDP2 window on this rank with torch's ``FSDPMemTracker`` (NOTE [ Wrapping ] in
    :mod:`memfit.training.distributed`).

    Yields a :class:`Fsdp2Peak`: call its :meth:`~Fsdp2Peak.next_micro_step` before each
    micro-step's forward; its ``peak_bytes`` (parameter shards, gathered units, gradients,
    optimizer state, activations, the batch) is set when the block ends.
    """
    tracker = _HeldByCollectives(model, optimizer)
    tensors = [
        t
        for t in (batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch])
        if isinstance(t, torch.Tensor)
    ]
    tracker.track_inputs(tuple(tensors))
    peak = Fsdp2Peak(tracker)
    with tracker:
        yield peak
    peak.peak_bytes = int(tracker.get_tracker_snapshot("peak")[device]["Total"])
    peak.collective_held_bytes = tracker.held_at_peak_bytes()


class Fsdp2Peak:
    """What :func:`fsdp2_peak` measures; ``peak_bytes`` and ``collective_held_bytes`` (the part of
    the peak held by buffers a collective's thread freed, NOTE [ Buffers a collective's thread
    frees ]) are None until its block ends."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self.peak_bytes: int | None = None
        self.collective_held_bytes: int | None = None

    def next_micro_step(self) -> None:
        """The tracker refuses a second forward of the root (a window's next micro-step) unless its
        per-module stats are cleared first; the peak it keeps is global and stays."""
        self._tracker.reset_mod_stats()


class _HeldByCollectives(FSDPMemTracker):
    """torch's ``FSDPMemTracker`` that also records which buffers were freed off the main thread
    and whether they were alive at the peak (NOTE [ Buffers a collective's thread frees ]).

    Every op the tracker sees on the main thread (each calls ``_update_peak_stats``) is one step; a
    buffer is alive at the peak's step when it was added before it and freed at or after it. The
    peak is the sum over devices (one device per rank here).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._main_thread = threading.get_ident()
        self._steps = 0
        self._peak_step = -1
        self._peak_total = -1
        self._born: dict[int, int] = {}  # id(winfo) -> step it was added at
        self._freed_elsewhere: list[tuple[int, int, int]] = []  # (added at, freed at, bytes)

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        if u_type.name == "ADD":
            self._born[id(winfo)] = self._steps
        elif u_type.name == "DEL":
            born = self._born.pop(id(winfo), 0)
            if threading.get_ident() != self._main_thread:
                self._freed_elsewhere.append((born, self._steps, winfo.mem_consumed))
        super()._update_snap(u_type, winfo, *args, **kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        self._steps += 1
        super()._update_peak_stats(peak_state)
        total = sum(self._peak_mem.values())
        if total > self._peak_total:
            self._peak_total, self._peak_step = total, self._steps

    def held_at_peak_bytes(self) -> int:
        """Bytes alive at the peak that a thread other than the main one freed."""
        # Added during a step's op (counter s - 1 then), the buffer is alive at that op's peak update (s).
        return sum(n for born, freed, n in self._freed_elsewhere if born < self._peak_step <= freed)
