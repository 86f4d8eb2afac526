"""Segments under torch.compile: how each compile mode runs them, and the tagging that makes a
segment one recompute region of the compiler's partitioner when the whole model is compiled.

NOTE [ Compiled segments ]
A segment's frames and hooks (NOTE [ Segments over any block list ] in :mod:`memfit.apply.segments`)
are Python state dynamo cannot trace, and a segment's recompute must
run exactly what its forward ran (torch compares the saved tensors' count and metadata). So a
segment composes with ``torch.compile`` in one of two ways, by where the compiled region lies
(:func:`memfit.apply.compiled.compile_applied`):

- Per block (torchtitan's order). A block of a segment gets its own forward compiled (its inner
  forward, :func:`memfit.apply.segments.compile_segment_block`), not its module call: the segment's steps run eagerly
  around it, at the block boundaries, which are graph boundaries in this mode anyway. The compiled
  forward is an autograd function whose saved tensors go through the segment frame's hooks; the
  recompute calls the same compiled function (torch re-enters an explicitly compiled function even
  under the dynamo-disabled recompute), so it saves what the forward saved. Memory as in eager:
  only the segment's input is kept.
- Whole model. Dynamo traces the model's loop; each block of a segment calls torch's checkpoint
  with its forward (as a recomputed block does, NOTE [ Compiled plans ] in
  :mod:`memfit.apply.engine`), under a ``context_fn`` (:func:`compiled_segment_contexts`) that
  gives all blocks of its innermost segment the region id of that segment's first block. torch
  tags every op of a checkpointed region with that id, and AOTAutograd's partitioner forces a save
  only where a region feeds one with a higher id (``cleanup_recompute_tags``): inside a segment
  nothing is saved, and the compiled backward recomputes the segment from its input, holding its
  blocks' activations at once (a segment's unit, as in eager). The partitioner has one level of
  recompute, so nesting is flattened to what the backward holds: nested segments act as their
  innermost ones (the forward also keeps the inner segments' inputs, which eager keeps only while
  the outer one is recomputed), and a block the plan recomputes on its own inside a segment is its
  own region (the engine's checkpoint, as ``all``). Measured (hf:gpt2, 4 layers, width 64, batch
  64 x 16, float64, aot_eager; compiled peaks by the profiler, eager by the tracker): one segment
  of 4 layers 44.9 MiB whole, 38.9 per block, 49.8 eager; segments 0..3 over 0..1 and 2..3 26.2,
  24.0, 28.7; a segment of 4 recomputed layers 17.5 whole, as ``all`` compiled.
- Eager code inside a compiled call (dynamo ran a frame of the model's loop eagerly: a graph break
  in the model, or its recompile limit): functions called from there would be compiled in the
  forward and not in the recompute (dynamo's run-only mode past its recompile limit runs cached
  graphs), so the segment's blocks run uncompiled (``torch.compiler.disable``), forward and
  recompute alike; a block whose segment began in a compiled graph is recomputed alone there.

Checked in tests/test_compile.py (hf:gpt2 and hf:llama, both modes, float64 gradients equal to the
unmodified model, no graph break; the whole-model graph saves exactly the inner blocks' inputs less
than the same blocks recomputed one by one; per block, the compiled forwards run once more in
backward and the inner blocks' outputs are freed after the forward). What does not compose
(torch 2.13): a block whose compiled forward recompiles between its forward and its recompute
(guards on Python values a forward changes, such as a call counter) runs another graph, or eager
code, in the recompute: torch's ``CheckpointError`` (pytorch/pytorch#166926), per block; compile
the whole model or keep those blocks. A transformers key/value cache is such a value (its layers
list, which the recompute replays): per block, a block of a segment is called without the cache
(decided in the forward, its recompute runs with the same arguments; a warning says the returned
cache misses those layers), and whole, a traced recomputed block runs without it.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch._guards import TracingContext
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachingTorchDispatchMode,
    create_selective_checkpoint_contexts,
)

__all__ = ["compiled_segment_contexts"]


def compiled_segment_contexts(start: int, stop: int, k: int) -> tuple[Any, Any]:
    """``context_fn`` of block ``k`` of segment ``start..stop-1`` under ``torch.compile``
    (NOTE [ Compiled segments ]): torch's contexts for a plain checkpoint, every op tagged for
    recompute, with the region id of the segment's first block when the segment's blocks were traced
    one after another."""
    fwd, recompute = create_selective_checkpoint_contexts(_prefer_recompute)
    return _SegmentTagMode(fwd.policy_fn, fwd.storage, (start, stop), k), recompute


def _prefer_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


# The last block of each segment torch.compile tagged: span -> (the segment's region id, the block's
# index, the graph being traced). An entry lives while a graph with the segment is traced.
_TRACED: dict[tuple[int, int], tuple[int, int, Any]] = {}


class _SegmentTagMode(_CachingTorchDispatchMode):
    """torch's tagging mode for a checkpointed region, whose ``ac_graph_id`` (set by torch right after
    the ``context_fn`` returns, a fresh id per checkpoint call) becomes its segment's: the id of the
    segment's first block when the blocks before it in the segment were tagged in the same graph."""

    def __init__(self, policy_fn: Any, storage: Any, span: tuple[int, int], k: int) -> None:
        self._span, self._k, self._graph_id = span, k, None
        super().__init__(policy_fn, storage)

    @property
    def ac_graph_id(self) -> int | None:  # type: ignore[override]
        return self._graph_id

    @ac_graph_id.setter
    def ac_graph_id(self, value: int | None) -> None:
        self._graph_id = value
        if value is None:
            return
        start, stop = self._span
        tracing = TracingContext.try_get()
        last = _TRACED.pop(self._span, None)
        if self._k > start and last is not None and last[1] == self._k - 1 and last[2]() is tracing is not None:
            self._graph_id = last[0]
        if self._k < stop - 1 and tracing is not None:
            _TRACED[self._span] = (self._graph_id, self._k, weakref.ref(tracing))
