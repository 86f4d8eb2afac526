"""A rank's accumulation window under DDP and FSDP2 (memfit.plan.window), as ``memfit fit --parallel``
and ``memfit plan --accumulation-steps K --parallel`` solve it.

References: the window's cost model against each micro-step's own cost model walked separately (every
keep/recompute plan and segment plans of a 4-block chain), and the peaks of 2 gloo ranks (CPU,
torchrun, 127.0.0.1 only) running ``memfit train --plan`` with a candidate auto-fit chose under a
per-rank budget: torch's ``FSDPMemTracker`` under FSDP2, memfit's tracker plus DDP's buckets under
DDP, over whole windows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shlex
import subprocess
import sys

import pytest
import torch
from ranks import assert_rank_peaks_within, rank_env
from test_distributed import _free_port
from test_parallel_estimate import FAKE_WORLD, HEAD_SPEC, _fake_rank0
from test_solver import check_budgets, random_costs

from memfit import StepSpec
from memfit.errors import SpecError
from memfit.fitting import autofit
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, ParallelKind, launch_command, param_table, rank_stats
from memfit.plan.policies import policy_plan
from memfit.plan.types import BlockDecision, Option, Plan, Segment
from memfit.plan.window import _micro_steps, _window_costs, window_costs, window_peak_bytes
from memfit.profiling.blocks import profile

PY = sys.executable
TIMEOUT_S = 180
# Odd width: FSDP2 pads dim 0 (63 rows -> 32 + 31), so the ranks hold different optimizer rows.
SPEC = "demo?n_layer=4&n_embd=63&n_head=3&dropout=0&seq_len=32"
LAYOUTS = [
    Parallel(kind=ParallelKind.DDP, world_size=2, bucket_cap_bytes=2**18),
    Parallel(kind=ParallelKind.FSDP2, world_size=2),
    Parallel(kind=ParallelKind.FSDP2, world_size=2, reshard_after_forward=False),
]


@pytest.fixture(scope="module")
def one_process():
    torch.set_num_threads(1)
    wl = load_workload(SPEC, dtype=torch.float64)
    return wl, profile(wl, step=StepSpec(batch_size=4, repeats=1), options=BASE_OPTIONS, heads=False, activations=False)


def _plans(names: list[str]) -> list[Plan]:
    """Every keep/recompute plan of the chain, and three segment plans."""
    out = []
    for acts in itertools.product([Option.KEEP, Option.RECOMPUTE], repeat=len(names)):
        out.append(
            Plan(
                policy="memfit",
                chain_path="blocks",
                blocks=tuple(BlockDecision(name=n, option=a) for n, a in zip(names, acts, strict=True)),
            )
        )
    every = tuple(BlockDecision(name=n, option=Option.RECOMPUTE) for n in names)
    for segs in [
        (Segment(start=0, stop=4),),
        (Segment(start=1, stop=3),),
        (Segment(start=0, stop=2), Segment(start=2, stop=4)),
    ]:
        out.append(Plan(policy="memfit", chain_path="blocks", blocks=every, segments=segs))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=["ddp", "fsdp2", "fsdp2-no-reshard"])
def test_window_costs_are_the_largest_micro_step_of_every_plan(one_process, layout: Parallel) -> None:
    """The solver plans under one cost model; it must predict, for every plan, the largest of the
    micro-steps' peaks, each micro-step walked through its own cost model."""
    wl, st = one_process
    for rank in (0, 1):
        rs = rank_stats(st, param_table(wl.model, [b.name for b in st.blocks]), layout, rank)
        costs = ChainCosts.from_stats(rs)
        for k in (2, 3, 4):
            merged = window_costs(rs, k, costs)
            steps = [
                _window_costs(costs, start=s.start, base=s.base, peak=s.peak, post=s.post)
                for s in _micro_steps(rs, costs, k)
            ]
            assert len(steps) == (2 if layout.kind is ParallelKind.DDP or k == 2 else 3)
            for plan in _plans([b.name for b in st.blocks]):
                want = max(predict(c, plan).peak_bytes for c in steps)
                assert predict(merged, plan).peak_bytes == want, (rank, k, plan.blocks, plan.segments)
                assert (
                    want >= predict(costs, plan).peak_bytes or layout.kind is ParallelKind.FSDP2
                )  # FSDP2's first micro-step skips the reduce-scatter


