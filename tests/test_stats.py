"""Stats and its typed ``calibration`` (:class:`memfit.capture.stats.Calibration`) against the JSON
the open dict gave before it was typed: the same keys in the same order with the same values, and
``from_dict`` of that JSON gives back what the profile or the estimate made.

References: the calibration dicts as memfit wrote them before (the option messages, the MILP
fractions, the estimate's FLOPs from :func:`memfit.estimation.estimate` without the per-block hooks,
the rank's memory from :func:`memfit.plan.parallel.rank_memory`), not the code under test.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from memfit import StepSpec
from memfit.capture.stats import Calibration, EstimatedInfo, FusedActivations, HeadOptionStats, ParallelInfo, Stats
from memfit.errors import SpecError
from memfit.estimation import estimate, estimate_stats, get_device, load_fake_workload
from memfit.estimation.devices import DEFAULT_MFU, resolve_mfu
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import DEFAULT_OPTIONS
from memfit.plan.parallel import Parallel, ParallelKind, param_table, rank_memory, rank_stats
from memfit.plan.policies import policy_plan
from memfit.profiling.blocks import profile

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = "demo?n_layer=2&n_embd=32&n_head=2"
GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256"
LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=256"
)
CPU_OFFLOAD = "the device is the CPU: offloading to host memory saves nothing"


def _json(stats: Stats) -> dict:
    """What ``memfit profile --json`` prints for the stats, read back."""
    return json.loads(json.dumps(stats.to_dict()))


def _round_trip(stats: Stats) -> None:
    d = _json(stats)
    back = Stats.from_dict(d)
    assert back.calibration == stats.calibration
    assert json.dumps(back.to_dict()) == json.dumps(stats.to_dict())


def test_profile_calibration_json_is_the_old_dict_and_round_trips() -> None:
    """Every option on the CPU: offload and the chunked head (not a transformers model) are dropped;
    the selective options ran their MILP at the three fractions."""
    stats = profile(
        load_workload(DEMO, seq_len=16),
        step=StepSpec(batch_size=2, repeats=1),
        options=DEFAULT_OPTIONS,
        tiling=False,  # tiled and host-held options add their own keys (tests/test_tiling.py)
        host_inputs=False,
    )
    old = {
        "dropped_options": {
            "offload": CPU_OFFLOAD,
            "head:chunked": "GPT is not a transformers causal language model (*ForCausalLM / *LMHeadModel)",
        },
        "milp_fractions": [0.25, 0.5, 0.75],
    }
    assert json.dumps(_json(stats)["calibration"]) == json.dumps(old)
    assert stats.calibration.estimated is None and stats.calibration.parallel is None
    _round_trip(stats)


def test_fused_activations_and_selective_drops_keep_their_json() -> None:
    stats = profile(
        load_workload(GPT2, seq_len=32),
        step=StepSpec(batch_size=2, repeats=1),
        options=DEFAULT_OPTIONS,
        heads=False,
        tiling=False,
        host_inputs=False,
    )
    old = {
        "dropped_options": {
            "selective:save_attention": "it caches nothing in this model (the same as recompute, with overhead)",
            "selective:save_matmuls_and_attention": "it caches the same op outputs as selective:save_matmuls",
            "offload": CPU_OFFLOAD,
        },
        "milp_fractions": [0.25, 0.5, 0.75],
        "fused_activations": {"modules": 2, "classes": ["NewGELUActivation"]},
    }
    assert json.dumps(_json(stats)["calibration"]) == json.dumps(old)
    assert stats.calibration.fused_activations == FusedActivations(modules=2, classes=("NewGELUActivation",))
    _round_trip(stats)


@pytest.mark.slow  # about 8 s on 2 cores: the fast tier keeps to about 4 minutes
def test_estimate_and_rank_calibration_json_is_the_old_dict() -> None:
    """The estimate's calibration keeps its old keys, in their order, and adds the long-sequence
    options' (host link rates, tiling) after them; its ``mfu`` is the device class's published one."""
    wl = load_fake_workload(LLAMA, seq_len=32)
    est = estimate_stats(wl, device="h100-sxm", step=StepSpec(batch_size=2))
    got = _json(est)["calibration"]
    assert list(got) == ["estimated", "dropped_options", "offload_d2h_bytes_per_s", "offload_h2d_bytes_per_s", "tiling"]
    info = got["estimated"]
    assert list(info) == [
        "device",
        "mfu",
        "kernels",
        "optimizer_impl",
        "peak_flops_per_s",
        "optimizer_s",
        "flops_by_option",
        "time_model",
    ]
    flops = {
        m: estimate(wl, device="h100-sxm", policy=p, step=StepSpec(batch_size=2)).flops
        for m, p in (("keep", "none"), ("recompute", "all"))
    }
    dev = get_device("h100-sxm")
    peak, mfu = dev.peak_flops_per_s(torch.float32), resolve_mfu(dev, None)
    assert {m: info["flops_by_option"][m] for m in flops} == flops
    assert (info["device"], info["mfu"], info["kernels"], info["optimizer_impl"], info["peak_flops_per_s"]) == (
        "h100-sxm",
        mfu,
        "cuda",
        "foreach",
        peak,
    )
    assert mfu != DEFAULT_MFU  # the H100 class's published utilisation, not the fallback
    assert info["optimizer_s"] == pytest.approx(est.step_s - flops["keep"] / (peak * mfu), rel=1e-9)
    assert info["time_model"] == "roofline: FLOPs / (peak x mfu), optimizer bytes / bandwidth"
    # fake tensors have no values: the tiled modules are chosen by rule and shape, and it says so
    assert (
        list(got["dropped_options"]) == ["tiled:values"] and "memfit verify" in got["dropped_options"]["tiled:values"]
    )
    assert got["tiling"] == {"modules": 2, "classes": ["LlamaMLP"], "tile_counts": [4]}
    assert got["offload_d2h_bytes_per_s"] == got["offload_h2d_bytes_per_s"] == dev.host_bytes_per_s
    _round_trip(est)

    params = param_table(wl.model, [b.name for b in est.blocks])
    for kind in ParallelKind:
        par = Parallel(kind=kind, world_size=4)
        rs = rank_stats(est, params, par, rank=1)
        old = {
            **par.to_dict(),
            "rank": 1,
            "memory": rank_memory(est, params, par, 1).to_dict(),
            "single_process_peak_bytes": est.peak_bytes,
        }
        cal = _json(rs)["calibration"]
        assert cal["estimated"] == info and list(cal) == [
            "estimated", "dropped_options", "offload_d2h_bytes_per_s", "offload_h2d_bytes_per_s", "parallel", "tiling"
        ]  # fmt: skip
        # the old keys first, then what the accumulation window's prediction reads (checked
        # against measured ranks in tests/test_train_parallel.py)
        window_keys = ["unit_grad_bytes", "unit_grad_shard_bytes", "head_grad_bytes", "backward_end_bytes"]
        assert list(cal["parallel"]) == [*old, *window_keys]
        assert json.dumps({k: cal["parallel"][k] for k in old}) == json.dumps(old)
        assert len(cal["parallel"]["unit_grad_bytes"]) == len(est.blocks) + 1  # the blocks, then the root
        assert rs.calibration.parallel is not None and rs.calibration.parallel.world_size == 4
        _round_trip(rs)


def test_every_field_round_trips_and_unknown_keys_are_refused() -> None:
    cal = Calibration(
        estimated=EstimatedInfo(
            device="a100-80gb", mfu=0.5, kernels="cpu", optimizer_impl="foreach", peak_flops_per_s=1e14,
            optimizer_s=1e-3, flops_by_option={"keep": 10, "recompute": 13}, time_model="roofline",
        ),
        dropped_options={"head:chunked": "why"},
        milp_fractions=(0.25, 0.5),
        offload_d2h_bytes_per_s=2.5e10,
        offload_h2d_bytes_per_s=2.4e10,
        segments="3 blocks take a residual",
        fused_activations=FusedActivations(modules=3, classes=("GELU",)),
        parallel=ParallelInfo(layout={"kind": "ddp", "world_size": 2}, rank=0, memory={"rank": 0, "params_bytes": 8}, single_process_peak_bytes=64),
    )  # fmt: skip
    d = json.loads(json.dumps(cal.to_dict()))
    assert list(d) == [
        "estimated",
        "dropped_options",
        "milp_fractions",
        "offload_d2h_bytes_per_s",
        "offload_h2d_bytes_per_s",
        "segments",
        "fused_activations",
        "parallel",
    ]
    assert d["parallel"] == {
        "kind": "ddp", "world_size": 2, "rank": 0, "memory": {"rank": 0, "params_bytes": 8}, "single_process_peak_bytes": 64,
        "unit_grad_bytes": [], "unit_grad_shard_bytes": [], "head_grad_bytes": 0, "backward_end_bytes": None,
    }  # fmt: skip
    assert Calibration.from_dict(d) == cal
    assert Calibration().to_dict() == {} and Calibration.from_dict({}) == Calibration()
    # selective options considered, none dropped: the empty dict is still written, as before
    assert Calibration(milp_fractions=(0.5,)).to_dict() == {"dropped_options": {}, "milp_fractions": [0.5]}
    with pytest.raises(SpecError, match="'notes'"):
        Calibration.from_dict({"notes": "x"})


def test_merged_keeps_both_drops_and_takes_the_set_fields() -> None:
    base = Calibration(dropped_options={"offload": "a"}, milp_fractions=(0.5,))
    note = Calibration(
        dropped_options={"activations:fused": "b"}, fused_activations=FusedActivations(modules=1, classes=("GELU",))
    )
    got = base.merged(note)
    assert dict(got.dropped_options) == {"offload": "a", "activations:fused": "b"}
    assert got.milp_fractions == (0.5,) and got.fused_activations == note.fused_activations


def test_stats_without_the_head_per_option_load_and_give_every_plan_the_largest_head() -> None:
    """A Stats JSON written before the per-option head fields loads; every plan then gets one ``H``
    (the largest over the calibration steps), on the safe side."""
    wl = load_workload(LLAMA, seq_len=32)
    stats = profile(
        wl, step=StepSpec(batch_size=2, repeats=1), options=("keep", "recompute"), heads=False, tiling=False
    )
    d = _json(stats)
    keys = ("head_peak_bytes_by_option", "head_model_peak_bytes_by_option", "head_backward_peak_bytes_by_option")
    assert all(set(d[k]) == {"keep", "recompute"} for k in keys)
    assert d["head_peak_bytes"] == max(d["head_peak_bytes_by_option"].values())
    _round_trip(stats)
    old = Stats.from_dict({k: v for k, v in d.items() if k not in keys})
    assert all(getattr(old, k) == {} for k in keys)
    keep = policy_plan(wl.model, "none").with_(activations=stats.activations)
    old_costs, new_costs = ChainCosts.from_stats(old), ChainCosts.from_stats(stats)
    # One H for both, not knowing which step's it is: the largest, with the most the forwards drop
    # before it (this Llama's layers fill the KV cache), on the safe side.
    assert old_costs.head_peak_for({"keep"}) == old_costs.head_peak_for({"recompute"}) > stats.head_peak_bytes
    assert predict(old_costs, keep).peak_bytes >= predict(new_costs, keep).peak_bytes


def _old_key(k: str) -> str:
    if k == "options":
        return "modes"
    return k.removesuffix("_by_option") + "_by_mode" if k.endswith("_by_option") else k


def _with_old_keys(x: object) -> object:
    """JSON as memfit wrote it before a block's option was called an option: ``modes`` and ``*_by_mode``."""
    if isinstance(x, dict):
        return {_old_key(k): _with_old_keys(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_with_old_keys(v) for v in x]
    return x


@pytest.mark.slow  # about 6 s on 2 cores: the fast tier keeps to about 4 minutes
def test_stats_written_with_the_old_option_keys_load_the_same() -> None:
    """Stats files written before the rename (``modes`` per block, ``*_by_mode`` in the stats, its
    head options and its estimate) load to the same stats; new files write only the new keys."""
    est = estimate_stats(load_fake_workload(LLAMA, seq_len=32), device="h100-sxm", step=StepSpec(batch_size=2))
    head = HeadOptionStats(
        head_peak_bytes=est.head_peak_bytes,
        step_s=est.step_s,
        measured_peak_bytes=est.peak_bytes,
        measured_peak_bytes_by_option=dict(est.measured_peak_bytes_by_option),
        head_peak_bytes_by_option=dict(est.head_peak_bytes_by_option),
    )
    stats = dataclasses.replace(est, head_options={"chunked": head})
    new = _json(stats)
    old = _with_old_keys(new)
    text = json.dumps(old)
    assert '"modes"' in text and '"options"' not in text and "_by_option" not in text
    assert set(old["blocks"][0]["modes"]) == set(new["blocks"][0]["options"]) >= {"keep", "recompute"}
    assert old["calibration"]["estimated"]["flops_by_mode"] == new["calibration"]["estimated"]["flops_by_option"]
    assert set(old["head_options"]["chunked"]) >= {"measured_peak_bytes_by_mode", "head_peak_bytes_by_mode"}
    assert sum(k.endswith("_by_mode") for k in old) == 5
    back = Stats.from_dict(old)
    assert back == stats
    assert json.dumps(back.to_dict()) == json.dumps(new)
