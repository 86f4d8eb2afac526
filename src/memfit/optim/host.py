"""Optimizer state and step on the host (:class:`HostOptimizer`), gradients accumulated there.

NOTE [ The host optimizer ]
Plain training keeps the optimizer state (AdamW: two tensors the size of the parameters) and every
gradient on the device. Here the device keeps the parameters only, and for each parameter the host
keeps a copy of it, a gradient buffer and the optimizer state:

- backward: as soon as a parameter's gradient is complete (``register_post_accumulate_grad_hook``)
  it is copied to the host and freed on the device, so the device holds the gradients of the
  parameters whose hooks have not fired yet, never all of them. The first micro-step of a window
  copies into the host buffer, later ones are added to it: the host sums the micro-steps of a window
  in the order plain accumulation sums them on the device (``g1 + g2 + ...``), so the accumulated
  gradient is the same, uneven and token-normalised windows included (memfit's Accumulator divides a
  deferred token count into the host gradients, through :meth:`HostOptimizer.host_parameters`).
- step: torch's own optimizer of the user's class runs on the host copies (same dtype as the device
  parameters: the arithmetic of plain training in the same precision), then each updated copy is
  copied back into its device parameter.
- clipping by the global norm: every gradient is on the host before the step, so the norm is exact:
  :meth:`HostOptimizer.clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` over the host gradients.

On the CPU (the host is the device; what the tests run) the host copies are separate CPU tensors and
the parameters after ``k`` steps equal plain training's bitwise: the same single-tensor kernels run
on the same numbers. On CUDA the host buffers are pinned, the device-to-host copies run on a side
stream that waits for the backward's stream (so they overlap the rest of the backward), each
device gradient is freed once its copy is done (``record_stream``), the step waits for the copies'
events, and the copies back run on the side stream, which the compute stream then waits for. The
optimizer state itself never crosses the link and is ordinary host memory. Plain CUDA training
defaults to the multi-tensor (``foreach``) kernels, the host to the single-tensor ones: equal up to
the last bit's rounding (build the plain optimizer with ``foreach=False`` to compare bitwise).

Memory accounting: the host tensors are made and changed inside :func:`host_scope`, which tells
every active memory tracker with a ``host_scope`` (memfit's ``MemoryTracker``) to count new CPU
storages as host bytes; :meth:`HostOptimizer.host_tensors` lists the ones that exist already, which
a tracker's ``track`` counts as host bytes. A step measured on the CPU thus reports the device bytes
this placement has on a GPU, and the host bytes apart.

Known limitations:
    - ``torch.amp.GradScaler`` does not see the host gradients (its ``unscale_`` reads the device
      ``.grad``); :meth:`HostOptimizer.step` refuses it: use bf16 (no loss scaling) or the ``device``
      placement with fp16.
    - The CUDA paths have not run on a GPU yet.
    - One process only: under DDP a parameter's hook fires before its gradient is all-reduced, so the
      host would receive this rank's gradient; FSDP2's sharded parameters are refused.
    - A device parameter changed in place outside the optimizer (``load_state_dict`` of the model)
      is noticed through its version counter and copied to the host before the next step; a
      parameter replaced by a new tensor is not (build the optimizer after such changes).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memfit.errors import SpecError
from memfit.optim.hooks import ParameterHooks, grad_hook, remove_handles

__all__ = ["HostOptimizer", "host_optimizer", "host_scope"]


@contextlib.contextmanager
def host_scope() -> Iterator[None]:
    """Count the CPU storages made inside as host bytes in every active memory tracker that can.

    A tracker takes part by having a ``host_scope()`` context manager (memfit's ``MemoryTracker``);
    outside any tracker this does nothing.
    """
    with contextlib.ExitStack() as stack:
        for mode in _get_current_dispatch_mode_stack():
            scope = getattr(mode, "host_scope", None)
            if callable(scope):
                stack.enter_context(scope())
        yield


SCALER_REFUSAL = (
    "memfit.optim: a GradScaler (fp16 loss scaling) cannot see the host optimizer's gradients, which "
    "leave the device during the backward. Use --amp bf16 (no loss scaling), or --states device with fp16."
)
"""Why :class:`HostOptimizer` does not take a GradScaler (its ``step`` and the Accumulator refuse it)."""


class _Slot:
    """One device parameter's host side."""

    __slots__ = ("param", "host", "grad", "filled", "staging", "event", "add_staged", "version")

    def __init__(self, param: torch.Tensor, host: torch.Tensor, grad: torch.Tensor) -> None:
        self.param = param
        self.host = host  # the host copy the optimizer steps (same dtype as param)
        self.grad = grad  # the host gradient buffer: holds this window's sum while `filled`
        self.filled = False
        self.staging: torch.Tensor | None = None  # CUDA: a later micro-step's copy, added on arrival
        self.event: Any = None  # CUDA: the side stream's event after the last copy of this parameter
        self.add_staged = False
        self.version = param._version


class HostOptimizer(ParameterHooks, torch.optim.Optimizer):
    """``optimizer_class`` over host copies of ``params``: state, gradients and step on the host.

    See NOTE [ The host optimizer ] in :mod:`memfit.optim.host`. Use it as the optimizer of plain
    training (``loss.backward(); opt.step(); opt.zero_grad()``) or of memfit's Accumulator; its
    ``param_groups`` are the device parameters' (an LR scheduler drives them; the host optimizer takes
    their values right before it steps), and :meth:`state_dict` has the plain optimizer's format and
    loads into either.

    Args:
        params: parameters or parameter groups on one device, as for ``optimizer_class``.
        optimizer_class: a ``torch.optim.Optimizer`` class (``AdamW``, ``Adam``, ``SGD``, ...).
        **defaults: its keyword arguments (``lr``, ``momentum``, ...).

    Raises:
        SpecError: the parameters are on several devices, or sharded (FSDP2).

    Undo with :meth:`remove` (or use it as a context manager): the hooks leave the parameters, which
    then keep their gradients on the device again. They also leave when the optimizer is collected.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> with HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) as opt:
        ...     model(torch.ones(1, 4)).sum().backward()  # gradients go to the host
        ...     norm = opt.clip_grad_norm_(1.0)
        ...     opt.step()
        ...     opt.zero_grad()
        >>> model.weight.grad is None
        True
    """

    # GradScaler.step hands a scaling optimizer its scale (``grad_scale``, ``found_inf``) instead of
    # asserting on device gradients it cannot find: step() then refuses it with the fix.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], **defaults: Any) -> None:
        template = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        super().__init__(params, dict(template.defaults))
        devices = sorted({str(p.device) for g in self.param_groups for p in g["params"]})
        if len(devices) != 1:
            raise SpecError(
                f"memfit.optim: the host optimizer's parameters are on {len(devices)} devices "
                f"({', '.join(devices) or 'none'}). Give it the parameters of one device."
            )
        if any(hasattr(p, "full_tensor") for g in self.param_groups for p in g["params"]):  # DTensor
            raise SpecError(
                "memfit.optim: the host optimizer takes plain parameters, and these are sharded (FSDP2 DTensors). "
                "Keep sharded parameters on the host with FSDP2's CPUOffloadPolicy "
                "(memfit.optim.host_params.offload_parameters), or keep the optimizer on the device."
            )
        self.device = torch.device(devices[0])
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._slots: dict[int, _Slot] = {}  # id(device parameter) -> its host side
        self._handles: list[Any] = []
        host_groups = []
        with torch.no_grad(), host_scope():
            for group in self.param_groups:
                hosts = []
                for p in group["params"]:
                    host = torch.empty_like(p, device="cpu", pin_memory=cuda).copy_(p.detach())
                    slot = _Slot(p, host, torch.empty_like(host, pin_memory=cuda))
                    self._slots[id(p)] = slot
                    hosts.append(host)
                host_groups.append({**group, "params": hosts})
            self.host_optimizer = optimizer_class(host_groups)
        for slot in self._slots.values():
            if slot.param.requires_grad:
                self._handles.append(
                    slot.param.register_post_accumulate_grad_hook(grad_hook(self, HostOptimizer._take))
                )
        self._finalizer = weakref.finalize(self, remove_handles, self._handles)

    # --- the torch.optim.Optimizer surface --------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's while constructing; afterwards refused (build a new optimizer)."""
        if hasattr(self, "host_optimizer"):
            raise SpecError(
                "memfit.optim: the host optimizer takes no parameter group after it is built. Build a new one."
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The host optimizer's step on the host copies, then the copies back into the device parameters."""
        if hasattr(self, "found_inf"):  # set by torch.amp.GradScaler.step
            raise SpecError(SCALER_REFUSAL)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        slots = self._gather()
        for group, host_group in zip(self.param_groups, self.host_optimizer.param_groups, strict=True):
            for k, v in group.items():
                if k != "params":
                    host_group[k] = v
        with host_scope():
            for s in slots:
                if s.param._version != s.version:  # changed on the device (a model's load_state_dict)
                    s.host.copy_(s.param.detach())
                s.host.grad = s.grad if s.filled else None
            self.host_optimizer.step()
        self._copy_back(slots)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new window: no gradient on the device or the host (zeros with ``set_to_none=False``)."""
        if self._stream is not None:
            self._stream.synchronize()
        with torch.no_grad():
            for s in self._slots.values():
                s.event, s.add_staged = None, False
                s.param.grad = None
                s.host.grad = None
                s.filled = not set_to_none
                if not set_to_none:
                    s.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer's state dict (the host optimizer's, with this one's hyperparameters)."""
        state = self.host_optimizer.state_dict()
        for saved, group in zip(state["param_groups"], self.param_groups, strict=True):
            saved.update({k: v for k, v in group.items() if k != "params"})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain optimizer's (or this one's) state dict: the state goes to the host."""
        self.host_optimizer.load_state_dict(state_dict)
        for group, host_group in zip(self.param_groups, self.host_optimizer.param_groups, strict=True):
            group.update({k: v for k, v in host_group.items() if k != "params"})

    # --- the host side ---------------------------------------------------------------------------

    def host_parameters(self) -> list[torch.Tensor]:
        """The host copies whose gradient this window holds, each with ``.grad`` set to it.

        What a caller reads or changes in place instead of the device ``.grad`` (which is None): the
        gradient norm, a division by a token count known only at the end of a window.
        """
        slots = self._gather()
        for s in slots:
            s.host.grad = s.grad if s.filled else None
        return [s.host for s in slots if s.filled]

    def clip_grad_norm_(self, max_norm: float | None, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the host gradients (a host tensor), clipped to ``max_norm`` unless None.

        ``torch.nn.utils.clip_grad_norm_`` over the host gradients: called between the last backward
        and :meth:`step`, it clips as plain training's ``clip_grad_norm_(model.parameters(), ...)``.
        """
        hosts = self.host_parameters()
        with host_scope():
            if max_norm is None:
                return torch.nn.utils.get_total_norm([h.grad for h in hosts], norm_type)
            return torch.nn.utils.clip_grad_norm_(hosts, max_norm, norm_type)

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer keeps on the host: copies, gradient buffers, state."""
        out: list[torch.Tensor] = []
        for s in self._slots.values():
            out += [s.host, s.grad] + ([s.staging] if s.staging is not None else [])
        for state in self.host_optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    # --- the machinery ---------------------------------------------------------------------------

    def _take(self, p: torch.Tensor) -> None:
        """Move ``p``'s new gradient to the host: copied, or added to this window's sum; freed on the device."""
        slot = self._slots[id(p)]
        grad = p.grad
        if grad is None:
            return
        if self._stream is None:  # the host is the device's own memory: copy or add at once
            with host_scope():
                slot.grad.add_(grad) if slot.filled else slot.grad.copy_(grad)
        else:
            self._settle(slot)  # this parameter's copy from the previous micro-step
            if slot.filled and slot.staging is None:
                with host_scope():
                    slot.staging = torch.empty_like(slot.grad, pin_memory=True)
            target = slot.staging if slot.filled else slot.grad
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is written
            with torch.cuda.stream(self._stream):
                target.copy_(grad, non_blocking=True)
                slot.event = self._stream.record_event()
            grad.record_stream(self._stream)  # its memory is reused only after the copy
            slot.add_staged = slot.filled
        slot.filled = True
        p.grad = None

    def _settle(self, slot: _Slot) -> None:
        """CUDA: wait for ``slot``'s copy to arrive and add a staged micro-step into the sum."""
        if slot.event is None:
            return
        slot.event.synchronize()
        slot.event = None
        if slot.add_staged:
            with host_scope():
                slot.grad.add_(slot.staging)
            slot.add_staged = False

    def _gather(self) -> list[_Slot]:
        """Every slot with its gradient on the host: copies arrived, gradients set by hand taken."""
        if self._stream is not None:
            self._stream.synchronize()  # also the copies back of the last step
        slots = list(self._slots.values())
        for s in slots:
            if s.param.grad is not None:  # not through the hook: set by hand, or hooks removed
                with torch.no_grad():
                    self._take(s.param)
            self._settle(s)
        return slots

    def _copy_back(self, slots: list[_Slot]) -> None:
        """Each updated host copy into its device parameter (on CUDA on the side stream)."""
        if self._stream is None:
            for s in slots:
                s.param.copy_(s.host)
        else:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)  # the parameters are no longer read by queued kernels
            with torch.cuda.stream(self._stream):
                for s in slots:
                    s.param.copy_(s.host, non_blocking=True)
            compute.wait_stream(self._stream)  # the next forward reads the new values
        for s in slots:
            s.version = s.param._version


def host_optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer], **defaults: Any) -> HostOptimizer:
    """A :class:`HostOptimizer` over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SpecError("memfit.optim: the model has no trainable parameters to step on the host.")
    return HostOptimizer(params, optimizer_class, **defaults)
