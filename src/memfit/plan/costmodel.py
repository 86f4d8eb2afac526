"""The cost model: predicted peak bytes and step seconds of any plan, from measured stats.

size: the NOTE, ChainCosts and predict are one model (what the solver must agree with), read together.

NOTE [ Cost model ]
Every block was measured in each option (``keep``, ``recompute``, ``selective:...``, ``offload``)
in a step where all blocks ran in that option (:func:`memfit.profiling.blocks.profile`). For block
``i`` in option ``o``:

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
- a segment ``[s, t)`` keeps only its output (``D`` of its last block under ``recompute``) in the
  forward; its forward peak is the largest block forward inside it, with the previous block's
  output alive; in its backward it is recomputed with its inner plan from ``S_s`` (its last
  block's retained bytes stand for its output), with the gradients alive when the recompute
  starts added to the recompute's forward events (:meth:`ChainCosts.segment_grad_base`), and the
  generator state it noted at its start (``checkpoint_state_bytes``) alive until its backward ends;
  its recompute adds the forward seconds of its blocks, except those of its last item when that
  item is recomputed on its own (a recomputed block, a nested segment): torch's checkpoint stops
  a recompute once the tensors its backward needs exist, the last item's input (early stop;
  block forwards counted by hooks on GPT-2: a segment of four recomputed blocks runs 7, not 8,
  tests/test_segments.py);

where ``H`` is the head option's (the model's own head, or the chunked loss of
:mod:`memfit.apply.head`, calibrated with every block kept; per option of the blocks, NOTE [ The
head's peak per option ]), and the constants ``pre`` (before the first block), ``post`` (after the first block's backward:
embeddings and the optimizer step). The predicted peak is the largest event. It is exact for the
two calibration plans (everything kept, everything recomputed) and adds up block by block for
mixed plans; tests compare it with measured peaks on several models.

Seconds: ``recompute`` adds the block's forward time scaled by what the two calibration steps
say (see :meth:`ChainCosts.from_stats`). Any other option ``o`` adds its op-level estimate
``rerun_s`` (the ops a selective block re-runs; what an offloaded block moves, at the measured
bandwidth) times a per-option scale ``(step_s[o] - step_s[keep]) / sum_i rerun_s[i]``, so that
the prediction equals the measured step for the calibration plan. The scale is at least 0.5 (a
noisy step must not make an option free) and has no upper bound: the op-level estimate leaves out
the selective-checkpoint modes' Python dispatch (tens of microseconds per op, forward and
recompute) and an offload's synchronisation, which the step measures. On an H200 running
hf:gpt2 (12 x d=256, B=4, T=256) the measured scales of the selective options were 10 to 28 and
offload's 3.7; a cap at 2 made the planner pick selective plans predicted at 1.2x that ran at
2.9x.

Options map to block decisions one to one: ``keep``, ``recompute``, ``offload`` to their decisions;
``selective:<name>`` to ``selective`` with the block's policy (the preset, or the MILP's
``save:`` list for that block); ``keep:tiles-N`` and ``recompute:tiles-N`` to ``keep`` and ``recompute``
with ``tiles`` N over the block's tiled submodules (:mod:`memfit.apply.tiling`), ``recompute:host`` (and
``recompute:tiles-N:host``) to ``recompute`` with ``host_input`` (:mod:`memfit.apply.host_inputs`). Each
was measured in its own calibration step, so it adds up as the others do. Selective, offload, tiled and
host-held options are top-level items only: a segment's blocks are kept or recomputed (the engine
refuses other options inside segments).

A relative safety margin (``margin``) is applied when checking a budget and reported with every
plan; the raw prediction is what is compared with measurements.

NOTE [ The head's peak per option ]
``H`` is measured in each calibration step (every block in one option) and may differ between
them, because some bytes are freed before the head's peak in one option and not in the other.
Measured on a transformers Llama (4 layers, d=256, 2 KV heads, vocabulary 2048, 2 x 256 tokens,
CPU kernels; the same on fake tensors): ``H`` 11,399,176 B with every layer kept, 11,536,392 B
with every layer recomputed (+137,216 B): with every layer kept, the causal mask and the other
model-level inputs of the layers (133,120 B here; 4,096 B more in the loss's backward) are freed
after the last layer's forward, while a recomputed layer holds them (its recorded arguments) until
its backward. The KV cache transformers fills by default (``use_cache=True``: two ``torch.cat``
outputs per layer) is held by the model's output alone and freed when the loss drops it; it is
counted as each layer's forward-only bytes in either option (NOTE [ Tensors the forward drops ]),
so it no longer splits ``H`` (it did, by 2,097,152 B here, before those bytes were recorded).
A plan's ``H`` (:meth:`ChainCosts.head_peak_for`) is that of its options' calibration step when
its top-level items all run in one option (a segment counts as ``recompute``: it holds its
arguments), and the largest over its options' steps otherwise. One option alone is then exact
(with one ``H`` for every plan, the largest, that small Llama's keep-all FSDP2 rank is 137 KB
above torch's FSDPMemTracker; per option, 156 B below). A mixed plan holds the mask through its
recomputed layers, so the largest ``H`` is its own: every keep/recompute plan of a 3-layer Llama
(d=64) is predicted to the byte (tests/test_costmodel.py). Stats made before these were recorded
give one ``H`` (the largest, with the most the forwards drop before it) to every plan. The solver searches the plans of each option alone
with that option's ``H`` beside all plans with the largest (:mod:`memfit.plan.solve`): it takes
every plan at the ``H`` :func:`predict` gives it, or above.

NOTE [ Inputs a recompute holds ]
A block run under a checkpoint (recomputed, selective, the first block of a segment) holds its
inputs until its backward. Most inputs are alive then anyway (an op of the block saves them, or
the previous block's output is the next one's saved input), but some are not: a DenseNet's layer
takes the list of every earlier layer's output and saves only their concatenation, so with every
layer kept the forward's end frees the outputs, and the ``keep`` calibration's backward bases
``g`` count them freed. The ``keep`` memory pass records, per block, its inputs that nothing keeps
once the backward starts, by source (``out:K``, block K's output; ``in:I:N``, another tensor first
taken by block I), and :func:`predict` adds to the backward of every top-level item that is not
checkpointed the union of those sources over the checkpointed items before it (the items run under
a checkpoint were calibrated with them held). Measured on a six-layer DenseNet of list-taking
layers (width 16, growth 8, B=4, 32 x 32, CPU): without them one recomputed layer was 3.8 % over its
prediction and a sweep of seven budgets up to 10.1 % over (6.8 % over its budget); with them every
plan of the sweep was predicted to the byte (tests/test_towers.py checks a smaller one). The solver's fronts stay additive; where blocks have such inputs it takes
the cheapest point of its front whose :func:`predict` fits (:mod:`memfit.plan.solve`).

NOTE [ Tensors the forward drops ]
A block's forward can leave tensors alive after it returns that the model's forward drops before
the backward, and that no later block takes: BLOOM's block returns its attention probabilities
beside its output (B x heads x T x T, float32), and its loop holds that tuple until the next block
returns. A kept block saves them for its backward anyway; under a checkpoint they live only until
the next block's forward ends. Counted as retained bytes (what the live bytes grew by when the next
block started), the recompute calibration gave the first and the last block the probabilities'
bytes and the others none (their own in, the previous block's out), so a plan mixing kept and
recomputed blocks was off by them at every backward: BLOOM (4 blocks, width 32, B=4, T=32) measured up to
65,536 B (3.5 %) over its prediction and as much under, and its mid-budget plan failed verify.
The memory pass now follows every storage made from a block's start to the next block's (the
tracker's allocation stream): what is still alive when the backward starts is the block's
retained bytes ``D``; what the next block's start finds alive but the forward drops before the
backward, and no later block takes as an input (those are NOTE [ Inputs a recompute holds ]'s),
is the option's ``fwd_only_bytes``, keyed by the block in whose forward it is dropped (``n``, the
number of blocks: after the last block's forward and before the head's peak, as BLOOM's last two
blocks' probabilities; ``n + 1``: after the head's peak, as the KV cache the model's output holds
until the loss function drops it). :func:`predict` adds to the forward of block ``m`` what the
plan's earlier blocks left alive then (each in its option, a segment's blocks as recomputed:
:func:`fwd_only_alive`); the head's event is ``max(A_n, A_{n+1} + H)`` above the kept bytes, with
``A`` what the plan left alive at the head's start and at its peak and ``H`` measured above the
kept bytes and what was alive at its peak (:func:`_above_kept_by_option`); the backward events hold
none of it. Calibration steps stay exact (the live bytes at each block's start are ``L0 + S_m``
plus that). Every keep/recompute plan of that BLOOM and of GPT-NeoX (whose layers' cache, ``n +
1``, the retained bytes had counted: up to 49,152 B over once the recomputed layers' cache was freed
with the output) is now predicted to the byte; tests/test_costmodel_dropped.py checks a tiny model
of BLOOM's shape (segment plans there: up to 0.6 % below their prediction, a segment's recompute in
the backward; plans with a segment whose blocks are recomputed inside it keep the generator-state
bytes ``ChainCosts`` documents). The solver's fronts leave these bytes out; where there are any it
takes the cheapest point whose :func:`predict` fits (:attr:`ChainCosts.additive`). A segment's
recompute in the backward adds none (that BLOOM's segment plans measured equal to their predictions
without).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from memfit.capture.stats import Stats
from memfit.capture.tracker import generator_state_bytes
from memfit.errors import PlanMismatchError
from memfit.plan.details import TimeScales
from memfit.plan.options import BlockOption
from memfit.plan.segments import segment_tree
from memfit.plan.types import BlockDecision, Option, Plan

SEGMENT_OPTIONS = ("keep", "recompute")
"""The options a block inside a segment can take."""
RECOMPUTE_SCALE_RANGE = (0.5, 8.0)  # H200, small models: 4.6 measured (launch-bound recompute)
OPTION_MIN_SCALE = 0.5

DEFAULT_MARGIN = 0.02  # 2 %: measured peaks were within this of predictions on the test models


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionCost:
    """One block in one option: bytes and seconds (see NOTE [ Cost model ]); ``policy`` is the
    block's save policy for a selective option, ``tiled`` its tiled submodules for a tiled one."""

    retained_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    bwd_base_bytes: int
    extra_s: float
    policy: str | None = None
    tiled: tuple[str, ...] = ()
    fwd_only_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes its forward leaves alive until the forward of a later block (by index; ``n``, the number
    of blocks: the head, before its peak; ``n + 1``: after it) drops them (NOTE [ Tensors the forward
    drops ]); not in ``retained_bytes``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadCost:
    """A head option (NOTE [ Chunked head ] in :mod:`memfit.apply.head`): its ``H`` (the peak of
    the loss and the head above the live bytes after the last block) and the seconds it adds to
    the step with every block kept (:meth:`ChainCosts.from_stats` never makes it negative: the
    model's own head is kept wherever it fits as fast)."""

    peak_bytes: int
    extra_s: float
    peak_bytes_by_option: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainCosts:
    """The cost model's inputs for one chain.

    Attributes:
        names: block names.
        options: per block, option name (``keep``, ``recompute``, ``selective:<name>``,
            ``offload``) -> its cost.
        start_bytes: live bytes when the first block starts (``L0``).
        pre_peak_bytes: peak before the first block.
        head_peak_bytes: peak from the last block's output to its gradient, above the live
            bytes after the last block's forward (the largest over the calibration steps).
        head_peak_bytes_by_option: the same in each calibration step, keyed by the option every
            block ran in (empty: unknown; NOTE [ The head's peak per option ]).
        post_peak_bytes: peak after the first block's backward (embeddings, optimizer).
        base_step_s: measured step time with every block kept.
        segments_allowed: the profile found blocks segments can hold (``Stats.segment_spans``).
        segment_spans: where segments may lie: ``(start, stop)`` block ranges, one per container
            that can run them (a segment never crosses two); None: the whole chain.
        margin: relative safety margin for budget checks.
        head_options: the calibrated head options besides the model's own head (whose ``H`` is
            ``head_peak_bytes``); see :meth:`with_head`.
        head: the head option these costs stand for (None: the model's own).
        activations: the activation option the costs were measured with (``"fused"``, see
            :mod:`memfit.apply.activations`; None: the model's own); plans made from them carry it.
        recompute_gathered_bytes: per block, the bytes a segment's recompute gathers for it and
            keeps until the block's backward ends (FSDP2 with reshard-after-forward: the block's
            unit, NOTE [ Per-rank accounting ] in :mod:`memfit.plan.parallel`); empty: none.
        checkpoint_state_bytes: bytes a segment keeps besides its output until its backward ends:
            the generator state noted at its start (NOTE [ Generator states are counted ] in
            :mod:`memfit.apply.state`; 5,056 on the CPU, 0 on CUDA). A recomputed block's is part
            of its measured ``retained_bytes``; a segment's blocks are measured one by one. Counted
            once inside nested segments (as the solver does): a nested segment that starts after
            its parent's first block keeps one more, so such plans are predicted that many bytes
            low (5,056 per level on the CPU; tests/test_costmodel.py).
    """

    names: tuple[str, ...]
    options: tuple[dict[str, OptionCost], ...]
    start_bytes: int
    pre_peak_bytes: int
    head_peak_bytes: int
    post_peak_bytes: int
    base_step_s: float
    segments_allowed: bool
    segment_spans: tuple[tuple[int, int], ...] | None = None
    margin: float = DEFAULT_MARGIN
    time_scales: TimeScales | None = None
    head_options: dict[str, HeadCost] = field(default_factory=dict)
    head: str | None = None
    activations: str | None = None
    recompute_gathered_bytes: tuple[int, ...] = ()
    head_peak_bytes_by_option: dict[str, int] = field(default_factory=dict)

    def head_peak_for(self, options: set[str]) -> int:
        """``H`` for a plan whose top-level items run in ``options`` (a segment counts as
        ``recompute``): the calibration step's of that option when there is one option, the
        largest over the options' steps when there are several, ``head_peak_bytes`` when one was
        not recorded (NOTE [ The head's peak per option ])."""
        by = self.head_peak_bytes_by_option
        if not options or not options <= by.keys():
            return self.head_peak_bytes
        return max(by[m] for m in options)

    checkpoint_state_bytes: int = 0
    freed_inputs: tuple[dict[str, int], ...] = ()
    """Per block, its inputs that nothing keeps once the backward starts when every block is kept,
    by source, bytes (:attr:`~memfit.capture.stats.BlockStats.freed_inputs`; NOTE [ Inputs a
    recompute holds ]); empty: none."""

    def with_head(self, head: str | None) -> ChainCosts:
        """The costs with head option ``head`` (None: the model's own head) in place of the head.

        Raises:
            PlanMismatchError: the option was not calibrated.
        """
        if head == self.head:
            return self
        if self.head is not None or head not in self.head_options:
            raise PlanMismatchError(
                f"memfit.plan: head option {head!r} was not calibrated for this model (calibrated: "
                f"{sorted(self.head_options) or 'none'}); profile it (memfit plan does) or plan without it."
            )
        hc = self.head_options[head]
        return replace(
            self, head_peak_bytes=hc.peak_bytes, head_peak_bytes_by_option=dict(hc.peak_bytes_by_option),
            base_step_s=self.base_step_s + hc.extra_s, head_options={}, head=head,
        )  # fmt: skip

    def head_choices(self) -> list[ChainCosts]:
        """These costs with each head option (the model's own first)."""
        return [self, *(self.with_head(h) for h in self.head_options)] if self.head is None else [self]

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def from_stats(cls, stats: Stats, *, margin: float = DEFAULT_MARGIN) -> ChainCosts:
        """Build the model from a profile with its options calibrated.

        The recompute time of a block is its forward time scaled so that recomputing every block
        adds what the measured steps say (``step_s_by_option``). A recompute is one more forward,
        so the scale is at least 0.5: on a noisy machine the two measured steps can differ by
        less than the forwards take, and a recompute must never look free. It may exceed 1 (on a
        GPU, small blocks recompute launch-bound: 4.6 was measured on an H200) up to 8, which
        bounds what one noisy measurement can do. Other
        options scale their op-level estimates by their own measured step, at least 0.5 and
        without an upper bound (NOTE [ Cost model ]).
        """
        t_keep = stats.step_s_by_option.get("keep", stats.step_s)
        scale, measured = _recompute_scale(stats, t_keep)
        option_scale, option_scale_measured = _option_scales(stats, t_keep)
        options = _option_costs(stats, scale, option_scale)
        return cls(
            names=tuple(b.name for b in stats.blocks),
            options=tuple(options),
            start_bytes=stats.start_bytes + stats.device_overhead_bytes,
            pre_peak_bytes=stats.pre_peak_bytes + stats.device_overhead_bytes,
            head_peak_bytes=_above_kept(stats.head_peak_bytes, stats.head_peak_bytes_by_option, options),
            head_peak_bytes_by_option=_above_kept_by_option(stats.head_peak_bytes_by_option, options),
            post_peak_bytes=stats.post_peak_bytes + stats.device_overhead_bytes,
            base_step_s=t_keep,
            segments_allowed=stats.sequential,
            segment_spans=stats.segment_spans,
            margin=margin,
            time_scales=TimeScales(
                recompute_time_scale=scale,
                recompute_time_scale_measured=measured,
                head_extra_s_measured={name: h.step_s - t_keep for name, h in stats.head_options.items()},
                time_scale_by_option={m: option_scale[m] for m in option_scale_measured},
                time_scale_measured_by_option=option_scale_measured,
            ),
            # A head option's measured time difference is used only when it is a cost: a head option
            # changes what the model returns (no logits), so a noisy "faster" must not make the
            # solver choose it where the model's own head fits.
            head_options={
                name: HeadCost(
                    peak_bytes=_above_kept(h.head_peak_bytes, h.head_peak_bytes_by_option, options),
                    extra_s=max(0.0, h.step_s - t_keep),
                    peak_bytes_by_option=_above_kept_by_option(h.head_peak_bytes_by_option, options),
                )
                for name, h in stats.head_options.items()
            },
            activations=stats.activations,
            recompute_gathered_bytes=_recompute_gathered(stats),
            checkpoint_state_bytes=generator_state_bytes(stats.device),
            freed_inputs=tuple(dict(b.freed_inputs) for b in stats.blocks)
            if any(b.freed_inputs for b in stats.blocks)
            else (),
        )

    def restricted(
        self, options: tuple[str, ...] | None = None, *, block_only: bool = False, heads: bool = True
    ) -> ChainCosts:
        """The same chain with only some options per block (``block_only``: keep and recompute),
        and without head options unless ``heads``."""
        keep = set(SEGMENT_OPTIONS if block_only else options or ())
        return replace(
            self,
            options=tuple({k: v for k, v in o.items() if k in keep} for o in self.options),
            head_options=self.head_options if heads else {},
        )

    def decision(self, i: int, option: str) -> BlockDecision:
        """The block decision an option stands for (a tiled option on a block without tiled
        submodules: the block untiled, as it was measured)."""
        opt = BlockOption.parse(option)
        oc = self.options[i][option]
        policy = (oc.policy or opt.variant) if opt.kind is Option.SELECTIVE else None
        tiled = oc.tiled if opt.tiles is not None else ()
        return BlockDecision(
            name=self.names[i], option=opt.kind, policy=policy, tiles=opt.tiles if tiled else None, tiled=tuple(tiled),
            host_input=opt.host,
        )  # fmt: skip

    def option_of(self, i: int, decision: BlockDecision) -> str:
        """The option of block ``i`` a decision stands for.

        Raises:
            PlanMismatchError: no calibrated option matches (a selective policy the profile did
                not measure, or offload on a profile without it).
        """
        if decision.option is not Option.SELECTIVE:
            want = BlockOption(decision.option, tiles=decision.tiles, host=decision.host_input).name
            if want in self.options[i]:
                return want
            for name, oc in self.options[i].items():  # a tiled option measured untiled on this block
                opt = BlockOption.parse(name)
                if opt.kind is decision.option and opt.host == decision.host_input and decision.tiles is None:
                    if opt.tiles is not None and not oc.tiled:
                        return name
        else:
            for name, oc in self.options[i].items():
                opt = BlockOption.parse(name)
                if opt.kind is Option.SELECTIVE and (oc.policy or opt.variant) == decision.policy:
                    return name
        have = ", ".join(
            f"{k} ({v.policy})" if v.policy and v.policy != BlockOption.parse(k).variant else k
            for k, v in self.options[i].items()
        )
        what = (
            f"'selective' with policy {decision.policy!r}"
            if decision.option is Option.SELECTIVE
            else repr(BlockOption(decision.option, tiles=decision.tiles, host=decision.host_input).name)
        )
        raise PlanMismatchError(
            f"memfit.plan: block {self.names[i]} is {what}, which the profile did not calibrate "
            f"(calibrated: {have}). Profile with that option (memfit.profiling.blocks.profile(..., "
            "options=(..., 'selective:PRESET'))) or plan again."
        )

    # --- segment quantities (shared by the simulator and the solver) ----------------------------

    def recompute(self, i: int) -> OptionCost:
        return self.options[i].get("recompute") or self.options[i]["keep"]

    def segment_retained(self, t: int) -> int:
        """Bytes a segment ending before block ``t`` keeps: its output."""
        return self.recompute(t - 1).retained_bytes

    def segment_fwd_peak(self, s: int, t: int, dropped: tuple[int, ...] = ()) -> int:
        """Forward peak of segment ``[s, t)`` above the live bytes at its start; ``dropped``: per
        block, the bytes earlier forwards left alive at its start that a later one drops
        (:func:`fwd_only_alive`; NOTE [ Tensors the forward drops ])."""
        return max(
            (self.recompute(i - 1).retained_bytes if i > s else 0)
            + self.recompute(i).fwd_peak_bytes
            + (dropped[i] if dropped else 0)
            for i in range(s, t)
        )

    @property
    def additive(self) -> bool:
        """Whether a plan's peak is the solver's additive excess: no block has inputs a recompute
        holds (NOTE [ Inputs a recompute holds ]) and no forward leaves tensors a later one drops
        (NOTE [ Tensors the forward drops ]); else the solver checks its answer with :func:`predict`."""
        return not self.freed_inputs and not any(oc.fwd_only_bytes for o in self.options for oc in o.values())

    def segment_grad_base(self, t: int) -> int:
        """Live bytes beyond the segment's start while a segment ending before block ``t`` is
        recomputed: the gradient state ``g`` of its last block, its output's gradient (the
        output's retained bytes stand for it), and the gradients of the last block's final ops
        that need no saved tensor (a residual add, a scale), computed before the first op that
        does starts the recompute. That last part is taken from the recompute calibration: its
        backward peak above the block's kept forward peak (the recompute with those gradients
        alive), at least 0."""
        opts = self.options[t - 1]
        base = max(opts[k].bwd_base_bytes for k in SEGMENT_OPTIONS if k in opts)
        rec, keep = opts.get("recompute"), opts.get("keep")
        trailing = max(0, rec.bwd_peak_bytes - keep.fwd_peak_bytes) if rec is not None and keep is not None else 0
        return base + self.segment_retained(t) + trailing

    def gathered(self, s: int, t: int | None = None) -> int:
        """Bytes a segment's recompute gathers for block ``s`` (or blocks ``s .. t-1``) and keeps
        until each block's backward ends (:attr:`recompute_gathered_bytes`)."""
        g = self.recompute_gathered_bytes
        return sum(g[s : s + 1 if t is None else t]) if g else 0

    def recompute_held(self, i: int, start: int) -> int:
        """Bytes of block ``i``'s backward peak that a recompute of the segment starting at block
        ``start`` already counts as gathered: its own unit, and the unit before it (which FSDP2
        prefetches in backward) when that one is in the segment too."""
        return self.gathered(i) + (self.gathered(i - 1) if i > start else 0)

    def segment_extra_s(self, s: int, t: int) -> float:
        return sum(self.recompute(i).extra_s for i in range(s, t))


