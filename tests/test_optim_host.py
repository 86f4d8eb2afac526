"""The host optimizer (optimizer state, gradients and step on the host) equals plain training.

The host is the device here (the CPU): the host copies are separate tensors, so every equality below
compares two different code paths. References: plain training with torch's optimizer, the big batch's
step (fp64), torch's ``clip_grad_norm_``, and the tensors' own byte counts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from tiny_models import TinyTokenLM, token_batch, token_count, token_loss
from torch import nn

from memfit.accumulate import Accumulator
from memfit.capture.step import measure_step, step_optimizer, tensor_bytes, warm_up
from memfit.capture.tracker import MemoryTracker
from memfit.errors import MemfitError, SpecError
from memfit.optim import ModelStates
from memfit.optim.build import implemented_states
from memfit.optim.host import HostOptimizer, host_optimizer
from memfit.optim.host_params import offload_parameters
from memfit.optim.in_backward import InBackwardError, refuse_in_accumulator
from memfit.training.guard import _WindowState

F64 = torch.float64
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 8, generator=g, dtype=next(model.parameters()).dtype)
    return model(x).square().mean()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, clip: float | None = None, sched=None) -> list:
    norms = []
    for step in range(steps):
        for micro in range(2):  # two backwards per step: the gradients add up
            _loss(model, 10 * step + micro).backward()
        if clip is not None:
            if isinstance(opt, HostOptimizer):
                norms.append(opt.clip_grad_norm_(clip))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return norms


def _assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, sa in a["state"].items():
        for k, v in sa.items():
            assert torch.equal(v, b["state"][i][k]), (i, k)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_k_steps_equal_plain_training(name: str) -> None:
    cls, kw = OPTIMIZERS[name]
    plain, host = _mlp(), _mlp()
    ref = cls(plain.parameters(), **kw)
    opt = HostOptimizer(host.parameters(), cls, **kw)
    _train(plain, ref, 3)
    _train(host, opt, 3)
    _assert_params_equal(plain, host)
    _assert_states_equal(ref.state_dict(), opt.state_dict())
    assert opt.state == {}  # nothing of the optimizer on the device
    assert all(p.grad is None for p in host.parameters())


def test_gradients_leave_the_device_during_backward() -> None:
    model = _mlp()
    opt = host_optimizer(model, torch.optim.AdamW, lr=1e-2)
    live = []
    model[0].weight.register_hook(lambda g: live.append(sum(p.grad is not None for p in model.parameters())))
    _loss(model, 0).backward()
    # when the first layer's gradient is made, the later layers' have gone to the host already
    assert live == [0]
    assert all(p.grad is None for p in model.parameters())
    want = [torch.autograd.grad(_loss(m, 0), list(m.parameters())) for m in [_mlp()]][0]
    got = [h.grad for h in opt.host_parameters()]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("with_count_fn", [True, False], ids=["count_fn", "deferred-count"])
def test_uneven_token_window_equals_big_batch(with_count_fn: bool) -> None:
    """Accumulated on the host over 4 + 4 + 2 samples, normalised by tokens: the big batch's steps (fp64)."""
    torch.manual_seed(0)
    big = TinyTokenLM().to(F64)
    acc_plain, acc_host = copy.deepcopy(big), copy.deepcopy(big)
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    ref = torch.optim.AdamW(big.parameters(), **kw)
    batches = [token_batch(10) for _ in range(3)]
    for batch in batches:  # the big batch: one backward of the token mean
        s, c = token_loss(big, batch)
        (s / c).backward()
        ref.step()
        ref.zero_grad()
    plain = Accumulator(acc_plain, torch.optim.AdamW(acc_plain.parameters(), **kw), micro_batch=4)
    host = Accumulator(acc_host, HostOptimizer(acc_host.parameters(), torch.optim.AdamW, **kw), micro_batch=4)
    count_fn = token_count if with_count_fn else None
    for batch in batches:
        assert plain.step(batch, token_loss, count_fn).micro_steps == 3
        assert host.step(batch, token_loss, count_fn).micro_steps == 3
    _assert_params_equal(acc_plain, acc_host)  # the same sums, on the host: bitwise
    for p, q in zip(big.parameters(), acc_host.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-13)  # fp64: the big batch up to rounding


