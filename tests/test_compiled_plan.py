"""Compiled planning (memfit.fitting.compiled): the fastest plan whose *compiled* step fits a budget.

References: brute force over the fraction grid for the bisection; for the planner, the chosen plan
applied again from its JSON file to a fresh copy of the model and measured on its own (profiler),
its gradients against the unmodified model run eagerly, and the model's state before planning
(bitwise). Compiles with ``aot_eager_decomp_partition``: inductor's min-cut partitioner (the one
``activation_memory_budget`` steers) without code generation, so a compile takes about a second.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from memfit import StepSpec
from memfit.apply import apply_plan, remove_plan
from memfit.apply.compiled import MemoryBudgetBackend, compile_plan
from memfit.capture.compiled import profiled_step_peak_bytes
from memfit.capture.step import make_optimizer, warm_up
from memfit.cli.main import main
from memfit.errors import BudgetInfeasibleError, PlanMismatchError, SpecError
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.compiled import plan_compiled
from memfit.fitting.compiled_bench import CompiledCandidate, choose, largest_fitting_fraction
from memfit.models.registry import load_workload
from memfit.plan import Plan, policy_plan
from memfit.plan.details import CompileSettings
from memfit.plan.options import BASE_OPTIONS
from memfit.profiling.blocks import profile
from memfit.verification.gradients import compare_gradients, model_grads
from memfit.workload import Workload

BACKEND = "aot_eager_decomp_partition"
WIDE_LM = f"{__file__}:wide_lm"


class Block(nn.Module):
    """A residual MLP block whose hidden activations (4x wide) dominate the step's memory."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))  # (B, T, d)


class WideLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # (B, T, V)


def _batch(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch_size, 32))


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())


def wide_lm() -> tuple[nn.Module, object, object]:
    """The file workload the CLI test loads."""
    torch.manual_seed(0)
    return WideLM(), _batch, _loss


def _workload() -> Workload:
    torch.manual_seed(0)
    return Workload(name="wide-lm", model=WideLM(), make_batch=_batch, loss_fn=_loss, default_batch_size=16)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_peak(wl: Workload, plan: Plan | None = None, *, fraction: float | None = None) -> int:
    """The compiled step's peak on a fresh copy, by the profiler (``plan`` with its compile settings,
    or the unmodified model compiled at ``fraction``)."""
    model = copy.deepcopy(wl.model)
    opt = make_optimizer(model, "adamw", lr=1e-6)
    torch.manual_seed(0)
    batch = wl.make_batch(wl.default_batch_size)
    warm_up(model, batch, wl.loss_fn, opt, seed=0)
    if plan is not None:
        undo = compile_plan(model, plan)
    else:
        model.compile(backend=MemoryBudgetBackend(fraction if fraction is not None else 1.0, BACKEND))
        undo = None
    profiled_step_peak_bytes(model, batch, wl.loss_fn, opt, seed=0)  # compiles
    peak = profiled_step_peak_bytes(model, batch, wl.loss_fn, opt, seed=0)
    if undo is not None:
        undo()
    return peak


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_fraction_bisection_is_the_brute_force_on_its_grid(steps: int) -> None:
    """Monotone peaks: the largest fitting fraction on the grid k / 2**steps (or 1.0), with at most
    steps + 1 measurements; when none on the grid fits, the first of 2**-(steps + j), j = 1..steps,
    that does (at most 2 * steps + 1 measurements); non-monotone: whatever it returns was measured
    to fit."""
    rng = random.Random(steps)
    for _ in range(200):
        a, b = rng.uniform(10, 100), rng.uniform(0, 200)
        budget = rng.uniform(0, 320)
        calls: list[float] = []

        def peak(f: float, a: float = a, b: float = b, calls: list[float] = calls) -> int:
            calls.append(f)
            return int(a + b * f)

        got = largest_fitting_fraction(peak, int(budget), steps=steps)
        grid = [1.0] + [k / 2**steps for k in range(2**steps - 1, 0, -1)]
        descent = [2.0 ** -(steps + j) for j in range(1, steps + 1)]
        want = next((f for f in grid + descent if int(a + b * f) <= int(budget)), None)
        assert got == want, (a, b, budget)
        on_grid = want is not None and want >= 2.0**-steps
        assert len(calls) <= (steps + 1 if on_grid else 2 * steps + 1) and len(set(calls)) == len(calls)
        bumpy = {
            f: rng.choice([None, rng.randint(0, 400)])
            for f in [1.0] + [k / 2**steps for k in range(1, 2**steps)] + descent
        }
        got = largest_fitting_fraction(bumpy.__getitem__, 200, steps=steps)
        assert got is None or (bumpy[got] is not None and bumpy[got] <= 200)


