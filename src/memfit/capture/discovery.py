"""The rules that find a model's block lists (NOTE [ Chain discovery ] in :mod:`memfit.capture.chain`).

:func:`discover_paths` returns the paths of the containers whose children are the chain's blocks;
:mod:`memfit.capture.chain` makes the :class:`~memfit.capture.chain.Chain` of them, and resolves the
paths a user names.
"""

from __future__ import annotations

import torch.nn as nn

from memfit.errors import UnsupportedModelError

__all__ = ["block_lists", "discover_paths", "is_container", "is_plain_list", "kind", "n_params"]

_STAGES_MIN_SHARE = 0.5  # the stages' block lists hold at least this share of the main container's


def is_container(mod: nn.Module, min_children: int = 1) -> bool:
    return isinstance(mod, nn.ModuleList | nn.Sequential) and len(mod) >= min_children


def is_plain_list(mod: nn.Module, min_children: int = 1) -> bool:
    """A plain module whose children are all blocks of one class, each a module of modules with
    parameters, and which holds no parameters of its own (timm's RegNet stage: ``b1``, ``b2``)."""
    if isinstance(mod, nn.ModuleList | nn.Sequential | nn.ModuleDict):
        return False
    kids = list(mod.children())
    return (
        len(kids) >= min_children
        and len({type(k) for k in kids}) == 1
        and next(mod.parameters(recurse=False), None) is None
        and all(_is_composite(k) for k in kids)
    )


def _is_composite(mod: nn.Module) -> bool:
    """A module of modules holding parameters (a block, not a layer)."""
    return next(mod.children(), None) is not None and next(mod.parameters(), None) is not None


def n_params(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters())


def kind(mod: nn.Module) -> int:
    """Rule 1's rank of a list by its children: 2 residual blocks (each holds a normalisation
    layer), 1 composite blocks, 0 anything else."""
    kids = [k for k in mod.children() if next(k.parameters(), None) is not None]
    if not kids or not all(_is_composite(k) for k in kids):
        return 0
    return 2 if all(any(_is_norm(m) for m in k.modules() if m is not k) for k in kids) else 1


def block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block lists of ``model``: its containers with two or more children, else its plain lists
    (NOTE [ Chain discovery ])."""
    found = [(n, m) for n, m in model.named_modules() if is_container(m, 2)]
    if any(kind(m) > 0 for _, m in found):
        return found
    return found + [(n, m) for n, m in model.named_modules() if is_plain_list(m, 2)]


def discover_paths(model: nn.Module) -> tuple[str, ...]:
    lists = block_lists(model)
    if not lists:
        raise UnsupportedModelError(_no_blocks_message(model))
    name, main = max(
        lists, key=lambda nm: (kind(nm[1]), n_params(nm[1]), len(list(nm[1].children())), -nm[0].count("."))
    )
    paths = _stage_lists(name, main) or _sibling_lists(model, name, main)
    paths += _towers(model, paths)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return tuple(sorted(paths, key=order.__getitem__))


def _no_blocks_message(model: nn.Module) -> str:
    """Why discovery found no blocks, and a fix; a ``set_blocks`` call only with paths it accepts."""
    single = next((n for n, m in model.named_modules() if is_container(m) and n_params(m) > 0), None)
    # The model's own modules that hold two or more submodules with parameters: where its blocks are.
    own = [
        n
        for n, m in model.named_modules()
        if n and sum(1 for k in m.children() if next(k.parameters(), None) is not None) >= 2
    ]
    own.sort(key=lambda n: -n_params(model.get_submodule(n)))
    where = f" Its modules with two or more parameterised children: {', '.join(own[:6])}." if own else ""
    if single is not None:
        fix = (
            f" Its container {single!r} holds one block: if the forward runs that block once, name it: "
            f"memfit.set_blocks(model, {single!r}); a block the forward runs several times (a layer shared across "
            "depth, as ALBERT's) cannot be planned, as memfit plans blocks that run once."
        )
    else:
        fix = (
            " Keep the blocks in an nn.ModuleList that forward iterates (or an nn.Sequential), then name it with "
            "memfit.set_blocks(model, PATH) if discovery does not find it."
        )
    return (
        f"memfit.chain: found no blocks in {type(model).__name__}: it has no nn.ModuleList or "
        f"nn.Sequential with two or more children, and no module whose children are blocks of one class.{where}{fix}"
    )


def _towers(model: nn.Module, paths: list[str]) -> list[str]:
    """Rule 4: lists elsewhere whose blocks share a class with the chain's (other towers)."""
    chain = [model.get_submodule(p) if p else model for p in paths]
    kinds = {type(b) for c in chain for b in c.children()}
    inside = {id(m) for c in chain for m in c.modules()}
    out: list[str] = []
    taken: set[int] = set()
    for name, mod in block_lists(model):
        if id(mod) in inside or id(mod) in taken or any(id(c) in {id(m) for m in mod.modules()} for c in chain):
            continue
        if kinds & {type(b) for b in mod.children()} and n_params(mod) > 0:
            out.append(name)
            taken.update(id(m) for m in mod.modules())
    return out


