"""Chain discovery: the model's sequence of blocks that plans act on.

A *chain* is the list of blocks that a plan keeps or recomputes, in the order the forward runs them:
the children of an ``nn.Sequential``, or the ``nn.ModuleList`` of layers that a model iterates
(HF GPT-2 ``transformer.h``, Llama ``model.layers``, BERT/ViT ``encoder.layer``, a user's own list),
or the children of several such containers run one after another (ResNet stages, ConvNeXT stages'
blocks, an encoder's layers then a decoder's).

NOTE [ Chain discovery ]
A *block list* is an ``nn.ModuleList`` / ``nn.Sequential`` with two or more children, or a plain
module whose children are all blocks of one class (timm's RegNet stages ``s1`` .. ``s4``, blocks
``b1``, ``b2`` registered by name); plain modules count only where no ``nn.ModuleList`` /
``nn.Sequential`` holds blocks.
1. The *main* list ranks first by what its children are: *residual blocks* (each a module of
   modules holding a normalisation layer: transformer layers, ResNet blocks, a U-Net's
   conv-norm blocks), then *composite blocks* (modules of modules), then anything (a plain
   ``nn.Sequential`` of layers); then by parameters, children, and shallower. A U-Net's wide
   bottleneck, an ``nn.Sequential`` of convolutions and norms, holds more parameters than its
   encoder and decoder lists of blocks and used to be chosen (its leaf layers planned, 0.4 % saved);
   DPT's neck (fusion layers without a norm) held more parameters than its ViT backbone.
2. *Stages*: when every child of the main container keeps its parameters in its own child
   containers, and the largest of those holds one kind of block, the chain is those inner lists,
   one per stage (HF ResNet ``encoder.stages.K.layers``, HF ConvNeXT and timm ConvNeXt stages'
   blocks), provided they hold at least half of the main container's parameters and more blocks
   than it has stages. A stage may also hold parameters in plain submodules (Swin's patch merging,
   SegFormer's patch embedding and norm, run before or after the blocks and kept) when its blocks
   are residual blocks: each holds a normalisation layer. A decoder layer whose MoE experts sit in
   a list is not a stage, however many parameters the experts hold: experts do not normalise. Nor
   is a module holding a second list of composite blocks beside its largest one a stage (a
   diffusers U-Net's up block: its ``resnets`` and ``attentions`` alternate, its ``upsamplers``
   follow): such a module is a block.
3. Otherwise *sibling lists* join the main one: lists with the same parent that share a
   block type with it (torchvision/timm ResNet ``layer1`` .. ``layer4``, a U-Net's ``encoder`` and
   ``decoder``), and containers with the same attribute name under a sibling of its parent (T5
   ``encoder.block`` and ``decoder.block``, BART ``model.encoder.layers`` and ``model.decoder.layers``).
   When the main list holds residual blocks, the rest of its *trunk* joins too, whatever the block
   class: the parent's other lists of residual blocks (Flux's ``transformer_blocks`` then
   ``single_transformer_blocks``; a U-Net's ``down_blocks`` and ``up_blocks``), a child of the parent
   that is a module holding such lists (a U-Net's ``mid_block``, run between those: its largest list, the
   ``resnets``, as its lists' blocks alternate), and the same under a sibling of the parent when one
   of those lists shares a block class with the chain's (a VAE's encoder's ``down_blocks`` and
   ``mid_block.resnets`` beside its decoder's, kin by their ``ResnetBlock2D``; a tower of other
   blocks stays out, as in rule 4). A residual block
   is one that holds a normalisation layer below it (a class *named* ``...NoLayerNormConvLayer``
   is not one). The trunk's lists run one after another in a U-Net and in Flux; where a loop
   alternates two lists' blocks instead, rule 5 keeps the larger list.
4. *Towers*: lists anywhere else in the model whose blocks share a class with the chain's, outside
   its lists and their blocks, join it (CLIP's text and vision encoders, each a list of
   ``CLIPEncoderLayer``).
5. Lists are ordered as the model registers them (``named_modules`` order).
   :func:`memfit.profiling.blocks.profile` runs the forward once to see the order: a discovered
   chain whose lists ran in another order (CLIP runs its vision tower first, registered second)
   is measured in the order they ran, a discovered tower that did not run is left out, and of
   discovered lists whose blocks alternate (a run of one list's blocks began before another's
   ended) the one with the most parameters stays; a chain the user named must run as named.

The chain's *coverage* (:func:`probe_chain`) is the share of the bytes autograd saves in one
forward that the chain's blocks save: what planning the chain can act on. Lists of composite
blocks outside the chain are named with their share, so that a tower left out is said.

Users can name the blocks themselves with :func:`set_blocks` when discovery picks the wrong lists.
Block names are dotted module paths (``resnet.encoder.stages.0.layers.1``), so plans and
``state_dict()`` keys mean the same modules with or without memfit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memfit.capture.discovery import block_lists, discover_paths, is_container, is_plain_list, kind, n_params
from memfit.errors import UnsupportedModelError

_BLOCKS_ATTR = "_memfit_blocks"
PATH_SEPARATOR = ","
"""Separates the containers of a multi-container chain in ``Chain.path`` and a plan's ``chain_path``."""


