"""Passes: one training step measured per block, on the model as the caller set it up.

capture measures; it knows nothing of plans. The caller installs a set-up (a plan applied, fused
activations, a head option) around each pass, and this module measures the step:

- a *memory pass* (:func:`memory_pass`): one step under the live-tensor tracker, with saved-tensor
  hooks around each block's forward and :class:`Event` marks at block and phase boundaries, from
  which :meth:`MemoryPass.derive` reads each block's costs (:class:`Derived`);
- a *time pass* (:func:`time_pass`): plain steps (no tracker) with timestamps at block boundaries,
  medians over repeats (:class:`TimePass`).

:func:`check_block_order` reads a memory pass's forward events (whether the chain's blocks ran
once each and in order), :func:`segment_spans` what each block was called with (which blocks take
the one before's output: where segments can lie). :func:`memfit.profiling.blocks.profile` runs these passes over its calibration set-ups.

size: the memory pass and the time pass share the block hooks and Event marks defined here.
"""

from __future__ import annotations

import bisect
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.capture.chain import Chain, accepts_blocks, computed_between_blocks
from memfit.capture.step import StepMemory, measure_step, training_step
from memfit.capture.tracker import MemoryTracker
from memfit.errors import UnsupportedModelError
from memfit.workload import Batch, Workload, iter_tensors

__all__ = [
    "Derived",
    "Event",
    "MemoryPass",
    "TimePass",
    "check_block_order",
    "container_order",
    "memory_pass",
    "segment_spans",
    "time_pass",
]

# --- memory pass ---------------------------------------------------------------------------------


class Event(NamedTuple):
    """A mark in a memory pass: at a block boundary (``fwd_start``, ``fwd_end``, ``bwd_start``,
    ``bwd_in``, ``bwd_param``) or a phase boundary
    (``start:forward``, ``end:backward``, ...; ``block`` is then -1)."""

    label: str
    block: int
    op_index: int
    """The tracker's op count when the mark was made."""
    live_bytes: int
    alloc_index: int = 0
    """The tracker's position in its stream of allocations and frees when the mark was made."""


def _storage_key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


@dataclass(slots=True)
class Derived:
    """Per-block and step-level bytes derived from one pass's events (see
    :class:`~memfit.capture.stats.OptionStats`)."""

    start: int
    pre_peak: int
    head_peak: int
    post_peak: int
    retained: list[int]
    fwd_peak: list[int]
    bwd_peak: list[int]
    bwd_base: list[int]
    fwd_ops: list[tuple[int, int]] = field(default_factory=list)
    """Per block, the tracker's op counts at its forward's start and end."""
    head_model_peak: int | None = None
    """The part of ``head_peak`` before the model's own forward returns (its head, and its loss when
    the model computes it, as HF models given labels do); None when the pass has no such mark."""
    head_backward_peak: int | None = None
    """The part of ``head_peak`` from the start of backward to the last block's backward; None when
    the pass has no ``start:backward`` mark."""
    bwd_ops: list[tuple[int, int]] = field(default_factory=list)
    """Per block, the op counts at its backward's start and end (recompute included)."""
    fwd_only: list[dict[int, int]] = field(default_factory=list)
    """Per block, bytes its forward leaves alive past its end that the forward drops before the
    backward, by the block in whose forward they are dropped (``n``: after the last block's,
    before the head's peak; ``n + 1``: after it); not in ``retained`` (NOTE [ Tensors the forward
    drops ] in :mod:`memfit.plan.costmodel`)."""


