"""The cost model: predicted peak bytes and step seconds of any plan, from measured stats.

NOTE [ Cost model ]
Every block was measured in each mode (``keep``, ``recompute``) in a step where all blocks ran in
that mode (:func:`memfit.capture.profile.profile`). For block ``i`` in option ``o``:

- ``D`` retained bytes: what the block adds to live memory from its forward until its backward;
- ``P`` forward peak above the live bytes at its start;
- ``Q`` backward peak (recompute included) above the live bytes when its output's gradient arrives;
- ``g`` backward base: live bytes at that moment beyond the step's start and the retained
  activations of blocks ``0..i`` (gradients of later blocks, its output's gradient);
- ``extra_s`` seconds added to the step (a recompute is one more forward of the block).

With ``L0`` the live bytes when the first block starts and ``S_k`` the retained bytes of the items
before item ``k``, a plan's events are (relative to ``L0``):

- forward of item ``k``:     ``S_k + P_k`` (``+ g`` of the enclosing segment during its recompute);
- the head (loss, logits):    ``S_N + H``;
- backward of block ``k``:   ``S_k + D_k + g_k + Q_k``;
- a segment ``[s, t)`` keeps only its output (``D`` of its last block in recompute mode) in the
  forward; its forward peak is the largest block forward inside it, with the previous block's
  output alive; in its backward it is recomputed with its inner plan from ``S_s`` (its last
  block's retained bytes stand for its output), the gradient state ``g`` of its last block added
  to the recompute's forward events;

and the constants ``pre`` (before the first block), ``post`` (after the first block's backward:
embeddings and the optimizer step). The predicted peak is the largest event. It is exact for the
two calibration plans (everything kept, everything recomputed) and adds up block by block for
mixed plans; tests compare it with measured peaks on several models.

A relative safety margin (``margin``) is applied when checking a budget and reported with every
plan; the raw prediction is what is compared with measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memfit.apply.engine import _segment_tree
from memfit.capture.profile import Stats
from memfit.plan.types import Action, Plan

DEFAULT_MARGIN = 0.02  # 2 %: measured peaks were within this of predictions on the test models


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionCost:
    """One block in one option: bytes and seconds (see NOTE [ Cost model ])."""

    retained_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    bwd_base_bytes: int
    extra_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainCosts:
    """The cost model's inputs for one chain.

    Attributes:
        names: block names.
        options: per block, option name (``keep``, ``recompute``) -> its cost.
        start_bytes: live bytes when the first block starts (``L0``).
        pre_peak_bytes: peak before the first block.
        head_peak_bytes: peak from the last block's output to its gradient, above the live
            bytes after the last block's forward.
        post_peak_bytes: peak after the first block's backward (embeddings, optimizer).
        base_step_s: measured step time with every block kept.
        segments_allowed: the container can run segments (``nn.Sequential``).
        margin: relative safety margin for budget checks.
    """

    names: tuple[str, ...]
    options: tuple[dict[str, OptionCost], ...]
    start_bytes: int
    pre_peak_bytes: int
    head_peak_bytes: int
    post_peak_bytes: int
    base_step_s: float
    segments_allowed: bool
    margin: float = DEFAULT_MARGIN
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def from_stats(cls, stats: Stats, *, margin: float = DEFAULT_MARGIN) -> ChainCosts:
        """Build the model from a profile with both modes calibrated.

        The recompute time of a block is its forward time scaled so that recomputing every block
        adds what the measured steps say (``step_s_by_mode``). A recompute is one more forward,
        so the scale is kept within [0.5, 2]: on a noisy machine the two measured steps can
        differ by less than the forwards take, and a recompute must never look free.
        """
        fwd_total = sum(b.fwd_s for b in stats.blocks) or 1e-12
        t_keep = stats.step_s_by_mode.get("keep", stats.step_s)
        t_rec = stats.step_s_by_mode.get("recompute")
        measured = (t_rec - t_keep) / fwd_total if t_rec is not None else 1.0
        scale = min(2.0, max(0.5, measured))
        options = []
        for b in stats.blocks:
            opts = {}
            for mode, c in b.modes.items():
                opts[mode] = OptionCost(
                    retained_bytes=c.retained_bytes,
                    fwd_peak_bytes=c.fwd_peak_bytes,
                    bwd_peak_bytes=c.bwd_peak_bytes,
                    bwd_base_bytes=c.bwd_base_bytes,
                    extra_s=0.0 if mode == "keep" else scale * b.fwd_s,
                )
            options.append(opts)
        return cls(
            names=tuple(b.name for b in stats.blocks),
            options=tuple(options),
            start_bytes=stats.start_bytes,
            pre_peak_bytes=stats.pre_peak_bytes,
            head_peak_bytes=stats.head_peak_bytes,
            post_peak_bytes=stats.post_peak_bytes,
            base_step_s=t_keep,
            segments_allowed=stats.sequential,
            margin=margin,
            info={"recompute_time_scale": scale, "recompute_time_scale_measured": measured},
        )

    # --- segment quantities (shared by the simulator and the solver) ----------------------------

    def recompute(self, i: int) -> OptionCost:
        return self.options[i].get("recompute") or self.options[i]["keep"]

    def segment_retained(self, t: int) -> int:
        """Bytes a segment ending before block ``t`` keeps: its output."""
        return self.recompute(t - 1).retained_bytes

    def segment_fwd_peak(self, s: int, t: int) -> int:
        """Forward peak of segment ``[s, t)`` above the live bytes at its start."""
        return max(
            (self.recompute(i - 1).retained_bytes if i > s else 0) + self.recompute(i).fwd_peak_bytes
            for i in range(s, t)
        )

    def segment_grad_base(self, t: int) -> int:
        """Gradient state when a segment ending before block ``t`` starts its backward."""
        return max(o.bwd_base_bytes for o in self.options[t - 1].values())

    def segment_extra_s(self, s: int, t: int) -> float:
        return sum(self.recompute(i).extra_s for i in range(s, t))


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """Predicted whole-step peak (bytes, without margin) and step time (seconds)."""

    peak_bytes: int
    step_s: float
    margin: float
    peak_event: str

    @property
    def peak_with_margin_bytes(self) -> int:
        return math.ceil(self.peak_bytes * (1 + self.margin))


def block_options(plan: Plan) -> list[str]:
    return ["recompute" if b.action is Action.RECOMPUTE else "keep" for b in plan.blocks]


def predict(costs: ChainCosts, plan: Plan) -> Prediction:
    """Predict a plan's peak and step time by walking its events (NOTE [ Cost model ])."""
    opts = block_options(plan)
    if len(opts) != len(costs):
        raise ValueError(f"plan has {len(opts)} blocks, costs {len(costs)}")
    events: list[tuple[int, str]] = [(costs.pre_peak_bytes, "before the first block"), (costs.post_peak_bytes, "embeddings backward / optimizer step")]
    extra = 0.0
    tree = _segment_tree(plan.segments, 0, len(costs))
    l0 = costs.start_bytes

    def item_retained(item: Any) -> int:
        if isinstance(item, int):
            return costs.options[item][opts[item]].retained_bytes
        return costs.segment_retained(item[1])

    def forward(items: Any, base: int, g: int) -> int:
        """Forward of items from live bytes ``base``; returns the live bytes after them."""
        nonlocal extra
        live = base
        for item in items:
            if isinstance(item, int):
                c = costs.options[item][opts[item]]
                events.append((live + g + c.fwd_peak_bytes, f"forward of {costs.names[item]}"))
                extra += c.extra_s
            else:
                s, t, _ = item
                events.append((live + g + costs.segment_fwd_peak(s, t), f"forward of segment {costs.names[s]}..{costs.names[t - 1]}"))
            live += item_retained(item)
        return live

    def backward(items: Any, base: int) -> None:
        """Backward of items whose forward started at live bytes ``base``."""
        nonlocal extra
        prefix = [base]
        for item in items:
            prefix.append(prefix[-1] + item_retained(item))
        for k in reversed(range(len(items))):
            item = items[k]
            if isinstance(item, int):
                c = costs.options[item][opts[item]]
                events.append((prefix[k] + c.retained_bytes + c.bwd_base_bytes + c.bwd_peak_bytes, f"backward of {costs.names[item]}"))
            else:
                s, t, inner = item
                extra += costs.segment_extra_s(s, t)
                # The recompute rebuilds the segment from its input; its last block's retained
                # bytes include the segment's output, so the output is not counted again.
                forward(inner, prefix[k], costs.segment_grad_base(t))
                backward(inner, prefix[k])

    end = forward(tree, l0, 0)
    events.append((end + costs.head_peak_bytes, "loss and head"))
    backward(tree, l0)
    peak, where = max(events, key=lambda e: e[0])
    return Prediction(peak_bytes=int(peak), step_s=costs.base_step_s + extra, margin=costs.margin, peak_event=where)
