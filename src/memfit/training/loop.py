"""The training loop of :func:`train`: exact gradient accumulation, also under ``torchrun``.

Every step draws one global batch of ``global_batch`` samples from the workload (the same batch on
every rank: the data RNG is separate from the training RNG and seeded identically), each rank takes
its share (``G / world_size``, the first ranks one more when it does not divide), and an
:class:`~memfit.accumulate.Accumulator` runs it in micro-batches and steps once. Under ``torchrun
--nproc_per_node=N`` the plan is applied, then the model is wrapped in DDP or, with
``parallel`` fsdp2, sharded with ``fully_shard`` per block and at the root (gloo on CPU, NCCL on
CUDA; NOTE [ Wrapping ] in :mod:`memfit.training.distributed`); the result equals a
single-process run up to the order of float additions. A plan file made for the run's layout,
micro-batch and window (``memfit plan --world-size N --parallel ... --accumulation-steps K --out``)
gives the per-rank peak the run's measured peak is compared with
(:func:`~memfit.training.replan.planned_peak`).

Out of memory: every step runs through :class:`memfit.training.guard.OutOfMemoryGuard`. An out-of-memory
error (``torch.OutOfMemoryError``, or with ``guard`` the tracker's ``BudgetExceededError``) puts
the state back where the step started, re-solves the auto-fit for a tighter budget
(``min(0.9 * B, B - overflow)``, NOTE [ Redo after out-of-memory ] in :mod:`memfit.training.guard`;
:func:`memfit.training.replan.autofit_replanner`), applies the new micro-batch and plan and redoes
the step with the same batch. ``guard`` (with ``budget_bytes``) runs every step under the
:class:`~memfit.capture.tracker.MemoryTracker` with the budget as its limit: the CPU stand-in for a
GPU's out-of-memory, at about 10-13 us per op on CPU (a tiny GPT's steps ran 2.4x slower, one of
width 128 at 128 tokens 1.1x), which samples/s then includes. Replanning needs one process; under
``torchrun`` an out-of-memory error stops the run with the state as it was before the step.

Measured against predicted: NOTE [ Watching a run ] in :mod:`memfit.training.watch`. Saving and
resuming: NOTE [ Saving ] in :mod:`memfit.training.saving`. Signals and divergence: NOTE [
Stopping a run ] in :mod:`memfit.training.signals`.

Windows that take no optimizer step (NOTE [ Skipped windows ] in :mod:`memfit.accumulate`): no
valid tokens, a NaN or infinite loss or gradient norm (or a GradScaler's overflow) leave weights
and optimizer state as they were and are counted (``skipped_steps``, ``skip_reasons``).

Known limitations:
    - Under DDP the tracker does not see DDP's own gradient buckets (allocated before the step).
    - Under ``torchrun``, a failure to write the checkpoint on rank 0 (disk full mid-run) ends
      that process, and torchrun then stops the others; ``PATH`` keeps the last complete save.
    - Signals are handled from the first training step on: a SIGINT or SIGTERM during loading or
      the auto-fit stops at once (under ``memfit train``: exit 130 / 143 with a line that says
      nothing was trained or written; from Python: ``KeyboardInterrupt`` under Python's handler). A
      first signal that arrives during the final save is not acted on (the run is complete).
    - A replan re-solves the start's auto-fit profiles for the tighter budget (no profiling, no
      measured window: the redone window is the check). A replan after a given plan (no fit to
      re-solve) runs the auto-fit again, about 30 s on CPU for the small demo GPT.
    - Under ``guard`` the step time includes the tracker, so the time drift is reported but not
      warned about.
"""

from __future__ import annotations

import contextlib
import gc
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.accumulate import Accumulator, SkipReason, StepResult
from memfit.apply import apply_plan
from memfit.capture.snapshot import seed_generators
from memfit.capture.step import make_optimizer
from memfit.errors import Interrupted, SpecError
from memfit.fitting import FitResult
from memfit.models.registry import load_workload
from memfit.plan.parallel import ParallelKind
from memfit.plan.policies import check_plan_for_run, policy_plan
from memfit.plan.types import Plan
from memfit.training.config import TrainConfig, TrainResult
from memfit.training.distributed import CollectiveInterrupted, CollectiveTimeout, Ranks, fsdp2_peak, is_lost_rank
from memfit.training.events import LoopEnded, Progress, RunStarted, Signalled, StepDone, TrainEvent, Warned
from memfit.training.guard import Choice, OutOfMemoryGuard, Replan
from memfit.training.replan import autofit_replanner, initial_choice, planned_peak
from memfit.training.saving import (
    check_start,
    claim_save_path,
    load_run,
    options_of,
    resume_notes,
    run_signature,
    save_run,
)
from memfit.training.signals import Abort, Interrupts, Stop, startup_stop_line
from memfit.training.state import NonFiniteStateError, RunSignature, check_resume, load_state
from memfit.training.watch import DriftWatch, ProgressLog
from memfit.workload import Workload, cast_batch, check_batch_rows, split_batch, with_dtype