@dataclass(slots=True)
class MemoryPass:
    """One tracked step with events at block and phase boundaries."""

    mem: StepMemory
    events: list[Event]
    timeline: list[Any]
    saved: list[dict[int, int]]
    output_keys: list[set[int]]
    outputs: list[int]
    inputs: list[int]
    between_blocks: list[bool] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    """Per block, whether a block after the next takes its output (a skip: a DenseNet's features):
    no segment holds it with the next block, as a segment keeps only its last block's output."""
    chained: list[bool] = field(default_factory=list)
    """Per block, whether it takes the block before's output (empty: not recorded). A segment runs
    blocks that do: of blocks that do not (DPT's reassemble layers each take another backbone
    state), every output stays alive, and a segment would keep them all."""
    freed_inputs: list[dict[str, int]] = field(default_factory=list)
    """Per block, its tensor inputs that nothing keeps once the backward starts (the model's own
    references dropped when its forward returned: a DenseNet's list of features), by source
    (``out:K``: block K's output; ``in:I:N``: the N-th other input of block I), bytes. A recomputed
    block holds them until its backward (NOTE [ Inputs a recompute holds ] in
    :mod:`memfit.plan.costmodel`)."""
    """Per block, whether it takes a tensor the model computed from earlier blocks' outputs of its
    container between the blocks (:func:`memfit.capture.chain.computed_between_blocks`)."""
    allocations: list[tuple[int, int]] = field(default_factory=list)
    """The tracker's allocations and frees (:attr:`~memfit.capture.tracker.MemoryTracker.allocations`)."""
    input_keys: list[set[int]] = field(default_factory=list)
    """Per block, the storages of its tensor inputs (parameters and buffers included)."""
    _ops: list[int] = field(default_factory=list)

    def saved_bytes(self, i: int) -> int:
        return sum(self.saved[i].values())

    def input_saved(self, i: int) -> bool:
        """Whether block i's forward saves its input (the previous block's output)."""
        return i == 0 or not self.output_keys[i - 1] or bool(self.output_keys[i - 1] & self.saved[i].keys())

    def offloaded_bytes(self, i: int) -> int:
        """Bytes block i would move to the host if offloaded: what it saves, less what stays (its
        inputs)."""
        return max(0, self.saved_bytes(i) - (self.inputs[i] if self.input_saved(i) else 0))

    def peak_between(self, a: Event, b: Event) -> int:
        """Highest live bytes from event ``a`` to event ``b``."""
        if not self._ops:
            self._ops = [s.op_index for s in self.timeline]
        lo, hi = bisect.bisect_right(self._ops, a.op_index), bisect.bisect_right(self._ops, b.op_index)
        return max([a.live_bytes, b.live_bytes, *(s.current_bytes for s in self.timeline[lo:hi])])

    def _forward_only(
        self, fstart: list[Event], last_end: Event, bwd_begin: Event | None, head_end: Event
    ) -> tuple[list[dict[int, int]], list[int]]:
        """Per block, the storages made in its forward or in the model's code after it (until the
        next block starts) that are alive when the next block starts, dropped before the backward
        starts, and taken by no later block (a later block's input is NOTE [ Inputs a recompute
        holds ]'s), by the block in whose window they are dropped (``n``: after the last block's
        forward and before the head's peak, ``n + 1``: after it), bytes; and per block, the bytes
        of those dropped in its window."""
        n = len(fstart)
        fwd_only: list[dict[int, int]] = [{} for _ in range(n)]
        freed_in = [0] * (n + 2)
        if not self.allocations or bwd_begin is None:
            return fwd_only, freed_in[:n]
        bounds = [ev.alloc_index for ev in fstart] + [last_end.alloc_index, self._head_peak_at(last_end, head_end)]
        live: dict[int, tuple[int, int]] = {}  # storage key -> (window, position) of what a window made
        for pos in range(bounds[0], min(bwd_begin.alloc_index, len(self.allocations))):
            key, nbytes = self.allocations[pos]
            w = min(n + 1, bisect.bisect_right(bounds, pos) - 1)
            if nbytes > 0:
                if w < n:
                    live[key] = (w, pos)
                continue
            made = live.pop(key, None)
            if made is None or made[0] == w:
                continue
            k = made[0]
            if any(key in self.input_keys[j] for j in range(k + 1, min(w, n - 1) + 1)):
                continue
            fwd_only[k][w] = fwd_only[k].get(w, 0) - nbytes
            freed_in[w] -= nbytes
        return fwd_only, freed_in[:n]

    def _head_peak_at(self, last_end: Event, head_end: Event) -> int:
        """The position in the allocation stream after which the live bytes are highest from the last
        block's end to its backward's start (the head's peak; the first, where several are equal)."""
        live = best = 0
        at = last_end.alloc_index
        for pos in range(last_end.alloc_index, min(head_end.alloc_index, len(self.allocations))):
            live += self.allocations[pos][1]
            if live > best:
                best, at = live, pos + 1
        return at

    def derive(self, n: int) -> Derived:
        first: dict[tuple[str, int], Event] = {}
        last: dict[tuple[str, int], Event] = {}
        for ev in self.events:
            first.setdefault((ev.label, ev.block), ev)
            last[(ev.label, ev.block)] = ev
        fstart = [first[("fwd_start", i)] for i in range(n)]
        fend = [first[("fwd_end", i)] for i in range(n)]
        step_end = last.get(("end:optimizer", -1)) or last[("end:backward", -1)]
        start = fstart[0].live_bytes
        retained = [
            (fstart[i + 1].live_bytes if i + 1 < n else fend[i].live_bytes) - fstart[i].live_bytes for i in range(n)
        ]
        fwd_peak = [self.peak_between(fstart[i], fend[i]) - fstart[i].live_bytes for i in range(n)]
        # Backward of block i: from its output's gradient to the last gradient of its inputs or
        # parameters (blocks run backward from the last one).
        bstart: list[Event] = [fend[0]] * n
        bend: list[Event] = [fend[0]] * n
        prev = last.get(("end:forward", -1), fend[n - 1])
        for i in reversed(range(n)):
            s = first.get(("bwd_start", i))
            if s is None or s.op_index < prev.op_index:
                s = prev
            ends = [last[k] for k in (("bwd_in", i), ("bwd_param", i)) if k in last]
            e = max(ends, key=lambda ev: ev.op_index) if ends else s
            bstart[i], bend[i] = s, e
            prev = e
        # The model's forward returns after its last block (HF models compute their loss inside it).
        model_end = next(
            (ev for ev in self.events if ev.label == "model_end" and ev.op_index >= fend[n - 1].op_index), None
        )
        bwd_begin = first.get(("start:backward", -1))
        fwd_only, freed_in = self._forward_only(fstart, fend[n - 1], first.get(("start:backward", -1)), bstart[n - 1])
        for i in range(n):  # what the forward drops is not retained (NOTE [ Tensors the forward drops ])
            retained[i] += freed_in[i] - sum(fwd_only[i].values())
        prefix = 0
        bwd_base = []
        for i in range(n):
            prefix += retained[i]
            bwd_base.append(bstart[i].live_bytes - start - prefix)
        return Derived(
            start=start,
            pre_peak=self.peak_between(first[("start:forward", -1)], fstart[0]),
            head_peak=max(0, self.peak_between(fend[n - 1], bstart[n - 1]) - fend[n - 1].live_bytes),
            post_peak=self.peak_between(bend[0], step_end),
            retained=retained,
            fwd_peak=[max(0, x) for x in fwd_peak],
            bwd_peak=[max(0, self.peak_between(bstart[i], bend[i]) - bstart[i].live_bytes) for i in range(n)],
            bwd_base=bwd_base,
            fwd_ops=[(fstart[i].op_index, fend[i].op_index) for i in range(n)],
            bwd_ops=[(bstart[i].op_index, bend[i].op_index) for i in range(n)],
            fwd_only=fwd_only,
            head_model_peak=None
            if model_end is None
            else max(0, self.peak_between(fend[n - 1], model_end) - fend[n - 1].live_bytes),
            head_backward_peak=None
            if bwd_begin is None
            else max(0, self.peak_between(bwd_begin, bstart[n - 1]) - fend[n - 1].live_bytes),
        )


