"""profile: measure one workload's training step, per block.

Produces immutable :class:`Stats` (per block: forward and backward seconds, bytes autograd saves,
output bytes, transient working memory) that planning consumes. Two kinds of passes:

- a *memory pass*: one steady-state step under the live-tensor tracker, with saved-tensor hooks
  around each block's forward and events at block boundaries;
- *time passes*: plain steps (no tracker) with timestamps at block boundaries, medians over repeats.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.apply.engine import remove_plan
from memfit.capture.chain import Chain, discover_chain
from memfit.capture.step import (
    StepMemory,
    make_optimizer,
    measure_step,
    step_runner,
    time_steps,
    training_step,
    warm_up,
)
from memfit.plan.policies import make_fingerprint
from memfit.workload import Batch, Workload, cast_batch, iter_tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockStats:
    """Measured costs of one block (bytes and seconds).

    Attributes:
        name: qualified module name.
        fwd_s: forward seconds (median).
        bwd_s: backward seconds (median): from its output's gradient to its input's and
            parameters' gradients.
        saved_bytes: bytes of the distinct storages autograd saves in the block's forward (the
            block's input included when an op saves it; parameters and buffers excluded).
        output_bytes: bytes of the block's output tensors.
        input_bytes: bytes of the block's tensor inputs.
        fwd_temp_bytes: peak live bytes during its forward above the live bytes at its start.
        bwd_temp_bytes: peak live bytes during its backward above the live bytes at its start.
    """

    name: str
    fwd_s: float
    bwd_s: float
    saved_bytes: int
    output_bytes: int
    input_bytes: int
    fwd_temp_bytes: int
    bwd_temp_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True, slots=True)
class Stats:
    """Everything one profile measured. JSON fields follow DESIGN.md (``memfit profile``)."""

    model: str
    batch_size: int
    dtype: str
    device: str
    optimizer: str
    chain_path: str
    sequential: bool
    blocks: tuple[BlockStats, ...]
    peak_bytes: int
    step_s: float
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_peak_bytes: int
    peak_bytes_by_phase: dict[str, int]
    fwd_s: float
    bwd_s: float
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["blocks"] = [b.to_dict() for b in self.blocks]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        d = dict(data)
        d["blocks"] = tuple(BlockStats(**b) for b in d["blocks"])
        return cls(**d)


def profile(
    workload: Workload,
    *,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    repeats: int = 3,
    device: torch.device | str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Stats:
    """Measure the workload's training step per block.

    Args:
        workload: the workload (any plan on its model is removed first).
        batch_size: samples per step (default: the workload's).
        dtype: convert model and batch to this dtype.
        optimizer: the step's optimizer ('adamw', 'adam', 'sgd').
        seed: seed for data and dropout.
        repeats: timed steps (medians); at least 1.
        device: run on this device (default: where the model is).
        progress: called with a short text before each pass.

    Returns:
        The measured :class:`Stats`.
    """
    say = progress or (lambda _s: None)
    model = workload.model
    remove_plan(model)
    model.zero_grad(set_to_none=True)
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype=dtype)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    eff_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    chain = discover_chain(model, workload.blocks)
    bs = batch_size or workload.default_batch_size
    torch.manual_seed(seed)
    batch = cast_batch(workload.make_batch(bs), dtype=dtype, device=dev)
    opt = make_optimizer(model, optimizer)

    say("warm-up step")
    warm_up(model, batch, workload.loss_fn, opt, seed=seed + 1)
    say("memory pass")
    mem, saved, outputs, inputs, fwd_temp, bwd_temp = _memory_pass(model, chain, batch, workload, opt, seed)
    say("time passes")
    fwd, bwd, fwd_total, bwd_total = _time_pass(model, chain, batch, workload, opt, seed, max(1, repeats))
    step_s = time_steps({"step": step_runner(model, batch, workload.loss_fn, opt, seed=seed)}, repeats=max(1, repeats), warmup=0)["step"]
    opt.zero_grad(set_to_none=True)

    blocks = tuple(
        BlockStats(
            name=name,
            fwd_s=fwd[i],
            bwd_s=bwd[i],
            saved_bytes=saved[i],
            output_bytes=outputs[i],
            input_bytes=inputs[i],
            fwd_temp_bytes=fwd_temp[i],
            bwd_temp_bytes=bwd_temp[i],
        )
        for i, name in enumerate(chain.names)
    )
    return Stats(
        model=workload.name,
        batch_size=bs,
        dtype=str(eff_dtype).removeprefix("torch."),
        device=str(dev),
        optimizer=optimizer,
        chain_path=chain.path,
        sequential=chain.sequential,
        blocks=blocks,
        peak_bytes=mem.peak_bytes,
        step_s=step_s,
        params_bytes=mem.params_bytes,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        activations_peak_bytes=mem.activations_peak_bytes,
        peak_bytes_by_phase=dict(mem.peak_bytes_by_phase),
        fwd_s=fwd_total,
        bwd_s=bwd_total,
        fingerprint=make_fingerprint(model, chain, batch),
    )


# --- memory pass ---------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


class _Marks:
    """Block-boundary events during a tracked step; peaks between them come from the timeline."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.events: list[tuple[str, int, int, int]] = []  # (label, block, op_count, live bytes)
        self._samples: list[Any] = []
        self._ops: list[int] | None = None

    def mark(self, label: str, block: int) -> None:
        self.events.append((label, block, self.tracker.op_count, self.tracker.current_bytes))

    def peak_between(self, a: tuple[str, int, int, int], b: tuple[str, int, int, int]) -> int:
        """Highest live bytes from event ``a`` to event ``b`` (call after the step)."""
        if self._ops is None:
            self._samples = self.tracker.timeline
            self._ops = [s.op_index for s in self._samples]
        lo, hi = bisect.bisect_right(self._ops, a[2]), bisect.bisect_right(self._ops, b[2])
        return max([a[3], *(s.current_bytes for s in self._samples[lo:hi])])


def _memory_pass(
    model: nn.Module, chain: Chain, batch: Batch, workload: Workload, opt: torch.optim.Optimizer, seed: int
) -> tuple[StepMemory, list[int], list[int], list[int], list[int], list[int]]:
    from memfit.capture.tracker import MemoryTracker

    n = len(chain)
    saved: list[dict[int, int]] = [{} for _ in range(n)]
    outputs = [0] * n
    inputs = [0] * n
    fixed = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    handles: list[Any] = []
    active: dict[int, Any] = {}
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    tracker = MemoryTracker(device=dev, record_timeline=True)
    marks = _Marks(tracker)
    mark = marks.mark

    def pre(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            ts = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
            inputs[i] = _bytes([t for t in ts if _storage_key(t) not in fixed])
            for t in ts:
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: mark("bwd_in", i))
            mark("fwd_start", i)

            def pack(t: torch.Tensor) -> torch.Tensor:
                k = _storage_key(t)
                if k not in fixed:
                    saved[i][k] = t.untyped_storage().nbytes()
                return t

            ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx.__enter__()
            active[i] = ctx

        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
            active.pop(i).__exit__(None, None, None)
            mark("fwd_end", i)
            outs = [t for t in iter_tensors(out) if isinstance(t, torch.Tensor)]
            outputs[i] = _bytes(outs)
            for t in outs:
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: mark("bwd_start", i))

        return hook

    for i, blk in enumerate(chain.blocks):
        handles.append(blk.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(blk.register_forward_hook(post(i), with_kwargs=True))
        for p in blk.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: mark("bwd_param", i)))
    try:
        mem = measure_step(model, batch, workload.loss_fn, opt, seed=seed + 2, tracker=tracker)
    finally:
        for h in handles:
            h.remove()
        for ctx in active.values():
            ctx.__exit__(None, None, None)
    opt.zero_grad(set_to_none=True)

    fwd_temp = [0] * n
    bwd_temp = [0] * n
    events = marks.events
    # Forward of block i: from fwd_start(i) to fwd_end(i).
    starts: dict[int, tuple[str, int, int, int]] = {}
    for ev in events:
        if ev[0] == "fwd_start":
            starts[ev[1]] = ev
        elif ev[0] == "fwd_end" and ev[1] in starts:
            fwd_temp[ev[1]] = max(0, marks.peak_between(starts[ev[1]], ev) - starts[ev[1]][3])
    # Backward of block i: from bwd_start(i) (its output's gradient) to its last bwd_in/bwd_param.
    bstart: dict[int, tuple[str, int, int, int]] = {}
    bend: dict[int, tuple[str, int, int, int]] = {}
    for ev in events:
        if ev[0] == "bwd_start":
            bstart.setdefault(ev[1], ev)
        elif ev[0] in ("bwd_in", "bwd_param"):
            bend[ev[1]] = ev
    for i, a_ev in bstart.items():
        if i in bend and bend[i][2] >= a_ev[2]:
            bwd_temp[i] = max(0, marks.peak_between(a_ev, bend[i]) - a_ev[3])
    return (
        mem,
        [sum(s.values()) for s in saved],
        outputs,
        inputs,
        fwd_temp,
        bwd_temp,
    )


