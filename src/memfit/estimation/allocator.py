"""A model of PyTorch's CUDA caching allocator: what ``max_memory_allocated`` and
``max_memory_reserved`` will read for a step whose allocations and frees are known.

memfit predicts the peak of live tensor bytes (the tracker's quantity). On a GPU what runs out is
the caching allocator's *reserved* memory: the segments it took from the driver with ``cudaMalloc``
and keeps cached, used or not. :class:`CachingAllocator` replays an ordered stream of allocations
and frees (the one a fake step records: :attr:`memfit.estimation.fake.FakeStep.allocations`) by the
rules of torch's allocator; :func:`replay_step` runs a step's stream as training runs it, step after
step, and :func:`allocator_model` adds the kernel workspaces no tensor owns.

Size: about 720 lines, over the ~500 of other modules: the rules as torch writes them (three NOTE
blocks, a third of the file), the allocator that follows them and the replay that feeds it are one
concern; the replay is checked against a brute-force allocator in tests/test_allocator.py.

NOTE [ CUDA caching allocator rules ]
From ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch, commit
001074d25084fdb87a799823e395a50f5ec044d3; the same rules since torch 2.1):

- Rounding (``round_size``): every request is rounded up to a multiple of 512 B (``kMinBlockSize``).
- Pools (``get_pool``): requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones
  from the large pool. Each pool keeps its free blocks per stream: a block freed on one stream is
  never handed to another.
- Best fit (``get_free_block``): the smallest free block of the pool and stream that is at least
  the request (ties: the lowest address). With ``max_split_size_mb`` set, a request below it does
  not take a block at or above it, and a request at or above it takes a block only up to 20 MiB
  larger.
- New segments (``get_allocation_size``): when no free block fits, ``cudaMalloc`` a segment of
  2 MiB (``kSmallBuffer``) for a small request, 20 MiB (``kLargeBuffer``) for a request below
  10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``).
- Splitting (``should_split``): the block handed out is the front of the free block found; the rest
  stays free in the pool if it is at least 512 B (small pool) or more than 1 MiB (large pool, and
  only for requests below ``max_split_size``). Otherwise the whole block is handed out, and
  ``allocated`` counts the whole block.
- Freeing (``free_block``): a freed block merges with free neighbours of its segment and goes back
  to the pool. Nothing is returned to the driver: reserved memory only grows, except when
  ``cudaMalloc`` fails (then cached blocks that are whole segments are released and the
  allocation retried; with ``max_split_size`` first just enough oversize ones) or on
  ``torch.cuda.empty_cache()``.
- ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``): one segment per pool and stream
  that grows by mapping pages at its end (2 MiB pages in the small pool, 20 MiB in the large one);
  a request that no free block fits maps just enough pages after the segment's last free block;
  any remainder of at least 512 B is split off (``should_split``).
- Statistics: ``allocated_bytes`` counts blocks handed out (their full size), ``reserved_bytes``
  the segments (mapped pages); their ``peak`` is what ``max_memory_allocated`` /
  ``max_memory_reserved`` read.

NOTE [ A step's allocations as training repeats it ]
``max_memory_reserved`` after a few steps is what runs out, and it depends on what the earlier
steps left cached. :func:`replay_step` allocates what exists before the step (parameters, buffers,
optimizer state, the batch: the events before ``step_start``), then replays the step's events
``steps`` times; between steps, what the step allocated and still holds at its end (gradients) is
freed first, as ``optimizer.zero_grad(set_to_none=True)`` frees it. Two steps reach the steady
state on the models tried (the third leaves reserved where the second did, a test checks this);
the default is three.

NOTE [ What the model adds beside the replay ]
- cuBLAS workspaces: torch allocates one per (cuBLAS handle, stream) through the caching allocator
  (``CublasHandlePool.cpp``): ``4096 KiB x 8 = 32 MiB`` on Hopper and later (sm90+),
  ``2 x 4096 KiB + 8 x 16 KiB`` before (``CUBLAS_WORKSPACE_CONFIG``'s defaults). A training step
  uses two: the forward's thread and the autograd engine's device thread. They are large-pool
  blocks of their own segment and stay allocated, so they add to both predictions.
- Checked against the recorded H200 runs (benchmarks/allocator_check.py --recorded; report
  benchmarks/reports/allocator_recorded_*): the gap between ``max_memory_allocated`` and the tracked
  tensor peak is the two workspaces, plus the replay's 512 B rounding and blocks handed out whole,
  plus about 2 MiB already allocated before the step that no tensor memfit tracks owns (not
  modelled: its owner is not known without a GPU to look at).
- Without a stream (:func:`allocator_model` given only a tensor peak) the reserved prediction is
  a lower bound: the allocated peak rounded up to whole 2 MiB segments plus one small segment.

NOTE [ A rank's reserved memory ]
A rank of a DDP or FSDP2 job is predicted from its live-tensor peak (NOTE [ Per-rank accounting ] in
:mod:`memfit.plan.parallel`) plus two cached amounts, not from a replay of the rank's own stream
(the fake step is one process's):
- the default stream's caching: what one process running the same plan and micro-batch in the
  same dtype reserves above its allocated peak (its replay). The activations, the head and the loss
  allocate and free the same sizes in the same order on a rank; the model states do not: an FSDP2
  rank holds 1/N of the parameters, optimizer state and gradient shards, and its optimizer step's
  temporaries are 1/N of the one process's. The replay runs the rank's stream
  (:func:`shard_model_states`): the model states' allocations, the gradients live when the optimizer
  starts and every event of the optimizer step, at 1/N of their bytes. Replaying the one process's
  optimizer step instead cached the unsharded model's temporaries, which no rank holds (a 70B model
  on 64 ranks: 18 GiB too many).
- FSDP2's all-gather outputs are allocated on the all-gather copy-in stream
  (``foreach_all_gather`` in torch's ``_fsdp_collectives.py``), whose cached blocks the default
  stream cannot use. That pool grows to the most flat outputs live at once: the root's, or a
  block's own and the previous block's (``max(Fp_root, 2 Fp_block)``); at the rank's peak one
  block's is live and counted in the peak, the rest is cached: ``max(Fp_root, 2 Fp_block) - Fp_block``.
- FSDP2's reduce-scatter outputs are allocated on the reduce-scatter stream (``foreach_reduce``:
  ``reduce_output = reduce_scatter_input.new_empty(...)`` under ``reduce_scatter_stream``) and become
  the gradient shards. ``zero_grad(set_to_none=True)`` frees them before the next forward, and their
  blocks stay cached in that stream's pool, which the forward's activations cannot use: the rank's
  gradient-shard bytes are reserved at a peak in forward or in the head (at a peak late in backward
  the shards made so far are live and counted twice: the prediction is high by up to them).

Known limitations:
    - The stream is the fake step's: one CUDA stream. Collectives on their own streams (FSDP2's
      all-gather and reduce-scatter, DDP's buckets) hold their own cached blocks; the per-rank
      prediction adds them as separate pools (:func:`rank_allocator_model`) rather than replaying
      the collectives.
    - Kernel-internal scratch (cuDNN, flash attention's workspace) is not in the stream; cross-stream
      uses (``record_stream``) that delay a free, CUDA graphs' private pools, ``roundup_power2_divisions``
      and the garbage-collection threshold are not modelled.
    - The block addresses of separate ``cudaMalloc`` calls are the driver's; the model lays
      segments out in the order they are made, which only decides ties between free blocks of the
      same size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError, SpecError
from memfit.estimation.devices import DeviceSpec

__all__ = [
    "AllocatorConfig",
    "AllocatorOutOfMemoryError",
    "AllocatorPrediction",
    "AllocatorReplay",
    "CachingAllocator",
    "allocator_model",
    "collective_pool_bytes",
    "cublas_workspace_bytes",
    "rank_allocator_model",
    "replay_step",
    "round_size",
    "segment_size",
    "shard_model_states",
]

_KiB, _MiB = 2**10, 2**20
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_REQUEST_BYTES = 1 * _MiB  # kSmallSize
SMALL_SEGMENT_BYTES = 2 * _MiB  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 * _MiB  # kLargeBuffer
MIN_LARGE_ALLOC_BYTES = 10 * _MiB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * _MiB  # kRoundLarge
_HOPPER_AND_LATER = ("h100", "h200")  # sm90 in the device table
STEP_WORKSPACES = 2
"""cuBLAS workspaces a training step holds: the forward's thread and autograd's device thread."""


class AllocatorOutOfMemoryError(MemfitError):
    """The replay needed more than ``AllocatorConfig.capacity_bytes`` even after releasing every
    cached whole segment (torch raises ``torch.OutOfMemoryError`` there)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorConfig:
    """The allocator settings a replay follows (``PYTORCH_CUDA_ALLOC_CONF``).

    Attributes:
        expandable_segments: ``expandable_segments:True``.
        max_split_size_bytes: ``max_split_size_mb`` in bytes (None: unlimited, torch's default).
        capacity_bytes: memory the allocator may reserve (None: unlimited); past it, cached whole
            segments are released and the request retried, as torch does when ``cudaMalloc`` fails.
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None
    capacity_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "expandable_segments": self.expandable_segments,
            "max_split_size_bytes": self.max_split_size_bytes,
            "capacity_bytes": self.capacity_bytes,
        }


def round_size(nbytes: int) -> int:
    """A request's block size: at least 512 B, a multiple of 512 B (``round_size``).

    Example:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return MIN_BLOCK_BYTES * max(1, -(-nbytes // MIN_BLOCK_BYTES))


def segment_size(block_bytes: int) -> int:
    """The segment ``cudaMalloc``\\ ed for a (rounded) request no free block fits (``get_allocation_size``).

    Example:
        >>> [segment_size(s) // 2**20 for s in (512, 2**20, 2**20 + 512, 10 * 2**20, 11 * 2**20 + 512)]
        [2, 2, 20, 10, 12]
    """
    if block_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if block_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return ROUND_LARGE_BYTES * -(-block_bytes // ROUND_LARGE_BYTES)


class _Block:
    """A block of a segment: allocated or free (NOTE [ CUDA caching allocator rules ])."""

    __slots__ = ("addr", "allocated", "next", "prev", "size", "small", "stream", "tail")

    def __init__(self, addr: int, size: int, stream: int, small: bool) -> None:
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.tail = False  # expandable segments: the free block at the segment's mapped end

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


class CachingAllocator:
    """PyTorch's CUDA caching allocator, replayed on sizes (NOTE [ CUDA caching allocator rules ]).

    Example:
        >>> a = CachingAllocator()
        >>> a.malloc("x", 3 * 2**20)  # 3 MiB: the large pool, a 20 MiB segment
        >>> a.malloc("y", 100)  # 100 B: a 512 B block of a 2 MiB small segment
        >>> a.free("x")
        >>> a.allocated_bytes, a.reserved_bytes // 2**20, a.max_allocated_bytes
        (512, 22, 3146240)
    """

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> sorted keys
        self._by_key: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[Any, _Block] = {}
        self._tails: dict[tuple[bool, int], _Block] = {}  # (small, stream) -> expandable segment's end
        self._next_addr = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0
        self.segment_count = 0
        self.retries = 0

    # ------------------------------------------------------------ public API

    def malloc(self, key: Any, nbytes: int, stream: int = 0) -> None:
        """Allocate ``nbytes`` for ``key`` on ``stream``.

        Raises:
            SpecError: ``key`` is live already.
            AllocatorOutOfMemoryError: over ``capacity_bytes`` after the release-and-retry.
        """
        if key in self._live:
            raise SpecError(f"memfit.allocator: {key!r} is allocated already; free it first.")
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST_BYTES
        block = self._best_fit(small, stream, size)
        if block is None:
            block = self._new_memory(small, stream, size)
        self._take(block, size)
        self._live[key] = block
        self.allocated_bytes += block.size
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)

    def free(self, key: Any) -> None:
        """Free ``key``'s block: it merges with free neighbours and stays cached.

        Raises:
            SpecError: ``key`` is not live.
        """
        block = self._live.pop(key, None)
        if block is None:
            raise SpecError(f"memfit.allocator: {key!r} is not allocated; nothing to free.")
        self.allocated_bytes -= block.size
        block.allocated = False
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._merge(block, other)
        self._insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment no block of which is in use."""
        self._release_cached()

    @property
    def live_keys(self) -> list[Any]:
        """Keys allocated now."""
        return list(self._live)

    @property
    def live_set(self) -> Any:
        """Keys allocated now, as a set-like view."""
        return self._live.keys()

    # ------------------------------------------------------------ private machinery

    def _insert(self, block: _Block) -> None:
        k = block.key()
        bisect.insort(self._free[block.small], k)
        self._by_key[k] = block

    def _remove(self, block: _Block) -> None:
        k = block.key()
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, k)
        del pool[i]
        del self._by_key[k]

    def _best_fit(self, small: bool, stream: int, size: int) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i == len(pool) or pool[i][0] != stream:
            return None
        block = self._by_key[pool[i]]
        if self.config.expandable_segments and block.tail:
            # get_free_block: the block at an expandable segment's end counts as the size it can
            # grow to, so any other free block that fits comes first.
            if i + 1 < len(pool) and pool[i + 1][0] == stream:
                block = self._by_key[pool[i + 1]]
        cap = self.config.max_split_size_bytes
        if cap is not None and not self.config.expandable_segments:
            if size < cap <= block.size:
                return None  # no oversize block for a request below max_split_size
            if size >= cap and block.size >= size + LARGE_SEGMENT_BYTES:
                return None
        self._remove(block)
        return block

    def _new_memory(self, small: bool, stream: int, size: int) -> _Block:
        if self.config.expandable_segments:
            return self._expand(small, stream, size)
        alloc = segment_size(size)
        cap = self.config.capacity_bytes
        if cap is not None and self.reserved_bytes + alloc > cap:
            self.retries += 1
            self._release_cached()
            if self.reserved_bytes + alloc > cap:
                raise AllocatorOutOfMemoryError(
                    f"memfit.allocator: out of memory: {alloc} B more on {self.reserved_bytes} B reserved "
                    f"({self.allocated_bytes} B allocated) is over the capacity of {cap} B."
                )
        block = _Block(self._next_addr, alloc, stream, small)
        self._next_addr += alloc
        self._reserve(alloc)
        self.segment_count += 1
        return block

    def _expand(self, small: bool, stream: int, size: int) -> _Block:
        page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        tail = self._tails.get((small, stream))
        if tail is None:  # a new expandable segment: its address space, nothing mapped yet
            tail = _Block(self._next_addr, 0, stream, small)
            tail.tail = True
            self._next_addr += 2**50
            self.segment_count += 1
        elif not tail.allocated and tail.size:
            self._remove(tail)
        have = tail.size if not tail.allocated else 0
        grow = page * -(-(size - have) // page)
        cap = self.config.capacity_bytes
        if cap is not None and self.reserved_bytes + grow > cap:
            raise AllocatorOutOfMemoryError(
                f"memfit.allocator: out of memory: {grow} B more pages on {self.reserved_bytes} B reserved "
                f"({self.allocated_bytes} B allocated) is over the capacity of {cap} B."
            )
        if tail.allocated:  # map after the allocated end block: a new free block there
            new = _Block(tail.addr + tail.size, grow, stream, small)
            new.prev, tail.next = tail, new
            tail.tail = False
            new.tail = True
            tail = new
        else:
            tail.size += grow
        self._tails[(small, stream)] = tail
        self._reserve(grow)
        return tail

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)

    def _take(self, block: _Block, size: int) -> None:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            cap = self.config.max_split_size_bytes
            split = (cap is None or size < cap) and remaining > SMALL_REQUEST_BYTES
        if split:  # the front is handed out, the rest stays free
            rest = _Block(block.addr + size, remaining, block.stream, block.small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            if block.tail:
                block.tail, rest.tail = False, True
                self._tails[(block.small, block.stream)] = rest
            self._insert(rest)
        block.allocated = True

    def _merge(self, block: _Block, other: _Block) -> None:
        """Fold the free neighbour ``other`` into ``block`` (try_merge_blocks)."""
        self._remove(other)
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size
        if other.tail:
            block.tail = True
            self._tails[(block.small, block.stream)] = block

    def _release_cached(self) -> None:
        """release_cached_blocks: free every cached block that is a whole segment to the driver
        (expandable segments: unmap the whole pages of their free end)."""
        for small in (True, False):
            for k in list(self._free[small]):
                block = self._by_key[k]
                if block.tail:
                    page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
                    unmapped = (block.size // page) * page if block.addr % page == 0 else 0
                    if unmapped:
                        self._remove(block)
                        block.size -= unmapped
                        self.reserved_bytes -= unmapped
                        if block.size:
                            self._insert(block)
                elif block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved_bytes -= block.size
                    self.segment_count -= 1


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorReplay:
    """What a replayed stream of allocations left in the allocator's statistics (bytes).

    Attributes:
        max_allocated_bytes: ``torch.cuda.max_memory_allocated`` over the replay.
        max_reserved_bytes: ``torch.cuda.max_memory_reserved`` over the replay.
        reserved_bytes_by_step: reserved memory at the end of each replayed step.
        segments: segments (``cudaMalloc`` calls not released) at the end.
        steps: steps replayed.
        config: the allocator settings replayed.
    """

    max_allocated_bytes: int
    max_reserved_bytes: int
    reserved_bytes_by_step: tuple[int, ...]
    segments: int
    steps: int
    config: AllocatorConfig

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_allocated_bytes": self.max_allocated_bytes,
            "max_reserved_bytes": self.max_reserved_bytes,
            "reserved_bytes_by_step": list(self.reserved_bytes_by_step),
            "segments": self.segments,
            "steps": self.steps,
            "config": self.config.to_dict(),
        }


def replay_step(
    events: Sequence[tuple[int, int]],
    *,
    step_start: int = 0,
    steps: int = 3,
    config: AllocatorConfig | None = None,
    extra_blocks: Iterable[int] = (),
) -> AllocatorReplay:
    """Replay a step's allocations as training repeats it (NOTE [ A step's allocations as training repeats it ]).

    Args:
        events: ``(key, nbytes)`` in order: ``nbytes > 0`` allocates ``key``, ``< 0`` frees it
            (what :class:`memfit.capture.tracker.MemoryTracker` records with ``record_allocations``).
        step_start: events before it exist before the first step (parameters, optimizer state,
            the batch) and are allocated once.
        steps: times the step's events are replayed.
        config: allocator settings (default: torch's).
        extra_blocks: sizes allocated first and held throughout (cuBLAS workspaces).

    Raises:
        SpecError: ``steps`` below 1, or a free of a key not allocated.
    """
    if steps < 1:
        raise SpecError(f"memfit.allocator: steps={steps} must be at least 1.")
    alloc = CachingAllocator(config)
    for i, nbytes in enumerate(extra_blocks):
        alloc.malloc(("extra", i), nbytes)
    for key, nbytes in events[:step_start]:
        if nbytes > 0:
            alloc.malloc(("pre", key), nbytes)
        else:
            alloc.free(("pre", key))
    body = events[step_start:]
    live_pre = {key for key, _ in events[:step_start]} & {k[1] for k in alloc.live_keys if k[0] == "pre"}
    by_step = []
    for s in range(steps):
        for key, nbytes in body:
            if nbytes > 0:
                alloc.malloc((s, key), nbytes)
            elif (s, key) in alloc.live_set:
                alloc.free((s, key))
            elif key in live_pre:  # a step frees what existed before it (once)
                live_pre.discard(key)
                alloc.free(("pre", key))
            elif s == 0:
                raise SpecError(f"memfit.allocator: event {key!r} frees a key that is not allocated.")
        by_step.append(alloc.reserved_bytes)
        if s + 1 < steps:  # zero_grad(set_to_none=True): what the step still holds goes
            for k in [k for k in alloc.live_keys if k[0] == s]:
                alloc.free(k)
    return AllocatorReplay(
        max_allocated_bytes=alloc.max_allocated_bytes,
        max_reserved_bytes=alloc.max_reserved_bytes,
        reserved_bytes_by_step=tuple(by_step),
        segments=alloc.segment_count,
        steps=steps,
        config=alloc.config,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorPrediction:
    """The allocator model's numbers for one step (bytes; NOTE [ What the model adds beside the replay ]).

    Attributes:
        tensor_peak_bytes: the live-tensor peak (the tracker's quantity; the budget's on the CPU).
        workspace_bytes: cuBLAS workspaces.
        predicted_allocated_bytes: ``max_memory_allocated``.
        predicted_reserved_bytes: ``max_memory_reserved``: what a budget on CUDA means.
        method: ``replay`` (the step's allocations replayed), ``rank`` (a rank's peak plus a
            one-process replay's caching and the collectives' pools) or ``bound`` (from the peak
            alone: reserved is then a lower bound).
        replay: the replay's numbers, when replayed.
    """

    tensor_peak_bytes: int
    workspace_bytes: int
    predicted_allocated_bytes: int
    predicted_reserved_bytes: int
    method: str = "bound"
    replay: AllocatorReplay | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "workspace_bytes": self.workspace_bytes,
            "predicted_allocated_bytes": self.predicted_allocated_bytes,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "method": self.method,
            "model": {
                "replay": "the step's allocations replayed through torch's caching allocator rules, plus cuBLAS workspaces",
                "rank": "the rank's peak + cuBLAS workspaces + a one-process replay's cached bytes + the collectives' stream pools",
            }.get(self.method, "cuBLAS workspaces + whole 2 MiB segments (a lower bound of reserved)"),
        }
        if self.replay is not None:
            d["replay"] = self.replay.to_dict()
        return d


def rank_allocator_model(
    rank_peak_bytes: int,
    device: DeviceSpec,
    *,
    single: AllocatorPrediction,
    collective_pool_bytes: int = 0,
) -> AllocatorPrediction:
    """One rank's allocator numbers from its live-tensor peak and a one-process replay of the same
    plan and micro-batch (NOTE [ A rank's reserved memory ]).

    Args:
        rank_peak_bytes: the rank's predicted live-tensor peak (:func:`memfit.plan.parallel.rank_report`).
        device: the GPU.
        single: the allocator model of one process running the same plan and micro-batch in the
            same dtype (a replay; its reserved minus allocated is the default stream's caching).
        collective_pool_bytes: bytes the collectives' own streams keep cached beyond what is live
            at the rank's peak (:func:`collective_pool_bytes`).
    """
    if device.name == "cpu":
        return allocator_model(rank_peak_bytes, device)
    ws = STEP_WORKSPACES * cublas_workspace_bytes(device)
    cached = max(0, single.predicted_reserved_bytes - single.predicted_allocated_bytes)
    allocated = rank_peak_bytes + ws
    return AllocatorPrediction(
        tensor_peak_bytes=rank_peak_bytes,
        workspace_bytes=ws,
        predicted_allocated_bytes=allocated,
        predicted_reserved_bytes=allocated + cached + collective_pool_bytes,
        method="rank",
        replay=single.replay,
    )


def shard_model_states(
    events: Sequence[tuple[int, int]],
    *,
    states_end: int,
    step_start: int,
    optimizer_start: int,
    shards: int,
) -> list[tuple[int, int]]:
    """The allocation stream one rank runs when the model states are sharded over ``shards`` ranks
    (NOTE [ A rank's reserved memory ]): the one process's stream with the model states' events at
    ``ceil(bytes / shards)``.

    Scaled: the allocations before ``states_end`` (parameters, buffers, optimizer state), the step's
    allocations still live when the optimizer starts (the gradients), and every event from
    ``optimizer_start`` on (the optimizer step); a free takes its allocation's size. The batch and
    the forward's and backward's activations keep their bytes.

    Args:
        events: ``(key, nbytes)`` as :func:`replay_step` takes them.
        states_end: the index where the batch starts (:attr:`memfit.estimation.fake.FakeStep.states_end`).
        step_start: the index where the step starts.
        optimizer_start: the index where the optimizer phase starts.
        shards: ranks the model states are sharded over (1: the stream unchanged).

    Example:
        >>> shard_model_states([(1, 800), (2, 64), (3, 400), (4, 100), (4, -100), (5, 80)],
        ...                    states_end=1, step_start=2, optimizer_start=5, shards=4)
        [(1, 200), (2, 64), (3, 100), (4, 100), (4, -100), (5, 20)]
    """
    if shards < 1:
        raise SpecError(f"memfit.allocator: shards={shards} must be at least 1.")
    if shards == 1:
        return list(events)
    live: dict[int, int] = {}  # key -> index of its allocation, over the forward and backward
    for i in range(step_start, min(optimizer_start, len(events))):
        key, nbytes = events[i]
        if nbytes > 0:
            live[key] = i
        else:
            live.pop(key, None)
    scaled_at = set(live.values())
    out: list[tuple[int, int]] = []
    size: dict[int, int] = {}  # live key -> the bytes its allocation got
    for i, (key, nbytes) in enumerate(events):
        if nbytes > 0:
            states = i < states_end or i >= optimizer_start or i in scaled_at
            size[key] = -(-nbytes // shards) if states else nbytes
            out.append((key, size[key]))
        else:
            out.append((key, -size.pop(key, -nbytes)))
    return out


def collective_pool_bytes(layout_kind: str, unit_unsharded_bytes: Sequence[int], grad_shard_bytes: int = 0) -> int:
    """What FSDP2's collective streams keep cached beyond what is live at a rank's peak
    (NOTE [ A rank's reserved memory ]); 0 under DDP (its buckets are allocated once, on the default
    stream, and counted in the peak).

    Args:
        layout_kind: ``ddp`` or ``fsdp2``.
        unit_unsharded_bytes: per FSDP2 unit, its padded gathered bytes (blocks, then the root).
        grad_shard_bytes: the rank's gradient shards (``RankMemory.grads_bytes``): the
            reduce-scatter outputs, allocated on the reduce-scatter stream.

    Example:
        >>> collective_pool_bytes("fsdp2", [100, 100, 300], grad_shard_bytes=50)
        250
    """
    if layout_kind != "fsdp2" or not unit_unsharded_bytes:
        return 0
    *blocks, root = unit_unsharded_bytes
    block = max(blocks, default=0)
    return max(root, 2 * block) - block + grad_shard_bytes


def cublas_workspace_bytes(device: DeviceSpec) -> int:
    """One cuBLAS workspace as torch sizes it by default on ``device``."""
    if device.name.startswith(_HOPPER_AND_LATER):
        return 4096 * _KiB * 8
    return 4096 * _KiB * 2 + 16 * _KiB * 8


def allocator_model(
    tensor_peak_bytes: int,
    device: DeviceSpec,
    *,
    workspaces: int = STEP_WORKSPACES,
    events: Sequence[tuple[int, int]] | None = None,
    step_start: int = 0,
    config: AllocatorConfig | None = None,
) -> AllocatorPrediction:
    """What the CUDA allocator holds at a step whose live tensors peak at ``tensor_peak_bytes``.

    Args:
        tensor_peak_bytes: the predicted peak of live tensor bytes.
        device: the GPU (``cpu`` has no allocator: both predictions are the tensor peak).
        workspaces: cuBLAS workspaces alive (2 for a training step).
        events: the step's allocations and frees (:func:`replay_step`); without them reserved
            is a lower bound.
        step_start: the index in ``events`` where the step starts.
        config: allocator settings for the replay.
    """
    if device.name == "cpu":
        return AllocatorPrediction(
            tensor_peak_bytes=tensor_peak_bytes, workspace_bytes=0,
            predicted_allocated_bytes=tensor_peak_bytes, predicted_reserved_bytes=tensor_peak_bytes,
        )  # fmt: skip
    one = cublas_workspace_bytes(device)
    ws = workspaces * one
    if events:
        rep = replay_step(events, step_start=step_start, config=config, extra_blocks=[one] * workspaces)
        return AllocatorPrediction(
            tensor_peak_bytes=tensor_peak_bytes,
            workspace_bytes=ws,
            predicted_allocated_bytes=rep.max_allocated_bytes,
            predicted_reserved_bytes=rep.max_reserved_bytes,
            method="replay",
            replay=rep,
        )
    allocated = tensor_peak_bytes + ws
    reserved = -(-allocated // SMALL_SEGMENT_BYTES) * SMALL_SEGMENT_BYTES + SMALL_SEGMENT_BYTES
    return AllocatorPrediction(
        tensor_peak_bytes=tensor_peak_bytes,
        workspace_bytes=ws,
        predicted_allocated_bytes=allocated,
        predicted_reserved_bytes=reserved,
    )
