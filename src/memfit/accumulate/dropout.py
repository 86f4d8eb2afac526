"""Dropout off, train mode kept: what the accumulation check needs to compare two runs exactly."""

from __future__ import annotations

from torch import nn

__all__ = ["disable_dropout"]

_RANDOM_DROP_NAMES = ("dropout", "pdrop", "drop_prob", "drop_path", "layerdrop")


def disable_dropout(module: nn.Module) -> int:
    """Turn dropout off everywhere in ``module`` while keeping train mode; return how many changed.

    Sets ``p = 0`` on every ``nn.Dropout``-like module, and 0.0 on float attributes whose name
    contains ``dropout`` or ``pdrop`` on modules and on their ``config`` (HF attention computes
    its dropout from such attributes, not from a module), and on those of stochastic depth and
    layer drop (``drop_prob`` of HF's and timm's ``DropPath``, ``drop_path_rate``, ``layerdrop``):
    they drop whole samples or layers at random, as dropout drops units (BEiT, Swin and SegFormer
    default to ``drop_path_rate=0.1``; left on, their float64 accumulation check differed by 0.5-1.6).
    """
    changed = 0
    seen: set[int] = set()
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p != 0:
            m.p = 0.0
            changed += 1
        for target in (m, getattr(m, "config", None)):
            if target is None or id(target) in seen or not hasattr(target, "__dict__"):
                continue
            seen.add(id(target))
            for key, value in list(vars(target).items()):
                low = key.lower()
                if any(w in low for w in _RANDOM_DROP_NAMES) and isinstance(value, float) and value != 0.0:
                    setattr(target, key, 0.0)
                    changed += 1
    return changed
