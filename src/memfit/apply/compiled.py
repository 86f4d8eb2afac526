"""Compiling a model after its plan is applied: per block (torchtitan's order) or whole.

``compile_applied(model, "block")`` compiles each block of the model's chain in place
(``block.compile()``), after :func:`memfit.apply.apply_plan` wrapped it: the checkpoint is then
inside each compiled block, as torchtitan orders it (activation checkpointing applied to every
block, then ``torch.compile`` on every block). ``"model"`` compiles the whole model
(``model.compile()``, the same as ``torch.compile(model)`` without a second module). The returned
function undoes it. ``activation_memory_budget=f`` compiles with inductor's min-cut partitioner held
to the fraction ``f`` of its default saved activations (:class:`MemoryBudgetBackend`), and
:func:`compile_plan` applies a plan file written by ``memfit plan --compile`` (its plan and its
recorded compile settings, ``plan.compile_settings``) in one call. Either way the plan composes with the compiler without a fallback to eager at
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
import hashlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.apply.engine import apply_plan, remove_plan
from memfit.apply.segments import compile_segment_block
from memfit.capture.chain import discover_chain
from memfit.errors import PlanMismatchError, SpecError
from memfit.plan.types import Plan

COMPILE_MODES = ("block", "model")
"""``block``: each block of the chain compiled (torchtitan's order); ``model``: the whole model."""


class MemoryBudgetBackend:
    """A ``torch.compile`` backend compiling with ``torch._functorch.config.activation_memory_budget``.

    The fraction is set only while this backend compiles a graph (the min-cut partitioner reads it
    when it splits the joint graph into forward and backward), so other compiled code keeps its own.
    Give every setup its own instance: dynamo's BACKEND_MATCH guard keeps graphs compiled by
    different backend objects apart, so a model never reuses a graph partitioned under another
    fraction (the fraction is not part of dynamo's guards). ``compiles`` counts the graphs it compiled.

    With inductor, the backend also records the code of every forward and backward graph the
    partitioner produced (``graph_codes``; :attr:`digest`): two set-ups with the same digest run the
    same compiled graphs (different fractions often give the same partition), so a measured time
    difference between them is noise. For that the partitioner runs on every compile (AOTAutograd's
    cache, which would skip it, is off while this backend compiles; inductor's own cache of generated
    code still serves repeated graphs).

    Args:
        fraction: activation memory budget in [0, 1]: 1.0 is the partitioner's default (fastest)
            choice of saved activations, 0.0 recomputes everything it can.
        backend: the backend that compiles: ``"inductor"``, or one that runs the same min-cut
            partitioner without generating code (``"aot_eager_decomp_partition"``, for quick checks;
            no digest).
            A backend without the min-cut partitioner (``"aot_eager"``) ignores the fraction.
    """

    def __init__(self, fraction: float, backend: str = "inductor") -> None:
        if not 0.0 <= fraction <= 1.0:
            raise SpecError(
                f"memfit.apply: activation_memory_budget {fraction!r} is not a fraction in [0, 1]. Use 1.0 for the compiler's default, lower to save more."
            )
        self.fraction = fraction
        self.backend = backend
        self.compiles = 0
        self.graph_codes: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.compiles += 1
        # torch._dynamo is loaded by now (it is calling this backend); a top-level import of it
        # would cost every memfit command ~3 s
        if self.backend != "inductor":
            with torch._functorch.config.patch(activation_memory_budget=self.fraction):
                return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        # loaded when inductor compiles, as dynamo's own inductor backend loads it: imported at the
        # top it would cost every memfit command ~0.9 s
        fx = importlib.import_module("torch._inductor.compile_fx")

        def inner_compile(graph: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
            self.graph_codes.append(graph.code)  # a partitioned forward or backward graph
            return fx.compile_fx_inner(graph, *args, **kwargs)

        with torch._functorch.config.patch(activation_memory_budget=self.fraction, enable_autograd_cache=False):
            return fx.compile_fx(gm, example_inputs, inner_compile=inner_compile)

    @property
    def digest(self) -> str | None:
        """A hash of the partitioned graphs compiled so far (None: none recorded, or not inductor)."""
        if not self.graph_codes:
            return None
        return hashlib.sha256("\0".join(self.graph_codes).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"MemoryBudgetBackend({self.fraction:g}, {self.backend!r})"


def compile_plan(
    model: nn.Module, plan: Plan, *, compiler: MemoryBudgetBackend | None = None, **options: Any
) -> Callable[[], None]:
    """Apply ``plan`` and compile the model as ``plan.compile_settings`` records (``memfit plan --compile``).

    Args:
        model: the unmodified model.
        plan: a plan with compile settings: ``mode`` (``block`` or ``model``), ``backend`` and
            ``activation_memory_budget`` (see :func:`memfit.fitting.compiled.plan_compiled`).
        compiler: the backend object to compile with (default: one made from the recorded
            fraction and backend); pass one to read its ``compiles`` or ``digest`` afterwards.
        **options: further ``torch.compile`` keyword arguments.

    Returns:
        ``undo()``: undoes the compiling and removes the plan.

    Raises:
        PlanMismatchError: the plan records no compile settings (an eager plan: apply it with
            :func:`memfit.apply.apply_plan`) or the plan does not fit the model.
    """
    settings = plan.compile_settings
    if settings is None:
        raise PlanMismatchError(
            "memfit.apply: this plan records no compile settings (plan.compile_settings): it was planned for eager "
            "training. Apply it with memfit.apply_plan, or plan for the compiled step with `memfit plan --compile model`."
        )
    apply_plan(model, plan)
    try:
        b = compiler or MemoryBudgetBackend(settings.activation_memory_budget, settings.backend)
        undo = compile_applied(model, settings.mode, backend=b, **options)
    except BaseException:
        remove_plan(model)
        raise

    def undo_all() -> None:
        undo()
        remove_plan(model)

    return undo_all


def compile_applied(
    model: nn.Module,
    mode: str,
    *,
    backend: str | Callable[..., Any] = "inductor",
    activation_memory_budget: float | None = None,
    **options: Any,
) -> Callable[[], None]:
    """Compile ``model`` in place, after a plan was applied, and return a function that undoes it.

    Args:
        model: the model (with or without a plan applied).
        mode: ``"block"`` (each block of the model's chain, see :func:`memfit.capture.chain.discover_chain`)
            or ``"model"`` (the whole model).
        backend: the ``torch.compile`` backend, a name or a callable (``"inductor"``; ``"aot_eager"``
            traces the same graphs without generating code, for quick checks).
        activation_memory_budget: compile with the min-cut partitioner held to this fraction of its
            default saved activations (:class:`MemoryBudgetBackend` around ``backend``, which must
            then be a backend's name); None: the backend as it is.
        **options: further ``torch.compile`` keyword arguments (``mode``, ``dynamic``, ...).

    Returns:
        ``undo()``: restores each compiled module's call (or a segment block's forward) as it was
        before (compiled or not).

    Raises:
        SpecError: an unknown ``mode`` or ``backend`` name.
    """
    if mode not in COMPILE_MODES:
        raise SpecError(
            f"memfit.apply: compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}. Use 'block' (each block, torchtitan's order) or 'model'."
        )
    if isinstance(backend, str) and backend not in (known := torch._dynamo.list_backends(exclude_tags=())):
        common = [b for b in ("inductor", "aot_eager", "eager") if b in known]
        raise SpecError(
            f"memfit.apply: {backend!r} is not a torch.compile backend; use one of {', '.join(common)} "
            "(all: torch._dynamo.list_backends(exclude_tags=())), e.g. --compile-backend inductor."
        )
    if activation_memory_budget is not None:
        if not isinstance(backend, str):
            raise SpecError(
                f"memfit.apply: activation_memory_budget needs a backend's name (inductor, aot_eager_decomp_partition), not {backend!r}."
            )
    # One backend object for all the blocks: they share their code, and each backend object is a
    # separate entry in dynamo's cache of that code (limited to 8 by default).
    b = backend if activation_memory_budget is None else MemoryBudgetBackend(activation_memory_budget, backend)  # type: ignore[arg-type]
    undos: list[Callable[[], None]] = []
    for m in discover_chain(model).blocks if mode == "block" else [model]:
        # A block of a segment: its own forward compiled, the segment's steps eager around it.
        undo_inner = (
            compile_segment_block(m, functools.partial(torch.compile, backend=b, **options))
            if mode == "block"
            else None
        )
        if undo_inner is not None:
            undos.append(undo_inner)
            continue
        impl = m.__dict__.get("_compiled_call_impl")
        m.compile(backend=b, **options)
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
