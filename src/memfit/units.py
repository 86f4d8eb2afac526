"""Byte sizes and dtypes: parsed from human strings at the edges (CLI, config), bytes and
``torch.dtype`` everywhere else."""

from __future__ import annotations

import math
import re

import torch

from memfit.errors import SpecError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``123``, ``300MiB``, ``2GiB`` or ``1.5GB`` into bytes.

    Args:
        text: the size; an ``int`` is taken as bytes.

    Returns:
        The size in bytes (rounded down to a whole byte).

    Raises:
        SpecError: the text is not a size.

    Example:
        >>> parse_size("1.5GiB")
        1610612736
    """
    if isinstance(text, int):
        if text < 0:
            raise SpecError(f"memfit.units: size {text} is negative. Give a size >= 0 such as 300MiB.")
        return text
    if str(text).strip().startswith("-"):
        raise SpecError(f"memfit.units: size {text!r} is negative. Give a size >= 0 such as 300MiB.")
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise SpecError(
            f"memfit.units: cannot read {text!r} as a size. Use a number of bytes or a number "
            "with a unit: 123, 300MiB, 2GiB, 1.5GB (KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)."
        )
    if re.fullmatch(r"[KMGT]i?b", m.group(2)):  # an upper-case prefix with a lower-case b: bits
        number, prefix = m.group(1), m.group(2)[0]
        raise SpecError(
            f"memfit.units: {text!r} is in bits (a lower-case b), and sizes are bytes. Write {number}{prefix}B "
            f"(powers of 1000) or {number}{prefix}iB (powers of 1024)."
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value >= 2**63:
        raise SpecError(
            f"memfit.units: size {text!r} is too large ({value:g} bytes). Give a size below 8 EiB "
            "such as 300MiB or 80GiB."
        )
    return int(value)


def format_bytes(n: float) -> str:
    """Format a byte count for people: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(text: str | None) -> torch.dtype | None:
    """``"bf16"`` -> ``torch.bfloat16`` (names in :data:`DTYPES`); None stays None.

    Raises:
        SpecError: an unknown name; the message lists the known ones.
    """
    if text is None:
        return None
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise SpecError(f"memfit: unknown dtype {text!r}. Use one of: {', '.join(sorted(set(DTYPES)))}.") from None