_SKIP_WORDS = {
    SkipReason.NO_TOKENS: "no valid tokens",
    SkipReason.NONFINITE_LOSS: "the loss is NaN or infinite",
    SkipReason.NONFINITE_GRAD: "the gradient norm is NaN or infinite",
    SkipReason.GRAD_SCALER: "the GradScaler found an inf/NaN gradient",
}


def train(workload: Workload | str, config: TrainConfig, *, progress: Progress | None = None) -> TrainResult:
    """Train ``workload`` for ``config.steps`` optimizer steps with exact gradient accumulation.

    Also under ``torchrun`` (one call per rank; every rank returns its result, rank 0's is the one
    to report). The model is trained in place and keeps the applied plan afterwards.

    Args:
        workload: the workload, or a ``--model`` spec loaded with the config's ``seq_len``,
            ``dtype`` and ``seed`` (after the config and the save path are checked).
        config: what to run (:class:`~memfit.training.config.TrainConfig`).
        progress: called with each :class:`~memfit.training.events.TrainEvent` (rank 0; warnings
            and signals on every rank).

    Returns:
        The :class:`~memfit.training.config.TrainResult`; a run that stopped early (a signal,
        divergence) returns one with ``ok`` False, ``stopped`` and ``exit_code`` set.

    Raises:
        SpecError: the config cannot run (checked before any work).
        TrainStateError: the save path takes no file, or the resumed state does not fit this run.
        BudgetInfeasibleError: nothing fits the budget (also after ``max_replans`` replans).

    Example:
        >>> from memfit.training import TrainConfig, train
        >>> res = train("demo?n_layer=2&n_embd=32&seq_len=32", TrainConfig(global_batch=4, micro_batch=2, steps=2, device="cpu"))
        >>> res.optimizer_steps, res.accumulation_steps
        (2, 2)
    """
    dist = Ranks.setup(config.device, timeout_s=config.collective_timeout_s)
    try:
        config.check(dist.world)
        # Before any work: the save target takes a file and no other run writes it (NOTE [ Saving ]).
        lock = claim_save_path(config.save, dist)
        try:
            try:
                saved = load_state(config.resume) if config.resume else None
                run = _Run.set_up(workload, config, dist, saved, progress or _ignore)
            except Interrupted as sig:  # memfit's command line: say what the start-up left
                raise Interrupted(sig.signum, startup_stop_line(config, sig.signum)) from None
            result = run.loop()
            # The wrapped model holds the process group (DDP's reducer, FSDP2's mesh): let it go before
            # the group is destroyed, so that gloo's threads are not left to the interpreter's exit.
            del run
            gc.collect()
            return result
        finally:
            if lock is not None:
                lock.release()
    finally:
        dist.close()


def _ignore(event: TrainEvent) -> None:
    """The default ``progress``: nothing."""


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


