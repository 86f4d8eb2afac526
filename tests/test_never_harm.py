"""Measuring never changes the user's model .

Every measuring entry point (profile, plan_for_budget, autofit, verify, verify_accumulation,
explain, capture_ops) runs on a model the user has set up the way users do: a plan applied,
gradients left from a backward, one parameter frozen (its ``.grad`` None), one module in eval mode,
the RNGs advanced. Afterwards everything must be as before, bitwise: ``state_dict`` (values, dtype,
device), gradients, ``requires_grad``, ``training`` flags, the torch / Python / NumPy RNG states,
the parameters' storages, and the applied plan. The reference is taken with plain torch calls
(clones, ``get_rng_state``), not with memfit's snapshot, and the model must still compute what an
untouched deep copy (taken before the plan was applied) computes.

Models: a token LM with dropout (tests/tiny_models.py), the BatchNorm + Dropout2d conv net
(examples/convnet.py) and a two-layer HF GPT-2 (dropout, fused activations, chunked head).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import token_workload
from torch import nn

from memfit import StepSpec
from memfit.apply import applied_plan, apply_plan
from memfit.capture.ops import capture_ops
from memfit.capture.snapshot import ModelSnapshot, RngSnapshot, cast_copy, leave_unchanged
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.cli.main import main
from memfit.estimation import estimate
from memfit.fitting import autofit
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.options import BASE_OPTIONS
from memfit.profiling.blocks import profile
from memfit.profiling.residuals import explain
from memfit.profiling.side_by_side import measure_setups, plan_setup
from memfit.verification import verify_accumulation
from memfit.verification.plans import verify
from memfit.workload import Workload, mean_loss

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
CONVNET = str(ROOT / "examples" / "convnet.py") + ":build"
GPT2 = "hf:gpt2?num_hidden_layers=2&hidden_size=32&n_inner=64&num_attention_heads=2&vocab_size=128"


# --- the reference: what the user's model and process look like ------------------------------------


@dataclass
class Seen:
    """Everything measuring may touch, captured with plain torch calls."""

    state: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    requires_grad: dict[str, bool]
    training: dict[str, bool]
    storages: dict[str, int]
    torch_rng: torch.Tensor
    python_rng: Any
    numpy_rng: Any
    plan: Any


def seen(model: nn.Module) -> Seen:
    params = dict(model.named_parameters())
    return Seen(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        grads={k: None if p.grad is None else p.grad.detach().clone() for k, p in params.items()},
        requires_grad={k: p.requires_grad for k, p in params.items()},
        training={k: m.training for k, m in model.named_modules()},
        storages={k: p.untyped_storage().data_ptr() for k, p in params.items()},
        torch_rng=torch.get_rng_state(),
        python_rng=random.getstate(),
        numpy_rng=np.random.get_state(),
        plan=applied_plan(model),
    )


def assert_unchanged(model: nn.Module, before: Seen, *, same_storage: bool = True) -> None:
    """Bitwise the same; ``same_storage``: every parameter also kept its storage (NOTE [ Measuring
    leaves the model as it was ]: only a tensor cast or moved in place gets new storage)."""
    after = seen(model)
    assert after.state.keys() == before.state.keys()
    for k, v in before.state.items():
        w = after.state[k]
        assert (w.dtype, w.device, w.shape) == (v.dtype, v.device, v.shape), k
        assert torch.equal(w, v), f"{k} changed"
    assert after.requires_grad == before.requires_grad
    for k, g in before.grads.items():
        h = after.grads[k]
        assert (g is None) == (h is None), f"grad of {k}: {g is None=} {h is None=}"
        if g is not None:
            assert h.dtype == g.dtype and torch.equal(h, g), f"grad of {k} changed"
    assert after.training == before.training
    if same_storage:
        assert after.storages == before.storages, "a parameter got new storage"
    assert torch.equal(after.torch_rng, before.torch_rng), "torch RNG changed"
    assert after.python_rng == before.python_rng, "Python RNG changed"
    a, b = after.numpy_rng, before.numpy_rng
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:], "NumPy RNG changed"
    assert after.plan is before.plan, "the user's plan is gone or replaced"


def users_setup(wl: Workload) -> tuple[nn.Module, Seen]:
    """Set the model up as a user would have it; returns an untouched copy and the reference state.

    A backward leaves gradients; the first parameter is frozen (its gradient None); one module runs
    in eval mode; a plan is applied; the RNGs are advanced past a fresh seed.
    """
    model = wl.model
    torch.manual_seed(11)
    mean_loss(wl.loss_fn(model, wl.make_batch(2))).backward()
    first = next(model.parameters())
    first.requires_grad_(False)
    first.grad = None
    leaf = next(m for m in model.modules() if isinstance(m, nn.Dropout | nn.Dropout2d | nn.Linear))
    leaf.eval()
    twin = copy.deepcopy(model)
    apply_plan(model, policy_plan(model, "all"))
    torch.manual_seed(123)
    torch.rand(3)
    random.seed(5)
    random.random()
    np.random.seed(7)
    np.random.rand()
    return twin, seen(model)


def assert_computes_like(model: nn.Module, twin: nn.Module, wl: Workload) -> None:
    """The model (plan applied) gives the loss and gradients the untouched copy gives, bitwise."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        batch = wl.make_batch(2)
        out = []
        for m in (model, twin):
            torch.manual_seed(5)
            loss = mean_loss(wl.loss_fn(m, batch))
            grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
            out.append((loss.detach(), grads))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True))


