"""verify on a model whose blocks the user compiled in place (``block.compile()``) and that draws
dropout masks: the first check of a plan holds (memfit.verification.plans, NOTE [ Blocks compiled in
place ]). Inductor drew its own masks in the planned run, and the first verify failed by 0.67."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit import StepSpec, Workload
from memfit.plan.policies import policy_plan
from memfit.verification.plans import verify


class _Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln, self.up, self.down, self.drop = (
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.Dropout(0.1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.ln(x)))))


class _Model(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks, self.head = nn.Sequential(*[_Block() for _ in range(n)]), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).mean(1)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "sqrt"])
def test_the_first_verify_of_blocks_compiled_in_place_with_dropout_passes(policy: str) -> None:
    torch.manual_seed(0)
    model = _Model().train()
    for block in model.blocks:
        block.compile()
    wl = Workload(
        name="compiled-blocks", model=model, default_batch_size=4,
        make_batch=lambda b: (torch.randn(b, 8, 32), torch.randint(0, 4, (b,))),
        loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
    )  # fmt: skip
    torch._dynamo.reset()  # the first compile of these blocks happens inside verify, as in a fresh process
    result = verify(wl, policy_plan(model, policy), step=StepSpec(repeats=0))
    assert result.ok, result.reason
    assert result.max_grad_rel_err < 1e-5
    assert all(b.__dict__.get("_compiled_call_impl") is not None for b in model.blocks)  # left compiled
