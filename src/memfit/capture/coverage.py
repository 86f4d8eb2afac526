"""Coverage: what one forward shows of a chain (the order its lists run in, the share of the saved
bytes its blocks save).

Discovery is static (:mod:`memfit.capture.chain`); the forward tells what it cannot: the order a
model's towers run in (CLIP runs its vision tower first and registers it second), a tower that
does not run, and how much of what autograd saves the chain's blocks hold (NOTE [ Chain discovery ],
rule 5 and *coverage*). :func:`memfit.profiling.blocks.profile` runs :func:`chain_as_run` before
measuring.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.capture.chain import Chain, accepts_blocks, left_out_lists

__all__ = [
    "COVERAGE_WARN_SHARE",
    "ChainCoverageWarning",
    "LEFT_OUT_SHARE",
    "ChainProbe",
    "chain_as_run",
    "coverage_lines",
    "ordered_as_run",
    "ordered_by",
    "probe_chain",
    "suggest_block_lists",
    "warn_coverage",
]


def chain_as_run(model: nn.Module, chain: Chain, forward: Callable[[], Any]) -> tuple[Chain, ChainProbe]:
    """The chain as ``forward`` runs it (:func:`ordered_as_run`) and its probe.

    Args:
        model: the model (no plan applied).
        chain: its chain.
        forward: runs the forward and the loss, e.g. ``lambda: loss_fn(model, batch)``.

    Returns:
        The chain (``chain`` itself when it ran as found) and the :class:`ChainProbe` of it.
    """
    probe = probe_chain(model, chain, forward)
    ran = ordered_as_run(chain, probe)
    return (chain, probe) if ran is chain else (ran, probe_chain(model, ran, forward))


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainProbe:
    """What one forward showed of a chain (:func:`probe_chain`).

    Attributes:
        order: the chain's container indices in the order their first blocks ran (those that ran).
        ran: per container, whether any of its blocks ran.
        saved_bytes: distinct storages autograd saved in the forward (parameters and buffers
            excluded), bytes.
        chain_saved_bytes: the part of them saved inside the chain's blocks, bytes.
        left_out_saved_bytes: per list of blocks outside the chain (:func:`left_out_lists`), the
            bytes saved inside its blocks.
        lists_as_run: the chain's lists and those outside it, in the order their first blocks ran.
        runs: per list (the chain's and those outside it), the positions of its first and last block
            among the blocks of all of them in the order they started: lists whose runs overlap
            alternate their blocks.
    """

    order: tuple[int, ...]
    ran: tuple[bool, ...]
    saved_bytes: int
    chain_saved_bytes: int
    left_out_saved_bytes: dict[str, int]
    lists_as_run: tuple[str, ...] = ()
    runs: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def coverage(self) -> float | None:
        """The chain's share of the saved bytes (None: the forward saved nothing)."""
        return self.chain_saved_bytes / self.saved_bytes if self.saved_bytes else None

    def left_out_shares(self) -> dict[str, float]:
        """Per list outside the chain that saved something, its share of the saved bytes."""
        if not self.saved_bytes:
            return {}
        return {p: b / self.saved_bytes for p, b in self.left_out_saved_bytes.items() if b > 0}


def probe_chain(model: nn.Module, chain: Chain, forward: Callable[[], Any]) -> ChainProbe:
    """Run ``forward`` (the model's forward and loss, with gradients) once and see which of the
    chain's containers ran, in which order, and what share of the bytes autograd saves the chain's
    blocks save (its *coverage*; NOTE [ Chain discovery ]). The graph is dropped unused.

    Args:
        model: the model (no plan applied).
        chain: its chain.
        forward: runs the forward and the loss, e.g. ``lambda: loss_fn(model, batch)``.

    Returns:
        The :class:`ChainProbe`.
    """
    container_of = [j for j, (a, b) in enumerate(chain.spans) for _ in range(a, b)]
    others = {p: model.get_submodule(p) for p in left_out_lists(model, chain)}
    fixed = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    depth: dict[str, int] = {}  # "" for the chain, else the list's path -> blocks of it running now
    saved: dict[str, dict[int, int]] = {"": {}, **{p: {} for p in others}}
    total: dict[int, int] = {}
    order: list[int] = []
    handles: list[Any] = []

    ran: list[str] = []
    runs: dict[str, tuple[int, int]] = {}
    started = [0]  # blocks of every list started so far

    def enter(key: str, j: int | None = None) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            depth[key] = depth.get(key, 0) + 1
            if j is not None and j not in order:
                order.append(j)
            path = chain.paths[j] if j is not None else key
            if path not in ran:
                ran.append(path)
            runs[path] = (runs.get(path, (started[0], 0))[0], started[0])
            started[0] += 1

        return hook

    def leave(key: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            depth[key] -= 1

        return hook

    for i, blk in enumerate(chain.blocks):
        handles.append(blk.register_forward_pre_hook(enter("", container_of[i])))
        handles.append(blk.register_forward_hook(leave("")))
    for p, lst in others.items():
        for blk in lst.children():
            handles.append(blk.register_forward_pre_hook(enter(p)))
            handles.append(blk.register_forward_hook(leave(p)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        k = id(st)
        if k not in fixed:
            total[k] = st.nbytes()
            for key, d in depth.items():
                if d > 0:
                    saved[key][k] = total[k]
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        del out
    finally:
        for h in handles:
            h.remove()
    return ChainProbe(
        order=tuple(order),
        ran=tuple(j in order for j in range(len(chain.spans))),
        saved_bytes=sum(total.values()),
        chain_saved_bytes=sum(saved[""].values()),
        left_out_saved_bytes={p: sum(saved[p].values()) for p in others},
        lists_as_run=tuple(ran),
        runs=runs,
    )


def ordered_as_run(chain: Chain, probe: ChainProbe) -> Chain:
    """A discovered chain with its lists in the order the forward ran them, without the towers
    that did not run and without a list whose blocks alternated with a larger list's (NOTE [ Chain
    discovery ], rule 5); a named chain, one that ran as found, or one none of whose lists ran, as
    it is."""
    return ordered_by(chain, _apart(chain, probe))


def _apart(chain: Chain, probe: ChainProbe) -> tuple[int, ...]:
    """``probe.order`` without the containers whose blocks ran between the blocks of a container
    with more parameters (a trunk's lists that a loop alternates, joined by rule 3, cannot be one
    chain: the larger one stays); a named chain's order as it ran."""
    if not chain.discovered:
        return probe.order
    runs = {j: probe.runs[chain.paths[j]] for j in probe.order}
    size = {j: sum(p.numel() for p in chain.containers[j].parameters()) for j in probe.order}
    kept: set[int] = set()
    for j in sorted(probe.order, key=lambda j: -size[j]):
        (a0, a1) = runs[j]
        if all(a1 < runs[k][0] or runs[k][1] < a0 for k in kept):
            kept.add(j)
    return tuple(j for j in probe.order if j in kept)


def ordered_by(chain: Chain, order: tuple[int, ...]) -> Chain:
    """:func:`ordered_as_run` from the order the containers ran in (indices, those that ran)."""
    if not chain.discovered or not order or order == tuple(range(len(chain.paths))):
        return chain
    return chain.reordered(order)


def coverage_lines(
    chain_path: str,
    n_blocks: int,
    coverage: float | None,
    left_out: dict[str, float],
    lists_as_run: tuple[str, ...] = (),
    suggested: tuple[str, ...] = (),
) -> list[str]:
    """What ``memfit profile`` and ``memfit plan`` say of the chain: its share of the saved bytes,
    then one line per list of blocks left out that saves at least ``LEFT_OUT_SHARE`` of them, and
    the ``set_blocks`` call that plans them too (``suggested``: :func:`suggest_block_lists`), when
    there is one memfit accepts. ``lists_as_run`` is kept for the callers' signature."""
    if coverage is None:
        return []
    lines = [
        f"chain: {n_blocks} blocks in {chain_path or 'the model'!r} save {coverage:.0%} of the bytes autograd "
        "saves in the step's forward (what a plan can recompute)"
    ]
    for path, share in sorted(left_out.items(), key=lambda kv: -kv[1]):
        if share >= LEFT_OUT_SHARE:
            lines.append(f"{path!r} is left out of the chain and its blocks save {share:.0%}: a plan keeps all of it")
    if len(lines) > 1 and suggested:
        lines.append(f"to plan them too: {set_blocks_call(suggested)}")
    return lines


class ChainCoverageWarning(UserWarning):
    """The chain's blocks save less than ``COVERAGE_WARN_SHARE`` of what autograd saves: a plan acts on
    little of the step."""


def warn_coverage(chain: Chain, coverage: float | None, suggested: tuple[str, ...]) -> None:
    """Warn (:class:`ChainCoverageWarning`) when the chain covers less than ``COVERAGE_WARN_SHARE`` of
    the saved bytes, with the ``set_blocks`` call that covers more (``suggested``) when there is one."""
    if coverage is None or coverage >= COVERAGE_WARN_SHARE:
        return
    fix = (
        f"Name the lists a plan can cover too: {set_blocks_call(suggested)}."
        if suggested
        else "Name the model's block lists with memfit.set_blocks (the containers whose blocks the forward "
        "runs one after another)."
    )
    warnings.warn(
        f"memfit.profile: the chain's {len(chain)} blocks in {chain.path or 'the model'!r} save {coverage:.0%} of "
        f"the bytes autograd saves in the forward (below {COVERAGE_WARN_SHARE:.0%}): a plan keeps the rest, whatever "
        f"the budget. {fix}",
        ChainCoverageWarning,
        stacklevel=3,
    )


def set_blocks_call(paths: tuple[str, ...]) -> str:
    """The ``memfit.set_blocks`` call that names ``paths``, as a user types it."""
    return f"memfit.set_blocks(model, {', '.join(repr(p) for p in paths)})"


def suggest_block_lists(model: nn.Module, chain: Chain, probe: ChainProbe) -> tuple[str, ...]:
    """The lists a plan could cover: the chain's and those left out that save at least
    ``LEFT_OUT_SHARE``, in the order the forward runs them, as a call :func:`memfit.set_blocks`
    accepts and a profile runs; empty when there is none beyond the chain.

    Lists whose blocks alternate (a U-Net block's ``resnets`` and ``attentions``) cannot be a chain
    one after the other: they are replaced by the nearest container around both that ``set_blocks``
    accepts (``up_blocks``), and lists inside a named one are dropped.
    """
    shares = probe.left_out_shares()
    extra = [p for p, share in shares.items() if share >= LEFT_OUT_SHARE]
    if not extra:
        return ()
    runs = {p: probe.runs[p] for p in (*chain.paths, *extra) if p in probe.runs}
    merged = True
    while merged:
        merged = False
        for a in list(runs):
            for b in list(runs):
                if a == b or a not in runs or b not in runs:
                    continue
                (a0, a1), (b0, b1) = runs[a], runs[b]
                if a0 <= b1 and b0 <= a1:  # their blocks alternate: the container around both
                    outer = _around(model, a, b)
                    if outer is None:
                        return ()
                    span = (min(a0, b0), max(a1, b1))
                    for p in [p for p in runs if p == outer or _inside(p, outer)]:
                        span = (min(span[0], runs[p][0]), max(span[1], runs[p][1]))
                        del runs[p]
                    runs[outer] = span
                    merged = True
    paths = tuple(sorted(runs, key=lambda p: runs[p][0]))
    if not paths or set(paths) == set(chain.paths) or not accepts_blocks(model, paths):
        return ()
    return paths


def _inside(path: str, outer: str) -> bool:
    return outer == "" or path.startswith(outer + ".")


def _around(model: nn.Module, a: str, b: str) -> str | None:
    """The nearest module path around both ``a`` and ``b`` that :func:`memfit.set_blocks` accepts as
    a container of blocks the forward calls (not of lists: an ``nn.ModuleList`` is never called), or None."""
    common = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        common.append(x)
    while True:
        path = ".".join(common)
        if path not in (a, b) and accepts_blocks(model, (path,)) and not _holds_lists(model, path):
            return path
        if not common:
            return None
        common.pop()


def _holds_lists(model: nn.Module, path: str) -> bool:
    mod = model.get_submodule(path) if path else model
    return any(isinstance(k, nn.ModuleList | nn.ModuleDict) for k in mod.children())


LEFT_OUT_SHARE = 0.05
"""A list of blocks outside the chain is named when its blocks save at least this share (5 %)."""

COVERAGE_WARN_SHARE = 0.6
"""Below this share of the saved bytes in the chain's blocks, profiling warns (a plan acts on little
of the step): a diffusers U-Net's resnets lists alone, or Flux's first list alone."""
