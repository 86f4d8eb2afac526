"""Selective checkpointing: policies, plans, gradients against the unmodified model, the per-block
MILP and the chain solver with several options per block, both against brute force."""

from __future__ import annotations

import copy
import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_engine import BUILTIN, assert_same_training, conv_workload, kw_workload
from test_solver import laminar_families
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit import BudgetInfeasibleError, PlanFileError, PlanMismatchError, SpecError, StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.capture.ops import capture_ops
from memfit.capture.opstats import BlockOps, OpCall
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload
from memfit.plan import BlockDecision, Option, Plan, Segment, Selective, policy_plan
from memfit.plan.costmodel import ChainCosts, OptionCost, predict
from memfit.plan.milp import solve_block_milp
from memfit.plan.savepolicy import PRESET_OPS, parse_save_policy, policy_text
from memfit.plan.solve import min_budget, plan_from_solution, solve
from memfit.plan.types import SAVE_PRESETS, SELECTIVE_PRESETS
from memfit.profiling.blocks import profile
from memfit.verification.plans import verify
from memfit.workload import cast_batch

# --- policies -------------------------------------------------------------------------------------


def test_presets_are_one_list_and_name_what_they_save() -> None:
    # every named policy has one entry; the profile calibrates the default ones, torchtitan's when asked
    assert tuple(PRESET_OPS) == SAVE_PRESETS and set(SELECTIVE_PRESETS) < set(SAVE_PRESETS)
    att = parse_save_policy("save_attention")
    for op in (
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
    ):
        assert att.saves(op, 0)
    mm = parse_save_policy("save_matmuls")
    assert mm.saves("aten.addmm.default", 7) and mm.saves("aten.convolution.default", 0)
    assert not mm.saves("aten.gelu.default", 0) and not mm.saves("aten._scaled_dot_product_flash_attention.default", 0)
    both = parse_save_policy("save_matmuls_and_attention")
    assert both.saves("aten.bmm.default", 0) and both.saves("aten._scaled_dot_product_cudnn_attention.default", 0)


def test_explicit_op_lists_by_op_and_by_call() -> None:
    p = parse_save_policy("save:aten.mm.default, aten.addmm.default@2")
    assert p.saves("aten.mm.default", 0) and p.saves("aten.mm.default", 5)
    assert p.saves("aten.addmm.default", 2) and not p.saves("aten.addmm.default", 1)
    fn = p.policy_fn()
    from torch.utils.checkpoint import CheckpointPolicy

    got = [fn(None, torch.ops.aten.addmm.default) for _ in range(4)]
    assert got == [CheckpointPolicy.PREFER_RECOMPUTE] * 2 + [
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("save_everything", "unknown selective policy .* save_matmuls"),
        ("save:mm", "not 'namespace.op.overload'"),
        ("save:aten.no_such_op.default", "not an op overload of this torch"),
    ],
)
def test_bad_policies_say_what_is_valid(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_save_policy(text)


# --- plans ----------------------------------------------------------------------------------------


def test_plan_json_roundtrip_with_selective_and_offload(tmp_path: Path) -> None:
    wl = kw_workload()
    base = policy_plan(wl.model, "none")
    blocks = list(base.blocks)
    blocks[0] = BlockDecision(name=blocks[0].name, option=Option.SELECTIVE, policy="save_matmuls")
    blocks[1] = BlockDecision(name=blocks[1].name, option=Option.SELECTIVE, policy="save:aten.addmm.default@0")
    blocks[2] = BlockDecision(name=blocks[2].name, option=Option.OFFLOAD)
    plan = base.with_(blocks=tuple(blocks))
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["blocks"][0] == {"name": blocks[0].name, "option": "selective", "policy": "save_matmuls"}
    assert "policy" not in data["blocks"][3]
    assert Plan.load(path) == plan


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["blocks"][0].update(option="selective"), "is 'selective' but it has no policy"),
        (lambda d: d["blocks"][0].update(option="selective", policy="save_it_all"), "neither a preset"),
        (lambda d: d["blocks"][0].update(option="selective", policy="save:aten.mm"), "is not 'namespace.op.overload'"),
        (lambda d: d["blocks"][0].update(policy="save_matmuls"), "only 'selective' blocks take one"),
        (lambda d: d["blocks"][0].update(option="selective", policy=3), "not a string"),
        (
            lambda d: (d["blocks"][1].update(option="offload"), d.update(segments=[{"start": 0, "stop": 3}])),
            "inside segment .* cannot be inside a segment",
        ),
    ],
)
def test_hand_edited_selective_plans_are_refused_clearly(tmp_path: Path, edit, message: str) -> None:
    data = policy_plan(conv_workload().model, "none").to_dict()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message):
        Plan.load(path)