def memory_pass(
    model: nn.Module,
    chain: Chain,
    batch: Batch,
    workload: Workload,
    opt: torch.optim.Optimizer | None,
    seed: int,
    *,
    run_step: Callable[[Any, Callable[[str, str], None]], StepMemory] | None = None,
) -> MemoryPass:
    """One tracked step of ``model`` as the caller set it up, with the per-block hooks.

    ``run_step(tracker, on_phase)`` runs the step instead of :func:`measure_step` (the fake-tensor
    step of :mod:`memfit.estimation.stats`); it must run under ``tracker`` and call ``on_phase`` as
    :func:`measure_step` does.

    Example:
        >>> import memfit
        >>> from memfit.capture.chain import discover_chain
        >>> from memfit.capture.step import make_optimizer
        >>> wl = memfit.load_workload("demo?n_layer=2&n_embd=32&seq_len=16")
        >>> model, chain = wl.model, discover_chain(wl.model)
        >>> p = memory_pass(model, chain, wl.make_batch(2), wl, make_optimizer(model, "sgd"), seed=0)
        >>> d = p.derive(len(chain))
        >>> len(d.retained) == len(chain) and p.mem.peak_bytes > d.start
        True
    """
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    tracker = MemoryTracker(device=dev, record_timeline=True, record_allocations=True)
    rec = _BlockRecorder(model, chain, tracker)
    try:
        rec.install(model, chain)
        if run_step is not None:
            mem = run_step(tracker, rec.on_phase)
        else:
            assert opt is not None
            mem = measure_step(
                model, batch, workload.loss_fn, opt, seed=seed + 2, tracker=tracker, on_phase=rec.on_phase
            )
    finally:
        rec.remove()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    return rec.result(mem)


