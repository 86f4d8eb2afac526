"""Every ``memfit.set_blocks`` call memfit suggests is one it accepts, and a profile runs it: the
coverage hint and warning (diffusers' U-Net and Flux with lists named that cover little, built from small configs), the refusal when no
blocks are found (ALBERT, a one-layer model) and the refusal of a chain that ran in another order
(memfit.capture.coverage, memfit.capture.chain, memfit.capture.passes)."""

from __future__ import annotations

import ast
import re
import warnings

import pytest
import torch
from diffusion_models import flux_workload, unet_workload
from torch import nn

import memfit
from memfit import StepSpec
from memfit.capture.chain import discover_chain
from memfit.capture.coverage import COVERAGE_WARN_SHARE, ChainCoverageWarning
from memfit.errors import UnsupportedModelError
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import min_budget

CALL = re.compile(r"memfit\.set_blocks\(model, ([^)]*)\)")


def suggested_calls(text: str) -> list[tuple[str, ...]]:
    """The paths of every ``memfit.set_blocks(model, ...)`` call in ``text``."""
    return [tuple(ast.literal_eval(f"({args},)")) for args in CALL.findall(text)]


def _profile(wl: memfit.Workload) -> memfit.Stats:
    return memfit.profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, heads=False, activations=False)


def _unet() -> memfit.Workload:
    return unet_workload(width=32, batch_size=4)


_flux = flux_workload


PARTIAL = {
    "unet": ("mid_block.resnets", "up_blocks.0.resnets", "up_blocks.1.resnets"),
    "flux": ("transformer_blocks",),
}
"""Lists that cover little of each model (what discovery chose before it found their trunks)."""


@pytest.mark.slow  # ~1 min here: four profiles of two small diffusion models
@pytest.mark.parametrize("build", [_unet, _flux], ids=["unet", "flux"])
def test_low_coverage_warns_in_python_with_a_call_that_profiles(build) -> None:
    wl = build()
    memfit.set_blocks(wl.model, *PARTIAL[wl.name])
    with pytest.warns(ChainCoverageWarning) as caught:
        found = _profile(wl)
    assert found.chain_coverage is not None and found.chain_coverage < COVERAGE_WARN_SHARE
    (message,) = [str(w.message) for w in caught if w.category is ChainCoverageWarning]
    assert f"save {found.chain_coverage:.0%} of the bytes" in message
    (paths,) = suggested_calls(message)
    assert paths == found.suggested_blocks
    memfit.set_blocks(wl.model, *paths)  # accepted ...
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChainCoverageWarning)  # ... and it covers enough not to warn again
        named = _profile(wl)  # ... and the profile runs it (its blocks run once each, in order)
    assert named.chain_path == ",".join(paths) and named.chain_coverage > found.chain_coverage
    # what a plan can recompute grew: the least budget falls
    least = {k: min_budget(ChainCosts.from_stats(s))[0] for k, s in (("found", found), ("named", named))}
    assert least["named"] < least["found"], least


def test_the_unets_alternating_lists_are_suggested_as_their_container() -> None:
    """A U-Net block's resnets and attentions alternate: naming them as two lists was refused at
    profile; the suggestion names the container around them."""
    from memfit.capture.coverage import probe_chain, suggest_block_lists

    wl = _unet()
    chain = discover_chain(wl.model, PARTIAL["unet"])
    batch = wl.make_batch(2)
    probe = probe_chain(wl.model, chain, lambda: wl.loss_fn(wl.model, batch))
    paths = suggest_block_lists(wl.model, chain, probe)
    assert paths == ("down_blocks", "mid_block.resnets", "up_blocks")


def test_no_blocks_refusals_suggest_only_calls_set_blocks_accepts() -> None:
    # one layer: its one-block list is named, and then profiled
    demo = load_workload("demo?n_layer=1&n_embd=32&seq_len=16")
    with pytest.raises(UnsupportedModelError) as err:
        discover_chain(demo.model)
    (paths,) = suggested_calls(str(err.value))
    memfit.set_blocks(demo.model, *paths)
    assert len(_profile(demo).blocks) == 1
    # ALBERT shares one layer across depth: the call is accepted, and the profile then says why it cannot plan it
    albert = load_workload(
        "hf:albert?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&intermediate_size=64&vocab_size=64"
        "&embedding_size=16&seq_len=16"
    )
    with pytest.raises(UnsupportedModelError) as err:
        discover_chain(albert.model)
    for paths in suggested_calls(str(err.value)):
        memfit.set_blocks(albert.model, *paths)
    with pytest.raises(UnsupportedModelError, match="ran 2 times"):
        _profile(albert)


def test_a_chain_named_out_of_order_is_refused_with_the_order_it_ran_in() -> None:
    class TwoStages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(*[nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)])
            self.b = nn.Sequential(*[nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(x))

    model = TwoStages()
    memfit.set_blocks(model, "a", "b")
    wl = memfit.Workload(name="two", model=model, make_batch=lambda n: torch.randn(n, 8),
                         loss_fn=lambda m, x: m(x).pow(2).mean(), default_batch_size=2)  # fmt: skip
    with pytest.raises(UnsupportedModelError) as err:
        _profile(wl)
    (paths,) = suggested_calls(str(err.value))
    assert paths == ("b", "a")
    memfit.set_blocks(model, *paths)
    assert _profile(wl).chain_path == "b,a"