@dataclass(frozen=True, slots=True)
class Chain:
    """The blocks of a model, in the order its forward runs them.

    Attributes:
        paths: dotted paths of the containers from the model root ('' for the model itself), in
            execution order.
        containers: the ``nn.Sequential`` / ``nn.ModuleList`` holding the blocks, one per path.
        names: qualified module names of the blocks (as in ``model.named_modules()``).
        blocks: the block modules.
        spans: per container, the ``(start, stop)`` indices of its blocks in ``blocks``.
        discovered: whether discovery chose the containers.
    """

    paths: tuple[str, ...]
    containers: tuple[nn.Module, ...]
    names: tuple[str, ...]
    blocks: tuple[nn.Module, ...]
    spans: tuple[tuple[int, int], ...]
    discovered: bool = False
    """True when discovery chose the lists (NOTE [ Chain discovery ]); False when they were named
    (``blocks``, :func:`set_blocks`, a plan's ``chain_path``)."""

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def path(self) -> str:
        """The containers' paths joined by ``,`` (what plans record as ``chain_path``)."""
        return PATH_SEPARATOR.join(self.paths)

    @property
    def segment_spans(self) -> tuple[tuple[int, int], ...]:
        """Where segments (consecutive blocks recomputed as one unit) may lie: within each container,
        whoever runs its blocks (:mod:`memfit.apply.segments`); a segment never crosses containers.
        Whether the forward really chains the blocks (each taking the one before's output) is seen
        only in a step: :func:`memfit.profiling.blocks.profile` narrows these spans."""
        return self.spans

    @property
    def sequential(self) -> bool:
        """True when every container is a plain ``nn.Sequential`` (whose own forward runs its blocks)."""
        return all(is_plain_sequential(c) for c in self.containers)

    def reordered(self, order: Sequence[int]) -> Chain:
        """The chain with only the containers ``order`` names, in that order."""
        return _make_chain(
            tuple(self.paths[j] for j in order), tuple(self.containers[j] for j in order), discovered=self.discovered
        )

    def describe(self) -> str:
        """``'layers' (ModuleList)`` or ``'a' (Sequential), 'b' (Sequential)`` for messages."""
        return ", ".join(
            f"{p or 'the model'!r} ({type(c).__name__})" for p, c in zip(self.paths, self.containers, strict=True)
        )