def test_clipping_equals_torch_clip_grad_norm() -> None:
    plain, host = _mlp(), _mlp()
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt = HostOptimizer(host.parameters(), torch.optim.AdamW, lr=1e-2)
    want = _train(plain, ref, 3, clip=0.05)
    got = _train(host, opt, 3, clip=0.05)
    assert [float(n) for n in got] == [float(n) for n in want]
    assert all(float(n) > 0.05 for n in want)  # it clipped
    _assert_params_equal(plain, host)


def test_clipping_and_skips_through_the_accumulator() -> None:
    torch.manual_seed(0)
    model = TinyTokenLM().to(F64)
    twin = copy.deepcopy(model)
    plain = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch=3, max_grad_norm=0.05)
    host = Accumulator(
        twin, HostOptimizer(twin.parameters(), torch.optim.SGD, lr=0.5), micro_batch=3, max_grad_norm=0.05
    )
    batch = token_batch(8)
    want, got = plain.step(batch, token_loss, token_count), host.step(batch, token_loss, token_count)
    assert got.grad_norm == want.grad_norm and want.grad_norm > 0.05
    _assert_params_equal(model, twin)

    def nan_loss(m: nn.Module, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        s, c = token_loss(m, b)
        return s * float("nan"), c

    before = [p.detach().clone() for p in twin.parameters()]
    assert host.step(batch, nan_loss, token_count).skipped  # the host gradients' norm is NaN
    assert all(torch.equal(p, b) for p, b in zip(twin.parameters(), before, strict=True))


def test_lr_scheduler_drives_the_host_step() -> None:
    plain, host = _mlp(), _mlp()
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt = HostOptimizer(host.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(plain, ref, 3, sched=torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5))
    _train(host, opt, 3, sched=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    _assert_params_equal(plain, host)


def test_state_dict_round_trip_with_plain_optimizers() -> None:
    """Saved after 2 steps, resumed for 1: the uninterrupted plain run, whichever optimizer saves or loads."""
    full = _mlp()
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    _train(full, full_opt, 3)

    first = _mlp()
    first_opt = HostOptimizer(first.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(first, first_opt, 2)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(first_opt.state_dict())

    into_host = _mlp()
    host_opt = HostOptimizer(into_host.parameters(), torch.optim.AdamW, lr=1e-2)
    into_host.load_state_dict(saved_model)  # after the optimizer is built: its host copies follow
    host_opt.load_state_dict(copy.deepcopy(saved_opt))  # torch keeps the loaded `step` tensors, not copies
    into_plain = _mlp()
    into_plain.load_state_dict(saved_model)
    plain_opt = torch.optim.AdamW(into_plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(copy.deepcopy(saved_opt))
    for model, opt in ((into_host, host_opt), (into_plain, plain_opt)):
        for step in range(2):  # the third step's micro-steps, as _train runs them
            _loss(model, 20 + step).backward()
        opt.step()
        opt.zero_grad()
        _assert_params_equal(full, model)
    _assert_states_equal(full_opt.state_dict(), host_opt.state_dict())


def test_tracker_counts_host_bytes_apart() -> None:
    model = _mlp()
    plain_model = _mlp()
    opt = HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    for m, o in ((model, opt), (plain_model, plain)):
        _train(m, o, 1)  # the optimizer state exists
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # host copies, gradient buffers, AdamW's exp_avg and exp_avg_sq, and a 4-byte step per parameter
    n = len(list(model.parameters()))
    host_want = 4 * param_bytes + 4 * n
    assert tensor_bytes(opt.host_tensors()) == host_want

    peaks = {}
    for label, m, o in (("host", model, opt), ("plain", plain_model, plain)):
        device_want = param_bytes if label == "host" else 3 * param_bytes + 4 * n  # plain: AdamW's state too
        with MemoryTracker(device="cpu").track(m, o) as tracker:
            assert tracker.current_bytes == device_want
            start_host = tracker.host_bytes
            _train(m, o, 1)
        peaks[label] = tracker.peak_bytes
        assert tracker.current_bytes == device_want
        if label == "host":
            assert start_host == tracker.host_bytes == host_want
            assert tracker.peak_host_bytes > host_want  # the step's temporaries on the host
    # the plain step holds AdamW's state and every gradient on the device; the host step neither
    assert peaks["plain"] - peaks["host"] >= 2 * param_bytes + 4 * n


def test_tracker_host_scope_and_track_host() -> None:
    with MemoryTracker(device="cpu") as tracker:
        with tracker.host_scope():
            x = torch.empty(256)
        y = torch.empty(128)
        assert (tracker.current_bytes, tracker.host_bytes) == (512, 1024)
        tracker.track_host(y)  # counted on the device first, then named a host tensor
        assert (tracker.current_bytes, tracker.host_bytes) == (0, 1536)
        del x, y
        assert (tracker.current_bytes, tracker.host_bytes) == (0, 0)
    assert tracker.peak_host_bytes == 1536


def test_remove_takes_the_hooks_off() -> None:
    model = _mlp()
    opt = HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with opt:
        assert opt.hooked
        _loss(model, 0).backward()
        assert all(p.grad is None for p in model.parameters())
    assert not opt.hooked
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    _loss(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())  # on the device again
    twin = _mlp()
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    _loss(twin, 0).backward()
    _loss(twin, 0).backward()
    ref.step()
    opt.step()  # the first backward's host gradient plus the second's, still on the device
    _assert_params_equal(twin, model)


def test_parameters_on_two_devices_refused() -> None:
    with pytest.raises(SpecError, match="on 2 devices"):
        HostOptimizer([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))], torch.optim.SGD)


def test_an_abandoned_window_leaves_no_host_gradient() -> None:
    """A window left after its first micro-step (an error, a break): the next window starts from zero."""
    torch.manual_seed(0)
    model = TinyTokenLM().to(F64)
    twin, batch = copy.deepcopy(model), token_batch(8)
    plain = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch=3)
    host = Accumulator(twin, HostOptimizer(twin.parameters(), torch.optim.SGD, lr=0.5), micro_batch=3)
    for micro in host.window(token_batch(8)):
        micro.backward(token_loss(twin, micro.batch))
        break
    assert host.step(batch, token_loss, token_count).micro_steps == 3
    plain.step(batch, token_loss, token_count)
    _assert_params_equal(model, twin)


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_parameters_on_the_host_equal_plain_training() -> None:
    """FSDP2 with CPUOffloadPolicy over a group of one that memfit makes and destroys: an uneven,
    token-normalised, clipped window per step, equal to plain accumulation bitwise."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = TinyTokenLM().to(F64)
    twin, batches = copy.deepcopy(model), [token_batch(10) for _ in range(3)]
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    plain = Accumulator(model, torch.optim.AdamW(model.parameters(), **kw), micro_batch=4, max_grad_norm=0.5)
    with offload_parameters(twin) as placed:
        assert dist.get_world_size() == 1 and placed.made_group
        assert {p.device.type for p in twin.parameters()} == {"cpu"}
        with pytest.raises(SpecError, match="offload_parameters"):  # sharded parameters: not the host optimizer's
            HostOptimizer(twin.parameters(), torch.optim.AdamW, lr=1e-2)
        host = Accumulator(twin, torch.optim.AdamW(twin.parameters(), **kw), micro_batch=4, max_grad_norm=0.5)
        for batch in batches:
            want, got = plain.step(batch, token_loss, token_count), host.step(batch, token_loss, token_count)
            assert (got.micro_steps, got.grad_norm) == (3, want.grad_norm)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q.full_tensor())
    assert not dist.is_initialized()


def test_measured_step_reports_host_bytes_apart() -> None:
    """memfit's measured step with ``states='host-optimizer'``: the device holds no optimizer state and
    no gradient after the step; the host peak covers the host tensors, counted by their own bytes."""
    model = _mlp()
    batch = torch.randn(6, 8)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    peaks = {}
    for states in ("device", "host-optimizer"):
        with step_optimizer(model, "adamw", 1e-2, states=states) as opt:
            warm_up(model, batch, loss_fn, opt, seed=0)
            mem = measure_step(model, batch, loss_fn, opt, seed=0)
            host_bytes = tensor_bytes(opt.host_tensors()) if states == "host-optimizer" else 0
        peaks[states] = mem
        if states == "host-optimizer":
            assert isinstance(opt, HostOptimizer) and not opt.hooked  # released after the block
            assert (mem.grads_bytes, mem.optimizer_bytes) == (0, 0)
            assert mem.host_peak_bytes > host_bytes > 0
    assert peaks["device"].host_peak_bytes == 0
    assert peaks["device"].peak_bytes - peaks["host-optimizer"].peak_bytes >= peaks["device"].optimizer_bytes
    assert ModelStates.HOST_OPTIMIZER.value in implemented_states()


def test_grad_scaler_refused_with_the_fix() -> None:
    model = _mlp()
    opt = HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(_loss(model, 0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SpecError, match="--amp bf16"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


class _TiedAndUnused(nn.Module):
    """One layer applied twice (its gradient sums two uses) and one layer that never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.shared(x)))


