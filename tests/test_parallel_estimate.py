"""Per-rank accounting for DDP and FSDP2 (memfit.plan.parallel) against hand-computed numbers,
torch's own bucket assignment and shard split, and measured ranks of 2-process gloo jobs.

The 2-process checks run tests/parallel_worker.py on two ranks (gloo, CPU, 127.0.0.1 only) under
plans that recompute blocks; the prediction comes from a one-process profile of the same workload
turned into each rank's Stats, walked through the planner's cost model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import rank_env, run_ranks
from torch import nn

from memfit import StepSpec
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.estimation import estimate_stats, load_fake_workload
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import (
    Parallel,
    ParallelKind,
    ddp_buckets,
    launch_command,
    param_table,
    rank_memory,
    rank_stats,
    shard_rows,
)
from memfit.plan.policies import policy_plan
from memfit.profiling.blocks import profile
from memfit.workload import Workload

HERE = Path(__file__).parent
TIMEOUT_S = 180
# Odd widths: FSDP2 pads dim 0 (63 rows -> 32 + 31 on 2 ranks), so the two ranks differ.
SPEC = "demo?n_layer=4&n_embd=63&n_head=3&seq_len=32"
MICRO_BATCH = 4
CONFIGS = [
    {"parallel": "ddp", "policy": "every:2", "bucket_cap_mb": 0.25},
    {"parallel": "fsdp2", "policy": "all", "reshard_after_forward": True},
    {"parallel": "fsdp2", "policy": "every:2", "reshard_after_forward": False},
    {
        "parallel": "fsdp2",
        "policy": "sqrt",
        "reshard_after_forward": True,
    },  # a segment: its recompute gathers the units again
]


# --- units: shards, buckets, hand-computed per-rank bytes -----------------------------------------


@pytest.mark.parametrize("dim0, world", [(63, 2), (64, 2), (3, 4), (10, 4), (1, 8), (0, 2)])
def test_shard_rows_follow_torch_chunk(dim0: int, world: int) -> None:
    chunks = torch.empty(dim0, 2).chunk(world) if dim0 else ()
    for r in range(world):
        padded, local = shard_rows(dim0, world, r)
        assert local == (chunks[r].shape[0] if r < len(chunks) else 0)
        assert padded == (chunks[0].shape[0] if chunks else 0)


def test_ddp_buckets_equal_torch_assignment() -> None:
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 300), nn.Linear(300, 5), nn.LayerNorm(5))
    params = param_table(model, [])
    first, cap = 4_000, 20_000
    got = ddp_buckets(
        params, Parallel(kind=ParallelKind.DDP, world_size=2, bucket_cap_bytes=cap, first_bucket_bytes=first)
    )
    tensors = list(reversed(list(model.parameters())))
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
    want = sorted(sum(tensors[i].numel() * 4 for i in b) for b in indices)
    assert sorted(got) == want and len(got) >= 3
    assert sum(got) == sum(p.numel() * 4 for p in model.parameters())


class _Tiny(nn.Module):
    """Blocks: Linear(5, 3) and Linear(3, 3); root: Linear(3, 2) (head) and a frozen (7,) vector."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 3))
        self.head = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(7), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)) * self.scale[0]


def _tiny_workload() -> Workload:
    torch.manual_seed(0)
    return Workload(
        name="tiny",
        model=_Tiny(),
        make_batch=lambda b: torch.randn(b, 5),
        loss_fn=lambda m, x: m(x).square().mean(),
        default_batch_size=4,
    )


@pytest.fixture(scope="module")
def tiny_stats() -> tuple[Workload, object]:
    wl = _tiny_workload()
    return wl, profile(wl, step=StepSpec(batch_size=4, repeats=1), options=BASE_OPTIONS, heads=False, activations=False)


