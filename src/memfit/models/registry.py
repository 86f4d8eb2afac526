"""Loading a workload from a ``--model`` spec: ``demo``, ``hf:TYPE?key=value&...`` or
``path/to/file.py:NAME`` (DESIGN.md, "Workload spec").

The loader lives here, beside the models it builds, so that :mod:`memfit.workload` (the
``Workload`` type and the batch helpers) imports no model and the models import it without a cycle.

Example:
    >>> from memfit.models.registry import load_workload
    >>> wl = load_workload("demo?n_layer=2")
    >>> type(wl.model).__name__
    'GPT'
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import SpecError, WorkloadError
from memfit.models.demo import build_demo_workload
from memfit.models.hf import build_hf_workload
from memfit.workload import Batch, Workload, call_user, cast_batch, guard_workload, with_dtype, with_seq_len

__all__ = ["check_workload", "load_workload", "on_device"]


def load_workload(
    spec: str,
    *,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Workload:
    """Build the workload a ``--model`` spec names.

    Args:
        spec: ``demo``, ``hf:TYPE`` with optional ``?key=value&...`` config overrides, or
            ``path/to/file.py:NAME`` where ``NAME()`` returns ``(model, make_batch, loss_fn)``.
        seq_len: sequence length in tokens for the built-in token workloads (default: theirs).
        dtype: convert the model's floating parameters and buffers to this dtype, and the
            floating tensors of every ``make_batch`` result (:func:`with_dtype`).
        seed: seed for weight initialisation, so two loads give the same weights.
        device: move the model there and make every batch there (:func:`on_device`); None: where
            the builder put them (the CPU for ``demo`` and ``hf:``). The weights are the same on
            every device: they are drawn on the CPU first.

    Raises:
        SpecError: the spec is malformed, names an unknown type, or the file does not define NAME.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(_SPEC_HELP.format(spec=spec))
    spec = spec.strip()
    torch.manual_seed(seed)
    if spec == "demo" or spec.startswith("demo?"):
        wl = build_demo_workload(overrides=_parse_overrides(spec, "demo"), seq_len=seq_len)
    elif spec.startswith("hf:"):
        body = spec[3:]
        model_type = body.split("?", 1)[0]
        if not model_type:
            raise SpecError(_SPEC_HELP.format(spec=spec))
        wl = build_hf_workload(model_type, overrides=_parse_overrides(body, model_type), seq_len=seq_len, spec=spec)
    elif ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        path, name = spec.rsplit(":", 1)
        wl = _with_seq_len(_load_file_workload(path, name, spec), seq_len, spec)
    else:
        raise SpecError(_SPEC_HELP.format(spec=spec))
    check_workload(wl)
    return on_device(with_dtype(guard_workload(wl), dtype), device)


def on_device(workload: Workload, device: torch.device | str | None) -> Workload:
    """The workload on ``device``: its model moved there (in place) and its ``make_batch`` (and
    ``make_batch_at``) returning batches there, so that every command measures where the user
    trains. ``None`` returns the workload as it is.

    Example:
        >>> wl = on_device(load_workload("demo?n_layer=2"), "meta")
        >>> next(wl.model.parameters()).device.type, wl.make_batch(2)[0].device.type
        ('meta', 'meta')
    """
    if device is None:
        return workload
    device = torch.device(device)
    workload.model.to(device)
    changes: dict[str, Any] = {"make_batch": functools.partial(_made_on, workload.make_batch, device)}
    if workload.make_batch_at is not None:
        changes["make_batch_at"] = functools.partial(_made_at_on, workload.make_batch_at, device)
    return dataclasses.replace(workload, **changes)


def _made_on(make_batch: Any, device: torch.device, batch_size: int) -> Batch:
    return cast_batch(make_batch(batch_size), device=device)


def _made_at_on(make_batch_at: Any, device: torch.device, batch_size: int, seq_len: int) -> Batch:
    return cast_batch(make_batch_at(batch_size, seq_len), device=device)


def check_workload(wl: Workload) -> None:
    """Check what a workload returned before measuring it: callables, and something to train.

    Raises:
        WorkloadError: ``make_batch``, ``loss_fn`` or ``count_fn`` is not callable, the model has
            no parameters, or every parameter is frozen (``requires_grad=False``).
    """
    for name in ("make_batch", "loss_fn", "count_fn"):
        fn = getattr(wl, name)
        if fn is not None and not callable(fn):
            raise WorkloadError(
                f"memfit.workload: {wl.name}: {name} is a {type(fn).__name__}, not a function. Return "
                "(model, make_batch, loss_fn) with make_batch(batch_size) -> batch and loss_fn(model, batch) -> loss.",
                stage="check",
            )
    params = list(wl.model.parameters())
    if not params:
        raise WorkloadError(
            f"memfit.workload: {wl.name}: the model ({type(wl.model).__name__}) has no parameters, so a "
            "training step has nothing to train. Register its weights as nn.Parameter (layers assigned "
            "as attributes, nn.ModuleList rather than a Python list).",
            stage="check",
        )
    meta = [name for name, p in wl.model.named_parameters() if p.is_meta]
    if meta:
        raise WorkloadError(
            f"memfit.workload: {wl.name}: {len(meta)} of the model's parameters are on the meta device "
            f"({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}): shapes without data, nothing to train. "
            "Build the model on a real device, or materialise it (model.to_empty(device='cpu'), then initialise or "
            "load its weights) before returning it.",
            stage="check",
        )
    if not any(p.requires_grad for p in params):
        raise WorkloadError(
            f"memfit.workload: {wl.name}: all {len(params)} parameters of the model are frozen "
            "(requires_grad=False), so a training step has nothing to train. Unfreeze the ones to train "
            "(p.requires_grad_(True)), e.g. an adapter or the last layers.",
            stage="check",
        )


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
        if key.strip() in out:
            raise SpecError(
                f"memfit.workload: {body!r} sets {key.strip()!r} more than once, and only one value can hold; give "
                f"each key once, e.g. '{what}?{key.strip()}={value.strip()}'."
            )
        out[key.strip()] = _parse_value(value.strip())
    return out


def _with_seq_len(workload: Workload, seq_len: int | None, spec: str) -> Workload:
    """A file's workload at ``seq_len`` tokens per row (None: as built); refused where it makes batches
    of one shape only, where the length would change nothing."""
    if seq_len is None:
        return workload
    if workload.make_batch_at is None:
        raise SpecError(
            f"memfit.workload: seq_len={seq_len} (--seq-len) sets the tokens per row of a token workload, and {spec!r} "
            "makes its batches at one shape (its Workload has no make_batch_at), so it would change nothing. Leave out "
            "--seq-len, or return a Workload(..., make_batch_at=lambda batch_size, seq_len: ...) from your builder."
        )
    return with_seq_len(workload, seq_len)


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
            call_user("import", mod_spec.loader.exec_module, module, what=str(file))
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        have = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise SpecError(
            f"memfit.workload: {str(file)!r} has no function {name!r} (it has: {', '.join(have) or 'none'}). "
            f"Define {name}() returning (model, make_batch, loss_fn)."
        )
    result = call_user("builder", fn, what=f"{name}()")
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