def test_apply_refuses_unknown_ops_and_segments_around_selective_blocks_changing_nothing() -> None:
    wl = conv_workload()
    plan = policy_plan(wl.model, Selective(preset="save_matmuls"))
    bad = plan.with_(
        blocks=(
            BlockDecision(name=plan.blocks[0].name, option=Option.SELECTIVE, policy="save:aten.nope.default"),
            *plan.blocks[1:],
        )
    )
    with pytest.raises(PlanMismatchError, match="not an op overload"):
        apply_plan(wl.model, bad)
    nested = plan.with_(segments=(Segment(start=0, stop=2),))
    with pytest.raises(PlanMismatchError, match="cannot be inside a segment"):
        apply_plan(wl.model, nested)
    assert not any("forward" in m.__dict__ for m in wl.model.modules())


# --- gradients and buffers against the unmodified model --------------------------------------------

WORKLOADS = {
    "conv-bn": conv_workload,
    "kw-model": kw_workload,
    "demo": lambda: load_workload(BUILTIN["demo"], seq_len=32),
    "hf:gpt2": lambda: load_workload(BUILTIN["hf:gpt2"], seq_len=32),
    "hf:llama": lambda: load_workload(BUILTIN["hf:llama"], seq_len=32),
}


@pytest.mark.parametrize("preset", SELECTIVE_PRESETS)
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_preset_trains_the_same(name: str, preset: str) -> None:
    wl = WORKLOADS[name]()
    assert_same_training(wl, policy_plan(wl.model, Selective(preset=preset)), batch_size=3)


@pytest.mark.parametrize("name", ["conv-bn", "hf:gpt2"])
def test_milp_policies_and_mixed_plans_train_the_same(name: str) -> None:
    """Per-call MILP policies (``op@K``), mixed with keep and recompute, in fp64."""
    wl = WORKLOADS[name]()
    wl.model.double()
    ops = capture_ops(wl, batch_size=3, dtype=torch.float64, repeats=1)
    actions = [Option.SELECTIVE, Option.KEEP, Option.RECOMPUTE, Option.SELECTIVE]
    blocks = []
    for i, (d, bo) in enumerate(zip(policy_plan(wl.model, "none").blocks, ops.blocks, strict=True)):
        a = actions[i % len(actions)]
        pol = solve_block_milp(bo, bo.saved_bytes // (2 + i % 3)).policy if a is Option.SELECTIVE else None
        blocks.append(BlockDecision(name=d.name, option=a, policy=pol))
    if name == "hf:gpt2":  # four addmm per block: the MILP picks single calls
        assert any("@" in (b.policy or "") for b in blocks)
    assert_same_training(wl, policy_plan(wl.model, "none").with_(blocks=tuple(blocks)), batch_size=3)


def test_batchnorm_statistics_and_counter_move_once_under_selective() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()),
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
        nn.Linear(4, 1),
    )
    ref = copy.deepcopy(model)
    apply_plan(model, policy_plan(model, Selective(preset="save_matmuls")))
    for _ in range(2):
        x = torch.randn(16, 4) + 3.0
        model(x).sum().backward()
        ref(x).sum().backward()
    assert model[0][1].num_batches_tracked.item() == 2
    for (n, b), r in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, r), n


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_counts(wl, plan) -> dict[str, int]:
    torch.manual_seed(0)
    batch = wl.make_batch(3)
    apply_plan(wl.model, plan)
    try:
        loss = wl.loss_fn(wl.model, batch)
        loss = loss[0] if isinstance(loss, tuple) else loss
        with _CountOps() as c:
            loss.backward()
    finally:
        remove_plan(wl.model)
    return c.counts


def test_selective_recomputes_the_cheap_ops_and_not_the_matmuls() -> None:
    """Count forward ops run during backward: save_matmuls re-runs layer norms but no addmm."""
    wl = WORKLOADS["hf:gpt2"]()
    n = len(policy_plan(wl.model, "none").blocks)
    keep = _backward_counts(wl, policy_plan(wl.model, "none"))
    full = _backward_counts(wl, policy_plan(wl.model, "all"))
    sel = _backward_counts(wl, policy_plan(wl.model, Selective(preset="save_matmuls")))
    ln = "aten.native_layer_norm.default"
    assert keep.get(ln, 0) == 0 and full[ln] == 2 * n and sel[ln] == 2 * n
    assert keep.get("aten.addmm.default", 0) == 0 and sel.get("aten.addmm.default", 0) == 0
    assert full["aten.addmm.default"] == 4 * n  # GPT-2's Conv1D: four addmm per block


