"""What the optimizers of :mod:`memfit.optim` share: a hook on each parameter's finished gradient, held
weakly, and the undoing of those hooks (:class:`ParameterHooks`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Self

import torch

__all__ = ["ParameterHooks", "grad_hook", "remove_handles"]


class ParameterHooks:
    """The undoing of an optimizer's hooks on its parameters (``self._handles``): :meth:`remove`, a
    context manager, :attr:`hooked`. The hooks also leave when the optimizer is garbage-collected
    (:func:`grad_hook` holds it weakly; the optimizer registers :func:`remove_handles` as its finalizer)."""

    _handles: list[Any]

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        remove_handles(self._handles)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def hooked(self) -> bool:
        """Whether the hooks are on the parameters."""
        return bool(self._handles)


def grad_hook(optimizer: Any, on_grad: Callable[[Any, torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook calling ``on_grad(optimizer, p)`` without autograd, while ``optimizer``
    lives (held weakly, so that the hooks do not keep it alive)."""
    ref = weakref.ref(optimizer)

    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            with torch.no_grad():
                on_grad(opt, p)

    return hook


def remove_handles(handles: list[Any]) -> None:
    """Remove every hook handle in ``handles`` and empty the list."""
    for h in handles:
        h.remove()
    handles.clear()
