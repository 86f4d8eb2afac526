"""Sequence tiling (memfit.apply.tiling): a block's position-wise submodules run over tiles of the
sequence, forward and backward, as a block option the planner chooses from measured costs.

References: the untiled module's output and gradients (float64: equal to rounding); for dropout,
the same module run tile by tile with gradients on from the same generator states (the masks a
tiled forward draws); the profile's own measurements of the untiled options; the tracker's
measured peak against the cost model's prediction.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from torch import nn

from memfit import load_workload
from memfit.apply.engine import apply_plan, plan_applied, remove_plan
from memfit.apply.tiling import default_tile_counts, find_tileable, install_tiling, remove_tiling, tiled_call
from memfit.capture.step import StepSpec
from memfit.cli.common import tile_modules_arg, tiling_from_args
from memfit.errors import BudgetInfeasibleError, PlanFileError, PlanMismatchError, SpecError
from memfit.fitting.budget import plan_for_budget
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS, BlockOption, tiled_options
from memfit.plan.policies import policy_plan
from memfit.plan.solve import min_budget, solve
from memfit.plan.types import BlockDecision, Option, Plan, Segment
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = (
    "hf:llama?num_hidden_layers=3&hidden_size=64&intermediate_size=256&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=256"
)
GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256"


class _FFN(nn.Module):
    """A position-wise feed-forward a user writes (its class name does not end with MLP)."""

    def __init__(self, c: int, p: float = 0.0) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(c, 4 * c), nn.Linear(4 * c, c), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return self.drop(self.down(torch.relu(self.up(x))))


class _TimeConv(nn.Module):
    """Mixes neighbouring positions: not position-wise."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.ffn, self.mix = nn.LayerNorm(c), _FFN(c), _TimeConv(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x)) + self.mix(x)


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters()]


# --- the autograd function --------------------------------------------------------------------


@pytest.mark.parametrize("tiles", [2, 3, 7])
def test_tiled_call_equals_untiled_and_saves_only_its_input(tiles: int) -> None:
    torch.manual_seed(0)
    ffn = _FFN(8).double()
    x = torch.randn(2, 20, 8, dtype=torch.float64, requires_grad=True)
    ref = ffn(x)
    ref.square().sum().backward()
    want_x, want_p = x.grad.clone(), _grads(ffn)
    x.grad = None
    ffn.zero_grad()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = tiled_call(ffn, x, tiles, tuple(ffn.parameters()))
    assert [s.data_ptr() for s in saved] == [x.data_ptr()]  # the input only: no intermediate (B, T, 4C)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-14)
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, want_x, rtol=0, atol=1e-14)
    for g, w in zip(_grads(ffn), want_p, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_tiled_dropout_replays_each_tiles_mask() -> None:
    """Reference: the module run tile by tile with gradients on from the same generator state draws
    the masks the tiled forward draws; the tiled backward must recompute with exactly those."""
    torch.manual_seed(0)
    ffn = _FFN(8, p=0.5)
    x = torch.randn(2, 12, 8, requires_grad=True)
    torch.manual_seed(5)
    ref = torch.cat([ffn(xs) for xs in torch.tensor_split(x, 3, dim=1)], dim=1)
    ref.sum().backward()
    want_x, want_p = x.grad.clone(), _grads(ffn)
    x.grad = None
    ffn.zero_grad()
    torch.manual_seed(5)
    y = tiled_call(ffn, x, 3, tuple(ffn.parameters()))
    torch.manual_seed(99)  # backward runs with another generator state: the tiles' own are restored
    state = torch.get_rng_state()
    y.sum().backward()
    assert torch.equal(torch.get_rng_state(), state)  # and the generator is left where backward found it
    assert torch.equal(y, ref)
    torch.testing.assert_close(x.grad, want_x, rtol=0, atol=1e-6)
    for g, w in zip(_grads(ffn), want_p, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_install_and_remove_tiling_restore_the_forward() -> None:
    blk = _Block(8)
    install_tiling(blk, ["ffn"], 4)
    assert "forward" in blk.ffn.__dict__
    remove_tiling(blk)
    assert "forward" not in blk.ffn.__dict__
    with pytest.raises(PlanMismatchError, match="has none by that name"):
        install_tiling(blk, ["nope"], 4)


# --- which modules are tiled --------------------------------------------------------------------


def test_find_tileable_finds_llamas_mlp_and_refuses_what_mixes_positions() -> None:
    wl = load_workload(LLAMA, seq_len=32)
    layers = list(wl.model.model.layers)
    names = [f"model.layers.{i}" for i in range(len(layers))]
    batch = wl.make_batch(2)
    run = lambda: wl.loss_fn(wl.model, batch)  # noqa: E731
    found = find_tileable(wl.model, layers, names, run)
    assert found.modules == (("mlp",),) * 3 and found.classes == ("LlamaMLP",) and found.seq_len == 32
    norm = find_tileable(wl.model, layers, names, run, tile_modules=("post_attention_layernorm",))
    assert norm.classes == ("LlamaRMSNorm",)
    with pytest.raises(PlanMismatchError, match="cannot be tiled"):
        find_tileable(wl.model, layers, names, run, tile_modules=("self_attn",))
    with pytest.raises(PlanMismatchError, match="no block has a submodule named"):
        find_tileable(wl.model, layers, names, run, tile_modules=("feed_forward",))


def test_a_users_module_is_tiled_when_named_and_a_time_mixer_is_refused() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block(8) for _ in range(2)])
    x = torch.randn(2, 16, 8)

    def run() -> None:
        h = x
        for b in blocks:
            h = b(h)

    assert not find_tileable(blocks, list(blocks), ["0", "1"], run).any  # no *MLP class: nothing by guess
    named = find_tileable(blocks, list(blocks), ["0", "1"], run, tile_modules=("ffn",))
    assert named.modules == (("ffn",), ("ffn",)) and named.classes == ("_FFN",)
    with pytest.raises(PlanMismatchError, match="mixes positions"):
        find_tileable(blocks, list(blocks), ["0", "1"], run, tile_modules=("mix",))


