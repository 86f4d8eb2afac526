"""Per-rank memory under data parallelism (DDP, FSDP2): pure functions over Stats and a layout.

Size: one module, ~690 lines: the accounting (mixed precision included), its NOTE and the report that reads it belong together
(a window of several micro-steps is :mod:`memfit.plan.window`).

A profile or an estimate (:class:`~memfit.capture.stats.Stats`) describes one process holding the
whole model. :func:`rank_stats` turns it into the Stats of one rank of a data-parallel job, so the
cost model, the solver and auto-fit plan under a per-rank budget without knowing about ranks.

NOTE [ Per-rank accounting ]
Notation, per FSDP2 unit ``u`` (each block of the chain, and the root: every parameter outside the
blocks), with ``N`` ranks: ``F_u`` the unit's parameter bytes, ``Fp_u`` the same with dim 0 padded to
``N * ceil(d0 / N)`` rows (what an all-gather returns), ``Fp_u / N`` one rank's padded shard.

- DDP (``DistributedDataParallel``, ``gradient_as_bucket_view=False``): every rank holds the whole
  model, its gradients and optimizer state, as one process does; the reducer also allocates, when
  it is built, one flat tensor per gradient bucket (``bucket_cap_mb``, 25 MiB by default; the first
  bucket is capped at 1 MiB) and copies gradients into them for the all-reduce. The buckets live
  for the whole run: ``+ sum(bucket bytes)`` (= the trainable parameters' bytes) on every event.
- FSDP2 (``fully_shard`` on every block, then on the root, as torchtitan does), per rank ``r``:
  parameters are the padded shards (``sum Fp_u / N``); optimizer state follows each parameter's
  local rows (``ceil`` rows on the first ranks, fewer or none on the last: ranks differ); the
  root unit stays gathered from its forward to the end of backward (torch does not reshard the root
  after forward), so ``+ Fp_root`` from the first block to the loss. In forward, FSDP2 keeps each
  all-gather's flat output until the next unit's copy-out (to overlap them on a GPU), so a block's
  forward holds its unit twice and, while gathering, the previous unit's flat output:
  ``P' = max(P, Fp_{k-1}) + 2 Fp_k`` (the root's for block 0; ``pre`` gets ``2 Fp_root``). Its
  backward holds its own unit, the next one prefetched, and the previous reduce-scatter's input
  (freed only when the next reduce-scatter starts): ``Q' = Q + Fp_k + Fp_{k-1} + Fp_{k+1}``.
  Gradients of later blocks are reduce-scattered into padded shards, so the backward base loses
  ``sum_{j>k} (G_j - Fp_j / N)``. With ``reshard_after_forward=False`` a block's unit stays gathered
  from its forward to its backward: it counts as retained (``D' = D + Fp_k``) and nothing is
  prefetched. After the first block's backward, the embeddings' backward (root gathered, block 0's
  reduce-scatter input kept, the root's gradients unsharded), the root's reduce-scatter and the
  optimizer step over shards (its temporaries scaled by the shard fraction) make the ``post`` event.
  The last block's flat all-gather output has no next unit to free it: torch drops it in the root's
  post-forward, so it is live from the last block's output until the model's forward returns, under
  the head and, when the model computes its loss in its forward (HF models given labels), under the
  loss. Backward starts with the root's pre-backward, which prefetches the last block (its flat
  all-gather output, copied out at that block's pre-backward), so the head's backward holds it too:
  ``H' = max(H, H_model + Fp_{n-1}, H_bwd + Fp_{n-1})`` (``H_model``, ``H_bwd``:
  ``Stats.head_model_peak_bytes``, ``head_backward_peak_bytes``, and the same per calibration option
  (NOTE [ The head's peak per option ] in :mod:`memfit.plan.costmodel`); no prefetch without
  reshard-after-forward).

Mixed precision (``Parallel(param_dtype=..., reduce_dtype=...)``, torch's ``MixedPrecisionPolicy``):
the one-process Stats are made in ``param_dtype`` (activations, gathered units, unsharded gradients),
the parameter table keeps the parameters' own dtype (shards ``Fp_u / N``, gradient shards and
optimizer rows in it: fp32 master weights and AdamW state), and a reduce-scatter input is the
unit's padded gradients in ``reduce_dtype``.

Checked on 2-process gloo jobs (CPU) under plans that recompute blocks, with reshard-after-forward
on and off and with dim-0 padding (ranks differ): the predicted rank peak equals torch's
``FSDPMemTracker`` to ~100 bytes per rank, and DDP's rank (memfit's tracker plus DDP's buckets, and
``torch.profiler``) to 0.1 % (tests/test_parallel_estimate.py). The FSDP2 terms follow torch 2.13's
``_fully_shard`` (implicit forward overlap, default backward prefetch of one unit, one kept
reduce-scatter input); other torch versions may keep other buffers.

Known limitations:

- Units are the chain's blocks plus the root (torchtitan's wrapping; the root with torch's default
  reshard-after-forward). CPU offload, HSDP,
  explicit prefetching and ``gradient_as_bucket_view=True`` are not modelled.
- Segments (several blocks recomputed as one unit) under FSDP2 with reshard-after-forward: the
  recompute gathers each block's unit again and keeps it until the block's backward
  (NOTE [ Segments under FSDP2 ] in :mod:`memfit.apply.segments`); the cost model and the solver
  count it (``ChainCosts.recompute_gathered_bytes``, the block's own and prefetched unit in its
  backward not twice). Checked against ``FSDPMemTracker``: 2 gloo ranks under ``sqrt`` (+147 and
  +40 B); rank 0 of 4 on a fake process group, a 6-block demo GPT and a 4-layer HF Llama, single
  and disjoint segments within ~230 B, nested ones +1.2 % (the prefetched unit before an inner
  segment counted twice, safe side). Without reshard-after-forward a segment keeps every unit it
  ran gathered, which is not modelled: rank Stats then offer no segments (``sequential`` False).
- The chunked head (:mod:`memfit.apply.head`) under FSDP2: its ``H`` plus the last block's flat
  all-gather output (its parts are not recorded apart; at most one unit high): every block
  recomputed, to ~100 bytes of ``FSDPMemTracker``.
- The collectives' own scratch memory (NCCL's channels, gloo's buffers) is outside torch's
  allocator and not counted. Communication time: :mod:`memfit.plan.comm` (from ``RankMemory``'s
  ``unit_unsharded_bytes``, ``reduce_scatter_bytes``, ``buckets_bytes`` and ``bucket_ready_after``).
- Accumulation without gradient sync keeps unsharded gradients between micro-steps:
  :func:`memfit.plan.window.window_costs` is a window's per-rank cost model, which ``memfit plan
  --accumulation-steps K`` and ``memfit fit --parallel`` (auto-fit) solve under; checked on 2 gloo
  ranks running ``memfit train --plan`` (tests/test_train_parallel.py, tests/test_parallel_window.py).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from memfit.capture.stats import BlockStats, HeadOptionStats, OptionStats, ParallelInfo, Stats
from memfit.errors import SpecError
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.types import BlockDecision, Option, Plan
from memfit.units import format_bytes

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "Parallel",
    "ParallelKind",
    "ParamInfo",
    "RankMemory",
    "ddp_buckets",
    "dtype_itemsize",
    "launch_command",
    "layout_of",
    "param_table",
    "parallel_stats_fn",
    "phase_peaks",
    "rank_param_table",
    "rank_report",
    "rank_memory",
    "rank_stats",
    "shard_rows",
]

DDP_BUCKET_CAP_BYTES = 25 * 2**20
"""``DistributedDataParallel(bucket_cap_mb=25)``, torch's default."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: DDP caps its first bucket at 1 MiB."""


