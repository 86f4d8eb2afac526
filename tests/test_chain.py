"""Chains that span several containers (ResNet stages, ConvNeXT stages' blocks, encoder then decoder),
containers whose own forward does not run their blocks, ``--dtype`` on every command, and the one
gradient comparison every verify path shares.

Every planned model is checked against the unmodified model's gradients and buffers (``verify``);
memory savings against an independent measurement (the profiler's allocator events).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.capture.chain import discover_chain, set_blocks
from memfit.capture.tracker import profiler_peak_bytes
from memfit.errors import PlanMismatchError, UnsupportedModelError
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.types import Plan, Segment
from memfit.profiling.blocks import profile
from memfit.verification import verify_accumulation
from memfit.verification.gradients import compare_gradients
from memfit.verification.plans import verify
from memfit.workload import Workload

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
CONVNET = str(ROOT / "examples" / "convnet.py") + ":build"


# --- a torchvision-style ResNet, written here (the registry's torchvision does not load on CPU torch)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    """torchvision's ResNet layout: stem, ``layer1`` .. ``layer4`` (nn.Sequential of blocks), head."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64), depth: int = 2, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        c = widths[0]
        for k, w in enumerate(widths, start=1):
            blocks = [BasicBlock(c if j == 0 else w, w, 2 if (j == 0 and k > 1) else 1) for j in range(depth)]
            setattr(self, f"layer{k}", nn.Sequential(*blocks))
            c = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for k in range(1, 5):
            x = getattr(self, f"layer{k}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def image_workload(model: nn.Module, name: str, *, size: int = 32, batch: int = 4, hf: bool = False) -> Workload:
    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 3, size, size), torch.randint(0, 10, (b,))

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if hf:
            return m(pixel_values=b[0], labels=b[1]).loss
        return F.cross_entropy(m(b[0]), b[1])

    return Workload(name=name, model=model, make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch)


def resnet_workload() -> Workload:
    torch.manual_seed(0)
    return image_workload(TinyResNet(), "tiny-resnet", size=32, batch=8)


def hf_resnet() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[2, 2, 2, 2], num_labels=10)
    return transformers.ResNetForImageClassification(cfg)


def hf_convnext() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[2, 2, 2, 2], num_labels=10, patch_size=2)
    return transformers.ConvNextForImageClassification(cfg)


def hf_t5() -> Workload:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        dropout_rate=0.1,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, 64, (b, 12)), "labels": torch.randint(1, 64, (b, 7))}

    return Workload(
        name="t5", model=model, make_batch=make_batch, loss_fn=lambda m, b: m(**b).loss, default_batch_size=2
    )


# --- discovery ----------------------------------------------------------------------------------


def test_torchvision_style_resnet_chain_is_all_four_stages_in_order() -> None:
    chain = discover_chain(TinyResNet())
    assert chain.paths == ("layer1", "layer2", "layer3", "layer4")
    assert chain.names == tuple(f"layer{k}.{j}" for k in range(1, 5) for j in range(2))
    assert chain.spans == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert chain.sequential and chain.segment_spans == chain.spans
    assert chain.path == "layer1,layer2,layer3,layer4"


def test_hf_resnet_convnext_t5_chains() -> None:
    resnet = discover_chain(hf_resnet())
    assert resnet.paths == tuple(f"resnet.encoder.stages.{k}.layers" for k in range(4)) and len(resnet) == 8
    convnext = discover_chain(hf_convnext())
    assert convnext.paths == tuple(f"convnext.encoder.stages.{k}.layers" for k in range(4)) and len(convnext) == 8
    t5 = discover_chain(hf_t5().model)
    assert t5.paths == ("encoder.block", "decoder.block") and len(t5) == 5
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=64,
            d_model=16,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=32,
        )
    )
    assert discover_chain(bart).paths == ("model.encoder.layers", "model.decoder.layers")


