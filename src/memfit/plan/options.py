"""Block options: what a block can do with its activations, and which set-ups a profile measures so
that the cost model can price each one (the profile's *calibration steps*: every block in one option).

The cost model (NOTE [ Cost model ] in :mod:`memfit.plan.costmodel`) prices a block in an option
from a step in which *every* block took that option. This module decides those options and builds
their set-ups as plans; :func:`memfit.profiling.blocks.profile` applies each one and measures it.

- :class:`BlockOption`: one option a block can take (``keep``, ``recompute``, ``offload``,
  ``selective:<policy>``, ``selective:milp-<pct>``; ``keep`` and ``recompute`` also tiled,
  ``keep:tiles-<N>`` and ``recompute:tiles-<N>``, and ``recompute`` with its input held on the host,
  ``recompute:host`` and ``recompute:tiles-<N>:host``), parsed from its name once; the name is its key
  in :attr:`memfit.capture.stats.BlockStats.options` and in JSON.
- :func:`tiled_options` / :func:`host_options`: the tiled and host-held variants a profile measures.
- :func:`requested_options`: the options a request names (``selective`` stands for every
  preset and MILP variant).
- :func:`selective_options`: from a block-level op capture, each selective option's save policy per
  block (the MILP's choice for a MILP variant, :mod:`memfit.plan.milp`) and the options left out
  (caching nothing, the same as another, or outputs the block mutates).
- :func:`option_plan`: the calibration plan of one option (every block in it).
- :func:`rerun_fraction`: the share of a block's op time a selective policy re-runs in backward
  (the op-level time estimate the cost model scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memfit.capture.opstats import BlockOps, OpStats
from memfit.errors import SpecError
from memfit.plan.milp import solve_block_milp
from memfit.plan.savepolicy import cached_calls, parse_save_policy, uncacheable_calls
from memfit.plan.types import SAVE_PRESETS, SELECTIVE_PRESETS, BlockDecision, Option, Plan

__all__ = [
    "HOST",
    "DEFAULT_OPTIONS",
    "MILP_FRACTIONS",
    "BASE_OPTIONS",
    "BlockOption",
    "option_plan",
    "requested_options",
    "rerun_fraction",
    "selective_options",
    "host_options",
    "tiled_options",
]

BASE_OPTIONS = ("keep", "recompute")
"""The base options: every block kept, every block recomputed."""
DEFAULT_OPTIONS = ("keep", "recompute", "selective", "offload")
"""What :func:`memfit.profiling.blocks.profile` calibrates by default. ``selective`` stands for the
selective options (presets and MILP variants, see :func:`selective_options`); ``offload`` is left
out on the CPU, where moving activations to host memory saves nothing."""
MILP_FRACTIONS = (0.25, 0.5, 0.75)
"""Allotments of the selective MILP variants, as fractions of each block's saved bytes."""

_MILP = "milp-"
_TILES = "tiles-"
HOST = "host"
"""The suffix of an option whose kept input is held on the host (``recompute:host``)."""


