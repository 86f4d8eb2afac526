"""Sequence tiling: run a block's position-wise submodules (its MLP) over tiles of the sequence.

A position-wise module's output at position ``t`` depends only on its input at ``t`` (an MLP, a
norm). Tiled, it runs under ``no_grad`` over ``tiles`` slices of the sequence in forward and keeps
only its input; in backward it runs again tile by tile with gradients on and backpropagates each
tile before the next, summing the parameters' gradients. Only one tile's intermediates are ever
alive (the MLP's ``(B, T, 4C)`` or ``(B, T, 3 * I)`` activations become ``(B, T / tiles, ...)``),
at the cost of one more forward of the module. This is Arctic Long Sequence Training's TiledMLP
(Bekman et al., arXiv 2506.13996, Sec. 3.2), as a block option the planner chooses per block with
keep or recompute (:class:`memfit.plan.types.BlockDecision` ``tiles``).

- :func:`find_tileable`: the position-wise submodules of each block, by a rule (below) and a
  numerical check on the block's real input.
- :func:`install_tiling` / :func:`remove_tiling`: put the tiled forward on those submodules and
  take it off (what :func:`memfit.apply.apply_plan` does for a tiled block).
- :func:`tiled_call`: the autograd function, usable on its own.

NOTE [ Which modules are tiled ]
A submodule is tiled when (1) its class name ends with ``MLP`` (transformers' ``LlamaMLP``,
``Qwen2MLP``, ``Qwen3MLP``, ``MistralMLP``, ``GPT2MLP``, ``GemmaMLP``, ``Phi3MLP``, ``GPTNeoXMLP``,
...; mixture-of-experts blocks are not: their routing is per token but their auxiliary state is
not) or the user names it (``tile_modules=("mlp",)`` / ``--tile-modules mlp``: a submodule name
within the block or a class name), and (2) it passes a numerical check on the input it receives
in the real model: run on the whole sequence and on the two halves of it, the halves' outputs put
together equal the whole's (within the dtype's rounding, dropout off for the check), it takes one
tensor ``(..., T, C)`` and returns one tensor of the same leading shape. Attention, convolutions
over time and a mean over the sequence fail (2): the second half sees another context. A module
the user names that fails is refused with the reason; one found by name that fails is left out
with the reason (``Stats.calibration.dropped_options``). Nothing is tiled by guess.

NOTE [ How many tiles ]
A profile or an estimate measures 4 tiles and ALST's ``ceil(T / C)`` (tiles as long as the model
is wide), the latter at most 64. Every tile is a call of the tiled modules, forward and backward,
so the step's op count grows with the tile count, and an estimate runs each op on fake tensors
on the CPU: a model 32 wide at 100,000 tokens would run 3,000 tiles per block. Past 64 tiles a
tile's intermediates (``T / 64`` rows of the MLP's width ``I``) are ``I / (64 C)`` of the block's
input, a sixteenth for the usual ``I = 4C``, so more tiles buy little memory. A count past 64
is still applied when a plan names it.

NOTE [ Tiled gradients ]
The tiled backward computes each tile's gradients exactly as the untiled backward computes the
whole sequence's, except that a parameter's gradient is the sum over tiles of per-tile sums over
positions, where the untiled matmul sums all positions in one reduction. The terms are the same;
their order differs, so the result differs by rounding: at most about ``tiles`` more additions of
partial sums, each rounded at the dtype's unit roundoff ``u`` (float32 ``6e-8``, bfloat16 ``4e-3``).
``memfit verify`` judges plans with tiled blocks at the tolerance of reordered sums
(:data:`memfit.verification.gradients.GRAD_RTOL_REORDERED`: float32 1e-4, bfloat16 5e-2, float64
1e-10), which bounds ``tiles * u`` with room for every tile count up to 1,000 in float32. The input's
gradient is computed per position and is exactly the untiled one's up to the matmul kernel's own
blocking.

Dropout inside a tiled module: each tile's forward notes the generators' states before it runs, and
its backward recompute restores them, so each tile's mask in backward is the one its forward drew
(bitwise). The masks are not those of the untiled module (which draws one mask over the whole
sequence): they are as random and as likely, but another draw, so ``memfit verify`` compares a
tiled plan with dropout off in both runs and says so.

Known limitations:
- The tiled module must take one tensor argument (extra non-tensor arguments are passed to every
  tile) and return one tensor; the sequence is the second-to-last dimension of its input.
- Parameter gradients are summed in the parameters' dtype (bfloat16 parameters: bfloat16 sums).
- Inside ``torch.compile`` the tiled module runs untiled (the Python loop over tiles is not traced;
  NOTE [ Compiled plans ] in :mod:`memfit.apply.engine`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.apply.state import _RngState, _torch_rng_replayed
from memfit.errors import PlanMismatchError

__all__ = [
    "TileCheck",
    "untileable_shape",
    "default_tile_counts",
    "find_tileable",
    "install_tiling",
    "is_tiled",
    "remove_tiling",
    "tiled_call",
]

_TILED_ATTR = "_memfit_tiles"  # on a tiled submodule: its tile count
_TILED_ORIG_ATTR = "_memfit_tiled_orig_forward"  # an instance-level forward that was there before
SEQ_DIM = -2  # the sequence dimension of a tiled module's input: (..., T, C)
DEFAULT_TILE_COUNT = 4
# ALST's count ceil(T / C) is capped here (NOTE [ How many tiles ]).
MAX_TILE_COUNT = 64


def tiled_call(fwd: Callable[..., torch.Tensor], x: torch.Tensor, tiles: int, params: Sequence[torch.Tensor]) -> Any:
    """``fwd(x)`` computed over ``tiles`` slices of ``x`` along :data:`SEQ_DIM`, keeping only ``x``
    for backward (NOTE [ Tiled gradients ]).

    Args:
        fwd: the position-wise function, ``(..., t, C) -> (..., t, C')``.
        x: its input, ``(..., T, C)``.
        tiles: the number of slices (``torch.tensor_split``: sizes differ by at most one).
        params: the tensors ``fwd`` uses that need gradients (a module's parameters).

    Returns:
        ``fwd(x)``, ``(..., T, C')``.
    """
    return _Tiled.apply(fwd, tiles, x, *params)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fwd: Callable[..., torch.Tensor], tiles: int, x: torch.Tensor, *params: torch.Tensor) -> Any:
        # Parameters are the Function's inputs, so that autograd routes their gradients (and DDP's
        # hooks fire as usual); they are alive anyway, so ctx holds them without saving them.
        ctx.fwd, ctx.tiles, ctx.params = fwd, tiles, params
        ctx.device_type = x.device.type
        ctx.autocast = _autocast_state(x.device.type)  # backward runs outside the forward's autocast
        ctx.rngs = []
        outs = []
        with torch.no_grad():
            for xs in torch.tensor_split(x, tiles, dim=SEQ_DIM):
                ctx.rngs.append(_RngState.now([xs]))  # NOTE [ Tiled gradients ]: dropout replays per tile
                outs.append(fwd(xs.contiguous()))  # a slice of (B, T, C) is strided: GPT-2's Conv1D views it
        ctx.save_for_backward(x)
        return torch.cat(outs, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:], strict=True) if need]
        grad_x = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        start = 0
        grad_tiles = torch.tensor_split(grad_out, ctx.tiles, dim=SEQ_DIM)
        for k, xs in enumerate(torch.tensor_split(x, ctx.tiles, dim=SEQ_DIM)):
            xi = xs.detach().contiguous().requires_grad_(want_x)
            with torch.enable_grad(), _torch_rng_replayed(ctx.rngs[k], ctx.device_type), _autocast(ctx.autocast):
                yi = ctx.fwd(xi)  # (..., t, C'): one tile's intermediates, freed below
            inputs = ([xi] if want_x else []) + wanted
            got = list(torch.autograd.grad(yi, inputs, grad_tiles[k], allow_unused=True))
            del yi
            if want_x:
                g = got.pop(0)
                grad_x.narrow(SEQ_DIM, start, xs.shape[SEQ_DIM]).copy_(g)
            for j, g in enumerate(got):
                if g is None:
                    continue
                if sums[j] is None:
                    sums[j] = g
                else:
                    sums[j].add_(g)  # NOTE [ Tiled gradients ]: the sum over tiles
            start += xs.shape[SEQ_DIM]
        ctx.rngs = None
        it = iter(sums)
        grads = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, grad_x, *grads)


def _autocast_state(device_type: str) -> tuple[tuple[str, bool, torch.dtype], ...]:
    """The autocast state a tile's recompute must run under: the device's and the CPU's (what
    torch's checkpoint restores in its recompute)."""
    kinds = dict.fromkeys((device_type, "cpu"))
    return tuple(
        (k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
        for k in kinds
        if torch.amp.is_autocast_available(k)
    )


def _autocast(state: tuple[tuple[str, bool, torch.dtype], ...]) -> ExitStack:
    stack = ExitStack()
    for device_type, enabled, dtype in state:
        stack.enter_context(torch.autocast(device_type=device_type, enabled=enabled, dtype=dtype))
    return stack


def default_tile_counts(seq_len: int, hidden: int) -> tuple[int, ...]:
    """The tile counts a profile measures for inputs ``(..., seq_len, hidden)``: 4, and ALST's
    ``ceil(seq_len / hidden)`` (tiles about as long as the model is wide, where a tile's MLP
    intermediates are no larger than the block's input) when that is more, at most
    :data:`MAX_TILE_COUNT` (NOTE [ How many tiles ]); at most ``seq_len``."""
    counts = {DEFAULT_TILE_COUNT, min(MAX_TILE_COUNT, math.ceil(seq_len / max(1, hidden)))}
    return tuple(sorted(c for c in counts if 2 <= c <= seq_len))


# --- installing ---------------------------------------------------------------------------------


def install_tiling(block: nn.Module, names: Sequence[str], tiles: int) -> None:
    """Run the submodules ``names`` of ``block`` (relative names, ``""`` for the block itself) over
    ``tiles`` tiles of the sequence until :func:`remove_tiling`.

    Raises:
        PlanMismatchError: a name is not a submodule of the block, or ``tiles`` is below 2.
    """
    if tiles < 2:
        raise PlanMismatchError(f"memfit.apply: {tiles} tiles; a tiled block needs 2 or more.")
    mods = []
    for name in names:
        try:
            mods.append(block.get_submodule(name))
        except AttributeError:
            raise PlanMismatchError(
                f"memfit.apply: the plan tiles submodule {name!r} of {type(block).__name__}, which has none by "
                "that name. Make a plan for this model (`memfit plan`)."
            ) from None
    for mod in mods:
        d = mod.__dict__
        if _TILED_ATTR in d:
            continue
        if "forward" in d:
            d[_TILED_ORIG_ATTR] = d["forward"]
        d[_TILED_ATTR] = tiles
        d["forward"] = functools.partial(_tiled_forward, mod)  # a partial pickles (NOTE [ Saving applied models ])


def remove_tiling(model: nn.Module) -> None:
    """Undo :func:`install_tiling` on every submodule of ``model``."""
    for mod in model.modules():
        d = mod.__dict__
        if d.pop(_TILED_ATTR, None) is not None:
            d.pop("forward", None)
            if _TILED_ORIG_ATTR in d:
                d["forward"] = d.pop(_TILED_ORIG_ATTR)


def is_tiled(module: nn.Module) -> int | None:
    """The tile count of a tiled submodule, None when it is not tiled."""
    return module.__dict__.get(_TILED_ATTR)


def _plain_forward(mod: nn.Module) -> Callable[..., Any]:
    orig = mod.__dict__.get(_TILED_ORIG_ATTR)
    return orig if orig is not None else functools.partial(type(mod).forward, mod)


def _tiled_forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = _plain_forward(mod)
    x = args[0] if args else None
    if (
        not torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or not isinstance(x, torch.Tensor)
        or x.dim() < 2
        or x.shape[SEQ_DIM] < 2
    ):
        return fwd(*args, **kwargs)
    rest = (args[1:], kwargs)
    if any(isinstance(t, torch.Tensor) for t in (*args[1:], *kwargs.values())):
        raise PlanMismatchError(
            f"memfit.apply: tiled {type(mod).__name__} was called with more than one tensor argument; a tiled "
            "module takes one (..., T, C) tensor (NOTE [ Which modules are tiled ]). Plan without tiling this "
            "module (tiling=False / --no-tiling)."
        )
    tiles = min(mod.__dict__[_TILED_ATTR], x.shape[SEQ_DIM])
    params = tuple(p for p in mod.parameters() if p.requires_grad)
    one = functools.partial(_call_tile, fwd, rest) if args[1:] or kwargs else fwd
    return tiled_call(one, x, tiles, params)


def _call_tile(fwd: Callable[..., Any], rest: tuple[tuple[Any, ...], dict[str, Any]], x: torch.Tensor) -> Any:
    return fwd(x, *rest[0], **rest[1])


# --- finding position-wise submodules (NOTE [ Which modules are tiled ]) -----------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TileCheck:
    """What :func:`find_tileable` found in a chain's blocks.

    Attributes:
        modules: per block, the relative names of its submodules to tile (empty: none).
        classes: the tiled submodules' class names, sorted.
        seq_len: the sequence length of their input (``T`` of ``(..., T, C)``), the largest seen.
        hidden: its width ``C``.
        dropped: a candidate's name (``block.sub``) -> why it is not tiled.
    """

    modules: tuple[tuple[str, ...], ...]
    classes: tuple[str, ...]
    seq_len: int
    hidden: int
    dropped: dict[str, str]

    @property
    def any(self) -> bool:
        return any(self.modules)


def find_tileable(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    block_names: Sequence[str],
    run: Callable[[], Any],
    *,
    tile_modules: Sequence[str] | None = None,
) -> TileCheck:
    """The position-wise submodules of each block (NOTE [ Which modules are tiled ]).

    Args:
        model: the model (its dropout is off while checking).
        blocks: the chain's blocks.
        block_names: their names (for messages).
        run: runs the model's forward once on a real batch (under ``no_grad``); the candidates'
            inputs are taken from it.
        tile_modules: names the user gives (a submodule name within a block, or a class name);
            None: the rule's candidates (class names ending with ``MLP``).

    Returns:
        A :class:`TileCheck`.

    Raises:
        PlanMismatchError: a module the user named is in no block, or is not position-wise.
    """
    named = tuple(tile_modules or ())
    cands = _candidates(blocks, named)
    inputs: dict[int, tuple[Any, dict[str, Any]]] = {}
    handles = []
    for found in cands:
        for _, sub in found:
            handles.append(sub.register_forward_pre_hook(_first_input(inputs, sub), with_kwargs=True))
    dropouts = _dropout_off(model)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            run()
            return _checked_candidates(block_names, cands, inputs, named=bool(named))
    finally:
        for h in handles:
            h.remove()
        for m, p in dropouts:
            m.p = p


def _candidates(blocks: Sequence[nn.Module], named: tuple[str, ...]) -> list[list[tuple[str, nn.Module]]]:
    """Per block, its outermost submodules the user ``named`` (by name within the block, or class
    name), else those whose class name ends with ``MLP``; a name in no block is refused."""
    cands: list[list[tuple[str, nn.Module]]] = []
    for block in blocks:
        found = []
        for name, sub in block.named_modules():
            if not name:
                continue
            if named:
                hit = name in named or type(sub).__name__ in named
            else:
                hit = type(sub).__name__.endswith("MLP")
            if hit and not any(name.startswith(f"{n}.") for n, _ in found):  # the outermost only
                found.append((name, sub))
        cands.append(found)
    if named and not any(cands):
        raise PlanMismatchError(
            f"memfit.plan: no block has a submodule named {', '.join(map(repr, named))} (by name within the "
            f"block, or class name); the first block's are {', '.join(n for n, _ in blocks[0].named_modules() if n)[:300]}."
        )
    return cands


def _checked_candidates(
    block_names: Sequence[str],
    cands: list[list[tuple[str, nn.Module]]],
    inputs: dict[int, tuple[Any, dict[str, Any]]],
    *,
    named: bool,
) -> TileCheck:
    """The candidates that are position-wise on the inputs they ran with (a module shared by blocks
    checked once); one the user ``named`` that is not is refused, the rule's are dropped with why."""
    dropped: dict[str, str] = {}
    modules, classes, seq, hidden = [], set(), 0, 0
    verdicts: dict[int, str | None] = {}
    for bname, found in zip(block_names, cands, strict=True):
        ok = []
        for name, sub in found:
            got = inputs.get(id(sub))
            if id(sub) not in verdicts:  # a module shared by blocks is checked once
                verdicts[id(sub)] = (
                    "it did not run in the model's forward" if got is None else _not_position_wise(sub, *got)
                )
            why = verdicts[id(sub)]
            if why is None:
                ok.append(name)
                classes.add(type(sub).__name__)
                x = got[0][0]
                seq, hidden = max(seq, x.shape[SEQ_DIM]), max(hidden, x.shape[-1])
            else:
                if named:
                    raise PlanMismatchError(
                        f"memfit.plan: {bname}.{name} ({type(sub).__name__}) cannot be tiled: {why} "
                        "(NOTE [ Which modules are tiled ] in memfit.apply.tiling). Name a position-wise "
                        "submodule (an MLP) or plan without --tile-modules."
                    )
                dropped[f"{bname}.{name}"] = why
        modules.append(tuple(ok))
    return TileCheck(
        modules=tuple(modules), classes=tuple(sorted(classes)), seq_len=seq, hidden=hidden, dropped=dropped
    )


def _first_input(store: dict[int, Any], sub: nn.Module) -> Callable[..., None]:
    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        store.setdefault(id(sub), (args, kwargs))

    return hook


def _dropout_off(model: nn.Module) -> list[tuple[nn.Module, float]]:
    changed = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p != 0:
            changed.append((m, m.p))
            m.p = 0.0
    return changed


_NO_OUTPUT = object()


def untileable_shape(args: tuple[Any, ...], kwargs: dict[str, Any], y: Any = _NO_OUTPUT) -> str | None:
    """Why a call's arguments (and, given, its output ``y``) rule out tiling along :data:`SEQ_DIM`
    by their shapes alone, or None: the shape half of :func:`_not_position_wise`'s check."""
    if not args or not isinstance(args[0], torch.Tensor):
        return "its first argument is not a tensor"
    if any(isinstance(t, torch.Tensor) for t in (*args[1:], *kwargs.values())):
        return "it takes more than one tensor argument"
    x = args[0]
    if x.dim() < 2 or x.shape[SEQ_DIM] < 4 or not x.is_floating_point():
        return f"its input {tuple(x.shape)} has no floating-point (..., T, C) layout with T of 4 or more"
    if y is not _NO_OUTPUT and (not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-1]):
        return "it does not return one tensor with its input's (..., T) shape"
    return None


def _not_position_wise(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``mod`` is not position-wise along :data:`SEQ_DIM` on this input, or None when it is."""
    if (why := untileable_shape(args, kwargs)) is not None:
        return why
    x = args[0]
    fwd = _plain_forward(mod)
    y = fwd(x, *args[1:], **kwargs)
    if (why := untileable_shape(args, kwargs, y)) is not None:
        return why
    k = x.shape[SEQ_DIM] // 3  # an uneven split: a module that mirrors or pools halves fails too
    halves = (x.narrow(SEQ_DIM, 0, k), x.narrow(SEQ_DIM, k, x.shape[SEQ_DIM] - k))
    parts = [fwd(h.contiguous(), *args[1:], **kwargs) for h in halves]
    joined = torch.cat(parts, dim=SEQ_DIM)
    scale = float(y.abs().max()) or 1.0
    err = float((joined - y).abs().max()) / scale
    tol = 100 * torch.finfo(y.dtype).eps  # kernels may block the two shapes differently
    if not err <= tol:
        return (
            f"its output on a part of the sequence differs from the same positions of its output on the whole "
            f"({err:.2g} relative, tolerance {tol:.0e}): it mixes positions"
        )
    return None