def test_selective_peak_lies_between_recompute_and_keep() -> None:
    wl = WORKLOADS["demo"]()
    peaks = {
        p: verify(wl, plan, step=StepSpec(batch_size=4, repeats=0))
        for p, plan in {
            "none": policy_plan(wl.model, "none"),
            "all": policy_plan(wl.model, "all"),
            "sel": policy_plan(wl.model, Selective(preset="save_matmuls")),
        }.items()
    }
    assert all(r.ok for r in peaks.values())
    assert peaks["all"].measured_peak_bytes < peaks["sel"].measured_peak_bytes < peaks["none"].measured_peak_bytes


def test_deepcopy_of_a_selective_model_trains_on_its_own() -> None:
    wl = kw_workload()
    apply_plan(wl.model, policy_plan(wl.model, Selective(ops=("aten.addmm.default@0",))))
    clone = copy.deepcopy(wl.model)
    batch = wl.make_batch(2)
    wl.loss_fn(clone, batch).backward()
    assert all(p.grad is None for p in wl.model.parameters())
    assert all(p.grad is not None for p in clone.parameters())


# --- the per-block MILP against brute force -------------------------------------------------------


def random_block(n: int, seed: int) -> BlockOps:
    rng = random.Random(seed)
    calls = []
    for j in range(n):
        cacheable = rng.random() > 0.2
        b = rng.randint(1, 40) * 1024 if cacheable or rng.random() < 0.5 else 0
        calls.append(
            OpCall(
                op=("aten.mul.Tensor", "aten.add.Tensor", "aten.mm.default")[j % 3],
                index=j // 3,
                category="other",
                shapes=((b // 4,),),
                dtype="float32",
                out_bytes=b,
                saved_bytes=b,
                time_s=rng.uniform(1e-4, 5e-3),
                flops=rng.randint(0, 10**6),
                cheap=True,
                cacheable=cacheable and b > 0,
            )
        )
    return BlockOps(name="b", calls=tuple(calls), saved=(), fwd_s=sum(c.time_s for c in calls))


@pytest.mark.parametrize("seed", range(5))
def test_milp_matches_brute_force(seed: int) -> None:
    blk = random_block(12, seed)
    total_b = sum(c.out_bytes for c in blk.calls if c.cacheable)
    cand = [j for j, c in enumerate(blk.calls) if c.cacheable]
    for allot in (0, total_b // 5, total_b // 2, total_b - 1, total_b, 10 * total_b):
        best = max(
            sum(blk.calls[j].time_s for j in sub)
            for r in range(len(cand) + 1)
            for sub in itertools.combinations(cand, r)
            if sum(blk.calls[j].out_bytes for j in sub) <= allot
        )
        got = solve_block_milp(blk, allot)
        assert got.cached_bytes <= allot
        assert got.saved_s == pytest.approx(best, abs=1e-9), (allot, got)
        assert got.recompute_s == pytest.approx(blk.fwd_s - best, abs=1e-9)
        assert all(blk.calls[j].cacheable for j in got.calls)
        assert set(got.calls) == {
            j for j, c in enumerate(blk.calls) if parse_save_policy(got.policy).saves(c.op, c.index)
        }
    assert solve_block_milp(blk, 10 * total_b).calls == tuple(cand)  # non-binding: cache everything


def test_policy_text_names_an_op_alone_when_all_its_calls_are_chosen() -> None:
    blk = random_block(6, 0)  # mul at calls 0 and 3, add at 1 and 4, mm at 2 and 5
    assert policy_text(blk, [0, 3, 4]) == "save:aten.mul.Tensor,aten.add.Tensor@1"


# --- the chain solver with several options per block, against brute force ----------------------------

OPTIONS = ("keep", "recompute", "selective:a", "selective:b", "offload")


def random_costs(n: int, seed: int, *, segments: bool, margin: float = 0.0) -> ChainCosts:
    rng = random.Random(seed)
    options = []
    for i in range(n):
        out = rng.randint(1, 20)
        keep_d = out + rng.randint(20, 60)
        base = rng.randint(-10, 40)
        opts = {
            "keep": OptionCost(
                retained_bytes=keep_d,
                fwd_peak_bytes=keep_d + rng.randint(0, 30),
                bwd_peak_bytes=rng.randint(0, 50),
                bwd_base_bytes=base,
                extra_s=0.0,
            ),
            "recompute": OptionCost(
                retained_bytes=out,
                fwd_peak_bytes=out + rng.randint(0, 40),
                bwd_peak_bytes=rng.randint(20, 120),
                bwd_base_bytes=base + rng.randint(-3, 3),
                extra_s=rng.uniform(0.5, 1.0),
            ),
        }
        for k, name in enumerate(("selective:a", "selective:b")):
            d = out + rng.randint(1, keep_d - out)
            opts[name] = OptionCost(
                retained_bytes=d,
                fwd_peak_bytes=d + rng.randint(0, 40),
                bwd_peak_bytes=rng.randint(10, 100),
                bwd_base_bytes=base + rng.randint(-3, 3),
                extra_s=rng.uniform(0.05, 0.6),
                policy=f"save:aten.mm.default@{i + k}" if name.endswith("b") else "save_matmuls",
            )
        opts["offload"] = OptionCost(
            retained_bytes=out + rng.randint(0, 5),
            fwd_peak_bytes=keep_d,
            bwd_peak_bytes=rng.randint(10, 80),
            bwd_base_bytes=base,
            extra_s=rng.uniform(0.1, 0.9),
        )
        options.append(opts)
    return ChainCosts(
        names=tuple(str(i) for i in range(n)),
        options=tuple(options),
        start_bytes=rng.randint(0, 100),
        pre_peak_bytes=rng.randint(0, 100),
        head_peak_bytes=rng.randint(0, 100),
        post_peak_bytes=rng.randint(0, 150),
        base_step_s=1.0,
        segments_allowed=segments,
        margin=margin,
    )


def all_plans(costs: ChainCosts, segments: bool):
    n = len(costs)
    for fam in laminar_families(n) if segments else [()]:
        inside = {i for s, t in fam for i in range(s, t)}
        choices = [("keep", "recompute") if i in inside else OPTIONS for i in range(n)]
        for opts in itertools.product(*choices):
            yield Plan(
                policy="brute",
                chain_path="",
                blocks=tuple(costs.decision(i, o) for i, o in enumerate(opts)),
                segments=tuple(Segment(start=s, stop=t) for s, t in fam),
            )


def check_against_brute_force(costs: ChainCosts, segments: bool) -> None:
    table = [(predict(costs, p).peak_with_margin_bytes, predict(costs, p).step_s) for p in all_plans(costs, segments)]
    lo = min(peak for peak, _ in table)
    hi = max(peak for peak, _ in table)
    budgets = sorted(
        {
            lo - 1,
            lo,
            (lo + hi) // 2,
            (2 * lo + hi) // 3,
            (lo + 2 * hi) // 3,
            hi,
            *(peak for peak, _ in table[:: max(1, len(table) // 9)]),
        }
    )
    for budget in budgets:
        fits = [t for peak, t in table if peak <= budget]
        if not fits:
            with pytest.raises(BudgetInfeasibleError) as err:
                solve(costs, budget, segments=segments)
            assert err.value.min_budget_bytes == lo
            continue
        sol = solve(costs, budget, segments=segments)
        assert sol.prediction.peak_with_margin_bytes <= budget
        assert sol.prediction.step_s == pytest.approx(min(fits), abs=1e-9), (budget, sol)
    assert min_budget(costs, segments=segments)[0] == lo


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))])  # ~2 s each
@pytest.mark.slow  # about 5 s on 2 cores: the fast tier keeps to about 4 minutes
def test_five_options_per_block_match_brute_force(seed: int) -> None:
    check_against_brute_force(random_costs(6, seed, segments=False), segments=False)


@pytest.mark.parametrize("seed", range(3))
def test_five_options_with_segments_match_brute_force(seed: int) -> None:
    check_against_brute_force(random_costs(4, 50 + seed, segments=True, margin=0.03), segments=True)


def test_solution_maps_back_to_decisions_and_the_planner_picks_options() -> None:
    costs = random_costs(6, 9, segments=False)
    for budget in (min_budget(costs)[0], 10**9):
        sol = solve(costs, budget)
        plan = Plan(policy="x", chain_path="", blocks=tuple(costs.decision(i, o) for i, o in enumerate(sol.options)))
        assert predict(costs, plan) == sol.prediction
        for i, (o, d) in enumerate(zip(sol.options, plan.blocks, strict=True)):
            assert costs.option_of(i, d) == o
            if o == "selective:b":
                assert d.policy == f"save:aten.mm.default@{i + 1}"
    with pytest.raises(PlanMismatchError, match="did not calibrate"):
        predict(
            costs.restricted(block_only=True),
            policy_plan(nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)]), Selective(preset="save_matmuls")),
        )