@dataclass(frozen=True, slots=True)
class BlockOption:
    """One option a block can take, as the profile calibrates it and the cost model prices it.

    Attributes:
        kind: what the block does (keep, recompute, selective, offload).
        policy: for ``selective`` with a fixed policy: the preset or ``save:`` list, the same in
            every block.
        milp_percent: for a selective MILP variant: the allotment, in percent of each block's
            saved bytes (each block's policy is then the MILP's choice for that block).
        tiles: for ``keep`` and ``recompute``: the block's position-wise submodules run over this
            many tiles of the sequence (:mod:`memfit.apply.tiling`).
        host: for ``recompute``: the block's kept input is held in host memory
            (:mod:`memfit.apply.host_inputs`).

    Example:
        >>> o = BlockOption.parse("selective:milp-25")
        >>> o.kind.value, o.milp_percent, o.name
        ('selective', 25, 'selective:milp-25')
        >>> BlockOption.parse("keep") == BlockOption(Option.KEEP)
        True
        >>> o = BlockOption.parse("recompute:tiles-4:host")
        >>> o.kind.value, o.tiles, o.host
        ('recompute', 4, True)
    """

    kind: Option
    policy: str | None = None
    milp_percent: int | None = None
    tiles: int | None = None
    host: bool = False

    @property
    def name(self) -> str:
        """The option's name: its key in :attr:`~memfit.capture.stats.BlockStats.options`."""
        if self.kind is Option.SELECTIVE:
            return f"selective:{self.variant}"
        parts = [self.kind.value]
        if self.tiles is not None:
            parts.append(f"{_TILES}{self.tiles}")
        if self.host:
            parts.append(HOST)
        return ":".join(parts)

    @property
    def variant(self) -> str:
        """What follows ``selective:`` in the name (the policy, or ``milp-<pct>``)."""
        return f"{_MILP}{self.milp_percent}" if self.milp_percent is not None else self.policy or ""

    @property
    def milp_fraction(self) -> float | None:
        """The MILP allotment as a fraction of a block's saved bytes (None: not a MILP variant)."""
        return None if self.milp_percent is None else self.milp_percent / 100

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> BlockOption:
        """The option named ``name`` (``keep``, ``recompute``, ``offload``, ``selective:<policy>``,
        ``selective:milp-<pct>``, ``keep:tiles-<N>``, ``recompute:tiles-<N>``, ``recompute:host``,
        ``recompute:tiles-<N>:host``).

        Raises:
            SpecError: another name (the message lists the forms).
        """
        head, sep, what = name.partition(":")
        if not sep and head in (Option.KEEP, Option.RECOMPUTE, Option.OFFLOAD):
            return cls(Option(head))
        if head == Option.SELECTIVE and what:
            if what.startswith(_MILP) and what[len(_MILP) :].isdigit():
                return cls(Option.SELECTIVE, milp_percent=int(what[len(_MILP) :]))
            return cls(Option.SELECTIVE, policy=what)
        if head in (Option.KEEP, Option.RECOMPUTE) and what:
            parts = what.split(":")
            tiles, host = None, False
            if parts[0].startswith(_TILES) and parts[0][len(_TILES) :].isdigit() and int(parts[0][len(_TILES) :]) >= 2:
                tiles = int(parts.pop(0)[len(_TILES) :])
            if parts == [HOST] and head == Option.RECOMPUTE:
                host = True
                parts = []
            if not parts:
                return cls(Option(head), tiles=tiles, host=host)
        raise SpecError(
            f"memfit.plan: unknown block option {name!r}. Use keep, recompute, offload, selective:PRESET "
            f"({', '.join(SAVE_PRESETS)}), selective:save:OP,..., selective:milp-PCT, keep:tiles-N, "
            "recompute:tiles-N (N >= 2), recompute:host or recompute:tiles-N:host."
        )


def requested_options(options: Sequence[str]) -> tuple[BlockOption, ...]:
    """The options a profile request names, in the order they are measured: ``keep`` and
    ``recompute`` as asked, then the selective ones (``selective`` expands to every preset and one
    MILP variant per :data:`MILP_FRACTIONS`), then ``offload``. Duplicates are dropped.

    Raises:
        SpecError: ``options`` does not start with ``keep``, or names an unknown option.

    Example:
        >>> [o.name for o in requested_options(("keep", "offload", "selective:save_matmuls"))]
        ['keep', 'selective:save_matmuls', 'offload']
    """
    if not options or options[0] != "keep":
        raise SpecError(
            f"memfit.profile: options {options!r} must start with 'keep' (every option is measured against it), "
            "e.g. options=('keep', 'recompute', 'selective')."
        )
    unknown = [
        m for m in options if m not in (*BASE_OPTIONS, "selective", "offload") and not m.startswith("selective:")
    ]
    if unknown:
        raise SpecError(
            f"memfit.profile: unknown option(s) {unknown}. Use keep, recompute, selective, "
            "selective:PRESET (save_matmuls, save_attention, save_matmuls_and_attention) or offload."
        )
    base = [BlockOption(Option(m)) for m in options if m in BASE_OPTIONS]
    selective: list[BlockOption] = []
    for m in options:
        if m == "selective":
            selective.extend(BlockOption(Option.SELECTIVE, policy=p) for p in SELECTIVE_PRESETS)
            selective.extend(BlockOption(Option.SELECTIVE, milp_percent=round(f * 100)) for f in MILP_FRACTIONS)
        elif m.startswith("selective:"):
            selective.append(BlockOption.parse(m))
    offload = [BlockOption(Option.OFFLOAD)] if "offload" in options else []
    return tuple(dict.fromkeys([*base, *selective, *offload]))