def test_default_tile_counts() -> None:
    assert default_tile_counts(128, 64) == (2, 4)  # ALST's ceil(T / C) and 4
    assert default_tile_counts(32_768, 4096) == (4, 8)
    assert default_tile_counts(3, 64) == ()  # too short to tile
    assert default_tile_counts(131_072, 32) == (4, 64)  # ALST's count capped (NOTE [ How many tiles ])


# --- plan types and options ---------------------------------------------------------------------


def test_block_option_names_round_trip() -> None:
    for name in ("keep:tiles-4", "recompute:tiles-16", "recompute:host", "recompute:tiles-8:host"):
        assert BlockOption.parse(name).name == name
    for bad in ("keep:host", "keep:tiles-1", "recompute:tiles-x", "offload:tiles-4"):
        with pytest.raises(SpecError, match="keep:tiles-N"):
            BlockOption.parse(bad)
    assert [o.name for o in tiled_options((4,))] == ["keep:tiles-4", "recompute:tiles-4"]


def test_tiled_plan_json_round_trips_and_old_plans_load() -> None:
    blocks = (
        BlockDecision(name="h.0", option=Option.RECOMPUTE, tiles=4, tiled=("mlp",), host_input=True),
        BlockDecision(name="h.1", option=Option.KEEP, tiles=8, tiled=("mlp",)),
        BlockDecision(name="h.2", option=Option.KEEP),
    )
    plan = Plan(policy="memfit", chain_path="h", blocks=blocks)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["blocks"][0] == {"name": "h.0", "option": "recompute", "tiles": 4, "tiled": ["mlp"], "host_input": True}
    assert d["blocks"][2] == {"name": "h.2", "option": "keep"}  # untiled blocks: the JSON they had before
    assert Plan.from_dict(d) == plan
    assert not plan.is_plain and Plan(policy="none", chain_path="h", blocks=blocks[2:]).is_plain


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ({"option": "keep", "tiles": 1, "tiled": ["mlp"]}, "integer of 2 or more"),
        ({"option": "keep", "tiles": 4}, '"tiled" list'),
        ({"option": "offload", "tiles": 4, "tiled": ["mlp"]}, "only 'keep' and 'recompute' blocks are tiled"),
        ({"option": "keep", "host_input": True}, "only 'recompute' blocks keep an input"),
        ({"option": "recompute", "host_input": "yes"}, "not true or false"),
    ],
)
def test_bad_tiled_decisions_are_refused_with_the_fix(block: dict, match: str) -> None:
    d = Plan(policy="x", chain_path="h", blocks=(BlockDecision(name="h.0", option=Option.KEEP),)).to_dict()
    d["blocks"] = [{"name": "h.0", **block}]
    with pytest.raises(PlanFileError, match=match):
        Plan.from_dict(d)