def test_rank_memory_hand_computed(tiny_stats) -> None:
    wl, stats = tiny_stats
    params = param_table(wl.model, [b.name for b in stats.blocks])
    assert [p.unit for p in params] == [-1, 0, 0, 1, 1, -1, -1]  # own parameters come first
    fsdp = Parallel(kind=ParallelKind.FSDP2, world_size=2)
    # float32; padded shard rows ceil(d0 / 2): block 0 weight (3, 5) -> 2 rows of 5, bias (3) -> 2;
    # block 1 weight (3, 3) -> 2 x 3, bias -> 2; head weight (2, 3) -> 1 x 3, bias (2) -> 1; scale (7) -> 4.
    shard = 4 * ((10 + 2) + (6 + 2) + (3 + 1 + 4))
    r0, r1 = rank_memory(stats, params, fsdp, 0), rank_memory(stats, params, fsdp, 1)
    assert r0.params_bytes == r1.params_bytes == shard
    assert r0.grads_bytes == 4 * ((10 + 2) + (6 + 2) + (3 + 1))  # the frozen vector has none
    # gathered (padded) units: block 0 2 x 12 floats, block 1 2 x 8, root 2 x 8
    assert r0.unit_unsharded_bytes == (96, 64, 64)
    # AdamW keeps 2 floats per trainable element of the local rows (+ a step counter per tensor):
    # rank 1 holds 1 row of each 3-row tensor and the head's second row.
    full = 4 * (15 + 3 + 9 + 3 + 6 + 2)
    local1 = 4 * ((5 + 1) + (3 + 1) + (3 + 1))
    assert stats.optimizer_bytes == 2 * full + 6 * 4
    assert r1.optimizer_bytes == round(stats.optimizer_bytes * (local1 + 4 * 3) / (full + 28))
    ddp = rank_memory(stats, params, Parallel(kind=ParallelKind.DDP, world_size=2), 0)
    assert ddp.comm_bytes == sum(ddp.buckets_bytes) == full  # one bucket of every trainable parameter
    assert ddp.params_bytes == stats.params_bytes and ddp.optimizer_bytes == stats.optimizer_bytes


def test_rank_stats_ddp_adds_buckets_everywhere(tiny_stats) -> None:
    wl, stats = tiny_stats
    params = param_table(wl.model, [b.name for b in stats.blocks])
    rs = rank_stats(stats, params, Parallel(kind=ParallelKind.DDP, world_size=4))
    plan = policy_plan(wl.model, "all")
    one = predict(ChainCosts.from_stats(stats), plan).peak_bytes
    assert predict(ChainCosts.from_stats(rs), plan).peak_bytes == one + 4 * 38
    assert rs.calibration.parallel is not None and rs.calibration.parallel.world_size == 4


def test_rank_stats_ddp_of_a_profile_with_the_chunked_head() -> None:
    """A measured profile of a transformers causal LM calibrates the chunked head: DDP's buckets are
    live under it too (its whole-step peaks shift by them; its H, above the last block, does not)."""
    torch.set_num_threads(1)
    wl = load_workload("hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256", seq_len=32)
    stats = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=BASE_OPTIONS, heads=True, activations=False)
    rs = rank_stats(
        stats, param_table(wl.model, [b.name for b in stats.blocks]), Parallel(kind=ParallelKind.DDP, world_size=2)
    )
    buckets = rs.calibration.parallel.memory["comm_bytes"]
    assert buckets == sum(p.numel() * p.element_size() for p in wl.model.parameters() if p.requires_grad)
    (h,) = stats.head_options.values()
    (hr,) = rs.head_options.values()
    assert hr.measured_peak_bytes == h.measured_peak_bytes + buckets and hr.head_peak_bytes == h.head_peak_bytes
    assert hr.measured_peak_bytes_by_option == {m: v + buckets for m, v in h.measured_peak_bytes_by_option.items()}


def test_parallel_refuses_bad_values(tiny_stats) -> None:
    with pytest.raises(SpecError, match="world size 0"):
        Parallel(kind=ParallelKind.DDP, world_size=0)
    with pytest.raises(SpecError, match="fsdp3"):
        Parallel.from_dict({"kind": "fsdp3", "world_size": 2})
    wl, stats = tiny_stats
    params = param_table(wl.model, [b.name for b in stats.blocks])
    with pytest.raises(SpecError, match="rank 2 is outside"):
        rank_stats(stats, params, Parallel(kind=ParallelKind.FSDP2, world_size=2), rank=2)


