"""Op-level capture: inside each block, every op call and every tensor autograd saves.

``capture_ops(workload)`` runs the model's forward a few times with a ``TorchDispatchMode`` that
records each op call inside each block (op overload, output shapes, new bytes, measured seconds,
FLOPs) and ``saved_tensors_hooks`` that map every tensor autograd saves back to the op call that
created its storage. Selective checkpointing (:mod:`memfit.apply.selective`) and ``memfit explain``
read the result; the planner's calibration passes measure the options it builds.

NOTE [ Saved tensors and the ops that made them ]
Autograd saves tensors, memory belongs to storages (see NOTE [ Counting storages through weak
references ] in :mod:`memfit.capture.tracker`). A saved tensor is often a view of another op's
output: ``sdpa`` saves ``q, k, v``, three views of one ``addmm`` output; ``addmm`` saves
``x.view(-1, d)``. So each saved tensor is reduced to its storage, and the storage to the op call
that *created* it: an op output whose storage is not the storage of one of the op's inputs. Views
(``view``, ``transpose``, ``split``) and in-place ops (``bernoulli_``, ``div_``) return storages of
their inputs: they create nothing. An in-place op is remembered as the last writer of the storage
(a dropout mask is created by ``empty_like`` and written by ``bernoulli_`` and ``div_``), and the
creating call is marked *mutated*: selective checkpointing cannot cache its output (torch checks
that cached outputs are not mutated afterwards). Storages that no op of the block created are the
block's inputs (the hidden states, rotary ``cos``/``sin`` passed in) or, rarely, *external*
tensors the block reads from elsewhere. Parameters and buffers are left out, as in
:attr:`memfit.capture.stats.BlockStats.saved_bytes`; so the saved tensors listed here add up to
that number.

Known limitations:
- Op times are medians of a few forwards, measured around each op inside the dispatch mode (on
  CUDA with a synchronize around each op); they exclude Python time between ops, so they add up to
  somewhat less than the block's forward time.
- The op sequence must be the same in every forward (it is for models without data-dependent
  control flow); if it differs, the first forward's times are used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from memfit.capture.chain import discover_chain
from memfit.capture.opstats import BlockOps, OpCall, OpStats, SavedTensor, op_category
from memfit.capture.snapshot import leave_unchanged, seed_generators
from memfit.workload import Batch, Workload, cast_batch, iter_tensors

__all__ = ["capture_ops", "record_ops"]


def capture_ops(
    workload: Workload,
    *,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    repeats: int = 3,
    device: torch.device | str | None = None,
    batch: Batch | None = None,
) -> OpStats:
    """Record every op call and saved tensor inside each block of the workload's chain.

    Runs ``1 + repeats`` forwards (with the loss, without backward) in training mode: the first
    records structure and warms up, the others time each op (medians). Measuring never changes
    the model: its weights, buffers (BatchNorm statistics), gradients, modes, applied plan and the
    RNGs are restored bitwise afterwards, and ``dtype``/``device`` act on a copy
    (NOTE [ Measuring leaves the model as it was ] in :mod:`memfit.capture.snapshot`).

    Args:
        workload: the workload (a plan applied to its model is lifted while measuring).
        batch_size: samples per forward (default: the workload's).
        dtype: measure a copy of the model in this dtype (and convert the batch).
        seed: seed for data and dropout.
        repeats: timed forwards (medians); at least 1.
        device: measure a copy of the model on this device (default: the model where it is).
        batch: use this batch instead of making one (already on the device).

    Returns:
        The :class:`OpStats`.

    Example:
        >>> from memfit.models.registry import load_workload
        >>> wl = load_workload("demo?n_layer=2&n_embd=32&seq_len=16")
        >>> ops = capture_ops(wl, batch_size=2, repeats=1)
        >>> ops.blocks[0].saved_bytes > 0
        True
    """
    with leave_unchanged(workload.model, device=device, dtype=dtype) as model:
        if model is not workload.model:
            workload = replace(workload, model=model)
        return record_ops(workload, batch_size=batch_size, dtype=dtype, seed=seed, repeats=repeats, batch=batch)


def record_ops(
    workload: Workload,
    *,
    batch_size: int | None,
    dtype: torch.dtype | None,
    seed: int,
    repeats: int,
    batch: Batch | None,
) -> OpStats:
    """:func:`capture_ops`'s recording, on the model as it is (moved and cast already), without a
    snapshot: for a caller that already leaves the model as it was (:func:`memfit.profiling.blocks.profile`)."""
    model = workload.model
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    eff_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    chain = discover_chain(model, workload.blocks)
    bs = batch_size or workload.default_batch_size
    if batch is None:
        torch.manual_seed(seed)
        batch = cast_batch(workload.make_batch(bs), dtype=dtype, device=dev)
    fixed = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    recorder = _Recorder(len(chain), fixed, sync=dev.type == "cuda")
    handles = []
    for i, blk in enumerate(chain.blocks):
        handles.append(blk.register_forward_pre_hook(recorder.pre(i), with_kwargs=True))
        handles.append(blk.register_forward_hook(recorder.post(i), with_kwargs=True))
    was_training = model.training
    model.train()
    try:
        for r in range(1 + max(1, repeats)):
            recorder.start_run(structure=r == 0)
            seed_generators(seed + 1)
            with torch.enable_grad(), recorder:
                out = workload.loss_fn(model, batch)
            del out
    finally:
        for h in handles:
            h.remove()
        recorder.close()
        model.train(was_training)
    blocks = tuple(recorder.block_ops(i, name) for i, name in enumerate(chain.names))
    return OpStats(
        model=workload.name,
        batch_size=bs,
        device=str(dev),
        dtype=str(eff_dtype).removeprefix("torch."),
        blocks=blocks,
        info={"repeats": max(1, repeats)},
    )


# --- recording machinery -----------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    op: str
    index: int
    shapes: list[tuple[int, ...]]
    dtype: str
    new: list[tuple[int, int]]  # (storage key, bytes) of storages this call created
    mutable: bool
    flops: int
    mutated: bool = False


@dataclass(slots=True)
class _Saved:
    """A storage autograd saves, while recording (becomes a :class:`SavedTensor`)."""

    op: str
    call: int | None
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    n_views: int = 1


@dataclass(slots=True)
class _Block:
    calls: list[_Call] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    created: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (call, output)
    writer: dict[int, int] = field(default_factory=dict)  # key -> last in-place call
    inputs: set[int] = field(default_factory=set)
    saved: dict[int, _Saved] = field(default_factory=dict)  # storage key -> what autograd saves from it
    times: list[list[float]] = field(default_factory=list)  # per run, per call


class _Recorder(TorchDispatchMode):
    """Routes op calls to the block whose forward is running; maps saved tensors to calls."""

    def __init__(self, n: int, fixed: set[int], *, sync: bool) -> None:
        super().__init__()
        self.blocks = [_Block() for _ in range(n)]
        self.fixed = fixed
        self.sync = torch.cuda.synchronize if sync else (lambda: None)
        self.active: list[int] = []
        self.structure = True
        self.run_times: list[list[float]] = [[] for _ in range(n)]
        self.hooks: dict[int, Any] = {}

    def start_run(self, *, structure: bool) -> None:
        self.structure = structure
        for i, t in enumerate(self.run_times):
            if t and not structure:
                self.blocks[i].times.append(t)
        self.run_times = [[] for _ in self.blocks]

    def close(self) -> None:
        for i, t in enumerate(self.run_times):
            if t and not self.structure:
                self.blocks[i].times.append(t)
        self.run_times = [[] for _ in self.blocks]
        for ctx in self.hooks.values():
            ctx.__exit__(None, None, None)
        self.hooks.clear()

    # hooks around each block's forward
    def pre(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self.active.append(i)
            if self.structure:
                blk = self.blocks[i]
                blk.inputs = {id(t.untyped_storage()) for t in iter_tensors((args, kwargs))}
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack(i), _identity)
                ctx.__enter__()
                self.hooks[i] = ctx

        return hook

    def post(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple, _k: dict, _out: Any) -> None:
            if self.active and self.active[-1] == i:
                self.active.pop()
            ctx = self.hooks.pop(i, None)
            if ctx is not None:
                ctx.__exit__(None, None, None)

        return hook

    def _pack(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        blk = self.blocks[i]

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                return t
            key = id(st)
            if key in self.fixed:
                return t
            rec = blk.saved.get(key)
            if rec is not None:
                rec.n_views += 1
                return t
            where = blk.created.get(key)
            if where is not None:
                c, k = where
                call = blk.calls[c]
                w = blk.writer.get(key)
                op = blk.calls[w].op if w is not None and w > c else call.op
                shape = call.shapes[k] if k < len(call.shapes) else tuple(t.shape)
                blk.saved[key] = _Saved(op=op, call=c, shape=shape, dtype=call.dtype, bytes=st.nbytes())
            else:
                op = "input" if key in blk.inputs else "external"
                blk.saved[key] = _Saved(
                    op=op, call=None, shape=tuple(t.shape), dtype=_dtype_name(t.dtype), bytes=st.nbytes()
                )
            return t

        return pack

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.active or func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        i = self.active[-1]
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        dt = time.perf_counter() - t0
        self.run_times[i].append(dt)
        if self.structure:
            self._record(self.blocks[i], func, args, kwargs, out)
        return out

    def _record(self, blk: _Block, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = str(func)
        index = blk.counts.get(name, 0)
        blk.counts[name] = index + 1
        in_keys = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        outs = list(_tensors(out))
        mutable = bool(getattr(getattr(func, "_schema", None), "is_mutable", False))
        c = len(blk.calls)
        new: list[tuple[int, int]] = []
        for k, t in enumerate(outs):
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue
            key = id(st)
            if key in in_keys:  # a view of an input, or written in place
                if mutable:
                    blk.writer[key] = c
                    where = blk.created.get(key)
                    if where is not None:
                        c_made, _k = where
                        blk.calls[c_made].mutated = True
                continue
            if all(key != nk for nk, _ in new):
                new.append((key, st.nbytes()))
            blk.created[key] = (c, k)
        blk.calls.append(
            _Call(
                op=name,
                index=index,
                shapes=[tuple(t.shape) for t in outs],
                dtype=_dtype_name(outs[0].dtype) if outs else "",
                new=new,
                mutable=mutable,
                flops=_flops(func, args, kwargs, out),
            )
        )

    def block_ops(self, i: int, name: str) -> BlockOps:
        blk = self.blocks[i]
        n = len(blk.calls)
        runs = [t for t in blk.times if len(t) == n]
        times = [statistics.median(col) for col in zip(*runs, strict=True)] if runs else [0.0] * n
        saved_by_call: dict[int, int] = {}
        for r in blk.saved.values():
            if r.call is not None:
                saved_by_call[r.call] = saved_by_call.get(r.call, 0) + r.bytes
        calls = []
        for j, (c, t) in enumerate(zip(blk.calls, times, strict=True)):
            creates = bool(c.new)
            cat = op_category(c.op, creates=creates, mutable=c.mutable)
            calls.append(
                OpCall(
                    op=c.op,
                    index=c.index,
                    category=cat,
                    shapes=tuple(c.shapes),
                    dtype=c.dtype,
                    out_bytes=sum(b for _, b in c.new),
                    saved_bytes=saved_by_call.get(j, 0),
                    time_s=t,
                    flops=c.flops,
                    cheap=cat not in ("matmul", "attention"),
                    cacheable=creates and not c.mutated,
                )
            )
        saved = tuple(
            SavedTensor(op=r.op, call=r.call, shape=tuple(r.shape), dtype=r.dtype, bytes=r.bytes, n_views=r.n_views)
            for r in blk.saved.values()
        )
        return BlockOps(name=name, calls=tuple(calls), saved=saved, fwd_s=sum(times))


def _identity(t: Any) -> Any:
    return t


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = getattr(func, "overloadpacket", None)
    try:
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            q, k, v = args[:3]
            return int(sdpa_flop_count(q.shape, k.shape, v.shape))
        fn = flop_registry.get(packet)
        if fn is None:
            return 0
        return int(fn(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not accept this overload's arguments: no tiebreak
        return 0
