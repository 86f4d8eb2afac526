"""memfit.plan.comm: collective seconds and their overlap with compute, against hand arithmetic.

The 2-unit model is tests/test_parallel_estimate's ``_Tiny`` (blocks Linear(5, 3), Linear(3, 3);
root: a frozen (7,) vector registered first, then the head Linear(3, 2)), profiled once, with its
seconds replaced by round numbers so every time below is worked out by hand in the comments.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from test_parallel_estimate import _tiny_workload

from memfit import StepSpec
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.estimation.devices import get_device, interconnect
from memfit.models.registry import load_workload
from memfit.plan.comm import (
    Collective,
    CommOp,
    Interconnect,
    Link,
    collective_seconds,
    simulate,
    step_comm_time,
)
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, ParallelKind, param_table, rank_stats
from memfit.plan.policies import policy_plan
from memfit.plan.types import BlockDecision, Option
from memfit.profiling.blocks import profile

US = 1e-6
# A link of 1 MB/s bus bandwidth and no latency: a collective of S bytes over 2 ranks takes S/2 us
# (all-gather, reduce-scatter: (N-1)/N = 1/2) or S us (all-reduce: 2(N-1)/N = 1).
SLOW = Interconnect(
    intra=Link(kind="test", bandwidth_bytes_per_s=1e6, efficiency=1.0, step_latency_s=0.0), base_latency_s=0.0
)


def test_collective_seconds_ring_formulas() -> None:
    h100 = interconnect(get_device("h100-sxm"))
    assert h100 is not None and h100.intra.bus_bytes_per_s == pytest.approx(360e9)  # 450 GB/s x 0.8
    s = 2**30
    # one node of 8: NCCL's base 8.4 us + 7 (14) NVLink steps of 3.4 us + S (N-1)/N (2(N-1)/N) / busbw
    assert collective_seconds(Collective.ALL_GATHER, s, 8, h100) == pytest.approx(
        8.4e-6 + 7 * 3.4e-6 + s * 7 / 8 / 360e9
    )
    assert collective_seconds(Collective.REDUCE_SCATTER, s, 8, h100) == pytest.approx(
        8.4e-6 + 7 * 3.4e-6 + s * 7 / 8 / 360e9
    )
    assert collective_seconds(Collective.ALL_REDUCE, s, 8, h100) == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + s * 14 / 8 / 360e9
    )
    # two nodes of 8: the ring crosses the 400 Gb/s network (50 GB/s x 0.8); 2 of the 30 steps are network steps (9.6 us)
    assert collective_seconds(Collective.ALL_REDUCE, s, 16, h100) == pytest.approx(
        8.4e-6 + 28 * 3.4e-6 + 2 * 9.6e-6 + s * 30 / 16 / 40e9
    )
    assert collective_seconds(Collective.ALL_REDUCE, s, 1, h100) == 0.0
    with pytest.raises(SpecError, match="no network link"):
        collective_seconds(Collective.ALL_GATHER, s, 16, interconnect(get_device("l4")))


def test_simulate_hides_a_collective_shorter_than_the_compute_it_overlaps() -> None:
    def op(seconds: float) -> CommOp:
        return CommOp(kind=Collective.ALL_GATHER, what="x", size_bytes=1, seconds=seconds, issued_at=0, needed_by=2)

    segs = [10.0, 10.0, 10.0]
    # Issued when segment 0 starts, needed by segment 2: hidden behind 20 s of compute.
    assert simulate(segs, [op(5.0)]) == 30.0
    assert simulate(segs, [op(20.0)]) == 30.0
    # Longer than the compute it overlaps: the excess (comm - compute) is exposed.
    assert simulate(segs, [op(50.0)]) - sum(segs) == pytest.approx(50.0 - 20.0)
    # Two collectives share the link in issue order (0-15, 15-30): segment 1, which needs the second,
    # starts at 30 instead of 10.
    two = [op(15.0), replace(op(15.0), needed_by=1)]
    assert simulate(segs, two) == 30.0 + 10.0 + 10.0
    with pytest.raises(SpecError, match="before it is issued"):
        simulate(segs, [replace(op(1.0), issued_at=2, needed_by=1)])


@pytest.fixture(scope="module")
def tiny():
    """The tiny model's Stats with round seconds: blocks 100 us forward, 200 us backward (recompute
    adds its forward: scale 1), the head 50 us forward and 50 us backward, the optimizer 300 us."""
    wl = _tiny_workload()
    stats = profile(wl, step=StepSpec(batch_size=4, repeats=1), options=BASE_OPTIONS, heads=False, activations=False)
    blocks = tuple(
        replace(b, fwd_s=100 * US, bwd_s=200 * US, options={"keep": replace(b.options["keep"], fwd_s=100 * US, bwd_s=200 * US),
                                                         "recompute": replace(b.options["recompute"], fwd_s=100 * US, bwd_s=300 * US)})
        for b in stats.blocks
    )  # fmt: skip
    stats = replace(
        stats,
        blocks=blocks,
        fwd_s=250 * US,
        bwd_s=450 * US,
        step_s=1000 * US,
        step_s_by_option={"keep": 1000 * US, "recompute": 1200 * US},
    )
    return wl, stats


def _rank(tiny, parallel: Parallel):
    wl, stats = tiny
    return rank_stats(stats, param_table(wl.model, [b.name for b in stats.blocks]), parallel, 0)


def test_fsdp2_two_units_hand_computed(tiny) -> None:
    rs = _rank(tiny, Parallel(kind=ParallelKind.FSDP2, world_size=2))
    mem = rs.calibration.parallel.memory
    # float32, 2 ranks, dim 0 padded to even rows. All-gathers: block 0 (4 x 5 + 4) floats = 96 B,
    # block 1 (4 x 3 + 4) = 64 B, root: head (2 x 3 + 2) + frozen vector 8 = 64 B. Reduce-scatters:
    # the trainable ones: 96, 64, and the head's 32 B.
    assert mem["unit_unsharded_bytes"] == [96, 64, 64] and mem["reduce_scatter_bytes"] == [96, 64, 32]
    plan = policy_plan(tiny[0].model, "none")
    ct = step_comm_time(rs, plan, SLOW)
    # Seconds (S/2 us): AG root 32, block 0 48, block 1 32 (forward and backward); RS block 1 32, block 0 48, root 16.
    # Forward: AG root 0-32, AG b0 32-80 (both issued at 0); AG b1 issued when block 0 can start (32): 80-112.
    #   block 0 80-180, block 1 180-280, head 280-330.
    # Backward: the head's backward 330-380 prefetches block 1 (AG 330-362); block 1's backward 380-580
    #   prefetches block 0 (AG 380-428); RS b1 580-612; block 0 780 -> RS b0 780-828; RS root 828-844;
    #   the optimizer waits for it: 844-1144.
    assert ct.compute_s == pytest.approx(1000 * US)
    assert ct.step_s == pytest.approx(1144 * US)
    assert ct.exposed_s == pytest.approx(144 * US)  # root + block 0 gathers before compute, the last reduce-scatters
    assert ct.comm_s == pytest.approx((32 + 48 + 32 + 32 + 48 + 32 + 48 + 16) * US)
    assert ct.seconds_by_kind == pytest.approx({"all_gather": 192 * US, "reduce_scatter": 96 * US})
    # Recomputing block 1 lengthens its backward by its forward (100 us): the same collectives, hidden the same way.
    rec = plan.with_(blocks=(plan.blocks[0], BlockDecision(name=plan.blocks[1].name, option=Option.RECOMPUTE)))
    ct_rec = step_comm_time(rs, rec, SLOW)
    assert ct_rec.compute_s == pytest.approx(1100 * US) and ct_rec.exposed_s == pytest.approx(144 * US)
    # Without reshard-after-forward: no backward gathers. RS b1 at 580 (580-612), RS b0 780-828, RS root 828-844.
    nr = step_comm_time(
        _rank(tiny, Parallel(kind=ParallelKind.FSDP2, world_size=2, reshard_after_forward=False)), plan, SLOW
    )
    assert nr.step_s == pytest.approx(1144 * US) and nr.seconds_by_kind["all_gather"] == pytest.approx(112 * US)
    # Accumulation of 2 micro-steps: the first gathers only (exposed 80: AG root 32 + block 0 48), the second as above.
    acc = step_comm_time(rs, plan, SLOW, accumulation_steps=2)
    assert acc.step_s == pytest.approx((1080 + 1144) * US) and acc.exposed_s == pytest.approx((80 + 144) * US)


def test_fsdp2_communication_bound_exposes_comm_minus_overlapped_compute(tiny) -> None:
    rs = _rank(tiny, Parallel(kind=ParallelKind.FSDP2, world_size=2))
    ten_times_slower = replace(SLOW, intra=replace(SLOW.intra, bandwidth_bytes_per_s=1e5))
    ct = step_comm_time(rs, policy_plan(tiny[0].model, "none"), ten_times_slower)
    # Collectives 10x longer (2880 us in all). The link is busy from 0 to 1120 and from 1270 (the head's
    # backward issues block 1's gather) to 3030 (the last reduce-scatter); idle only during block 1's
    # forward and the head's forward (150 us). Step = 2880 + 150 + the optimizer 300 = 3330 us, so the
    # exposed time is the communication minus the compute it overlapped (1000 - 150 - 300 = 550 us).
    assert ct.comm_s == pytest.approx(2880 * US)
    assert ct.step_s == pytest.approx(3330 * US)
    assert ct.exposed_s == pytest.approx(ct.comm_s - 550 * US)


def test_ddp_buckets_hand_computed(tiny) -> None:
    # Buckets in reverse registration order (the frozen vector has no gradient): head bias 8 B + weight
    # 24 B reach the 16 B first cap (32 B, complete after the head's backward); block 1's bias 12 + weight
    # 36 = 48 B (after block 1's backward); block 0's 12 + 60 = 72 B (after block 0's).
    rs = _rank(tiny, Parallel(kind=ParallelKind.DDP, world_size=2, first_bucket_bytes=16, bucket_cap_bytes=40))
    mem = rs.calibration.parallel.memory
    assert mem["buckets_bytes"] == [32, 48, 72] and mem["bucket_ready_after"] == [-1, 1, 0]
    ct = step_comm_time(rs, policy_plan(tiny[0].model, "none"), SLOW)
    # All-reduce seconds = S us. Forward 0-250, the head's backward 250-300 -> AR 300-332 (hidden behind
    # block 1's backward 300-500) -> AR 500-548 (behind block 0's 500-700) -> AR 700-772, the last bucket,
    # exposed: the optimizer runs 772-1072.
    assert ct.step_s == pytest.approx(1072 * US) and ct.exposed_s == pytest.approx(72 * US)
    assert ct.bytes_by_kind == {"all_reduce": 152} and ct.comm_s == pytest.approx(152 * US)
    # With accumulation the all-reduces run on the last micro-step only.
    assert step_comm_time(
        rs, policy_plan(tiny[0].model, "none"), SLOW, accumulation_steps=3
    ).exposed_s == pytest.approx(72 * US)


def test_one_process_stats_are_refused(tiny) -> None:
    with pytest.raises(SpecError, match="one process's"):
        step_comm_time(tiny[1], policy_plan(tiny[0].model, "none"), SLOW)
    assert math.isclose(Link(kind="nvlink", bandwidth_bytes_per_s=450e9).latency_s, 3.4e-6)


TINY = "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4&num_key_value_heads=4&vocab_size=512"


def _estimate(capsys, *extra: str) -> dict:
    argv = ["estimate", "--model", TINY, "--batch-size", "2", "--seq-len", "64", "--dtype", "bfloat16", "--policy", "all",
            "--device", "h100-sxm", "--world-size", "8", "--parallel", "fsdp2", *extra, "--json"]  # fmt: skip
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_cli_prints_communication_from_the_model_sizes(capsys) -> None:
    torch.set_num_threads(1)
    model = load_workload(TINY).model
    numel = {n: p.numel() for n, p in model.named_parameters()}
    blocks = sum(v for n, v in numel.items() if ".layers." in n)
    root = sum(numel.values()) - blocks
    d = _estimate(capsys)
    c = d["communication"]
    # bf16 (2 B), every dim 0 divisible by 8 (no padding): each block gathered in forward and again in
    # backward, the root once; every parameter reduce-scattered once.
    assert c["bytes_by_kind"] == {"all_gather": 2 * (2 * blocks + root), "reduce_scatter": 2 * (blocks + root)}
    assert c["link"] == "nvlink" and c["bus_bytes_per_s"] == pytest.approx(360e9)
    assert 0 <= c["exposed_s"] <= c["comm_s"] and c["step_s"] == pytest.approx(c["compute_s"] + c["exposed_s"])
    assert c["predicted_samples_per_s"] == pytest.approx(d["predicted_samples_per_s"] * c["compute_s"] / c["step_s"])
    # 8 collectives (5 all-gathers, 3 reduce-scatters), each 7 ring steps moving 7/8 of its size: on one node
    # NCCL's 8.4 us + 7 NVLink steps of 3.4 us at 360 GB/s; on two nodes of 4 (--gpus-per-node 4) one of the
    # steps crosses the network (9.6 us) and the ring runs at the network's 40 GB/s.
    moved = (c["bytes_by_kind"]["all_gather"] + c["bytes_by_kind"]["reduce_scatter"]) * 7 / 8
    assert c["comm_s"] == pytest.approx(8 * (8.4e-6 + 7 * 3.4e-6) + moved / 360e9)
    two_nodes = _estimate(capsys, "--gpus-per-node", "4")["communication"]
    assert two_nodes["link"] == "network" and two_nodes["exposed_s"] > c["exposed_s"]
    assert two_nodes["comm_s"] == pytest.approx(8 * (8.4e-6 + 6 * 3.4e-6 + 9.6e-6) + moved / 40e9)
    assert (
        main(
            [
                "estimate",
                "--model",
                TINY,
                "--batch-size",
                "2",
                "--seq-len",
                "64",
                "--device",
                "h100-sxm",
                "--param-dtype",
                "bfloat16",
            ]
        )
        == 2
    )
    assert "add --parallel fsdp2" in capsys.readouterr().err