@pytest.mark.parametrize("steps", [2, 3])
def test_a_fraction_search_that_leaves_the_budget_unused_bisects_on(steps: int) -> None:
    """slack: past the grid, the bisection goes on while the fitting peak leaves more than the slack
    of the budget unused (at most steps more compiles); it never ends below the grid's answer, and
    where nothing on the grid fits it descends as before."""
    rng = random.Random(steps)
    for _ in range(200):
        a, b, budget = rng.uniform(10, 100), rng.uniform(0, 200), rng.uniform(0, 320)

        def peak(f: float, a: float = a, b: float = b) -> int:
            return int(a + b * f)

        calls: list[float] = []
        grid = largest_fitting_fraction(peak, int(budget), steps=steps)
        got = largest_fitting_fraction(
            lambda f, calls=calls, peak=peak: calls.append(f) or peak(f), int(budget), steps=steps, slack=0.05
        )
        assert len(set(calls)) == len(calls) <= 2 * steps + 1
        if grid is None or grid == 1.0 or grid < 2.0**-steps:  # nothing to refine: the same search
            assert got == grid
            continue
        assert got is not None and got >= grid and peak(got) <= int(budget)
        assert peak(got) >= 0.95 * int(budget) or len(calls) == 2 * steps + 1, (a, b, budget, calls)
    # The peaks measured on the 24-layer GPT-2 (frontier.py, 241 MiB budget), linear between them.
    measured = [(0.0, 150.0), (0.25, 212.0), (0.3, 233.0), (0.375, 243.0), (0.5, 289.0), (1.0, 463.0)]

    def gpt2_24(f: float) -> int:
        (f0, p0), (f1, p1) = next(
            (lo, hi) for lo, hi in zip(measured, measured[1:], strict=False) if lo[0] <= f <= hi[0]
        )
        return int(p0 + (p1 - p0) * (f - f0) / (f1 - f0))

    assert largest_fitting_fraction(gpt2_24, 241, steps=3) == 0.25
    got = largest_fitting_fraction(gpt2_24, 241, steps=3, slack=0.05)
    assert got is not None and got > 0.3 and gpt2_24(got) <= 241


@pytest.mark.slow
def test_the_fraction_reaches_the_partitioner() -> None:
    """MemoryBudgetBackend's fraction changes what the compiled step keeps: measured lower at 0.1
    than at 1.0 (a backend that dropped the fraction would measure them equal)."""
    wl = _workload()
    assert _compiled_peak(wl, fraction=0.1) < 0.9 * _compiled_peak(wl, fraction=1.0)