def test_plan_for_budget_solves_the_window(one_process) -> None:
    """``accumulation_steps``: the window's peak (not one micro-step's) fits the budget; a plan solved
    for one micro-step at the same budget does not fit the window."""
    wl, st = one_process
    par = LAYOUTS[1]
    rs = rank_stats(st, param_table(wl.model, [b.name for b in st.blocks]), par)
    keep = policy_plan(wl.model, "none")
    budget = (window_peak_bytes(rs, keep, 3) + predict(ChainCosts.from_stats(rs), keep).peak_bytes) // 2
    one = plan_for_budget(wl, budget, stats=st, parallel=par).plan
    assert window_peak_bytes(rs, one, 3) * (1 + (one.margin or 0)) > budget  # one micro-step's plan: the window is over
    res = plan_for_budget(wl, budget, stats=st, parallel=par, accumulation_steps=3)
    acc = res.plan.accumulation_window
    assert acc is not None and acc.steps == 3 and acc.predicted_peak_bytes == window_peak_bytes(rs, res.plan, 3)
    assert acc.predicted_peak_bytes * (1 + (res.plan.margin or 0)) <= budget
    assert (
        res.plan.predicted_peak_bytes
        == predict(ChainCosts.from_stats(rs), res.plan).peak_bytes
        < acc.predicted_peak_bytes
    )
    assert not res.plan.is_plain
    with pytest.raises(SpecError, match="parallel"):
        plan_for_budget(wl, budget, stats=st, accumulation_steps=3)


# --- 2-process gloo: auto-fit's candidates run by memfit train --------------------------------------

FIT = {
    # per-rank budget, rank share of the global batch: candidates that recompute blocks (FSDP2: 6 x 2 and
    # 4 x 3; DDP: 6 x 2). A micro-batch is profiled where its profile fits the budget (NOTE [ Bounded
    # measurement ]): at 11 MiB a DDP rank's micro-batches 2 and 4 (11.3 and 15.6 MiB with every block
    # kept) are not, and larger ones are scaled from micro-batch 1, a line that errs high by more than
    # the 3 % checked here (tests/test_autofit_scaled.py checks what it offers at 11 MiB).
    "fsdp2": (8 * 2**20, 12),
    "ddp": (16 * 2**20, 12),
}


@pytest.fixture(scope="module")
def fitted(one_process):
    wl, _ = one_process
    out = {}
    for kind, (budget, share) in FIT.items():
        par = Parallel(kind=ParallelKind(kind), world_size=2, **({"bucket_cap_bytes": 2**18} if kind == "ddp" else {}))
        out[kind] = (
            par,
            autofit(
                wl,
                budget,
                share,
                parallel=par,
                measure=False,
                heads=False,
                activations=False,
                step=StepSpec(repeats=1),
                max_micro_batch=6,
            ),
        )
    return out


