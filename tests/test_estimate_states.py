"""Model states placed in estimates (memfit.estimation.states, `memfit estimate --states`): each
placement's bytes against the tensors of real CPU steps, the step-in-backward peak against a real step
that steps each parameter in its gradient hook (torch's own recipe), the JSON verdict and launch line,
and refusals before any fake step."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import torch

from memfit.apply.engine import apply_plan
from memfit.capture.chain import discover_chain
from memfit.capture.step import StepSpec, make_optimizer, optimizer_tensors
from memfit.capture.tracker import MemoryTracker
from memfit.cli.main import build_parser, main
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.estimation import estimate, estimate_stats, estimator, stats
from memfit.estimation.states import (
    host_optimizer_rate,
    place,
    placed_peak_bytes,
    placed_step_s,
    state_sizes,
    states_floor,
)
from memfit.models.registry import load_workload
from memfit.optim.states import ModelStates
from memfit.plan.policies import policy_plan
from memfit.profiling.blocks import profile
from memfit.workload import iter_tensors, mean_loss

SMALL_LLAMA = (
    "hf:llama?hidden_size=128&num_hidden_layers=2&num_attention_heads=4&intermediate_size=256&vocab_size=512&seq_len=64"
)
# Llama-3.1-8B's width and vocabulary with 2 layers: far over a small budget, quick to build with fake weights
WIDE_LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=4096&num_attention_heads=32&num_key_value_heads=8"
    "&intermediate_size=14336&vocab_size=128256&padding=false&seq_len=2048"
)
LLAMA_8B = WIDE_LLAMA.replace("num_hidden_layers=2", "num_hidden_layers=32")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sizes(wl, optimizer: str):
    return state_sizes(wl.model, optimizer=optimizer, blocks=discover_chain(wl.model, wl.blocks).blocks)


@pytest.mark.parametrize(
    ("dtype", "optimizer"), [(torch.float32, "adamw"), (torch.bfloat16, "adamw"), (torch.float32, "sgd")]
)
def test_placement_bytes_are_the_real_steps_tensors(dtype, optimizer):
    wl = load_workload(SMALL_LLAMA, dtype=dtype)
    opt = make_optimizer(wl.model, optimizer)
    mean_loss(wl.loss_fn(wl.model, wl.make_batch(2))).backward()
    opt.step()
    params = list(wl.model.parameters())
    grads = [p.grad for p in params]
    # Adam's 0-dim `step` counters stay on the host (on a GPU too): the host placements' optimizer state only
    state = [t for t in optimizer_tensors(opt) if t.dim() > 0]
    counters = [t for t in optimizer_tensors(opt) if t.dim() == 0]
    assert all(t.dtype == dtype for t in state)  # torch keeps AdamW's moments in the parameter's dtype
    sizes = _sizes(wl, optimizer)
    dev = place(sizes, "device")
    assert (dev.device_params_bytes, dev.device_grads_bytes, dev.device_optimizer_bytes) == (
        _nbytes(params), _nbytes(grads), _nbytes(state),
    )  # fmt: skip
    assert dev.host_bytes == 0
    largest = max(p.numel() * p.element_size() for p in params)
    sib = place(sizes, "step-in-backward")
    assert (sib.device_grads_bytes, sib.device_optimizer_bytes) == (largest, _nbytes(state))
    host = place(sizes, "host-optimizer")
    assert (host.device_params_bytes, host.device_grads_bytes, host.device_optimizer_bytes) == (
        _nbytes(params),
        largest,
        0,
    )
    assert (host.host_params_bytes, host.host_grads_bytes, host.host_optimizer_bytes) == (
        _nbytes(params), _nbytes(grads), _nbytes(state) + _nbytes(counters),
    )  # fmt: skip
    hp = place(sizes, "host-params")
    blocks = discover_chain(wl.model, wl.blocks).blocks
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = _nbytes(p for p in params if id(p) not in in_blocks)
    unit = max(_nbytes(b.parameters()) for b in blocks)
    assert (hp.device_params_bytes, hp.device_grads_bytes, hp.device_optimizer_bytes) == (
        root + 2 * unit,
        root + unit,
        0,
    )
    assert hp.host_bytes == _nbytes(params) + _nbytes(grads) + _nbytes(state) + _nbytes(counters)


def _step_in_backward_peak(spec: str, optimizer: str, policy: str | None, batch_size: int) -> int:
    """The tracked peak of a real CPU step that steps each parameter in its post-accumulate-grad hook
    and frees its gradient (the recipe of torch's "optimizer step in backward" tutorial)."""
    wl = load_workload(spec)
    torch.manual_seed(0)
    batch = wl.make_batch(batch_size)
    if policy is not None:
        plan = policy_plan(wl.model, policy, chain=discover_chain(wl.model, wl.blocks), batch=batch)
        apply_plan(wl.model, plan, batch=batch)
    params = list(wl.model.parameters())
    opts = {p: make_optimizer(torch.nn.ParameterList([p]), optimizer) for p in params}
    for p in params:  # the state allocated first: a steady-state step
        p.grad = torch.zeros_like(p)
        opts[p].step()
        p.grad = None

    def step_one(p: torch.Tensor) -> None:
        opts[p].step()
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(step_one) for p in params]
    tracker = MemoryTracker(device="cpu")
    tracker.track(wl.model, *opts.values(), iter_tensors(batch))
    with tracker:
        mean_loss(wl.loss_fn(wl.model, batch)).backward()
    for h in handles:
        h.remove()
    return tracker.peak_bytes


