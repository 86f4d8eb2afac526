"""Saving a model with a plan applied: pickle, ``torch.save`` / ``torch.load`` and ``copy.deepcopy``
bring it back with the plan still applied (NOTE [ Saving applied models ] in memfit.apply.engine).

Every plan kind memfit applies, on tiny CPU models: the copy trains as the unmodified model from
the same weights and data (loss, every gradient, buffers), saves what the original saves, refuses a
second plan, and ``remove_plan`` on it restores the plain model; the original is left alone."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import token_workload
from torch import nn
from torch.testing import assert_close

from memfit import MemfitError
from memfit.apply import applied_plan, apply_plan, is_applied, remove_plan
from memfit.models.registry import load_workload
from memfit.plan import Option, Plan, Segment, policy_plan
from memfit.workload import Workload, cast_batch, mean_loss

ROOT = Path(__file__).resolve().parents[1]
CONVNET = f"{ROOT / 'examples' / 'convnet.py'}:build"
HF_TINY = "num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=2&vocab_size=128"
GPT2 = f"hf:gpt2?{HF_TINY.replace('intermediate_size', 'n_inner')}"
LLAMA = f"hf:llama?{HF_TINY}&num_key_value_heads=1"

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the plans ------------------------------------------------------------------------------------


def _with(plan: Plan, actions: dict[int, tuple[Option, str | None]], **changes: Any) -> Plan:
    """``plan`` with some blocks' decisions replaced (index -> (action, selective policy))."""
    blocks = tuple(
        type(b)(name=b.name, option=actions[i][0], policy=actions[i][1]) if i in actions else b
        for i, b in enumerate(plan.blocks)
    )
    return plan.with_(policy="custom", blocks=blocks, **changes)


def tiny() -> Workload:
    wl = token_workload(dropout=0.1)  # dropout: the recompute must replay the forward's masks
    wl.model.double()
    return wl


def convnet() -> Workload:
    return load_workload(CONVNET, dtype=torch.float64)  # BatchNorm and Dropout2d in every block


def gpt2() -> Workload:
    return load_workload(GPT2, seq_len=16, dtype=torch.float64)


def llama() -> Workload:
    return load_workload(LLAMA, seq_len=16, dtype=torch.float64)


OPS = "save:aten.addmm.default,aten.tanh.default@0"
REC, SEL, OFF = Option.RECOMPUTE, Option.SELECTIVE, Option.OFFLOAD

# name -> (workload, plan of its model); each plan kind apply_plan knows, and combinations
CASES: dict[str, tuple[Callable[[], Workload], Callable[[nn.Module], Plan]]] = {
    "recompute": (tiny, lambda m: policy_plan(m, "all")),
    "keep-and-recompute": (tiny, lambda m: _with(policy_plan(m, "none"), {1: (REC, None)})),
    "recompute-batchnorm": (convnet, lambda m: policy_plan(m, "all")),
    "segments-batchnorm": (
        convnet,
        lambda m: _with(
            policy_plan(m, "none"),
            {1: (REC, None), 4: (REC, None)},
            segments=(Segment(start=0, stop=6), Segment(start=1, stop=3), Segment(start=3, stop=5)),
        ),
    ),
    "sqrt-segments": (convnet, lambda m: policy_plan(m, "sqrt")),
    "segment-of-hf-layers": (
        llama,
        lambda m: policy_plan(m, "none").with_(policy="custom", segments=(Segment(start=0, stop=2),)),
    ),
    "segment-of-hf-layers-recompute-inside": (
        gpt2,
        lambda m: _with(policy_plan(m, "none"), {1: (REC, None)}, segments=(Segment(start=0, stop=2),)),
    ),
    "selective-op-list": (tiny, lambda m: _with(policy_plan(m, "none"), {0: (SEL, OPS), 1: (SEL, OPS)})),
    "selective-preset": (
        gpt2,
        lambda m: _with(policy_plan(m, "none"), {0: (SEL, "save_matmuls_and_attention"), 1: (SEL, "save_matmuls")}),
    ),
    "offload-batchnorm": (convnet, lambda m: _with(policy_plan(m, "none"), dict.fromkeys(range(8), (OFF, None)))),
    "head-gpt2": (gpt2, lambda m: policy_plan(m, "none").with_(head="chunked")),
    "head-llama": (llama, lambda m: policy_plan(m, "none").with_(head="chunked")),
    "fused-activations": (gpt2, lambda m: policy_plan(m, "none").with_(activations="fused")),
    "mixed-gpt2": (
        gpt2,
        lambda m: _with(
            policy_plan(m, "none"), {0: (SEL, "save_matmuls"), 1: (OFF, None)}, head="chunked", activations="fused"
        ),
    ),
    "mixed-llama": (
        llama,
        lambda m: _with(
            policy_plan(m, "none"), {0: (REC, None), 1: (SEL, "save_matmuls_and_attention")}, head="chunked"
        ),
    ),
}