def _recompute_scale(stats: Stats, t_keep: float) -> tuple[float, float]:
    """The factor on a block's forward time that a recompute costs (within
    :data:`RECOMPUTE_SCALE_RANGE`), and the one measured: recomputing every block adds what the
    measured steps say (:meth:`ChainCosts.from_stats`)."""
    fwd_total = sum(b.fwd_s for b in stats.blocks) or 1e-12
    t_rec = stats.step_s_by_option.get("recompute")
    measured = (t_rec - t_keep) / fwd_total if t_rec is not None else 1.0
    lo, hi = RECOMPUTE_SCALE_RANGE
    return min(hi, max(lo, measured)), measured


def _option_scales(stats: Stats, t_keep: float) -> tuple[dict[str, float], dict[str, float]]:
    """Per option other than keep and recompute, the factor on its op-level re-run estimate (at
    least :data:`OPTION_MIN_SCALE`; 1 where not measured), and the ones measured."""
    option_scale: dict[str, float] = {}
    option_scale_measured: dict[str, float] = {}
    for name in stats.blocks[0].options if stats.blocks else ():
        if name in ("keep", "recompute"):
            continue
        est = sum(b.options[name].rerun_s for b in stats.blocks if name in b.options)
        t_opt = stats.step_s_by_option.get(name)
        if est <= 0 or t_opt is None:
            option_scale[name] = 1.0
            continue
        m = (t_opt - t_keep) / est
        option_scale[name] = max(OPTION_MIN_SCALE, m)
        option_scale_measured[name] = m
    return option_scale, option_scale_measured