@pytest.mark.parametrize(("optimizer", "policy"), [("adamw", None), ("adamw", "all")])
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_step_in_backward_peak_bounds_a_real_step_in_backward(optimizer, policy):
    est = estimate(SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=3, optimizer=optimizer), policy=policy)
    sizes = _sizes(load_workload(SMALL_LLAMA), optimizer)
    sib = place(sizes, "step-in-backward")
    predicted = placed_peak_bytes(
        sib, sizes, device_peak_bytes=est.peak_bytes, start_bytes=est.breakdown["start_bytes"],
        activations_bytes=est.activations_bytes,
    )  # fmt: skip
    measured = _step_in_backward_peak(SMALL_LLAMA, optimizer, policy, 3)
    # An upper bound by at most the one gradient and the one step temporary it adds at the activations'
    # peak (the real step's hooks fire where fewer activations are live), plus Adam's 0-dim step counters.
    counters = 8 * len(list(load_workload(SMALL_LLAMA).model.parameters()))
    assert measured - counters <= predicted <= measured + sib.device_grads_bytes + sib.step_temp_bytes
    if policy == "all":  # recomputing every block, holding one gradient at a time lowers the step's peak
        assert measured < est.peak_bytes
    # the fake step run with memfit's own wrapper (memfit.optim.in_backward) is the real step's peak
    stepped = estimate(
        SMALL_LLAMA, device="cpu", step=StepSpec(batch_size=3, optimizer=optimizer), policy=policy,
        states="step-in-backward",
    )  # fmt: skip
    assert abs(stepped.peak_bytes - measured) <= counters
    assert stepped.peak_bytes <= predicted