class _BlockRecorder:
    """The hooks of a memory pass and what they record: :class:`Event` marks at block and phase
    boundaries, what each block's forward saves (saved-tensor hooks), its inputs and outputs."""

    def __init__(self, model: nn.Module, chain: Chain, tracker: MemoryTracker) -> None:
        n = len(chain)
        self.n = n
        self.tracker = tracker
        self.saved: list[dict[int, int]] = [{} for _ in range(n)]
        self.output_keys: list[set[int]] = [set() for _ in range(n)]
        self.outputs = [0] * n
        self.inputs = [0] * n
        self.between = [False] * n
        self.container_of = [j for j, (a, b) in enumerate(chain.spans) for _ in range(a, b)]
        self.out_nodes: list[set[int]] = [set() for _ in chain.spans]  # per container: its outputs' grad_fn ids
        self.out_refs: list[dict[int, Any]] = [{} for _ in chain.spans]  # per container: id -> weak ref of its outputs
        self.fixed = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.handles: list[Any] = []
        self.active: dict[int, Any] = {}
        self.events: list[Event] = []
        self.input_keys: list[set[int]] = [set() for _ in range(n)]
        self.users: dict[int, tuple[Any, set[int]]] = {}  # id of a block input -> (weak ref, the blocks taking it)
        self.taken: list[list[tuple[str, int, Any]]] = [[] for _ in range(n)]  # per block: (source, bytes, weak ref)
        self.freed: list[dict[str, int]] = [{} for _ in range(n)]
        self.sources: dict[
            int, str
        ] = {}  # storage of a block input -> its source, named once for every block taking it

    def mark(self, label: str, i: int) -> None:
        t = self.tracker
        self.events.append(Event(label, i, t.op_count, t.current_bytes, t.allocation_count))

    def install(self, model: nn.Module, chain: Chain) -> None:
        """The hooks on every block, its parameters' gradients, and the model's forward."""
        for i, blk in enumerate(chain.blocks):
            self.handles.append(blk.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(blk.register_forward_hook(self._post(i), with_kwargs=True))
            for p in blk.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self.mark("bwd_param", i)))
        # Where the model's own forward returns (FSDP2 frees the last all-gather output there).
        self.handles.append(model.register_forward_hook(lambda _m, _a, _o: self.mark("model_end", -1)))

    def remove(self) -> None:
        """Remove the hooks, and exit the saved-tensor hooks a block whose forward raised left entered."""
        for h in self.handles:
            h.remove()
        for ctx in self.active.values():
            ctx.__exit__(None, None, None)

    def on_phase(self, where: str, name: str) -> None:
        self.mark(f"{where}:{name}", -1)
        if (where, name) == ("start", "backward"):  # what the forward's end dropped
            for i, ins in enumerate(self.taken):
                self.freed[i] = {src: b for src, b, ref in ins if ref() is None}

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            ts = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
            self.inputs[i] = _bytes([t for t in ts if _storage_key(t) not in self.fixed])
            j = self.container_of[i]
            self.between[i] = self.between[i] or any(
                computed_between_blocks(t, self.out_nodes[j]) and (self.out_refs[j].get(id(t)) or _dead)() is not t
                for t in ts
            )
            self._note_users(i, ts)
            _note_inputs(i, ts, self.output_keys, self.fixed, self.sources, self.taken[i])
            self.input_keys[i] = {_storage_key(t) for t in iter_tensors((args, kwargs))}
            self.mark("fwd_start", i)
            self._record_saved(i)

        return hook

    def _note_users(self, i: int, ts: list[torch.Tensor]) -> None:
        """Mark ``bwd_in`` when the gradient of block ``i``'s input arrives; an input several blocks
        take (encoder states) gets its gradient last: no block's end."""
        for t in ts:
            if t.requires_grad:
                seen = self.users.get(id(t))
                if seen is None or seen[0]() is not t:
                    seen = self.users[id(t)] = (weakref.ref(t), set())
                seen[1].add(i)
                t.register_hook(lambda _g, i=i, who=seen[1]: self.mark("bwd_in", i) if len(who) == 1 else None)

    def _record_saved(self, i: int) -> None:
        """Saved-tensor hooks that note what block ``i``'s forward saves (left in its forward hook)."""
        saved, fixed = self.saved[i], self.fixed

        def pack(t: torch.Tensor) -> torch.Tensor:
            k = _storage_key(t)
            if k not in fixed:
                saved[k] = t.untyped_storage().nbytes()
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        ctx.__enter__()
        self.active[i] = ctx

    def _post(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
            self.active.pop(i).__exit__(None, None, None)
            self.mark("fwd_end", i)
            outs = [t for t in iter_tensors(out) if isinstance(t, torch.Tensor)]
            self.outputs[i] = _bytes(outs)
            j = self.container_of[i]
            self.out_nodes[j].update(id(t.grad_fn) for t in outs if t.grad_fn is not None)
            self.out_refs[j].update((id(t), weakref.ref(t)) for t in outs)
            self.output_keys[i] = {_storage_key(t) for t in outs}
            for t in outs:
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: self.mark("bwd_start", i))

        return hook

    def result(self, mem: StepMemory) -> MemoryPass:
        """The pass: the step's memory and what the hooks recorded."""
        n, taken = self.n, self.taken
        return MemoryPass(
            mem=mem,
            events=self.events,
            timeline=self.tracker.timeline,
            saved=self.saved,
            output_keys=self.output_keys,
            outputs=self.outputs,
            inputs=self.inputs,
            between_blocks=self.between,
            freed_inputs=self.freed,
            allocations=self.tracker.allocations,
            input_keys=self.input_keys,
            skipped=[any(src == f"out:{i}" for j in range(i + 2, n) for src, _, _ in taken[j]) for i in range(n)],
            chained=[i > 0 and any(src == f"out:{i - 1}" for src, _, _ in taken[i]) for i in range(n)],
        )


