"""Coverage: what one forward shows of a chain (the order its lists run in, the share of the saved
bytes its blocks save).

Discovery is static (:mod:`memfit.capture.chain`); the forward tells what it cannot: the order a
model's towers run in (CLIP runs its vision tower first and registers it second), a tower that
does not run, and how much of what autograd saves the chain's blocks hold (NOTE [ Chain discovery ],
rule 5 and *coverage*). :func:`memfit.profiling.blocks.profile` runs :func:`chain_as_run` before
measuring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.capture.chain import Chain, left_out_lists

__all__ = [
    "LEFT_OUT_SHARE",
    "ChainProbe",
    "chain_as_run",
    "coverage_lines",
    "ordered_as_run",
    "ordered_by",
    "probe_chain",
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
    """

    order: tuple[int, ...]
    ran: tuple[bool, ...]
    saved_bytes: int
    chain_saved_bytes: int
    left_out_saved_bytes: dict[str, int]
    lists_as_run: tuple[str, ...] = ()

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

    def enter(key: str, j: int | None = None) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            depth[key] = depth.get(key, 0) + 1
            if j is not None and j not in order:
                order.append(j)
            path = chain.paths[j] if j is not None else key
            if path not in ran:
                ran.append(path)

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
    )


def ordered_as_run(chain: Chain, probe: ChainProbe) -> Chain:
    """A discovered chain with its lists in the order the forward ran them, without the towers
    that did not run (NOTE [ Chain discovery ], rule 5); a named chain, one that ran as found, or one
    none of whose lists ran, as it is."""
    return ordered_by(chain, probe.order)


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
) -> list[str]:
    """What ``memfit profile`` and ``memfit plan`` say of the chain: its share of the saved bytes,
    then one line per list of blocks left out that saves at least ``LEFT_OUT_SHARE`` of them, with
    the call that adds it (the lists in the order the forward ran them, ``lists_as_run``)."""
    if coverage is None:
        return []
    lines = [
        f"chain: {n_blocks} blocks in {chain_path or 'the model'!r} save {coverage:.0%} of the bytes autograd "
        "saves in the step's forward (what a plan can recompute)"
    ]
    paths = chain_path.split(",") if chain_path else [""]
    for path, share in sorted(left_out.items(), key=lambda kv: -kv[1]):
        if share >= LEFT_OUT_SHARE:
            both = [*paths, path]
            rank = {p: k for k, p in enumerate(lists_as_run)}
            named = ", ".join(repr(p) for p in sorted(both, key=lambda p: rank.get(p, len(rank))))
            lines.append(
                f"{path!r} is left out of the chain and its blocks save {share:.0%}: a plan keeps all of it. To plan it "
                f"too, name the lists in the order the forward runs them: memfit.set_blocks(model, {named})"
            )
    return lines


LEFT_OUT_SHARE = 0.05
"""A list of blocks outside the chain is named when its blocks save at least this share (5 %)."""
