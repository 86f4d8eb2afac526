"""The report PNG: memory/time frontier, memory timeline of one step, and (for fit) the candidates.

Drawing only: the numbers come from :mod:`memfit.report.frontier`, :mod:`memfit.profiling.timeline`
and :class:`memfit.fitting.FitResult`. matplotlib is loaded lazily (``pip install memfit[plot]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.profiling.types import StepTimeline
from memfit.report.frontier import FrontierPoint

__all__ = ["Marker", "envelope", "plot_report", "timeline_x"]

MIB = 2**20
_PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fbe3d0", "optimizer": "#dcefd8"}
_STACK = (  # (label, color) bottom to top
    ("parameters", "#4c72b0"),
    ("optimizer state", "#8172b2"),
    ("gradients", "#dd8452"),
    ("activations & temporaries", "#55a868"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Marker:
    """A labelled point on the frontier panel: ``peak_bytes`` and ``step_s``."""

    label: str
    peak_bytes: int
    step_s: float


def plot_report(
    path: str | Path,
    *,
    title: str,
    frontier: Sequence[FrontierPoint],
    chosen: Marker,
    budget_bytes: int | None,
    timeline: StepTimeline,
    anchors: Sequence[Marker] = (),
    measured: Marker | None = None,
    time_label: str = "predicted step time (s)",
    candidates: Sequence[Any] = (),
    measurements: Sequence[Any] = (),
    chosen_micro_batch: int | None = None,
    notes: Mapping[str, str] | None = None,
) -> str:
    """Write the report PNG and return its path.

    Args:
        path: the PNG to write (folders are created).
        title: the figure's title.
        frontier: the planner's frontier (:func:`memfit.report.frontier.frontier`).
        chosen: the chosen plan's predicted point.
        budget_bytes: the budget, drawn as a vertical line (frontier) and a horizontal one (timeline).
        timeline: one recorded step (:func:`memfit.profiling.timeline.record_timeline`).
        anchors: baseline policies' predicted points (``none``, ``all``, ``sqrt``).
        measured: the chosen plan's measured point, if it was run.
        time_label: the frontier's y-axis label.
        candidates: for ``memfit fit``: :class:`memfit.fitting.Candidate` per micro-batch (a third
            panel: predicted samples/s against micro-batch).
        measurements: for ``memfit fit``: measured candidates (:class:`memfit.fitting.Measurement`).
        chosen_micro_batch: for ``memfit fit``: the chosen micro-batch.
        notes: short lines printed under the figure, ``{label: text}``.

    Raises:
        MemfitError: matplotlib is not installed.
    """
    plt = _pyplot()
    if candidates:  # frontier and candidates side by side, the timeline below across the width
        fig = plt.figure(figsize=(14.5, 10.5))
        grid = fig.add_gridspec(2, 2)
        ax_frontier, ax_candidates = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
        ax_timeline = fig.add_subplot(grid[1, :])
        _candidates_panel(ax_candidates, candidates, measurements, chosen_micro_batch)
    else:
        fig, (ax_frontier, ax_timeline) = plt.subplots(1, 2, figsize=(15, 5.8), gridspec_kw={"width_ratios": [1, 1.3]})
    _frontier_panel(ax_frontier, frontier, chosen, budget_bytes, anchors, measured, time_label)
    _timeline_panel(ax_timeline, timeline, budget_bytes, label="(c)" if candidates else "(b)")
    fig.suptitle(title, fontsize=13, fontweight="bold")
    if notes:
        fig.text(
            0.01,
            0.01,
            "   ".join(f"{k}: {v}" for k, v in notes.items()),
            fontsize=8.5,
            color="#444444",
            ha="left",
            va="bottom",
        )
    fig.tight_layout(rect=(0, 0.04 if notes else 0, 1, 0.95))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemfitError(
            "memfit.report: --report needs matplotlib. Install it with `pip install memfit[plot]`."
        ) from None
    return plt


def _frontier_panel(
    ax: Any,
    points: Sequence[FrontierPoint],
    chosen: Marker,
    budget_bytes: int | None,
    anchors: Sequence[Marker],
    measured: Marker | None,
    time_label: str,
) -> None:
    xs = [p.predicted_peak_bytes / MIB for p in points]
    ys = [p.predicted_step_s for p in points]
    # A staircase: from each plan, a larger peak buys nothing until the next plan.
    ax.step(xs, ys, where="post", color="#4c72b0", lw=1.5, label=f"best plan per budget ({len(points)} plans)")
    ax.plot(xs, ys, "o", color="#4c72b0", ms=3.5)
    if points:
        lo, hi = points[0], points[-1]
        ax.annotate(
            f"minimum: {lo.predicted_peak_bytes / MIB:.1f} MiB\n{lo.not_kept_blocks} blocks not kept",
            (lo.predicted_peak_bytes / MIB, lo.predicted_step_s),
            textcoords="offset points", xytext=(8, -4), fontsize=8.5, va="top",
        )  # fmt: skip
        ax.annotate(
            f"fastest: {hi.predicted_peak_bytes / MIB:.1f} MiB",
            (hi.predicted_peak_bytes / MIB, hi.predicted_step_s),
            textcoords="offset points", xytext=(-4, 16), fontsize=8.5, ha="right",
        )  # fmt: skip
    for i, a in enumerate(anchors):
        ax.plot(
            a.peak_bytes / MIB,
            a.step_s,
            marker="sD^v"[i % 4],
            ls="none",
            ms=7,
            mfc="white",
            mec="#555555",
            mew=1.3,
            label=a.label,
        )
    if measured is not None:
        ax.plot(measured.peak_bytes / MIB, measured.step_s, "X", color="#c44e52", ms=10, label=measured.label)
    ax.plot(
        chosen.peak_bytes / MIB, chosen.step_s, "*", color="#e8a33c", mec="black", ms=17, zorder=5, label=chosen.label
    )
    if budget_bytes:
        ax.axvline(budget_bytes / MIB, color="#c44e52", ls="--", lw=1.3, label=f"budget {budget_bytes / MIB:.1f} MiB")
    ax.set_xlabel("predicted peak memory of a step (MiB)")
    ax.set_ylabel(time_label)
    ax.set_title("(a) memory/time frontier (planner's predictions)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8.5, loc="upper right")


def _timeline_panel(ax: Any, tl: StepTimeline, budget_bytes: int | None, *, label: str) -> None:
    xs, unit = timeline_x(tl)
    scale = 1e-3 if unit == "ms" else 1.0
    x, idx = envelope(xs, tl.live_bytes)
    x = [v * scale for v in x]
    acts = tl.activations_bytes
    params = [tl.params_bytes / MIB] * len(x)
    opt = [tl.optimizer_bytes / MIB] * len(x)
    grads = [tl.grads_bytes[i] / MIB for i in idx]
    act = [acts[i] / MIB for i in idx]
    ax.stackplot(
        x,
        params,
        opt,
        grads,
        act,
        labels=[s[0] for s in _STACK],
        colors=[s[1] for s in _STACK],
        step="post",
        alpha=0.9,
        lw=0,
    )
    x = [v * scale for v in xs]
    # Phases as background bands, each labelled once.
    spans: list[tuple[str, float, float]] = []
    for xi, ph in zip(x, tl.phase, strict=True):
        if ph not in _PHASE_COLORS:
            continue
        if spans and spans[-1][0] == ph:
            spans[-1] = (ph, spans[-1][1], xi)
        else:
            spans.append((ph, xi, xi))
    labelled: set[str] = set()
    for ph, a, b in spans:
        ax.axvspan(
            a,
            max(b, a + (x[-1] - x[0]) / 1000),
            color=_PHASE_COLORS[ph],
            zorder=0,
            label=f"phase: {ph}" if ph not in labelled else None,
        )
        labelled.add(ph)
    peak_i = max(range(len(x)), key=lambda i: tl.live_bytes[i]) if x else None
    if peak_i is not None:
        ax.annotate(
            f"peak {tl.peak_bytes / MIB:.2f} MiB ({tl.phase[peak_i] or 'between phases'})",
            (x[peak_i], tl.live_bytes[peak_i] / MIB),
            textcoords="offset points", xytext=(14, 10), ha="left", fontsize=9, fontweight="bold",
            arrowprops={"arrowstyle": "-", "color": "black", "lw": 0.8},
        )  # fmt: skip
    if budget_bytes:
        ax.axhline(budget_bytes / MIB, color="#c44e52", ls="--", lw=1.3, label=f"budget {budget_bytes / MIB:.1f} MiB")
    top = max([tl.peak_bytes, budget_bytes or 0]) / MIB
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(x[0] if x else 0, x[-1] if x else 1)
    ax.set_xlabel(_TIMELINE_X[unit])
    ax.set_ylabel("live tensor memory (MiB)")
    what = f"batch {tl.batch_size}" + (
        f" = {tl.micro_steps} micro-steps of {tl.micro_batch}" if tl.micro_steps > 1 else ""
    )
    ax.set_title(f"{label} measured memory timeline of one step ({what})")
    ax.legend(fontsize=8, loc="upper right", ncol=2)


_TIMELINE_X = {
    "ms": "time into the step (ms), recorded under the memory tracker (which slows each op)",
    "op": "ops run in the step (each column: its highest sample)",
}


def timeline_x(tl: StepTimeline) -> tuple[list[int], str]:
    """Each sample's place on a timeline's x axis: microseconds from the step's start (``"ms"``
    axes divide by 1000), or the op count where the step recorded no times (``"op"``)."""
    if len(tl.time_s) == len(tl.op_index) and tl.time_s:
        return [round(t * 1e6) for t in tl.time_s], "ms"
    return list(tl.op_index), "op"


def envelope(op_index: Sequence[int], live: Sequence[int], columns: int = 700) -> tuple[list[float], list[int]]:
    """Per column of x (ops, or microseconds: :func:`timeline_x`), the sample with the most live
    bytes (so that a peak that lasts one op stays visible); a column without samples repeats the
    state the previous one ended in. Returns the columns' starting x and the chosen sample per column."""
    if not op_index:
        return [], []
    lo, hi = op_index[0], op_index[-1]
    width = max(1.0, (hi - lo + 1) / columns)
    n = int((hi - lo) / width) + 1
    best: list[int | None] = [None] * n
    last: list[int | None] = [None] * n
    for i, (o, b) in enumerate(zip(op_index, live, strict=True)):
        c = int((o - lo) / width)
        if best[c] is None or b > live[best[c]]:  # type: ignore[index]
            best[c] = i
        last[c] = i
    xs, idx = [], []
    carry = 0
    for c in range(n):
        i = best[c] if best[c] is not None else carry
        xs.append(lo + c * width)
        idx.append(i)
        carry = last[c] if last[c] is not None else carry
    xs.append(lo + n * width)  # close the last column
    idx.append(idx[-1])
    return xs, idx


