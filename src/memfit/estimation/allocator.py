"""A model of what PyTorch's CUDA caching allocator holds beside the live tensors (a model, not
checked on a GPU in this code's tests).

memfit predicts the peak of live tensor bytes (the budget's quantity). A GPU's
``torch.cuda.max_memory_allocated`` adds memory no tensor owns, and ``max_memory_reserved`` adds
the allocator's cached segments on top. :func:`allocator_model` puts numbers on the parts that
are known from torch's source and from measurements on this project's lent GPU:

NOTE [ CUDA allocator model ]
- cuBLAS workspaces: torch allocates one per (cuBLAS handle, stream) through the caching
  allocator: ``4096 KiB x 8 = 32 MiB`` on Hopper and later (sm90+), ``2 x 4096 KiB + 8 x 16 KiB``
  before (``CUBLAS_WORKSPACE_CONFIG``'s defaults, ATen's ``CublasHandlePool.cpp``). A training step
  uses two: the forward's thread and the autograd engine's device thread. On an H200 (bf16,
  hf:gpt2 / hf:llama / demo, 2026-11-30) ``max_memory_allocated`` exceeded the tracked tensor peak
  by 66-72 MiB: the two 32 MiB workspaces plus 2-8 MiB.
- Block rounding: every block is a multiple of 512 B, so each live tensor costs up to 511 B more;
  not modelled per tensor (the 2-8 MiB above is that and kernel workspaces).
- Reserved memory: requests up to 1 MiB come from 2 MiB segments, larger ones from 20 MiB
  segments (up to 10 MiB) or their own segment rounded to 2 MiB. How far ``max_memory_reserved``
  exceeds ``max_memory_allocated`` depends on the order of allocations (fragmentation), which
  per-block stats do not have: the model gives the least it can be, the allocated peak rounded
  up to whole 2 MiB segments plus one small-pool segment. Expect more; ``expandable_segments:True``
  (``PYTORCH_CUDA_ALLOC_CONF``) brings reserved close to allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.estimation.devices import DeviceSpec

__all__ = ["AllocatorPrediction", "allocator_model", "cublas_workspace_bytes"]

_MiB = 2**20
_SEGMENT_BYTES = 2 * _MiB
_HOPPER_AND_LATER = ("h100", "h200")  # sm90 in the device table
STEP_WORKSPACES = 2
"""cuBLAS workspaces a training step holds: the forward's thread and autograd's device thread."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorPrediction:
    """The allocator model's numbers for one step (bytes; NOTE [ CUDA allocator model ])."""

    tensor_peak_bytes: int
    workspace_bytes: int
    predicted_allocated_bytes: int
    predicted_reserved_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "workspace_bytes": self.workspace_bytes,
            "predicted_allocated_bytes": self.predicted_allocated_bytes,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "model": "cuBLAS workspaces + whole 2 MiB segments (a lower bound of reserved); not checked on a GPU",
        }


def cublas_workspace_bytes(device: DeviceSpec) -> int:
    """One cuBLAS workspace as torch sizes it by default on ``device``."""
    if device.name.startswith(_HOPPER_AND_LATER):
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def allocator_model(
    tensor_peak_bytes: int, device: DeviceSpec, *, workspaces: int = STEP_WORKSPACES
) -> AllocatorPrediction:
    """What the CUDA allocator holds at a step whose live tensors peak at ``tensor_peak_bytes``.

    Args:
        tensor_peak_bytes: the predicted peak of live tensor bytes.
        device: the GPU (``cpu`` has no allocator overhead: both predictions are the tensor peak).
        workspaces: cuBLAS workspaces alive (2 for a training step).
    """
    if device.name == "cpu":
        return AllocatorPrediction(
            tensor_peak_bytes=tensor_peak_bytes, workspace_bytes=0,
            predicted_allocated_bytes=tensor_peak_bytes, predicted_reserved_bytes=tensor_peak_bytes,
        )  # fmt: skip
    ws = workspaces * cublas_workspace_bytes(device)
    allocated = tensor_peak_bytes + ws
    reserved = -(-allocated // _SEGMENT_BYTES) * _SEGMENT_BYTES + _SEGMENT_BYTES
    return AllocatorPrediction(
        tensor_peak_bytes=tensor_peak_bytes,
        workspace_bytes=ws,
        predicted_allocated_bytes=allocated,
        predicted_reserved_bytes=reserved,
    )
