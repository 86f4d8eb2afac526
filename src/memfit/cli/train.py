"""`memfit train`: real training with exact gradient accumulation, also under ``torchrun``.

Every step draws one global batch of ``--global-batch`` samples from the workload (the same batch
on every rank: the data RNG is separate from the training RNG and seeded identically), each rank
takes its share (``G / world_size``, the first ranks one more when it does not divide), and an
:class:`~memfit.accumulate.Accumulator` runs it in micro-batches of ``--micro-batch`` and steps
once. Under ``torchrun --nproc_per_node=N`` the model is wrapped in DDP (gloo on CPU, NCCL on
CUDA) and only rank 0 prints; the result equals a single-process run up to the order of float
additions.

NOTE [ Watching a run ]
Out of memory: every step runs through :class:`memfit.guard.OutOfMemoryGuard`. An out-of-memory
error (``torch.OutOfMemoryError``, or with ``--guard`` the tracker's ``BudgetExceededError``) puts
the state back where the step started, re-runs the auto-fit for a tighter budget
(``min(0.9 * B, B - overflow)``, see NOTE [ Redo after out-of-memory ] in :mod:`memfit.guard`) on a
saved copy of the training state, applies the new micro-batch and plan and redoes the step with
the same batch. ``--guard`` (with ``--budget``) runs every step under the
:class:`~memfit.capture.tracker.MemoryTracker` with the budget as its limit: the CPU stand-in for a
GPU's out-of-memory, at about 10-13 us per op on CPU (a tiny GPT's steps ran 2.4x slower, one
of width 128 at 128 tokens 1.1x), which samples/s then includes. Replanning needs one process;
under ``torchrun`` an out-of-memory error stops the run with the state as it was before the step.

Predicted vs measured: with ``--budget`` the auto-fit predicts the peak of a step and its seconds
(global batch share / predicted samples/s). Peak memory is measured by the tracker on the first two
steps on CPU (the optimizer state exists from the second on; every step under ``--guard``) and by
``torch.cuda.max_memory_allocated`` per step on CUDA; step time is the median over steps that
ran without the tracker (all but the first under ``--guard``), leaving out the first step and steps
that replanned. A drift of more than 10 % either way is warned about (the time only after 3 timed
steps, and not under ``--guard``, whose cost the prediction does not include). Both drifts, the
replans and the skipped windows (with their reasons) are in the summary and in ``--json``;
``--progress-jsonl PATH`` adds one line per step (loss, skip reason, the tracker's peak when it
ran, the process's RSS), for soak runs (``benchmarks/soak.py``).

NOTE [ Saving ]
``--save PATH`` is checked before anything else runs (the directory exists and takes a probe file)
and locked for the whole run (``PATH.lock``, see :mod:`memfit.trainstate`): a second run on the
same path is refused with the other run's pid. The state is written at the end, every
``--save-every N`` steps, and when the run stops early, always atomically (a temporary file beside
``PATH``, fsynced, renamed over it), so ``PATH`` is the previous complete state or the new one,
never a mix, whatever kills the process. Rank 0 writes; the RNG states of every rank are gathered
into the file so that ``--resume`` continues bitwise on the same world size.

The first SIGINT or SIGTERM lets the current window finish, saves (with ``--save``) and exits 130
or 143 with one line that ends in ``--resume PATH``; a second one leaves at once (a save in
progress removes its temporary file; ``PATH`` keeps the last complete save). Under ``torchrun``
the ranks agree on the window to stop after (one all-reduce of a flag per step).

``--resume PATH`` reads the file with one-line errors for a missing, empty, truncated or foreign
file, then refuses, before any fitting, a state that cannot continue exactly: other parameter
names or shapes, another optimizer, sequence length, global batch, world size or dtype. ``--lr``
replaces the saved learning rate in every parameter group (reported as ``lr`` and ``lr_saved``).

Windows that take no optimizer step (NOTE [ Skipped windows ] in :mod:`memfit.accumulate`): no
valid tokens, a NaN or infinite loss or gradient norm (or a GradScaler's overflow) leave weights
and optimizer state as they were and are counted (``skipped_steps``, ``skip_reasons``). After
``--max-skips N`` consecutive non-finite windows the run stops with exit code 3 (1 is "verify
found a difference", 2 a user error), saving the last finite state; a state holding NaN or inf
is never written.

Known limitations:
    - Under DDP the tracker does not see DDP's own gradient buckets (allocated before the step).
    - Under ``torchrun``, a failure to write the checkpoint on rank 0 (disk full mid-run) ends
      that process, and torchrun then stops the others; ``PATH`` keeps the last complete save.
    - Signals are handled from the first training step on: a Ctrl-C during loading or the
      auto-fit stops at once (exit 130, nothing trained yet, nothing written). A first signal
      that arrives during the final save is not acted on (the run is complete).
    - A replan re-solves the start's auto-fit profiles for the tighter budget (no profiling, no
      measured window: the redone window is the check). A replan after ``--policy`` (no fit to
      re-solve) runs the auto-fit again, about 30 s on CPU for the small demo GPT.
    - Under ``--guard`` the step time includes the tracker, so the time drift is reported but
      not warned about.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from memfit.accumulate import Accumulator, Normalize, SkipReason, StepResult
from memfit.cli.common import (
    EXIT_DIVERGED,
    Output,
    add_workload_args,
    mib,
    named_plan,
    nonneg_int,
    parse_dtype,
    policy_arg,
    positive_float,
    positive_int,
    size_arg,
)
from memfit.errors import MemfitError, SpecError
from memfit.guard import Choice, OutOfMemoryGuard, Replan, preserved_state
from memfit.models.registry import load_workload
from memfit.trainstate import (
    NonFiniteStateError,
    RunSignature,
    StateLock,
    TrainStateError,
    check_resume,
    check_writable,
    load_state,
    save_state,
)
from memfit.workload import Workload, cast_batch, split_batch

HELP = "train a workload with exact gradient accumulation (progress, samples/s, peak memory; torchrun-aware)"

DRIFT_WARN = 0.10
"""Relative drift of measured peak or step time from the prediction that is warned about."""
TIME_CHECK_STEPS = 3
"""Timed steps before the time drift is checked."""
DEFAULT_MAX_SKIPS = 5
"""Consecutive windows skipped for a non-finite loss or gradient before the run stops."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from memfit.capture.step import OPTIMIZERS
    from memfit.cli.common import device_arg

    add_workload_args(p, batch=False)
    p.add_argument("--global-batch", type=positive_int, required=True, metavar="G", help="samples per optimizer step, over all ranks")
    # Sizing of a micro-step: fixed, or fitted to a memory budget (micro-batch and plan).
    sizing = p.add_mutually_exclusive_group()
    sizing.add_argument("--micro-batch", type=positive_int, default=None, metavar="b", help="samples per micro-step on each rank (default: the rank's whole share, no accumulation)")
    sizing.add_argument("--budget", type=size_arg, default=None, metavar="SIZE", help="fit micro-batch and checkpoint plan to this peak memory per rank (memfit fit)")
    p.add_argument("--guard", action="store_true", help="enforce --budget with the memory tracker on every step: going over it counts as out of memory and triggers a replan "
                   "(the CPU stand-in for a GPU's out-of-memory; ~10 us per op: 1.1x-2.4x slower steps, the more so the smaller the ops)")  # fmt: skip
    p.add_argument("--keep-head", action="store_true", help="with --budget: never replace the model's head (no chunked loss)")
    p.add_argument("--keep-activations", action="store_true", help="with --budget: never fuse activation modules (see memfit.apply.activations)")
    p.add_argument("--max-replans", type=nonneg_int, default=3, metavar="N", help="out-of-memory replans allowed before the run stops (default 3)")
    p.add_argument("--steps", type=positive_int, required=True, metavar="N", help="optimizer steps (in total, counting those of a resumed run)")
    p.add_argument("--lr", type=positive_float, default=None, help="learning rate (default 3e-4 for adamw/adam, 0.05 for sgd; with --resume: replaces the saved one)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--normalize", default="auto", choices=[n.value for n in Normalize], help="loss normalisation (auto: tokens for (loss_sum, count) workloads, else mean)")
    p.add_argument("--policy", type=policy_arg, default=None, metavar="P", help="apply a checkpoint policy first: none, all, sqrt, every:K, selective:PRESET, offload")
    p.add_argument("--max-grad-norm", type=positive_float, default=None, metavar="X", help="clip the global gradient norm at each step (a number > 0)")
    p.add_argument("--amp", default=None, choices=["bf16", "fp16"], help="autocast the forward (fp16 adds a GradScaler)")
    p.add_argument("--device", type=device_arg, default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--resume", default=None, metavar="PATH", help="continue from a state saved with --save")
    p.add_argument("--save", default=None, metavar="PATH", help="save the training state at the end, on SIGINT/SIGTERM and every --save-every steps "
                   "(atomic: written beside PATH, then renamed over it; PATH.lock keeps other runs out)")  # fmt: skip
    p.add_argument("--save-every", type=positive_int, default=None, metavar="N", help="with --save: also save every N optimizer steps")
    p.add_argument("--max-skips", type=positive_int, default=DEFAULT_MAX_SKIPS, metavar="N",
                   help=f"stop (exit {EXIT_DIVERGED}) after N consecutive windows skipped for a NaN/inf loss or gradient (default {DEFAULT_MAX_SKIPS})")  # fmt: skip
    p.add_argument("--progress-jsonl", default=None, metavar="PATH", help="append one JSON line per step: loss, skip reason, tracked peak bytes, process RSS bytes")


def resolve_micro_batch(args: argparse.Namespace, workload: Workload, share: int, out: Output, dist: _Dist) -> tuple[int, Any]:
    """Samples per micro-step on this rank, and the fitted plan when ``--budget`` is given."""
    choice, _fit = initial_choice(args, workload, share, out, dist)
    return choice.micro_batch, choice.plan


def initial_choice(args: argparse.Namespace, workload: Workload, share: int, out: Output, dist: _Dist) -> tuple[Choice, Any]:
    """Micro-batch and plan (with the fit's predictions when ``--budget`` is given), and rank 0's fit.

    With ``--budget``, rank 0 runs the auto-fit on its share of the global batch and sends the
    micro-batch, the plan and the predictions to the other ranks, so that every rank runs the same
    plan. The :class:`memfit.autofit.FitResult` (rank 0 only, else None) keeps the profiles that a
    replan re-solves from.
    """
    if getattr(args, "budget", None) is None:
        return Choice(micro_batch=min(args.micro_batch or share, share), plan=None), None
    from memfit.autofit import autofit

    sent: list[Any] = [None]
    res = None
    if dist.is_main:
        with out.console.status("auto-fit ...") as status:
            res = autofit(workload, args.budget, share, optimizer=args.optimizer, seed=args.seed, heads=not args.keep_head, activations=not args.keep_activations, progress=lambda s: status.update(f"auto-fit: {s}"))
        out.print(
            f"auto-fit: micro-batch {res.micro_batch} x {res.accumulation_steps}, {len(res.plan.recomputed)} blocks recomputed; "
            f"predicted peak {mib(res.predicted_peak_bytes)}, measured {mib(res.measured_peak_bytes)} (budget {mib(args.budget)})"
        )
        sent = [_choice_to_wire(_fit_choice(res, share))]
    if dist.world > 1:
        torch.distributed.broadcast_object_list(sent, src=0)
    return _choice_from_wire(sent[0]), res


def run(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    dist = _Dist.setup(args.device)
    try:
        if not dist.is_main:
            out = Output(json_mode=True)  # silent on other ranks
        result = _train(args, out, dist)
    finally:
        dist.close()
    if not dist.is_main:
        # Only rank 0 prints the JSON that `memfit --json` writes after run() returns.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    return result


def _train(args: argparse.Namespace, out: Output, dist: _Dist) -> dict[str, Any]:
    dtype = parse_dtype(args.dtype)
    if args.global_batch < dist.world:
        raise SpecError(
            f"memfit train: --global-batch {args.global_batch} is smaller than the {dist.world} ranks; "
            f"give every rank at least one sample (--global-batch >= {dist.world})."
        )
    if args.micro_batch is not None and args.micro_batch > args.global_batch:
        raise SpecError(
            f"memfit train: --micro-batch {args.micro_batch} is larger than --global-batch {args.global_batch}. "
            "Use --micro-batch <= --global-batch (or leave it out: no accumulation)."
        )
    if args.guard and args.budget is None:
        raise SpecError("memfit train: --guard enforces --budget; give --budget SIZE too (e.g. --budget 300MiB --guard).")
    if args.policy and getattr(args, "budget", None) is not None:
        raise SpecError("memfit train: give --policy or --budget, not both (--budget chooses the plan).")
    if args.save_every is not None and not args.save:
        raise SpecError(f"memfit train: --save-every {args.save_every} needs a file to save to; give --save PATH too.")
    # Before any work: the save target takes a file and no other run writes it (NOTE [ Saving ]).
    lock = _claim_save_path(args.save, dist)
    try:
        saved = load_state(args.resume) if args.resume else None
        return _run_training(args, out, dist, dtype, saved)
    finally:
        if lock is not None:
            lock.release()


def _run_training(args: argparse.Namespace, out: Output, dist: _Dist, dtype: torch.dtype | None, saved: dict[str, Any] | None) -> dict[str, Any]:
    wl = load_workload(args.model, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
    raw = wl.model.to(dist.device)
    raw.train()
    signature = RunSignature(
        model=wl.name,
        optimizer=args.optimizer,
        seq_len=args.seq_len or wl.info.get("seq_len") or wl.info.get("config", {}).get("seq_len"),
        global_batch=args.global_batch,
        world_size=dist.world,
        dtype=str(next((p.dtype for p in raw.parameters()), torch.float32)).removeprefix("torch."),
    )
    if saved is not None:
        check_resume(args.resume, saved, signature, raw)  # before the fit: a wrong file fails fast
    shares = [args.global_batch // dist.world + (r < args.global_batch % dist.world) for r in range(dist.world)]
    share = shares[dist.rank]
    choice, fit = initial_choice(args, wl, share, out, dist)
    plan = choice.plan
    if args.policy:
        plan = named_plan(raw, args.policy)
        choice = Choice(micro_batch=choice.micro_batch, plan=plan)
    if plan is not None:
        from memfit.apply import apply_plan

        apply_plan(raw, plan)
    model = dist.wrap(raw)

    from memfit.capture.step import make_optimizer

    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 3e-4)
    optimizer = make_optimizer(model, args.optimizer, lr=lr)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp or "")
    scaler = torch.amp.GradScaler(dist.device.type) if amp is torch.float16 else None
    acc = Accumulator(
        model,
        optimizer,
        micro_batch=choice.micro_batch,
        normalize=args.normalize,
        scaler=scaler,
        max_grad_norm=args.max_grad_norm,
        autocast_dtype=amp,
        sync_loss=True,  # print the global batch's loss, as a single process would
    )
    # Data RNG: the same stream on every rank and independent of dropout (training RNG per rank).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed + 1)
        data_rng = torch.get_rng_state()
    torch.manual_seed(args.seed + 2 + 1000 * dist.rank)
    lr_saved: float | None = None
    if saved is not None:
        data_rng = _load(saved, acc, dist)
        lr_saved = float(optimizer.param_groups[0]["lr"])
        if args.lr is not None:  # the saved optimizer state brought its own lr: --lr replaces it
            for group in optimizer.param_groups:
                group["lr"] = args.lr
    start = acc.windows
    if start >= args.steps:
        raise SpecError(
            f"memfit train: {args.resume} is already at step {start}; ask for more --steps than that."
        )

    watch = _Watch(choice, guard=args.guard, device=dist.device)
    notes: list[str] = []  # warnings, printed above the progress bar and returned in the JSON
    progress_console: list[Any] = []

    def note(message: str) -> None:
        notes.append(message)
        if out.json_mode or not progress_console:
            out.warn(message)
        else:
            progress_console[0].print(f"[yellow]warning:[/] {message}", soft_wrap=True)

    def on_replan(event: Replan) -> None:
        note(event.describe())
        watch.new_choice(guard.last_choice)

    guard = OutOfMemoryGuard(
        acc,
        model=raw,
        budget_bytes=args.budget,
        replan=_replanner(args, wl, raw, optimizer, share, acc, fit) if dist.world == 1 else None,
        limit_bytes=args.budget if args.guard else None,
        max_replans=args.max_replans,
        on_replan=on_replan,
        choice=choice,
    )

    k = -(-share // choice.micro_batch)
    out.print(
        f"[bold]memfit train[/] {wl.name}: global batch {args.global_batch} = {dist.world} rank(s) x "
        f"{share} = {k} micro-step(s) of {choice.micro_batch}" + (f", policy {plan.policy!r}" if plan else "")
        + (f", resumed at step {start}" if args.resume else "")
        + (f", lr {lr_saved:g} -> {args.lr:g} (--lr)" if saved is not None and args.lr is not None else "")
        + (f"; guard: every step under the memory tracker with a limit of {mib(args.budget)}" if args.guard else ""),
    )
    losses: list[float] = []
    skips: dict[str, int] = {}
    stop: _Stop | None = None
    saved_at: int | None = None
    log = _ProgressLog.open(args.progress_jsonl) if dist.is_main else None
    interrupts = _Interrupts()
    try:
        with interrupts, out.progress() as progress:
            progress_console.append(progress.console)
            task = progress.add_task("train", total=args.steps, completed=start, info="")
            for step in range(start, args.steps):
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(data_rng)
                    batch = wl.make_batch(args.global_batch)
                    data_rng = torch.get_rng_state()
                mine = split_batch(batch, shares)[dist.rank] if dist.world > 1 else batch
                mine = cast_batch(mine, dtype=dtype, device=dist.device)
                # CPU without the guard: the tracker measures the first two steps (optimizer state exists
                # from the second on), which are then left out of the timing.
                measure = dist.device.type == "cpu" and step - start < 2
                replans_before = len(guard.replans)
                t0 = time.perf_counter()
                last = guard.step(mine, wl.loss_fn, count_fn=wl.count_fn, measure=measure)
                if dist.device.type == "cuda":
                    torch.cuda.synchronize(dist.device)
                dt = time.perf_counter() - t0
                timed = step > start and len(guard.replans) == replans_before and (args.guard or not measure)
                for message in watch.observe(guard.last_peak_bytes, dt if timed else None, guard.last_op_count):
                    note(message)
                losses.append(last.loss)
                if last.skip_reason is not None:
                    skips[last.skip_reason.value] = skips.get(last.skip_reason.value, 0) + 1
                    note(f"step {step + 1}: window skipped ({_SKIP_WORDS[last.skip_reason]}); weights and optimizer state unchanged")
                if log is not None:
                    log.write(step + 1, last, guard.last_peak_bytes)
                sps = watch.samples_per_s(args.global_batch)
                progress.update(
                    task,
                    advance=1,
                    info=f"loss {last.loss:.4f}  "
                    + (f"{sps:.1f} samples/s  " if sps else "")
                    + f"peak {mib(watch.peak_bytes)}"
                    + (f"  skipped {acc.skipped_steps}" if acc.skipped_steps else "")
                    + (f"  replans {len(guard.replans)}" if guard.replans else ""),
                )
                if acc.consecutive_skips >= args.max_skips:
                    stop = _Stop(kind="diverged", step=step + 1)
                elif dist.any(interrupts.signum is not None):
                    stop = _Stop(kind="signal", step=step + 1, signum=interrupts.signum or signal.SIGTERM)
                elif args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                    _save(args.save, acc, dist, data_rng, signature)
                    saved_at = step + 1
                if stop is not None:
                    break
            if args.save and saved_at != acc.windows:
                try:
                    _save(args.save, acc, dist, data_rng, signature)
                except NonFiniteStateError as err:
                    stop = _Stop(kind="nonfinite_state", step=acc.windows, message=str(err))
                else:
                    saved_at = acc.windows
    except _Abort as abort:
        stop = _Stop(kind="abort", step=acc.windows, signum=abort.signum)
    finally:
        if log is not None:
            log.close()
    for message in watch.finish():
        note(message)
    report = watch.report(args.global_batch)
    final = guard.last_choice
    result = {
        "ok": stop is None,
        "model": wl.name,
        "world_size": dist.world,
        "global_batch": args.global_batch,
        "micro_batch": final.micro_batch,
        "accumulation_steps": -(-share // final.micro_batch),
        "steps": args.steps,
        "start_step": start,
        "end_step": acc.windows,
        "optimizer_steps": acc.optimizer_steps,
        "skipped_steps": acc.skipped_steps,
        "skip_reasons": skips,
        "consecutive_skips": acc.consecutive_skips,
        "max_skips": args.max_skips,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "lr_saved": lr_saved,
        "replans": len(guard.replans),
        "replan_events": [r.to_dict() for r in guard.replans],
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        **report,
        "budget_bytes": args.budget,
        "guard": bool(args.guard),
        "policy": final.plan.policy if final.plan else None,
        "recomputed_blocks": len(final.plan.recomputed) if final.plan else 0,
        "head": final.plan.head if final.plan else None,
        "activations": final.plan.activations if final.plan else None,
        "normalize": args.normalize,
        "saved_to": args.save if saved_at is not None else None,
        "saved_step": saved_at,
        "warnings": notes,
    }
    if dist.is_main:
        out.table(f"trained {wl.name}", ["quantity", "value"], _summary_rows(result, start, args))
    if stop is not None:
        message = stop.describe(args, saved_at, acc)
        result.update(stopped=stop.kind, error=message, exit_code=stop.exit_code())
        if args.save and saved_at is not None:
            result["resume"] = f"--resume {args.save}"
        if dist.is_main:
            out.error(message)
    return result


def _summary_rows(r: dict[str, Any], start: int, args: argparse.Namespace) -> list[tuple[str, str]]:
    def drift(x: float | None) -> str:
        return "" if x is None else f" ({x:+.0%}{', over 10 %' if abs(x) > DRIFT_WARN else ''})"

    rows = [
        ("steps", f"{start} -> {r['end_step']} of {args.steps} ({r['skipped_steps']} windows skipped" + "".join(f", {n} {why}" for why, n in r["skip_reasons"].items()) + ")"),
        ("learning rate", f"{r['lr']:g}" + (f" (--lr; the saved state had {r['lr_saved']:g})" if r["lr_saved"] is not None and r["lr_saved"] != r["lr"] else "")),
        ("replans after out-of-memory", str(r["replans"]) + "".join(f"\n window {e['window']}: {mib(e['failed_budget_bytes'])} -> {mib(e['budget_bytes'])}, micro-batch {e['micro_batch_before']} -> {e['micro_batch']}" for e in r["replan_events"])),
        ("micro-batch x steps", f"{r['micro_batch']} x {r['accumulation_steps']}" + (f", policy {r['policy']!r}" if r["policy"] else "") + (f", {r['recomputed_blocks']} blocks recomputed" if r["policy"] else "") + (f", {r['head']} head" if r["head"] else "") + (f", {r['activations']} activations" if r["activations"] else "")),
        ("final loss", f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-"),
        ("samples/s", f"{r['samples_per_s']:.1f} (median over timed steps{', guard included' if r['guard'] else ''})" if r["samples_per_s"] else "-"),
        ("peak memory", f"{mib(r['measured_peak_bytes'])} measured ({r['peak_measured_by']}), {mib(r['predicted_peak_bytes'])} predicted" + drift(r["peak_drift"])),
        ("step time", (f"{r['measured_step_s'] * 1e3:.0f} ms measured" if r["measured_step_s"] else "- measured") + (f", {r['predicted_step_s'] * 1e3:.0f} ms predicted" if r["predicted_step_s"] else "") + drift(r["time_drift"]) + (" (guard included)" if r["guard"] and r["time_drift"] is not None else "")),
    ]
    if r["guard"]:
        ops = r.get("guard_ops_per_step")
        rows.append(("guard", f"limit {mib(r['budget_bytes'])}, memory tracker on every step" + (f" ({ops} ops per step, ~10 us each: ~{ops * 1e-5 * 1e3:.0f} ms)" if ops else "")))
    if r["warnings"]:
        rows.append(("warnings", str(len(r["warnings"]))))
    return rows


class _Watch:
    """Measured peak and step time against the current choice's predictions (NOTE [ Watching a run ])."""

    def __init__(self, choice: Choice, *, guard: bool, device: torch.device) -> None:
        self.guard = guard
        self.device = device
        self.peak_bytes: int | None = None  # over the whole run
        self.ops: int | None = None
        self.all_step_s: list[float] = []
        self.new_choice(choice)

    def new_choice(self, choice: Choice) -> None:
        self.choice = choice
        self.choice_peak: int | None = None
        self.n_peaks = 0
        self.step_s: list[float] = []
        self.warned_peak = self.warned_time = False

    def observe(self, peak_bytes: int | None, step_s: float | None, ops: int | None) -> list[str]:
        if ops is not None:
            self.ops = ops
        if peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, peak_bytes)
            self.choice_peak = max(self.choice_peak or 0, peak_bytes)
            self.n_peaks += 1
        if step_s is not None:
            self.step_s.append(step_s)
            self.all_step_s.append(step_s)
        # The first step of a run creates the optimizer state: its peak is not the steady one.
        messages = self._peak_message() if self.n_peaks >= 2 else []
        if len(self.step_s) >= TIME_CHECK_STEPS:
            messages += self._time_message()
        return messages

    def finish(self) -> list[str]:
        return self._peak_message() + (self._time_message() if self.step_s else [])

    def _peak_message(self) -> list[str]:
        d = self.peak_drift()
        if d is None or abs(d) <= DRIFT_WARN or self.warned_peak:
            return []
        self.warned_peak = True
        return [
            f"measured peak {mib(self.choice_peak)} is {d:+.0%} off the predicted {mib(self.choice.predicted_peak_bytes)} "
            f"(micro-batch {self.choice.micro_batch}): the fit's memory model does not match this run"
        ]

    def _time_message(self) -> list[str]:
        d = self.time_drift()
        if d is None or abs(d) <= DRIFT_WARN or self.warned_time or self.guard:
            return []
        self.warned_time = True
        return [
            f"measured step time {statistics.median(self.step_s) * 1e3:.0f} ms is {d:+.0%} off the predicted "
            f"{self.choice.predicted_window_s * 1e3:.0f} ms (median of {len(self.step_s)} steps; a shared machine adds noise)"
        ]

    def peak_drift(self) -> float | None:
        p = self.choice.predicted_peak_bytes
        if not p or self.choice_peak is None:
            return None
        return self.choice_peak / p - 1.0

    def time_drift(self) -> float | None:
        p = self.choice.predicted_window_s
        if not p or not self.step_s:
            return None
        return statistics.median(self.step_s) / p - 1.0

    def samples_per_s(self, global_batch: int) -> float | None:
        return global_batch / statistics.median(self.all_step_s) if self.all_step_s else None

    def report(self, global_batch: int) -> dict[str, Any]:
        how = (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else ("MemoryTracker, every step" if self.guard else "MemoryTracker, first two steps")
        )
        step_s = statistics.median(self.all_step_s) if self.all_step_s else None
        return {
            "samples_per_s": self.samples_per_s(global_batch),
            "step_s": step_s,
            "peak_bytes": self.peak_bytes,
            "peak_measured_by": how if self.peak_bytes is not None else "none",
            "predicted_peak_bytes": self.choice.predicted_peak_bytes,
            "measured_peak_bytes": self.choice_peak,
            "peak_drift": self.peak_drift(),
            "predicted_step_s": self.choice.predicted_window_s,
            "measured_step_s": statistics.median(self.step_s) if self.step_s else None,
            "time_drift": self.time_drift(),
            "guard_ops_per_step": self.ops if self.guard else None,
        }


def _fit_choice(res: Any, share: int) -> Choice:
    """A :class:`Choice` from a :class:`memfit.autofit.FitResult` (a step is the rank's share)."""
    sps = res.predicted_samples_per_s
    return Choice(
        micro_batch=res.micro_batch,
        plan=res.plan,
        predicted_peak_bytes=res.predicted_peak_bytes,
        predicted_window_s=share / sps if sps else None,
    )


def _choice_to_wire(c: Choice) -> tuple[Any, ...]:
    return (c.micro_batch, c.plan.to_dict() if c.plan else None, c.predicted_peak_bytes, c.predicted_window_s)


def _choice_from_wire(w: tuple[Any, ...]) -> Choice:
    from memfit.plan import Plan

    micro, plan, peak, window_s = w
    return Choice(micro_batch=micro, plan=Plan.from_dict(plan) if plan else None, predicted_peak_bytes=peak, predicted_window_s=window_s)


def _replanner(args: argparse.Namespace, wl: Workload, raw: torch.nn.Module, optimizer: Any, share: int, acc: Accumulator, fit: Any = None) -> Any:
    """``budget_bytes -> Choice``: re-solve the auto-fit's profiles for the tighter budget.

    With the start's :class:`memfit.autofit.FitResult` this is the solver only
    (:meth:`~memfit.autofit.FitResult.resolve`, milliseconds); the guard's redone window is the
    check, and a second failure tightens again. Without one (``--policy`` or no ``--budget``) the
    auto-fit runs again on a saved copy of the training state: it profiles and measures on the
    model itself (its steps change the weights and draw random numbers), and
    :func:`memfit.guard.preserved_state` puts weights, RNG and plan back. A tighter budget never
    needs a larger micro-batch, so the search stops at the current one.
    """

    def replan(budget_bytes: int) -> Choice:
        from memfit.autofit import autofit

        if fit is not None and fit.profiles:
            return _fit_choice(fit.resolve(budget_bytes, max_micro_batch=acc.micro_batch), share)
        with preserved_state(raw, optimizer):
            res = autofit(wl, budget_bytes, share, optimizer=args.optimizer, seed=args.seed, repeats=1, max_micro_batch=acc.micro_batch, heads=not args.keep_head, activations=not args.keep_activations)
        return _fit_choice(res, share)

    return replan


def _save(path: str, acc: Accumulator, dist: _Dist, data_rng: torch.Tensor, signature: RunSignature) -> None:
    """Every rank's RNG gathered into one state; rank 0 writes it atomically (NOTE [ Saving ])."""
    state = acc.state_dict(extra={"data_rng": data_rng, "world_size": dist.world, "run": signature.to_dict()})
    rngs = dist.gather_objects(state["rng"])
    if dist.is_main:
        state["rng_per_rank"] = rngs
        save_state(path, state)
    dist.barrier()


def _load(state: dict[str, Any], acc: Accumulator, dist: _Dist) -> torch.Tensor:
    """Put a state read by :func:`memfit.trainstate.load_state` into ``acc``; return the data RNG."""
    state = dict(state)
    per_rank = state.pop("rng_per_rank", None)
    saved_world = state.get("extra", {}).get("world_size")
    if per_rank is not None and saved_world == dist.world:
        state["rng"] = per_rank[dist.rank]
    extra = acc.load_state_dict(state)
    return extra["data_rng"]


def _claim_save_path(path: str | None, dist: _Dist) -> StateLock | None:
    """Rank 0 checks that ``path`` takes a file and locks it for the run; every rank gets its error."""
    if path is None:
        return None
    lock = None
    error: str | None = None
    if dist.is_main:
        try:
            check_writable(path)
            lock = StateLock(path).acquire()
        except MemfitError as err:
            error = str(err)
    error = dist.broadcast(error)
    if error is not None:
        raise TrainStateError(error)
    return lock


class _Abort(BaseException):
    """A second SIGINT/SIGTERM: leave at once (a BaseException, as KeyboardInterrupt, so that no
    ``except Exception`` in user code swallows it; a save in progress removes its temporary file)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """SIGINT and SIGTERM while training: the first asks the loop to stop after the current window,
    the second raises :class:`_Abort` (NOTE [ Saving ]). Handlers are restored on exit; outside the
    main thread (where Python cannot set handlers) signals keep their default behaviour."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise _Abort(signum)
        self.signum = signum
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"\nmemfit train: {signal.Signals(signum).name} received: finishing the current window, then saving "
                             "and stopping (send it again to stop at once)\n")  # fmt: skip
            sys.stderr.flush()


_SKIP_WORDS = {
    SkipReason.NO_TOKENS: "no valid tokens",
    SkipReason.NONFINITE_LOSS: "the loss is NaN or infinite",
    SkipReason.NONFINITE_GRAD: "the gradient norm is NaN or infinite",
    SkipReason.GRAD_SCALER: "the GradScaler found an inf/NaN gradient",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Stop:
    """Why the loop stopped before ``--steps``: a signal, a second signal, or divergence."""

    kind: str  # signal | abort | diverged | nonfinite_state
    step: int
    signum: int | None = None
    message: str | None = None

    def exit_code(self) -> int:
        if self.kind in ("signal", "abort"):
            return 128 + int(self.signum or signal.SIGTERM)  # 130 for SIGINT, 143 for SIGTERM
        return EXIT_DIVERGED

    def describe(self, args: argparse.Namespace, saved_at: int | None, acc: Accumulator) -> str:
        if args.save and saved_at is not None:
            resume = f"state of step {saved_at} saved to {args.save}; continue with the same command and --resume {args.save}"
        elif args.save:
            resume = f"{args.save} keeps its last complete save; continue with the same command and --resume {args.save}"
        else:
            resume = "nothing was saved (no --save); give --save PATH to be able to resume"
        if self.kind == "signal":
            return f"memfit train: stopped by {signal.Signals(self.signum or signal.SIGTERM).name} after step {self.step} of {args.steps}; {resume}"
        if self.kind == "abort":
            return f"memfit train: aborted at once by a second {signal.Signals(self.signum or signal.SIGTERM).name} during step {self.step + 1}; {resume}"
        if self.kind == "nonfinite_state":
            return f"{self.message}"
        last = acc.last_result.skip_reason.value if acc.last_result is not None and acc.last_result.skip_reason is not None else "?"
        return (
            f"memfit train: {acc.consecutive_skips} consecutive windows skipped for a NaN or infinite loss or gradient "
            f"(--max-skips {args.max_skips}; last: {last}) at step {self.step}: the run diverged. {resume[0].upper() + resume[1:]} "
            "after lowering --lr or setting --max-grad-norm."
        )


class _ProgressLog:
    """``--progress-jsonl``: one JSON line per step (rank 0), for soak tests and dashboards."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._t0 = time.perf_counter()

    @classmethod
    def open(cls, path: str | None) -> _ProgressLog | None:
        if path is None:
            return None
        try:
            return cls(open(path, "a", buffering=1))  # noqa: SIM115  (line-buffered, closed by close())
        except OSError as err:
            raise SpecError(f"memfit train: cannot write --progress-jsonl {path!r} ({err.strerror}). Give a writable path.") from None

    def write(self, step: int, result: StepResult, peak_bytes: int | None) -> None:
        record = {
            "step": step,
            "loss": result.loss if math.isfinite(result.loss) else None,
            "skip_reason": result.skip_reason.value if result.skip_reason is not None else None,
            "tracked_peak_bytes": peak_bytes,
            "rss_bytes": _rss_bytes(),
            "elapsed_s": time.perf_counter() - self._t0,
        }
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


def _rss_bytes() -> int | None:
    """Resident set size of this process now (Linux ``/proc/self/statm``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Dist:
    """The process group when launched by torchrun (WORLD_SIZE > 1), else a single process."""

    def __init__(self, rank: int, world: int, device: torch.device, owned: bool) -> None:
        self.rank, self.world, self.device, self._owned = rank, world, device, owned
        self.is_main = rank == 0

    @classmethod
    def setup(cls, device_arg: str) -> _Dist:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_arg == "auto":
            device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(device_arg)
            if device.type == "cuda" and device.index is None:
                device = torch.device(f"cuda:{local}")
        if world <= 1:
            return cls(0, 1, device, owned=False)
        import torch.distributed as tdist

        owned = not tdist.is_initialized()
        if owned:
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(tdist.get_rank(), tdist.get_world_size(), device, owned)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world <= 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def gather_objects(self, obj: Any) -> list[Any]:
        if self.world <= 1:
            return [obj]
        import torch.distributed as tdist

        objs: list[Any] = [None] * self.world
        tdist.all_gather_object(objs, obj)
        return objs

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world <= 1:
            return obj
        import torch.distributed as tdist

        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (one small all-reduce under torchrun)."""
        if self.world <= 1:
            return flag
        import torch.distributed as tdist

        t = torch.tensor([1.0 if flag else 0.0], device=self.device if self.device.type == "cuda" else "cpu")
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as tdist

            tdist.barrier()

    def close(self) -> None:
        if self._owned:
            import torch.distributed as tdist

            tdist.destroy_process_group()
