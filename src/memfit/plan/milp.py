"""The per-block selective MILP: which op outputs of one block to cache within a byte allotment.

:func:`solve_block_milp` chooses, for one block and a byte allotment, which op outputs to save for
the least recompute time (NOTE [ Selective MILP ]) and writes the choice as a ``save:`` policy.

NOTE [ Selective MILP ]
With torch's selective checkpointing the recompute of a block re-runs *every* op of its forward
whose output was not cached (cached ones return their output), whatever backward needs. So the
inputs of a recomputed op are always there (recomputed or cached): choosing what to cache is a
0/1 knapsack over the block's op calls,

    maximise  sum_c t_c x_c    subject to   sum_c b_c x_c <= allotment,   x_c in {0, 1},

where ``t_c`` is the call's measured time (FLOPs break ties, scaled far below a nanosecond) and
``b_c`` the bytes of the storages it creates. The recompute time is the block's op time minus the
objective. Only calls that create storage that is not mutated later can be cached (views and
in-place ops cannot). It is solved exactly with ``scipy.optimize.milp`` (HiGHS).

What the model leaves out, and why that is safe or conservative:
- Caching an output that autograd does not save (a matmul whose output only feeds a residual add)
  costs its bytes although keeping the block whole would not: ``b_c`` counts every cached byte,
  needed or not, so the knapsack never under-counts memory.
- torch stops a recompute early once every saved tensor the backward needs exists; the ops after
  that point are counted as re-run although they are not (the model over-estimates time).
- The backward of a selective block rematerialises all the tensors autograd saves at once (cached
  or recomputed), as a recomputed block does: its backward peak is not part of the knapsack; the
  planner measures it in its calibration pass with every block in that option.
- Per-op dispatch overhead of the selective-checkpoint modes (tens of microseconds per op) is not
  in ``t_c``; the planner's calibration step times absorb it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from memfit.capture.opstats import BlockOps
from memfit.errors import MemfitError
from memfit.plan.savepolicy import policy_text
from memfit.plan.types import SAVE_PREFIX

__all__ = ["MilpChoice", "solve_block_milp"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MilpChoice:
    """A block's cached calls chosen by :func:`solve_block_milp`.

    Attributes:
        policy: the choice as a ``save:`` policy.
        calls: indices in ``BlockOps.calls`` of the cached calls.
        cached_bytes: bytes the cached outputs keep (<= the allotment).
        recompute_s: seconds of the ops re-run in backward (measured op times).
        saved_s: seconds the cache saves against recomputing the whole block.
    """

    policy: str
    calls: tuple[int, ...]
    cached_bytes: int
    recompute_s: float
    saved_s: float


def solve_block_milp(block: BlockOps, allotment_bytes: int) -> MilpChoice:
    """The op outputs of one block to cache within ``allotment_bytes`` for the least recompute time.

    See NOTE [ Selective MILP ]. Solved with ``scipy.optimize.milp`` (HiGHS), exact.

    Args:
        block: the block's captured op calls (:func:`memfit.capture.ops.capture_ops`).
        allotment_bytes: bytes the cached outputs may keep.

    Returns:
        The :class:`MilpChoice` (an empty ``save:`` policy when nothing fits).

    Raises:
        MemfitError: HiGHS failed (it does not on a feasible knapsack; the all-zero choice is
            always feasible).
    """
    cand = [j for j, c in enumerate(block.calls) if c.cacheable and c.out_bytes > 0]
    total_s = sum(c.time_s for c in block.calls)
    if not cand or allotment_bytes <= 0:
        return MilpChoice(policy=SAVE_PREFIX, calls=(), cached_bytes=0, recompute_s=total_s, saved_s=0.0)
    t = np.array([block.calls[j].time_s for j in cand], dtype=float)
    f = np.array([block.calls[j].flops for j in cand], dtype=float)
    b = np.array([block.calls[j].out_bytes for j in cand], dtype=float)
    # FLOPs as a tiebreak: at most 1e-9 s in all, below any measured difference.
    gain = t + (f / max(1.0, f.sum())) * 1e-9
    from scipy.optimize import Bounds, LinearConstraint, milp  # ~0.7 s of CPU: only a selective plan pays it

    with _quiet_stdout():  # HiGHS may print solver notes on fd 1, into a command's JSON
        res = milp(
            c=-gain,
            constraints=[LinearConstraint(b[None, :], -np.inf, float(allotment_bytes))],
            integrality=np.ones(len(cand)),
            bounds=Bounds(0, 1),
        )
    if res.x is None:
        raise MemfitError(f"memfit.selective: the MILP for {block.name} failed ({res.message}).")
    chosen = tuple(j for j, x in zip(cand, res.x, strict=True) if x > 0.5)
    saved_s = sum(block.calls[j].time_s for j in chosen)
    return MilpChoice(
        policy=policy_text(block, chosen),
        calls=chosen,
        cached_bytes=sum(block.calls[j].out_bytes for j in chosen),
        recompute_s=total_s - saved_s,
        saved_s=saved_s,
    )


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Send what C code writes to file descriptor 1 to /dev/null for a while."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real fd 1 (embedded interpreters)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