def _note_inputs(
    i: int,
    ts: list[torch.Tensor],
    output_keys: list[set[int]],
    fixed: set[int],
    sources: dict[int, str],
    taken: list[tuple[str, int, Any]],
) -> None:
    """Note block ``i``'s tensor inputs by source, with weak references (``MemoryPass.freed_inputs``)."""
    seen: set[int] = set()
    for t in ts:
        k = _storage_key(t)
        if k in fixed or k in seen:
            continue
        seen.add(k)
        if k not in sources:
            sources[k] = next((f"out:{j}" for j in range(i) if k in output_keys[j]), f"in:{i}:{len(sources)}")
        taken.append((sources[k], t.untyped_storage().nbytes(), weakref.ref(t)))


def _forward_events(p: MemoryPass) -> list[Event]:
    end = next((k for k, ev in enumerate(p.events) if ev.label == "end:forward"), len(p.events))
    return p.events[:end]


def container_order(p: MemoryPass, chain: Chain) -> tuple[int, ...]:
    """The chain's container indices in the order their first blocks ran in pass ``p``'s forward."""
    container_of = [j for j, (a, b) in enumerate(chain.spans) for _ in range(a, b)]
    order: list[int] = []
    for label, i, *_ in _forward_events(p):
        if label == "fwd_start" and container_of[i] not in order:
            order.append(container_of[i])
    return tuple(order)


