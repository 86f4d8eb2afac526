"""float32 islands inside a float64 check: find them, run them in float64, say so.

A float64 check (``memfit verify --dtype float64``) is sharp because two runs that compute the
same sums in another order (micro-batches against the whole batch, a chunked loss) then differ by
~1e-15. Most current decoders compute parts of their forward in float32 whatever the model's
dtype: transformers' RMSNorm (``hidden_states.to(torch.float32)``), the rotary tables
(``inv_freq.float()``), softmax upcasts (``softmax(..., dtype=torch.float32)``), Gemma's
``1 + weight.float()``, routers, recurrences. Inside a float64 model those are float32 islands:
their rounding differs with the shape of the work (a matrix product's kernel, a reduction's split),
so a correct accumulation reads 1e-7 to 1e-8 apart from the big batch and a 1e-10 bar calls it wrong.

NOTE [ float32 islands ]
While a float64 check runs, :class:`Float32Islands` (a ``TorchDispatchMode``) turns every request
for float32 into float64: an aten op with a ``dtype`` argument of ``torch.float32`` runs with
``torch.float64`` instead. That covers ``Tensor.float()``, ``.to(torch.float32)`` (and
``.to(float32_tensor)``, ``.type(...)``, ``.type_as(...)``: all reach aten as ``_to_copy``),
``softmax(..., dtype=torch.float32)``, ``sum(..., dtype=...)`` and factories such as
``torch.ones(..., dtype=torch.float32)``; views of the bits as another dtype are left alone. Both runs
of the check (the reference and the one under test) run the same promoted function, so the
comparison stays a comparison of memfit's change alone, at float64's tolerance. Each promoted site
is named (file and function of the model's code) in the check's ``notes`` and JSON
(``float32_islands``). It works at the dispatcher, not as a function mode, because torch's
checkpoint replays a block's forward inside backward without the forward's function modes, while
dispatch modes stay active there: the replay is promoted as the forward was and saved tensors keep
their dtypes.

What it cannot promote (a float32 or half parameter or buffer the model keeps, a cast to float16 or
bfloat16, complex64 arithmetic) is found by :class:`LowPrecisionOps`, a ``TorchDispatchMode`` that
records every op whose output is a floating or complex tensor narrower than float64, during the
reference run. When it finds any, the check judges gradients at the tolerance of float32 runs that
reorder sums (:data:`memfit.verification.gradients.GRAD_RTOL_REORDERED`, ``1e-4``) and says why
(``float32_kept``, ``grad_rtol_reason``). A wrong accumulation (a micro-batch missing, a count off by
one token of a few hundred, a loss scaled by the step count) is 1e-3 to 1 apart: it fails either way.
``torch.compile`` does not trace through dispatch modes: compiled checks do not promote.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Float32Islands", "IslandReport", "LowPrecisionOps", "where_in_model_code"]

_F32, _F64 = torch.float32, torch.float64
_NARROW = (torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex32)
_SKIP_DIRS = (
    str(Path(torch.__file__).parent),
    str(Path(__file__).resolve().parents[1]),  # memfit's own code
    str(Path(sys.modules["contextlib"].__file__ or "").parent),  # the standard library's wrappers
)


def where_in_model_code(depth: int = 1) -> str:
    """``file.py:Qualified.function`` of the innermost caller outside torch, memfit and the standard
    library: the model's own code that made the call."""
    f = sys._getframe(depth)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_SKIP_DIRS) and not name.startswith("<"):
            return f"{Path(name).name}:{f.f_code.co_qualname}"
        f = f.f_back
    return "<torch>"


class Float32Islands(TorchDispatchMode):
    """Run a float64 model's float32 casts in float64 while active (NOTE [ float32 islands ]).

    Attributes:
        sites: how many ops asked for float32, by ``(where, op)`` (where: the model's code that
            ran it, :func:`where_in_model_code`, or ``"backward"``; op: the aten op). Filled only
            with ``record=True``.
    """

    def __init__(self, *, record: bool = True) -> None:
        super().__init__()
        self.record = record
        self.sites: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        at = _dtype_argument(func)
        if at is not None:
            i, name = at
            if i < len(args) and args[i] is _F32:
                args = (*args[:i], _F64, *args[i + 1 :])
            elif kwargs.get(name) is _F32:
                kwargs = {**kwargs, name: _F64}
            else:
                at = None
            if at is not None and self.record:
                where = "backward" if torch._C._current_graph_task_id() != -1 else where_in_model_code()
                self.sites[(where, f"{func.overloadpacket.__name__}(dtype=float32)")] += 1
        return func(*args, **kwargs)


def _dtype_argument(func: Any) -> tuple[int, str] | None:
    """``(position, name)`` of the output-dtype argument of an aten op, or None (views of the bits
    as another dtype, ``view(dtype)``, are not conversions)."""
    if func.overloadpacket.__name__ in _NOT_CONVERSIONS:
        return None
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dtype":
            return (len(func._schema.arguments) if arg.kwarg_only else i), arg.name
    return None


_NOT_CONVERSIONS = {"view", "view_copy", "_view_dtype"}


class LowPrecisionOps(TorchDispatchMode):
    """Record ops whose output is a floating or complex tensor narrower than float64 (NOTE [ float32 islands ]).

    Attributes:
        sites: ops by ``(where, "aten.op -> dtype")`` (where: the model's code running, or
            ``"backward"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        narrow = {t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dtype in _NARROW}
        if narrow:
            where = "backward" if torch._C._current_graph_task_id() != -1 else where_in_model_code()
            for dt in sorted(narrow, key=str):
                self.sites[(where, f"{func.overloadpacket.__name__} -> {str(dt).removeprefix('torch.')}")] += 1
        return out


@dataclass(slots=True)
class IslandReport:
    """What a float64 check found: the casts it promoted and the narrow ops it could not."""

    promoted: Counter[tuple[str, str]] = field(default_factory=Counter)
    kept: Counter[tuple[str, str]] = field(default_factory=Counter)

    def promoted_json(self) -> list[dict[str, Any]]:
        """``[{"where", "cast", "count"}]``, the most frequent first."""
        return [{"where": w, "cast": c, "count": n} for (w, c), n in self.promoted.most_common()]

    def kept_json(self) -> list[dict[str, Any]]:
        """``[{"where", "op", "count"}]``, the most frequent first."""
        return [{"where": w, "op": o, "count": n} for (w, o), n in self.kept.most_common()]

    def note(self) -> str | None:
        """The one line a check prints about its float32 islands, or None when there were none."""
        if not self.promoted and not self.kept:
            return None
        parts = []
        if self.promoted:
            where = sorted({w for w, _ in self.promoted})
            parts.append(
                f"the model computes in float32 inside this float64 check at {_names(where)}; memfit ran these "
                "casts in float64 in both runs, so the comparison is memfit's change alone at float64's tolerance"
            )
        if self.kept:
            where = sorted({w for w, _ in self.kept})
            parts.append(
                f"ops narrower than float64 remain at {_names(where)} (a float32 parameter or buffer, a cast to "
                "half precision): gradients are judged at float32's tolerance for reordered sums"
            )
        return "; ".join(parts)


def _names(where: list[str], most: int = 4) -> str:
    shown = ", ".join(where[:most])
    return shown + (f" and {len(where) - most} more" if len(where) > most else "")
