"""Plans composed with torch.compile: per block (torchtitan's order) and whole-model.

Every check compares the compiled, planned model with the unmodified model run eagerly (float64,
the bar verify uses), and counts graph breaks with memfit.capture.compiled.GraphBreaks, itself
checked on a function with a known break. Most tests compile with ``aot_eager`` (the same dynamo
graphs and AOTAutograd partitioner as inductor, without code generation, so they run in seconds);
one runs inductor end to end through ``memfit verify --compile``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
import torch._dynamo
from test_segments import loop_workload
from test_segments import segmented as loop_segmented
from test_segments import train_step as loop_train_step
from tiny_models import TinyTokenLM, token_batch, token_loss, token_workload
from torch import nn

import memfit.apply.segments
import memfit.verification.plans as verify_plans
from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.apply.compiled import compile_applied
from memfit.capture.compiled import GraphBreaks
from memfit.capture.tracker import profiler_peak_bytes
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.models.registry import load_workload
from memfit.plan import Option, Segment, policy_plan
from memfit.verification.gradients import compare_gradients, model_grads
from memfit.verification.plans import verify
from memfit.workload import cast_batch

ROOT = Path(__file__).resolve().parents[1]
CONVNET = str(ROOT / "examples" / "convnet.py") + ":build"
TINY_GPT2 = "hf:gpt2?num_hidden_layers=2&hidden_size=32&n_inner=64&num_attention_heads=2&vocab_size=256"
MEMFIT_SRC = str(ROOT / "src" / "memfit")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # graph breaks are logged when a frame compiles: no cache hits from other tests
    yield
    torch._dynamo.reset()


class SeqLM(nn.Module):
    """Blocks in an nn.Sequential run by its own forward: the chain segments need."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 16)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16)) for _ in range(4)]
        )
        self.head = nn.Linear(16, 37)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(idx)))


def _with_action(plan, action: Option, policy: str | None = None):
    return dataclasses.replace(
        plan, blocks=tuple(dataclasses.replace(b, option=action, policy=policy) for b in plan.blocks)
    )


def _cases() -> dict[str, tuple[nn.Module, object]]:
    torch.manual_seed(0)
    tok = TinyTokenLM(n_layer=3, dropout=0.1)
    seq = SeqLM()
    return {
        "sqrt-sequential": (seq, policy_plan(seq, "sqrt")),
        "recompute": (tok, policy_plan(tok, "all")),
        "every:2": (tok, policy_plan(tok, "every:2")),
        "selective": (tok, _with_action(policy_plan(tok, "all"), Option.SELECTIVE, "save_matmuls")),
        "selective-calls": (tok, _with_action(policy_plan(tok, "all"), Option.SELECTIVE, "save:aten.addmm.default@1")),
    }


def dropout_token_lm() -> tuple[nn.Module, object, object]:
    """A file workload for the CLI: the tiny token LM with dropout on."""
    torch.manual_seed(0)
    return TinyTokenLM(n_layer=3, dropout=0.1), lambda b: token_batch(b), token_loss


def test_graph_breaks_are_counted_where_they_happen() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        print("a side effect dynamo cannot trace")
        return x + 1

    log = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
    before = (log.level, log.propagate, list(log.handlers))
    with GraphBreaks() as gb:
        torch.compile(f, backend="eager")(torch.ones(2))
    assert gb.count == 1
    assert gb.reasons[0].startswith(__file__) and "print" in gb.reasons[0], gb.reasons
    assert (log.level, log.propagate, list(log.handlers)) == before  # the user's logging as it was


@pytest.mark.parametrize("mode", ["block", "model"])
@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.slow  # about 10 s on 2 cores: the fast tier keeps to about 4 minutes
def test_compiled_plan_has_eager_gradients_and_no_breaks(case: str, mode: str) -> None:
    model, plan = _cases()[case]
    model = model.double()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 37, (3, 12))
    torch.manual_seed(7)
    ref(x).pow(2).mean().backward()  # the unmodified model, eager

    apply_plan(model, plan)
    undo = compile_applied(model, mode, backend="aot_eager")
    with GraphBreaks() as gb:
        torch.manual_seed(7)
        model(x).pow(2).mean().backward()
    undo()
    remove_plan(model)
    assert gb.count == 0, gb.reasons
    res = compare_gradients(model_grads(model), model_grads(ref))
    assert res.ok(1e-10), (res.max_rel_err, res.worst_param)