def test_a_tiled_block_inside_a_segment_is_refused() -> None:
    blocks = (
        BlockDecision(name="h.0", option=Option.RECOMPUTE, tiles=4, tiled=("mlp",)),
        BlockDecision(name="h.1", option=Option.RECOMPUTE),
    )
    d = Plan(policy="x", chain_path="h", blocks=blocks, segments=(Segment(start=0, stop=2),)).to_dict()
    with pytest.raises(PlanFileError, match="'tiled' inside segment"):
        Plan.from_dict(d)


def test_cli_flags() -> None:
    assert tile_modules_arg("mlp, ffn") == ("mlp", "ffn")
    with pytest.raises(argparse.ArgumentTypeError):
        tile_modules_arg(" , ")
    assert tiling_from_args(argparse.Namespace(no_tiling=True, tile_modules=None)) == {
        "tiling": False,
        "tile_modules": None,
    }
    with pytest.raises(SpecError, match="contradict"):
        tiling_from_args(argparse.Namespace(no_tiling=True, tile_modules=("mlp",)))


# --- measured, planned, verified -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_stats():  # type: ignore[no-untyped-def]
    wl = load_workload(LLAMA, seq_len=128)
    return wl, profile(wl, step=StepSpec(batch_size=2, repeats=1), options=BASE_OPTIONS, activations=False)


def test_profile_measures_tiled_options_that_hold_less(llama_stats) -> None:  # type: ignore[no-untyped-def]
    _, stats = llama_stats
    assert stats.calibration.tiling is not None and stats.calibration.tiling.classes == ("LlamaMLP",)
    assert stats.calibration.tiling.tile_counts == (2, 4)
    assert "recompute:host" in stats.calibration.dropped_options  # the CPU: nothing to gain
    for b in stats.blocks:
        o = b.options
        assert o["keep:tiles-4"].tiled == ("mlp",)
        # Kept, a tiled MLP keeps its input only: its (B, T, 3 x 256) intermediates are gone.
        assert o["keep:tiles-4"].retained_bytes < 0.6 * o["keep"].retained_bytes
        # Recomputed, its backward holds one tile's intermediates at a time, finer tiles less.
        assert o["recompute:tiles-4"].bwd_peak_bytes < o["recompute:tiles-2"].bwd_peak_bytes
        assert o["recompute:tiles-2"].bwd_peak_bytes < o["recompute"].bwd_peak_bytes
    # The stats round-trip with their tiled options.
    back = type(stats).from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back.blocks[0].options["keep:tiles-4"].tiled == ("mlp",) and back.calibration == stats.calibration


