"""A profiled step's seconds as parts that add up to the step: the blocks' forward and backward, the
rest of the forward and backward (embeddings, head, loss), and the rest of the step (optimizer).

NOTE [ Per-block seconds add up to the step ]

:func:`memfit.profiling.profile` times a block's forward from its forward pre-hook to its forward
hook, and its backward from the first gradient of its outputs to the last gradient of its inputs and
parameters, in *time passes*: plain steps without the optimizer (medians over repeats, with the
forward and backward totals of the same passes). The whole step, optimizer included, is timed apart
(``Stats.step_s``). So the step splits into

    step_s = blocks' forward + blocks' backward
           + outside the blocks   (Stats.fwd_s + Stats.bwd_s - the blocks': embeddings, head, loss)
           + the rest             (step_s - Stats.fwd_s - Stats.bwd_s: the optimizer step, zero_grad)

which holds exactly, each part being a difference of measured medians. What overlaps: blocks run one
after another, so their seconds do not overlap, except where a block's input also feeds a later
block (a skip connection, an encoder's output read by every decoder block): that input's gradient is
complete only after the later block's backward, so the earlier block's backward interval covers it
too, and "outside the blocks" can read below zero by that much. The rest comes from other steps than
the time passes: on a noisy machine it carries the difference of the two measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.capture.stats import Stats

__all__ = ["StepParts", "parts_line", "step_parts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepParts:
    """One profiled step in seconds, by part; :attr:`total_s` is ``step_s``.

    Attributes:
        blocks_fwd_s: the blocks' forward seconds, summed.
        blocks_bwd_s: the blocks' backward seconds (recomputation none: every block kept), summed.
        outside_blocks_s: forward and backward outside the blocks (embeddings, head, loss).
        rest_s: the whole step less its forward and backward (the optimizer step, zero_grad).
        step_s: the whole step (median of whole steps).
    """

    blocks_fwd_s: float
    blocks_bwd_s: float
    outside_blocks_s: float
    rest_s: float
    step_s: float

    @property
    def total_s(self) -> float:
        return self.blocks_fwd_s + self.blocks_bwd_s + self.outside_blocks_s + self.rest_s

    def to_dict(self) -> dict[str, float]:
        return {
            "blocks_fwd_s": self.blocks_fwd_s,
            "blocks_bwd_s": self.blocks_bwd_s,
            "outside_blocks_s": self.outside_blocks_s,
            "rest_s": self.rest_s,
            "step_s": self.step_s,
        }


def step_parts(stats: Stats) -> StepParts:
    """The parts of ``stats``' step (NOTE [ Per-block seconds add up to the step ])."""
    fwd = sum(b.fwd_s for b in stats.blocks)
    bwd = sum(b.bwd_s for b in stats.blocks)
    return StepParts(
        blocks_fwd_s=fwd,
        blocks_bwd_s=bwd,
        outside_blocks_s=(stats.fwd_s - fwd) + (stats.bwd_s - bwd),
        rest_s=stats.step_s - stats.fwd_s - stats.bwd_s,
        step_s=stats.step_s,
    )


def parts_line(parts: StepParts) -> str:
    """The parts in milliseconds as a sum that adds up as printed: the step and the first three parts
    rounded to 0.1 ms, the rest written as what they leave (so it is within 0.2 ms of its own value)."""
    step, f, b, o = (
        round(p * 1e3, 1) for p in (parts.step_s, parts.blocks_fwd_s, parts.blocks_bwd_s, parts.outside_blocks_s)
    )
    r = round(step - f - b - o, 1)
    return (
        f"step {step:.1f} ms = blocks {f:.1f} ms forward + {b:.1f} ms backward + {o:.1f} ms outside the blocks "
        f"(embeddings, head, loss) + {r:.1f} ms rest (optimizer step, zero_grad; timed in other steps than the "
        "blocks, so it also carries the machine's noise)"
    )
