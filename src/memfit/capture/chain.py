"""Chain discovery: the model's sequence of blocks that plans act on.

A *chain* is the list of blocks (children of one container) that a plan keeps or recomputes:
the children of an ``nn.Sequential``, or the ``nn.ModuleList`` of layers that a model iterates
(HF GPT-2 ``transformer.h``, Llama ``model.layers``, BERT/ViT ``encoder.layer``, a user's own list).

Users can name the blocks themselves with :func:`set_blocks` when discovery picks the wrong list.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from memfit.errors import UnsupportedModelError

_BLOCKS_ATTR = "_memfit_blocks"


@dataclass(frozen=True, slots=True)
class Chain:
    """The blocks of a model, in order.

    Attributes:
        path: dotted path of the container from the model root ('' when the model itself).
        container: the ``nn.Sequential`` or ``nn.ModuleList`` holding the blocks.
        names: qualified module names of the blocks (as in ``model.named_modules()``).
        blocks: the block modules.
        sequential: True when the container is a plain ``nn.Sequential`` that runs its children in
            order, so consecutive blocks can be grouped into one recomputed segment.
    """

    path: str
    container: nn.Module
    names: tuple[str, ...]
    blocks: tuple[nn.Module, ...]
    sequential: bool

    def __len__(self) -> int:
        return len(self.blocks)


def set_blocks(model: nn.Module, path: str) -> None:
    """Name the container whose children are the model's blocks (overrides discovery).

    Args:
        model: the model.
        path: dotted path of an ``nn.ModuleList`` or ``nn.Sequential`` inside ``model``
            (``''`` for the model itself when it is an ``nn.Sequential``).

    Raises:
        UnsupportedModelError: the path does not name such a container.

    Example:
        >>> import torch.nn as nn, memfit
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> memfit.set_blocks(m, "")
    """
    _resolve(model, path)  # validates
    object.__setattr__(model, _BLOCKS_ATTR, path)


def discover_chain(model: nn.Module, blocks: str | None = None) -> Chain:
    """Find the model's chain of blocks.

    The container is, in order of precedence: ``blocks`` when given, the path set with
    :func:`set_blocks`, else the ``nn.ModuleList`` / ``nn.Sequential`` with at least two children
    that holds the most parameters (ties: the one with more children, then the shallower).

    Args:
        model: the model.
        blocks: optional dotted path of the container.

    Returns:
        The :class:`Chain`.

    Raises:
        UnsupportedModelError: no container found, or ``blocks`` names something else; the message
            says how to name the blocks.
    """
    path = blocks if blocks is not None else getattr(model, _BLOCKS_ATTR, None)
    if path is not None:
        return _make_chain(model, path, _resolve(model, path))

    best: tuple[tuple[int, int, int], str, nn.Module] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential) or len(mod) < 2:
            continue
        n_params = sum(p.numel() for p in mod.parameters())
        key = (n_params, len(mod), -name.count("."))
        if best is None or key > best[0]:
            best = (key, name, mod)
    if best is None:
        raise UnsupportedModelError(
            f"memfit.chain: found no blocks in {type(model).__name__}: it has no nn.ModuleList or "
            "nn.Sequential with two or more children. Keep the blocks in an nn.ModuleList that forward "
            "iterates (or an nn.Sequential), or name the container: memfit.set_blocks(model, 'encoder.layers')."
        )
    return _make_chain(model, best[1], best[2])


def _resolve(model: nn.Module, path: str) -> nn.Module:
    try:
        mod = model.get_submodule(path) if path else model
    except AttributeError:
        raise UnsupportedModelError(
            f"memfit.chain: {type(model).__name__} has no submodule {path!r}. Name a container from "
            f"model.named_modules(), e.g. one of: {', '.join(_containers(model)[:8]) or '(none)'}."
        ) from None
    if not isinstance(mod, nn.ModuleList | nn.Sequential) or len(mod) < 1:
        raise UnsupportedModelError(
            f"memfit.chain: {path!r} is a {type(mod).__name__}, not an nn.ModuleList or nn.Sequential "
            f"of blocks. Containers in this model: {', '.join(_containers(model)[:8]) or '(none)'}."
        )
    return mod


def _containers(model: nn.Module) -> list[str]:
    return [repr(n) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential)]


def _make_chain(model: nn.Module, path: str, container: nn.Module) -> Chain:
    prefix = f"{path}." if path else ""
    names = tuple(f"{prefix}{k}" for k, _ in container.named_children())
    blocks = tuple(container.children())
    sequential = isinstance(container, nn.Sequential) and type(container).forward is nn.Sequential.forward
    return Chain(path=path, container=container, names=names, blocks=blocks, sequential=sequential)