def is_plain_sequential(container: nn.Module) -> bool:
    """An ``nn.Sequential`` whose forward is torch's (runs its children one after another)."""
    return isinstance(container, nn.Sequential) and type(container).forward is nn.Sequential.forward


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is FSDP2's (``fully_shard``-ed), without importing FSDP: importing it loads
    torch's DTensor (~1 s), and no module can be FSDP2's before something has imported it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def computed_between_blocks(x: torch.Tensor, output_nodes: set[int], *, depth: int = 4) -> bool:
    """Whether ``x`` is a tensor the model's own code computed from earlier blocks' outputs (a
    residual ``h = h + block(h)`` in its loop), rather than an output itself, a view, or a tensor
    computed before the blocks: it requires gradients, is not a view, and its autograd graph
    reaches, within ``depth`` nodes, one of ``output_nodes`` (ids of the outputs' ``grad_fn``).

    A segment (several blocks recomputed as one unit) can start anywhere but must not contain a
    block taking such a tensor: its recompute runs only the blocks, not the model's code between
    them (:mod:`memfit.apply.segments`)."""
    if not x.requires_grad or x._base is not None:
        return False
    seen: set[int] = set()
    level = [x.grad_fn]
    for _ in range(depth):
        nxt = []
        for fn in level:
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            if id(fn) in output_nodes:
                return True
            nxt.extend(n for n, _ in fn.next_functions)
        level = nxt
    return False


def set_blocks(model: nn.Module, *paths: str) -> None:
    """Name the containers whose children are the model's blocks (overrides discovery).

    Args:
        model: the model.
        *paths: dotted paths of ``nn.ModuleList`` or ``nn.Sequential`` containers inside ``model``
            (``''`` for the model itself when it is an ``nn.Sequential``), or of modules whose
            children are all blocks of one class (timm's RegNet stages), in the order the forward
            runs them; one path, or several when the blocks live in several containers (ResNet
            stages, an encoder then a decoder, two towers). One string may also hold several paths joined by
            ``,`` (a plan's ``chain_path``).

    Raises:
        UnsupportedModelError: no path given, a path that does not name such a container, the same
            container twice, or one container inside another's blocks.

    Example:
        >>> import torch.nn as nn, memfit
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> memfit.set_blocks(m, "")
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer1 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        ...         self.layer2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> memfit.set_blocks(Net(), "layer1", "layer2")
    """
    split = _split_paths(paths)
    _resolve_all(model, split)  # validates
    object.__setattr__(model, _BLOCKS_ATTR, split)


def accepts_blocks(model: nn.Module, paths: Sequence[str]) -> bool:
    """Whether :func:`set_blocks` accepts ``paths`` for ``model`` (memfit checks the calls it suggests)."""
    try:
        _resolve_all(model, _split_paths(paths))
    except UnsupportedModelError:
        return False
    return True


def discover_chain(model: nn.Module, blocks: str | Sequence[str] | None = None) -> Chain:
    """Find the model's chain of blocks (NOTE [ Chain discovery ]).

    The containers are, in order of precedence: ``blocks`` when given, the paths set with
    :func:`set_blocks`, else those discovery finds.

    Args:
        model: the model.
        blocks: optional dotted path of the container, or several paths (a sequence, or one string
            with paths joined by ``,``).

    Returns:
        The :class:`Chain`.

    Raises:
        UnsupportedModelError: no container found, or ``blocks`` names something else; the message
            says how to name the blocks.
    """
    chosen = blocks if blocks is not None else getattr(model, _BLOCKS_ATTR, None)
    if chosen is not None:
        paths = _split_paths((chosen,) if isinstance(chosen, str) else tuple(chosen))
        return _make_chain(paths, _resolve_all(model, paths))
    paths = discover_paths(model)
    return _make_chain(paths, tuple(model.get_submodule(p) if p else model for p in paths), discovered=True)


# --- discovery: memfit.capture.discovery ------------------------------------------------------


