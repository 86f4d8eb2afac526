"""The estimator's long-sequence set-ups: tiled blocks, host-held inputs and the chunked head on
fake tensors (what :func:`memfit.profiling.tiling.tiled_setups` and the profile's head check do on
real ones).

NOTE [ Estimated long-sequence options ]
A profile calibrates ``keep:tiles-N`` / ``recompute:tiles-N``, ``recompute:host`` and the
chunked head by running each as a step; :func:`memfit.estimation.estimate_stats` runs the same
calibration plans as fake-tensor steps, so a block's bytes are those of the tiled forward and
backward themselves (one tile's MLP intermediates alive, the recompute's extra forward counted
in the FLOPs), not a formula. What a fake step cannot do, and what the estimate does instead:

- *Which submodules are tiled* (NOTE [ Which modules are tiled ] in :mod:`memfit.apply.tiling`): a
  profile checks on real values that the module's output on part of the sequence is the same
  positions of its output on the whole. Fake tensors have no values, so :func:`find_tileable_fake`
  keeps the rule (a class named ``*MLP``, or the modules the user names) and the checks on
  shapes (one tensor ``(..., T, C)`` in, one tensor with its ``(..., T)`` out) and says in
  ``calibration.dropped_options["tiled:values"]`` that the value check was not run; ``memfit
  verify`` on the device compares the tiled plan's gradients with the untiled model's.
- *Host-held inputs* (NOTE [ Host-held inputs ] in :mod:`memfit.apply.host_inputs`): the plan runs
  as on the device, with the host copy of a fake tensor made shape-only: the input's
  device storage is released when the checkpoint saves it and a device copy is allocated when the
  previous block's recompute prefetches it, as the CUDA path does, and freed after its block's
  backward: after the backward the step's bytes are plain recompute's. Its seconds are the copies at
  the device's host link (``DeviceSpec.host_bytes_per_s``), less the compute they overlap
  (:func:`host_exposed_s`).
- *The chunked head* (NOTE [ Chunked head ] in :mod:`memfit.apply.head`): a profile compares the
  chunked loss with the plain one; on fake tensors only :func:`memfit.apply.head.head_unsupported_reason`
  (the model's structure: a causal LM without a logit transform) decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.apply.head import head_unsupported_reason
from memfit.apply.tiling import SEQ_DIM, TileCheck, default_tile_counts, untileable_shape
from memfit.capture.stats import TiledModules
from memfit.errors import PlanMismatchError
from memfit.estimation.devices import DeviceSpec
from memfit.plan.options import BASE_OPTIONS, BlockOption, host_options, option_plan, tiled_options
from memfit.plan.policies import policy_plan
from memfit.plan.types import Plan
from memfit.workload import Workload

__all__ = ["VALUES_UNCHECKED", "LongSetups", "find_tileable_fake", "host_exposed_s", "long_setups"]

VALUES_UNCHECKED = (
    "not checked on values (fake tensors have none): tiled by the rule (class *MLP, or named) and its shapes; "
    "`memfit verify` on the device compares the tiled plan's gradients with the untiled model's"
)


def find_tileable_fake(
    blocks: Sequence[nn.Module],
    block_names: Sequence[str],
    run: Callable[[], Any],
    *,
    tile_modules: Sequence[str] | None = None,
) -> TileCheck:
    """The position-wise submodules of each block by the rule and their shapes (NOTE [ Estimated
    long-sequence options ]), from one fake forward ``run`` (under ``no_grad``).

    Raises:
        PlanMismatchError: a module the user named is in no block, or its shapes are not ``(..., T, C)``.
    """
    named = tuple(tile_modules or ())
    cands: list[list[tuple[str, nn.Module]]] = []
    for block in blocks:
        found: list[tuple[str, nn.Module]] = []
        for name, sub in block.named_modules():
            if not name:
                continue
            hit = (name in named or type(sub).__name__ in named) if named else type(sub).__name__.endswith("MLP")
            if hit and not any(name.startswith(f"{n}.") for n, _ in found):  # the outermost only
                found.append((name, sub))
        cands.append(found)
    if named and not any(cands):
        raise PlanMismatchError(
            f"memfit.estimate: no block has a submodule named {', '.join(map(repr, named))} (by name within the "
            "block, or class name). Name a submodule of the blocks, or estimate without --tile-modules."
        )
    seen: dict[int, tuple[tuple[Any, ...], dict[str, Any], Any]] = {}

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        seen.setdefault(id(mod), (args, kwargs, out))

    handles = [sub.register_forward_hook(hook, with_kwargs=True) for found in cands for _, sub in found]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    modules, classes, seq, hidden, dropped = [], set(), 0, 0, {}
    for bname, found in zip(block_names, cands, strict=True):
        ok = []
        for name, sub in found:
            why = _not_tileable_shape(seen.get(id(sub)))
            if why is None:
                ok.append(name)
                classes.add(type(sub).__name__)
                x = seen[id(sub)][0][0]
                seq, hidden = max(seq, x.shape[SEQ_DIM]), max(hidden, x.shape[-1])
            elif named:
                raise PlanMismatchError(
                    f"memfit.estimate: {bname}.{name} ({type(sub).__name__}) cannot be tiled: {why}. Name a "
                    "position-wise submodule (an MLP) or estimate without --tile-modules."
                )
            else:
                dropped[f"{bname}.{name}"] = why
        modules.append(tuple(ok))
    return TileCheck(
        modules=tuple(modules), classes=tuple(sorted(classes)), seq_len=seq, hidden=hidden, dropped=dropped
    )


def _not_tileable_shape(got: tuple[tuple[Any, ...], dict[str, Any], Any] | None) -> str | None:
    """Why a call's shapes rule out tiling (the shape half of :mod:`memfit.apply.tiling`'s check)."""
    if got is None:
        return "it did not run in the model's forward"
    args, kwargs, y = got
    return untileable_shape(args, kwargs, y)


def host_exposed_s(input_bytes: int, fwd_s: float, bwd_s: float, host_bytes_per_s: float) -> float:
    """Seconds a host-held input adds to the step: its copy to the host overlaps the forward compute
    after the save and its copy back the block recomputed before it (the prefetch one block ahead),
    so each direction costs what it takes beyond that compute (the block's own ``fwd_s`` and ``bwd_s``
    stand for its neighbour's: a chain's blocks are alike).

    Example:
        >>> host_exposed_s(64 * 10**9, fwd_s=0.5, bwd_s=2.0, host_bytes_per_s=64e9)  # 1 s each way
        0.5
    """
    one_way = input_bytes / host_bytes_per_s
    return max(0.0, one_way - fwd_s) + max(0.0, one_way - bwd_s)


@dataclass
class LongSetups:
    """The tiled and host-held calibration plans an estimate runs, and whether the chunked head is."""

    plans: dict[str, Plan] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    record: TiledModules | None = None
    head: bool = False


def long_setups(
    model: torch.nn.Module,
    chain: Any,
    wl: Workload,
    batch: Any,
    mode: Any,
    options: tuple[str, ...],
    dev: DeviceSpec,
    *,
    heads: bool,
    tiling: bool,
    tile_modules: tuple[str, ...] | None,
    host_inputs: bool,
) -> LongSetups:
    """What :func:`memfit.profiling.tiling.tiled_setups` and the profile's head check give, on fake
    tensors (NOTE [ Estimated long-sequence options ] in :mod:`memfit.estimation.setups`): the
    options named in ``options``, and with ``tiling`` / ``host_inputs`` each one the profile would
    measure; none without ``recompute`` in ``options``."""
    out = LongSetups()
    if heads:
        why = head_unsupported_reason(model)
        out.head = why is None
        if why is not None:
            out.dropped["head:chunked"] = why
    named = [BlockOption.parse(m) for m in options if m not in BASE_OPTIONS and not m.startswith("selective:")]
    if "recompute" not in options:
        return out
    base = policy_plan(model, "none", chain=chain)
    tiles = None
    counts: tuple[int, ...] = ()
    if tiling or any(o.tiles is not None for o in named):
        with mode:
            tiles = find_tileable_fake(
                chain.blocks, chain.names, lambda: wl.loss_fn(model, batch), tile_modules=tile_modules
            )
        for name, why in tiles.dropped.items():
            out.dropped[f"tiled:{name}"] = why
        if not tiles.any:
            out.dropped["tiled"] = (
                "no block has a position-wise submodule memfit recognises (a class named *MLP); name yours with "
                "tile_modules= (--tile-modules NAME)"
            )
        else:
            out.dropped["tiled:values"] = VALUES_UNCHECKED
            counts = default_tile_counts(tiles.seq_len, tiles.hidden) if tiling else ()
            counts = tuple(sorted({*counts, *(o.tiles for o in named if o.tiles is not None)}))
            out.record = TiledModules(modules=sum(map(len, tiles.modules)), classes=tiles.classes, tile_counts=counts)
    wanted = [*(tiled_options(counts) if tiling and tiles is not None and tiles.any else ()), *named]
    if host_inputs or any(o.host for o in named):
        if dev.name == "cpu":
            out.dropped["recompute:host"] = (
                "the device is the CPU: holding checkpoint inputs in host memory saves nothing"
            )
        elif dev.host_bytes_per_s is None:
            out.dropped["recompute:host"] = f"{dev.name} has no host link rate in memfit's device table"
        else:
            wanted += [*host_options(counts)] if host_inputs else []
    for o in dict.fromkeys(wanted):
        if o.host and (dev.name == "cpu" or dev.host_bytes_per_s is None):
            continue
        if o.tiles is not None and (tiles is None or not tiles.any):
            continue
        out.plans[o.name] = option_plan(base, o, tiled=tiles.modules if tiles is not None else None)
    return out