def test_launch_command() -> None:
    cmd = launch_command(
        Parallel(kind=ParallelKind.FSDP2, world_size=8), ["--model", "hf:llama?x=1&y=2", "--steps", "10"]
    )
    assert (
        cmd
        == "torchrun --nproc-per-node 8 -m memfit.cli.main train --model 'hf:llama?x=1&y=2' --steps 10 --world-size 8 --parallel fsdp2"
    )
    # More ranks than one node holds: the line every node runs (torchrun's own multi-node flags).
    multi = launch_command(Parallel(kind=ParallelKind.FSDP2, world_size=16), ["--model", "m"], gpus_per_node=4)
    assert multi.startswith(
        'torchrun --nnodes 4 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500" -m memfit.cli.main train'
    )
    assert multi.endswith("--world-size 16 --parallel fsdp2")
    assert launch_command(Parallel(kind=ParallelKind.DDP, world_size=8), ["--model", "m"], gpus_per_node=8).startswith(
        "torchrun --nproc-per-node 8 "
    )


# --- 2-process gloo: predicted against measured ranks ----------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[list[dict], list[list[dict]]]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.fail("torch.distributed with gloo is needed (the pinned CPU torch has it)")
    wl = load_workload(SPEC)
    cfgs = [
        {**c, "model": SPEC, "micro_batch": MICRO_BATCH, "plan": policy_plan(wl.model, c["policy"]).to_dict()}
        for c in CONFIGS
    ]
    tmp = tmp_path_factory.mktemp("parallel")
    ranks = run_ranks("parallel_worker.py", tmp, json.dumps(cfgs), timeout_s=TIMEOUT_S)
    return cfgs, [[ranks[r][i] for r in range(2)] for i in range(len(cfgs))]


@pytest.fixture(scope="module", params=["measured", "estimated"])
def one_process_stats(request):
    """One process's stats at the rank's micro-batch: profiled here, or estimated from fake-tensor
    steps with this machine's CPU kernels (what the gloo ranks run)."""
    torch.set_num_threads(1)
    wl = load_workload(SPEC)
    if request.param == "measured":
        return wl, profile(
            wl, step=StepSpec(batch_size=MICRO_BATCH, repeats=1), options=BASE_OPTIONS, heads=False, activations=False
        )
    return wl, estimate_stats(
        wl,
        device="h100-sxm",
        gpu_kernels=False,
        foreach=False,
        activations=False,
        step=StepSpec(batch_size=MICRO_BATCH),
    )


def _predicted(wl: Workload, stats, cfg: dict, rank: int) -> tuple[int, dict]:
    par = Parallel(
        kind=ParallelKind(cfg["parallel"]),
        world_size=2,
        bucket_cap_bytes=int(cfg.get("bucket_cap_mb", 25) * 2**20),
        reshard_after_forward=cfg.get("reshard_after_forward", True),
    )
    rs = rank_stats(stats, param_table(wl.model, [b.name for b in stats.blocks]), par, rank)
    plan = policy_plan(wl.model, cfg["policy"])
    assert not plan.is_plain  # every check runs under a plan that recomputes blocks
    return predict(ChainCosts.from_stats(rs), plan).peak_bytes, rs.calibration.parallel.memory


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[f"{c['parallel']}-{c['policy']}" for c in CONFIGS])
def test_predicted_rank_peak_within_3_percent_of_measured(measured, one_process_stats, i: int) -> None:
    cfgs, results = measured
    wl, stats = one_process_stats
    cfg = cfgs[i]
    for rank, res in enumerate(results[i]):
        pred, _mem = _predicted(wl, stats, cfg, rank)
        held = res.get("collective_held_bytes", 0)  # what gloo's threads still held at the peak (3 tries to get 0)
        if cfg["parallel"] == "fsdp2":
            tracked = res["fsdp_mem_tracker_peak_bytes"]  # torch's FSDP2 tracker
        else:
            tracked = res["tracker_peak_bytes"] + sum(map(int, res["ddp_bucket_sizes"].split(", ")))
        assert -0.03 * tracked - held <= pred - tracked <= 0.03 * tracked, (rank, pred, tracked, held)
        # The allocator's view (torch.profiler) over the whole session sees every allocation, so the
        # prediction is never above it. It also keeps counting buffers that gloo's threads freed unseen
        # (tests/parallel_worker.py): under FSDP2 0-2 gathered units more, varying from run to run; under
        # DDP usually nothing (within 3 % of the prediction), but a fresh-clone run once measured +17 %
        # (every:2, 6,299,364 B against 5,386,620). So only the lower bound is checked against it; the
        # two-sided check is the tracker's above.
        prof = res["profiler_peak_bytes"]
        assert pred <= 1.03 * prof, (rank, pred, prof)


