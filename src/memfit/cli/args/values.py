"""argparse types that need neither torch nor the library: numbers in a range, names, files.

:mod:`memfit.cli.common` re-exports them for the commands.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def nonneg_int(text: str) -> int:
    """argparse type: a whole number >= 0 (counts that may be zero, such as retries)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


SEED_MAX = 2**63 - 1
"""The largest ``--seed``: torch's generators take 64 bits, and memfit adds small offsets to a seed."""


def seed_arg(text: str) -> int:
    """argparse type: a seed, a whole number from 0 to :data:`SEED_MAX`."""
    value = nonneg_int(text)
    if value > SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} is larger than the largest seed, 2**63 - 1 = {SEED_MAX}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (learning rates, clipping norms)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be greater than 0")
    return value


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0 (margins, fractions)."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be 0 or more")
    return value


def positive_number(text: str) -> float:
    """argparse type: a number > 0 (rates and sizes of the data-parallel options)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


MAX_MARGIN = 1.0
"""``--margin`` must stay below this: a margin of 1 reserves the whole predicted peak again."""


def margin_arg(text: str) -> float:
    """argparse type for ``--margin``: a fraction of the predicted peak kept free, in [0, 1)."""
    value = nonneg_float(text)
    if value >= MAX_MARGIN:
        raise argparse.ArgumentTypeError(
            f"{value:g} is not a fraction below 1: the margin is the share of the predicted peak kept free "
            "(0.02 = 2 %), and 1 or more would plan for half the budget or less; give e.g. 0.05, or lower --budget"
        )
    return value


def plan_file_arg(text: str) -> str:
    """argparse type for ``--plan``: an existing file (its content is checked by ``Plan.load``)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(
            f"no plan file {text!r}; write one with `memfit plan --model SPEC --budget SIZE --out {text}`"
        )
    return text


def seq_len_arg(text: str) -> int | str:
    """argparse type for ``memfit fit --seq-len``: tokens per row, or ``auto`` (the longest that trains)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a whole number of tokens nor auto (the longest sequence that trains in --budget)"
        ) from None


def tile_modules_arg(text: str) -> tuple[str, ...]:
    """argparse type for ``--tile-modules``: comma-separated names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more submodule names, e.g. --tile-modules mlp")
    return names
