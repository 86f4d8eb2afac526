"""Reports: the frontier is the solver's own staircase, the timeline's split adds up to the
tracker's live bytes, and ``--report`` draws for plan and fit the numbers it was given (read back
from the saved figure's artists) into a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.figure
import matplotlib.image
import pytest
import torch
from tiny_models import token_workload

from memfit import StepSpec
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.cli.main import main
from memfit.fitting import Candidate, FitResult, Measurement
from memfit.fitting.report_inputs import gather_fit_report
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.plan.costmodel import ChainCosts
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.solve import min_budget, solve
from memfit.profiling.blocks import profile
from memfit.profiling.timeline import record_timeline
from memfit.report import fit_report, frontier

DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"


pytestmark = pytest.mark.usefixtures("one_thread")


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def demo_costs() -> ChainCosts:
    wl = load_workload(DEMO_SMALL)
    return ChainCosts.from_stats(profile(wl, step=StepSpec(batch_size=4, repeats=1), options=BASE_OPTIONS))


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_frontier_is_the_solvers_staircase(demo_costs: ChainCosts) -> None:
    pts = frontier(demo_costs, grid=2)  # completeness from the front, not from a dense grid
    assert len(pts) >= 3
    need, smallest = min_budget(demo_costs)
    assert pts[0].predicted_peak_bytes == smallest.prediction.peak_bytes and pts[0].budget_bytes == need
    assert set(pts[-1].options) == {"keep"} and pts[-1].segments == ()  # store-all is the fastest
    for a, b in zip(pts, pts[1:], strict=False):
        assert a.predicted_peak_bytes < b.predicted_peak_bytes and a.predicted_step_s > b.predicted_step_s
    # Whatever budget the solver is given, its answer is a point of the frontier.
    on_frontier = {(p.options, p.segments) for p in pts}
    lo, hi = need, int(pts[-1].predicted_peak_bytes * 1.1)
    for i in range(150):
        sol = solve(demo_costs, lo + (hi - lo) * i // 149)
        assert (sol.options, sol.segments) in on_frontier


@pytest.mark.parametrize("micro_batch", [None, 3])
def test_timeline_parts_add_up_to_live_bytes(micro_batch: int | None) -> None:
    wl = load_workload(DEMO_SMALL)
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    tl = record_timeline(wl, policy_plan(wl.model, "all"), batch_size=8, micro_batch=micro_batch)
    torch.testing.assert_close(wl.model.state_dict(), before, rtol=0, atol=0)  # the model is put back
    pb = param_bytes(wl.model)
    assert tl.params_bytes == pb + sum(b.numel() * b.element_size() for b in wl.model.buffers())
    n_params = len(list(wl.model.parameters()))
    assert tl.optimizer_bytes == 2 * pb + 4 * n_params  # AdamW: two moments and a float32 step each
    assert tl.grads_bytes[-1] == pb  # every gradient exists once backward is done
    assert all(a <= b for a, b in zip(tl.grads_bytes, tl.grads_bytes[1:], strict=False))
    base = tl.params_bytes + tl.optimizer_bytes
    assert all(live - base - g >= 0 for live, g in zip(tl.live_bytes, tl.grads_bytes, strict=True))  # nothing clipped
    assert max(tl.live_bytes) == tl.peak_bytes
    phases = [p for i, p in enumerate(tl.phase) if p and (i == 0 or tl.phase[i - 1] != p)]
    k = 1 if micro_batch is None else 3
    assert tl.micro_steps == k and phases == ["forward", "backward"] * k + ["optimizer"]


def test_timeline_peak_matches_a_measured_step() -> None:
    """One step without accumulation: the same peak as memfit's step measurement (to a few scalars)."""
    wl = load_workload(DEMO_SMALL)
    tl = record_timeline(wl, None, batch_size=8, seed=3)
    model = wl.model
    opt = make_optimizer(model)
    torch.manual_seed(3)
    batch = wl.make_batch(8)
    warm_up(model, batch, wl.loss_fn, opt, seed=3)
    ref = measure_step(model, batch, wl.loss_fn, opt, seed=3)
    assert abs(tl.peak_bytes - ref.peak_bytes) <= 64
    assert tl.optimizer_bytes == ref.optimizer_bytes and tl.params_bytes == ref.params_bytes


MIB = 2**20


def png_shape(path: Path) -> tuple[int, ...]:
    img = matplotlib.image.imread(path)
    assert float(img[..., :3].std()) > 0.05  # not blank
    return img.shape


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[matplotlib.figure.Figure]:
    """The figures the report saves, kept so that their artists' data can be read back."""
    figures: list[matplotlib.figure.Figure] = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(self: matplotlib.figure.Figure, *args: Any, **kwargs: Any) -> Any:
        figures.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def line(ax: Any, label_start: str) -> tuple[list[float], list[float]]:
    """(x, y) data of the one line of ``ax`` whose label starts with ``label_start``."""
    (found,) = [ln for ln in ax.get_lines() if ln.get_label().startswith(label_start)]
    return [float(v) for v in found.get_xdata()], [float(v) for v in found.get_ydata()]