def _one_line(err: BaseException) -> str:
    """``err``'s message on one line, at most 300 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _given_plan(config: TrainConfig, model: nn.Module) -> Plan | None:
    """The plan the config names for ``model`` (``plan``, or ``policy`` without a budget, which
    the fit keeps instead), or None when the fit chooses it or there is none."""
    if config.plan is not None:
        return config.plan if isinstance(config.plan, Plan) else config.plan(model)
    if config.policy is not None and config.budget_bytes is None:
        return policy_plan(model, config.policy)
    return None


@dataclass(kw_only=True)
class _Run:
    """A run set up (model, plan, optimizer, Accumulator, guard), then looped by :meth:`loop`."""

    config: TrainConfig
    dist: Ranks
    emit: Progress
    workload: Workload
    signature: RunSignature
    shares: list[int]
    acc: Accumulator
    watch: DriftWatch
    data_rng: torch.Tensor
    start: int
    lr_saved: float | None
    notes: list[str] = field(default_factory=list)
    guard: OutOfMemoryGuard = field(init=False)
    _saved_at: int | None = field(init=False, default=None)  # the step the save file holds

    @classmethod
    def set_up(
        cls, workload: Workload | str, config: TrainConfig, dist: Ranks, saved: dict[str, Any] | None, emit: Progress
    ) -> _Run:
        """Load, check the resumed state, fit or apply the plan, build optimizer, Accumulator and guard."""
        if isinstance(workload, str):
            seed_generators(config.seed)  # a builder that draws from Python's random or NumPy builds the same model
            wl = load_workload(workload, seq_len=config.seq_len, dtype=config.dtype, seed=config.seed)
        else:
            wl = with_dtype(workload, config.dtype)
        raw = wl.model.to(dist.device)
        raw.train()
        signature = run_signature(wl, raw, config, dist.world)
        notes: list[str] = []
        if saved is not None:  # before the fit: a wrong file fails fast
            check_resume(config.resume, saved, signature, raw)
        notes += check_start(config, saved, raw, dist)  # the saved values, the free space for a save
        shares = dist.shares(config.global_batch)
        share = shares[dist.rank]
        choice, fit = initial_choice(wl, config, share, dist, emit if dist.is_main else _ignore)
        plan = choice.plan
        given = _given_plan(config, raw)
        if given is not None:
            check_plan_for_run(given, raw, wl.make_batch, choice.micro_batch)  # before any step
            plan = given
            peak, plan_notes = planned_peak(
                plan,
                config.parallel,
                micro_batch=choice.micro_batch,
                accumulation_steps=-(-share // choice.micro_batch),
            )
            choice = Choice(micro_batch=choice.micro_batch, plan=plan, predicted_peak_bytes=peak)
            notes += plan_notes
        if plan is not None:
            apply_plan(raw, plan)  # before wrapping (NOTE [ Wrapping ] in memfit.training.distributed)
        model = dist.wrap(raw, config.parallel, wl.blocks)
        optimizer = make_optimizer(model, config.optimizer, lr=config.learning_rate, states=config.states)
        amp = config.autocast_dtype
        scaler = torch.amp.GradScaler(dist.device.type) if amp is torch.float16 else None
        acc = Accumulator(
            model,
            optimizer,
            micro_batch=choice.micro_batch,
            normalize=config.normalize,
            scaler=scaler,
            max_grad_norm=config.max_grad_norm,
            autocast_dtype=amp,
            sync_loss=True,  # report the global batch's loss, as a single process would
        )
        # Data RNG: the same stream on every rank and independent of dropout (training RNG per rank).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed + 1)
            data_rng = torch.get_rng_state()
        seed_generators(config.seed + 2 + 1000 * dist.rank)  # torch's, Python's random and NumPy's, all saved
        lr_saved: float | None = None
        if saved is not None:
            notes += resume_notes(config.resume, saved, config, acc)  # before loading: refuses fp16's scaler state
            data_rng = load_run(saved, acc, dist, config.parallel)
            lr_saved = float(optimizer.param_groups[0]["lr"])
            if config.lr is not None:  # the saved optimizer state brought its own lr: lr replaces it
                for group in optimizer.param_groups:
                    group["lr"] = config.lr
        start = acc.windows
        if start >= config.steps:
            raise SpecError(
                f"memfit.training: {config.resume} is already at step {start}; ask for more --steps than that."
            )
        run = cls(
            config=config, dist=dist, emit=emit, workload=wl, signature=signature, shares=shares, acc=acc,
            watch=DriftWatch(choice, guard=config.guard, device=dist.device),
            data_rng=data_rng, start=start, lr_saved=lr_saved,
        )  # fmt: skip
        run.guard = run._make_guard(choice, fit, share)
        for message in notes:
            run.note(message)
        return run

    def _make_guard(self, choice: Choice, fit: FitResult | None, share: int) -> OutOfMemoryGuard:
        """The guard every window runs through; it replans with the auto-fit on one process."""
        config = self.config

        def on_replan(event: Replan) -> None:
            self.note(event.describe())
            self.watch.new_choice(self.guard.last_choice)

        replan = None
        if self.dist.world == 1:
            replan = autofit_replanner(
                self.workload, self.acc, window_samples=share, fit=fit, optimizer=config.optimizer, seed=config.seed,
                heads=config.heads, activations=config.activations, policy=config.policy, states=config.states,
            )  # fmt: skip
        return OutOfMemoryGuard(
            self.acc,
            model=self.workload.model,
            budget_bytes=config.budget_bytes,
            replan=replan,
            limit_bytes=config.budget_bytes if config.guard else None,
            max_replans=config.max_replans,
            on_replan=on_replan,
            choice=choice,
        )

    def note(self, message: str) -> None:
        """A warning: kept for the result and sent to ``progress`` (every rank)."""
        self.notes.append(message)
        self.emit(Warned(message=message))

    def main_emit(self, event: TrainEvent) -> None:
        """Send ``event`` to ``progress`` on rank 0 only."""
        if self.dist.is_main:
            self.emit(event)

    def loop(self) -> TrainResult:
        """Run the windows from ``start`` to ``steps``, save, and report."""
        config, dist, acc, guard, watch = self.config, self.dist, self.acc, self.guard, self.watch
        share = self.shares[dist.rank]
        choice = guard.last_choice
        self.main_emit(
            RunStarted(
                model=self.workload.name, world_size=dist.world, global_batch=config.global_batch, share=share,
                micro_batch=choice.micro_batch, accumulation_steps=-(-share // choice.micro_batch),
                policy=choice.plan.policy if choice.plan else None, start_step=self.start, steps=config.steps,
                resumed=config.resume is not None, lr_saved=self.lr_saved if config.lr is not None else None,
                lr=float(acc.optimizer.param_groups[0]["lr"]), guard_limit_bytes=config.budget_bytes if config.guard else None,
            )
        )  # fmt: skip
        losses: list[float] = []
        skips: dict[str, int] = {}
        stop: Stop | None = None
        self._saved_at = None
        log = ProgressLog.open(config.progress_jsonl, warn=self.note) if dist.is_main else None
        interrupts = Interrupts(on_signal=lambda signum, message: self.emit(Signalled(signum=signum, message=message)))
        dist.signal_received = lambda: interrupts.signum  # a signal while awaiting the other ranks ends the wait
        try:
            with interrupts:
                for step in range(self.start, config.steps):
                    last = self._step(step)
                    losses.append(last.loss)
                    if last.skip_reason is not None:
                        skips[last.skip_reason.value] = skips.get(last.skip_reason.value, 0) + 1
                        self.note(
                            f"step {step + 1}: window skipped ({_SKIP_WORDS[last.skip_reason]}); weights and optimizer state unchanged"
                        )
                    if log is not None:
                        log.write(step + 1, last, guard.last_peak_bytes)
                    self.main_emit(
                        StepDone(
                            step=step + 1, steps=config.steps, result=last, samples_per_s=watch.samples_per_s(config.global_batch),
                            peak_bytes=watch.peak_bytes, skipped_steps=acc.skipped_steps, replans=len(guard.replans),
                        )
                    )  # fmt: skip
                    if acc.consecutive_skips >= config.max_skips:
                        stop = Stop(kind="diverged", step=step + 1)
                    elif dist.any(interrupts.signum is not None):
                        stop = Stop(kind="signal", step=step + 1, signum=interrupts.signum or signal.SIGTERM)
                    elif config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
                        self._save(step + 1)
                    if stop is not None:
                        break
                if config.save and self._saved_at != acc.windows:
                    try:
                        self._save(acc.windows)
                    except NonFiniteStateError as err:
                        stop = Stop(kind="nonfinite_state", step=acc.windows, message=str(err))
        except Abort as abort:
            stop = Stop(kind="abort", step=acc.windows, signum=abort.signum)
        except (CollectiveTimeout, CollectiveInterrupted, RuntimeError) as err:
            if dist.world <= 1 or not is_lost_rank(err):
                raise
            # Another rank is gone: no save (it needs every rank); the line names the last complete one.
            dist.lost = True
            signum = err.signum if isinstance(err, CollectiveInterrupted) else interrupts.signum
            why = _one_line(err)
            if not isinstance(err, CollectiveTimeout | CollectiveInterrupted):  # torch's own collective failed
                torch_says = _SOURCE_PREFIX.sub("", why)[:200]  # gloo's "[.../unbound_buffer.cc:78] "
                why = (
                    f"another rank stopped answering within --collective-timeout {config.collective_timeout_s:g} s "
                    f"(rank {dist.rank}: {torch_says})"
                )
            stop = Stop(kind="ranks_lost", step=acc.windows, signum=signum, message=why)
        finally:
            if log is not None:
                log.close()
        self.main_emit(LoopEnded(aborted=stop is not None and stop.kind == "abort"))
        for message in watch.finish():
            self.note(message)
        return self._result(losses, skips, stop, self._saved_at)

    def _step(self, step: int) -> StepResult:
        """One window: draw the global batch, take this rank's share, run it through the guard."""
        config, dist, guard = self.config, self.dist, self.guard
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.data_rng)
            batch = self.workload.make_batch(config.global_batch)
            self.data_rng = torch.get_rng_state()
        check_batch_rows(batch, config.global_batch)  # a workload not loaded from a spec is not guarded
        mine = split_batch(batch, self.shares)[dist.rank] if dist.world > 1 else batch
        mine = cast_batch(mine, dtype=config.dtype, device=dist.device)
        # CPU without the guard: the tracker measures the first two steps (optimizer state exists
        # from the second on), which are then left out of the timing.
        measure = dist.device.type == "cpu" and step - self.start < 2
        # FSDP2 frees and re-allocates parameter storage, which memfit's tracker does not see: torch's FSDP tracker measures.
        fsdp2 = (
            measure and dist.world > 1 and config.parallel is not None and config.parallel.kind is ParallelKind.FSDP2
        )
        replans_before = len(guard.replans)
        t0 = time.perf_counter()
        loss_fn = self.workload.loss_fn
        with (
            fsdp2_peak(self.acc.model, self.acc.optimizer, mine, dist.device)
            if fsdp2
            else contextlib.nullcontext() as tracked
        ):
            if tracked is not None:

                def loss_fn(model: Any, batch: Any, _fn: Any = self.workload.loss_fn, _peak: Any = tracked) -> Any:
                    _peak.next_micro_step()
                    return _fn(model, batch)

            last = guard.step(mine, loss_fn, count_fn=self.workload.count_fn, measure=measure and not fsdp2)
        if dist.device.type == "cuda":
            torch.cuda.synchronize(dist.device)
        dt = time.perf_counter() - t0
        timed = step > self.start and len(guard.replans) == replans_before and (config.guard or not measure)
        peak = tracked.peak_bytes if tracked is not None else guard.last_peak_bytes
        held = tracked.collective_held_bytes if tracked is not None else None
        for message in self.watch.observe(peak, dt if timed else None, guard.last_op_count, held):
            self.note(message)
        return last

    def _save(self, step: int) -> None:
        """Save; ``step`` counts as saved once the file is complete, even if a rank is lost at the closing barrier."""
        assert self.config.save is not None

        def written() -> None:
            self._saved_at = step

        save_run(
            self.config.save,
            self.acc,
            self.dist,
            self.data_rng,
            self.signature,
            self.config.parallel,
            on_written=written,
            options=options_of(self.config, self.acc),
        )

    def _watch_report(self) -> dict[str, Any]:
        report = self.watch.report(self.config.global_batch)
        par = self.config.parallel
        if (
            report["peak_bytes"] is not None
            and self.dist.device.type == "cpu"
            and self.dist.world > 1
            and par is not None
            and par.kind is ParallelKind.FSDP2
        ):
            report["peak_measured_by"] = "FSDPMemTracker (torch's), first two steps"
        return report

    def _result(
        self, losses: list[float], skips: dict[str, int], stop: Stop | None, saved_at: int | None
    ) -> TrainResult:
        config, acc, guard = self.config, self.acc, self.guard
        final = guard.last_choice
        share = self.shares[self.dist.rank]
        message = stop.describe(config, saved_at, acc) if stop is not None else None
        gather = self.dist.gather_objects if not self.dist.lost else (lambda x: [x])  # this rank's only
        return TrainResult(
            ok=stop is None,
            model=self.workload.name,
            world_size=self.dist.world,
            rank=self.dist.rank,
            global_batch=config.global_batch,
            micro_batch=final.micro_batch,
            accumulation_steps=-(-share // final.micro_batch),
            steps=config.steps,
            start_step=self.start,
            end_step=acc.windows,
            optimizer_steps=acc.optimizer_steps,
            skipped_steps=acc.skipped_steps,
            skip_reasons=skips,
            consecutive_skips=acc.consecutive_skips,
            max_skips=config.max_skips,
            lr=float(acc.optimizer.param_groups[0]["lr"]),
            lr_saved=self.lr_saved,
            replan_events=tuple(guard.replans),
            losses=tuple(losses),
            **self._watch_report(),
            budget_bytes=config.budget_bytes,
            guard=bool(config.guard),
            parallel=config.parallel.to_dict() if config.parallel is not None else None,
            measured_peak_bytes_by_rank=tuple(gather(self.watch.choice_peak)),
            collective_held_bytes_by_rank=tuple(gather(self.watch.choice_peak_held)),
            policy=final.plan.policy if final.plan else None,
            recomputed_blocks=len(final.plan.recomputed) if final.plan else 0,
            head=final.plan.head if final.plan else None,
            activations=final.plan.activations if final.plan else None,
            normalize=acc.normalize.value,
            saved_to=config.save if saved_at is not None else None,
            saved_step=saved_at,
            warnings=tuple(self.notes),
            stopped=stop.kind if stop is not None else None,
            error=message,
            exit_code=stop.exit_code() if stop is not None else 0,
            resume=f"--resume {config.save}" if stop is not None and config.save and saved_at is not None else None,
        )
