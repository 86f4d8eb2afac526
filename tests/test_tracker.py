"""MemoryTracker against a second measurement (the profiler's allocator events) and exact cases."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.checkpoint import checkpoint

from memfit.capture.tracker import (
    BudgetExceededError,
    MemoryTracker,
    TimelineSample,
    profiler_peak_bytes,
)
from memfit.errors import MemfitError

F32 = 4  # bytes per float32


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ---------------------------------------------------------------- cross-check with the profiler


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return model, torch.randn(64, 256)


def _transformer() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model, torch.randn(4, 32, 64)  # (B, T, C)


def _conv_bn(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


def _convnet() -> tuple[nn.Module, torch.Tensor]:
    # Downsampling by max-pool, not by strided convolutions: see test_strided_conv_workspaces.
    model = nn.Sequential(
        *_conv_bn(3, 16), nn.MaxPool2d(2),
        *_conv_bn(16, 32), nn.MaxPool2d(2),
        *_conv_bn(32, 64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip
    return model, torch.randn(8, 3, 32, 32)  # (B, C, H, W)


def _first_steps(make: Callable[[], tuple[nn.Module, torch.Tensor]]):
    """Two identical fresh (model, optimizer) pairs and a step function.

    Both measurements see the same first training step: grads are None and the optimizer has no
    state before it, so parameter gradients and AdamW state are allocated inside the step in both,
    and nothing pre-existing is freed during it (the profiler cannot see such frees). The tracker
    tracks nothing pre-existing: both count only what the step allocates.
    """
    torch.manual_seed(0)
    model_a, x = make()
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.AdamW(model_a.parameters())
    opt_b = torch.optim.AdamW(model_b.parameters())

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()

    return (lambda: step(model_a, opt_a)), (lambda: step(model_b, opt_b))


class _CheckpointedResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)  # recomputed in backward
        return x


def _checkpointed() -> tuple[nn.Module, torch.Tensor]:
    return _CheckpointedResidualMLP(), torch.randn(256, 64)


@pytest.mark.parametrize(
    "make",
    [_mlp, _transformer, _convnet, _checkpointed],
    ids=["mlp", "transformer", "convnet", "checkpointed"],
)
def test_tracker_matches_profiler_on_a_training_step(make) -> None:
    step_a, step_b = _first_steps(make)
    with MemoryTracker(device="cpu") as tracker:
        step_a()
    reference = profiler_peak_bytes(step_b)

    assert reference > 100_000
    assert tracker.peak_bytes == pytest.approx(reference, rel=0.02)
    # The tracker sees only tensors; the profiler also sees kernel-internal buffers.
    assert tracker.peak_bytes <= reference


def test_strided_conv_workspaces() -> None:
    """Known gap: oneDNN's strided conv backward uses hidden buffers that only the profiler sees.

    On CPU (torch 2.13) the backward of a stride-2 convolution allocates grad-input-sized buffers
    inside the kernel (ideep scratch, then a contiguous copy) and frees them before returning;
    no dispatched op owns them. The tracker therefore reports a lower peak than the allocator
    (about 27 % lower for this net). It must still never report more.
    """

    def make() -> tuple[nn.Module, torch.Tensor]:
        model = nn.Sequential(
            *_conv_bn(3, 16), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip
        return model, torch.randn(8, 3, 32, 32)

    step_a, step_b = _first_steps(make)
    with MemoryTracker(device="cpu") as tracker:
        step_a()
    reference = profiler_peak_bytes(step_b)
    assert 0.5 * reference < tracker.peak_bytes <= reference


def test_profiler_peak_bytes_exact_and_ignores_earlier_memory() -> None:
    earlier: list[torch.Tensor | None] = [torch.empty(10_000)]
    # Allocated under an earlier profiling session: the allocator remembers its size and reports
    # its free in the next session, which must not lower that session's sum.
    assert profiler_peak_bytes(lambda: earlier.append(torch.empty(20_000))) == 80_000

    def fn() -> None:
        earlier.clear()  # frees 40 000 + 80 000 bytes allocated before fn
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500)  # 2000 bytes
        del a
        c = torch.empty(250)  # 1000 bytes
        del b, c

    assert profiler_peak_bytes(fn) == 6000
    assert profiler_peak_bytes(lambda: None) == 0


# ---------------------------------------------------------------- exact small cases


def test_allocation_view_delete() -> None:
    with MemoryTracker() as tracker:
        x = torch.empty(1000)
        assert tracker.current_bytes == 1000 * F32
        v = x.view(10, 100)[2:5]  # views add nothing
        assert tracker.current_bytes == 1000 * F32
        y = torch.ones(10, dtype=torch.float64)
        assert tracker.current_bytes == 1000 * F32 + 10 * 8
        del x
        assert tracker.current_bytes == 1000 * F32 + 80  # the view keeps the storage alive
        del v
        assert tracker.current_bytes == 80
        del y
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 1000 * F32 + 80


def test_inplace_and_out_ops_add_nothing() -> None:
    a, b = torch.randn(100), torch.randn(100)
    with MemoryTracker() as tracker:
        c = a + b
        assert tracker.current_bytes == 100 * F32
        c.mul_(2).add_(a)
        torch.add(a, b, out=c)
        a.add_(1)  # in place on an untracked tensor: not new memory either
        assert tracker.current_bytes == 100 * F32
        assert tracker.op_count == 5


def test_resized_storage_is_accounted() -> None:
    a, b = torch.randn(100), torch.randn(100)
    with MemoryTracker() as tracker:
        out = torch.empty(0)
        assert tracker.current_bytes == 0
        torch.add(a, b, out=out)  # out= grows the storage in place
        assert tracker.current_bytes == 100 * F32
        out.resize_(300)
        assert tracker.current_bytes == 300 * F32
        assert out.untyped_storage().nbytes() == 300 * F32
        del out
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 300 * F32


def test_tensor_literal_is_counted() -> None:
    # torch.tensor() builds its data outside dispatch and lifts it (aten.lift_fresh, an alias).
    with MemoryTracker() as tracker:
        t = torch.tensor([1.0, 2.0, 3.0])
        assert tracker.current_bytes == 3 * F32
        del t
    assert tracker.current_bytes == 0


def test_transpose_of_a_parameter_adds_nothing() -> None:
    lin = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with MemoryTracker() as tracker:
        tracker.track(lin)
        assert tracker.current_bytes == param_bytes(lin)
        wt = lin.weight.t()  # aten.t(weight) shares the weight's storage
        assert tracker.current_bytes == param_bytes(lin)
        y = lin(x)  # only the output is new
        assert tracker.current_bytes == param_bytes(lin) + 8 * 32 * F32
        del wt, y
    untracked = MemoryTracker()
    with untracked:
        lin.weight.t()  # untracked parameter: its alias is not new memory either
    assert untracked.peak_bytes == 0


def test_tracked_storages_counted_once() -> None:
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied weights: one storage
    model = nn.ModuleList([emb, head])
    tracker = MemoryTracker().track(model, model, emb.weight, [emb.weight], {"w": head.weight})
    assert tracker.current_bytes == 100 * 16 * F32
    assert tracker.device == torch.device("cpu")


def test_track_accepts_batches_and_rejects_unknown_objects() -> None:
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "lengths": [8, 7, 5, 3], "tag": "x"}
    a, b = torch.zeros(2), torch.zeros(3)
    tracker = MemoryTracker().track(batch, (a,), iter([b]), None)
    assert tracker.current_bytes == 4 * 8 * 8 + 2 * F32 + 3 * F32
    del b  # dies: no longer counted
    assert tracker.current_bytes == 4 * 8 * 8 + 2 * F32
    with pytest.raises(TypeError, match="cannot count a object"):
        MemoryTracker().track([object()])


def test_grads_created_by_backward_are_counted() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    x = torch.randn(16, 64)
    with MemoryTracker() as tracker:
        tracker.track(model)
        assert all(p.grad is None for p in model.parameters())
        model(x).sum().backward()
        gc.collect()
        # Autograd's graph is gone; what stays is exactly the new .grad of every parameter, each
        # one storage of the parameter's size (AccumulateGrad keeps the buffer an op made).
        assert all(p.grad is not None for p in model.parameters())
        assert tracker.current_bytes == 2 * param_bytes(model)
        model.zero_grad(set_to_none=True)
        assert tracker.current_bytes == param_bytes(model)


def test_existing_grads_counted_by_track_and_accumulated_in_place() -> None:
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32)
    lin(x).sum().backward()  # grads exist before the tracker
    tracker = MemoryTracker().track(lin)
    assert tracker.current_bytes == 2 * param_bytes(lin)
    with tracker:
        lin(x).sum().backward()  # second backward accumulates into the existing .grad
    gc.collect()
    assert tracker.current_bytes == 2 * param_bytes(lin)


def test_optimizer_state_counted() -> None:
    lin = nn.Linear(32, 16)
    opt = torch.optim.AdamW(lin.parameters())
    x = torch.randn(4, 32)
    lin(x).sum().backward()
    with MemoryTracker() as tracker:
        tracker.track(lin)  # params + grads
        opt.step()  # creates exp_avg, exp_avg_sq (param-sized) and a scalar step per param
    n_params = len(list(lin.parameters()))
    state_bytes = 2 * param_bytes(lin) + n_params * F32
    assert tracker.current_bytes == 2 * param_bytes(lin) + state_bytes

    again = MemoryTracker().track(opt)  # existing state
    assert again.current_bytes == state_bytes


def test_storage_kept_alive_by_autograd_graph() -> None:
    """The weak reference sees the real death of a storage, not of its Python object."""
    w = torch.randn(1000, requires_grad=True)
    with MemoryTracker() as tracker:
        y = w.exp()  # exp saves its output for backward
        loss = y.sum()
        del y  # storage now held only by the autograd graph
        gc.collect()
        assert tracker.current_bytes == 1000 * F32 + F32  # y + the loss scalar
        loss.backward()  # frees the graph (and creates w.grad)
        gc.collect()
        assert tracker.current_bytes == F32 + 1000 * F32  # loss + w.grad
        del loss
        w.grad = None
    assert tracker.current_bytes == 0


def test_phase_peaks() -> None:
    with MemoryTracker() as tracker:
        keep = torch.empty(100)  # 400 bytes live before any phase
        with tracker.phase("forward"):
            a = torch.empty(1000)
            del a
        with tracker.phase("backward"):
            b = torch.empty(200)
            with tracker.phase("inner"):
                c = torch.empty(300)
                del c
            del b
        with tracker.phase("forward"):  # re-entered: the max of both entries stays
            d = torch.empty(10)
            del d
        with tracker.phase("optimizer"):
            pass
        del keep
    assert tracker.peak_bytes_by_phase == {
        "forward": 400 + 4000,
        "backward": 400 + 800 + 1200,
        "inner": 400 + 800 + 1200,
        "optimizer": 400,
    }
    assert tracker.peak_bytes == 4400


def test_reset_peak() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(1000)
        b = torch.empty(1000)
        del a
        assert tracker.peak_bytes == 8000
        tracker.reset_peak()
        assert tracker.peak_bytes == tracker.current_bytes == 4000
        assert tracker.peak_bytes_by_phase == {}
        c = torch.empty(10)
        assert tracker.peak_bytes == 4040
        del b, c


def test_timeline() -> None:
    with MemoryTracker(record_timeline=True) as tracker:
        with tracker.phase("forward"):
            a = torch.empty(10)
            b = a * 2
        del a, b
    assert tracker.timeline == [
        TimelineSample(1, 40, "forward"),
        TimelineSample(2, 80, "forward"),
        TimelineSample(2, 40, None),
        TimelineSample(2, 0, None),
    ]
    assert MemoryTracker().timeline == []


def test_budget_exceeded_in_forward() -> None:
    with MemoryTracker(budget_bytes=10_000) as tracker, tracker.phase("forward"):
        a = torch.empty(2000)  # 8000 bytes: fine
        with pytest.raises(BudgetExceededError) as info:
            b = torch.empty(1000)  # 12000 bytes live: over
    del a
    err = info.value
    assert isinstance(err, MemfitError)
    assert (err.budget_bytes, err.live_bytes, err.phase) == (10_000, 12_000, "forward")
    assert "aten.empty" in err.op
    message = str(err)
    for fact in ("12000 bytes", "10000 bytes", "'forward'", "Raise the budget"):
        assert fact in message
    assert "b" not in locals()


def test_budget_exceeded_in_backward_keeps_its_type() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    tracker = MemoryTracker(budget_bytes=param_bytes(model) + 100_000).track(model)
    with tracker:
        loss = model(x).square().mean()  # activations fit
        with tracker.phase("backward"), pytest.raises(BudgetExceededError, match="'backward'"):
            loss.backward()  # grads (param-sized) do not


def test_device_filter() -> None:
    with MemoryTracker(device="cpu") as tracker:
        m = torch.empty(1000, device="meta")
        c = torch.empty(10)
    assert tracker.current_bytes == 40
    assert tracker.current_bytes_by_device == {torch.device("cpu"): 40, torch.device("meta"): 4000}
    assert tracker.peak_bytes_by_device[torch.device("meta")] == 4000
    del m, c

    lazy = MemoryTracker()  # device: the first tensor it meets
    assert lazy.device == torch.device("cpu")
    with lazy:
        m = torch.empty(1000, device="meta")
        c = torch.empty(10)
    assert lazy.device == torch.device("meta")
    assert lazy.current_bytes == 4000
    assert lazy.current_bytes_by_device[torch.device("cpu")] == 40
    del m, c


# ---------------------------------------------------------------- fake tensors


def _linear_fwd_bwd() -> MemoryTracker:
    """Linear(4096 -> 1024) forward and backward on a (1024, 4096) input, params tracked."""
    torch.manual_seed(0)
    lin = nn.Linear(4096, 1024)
    x = torch.randn(1024, 4096, requires_grad=True)
    with MemoryTracker(device="cpu") as tracker:
        tracker.track(lin, x)
        with tracker.phase("forward"):
            y = lin(x)  # (1024, 1024)
        with tracker.phase("backward"):
            y.square().mean().backward()
    return tracker


def test_fake_tensors_measure_like_real_ones_without_allocating() -> None:
    real = _linear_fwd_bwd()

    fake_result: dict[str, MemoryTracker] = {}

    def run_fake() -> None:
        with FakeTensorMode():
            fake_result["tracker"] = _linear_fwd_bwd()

    allocated_for_real = profiler_peak_bytes(run_fake)
    fake = fake_result["tracker"]

    activation = 1024 * 1024 * F32
    assert real.peak_bytes > 2 * 1024 * 4096 * F32  # x and weight, their grads, activations
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_bytes_by_phase == real.peak_bytes_by_phase
    assert allocated_for_real < activation  # only scalars: nothing of the step's size


def test_fake_tensors_with_tracker_outside_the_fake_mode() -> None:
    # The documented order is tracker inside FakeTensorMode; the other order works as well in
    # torch 2.13 (FakeTensorMode redispatches its fake ops to the modes below it).
    with MemoryTracker() as tracker, FakeTensorMode():
        x = torch.empty(1000)
        y = x + 1
        assert isinstance(y, FakeTensor)
        del x, y
    assert tracker.peak_bytes == 2 * 1000 * F32
    assert tracker.current_bytes == 0


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.gpu
def test_tracker_matches_cuda_allocator() -> None:
    device = torch.device("cuda")
    x = torch.randn(512, 1024, device=device)

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(
            nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
            nn.Linear(4096, 1024),
        ).to(device)  # fmt: skip
        return model, torch.optim.AdamW(model.parameters())

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        model(x).square().mean().backward()
        opt.step()

    step(*make())  # warm-up: cuBLAS workspaces are allocated once, before measuring
    model, opt = make()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with MemoryTracker(device=device) as tracker:
        step(model, opt)
    torch.cuda.synchronize(device)
    allocator_peak = torch.cuda.max_memory_allocated(device) - before

    assert allocator_peak > 100 * 2**20
    assert tracker.peak_bytes == pytest.approx(allocator_peak, rel=0.02)
    assert tracker.device.index is not None  # "cuda" resolved to the current device
    assert tracker.peak_bytes_by_device[tracker.device] == tracker.peak_bytes

    model, opt = make()
    torch.cuda.synchronize(device)
    assert profiler_peak_bytes(lambda: step(model, opt), device=device) == pytest.approx(allocator_peak, rel=0.02)