def check_block_order(p: MemoryPass, chain: Chain, model: nn.Module) -> None:
    """Refuse a chain whose blocks did not all run, ran more than once, or ran in another order than
    the chain's, as the forward events of pass ``p`` show.

    Raises:
        UnsupportedModelError: with the block at fault and the fix (``memfit.set_blocks``).
    """
    order: list[int] = []
    runs = [0] * len(chain)
    for label, i, *_ in _forward_events(p):
        if label == "fwd_start":
            runs[i] += 1
            if i not in order:
                order.append(i)
    again = [i for i, n in enumerate(runs) if n > 1]
    if again:
        # NOTE: the events of a block are taken from its first run (``MemoryPass.derive``); a module shared
        # across depth (ALBERT runs one layer num_hidden_layers times) was predicted 1.27 MB and measured
        # 0.73 MB. The gradients would be exact, the memory plan would not be.
        i = again[0]
        raise UnsupportedModelError(
            f"memfit.profile: block {chain.names[i]} ({type(chain.blocks[i]).__name__}) ran {runs[i]} times in one "
            "forward: a module shared across depth (as ALBERT's layer) or a loss_fn that calls the model more than "
            "once. memfit plans and predicts memory for blocks that run once per forward. Call the model once per "
            "step (concatenate the inputs), name containers whose blocks run once (memfit.set_blocks), or "
            "recompute the shared module without a memfit plan (model.gradient_checkpointing_enable() for "
            "transformers models)."
        )
    if order == list(range(len(chain))):
        return
    missing = [chain.names[i] for i in range(len(chain)) if i not in order]
    if missing:
        what = f"{len(missing)} of its {len(chain)} blocks did not run in the forward ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
    else:
        k = next(k for k, i in enumerate(order) if i != k)
        what = f"its blocks ran in another order ({chain.names[order[k]]} ran before {chain.names[k]})"
    call = _set_blocks_fix(chain, model, order)
    fix = (
        "If the forward skips blocks at random in training (LayerDrop; memfit switches off the attributes and "
        "config fields named '*layerdrop' itself), set that probability to 0 while measuring; else name the "
        f"containers whose blocks run every forward{f': {call}' if call else ' with memfit.set_blocks'}."
        if missing
        else "Name the block containers in the order the forward runs them"
        f"{f': {call}' if call else ' (memfit.set_blocks), or the container around lists whose blocks alternate'}."
    )
    raise UnsupportedModelError(
        f"memfit.profile: the chain of {type(model).__name__} is {chain.describe()}, but {what}. Plans need "
        f"every block of the chain to run once per forward, in chain order. {fix}"
    )


def segment_spans(p: MemoryPass, chain: Chain) -> tuple[tuple[int, int], ...]:
    """Where a plan's segments may lie: runs of two or more blocks of one container, each taking
    the blocks before it as they returned them (:mod:`memfit.apply.segments` refuses a segment
    with a block that takes a tensor the model's loop computed between blocks);
    :func:`segments_note` says why when some blocks cannot be in a segment with the one before."""
    out = []
    for a, b in chain.spans:
        start = a
        for i in range(a + 1, b + 1):
            if i == b or p.between_blocks[i] or (p.skipped and p.skipped[i - 1]) or (p.chained and not p.chained[i]):
                if i - start >= 2:
                    out.append((start, i))
                start = i
    return tuple(out)


def _set_blocks_fix(chain: Chain, model: nn.Module, order: list[int]) -> str | None:
    """The ``set_blocks`` call that names the chain's containers whose blocks all ran, in the order
    their first blocks ran, when that order runs each container's blocks together and
    :func:`memfit.set_blocks` accepts it; else None (no call memfit would refuse is suggested)."""
    container_of = [j for j, (a, b) in enumerate(chain.spans) for _ in range(a, b)]
    ran = set(order)
    whole = [j for j, (a, b) in enumerate(chain.spans) if all(i in ran for i in range(a, b))]
    seq = [container_of[i] for i in order if container_of[i] in whole]
    firsts = list(dict.fromkeys(seq))
    if not firsts or any(seq[k] != seq[k - 1] and seq[k] in seq[:k] for k in range(1, len(seq))):
        return None  # none ran whole, or their blocks alternate: no order of the lists runs them
    paths = tuple(chain.paths[j] for j in firsts)
    if paths == chain.paths or not accepts_blocks(model, paths):
        return None
    return f"memfit.set_blocks(model, {', '.join(repr(p) for p in paths)})"


def segments_note(p: MemoryPass, chain: Chain) -> str | None:
    """Why some blocks cannot be in a segment with the one before (``Calibration.segments``), or
    None when every block takes the one before's output as it returned it."""
    cut = [chain.names[i] for i, between in enumerate(p.between_blocks) if between]
    skips = [chain.names[i] for i, skipped in enumerate(p.skipped) if skipped and i + 1 < len(chain)]
    notes = []
    if cut:
        notes.append(
            f"{len(cut)} blocks ({', '.join(cut[:3])}{', ...' if len(cut) > 3 else ''}) take a tensor the model's "
            "forward computed from the blocks before them (a residual in its loop): no segment holds such a block "
            "with the one before it"
        )
    loose = [
        chain.names[i]
        for i, c in enumerate(p.chained)
        if not c and i > 0 and not p.between_blocks[i] and i not in {a for a, _ in chain.spans}
    ]
    if loose:
        notes.append(
            f"{len(loose)} blocks ({', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''}) do not take the output "
            "of the block before them: no segment holds such a block with the one before it"
        )
    if skips:
        notes.append(
            f"{len(skips)} blocks ({', '.join(skips[:3])}{', ...' if len(skips) > 3 else ''}) have their output "
            "taken by a block after the next (a skip): no segment holds such a block with the one after it"
        )
    return "; ".join(notes) or None


