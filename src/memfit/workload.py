"""Workloads: what memfit measures, plans and trains.

A workload is ``(model, make_batch, loss_fn)`` (DESIGN.md, "Workload spec"):

- ``make_batch(batch_size)`` returns a tensor, or a dict/tuple/list of tensors with the batch on dim 0;
- ``loss_fn(model, batch)`` returns a scalar loss averaged over the batch, or a pair
  ``(loss_sum, count)`` for token-level losses, where the exact loss of a global batch is the sum of
  ``loss_sum`` over all its pieces divided by the sum of ``count``.

``load_workload(spec)`` builds one from a ``--model`` spec: ``demo``, ``hf:TYPE?key=value&...`` or
``path/to/file.py:NAME``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import SpecError

Batch = Any  # a tensor, or a dict / tuple / list of tensors with the batch on dim 0
LossOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model with a way to make batches and a loss.

    Attributes:
        name: the spec it was built from (for reports and plan fingerprints).
        model: the ``nn.Module`` to train.
        make_batch: ``batch_size -> batch``; deterministic given the torch RNG state.
        loss_fn: ``(model, batch) -> loss`` or ``(loss_sum, count)``.
        count_fn: optional ``batch -> count`` giving the loss normaliser (valid tokens) without a
            forward pass; token-level workloads provide it so accumulation can normalise by the
            global count before the first backward.
        default_batch_size: the batch size used when a command is not given one.
        blocks: optional dotted path of the module list holding the blocks, or several paths of
            containers run one after another (overrides discovery; see
            :func:`memfit.capture.chain.set_blocks`).
    """

    name: str
    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[nn.Module, Batch], LossOutput]
    count_fn: Callable[[Batch], int] | None = None
    default_batch_size: int = 4
    blocks: str | Sequence[str] | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