def _option_costs(stats: Stats, scale: float, option_scale: dict[str, float]) -> list[dict[str, OptionCost]]:
    """Per block, the cost of each option profiled, its seconds scaled as measured."""
    options = []
    for b in stats.blocks:
        opts = {}
        for name, c in b.options.items():
            if name == "keep":
                extra = 0.0
            elif name == "recompute":
                extra = scale * b.fwd_s
            else:
                extra = option_scale.get(name, 1.0) * c.rerun_s
            opts[name] = OptionCost(
                retained_bytes=c.retained_bytes,
                fwd_peak_bytes=c.fwd_peak_bytes,
                bwd_peak_bytes=c.bwd_peak_bytes,
                bwd_base_bytes=c.bwd_base_bytes,
                extra_s=extra,
                policy=c.policy,
                tiled=tuple(c.tiled),
                fwd_only_bytes=dict(c.fwd_only_bytes),
            )
        options.append(opts)
    return options


def _above_kept_by_option(peaks: dict[str, int], options: list[dict[str, OptionCost]]) -> dict[str, int]:
    """The head's peak of each calibration step above what its blocks keep and what their forwards
    left alive through it: measured above the live bytes after the last block, which also hold
    what the forward drops before the head's peak (NOTE [ Tensors the forward drops ]); the same
    where there is none."""
    n = len(options)
    return {m: h + sum(o[m].fwd_only_bytes.get(n, 0) for o in options if m in o) for m, h in peaks.items()}