def left_out_lists(model: nn.Module, chain: Chain) -> list[str]:
    """Lists of composite blocks (NOTE [ Chain discovery ]) outside the chain's lists and blocks
    and not around them, outermost first (one not inside another named), by parameters."""
    inside = {id(m) for c in chain.containers for m in c.modules()}
    out: list[tuple[str, nn.Module]] = []
    for name, mod in block_lists(model):
        if id(mod) in inside or kind(mod) == 0:
            continue
        below = {id(m) for m in mod.modules()}
        if any(id(c) in below for c in chain.containers) or any(
            id(mod) in {id(m) for m in o.modules()} for _, o in out
        ):
            continue
        out.append((name, mod))
    return [n for n, _ in sorted(out, key=lambda nm: -n_params(nm[1]))]


# --- named containers ----------------------------------------------------------------------------


def _split_paths(paths: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for p in paths:
        if not isinstance(p, str):
            raise UnsupportedModelError(
                f"memfit.chain: block container paths are strings, got {type(p).__name__} {p!r}. "
                "Name containers as in model.named_modules(), e.g. memfit.set_blocks(model, 'layer1', 'layer2')."
            )
        out.extend(q.strip() for q in p.split(PATH_SEPARATOR))
    if not out:
        raise UnsupportedModelError(
            "memfit.chain: no block container named. Give one or more paths, e.g. "
            "memfit.set_blocks(model, 'encoder.layers') or memfit.set_blocks(model, 'layer1', 'layer2')."
        )
    return tuple(out)


def _resolve_all(model: nn.Module, paths: tuple[str, ...]) -> tuple[nn.Module, ...]:
    mods = tuple(_resolve(model, p) for p in paths)
    for i, (p, m) in enumerate(zip(paths, mods, strict=True)):
        for q, o in zip(paths[i + 1 :], mods[i + 1 :], strict=True):
            if m is o:
                raise UnsupportedModelError(
                    f"memfit.chain: block container {p!r} is named twice ({p!r}, {q!r}). Name each container once."
                )
            inner, outer = (
                (p, q)
                if any(x is m for x in o.modules())
                else (q, p)
                if any(x is o for x in m.modules())
                else (None, None)
            )
            if inner is not None:
                raise UnsupportedModelError(
                    f"memfit.chain: block container {inner!r} lies inside {outer!r}, whose children are blocks "
                    "too; a block cannot contain other blocks. Name either the outer container or the inner ones."
                )
    return mods


def _resolve(model: nn.Module, path: str) -> nn.Module:
    try:
        mod = model.get_submodule(path) if path else model
    except AttributeError:
        raise UnsupportedModelError(
            f"memfit.chain: {type(model).__name__} has no submodule {path!r}. Name a container from "
            f"model.named_modules(), e.g. one of: {', '.join(_containers(model)[:8]) or '(none)'}."
        ) from None
    if not (is_container(mod) or is_plain_list(mod)):
        raise UnsupportedModelError(
            f"memfit.chain: {path!r} is a {type(mod).__name__}, not an nn.ModuleList or nn.Sequential "
            f"of blocks, nor a module whose children are blocks of one class. Containers in this model: "
            f"{', '.join(_containers(model)[:8]) or '(none)'}."
        )
    return mod


def _containers(model: nn.Module) -> list[str]:
    return [
        repr(n) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) or is_plain_list(m)
    ]


def _make_chain(paths: tuple[str, ...], containers: tuple[nn.Module, ...], *, discovered: bool = False) -> Chain:
    names: list[str] = []
    blocks: list[nn.Module] = []
    spans: list[tuple[int, int]] = []
    for path, container in zip(paths, containers, strict=True):
        prefix = f"{path}." if path else ""
        start = len(blocks)
        for k, b in container.named_children():
            names.append(f"{prefix}{k}")
            blocks.append(b)
        spans.append((start, len(blocks)))
    return Chain(
        paths=paths, containers=containers, names=tuple(names), blocks=tuple(blocks), spans=tuple(spans),
        discovered=discovered,
    )  # fmt: skip
