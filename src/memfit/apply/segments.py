"""Segments: consecutive blocks of one container recomputed in backward as one unit, from the
segment's input alone, whoever runs the loop over the blocks (an ``nn.Sequential``'s own forward, a
model's forward iterating its ``nn.ModuleList`` of layers as every transformers model does, or a
stage looping over its ``nn.Sequential``).

NOTE [ Segments over any block list ]
``torch.utils.checkpoint.checkpoint_sequential`` needs one function to call for the whole segment,
which a model that loops over its layers itself does not have. memfit wraps each block of a segment
instead (its instance ``forward``, as for any planned block) and builds the segment from torch's
own non-reentrant checkpoint pieces (``torch/utils/checkpoint.py``: ``_CheckpointFrame``,
``_checkpoint_hook``, and its ``_recomputation_hook`` run by the frame's unpack hook), following
``NOTE [ Nestable Checkpoint ]`` there:

- Forward. When the segment's first block is called, a ``_CheckpointFrame`` is opened and that
  block's tensor arguments are saved as the frame's inputs (``save_inputs``: under the enclosing
  segment's hook when segments nest, so that, by torch's rule 2, an inner segment's input is a
  tensor saved by the outer one). Each block of the segment then runs under ``_checkpoint_hook``
  of the innermost open frame: every tensor autograd saves inside the segment becomes a holder of
  that frame, and nothing is kept. Between blocks no hook of memfit's is active: what the model's
  own loop computes there is saved as usual.
- What a block is called with is recorded per frame, tensors replaced by where they come from:
  an input of the segment's first block, or a tensor an earlier block of the segment returned
  (found by identity: ``hidden = layer(hidden, ...)``, ``hidden = outputs[0]``), or kept as it is
  (masks, position embeddings, a bias computed before the segment: alive anyway). A block of the
  segment taking a tensor that requires gradients, that the model computed between blocks from
  a block's output (a residual ``h = h + layer(h)`` in the model's loop), is refused: a segment
  recomputes only its blocks, so it would have to keep that tensor and save nothing.
- Per block, the forward notes what the engine notes for any recomputed block: torch's CPU and
  device generators, Python's and NumPy's, the buffers it changed and the attributes it
  reassigned (NOTE [ Buffers are updated once ], NOTE [ State a recompute would change twice ] in
  :mod:`memfit.apply.engine`), and a transformers layer's key/value cache update (NOTE [ A recomputed
  layer fills its cache once ]; a block with a compiled forward runs without the cache, decided here
  once). RNG is replayed per block, so a generator the model's loop draws from between blocks
  (LayerDrop) does not shift the masks.
- Backward. The first unpack of a tensor saved inside the segment runs the frame's recompute:
  the blocks again, one by one, each with its recorded arguments (the recomputed output of the
  block before standing for the forward's), its generators set to what its forward started
  from, its buffers and attributes put back afterwards. Torch's recomputation hook collects the
  saved tensors in order, checks their count and metadata, and stops once it has all of them.
  Nested segments open fresh frames in the recompute, as nested checkpoints do in torch.

Blocks of a segment must run once per forward, in order, one after another; anything else is
refused with a one-line error.

Under ``torch.compile`` a segment runs as NOTE [ Compiled segments ] in
:mod:`memfit.apply.compiled_segments` says: per block, the compiled blocks inside eager segment
frames; whole model, one recompute region of the compiler's partitioner per segment.

Known limitations:
- A block taking a tensor computed from an earlier block's output by the model's loop (beyond
  indexing the block's output) is refused, as above; one taking a view of such a tensor, or a
  tensor built from it more than a few operations deep, keeps it (correct, saving less memory).
- A model's forward interrupted by an exception between two blocks of a segment leaves the
  segment open; the next forward is refused once (block order) and then runs.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils.checkpoint import (
    _checkpoint_hook,
    _CheckpointFrame,
    _default_meta_extractor,
    _get_autocast_kwargs,
    _infer_device_type,
    checkpoint,
)

from memfit.apply.compiled_segments import compiled_segment_contexts
from memfit.apply.state import (
    _buffer_contexts,
    _forked_rng,
    _note_and_replay,
    _refuse_changed_state,
    _RngState,
    _without_cache,
)
from memfit.capture.chain import computed_between_blocks, is_fully_sharded
from memfit.errors import UnsupportedModelError
from memfit.plan.types import Segment

_LAYOUT_ATTR = "_memfit_segment_layout"  # on a container: the segments containing each of its blocks
_RUN_ATTR = "_memfit_segment_run"  # on a container while a forward has segments open (transient)
_INNER_ATTR = "_memfit_segment_inner"  # on a block in a segment: the forward it calls (None: its class's)
_UNIT_ATTR = "_memfit_segment_unit"  # on a block in a segment: its innermost segment and index (None: recomputed alone)
_COMPILED_ATTR = "_memfit_segment_compiled"  # on a block in a segment whose inner forward is compiled


def install_segments(
    container: nn.Module, segments: Sequence[Segment], recomputed: frozenset[int] = frozenset()
) -> None:
    """Make the blocks of ``container`` run ``segments`` (indices relative to the container);
    ``recomputed``: the blocks the plan also recomputes on their own (inside their segments)."""
    blocks = list(container.children())
    spans = sorted({(s.start, s.stop) for s in segments}, key=lambda s: s[0] - s[1])  # outermost first
    paths = tuple(tuple(s for s in spans if s[0] <= k < s[1]) for k in range(len(blocks)))
    container.__dict__[_LAYOUT_ATTR] = _Layout(paths=paths)
    for k, block in enumerate(blocks):
        if paths[k]:
            d = block.__dict__
            d[_INNER_ATTR] = d.get("forward")  # the engine's wrapper of the block's action, or a user's
            d[_UNIT_ATTR] = None if k in recomputed else (*paths[k][-1], k)  # NOTE [ Compiled segments ]
            d["forward"] = functools.partial(
                _segment_block_forward, container, k, block
            )  # NOTE [ Saving applied models ]


def remove_segments(module: nn.Module) -> None:
    """Undo :func:`install_segments` on one module (a container or a block; a no-op otherwise)."""
    d = module.__dict__
    for key in (_LAYOUT_ATTR, _RUN_ATTR, _UNIT_ATTR, _COMPILED_ATTR):
        d.pop(key, None)
    if _INNER_ATTR in d:
        inner = d.pop(_INNER_ATTR)
        if inner is None:
            d.pop("forward", None)
        else:
            d["forward"] = inner


def compile_segment_block(
    block: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None] | None:
    """Compile what a block of a segment runs inside the segment (its own forward), leaving the
    segment's steps around it eager (NOTE [ Compiled segments ]).

    Args:
        block: a block of a container with segments installed.
        compile_fn: compiles a function (``torch.compile`` with the caller's backend and options).

    Returns:
        ``undo()`` restoring the block's inner forward, or None for a block in no segment.
    """
    d = block.__dict__
    if _INNER_ATTR not in d:
        return None
    inner = d[_INNER_ATTR]
    compiled = d[_INNER_ATTR] = compile_fn(_inner_forward(block))
    d[_COMPILED_ATTR] = True

    def undo() -> None:
        if d.get(_INNER_ATTR) is compiled:  # not removed meanwhile (remove_plan restores the forward itself)
            d[_INNER_ATTR] = inner
            d.pop(_COMPILED_ATTR, None)

    return undo


@dataclass(frozen=True, slots=True)
class _Layout:
    """Per block of the container, the segments ``(start, stop)`` containing it, outermost first."""

    paths: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True, slots=True)
class _Input:
    """Stands for the segment's ``i``-th saved input."""

    i: int


@dataclass(frozen=True, slots=True)
class _Output:
    """Stands for tensor ``leaf`` of what the segment's block ``offset`` returned."""

    offset: int
    leaf: int


@dataclass(eq=False, slots=True)
class _BlockRun:
    """What one forward of a block noted, replayed by every recompute of it."""

    rng: _RngState | None  # None: the generators were where the block before left them
    replay: Any  # () -> context manager (memfit.apply.state._note_and_replay)


@dataclass(eq=False, slots=True)
class _Call:
    block: nn.Module
    index: int
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # their leaves, tensors as _Input / _Output or kept
    run: _BlockRun


@dataclass(eq=False, slots=True)
class _Record:
    """What a segment's recompute needs (held by torch's frame, which holds no reference back)."""

    container: nn.Module
    start: int
    stop: int
    device_type: str
    autocast: tuple[dict[str, Any], dict[str, Any]]
    rng: _RngState  # at the segment's start
    calls: list[_Call] = field(default_factory=list)
    last_use: dict[int, int] = field(default_factory=dict)  # block offset -> last call taking its output


@dataclass(eq=False, slots=True)
class _Frame:
    """A segment whose forward is running."""

    record: _Record
    ckpt: _CheckpointFrame
    inputs: dict[int, tuple[Any, int]]  # id -> (weak ref, saved index) of the first block's tensors
    outputs: dict[int, tuple[Any, int, int]] = field(default_factory=dict)  # id -> (weak ref, offset, leaf)
    output_fns: set[int] = field(default_factory=set)  # ids of the outputs' autograd nodes

    @property
    def span(self) -> tuple[int, int]:
        return (self.record.start, self.record.stop)


@dataclass(eq=False, slots=True)
class _Run:
    inside: tuple[int, int] | None  # the segment being recomputed (None: the model's forward)
    open: list[_Frame] = field(default_factory=list)  # outermost first
    last_rng: _RngState | None = None  # the generators after the last block (the forward's)


def _inner_forward(block: nn.Module) -> Any:
    inner = block.__dict__.get(_INNER_ATTR)
    return inner if inner is not None else functools.partial(type(block).forward, block)


def _segment_block_forward(container: nn.Module, k: int, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    run = container.__dict__.get(_RUN_ATTR)
    if run is None and not torch.is_grad_enabled():  # nothing will be saved: run as is
        return _inner_forward(block)(*args, **kwargs)
    if run is None and torch.compiler.is_compiling():  # NOTE [ Compiled segments ]
        args, kwargs = _without_cache(block, args, kwargs)
        # Read from the block, not the partial's k: dynamo makes an int argument that changes
        # between calls of one frame symbolic, and a context_fn must be a partial of constants.
        unit = getattr(block, _UNIT_ATTR)
        if unit is None:  # recomputed on its own: the engine's wrapper checkpoints it as one region
            return _inner_forward(block)(*args, **kwargs)
        start, stop, i = unit  # the innermost segment: one region of the compiler's partitioner
        context_fn = functools.partial(compiled_segment_contexts, start, stop, i)
        return checkpoint(_inner_forward(block), *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    if torch.compiler.is_compiling() or _in_compiled_call():  # NOTE [ Compiled segments ]: run eagerly there
        return _eager_segment_block_uncompiled()(container, k, block, args, kwargs, True)
    return _eager_segment_block(container, k, block, args, kwargs)


def _eager_segment_block(
    container: nn.Module,
    k: int,
    block: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_compiled_call: bool = False,
) -> Any:
    d = container.__dict__
    run = d.get(_RUN_ATTR)
    if run is None and in_compiled_call and any(a < k for a, _ in d[_LAYOUT_ATTR].paths[k]):
        # The segment's first blocks ran compiled, as one region of the compiler: this one is recomputed
        # alone, as the engine recomputes a block (NOTE [ Compiled segments ]).
        args, kwargs = _without_cache(block, args, kwargs)
        with _refuse_changed_state((block,), args, kwargs):
            context_fn = functools.partial(_buffer_contexts, (block,), (args, kwargs))
            # Generator states kept by the context, as the engine's (NOTE [ Generator states are counted ]).
            return checkpoint(
                _inner_forward(block),
                *args,
                use_reentrant=False,
                preserve_rng_state=False,
                context_fn=context_fn,
                **kwargs,
            )
    if run is None:
        run = d[_RUN_ATTR] = _Run(inside=None)
    try:
        out = _run_block(container, k, block, run, args, kwargs, None)
    except BaseException:
        d.pop(_RUN_ATTR, None)
        raise
    if not run.open:
        d.pop(_RUN_ATTR, None)
    return out


def _in_compiled_call() -> bool:
    """True in eager code inside a ``torch.compile``'d call (dynamo left this frame to run eagerly,
    or runs only what it compiled already, past its recompile limit): functions called from here
    may run compiled in the forward, and not in the recompute."""
    return get_eval_frame_callback() is not None  # False: dynamo's run-only mode (cached graphs only)


@functools.cache
def _eager_segment_block_uncompiled() -> Callable[..., Any]:
    # Built on first use: torch.compiler.disable imports dynamo (seconds), which eager runs never need.
    return torch.compiler.disable(_eager_segment_block, recursive=True)


def _run_block(
    container: nn.Module,
    k: int,
    block: nn.Module,
    run: _Run,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    replay: _BlockRun | None,
) -> Any:
    """Run block ``k`` inside its segments: in the forward (``replay`` None) or in a recompute."""
    path = container.__dict__[_LAYOUT_ATTR].paths[k]
    if run.inside is not None:  # a recompute runs the segments inside the one recomputed
        a, b = run.inside
        path = tuple(s for s in path if a <= s[0] and s[1] <= b and s != run.inside)
    going_on = tuple(s for s in path if s[0] < k)
    if tuple(f.span for f in run.open) != going_on or any(f.record.start + len(f.record.calls) != k for f in run.open):
        _refuse_order(container, k, block, run, going_on)
    forward = replay is None
    if forward:  # decided once: the recompute runs with the arguments recorded here (NOTE [ Compiled segments ])
        args, kwargs = _without_cache(block, args, kwargs, compiled=_COMPILED_ATTR in block.__dict__)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    starts = path[len(going_on) :]  # the segments this block starts, outermost first
    rng = _RngState.now(tensors) if forward or starts else None
    for span in starts:
        run.open.append(_open_frame(container, span, tensors, rng, run.open[-1] if run.open else None))
    if forward:
        assert rng is not None
        note, replay_factory = _note_and_replay((block,), (args, kwargs))
        # One generator state per segment, as torch's checkpoint keeps, and one more per block only
        # where the model's loop drew from them between blocks (LayerDrop): a CPU state is 5 KB.
        moved = run.last_rng is None or not rng.same(run.last_rng)
        block_run = _BlockRun(rng=rng if moved else None, replay=replay_factory)
        run.last_rng = None  # compared: not kept while the block runs (NOTE [ Generator states are counted ])
    else:
        block_run = replay
    for f in run.open:
        f.record.calls.append(
            _Call(block=block, index=k, spec=spec, leaves=_template(f, leaves, k, block), run=block_run)
        )
    inner = _inner_forward(block)
    if forward:
        with _refuse_changed_state((block,), args, kwargs), _checkpoint_hook(run.open[-1].ckpt), note:
            out = inner(*args, **kwargs)
        run.last_rng = _RngState.now(tensors)
    else:  # outside the inner segments the recomputation hook (torch's, on top) collects what is saved
        _gather_fsdp2_unit(block)
        with _checkpoint_hook(run.open[-1].ckpt) if run.open else contextlib.nullcontext():
            out = inner(*args, **kwargs)
    out_leaves = pytree.tree_leaves(out)
    for f in run.open:
        offset = k - f.record.start
        for i, x in enumerate(out_leaves):
            if isinstance(x, torch.Tensor):
                f.outputs[id(x)] = (weakref.ref(x), offset, i)
                if x.grad_fn is not None:
                    f.output_fns.add(id(x.grad_fn))
    while run.open and run.open[-1].record.stop == k + 1:
        run.open.pop().ckpt.forward_completed = True
    return out


def _gather_fsdp2_unit(block: nn.Module) -> None:
    """Gather a ``fully_shard``-ed block's parameters before its recompute (NOTE [ Segments under
    FSDP2 ]).

    NOTE [ Segments under FSDP2 ]
    A recompute calls the block's forward itself, not the module, so FSDP2's forward hooks (which
    gather the unit, as they do in a recompute by torch's checkpoint) do not run: only the segment's
    last block (its pre-backward) and the one FSDP2 prefetched before it are gathered. Each block is
    gathered here as FSDP2 would (``FSDPModule.unshard``, waited on); it stays gathered until its
    post-backward reshards it, as after a checkpoint's recompute. FSDP2's pre-forward hook also
    hands each block its input as a view (through the autograd function that registers its
    post-backward): the segment's record finds the block before's output behind it
    (:func:`_aliased`), else it would keep every inner block's input alive.
    """
    if is_fully_sharded(block):
        block.unshard()


def _open_frame(
    container: nn.Module, span: tuple[int, int], tensors: list[torch.Tensor], rng: _RngState, parent: _Frame | None
) -> _Frame:
    """Open a segment's frame at its first block, whose tensor arguments are ``tensors``."""
    device_type = _infer_device_type(*tensors)
    record = _Record(container=container, start=span[0], stop=span[1], device_type=device_type,
                     autocast=_get_autocast_kwargs(device_type), rng=rng)  # fmt: skip
    early_stop = torch_checkpoint._enable_checkpoint_early_stop
    ckpt = _CheckpointFrame(
        functools.partial(_recompute, record), True if early_stop is None else early_stop, None, _default_meta_extractor
    )
    # Rule 2 of torch's NOTE [ Nestable Checkpoint ]: an inner segment's inputs are saved by the outer.
    with _checkpoint_hook(parent.ckpt) if parent is not None else contextlib.nullcontext():
        if hasattr(ckpt, "save_inputs"):  # torch 2.13; torch 2.11's unpack hook reads a no-op function's saved tensors
            ckpt.save_inputs(*tensors)
        else:  # (its get_args drops the leading dummy)
            ckpt.input_saver = torch_checkpoint._NoopSaveInputs.apply(torch.empty((0,), requires_grad=True), *tensors)
    return _Frame(record=record, ckpt=ckpt, inputs={id(t): (weakref.ref(t), i) for i, t in enumerate(tensors)})


def _template(f: _Frame, leaves: list[Any], k: int, block: nn.Module) -> list[Any]:
    """Block ``k``'s argument leaves with tensors replaced by where the recompute finds them."""
    out: list[Any] = []
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        hit = f.inputs.get(id(x))
        if hit is not None and hit[0]() is x:
            out.append(_Input(hit[1]))
            continue
        alias = _aliased(x)
        got = f.outputs.get(id(x)) or (f.outputs.get(id(alias)) if alias is not None else None)
        if got is not None and (got[0]() is x or got[0]() is alias):
            out.append(_Output(got[1], got[2]))
            f.record.last_use[got[1]] = k - f.record.start
            continue
        if computed_between_blocks(x, f.output_fns):
            raise UnsupportedModelError(
                f"memfit.apply: block {k} ({type(block).__name__}) of a recomputed segment of blocks "
                f"{f.record.start}..{f.record.stop - 1} takes a tensor of shape {list(x.shape)} that the model's forward "
                "computed from an earlier block's output between the blocks (a residual `h = h + block(h)` in the "
                "model's loop); a segment recomputes only its blocks, so it would keep that tensor and save no memory. "
                "Use a plan without segments: `memfit plan` (its profile finds this), or policy 'all' or 'every:K'."
            )
        out.append(x)  # alive anyway: a mask, position embeddings, a tensor computed before the segment
    return out


def _aliased(x: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``x`` is a whole alias of (a view with its base's shape, strides and offset), or
    None. FSDP2's pre-forward hook hands a ``fully_shard``-ed block its inputs through an autograd
    function that returns them as such views: the block's input is then the block before's output
    (NOTE [ Segments under FSDP2 ]), not a tensor for the segment to keep."""
    b = x._base
    if b is None or x.shape != b.shape or x.stride() != b.stride() or x.storage_offset() != b.storage_offset():
        return None
    return b


def _refuse_order(
    container: nn.Module, k: int, block: nn.Module, run: _Run, going_on: tuple[tuple[int, int], ...]
) -> None:
    if run.open:
        f = run.open[-1]
        expected = f.record.start + len(f.record.calls)
        what = f"block {k} ran again" if k < expected else f"block {k} ran where block {expected} was due"
        seg = f.span
    else:
        seg = going_on[-1]
        what = f"block {k} ran before block {seg[0]}, the segment's first"
    run.open.clear()
    raise UnsupportedModelError(
        f"memfit.apply: the blocks of the recomputed segment {seg[0]}..{seg[1] - 1} of {type(container).__name__} "
        f"({type(block).__name__}) did not run once each, in order ({what}); a segment needs its blocks run one "
        "after another, once per forward (no block skipped, as LayerDrop does in training, or repeated). Use a plan "
        "without segments: `memfit plan`, or policy 'all' or 'every:K'."
    )


def _recompute(record: _Record, *inputs: torch.Tensor) -> None:
    """A segment's recompute (the ``recompute_fn`` of its torch frame): its blocks, one by one."""
    run = _Run(inside=(record.start, record.stop))
    outputs: dict[int, list[Any]] = {}
    devices = sorted(
        {d for c in record.calls if c.run.rng is not None for d in c.run.rng.devices} | set(record.rng.devices)
    )
    dev_autocast, cpu_autocast = record.autocast
    with contextlib.ExitStack() as stack:
        stack.enter_context(_forked_rng(devices, record.device_type))  # NOTE [ Generator states are counted ]
        if torch.amp.is_autocast_available(record.device_type):
            stack.enter_context(torch.amp.autocast(device_type=record.device_type, **dev_autocast))
        stack.enter_context(torch.amp.autocast("cpu", **cpu_autocast))
        for offset, call in enumerate(record.calls):
            leaves = [
                inputs[x.i] if isinstance(x, _Input) else outputs[x.offset][x.leaf] if isinstance(x, _Output) else x
                for x in call.leaves
            ]
            args, kwargs = pytree.tree_unflatten(leaves, call.spec)
            rng = record.rng if offset == 0 else call.run.rng
            if rng is not None:
                rng.restore(record.device_type)
            with call.run.replay():
                out = _run_block(record.container, call.index, call.block, run, args, kwargs, call.run)
            if offset in record.last_use:
                outputs[offset] = pytree.tree_leaves(out)
            for j in [j for j in outputs if record.last_use[j] <= offset]:
                del outputs[j]
