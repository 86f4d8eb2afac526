"""Measuring compiled code: where ``torch.compile`` falls back to eager, and a compiled step's peak.

``with GraphBreaks() as gb: step()`` records every graph break dynamo logs while compiling code run
inside the block (``gb.count``, ``gb.reasons``), whatever compiled it: a whole model, each block, a
function. Nothing is printed and the user's logging is left as it was.

:func:`profiled_step_peak_bytes` measures a training step's peak with the profiler, the method that
sees compiled code: the live-tensor tracker is a dispatch mode, and a compiled module run under a
dispatch mode runs eagerly (and stays eager), so the tracker cannot measure compiled code at all.
The profiler records the allocator's allocations and frees, whoever makes them (inductor's
generated code allocates its buffers through the same CPU and CUDA allocators).

NOTE [ Counting graph breaks ]
Three ways were tried on torch 2.13. ``torch._dynamo.explain(fn)(*args)`` reports ``graph_count 0,
graph_break_count -1`` when dynamo gives up on a whole frame ("Failed to handle graph break
gracefully. Skipping the function and falling back to eager"), the case that matters most; and
``torch._dynamo.utils.counters["graph_break"]`` misses those too (they land in
``counters["unimplemented"]``, keyed by message, next to breaks dynamo recovered from). Every break
(and every skipped frame) is logged by ``InstructionTranslator.log_graph_break`` on the
``graph_breaks`` artifact logger, once per break, whether the message is shortened as a duplicate
or not. This module listens on that logger for the duration of the block: it raises the logger's
level to DEBUG, stops propagation (so nothing reaches torch's handlers), and restores both after.

Known limitations:
    - Breaks are counted when dynamo compiles a frame: code compiled before the block (a cache hit)
      shows none. Count on the first call after ``torch.compile`` (or ``torch._dynamo.reset()``).
    - The logger's name is torch's (``torch._dynamo.symbolic_convert.__graph_breaks``), not a
      public API; if a later torch renames it, :attr:`GraphBreaks.count` stays 0. The test suite
      checks that a known break is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from memfit.capture.step import optimizer_tensors, tensor_bytes, training_step
from memfit.capture.tracker import profiler_peak_bytes
from memfit.workload import Batch, iter_tensors

_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_REASON = "Graph Break Reason: "


class GraphBreaks(logging.Handler):
    """Context manager recording the graph breaks dynamo logs while it is active.

    Example:
        >>> import torch
        >>> def f(x):
        ...     print("side effect")  # a graph break
        ...     return x + 1
        >>> with GraphBreaks() as gb:
        ...     _ = torch.compile(f, backend="eager")(torch.ones(1))
        side effect
        >>> gb.count
        1
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.reasons: list[str] = []
        self._saved: tuple[int, bool] | None = None

    @property
    def count(self) -> int:
        """Graph breaks (and frames dynamo skipped, falling back to eager) seen so far."""
        return len(self.reasons)

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(_one_line(record.getMessage()))

    def __enter__(self) -> GraphBreaks:
        log = logging.getLogger(_LOGGER)
        self._saved = (log.level, log.propagate)
        log.setLevel(logging.DEBUG)
        log.propagate = False
        log.addHandler(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        log = logging.getLogger(_LOGGER)
        log.removeHandler(self)
        if self._saved is not None:
            log.setLevel(self._saved[0])
            log.propagate = self._saved[1]


def _one_line(msg: str) -> str:
    """``FILE:LINE: kind of break: explanation`` from dynamo's multi-line graph-break message."""
    head, _, rest = msg.partition(_REASON)
    where = head.strip().split(" at ", 1)[-1]
    lines = [ln.strip() for ln in rest.split("User code traceback:", 1)[0].splitlines() if ln.strip()]
    kind = next((ln for ln in lines[1:] if not ln.startswith(("Explanation:", "Hint:", "Developer", "For more"))), "")
    explanation = next((ln.removeprefix("Explanation:").strip() for ln in lines if ln.startswith("Explanation:")), "")
    first = lines[0].rstrip(":") if lines else ""
    return ": ".join(x for x in (where, kind or first, explanation) if x)


def profiled_step_peak_bytes(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[nn.Module, Batch], Any],
    optimizer: torch.optim.Optimizer,
    *,
    seed: int,
) -> int:
    """Peak bytes of one training step (forward, backward, optimizer step), measured with the profiler.

    The same quantity as :attr:`memfit.capture.step.StepMemory.peak_bytes`: what is live at the start
    (parameters, buffers, optimizer state, the batch) plus the highest sum of bytes the step
    allocated and had not yet freed (:func:`memfit.capture.tracker.profiler_peak_bytes`). Use it for
    compiled models; gradients are left set afterwards, as :func:`~memfit.capture.step.measure_step`
    leaves them.
    """
    optimizer.zero_grad(set_to_none=True)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    start_bytes = tensor_bytes(
        [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), *iter_tensors(batch)]
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_bytes = profiler_peak_bytes(lambda: training_step(model, batch, loss_fn, optimizer, seed=seed), device=device)
    return start_bytes + step_bytes
