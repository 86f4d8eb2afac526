"""The PNG of ``memfit demo``: drawn from the run :mod:`memfit.training.demo` measured."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit.fitting.result import FitResult
    from memfit.training.config import DemoRun

__all__ = ["demo_plot"]


def demo_plot(path: str | Path, run: DemoRun, *, baseline_bytes: int, budget_bytes: int, fit: FitResult) -> str | None:
    """Draw the demo's PNG: the loss curve, peak memory (without memfit, predicted, measured) and
    the auto-fit's candidates.

    Args:
        path: the PNG to write (its folder is created).
        run: the training run.
        baseline_bytes: measured peak of a plain step of the global batch.
        budget_bytes: the budget the fit was made for.
        fit: the auto-fit's result.

    Returns:
        The PNG's path, or None without matplotlib (``pip install memfit[plot]``).
    """
    losses, need, budget, peak = run.losses, baseline_bytes, budget_bytes, run.measured_peak_bytes
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [2, 1.2, 1.2]})
    ax1.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("loss (nats per byte)")
    ax1.set_title(f"training: micro-batch {fit.micro_batch} x {fit.accumulation_steps}")
    ax1.grid(alpha=0.3)
    vals = [need / 2**20, fit.predicted_peak_bytes / 2**20, (peak or 0) / 2**20]
    bars = ax2.bar(
        ["without\nmemfit", "memfit\npredicted", "memfit\nmeasured"], vals, color=["#999999", "#9ec3f0", "#3b7dd8"]
    )
    ax2.axhline(budget / 2**20, color="#d62728", ls="--", lw=1, label=f"budget {budget / 2**20:.0f} MiB")
    for b, v in zip(bars, vals, strict=True):
        ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("peak memory of a step (MiB)")
    ax2.set_title("memory")
    ax2.legend(fontsize=8)
    feas = [c for c in fit.candidates if c.feasible]
    ax3.scatter(
        [c.micro_batch for c in feas],
        [c.predicted_samples_per_s for c in feas],
        s=18,
        color="#3b7dd8",
        label="predicted (fits)",
    )
    ax3.scatter(
        [fit.micro_batch], [fit.predicted_samples_per_s], s=80, facecolors="none", edgecolors="#d62728", label="chosen"
    )
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("micro-batch")
    ax3.set_ylabel("samples/s")
    ax3.set_title("auto-fit candidates")
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