# Segments on HF layers (memfit.apply.segments, NOTE [ Compiled segments ]): GPT-2 with its dropout.
HF_TINY = "hidden_size=32&intermediate_size=64&num_attention_heads=2&vocab_size=128"
SEG_MODELS = {
    "gpt2": "hf:gpt2?n_layer=6&n_embd=32&n_inner=64&n_head=2&vocab_size=128",
    "llama": f"hf:llama?num_hidden_layers=6&{HF_TINY}&num_key_value_heads=1",
}


def _segmented(plan, segments, recompute=()):
    blocks = tuple(
        dataclasses.replace(b, option=Option.RECOMPUTE if i in recompute else Option.KEEP)
        for i, b in enumerate(plan.blocks)
    )
    return dataclasses.replace(
        plan, policy="custom", blocks=blocks, segments=tuple(Segment(start=a, stop=b) for a, b in segments)
    )


def _hf_step(wl, model: nn.Module, batch) -> None:
    torch.manual_seed(7)
    wl.loss_fn(model, batch)[0].backward()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["block", "model"])
@pytest.mark.parametrize(("name", "layout"), [("gpt2", "sqrt"), ("llama", "nested")])
def test_segment_plans_compile_with_eager_gradients_and_no_breaks(name: str, layout: str, mode: str) -> None:
    """sqrt(N) segments (GPT-2, dropout on), and nested segments with a block recomputed inside
    (Llama), compiled per block and whole: float64 gradients equal to the unmodified model run
    eagerly, and no graph break anywhere (memfit's code or the model's)."""
    wl = load_workload(SEG_MODELS[name], seq_len=16)
    model = wl.model.double()
    ref = copy.deepcopy(model)
    batch = cast_batch(wl.make_batch(2), dtype=torch.float64)
    _hf_step(wl, ref, batch)
    plan = policy_plan(model, "sqrt")
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 2), (2, 4)]
    if layout == "nested":
        plan = _segmented(plan, [(0, 6), (0, 3), (3, 6)], recompute=(1,))
    apply_plan(model, plan)
    undo = compile_applied(model, mode, backend="aot_eager")
    with GraphBreaks() as gb:
        _hf_step(wl, model, batch)
    undo()
    remove_plan(model)
    assert gb.count == 0, gb.reasons
    res = compare_gradients(model_grads(model), model_grads(ref))
    assert res.ok(1e-10), (res.max_rel_err, res.worst_param)


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_segments_in_a_model_that_breaks_the_graph_compile_whole() -> None:
    """A model whose layers draw from Python's and NumPy's generators and count their calls (graph
    breaks, a recompile per call until dynamo's limit): dynamo runs parts of the loop eagerly inside
    the compiled call, where memfit runs the segment's blocks uncompiled, forward and recompute
    alike. Gradients as the unmodified model's (float64). (Its BatchNorm buffers are not compared:
    where dynamo falls back from a checkpoint it cannot trace, torch's eager checkpoint updates them
    twice, for policy `all` too.)"""
    wl = loop_workload(n=12)
    model = wl.model.double()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    batch = {k: v.double() for k, v in wl.make_batch(4).items()}
    apply_plan(model, loop_segmented(model, [(a, a + 3) for a in range(0, 12, 3)]))
    undo = compile_applied(model, "model", backend="aot_eager")
    grads, _ = loop_train_step(model, batch)
    undo()
    remove_plan(model)
    grads_ref, _ = loop_train_step(ref, batch)
    res = compare_gradients(grads, grads_ref)
    assert res.ok(1e-10), (res.max_rel_err, res.worst_param)


