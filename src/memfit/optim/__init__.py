"""Where model states live and when the optimizer steps: optimizer wrappers on plain torch.

memfit plans activations in :mod:`memfit.plan`; this room holds the other half of a step's memory, the
model states (parameters, gradients, optimizer state). Each placement in :class:`ModelStates` gives the
same parameters after ``k`` optimizer steps as plain training in the same precision; it changes where the
bytes live and when the step runs, not the arithmetic. Ground floor: torch only.

:mod:`memfit.optim.host_params` (parameters on the host through FSDP2) is imported on use only: it
loads torch's FSDP.
"""

from memfit.optim.host import HostOptimizer, host_scope
from memfit.optim.in_backward import InBackwardError, StepInBackward, release_optimizer
from memfit.optim.states import ModelStates

__all__ = ["HostOptimizer", "InBackwardError", "ModelStates", "StepInBackward", "host_scope", "release_optimizer"]
