"""Saving and resuming a run: every rank's RNG in one atomic file that rank 0 writes.

NOTE [ Saving ]
The ``save`` path is checked before anything else runs (the directory exists and takes a probe
file) and locked for the whole run (``PATH.lock``, see :mod:`memfit.training.state`): a second run on
the same path is refused with the other run's pid. The state is written at the end, every
``save_every`` steps, and when the run stops early, always atomically (a temporary file beside
``PATH``, fsynced, renamed over it), so ``PATH`` is the previous complete state or the new one,
never a mix, whatever kills the process. Rank 0 writes; the RNG states of every rank are gathered
into the file so that ``resume`` continues bitwise on the same world size. The step a save holds
counts as saved once the file is renamed, before the barrier that closes the save: a rank lost at
that barrier leaves a complete file, and the resume line names that step.

Under FSDP2 (``parallel`` fsdp2 on several ranks) each rank holds shards (DTensors), which the
file cannot hold as they are: the model and the optimizer state are gathered into full state
dicts (``torch.distributed.checkpoint.state_dict``, ``full_state_dict=True``, on rank 0's CPU) and
written in the same one file. The model's keys are those of a single process (a plan changes no
name), so the weights load anywhere; the optimizer state is keyed by parameter name, so the file
resumes under FSDP2 only (another layout is refused with the fix), on the same world size as every
resume.

``resume`` reads the file with one-line errors for a missing, empty, truncated or foreign file,
then refuses, before any fitting, a state that cannot continue exactly: other parameter names or
shapes, another optimizer, sequence length, global batch, world size or dtype
(:func:`memfit.training.state.check_resume`). The config's ``lr`` replaces the saved learning rate in
every parameter group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memfit.accumulate import Accumulator
from memfit.errors import MemfitError
from memfit.plan.parallel import Parallel, ParallelKind
from memfit.training.config import TrainConfig
from memfit.training.distributed import Ranks
from memfit.training.integrity import CHECKSUM_KEY, changed_options, check_values, run_options
from memfit.training.savepath import check_free_space
from memfit.training.state import (
    RunSignature,
    StateLock,
    TrainStateError,
    check_writable,
    save_state,
)
from memfit.workload import Workload


def save_run(
    path: str,
    acc: Accumulator,
    dist: Ranks,
    data_rng: torch.Tensor,
    signature: RunSignature,
    parallel: Parallel | None = None,
    on_written: Callable[[], None] | None = None,
    options: Mapping[str, Any] | None = None,
) -> None:
    """Every rank's RNG gathered into one state; rank 0 writes it atomically (NOTE [ Saving ]).

    ``on_written`` runs once the file is complete (on the other ranks: once their part is gathered),
    before the closing barrier: a rank lost at that barrier leaves a complete file to resume from.
    ``options`` (:func:`options_of`) are compared with a resumed run's.
    """
    sharded = _sharded(parallel, dist)
    extra = {
        "data_rng": data_rng,
        "world_size": dist.world,
        "run": signature.to_dict(),
        "parallel": parallel.kind.value if parallel else None,
        "options": dict(options or {}),
    }
    state = acc.state_dict(include_model=not sharded, extra=extra)
    if sharded:  # every rank takes part in the gathers; rank 0 keeps the full tensors
        # Loads DTensor and FSDP (~1.5 s of CPU): only a sharded run pays it.
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state["model"] = get_model_state_dict(acc.model, options=opts)
        state["optimizer"] = get_optimizer_state_dict(acc.model, acc.optimizer, options=opts)
    rngs = dist.gather_objects(state["rng"])
    if dist.is_main:
        state["rng_per_rank"] = rngs
        save_state(path, state)
    if on_written is not None:
        on_written()
    dist.barrier()


def load_run(state: dict[str, Any], acc: Accumulator, dist: Ranks, parallel: Parallel | None = None) -> torch.Tensor:
    """Put a state read by :func:`memfit.training.state.load_state` into ``acc``; return the data RNG.

    Raises:
        TrainStateError: a state saved under FSDP2 resumed in another layout, or the reverse.
    """
    state = dict(state)
    saved_kind = state.get("extra", {}).get("parallel")
    sharded = _sharded(parallel, dist)
    if (saved_kind == ParallelKind.FSDP2.value) != sharded:
        was = (
            "an FSDP2 run (--parallel fsdp2)"
            if saved_kind == ParallelKind.FSDP2.value
            else f"a {saved_kind or 'single-process or DDP'} run"
        )
        now = "FSDP2" if sharded else "not FSDP2"
        fix = f"--parallel {saved_kind}" if saved_kind else "the layout it was saved with (leave out --parallel fsdp2)"
        raise TrainStateError(
            f"memfit.training: the state was saved by {was} and this run is {now}; its optimizer state is laid out for that "
            f"layout. Resume with {fix}."
        )
    if sharded:  # full state dicts: every rank loads its own shards from them
        # Loads DTensor and FSDP (~1.5 s of CPU): only a sharded run pays it.
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(acc.model, state.pop("model"), options=opts)
        set_optimizer_state_dict(acc.model, acc.optimizer, state["optimizer"], options=opts)
        state["optimizer"] = acc.optimizer.state_dict()  # now this rank's shards, for the Accumulator's own load
    per_rank = state.pop("rng_per_rank", None)
    saved_world = state.get("extra", {}).get("world_size")
    if per_rank is not None and saved_world == dist.world:
        state["rng"] = per_rank[dist.rank]
    with warnings.catch_warnings():  # a changed micro-batch is one of resume_notes' lines instead
        warnings.filterwarnings("ignore", message="memfit.accumulate: resuming with micro_batch")
        extra = acc.load_state_dict(state)
    return extra["data_rng"]


_AMP_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def options_of(config: TrainConfig, acc: Accumulator) -> dict[str, Any]:
    """The options a save records and a resume compares (NOTE [ Checked resume files ] in :mod:`memfit.training.integrity`)."""
    return run_options(
        seed=config.seed,
        normalize=acc.normalize.value,
        amp=_AMP_NAMES.get(config.autocast_dtype) if config.autocast_dtype is not None else None,
        max_grad_norm=config.max_grad_norm,
        micro_batch=acc.micro_batch,
        device=next((p.device.type for p in acc.model.parameters()), "cpu"),
    )


def check_start(config: TrainConfig, saved: Mapping[str, Any] | None, model: nn.Module, dist: Ranks) -> list[str]:
    """Before the fit: refuse a saved state whose values no run can continue from, and a save that
    would not fit the free space; return a warning for a saved state without a checksum."""
    check_save_space(config.save, model, config.optimizer, dist)
    if saved is None or config.resume is None:
        return []
    check_values(config.resume, saved, model)
    if CHECKSUM_KEY in saved:
        return []
    return [
        f"memfit.trainstate: {config.resume!r} has no checksum (written by torch.save or an older memfit): its "
        "content was not checked; memfit train --save writes one."
    ]


def resume_notes(path: str, state: Mapping[str, Any], config: TrainConfig, acc: Accumulator) -> list[str]:
    """One line per option changed since the save (raises where the run cannot continue)."""
    return changed_options(path, (state.get("extra") or {}).get("options"), options_of(config, acc))


_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1}  # optimizer tensors per parameter (exp_avg and exp_avg_sq; momentum)


def check_save_space(path: str | None, model: nn.Module, optimizer: str, dist: Ranks) -> None:
    """Rank 0: refuse a run whose save would not fit in the free space beside ``path`` (NOTE [ Save targets ])."""
    if path is None:
        return
    error: str | None = None
    if dist.is_main:
        seen: set[int] = set()
        model_bytes = 0
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                model_bytes += t.numel() * t.element_size()
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        try:
            check_free_space(path, model_bytes + _MOMENTS.get(optimizer, 2) * trainable)
        except TrainStateError as err:
            error = str(err)
    error = dist.broadcast(error)
    if error is not None:
        raise TrainStateError(error)


def _sharded(parallel: Parallel | None, dist: Ranks) -> bool:
    return parallel is not None and parallel.kind is ParallelKind.FSDP2 and dist.world > 1


def claim_save_path(path: str | None, dist: Ranks) -> StateLock | None:
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


def run_signature(workload: Workload, model: nn.Module, config: TrainConfig, world_size: int) -> RunSignature:
    """What a saved state must match to be resumed by this run (:func:`memfit.training.state.check_resume`)."""
    return RunSignature(
        model=workload.name,
        optimizer=config.optimizer,
        seq_len=config.seq_len or workload.info.get("seq_len") or workload.info.get("config", {}).get("seq_len"),
        global_batch=config.global_batch,
        world_size=world_size,
        dtype=str(next((p.dtype for p in model.parameters()), torch.float32)).removeprefix("torch."),
    )