def test_the_planner_tiles_when_the_budget_needs_it_and_verify_agrees(llama_stats) -> None:  # type: ignore[no-untyped-def]
    wl, stats = llama_stats
    costs = ChainCosts.from_stats(stats)
    untiled = costs.restricted(("keep", "recompute"))
    need_untiled, _ = min_budget(untiled)
    need, _ = min_budget(costs)
    assert need < need_untiled
    budget = (need + need_untiled) // 2
    with pytest.raises(BudgetInfeasibleError):
        solve(untiled, budget)
    res = plan_for_budget(wl, budget, stats=stats)
    plan = res.plan
    assert any(b.tiles is not None for b in plan.blocks)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    out = verify(wl, plan, budget_bytes=budget, step=StepSpec(batch_size=2, repeats=0))
    assert out.ok, out.to_dict()
    assert out.grad_rtol == 1e-4 and "tiles" in out.grad_rtol_reason  # reordered sums, and why
    assert any("tolerance" in n for n in out.notes)
    # The cost model adds up the measured options: the plan's peak is predicted to the byte here.
    assert abs(out.measured_peak_bytes - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes
    assert predict(costs, plan).peak_bytes == plan.predicted_peak_bytes


def test_no_tiling_profiles_no_tiled_option() -> None:
    wl = load_workload(LLAMA, seq_len=32)
    stats = profile(wl, step=StepSpec(batch_size=1, repeats=1), options=BASE_OPTIONS, tiling=False, host_inputs=False)
    assert set(stats.blocks[0].options) == {"keep", "recompute"} and stats.calibration.tiling is None
    # per-block stats (no recompute calibrated): nothing to plan, nothing tiled
    keep_only = profile(wl, step=StepSpec(batch_size=1, repeats=1), options=("keep",))
    assert set(keep_only.blocks[0].options) == {"keep"}


def test_verify_turns_dropout_off_inside_tiled_modules_only_and_restores_it() -> None:
    """GPT-2 with its default dropout (0.1): tiling draws each tile's mask on its own, so verify
    compares with the MLPs' dropout off in both runs, says so, and gives the model back as it was."""
    wl = load_workload(GPT2, seq_len=32)
    blocks = tuple(
        BlockDecision(name=f"transformer.h.{i}", option=Option.RECOMPUTE, tiles=4, tiled=("mlp",)) for i in range(2)
    )
    plan = policy_plan(wl.model, "all").with_(blocks=blocks)
    before = {n: m.p for n, m in wl.model.named_modules() if isinstance(m, nn.Dropout)}
    out = verify(wl, plan, step=StepSpec(batch_size=2, repeats=0))
    assert out.ok, out.to_dict()
    assert any("dropout off in the 2 dropout module(s) inside tiled submodules" in n for n in out.notes), out.notes
    assert {n: m.p for n, m in wl.model.named_modules() if isinstance(m, nn.Dropout)} == before


def test_apply_refuses_a_tiled_submodule_the_model_lacks_and_changes_nothing() -> None:
    wl = load_workload(GPT2, seq_len=32)
    blocks = tuple(
        BlockDecision(name=f"transformer.h.{i}", option=Option.KEEP, tiles=4, tiled=("ffn",)) for i in range(2)
    )
    plan = policy_plan(wl.model, "none").with_(blocks=blocks)
    with pytest.raises(PlanMismatchError, match="'ffn'"):
        apply_plan(wl.model, plan)
    assert not any("forward" in m.__dict__ for m in wl.model.modules())
    ok = plan.with_(blocks=tuple(b.__class__(name=b.name, option=b.option, tiles=4, tiled=("mlp",)) for b in blocks))
    with plan_applied(wl.model, ok):
        assert all("forward" in wl.model.transformer.h[i].mlp.__dict__ for i in range(2))
    assert not any("forward" in m.__dict__ for m in wl.model.modules())
    remove_plan(wl.model)


def test_a_tile_recomputes_under_the_forwards_autocast() -> None:
    """Backward runs outside the forward's autocast: a tile's recompute must enter it again (as
    torch's checkpoint does), or it would recompute in float32 and differ from the forward."""
    torch.manual_seed(0)
    ffn = _FFN(16)
    x = torch.randn(2, 12, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = ffn(x)
    ref.float().square().sum().backward()
    want = [x.grad.clone(), *_grads(ffn)]
    x.grad = None
    ffn.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled_call(ffn, x, 3, tuple(ffn.parameters()))
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    for g, w in zip([x.grad, *_grads(ffn)], want, strict=True):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2 * float(w.abs().max()))


def test_a_model_with_a_tiled_plan_deep_copies_with_the_plan() -> None:
    import copy

    from memfit.apply.engine import applied_plan

    wl = load_workload(GPT2, seq_len=32)
    blocks = tuple(
        BlockDecision(name=f"transformer.h.{i}", option=Option.RECOMPUTE, tiles=4, tiled=("mlp",)) for i in range(2)
    )
    plan = policy_plan(wl.model, "all").with_(blocks=blocks)
    apply_plan(wl.model, plan)
    try:
        twin = copy.deepcopy(wl.model)
    finally:
        remove_plan(wl.model)
    assert applied_plan(twin) == plan and "forward" in twin.transformer.h[0].mlp.__dict__
    remove_plan(twin)
    assert "forward" not in twin.transformer.h[0].mlp.__dict__


@pytest.mark.slow
def test_cli_plan_tiles_and_no_tiling_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    """`memfit plan --json` at the least budget a tiled plan reaches: its blocks carry their tiles;
    with --no-tiling that budget is refused (exit 2) with the larger minimum."""
    from memfit.cli.main import main

    spec = LLAMA.replace("num_hidden_layers=3", "num_hidden_layers=2")
    base = [
        "plan",
        "--model",
        spec,
        "--seq-len",
        "128",
        "--batch-size",
        "2",
        "--repeats",
        "1",
        "--json",
        "--states",
        "device",
    ]

    def minimum(*extra: str) -> int:
        assert main([*base, "--budget", "1KiB", *extra]) == 2
        err = json.loads(capsys.readouterr().out)["error"]
        return int(re.search(r"minimum [^:]*: [^(]*\((\d+) bytes", err).group(1))

    need = minimum()
    assert need < minimum("--no-tiling")
    assert main([*base, "--budget", str(need)]) == 0
    blocks = json.loads(capsys.readouterr().out)["blocks"]
    assert any("tiles" in b for b in blocks), blocks
