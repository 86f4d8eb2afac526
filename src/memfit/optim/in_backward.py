"""The optimizer step inside the backward (:class:`StepInBackward`), on torch's own optimizers.

NOTE [ The step inside the backward ]
Plain training holds every gradient at once: the backward writes them all, then the optimizer
reads them all. Here each parameter is stepped as soon as its gradient is complete
(``Tensor.register_post_accumulate_grad_hook``, as torchtune's ``optimizer_in_bwd`` and torch's
tutorial "How to save memory by fusing the optimizer step into the backward pass" do), and its
gradient is freed at once (``p.grad = None``): the device holds the gradients of the parameters whose
hooks have not fired yet, never all of them.

One optimizer of the user's class per parameter does the arithmetic (torch's own kernels, each
over one tensor), and :class:`StepInBackward` is the one ``torch.optim.Optimizer`` the user
holds: its ``param_groups`` are the plain optimizer's (an LR scheduler drives them; each
parameter's optimizer takes its group's values right before it steps), and its ``state`` is the
one dictionary every parameter's optimizer writes into, so that ``state_dict()`` has the plain
optimizer's format and loads into either. On the CPU torch's optimizers default to the
single-tensor kernels, the ones a parameter's own optimizer runs: the parameters after ``k``
steps equal plain training's bitwise. On CUDA plain training defaults to the multi-tensor
(``foreach``) kernels, which may round differently in the last bit; build the plain optimizer
with ``foreach=False`` to compare bitwise.

The window must be one micro-step: a second backward before :meth:`StepInBackward.step` or
``zero_grad`` would step each parameter again (it raises instead). Clipping by the global norm
needs every gradient before any step, which never exist together here (refused: use the
``device`` placement).

Known limitations:
    - A window cannot be skipped after the fact (a non-finite loss or gradient, a GradScaler's
      inf check): the parameters were stepped in the backward.
    - Parameters without a gradient in a backward are not stepped in it (as plain training, whose
      optimizer skips them); a gradient set by hand is stepped by :meth:`StepInBackward.step`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfit.errors import MemfitError
from memfit.optim.hooks import ParameterHooks, grad_hook, remove_handles
from memfit.optim.host import SCALER_REFUSAL, HostOptimizer

__all__ = ["InBackwardError", "StepInBackward", "placement_refusal", "release_optimizer"]


class InBackwardError(MemfitError):
    """The optimizer step inside the backward cannot do what was asked (accumulation, clipping)."""


ACCUMULATION_FIX = (
    "The step inside the backward needs a window of one micro-step; use --states device, or a "
    "micro-batch equal to the global batch."
)
CLIPPING_FIX = "Clipping by the global norm needs every gradient before any step; use --states device, or do not clip."


class StepInBackward(ParameterHooks, torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, stepping each parameter inside the backward.

    Args:
        params: parameters or parameter groups, as for ``optimizer_class``.
        optimizer_class: a ``torch.optim.Optimizer`` class (``AdamW``, ``Adam``, ``SGD``, ...).
        **defaults: its keyword arguments (``lr``, ``momentum``, ...).

    Undo with :meth:`remove` (or use it as a context manager): the hooks leave the parameters.
    They also leave when the optimizer is garbage-collected.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> with StepInBackward(model.parameters(), torch.optim.SGD, lr=0.1) as opt:
        ...     model(torch.ones(1, 4)).sum().backward()  # steps here
        ...     opt.step()  # nothing left to step
        ...     opt.zero_grad()
        >>> model.weight.grad is None
        True
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], **defaults: Any) -> None:
        self._optimizer_class = optimizer_class
        self._one: dict[int, torch.optim.Optimizer] = {}  # id(p) -> p's own optimizer
        self._where: dict[int, int] = {}  # id(p) -> index of its group
        self._handles: list[Any] = []
        self._stepped: set[int] = set()  # ids of the parameters stepped in this window
        self._ready = False
        template = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        super().__init__(params, dict(template.defaults))
        self._ready = True
        for i, group in enumerate(self.param_groups):
            self._register(group, i)
        # The hooks hold the optimizer weakly; when it is collected they leave the parameters.
        self._finalizer = weakref.finalize(self, remove_handles, self._handles)

    # --- the torch.optim.Optimizer surface --------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and the group's parameters step inside the backward from now on."""
        super().add_param_group(param_group)
        if self._ready:
            self._register(self.param_groups[-1], len(self.param_groups) - 1)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """End the window: step any gradient the backward left (one set by hand), start a new window.

        The backward already stepped every parameter whose gradient it produced, so the plain
        loop's ``loss.backward(); opt.step()`` updates each parameter once. ``closure`` (as torch's
        optimizers take) runs the forward and backward, which step the parameters.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in self._stepped:
                    self._step_one(p)
        self._stepped.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; also starts a new window."""
        super().zero_grad(set_to_none=set_to_none)
        self._stepped.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's (the plain optimizer's format); each parameter's optimizer reads the loaded state."""
        super().load_state_dict(state_dict)
        for one in self._one.values():
            one.state = self.state

    # --- the machinery ---------------------------------------------------------------------------

    def _register(self, group: dict[str, Any], index: int) -> None:
        options = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if not p.requires_grad:
                continue
            one = self._optimizer_class([{"params": [p], **options}])
            one.state = self.state  # one dictionary: the wrapper's state_dict is the plain one's
            self._one[id(p)] = one
            self._where[id(p)] = index
            self._handles.append(p.register_post_accumulate_grad_hook(grad_hook(self, StepInBackward._step_one)))

    def _step_one(self, p: torch.Tensor) -> None:
        """Step ``p`` with its group's current values (an LR scheduler may have changed them), free its gradient."""
        if id(p) in self._stepped:
            raise InBackwardError(
                f"memfit.optim: a second backward before the optimizer's step() reached a parameter of "
                f"shape {tuple(p.shape)} that this window already stepped (accumulation over several "
                f"micro-steps). {ACCUMULATION_FIX}"
            )
        one = self._one[id(p)]
        group = self.param_groups[self._where[id(p)]]
        mine = one.param_groups[0]
        for k, v in group.items():
            if k != "params":
                mine[k] = v
        one.step()
        p.grad = None
        self._stepped.add(id(p))


