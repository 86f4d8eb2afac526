"""`memfit train`: real training with exact gradient accumulation, also under ``torchrun``.

Every step draws one global batch of ``--global-batch`` samples from the workload (the same batch
on every rank: the data RNG is separate from the training RNG and seeded identically), each rank
takes its share (``G / world_size``, the first ranks one more when it does not divide), and an
:class:`~memfit.accumulate.Accumulator` runs it in micro-batches of ``--micro-batch`` and steps
once. Under ``torchrun --nproc_per_node=N`` the model is wrapped in DDP (gloo on CPU, NCCL on
CUDA) and only rank 0 prints; the result equals a single-process run up to the order of float
additions.

Peak memory is measured on the first step only, with :class:`memfit.capture.tracker.MemoryTracker`
on CPU (it costs tens of microseconds per op, so the first step is slower and is left out of
samples/s), and with ``torch.cuda.max_memory_allocated`` over all steps on CUDA.

Known limitations:
    - Under DDP the tracker does not see DDP's own gradient buckets (allocated before the step).
    - ``--save`` writes at the end of the run (rank 0); RNG states of every rank are gathered into
      the file so that ``--resume`` continues bitwise on the same world size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch

from memfit.accumulate import Accumulator, Normalize, StepResult
from memfit.cli.common import Output, add_workload_args, mib, parse_dtype, positive_int, size_arg
from memfit.errors import SpecError
from memfit.workload import Workload, cast_batch, load_workload, split_batch

HELP = "train a workload with exact gradient accumulation (progress, samples/s, peak memory; torchrun-aware)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from memfit.capture.step import OPTIMIZERS

    add_workload_args(p, batch=False)
    p.add_argument("--global-batch", type=positive_int, required=True, metavar="G", help="samples per optimizer step, over all ranks")
    # Sizing of a micro-step: fixed, or fitted to a memory budget (micro-batch and plan).
    sizing = p.add_mutually_exclusive_group()
    sizing.add_argument("--micro-batch", type=positive_int, default=None, metavar="b", help="samples per micro-step on each rank (default: the rank's whole share, no accumulation)")
    sizing.add_argument("--budget", type=size_arg, default=None, metavar="SIZE", help="fit micro-batch and checkpoint plan to this peak memory per rank (memfit fit)")
    p.add_argument("--steps", type=positive_int, required=True, metavar="N", help="optimizer steps (in total, counting those of a resumed run)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 3e-4 for adamw/adam, 0.05 for sgd)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--normalize", default="auto", choices=[n.value for n in Normalize], help="loss normalisation (auto: tokens for (loss_sum, count) workloads, else mean)")
    p.add_argument("--policy", default=None, metavar="P", help="apply a checkpoint policy first: none, all, sqrt, every:K")
    p.add_argument("--max-grad-norm", type=float, default=None, metavar="X", help="clip the global gradient norm at each step")
    p.add_argument("--amp", default=None, choices=["bf16", "fp16"], help="autocast the forward (fp16 adds a GradScaler)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--resume", default=None, metavar="PATH", help="continue from a state saved with --save")
    p.add_argument("--save", default=None, metavar="PATH", help="save the training state at the end")


def resolve_micro_batch(args: argparse.Namespace, workload: Workload, share: int, out: Output, dist: _Dist) -> tuple[int, Any]:
    """Samples per micro-step on this rank, and the fitted plan when ``--budget`` is given.

    With ``--budget``, rank 0 runs the auto-fit on its share of the global batch and sends the
    micro-batch and the plan to the other ranks, so that every rank runs the same plan.
    """
    if getattr(args, "budget", None) is None:
        return min(args.micro_batch or share, share), None
    from memfit.autofit import autofit
    from memfit.plan import Plan

    choice: list[Any] = [None]
    if dist.is_main:
        with out.console.status("auto-fit ...") as status:
            res = autofit(workload, args.budget, share, optimizer=args.optimizer, seed=args.seed, progress=lambda s: status.update(f"auto-fit: {s}"))
        out.print(
            f"auto-fit: micro-batch {res.micro_batch} x {res.accumulation_steps}, {len(res.plan.recomputed)} blocks recomputed; "
            f"predicted peak {mib(res.predicted_peak_bytes)}, measured {mib(res.measured_peak_bytes)} (budget {mib(args.budget)})"
        )
        choice = [(res.micro_batch, res.plan.to_dict())]
    if dist.world > 1:
        torch.distributed.broadcast_object_list(choice, src=0)
    micro, plan_dict = choice[0]
    return micro, Plan.from_dict(plan_dict)


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
    wl = load_workload(args.model, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
    raw = wl.model.to(dist.device)
    raw.train()
    shares = [args.global_batch // dist.world + (r < args.global_batch % dist.world) for r in range(dist.world)]
    share = shares[dist.rank]
    if args.policy and getattr(args, "budget", None) is not None:
        raise SpecError("memfit train: give --policy or --budget, not both (--budget chooses the plan).")
    micro, plan = resolve_micro_batch(args, wl, share, out, dist)
    if args.policy:
        from memfit.plan import policy_plan

        plan = policy_plan(raw, args.policy)
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
        micro_batch=micro,
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
    if args.resume:
        data_rng = _load(args.resume, acc, dist)
    start = acc.windows
    if start >= args.steps:
        raise SpecError(
            f"memfit train: {args.resume} is already at step {start}; ask for more --steps than that."
        )

    k = -(-share // micro)
    out.print(
        f"[bold]memfit train[/] {wl.name}: global batch {args.global_batch} = {dist.world} rank(s) x "
        f"{share} = {k} micro-step(s) of {micro}" + (f", policy {plan.policy!r}" if plan else "")
        + (f", resumed at step {start}" if args.resume else ""),
    )
    losses: list[float] = []
    step_s: list[float] = []
    peak_bytes: int | None = None
    peak_how = "none"
    last: StepResult | None = None
    with out.progress() as progress:
        task = progress.add_task("train", total=args.steps, completed=start, info="")
        for step in range(start, args.steps):
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(data_rng)
                batch = wl.make_batch(args.global_batch)
                data_rng = torch.get_rng_state()
            mine = split_batch(batch, shares)[dist.rank] if dist.world > 1 else batch
            mine = cast_batch(mine, dtype=dtype, device=dist.device)
            measure = step == start and dist.device.type == "cpu"
            tracker = _tracker(measure, dist.device)
            t0 = time.perf_counter()
            with tracker if tracker is not None else nullcontext():
                if tracker is not None:
                    tracker.track(raw, optimizer, mine)
                last = acc.step(mine, wl.loss_fn, count_fn=wl.count_fn)
            if dist.device.type == "cuda":
                torch.cuda.synchronize(dist.device)
            dt = time.perf_counter() - t0
            if tracker is not None:
                peak_bytes, peak_how = tracker.peak_bytes, "MemoryTracker, first step"
            else:
                step_s.append(dt)
            if dist.device.type == "cuda":
                peak_bytes, peak_how = torch.cuda.max_memory_allocated(dist.device), "torch.cuda.max_memory_allocated"
            losses.append(last.loss)
            sps = args.global_batch / statistics.median(step_s) if step_s else None
            progress.update(
                task,
                advance=1,
                info=f"loss {last.loss:.4f}  "
                + (f"{sps:.1f} samples/s  " if sps else "")
                + f"peak {mib(peak_bytes)}"
                + (f"  skipped {acc.skipped_steps}" if acc.skipped_steps else ""),
            )
    if args.save:
        _save(args.save, acc, dist, data_rng)
    samples_per_s = args.global_batch / statistics.median(step_s) if step_s else None
    result = {
        "model": wl.name,
        "world_size": dist.world,
        "global_batch": args.global_batch,
        "micro_batch": micro,
        "accumulation_steps": k,
        "steps": args.steps,
        "start_step": start,
        "optimizer_steps": acc.optimizer_steps,
        "skipped_steps": acc.skipped_steps,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "samples_per_s": samples_per_s,
        "step_s": statistics.median(step_s) if step_s else None,
        "peak_bytes": peak_bytes,
        "peak_measured_by": peak_how,
        "policy": plan.policy if plan else None,
        "normalize": args.normalize,
        "saved_to": args.save,
    }
    out.table(
        f"trained {wl.name}",
        ["quantity", "value"],
        [
            ("steps", f"{start} -> {args.steps} ({acc.skipped_steps} skipped)"),
            ("final loss", f"{losses[-1]:.4f}" if losses else "-"),
            ("samples/s", f"{samples_per_s:.1f} (median over steps after the first)" if samples_per_s else "-"),
            ("peak memory", f"{mib(peak_bytes)} ({peak_how})"),
        ],
    )
    return result


def _tracker(enabled: bool, device: torch.device) -> Any:
    if not enabled:
        return None
    try:
        from memfit.capture.tracker import MemoryTracker
    except ImportError:  # pragma: no cover - the tracker ships with memfit
        return None
    return MemoryTracker(device=device)


def _save(path: str, acc: Accumulator, dist: _Dist, data_rng: torch.Tensor) -> None:
    state = acc.state_dict(extra={"data_rng": data_rng, "world_size": dist.world})
    rngs = dist.gather_objects(state["rng"])
    if dist.is_main:
        state["rng_per_rank"] = rngs
        torch.save(state, path)
    dist.barrier()


def _load(path: str, acc: Accumulator, dist: _Dist) -> torch.Tensor:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SpecError(f"memfit train: no saved state at {path!r}. Save one with --save PATH first.") from None
    per_rank = state.pop("rng_per_rank", None)
    saved_world = state.get("extra", {}).get("world_size")
    if per_rank is not None and saved_world == dist.world:
        state["rng"] = per_rank[dist.rank]
    extra = acc.load_state_dict(state)
    return extra["data_rng"]


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

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as tdist

            tdist.barrier()

    def close(self) -> None:
        if self._owned:
            import torch.distributed as tdist

            tdist.destroy_process_group()