def test_single_container_models_keep_their_chain() -> None:
    """MoE experts inside decoder layers are not stages; GPT-2 and the demo keep one container."""
    assert discover_chain(
        load_workload("hf:gpt2?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&vocab_size=64").model
    ).paths == ("transformer.h",)

    class MoELayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(8, 8)
            self.experts = nn.ModuleList(nn.Linear(8, 64) for _ in range(8))  # most of the parameters

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MoELayer() for _ in range(3))

    assert discover_chain(MoE()).paths == ("layers",)


def test_set_blocks_with_several_paths_and_bad_paths() -> None:
    m = TinyResNet()
    set_blocks(m, "layer2", "layer3")
    chain = discover_chain(m)
    assert chain.names == ("layer2.0", "layer2.1", "layer3.0", "layer3.1")
    assert discover_chain(m, "layer1,layer4").paths == ("layer1", "layer4")  # a plan's chain_path
    with pytest.raises(UnsupportedModelError, match="no submodule 'layer9'"):
        set_blocks(m, "layer1", "layer9")
    with pytest.raises(UnsupportedModelError, match="not an nn.ModuleList"):
        set_blocks(m, "layer1", "fc")
    with pytest.raises(UnsupportedModelError, match="named twice"):
        set_blocks(m, "layer1", "layer1")
    with pytest.raises(UnsupportedModelError, match="lies inside 'layer2'"):
        set_blocks(m, "layer2", "layer2.0.downsample")
    with pytest.raises(UnsupportedModelError, match="no block container named"):
        set_blocks(m)
    assert discover_chain(m).paths == ("layer2", "layer3")  # a refused call changes nothing


# --- plans on multi-container chains ----------------------------------------------------------------


def test_policy_plans_on_resnet_keep_state_dict_and_gradients() -> None:
    wl = resnet_workload()
    keys = list(wl.model.state_dict())
    for policy in ("all", "every:2", "sqrt"):
        plan = policy_plan(wl.model, policy)
        assert plan.chain_path == "layer1,layer2,layer3,layer4"
        for s in plan.segments:  # never across two containers
            assert any(a <= s.start and s.stop <= b for a, b in discover_chain(wl.model).spans)
        apply_plan(wl.model, plan)
        assert list(wl.model.state_dict()) == keys
        remove_plan(wl.model)
        res = verify(
            wl,
            Plan.from_dict(json.loads(json.dumps(plan.to_dict()))),
            step=StepSpec(batch_size=2, dtype=torch.float64, repeats=0),
        )
        assert res.ok and res.buffers_equal and res.max_grad_rel_err <= 1e-10, (policy, res)
    assert list(wl.model.state_dict()) == keys


def test_segment_across_containers_is_refused() -> None:
    m = TinyResNet()
    plan = policy_plan(m, "none").with_(segments=(Segment(start=1, stop=3),))
    with pytest.raises(PlanMismatchError, match="one container"):
        apply_plan(m, plan)
    assert not any("forward" in x.__dict__ for x in m.modules())


def _first_step_peak(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    def step() -> None:
        F.cross_entropy(model(batch[0]), batch[1]).backward()

    return profiler_peak_bytes(step)


def test_policy_all_on_resnet_saves_memory_by_an_independent_measure() -> None:
    """The profiler's allocator events (not memfit's tracker): every stage recomputed peaks well below
    the plain model, and below recomputing only the stage with the most parameters (the old chain)."""
    torch.manual_seed(0)
    base = TinyResNet()
    batch = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    plain = _first_step_peak(copy.deepcopy(base), batch)
    multi = copy.deepcopy(base)
    apply_plan(multi, policy_plan(multi, "all"))
    multi_peak = _first_step_peak(multi, batch)
    last = copy.deepcopy(base)
    set_blocks(last, "layer4")
    apply_plan(last, policy_plan(last, "all"))
    last_peak = _first_step_peak(last, batch)
    assert multi_peak < 0.75 * plain, (multi_peak, plain)
    assert multi_peak < 0.85 * last_peak, (multi_peak, last_peak)


@pytest.mark.parametrize("build", ["hf_resnet", "hf_convnext"])
def test_hf_convolutional_families_policy_all_verifies_and_saves(build: str) -> None:
    wl = image_workload(globals()[build](), build, size=32, batch=4, hf=True)
    res = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(dtype=torch.float64, repeats=0))
    assert res.ok and res.buffers_equal, res
    assert res.measured_peak_bytes < res.baseline_peak_bytes, res


