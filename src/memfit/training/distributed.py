"""The ranks of a run: one process, or a process group set up from ``torchrun``'s environment.

Under ``torchrun --nproc_per_node=N`` (``WORLD_SIZE > 1``) :meth:`Ranks.setup` starts the process
group (gloo on CPU, NCCL on CUDA) unless the caller already did, :meth:`Ranks.wrap` wraps the model
in DDP or FSDP2 (NOTE [ Wrapping ]), and the helpers below move Python objects between ranks. With
one process every helper is the identity and nothing of ``torch.distributed`` is touched.

NOTE [ Wrapping ]
The plan is applied to the plain model first, then the model is wrapped (torchtitan's order):
DDP (``bucket_cap_mb`` from the layout), or FSDP2: ``fully_shard`` on each block of the chain
(``reshard_after_forward`` and the ``MixedPrecisionPolicy`` of ``param_dtype`` / ``reduce_dtype``
from the layout), then on the root with torch's default resharding and the same policy. That is the
layout :mod:`memfit.plan.parallel` accounts for, so a plan made with ``memfit plan --world-size N
--parallel fsdp2`` predicts each rank's peak of this run. Without a layout, ``torchrun`` runs
get DDP with torch's defaults (as before). The Accumulator recognises either wrapper and turns
gradient sync off on the non-final micro-steps (``no_sync`` / ``set_requires_gradient_sync``).

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
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.capture.chain import discover_chain
from memfit.plan.parallel import Parallel, ParallelKind

try:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - torch without distributed
    FSDPMemTracker = fully_shard = MixedPrecisionPolicy = None  # type: ignore[assignment,misc]


class Ranks:
    """The process group when launched by torchrun (WORLD_SIZE > 1), else a single process."""

    def __init__(self, rank: int, world: int, device: torch.device, owned: bool) -> None:
        """Use :meth:`setup`; ``owned``: this object started the process group and ends it."""
        self.rank, self.world, self.device, self._owned = rank, world, device, owned
        self.is_main = rank == 0

    @classmethod
    def setup(cls, device_arg: str) -> Ranks:
        """This process's rank and device (``auto``: ``cuda:LOCAL_RANK`` when CUDA is available)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_arg == "auto":
            device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(device_arg)
            if device.type == "cuda" and device.index is None:
                device = torch.device(f"cuda:{local}")
        if world <= 1:
            return cls(0, 1, device, owned=False)
        owned = not tdist.is_initialized()
        if owned:
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(tdist.get_rank(), tdist.get_world_size(), device, owned)

    def wrap(self, model: nn.Module, parallel: Parallel | None = None, blocks: Any = None) -> nn.Module:
        """``model`` wrapped for the ranks (NOTE [ Wrapping ]); ``model`` itself on one process.

        Args:
            model: the plain model, with its plan applied.
            parallel: the layout (None: DDP with torch's defaults).
            blocks: the chain's containers (the workload's ``blocks``), for FSDP2's units.
        """
        if self.world <= 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        if parallel is None or parallel.kind is ParallelKind.DDP:
            cap_mb = parallel.bucket_cap_bytes / 2**20 if parallel is not None else 25
            return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cap_mb)
        mp = _mixed_precision(parallel)
        for block in discover_chain(model, blocks).blocks:
            fully_shard(block, reshard_after_forward=parallel.reshard_after_forward, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # the root: torch's default (kept gathered from forward to backward)
        return model

    def shares(self, global_batch: int) -> list[int]:
        """Samples of a global batch per rank: ``G / world``, the first ranks one more when it does not divide."""
        return [global_batch // self.world + (r < global_batch % self.world) for r in range(self.world)]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world <= 1:
            return [obj]
        objs: list[Any] = [None] * self.world
        tdist.all_gather_object(objs, obj)
        return objs

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world <= 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (one small all-reduce under torchrun)."""
        if self.world <= 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device if self.device.type == "cuda" else "cpu")
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world > 1:
            tdist.barrier()

    def close(self) -> None:
        """End the process group if :meth:`setup` started it."""
        if self._owned:
            tdist.destroy_process_group()


def _mixed_precision(parallel: Parallel) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the layout's ``param_dtype`` / ``reduce_dtype`` (torch's
    default policy, no casts, when neither is set)."""

    def dtype(name: str | None) -> torch.dtype | None:
        return getattr(torch, name) if name else None

    return MixedPrecisionPolicy(param_dtype=dtype(parallel.param_dtype), reduce_dtype=dtype(parallel.reduce_dtype))


@contextlib.contextmanager
def fsdp2_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, device: torch.device
) -> Iterator[Fsdp2Peak]:
    """Measure one FSDP2 window on this rank with torch's ``FSDPMemTracker`` (NOTE [ Wrapping ]).

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


class _HeldByCollectives(FSDPMemTracker if FSDPMemTracker is not None else object):  # type: ignore[misc]
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