def _above_kept(peak: int, peaks: dict[str, int], options: list[dict[str, OptionCost]]) -> int:
    """The largest of :func:`_above_kept_by_option` (``peak``, the largest measured, at least).
    Without the steps' own peaks (stats written before they were recorded) ``peak`` is one of the
    steps', not known which: it gets the largest of their forwards' dropped bytes, on the safe side."""
    if peaks:
        return max(peak, *_above_kept_by_option(peaks, options).values())
    return peak + max(
        _above_kept_by_option(dict.fromkeys(options[0] if options else (), 0), options).values(), default=0
    )


def _recompute_gathered(stats: Stats) -> tuple[int, ...]:
    """FSDP2 rank Stats with reshard-after-forward: each block's unit, gathered again by a
    segment's recompute (NOTE [ Segments under FSDP2 ] in :mod:`memfit.apply.segments`); else ()."""
    par = stats.calibration.parallel
    if par is None or par.layout.get("kind") != "fsdp2" or not par.layout.get("reshard_after_forward", True):
        return ()
    return tuple(par.memory["unit_unsharded_bytes"][: len(stats.blocks)])


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """Predicted whole-step peak (bytes, without margin) and step time (seconds)."""

    peak_bytes: int
    step_s: float
    margin: float
    peak_event: str
    peak_kept_bytes: int = 0
    """Of ``peak_bytes``, the activations blocks hold at the peak event above the step's start
    (``L0``): kept until their backward, or rebuilt by a recompute; the rest above ``L0`` is the
    event's working set (the HTML report splits the peak by it)."""

    @property
    def peak_with_margin_bytes(self) -> int:
        return math.ceil(self.peak_bytes * (1 + self.margin))


