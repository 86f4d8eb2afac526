"""Parameters, gradients and optimizer state in bytes, by exact arithmetic.

NOTE [ Precision convention ]
With ``dtype`` D (the ``--dtype`` the model is trained in) and ``N`` trainable parameters:

- parameters are stored in D: ``params_bytes = N_all x size(D)``;
- gradients have the parameters' dtype (what autograd produces): ``N x size(D)``;
- optimizer state follows the parameters it updates, as torch's optimizers allocate it
  (``zeros_like(param)``): SGD with momentum keeps 1 tensor per parameter, Adam and AdamW keep 2
  (``exp_avg``, ``exp_avg_sq``). Adam's per-parameter ``step`` counters are 0-dim tensors, kept
  on the CPU for CUDA parameters, and are left out.
- with ``master_weights`` (mixed precision with a low-precision D), the optimizer updates fp32
  copies of the parameters instead: the copies (``N x 4``) and an fp32 state (``k x N x 4``)
  count as optimizer memory, the model keeps its D parameters and D gradients. AdamW with bf16
  and master weights is therefore 2 + 2 + 12 = 16 bytes per parameter.

Known limitations:
    Frameworks that keep fp32 gradient buffers (Megatron's ``accumulate_allreduce_grads_in_fp32``,
    DeepSpeed's bf16 optimizer) use 2 more bytes per parameter than this convention's gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from memfit.errors import SpecError

__all__ = ["OPTIMIZER_STATES", "StaticBytes", "static_bytes", "unique_parameters"]

OPTIMIZER_STATES: dict[str, int] = {"sgd": 1, "adam": 2, "adamw": 2}
"""State tensors per parameter, by optimizer name (SGD is with momentum, as memfit runs it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticBytes:
    """The memory a training step holds whatever the batch: parameters, gradients, optimizer.

    Attributes:
        n_params: parameters (each shared tensor once), trainable or not.
        n_trainable: parameters with ``requires_grad``.
        params_bytes: the parameters, in the training dtype.
        buffers_bytes: the model's buffers (rotary tables, BatchNorm statistics, ...).
        grads_bytes: one gradient per trainable parameter, in the parameters' dtype.
        master_weights_bytes: fp32 copies of the trainable parameters (0 without master weights).
        optimizer_state_bytes: the optimizer's state tensors (momentum, Adam moments).
        optimizer_bytes: ``master_weights_bytes + optimizer_state_bytes``.
    """

    n_params: int
    n_trainable: int
    params_bytes: int
    buffers_bytes: int
    grads_bytes: int
    master_weights_bytes: int
    optimizer_state_bytes: int
    optimizer_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters, each shared (tied) tensor once, in ``model.parameters()`` order."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def static_bytes(model: nn.Module, *, optimizer: str, master_weights: bool = False) -> StaticBytes:
    """Bytes of parameters, buffers, gradients and optimizer state of ``model`` as it is now.

    Only shapes and dtypes are read, so ``model`` may hold meta or fake tensors. See
    NOTE [ Precision convention ] for what is counted.

    Args:
        model: the model, already in its training dtype.
        optimizer: ``sgd`` (with momentum), ``adam`` or ``adamw``.
        master_weights: the optimizer updates fp32 copies of the parameters.

    Raises:
        SpecError: unknown optimizer.

    Example:
        >>> static_bytes(nn.Linear(10, 10), optimizer="adamw").optimizer_bytes  # 110 x 2 x 4
        880
    """
    if optimizer not in OPTIMIZER_STATES:
        raise SpecError(f"memfit.estimate: unknown optimizer {optimizer!r}. Use one of: {', '.join(OPTIMIZER_STATES)}.")
    params = unique_parameters(model)
    trainable = [p for p in params if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    states = OPTIMIZER_STATES[optimizer]
    if master_weights:
        master = n_trainable * 4
        state = states * n_trainable * 4
    else:
        master = 0
        state = states * grads
    buffers = {id(b): b.numel() * b.element_size() for b in model.buffers()}
    return StaticBytes(
        n_params=sum(p.numel() for p in params),
        n_trainable=n_trainable,
        params_bytes=sum(p.numel() * p.element_size() for p in params),
        buffers_bytes=sum(buffers.values()),
        grads_bytes=grads,
        master_weights_bytes=master,
        optimizer_state_bytes=state,
        optimizer_bytes=master + state,
    )
