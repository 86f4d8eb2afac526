"""The ranks of a run: one process, or a process group set up from ``torchrun``'s environment.

Under ``torchrun --nproc_per_node=N`` (``WORLD_SIZE > 1``) :meth:`Ranks.setup` starts the process
group (gloo on CPU, NCCL on CUDA) unless the caller already did, :meth:`Ranks.wrap` wraps the model
in DDP, and the helpers below move Python objects between ranks. With one process every helper is
the identity and nothing of ``torch.distributed`` is touched.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel


class Ranks:
    """The process group when launched by torchrun (WORLD_SIZE > 1), else a single process."""

    def __init__(self, rank: int, world: int, device: torch.device, owned: bool) -> None:
        """Use :meth:`setup`; ``owned``: this object started the process group and ends it."""
        self.rank, self.world, self.device, self._owned = rank, world, device, owned
        self.is_main = rank == 0

    @classmethod
    def setup(cls, device_arg: str) -> Ranks:
        """This process's rank and device (``auto``: ``cuda:LOCAL_RANK`` when CUDA is available)."""
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
        owned = not tdist.is_initialized()
        if owned:
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(tdist.get_rank(), tdist.get_world_size(), device, owned)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` in DDP under torchrun, else ``model``."""
        if self.world <= 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def shares(self, global_batch: int) -> list[int]:
        """Samples of a global batch per rank: ``G / world``, the first ranks one more when it does not divide."""
        return [global_batch // self.world + (r < global_batch % self.world) for r in range(self.world)]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world <= 1:
            return [obj]
        objs: list[Any] = [None] * self.world
        tdist.all_gather_object(objs, obj)
        return objs

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world <= 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (one small all-reduce under torchrun)."""
        if self.world <= 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device if self.device.type == "cuda" else "cpu")
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world > 1:
            tdist.barrier()

    def close(self) -> None:
        """End the process group if :meth:`setup` started it."""
        if self._owned:
            tdist.destroy_process_group()
