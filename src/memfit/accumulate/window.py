"""The user's side of the loop: a window over one global batch and its micro-steps.

:meth:`Accumulator.window <memfit.accumulate.accumulator.Accumulator.window>` makes a
:class:`Window`; iterating it yields one :class:`MicroStep` per micro-batch, each backpropagated
with ``micro.backward(loss)``. The Accumulator runs the loop (sync, autocast, BatchNorm, the
optimizer boundary); these two classes are what the caller holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

from memfit.accumulate.types import AccumulationError, StepResult
from memfit.errors import SpecError
from memfit.workload import Batch, LossOutput

__all__ = ["MicroStep", "Window", "micro_batch_sizes"]


def micro_batch_sizes(batch_size: int, micro_batch: int) -> list[int]:
    """Split ``batch_size`` samples into micro-batches of ``micro_batch``, the last one smaller.

    >>> micro_batch_sizes(10, 4)
    [4, 4, 2]
    """
    if batch_size < 1 or micro_batch < 1:
        raise SpecError(
            f"memfit.accumulate: batch size {batch_size} and micro-batch {micro_batch} must both be at least 1."
        )
    k = math.ceil(batch_size / micro_batch)
    return [micro_batch] * (k - 1) + [batch_size - micro_batch * (k - 1)]


class MicroStep:
    """One micro-step of a window: its batch, whether it syncs gradients, and its backward.

    Attributes:
        index: 0-based position in the window.
        micro_steps: micro-steps in the window (``k``).
        batch: this micro-batch (a slice of the global batch on dim 0).
        size: samples in this micro-batch.
        sync_gradients: True on the last micro-step, the only one whose backward reduces gradients
            across ranks (and after which the optimizer steps).
    """

    __slots__ = ("index", "micro_steps", "batch", "size", "sync_gradients", "_backward", "_done")

    def __init__(
        self, index: int, micro_steps: int, batch: Batch, size: int, backward: Callable[[MicroStep, LossOutput], None]
    ) -> None:
        self.index = index
        self.micro_steps = micro_steps
        self.batch = batch
        self.size = size
        self.sync_gradients = index == micro_steps - 1
        self._backward = backward
        self._done = False

    @property
    def done(self) -> bool:
        """True once :meth:`backward` was called."""
        return self._done

    def backward(self, out: LossOutput) -> None:
        """Backpropagate this micro-batch's loss, scaled for the window (and the GradScaler).

        Args:
            out: what ``loss_fn(model, micro.batch)`` returned: a scalar mean loss or a
                ``(loss_sum, count)`` pair.

        Raises:
            AccumulationError: called twice, or the loss kind does not fit the normalisation.
        """
        if self._done:
            raise AccumulationError(
                f"memfit.accumulate: micro-step {self.index} was already backpropagated; call "
                "micro.backward(...) once per micro-step."
            )
        self._done = True
        self._backward(self, out)


class Window:
    """An iterable over the micro-steps of one global batch; steps the optimizer after the last.

    Made by :meth:`Accumulator.window`. Iterate it once; :attr:`result` is set after the loop.

    Args:
        start: starts the Accumulator's loop over this window's micro-steps when the iteration
            begins; the loop sets :attr:`result` after the last one.
    """

    def __init__(self, start: Callable[[Window], Generator[MicroStep, None, None]]) -> None:
        self._start = start
        self._used = False
        self.result: StepResult | None = None

    def __iter__(self) -> Generator[MicroStep, None, None]:
        if self._used:
            raise AccumulationError("memfit.accumulate: a window can be iterated only once.")
        self._used = True
        return self._start(self)