def token() -> Workload:
    return token_workload(dropout=0.1)


def convnet() -> Workload:
    return load_workload(CONVNET, seed=0)


def gpt2() -> Workload:
    return load_workload(GPT2, seq_len=16, seed=0)


MODELS = {"token": token, "convnet": convnet, "gpt2": gpt2}

# Each entry point with small arguments; each returns something so that it really ran.
RUNS = {
    "profile": lambda wl: profile(wl, step=StepSpec(batch_size=2, repeats=1)),
    "profile-float64": lambda wl: profile(
        wl, step=StepSpec(batch_size=2, repeats=1, dtype=torch.float64), options=BASE_OPTIONS
    ),
    "plan_for_budget": lambda wl: plan_for_budget(wl, 10**9, step=StepSpec(batch_size=2, repeats=1)),
    "autofit": lambda wl: autofit(wl, 10**9, 3, step=StepSpec(repeats=1), max_tries=1),
    "verify": lambda wl: verify(wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=2, repeats=1)),
    "verify-float64": lambda wl: verify(
        wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=2, repeats=0, dtype=torch.float64)
    ),
    "verify_accumulation": lambda wl: verify_accumulation(wl, 4, 2, plan="all"),
    "explain": lambda wl: explain(wl, policy_plan(wl.model, "all"), step=StepSpec(batch_size=2, repeats=1)),
    "capture_ops": lambda wl: capture_ops(wl, batch_size=2, repeats=1),
    "estimate": lambda wl: estimate(wl, step=StepSpec(batch_size=2)),
    "estimate-all": lambda wl: estimate(wl, policy="all", step=StepSpec(batch_size=2)),
    # `memfit plan --measure`: no plan, memfit's plan and 'all', each applied and undone in turn
    "measure_setups": lambda wl: measure_setups(
        wl,
        {name: plan_setup(policy_plan(wl.model, name)) for name in ("none", "every:2", "all")},
        batch_size=2,
        repeats=1,
    ),
}
CASES = [
    ("token", "profile"),
    ("convnet", "profile"),
    ("gpt2", "profile"),
    ("token", "profile-float64"),
    ("token", "plan_for_budget"),
    ("convnet", "plan_for_budget"),
    ("token", "autofit"),
    ("convnet", "autofit"),
    ("token", "verify"),
    ("convnet", "verify"),
    ("gpt2", "verify"),
    ("convnet", "verify-float64"),
    ("token", "verify_accumulation"),
    ("convnet", "verify_accumulation"),
    ("gpt2", "explain"),
    ("convnet", "explain"),
    ("convnet", "capture_ops"),
    ("gpt2", "capture_ops"),
    ("token", "estimate"),
    ("convnet", "estimate"),
    ("gpt2", "estimate-all"),
    ("token", "measure_setups"),
    ("convnet", "measure_setups"),
    ("gpt2", "measure_setups"),
]


