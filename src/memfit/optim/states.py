"""The placements of model states a step can use (:class:`ModelStates`)."""

from __future__ import annotations

from enum import StrEnum

from memfit.errors import SpecError


class ModelStates(StrEnum):
    """Where a step's parameters, gradients and optimizer state live, and when the optimizer steps.

    - ``device``: all on the device, the step after the backward (plain training).
    - ``step-in-backward``: the optimizer steps each parameter as soon as its gradient is complete,
      inside the backward (``register_post_accumulate_grad_hook``, as torchtune's ``optimizer_in_bwd``),
      and frees that gradient: the device never holds every gradient at once. The window must be
      one micro-step (no accumulation).
    - ``host-optimizer``: optimizer state and step on the host (pinned memory on CUDA); each gradient is
      copied to the host as the backward produces it and freed on the device, accumulated there
      across the micro-steps of a window; updated parameters are copied back.
    - ``host-params``: parameters, gradients and optimizer state on the host between uses, through
      torch's FSDP2 ``fully_shard`` with ``CPUOffloadPolicy`` (also at world size 1).
    """

    DEVICE = "device"
    STEP_IN_BACKWARD = "step-in-backward"
    HOST_OPTIMIZER = "host-optimizer"
    HOST_PARAMS = "host-params"

    @classmethod
    def parse(cls, text: str | ModelStates) -> ModelStates:
        """``text`` as a placement, or a :class:`~memfit.errors.SpecError` that lists them."""
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise SpecError(f"memfit: unknown model-states placement {text!r}. Use one of: {names}.") from None