def _fwd_saved_bytes(wl, plan, batch) -> tuple[int, int]:
    """Bytes the compiled forward graph hands to the backward (AOTAutograd's default partition:
    what the backward needs outside the recompute regions, and the regions' inputs), and how many
    tensors of a data-dependent size it hands (the loss's, the same for every plan)."""
    from functorch.compile import default_partition, make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    saved = []

    def partition(joint, inputs, **kw):
        fw, bw = default_partition(joint, inputs, **kw)
        outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        vals = [o.meta.get("val") for o in outputs if hasattr(o, "meta")]
        sizes = [v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)]
        saved.append((sum(n for n in sizes if isinstance(n, int)), sum(not isinstance(n, int) for n in sizes)))
        return fw, bw

    def keep(g, _):
        return make_boxed_func(g)

    torch._dynamo.reset()
    apply_plan(wl.model, plan)
    undo = compile_applied(
        wl.model, "model", backend=aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition)
    )
    _hf_step(wl, wl.model, batch)
    undo()
    remove_plan(wl.model)
    assert len(saved) == 1  # one graph: nothing fell back to eager
    return saved[0]


@pytest.mark.slow
def test_compiled_model_keeps_only_each_segments_input() -> None:
    """Whole-model compile: a segment is one recompute region for the partitioner. Against the same
    blocks recomputed one by one, the forward graph saves exactly the inputs of the blocks inside
    the segment less (block 1, of segment 0..1 of 4 layers: (B, T, d) float64)."""
    wl = load_workload(SEG_MODELS["gpt2"].replace("n_layer=6", "n_layer=4"), seq_len=16)
    wl.model.double()  # and memfit's float64 loss: transformers' loss logs a warning, a graph break
    batch = cast_batch(wl.make_batch(2), dtype=torch.float64)
    sqrt = policy_plan(wl.model, "sqrt")
    assert [(s.start, s.stop) for s in sqrt.segments] == [(0, 2)]
    one_by_one = _segmented(sqrt, [], recompute=(0, 1))
    block_input_bytes = 2 * 16 * 32 * 8
    (one_by_one_bytes, one_by_one_unsized), (sqrt_bytes, sqrt_unsized) = (
        _fwd_saved_bytes(wl, p, batch) for p in (one_by_one, sqrt)
    )
    assert one_by_one_bytes - sqrt_bytes == block_input_bytes and one_by_one_unsized == sqrt_unsized, (
        one_by_one_bytes,
        sqrt_bytes,
    )


@pytest.mark.slow
def test_compiled_model_holds_in_backward_what_eager_nesting_holds() -> None:
    """Compiled whole, nesting is flattened to one level of recompute by what the backward holds: a
    segment whose layers the plan also recomputes on their own peaks as `all` compiled (each layer
    its own region), while the same segment with its layers kept peaks far higher (its 4 layers'
    activations at once, as eager). Peaks of a compiled step from the profiler's allocator events."""
    wl = load_workload(
        SEG_MODELS["gpt2"].replace("n_layer=6&n_embd=32&n_inner=64", "n_layer=4&n_embd=64&n_inner=128"), seq_len=16
    )
    batch = wl.make_batch(32)
    every = policy_plan(wl.model, "all")
    plans = {
        "all": every,
        "segment of recomputed": _segmented(every, [(0, 4)], recompute=(0, 1, 2, 3)),
        "segment": _segmented(every, [(0, 4)]),
    }
    peaks = {}
    for name, plan in plans.items():
        torch._dynamo.reset()
        apply_plan(wl.model, plan)
        undo = compile_applied(wl.model, "model", backend="aot_eager")
        _hf_step(wl, wl.model, batch)  # compiles
        wl.model.zero_grad(set_to_none=True)
        peaks[name] = profiler_peak_bytes(lambda: _hf_step(wl, wl.model, batch))
        undo()
        remove_plan(wl.model)
        wl.model.zero_grad(set_to_none=True)
    assert peaks["segment of recomputed"] <= 1.02 * peaks["all"] and peaks["segment"] > 1.5 * peaks["all"], peaks


def _note_output(outs: dict, i: int, _module, _args, out) -> None:
    outs[i] = weakref.ref(out if isinstance(out, torch.Tensor) else out[0])


