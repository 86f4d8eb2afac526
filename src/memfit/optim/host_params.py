"""Parameters, gradients and optimizer state on the host between uses (:func:`offload_parameters`).

NOTE [ Parameters on the host ]
For models whose weights alone exceed the device, torch's own engine does the work: FSDP2's
``fully_shard(module, offload_policy=CPUOffloadPolicy())`` keeps each unit's parameters (its
"shard", the whole parameter at world size 1), their gradients, and so the optimizer state in
host memory; the forward and the backward copy a unit's parameters to the device just before it
runs and free them after; each gradient is reduced (a no-op over one process) and copied to the
host as the backward produces it; the optimizer steps on the host. memfit applies it to each block
given (by default each direct child of the model that holds parameters, looking into lists) and to the model itself,
also without ``torchrun``: when no process group exists it makes one of one process (gloo, and NCCL
for CUDA tensors) over an in-memory ``HashStore`` (no network), and destroys it on
:meth:`HostParams.close`.

At world size 1 the reduction divides by 1 and the optimizer (a plain ``torch.optim`` optimizer
built over the sharded parameters afterwards) runs the same single-tensor kernels on the same
numbers: on the CPU the parameters after ``k`` steps equal plain training's bitwise.

Known limitations:
    - ``fully_shard`` changes the model in place (its classes, its parameters become DTensors) and
      is not undone by :meth:`HostParams.close`: apply it to the model that is trained, or a copy.
    - Under memfit's Accumulator, micro-steps before the last of a window run without gradient sync
      (``set_requires_gradient_sync(False)``): FSDP2 then keeps their unsharded gradients on the
      device until the window's last micro-step; the window's gradient is the same.
    - The CUDA path (pinned host memory, NCCL group of one) has not run on a GPU yet. memfit's
      live-tensor tracker does not see FSDP2's storage resizes, so its peak of this placement is
      not a measurement (torch's ``FSDPMemTracker`` is).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from memfit.errors import SpecError

__all__ = ["HostParams", "offload_parameters"]


class HostParams:
    """What :func:`offload_parameters` did: the sharded model, and the process group it made, if any.

    Attributes:
        model: the model, sharded (the same object).
        units: the modules given to ``fully_shard`` (the blocks, then the model).
        made_group: whether memfit made the process group (then :meth:`close` destroys it).
    """

    def __init__(self, model: nn.Module, units: list[nn.Module], made_group: bool) -> None:
        self.model = model
        self.units = units
        self.made_group = made_group

    def close(self) -> None:
        """Destroy the process group memfit made (the model stays sharded)."""
        if self.made_group and dist.is_initialized():
            dist.destroy_process_group()
        self.made_group = False

    def __enter__(self) -> HostParams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def offload_parameters(
    model: nn.Module, blocks: Iterable[nn.Module] | None = None, *, pin_memory: bool | None = None
) -> HostParams:
    """Keep ``model``'s parameters, gradients and optimizer state on the host between uses (FSDP2).

    Build the optimizer after this call, over ``model.parameters()``. See NOTE [ Parameters on the
    host ] in :mod:`memfit.optim.host_params`.

    Args:
        model: the model, on its device (CPU or CUDA).
        blocks: the units whose parameters go to the device together (a transformer's layers);
            None: each direct child of ``model`` that holds parameters (the children of a
            ``ModuleList`` or ``ModuleDict`` child, which has no forward of its own).
        pin_memory: pin the host copies (None: on CUDA only; pinned memory needs an accelerator).

    Returns:
        A :class:`HostParams`; close it (or use it as a context manager) when training ends.

    Raises:
        SpecError: torch has no ``torch.distributed``, the model has no parameters, a process group
            of several processes exists, or the parameters are on several devices.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> with offload_parameters(model) as placed:
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     model(torch.ones(3, 4)).sum().backward()
        ...     opt.step()
        >>> len(placed.units)
        3
    """
    if not dist.is_available():
        raise SpecError(
            "memfit.optim: this torch has no torch.distributed, which keeps parameters on the host. Use --states host-optimizer."
        )
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) != 1:
        raise SpecError(
            f"memfit.optim: parameters on the host need the model's parameters on one device, found "
            f"{len(devices)} ({', '.join(devices) or 'none'}). Move the model to one device first."
        )
    device = torch.device(devices[0])
    made_group = not dist.is_initialized()
    if made_group:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise SpecError(
            f"memfit.optim: offload_parameters shards over one process, and a group of {dist.get_world_size()} "
            "exists. Under torchrun use torch's fully_shard with CPUOffloadPolicy (memfit train --parallel fsdp2)."
        )
    try:
        mesh = init_device_mesh(device.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda" if pin_memory is None else pin_memory)
        chosen = list(blocks) if blocks is not None else _default_units(model)
        units = [*chosen, model]
        for unit in units:
            fully_shard(unit, mesh=mesh, offload_policy=policy)
    except Exception:
        if made_group:
            dist.destroy_process_group()
        raise
    return HostParams(model, units, made_group)


def _default_units(model: nn.Module) -> list[nn.Module]:
    """Each child of ``model`` that holds parameters; a ``ModuleList``/``ModuleDict`` gives its children."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += _default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units