@pytest.mark.distributed
def test_fsdp2_ranks_differ_as_padding_says(measured, one_process_stats) -> None:
    cfgs, results = measured
    wl, stats = one_process_stats
    i = next(k for k, c in enumerate(cfgs) if c["parallel"] == "fsdp2")
    r0, r1 = results[i]
    got = r0["fsdp_mem_tracker_peak_bytes"] - r1["fsdp_mem_tracker_peak_bytes"]
    want = _predicted(wl, stats, cfgs[i], 0)[0] - _predicted(wl, stats, cfgs[i], 1)[0]
    late = r0["collective_held_bytes"] + r1["collective_held_bytes"]  # 0 unless 3 tries all had gloo hold a buffer
    assert want > 0 and abs(got - want) <= 0.05 * want + late, (got, want, late)  # rank 1 holds fewer optimizer rows


# --- FSDP2 on torch's fake process group (one process plays rank 0), against FSDPMemTracker ----------

# An HF causal LM computes its loss inside its forward (labels given), and a large vocabulary puts
# the step's peak at the loss and head: there FSDP2 still holds the last block's all-gather output
# (freed in the root's post-forward) and, from the start of backward, the last block prefetched.
HEAD_SPEC = "hf:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=3&num_attention_heads=4&num_key_value_heads=2&vocab_size=4096"
FAKE_WORLD = 4


