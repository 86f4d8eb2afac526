"""Reports: the frontier is the solver's own staircase, the timeline's split adds up to the
tracker's live bytes, and ``--report`` writes a PNG for plan and fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from memfit.autofit import Candidate, FitResult, Measurement
from memfit.capture.step import make_optimizer, measure_step, warm_up
from memfit.cli.main import main
from memfit.plan import policy_plan
from memfit.plan.calibrate import MODES
from memfit.plan.costmodel import ChainCosts
from memfit.plan.solve import min_budget, solve
from memfit.profiling import profile
from memfit.report import fit_report, frontier, record_timeline
from memfit.workload import load_workload

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import token_workload  # noqa: E402

DEMO_SMALL = "demo?n_layer=4&n_embd=32&seq_len=32"


pytestmark = pytest.mark.usefixtures("one_thread")


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def demo_costs() -> ChainCosts:
    wl = load_workload(DEMO_SMALL)
    return ChainCosts.from_stats(profile(wl, batch_size=4, repeats=1, modes=MODES))


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


def png_shape(path: Path) -> tuple[int, ...]:
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert float(img[..., :3].std()) > 0.05  # not blank
    return img.shape


def test_plan_report_png(capsys, tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    code = main(["plan", "--model", "demo?n_layer=2&n_embd=16&n_head=2&seq_len=16", "--batch-size", "4", "--budget", "480KiB", "--repeats", "1", "--report", str(png), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["report"] == str(png)
    h, w, _ = png_shape(png)
    assert w > 1500 and h > 600


def test_fit_report_png(tmp_path: Path) -> None:
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
        measurements=(Measurement(micro_batch=4, peak_bytes=101_000, window_s=8 / 380, samples_per_s=380.0, within_budget=True),),
    )
    png = fit_report(tmp_path / "fit.png", wl, res)
    h, w, _ = png_shape(Path(png))
    assert h > 1000 and w > 1500  # three panels: frontier and candidates above, timeline below