# --- profile, cost model and planner with selective options ----------------------------------------


@pytest.fixture(scope="module")
def demo_stats():
    wl = load_workload("demo?n_layer=4&n_embd=32&seq_len=32")
    return wl, profile(wl, step=StepSpec(batch_size=4, repeats=1))


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_profile_calibrates_distinct_selective_options_and_predicts_mixed_plans_exactly(demo_stats) -> None:
    """The calibration measures one option on every block at a time; plans that mix a different
    option on each block (never measured while calibrating) are predicted to the byte of their
    measured peak (measured as they run, by verify)."""
    wl, stats = demo_stats
    options = list(stats.blocks[0].options)
    assert options[:2] == ["keep", "recompute"] and any(m.startswith("selective:milp-") for m in options)
    assert any(m.startswith("selective:save_") for m in options)
    assert "offload" in stats.calibration.dropped_options  # CPU: never offered
    costs = ChainCosts.from_stats(stats)
    for shift in range(0, len(options), 3):  # each block its own option, rotated: none of them calibrated
        mixed = [options[(i + shift) % len(options)] for i in range(len(costs))]
        assert len(set(mixed)) == len(costs)
        plan = policy_plan(wl.model, "none").with_(blocks=tuple(costs.decision(i, m) for i, m in enumerate(mixed)))
        measured = verify(wl, plan, step=StepSpec(batch_size=4, repeats=0))
        assert measured.ok and predict(costs, plan).peak_bytes == measured.measured_peak_bytes, mixed