def test_the_compilers_own_set_up_stays_unless_memfits_gains_min_gain() -> None:
    """The choice between timed candidates: the fastest round by round against the compiler's own,
    but a candidate of memfit's that gains less than min_gain leaves the compiler's own chosen."""
    wl = _workload()
    keep, rec = policy_plan(wl.model, "none"), policy_plan(wl.model, "all")

    def cand(name: str, kind: str, plan: Plan, f: float, vs: float | None, step: float) -> CompiledCandidate:
        return CompiledCandidate(
            name=name,
            kind=kind,
            plan=plan,
            activation_memory_budget=f,
            peak_bytes=100,
            step_s=step,
            time_vs_compiler=vs,
        )

    own, lower = (
        cand("compiler f=0.5", "compiler", keep, 0.5, 1.0, 0.10),
        cand("compiler f=0.25", "compiler", keep, 0.25, 1.01, 0.101),
    )
    for vs, min_gain, chosen in [
        (0.99, 0.02, own.name),
        (0.97, 0.02, "memfit"),
        (0.99, 0.0, "memfit"),
        (1.2, 0.0, own.name),
    ]:
        memfit = cand("memfit", "memfit", rec, 1.0, vs, 0.099)  # its median step time is the lowest in every case
        best, note = choose([lower, own, memfit], min_gain)
        assert best.name == chosen, (vs, min_gain)
        assert (note is not None) == (best is own and vs < 1.0), note
    # No compiler candidate fits: the lowest median time.
    best, note = choose(
        [
            cand("memfit", "memfit", rec, 1.0, None, 0.2),
            cand("memfit+compiler", "memfit+compiler", rec, 0.5, None, 0.1),
        ],
        0.02,
    )
    assert best.name == "memfit+compiler" and note is None
    with pytest.raises(SpecError, match="min_gain"):
        plan_compiled(wl, 1 << 30, min_gain=1.0)


@pytest.mark.slow
def test_candidates_compiled_to_the_same_graphs_are_one_program() -> None:
    """inductor: the backend records the partitioned graphs' code. The same fraction on two copies
    gives one digest; a fraction whose measured peak differs gives another; and in the planner a
    plan that changes nothing (memfit's plan at a budget everything fits) compiles to the compiler's
    own graphs: reported the same program, timed once."""
    wl = _workload()
    digests, peaks = [], []
    for f in (1.0, 1.0, 0.1):
        model = copy.deepcopy(wl.model)
        opt = make_optimizer(model, "adamw", lr=1e-6)
        backend = MemoryBudgetBackend(f)
        model.compile(backend=backend)
        batch = _batch(16)
        profiled_step_peak_bytes(model, batch, wl.loss_fn, opt, seed=0)  # compiles
        digests.append(backend.digest)
        peaks.append(profiled_step_peak_bytes(model, batch, wl.loss_fn, opt, seed=0))
        torch._dynamo.reset()
    assert digests[0] is not None and digests[0] == digests[1] and peaks[0] == peaks[1]
    assert peaks[2] < peaks[0] and digests[2] != digests[0]

    res = plan_compiled(
        wl, 4 * peaks[0], step=StepSpec(repeats=1), fraction_steps=1, replans=0, kinds=("compiler", "memfit")
    )
    own, memfit = res.candidates
    assert own.name == "compiler f=1" and memfit.kind == "memfit" and memfit.plan.is_plain
    assert memfit.same_as == own.name and memfit.digest == own.digest and memfit.step_s == own.step_s
    assert res.chosen.name == own.name