@pytest.mark.parametrize(("model", "run"), CASES, ids=[f"{m}-{r}" for m, r in CASES])
@pytest.mark.slow  # about 14 s on 2 cores: the fast tier keeps to about 4 minutes
def test_measuring_leaves_the_model_and_the_rngs_as_they_were(model: str, run: str) -> None:
    wl = MODELS[model]()
    twin, before = users_setup(wl)
    assert RUNS[run](wl) is not None
    assert_unchanged(wl.model, before)
    assert_computes_like(wl.model, twin, wl)


class Raises:
    """A loss that raises on its n-th call (after the measurement has trained on the model)."""

    def __init__(self, loss_fn: Any, n: int) -> None:
        self.loss_fn, self.n, self.calls = loss_fn, n, 0

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("the workload's loss failed")
        return self.loss_fn(model, batch)


@pytest.mark.parametrize(
    ("run", "n"),
    [("profile", 5), ("autofit", 8), ("verify", 6), ("capture_ops", 2), ("explain", 2), ("verify_accumulation", 3)],
)
def test_the_model_is_restored_when_measuring_raises(run: str, n: int) -> None:
    wl = token()
    twin, before = users_setup(wl)
    raising = Workload(
        name=wl.name, model=wl.model, make_batch=wl.make_batch, loss_fn=Raises(wl.loss_fn, n), count_fn=wl.count_fn
    )
    with pytest.raises(RuntimeError, match="the workload's loss failed"):
        RUNS[run](raising)
    assert raising.loss_fn.calls == n
    assert_unchanged(wl.model, before)
    assert_computes_like(wl.model, twin, wl)


# --- the snapshot itself --------------------------------------------------------------------------