def _run(par: Parallel, plan: Plan, micro: int, k: int, tmp_path) -> dict:
    path = str(tmp_path / f"{par.kind.value}-{micro}x{k}.json")
    plan.save(path)
    train = [
        "--model",
        SPEC,
        "--dtype",
        "float64",
        "--global-batch",
        str(micro * k * par.world_size),
        "--micro-batch",
        str(micro),
        "--steps",
        "2",
    ]
    cmd = shlex.split(launch_command(par, train, plan_file=path))
    argv = [
        PY,
        "-m",
        "torch.distributed.run",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        *cmd[1:],
        "--json",
    ]
    r = subprocess.run(argv, env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    return json.loads(r.stdout)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind, micro, k", [("fsdp2", 6, 2), ("fsdp2", 4, 3), ("ddp", 6, 2)])
def test_fit_candidate_window_within_3_percent_of_gloo_ranks(fitted, tmp_path, kind: str, micro: int, k: int) -> None:
    par, res = fitted[kind]
    cand = next(c for c in res.candidates if (c.micro_batch, c.accumulation_steps) == (micro, k))
    assert cand.feasible and cand.plan is not None and not cand.plan.is_plain, (
        cand
    )  # under a plan that recomputes blocks
    assert cand.predicted_peak_bytes * (1 + res.margin) <= res.budget_bytes
    got = _run(par, cand.plan, micro, k, tmp_path)
    assert got["accumulation_steps"] == k and got["recomputed_blocks"] == len(cand.plan.recomputed)
    assert got["predicted_peak_bytes"] == cand.predicted_peak_bytes  # train compares with the fit's window
    measured = got["measured_peak_bytes_by_rank"]
    print(
        f"{kind} {micro}x{k}: predicted {cand.predicted_peak_bytes:,} B, ranks {measured}",
        *(f"{(cand.predicted_peak_bytes - m) / m:+.3%}" for m in measured),
    )
    assert_rank_peaks_within(got, cand.predicted_peak_bytes)


# --- segments under FSDP2: a recompute gathers its blocks' units again -------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_solver_matches_brute_force_with_units_gathered_in_recomputes(seed: int) -> None:
    """The solver and the cost model agree on segments whose recompute gathers units (every plan of
    a 5-block chain, nested segments included, brute force)."""
    rng = random.Random(seed)
    costs = random_costs(5, 300 + seed, segments=True)
    costs = dataclasses.replace(costs, recompute_gathered_bytes=tuple(rng.randint(0, 60) for _ in range(5)))
    check_budgets(costs, segments=True)


SEG_SPEC = "demo?n_layer=6&n_embd=63&n_head=3&seq_len=32"
LLAMA4 = "hf:llama?hidden_size=128&intermediate_size=256&num_hidden_layers=4&num_attention_heads=4&num_key_value_heads=2&vocab_size=1024"
R, K = Option.RECOMPUTE, Option.KEEP
SEG_CASES = [
    (SEG_SPEC, [R] * 6, [(0, 6)]),
    (SEG_SPEC, [K, R, R, R, R, K], [(1, 5)]),
    (SEG_SPEC, [R] * 6, [(0, 3), (3, 6)]),
    (SEG_SPEC, [R, K, R, R, R, R], [(2, 6), (3, 5)]),  # nested
    (LLAMA4, [R] * 4, [(0, 2), (2, 4)]),  # segments over an HF model's layer list
]


@pytest.fixture(scope="module")
def seg_stats():
    torch.set_num_threads(1)
    out = {}
    for spec in {c[0] for c in SEG_CASES}:
        wl = load_workload(spec)
        out[spec] = (
            wl,
            profile(wl, step=StepSpec(batch_size=2, repeats=1), options=BASE_OPTIONS, heads=True, activations=False),
        )
    return out


def _fsdp2_rank(wl, stats, *, reshard_after_forward: bool = True):
    par = Parallel(kind=ParallelKind.FSDP2, world_size=FAKE_WORLD, reshard_after_forward=reshard_after_forward)
    return rank_stats(stats, param_table(wl.model, [b.name for b in stats.blocks]), par)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("spec, acts, segs", SEG_CASES, ids=[f"{c[0][:5]}-{c[2]}" for c in SEG_CASES])
def test_fsdp2_segment_plans_against_fsdp_mem_tracker(
    seg_stats, spec: str, acts: list[Option], segs: list[tuple[int, int]]
) -> None:
    """A segment's recompute gathers its blocks' units again (each kept until the block's backward):
    predicted within 3 % of torch's FSDPMemTracker on rank 0 of 4 (fake process group): single and
    disjoint segments to ~230 B, nested ones +1.2 % (the unit before an inner segment counted twice)."""
    wl, st = seg_stats[spec]
    names = [b.name for b in st.blocks]
    plan = Plan(policy="memfit", chain_path=st.chain_path, blocks=tuple(BlockDecision(name=n, option=a) for n, a in zip(names, acts, strict=True)),
                segments=tuple(Segment(start=s, stop=t) for s, t in segs))  # fmt: skip
    got = _fake_rank0({"model": spec, "micro_batch": 2, "plan": plan.to_dict(), "world": FAKE_WORLD})["peak_bytes"]
    costs = ChainCosts.from_stats(_fsdp2_rank(wl, st))
    pred = predict(costs, plan).peak_bytes
    unmodelled = predict(dataclasses.replace(costs, recompute_gathered_bytes=()), plan).peak_bytes
    print(
        f"{spec[:5]} {segs}: predicted {pred:,} B, FSDPMemTracker {got:,} B, {(pred - got) / got:+.3%} (units not counted: {(unmodelled - got) / got:+.3%})"
    )
    assert abs(pred - got) <= 0.03 * got, (pred, got)
    if not any(
        a < c and d <= b for a, b in segs for c, d in segs if (a, b) != (c, d)
    ):  # not nested: to ~230 B alone; in the full suite once 16,358 B low (the single segment), which
        # neither the file alone nor the earlier files with this test reproduce: an open item
        assert abs(pred - got) < 0.01 * got, (pred, got)
    if segs == [(0, 6)]:  # the check is sensitive: without the units a recompute gathers, far low
        assert unmodelled < 0.97 * got, (unmodelled, got)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_solver_plans_segments_and_the_chunked_head_per_rank() -> None:
    """At the per-rank minimum the solver takes a segment and the chunked loss under FSDP2; the plan
    runs under fully_shard and its predicted peak is within 3 % of FSDPMemTracker's."""
    torch.set_num_threads(1)
    wl = load_workload(HEAD_SPEC)
    st = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=BASE_OPTIONS, heads=True, activations=False)
    par = Parallel(kind=ParallelKind.FSDP2, world_size=FAKE_WORLD)
    need = plan_for_budget(wl, 10**12, stats=st, parallel=par).min_budget_bytes
    plan = plan_for_budget(wl, need, stats=st, parallel=par).plan
    assert plan.segments and plan.head == "chunked", (plan.segments, plan.head)
    got = _fake_rank0({"model": HEAD_SPEC, "micro_batch": 2, "plan": plan.to_dict(), "world": FAKE_WORLD})["peak_bytes"]
    print(
        f"llama min plan {[(s.start, s.stop) for s in plan.segments]} {plan.head}: predicted {plan.predicted_peak_bytes:,} B, FSDPMemTracker {got:,} B"
    )
    assert abs(plan.predicted_peak_bytes - got) <= 0.03 * got, (plan.predicted_peak_bytes, got)
    # The chunked head's own peak under FSDP2, every block recomputed: to the last gathered unit.
    flat = policy_plan(wl.model, "all").with_(head="chunked")
    got_all = _fake_rank0({"model": HEAD_SPEC, "micro_batch": 2, "plan": flat.to_dict(), "world": FAKE_WORLD})[
        "peak_bytes"
    ]
    rs = _fsdp2_rank(wl, st)
    pred_all = predict(ChainCosts.from_stats(rs), flat)
    assert pred_all.peak_event == "loss and head"
    assert (
        abs(pred_all.peak_bytes - got_all)
        < rs.calibration.parallel.memory["unit_unsharded_bytes"][len(st.blocks) - 1] // 4
    ), (pred_all, got_all)