def block_options(plan: Plan, costs: ChainCosts) -> list[str]:
    """The option of each block of a plan (see :meth:`ChainCosts.option_of`)."""
    return [costs.option_of(i, b) for i, b in enumerate(plan.blocks)]


def _top_level_options(tree: Any, opts: list[str]) -> set[str]:
    """The options the top-level items of a plan's segment tree run in (a segment: ``recompute``)."""
    return {opts[item] if isinstance(item, int) else "recompute" for item in tree}


def held_inputs_bytes(costs: ChainCosts, tree: Any, opts: list[str]) -> tuple[int, ...]:
    """Per top-level item of a plan, the bytes its backward has alive beyond what its calibration
    counted: inputs that the items before it which run under a checkpoint (recomputed, selective,
    segments) hold until their backward and that the ``keep`` calibration saw freed when the
    forward returned (NOTE [ Inputs a recompute holds ]). Items that run under a checkpoint were
    calibrated with those inputs held: 0 for them; () when no block has such inputs."""
    if not costs.freed_inputs:
        return ()
    out: list[int] = []
    held: dict[str, int] = {}
    for item in tree:
        first = item if isinstance(item, int) else item[0]
        checkpointed = not isinstance(item, int) or BlockOption.parse(opts[item]).kind in (
            Option.RECOMPUTE, Option.SELECTIVE,
        )  # fmt: skip
        out.append(0 if checkpointed else sum(held.values()))
        if checkpointed:
            held.update(costs.freed_inputs[first])
    return tuple(out)