class Counter(nn.Module):
    """A buffer updated by reassignment (a new tensor object each forward), as some models do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return self.lin(x)


def test_snapshot_restores_reassigned_buffers_flags_and_grads() -> None:
    model = Counter()
    model.lin.weight.grad = torch.ones(3, 3)
    grad, steps, weight = model.lin.weight.grad, model.steps, model.lin.weight
    before = seen(model)
    snap = ModelSnapshot.take(model)
    model(torch.ones(2, 3)).sum().backward()  # grads accumulate, the bias gets one, steps reassigned
    with torch.no_grad():
        model.lin.weight.mul_(2)
    model.lin.bias.requires_grad_(False)
    model.eval()
    snap.restore()
    assert model.steps is steps and int(model.steps) == 0
    assert model.lin.weight is weight and model.lin.weight.grad is grad
    assert_unchanged(model, before)
    snap.restore()  # twice is the same
    assert_unchanged(model, before)


def test_snapshot_restores_a_cast_in_place() -> None:
    model = Counter()
    model.lin.weight.grad = torch.ones(3, 3)
    before = seen(model)
    snap = ModelSnapshot.take(model)
    model.double()
    model.lin.weight.grad = None
    snap.restore()
    assert model.lin.weight.dtype == torch.float32 and model.lin.weight.grad.dtype == torch.float32
    assert_unchanged(model, before, same_storage=False)


def test_rng_snapshot_restores_every_generator() -> None:
    s = RngSnapshot.take()
    want = (torch.rand(4), random.random(), np.random.rand())
    torch.rand(100), random.random(), np.random.rand(7)
    s.restore()
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_cast_copy_leaves_the_model_and_casts_only_floating_tensors() -> None:
    model = Counter()
    assert cast_copy(model) is model and cast_copy(model, dtype=torch.float32, device="cpu") is model
    before = seen(model)
    c = cast_copy(model, dtype=torch.float64)
    assert c is not model and c.lin.weight.dtype == torch.float64 and c.steps.dtype == torch.long
    assert torch.equal(c.lin.weight, model.lin.weight.double())
    assert c.lin.weight.grad is None and isinstance(c.lin.weight, nn.Parameter)
    m = cast_copy(model, device="meta")  # a move (no CUDA needed to see one)
    assert m.lin.weight.device.type == "meta" and m.steps.device.type == "meta"
    assert_unchanged(model, before)


def test_the_snapshot_is_not_in_measured_peaks() -> None:
    """A step measured inside leave_unchanged has the tracker peak of one measured without it."""
    wl = token()
    batch = wl.make_batch(4)
    peaks = []
    for wrap in (False, True):
        model = copy.deepcopy(wl.model)
        opt = make_optimizer(model)
        warm_up(model, batch, wl.loss_fn, opt, seed=0)
        if wrap:
            with leave_unchanged(model) as m:
                peaks.append(measure_step(m, batch, wl.loss_fn, opt, seed=1).peak_bytes)
        else:
            peaks.append(measure_step(model, batch, wl.loss_fn, opt, seed=1).peak_bytes)
    assert peaks[0] == peaks[1] > 0


@pytest.mark.gpu
def test_on_cuda_the_snapshot_stays_off_the_device() -> None:
    """The allocator's peak of a step measured inside leave_unchanged is that of one without it."""
    wl = token()
    model = wl.model.cuda()
    batch = {k: v.cuda() for k, v in wl.make_batch(4).items()}
    opt = make_optimizer(model)
    warm_up(model, batch, wl.loss_fn, opt, seed=0)
    peaks = []
    for wrap in (False, True, False):
        with leave_unchanged(model) if wrap else contextlib.nullcontext(model) as m:
            mem = measure_step(m, batch, wl.loss_fn, opt, seed=1)
            peaks.append((mem.allocator_peak_bytes, mem.peak_bytes))
        opt.zero_grad(set_to_none=True)
    assert peaks[0] == peaks[1] == peaks[2]


@pytest.mark.gpu
def test_profile_on_cuda_measures_a_copy_and_leaves_the_cpu_model() -> None:
    wl = token()
    twin, before = users_setup(wl)
    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1, device="cuda"), options=BASE_OPTIONS)
    assert stats.device.startswith("cuda")
    assert_unchanged(wl.model, before)
    assert_computes_like(wl.model, twin, wl)


# --- memfit train: the fit does not change where training starts ----------------------------------

# Dropout 0.1: masks depend on the micro-batch split, so the fixed-micro-batch run uses the
# micro-batch the fit chose. At 1300 KiB only micro-batch 1 fits (2 needs 1.31 MiB, 4 needs 1.38
# MiB), and it fits only with blocks recomputed: the fit profiles and runs measured windows.
DEMO = "demo?n_layer=4&n_embd=32&seq_len=32"
TRAIN = ["train", "--model", DEMO, "--global-batch", "4", "--steps", "2", "--seed", "3", "--json"]


def _train(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main([*TRAIN, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_train_with_a_budget_starts_from_the_built_weights(capsys: pytest.CaptureFixture[str]) -> None:
    a = _train(capsys, "--budget", "1300KiB")
    b = _train(capsys, "--budget", "1300KiB")
    assert a["micro_batch"] == b["micro_batch"] == 1
    assert a["recomputed_blocks"] > 0
    assert a["losses"] == b["losses"]
    fixed = _train(capsys, "--micro-batch", str(a["micro_batch"]))
    # A recomputing plan replays the dropout masks: the same numbers as no plan, step after step.
    assert fixed["losses"] == a["losses"]
