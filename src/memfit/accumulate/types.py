"""The accumulation loop's values: what a window did, how far it got, the run's counters, its error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from memfit.capture.snapshot import RngSnapshot
from memfit.errors import MemfitError

__all__ = ["AccumulationError", "Counters", "Mark", "SkipReason", "StepResult", "WindowProgress"]


class AccumulationError(MemfitError):
    """The accumulation loop was used in a way that would give a wrong gradient."""


class SkipReason(StrEnum):
    """Why a window took no optimizer step (see NOTE [ Skipped windows ])."""

    GRAD_SCALER = "grad_scaler_overflow"
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad_norm"
    NO_TOKENS = "no_tokens"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one window (one optimizer step over a global batch) did.

    Attributes:
        loss: the normalised loss of this rank's share of the global batch (of the whole global
            batch on one process or with ``sync_loss=True``): ``sum(loss_sum) / tokens`` for ``tokens``, the sample mean for
            ``mean``, the sum for ``sum``.
        count: the normaliser over all ranks: valid tokens (``tokens``), samples (``mean``), or
            ``1.0`` (``sum``).
        samples: samples this rank processed in the window.
        micro_steps: micro-steps this rank ran.
        skipped: True when the whole window was dropped (no optimizer or scheduler step, gradients
            discarded): see ``skip_reason`` and NOTE [ Skipped windows ].
        grad_norm: total gradient norm before clipping (unscaled); None without ``max_grad_norm``
            unless it was computed for the finiteness check.
        lr: learning rate of the first parameter group used for this step (None without optimizer).
        step: optimizer steps taken so far, this one included.
        skip_reason: why the window was skipped (None when it stepped).
    """

    loss: float
    count: float
    samples: int
    micro_steps: int
    skipped: bool
    grad_norm: float | None
    lr: float | None
    step: int
    skip_reason: SkipReason | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Counters:
    """An Accumulator's progress over a run: saved in its state, put back when a window is redone.

    Attributes:
        optimizer_steps: optimizer steps taken (skipped windows not counted).
        skipped_steps: windows dropped (NOTE [ Skipped windows ]).
        consecutive_skips: windows skipped for an inf/NaN loss or gradient since the last step.
        windows: global batches consumed (the data position to resume from).
        samples_seen: samples consumed over all ranks.
    """

    optimizer_steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    windows: int = 0
    samples_seen: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Counters:
        """The counters of a saved state (``consecutive_skips`` is 0 in states saved before it existed)."""
        return cls(
            optimizer_steps=int(d["optimizer_steps"]),
            skipped_steps=int(d["skipped_steps"]),
            consecutive_skips=int(d.get("consecutive_skips", 0)),
            windows=int(d["windows"]),
            samples_seen=int(d["samples_seen"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowProgress:
    """How far a window got: which window, and how many of its micro-steps were backpropagated.

    Attributes:
        window: the window's index (``Accumulator.windows`` when it started).
        backpropagated: micro-steps whose backward finished; ``micro_steps`` from the moment the
            last one finished (the optimizer boundary).
        micro_steps: micro-steps in the window (``k``).
    """

    window: int
    backpropagated: int
    micro_steps: int

    @property
    def at_boundary(self) -> bool:
        """True once every micro-step was backpropagated (the optimizer boundary runs or ran)."""
        return self.backpropagated >= self.micro_steps

    def describe(self) -> str:
        """``"micro-step i of k"`` (1-based: the one that was running) or ``"optimizer step"``.

        >>> WindowProgress(window=0, backpropagated=1, micro_steps=4).describe()
        'micro-step 2 of 4'
        """
        if self.at_boundary:
            return "optimizer step"
        return f"micro-step {self.backpropagated + 1} of {self.micro_steps}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Mark:
    """What :meth:`Accumulator.rewind` puts back: counters, last result and every RNG, as at a boundary.

    Attributes:
        counters: the Accumulator's counters.
        last_result: its last window's result.
        rng: the global random number generators (torch CPU and CUDA, Python, NumPy).
    """

    counters: Counters
    last_result: StepResult | None
    rng: RngSnapshot