# --- time passes ---------------------------------------------------------------------------------


def _time_pass(
    model: nn.Module,
    chain: Chain,
    batch: Batch,
    workload: Workload,
    opt: torch.optim.Optimizer,
    seed: int,
    repeats: int,
) -> tuple[list[float], list[float], float, float]:
    n = len(chain)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fwd_samples: list[list[float]] = [[] for _ in range(n)]
    bwd_samples: list[list[float]] = [[] for _ in range(n)]
    fwd_tot: list[float] = []
    bwd_tot: list[float] = []
    t_start: dict[int, float] = {}
    t_bstart: dict[int, float] = {}
    t_bend: dict[int, float] = {}
    handles: list[Any] = []

    def now() -> float:
        sync()
        return time.perf_counter()

    def end_at(i: int) -> None:  # the latest gradient of block i's inputs or parameters
        t_bend[i] = max(t_bend.get(i, 0.0), now())

    def start_at(i: int) -> None:  # the first gradient of block i's outputs
        if i not in t_bstart:
            t_bstart[i] = now()

    def pre(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            for t in iter_tensors((args, kwargs)):
                if t.requires_grad:
                    t.register_hook(lambda _g, i=i: end_at(i))
            t_start[i] = now()

        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple, _k: dict, out: Any) -> None:
            fwd_samples[i].append(now() - t_start[i])
            for t in iter_tensors(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _g, i=i: start_at(i))

        return hook

    for i, blk in enumerate(chain.blocks):
        handles.append(blk.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(blk.register_forward_hook(post(i), with_kwargs=True))
        for p in blk.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: end_at(i)))
    try:
        phase_t: dict[str, float] = {}

        class _Phase:
            def __init__(self, name: str) -> None:
                self.name = name

            def __enter__(self) -> None:
                phase_t[self.name] = now()

            def __exit__(self, *exc: Any) -> None:
                phase_t[self.name] = now() - phase_t[self.name]

        for _ in range(repeats):
            t_bstart.clear()
            t_bend.clear()
            training_step(model, batch, workload.loss_fn, None, seed=seed + 2, phase=_Phase)
            model.zero_grad(set_to_none=True)
            fwd_tot.append(phase_t["forward"])
            bwd_tot.append(phase_t["backward"])
            for i in range(n):
                if i in t_bstart and i in t_bend:
                    bwd_samples[i].append(max(0.0, t_bend[i] - t_bstart[i]))
    finally:
        for h in handles:
            h.remove()

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    return [med(s) for s in fwd_samples], [med(s) for s in bwd_samples], med(fwd_tot), med(bwd_tot)
