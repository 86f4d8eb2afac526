"""Selective (op-level) policies per rank: the ``selective:torchtitan`` preset against torchtitan's
policy as it is written, estimated selective options against a fake step of the same plan, and
``--world-size N --parallel ddp|fsdp2`` with a selective policy in ``estimate``, ``plan`` and ``fit``;
the communication model's settable link rate."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from memfit import StepSpec
from memfit.cli.main import main
from memfit.estimation import estimate
from memfit.estimation.parallel import estimate_rank
from memfit.estimation.stats import estimate_stats, load_fake_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.parallel import Parallel, ParallelKind
from memfit.plan.policies import Selective, policy_plan
from memfit.plan.savepolicy import parse_save_policy

SPEC = "hf:llama?num_hidden_layers=2"


def _torchtitan_decisions(ops: list[str]) -> list[bool]:
    """torchtitan's ``_custom_policy`` (torchtitan/distributed/activation_checkpoint.py, commit
    cfb93265153094f99736547f26b5346410181102) as written: count mm calls, then save an op in the
    save list unless it is an mm whose count is even."""
    save_list = {
        "aten.mm.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten.max.default",
    }
    meta: dict[str, int] = defaultdict(int)
    out = []
    for op in ops:
        if op == "aten.mm.default":
            meta["forward_mm_count"] += 1
        out.append(op in save_list and not (op == "aten.mm.default" and meta["forward_mm_count"] % 2 == 0))
    return out


def test_torchtitan_preset_decides_as_torchtitan_does() -> None:
    # a Llama block's forward: 7 mm (q, k, v, o, gate, up, down), attention, elementwise ops
    ops = ["aten.mm.default"] * 3 + ["aten._scaled_dot_product_flash_attention.default", "aten.mm.default"]
    ops += ["aten.add.Tensor", "aten.mm.default", "aten.silu.default", "aten.mm.default", "aten.mul.Tensor"]
    ops += ["aten.mm.default", "aten.max.default", "aten.addmm.default"]
    want = _torchtitan_decisions(ops)
    policy = parse_save_policy("torchtitan")
    counts: dict[str, int] = defaultdict(int)
    got = []
    for op in ops:
        got.append(policy.saves(op, counts[op]))
        counts[op] += 1
    assert got == want
    # and the policy function torch's selective checkpointing calls agrees
    fn = policy.policy_fn()
    from torch.utils.checkpoint import CheckpointPolicy

    resolved = [getattr(getattr(torch.ops.aten, o.split(".")[1]), o.split(".")[2]) for o in ops]
    assert [fn(None, op) == CheckpointPolicy.MUST_SAVE for op in resolved] == want


@pytest.mark.slow
def test_estimated_selective_option_predicts_the_fake_step_of_its_plan() -> None:
    # the selective option's costs come from a fake step with every block selective; the cost
    # model's prediction of that plan must equal a fake step of the plan run on its own
    wl = load_fake_workload(SPEC)
    st = estimate_stats(wl, device="h100-sxm", options=("keep", "recompute", "selective:torchtitan"), activations=False,
                        step=StepSpec(batch_size=2))  # fmt: skip
    opt = st.blocks[0].options["selective:torchtitan"]
    keep, rec = st.blocks[0].options["keep"], st.blocks[0].options["recompute"]
    assert rec.retained_bytes < opt.retained_bytes < keep.retained_bytes
    assert opt.policy == "torchtitan" and 0 < opt.rerun_s < rec.bwd_s - keep.bwd_s + 1e-12
    plan = policy_plan(wl.model, Selective(preset="torchtitan"))
    pred = predict(ChainCosts.from_stats(st), plan)
    direct = estimate(wl, plan=plan, device="h100-sxm", step=StepSpec(batch_size=2))
    assert pred.peak_bytes == direct.peak_bytes
    flops = st.calibration.estimated.flops_by_option
    assert flops["keep"] < flops["selective:torchtitan"] < flops["recompute"]


@pytest.mark.slow
def test_selective_policy_per_rank_between_keep_and_recompute() -> None:
    par = Parallel(kind=ParallelKind.FSDP2, world_size=4)
    peaks = {p: estimate_rank(SPEC, parallel=par, device="h100-sxm", policy=p, batch_size=2)[2].peak_bytes
             for p in ("none", "all", "selective:torchtitan")}  # fmt: skip
    assert peaks["all"] < peaks["selective:torchtitan"] < peaks["none"]


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_estimate_plan_fit_take_a_selective_policy_under_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", SPEC, "--policy", "selective:torchtitan", "--world-size", "2"]
    est = _cli_json(capsys, "estimate", *common, "--parallel", "fsdp2", "--device", "h100", "--batch-size", "2")
    rank = est["rank"]
    assert {b["option"] for b in est["blocks"]} == {"selective"}
    # reserved (what runs out on CUDA) is above allocated, allocated above the live tensors
    assert rank["predicted_reserved_bytes"] >= rank["predicted_allocated_bytes"] > est["predicted_peak_bytes"]
    assert rank["allocator"]["method"] == "rank"
    plan = _cli_json(
        capsys, "plan", *common, "--parallel", "ddp", "--estimate", "--target", "h100", "--batch-size", "2"
    )
    assert {b["option"] for b in plan["blocks"]} == {"selective"}
    assert plan["rank"]["predicted_reserved_bytes"] >= plan["rank"]["predicted_allocated_bytes"]
    fit = _cli_json(capsys, "fit", *common, "--parallel", "ddp", "--estimate", "--target", "h100",
                    "--budget", "10GiB", "--global-batch", "4")  # fmt: skip
    assert {b["option"] for b in fit["plan"]["blocks"]} == {"selective"}
    assert fit["rank"]["predicted_reserved_bytes"] >= fit["rank"]["predicted_allocated_bytes"]


def test_link_rate_is_settable_and_the_default_is_named_in_the_links() -> None:
    from argparse import Namespace

    from memfit.cli.parallel import network_of
    from memfit.plan.comm import Collective, collective_seconds

    default = network_of(Namespace(gpus_per_node=8), "h100-sxm")
    assert default.intra.bandwidth_bytes_per_s == 450e9 and "datasheet" in default.intra.source
    assert "400 Gb/s NDR" in default.inter.source
    set_ = network_of(Namespace(gpus_per_node=8, link_gbps=400), "h100-sxm")
    assert set_.intra.bandwidth_bytes_per_s == set_.inter.bandwidth_bytes_per_s == 50e9
    assert "--link-gbps" in set_.intra.source
    # a 1 GiB all-gather over 8 ranks: 9x the bandwidth, within the latency
    t_default = collective_seconds(Collective.ALL_GATHER, 2**30, 8, default)
    t_set = collective_seconds(Collective.ALL_GATHER, 2**30, 8, set_)
    assert 8.5 < t_set / t_default <= 9


@pytest.mark.slow
def test_link_rate_is_settable_and_the_default_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    common = [
        "estimate",
        "--model",
        SPEC,
        "--world-size",
        "2",
        "--parallel",
        "ddp",
        "--device",
        "h100",
        "--batch-size",
        "2",
    ]
    default = _cli_json(capsys, *common)["communication"]
    assert "datasheet" in default["link_source"] and default["link_bytes_per_s"] == 450e9
    slow = _cli_json(capsys, *common, "--link-gbps", "400")["communication"]
    assert slow["link_bytes_per_s"] == 50e9 and "--link-gbps" in slow["link_source"]
    assert slow["comm_s"] > default["comm_s"] * 5