def _dead() -> None:
    return None


# --- time passes ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TimePass:
    """Seconds of a step measured by :func:`time_pass` (medians over its repeats).

    Attributes:
        block_fwd_s: per block, its forward.
        block_bwd_s: per block, from its output's first gradient to the last gradient of its inputs
            and parameters (recompute included).
        fwd_s: the whole forward (loss included).
        bwd_s: the whole backward.
    """

    block_fwd_s: tuple[float, ...]
    block_bwd_s: tuple[float, ...]
    fwd_s: float
    bwd_s: float


def time_pass(
    model: nn.Module,
    chain: Chain,
    batch: Batch,
    workload: Workload,
    opt: torch.optim.Optimizer,
    seed: int,
    repeats: int,
) -> TimePass:
    """Time ``repeats`` plain steps of the model as it is set up, per block (no tracker, no
    optimizer step); the caller warms up first."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    clock = _BlockClock(len(chain), sync=torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))
    handles = clock.install(chain)
    fwd_tot: list[float] = []
    bwd_tot: list[float] = []
    try:
        for _ in range(repeats):
            clock.t_bstart.clear()
            clock.t_bend.clear()
            training_step(model, batch, workload.loss_fn, None, seed=seed + 2, phase=clock.phase)
            model.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)  # ends a step-in-backward optimizer's window (it stepped in the backward)
            fwd_tot.append(clock.phase_s["forward"])
            bwd_tot.append(clock.phase_s["backward"])
            clock.add_backward_samples()
    finally:
        for h in handles:
            h.remove()

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    return TimePass(
        block_fwd_s=tuple(med(s) for s in clock.fwd_samples),
        block_bwd_s=tuple(med(s) for s in clock.bwd_samples),
        fwd_s=med(fwd_tot),
        bwd_s=med(bwd_tot),
    )


class _BlockClock:
    """The hooks of a time pass: timestamps at block and phase boundaries (synchronized first)."""

    def __init__(self, n: int, *, sync: Callable[[], Any]) -> None:
        self.n = n
        self.sync = sync
        self.fwd_samples: list[list[float]] = [[] for _ in range(n)]
        self.bwd_samples: list[list[float]] = [[] for _ in range(n)]
        self.t_start: dict[int, float] = {}
        self.t_bstart: dict[int, float] = {}
        self.t_bend: dict[int, float] = {}
        self.phase_s: dict[str, float] = {}  # seconds of each phase of the last step

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def install(self, chain: Chain) -> list[Any]:
        """The hooks on every block and its parameters' gradients; returns their handles."""
        handles = []
        for i, blk in enumerate(chain.blocks):
            handles.append(blk.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            handles.append(blk.register_forward_hook(self._post(i), with_kwargs=True))
            for p in blk.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._end_at(i)))
        return handles

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase of the step (``training_step``'s ``phase``)."""
        t0 = self.now()
        try:
            yield
        finally:
            self.phase_s[name] = self.now() - t0

    def add_backward_samples(self) -> None:
        """Each block's backward in the step just run: from its output's first gradient to the last
        gradient of its inputs and parameters."""
        for i in range(self.n):
            if i in self.t_bstart and i in self.t_bend:
                self.bwd_samples[i].append(max(0.0, self.t_bend[i] - self.t_bstart[i]))

    def _end_at(self, i: int) -> None:  # the latest gradient of block i's inputs or parameters
        self.t_bend[i] = max(self.t_bend.get(i, 0.0), self.now())

    def _start_at(self, i: int) -> None:  # the first gradient of block i's outputs
        if i not in self.t_bstart:
            self.t_bstart[i] = self.now()

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            for t in iter_tensors((args, kwargs)):
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: self._end_at(i))
            self.t_start[i] = self.now()

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple, _k: dict, out: Any) -> None:
            self.fwd_samples[i].append(self.now() - self.t_start[i])
            for t in iter_tensors(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _g, i=i: self._start_at(i))

        return hook