def _fake_rank0(cfg: dict) -> dict:
    res = subprocess.run(
        [sys.executable, str(HERE / "fsdp_fake_worker.py"), json.dumps(cfg)],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
@pytest.mark.parametrize("source", ["measured", "estimated"])
def test_fsdp2_peak_at_the_loss_holds_the_last_gathered_block(source: str) -> None:
    torch.set_num_threads(1)
    wl = load_workload(HEAD_SPEC)
    plan = policy_plan(wl.model, "all")
    got = _fake_rank0({"model": HEAD_SPEC, "micro_batch": 2, "plan": plan.to_dict(), "world": FAKE_WORLD})
    if source == "measured":
        stats = profile(
            wl, step=StepSpec(batch_size=2, repeats=1), options=BASE_OPTIONS, heads=False, activations=False
        )
    else:
        stats = estimate_stats(
            wl, device="h100-sxm", gpu_kernels=False, foreach=False, activations=False, step=StepSpec(batch_size=2)
        )
    rs = rank_stats(
        stats,
        param_table(wl.model, [b.name for b in stats.blocks]),
        Parallel(kind=ParallelKind.FSDP2, world_size=FAKE_WORLD),
    )
    pred = predict(ChainCosts.from_stats(rs), plan)
    last_unit = rs.calibration.parallel.memory["unit_unsharded_bytes"][len(stats.blocks) - 1]
    assert pred.peak_event == "loss and head"
    assert abs(pred.peak_bytes - got["peak_bytes"]) <= 0.03 * got["peak_bytes"], (pred.peak_bytes, got)
    # Tighter than 3 %: leaving out the last block's gathered unit (what the accounting missed) fails.
    assert abs(pred.peak_bytes - got["peak_bytes"]) < last_unit // 4, (pred.peak_bytes, got["peak_bytes"], last_unit)


# The small Llama of benchmarks/estimate_compare.py, rank 0 of 8. Its layers hold the causal mask
# when recomputed, so the head's peak differs between the calibration steps (NOTE [ The head's
# peak per option ]).
SMALL_LLAMA = (
    "hf:llama?hidden_size=256&intermediate_size=688&num_hidden_layers=4&num_attention_heads=4&num_key_value_heads=2"
    "&vocab_size=2048&max_position_embeddings=256"
)


@pytest.fixture(scope="module")
def small_llama_estimate():
    torch.set_num_threads(1)
    wl = load_fake_workload(SMALL_LLAMA)
    return wl, estimate_stats(
        wl, device="h100-sxm", gpu_kernels=False, foreach=False, activations=False, step=StepSpec(batch_size=2)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("policy", ["none", "all"])
def test_fsdp2_small_llama_keep_all_and_recompute_all_against_fsdp_mem_tracker(
    small_llama_estimate, policy: str
) -> None:
    wl, stats = small_llama_estimate
    plan = policy_plan(wl.model, policy)
    got = _fake_rank0({"model": SMALL_LLAMA, "micro_batch": 2, "plan": plan.to_dict(), "world": 8})
    rs = rank_stats(
        stats, param_table(wl.model, [b.name for b in stats.blocks]), Parallel(kind=ParallelKind.FSDP2, world_size=8)
    )
    costs = ChainCosts.from_stats(rs)
    pred = predict(costs, plan).peak_bytes
    assert abs(pred - got["peak_bytes"]) <= 0.02 * got["peak_bytes"], (pred, got)
    assert abs(pred - got["peak_bytes"]) <= 1024, (pred, got["peak_bytes"])  # measured: 156 B below
    # One H for every plan (the larger step's, as stats without the per-option fields give) puts
    # keep-all above the tracker by the mask its layers free before the head (137 KB measured).
    one_h = predict(dataclasses.replace(costs, head_peak_bytes_by_option={}), plan).peak_bytes
    if policy == "none":
        assert one_h - got["peak_bytes"] > 128 * 1024, (one_h, got["peak_bytes"])
    else:
        assert one_h == pred


MP_SPEC = "hf:llama?hidden_size=128&intermediate_size=512&num_hidden_layers=4&num_attention_heads=4&num_key_value_heads=2&vocab_size=256"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "spec, policy",
    [(MP_SPEC, "all"), (MP_SPEC, "every:2"), (HEAD_SPEC, "all")],
    ids=["block-backward", "every2", "loss"],
)
def test_fsdp2_mixed_precision_against_fsdp_mem_tracker(spec: str, policy: str) -> None:
    """fp32 parameters under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 shards,
    gradient shards and AdamW state, bf16 gathered units and activations, fp32 reduce-scatter inputs."""
    torch.set_num_threads(1)
    wl = load_workload(spec)
    plan = policy_plan(wl.model, policy)
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    got = _fake_rank0({"model": spec, "micro_batch": 2, "plan": plan.to_dict(), "world": FAKE_WORLD, **mp})
    stats = estimate_stats(
        load_fake_workload(spec, dtype=torch.bfloat16),
        device="h100-sxm",
        gpu_kernels=False,
        foreach=False,
        activations=False,
        step=StepSpec(batch_size=2),
    )
    table = param_table(wl.model, [b.name for b in stats.blocks])  # fp32, as the model is
    rs = rank_stats(stats, table, Parallel(kind=ParallelKind.FSDP2, world_size=FAKE_WORLD, **mp))
    pred = predict(ChainCosts.from_stats(rs), plan).peak_bytes
    assert abs(pred - got["peak_bytes"]) <= 0.03 * got["peak_bytes"], (pred, got)
    mem = rs.calibration.parallel.memory
    # fp32 shards (the buffers are made in bf16 by the bf16 estimate, fp32 in the tracked model).
    assert 0 <= mem["params_bytes"] - got["parts"]["SHARDED_PARAM"] <= got["parts"]["BUFFER"], (mem, got)
    assert mem["optimizer_bytes"] == pytest.approx(got["parts"]["OPT"], rel=1e-3), (mem, got)
    # Without the policy (everything in bf16: 8 B/parameter over the ranks) the rank is far short.
    bf16 = rank_stats(
        stats,
        param_table(wl.model, [b.name for b in stats.blocks], itemsize=2),
        Parallel(kind=ParallelKind.FSDP2, world_size=FAKE_WORLD),
    )
    short = got["peak_bytes"] - predict(ChainCosts.from_stats(bf16), plan).peak_bytes
    assert short > 4 * abs(pred - got["peak_bytes"]), (short, pred, got)


@pytest.mark.slow  # about 13 s on 2 cores: the fast tier keeps to about 4 minutes
def test_mixed_precision_refusals() -> None:
    with pytest.raises(SpecError, match="fsdp2"):
        Parallel(kind=ParallelKind.DDP, world_size=2, param_dtype="bfloat16")
    with pytest.raises(SpecError, match="float dtype"):
        Parallel(kind=ParallelKind.FSDP2, world_size=2, param_dtype="bf16")
    wl = load_workload(MP_SPEC)
    st = estimate_stats(
        load_fake_workload(MP_SPEC),
        device="h100-sxm",
        gpu_kernels=False,
        activations=False,
        step=StepSpec(batch_size=1),
    )
    with pytest.raises(SpecError, match="made in float32"):
        rank_stats(
            st,
            param_table(wl.model, [b.name for b in st.blocks]),
            Parallel(kind=ParallelKind.FSDP2, world_size=2, param_dtype="bfloat16"),
        )


# --- the CLI: per-rank plan, fit and estimate ------------------------------------------------------


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


TINY = "demo?n_layer=3&n_embd=63&n_head=3&seq_len=32"


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_cli_plan_per_rank_budget_matches_the_library(capsys) -> None:
    budget = 6 * 2**20
    code, d = _run_json(
        capsys,
        "plan",
        "--model",
        TINY,
        "--batch-size",
        "4",
        "--budget",
        str(budget),
        "--world-size",
        "2",
        "--parallel",
        "fsdp2",
    )
    assert code == 0, d
    assert d["predicted_peak_bytes"] * 1.02 <= budget
    wl = load_workload(TINY)
    stats = profile(wl, step=StepSpec(batch_size=4, repeats=1), options=BASE_OPTIONS, heads=False, activations=True)
    rs = rank_stats(
        stats, param_table(wl.model, [b.name for b in stats.blocks]), Parallel(kind=ParallelKind.FSDP2, world_size=2)
    )
    from memfit.plan.types import Plan

    plan = Plan.from_dict({"format": "memfit.plan", "version": 1, "policy": "memfit", "chain_path": d["blocks"] and stats.chain_path,
                           "blocks": d["blocks"], "segments": d["segments"], "activations": d["activations"]})  # fmt: skip
    assert d["predicted_peak_bytes"] == predict(ChainCosts.from_stats(rs), plan).peak_bytes
    assert d["rank"]["memory"]["params_bytes"] < stats.params_bytes / 1.9  # sharded over 2 (padded)
    assert max(d["rank"]["peak_bytes_by_phase"].values()) == d["predicted_peak_bytes"]
    assert d["launch_command"].startswith("torchrun --nproc-per-node 2 -m memfit.cli.main train --model")


@pytest.mark.slow  # about 14 s on 2 cores: the fast tier keeps to about 4 minutes
def test_cli_fit_and_estimate_per_rank(capsys) -> None:
    # on an H100 the budget is reserved memory: two 32 MiB cuBLAS workspaces and the allocator's cache included
    code, d = _run_json(capsys, "fit", "--model", TINY, "--global-batch", "16", "--budget", "80MiB", "--world-size", "4",
                        "--parallel", "ddp", "--estimate", "--target", "h100-sxm")  # fmt: skip
    assert code == 0, d
    assert d["rank_share"] == 4 and d["micro_batch"] * d["accumulation_steps"] >= 4
    assert d["rank"]["memory"]["comm_bytes"] == d["rank"]["memory"]["grads_bytes"]  # DDP's buckets: every gradient once
    code, e = _run_json(capsys, "estimate", "--model", TINY, "--batch-size", "2", "--policy", "all", "--world-size", "2",
                        "--parallel", "fsdp2", "--device", "h100-sxm")  # fmt: skip
    assert code == 0, e
    assert e["predicted_peak_bytes"] == max(e["rank"]["peak_bytes_by_phase"].values())


@pytest.mark.slow
def test_cli_mixed_precision_fsdp2(capsys) -> None:
    """``--param-dtype bfloat16 --reduce-dtype float32`` on estimate, plan and fit: the library's
    accounting (checked against FSDPMemTracker above); without --estimate it is refused."""
    mp = [
        "--world-size",
        "4",
        "--parallel",
        "fsdp2",
        "--param-dtype",
        "bfloat16",
        "--reduce-dtype",
        "float32",
        "--device",
        "h100-sxm",
    ]
    code, e = _run_json(capsys, "estimate", "--model", MP_SPEC, "--batch-size", "2", "--policy", "all", *mp)
    assert code == 0, e
    wl = load_fake_workload(MP_SPEC)
    stats = estimate_stats(wl, device="h100-sxm", activations=False, step=StepSpec(batch_size=2, dtype=torch.bfloat16))
    par = Parallel(kind=ParallelKind.FSDP2, world_size=4, param_dtype="bfloat16", reduce_dtype="float32")
    rs = rank_stats(stats, param_table(wl.model, [b.name for b in stats.blocks]), par)
    assert e["predicted_peak_bytes"] == predict(ChainCosts.from_stats(rs), policy_plan(wl.model, "all")).peak_bytes
    assert e["rank"]["memory"]["optimizer_bytes"] == rs.calibration.parallel.memory["optimizer_bytes"]
    # On CUDA a budget is reserved memory (the live peak plus what the caching allocator holds).
    budget = str(round(1.1 * e["rank"]["predicted_reserved_bytes"]))
    code, d = _run_json(capsys, "plan", "--model", MP_SPEC, "--batch-size", "2", "--budget", budget, "--estimate", *mp)
    assert code == 0 and d["budget_means"] == "reserved" and d["predicted_reserved_bytes"] <= int(budget), d
    assert d["parallel"]["param_dtype"] == "bfloat16" and d["parallel"]["reduce_dtype"] == "float32"
    code, d = _run_json(capsys, "plan", "--model", MP_SPEC, "--budget", budget, *mp[:-2])
    assert code == 2 and "--estimate" in d["error"], d


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", "--budget", "6MiB", "--world-size", "2"], "needs --parallel"),
        (["plan", "--budget", "6MiB", "--world-size", "2", "--parallel", "ddp", "--measure"], "--measure"),
        (["estimate", "--world-size", "2", "--parallel", "ddp"], "needs --device"),
    ],
)
def test_cli_parallel_refusals(capsys, argv: list[str], fragment: str) -> None:
    code, d = _run_json(capsys, argv[0], "--model", TINY, *argv[1:])
    assert code == 2 and fragment in d["error"], d


# --- the CUDA allocator model against the recorded H200 measurements --------------------------------


def test_allocator_model_against_recorded_h200_allocator_peaks() -> None:
    from memfit.estimation import get_device
    from memfit.estimation.allocator import allocator_model, cublas_workspace_bytes

    assert cublas_workspace_bytes(get_device("h200")) == 32 * 2**20
    assert cublas_workspace_bytes(get_device("a100-80gb")) == 8 * 2**20 + 128 * 2**10
    rec = json.loads((HERE.parent / "benchmarks" / "results" / "gpu_check_2026-11-30.json").read_text())
    assert rec["device"] == "NVIDIA H200"
    rows = [r for m in rec["models"] for r in m["results"].values()]
    assert len(rows) >= 12
    for r in rows:
        pred = allocator_model(r["tracker_peak_bytes"], get_device("h200"))
        # torch.cuda.max_memory_allocated: the workspaces, plus block rounding and kernel workspaces (2-8 MiB)
        assert 0 <= r["allocator_peak_bytes"] - pred.predicted_allocated_bytes <= 8 * 2**20, r
        assert pred.predicted_reserved_bytes >= pred.predicted_allocated_bytes
        assert pred.predicted_reserved_bytes % (2 * 2**20) == 0