def stack_tops_mib(ax: Any) -> dict[str, float]:
    """Highest point of each band of the timeline's stacked area, by band label (MiB)."""
    return {
        c.get_label(): max(float(p.vertices[:, 1].max()) for p in c.get_paths())
        for c in ax.collections
        if c.get_label() in STACK_LABELS
    }


STACK_LABELS = ("parameters", "optimizer state", "gradients", "activations & temporaries")


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.slow  # about 4 s on 2 cores: the fast tier keeps to about 4 minutes
def test_plan_report_draws_the_plan_the_command_printed(capsys, tmp_path: Path, drawn) -> None:
    """The frontier panel puts the chosen plan where `memfit plan` printed its prediction, on the
    staircase, left of the budget line; the timeline's bands start at the model's own parameter
    bytes and reach the peak that --measure measured for the plan."""
    spec = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=16"
    png = tmp_path / "plan.png"
    code = main(
        [
            "plan",
            "--model",
            spec,
            "--batch-size",
            "4",
            "--budget",
            "480KiB",
            "--repeats",
            "1",
            "--measure",
            "--report",
            str(png),
            "--json",
        ]
    )
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["report"] == str(png)
    h, w, _ = png_shape(png)
    assert w > 1500 and h > 600
    (fig,) = drawn
    ax_frontier, ax_timeline = fig.axes
    chosen = (res["predicted_peak_bytes"] / MIB, res["predicted_step_s"])
    xs, ys = line(ax_frontier, "chosen plan (")
    assert (xs, ys) == ([pytest.approx(chosen[0])], [pytest.approx(chosen[1])])
    xs, ys = line(ax_frontier, "best plan per budget")
    assert any(x == pytest.approx(chosen[0]) and y == pytest.approx(chosen[1]) for x, y in zip(xs, ys, strict=True))
    assert line(ax_frontier, "chosen plan, measured") == (
        [pytest.approx(res["measured_peak_bytes"] / MIB)],
        [pytest.approx(res["measured_step_s"])],
    )
    assert line(ax_frontier, "budget")[0] == [pytest.approx(res["budget_bytes"] / MIB)] * 2
    assert chosen[0] <= res["budget_bytes"] / MIB
    tops = stack_tops_mib(ax_timeline)
    assert tops["parameters"] == pytest.approx(model_bytes(load_workload(spec).model) / MIB)
    assert tops["activations & temporaries"] == pytest.approx(res["measured_peak_bytes"] / MIB, rel=0.01)


def test_fit_report_draws_the_fit_result(tmp_path: Path, drawn) -> None:
    """Every number of the fit result given is where it belongs: the feasible candidates' predicted
    samples/s and the measured window in the candidates panel, the measured point and the budget
    in the frontier panel; the timeline's bands are the model's parameter bytes below and the
    recorded step's peak on top."""
    wl = token_workload()
    plan = policy_plan(wl.model, "all")
    cands = [
        Candidate(micro_batch=b, accumulation_steps=-(-8 // b), sizes=(), feasible=b <= 4, plan=plan if b <= 4 else None,
                  predicted_peak_bytes=10**5 if b <= 4 else None, predicted_samples_per_s=100.0 * b if b <= 4 else None,
                  reason="" if b <= 4 else "needs 1 MiB")
        for b in (8, 4, 3, 2, 1)
    ]  # fmt: skip
    res = FitResult(
        budget_bytes=200_000,
        global_batch=8,
        micro_batch=4,
        accumulation_steps=2,
        predicted_peak_bytes=10**5,
        predicted_samples_per_s=400.0,
        measured_peak_bytes=101_000,
        measured_samples_per_s=380.0,
        plan=plan,
        candidates=tuple(cands),
        measurements=(
            Measurement(micro_batch=4, peak_bytes=101_000, window_s=8 / 380, samples_per_s=380.0, within_budget=True),
        ),
    )
    png = fit_report(tmp_path / "fit.png", res, gather_fit_report(wl, res))
    h, w, _ = png_shape(Path(png))
    assert h > 1000 and w > 1500  # three panels: frontier and candidates above, timeline below
    (fig,) = drawn
    ax_frontier, ax_candidates, ax_timeline = fig.axes
    assert line(ax_candidates, "predicted (fits the budget)") == ([1, 2, 3, 4], [100.0, 200.0, 300.0, 400.0])
    assert line(ax_candidates, "measured window") == ([4], [380.0])
    assert line(ax_candidates, "chosen: micro-batch 4 x 2") == ([4], [400.0])
    assert [c.get_label() for c in ax_candidates.patches] == ["does not fit the budget (micro-batch >= 8)"]
    assert line(ax_frontier, "chosen, measured window") == ([pytest.approx(101_000 / MIB)], [pytest.approx(8 / 380)])
    assert line(ax_frontier, "budget")[0] == [pytest.approx(200_000 / MIB)] * 2
    recorded = record_timeline(wl, plan, batch_size=8, micro_batch=4)
    tops = stack_tops_mib(ax_timeline)
    assert tops["parameters"] == pytest.approx(model_bytes(wl.model) / MIB)
    assert tops["activations & temporaries"] == pytest.approx(recorded.peak_bytes / MIB, rel=0.01)