@pytest.mark.slow
def test_compiled_plan_fits_reproduces_from_its_file_and_has_eager_gradients(tmp_path: Path) -> None:
    wl = _workload()
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    stats = profile(wl, step=StepSpec(repeats=1))
    lo, hi = _compiled_peak(wl, fraction=0.1), _compiled_peak(wl, fraction=1.0)
    budget = (lo + hi) // 2  # the compiled step without recompute does not fit
    res = plan_compiled(wl, budget, backend=BACKEND, stats=stats, step=StepSpec(repeats=1), fraction_steps=2)
    assert all(torch.equal(v, before[k]) for k, v in wl.model.state_dict().items())  # planning left the model as it was
    assert res.chosen.peak_bytes is not None and res.chosen.peak_bytes <= budget
    assert {c.kind for c in res.candidates} >= {"compiler", "memfit"}
    fitting = [c for c in res.candidates if c.step_s is not None]
    # the fastest fitting one against the compiler's own round by round, or the compiler's own
    # when nothing gains 2 % over it
    own = max((c for c in fitting if c.kind == "compiler"), key=lambda c: c.activation_memory_budget)
    fastest = min(fitting, key=lambda c: c.time_vs_compiler)
    assert own.time_vs_compiler == 1.0
    assert res.chosen.name == (fastest.name if fastest.time_vs_compiler <= 0.98 else own.name)
    assert all(c.peak_bytes is not None and c.peak_bytes <= budget for c in fitting)
    settings = res.plan.compile_settings
    assert settings is not None
    assert settings.mode == "model" and settings.backend == BACKEND and 0 < settings.activation_memory_budget <= 1
    assert res.plan.predicted_peak_bytes == res.chosen.peak_bytes

    path = tmp_path / "plan.json"
    res.plan.save(path)
    plan = Plan.load(path)
    again = _compiled_peak(wl, plan)  # applied from the file to a fresh copy, measured on its own
    assert again <= budget
    assert abs(again - res.chosen.peak_bytes) <= 0.02 * budget

    model, ref = copy.deepcopy(wl.model).double(), copy.deepcopy(wl.model).double()
    torch.manual_seed(1)
    idx = _batch(4)
    _loss(ref, idx).backward()
    undo = compile_plan(model, plan)
    _loss(model, idx).backward()
    undo()
    cmp = compare_gradients(model_grads(model), model_grads(ref))
    assert cmp.ok(1e-9), (cmp.max_rel_err, cmp.worst_param)


@pytest.mark.slow
def test_memfit_head_and_activations_under_the_compilers_fraction_are_a_candidate() -> None:
    """When memfit's eager plan uses the chunked head or fused activations, those options alone
    (every block kept, no segment) are compiled at the largest fraction that fits, and timed when
    they fit: savings the compiler cannot make, with its cheap-op recompute for the rest."""
    wl = load_workload("hf:gpt2?n_layer=3&n_embd=64&n_head=2&vocab_size=4096", seq_len=64)
    stats = profile(wl, step=StepSpec(repeats=1), options=BASE_OPTIONS, tiling=False)
    budget = int(stats.peak_bytes * 0.7)  # memfit's eager plan: chunked head, fused GELU, a block recomputed
    eager = plan_for_budget(wl, budget, stats=stats).plan
    assert eager.head == "chunked" and eager.activations == "fused" and eager.recomputed
    res = plan_compiled(
        wl,
        budget,
        backend=BACKEND,
        stats=stats,
        step=StepSpec(repeats=1),
        fraction_steps=1,
        fraction_slack=0.0,
        replans=0,
        kinds=("memfit+compiler",),
    )
    opts = [c for c in res.candidates if c.name.startswith("memfit head/activations f=")]
    # The largest fraction first; bisected once only when it is over the budget.
    assert [c.activation_memory_budget for c in opts] == ([1.0, 0.5] if opts[0].peak_bytes > budget else [1.0])
    for c in opts:
        assert c.kind == "memfit+compiler" and (c.plan.head, c.plan.activations) == (eager.head, eager.activations)
        assert c.plan.is_plain is False and not c.plan.recomputed and not c.plan.segments
    assert budget >= opts[-1].peak_bytes and opts[-1].step_s is not None  # the fitting one was timed


