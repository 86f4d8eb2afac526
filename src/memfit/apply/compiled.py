"""Compiling a model after its plan is applied: per block (torchtitan's order) or whole.

``compile_applied(model, "block")`` compiles each block of the model's chain in place
(``block.compile()``), after :func:`memfit.apply.apply_plan` wrapped it: the checkpoint is then
inside each compiled block, as torchtitan orders it (activation checkpointing applied to every
block, then ``torch.compile`` on every block). ``"model"`` compiles the whole model
(``model.compile()``, the same as ``torch.compile(model)`` without a second module). The returned
function undoes it. Either way the plan composes with the compiler without a fallback to eager at
the checkpoint boundaries (NOTE [ Compiled plans ] in :mod:`memfit.apply.engine`); what does not
compose is listed there. A block inside a segment (several blocks recomputed as one unit) is
compiled per block as its own forward, with the segment's steps eager around it; compiled whole,
each segment is one recompute region of the compiler (NOTE [ Compiled segments ] in
:mod:`memfit.apply.compiled_segments`).

Example:
    >>> import torch.nn as nn
    >>> from memfit.apply import apply_plan
    >>> from memfit.plan import policy_plan
    >>> m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    >>> _ = apply_plan(m, policy_plan(m, "all"))
    >>> undo = compile_applied(m, "block", backend="eager")
    >>> undo()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.apply.segments import compile_segment_block
from memfit.capture.chain import discover_chain
from memfit.errors import SpecError

COMPILE_MODES = ("block", "model")
"""``block``: each block of the chain compiled (torchtitan's order); ``model``: the whole model."""


def compile_applied(model: nn.Module, mode: str, *, backend: str | Callable[..., Any] = "inductor", **options: Any) -> Callable[[], None]:
    """Compile ``model`` in place, after a plan was applied, and return a function that undoes it.

    Args:
        model: the model (with or without a plan applied).
        mode: ``"block"`` (each block of the model's chain, see :func:`memfit.capture.chain.discover_chain`)
            or ``"model"`` (the whole model).
        backend: the ``torch.compile`` backend, a name or a callable (``"inductor"``; ``"aot_eager"``
            traces the same graphs without generating code, for quick checks).
        **options: further ``torch.compile`` keyword arguments (``mode``, ``dynamic``, ...).

    Returns:
        ``undo()``: restores each compiled module's call (or a segment block's forward) as it was
        before (compiled or not).

    Raises:
        SpecError: an unknown ``mode``.
    """
    if mode not in COMPILE_MODES:
        raise SpecError(f"memfit.apply: compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}. Use 'block' (each block, torchtitan's order) or 'model'.")
    undos: list[Callable[[], None]] = []
    for m in discover_chain(model).blocks if mode == "block" else [model]:
        # A block of a segment: its own forward compiled, the segment's steps eager around it.
        undo_inner = compile_segment_block(m, functools.partial(torch.compile, backend=backend, **options)) if mode == "block" else None
        if undo_inner is not None:
            undos.append(undo_inner)
            continue
        impl = m.__dict__.get("_compiled_call_impl")
        m.compile(backend=backend, **options)
        undos.append(functools.partial(_restore_call, m, impl))

    def undo() -> None:
        for u in undos:
            u()

    return undo


def _restore_call(module: nn.Module, impl: Callable[..., Any] | None) -> None:
    if impl is None:
        module.__dict__.pop("_compiled_call_impl", None)
    else:
        module.__dict__["_compiled_call_impl"] = impl
