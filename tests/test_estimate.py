"""memfit estimate: static bytes against arithmetic, the fake step against real measured steps,
FLOPs against hand counts, the device table and time model, the CLI and its JSON."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
from torch import nn

from memfit.apply import apply_plan
from memfit.capture.chain import discover_chain
from memfit.capture.step import StepSpec, make_optimizer, measure_step, warm_up
from memfit.cli.main import main
from memfit.errors import SpecError, UnsupportedModelError
from memfit.estimation import DEVICES, estimate, get_device, static_bytes, step_seconds
from memfit.estimation.devices import DEFAULT_MFU, published_mfu, resolve_mfu
from memfit.estimation.fake import build_fake_workload, fake_mode, fake_parameters
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.workload import Workload, cast_batch

LLAMA_7B = (
    "hf:llama?hidden_size=4096&intermediate_size=11008&num_hidden_layers=32"
    "&num_attention_heads=32&num_key_value_heads=32&vocab_size=32000"
)
LLAMA_7B_PARAMS = 6_738_415_616  # the number
SMALL_LLAMA = (
    "hf:llama?hidden_size=128&num_hidden_layers=2&num_attention_heads=4&intermediate_size=256&vocab_size=512&seq_len=64"
)
SMALL_GPT2 = "hf:gpt2?num_hidden_layers=2&hidden_size=128&vocab_size=512&seq_len=64"


def llama_params(*, h: int, i: int, L: int, V: int, kv_ratio: int = 1) -> int:
    """Llama parameter count from its shape: untied embedding and head, no biases."""
    attn = 2 * h * h + 2 * h * (h // kv_ratio)  # q, o; k, v
    mlp = 3 * h * i  # gate, up, down
    return 2 * V * h + L * (attn + mlp + 2 * h) + h  # + 2 RMSNorms per layer, final norm


def gpt2_params(*, h: int, i: int, L: int, V: int, P: int) -> int:
    """GPT-2 parameter count: tied head, biases everywhere, MLP width i."""
    block = (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h  # + 2 LayerNorms
    return V * h + P * h + L * block + 2 * h


def real_step(spec: str, *, batch_size: int, policy: str | None = None, optimizer: str = "adamw", dtype=None):
    """One steady-state step of the real model, measured with the live-tensor tracker."""
    wl = load_workload(spec, dtype=dtype)
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(batch_size), dtype=dtype)
    if policy is not None:
        chain = discover_chain(wl.model, wl.blocks)
        apply_plan(wl.model, policy_plan(wl.model, policy, chain=chain, batch=batch), batch=batch)
    opt = make_optimizer(wl.model, optimizer)
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
    return measure_step(wl.model, batch, wl.loss_fn, opt, seed=2)


# --- static parts: exact arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("optimizer", "dtype", "master", "per_param"),
    [
        # (params, grads, optimizer) bytes per parameter, by NOTE [ Precision convention ]
        ("sgd", torch.float32, False, (4, 4, 4)),
        ("adamw", torch.float32, False, (4, 4, 8)),
        ("adam", torch.bfloat16, False, (2, 2, 4)),
        ("adamw", torch.bfloat16, True, (2, 2, 12)),
        ("sgd", torch.float16, True, (2, 2, 8)),
    ],
)
def test_static_bytes_are_parameter_count_times_bytes(optimizer, dtype, master, per_param):
    h, i, L, V = 128, 256, 2, 512
    n = llama_params(h=h, i=i, L=L, V=V)
    mode = fake_mode()
    wl, built = build_fake_workload(SMALL_LLAMA, mode=mode)
    assert built == "fake"
    with fake_parameters(wl.model, mode, dtype=dtype) as model:
        s = static_bytes(model, optimizer=optimizer, master_weights=master)
    assert s.n_params == s.n_trainable == n
    assert (s.params_bytes, s.grads_bytes, s.optimizer_bytes) == tuple(k * n for k in per_param)
    assert s.master_weights_bytes == (4 * n if master else 0)


def test_static_bytes_count_tied_weights_once():
    h, i, L, V, P = 128, 4 * 128, 2, 512, 512  # the spec gives the width: GPT-2's own n_inner, 4 x n_embd
    mode = fake_mode()
    wl, _ = build_fake_workload(SMALL_GPT2, mode=mode)
    with fake_parameters(wl.model, mode) as model:
        s = static_bytes(model, optimizer="adamw")
    assert s.n_params == gpt2_params(h=h, i=i, L=L, V=V, P=P)
    assert s.params_bytes == 4 * s.n_params and s.optimizer_bytes == 8 * s.n_params


def test_llama_7b_params_bytes_exact_without_allocating():
    assert llama_params(h=4096, i=11008, L=32, V=32000) == LLAMA_7B_PARAMS
    mode = fake_mode()
    wl, built = build_fake_workload(LLAMA_7B, mode=mode)
    with fake_parameters(wl.model, mode, dtype=torch.bfloat16) as model:
        s = static_bytes(model, optimizer="adamw")
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert built == "fake"
    assert s.params_bytes == LLAMA_7B_PARAMS * 2
    assert s.optimizer_bytes == LLAMA_7B_PARAMS * 2 * 2


def test_unknown_optimizer_is_a_spec_error():
    with pytest.raises(SpecError, match="unknown optimizer 'lion'"):
        static_bytes(nn.Linear(2, 2), optimizer="lion")


# --- the fake step against real measured steps ------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "policy", "optimizer"),
    [
        ("demo?n_layer=3&n_embd=64", None, "adamw"),
        (SMALL_LLAMA, None, "adamw"),
        (SMALL_GPT2, "all", "adamw"),
        (
            "hf:llama?hidden_size=128&num_hidden_layers=4&num_attention_heads=4&intermediate_size=256&vocab_size=512&seq_len=64",
            "every:2",
            "sgd",
        ),
    ],
)
@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fake_step_peak_equals_real_tracked_peak(spec, policy, optimizer):
    B = 3
    est = estimate(spec, policy=policy, device="cpu", step=StepSpec(batch_size=B, optimizer=optimizer))
    real = real_step(spec, batch_size=B, policy=policy, optimizer=optimizer)
    # The only difference allowed: Adam's 0-dim `step` counters, which the real CPU step counts
    # (4 bytes per parameter tensor) and the estimate leaves out (they stay on the CPU on a GPU).
    assert est.peak_bytes == pytest.approx(real.peak_bytes, rel=0.02)
    assert abs(est.peak_bytes - real.peak_bytes) <= 8 * len(list(load_workload(spec).model.parameters()))
    for phase, value in real.peak_bytes_by_phase.items():
        assert est.breakdown["peak_bytes_by_phase"][phase] == pytest.approx(value, rel=0.02)
    assert est.params_bytes == real.params_bytes - est.breakdown["buffers_bytes"]
    assert est.grads_bytes == real.grads_bytes == est.breakdown["measured_grads_bytes"]
    assert est.optimizer_bytes == est.breakdown["measured_optimizer_bytes"]
    assert est.policy == (policy or "none")


def test_bf16_fake_step_matches_real_bf16_step():
    est = estimate(SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=2, dtype=torch.bfloat16))
    real = real_step(SMALL_LLAMA, batch_size=2, dtype=torch.bfloat16)
    assert est.dtype == "bfloat16"
    assert est.peak_bytes == pytest.approx(real.peak_bytes, rel=0.02)


def test_checkpointing_all_blocks_estimates_fewer_activations_and_more_flops():
    none = estimate(SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=4))
    every2 = estimate(SMALL_LLAMA, policy="every:2", device="cpu", step=StepSpec(batch_size=4))
    full = estimate(SMALL_LLAMA, policy="all", device="cpu", step=StepSpec(batch_size=4))
    assert full.activations_bytes < every2.activations_bytes < none.activations_bytes
    assert full.peak_bytes < none.peak_bytes
    # recompute is counted: one more forward of the blocks
    assert none.flops < full.flops < none.flops + none.breakdown["forward_flops"]
    assert (full.params_bytes, full.grads_bytes, full.optimizer_bytes) == (
        none.params_bytes,
        none.grads_bytes,
        none.optimizer_bytes,
    )


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_gpu_estimate_keeps_cuda_kernels_saved_tensors():
    """Dropout masks of 1 byte and fused attention with dropout, as on CUDA (checked on an H200
    by the GPU test below); the recompute of checkpointed blocks takes the same kernels."""
    spec = "hf:gpt2?num_hidden_layers=2&hidden_size=128&vocab_size=512&seq_len=64"  # dropout 0.1
    cpu = estimate(spec, device="cpu", step=StepSpec(batch_size=2))
    gpu = estimate(spec, device="h100-sxm", step=StepSpec(batch_size=2))
    assert (cpu.breakdown["kernels"], gpu.breakdown["kernels"]) == ("cpu", "cuda")
    assert gpu.activations_bytes < cpu.activations_bytes
    assert "bmm" in cpu.breakdown["flops_by_op"]  # CPU: attention with dropout on the math path
    assert "_scaled_dot_product_flash_attention_for_cpu" in gpu.breakdown["flops_by_op"]
    # the fused backward recomputes the scores: 5 attention matmuls instead of the math path's 4
    assert gpu.flops > cpu.flops
    # checkpointed blocks recompute with the same kernels (else torch raises CheckpointError)
    demo = "demo?n_layer=4&n_embd=64"  # nn.Dropout(0.1) in every block
    kept = estimate(demo, device="a100-80gb", step=StepSpec(batch_size=2))
    recomputed = estimate(demo, policy="all", device="a100-80gb", step=StepSpec(batch_size=2))
    assert recomputed.activations_bytes < kept.activations_bytes
    assert recomputed.flops > kept.flops


def test_plan_object_is_applied_like_its_policy():
    wl = load_workload(SMALL_LLAMA)
    plan = policy_plan(wl.model, "all", chain=discover_chain(wl.model, wl.blocks), batch=wl.make_batch(2))
    by_plan = estimate(SMALL_LLAMA, plan=plan, device="cpu", step=StepSpec(batch_size=2))
    by_policy = estimate(SMALL_LLAMA, policy="all", device="cpu", step=StepSpec(batch_size=2))
    assert by_plan.peak_bytes == by_policy.peak_bytes
    assert by_plan.activations_bytes == by_policy.activations_bytes


def test_foreach_optimizer_adds_whole_model_temporaries():
    loop = estimate(SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=2))
    multi = estimate(SMALL_LLAMA, step=StepSpec(batch_size=2))  # GPU default: foreach
    assert multi.breakdown["optimizer_impl"] == "foreach"
    # AdamW's foreach step keeps sqrt(exp_avg_sq) for all parameters at once
    assert multi.breakdown["optimizer_temp_bytes"] >= multi.params_bytes
    assert loop.breakdown["optimizer_temp_bytes"] < multi.params_bytes
    assert multi.activations_bytes == loop.activations_bytes


def test_master_weights_convention_and_step():
    est = estimate(SMALL_LLAMA, master_weights=True, step=StepSpec(batch_size=2, dtype=torch.bfloat16))
    n = est.n_params
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (2 * n, 2 * n, 12 * n)
    assert est.breakdown["master_weights_bytes"] == 4 * n
    assert est.breakdown["measured_optimizer_bytes"] == 12 * n
    # the step converts the bf16 gradients to fp32: 2 more bytes per parameter than bf16 grads
    assert est.breakdown["optimizer_temp_bytes"] >= 2 * n
    with pytest.raises(SpecError, match="need.*dtype bfloat16 or float16"):
        estimate(SMALL_LLAMA, master_weights=True, step=StepSpec(batch_size=2))


def test_given_workload_is_left_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    wl = Workload(
        name="mlp",
        model=model,
        make_batch=lambda b: torch.randn(b, 32),
        loss_fn=lambda m, x: m(x).square().mean(),
    )
    est = estimate(wl, device="cpu", step=StepSpec(batch_size=16, optimizer="sgd", dtype=torch.bfloat16))
    assert est.params_bytes == sum(p.numel() for p in params) * 2
    assert list(model.parameters()) == params
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 and p.grad is None for p in params)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    with pytest.raises(SpecError, match="seq_len applies"):
        estimate(wl, seq_len=8)


def test_flops_of_two_linear_layers_by_hand():
    B, a, b, c = 16, 32, 24, 8
    wl = Workload(
        name="mlp",
        model=nn.Sequential(nn.Linear(a, b), nn.Linear(b, c)),
        make_batch=lambda n: torch.randn(n, a),
        loss_fn=lambda m, x: m(x).square().mean(),
    )
    est = estimate(wl, device="cpu", step=StepSpec(batch_size=B))
    # forward: 2 B a b + 2 B b c (addmm); backward: weight grads of both layers, input grad of the
    # second only (the batch does not require grad)
    assert est.breakdown["forward_flops"] == 2 * B * a * b + 2 * B * b * c
    assert est.flops == 4 * B * a * b + 6 * B * b * c


def test_attention_flops_are_counted_on_the_cpu_flash_kernel():
    est = estimate(SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=2))
    ops = est.breakdown["flops_by_op"]
    B, T, h, L = 2, 64, 128, 2
    # torch counts attention as 2 matmuls of B x T x T x h forward, 5 backward (full, not causal)
    assert ops["_scaled_dot_product_flash_attention_for_cpu"] == L * 2 * (2 * B * T * T * h)
    assert ops["_scaled_dot_product_flash_attention_for_cpu_backward"] == L * 5 * (2 * B * T * T * h)


def test_data_dependent_model_is_refused_with_the_fix():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y if y.sum().item() > 0 else -y

    wl = Workload(name="gate", model=Gate(), make_batch=lambda b: torch.randn(b, 4), loss_fn=lambda m, x: m(x).mean())
    with pytest.raises(UnsupportedModelError, match="reads tensor values"):
        estimate(wl, step=StepSpec(batch_size=2))


# --- devices and time ------------------------------------------------------------------------------


def test_device_table_has_the_common_gpus_with_consistent_numbers():
    for name in [
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h100-pcie",
        "h200",
        "l4",
        "l40s",
        "rtx4090",
        "rtx3090",
        "a10g",
        "v100-32gb",
        "t4",
    ]:
        d = DEVICES[name]
        assert d.memory_bytes and d.memory_bytes >= 16 * 2**30
        assert d.fp32_flops_per_s and d.memory_bandwidth_bytes_per_s
        assert d.fp16_flops_per_s and d.fp16_flops_per_s > d.fp32_flops_per_s
        assert d.bf16_flops_per_s is None or d.bf16_flops_per_s == d.fp16_flops_per_s
    assert DEVICES["h100-sxm"].bf16_flops_per_s == pytest.approx(989.4e12)
    assert DEVICES["v100-32gb"].bf16_flops_per_s is None
    assert DEVICES["cpu"].memory_bytes is None and DEVICES["cpu"].fp32_flops_per_s is None
    assert get_device("H100").name == "h100-sxm" and get_device("A100_80GB").name == "a100-80gb"


def test_unknown_device_lists_the_names():
    with pytest.raises(SpecError) as err:
        estimate("demo", device="h800")
    assert "unknown device 'h800'" in str(err.value)
    for name in DEVICES:
        assert name in str(err.value)


def test_step_time_is_flops_over_peak_times_mfu_plus_optimizer_traffic():
    d = DEVICES["a100-80gb"]
    t = step_seconds(d, dtype=torch.bfloat16, flops=312e12, optimizer_traffic_bytes=2039e9, mfu=0.5)
    assert t.compute_s == pytest.approx(2.0) and t.optimizer_s == pytest.approx(1.0)
    assert t.step_s == pytest.approx(3.0)
    none = step_seconds(DEVICES["t4"], dtype=torch.bfloat16, flops=1, optimizer_traffic_bytes=1)
    assert none.step_s is None and "bfloat16" in none.reason
    with pytest.raises(SpecError, match="mfu"):
        step_seconds(d, dtype=torch.float32, flops=1, optimizer_traffic_bytes=1, mfu=0)


def test_estimate_reports_fit_and_time_on_a_device():
    est = estimate(SMALL_LLAMA, device="l4", step=StepSpec(batch_size=2, dtype=torch.bfloat16))
    d = DEVICES["l4"]
    assert est.fits is True and est.headroom_bytes == d.memory_bytes - est.peak_bytes
    traffic = 2 * est.params_bytes + est.grads_bytes + 2 * est.optimizer_bytes
    assert est.step_s == pytest.approx(
        est.flops / (d.bf16_flops_per_s * 0.4) + traffic / d.memory_bandwidth_bytes_per_s
    )
    assert estimate(SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=2)).step_s is None


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_json_fields(capsys):
    code = main(
        ["estimate", "--model", SMALL_LLAMA, "--batch-size", "2", "--device", "rtx4090", "--policy", "all", "--json"]
    )
    assert code == 0
    d = json.loads(capsys.readouterr().out)
    for key in [
        "params_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "activations_bytes",
        "peak_bytes",
        "step_s",
        "flops",
        "device",
        "fits",
        "mfu",
        "breakdown",
    ]:
        assert key in d
    assert d["device"] == "rtx4090" and d["fits"] is True and d["policy"] == "all" and d["mfu"] == 0.4
    assert d["peak_bytes"] >= d["params_bytes"] + d["optimizer_bytes"]
    assert d["step_s"] > 0


def test_cli_unknown_device_is_an_error_with_the_names(capsys):
    code = main(["estimate", "--model", "demo", "--device", "gtx1080", "--json"])
    assert code == 2
    d = json.loads(capsys.readouterr().out)
    assert d["error_type"] == "SpecError" and "h100-sxm" in d["error"]


def test_cli_table(capsys):
    assert main(["estimate", "--model", "demo?n_layer=2", "--batch-size", "2", "--device", "t4"]) == 0
    out = capsys.readouterr().out
    assert "peak (whole step)" in out and "on t4" in out and "fits" in out


@pytest.mark.slow
def test_cli_llama_7b_at_4096_tokens(capsys):
    """The headline command: exact params_bytes, nothing allocated (its time is a benchmark
    figure, in benchmarks/reports/estimate_compare_*, not a test)."""
    code = main(
        [
            "estimate",
            "--model",
            LLAMA_7B,
            "--batch-size",
            "1",
            "--seq-len",
            "4096",
            "--dtype",
            "bfloat16",
            "--optimizer",
            "adamw",
            "--json",
        ]
    )
    assert code == 0
    d = json.loads(capsys.readouterr().out)
    assert d["params_bytes"] == LLAMA_7B_PARAMS * 2
    assert d["grads_bytes"] == LLAMA_7B_PARAMS * 2 and d["optimizer_bytes"] == LLAMA_7B_PARAMS * 4
    assert d["seq_len"] == 4096 and d["breakdown"]["built"] == "fake"
    # Activations of a 7B Llama at 4096 tokens without checkpointing: tens of GiB.
    assert 10 * 2**30 < d["activations_bytes"] < 60 * 2**30
    assert d["peak_bytes"] >= d["params_bytes"] + d["grads_bytes"] + d["optimizer_bytes"]


# --- GPU: the estimate against the CUDA allocator ------------------------------------------------------

GPU_LLAMA = (
    "hf:llama?hidden_size=1024&intermediate_size=2816&num_hidden_layers=8&num_attention_heads=16"
    "&vocab_size=32000&seq_len=1024"
)
GPU_GPT2 = "hf:gpt2?num_hidden_layers=8&hidden_size=1024&num_attention_heads=16&vocab_size=32000&seq_len=1024"
GPU_DEMO = "demo?n_layer=8&n_embd=1024&n_head=16&seq_len=1024"


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("spec", "batch_size", "policy"),
    [
        (GPU_LLAMA, 4, None),
        (GPU_LLAMA, 4, "all"),
        (GPU_GPT2, 4, None),  # dropout in attention: CUDA's fused kernel, not the math path
        (GPU_DEMO, 8, None),  # nn.Dropout: CUDA's bool mask
        (GPU_DEMO, 8, "every:2"),
        (LLAMA_7B + "&seq_len=4096", 1, None),
    ],
)
def test_estimate_matches_a_real_cuda_step(spec, batch_size, policy):
    """The fake step's peak against the same real bf16 AdamW step on CUDA: the live-tensor
    tracker (same quantity: within 1 %) and ``torch.cuda.max_memory_allocated`` (which adds
    kernel workspaces and allocator rounding: the estimate is at most 10 % below). Prints the
    measured step time against the prediction."""
    from memfit.capture.step import training_step

    est = estimate(spec, policy=policy, device="h200", step=StepSpec(batch_size=batch_size, dtype=torch.bfloat16))
    gc.collect()  # models of earlier cases are freed by the cycle collector, not at once
    torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        wl = load_workload(spec, dtype=torch.bfloat16)
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(batch_size), device="cuda")
    if policy is not None:
        chain = discover_chain(wl.model, wl.blocks)
        apply_plan(wl.model, policy_plan(wl.model, policy, chain=chain, batch=batch), batch=batch)
    opt = make_optimizer(wl.model, "adamw")
    warm_up(wl.model, batch, wl.loss_fn, opt, seed=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    tracked = measure_step(wl.model, batch, wl.loss_fn, opt, seed=2)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - leftover
    times = []
    for k in range(3):
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        training_step(wl.model, batch, wl.loss_fn, opt, seed=3 + k)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[1]
    print(
        f"\nGPU {spec} B={batch_size} policy={policy}: estimate {est.peak_bytes} B, tracked "
        f"{tracked.peak_bytes} B ({est.peak_bytes / tracked.peak_bytes:.4f}), allocated {allocated} B "
        f"({est.peak_bytes / allocated:.4f}); step {step_s * 1e3:.1f} ms measured, "
        f"{est.step_s * 1e3:.1f} ms predicted at mfu {est.mfu} (achieved "
        f"{est.flops / step_s / DEVICES['h200'].bf16_flops_per_s:.3f}); "
        f"total_memory {torch.cuda.get_device_properties(0).total_memory}"
    )
    del wl, opt, batch
    gc.collect()
    torch.cuda.empty_cache()
    assert est.peak_bytes == pytest.approx(tracked.peak_bytes, rel=0.01)
    assert 0.9 * allocated <= est.peak_bytes <= 1.01 * allocated


def test_default_mfu_is_the_one_fitted_to_a_published_run_of_the_device_class():
    """Without ``mfu`` the roofline runs at the utilisation fitted to a published run of the device's
    class (H100: torchtitan's 8-GPU Llama 3.1 8B run) and at 0.4 where there is none (H200); a
    given ``mfu`` wins. The step's compute seconds follow: FLOPs / (peak x mfu)."""
    h100, h200 = get_device("h100-sxm"), get_device("h200")
    assert resolve_mfu(h100, None) == published_mfu(h100).mfu and published_mfu(h200) is None
    assert resolve_mfu(h200, None) == DEFAULT_MFU and resolve_mfu(h100, 0.5) == 0.5
    flops = 1e15
    t = step_seconds(h100, dtype=torch.bfloat16, flops=flops, optimizer_traffic_bytes=0)
    assert t.mfu == published_mfu(h100).mfu
    assert t.compute_s == pytest.approx(flops / (h100.peak_flops_per_s(torch.bfloat16) * t.mfu))
    est = estimate("demo?n_layer=2", step=StepSpec(batch_size=2), policy="all", device="h100-sxm")
    assert est.mfu == published_mfu(h100).mfu
    assert estimate("demo?n_layer=2", step=StepSpec(batch_size=2), policy="all", device="h200").mfu == DEFAULT_MFU


def test_a_model_on_another_device_is_estimated_with_its_batch_on_that_device() -> None:
    """`memfit plan` on a GPU estimates the user's model where it is (the budget as reserved memory):
    the batch make_batch gives on the CPU goes to the model's device, as the step moves it. The meta
    device stands in for a GPU here; the step failed on mixed devices before."""
    from memfit.estimation.fake import fake_batch
    from memfit.workload import iter_tensors

    wl = load_workload(SMALL_GPT2)
    wl.model.to("meta")
    mode = fake_mode()
    with fake_parameters(wl.model, mode):
        batch = fake_batch(wl, 2, mode)
    assert {t.device.type for t in iter_tensors(batch)} == {"meta"}
    est = estimate(wl, device="h200", step=StepSpec(batch_size=2))
    assert est.predicted_reserved_bytes >= est.peak_bytes > 0
