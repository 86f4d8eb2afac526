"""What a training run is asked to do (:class:`TrainConfig`) and what it reports (:class:`TrainResult`).

``memfit train`` builds a :class:`TrainConfig` from its arguments and prints
:meth:`TrainResult.to_dict` under ``--json``; a Python user builds the config directly. Sizes are
bytes, times seconds; human strings ("300MiB", "bf16", "every:2") are parsed by the CLI only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.accumulate import Normalize
from memfit.errors import SpecError
from memfit.plan.parallel import Parallel, ParallelKind
from memfit.plan.policies import Policy
from memfit.plan.types import Plan
from memfit.training.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S
from memfit.training.guard import Replan

DEFAULT_MAX_SKIPS = 5
"""Consecutive windows skipped for a non-finite loss or gradient before the run stops."""

DEFAULT_LR = {"adamw": 3e-4, "adam": 3e-4, "sgd": 0.05}
"""Learning rate of each optimizer when :attr:`TrainConfig.lr` is None."""

PlanSource = Plan | Callable[[nn.Module], Plan]
"""A plan, or a function that makes it from the loaded model (e.g. ``lambda m: policy_plan(m, "all")``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """A training run: global batch, how a window is sized, optimizer, saving and resuming.

    Attributes:
        global_batch: samples per optimizer step, over all ranks.
        steps: optimizer steps in total, counting those of a resumed run.
        micro_batch: samples per micro-step on each rank (None: the rank's whole share).
        budget_bytes: fit micro-batch and checkpoint plan to this peak per rank (``memfit fit``;
            with ``policy``, the micro-batch for that policy's plan); excludes ``micro_batch`` and
            ``plan``.
        min_micro_batch: with ``budget_bytes``: the smallest micro-batch the fit considers (default:
            the smallest the model runs in train mode; BatchNorm refuses 1).
        guard: run every step under the memory tracker with ``budget_bytes`` as its limit (going
            over it counts as out of memory and triggers a replan).
        heads: with ``budget_bytes``: the fit may replace a causal LM's head (chunked loss).
        activations: with ``budget_bytes``: the fit may fuse activation modules.
        max_replans: out-of-memory replans allowed before the run stops.
        plan: a checkpoint plan to apply first (before the model is wrapped for the ranks), or a
            function making it from the loaded model.
        policy: a checkpoint policy (:mod:`memfit.plan.policies`): without ``budget_bytes`` its
            plan is applied first, as ``plan`` would be; with ``budget_bytes`` the fit and every
            replan keep its plan and choose only the micro-batch (``memfit fit --policy``).
            Excludes ``plan``.
        parallel: under ``torchrun``: how the ranks hold the model (DDP or FSDP2 and their options,
            :mod:`memfit.training.distributed`); its ``world_size`` must be the number of
            processes. None: DDP with torch's defaults under ``torchrun``.
        lr: learning rate (None: :data:`DEFAULT_LR`; on resume: replaces the saved one).
        optimizer: ``adamw``, ``adam`` or ``sgd``.
        states: where the model states live and when the optimizer steps (:class:`memfit.optim.ModelStates`:
            ``step-in-backward`` needs a window of one micro-step, no clipping, no float16 GradScaler).
        normalize: loss normalisation (:class:`~memfit.accumulate.Normalize`).
        max_grad_norm: clip the global gradient norm at each step.
        autocast_dtype: autocast the forward in this dtype (float16 adds a GradScaler).
        device: ``auto`` (cuda when available), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: with a workload spec: load the model in this dtype; batches are cast to it.
        seq_len: with a workload spec: its sequence length in tokens.
        seed: seed of weights (spec), data and dropout.
        resume: continue from a state saved with ``save``.
        save: save the training state here at the end, on SIGINT/SIGTERM and every ``save_every``.
        save_every: with ``save``: also save every N optimizer steps.
        max_skips: stop after N consecutive windows skipped for a NaN/inf loss or gradient.
        progress_jsonl: append one JSON line per step (loss, skip reason, tracked peak, RSS);
            a write that fails (a full disk) is warned about once and the log stops, the run goes on.
        collective_timeout_s: under ``torchrun``, the longest wait for the other ranks at one
            collective (NOTE [ Bounded collectives ] in :mod:`memfit.training.distributed`).
    """

    global_batch: int
    steps: int
    micro_batch: int | None = None
    budget_bytes: int | None = None
    min_micro_batch: int | None = None
    guard: bool = False
    heads: bool = True
    activations: bool = True
    max_replans: int = 3
    plan: PlanSource | None = None
    policy: Policy | None = None
    parallel: Parallel | None = None
    lr: float | None = None
    optimizer: str = "adamw"
    states: str = "device"
    normalize: Normalize | str = Normalize.AUTO
    max_grad_norm: float | None = None
    autocast_dtype: torch.dtype | None = None
    device: str = "auto"
    dtype: torch.dtype | None = None
    seq_len: int | None = None
    seed: int = 0
    resume: str | None = None
    save: str | None = None
    save_every: int | None = None
    max_skips: int = DEFAULT_MAX_SKIPS
    progress_jsonl: str | None = None
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    def check(self, world_size: int) -> None:
        """Refuse a config that cannot run, before any work.

        Raises:
            SpecError: with the option to change.
        """
        if self.global_batch < world_size:
            raise SpecError(
                f"memfit.training: --global-batch {self.global_batch} is smaller than the {world_size} ranks; "
                f"give every rank at least one sample (--global-batch >= {world_size})."
            )
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            raise SpecError(
                f"memfit.training: --micro-batch {self.micro_batch} is larger than --global-batch {self.global_batch}. "
                "Use --micro-batch <= --global-batch (or leave it out: no accumulation)."
            )
        if self.micro_batch is not None and self.budget_bytes is not None:
            raise SpecError(
                "memfit.training: give --micro-batch or --budget, not both (--budget chooses the micro-batch)."
            )
        if self.min_micro_batch is not None and self.budget_bytes is None:
            raise SpecError(
                "memfit.training: --min-micro-batch bounds the micro-batches --budget's fit considers; give --budget SIZE "
                "too, or set the micro-batch yourself with --micro-batch."
            )
        if self.guard and self.budget_bytes is None:
            raise SpecError(
                "memfit.training: --guard enforces --budget; give --budget SIZE too (e.g. --budget 300MiB --guard)."
            )
        if self.plan is not None and self.budget_bytes is not None:
            raise SpecError(
                "memfit.training: give --plan or --budget, not both (--budget chooses the plan; to keep a policy's plan and fit "
                "the micro-batch to the budget, give --policy P with --budget)."
            )
        if self.plan is not None and self.policy is not None:
            raise SpecError(
                f"memfit.training: give --plan or --policy {self.policy}, not both (each names the plan to apply)."
            )
        if self.parallel is not None:
            self._check_parallel(self.parallel, world_size)
        # the host optimizer takes accumulation and clipping (fp16's GradScaler is refused by the Accumulator)
        if self.states == "step-in-backward":
            self._check_states()
        if not (self.collective_timeout_s > 0 and math.isfinite(self.collective_timeout_s)):
            raise SpecError(
                f"memfit.training: collective_timeout_s={self.collective_timeout_s} must be a number of seconds > 0, e.g. 300."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 2**63 - 1:
            raise SpecError(
                f"memfit.training: seed {self.seed!r} is not a whole number from 0 to 2**63 - 1 (what torch's "
                "generators take); give --seed N in that range, e.g. --seed 0."
            )
        if self.save_every is not None and not self.save:
            raise SpecError(
                f"memfit.training: --save-every {self.save_every} needs a file to save to; give --save PATH too."
            )

    def _check_states(self) -> None:
        """What the step inside the backward cannot do (:mod:`memfit.optim.in_backward`), refused before any work."""
        fix = "or leave out --states step-in-backward"
        if self.micro_batch is not None and self.micro_batch < self.global_batch:
            raise SpecError(
                f"memfit.training: --micro-batch {self.micro_batch} makes windows of several micro-steps, and with "
                f"--states {self.states} the optimizer steps inside each backward. Leave out --micro-batch, {fix}."
            )
        if self.max_grad_norm is not None:
            raise SpecError(
                f"memfit.training: --max-grad-norm needs every gradient before any step, and with --states "
                f"{self.states} the optimizer steps inside the backward. Leave out --max-grad-norm, {fix}."
            )
        if self.autocast_dtype is torch.float16:
            raise SpecError(
                f"memfit.training: --amp fp16's GradScaler checks the gradients before the step, and with --states "
                f"{self.states} the step runs inside the backward. Use --amp bf16, {fix}."
            )

    def _check_parallel(self, parallel: Parallel, world_size: int) -> None:
        kind = parallel.kind.value
        if world_size <= 1:
            raise SpecError(
                f"memfit.training: --parallel {kind} needs several processes and this is one; launch it with "
                f"torchrun --nproc-per-node {max(2, parallel.world_size)} -m memfit.cli.main train ... (or leave out --parallel)."
            )
        if parallel.world_size != world_size:
            raise SpecError(
                f"memfit.training: the layout is for --world-size {parallel.world_size} and torchrun started {world_size} "
                f"processes; launch with torchrun --nproc-per-node {parallel.world_size} (or give --world-size {world_size})."
            )
        if self.budget_bytes is not None:
            raise SpecError(
                f"memfit.training: --budget fits one process, not one rank of a --parallel {kind} job; plan per rank with "
                f"`memfit plan --world-size {world_size} --parallel {kind} --budget SIZE --out PLAN.json` and train with --plan PLAN.json."
            )
        if parallel.kind is ParallelKind.FSDP2 and self.autocast_dtype is torch.float16:
            raise SpecError(
                "memfit.training: --amp fp16 under --parallel fsdp2 needs a sharded GradScaler, which memfit train does not "
                "set up yet; use --amp bf16 (no scaler) or --parallel ddp."
            )

    @property
    def learning_rate(self) -> float:
        """:attr:`lr`, or the optimizer's default."""
        return self.lr if self.lr is not None else DEFAULT_LR.get(self.optimizer, 3e-4)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    """What a run did: steps, losses, memory and speed against the predictions (``--json``).

    Attributes:
        ok: the run reached ``steps`` (False: it stopped early, see :attr:`stopped`).
        model: the workload's name.
        world_size: processes (ranks).
        rank: this process's rank (not in :meth:`to_dict`).
        global_batch: samples per optimizer step over all ranks.
        micro_batch: samples per micro-step at the end (a replan may lower it).
        accumulation_steps: micro-steps per window on this rank at the end.
        steps: the optimizer steps asked for.
        start_step: windows done before this run (resume).
        end_step: windows done at the end.
        optimizer_steps: windows that stepped the optimizer.
        skipped_steps: windows skipped (no tokens, non-finite loss or gradient).
        skip_reasons: skipped windows per reason.
        consecutive_skips: skipped windows in a row at the end.
        max_skips: the limit of consecutive skips.
        lr: learning rate at the end.
        lr_saved: the resumed state's learning rate (None without resume).
        replan_events: every out-of-memory replan.
        losses: the loss of every window of this run.
        samples_per_s: global batch / median step seconds (None: no timed step).
        step_s: median seconds of the timed steps.
        peak_bytes: the highest measured peak of the run.
        peak_measured_by: how peaks were measured.
        predicted_peak_bytes: the current choice's predicted peak.
        measured_peak_bytes: the measured peak under the current choice.
        peak_drift: measured / predicted peak - 1.
        predicted_step_s: the current choice's predicted seconds per step.
        measured_step_s: median seconds per step under the current choice.
        time_drift: measured / predicted step time - 1.
        guard_ops_per_step: ops the tracker saw in a step (guard only).
        budget_bytes: the planning budget asked for.
        guard: the tracker enforced the budget on every step.
        parallel: the layout of the ranks (``Parallel.to_dict()``; None: one process, or DDP
            with torch's defaults).
        measured_peak_bytes_by_rank: each rank's measured peak under the current choice (rank
            order; None where unmeasured).
        collective_held_bytes_by_rank: of each rank's measured peak, the bytes of buffers that a
            collective's thread (gloo) freed after the main thread had gone on: a timing-dependent
            part no prediction counts (FSDP2 ranks on CPU; None elsewhere; NOTE [ Buffers a
            collective's thread frees ] in :mod:`memfit.training.distributed`).
        policy: the plan's policy at the end.
        recomputed_blocks: blocks not kept by that plan.
        head: its head option.
        activations: its activations option.
        normalize: the loss normalisation.
        saved_to: where the state was saved (None: nothing saved).
        saved_step: the step of the last save.
        warnings: every warning of the run, in order.
        stopped: why the run stopped early (``signal``, ``abort``, ``diverged``, ``nonfinite_state``).
        error: the one-line message of that stop.
        exit_code: the exit code ``memfit train`` leaves with (0, 3, 130, 143).
        resume: the ``--resume`` option that continues a stopped run from its save.
    """

    ok: bool
    model: str
    world_size: int
    rank: int = 0
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    steps: int
    start_step: int
    end_step: int
    optimizer_steps: int
    skipped_steps: int
    skip_reasons: dict[str, int]
    consecutive_skips: int
    max_skips: int
    lr: float
    lr_saved: float | None
    replan_events: tuple[Replan, ...]
    losses: tuple[float, ...]
    samples_per_s: float | None
    step_s: float | None
    peak_bytes: int | None
    peak_measured_by: str
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    peak_drift: float | None
    predicted_step_s: float | None
    measured_step_s: float | None
    time_drift: float | None
    guard_ops_per_step: int | None
    budget_bytes: int | None
    guard: bool
    parallel: dict[str, Any] | None
    measured_peak_bytes_by_rank: tuple[int | None, ...]
    collective_held_bytes_by_rank: tuple[int | None, ...] = ()
    policy: str | None
    recomputed_blocks: int
    head: str | None
    activations: str | None
    normalize: str
    saved_to: str | None
    saved_step: int | None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    stopped: str | None = None
    error: str | None = None
    exit_code: int = 0
    resume: str | None = None

    @property
    def replans(self) -> int:
        """Out-of-memory replans."""
        return len(self.replan_events)

    @property
    def final_loss(self) -> float | None:
        """The last window's loss."""
        return self.losses[-1] if self.losses else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON ``memfit train --json`` prints (``stopped``, ``error``, ``exit_code`` and
        ``resume`` only when the run stopped early)."""
        d: dict[str, Any] = {}
        for name in self.__slots__:  # type: ignore[attr-defined]
            if name in ("rank", "stopped", "error", "exit_code", "resume"):
                continue
            if name == "replan_events":
                d["replans"] = self.replans
                d[name] = [r.to_dict() for r in self.replan_events]
            elif name == "losses":
                d["final_loss"] = self.final_loss
                d[name] = list(self.losses)
            elif name == "skip_reasons":
                d[name] = dict(self.skip_reasons)
            elif name in ("warnings", "measured_peak_bytes_by_rank", "collective_held_bytes_by_rank"):
                d[name] = list(getattr(self, name))
            else:
                d[name] = getattr(self, name)
        if self.stopped is not None:
            d.update(stopped=self.stopped, error=self.error, exit_code=self.exit_code)
            if self.resume is not None:
                d["resume"] = self.resume
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoRun:
    """A training run of the demo.

    Attributes:
        global_batch: samples per optimizer step.
        losses: the loss of every optimizer step.
        step_s: seconds of every step but the measured one (step 1, under the tracker).
        measured_peak_bytes: tracked peak of step 1 (a steady-state window: optimizer state
            exists); None with a single step.
    """

    global_batch: int
    losses: tuple[float, ...]
    step_s: tuple[float, ...]
    measured_peak_bytes: int | None

    @property
    def samples_per_s(self) -> float:
        """Global batch over the median step time."""
        return self.global_batch / statistics.median(self.step_s)

    def loss_means(self) -> tuple[int, float, float]:
        """``(k, first, last)``: the mean loss of the first and of the last ``k`` steps."""
        k = max(1, min(10, len(self.losses) // 5))
        return k, statistics.mean(self.losses[:k]), statistics.mean(self.losses[-k:])