@pytest.mark.slow
def test_compiled_blocks_run_inside_eager_segments() -> None:
    """Per-block compile: each block of a segment runs its compiled forward, once in the forward and
    once more when its segment is recomputed, and the outputs of blocks inside a segment are gone
    after the forward (nothing saved them), while recomputing the same blocks one by one keeps them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    calls = []

    def counting(g, _):
        f = make_boxed_func(g)

        def run(args):
            calls.append(1)
            return f(args)

        run._boxed_call = True
        return run

    backend = aot_autograd(fw_compiler=counting, bw_compiler=lambda g, _: make_boxed_func(g))
    wl = load_workload(SEG_MODELS["gpt2"], seq_len=16)
    model, batch = wl.model, wl.make_batch(2)
    sqrt = policy_plan(model, "sqrt")  # segments 0..1 and 2..3, blocks 4 and 5 kept
    alive = {}
    for plan in (sqrt, _segmented(sqrt, [], recompute=(0, 1, 2, 3))):
        torch._dynamo.reset()
        calls.clear()
        outs: dict[int, object] = {}
        hooks = [
            b.register_forward_hook(functools.partial(_note_output, outs, i))
            for i, b in enumerate(model.transformer.h[:4])
        ]
        apply_plan(model, plan)
        undo = compile_applied(model, "block", backend=backend)
        torch.manual_seed(7)
        loss = wl.loss_fn(model, batch)[0]
        forward_calls = len(calls)
        gc.collect()
        alive[plan.policy] = [i for i, r in sorted(outs.items()) if r() is not None]
        loss.backward()
        undo()
        remove_plan(model)
        for h in hooks:
            h.remove()
        if plan is sqrt:
            assert forward_calls == 6 and len(calls) == 6 + 4, calls  # blocks 0..3 once more in backward
    assert alive == {"sqrt": [1, 3], "custom": [0, 1, 2, 3]}, alive


def test_compiled_recompute_saves_what_eager_recompute_saves() -> None:
    """The checkpoint is honoured inside the compiled graph, not dropped: the bytes the forward
    graph hands to the backward (outputs and saved activations, as AOTAutograd's partitioner
    splits them) shrink by at least the hidden activation each block keeps without checkpointing
    (tanh's output, (B, T, 2d) floats: the partitioner recomputes the rest already)."""
    saved: dict[str, int] = {}

    def count_saved(policy: str):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def partition(joint, inputs, **kw):
            fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
            outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
            vals = [o.meta.get("val") for o in outputs if hasattr(o, "meta")]
            saved[policy] = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
            return fw, bw

        keep = make_boxed_func
        return aot_autograd(fw_compiler=lambda g, _: keep(g), bw_compiler=lambda g, _: keep(g), partition_fn=partition)

    for policy in ("none", "all"):
        torch.manual_seed(0)
        model = TinyTokenLM(n_layer=4)
        apply_plan(model, policy_plan(model, policy))
        torch._dynamo.reset()
        compile_applied(model, "model", backend=count_saved(policy))
        model(torch.randint(0, 37, (2, 12))).sum().backward()
    assert saved["none"] - saved["all"] >= 4 * (2 * 12 * 32) * 4, saved  # 4 blocks, B=2, T=12, 2d=32, float32


@pytest.mark.slow
def test_batchnorm_buffers_are_updated_once_when_compiled() -> None:
    """Compiled, a recomputed block's BatchNorm runs once in the forward graph: buffers (and
    num_batches_tracked) equal the unmodified model's, as eager memfit keeps them."""
    wl = load_workload(CONVNET)
    res = verify(
        wl,
        policy_plan(wl.model, "all"),
        step=StepSpec(dtype=torch.float64, repeats=0, batch_size=4),
        compile="model",
        compile_backend="aot_eager",
    )
    assert res.ok and res.buffers_equal and res.max_grad_rel_err <= 1e-10, res
    assert res.compile == "model" and res.memfit_graph_breaks == 0, res.graph_break_reasons


@pytest.mark.slow
def test_hf_head_fused_activations_and_cache_compose() -> None:
    """A transformers model with the chunked head, fused activations and recomputed layers (whose
    cache memfit drops): no graph break in memfit's code, per block or whole."""
    wl = load_workload(TINY_GPT2, seq_len=16)
    plan = dataclasses.replace(policy_plan(wl.model, "all"), head="chunked", activations="fused")
    for mode in ("block", "model"):
        torch._dynamo.reset()
        res = verify(
            wl,
            plan,
            step=StepSpec(dtype=torch.float64, repeats=0, batch_size=2),
            compile=mode,
            compile_backend="aot_eager",
        )
        assert res.ok, (mode, res.reason)
        assert res.memfit_graph_breaks == 0, (mode, res.graph_break_reasons)


def test_offload_runs_compiled_with_a_break_in_torch() -> None:
    """Offload's saved-tensor hooks are not traced by dynamo (a break in torch, not memfit's code):
    the block falls back to eager around them and gradients stay equal."""
    torch.manual_seed(0)
    model = TinyTokenLM(n_layer=2).double()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 37, (2, 12))
    ref(x).sum().backward()
    apply_plan(model, _with_action(policy_plan(model, "all"), Option.OFFLOAD))
    compile_applied(model, "block", backend="aot_eager")
    with GraphBreaks() as gb:
        model(x).sum().backward()
    assert compare_gradients(model_grads(model), model_grads(ref)).ok(1e-10)
    assert not [r for r in gb.reasons if r.startswith(MEMFIT_SRC)], gb.reasons