def test_tied_and_unused_parameters_as_plain_training() -> None:
    torch.manual_seed(0)
    plain = _TiedAndUnused()
    host = copy.deepcopy(plain)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt = HostOptimizer(host.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for m, o in ((plain, ref), (host, opt)):
        for step in range(3):
            m(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_params_equal(plain, host)  # the unused layer: untouched by both (no gradient, no weight decay)
    _assert_states_equal(ref.state_dict(), opt.state_dict())


def test_out_of_memory_guard_sees_the_host_state_change() -> None:
    """A window that failed inside the host step cannot be redone: memfit's guard must notice the
    host optimizer state it changed (the device parameters are not yet copied back)."""
    torch.manual_seed(0)
    model = TinyTokenLM().to(F64)
    opt = HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    acc = Accumulator(model, opt, micro_batch=4)
    acc.step(token_batch(8), token_loss, token_count)  # the state exists
    window = _WindowState(acc, model)
    token_loss(model, token_batch(4))[0].backward()
    for h in opt.host_parameters():
        h.grad = h.grad.clone()
    opt.host_optimizer.step()  # the host half of a step; failing here leaves the device as it was
    with pytest.raises(MemfitError, match="optimizer state tensor"):
        window.restore()


def test_bf16_parameters_as_plain_bf16_training() -> None:
    """The host copies keep the device parameters' dtype: bf16 training stays bf16 training."""
    plain, host = _mlp().to(torch.bfloat16), _mlp().to(torch.bfloat16)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt = HostOptimizer(host.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(plain, ref, 3)
    _train(host, opt, 3)
    assert {h.dtype for h in opt.host_tensors() if h.dim() > 0} == {torch.bfloat16}
    _assert_params_equal(plain, host)
    _assert_states_equal(ref.state_dict(), opt.state_dict())


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_data_parallel_windows_are_refused_with_the_fix(parallel: str) -> None:
    # A parameter's hook fires before DDP/FSDP2 reduce its gradient: the host would step this rank's alone.
    model = nn.Linear(4, 4)
    opt = host_optimizer(model, torch.optim.AdamW, lr=1e-3)
    try:
        with pytest.raises(InBackwardError, match="Use --states device with --parallel"):
            refuse_in_accumulator(opt, None, None, parallel)
        refuse_in_accumulator(opt, None, None, "local")  # one process: accepted
    finally:
        opt.remove()