def test_fsdp2_without_reshard_after_forward_plans_no_segments(seg_stats) -> None:
    wl, st = seg_stats[SEG_SPEC]
    par = Parallel(kind=ParallelKind.FSDP2, world_size=FAKE_WORLD, reshard_after_forward=False)
    assert (
        st.sequential and not ChainCosts.from_stats(_fsdp2_rank(wl, st, reshard_after_forward=False)).segments_allowed
    )
    need = plan_for_budget(wl, 10**12, stats=st, parallel=par).min_budget_bytes
    assert not plan_for_budget(wl, need, stats=st, parallel=par).plan.segments


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_ddp_rank_stats_keep_head_options() -> None:
    """DDP's buckets shift a head option's measured whole-step peaks, not its ``H`` (relative)."""
    torch.set_num_threads(1)
    wl = load_workload(HEAD_SPEC)
    st = profile(wl, step=StepSpec(batch_size=2, repeats=1), options=BASE_OPTIONS, heads=True, activations=False)
    rs = rank_stats(
        st, param_table(wl.model, [b.name for b in st.blocks]), Parallel(kind=ParallelKind.DDP, world_size=2)
    )
    buckets = sum(rs.calibration.parallel.memory["buckets_bytes"])
    assert st.head_options and buckets > 0
    for k, h in st.head_options.items():
        got = rs.head_options[k]
        assert got.head_peak_bytes == h.head_peak_bytes and got.measured_peak_bytes == h.measured_peak_bytes + buckets
