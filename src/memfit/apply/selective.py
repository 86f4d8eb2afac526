"""Selective (op-level) checkpointing: inside a block, save some op outputs and recompute the rest.

A block in action ``selective`` runs under non-reentrant ``torch.utils.checkpoint`` with torch's
``create_selective_checkpoint_contexts``: during the forward, each op's output is cached when the
block's *save policy* says ``MUST_SAVE``; during backward the block's forward runs again and every
op whose output was cached returns it instead of computing. The policy is composed with memfit's
buffer contexts (NOTE [ Buffers are updated once ] in :mod:`memfit.apply.engine`): both the forward
and the recompute context managers are entered, and the recompute runs the same ops, so autograd
sees the same saved tensors.

Save policies are written as text (a plan is JSON):

- a named preset whose name says what is saved (as JAX's ``dots_saveable``):
  ``save_matmuls`` (matmuls and convolutions), ``save_attention`` (fused attention kernels, on CPU
  ``aten._scaled_dot_product_flash_attention_for_cpu``, on CUDA flash, memory-efficient and cuDNN
  attention), ``save_matmuls_and_attention``;
- an explicit list ``save:OP[,OP...]`` of op overloads, each either every call of that op in the
  block (``aten.mm.default``) or one call (``aten.addmm.default@2``: the third ``addmm`` of the
  block's forward, counted as torch's selective checkpointing counts them).

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

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit.capture.ops import ATTENTION_OPS, MATMUL_OPS, BlockOps
from memfit.errors import MemfitError, SpecError
from memfit.plan.types import SAVE_PREFIX, SELECTIVE_PRESETS, Action, BlockDecision, Plan

__all__ = [
    "MilpChoice",
    "PRESET_OPS",
    "SavePolicy",
    "parse_save_policy",
    "resolve_op",
    "selective_plan",
    "solve_block_milp",
]

# What each preset saves: op overload packets (every overload of the packet is saved).
PRESET_OPS: dict[str, frozenset[str]] = {
    "save_matmuls": MATMUL_OPS,
    "save_attention": ATTENTION_OPS,
    "save_matmuls_and_attention": MATMUL_OPS | ATTENTION_OPS,
}

_ENTRY = re.compile(r"^(?P<op>[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*)(?:@(?P<index>\d+))?$")


@dataclass(frozen=True, slots=True)
class SavePolicy:
    """What a selective block saves, parsed from its policy text.

    Attributes:
        text: the policy as written in the plan.
        packets: op overload packets saved at every call (``aten.mm``; from presets).
        ops: op overloads saved at every call (``aten.mm.default``).
        calls: single calls saved: ``(overload name, index)``.
    """

    text: str
    packets: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()
    calls: frozenset[tuple[str, int]] = frozenset()
    _rules: dict[Any, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def saves(self, op: str, index: int) -> bool:
        """Whether the ``index``-th call of overload ``op`` (``"aten.mm.default"``) is saved."""
        return op in self.ops or (op, index) in self.calls or op.rsplit(".", 1)[0] in self.packets

    def _rule(self, op: Any) -> bool | frozenset[int]:
        """For one op overload: True (every call saved), False (none) or the saved call indices."""
        rule = self._rules.get(op)
        if rule is None:
            name = str(op)
            if name in self.ops or name.rsplit(".", 1)[0] in self.packets:
                rule = True
            else:
                idx = frozenset(k for o, k in self.calls if o == name)
                rule = idx if idx else False
            self._rules[op] = rule
        return rule

    def policy_fn(self) -> Callable[..., CheckpointPolicy]:
        """A fresh policy for ``create_selective_checkpoint_contexts`` (one per forward: it counts
        calls per op, as torch's cache does). It runs for every op of the block's forward, so the
        decision per op overload is looked up once and cached."""
        counts: dict[Any, int] = {}
        save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

        def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
            rule = self._rule(op)
            if rule is True:
                return save
            if rule is False:
                return recompute
            k = counts.get(op, 0)
            counts[op] = k + 1
            return save if k in rule else recompute

        return policy

    def __deepcopy__(self, memo: dict) -> SavePolicy:  # immutable: a copied model shares it
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # pickled without the op lookups (op overloads do not pickle)
        return (SavePolicy, (self.text, self.packets, self.ops, self.calls))


def resolve_op(name: str) -> Any:
    """The op overload named ``namespace.op.overload`` (``"aten.addmm.default"``).

    Raises:
        SpecError: no such op in this torch.
    """
    try:
        ns, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (ValueError, AttributeError, RuntimeError):
        raise SpecError(
            f"memfit.selective: {name!r} is not an op overload of this torch ({torch.__version__}). "
            "Name ops as namespace.op.overload, e.g. aten.addmm.default (see `memfit explain` for "
            "the ops a block runs)."
        ) from None


@functools.lru_cache(maxsize=256)
def parse_save_policy(text: str) -> SavePolicy:
    """Parse a selective policy: a preset name or ``save:OP[@K],...``.

    Raises:
        SpecError: unknown preset, malformed entry, or an op this torch does not have.
    """
    t = text.strip()
    if t in PRESET_OPS:
        return SavePolicy(text=t, packets=PRESET_OPS[t])
    if not t.startswith(SAVE_PREFIX):
        raise SpecError(
            f"memfit.selective: unknown selective policy {text!r}. Use a preset "
            f"({', '.join(SELECTIVE_PRESETS)}) or an op list such as "
            "'save:aten.addmm.default,aten.bmm.default@0'."
        )
    ops: set[str] = set()
    calls: set[tuple[str, int]] = set()
    body = t[len(SAVE_PREFIX) :]
    for entry in filter(None, (e.strip() for e in body.split(","))):
        m = _ENTRY.match(entry)
        if m is None:
            raise SpecError(
                f"memfit.selective: {entry!r} in policy {text!r} is not 'namespace.op.overload' or "
                "'namespace.op.overload@K', e.g. aten.addmm.default@2."
            )
        resolve_op(m["op"])
        if m["index"] is None:
            ops.add(m["op"])
        else:
            calls.add((m["op"], int(m["index"])))
    return SavePolicy(text=t, ops=frozenset(ops), calls=frozenset(calls))


def selective_contexts(
    block: nn.Module, policy: SavePolicy, buffer_contexts: Callable[[Sequence[nn.Module]], tuple[Any, Any]]
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for a selective block: torch's selective-checkpoint contexts, each inside
    memfit's buffer contexts (forward: note mutated buffers; recompute: restore them)."""
    fwd_sac, rec_sac = create_selective_checkpoint_contexts(policy.policy_fn())
    fwd_buf, rec_buf = buffer_contexts((block,))
    # The buffer contexts go outside: their snapshot and restore copies must not run under the
    # selective-checkpoint modes (the recompute's mode would look them up in its cache).
    return _both(fwd_buf, fwd_sac), _both(rec_buf, rec_sac)


def compiled_selective_contexts(policy_text: str) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for a selective block under ``torch.compile``: torch's selective-checkpoint
    contexts alone (NOTE [ Compiled plans ] in :mod:`memfit.apply.engine`).

    torch.compile calls it while tracing, to tag which ops of the checkpointed region the partitioner
    saves; it takes the policy as text because torch.compile accepts a ``context_fn`` only as a
    function or a ``functools.partial`` of constants.
    """
    return create_selective_checkpoint_contexts(_parsed(policy_text).policy_fn())


@functools.lru_cache(maxsize=64)
def _parsed(policy_text: str) -> SavePolicy:
    return parse_save_policy(policy_text)


@contextmanager
def _both(a: AbstractContextManager, b: AbstractContextManager) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(a)
        stack.enter_context(b)
        yield


# --- the per-block MILP ---------------------------------------------------------------------


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
    from scipy.optimize import Bounds, LinearConstraint, milp

    cand = [j for j, c in enumerate(block.calls) if c.cacheable and c.out_bytes > 0]
    total_s = sum(c.time_s for c in block.calls)
    if not cand or allotment_bytes <= 0:
        return MilpChoice(policy=SAVE_PREFIX, calls=(), cached_bytes=0, recompute_s=total_s, saved_s=0.0)
    t = np.array([block.calls[j].time_s for j in cand], dtype=float)
    f = np.array([block.calls[j].flops for j in cand], dtype=float)
    b = np.array([block.calls[j].out_bytes for j in cand], dtype=float)
    # FLOPs as a tiebreak: at most 1e-9 s in all, below any measured difference.
    gain = t + (f / max(1.0, f.sum())) * 1e-9
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
    import os
    import sys

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


def policy_text(block: BlockOps, chosen: Sequence[int]) -> str:
    """A ``save:`` policy caching exactly the calls ``chosen`` (indices in ``block.calls``): an op
    named alone when every one of its calls is chosen, else ``op@index`` per call."""
    by_op: dict[str, list[int]] = {}
    for c in block.calls:
        by_op.setdefault(c.op, []).append(c.index)
    picked: dict[str, list[int]] = {}
    for j in sorted(chosen):
        c = block.calls[j]
        picked.setdefault(c.op, []).append(c.index)
    parts = []
    for op, idx in picked.items():
        if sorted(idx) == sorted(by_op[op]):
            parts.append(op)
        else:
            parts.extend(f"{op}@{k}" for k in sorted(idx))
    return SAVE_PREFIX + ",".join(parts)


def cached_calls(block: BlockOps, policy: SavePolicy) -> tuple[int, ...]:
    """Indices of the block's calls whose outputs the policy caches (views included: torch caches
    whatever the policy names; caching a view keeps its base alive)."""
    return tuple(j for j, c in enumerate(block.calls) if policy.saves(c.op, c.index))


def uncacheable_calls(block: BlockOps, policy: SavePolicy) -> list[str]:
    """Calls the policy caches whose output the block mutates afterwards (torch raises on those
    during backward): their names; empty when the policy is safe for this block."""
    return [block.calls[j].name for j in cached_calls(block, policy) if block.calls[j].out_bytes > 0 and not block.calls[j].cacheable]


def selective_plan(model: nn.Module, policy: str, *, chain: Any = None, batch: Any = None) -> Plan:
    """A plan with every block selective under one policy (a preset or a ``save:`` list).

    Raises:
        SpecError: the policy does not parse.
    """
    from memfit.capture.chain import discover_chain
    from memfit.plan.policies import make_fingerprint

    parse_save_policy(policy)
    chain = chain or discover_chain(model)
    return Plan(
        policy=f"selective:{policy}",
        chain_path=chain.path,
        blocks=tuple(BlockDecision(name=n, action=Action.SELECTIVE, policy=policy) for n in chain.names),
        fingerprint=make_fingerprint(model, chain, batch),
    )
