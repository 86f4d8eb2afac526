"""memfit.capture.ops.capture_ops against references it does not compute: the op calls and their
FLOPs against the torch profiler's events over the same block's forward, the saved storages against
saved-tensor hooks on the unmodified model and against counts by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import SAVED_WIDTH, mlp_chain_workload, saved_tensor_counts
from torch.profiler import ProfilerActivity, profile

from memfit.capture.ops import capture_ops

pytestmark = pytest.mark.usefixtures("one_thread")

ACTS = ("relu", "gelu", "tanh")
B, D = 64, 16
F32 = 4  # bytes


@pytest.fixture(scope="module")
def captured():
    wl = mlp_chain_workload(ACTS, d=D)
    batch = wl.make_batch(B)
    return wl, batch, capture_ops(wl, batch=batch, repeats=1)


def block_inputs(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    """Each block's input in one plain forward (detached copies)."""
    inputs: list[torch.Tensor] = []
    handles = [
        blk.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().clone())) for blk in model.blocks
    ]
    try:
        with torch.no_grad():
            model(batch[0])
    finally:
        for h in handles:
            h.remove()
    return inputs


def profiler_ops(block: torch.nn.Module, x: torch.Tensor) -> list[tuple[str, int]]:
    """(``aten::name``, FLOPs) of every op event of one forward of ``block``, in start order."""
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        block(x.requires_grad_())
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return [(e.name, int(e.flops or 0)) for e in events if e.name.startswith("aten::")]


def profiler_name(op: str) -> str:
    """``aten.addmm.default`` -> ``aten::addmm``."""
    ns, name, _overload = op.split(".")
    return f"{ns}::{name}"


def test_calls_and_flops_are_the_profilers(captured) -> None:
    """Per block: the calls memfit records are, in order, the profiler's events of those ops (the
    profiler also shows the composite ops above them, aten::linear, and the kernels' own calls
    below them, which memfit leaves out); each matmul's FLOPs are the profiler's and 2 B d 4d."""
    wl, batch, ops = captured
    model = copy.deepcopy(wl.model)
    for blk_ops, blk, x in zip(ops.blocks, model.blocks, block_inputs(model, batch), strict=True):
        names = [profiler_name(c.op) for c in blk_ops.calls]
        events = [(n, f) for n, f in profiler_ops(blk, x) if n in set(names)]
        assert [n for n, _ in events] == names, blk_ops.name
        for call, (_, flops) in zip(blk_ops.calls, events, strict=True):
            if call.category == "matmul":
                assert call.flops == flops == 2 * B * D * 4 * D
    assert [[c.op for c in b.calls if c.category != "view"] for b in ops.blocks] == [
        ["aten.addmm.default", f"aten.{act}.default", "aten.addmm.default", "aten.add.Tensor"] for act in ACTS
    ]


def test_saved_storages_are_those_hooks_and_hand_counts_find(captured) -> None:
    """The storages autograd saves in each block, by saved-tensor hooks on the unmodified model and
    by hand (SAVED_WIDTH), and which op made each: the block input; ReLU's and Tanh's output, or
    GELU's input (fc1's output) and its output."""
    wl, batch, ops = captured
    model = copy.deepcopy(wl.model)
    hooks = saved_tensor_counts(model, list(model.blocks), batch, wl.loss_fn)
    assert [b.saved_bytes for b in ops.blocks] == [s for s, _ in hooks] == [SAVED_WIDTH[a] * B * D * F32 for a in ACTS]
    assert [[s.op for s in b.saved] for b in ops.blocks] == [
        ["input", "aten.relu.default"],
        ["input", "aten.addmm.default", "aten.gelu.default"],
        ["input", "aten.tanh.default"],
    ]
    for b in ops.blocks:
        for s in b.saved:  # each saved storage points at the call that made it, of the same size
            if s.call is not None:
                assert b.calls[s.call].op == s.op and b.calls[s.call].out_bytes == s.bytes
        assert sum(c.saved_bytes for c in b.calls) + sum(s.bytes for s in b.saved if s.op == "input") == b.saved_bytes


def test_out_bytes_are_the_outputs_sizes(captured) -> None:
    """Views create no storage; every other call's new storage is its output's size."""
    _, _, ops = captured
    for b in ops.blocks:
        for c in b.calls:
            if c.category == "view":
                assert c.out_bytes == 0
            else:
                numel = sum(torch.Size(s).numel() for s in c.shapes)
                assert c.out_bytes == numel * F32 and c.dtype == "float32"
    assert [c.out_bytes for c in ops.blocks[0].calls if c.category != "view"] == [
        B * 4 * D * F32,
        B * 4 * D * F32,
        B * D * F32,
        B * D * F32,
    ]