def test_states_floor_names_the_parts_and_the_least_placement():
    wl = load_workload(SMALL_LLAMA)
    sizes = _sizes(wl, "adamw")
    dev = place(sizes, "device")
    need = dev.device_states_bytes + sizes.buffers_bytes
    with pytest.raises(BudgetInfeasibleError, match="model states alone need .* placement device") as err:
        states_floor(
            sizes,
            budget_bytes=need - 1,
            host_budget_bytes=None,
            placements=[ModelStates.DEVICE],
            subsystem="memfit fit",
        )
    assert err.value.min_budget_bytes == need
    assert (
        states_floor(sizes, budget_bytes=need, host_budget_bytes=None, placements=[ModelStates.DEVICE], subsystem="x")
        == dev
    )
    best = states_floor(sizes, budget_bytes=need, host_budget_bytes=10**12, placements=list(ModelStates), subsystem="x")
    assert best.device_states_bytes == min(place(sizes, m).device_states_bytes for m in ModelStates)
    with pytest.raises(BudgetInfeasibleError, match="host budget"):
        states_floor(
            sizes, budget_bytes=need, host_budget_bytes=1, placements=[ModelStates.HOST_OPTIMIZER], subsystem="x"
        )


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow  # three estimates (~8 s here)
def test_estimate_json_says_whether_it_fits_and_by_how_much(capsys):
    base = ["estimate", "--model", "demo?n_layer=2", "--batch-size", "2", "--device", "rtx4090"]
    code, res = _json(capsys, base)
    assert code == 0 and res["fits"] is True and res["states"] == "device" and "over_bytes" not in res
    assert res["device_bytes"]["peak_bytes"] == res["peak_bytes"]
    assert {r["states"] for r in res["placements"]} == {m.value for m in ModelStates}
    # a budget between the host-optimizer's peak and the device's: auto moves the optimizer to the host
    rows = {r["states"]: r for r in res["placements"]}
    mid = (rows["host-optimizer"]["device_peak_bytes"] + rows["device"]["device_peak_bytes"]) // 2
    assert rows["host-optimizer"]["device_peak_bytes"] < mid < rows["step-in-backward"]["device_peak_bytes"]
    code, res = _json(capsys, [*base, "--budget", str(mid), "--host-budget", "1GiB"])
    assert res["fits"] is True and res["states"] == "host-optimizer"
    assert res["device_bytes"]["optimizer_bytes"] == 0 and res["host_bytes"]["optimizer_bytes"] > 0
    code, res = _json(capsys, [*base, "--states", "step-in-backward"])  # its own fake step, with the wrapper
    row = res["placements"][0]
    assert row["peak_from"] == "fake step" and row["device_peak_bytes"] <= rows["step-in-backward"]["device_peak_bytes"]
    code, res = _json(capsys, [*base, "--budget", str(mid), "--states", "device"])
    assert res["fits"] is False and res["over_bytes"] == rows["device"]["device_peak_bytes"] - mid
    assert res["largest_parts"] and res["largest_parts"][0]["bytes"] >= res["largest_parts"][-1]["bytes"]


@pytest.mark.slow  # three per-rank estimates (~16 s here)
def test_estimate_per_rank_launch_line_only_when_it_fits(capsys):
    base = ["estimate", "--model", "demo?n_layer=2", "--batch-size", "2", "--device", "rtx4090",
            "--world-size", "2", "--parallel", "fsdp2"]  # fmt: skip
    code, res = _json(capsys, base)
    assert res["fits"] is True and "launch_command" in res
    main([*base, "--budget", "1MiB"])
    text = capsys.readouterr().out
    assert "rank 0 does not fit" in text and "torchrun" not in text
    code, res = _json(capsys, [*base, "--budget", "1MiB"])
    assert res["fits"] is False and res["over_bytes"] > 0 and "launch_command" not in res