def fwd_only_alive(costs: ChainCosts, tree: Any, opts: list[str]) -> tuple[int, ...]:
    """Per block ``m``, the bytes the forwards of the blocks before it left alive when it starts,
    which a later forward drops (NOTE [ Tensors the forward drops ]): of each top-level block in
    its option, of a segment's blocks as recomputed; then those alive when the head starts
    (``m = n``) and at the head's peak (``m = n + 1``). () when there are none."""
    n = len(costs)
    diff = [0] * (n + 3)
    for item in tree:
        blocks = [(item, opts[item])] if isinstance(item, int) else [(i, None) for i in range(item[0], item[1])]
        for k, opt in blocks:
            oc = costs.options[k][opt] if opt is not None else costs.recompute(k)
            for w, nbytes in oc.fwd_only_bytes.items():
                diff[k + 1] += nbytes
                diff[min(w, n + 1) + 1] -= nbytes
    if not any(diff):
        return ()
    out, acc = [], 0
    for m in range(n + 2):
        acc += diff[m]
        out.append(acc)
    return tuple(out)


def predict(costs: ChainCosts, plan: Plan) -> Prediction:
    """Predict a plan's peak and step time by walking its events (NOTE [ Cost model ]).

    Raises:
        PlanMismatchError: the plan has another number of blocks, or a decision the costs have
            no option for.
    """
    if len(plan.blocks) != len(costs):
        raise PlanMismatchError(f"memfit.plan: the plan has {len(plan.blocks)} blocks, the cost model {len(costs)}.")
    costs = costs.with_head(plan.head)
    opts = block_options(plan, costs)
    tree = segment_tree(plan.segments, 0, len(costs))
    walk = _EventWalk(costs, opts, dropped=fwd_only_alive(costs, tree, opts))
    l0 = costs.start_bytes
    end = walk.forward(tree, l0, 0)
    dropped = walk.dropped
    h = costs.head_peak_for(_top_level_options(tree, opts))
    head = max(dropped[-2], dropped[-1] + h) if dropped else h
    walk.events.append((end + head, "loss and head", end - l0))
    walk.backward(tree, l0, held=held_inputs_bytes(costs, tree, opts))
    peak, where, kept = max(walk.events, key=lambda e: e[0])
    return Prediction(
        peak_bytes=int(peak), step_s=costs.base_step_s + walk.extra_s, margin=costs.margin, peak_event=where,
        peak_kept_bytes=max(0, int(kept)),
    )  # fmt: skip