def load_workload(
    spec: str,
    *,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Workload:
    """Build the workload a ``--model`` spec names.

    Args:
        spec: ``demo``, ``hf:TYPE`` with optional ``?key=value&...`` config overrides, or
            ``path/to/file.py:NAME`` where ``NAME()`` returns ``(model, make_batch, loss_fn)``.
        seq_len: sequence length in tokens for the built-in token workloads (default: theirs).
        dtype: convert the model's floating parameters and buffers to this dtype, and the
            floating tensors of every ``make_batch`` result (:func:`with_dtype`).
        seed: seed for weight initialisation, so two loads give the same weights.

    Raises:
        SpecError: the spec is malformed, names an unknown type, or the file does not define NAME.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(_SPEC_HELP.format(spec=spec))
    spec = spec.strip()
    torch.manual_seed(seed)
    if spec == "demo" or spec.startswith("demo?"):
        from memfit.models.demo import build_demo_workload

        wl = build_demo_workload(overrides=_parse_overrides(spec, "demo"), seq_len=seq_len)
    elif spec.startswith("hf:"):
        from memfit.models.hf import build_hf_workload

        body = spec[3:]
        model_type = body.split("?", 1)[0]
        if not model_type:
            raise SpecError(_SPEC_HELP.format(spec=spec))
        wl = build_hf_workload(
            model_type, overrides=_parse_overrides(body, model_type), seq_len=seq_len, spec=spec
        )
    elif ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        path, name = spec.rsplit(":", 1)
        wl = _load_file_workload(path, name, spec)
    else:
        raise SpecError(_SPEC_HELP.format(spec=spec))
    return with_dtype(wl, dtype)


def with_dtype(workload: Workload, dtype: torch.dtype | None) -> Workload:
    """The workload in ``dtype``: its model converted (in place) and its ``make_batch`` returning
    batches whose floating tensors are converted, so that every command and entry point feeds the
    model batches of its own dtype. ``None`` returns the workload as it is.

    Example:
        >>> wl = with_dtype(load_workload("examples/convnet.py:build"), torch.float64)
        >>> wl.make_batch(2)[0].dtype
        torch.float64
    """
    if dtype is None:
        return workload
    workload.model.to(dtype=dtype)
    make_batch = workload.make_batch
    if isinstance(make_batch, functools.partial) and make_batch.func is _cast_made_batch:
        make_batch = make_batch.args[0]  # cast once, to the latest dtype
    return dataclasses.replace(workload, make_batch=functools.partial(_cast_made_batch, make_batch, dtype))


def _cast_made_batch(make_batch: Callable[[int], Batch], dtype: torch.dtype, batch_size: int) -> Batch:
    return cast_batch(make_batch(batch_size), dtype=dtype)


_SPEC_HELP = (
    "memfit.workload: cannot read model spec {spec!r}. Use one of: 'demo' (the built-in GPT-style "
    "model), 'hf:TYPE' with optional config overrides such as "
    "'hf:llama?num_hidden_layers=8&hidden_size=256' (types: gpt2, llama, bert and other transformers "
    "model types), or 'path/to/file.py:NAME' where NAME() returns (model, make_batch, loss_fn)."
)


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _parse_overrides(body: str, what: str) -> dict[str, Any]:
    if "?" not in body:
        return {}
    query = body.split("?", 1)[1]
    out: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        if "=" not in part:
            raise SpecError(
                f"memfit.workload: override {part!r} in {body!r} has no '='. Write overrides as "
                f"'{what}?key=value&key2=value2', e.g. 'hf:llama?num_hidden_layers=8'."
            )
        key, value = part.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


def _load_file_workload(path: str, name: str, spec: str) -> Workload:
    file = Path(path)
    if not file.is_file():
        raise SpecError(
            f"memfit.workload: no file {str(file)!r} for spec {spec!r}. Give an existing Python file "
            "and a function name, e.g. 'examples/convnet.py:build'."
        )
    mod_name = "memfit_user_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module = sys.modules.get(mod_name)
    if module is None:
        mod_spec = importlib.util.spec_from_file_location(mod_name, file)
        if mod_spec is None or mod_spec.loader is None:
            raise SpecError(f"memfit.workload: cannot import {str(file)!r} as a Python module.")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception:
            sys.modules.pop(mod_name, None)
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        have = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise SpecError(
            f"memfit.workload: {str(file)!r} has no function {name!r} (it has: {', '.join(have) or 'none'}). "
            f"Define {name}() returning (model, make_batch, loss_fn)."
        )
    result = fn()
    if isinstance(result, Workload):
        return result
    if not (isinstance(result, tuple | list) and len(result) in (3, 4)):
        raise SpecError(
            f"memfit.workload: {spec} returned {type(result).__name__}; it must return "
            "(model, make_batch, loss_fn) or (model, make_batch, loss_fn, count_fn)."
        )
    model, make_batch, loss_fn, *rest = result
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"memfit.workload: {spec} returned a {type(model).__name__} as its model; the first item "
            "must be a torch.nn.Module."
        )
    return Workload(
        name=spec,
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        count_fn=rest[0] if rest else None,
    )


# --- batches -------------------------------------------------------------------------------------


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """Apply ``fn`` to every tensor of a batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def iter_tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor of a batch, in a stable order."""
    out: list[torch.Tensor] = []
    map_tensors(batch, lambda t: out.append(t) or t)
    return out


def cast_batch(batch: Batch, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Batch:
    """Move a batch to ``device`` and convert its floating tensors to ``dtype``."""

    def conv(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        return t

    return map_tensors(batch, conv)


def batch_size_of(batch: Batch) -> int:
    """The batch size (dim 0 of every tensor, which must agree)."""
    sizes = {t.shape[0] for t in iter_tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise SpecError(
            f"memfit.workload: the batch's tensors disagree on dim 0 ({sorted(sizes)}). make_batch "
            "must return tensors with the batch on dim 0."
        )
    return sizes.pop()


def split_batch(batch: Batch, sizes: Sequence[int]) -> list[Batch]:
    """Split a batch on dim 0 into pieces of the given sizes (which must add up to its size)."""
    total = batch_size_of(batch)
    if sum(sizes) != total or any(s <= 0 for s in sizes):
        raise SpecError(
            f"memfit.workload: cannot split a batch of {total} into pieces {list(sizes)}; the pieces "
            "must be positive and add up to the batch size."
        )
    pieces: list[Batch] = []
    start = 0
    for s in sizes:
        pieces.append(map_tensors(batch, lambda t, a=start, b=start + s: t[a:b] if t.dim() > 0 else t))
        start += s
    return pieces


def batch_signature(batch: Batch) -> list[dict[str, Any]]:
    """Shapes and dtypes of a batch's tensors: what a plan's batch fingerprint records."""
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in iter_tensors(batch)]


def reduce_loss(out: LossOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read a loss_fn result as ``(loss, count)``; ``count`` is None for a mean loss.

    Raises:
        SpecError: the result is neither a scalar tensor nor a ``(loss_sum, count)`` pair.
    """
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        loss_sum, count = out
        if not isinstance(count, torch.Tensor):
            count = torch.tensor(float(count))
        return loss_sum, count
    raise SpecError(
        "memfit.workload: loss_fn must return a scalar tensor (mean loss) or a pair (loss_sum, count); "
        f"it returned {type(out).__name__}"
        + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
        + ". Reduce the loss to a scalar, e.g. loss.mean()."
    )


def mean_loss(out: LossOutput) -> torch.Tensor:
    """The scalar loss of one batch: the mean, or ``loss_sum / count``."""
    loss, count = reduce_loss(out)
    return loss if count is None else loss / count.to(loss.dtype)


def signature_digest(obj: Any) -> str:
    """A short stable hash of a JSON-serialisable object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