@pytest.mark.slow
def test_the_chunked_head_compiles_under_a_memory_budget_fraction() -> None:
    """inductor with activation_memory_budget < 1: the chunked head's meta placeholder for the
    logits must not be a graph output (torch's partitioner raised "Node empty_strided_default
    didn't have `val` metadata"); compiled, the training call returns logits=None and the same
    loss and gradients as the chunked head eagerly."""
    wl = load_workload("hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=4096", seq_len=64)
    plan = policy_plan(wl.model, "none").with_(head="chunked")
    torch.manual_seed(0)
    batch = wl.make_batch(4)
    eager, compiled = (
        copy.deepcopy(wl.model).eval(),
        copy.deepcopy(wl.model).eval(),
    )  # dropout off: inductor's RNG is not eager's
    apply_plan(eager, plan)
    undo = compile_plan(
        compiled,
        plan.with_(compile_settings=CompileSettings(mode="model", backend="inductor", activation_memory_budget=0.5)),
    )
    labels = batch["input_ids"].clone()
    out = compiled(**batch, labels=labels)
    out.loss.backward()
    ref = eager(**batch, labels=labels)
    ref.loss.backward()
    undo(), remove_plan(eager)
    assert out.logits is None and ref.logits.device.type == "meta" and torch.allclose(out.loss, ref.loss, rtol=1e-5)
    cmp = compare_gradients(model_grads(compiled), model_grads(eager))
    assert cmp.ok(1e-4), (cmp.max_rel_err, cmp.worst_param)


@pytest.mark.parametrize("mode", [pytest.param("model", marks=pytest.mark.slow), "block"])
@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_a_budget_the_compiled_step_fits_recomputes_nothing(mode: str) -> None:
    wl = _workload()
    hi = _compiled_peak(wl, fraction=1.0)
    budget = int(hi * 1.05) if mode == "model" else 4 * hi  # compiled per block, the head and the loss run eagerly
    res = plan_compiled(
        wl, budget, mode=mode, backend=BACKEND, step=StepSpec(repeats=1), fraction_steps=1, kinds=("compiler",)
    )
    assert [c.name for c in res.candidates] == ["compiler f=1"]  # one compile, no bisection
    settings = res.plan.compile_settings
    assert settings is not None and settings.activation_memory_budget == 1.0 and not res.plan.recomputed
    assert settings.mode == mode and res.chosen.peak_bytes <= budget


@pytest.mark.slow
def test_an_infeasible_compiled_budget_says_the_lowest_measured() -> None:
    wl = _workload()
    params_bytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    with pytest.raises(
        BudgetInfeasibleError, match=r"no compiled plan fits .*the lowest compiled peak measured is"
    ) as err:
        plan_compiled(wl, params_bytes, backend=BACKEND, step=StepSpec(repeats=1), fraction_steps=1, replans=0)
    assert err.value.min_budget_bytes is not None and err.value.min_budget_bytes > params_bytes


def test_bad_arguments_and_eager_plans_are_refused() -> None:
    wl = _workload()
    with pytest.raises(SpecError, match="compile mode"):
        plan_compiled(wl, 1 << 30, mode="layer")
    with pytest.raises(SpecError, match="kinds"):
        plan_compiled(wl, 1 << 30, kinds=("sqrt",))
    with pytest.raises(PlanMismatchError, match="no compile settings"):
        compile_plan(wl.model, policy_plan(wl.model, "all"))
    with pytest.raises(SpecError, match="fraction"):
        MemoryBudgetBackend(1.5)


@pytest.mark.slow
def test_cli_plan_compile_writes_the_settings_and_verify_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = _workload()
    budget = (_compiled_peak(wl, fraction=0.1) + _compiled_peak(wl, fraction=1.0)) // 2
    path = tmp_path / "plan.json"
    args = ["plan", "--model", WIDE_LM, "--budget", str(budget), "--batch-size", "16", "--compile", "model"]
    args += ["--compile-backend", BACKEND, "--fraction-steps", "1", "--repeats", "1", "--out", str(path), "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_peak_bytes"] <= budget and out["compile"]["backend"] == BACKEND
    settings = Plan.load(path).compile_settings
    assert settings is not None and settings.to_dict() == out["compile"]
    assert (
        main(["verify", "--model", WIDE_LM, "--plan", str(path), "--batch-size", "16", "--repeats", "1", "--json"]) == 0
    )
    ver = json.loads(capsys.readouterr().out)
    assert ver["ok"] and ver["compile"] == "model"
    assert main(["plan", "--model", WIDE_LM, "--policy", "all", "--compile", "model", "--json"]) == 2
    assert "--compile" in json.loads(capsys.readouterr().out)["error"]