def test_mixed_plans_peaks_hold_and_selective_never_slows_the_planner(demo_stats) -> None:
    """Plans mixing selective options with keep and recompute: measured peaks within 5 % of the
    prediction and within the budget. Selective options are made cheap in time so that the solver
    uses them whatever the machine's timing noise (the peaks do not depend on seconds)."""
    wl, stats = demo_stats
    costs = ChainCosts.from_stats(stats)
    cheap = replace(
        costs,
        options=tuple(
            {k: replace(v, extra_s=v.extra_s * 0.01) if k.startswith("selective") else v for k, v in o.items()}
            for o in costs.options
        ),
    )
    full = stats.peak_bytes
    low = stats.measured_peak_bytes_by_option["recompute"]
    used = set()
    for frac in (0.2, 0.45, 0.7):
        budget = int(low + frac * (full - low))
        sol = solve(cheap, budget)
        plan = plan_from_solution(
            sol, cheap, chain_path=stats.chain_path, fingerprint=stats.fingerprint, budget_bytes=budget
        )
        used |= {b.option for b in plan.blocks}
        out = verify(wl, plan, step=StepSpec(batch_size=4, repeats=0))
        assert out.ok, out
        assert out.measured_peak_bytes <= budget
        assert abs(out.measured_peak_bytes - plan.predicted_peak_bytes) <= 0.05 * out.measured_peak_bytes
    assert Option.SELECTIVE in used
    res = plan_for_budget(wl, int(low + 0.5 * (full - low)), stats=stats)  # the real planner, end to end
    assert verify(wl, res.plan, step=StepSpec(batch_size=4, repeats=0)).ok
    budget = int(low + 0.5 * (full - low))
    assert solve(costs, budget).prediction.step_s <= solve(costs.restricted(block_only=True), budget).prediction.step_s


def test_capture_matches_what_torch_saves_and_runs() -> None:
    wl = load_workload(BUILTIN["hf:gpt2"], seq_len=32)
    torch.manual_seed(0)
    batch = cast_batch(wl.make_batch(2))
    ops = capture_ops(wl, batch=batch, repeats=1)
    blk = ops.blocks[0]
    addmm = [c for c in blk.calls if c.op == "aten.addmm.default"]
    assert [c.index for c in addmm] == [0, 1, 2, 3] and all(
        c.category == "matmul" and not c.cheap and c.flops > 0 for c in addmm
    )
    views = [c for c in blk.calls if c.op == "aten.view.default"]
    assert views and all(c.out_bytes == 0 and not c.cacheable for c in views)
    assert any(c.category == "inplace" for c in blk.calls)  # dropout's bernoulli_
    assert blk.saved[0].op == "input" and blk.saved_bytes == sum(s.bytes for s in blk.saved)


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("preset", SELECTIVE_PRESETS)
def test_cuda_presets_train_the_same(preset: str) -> None:
    wl = load_workload(BUILTIN["hf:llama"], seq_len=64)
    res = verify(
        wl,
        policy_plan(wl.model, Selective(preset=preset)),
        step=StepSpec(batch_size=3, repeats=0, device="cuda", dtype=torch.float64),
    )
    assert res.ok, res