def selective_options(
    ops: OpStats, requested: Sequence[BlockOption]
) -> tuple[dict[BlockOption, list[str]], dict[str, str]]:
    """The selective options worth calibrating, and the ones left out with the reason.

    An option is left out when it caches nothing in every block (it would be a slower
    ``recompute``), when it caches exactly what an option already kept caches, or when it would
    cache an output that the block then mutates in place (torch raises on that in backward).

    Args:
        ops: the op-level capture (:func:`memfit.capture.ops.capture_ops`).
        requested: the selective options to consider (others are ignored), in order.

    Returns:
        ``({option: [save policy per block]}, {option name: why it was left out})``.
    """
    options: dict[BlockOption, list[str]] = {}
    dropped: dict[str, str] = {}
    seen: dict[tuple[tuple[int, ...], ...], str] = {}
    for opt in requested:
        if opt.kind is not Option.SELECTIVE:
            continue
        frac = opt.milp_fraction
        if frac is not None:
            pols = [solve_block_milp(b, int(frac * b.saved_bytes)).policy for b in ops.blocks]
        else:
            pols = [opt.variant] * len(ops.blocks)
        parsed = [parse_save_policy(p) for p in pols]
        sets = tuple(cached_calls(b, p) for b, p in zip(ops.blocks, parsed, strict=True))
        bad = [c for b, p in zip(ops.blocks, parsed, strict=True) for c in uncacheable_calls(b, p)]
        cached = [sum(b.calls[j].out_bytes for j in s) for b, s in zip(ops.blocks, sets, strict=True)]
        if bad:
            dropped[opt.name] = f"it would cache outputs the blocks mutate in place ({', '.join(bad[:3])})"
        elif not any(cached):
            dropped[opt.name] = "it caches nothing in this model (the same as recompute, with overhead)"
        elif sets in seen:
            dropped[opt.name] = f"it caches the same op outputs as {seen[sets]}"
        else:
            seen[sets] = opt.name
            options[opt] = pols
    return options, dropped


def option_plan(
    base: Plan,
    option: BlockOption,
    policies: Sequence[str] | None = None,
    tiled: Sequence[Sequence[str]] | None = None,
) -> Plan:
    """The calibration plan of ``option``: ``base`` (a plan that keeps every block) with every
    block in the option; ``policies`` gives a selective option's save policy per block, ``tiled``
    a tiled option's submodules per block (a block without any runs the option untiled).

    ``keep`` and ``recompute`` calibrate on the baseline plans instead
    (:func:`memfit.plan.policies.policy_plan` ``none`` and ``all``).
    """
    if option.kind is Option.SELECTIVE:
        assert policies is not None and len(policies) == len(base.blocks)
        blocks = tuple(
            BlockDecision(name=b.name, option=Option.SELECTIVE, policy=p)
            for b, p in zip(base.blocks, policies, strict=True)
        )
    elif option.tiles is not None or option.host:
        blocks = tuple(
            BlockDecision(
                name=b.name, option=option.kind, host_input=option.host,
                tiles=option.tiles if option.tiles is not None and tiled and tiled[i] else None,
                tiled=tuple(tiled[i]) if option.tiles is not None and tiled and tiled[i] else (),
            )
            for i, b in enumerate(base.blocks)
        )  # fmt: skip
    else:
        blocks = tuple(BlockDecision(name=b.name, option=option.kind) for b in base.blocks)
    return base.with_(policy=option.name, blocks=blocks)


def rerun_fraction(block_ops: BlockOps, policy: str) -> float:
    """Share of a block's op time that a selective policy re-runs in backward."""
    total = sum(c.time_s for c in block_ops.calls)
    if total <= 0:
        return 1.0
    saved = sum(block_ops.calls[j].time_s for j in cached_calls(block_ops, parse_save_policy(policy)))
    return max(0.0, total - saved) / total


def tiled_options(tile_counts: Sequence[int]) -> tuple[BlockOption, ...]:
    """The tiled options a profile measures: ``keep`` and ``recompute`` at each tile count.

    Example:
        >>> [o.name for o in tiled_options((4, 8))]
        ['keep:tiles-4', 'recompute:tiles-4', 'keep:tiles-8', 'recompute:tiles-8']
    """
    return tuple(BlockOption(k, tiles=n) for n in tile_counts for k in (Option.KEEP, Option.RECOMPUTE))


def host_options(tile_counts: Sequence[int] = ()) -> tuple[BlockOption, ...]:
    """The host-held options a profile measures: ``recompute:host``, and with each tile count
    ``recompute:tiles-N:host``.

    Example:
        >>> [o.name for o in host_options((4,))]
        ['recompute:host', 'recompute:tiles-4:host']
    """
    return (
        BlockOption(Option.RECOMPUTE, host=True),
        *(BlockOption(Option.RECOMPUTE, tiles=n, host=True) for n in tile_counts),
    )
