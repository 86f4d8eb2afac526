"""What profiling returns, as data: the report draws these and imports nothing that measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimeline:
    """Live bytes of one training step (all byte counts on the model's device).

    Attributes:
        op_index: per sample, ops the tracker had seen.
        live_bytes: per sample, live tensor bytes.
        phase: per sample, ``forward``, ``backward`` or ``optimizer``.
        grads_bytes: per sample, bytes of gradients that exist.
        params_bytes: parameters and buffers.
        optimizer_bytes: optimizer state.
        peak_bytes: the tracker's peak over the step.
        batch_size: samples in the step.
        micro_batch: samples per micro-step.
        micro_steps: micro-steps (forward and backward passes) in the step.
        time_s: per sample, seconds from the step's start, recorded under the memory tracker
            (which slows each op: the times place samples, they do not time the step); empty
            when not recorded.
    """

    op_index: tuple[int, ...]
    live_bytes: tuple[int, ...]
    phase: tuple[str, ...]
    grads_bytes: tuple[int, ...]
    params_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    batch_size: int
    micro_batch: int
    micro_steps: int
    time_s: tuple[float, ...] = ()

    @property
    def activations_bytes(self) -> tuple[int, ...]:
        """Per sample, live bytes that are not parameters, optimizer state or gradients."""
        base = self.params_bytes + self.optimizer_bytes
        return tuple(max(0, live - base - g) for live, g in zip(self.live_bytes, self.grads_bytes, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "op_index": list(self.op_index),
            "live_bytes": list(self.live_bytes),
            "phase": list(self.phase),
            "grads_bytes": list(self.grads_bytes),
            "params_bytes": self.params_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "peak_bytes": self.peak_bytes,
            "batch_size": self.batch_size,
            "micro_batch": self.micro_batch,
            "micro_steps": self.micro_steps,
            "time_s": list(self.time_s),
        }