def applied(case: str) -> tuple[Workload, nn.Module, Plan]:
    """The case's workload with its plan applied, and the unmodified model from the same weights."""
    make_wl, make_plan = CASES[case]
    wl = make_wl()
    ref = copy.deepcopy(wl.model)
    plan = make_plan(wl.model)
    apply_plan(wl.model, plan)
    for m in wl.model.modules():  # offload even tiny tensors, so that CPU tests see it happen
        if "_memfit_offload" in m.__dict__:
            m.__dict__["_memfit_offload"].min_bytes = 0
    return wl, ref, plan


def same_computation(plan: Plan, wl: Workload) -> bool:
    """Block plans run the same ops as plain training: bitwise equal. The chunked head and fused
    activations compute the same functions in another order, and a recomputed transformers layer
    runs without the KV cache the unmodified model fills (NOTE [ State a recompute would change
    twice ] in apply/engine.py), which rounds differently in the last bits: equal to rounding (fp64)."""
    return plan.head is None and plan.activations is None and not wl.name.startswith("hf:")


# --- helpers --------------------------------------------------------------------------------------


def make_batch(wl: Workload, seed: int) -> Any:
    torch.manual_seed(seed)
    return cast_batch(wl.make_batch(4), dtype=torch.float64)


def step(
    model: nn.Module, wl: Workload, batch: Any, seed: int = 7
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward and backward: loss, gradients, and the bytes of the distinct storages autograd
    saved outside memfit's own checkpoint and offload hooks (what the plan leaves on the device)."""
    model.zero_grad(set_to_none=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    torch.manual_seed(seed)  # the same dropout masks for both models
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = mean_loss(wl.loss_fn(model, batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, sum(saved.values())


def assert_trains_as(got: tuple, want: tuple, *, exact: bool) -> None:
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-9, "atol": 1e-12}
    assert_close(got[0], want[0], **tol)
    assert got[1].keys() == want[1].keys() and got[1]
    for n in got[1]:
        assert_close(got[1][n], want[1][n], **tol, msg=lambda m, n=n: f"{n}: {m}")


def assert_same_buffers(model: nn.Module, ref: nn.Module) -> None:
    for (n, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(b, b_ref), n


def batch_counts(model: nn.Module) -> list[int]:
    return [int(m.num_batches_tracked) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def instance_state(model: nn.Module) -> list[dict[str, Any]]:
    """Each module's instance attributes (what memfit installs lives there)."""
    return [dict(m.__dict__) for m in model.modules()]


def round_trip(model: nn.Module, how: str, tmp_path: Path) -> nn.Module:
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    if how == "torch.save":
        path = tmp_path / "model.pt"
        torch.save(model, path)
        return torch.load(path, weights_only=False)
    return copy.deepcopy(model)


# --- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow  # about 12 s on 2 cores: the fast tier keeps to about 4 minutes
def test_saved_model_comes_back_with_the_plan_and_trains_as_the_unmodified_model(
    case: str, how: str, tmp_path: Path
) -> None:
    wl, ref, plan = applied(case)
    model, exact = wl.model, same_computation(plan, wl)
    # A step first: the model is saved with whatever a step leaves behind (policy lookups,
    # the buffers a block mutates, the head's state).
    assert_trains_as(step(model, wl, make_batch(wl, 1)), step(ref, wl, make_batch(wl, 1)), exact=exact)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = instance_state(model)

    loaded = round_trip(model, how, tmp_path)

    # The plan is still applied, and a second one is refused as on the original.
    assert loaded is not model and is_applied(loaded) and applied_plan(loaded) == plan
    with pytest.raises(MemfitError, match="already has a plan applied"):
        apply_plan(loaded, plan)
    assert list(loaded.state_dict()) == list(ref.state_dict())
    # It trains as the unmodified model, saves what the planned original saves (less than plain
    # training: the plan is at work), and updates buffers once (BatchNorm: +1 per step).
    counts = batch_counts(loaded)
    batch = make_batch(wl, 2)
    got, want = step(loaded, wl, batch), step(ref, wl, batch)
    assert_trains_as(got, want, exact=exact)
    assert_same_buffers(loaded, ref)
    assert batch_counts(loaded) == [c + 1 for c in counts]
    assert got[2] < want[2]
    # The original is untouched by what was done to the copy, and still saves the same.
    assert instance_state(model) == state_before
    assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, params_before[n]), n
    original = step(model, wl, batch)
    assert_trains_as(original, got, exact=True)
    assert original[2] == got[2]
    # The original's own step may count its checked forwards (NOTE [ State a recompute would change
    # twice ] in apply/engine.py); from here on only the copy is worked on.
    state_before = instance_state(model)

    # remove_plan on the copy: the plain model, as the unmodified one (no memfit attributes, no
    # instance forwards), and the original keeps its plan.
    remove_plan(loaded)
    assert not is_applied(loaded)
    for m, m_ref in zip(loaded.modules(), ref.modules(), strict=True):
        assert set(m.__dict__) == set(m_ref.__dict__), type(m).__name__
        assert "forward" not in m.__dict__ and not any(k.startswith("_memfit") for k in m.__dict__)
    batch = make_batch(wl, 3)
    plain, want = step(loaded, wl, batch), step(ref, wl, batch)
    assert_trains_as(plain, want, exact=True)
    assert plain[2] == want[2]
    assert is_applied(model) and instance_state(model) == state_before


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_of_an_applied_model_loads_into_a_plain_one(case: str, tmp_path: Path) -> None:
    wl, ref, _ = applied(case)
    path = tmp_path / "state.pt"
    torch.save(wl.model.state_dict(), path)
    plain = CASES[case][0]().model  # the same class, built afresh
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)  # other weights, so that loading has something to do
    plain.load_state_dict(torch.load(path))
    assert not is_applied(plain) and not any("forward" in m.__dict__ for m in plain.modules())
    batch = make_batch(wl, 1)
    assert_trains_as(step(plain, wl, batch), step(ref, wl, batch), exact=True)


def test_offload_settings_survive_and_streams_do_not_travel() -> None:
    wl, _, _ = applied("offload-batchnorm")
    state = wl.model[0].__dict__["_memfit_offload"]
    state.stream = object()  # stands for a CUDA stream, which neither pickles nor copies
    for loaded in (pickle.loads(pickle.dumps(wl.model)), copy.deepcopy(wl.model)):
        got = loaded[0].__dict__["_memfit_offload"]
        assert got is not state and got.min_bytes == 0 and got.stream is None


@pytest.mark.slow
def test_a_fresh_process_loads_and_trains_the_saved_model(tmp_path: Path) -> None:
    """As multiprocessing's spawn or a later run: the saved file alone, in a new interpreter."""
    wl, ref, plan = applied("segments-batchnorm")
    batch = make_batch(wl, 1)
    torch.save({"model": wl.model, "batch": batch}, tmp_path / "saved.pt")
    script = f"""
import torch
from memfit.apply import applied_plan, remove_plan
from memfit.workload import mean_loss
from memfit.models.registry import load_workload
saved = torch.load({str(tmp_path / "saved.pt")!r}, weights_only=False)
model, batch = saved["model"], saved["batch"]
loss_fn = load_workload({CONVNET!r}).loss_fn
assert applied_plan(model).segments, "plan lost"
torch.manual_seed(7)
mean_loss(loss_fn(model, batch)).backward()
torch.save({{n: p.grad for n, p in model.named_parameters()}} | {{"buffers": dict(model.named_buffers())}}, {str(tmp_path / "out.pt")!r})
remove_plan(model)
assert not any("forward" in m.__dict__ for m in model.modules())
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = torch.load(tmp_path / "out.pt")
    _, want, _ = step(ref, wl, batch)
    for n, g in want.items():
        assert_close(out[n], g, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    for n, b in ref.named_buffers():
        assert torch.equal(out["buffers"][n], b), n


def test_a_copy_taken_during_a_forward_leaves_the_call_behind() -> None:
    """An EMA copy taken in a hook while the chunked head holds this call's hidden states."""
    wl, ref, _ = applied("head-gpt2")
    copies: list[nn.Module] = []
    head = wl.model.get_output_embeddings()

    def take_copies(module: nn.Module, *_: Any) -> None:
        if module is head:
            assert wl.model.__dict__["_memfit_head"].hidden is not None  # the call's hidden states
            copies.extend([copy.deepcopy(wl.model), pickle.loads(pickle.dumps(wl.model))])

    # a global hook: not part of the model, so not copied with it
    handle = nn.modules.module.register_module_forward_hook(take_copies)
    batch = make_batch(wl, 1)
    try:
        step(wl.model, wl, batch)
    finally:
        handle.remove()
    assert len(copies) == 2
    for twin in copies:
        state = twin.__dict__["_memfit_head"]
        assert state.hidden is None and not state.armed and state.head is twin.get_output_embeddings()
        assert_trains_as(step(twin, wl, batch), step(ref, wl, batch), exact=False)