def test_t5_encoder_and_decoder_planned_together() -> None:
    wl = hf_t5()
    plan = policy_plan(wl.model, "all")
    assert plan.chain_path == "encoder.block,decoder.block" and len(plan.blocks) == 5
    res = verify(wl, plan, step=StepSpec(dtype=torch.float64, repeats=0))
    assert res.ok and res.buffers_equal, res
    assert res.measured_peak_bytes < res.baseline_peak_bytes


def test_planner_on_resnet_stays_within_budget_and_verifies() -> None:
    wl = resnet_workload()
    stats = profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS)
    assert stats.chain_path == "layer1,layer2,layer3,layer4" and stats.segment_spans == ((0, 2), (2, 4), (4, 6), (6, 8))
    full = plan_for_budget(wl, stats.peak_bytes * 2, stats=stats)
    budget = (full.min_budget_bytes + stats.peak_bytes) // 2
    res = plan_for_budget(wl, budget, stats=stats)
    assert any(b.option.value == "recompute" for b in res.plan.blocks) or res.plan.segments
    assert not res.notes
    check = verify(wl, res.plan, budget_bytes=budget, step=StepSpec(repeats=0))
    assert check.ok and check.measured_peak_bytes <= budget, check
    assert check.measured_peak_bytes < check.baseline_peak_bytes


# --- a container whose own forward does not run its blocks ------------------------------------------


class LoopedSequential(nn.Module):
    """Blocks in an nn.Sequential that the model's forward loops over itself (as HF ResNetStage does)."""

    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)]
        )
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def looped_workload() -> Workload:
    torch.manual_seed(0)
    return Workload(
        name="looped",
        model=LoopedSequential(),
        make_batch=lambda b: (torch.randn(b, 16), torch.randn(b, 1)),
        loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
        default_batch_size=512,
    )


def test_segments_over_blocks_the_model_adds_a_residual_between_are_refused() -> None:
    wl = looped_workload()
    plan = policy_plan(wl.model, "sqrt")  # statically nothing tells that the loop adds a residual
    assert plan.segments
    with pytest.raises(UnsupportedModelError, match="residual"):
        verify(wl, plan, step=StepSpec(repeats=0))
    assert not any(k.startswith("_memfit") or k == "forward" for m in wl.model.modules() for k in m.__dict__)
    x = torch.randn(3, 16)
    with torch.no_grad():  # no training forward, nothing to refuse
        apply_plan(wl.model, plan)
        wl.model(x)
        remove_plan(wl.model)


def test_profile_finds_the_residual_between_blocks_and_plans_block_by_block() -> None:
    wl = looped_workload()
    stats = profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS)
    assert stats.segment_spans == () and not stats.sequential and "residual" in (stats.calibration.segments or "")
    full = plan_for_budget(wl, stats.peak_bytes * 2, stats=stats)
    budget = (full.min_budget_bytes + stats.peak_bytes) // 2
    res = plan_for_budget(wl, budget, stats=stats)
    assert not res.plan.segments
    check = verify(wl, res.plan, budget_bytes=budget, step=StepSpec(repeats=0))
    assert check.ok and check.measured_peak_bytes <= budget, check
    # HF ResNet's stages loop over their nn.Sequential too, but each layer takes the one before's
    # output: segments may lie anywhere inside a stage.
    hf_wl = image_workload(hf_resnet(), "hf-resnet", batch=2, hf=True)
    hf = profile(hf_wl, step=StepSpec(repeats=1), options=("keep",), heads=False, activations=False)
    assert hf.segment_spans == discover_chain(hf_wl.model).spans and hf.calibration.segments is None