def test_verify_fails_when_the_compiler_changes_gradients() -> None:
    """A backend that changes the forward (as a miscompile would) is caught: ok False, the reason
    names the gradients."""

    def off_by_a_thousandth(gm: torch.fx.GraphModule, _inputs):
        def run(*args):
            out = gm(*args)
            return type(out)(o * 1.001 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)

        return run

    wl = token_workload()
    res = verify(
        wl,
        policy_plan(wl.model, "all"),
        step=StepSpec(dtype=torch.float64, repeats=0),
        compile="model",
        compile_backend=off_by_a_thousandth,
    )
    assert not res.ok and "gradients differ" in (res.reason or ""), res


def test_compile_mode_is_checked() -> None:
    with pytest.raises(SpecError, match="compile mode"):
        compile_applied(nn.Linear(2, 2), "layers")


@pytest.mark.slow
def test_verify_compile_cli_inductor_with_dropout(capsys) -> None:
    """`memfit verify --compile` end to end with inductor, float64, dropout on: same gradients as
    eager (inductor draws dropout from torch's generator under fallback_random), zero graph breaks,
    and peaks measured with the profiler that agree with the tracker's on the eager baseline."""
    spec = f"{__file__}:dropout_token_lm"
    code = main(
        ["verify", "--model", spec, "--policy", "all", "--dtype", "float64", "--compile", "--repeats", "0", "--json"]
    )
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["ok"], res
    assert res["compile"] == "block" and res["graph_breaks"] == 0 and res["compile_s"] > 0
    assert res["peak_method"] == "profiler"
    code = main(["verify", "--model", spec, "--policy", "all", "--dtype", "float64", "--repeats", "0", "--json"])
    eager = json.loads(capsys.readouterr().out)
    assert eager["peak_method"] == "tracker" and eager["compile"] is None
    # Two methods, one eager baseline: the profiler's whole-step peak within 2 % of the tracker's.
    assert abs(res["baseline_peak_bytes"] - eager["baseline_peak_bytes"]) <= 0.02 * eager["baseline_peak_bytes"], (
        res,
        eager,
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["block", "model"])
def test_verify_compile_cli_inductor_with_segments(mode: str, capsys) -> None:
    """`memfit verify --policy sqrt --compile` on GPT-2 layers with inductor (the case that raised
    torch's CheckpointError before NOTE [ Compiled segments ]): float64 gradients as the unmodified
    model's with dropout on, no graph break."""
    spec = SEG_MODELS["gpt2"].replace("n_layer=6", "n_layer=4")
    args = ["verify", "--model", spec, "--seq-len", "16", "--batch-size", "2", "--policy", "sqrt", "--dtype", "float64"]
    code = main([*args, "--compile", mode, "--repeats", "0", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["ok"], res
    assert res["compile"] == mode and res["graph_breaks"] == 0 and res["memfit_graph_breaks"] == 0, res


def test_verify_compile_refuses_accumulation(capsys) -> None:
    spec = f"{__file__}:dropout_token_lm"
    code = main(["verify", "--model", spec, "--compile", "--global-batch", "4", "--micro-batch", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and "--global-batch" in out["error"], out


def test_memfit_graph_breaks_are_those_anywhere_in_the_package() -> None:
    """verify's count of graph breaks in memfit's own code covers the plan's wrappers (memfit.apply),
    not only the verification package."""
    assert memfit.apply.segments.__file__.startswith(verify_plans._MEMFIT_SOURCE)
    assert not torch.__file__.startswith(verify_plans._MEMFIT_SOURCE)
