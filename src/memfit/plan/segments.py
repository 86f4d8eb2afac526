"""Segment trees: the nesting of a plan's segments over a chain's blocks.

A plan's segments (:class:`~memfit.plan.types.Segment`, consecutive blocks recomputed as one unit)
may nest. :func:`segment_tree` turns them into the tree that both the engine runs
(:mod:`memfit.apply.engine`) and the cost model walks (:func:`memfit.plan.costmodel.predict`).

Example:
    >>> from memfit.plan.types import Segment
    >>> segment_tree([Segment(start=0, stop=4), Segment(start=1, stop=3)], 0, 6)
    ((0, 4, (0, (1, 3, (1, 2)), 3)), 4, 5)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memfit.plan.types import Segment

__all__ = ["SegmentTree", "segment_tree"]

SegmentTree = tuple[Any, ...]  # items: int (block index) or (start, stop, SegmentTree)


def segment_tree(
    segments: Sequence[Segment], start: int, stop: int, *, inside_of: Segment | None = None
) -> SegmentTree:
    """Nest segments into a tree over blocks ``start .. stop-1`` (the children of ``inside_of``).

    Returns:
        The items in order: a block index, or ``(start, stop, subtree)`` for a segment.
    """
    inside = [s for s in segments if start <= s.start and s.stop <= stop and s != inside_of]
    top = [s for s in inside if not any(o is not s and o.start <= s.start and s.stop <= o.stop for o in inside)]
    top.sort(key=lambda s: s.start)
    items: list[Any] = []
    i = start
    for s in top:
        items.extend(range(i, s.start))
        items.append((s.start, s.stop, segment_tree(segments, s.start, s.stop, inside_of=s)))
        i = s.stop
    items.extend(range(i, stop))
    return tuple(items)