class ParallelKind(StrEnum):
    """How parameters, gradients and optimizer state are spread over ranks."""

    DDP = "ddp"  # every rank holds everything; gradients all-reduced in buckets
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard: sharded on dim 0, gathered per unit


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel:
    """A data-parallel layout: what :func:`rank_stats` accounts for.

    Attributes:
        kind: ``ddp`` or ``fsdp2``.
        world_size: number of ranks (data-parallel degree), at least 1.
        bucket_cap_bytes: DDP's ``bucket_cap_mb`` in bytes.
        first_bucket_bytes: DDP's cap of its first bucket.
        reshard_after_forward: FSDP2's ``fully_shard(block, reshard_after_forward=...)`` for the
            blocks (the root takes torch's default: not resharded after forward).
        param_dtype: FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` (a torch dtype name, e.g.
            ``"bfloat16"``): units are gathered and run in it, while shards, gradient shards and
            optimizer state keep the parameters' own dtype (the parameter table's). The one-process
            Stats must then be made in this dtype. None: no mixed precision.
        reduce_dtype: ``MixedPrecisionPolicy(reduce_dtype=...)``: the reduce-scatter input's dtype
            (None: ``param_dtype``).
    """

    kind: ParallelKind
    world_size: int
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and (self.kind is not ParallelKind.FSDP2 or dtype_itemsize(value) is None):
                raise SpecError(
                    f"memfit.plan: {name} {value!r} is FSDP2's MixedPrecisionPolicy and needs a torch float dtype name "
                    f"and --parallel fsdp2, e.g. --param-dtype bfloat16 --reduce-dtype float32."
                )
        if self.world_size < 1:
            raise SpecError(f"memfit.plan: world size {self.world_size} must be at least 1, e.g. --world-size 8.")
        if self.bucket_cap_bytes < 1 or self.first_bucket_bytes < 1:
            raise SpecError(
                f"memfit.plan: DDP bucket caps must be positive (got {self.bucket_cap_bytes} and "
                f"{self.first_bucket_bytes} bytes), e.g. --bucket-cap-mb 25."
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "world_size": self.world_size,
            "bucket_cap_bytes": self.bucket_cap_bytes,
            "first_bucket_bytes": self.first_bucket_bytes,
            "reshard_after_forward": self.reshard_after_forward,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Parallel:
        try:
            kind = ParallelKind(data["kind"])
        except (KeyError, ValueError):
            raise SpecError(
                f"memfit.plan: parallel kind {data.get('kind')!r} unknown; use one of {', '.join(k.value for k in ParallelKind)}."
            ) from None
        return cls(kind=kind, **{k: v for k, v in data.items() if k != "kind"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamInfo:
    """One parameter as the accounting needs it: ``unit`` is the chain block it belongs to, -1 for
    the root (embeddings, final norm, head: everything outside the blocks)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    requires_grad: bool
    unit: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def param_table(model: nn.Module, block_names: Sequence[str], *, itemsize: int | None = None) -> tuple[ParamInfo, ...]:
    """The parameters of ``model`` in registration order, each with its unit (real, fake or meta
    tensors alike: only shapes are read). A parameter shared by several modules counts once, as
    ``named_parameters`` yields it.

    Args:
        model: the model.
        block_names: the chain's block names (``Stats.blocks[i].name``), paths inside ``model``.
        itemsize: bytes per element of floating-point parameters, when training casts them
            (default: as they are).
    """
    prefixes = [(n + ".", i) for i, n in enumerate(block_names)]
    rows = []
    for name, p in model.named_parameters():
        unit = next((i for pre, i in prefixes if name.startswith(pre)), -1)
        rows.append(
            ParamInfo(
                name=name,
                shape=tuple(p.shape),
                itemsize=itemsize if itemsize and p.is_floating_point() else p.element_size(),
                requires_grad=p.requires_grad,
                unit=unit,
            )
        )
    return tuple(rows)


def rank_param_table(model: nn.Module, stats: Stats, parallel: Parallel) -> tuple[ParamInfo, ...]:
    """The parameter table :func:`rank_stats` needs for ``stats`` of ``model``: floating-point
    parameters at the Stats' dtype (the step casts them), or, under a ``param_dtype``
    (``MixedPrecisionPolicy``), at the model's own dtype, which the shards keep."""
    names = [b.name for b in stats.blocks]
    return param_table(model, names, itemsize=None if parallel.param_dtype else dtype_itemsize(stats.dtype))


def dtype_itemsize(dtype: str) -> int | None:
    """Bytes per element of a Stats' dtype name (``"bfloat16"``), None when torch has no such dtype."""
    dt = getattr(torch, dtype, None)
    return torch.empty((), dtype=dt).element_size() if isinstance(dt, torch.dtype) else None


def shard_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(padded rows, local rows)`` of a dim-0 shard as FSDP2 cuts it (``torch.chunk``: chunks of
    ``ceil(dim0 / N)`` rows; the last ranks may hold fewer or none, their storage is padded)."""
    c = -(-dim0 // world_size) if dim0 else 0
    return c, max(0, min(c, dim0 - rank * c))


def ddp_buckets(params: Iterable[ParamInfo], parallel: Parallel) -> list[int]:
    """Bytes of each DDP gradient bucket, in the order DDP builds them at construction.

    DDP fills buckets with the trainable parameters in reverse registration order (gradients
    arrive roughly backwards), closing a bucket once it reaches its cap: ``first_bucket_bytes`` for
    the first, ``bucket_cap_bytes`` after; as ``torch.distributed._compute_bucket_assignment_by_size``
    (one dtype). After the first iteration DDP rebuilds the buckets in the order gradients arrived:
    the sizes may change, the total (every trainable parameter once) does not.
    """
    sizes: list[int] = []
    cur = 0
    for p in reversed([p for p in params if p.requires_grad]):
        cur += p.nbytes
        cap = parallel.first_bucket_bytes if not sizes else parallel.bucket_cap_bytes
        if cur >= cap:
            sizes.append(cur)
            cur = 0
    if cur:
        sizes.append(cur)
    return sizes


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    """What one rank holds besides activations (bytes), for reports.

    Attributes:
        rank: the rank.
        params_bytes: parameters (padded shards under FSDP2) and buffers.
        grads_bytes: gradients after backward (padded shards under FSDP2).
        optimizer_bytes: optimizer state (local rows under FSDP2).
        comm_bytes: DDP: its gradient buckets; FSDP2: the largest working set of gathered units
            and communication buffers in backward (root, own unit, the prefetched one and the kept
            reduce-scatter input; every unit without reshard-after-forward).
        buckets_bytes: DDP's bucket sizes (empty under FSDP2).
        unit_unsharded_bytes: FSDP2: each block unit gathered (padded), then the root's.
        reduce_scatter_bytes: FSDP2: each unit's reduce-scatter input (its padded trainable
            parameters in ``reduce_dtype``), blocks then the root (for :mod:`memfit.plan.comm`).
        bucket_ready_after: DDP: per bucket, the backward phase whose end completes its
            gradients: ``-1`` the head's (root parameters registered after the blocks'), ``k``
            block ``k``'s, ``n`` the embeddings' after the blocks (for :mod:`memfit.plan.comm`).
    """

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    comm_bytes: int
    buckets_bytes: tuple[int, ...] = ()
    unit_unsharded_bytes: tuple[int, ...] = ()
    reduce_scatter_bytes: tuple[int, ...] = ()
    bucket_ready_after: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "comm_bytes": self.comm_bytes,
            "buckets_bytes": list(self.buckets_bytes),
            "unit_unsharded_bytes": list(self.unit_unsharded_bytes),
            "reduce_scatter_bytes": list(self.reduce_scatter_bytes),
            "bucket_ready_after": list(self.bucket_ready_after),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class _Units:
    """Per unit (blocks ``0..n-1``, then the root at ``n``): full, gathered (padded), shard and
    local bytes, and trainable full bytes."""

    full: tuple[int, ...]
    gathered: tuple[int, ...]
    shard: tuple[int, ...]
    local: tuple[int, ...]
    grad_full: tuple[int, ...]
    grad_shard: tuple[int, ...]


def _retyped(params: Sequence[ParamInfo], dtype: str | None) -> Sequence[ParamInfo]:
    """``params`` as ``MixedPrecisionPolicy`` casts them to ``dtype`` (None: as they are)."""
    size = dtype_itemsize(dtype) if dtype else None
    return params if size is None else tuple(replace(p, itemsize=size) for p in params)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layout:
    """A layout's units: ``own`` in the parameters' dtype (shards, gradient shards, optimizer rows),
    ``comp`` in ``param_dtype`` (gathered units, unsharded gradients, the one-process Stats),
    ``red`` in ``reduce_dtype`` (reduce-scatter inputs)."""

    own: _Units
    comp: _Units
    red: _Units


def _layout(params: Sequence[ParamInfo], n_blocks: int, parallel: Parallel, rank: int) -> _Layout:
    w = parallel.world_size
    comp = _retyped(params, parallel.param_dtype)
    return _Layout(
        own=_units(params, n_blocks, w, rank),
        comp=_units(comp, n_blocks, w, rank),
        red=_units(_retyped(comp, parallel.reduce_dtype), n_blocks, w, rank),
    )


def _units(params: Sequence[ParamInfo], n_blocks: int, world: int, rank: int) -> _Units:
    cols = {k: [0] * (n_blocks + 1) for k in ("full", "gathered", "shard", "local", "grad_full", "grad_shard")}
    for p in params:
        u = p.unit if p.unit >= 0 else n_blocks
        d0 = p.shape[0] if p.shape else 1
        row = math.prod(p.shape[1:]) * p.itemsize if p.shape else p.itemsize
        padded, local = shard_rows(d0, world, rank)
        cols["full"][u] += p.nbytes
        cols["gathered"][u] += padded * world * row
        cols["shard"][u] += padded * row
        cols["local"][u] += local * row
        if p.requires_grad:
            cols["grad_full"][u] += p.nbytes
            cols["grad_shard"][u] += padded * row
    return _Units(**{k: tuple(v) for k, v in cols.items()})


def rank_memory(stats: Stats, params: Sequence[ParamInfo], parallel: Parallel, rank: int = 0) -> RankMemory:
    """What rank ``rank`` holds besides activations (see NOTE [ Per-rank accounting ])."""
    _check(stats, params, parallel, rank)
    full = sum(p.nbytes for p in params)
    buffers = max(0, stats.params_bytes - full)
    if parallel.kind is ParallelKind.DDP:
        buckets = tuple(ddp_buckets(params, parallel))
        return RankMemory(
            rank=rank, params_bytes=stats.params_bytes, grads_bytes=stats.grads_bytes, optimizer_bytes=stats.optimizer_bytes,
            comm_bytes=sum(buckets), buckets_bytes=buckets, bucket_ready_after=_bucket_ready_after(params, buckets, len(stats.blocks)),
        )  # fmt: skip
    n = len(stats.blocks)
    lay = _layout(params, n, parallel, rank)
    u = lay.own
    g, r = lay.comp.gathered, lay.red.gathered
    full = sum(lay.comp.full)  # the one-process Stats' parameters (param_dtype)
    buffers = max(0, stats.params_bytes - full)
    if parallel.reshard_after_forward:  # root, own unit, prefetched unit, kept reduce-scatter input
        working = g[n] + max(
            (g[k] + (g[k - 1] if k else 0) + (r[k + 1] if k + 1 < n else 0) for k in range(n)), default=0
        )
    else:
        working = sum(g) + max(r[1:n], default=0)
    return RankMemory(
        rank=rank,
        params_bytes=sum(u.shard) + buffers,
        grads_bytes=sum(u.grad_shard),
        # Optimizer state follows the local rows in the parameters' own dtype.
        optimizer_bytes=_scaled(stats.optimizer_bytes, sum(u.local), full),
        comm_bytes=working,
        unit_unsharded_bytes=g,
        reduce_scatter_bytes=tuple(b * parallel.world_size for b in lay.red.grad_shard),
    )


def _bucket_ready_after(params: Sequence[ParamInfo], buckets: Sequence[int], n_blocks: int) -> tuple[int, ...]:
    """Per DDP bucket (:func:`ddp_buckets`, filled in reverse registration order), the backward
    phase that completes it (``RankMemory.bucket_ready_after``): the last, in backward order (head,
    blocks from the last, embeddings), of its parameters' phases."""
    last_block = max((i for i, p in enumerate(params) if p.unit >= 0), default=len(params))
    order = lambda ph: 0 if ph < 0 else n_blocks - ph if ph < n_blocks else n_blocks + 1  # noqa: E731
    out, cur, ready = [], 0, None
    for i in reversed([i for i, p in enumerate(params) if p.requires_grad]):
        p = params[i]
        ph = p.unit if p.unit >= 0 else -1 if i > last_block else n_blocks
        ready = ph if ready is None or order(ph) > order(ready) else ready
        cur += p.nbytes
        if len(out) < len(buckets) and cur == buckets[len(out)]:
            out.append(ready)
            cur, ready = 0, None
    return tuple(out)


def rank_stats(stats: Stats, params: Sequence[ParamInfo], parallel: Parallel, rank: int = 0) -> Stats:
    """The Stats of rank ``rank`` of a data-parallel job, from one process's Stats.

    Pure: the result plans, predicts and fits like measured Stats (NOTE [ Per-rank accounting ]).
    ``peak_bytes`` becomes the per-rank peak with every block kept, ``calibration.parallel``
    records the layout and the rank's :class:`RankMemory`.

    Args:
        stats: one process's Stats (measured or estimated) at the per-rank micro-batch.
        params: the model's parameters (:func:`param_table`).
        parallel: the layout.
        rank: the rank (under FSDP2 the last ranks may hold fewer rows).

    Raises:
        SpecError: the rank is outside the world, or ``params`` do not match ``stats``.
    """
    mem = rank_memory(stats, params, parallel, rank)
    bwd_end: int | None = None
    if parallel.kind is ParallelKind.DDP:
        out = _shift(stats, mem.comm_bytes)
    else:
        out, bwd_end = _fsdp2_stats(stats, params, parallel, rank, mem)
        costs = ChainCosts.from_stats(out)
        by_option = {
            m: predict(costs, _uniform(out, Option(m))).peak_bytes
            for m in ("keep", "recompute")
            if all(m in b.options for b in out.blocks)
        }
        out = replace(out, peak_bytes=by_option.get("keep", out.peak_bytes), measured_peak_bytes_by_option=by_option)
    u = _units(params, len(stats.blocks), parallel.world_size, rank)
    info = ParallelInfo(
        layout=parallel.to_dict(), rank=rank, memory=mem.to_dict(), single_process_peak_bytes=stats.peak_bytes,
        # for window_peak_bytes: per unit (blocks, then the root) gradient bytes, whole and one rank's padded shard
        unit_grad_bytes=tuple(u.grad_full), unit_grad_shard_bytes=tuple(u.grad_shard), head_grad_bytes=_head_grad_bytes(params),
        backward_end_bytes=bwd_end if bwd_end is not None else out.post_peak_bytes,
    )  # fmt: skip
    return replace(out, calibration=replace(out.calibration, parallel=info))


def _head_grad_bytes(params: Sequence[ParamInfo]) -> int:
    """Gradient bytes of the root's parameters registered after the last block's (the head, final
    norm): taken as used after the chain, so their gradients exist before any block's backward."""
    last = max((i for i, p in enumerate(params) if p.unit >= 0), default=len(params))
    return sum(p.nbytes for p in params[last + 1 :] if p.requires_grad and p.unit < 0)


def _check(stats: Stats, params: Sequence[ParamInfo], parallel: Parallel, rank: int) -> None:
    if not 0 <= rank < parallel.world_size:
        raise SpecError(
            f"memfit.plan: rank {rank} is outside world size {parallel.world_size}; use 0..{parallel.world_size - 1}."
        )
    if parallel.param_dtype and stats.dtype != parallel.param_dtype:
        raise SpecError(
            f"memfit.plan: param_dtype {parallel.param_dtype} runs the blocks in {parallel.param_dtype}, but these stats were made in "
            f"{stats.dtype}; make them in {parallel.param_dtype} (--dtype is the parameters' own dtype, e.g. float32)."
        )
    full = sum(p.nbytes for p in _retyped(params, parallel.param_dtype))
    if full > stats.params_bytes:
        raise SpecError(
            f"memfit.plan: the parameter table holds {format_bytes(full)}, more than the stats' parameters and buffers "
            f"({format_bytes(stats.params_bytes)}); build it from the model the stats were made from (param_table)."
        )


def _scaled(total: int, part: int, whole: int) -> int:
    return round(total * part / whole) if whole else 0


def _shift(stats: Stats, extra: int) -> Stats:
    """Stats with ``extra`` bytes live through the whole step (DDP's buckets)."""
    return replace(
        stats,
        start_bytes=stats.start_bytes + extra,
        pre_peak_bytes=stats.pre_peak_bytes + extra,
        post_peak_bytes=stats.post_peak_bytes + extra,
        peak_bytes=stats.peak_bytes + extra,
        peak_bytes_by_phase={k: v + extra for k, v in stats.peak_bytes_by_phase.items()},
        measured_peak_bytes_by_option={k: v + extra for k, v in stats.measured_peak_bytes_by_option.items()},
        head_options={k: _shifted_head(h, extra) for k, h in stats.head_options.items()},
    )


def _shifted_head(h: HeadOptionStats, extra: int) -> HeadOptionStats:
    """A head option's measured whole-step peaks with ``extra`` bytes more (its ``H`` is relative)."""
    return replace(
        h,
        measured_peak_bytes=h.measured_peak_bytes + extra,
        measured_peak_bytes_by_option={k: v + extra for k, v in h.measured_peak_bytes_by_option.items()},
    )


def _fsdp2_stats(
    stats: Stats, params: Sequence[ParamInfo], parallel: Parallel, rank: int, mem: RankMemory
) -> tuple[Stats, int]:
    n = len(stats.blocks)
    lay = _layout(params, n, parallel, rank)
    u, uc = lay.own, lay.comp
    full = sum(uc.full)
    raf = parallel.reshard_after_forward
    # Static parts at the start of a step: parameters become padded shards, optimizer state local rows.
    d_static = (full - sum(u.shard)) + (stats.optimizer_bytes - mem.optimizer_bytes)
    g, red = uc.gathered, lay.red.gathered
    root, last = g[n], g[n - 1] if n else 0
    start = stats.start_bytes - d_static + root
    # The root's flat all-gather output is freed only at the next unit's copy-out.
    pre = stats.pre_peak_bytes - d_static + 2 * root
    blocks = []
    for k, b in enumerate(stats.blocks):
        gk = g[k]
        prev_flat = g[k - 1] if k else root
        later = sum(uc.grad_full[j] - u.grad_shard[j] for j in range(k + 1, n))
        prefetch = g[k - 1] if raf and k else 0
        rs_kept = red[k + 1] if k + 1 < n else 0  # the later unit's reduce-scatter input, freed at the next one
        options = {}
        for m, c in b.options.items():
            options[m] = replace(
                c,
                retained_bytes=c.retained_bytes + (0 if raf else gk),
                fwd_peak_bytes=max(c.fwd_peak_bytes, prev_flat) + 2 * gk,
                bwd_peak_bytes=c.bwd_peak_bytes + (gk + prefetch if raf else 0) + rs_kept,
                bwd_base_bytes=c.bwd_base_bytes - later,
            )
        blocks.append(_with_options(b, options))
    # After the first block's backward: the embeddings' backward (root gathered, block 0's
    # reduce-scatter input kept), the root's reduce-scatter, then the optimizer over shards.
    opt_peak = stats.peak_bytes_by_phase.get("optimizer", stats.post_peak_bytes)
    temps = max(0, opt_peak - stats.params_bytes - stats.grads_bytes - stats.optimizer_bytes)
    frac = sum(u.local) / full if full else 0.0
    params_now = stats.params_bytes - (full - sum(u.shard))
    base = stats.start_bytes - stats.params_bytes - stats.optimizer_bytes  # batch and embeddings' outputs
    held = base + params_now + mem.optimizer_bytes + sum(u.grad_shard[:n]) + uc.grad_full[n]
    bwd_end = held + root + max(red[0] if n else 0, u.grad_shard[n])
    opt = params_now + mem.optimizer_bytes + mem.grads_bytes + round(temps * frac)
    post = max(bwd_end, opt)
    out = replace(
        stats,
        blocks=tuple(blocks),
        start_bytes=start,
        pre_peak_bytes=pre,
        post_peak_bytes=post,
        params_bytes=params_now,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        peak_bytes_by_phase={**stats.peak_bytes_by_phase, "optimizer": opt},
        head_peak_bytes=_fsdp2_head_peak(
            stats.head_peak_bytes, stats.head_model_peak_bytes, stats.head_backward_peak_bytes, last, raf
        ),
        head_peak_bytes_by_option={
            m: _fsdp2_head_peak(
                h,
                stats.head_model_peak_bytes_by_option.get(m),
                stats.head_backward_peak_bytes_by_option.get(m),
                last,
                raf,
            )
            for m, h in stats.head_peak_bytes_by_option.items()
        },
        head_options=_fsdp2_head_options(stats, last, raf),
        # Without reshard-after-forward a segment keeps every unit it ran gathered, which the
        # cost model's segment events (its output, one block's forward) do not count: not planned.
        sequential=stats.sequential and raf,
    )
    return out, bwd_end


def _fsdp2_head_peak(
    h: int, model_h: int | None, backward_h: int | None, last_flat: int, reshard_after_forward: bool
) -> int:
    """The head's peak ``h`` (its part until the model's forward returns ``model_h``, from the start
    of backward ``backward_h``) under FSDP2 (NOTE [ Per-rank accounting ]): the last block's flat
    all-gather output (``last_flat`` bytes) is live until the model's forward returns, and again from the
    start of backward (the root's pre-backward prefetches the last block) when blocks reshard after
    forward. A part of the head not recorded counts as the whole head."""
    fwd = h if model_h is None else model_h
    bwd = h if backward_h is None else backward_h
    return max(h, fwd + last_flat, bwd + (last_flat if reshard_after_forward else 0))


def _fsdp2_head_options(stats: Stats, last_flat: int, reshard_after_forward: bool) -> dict[str, HeadOptionStats]:
    """The head options (the chunked loss, :mod:`memfit.apply.head`) under FSDP2: an option's
    ``H`` is recorded whole (not split at the model's return), so the last block's flat all-gather
    output counts over all of it, as for the model's own head without its parts
    (:func:`_fsdp2_head_peak`; whether it is freed before the loss runs outside the model's forward
    is not told apart: at most one unit high). The measured whole-step peaks stay one process's."""
    return {
        k: replace(
            h,
            head_peak_bytes=h.head_peak_bytes + last_flat,
            head_peak_bytes_by_option={m: v + last_flat for m, v in h.head_peak_bytes_by_option.items()},
        )
        for k, h in stats.head_options.items()
    }


def _with_options(b: BlockStats, options: dict[str, OptionStats]) -> BlockStats:
    keep = options.get("keep")
    return replace(
        b,
        options=options,
        fwd_temp_bytes=keep.fwd_peak_bytes if keep else b.fwd_temp_bytes,
        bwd_temp_bytes=keep.bwd_peak_bytes if keep else b.bwd_temp_bytes,
    )


def parallel_stats_fn(
    base: Callable[[int], Stats], model: nn.Module, parallel: Parallel, *, rank: int = 0, itemsize: int | None = None
) -> Callable[[int], Stats]:
    """``micro_batch -> rank Stats``: ``base``'s (measured or estimated) Stats turned into rank
    ``rank``'s (rank 0 holds the most under FSDP2), for the planner's and auto-fit's ``stats_fn``.

    Args:
        base: one process's stats at a micro-batch size.
        model: the model (real or fake), for its parameter shapes.
        parallel: the layout.
        rank: the rank to plan for.
        itemsize: bytes per element of floating-point parameters when the stats were made in
            another dtype than the model's (``--dtype``).
    """

    def make(batch_size: int) -> Stats:
        st = base(batch_size)
        params = (
            param_table(model, [b.name for b in st.blocks], itemsize=itemsize)
            if itemsize
            else rank_param_table(model, st, parallel)
        )
        return rank_stats(st, params, parallel, rank)

    return make


def launch_command(
    parallel: Parallel, train_args: Sequence[str], *, plan_file: str | None = None, gpus_per_node: int | None = None
) -> str:
    """The ``torchrun`` line that runs ``memfit train`` with these settings: the layout
    (``--world-size``, ``--parallel`` and its options where they are not torch's defaults, the
    ``MixedPrecisionPolicy`` dtypes when set) and, with ``plan_file``, ``--plan`` (train applies it
    before wrapping the model). One node, unless ``gpus_per_node`` is given and the world is a
    multiple of it: then the line to run on each of ``world_size / gpus_per_node`` nodes (torchrun's
    c10d rendezvous at ``$MASTER_ADDR:29500``; torchrun starts as many processes on every node)."""
    layout = ["--world-size", str(parallel.world_size), "--parallel", parallel.kind.value]
    if parallel.kind is ParallelKind.DDP and parallel.bucket_cap_bytes != DDP_BUCKET_CAP_BYTES:
        layout += ["--bucket-cap-mb", f"{parallel.bucket_cap_bytes / 2**20:g}"]
    if parallel.kind is ParallelKind.FSDP2 and not parallel.reshard_after_forward:
        layout.append("--no-reshard-after-forward")
    for flag, dtype in (("--param-dtype", parallel.param_dtype), ("--reduce-dtype", parallel.reduce_dtype)):
        if dtype is not None:
            layout += [flag, dtype]
    plan = ["--plan", plan_file] if plan_file else []
    procs = [f"--nproc-per-node {parallel.world_size}"]
    if gpus_per_node and parallel.world_size > gpus_per_node and parallel.world_size % gpus_per_node == 0:
        nodes = parallel.world_size // gpus_per_node
        procs = [
            f"--nnodes {nodes}",
            f"--nproc-per-node {gpus_per_node}",
            "--rdzv-backend c10d",
            '--rdzv-endpoint "$MASTER_ADDR:29500"',
        ]
    return " ".join(
        ["torchrun", *procs, "-m memfit.cli.main train", *(shlex.quote(a) for a in [*train_args, *plan, *layout])]
    )


def layout_of(stats: Stats) -> dict[str, Any] | None:
    """The layout rank Stats were made for (``Parallel.to_dict()``), None for one process's: what a
    plan made from them records in ``Plan.parallel`` (``memfit train`` compares it with its own)."""
    info = stats.calibration.parallel
    if info is None:
        return None
    keys = (
        "kind",
        "world_size",
        "bucket_cap_bytes",
        "first_bucket_bytes",
        "reshard_after_forward",
        "param_dtype",
        "reduce_dtype",
    )
    return {k: info.layout.get(k) for k in keys}


_NONE = -(2**62)  # an event that never sets a peak


def phase_peaks(costs: ChainCosts, plan: Plan, *, optimizer_peak_bytes: int | None = None) -> dict[str, int]:
    """A plan's predicted peak per phase (bytes): ``forward`` (before the first block, the blocks'
    forwards, the loss and head), ``backward`` (the blocks' backwards, recomputes included),
    ``after_blocks`` (embeddings' backward and the optimizer step), and ``optimizer`` when given.
    The step's peak is the largest of them: the cost model's events, split by phase."""
    c = costs.with_head(plan.head)

    def only(forward: bool) -> ChainCosts:
        options = tuple(
            {
                k: replace(
                    o,
                    fwd_peak_bytes=o.fwd_peak_bytes if forward else _NONE,
                    bwd_peak_bytes=_NONE if forward else o.bwd_peak_bytes,
                )
                for k, o in opts.items()
            }
            for opts in c.options
        )
        return replace(
            c, options=options, post_peak_bytes=_NONE, pre_peak_bytes=c.pre_peak_bytes if forward else _NONE,
            head_peak_bytes=c.head_peak_bytes if forward else _NONE,
            head_peak_bytes_by_option=c.head_peak_bytes_by_option if forward else {},
        )  # fmt: skip

    out = {
        "forward": predict(only(True), plan).peak_bytes,
        "backward": predict(only(False), plan).peak_bytes,
        "after_blocks": c.post_peak_bytes,
    }
    if optimizer_peak_bytes is not None:
        out["optimizer"] = optimizer_peak_bytes
    return out


def rank_report(stats: Stats, plan: Plan) -> dict[str, Any]:
    """What a user acts on for rank Stats (:func:`rank_stats`) and a plan made from them: the rank's
    parts (``memory``), the plan's peak per phase (:func:`phase_peaks`) and the single-process peak."""
    cal = stats.calibration.parallel
    if cal is None:
        raise SpecError(
            "memfit.plan: these stats are one process's; make a rank's with memfit.plan.parallel.rank_stats."
        )
    costs = ChainCosts.from_stats(stats)
    return {
        "rank": cal.rank,
        "memory": dict(cal.memory),
        "peak_bytes_by_phase": phase_peaks(
            costs, plan, optimizer_peak_bytes=stats.peak_bytes_by_phase.get("optimizer")
        ),
        "predicted_peak_bytes": predict(costs, plan).peak_bytes,
        "single_process_peak_bytes": cal.single_process_peak_bytes,
    }


def _uniform(stats: Stats, action: Option) -> Plan:
    return Plan(
        policy="none" if action is Option.KEEP else "all",
        chain_path=stats.chain_path,
        blocks=tuple(BlockDecision(name=b.name, option=action) for b in stats.blocks),
    )
