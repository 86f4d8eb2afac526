"""The panels of the HTML report as JSON-ready dicts: the pieces :mod:`memfit.report.html` builds
its ``report_data`` from (recorded steps downsampled to columns, each peak by part, the blocks,
the frontier). Drawing only: nothing here measures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memfit.errors import PlanMismatchError
from memfit.fitting.types import ReportInputs, StepRecords
from memfit.plan.costmodel import ChainCosts, Prediction
from memfit.plan.types import Plan
from memfit.profiling.types import StepTimeline
from memfit.report.frontier import frontier, keep_all_plan, predict_point
from memfit.report.plots import envelope, timeline_x

TIMELINE_COLUMNS = 600
"""Columns of a drawn timeline: each keeps its highest sample (a one-op peak stays visible)."""

_PHASE_CODE = {"forward": "f", "backward": "b", "optimizer": "o"}


def base(command: str, title: str, budget_bytes: int | None) -> dict[str, Any]:
    return {
        "version": 1,
        "command": command,
        "title": title,
        "budget_bytes": budget_bytes,
        "timelines": [],
        "peak_parts": [],
        "blocks": [],
        "frontier": None,
        "compare": [],
        "notes": [],
        "unavailable": {},
    }


def row(what: str, unit: str, predicted: float | None, measured: float | None) -> dict[str, Any]:
    return {"what": what, "unit": unit, "predicted": predicted, "measured": measured}


def predict_keep_all(costs: ChainCosts) -> Prediction | None:
    return predict_point(costs, keep_all_plan(costs))


def anchor_points(inputs: ReportInputs, to_time: Any) -> list[dict[str, Any]]:
    out = []
    for a in inputs.anchors:
        pred = predict_point(inputs.costs, a.plan)
        if pred is not None:
            out.append({"label": a.label, "peak_bytes": pred.peak_bytes, "step_s": to_time(pred.step_s)})
    return out


def policy_anchors(costs: ChainCosts) -> list[dict[str, Any]]:
    """Without a workload (``--estimate``): store-all and recompute-all on the costs themselves."""
    out = []
    for label, option in (("no checkpointing", "keep"), ("policy 'all' (HF-style)", "recompute")):
        try:
            plan = Plan(policy=label, chain_path="", blocks=tuple(costs.decision(i, option) for i in range(len(costs))))
        except (KeyError, ValueError):
            continue
        pred = predict_point(costs, plan)
        if pred is not None:
            out.append({"label": label, "peak_bytes": pred.peak_bytes, "step_s": pred.step_s})
    return out


def frontier_panel(
    costs: ChainCosts,
    chosen: dict[str, Any],
    anchors: list[dict[str, Any]],
    *,
    measured: tuple[int, float] | None,
    time_label: str,
    to_time: Any,
) -> dict[str, Any]:
    points = [
        {
            "budget_bytes": p.budget_bytes,
            "peak_bytes": p.predicted_peak_bytes,
            "step_s": to_time(p.predicted_step_s),
            "not_kept_blocks": p.not_kept_blocks,
            "plan": short(p.options),
            "segments": [list(s) for s in p.segments],
            "head": p.head,
        }
        for p in frontier(costs)
    ]
    return {
        "time_label": time_label,
        "margin": costs.margin,
        "points": points,
        "anchors": anchors,
        "chosen": chosen,
        "measured": {"label": "chosen, measured", "peak_bytes": measured[0], "step_s": measured[1]}
        if measured
        else None,
    }


def short(options: Sequence[str]) -> str:
    """One letter per block: R recompute, S selective, O offload, . keep (the CLI's), by the option's
    kind (``recompute:tiles-4`` and ``recompute:host`` are R, ``keep:tiles-4`` is .)."""
    return "".join({"recompute": "R", "offload": "O", "selective": "S"}.get(o.split(":", 1)[0], ".") for o in options)


def timeline(label: str, tl: StepTimeline) -> dict[str, Any]:
    """A recorded step, downsampled to columns: ``x`` in milliseconds from the step's start
    (``x_unit`` ``ms``), or in ops when the step has no times (``x_unit`` ``op``)."""
    xs, unit = timeline_x(tl)
    x, idx = envelope(xs, tl.live_bytes, TIMELINE_COLUMNS)
    peak_i = max(range(len(tl.live_bytes)), key=lambda i: tl.live_bytes[i]) if tl.live_bytes else None
    scale = 1e-3 if unit == "ms" else 1.0
    return {
        "label": label,
        "peak_bytes": tl.peak_bytes,
        "peak_op": tl.op_index[peak_i] if peak_i is not None else None,
        "peak_x": round(xs[peak_i] * scale, 3) if peak_i is not None else None,
        "x_unit": unit,
        "peak_phase": tl.phase[peak_i] if peak_i is not None else None,
        "params_bytes": tl.params_bytes,
        "optimizer_bytes": tl.optimizer_bytes,
        "batch_size": tl.batch_size,
        "micro_batch": tl.micro_batch,
        "micro_steps": tl.micro_steps,
        "x": [round(v * scale, 3) for v in x],
        "live_bytes": [tl.live_bytes[i] for i in idx],
        "grads_bytes": [tl.grads_bytes[i] for i in idx],
        "phase": "".join(_PHASE_CODE.get(tl.phase[i], "-") for i in idx),
    }


def peak_parts(
    label: str,
    tl: StepTimeline,
    pred: Prediction | None,
    plan_options: Sequence[str],
    explained_kept_bytes: int | None = None,
) -> dict[str, Any]:
    """The measured peak by part; the activations split at the cost model's kept bytes at its
    peak event, or without a cost model at what ``explain`` says the blocks keep until backward
    (all of them, as when backward starts: at most what is kept at the peak)."""
    i = max(range(len(tl.live_bytes)), key=lambda j: tl.live_bytes[j])
    live, grads = tl.live_bytes[i], tl.grads_bytes[i]
    acts = max(0, live - tl.params_bytes - tl.optimizer_bytes - grads)
    parts = [
        {"part": "parameters", "bytes": tl.params_bytes},
        {"part": "optimizer state", "bytes": tl.optimizer_bytes},
        {"part": "gradients", "bytes": grads},
    ]
    where = f"measured peak in {tl.phase[i] or 'between phases'}"
    if pred is None and explained_kept_bytes is None:
        parts.append({"part": "activations & temporaries", "bytes": acts})
    elif pred is None:
        kept = min(acts, explained_kept_bytes or 0)
        rest = "recompute working set" if any(o != "keep" for o in plan_options) else "working set (temporaries)"
        parts += [{"part": "kept activations", "bytes": kept}, {"part": rest, "bytes": acts - kept}]
        where += "; kept activations: what the blocks keep when backward starts (explain), at most"
    else:
        kept = min(acts, pred.peak_kept_bytes)
        event = pred.peak_event
        if event == "loss and head":
            rest = "head (loss, logits and their gradient)"
        elif any(o != "keep" for o in plan_options) and event.startswith("backward"):
            rest = "recompute working set"
        else:
            rest = "working set (temporaries)"
        parts += [{"part": "kept activations", "bytes": kept}, {"part": rest, "bytes": acts - kept}]
        where += f"; predicted at {event}"
    return {"label": label, "total_bytes": live, "parts": parts, "where": where}


def timelines(data: dict[str, Any], records: StepRecords, costs: ChainCosts | None, plan: Plan) -> None:
    keep_pred = predict_point(costs, keep_all_plan(costs)) if costs is not None else None
    plan_pred = predict_point(costs, plan) if costs is not None else None
    opts = [b.option.value for b in plan.blocks]
    ex = records.explanation
    if records.baseline_timeline is not None:
        data["timelines"].append(timeline("no checkpointing", records.baseline_timeline))
        all_saved = ex["saved_bytes"] if ex else None  # keeping every block keeps every saved tensor
        data["peak_parts"].append(peak_parts("no checkpointing", records.baseline_timeline, keep_pred, [], all_saved))
    else:
        data["notes"].append(f"no checkpointing: {records.baseline_error}")
    label = "chosen plan" if data["command"] != "verify" else plan_name(plan)
    data["timelines"].append(timeline(label, records.plan_timeline))
    kept = ex["kept_bytes"] + ex["cached_extra_bytes"] if ex else None
    data["peak_parts"].append(peak_parts(label, records.plan_timeline, plan_pred, opts, kept))


def plan_name(plan: Plan) -> str:
    """``plan 'all'`` for a policy's plan (``'memfit'`` for the solver's), ``the plan`` for one that names none."""
    return f"plan {plan.policy!r}" if plan.policy else "the plan"


def add_records(
    data: dict[str, Any], inputs: ReportInputs | None, costs: ChainCosts | None, plan: Plan, *, why: str
) -> None:
    if inputs is None or inputs.records is None:
        why = why or "no step was recorded."
        data["unavailable"]["timeline"] = why
        data["unavailable"]["peak_parts"] = why
        return
    timelines(data, inputs.records, costs, plan)


def add_blocks(
    data: dict[str, Any],
    plan: Plan,
    costs: ChainCosts | None,
    explanation: Mapping[str, Any] | None,
    inputs: ReportInputs | None,
    *,
    explanation_error: str = "",
) -> None:
    """Per block: option, bytes saved and seconds added (measured by ``explain``; without it,
    the cost model's), and the tensors it keeps."""
    if explanation_error or (inputs is not None and inputs.records is not None and inputs.records.explanation_error):
        data["notes"].append(f"blocks: {explanation_error or inputs.records.explanation_error}")  # type: ignore[union-attr]
    by_name = {b["name"]: b for b in (explanation or {}).get("blocks", [])}
    in_segment = {i for s in plan.segments for i in range(s.start, s.stop)}
    rows = []
    for i, d in enumerate(plan.blocks):
        ex = by_name.get(d.name)
        option = d.option.value + (f" ({d.policy})" if d.policy else "")
        if d.tiles:  # a tiled block: its position-wise submodules run over tiles of the sequence
            option += f", {'/'.join(d.tiled) or 'position-wise parts'} in {d.tiles} tiles"
        if d.host_input:
            option += ", input held on the host"
        if i in in_segment:
            option += " (in a segment)"
        row: dict[str, Any] = {"name": d.name, "option": option, "source": None}
        if ex is not None:
            row |= {
                "source": "explain",
                # freed after the forward, less what a selective policy caches beyond autograd's saves
                "bytes_saved": ex["recomputed_bytes"] + ex["offloaded_bytes"] - ex["cached_extra_bytes"],
                "seconds_added": ex["seconds_added"],
                "kept_bytes": ex["kept_bytes"] + ex["cached_extra_bytes"],
                "tensors": [
                    {k: t[k] for k in ("op", "shape", "dtype", "bytes", "decision")}
                    for t in (*ex["tensors"], *ex["cached"])
                ],
            }
        elif costs is not None and i < len(costs):
            try:
                opt = costs.option_of(i, d)
            except PlanMismatchError:  # an option these costs were not calibrated for
                opt = ""
            keep, mine = costs.options[i]["keep"], costs.options[i].get(opt)
            if mine is not None:
                row |= {
                    "source": "cost model",
                    "bytes_saved": keep.retained_bytes - mine.retained_bytes,
                    "seconds_added": mine.extra_s,
                    "kept_bytes": mine.retained_bytes,
                    "tensors": None,
                }
        rows.append(row)
    data["blocks"] = rows
    if not rows:
        data["unavailable"]["blocks"] = "the plan has no blocks."
    elif explanation is None:
        data["notes"].append(
            "blocks: bytes and seconds from the cost model; the tensors each block keeps need a step that runs (`memfit explain`)."
            if any(r["source"] for r in rows)
            else "blocks: options only; bytes and seconds need a profile (`memfit plan`) or a step (`memfit explain`)."
        )