def release_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Take a :class:`StepInBackward`'s or a :class:`~memfit.optim.host.HostOptimizer`'s hooks off its
    parameters; other optimizers hold none."""
    if isinstance(optimizer, (StepInBackward, HostOptimizer)):
        optimizer.remove()


def refuse_clipping(max_grad_norm: float | None, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise :class:`InBackwardError` when a :class:`StepInBackward` would be asked to clip."""
    if max_grad_norm is not None and isinstance(optimizer, StepInBackward):
        raise InBackwardError(_clipping_message(max_grad_norm))


def refuse_in_accumulator(
    optimizer: torch.optim.Optimizer | None, max_grad_norm: float | None, scaler: Any, parallel: str
) -> None:
    """What an accumulation loop cannot do with a :class:`StepInBackward`, refused before any step:
    clipping, a GradScaler (it unscales and checks the gradients before the step), data parallelism
    (its gradient reduction is not done when a parameter's hook fires; ``parallel``: ``local`` for none).
    A :class:`~memfit.optim.host.HostOptimizer` is refused under data parallelism for the same reason, and
    with a GradScaler (it cannot see the host gradients)."""
    states = (
        "step-in-backward"
        if isinstance(optimizer, StepInBackward)
        else "host-optimizer"
        if isinstance(optimizer, HostOptimizer)
        else None
    )
    if states is None:
        return
    why = placement_refusal(states, max_grad_norm=max_grad_norm, scaler=scaler is not None, parallel=parallel)
    if why is not None:
        raise InBackwardError(why)


def placement_refusal(
    states: str,
    *,
    micro_steps: int = 1,
    max_grad_norm: float | None = None,
    scaler: bool = False,
    parallel: str = "local",
) -> str | None:
    """Why the placement ``states`` (a :class:`~memfit.optim.ModelStates` value) cannot step exactly in
    this context, as its optimizer's refusal says it, or None when it can: ``micro_steps`` per window,
    clipping at ``max_grad_norm``, a GradScaler (``scaler``), data parallelism (``parallel`` other than
    ``local``). ``memfit plan/fit/train --states auto`` never chooses a placement this refuses.

    Example:
        >>> placement_refusal("step-in-backward", micro_steps=2).split(". ")[0]
        'memfit.optim: this window has 2 micro-steps, and the optimizer steps inside the backward of the first'
        >>> placement_refusal("host-optimizer", micro_steps=2) is None
        True
    """
    if states == "host-optimizer":
        return _HOST_PARALLEL if parallel != "local" else SCALER_REFUSAL if scaler else None
    if states != "step-in-backward":
        return None
    if max_grad_norm is not None:
        return _clipping_message(max_grad_norm)
    if scaler:
        return _SCALER
    if parallel != "local":
        return _IN_BACKWARD_PARALLEL
    if micro_steps > 1:
        return _window_message(micro_steps)
    return None


_HOST_PARALLEL = (
    "memfit.optim: under data parallelism a gradient is reduced over the ranks after its parameter's hook "
    "copied it to the host, so the host would step this rank's gradient alone. Use --states device with "
    "--parallel."
)
_IN_BACKWARD_PARALLEL = (
    "memfit.optim: under data parallelism a gradient is reduced over the ranks after its parameter's hook "
    "could step it. Use --states device with --parallel."
)
_SCALER = (
    "memfit.optim: a GradScaler (float16 autocast) unscales and checks every gradient before the step, and "
    "the step inside the backward has already run by then. Use --amp bf16, or --states device."
)


def _clipping_message(max_grad_norm: float) -> str:
    return (
        f"memfit.optim: clipping the gradient norm at {max_grad_norm:g} with the optimizer step inside "
        f"the backward. {CLIPPING_FIX}"
    )


def _window_message(micro_steps: int) -> str:
    return (
        f"memfit.optim: this window has {micro_steps} micro-steps, and the optimizer steps inside the "
        f"backward of the first. {ACCUMULATION_FIX}"
    )


def refuse_window(optimizer: torch.optim.Optimizer | None, micro_steps: int, counted: bool) -> None:
    """Refuse a window a :class:`StepInBackward` cannot step exactly: several micro-steps, or a token
    count known only after the backward (``counted``: the count, or no count, is known before it)."""
    if not isinstance(optimizer, StepInBackward):
        return
    if micro_steps > 1:
        raise InBackwardError(_window_message(micro_steps))
    if not counted:
        raise InBackwardError(
            "memfit.optim: the loss is normalised by its token count only after the backward (no count_fn), "
            "and the step inside the backward runs before that. Give the workload a count_fn, or use "
            "normalize='mean', or --states device."
        )