def test_blocks_that_do_not_run_in_chain_order_are_refused() -> None:
    wl = resnet_workload()
    set_blocks(wl.model, "layer2", "layer1")
    with pytest.raises(UnsupportedModelError, match="another order"):
        profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",))


@pytest.mark.parametrize("kind", ["one module listed four times", "a list run three times"])
def test_blocks_that_run_more_than_once_per_forward_are_refused(kind: str) -> None:
    """A module shared across depth (ALBERT, a universal transformer) is planned from its first run
    only: ALBERT's plan was predicted at 1.27 MB and measured 0.73 MB. Refused with one line."""
    shared = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    blocks = [shared] * 4 if kind == "one module listed four times" else [nn.Linear(8, 8), nn.Linear(8, 8)]

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(blocks)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(1 if kind == "one module listed four times" else 3):
                for layer in self.layers:
                    x = x + layer(x)
            return self.head(x)

    wl = Workload(
        name=kind, model=Deep(), make_batch=lambda b: (torch.randn(b, 8), torch.randint(0, 3, (b,))),
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"layers.0 \(\w+\) ran [34] times in one forward") as err:
        profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",), heads=False, activations=False)
    assert "\n" not in str(err.value)


# --- --dtype on every command -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "--repeats", "1"],
        ["plan", "--budget", "1GiB", "--repeats", "1"],
        ["verify", "--policy", "all", "--repeats", "0"],
        ["verify", "--policy", "all", "--global-batch", "4", "--micro-batch", "2", "--bn", "freeze"],
        ["explain", "--policy", "all", "--repeats", "1"],
        ["fit", "--budget", "1GiB", "--global-batch", "4", "--no-measure", "--repeats", "1", "--max-micro-batch", "2"],
    ],
    ids=["profile", "plan", "verify", "verify-accumulation", "explain", "fit"],
)
@pytest.mark.slow  # about 5 s on 2 cores: the fast tier keeps to about 4 minutes
def test_every_command_casts_batches_to_dtype(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.cli.main import main

    code = main(
        [*argv, "--model", CONVNET, "--dtype", "float64", "--batch-size", "2", "--json"]
        if argv[0] != "fit"
        else [*argv, "--model", CONVNET, "--dtype", "float64", "--json"]
    )
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res.get("ok", True) is not False, res
    if "dtype" in res:
        assert res["dtype"] == "float64"


def test_load_workload_dtype_casts_batches() -> None:
    wl = load_workload(CONVNET, dtype=torch.float64)
    images, labels = wl.make_batch(2)
    assert images.dtype == torch.float64 and labels.dtype == torch.int64
    assert next(wl.model.parameters()).dtype == torch.float64


# --- one gradient comparison ------------------------------------------------------------------------


def test_comparison_floor_rule() -> None:
    big = torch.tensor([1.0, -2.0], dtype=torch.float64)
    ok = compare_gradients(
        {"w": big, "kbias": torch.tensor([3e-17])}, {"w": big.clone(), "kbias": torch.tensor([-2e-17])}
    )
    assert ok.ok(1e-10) and ok.max_rel_err < 1e-12  # zero in exact arithmetic: rounding noise passes
    bad = compare_gradients({"w": big * (1 + 1e-3), "b": torch.tensor([0.5])}, {"w": big, "b": torch.tensor([0.5])})
    assert not bad.ok(1e-5) and bad.worst_param == "w" and bad.max_rel_err == pytest.approx(1e-3, rel=1e-6)
    small = compare_gradients({"w": big, "b": torch.tensor([0.01 * (1 + 1e-3)])}, {"w": big, "b": torch.tensor([0.01])})
    assert not small.ok(1e-5) and small.worst_param == "b"  # above the floor: a real error shows
    missing = compare_gradients({"w": big, "b": None}, {"w": big, "b": torch.tensor([1.0])})
    assert not missing.ok(1.0) and missing.missing == ("b",)


_DRIFT_CALLS: dict[int, int] = {}
"""Calls per DriftingBlock, kept outside the module: memfit refuses a block whose own attributes
change in forward (NOTE [ State a recompute would change twice ]); this drift must reach verify."""


class DriftingBlock(nn.Module):
    """A block whose every call after the first scales its output by 1 + 1e-3 (a recompute or a
    second micro-step sees another function): a real 1e-3 error for both verify paths."""

    def __init__(self, d: int, drift: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drift = drift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = _DRIFT_CALLS[id(self)] = _DRIFT_CALLS.get(id(self), 0) + 1
        scale = 1.0 + (1e-3 if self.drift and calls > 1 else 0.0)
        return torch.tanh(self.fc(x) * scale)  # the recompute saves another tanh output


class KeyBiasAttention(nn.Module):
    """Self-attention with a key bias, whose gradient is zero in exact arithmetic."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        return x + F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))


def comparison_workload(drift: bool) -> Workload:
    torch.manual_seed(0)
    d = 8

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([KeyBiasAttention(d), DriftingBlock(d, drift), KeyBiasAttention(d)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    return Workload(
        name="keybias",
        model=Net(),
        make_batch=lambda b: torch.randn(b, 5, d),
        loss_fn=lambda m, x: m(x).square().mean(),
        default_batch_size=4,
    )


def test_both_verify_paths_share_the_verdict() -> None:
    for drift in (False, True):
        wl = comparison_workload(drift)
        ckpt = verify(wl, policy_plan(wl.model, "all"), step=StepSpec(dtype=torch.float64, repeats=0))
        acc = verify_accumulation(comparison_workload(drift), 4, 2, plan="none")
        assert ckpt.ok is acc["ok"] is (not drift), (drift, ckpt, acc)
        if drift:
            assert ckpt.worst_param.startswith("layers.") and 1e-4 < ckpt.max_grad_rel_err < 1e-2
            assert 1e-4 < acc["max_grad_rel_err"] < 1e-2 and "differ" in ckpt.reason and "differ" in acc["reason"]
        else:  # the key biases' gradients are rounding noise; judged against the floor they pass
            assert ckpt.max_grad_rel_err < 1e-12 and acc["max_grad_rel_err"] < 1e-12


def test_verify_says_when_the_unmodified_model_is_not_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(1e30)  # overflows in float32 without memfit
    wl = Workload(
        name="inf",
        model=model,
        make_batch=lambda b: torch.randn(b, 4),
        loss_fn=lambda m, x: m(x).square().mean() * 1e30,
    )
    res = verify(wl, policy_plan(model, "all"), step=StepSpec(repeats=0))
    assert not res.ok and "unmodified model's own" in res.reason
    acc = verify_accumulation(wl, 4, 2, step=StepSpec(dtype=torch.float32))
    assert not acc["ok"] and "unmodified model's own" in acc["reason"]


def test_accumulation_verify_with_batchnorm_says_why_and_offers_the_modes() -> None:
    wl = load_workload(CONVNET)
    ghost = verify_accumulation(wl, 8, 4, plan="all")
    assert not ghost["ok"] and "ghost batch norm" in ghost["reason"] and "freeze" in ghost["reason"]
    for bn in ("freeze", "groupnorm"):
        res = verify_accumulation(wl, 8, 4, plan="all", bn=bn)
        assert res["ok"] and res["max_grad_rel_err"] < 1e-10, (bn, res)


def test_plan_and_verify_say_when_recomputing_saves_nothing() -> None:
    """Parameters and AdamW state set the peak (batch 1): no plan is below keeping everything."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    wl = Workload(
        name="params",
        model=model,
        make_batch=lambda b: torch.randn(b, 256),
        loss_fn=lambda m, x: m(x).square().mean(),
        default_batch_size=1,
    )
    res = plan_for_budget(wl, 64 * 2**20, step=StepSpec(repeats=1))
    assert any("no plan saves memory" in n for n in res.notes), res.notes
    check = verify(wl, policy_plan(model, "all"), step=StepSpec(repeats=0))
    assert check.ok and check.measured_peak_bytes >= check.baseline_peak_bytes
    assert any("not below keeping every activation" in n for n in check.notes)