def _candidates_panel(
    ax: Any, candidates: Sequence[Any], measurements: Sequence[Any], chosen_micro_batch: int | None
) -> None:
    feas = sorted((c for c in candidates if c.feasible), key=lambda c: c.micro_batch)
    infeas = sorted((c for c in candidates if not c.feasible), key=lambda c: c.micro_batch)
    ax.plot(
        [c.micro_batch for c in feas],
        [c.predicted_samples_per_s for c in feas],
        "o-",
        color="#4c72b0",
        ms=4,
        label="predicted (fits the budget)",
    )
    if measurements:
        ax.plot(
            [m.micro_batch for m in measurements],
            [m.samples_per_s for m in measurements],
            "X",
            color="#c44e52",
            ms=9,
            ls="none",
            label="measured window",
        )
    for c in feas:
        if c.micro_batch == chosen_micro_batch:
            ax.plot(
                c.micro_batch,
                c.predicted_samples_per_s,
                "*",
                color="#e8a33c",
                mec="black",
                ms=17,
                zorder=5,
                label=f"chosen: micro-batch {c.micro_batch} x {c.accumulation_steps}",
            )
    sizes = sorted(c.micro_batch for c in candidates)
    if infeas:
        first = infeas[0].micro_batch
        below = max((c.micro_batch for c in feas if c.micro_batch < first), default=first / 2)
        ax.axvspan(
            (below * first) ** 0.5,
            sizes[-1] * 1.3,
            color="#e6e6e6",
            zorder=0,
            label=f"does not fit the budget (micro-batch >= {first})",
        )
    ax.set_xscale("log", base=2)
    ticks = sizes if len(sizes) <= 12 else sorted({sizes[int(i * (len(sizes) - 1) / 11)] for i in range(12)})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("micro-batch size (samples per micro-step, log scale)")
    ax.set_ylabel("samples/s (optimizer steps over the global batch)")
    ax.set_title("(b) auto-fit candidates (predicted for every micro-batch size)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8.5)