@pytest.fixture
def fake_steps(monkeypatch):
    """Count the fake steps run (none may run before a refusal)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        raise AssertionError("a fake step ran")

    monkeypatch.setattr(stats, "run_fake_step", counted)
    monkeypatch.setattr(estimator, "run_fake_step", counted)
    return calls


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_fit_and_plan_refuse_model_states_over_the_budget_before_any_fake_step(capsys, fake_steps, command):
    argv = [
        command,
        "--model",
        WIDE_LLAMA,
        "--estimate",
        "--target",
        "rtx4090",
        "--dtype",
        "bfloat16",
        "--budget",
        "4GB",
    ]
    argv += ["--global-batch", "2"] if command == "fit" else []
    code, res = _json(capsys, argv)
    assert code != 0 and res["ok"] is False and fake_steps == []
    assert "model states alone need" in res["error"] and "optimizer state" in res["error"]
    # the call it suggests is one memfit accepts
    suggested = res["error"].split("`")[1]
    args = build_parser().parse_args(shlex.split(suggested)[1:])
    assert args.states == "auto"


def test_estimate_refuses_before_any_fake_step_with_the_parts(capsys, fake_steps):
    argv = ["estimate", "--model", WIDE_LLAMA, "--device", "rtx4090", "--dtype", "bfloat16", "--budget", "4GB"]
    code, res = _json(capsys, [*argv, "--states", "device"])
    assert code == 0 and fake_steps == [] and res["refused_before_fake_step"] is True
    assert res["fits"] is False and res["states"] == "device" and res["over_bytes"] > 0
    assert [p["part"] for p in res["largest_parts"]][:1] == ["optimizer state"]
    # with the host placements over the host budget, the refusal names the least device need left and says so
    code, res = _json(capsys, [*argv, "--host-budget", "1GiB"])
    assert fake_steps == [] and res["fits"] is False and res["states"] == "step-in-backward"
    assert "--host-budget" in res["reason"] and "host-optimizer, host-params" in res["reason"]


@pytest.mark.slow
def test_llama_8b_fit_is_refused_before_any_fake_step(capsys, fake_steps):
    argv = ["fit", "--model", LLAMA_8B, "--estimate", "--target", "rtx4090", "--dtype", "bfloat16", "--budget", "24GB"]
    code, res = _json(capsys, [*argv, "--global-batch", "2"])
    assert code != 0 and fake_steps == [] and "model states alone need" in res["error"]


def test_placed_step_time_is_the_notes_arithmetic():
    sizes = _sizes(load_workload(SMALL_LLAMA), "adamw")
    P, G = sizes.trainable_bytes, sizes.grads_bytes
    C, B, S, L, H = 2.0, 1.2, 0.1, 1e6, 4e5  # compute, its backward, device optimizer (s); link, host step (B/s)
    kw = {"compute_s": C, "backward_s": B, "device_optimizer_s": S, "host_link_bytes_per_s": L}
    for m in (ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD):
        assert placed_step_s(place(sizes, m), **kw, host_optimizer_bytes_per_s=H) == C + S
    host = placed_step_s(place(sizes, "host-optimizer"), **kw, host_optimizer_bytes_per_s=H)
    assert host == pytest.approx(C + max(0.0, G / L - B) + P / H + P / L)
    params = placed_step_s(place(sizes, "host-params"), **kw, host_optimizer_bytes_per_s=H)
    assert params == pytest.approx(max(C, (2 * sizes.params_bytes + G) / L) + P / H)
    assert placed_step_s(place(sizes, "host-params"), **{**kw, "host_link_bytes_per_s": None}) is None
    # the host optimizer's rate, measured here (a small step), sets the host placements' time
    rate = host_optimizer_rate(numel=1 << 14, tensors=2, repeats=1)
    assert rate > 0
    slower = placed_step_s(place(sizes, "host-optimizer"), **kw, host_optimizer_bytes_per_s=rate / 2)
    faster = placed_step_s(place(sizes, "host-optimizer"), **kw, host_optimizer_bytes_per_s=rate)
    assert slower - faster == pytest.approx(P / rate)


@pytest.mark.slow  # a profile and two estimated stats per optimizer (~15 s here)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_estimated_stats_with_the_step_in_backward_equal_a_measured_profile(optimizer):
    """`plan`/`fit --estimate --states step-in-backward` plan on these: fake steps with memfit's wrapper,
    against the profile measured here with the same placement (CPU kernels on both)."""
    wl = load_workload(SMALL_LLAMA, seed=0)
    step = StepSpec(batch_size=2, optimizer=optimizer, states="step-in-backward")
    kw = {"options": ("keep", "recompute"), "heads": False, "tiling": False}
    measured = profile(wl, step=dataclasses.replace(step, repeats=1), **kw)
    est = estimate_stats(wl, device="h100-sxm", gpu_kernels=False, step=step, host_inputs=False, **kw)
    device = estimate_stats(wl, device="h100-sxm", gpu_kernels=False, step=dataclasses.replace(step, states="device"),
                            host_inputs=False, **kw)  # fmt: skip
    assert est.states == measured.states == "step-in-backward"
    counters = 4 * len(list(wl.model.parameters())) if optimizer == "adamw" else 0  # Adam's CPU step counters
    assert abs(est.peak_bytes - measured.peak_bytes) <= counters
    assert est.grads_bytes == measured.grads_bytes
    assert est.peak_bytes <= device.peak_bytes


def test_estimated_stats_refuse_the_host_placements():
    with pytest.raises(SpecError, match="memfit estimate --states host-optimizer"):
        estimate_stats(load_workload(SMALL_LLAMA), device="h100-sxm", step=StepSpec(states="host-optimizer"))