def _stage_lists(name: str, main: nn.Module) -> list[str] | None:
    """Rule 2: the block list inside each stage of ``main``, or None when ``main``'s children are
    not stages."""
    prefix = f"{name}." if name else ""
    out: list[str] = []
    n_blocks = 0
    inner_params = 0
    for key, stage in main.named_children():
        lists = [(n, m, n_params(m)) for n, m in stage.named_children() if is_container(m)]
        loose = [n for n, m in stage.named_children() if not is_container(m) and n_params(m) > 0]
        if not lists or next(stage.parameters(recurse=False), None) is not None:
            return None
        inner_name, inner, params = max(lists, key=lambda x: x[2])
        if len({type(b) for b in inner.children()}) != 1 or any(m is not inner and kind(m) > 0 for _, m, _ in lists):
            return None
        if loose and not all(any(_is_norm(m) for m in b.modules()) for b in inner.children()):
            return None
        out.append(f"{prefix}{key}.{inner_name}")
        n_blocks += len(inner)
        inner_params += params
    if n_blocks <= len(list(main.children())) or inner_params < _STAGES_MIN_SHARE * n_params(main):
        return None
    return out


def _is_norm(mod: nn.Module) -> bool:
    """A normalisation layer: torch's (LayerNorm, BatchNorm, GroupNorm, RMSNorm, ...) or a library's
    own (``LlamaRMSNorm``, ``T5LayerNorm``: by class name)."""
    return (
        isinstance(mod, nn.LayerNorm | nn.GroupNorm | nn.RMSNorm | nn.modules.batchnorm._NormBase)
        or "Norm" in type(mod).__name__
    )


def _sibling_lists(model: nn.Module, name: str, main: nn.Module) -> list[str]:
    """Rule 3: ``main`` and the containers run beside it: with the same parent, those sharing a block
    type with it and, when its blocks are residual blocks, the trunk's other lists of residual
    blocks (:func:`_trunk_lists`); under a sibling of its parent, the container of the same
    attribute name and, for residual blocks, that sibling's trunk lists when one of them shares a
    block type with the lists found so far (a tower of other blocks stays out)."""
    out = [name]
    if not name:
        return out
    parent_path, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    kinds = {type(b) for b in main.children()}
    residual = kind(main) == 2

    def join(*parts: str) -> str:
        return ".".join(p for p in parts if p)

    for key, mod in parent.named_children():
        if mod is main:
            continue
        if (
            (is_container(mod) or is_plain_list(mod))
            and n_params(mod) > 0
            and kinds & {type(b) for b in mod.children()}
        ):
            out.append(join(parent_path, key))
        elif residual:
            out.extend(join(parent_path, key, p) for p in _trunk_lists(mod, top=False))
    if parent_path:
        grand_path, _, parent_key = parent_path.rpartition(".")
        grand = model.get_submodule(grand_path) if grand_path else model
        for key, sib in grand.named_children():
            if key == parent_key:
                continue
            cousin = sib._modules.get(attr)
            if cousin is not None and is_container(cousin) and n_params(cousin) > 0:
                out.append(join(grand_path, key, attr))
            trunk = [join(grand_path, key, p) for p in _trunk_lists(sib, top=True)] if residual else []
            if _block_types(model, trunk) & _block_types(model, out):  # kin: a VAE's encoder beside its decoder
                out.extend(q for q in trunk if q not in out)
    return out


def _block_types(model: nn.Module, paths: list[str]) -> set[type]:
    return {type(b) for p in paths for b in (model.get_submodule(p) if p else model).children()}


def _trunk_lists(mod: nn.Module, *, top: bool) -> list[str]:
    """The lists of residual blocks a trunk's forward runs one after another (rule 3), as paths
    relative to ``mod``: ``mod`` itself when it is such a list; else, when ``top`` (``mod`` is a
    trunk: a U-Net's encoder, a decoder), such lists among its children and, for each other child,
    the lists it holds as a middle module; else (``mod`` is a middle module: a U-Net's middle block
    between its down and up lists) the largest list of residual blocks among its children. A middle
    module holds one list of them: its lists' blocks alternate (resnets and attentions), and the
    largest one is what a chain can hold."""
    if is_container(mod, 2):
        return [""] if kind(mod) == 2 else []
    if is_container(mod):
        return []
    if top:
        out: list[str] = []
        for key, kid in mod.named_children():
            out.extend(f"{key}.{p}" if p else key for p in _trunk_lists(kid, top=False))
        return out
    lists = [(key, kid) for key, kid in mod.named_children() if is_container(kid, 2) and kind(kid) == 2]
    return [max(lists, key=lambda kv: n_params(kv[1]))[0]] if lists else []