class _EventWalk:
    """The events of a plan's step, walked forward and backward through its segment tree by
    :func:`predict`: ``(live bytes, where, bytes blocks hold above L0)``, and the seconds the plan adds."""

    __slots__ = ("costs", "dropped", "events", "extra_s", "l0", "opts")

    def __init__(self, costs: ChainCosts, opts: list[str], *, dropped: tuple[int, ...]) -> None:
        self.costs = costs
        self.opts = opts
        self.dropped = dropped  # NOTE [ Tensors the forward drops ]: top-level forward only
        self.l0 = costs.start_bytes
        self.events: list[tuple[int, str, int]] = [
            (costs.pre_peak_bytes, "before the first block", 0),
            (costs.post_peak_bytes, "embeddings backward / optimizer step", 0),
        ]
        self.extra_s = 0.0

    def item_retained(self, item: Any, inside: int | None) -> int:
        """What an item keeps until its backward; ``inside`` a segment's recompute (the
        segment's first block) also the units it gathers there (:attr:`ChainCosts.recompute_gathered_bytes`)."""
        costs, opts = self.costs, self.opts
        if inside is None:
            return (
                costs.options[item][opts[item]].retained_bytes
                if isinstance(item, int)
                else costs.segment_retained(item[1])
            )
        if isinstance(item, int):
            return costs.options[item][opts[item]].retained_bytes + costs.gathered(item)
        return costs.segment_retained(item[1]) + costs.gathered(item[0], item[1])

    def forward(self, items: Any, base: int, g: int, inside: int | None = None) -> int:
        """Forward of items from live bytes ``base``; returns the live bytes after them."""
        costs, dropped, l0 = self.costs, self.dropped, self.l0
        live = base
        for item in items:
            if isinstance(item, int):
                c = costs.options[item][self.opts[item]]
                # Inside a recompute the block's forward peak (which counts its unit gathered twice,
                # as FSDP2's forward keeps the all-gather output) holds the unit once.
                own = costs.gathered(item) if inside is not None else 0
                held = dropped[item] if dropped and inside is None else 0
                self.events.append(
                    (live + g + c.fwd_peak_bytes - own + held, f"forward of {costs.names[item]}", live - l0)
                )
                self.extra_s += c.extra_s
            else:
                s, t, _ = item
                self.events.append(
                    (
                        live + g + costs.segment_fwd_peak(s, t, dropped if inside is None else ()),
                        f"forward of segment {costs.names[s]}..{costs.names[t - 1]}",
                        live - l0,
                    )
                )
            live += self.item_retained(item, inside)
        return live

    def skipped_s(self, inner: Any) -> float:
        """Seconds a segment's recompute does not spend: torch stops it once the tensors its
        backward needs exist, so a last item that is recomputed on its own (a recomputed block,
        a nested segment) is not run by it, only its input."""
        last = inner[-1]
        if isinstance(last, int):
            return self.costs.recompute(last).extra_s if self.opts[last] == "recompute" else 0.0
        return self.costs.segment_extra_s(last[0], last[1])

    def backward(
        self, items: Any, base: int, inside: int | None = None, state: int = 0, held: tuple[int, ...] = ()
    ) -> None:
        """Backward of items whose forward started at live bytes ``base``; ``state``: bytes the
        enclosing segment keeps meanwhile besides its output (its generator state); ``held``: per
        item, inputs checkpoints before it hold (:func:`held_inputs_bytes`, top level only)."""
        costs = self.costs
        prefix = [base]
        for item in items:
            prefix.append(prefix[-1] + self.item_retained(item, inside))
        for k in reversed(range(len(items))):
            item = items[k]
            if isinstance(item, int):
                c = costs.options[item][self.opts[item]]
                held_g = costs.recompute_held(item, inside) if inside is not None else 0
                retained = self.item_retained(item, inside)
                self.events.append(
                    (
                        prefix[k] + state + retained + c.bwd_base_bytes + c.bwd_peak_bytes - held_g
                        + (held[k] if held else 0),
                        f"backward of {costs.names[item]}",
                        prefix[k] + retained - self.l0,
                    )
                )  # fmt: skip
            else:
                s, t, inner = item
                self.extra_s += costs.segment_extra_s(s, t) - self.skipped_s(inner)
                # The recompute rebuilds the segment from its input; its last block's retained
                # bytes include the segment's output, so the output is not counted again.
                self.forward(inner, prefix[k], costs.segment_grad_base(t), inside=s)
                self.backward(inner, prefix[k], inside=s, state=costs.checkpoint_state_bytes)
