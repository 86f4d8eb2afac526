"""Communication time of one rank's step under DDP or FSDP2: collectives over the device's links,
overlapped with compute. Pure functions over rank Stats (:func:`memfit.plan.parallel.rank_stats`).

NOTE [ Communication time ]
One collective of ``S`` bytes over ``N`` ranks takes, in the ring algorithm NCCL uses for large
messages (Thakur, Rabenseifner, Gropp 2005, "Optimization of collective communication operations
in MPICH"; NCCL's own cost model, ``src/graph/tuning.cc``)::

    t = base + steps_intra * lat_intra + steps_inter * lat_inter + S * f / busbw

with ``f = (N-1)/N`` for all-gather (``S`` its output) and reduce-scatter (``S`` its input) and
``f = 2(N-1)/N`` for all-reduce: the factors nccl-tests uses to turn algorithm bandwidth
``S / t`` into bus bandwidth (``doc/PERFORMANCE.md``), so ``busbw`` is comparable to one link's
rate. ``steps`` is ``N-1`` (``2(N-1)`` for all-reduce), of which ``nodes-1`` (``2(nodes-1)``) cross
nodes. ``busbw`` is the slowest link on the ring (intra-node while the job fits in one node of
``gpus_per_node``, else the per-GPU network rate) times an efficiency (:data:`COMM_EFFICIENCY`).

What a rank communicates (bytes from the per-rank accounting, NOTE [ Per-rank accounting ]):

- DDP: one all-reduce per gradient bucket (``RankMemory.buckets_bytes``), launched in bucket
  order as soon as the backward phase that produces its last gradient ends (the head's, a
  block's, or the embeddings' after the blocks): hidden behind the backward of the blocks still
  to run, the last bucket exposed before the optimizer step.
- FSDP2: per unit an all-gather of its padded parameters in ``param_dtype`` in forward (the
  root's first, exposed), and again in backward when blocks reshard after forward, and a
  reduce-scatter of its padded gradients in ``reduce_dtype`` after its backward. A unit's
  all-gather is issued when the unit before it starts computing (FSDP2 keeps one all-gather in
  flight ahead of compute: the implicit forward prefetch and the default backward prefetch of one
  unit), so it is hidden when it is shorter than that unit's compute.

The step is simulated on two streams: compute runs the segments in order (embeddings' forward,
each block's forward, the head's forward and backward, each block's backward with its
recompute, the embeddings' backward, the optimizer), waiting for the collective a segment needs;
the collectives run one at a time in the order they are issued (concurrent NCCL collectives share
the same links, so serialising them keeps the transfer time). Exposed communication is the
simulated step minus the compute alone. Under accumulation without gradient sync the first
``K-1`` micro-steps run the all-gathers only; reduce-scatters and all-reduces run on the last.

Known limitations:
    - Ring only: no tree, CollNet or NVLink SHARP (on H100/H200 NCCL runs all-reduce with NVLS by
      default, up to ~480 GB/s busbw on 8 GPUs per nccl-tests#212, so DDP's all-reduce there is
      predicted slower than it may run); one bandwidth per link kind; latencies from NCCL's tuning
      table of 2.7-era NCCL; compute is not slowed by the collectives' own SM use.
    - Per-segment seconds are the Stats' (roofline or measured); the non-block forward and
      backward are counted as the head's, and a segment's recompute is charged to its blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memfit.capture.stats import Stats
from memfit.errors import SpecError
from memfit.plan.costmodel import ChainCosts, block_options
from memfit.plan.types import Plan

__all__ = [
    "COMM_EFFICIENCY",
    "NCCL_BASE_LATENCY_S",
    "Collective",
    "CommOp",
    "CommTime",
    "Interconnect",
    "Link",
    "collective_seconds",
    "simulate",
    "step_comm_time",
    "window_with_comm",
]

COMM_EFFICIENCY = 0.8
"""Fraction of a link's per-direction rate a large ring collective's bus bandwidth reaches. NCCL's
maintainer: on H100 "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an
effective NVLink bandwidth of 370GB/s", seen as busbw of ring collectives (82 %,
github.com/NVIDIA/nccl-tests/issues/212); on A100 about 230 of 300 GB/s (77 %,
github.com/NVIDIA/nccl-tests/issues/149); NVIDIA's p2pBandwidthLatencyTest reaches 376-380 GB/s
one way on H100 SXM (github.com/NVIDIA/nccl/issues/1264). So 0.8: 360 GB/s on H100 SXM."""

NCCL_BASE_LATENCY_S = 8.4e-6
"""NCCL's base latency of a ring collective with the Simple protocol (``baseLat``, 8.4 us,
``src/graph/tuning.cc``)."""

_STEP_LATENCY_S = {"nvlink": 3.4e-6, "pcie": 5.7e-6, "network": 9.6e-6}
"""NCCL's per-step hardware latency of a ring with the Simple protocol (``hwLat``: NVLink 3.4 us,
PCI 5.7 us, network 9.6 us, ``src/graph/tuning.cc``)."""


class Collective(StrEnum):
    """The collectives data parallelism runs."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One kind of link a ring runs over.

    Attributes:
        kind: ``nvlink``, ``pcie``, ``network`` (NCCL's latency class), or another name with
            ``step_latency_s`` given (e.g. ``cpu-gloo``).
        bandwidth_bytes_per_s: the link's rate per GPU and direction (nominal).
        efficiency: the fraction of it a large collective's bus bandwidth reaches.
        step_latency_s: seconds each ring step adds (None: NCCL's for ``kind``).
        source: where ``bandwidth_bytes_per_s`` comes from (the published rate assumed, or "set").
    """

    kind: str
    bandwidth_bytes_per_s: float
    efficiency: float = COMM_EFFICIENCY
    step_latency_s: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or not 0 < self.efficiency <= 1:
            raise SpecError(
                f"memfit.plan: link {self.kind!r} needs a positive bandwidth and an efficiency in (0, 1] "
                f"(got {self.bandwidth_bytes_per_s} B/s, {self.efficiency})."
            )
        if self.step_latency_s is None and self.kind not in _STEP_LATENCY_S:
            raise SpecError(
                f"memfit.plan: link kind {self.kind!r} has no known latency; give step_latency_s (seconds per ring step)."
            )

    @property
    def bus_bytes_per_s(self) -> float:
        """The bus bandwidth a large collective reaches on this link."""
        return self.bandwidth_bytes_per_s * self.efficiency

    @property
    def latency_s(self) -> float:
        return self.step_latency_s if self.step_latency_s is not None else _STEP_LATENCY_S[self.kind]


@dataclass(frozen=True, kw_only=True, slots=True)
class Interconnect:
    """The links of a job: within a node and between nodes.

    Attributes:
        intra: the link between GPUs of one node.
        inter: the per-GPU network link between nodes (None: unknown; a job larger than one node
            is then not modelled).
        gpus_per_node: ranks per node (a job of more ranks crosses nodes).
        base_latency_s: seconds every collective costs besides its steps.
    """

    intra: Link
    inter: Link | None = None
    gpus_per_node: int = 8
    base_latency_s: float = NCCL_BASE_LATENCY_S

    def link_for(self, world_size: int) -> Link:
        """The slowest link a ring of ``world_size`` ranks crosses (it sets the ring's bandwidth).

        Raises:
            SpecError: the job spans nodes and the network link is unknown.
        """
        if world_size <= self.gpus_per_node:
            return self.intra
        if self.inter is None:
            raise SpecError(
                f"memfit.plan: {world_size} ranks span {math.ceil(world_size / self.gpus_per_node)} nodes of {self.gpus_per_node} "
                "GPUs, and this device has no network link in memfit's table; plan within one node (--gpus-per-node)."
            )
        return self.inter if self.inter.bus_bytes_per_s < self.intra.bus_bytes_per_s else self.intra


def collective_seconds(kind: Collective, size_bytes: int, world_size: int, net: Interconnect) -> float:
    """Seconds of one ring collective of ``size_bytes`` over ``world_size`` ranks (NOTE [ Communication time ]).

    ``size_bytes`` is the all-gather's output, the reduce-scatter's input or the all-reduce's buffer
    (the sizes nccl-tests reports). One rank takes no time.
    """
    n = world_size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    nodes = math.ceil(n / net.gpus_per_node)
    twice = 2 if kind is Collective.ALL_REDUCE else 1
    steps, inter_steps = twice * (n - 1), twice * (nodes - 1)
    link = net.link_for(n)
    inter_latency = net.inter.latency_s if net.inter is not None else 0.0
    latency = net.base_latency_s + (steps - inter_steps) * net.intra.latency_s + inter_steps * inter_latency
    return latency + size_bytes * (steps / n) / link.bus_bytes_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class CommOp:
    """One collective in a step's schedule.

    Attributes:
        kind: the collective.
        what: what it moves, in words (``block 3``, ``root``, ``bucket 0``).
        size_bytes: its size (as :func:`collective_seconds` takes it).
        seconds: its duration.
        issued_at: the compute segment at which it is issued.
        at_end: issued when that segment ends (else when compute reaches it, before it starts).
        needed_by: the segment that waits for it (None: the last segment, the optimizer step).
    """

    kind: Collective
    what: str
    size_bytes: int
    seconds: float
    issued_at: int
    at_end: bool = False
    needed_by: int | None = None


def simulate(segments_s: Sequence[float], ops: Sequence[CommOp]) -> float:
    """Seconds of a step whose compute runs ``segments_s`` in order and whose collectives run one at
    a time in the order they are issued (NOTE [ Communication time ]).

    Raises:
        SpecError: an op is needed before it is issued.
    """
    last = len(segments_s) - 1
    order = sorted(range(len(ops)), key=lambda i: (ops[i].issued_at, ops[i].at_end))
    for op in ops:
        need = last if op.needed_by is None else op.needed_by
        if need < op.issued_at or (need == op.issued_at and op.at_end):
            raise SpecError(
                f"memfit.plan: {op.kind.value} of {op.what} is needed by segment {need} before it is issued ({op.issued_at})."
            )
    done: dict[int, float] = {}
    comm_free = t = 0.0
    pos = 0

    def issue(j: int, at_end: bool, now: float) -> None:
        nonlocal pos, comm_free
        while pos < len(order) and (ops[order[pos]].issued_at, ops[order[pos]].at_end) == (j, at_end):
            i = order[pos]
            comm_free = max(comm_free, now) + ops[i].seconds
            done[i] = comm_free
            pos += 1

    for j, seg_s in enumerate(segments_s):
        issue(j, False, t)
        waits = [done[i] for i, op in enumerate(ops) if (last if op.needed_by is None else op.needed_by) == j]
        t = max([t, *waits]) + seg_s
        issue(j, True, t)
    return t


@dataclass(frozen=True, kw_only=True, slots=True)
class CommTime:
    """A rank's step (or accumulation window) with its communication.

    Attributes:
        compute_s: the seconds without communication (the simulated segments).
        comm_s: the collectives' seconds, added up.
        exposed_s: the seconds communication adds to the step (``step_s - compute_s``), at least 0.
        step_s: the simulated seconds.
        seconds_by_kind: the collectives' seconds per kind.
        bytes_by_kind: the collectives' sizes per kind, added up.
        link: the link that sets the ring's bandwidth (``nvlink``, ``pcie``, ``network``, ...).
        bus_bytes_per_s: its bus bandwidth.
        link_bytes_per_s: its rate per GPU and direction, before the efficiency.
        link_source: where that rate comes from: the published rate memfit assumed for the device, or
            the rate the user set (``--link-gbps``).
    """

    compute_s: float
    comm_s: float
    exposed_s: float
    step_s: float
    seconds_by_kind: dict[str, float]
    bytes_by_kind: dict[str, int]
    link: str
    bus_bytes_per_s: float
    link_bytes_per_s: float = 0.0
    link_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {f: (dict(v) if isinstance(v := getattr(self, f), dict) else v) for f in self.__slots__}  # type: ignore[attr-defined]


def step_comm_time(
    stats: Stats, plan: Plan, net: Interconnect, *, accumulation_steps: int = 1, compute_scale: float = 1.0
) -> CommTime:
    """The communication of rank Stats' step under ``plan``, overlapped with its compute.

    Args:
        stats: one rank's Stats (:func:`memfit.plan.parallel.rank_stats`).
        plan: the plan (its recomputes lengthen the blocks' backward).
        net: the links.
        accumulation_steps: micro-steps per optimizer step; gradient sync only on the last.
        compute_scale: the compute segments' seconds times this (estimated Stats made at one mfu,
            simulated at another: ``mfu_made / mfu_wanted``).

    Raises:
        SpecError: ``stats`` are one process's, or the job needs a link the device lacks.
    """
    info = stats.calibration.parallel
    if info is None:
        raise SpecError(
            "memfit.plan: these stats are one process's; communication needs a rank's (memfit.plan.parallel.rank_stats)."
        )
    world = info.world_size
    link = net.link_for(world)
    segs = [t * compute_scale for t in _segments(stats, plan)]
    n = len(stats.blocks)
    if info.layout["kind"] == "ddp":
        sync_ops = _ddp_ops(info.memory, n, world, net)
        nosync_ops: list[CommOp] = []
    else:
        nosync_ops = _fsdp2_gathers(info.memory, n, world, net, bool(info.layout.get("reshard_after_forward", True)))
        sync_ops = nosync_ops + _fsdp2_reduces(info.memory, n, world, net)
    k = max(1, accumulation_steps)
    step_sync = simulate(segs, sync_ops)
    step_nosync = simulate(segs, nosync_ops)
    compute = sum(segs)
    step = (k - 1) * step_nosync + step_sync
    ops = [*sync_ops, *(nosync_ops * (k - 1))]
    by_s: dict[str, float] = {}
    by_b: dict[str, int] = {}
    for op in ops:
        by_s[op.kind.value] = by_s.get(op.kind.value, 0.0) + op.seconds
        by_b[op.kind.value] = by_b.get(op.kind.value, 0) + op.size_bytes
    return CommTime(
        compute_s=k * compute,
        comm_s=sum(op.seconds for op in ops),
        exposed_s=max(0.0, step - k * compute),
        step_s=step,
        seconds_by_kind=by_s,
        bytes_by_kind=by_b,
        link=link.kind,
        bus_bytes_per_s=link.bus_bytes_per_s,
        link_bytes_per_s=link.bandwidth_bytes_per_s,
        link_source=link.source,
    )


def window_with_comm(
    stats: Stats, plan: Plan, net: Interconnect, *, accumulation_steps: int, compute_window_s: float
) -> tuple[float, CommTime]:
    """Seconds of one optimizer step's window with its exposed communication, and the collectives.

    The one formula auto-fit ranks candidates by and ``plan``/``fit``/``estimate`` print: the
    compute-only window (the cost model's ``accumulation_steps`` passes and the optimizer step,
    ``compute_window_s``) plus the communication :func:`step_comm_time` simulates as not hidden
    behind compute.

    Raises:
        SpecError: as :func:`step_comm_time`.
    """
    ct = step_comm_time(stats, plan, net, accumulation_steps=accumulation_steps)
    return compute_window_s + ct.exposed_s, ct


# Compute segments, in order (n blocks):
#   0: embeddings' forward (root, before the blocks)   1+k: block k's forward
#   n+1: the head's forward and loss                   n+2: the head's backward
#   n+3+(n-1-k): block k's backward (recompute incl.)  2n+3: the embeddings' backward   2n+4: optimizer
def _fwd(k: int) -> int:
    return 1 + k


def _bwd(k: int, n: int) -> int:
    return n + 3 + (n - 1 - k)


def _segments(stats: Stats, plan: Plan) -> list[float]:
    """Seconds of each compute segment of one micro-step under ``plan`` (optimizer included)."""
    costs = ChainCosts.from_stats(stats).with_head(plan.head)
    opts = block_options(plan, costs)
    bwd = [b.bwd_s + costs.options[i][opts[i]].extra_s for i, b in enumerate(stats.blocks)]
    for s in plan.segments:
        for i in range(s.start, s.stop):
            bwd[i] += costs.recompute(i).extra_s
    blocks_fwd = sum(b.fwd_s for b in stats.blocks)
    head_fwd = max(0.0, stats.fwd_s - blocks_fwd)
    head_bwd = max(0.0, stats.bwd_s - sum(b.bwd_s for b in stats.blocks))
    rest = max(0.0, costs.base_step_s - blocks_fwd - sum(b.bwd_s for b in stats.blocks) - head_fwd - head_bwd)
    return [0.0, *(b.fwd_s for b in stats.blocks), head_fwd, head_bwd, *reversed(bwd), 0.0, rest]


def _ddp_ops(memory: Any, n: int, world: int, net: Interconnect) -> list[CommOp]:
    """One all-reduce per bucket, issued when the backward phase completing it ends, in bucket order."""
    out: list[CommOp] = []
    prev = 0
    for i, (size, after) in enumerate(zip(memory["buckets_bytes"], memory["bucket_ready_after"], strict=True)):
        seg = n + 2 if after < 0 else _bwd(after, n) if after < n else 2 * n + 3
        prev = max(prev, seg)
        out.append(CommOp(kind=Collective.ALL_REDUCE, what=f"bucket {i}", size_bytes=size,
                          seconds=collective_seconds(Collective.ALL_REDUCE, size, world, net), issued_at=prev, at_end=True))  # fmt: skip
    return out


def _fsdp2_gathers(memory: Any, n: int, world: int, net: Interconnect, reshard_after_forward: bool) -> list[CommOp]:
    """All-gathers: the root's, each block's in forward (issued when the unit before starts), and
    with reshard-after-forward each block's again in backward (prefetched one unit ahead)."""
    g = memory["unit_unsharded_bytes"]

    def ag(what: str, size: int, issued_at: int, needed_by: int) -> CommOp:
        return CommOp(kind=Collective.ALL_GATHER, what=what, size_bytes=size, seconds=collective_seconds(Collective.ALL_GATHER, size, world, net),
                      issued_at=issued_at, needed_by=needed_by)  # fmt: skip

    ops = [ag("root", g[n], 0, 0)]
    ops += [ag(f"block {k}", g[k], _fwd(k - 1) if k else 0, _fwd(k)) for k in range(n)]
    if reshard_after_forward:
        ops += [
            ag(f"block {k} (backward)", g[k], _bwd(k + 1, n) if k + 1 < n else n + 2, _bwd(k, n))
            for k in reversed(range(n))
        ]
    return ops


def _fsdp2_reduces(memory: Any, n: int, world: int, net: Interconnect) -> list[CommOp]:
    """Reduce-scatters: each block's after its backward, the root's after the embeddings' backward."""
    r = memory["reduce_scatter_bytes"]
    return [
        CommOp(kind=Collective.REDUCE_SCATTER, what="root" if u == n else f"block {u}", size_bytes=r[u],
               seconds=collective_seconds(Collective.REDUCE_SCATTER, r[u], world, net), issued_at=2 * n + 3 if u == n else _bwd(u, n), at_end=True)
        for u in [*reversed(range(n)), n]
    ]  # fmt: skip
