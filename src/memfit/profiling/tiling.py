"""The tiled and host-held calibration set-ups of a profile (:func:`memfit.profiling.blocks.profile`).

- tiled ``keep`` and ``recompute`` (``keep:tiles-N``, ``recompute:tiles-N``): every block's
  position-wise submodules run over ``N`` tiles of the sequence (:mod:`memfit.apply.tiling`; which
  submodules: NOTE [ Which modules are tiled ]), at each tile count;
- ``recompute`` with the kept input in host memory (``recompute:host``, ``recompute:tiles-N:host``;
  :mod:`memfit.apply.host_inputs`), off the CPU only, with the copy bandwidth ``offload`` measures.

Each is a calibration plan measured like the others (NOTE [ Cost model ] in
:mod:`memfit.plan.costmodel`); :func:`tiled_rerun_s` is the op-level time estimate the measured step
scales.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.apply.offload import measure_bandwidth
from memfit.apply.tiling import TileCheck, default_tile_counts, find_tileable
from memfit.capture.chain import Chain
from memfit.capture.stats import TiledModules
from memfit.plan.options import BlockOption, host_options, option_plan, tiled_options
from memfit.plan.types import Option, Plan

__all__ = ["TiledRequest", "TiledSetups", "tiled_rerun_s", "tiled_setups"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TiledRequest:
    """What a profile is asked to measure besides its options (:func:`~memfit.profiling.blocks.profile`
    takes these as keywords; only when it calibrates ``recompute``, i.e. when it measures for planning).

    Attributes:
        tiling: measure ``keep`` and ``recompute`` with the blocks' position-wise submodules tiled over
            the sequence (found by NOTE [ Which modules are tiled ] in :mod:`memfit.apply.tiling`).
        tile_modules: the submodules to tile (names within a block, or class names); each must pass
            the position-wise check (else :class:`~memfit.errors.PlanMismatchError` says why). None:
            found by the rule.
        tile_counts: the tile counts to measure (each 2 or more); None:
            :func:`~memfit.apply.tiling.default_tile_counts` of the tiled modules' input.
        host_inputs: measure ``recompute`` (and each tiled ``recompute``) with its input held in host
            memory (:mod:`memfit.apply.host_inputs`); not on the CPU (``Stats.calibration.
            dropped_options["recompute:host"]`` says why).
    """

    tiling: bool = False
    tile_modules: tuple[str, ...] | None = None
    tile_counts: tuple[int, ...] | None = None
    host_inputs: bool = False


@dataclass(kw_only=True, slots=True)
class TiledSetups:
    """The set-ups :func:`tiled_setups` made.

    Attributes:
        plans: option name -> calibration plan.
        dropped: option name -> why it is not offered.
        tiles: what was found to tile (None: tiling was not asked for).
        record: the stats' record of it (``Stats.calibration.tiling``).
        bandwidth: ``(device_to_host, host_to_device)`` bytes per second, when host-held inputs
            are measured.
    """

    plans: dict[str, Plan] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    tiles: TileCheck | None = None
    record: TiledModules | None = None
    bandwidth: tuple[float, float] | None = None


def tiled_setups(
    model: nn.Module,
    chain: Chain,
    forward: Callable[[], Any],
    base: Plan,
    request: TiledRequest | None,
    options: Sequence[BlockOption],
    device: torch.device,
    say: Callable[[str], None],
) -> TiledSetups:
    """The tiled and host-held calibration plans (``base``: every block kept); none when the
    profile does not calibrate ``recompute`` (per-block stats only: nothing to plan).

    Args:
        model: the model.
        chain: its chain of blocks.
        forward: runs the model's forward (and loss) on the profile's batch.
        base: the plan that keeps every block.
        request: what to measure (None: nothing).
        options: the block options the profile calibrates.
        device: the profile's device (host-held inputs are not offered on the CPU).
        say: progress.

    Raises:
        PlanMismatchError: a module ``request.tile_modules`` names is in no block or is not
            position-wise.
    """
    out = TiledSetups()
    counts: tuple[int, ...] = ()
    if request is None or not any(o.kind is Option.RECOMPUTE for o in options):
        return out
    if request.tiling:
        say("finding position-wise submodules")
        out.tiles = tiles = find_tileable(model, chain.blocks, chain.names, forward, tile_modules=request.tile_modules)
        for name, why in tiles.dropped.items():
            out.dropped[f"tiled:{name}"] = why
        if not tiles.any:
            out.dropped["tiled"] = (
                "no block has a position-wise submodule memfit recognises (a class named *MLP that passes the "
                "check); name yours with tile_modules= (--tile-modules NAME)"
            )
        else:
            counts = tuple(sorted(set(request.tile_counts or default_tile_counts(tiles.seq_len, tiles.hidden))))
            for o in tiled_options(counts):
                out.plans[o.name] = option_plan(base, o, tiled=tiles.modules)
            out.record = TiledModules(modules=sum(map(len, tiles.modules)), classes=tiles.classes, tile_counts=counts)
    if request.host_inputs:
        if device.type == "cpu":
            out.dropped["recompute:host"] = (
                "the device is the CPU: holding checkpoint inputs in host memory saves nothing"
            )
        else:
            out.bandwidth = measure_bandwidth(device)
            for o in host_options(counts):
                out.plans[o.name] = option_plan(base, o, tiled=out.tiles.modules if out.tiles is not None else None)
    return out


def tiled_rerun_s(
    blocks: Sequence[nn.Module],
    tiles: TileCheck | None,
    option: BlockOption,
    fwd_s: Sequence[float],
    input_bytes: Sequence[int],
    bandwidth: tuple[float | None, float | None],
) -> list[float]:
    """Per block, the seconds a tiled or host-held option adds by estimate: a recompute's forward
    of the block (``fwd_s``); one more forward of the tiled submodules, priced at their share of the
    block's parameters (a position-wise module does one multiply-add per parameter per position);
    and for a held input (``input_bytes``) its copy both ways at ``bandwidth`` (NOTE [ Host-held
    inputs ] in :mod:`memfit.apply.host_inputs`). The cost model scales these by the measured step."""
    out = []
    for i, block in enumerate(blocks):
        t = fwd_s[i] if option.kind is Option.RECOMPUTE else 0.0
        if option.tiles is not None and tiles is not None and tiles.modules[i]:
            total = sum(p.numel() for p in block.parameters()) or 1
            tiled = sum(p.numel() for n in tiles.modules[i] for p in block.get_submodule(n).parameters())
            t += fwd_s[i] * tiled / total
        if option.host:
            d2h, h2d = bandwidth
            assert d2h and h2d, "host-held options are measured with the bandwidth"
            t += input_bytes[i] * (1.0 / d2h + 1.0 / h2d)
        out.append(t)
    return out
