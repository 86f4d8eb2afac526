"""Data parallelism under accumulation: which kind, its process group, gradient sync, small all-reduces.

NOTE [ Gradient sync ]
Under DDP the first ``k - 1`` micro-steps run inside ``model.no_sync()`` (forward and backward);
under FSDP2 (``fully_shard``) ``model.set_requires_gradient_sync(False)`` is set for them and
``True`` for the last. Gradients are therefore reduced once per bucket (DDP) or once per FSDP
parameter group (FSDP2) per optimizer step. Only public APIs are used.

Known limitations:
    - Data parallelism is recognised when ``model`` itself is a ``DistributedDataParallel`` or an
      FSDP2 module; counts are all-reduced over the DDP process group, or the default group for
      FSDP2 (pass ``process_group=`` for HSDP or tensor parallel meshes). A plain model under an
      initialised process group is treated as single-process (its gradients are not reduced by
      memfit).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.accumulate.types import AccumulationError
from memfit.capture.chain import is_fully_sharded

__all__ = ["DataParallel", "equal_sizes"]

Kind = Literal["local", "ddp", "fsdp2"]


class DataParallel:
    """How ``model`` is spread over processes, and the operations accumulation needs from that.

    Args:
        model: the model as the loss function calls it: a plain module, a
            ``DistributedDataParallel`` or an FSDP2 (``fully_shard``) module.
        process_group: the group data parallelism runs over (default: DDP's group, or the default
            group for FSDP2).
        device: where the model's parameters are (small all-reduces run there, or on the CPU for gloo).

    Attributes:
        kind: ``"local"`` (one process, or a plain model), ``"ddp"`` or ``"fsdp2"``.
        group: the process group (None when local).
        world_size: processes in the group (1 when local).
        rank: this process's rank in the group (0 when local).
    """

    def __init__(self, model: nn.Module, process_group: Any = None, *, device: torch.device) -> None:
        self.model = model
        self.kind, self.group = _data_parallel_kind(model, process_group)
        self.world_size = dist.get_world_size(self.group) if self.kind != "local" else 1
        self.rank = dist.get_rank(self.group) if self.kind != "local" else 0
        self._device = device

    def sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Where a micro-step's backward runs: gradient reduction on only when ``sync`` (NOTE [ Gradient sync ])."""
        if self.kind == "ddp" and not sync:
            return self.model.no_sync()  # type: ignore[operator]
        if self.kind == "fsdp2":
            self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return contextlib.nullcontext()

    def restore_sync(self) -> None:
        """Gradient reduction back on (FSDP2 keeps the flag between calls)."""
        if self.kind == "fsdp2":
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def one_hot(self, value: int) -> list[float]:
        """``[0, ..., value, ..., 0]``: ``value`` at this rank's position of ``world_size`` slots."""
        out = [0.0] * self.world_size
        out[self.rank] = float(value)
        return out

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum small host numbers over the data-parallel group (no-op on one process)."""
        if self.kind == "local":
            return values
        dev = self._device if _backend(self.group) != "gloo" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def unwrapped(self) -> nn.Module:
        """The module whose ``state_dict`` to save: DDP's inner module (its keys start with
        ``module.``), so a state is loadable by a single process and by any world size."""
        return self.model.module if self.kind == "ddp" else self.model  # type: ignore[return-value]


def equal_sizes(total: int, k: int, rank: int) -> list[int]:
    """``total`` samples in ``k`` near-equal micro-batches (FSDP2 needs the same k on every rank)."""
    if total < k:
        raise AccumulationError(
            f"memfit.accumulate: rank {rank} has {total} samples but another rank runs {k} "
            "micro-steps; under FSDP2 every rank must run the same number of forwards (each one "
            f"all-gathers parameters). Give every rank at least {k} samples, or equal shares."
        )
    base, rem = divmod(total, k)
    return [base + 1] * rem + [base] * (k - rem)


def _data_parallel_kind(model: nn.Module, group: Any) -> tuple[Kind, Any]:
    if isinstance(model, DistributedDataParallel):
        return "ddp", group if group is not None else model.process_group
    if is_fully_sharded(model):
        return "fsdp2", group
    return "local", None


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()
