"""``--report FILE.html``: one self-contained page of a step's memory, the plan and its frontier.

The page is ``report.html`` (package data beside this module: hand-written CSS, SVG and a short
script, no library and no URL) with one JSON blob, ``<script type="application/json"
id="memfit-data">``, that the script renders from. The blob is what the command prints with
``--json``, plus one key, :data:`REPORT_KEY`, holding what the panels draw and the command's JSON
lacks (the recorded steps, the frontier, the blocks explained). Numbers the page shows carry
``data-json`` (their path in the blob) and ``data-value`` (the number), so a test can check the
page against the JSON.

Panels (a panel without its data says why in one line):

- **memory over time**: one step (or accumulation window) with no checkpointing and with the plan,
  stacked by parameters, optimizer state, gradients and activations, phases as bands, the budget
  line and each peak marked (the steps of :mod:`memfit.profiling.timeline`);
- **alive at the peak**: each step's peak by part; kept activations are the cost model's at its
  predicted peak event (:attr:`memfit.plan.costmodel.Prediction.peak_kept_bytes`), the measured
  activations beyond them the working set (a recompute's, the head's, or temporaries);
- **blocks**: option, bytes saved and seconds added per block, the tensors it keeps on hover
  (:func:`memfit.profiling.residuals.explain`);
- **frontier**: every plan the solver answered between the minimum budget and store-all
  (:func:`memfit.report.frontier.frontier`), the baseline policies, the chosen point and the
  measured one; for ``memfit fit`` also the micro-batch x accumulation candidates;
- **predicted against measured**, and for ``--parallel`` rank 0's memory by part and phase (read
  from the command's own JSON keys ``rank`` and ``parallel``).

This module measures nothing: :mod:`memfit.fitting.report_inputs` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.fitting.types import PlanResult, ReportInputs, StepRecords
from memfit.plan.types import Plan
from memfit.report.memviz import open_command
from memfit.report.panels import (
    add_blocks,
    add_records,
    anchor_points,
    base,
    frontier_panel,
    plan_name,
    policy_anchors,
    predict_keep_all,
    row,
    timelines,
)

if TYPE_CHECKING:
    from memfit.fitting.result import FitResult

__all__ = [
    "REPORT_KEY",
    "estimate_report_data",
    "fit_report_data",
    "plan_report_data",
    "verify_report_data",
    "write_html",
]

REPORT_KEY = "report_data"
"""The one key the page's JSON adds to the command's ``--json``."""

_TEMPLATE = "report.html"
_DATA_MARK = "/*MEMFIT_DATA*/"


# NOTE [ JSON inside a script element ]
# The HTML parser reads a <script> element's text before any JSON parser does: "</script" ends it, and
# "<!--" followed by "<script" switches it to the "double escaped" state, where the element's own closing
# tag no longer closes it and the page's renderer is swallowed (a module named "<!--<script>" blanked the
# page). Escaping every "<", ">" and "&" as JSON's \u escapes leaves no markup in the blob at all; U+2028
# and U+2029 are escaped too, as every JSON-in-HTML encoder does. JSON.parse gives the same strings back.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def write_html(path: str | Path, command_json: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    """Write the page: the template with ``command_json`` plus ``{REPORT_KEY: data}`` as its JSON.

    Args:
        path: the ``.html`` file (its folder is created).
        command_json: what the command prints with ``--json`` (plain JSON values).
        data: the panels' data (one of the ``*_report_data`` functions); where ``command_json`` names a
            ``snapshot`` (``--snapshot``), the page links it (``data["snapshot"]``: its path relative to
            the page and the command that opens it in PyTorch's memory_viz).

    Returns:
        The path written.
    """
    data = dict(data)
    snapshot = command_json.get("snapshot")
    if isinstance(snapshot, str) and snapshot:  # --snapshot: the page links it, relative to the page
        rel = os.path.relpath(Path(snapshot).resolve(), Path(path).resolve().parent)
        data["snapshot"] = {"href": Path(rel).as_posix(), "command": open_command(snapshot)}
    blob = json.dumps({**command_json, REPORT_KEY: data}, allow_nan=False, separators=(",", ":"))
    blob = blob.translate(_SCRIPT_SAFE)  # NOTE [ JSON inside a script element ]
    page = resources.files("memfit.report").joinpath(_TEMPLATE).read_text(encoding="utf-8")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page.replace(_DATA_MARK, blob, 1), encoding="utf-8")
    return str(out)


def plan_report_data(
    result: PlanResult,
    inputs: ReportInputs | None,
    *,
    measured: tuple[int, float] | None = None,
    baseline: tuple[int, float] | None = None,
    no_steps: str = "",
) -> dict[str, Any]:
    """The panels of ``memfit plan --report FILE.html``.

    Args:
        result: the plan and its costs.
        inputs: :func:`memfit.fitting.report_inputs.gather_plan_report` with ``records=True``
            (None where no step runs: the panels of recorded steps say ``no_steps``).
        measured: ``(peak_bytes, step_s)`` when ``--measure`` ran the plan.
        baseline: ``(peak_bytes, step_s)`` of the step with no checkpointing ``--measure`` ran beside it
            (the JSON's ``baseline_*``; None: the profile's step).
        no_steps: why no step was recorded (``--estimate``, ``--parallel``), one line.
    """
    plan, costs = result.plan, result.costs
    stats = result.stats
    data = base("plan", f"memfit plan: {stats.model}, batch {stats.batch_size}", plan.budget_bytes)
    chosen = {"label": "chosen plan", "peak_bytes": plan.predicted_peak_bytes, "step_s": plan.predicted_step_s}
    points = anchor_points(inputs, lambda s: s) if inputs is not None else policy_anchors(costs)
    data["frontier"] = frontier_panel(
        costs, chosen, points, measured=measured, time_label="predicted step time", to_time=lambda s: s
    )
    keep = predict_keep_all(costs)
    stats_step = (stats.peak_bytes, stats.step_s)  # measured while profiling, where --measure ran no baseline
    data["compare"] = [
        row("peak memory of a step", "bytes", plan.predicted_peak_bytes, measured[0] if measured else None),
        row("step time", "s", plan.predicted_step_s, measured[1] if measured else None),
        row("no checkpointing: peak", "bytes", keep.peak_bytes if keep else None, (baseline or stats_step)[0]),
        row("no checkpointing: step time", "s", keep.step_s if keep else None, (baseline or stats_step)[1]),
    ]
    if stats.calibration.estimated is not None:  # estimated stats: nothing measured
        for r in data["compare"]:
            r["measured"] = None
        data["unavailable"]["compare"] = "--estimate: nothing runs, so nothing is measured."
    add_records(data, inputs, costs, plan, why=no_steps)
    add_blocks(data, plan, costs, inputs.records.explanation if inputs and inputs.records else None, inputs)
    data["unavailable"]["grid"] = (
        "memfit plan solves one batch size: `memfit fit --report FILE.html` tries micro-batches and accumulation steps."
    )
    return data


def fit_report_data(
    result: FitResult, inputs: ReportInputs | None, *, no_steps: str = "", command: str = "fit", fit_json: str = ""
) -> dict[str, Any]:
    """The panels of ``memfit fit --report FILE.html``.

    Args:
        result: the fit.
        inputs: :func:`memfit.fitting.report_inputs.gather_fit_report` with ``records=True``
            (None where no step runs: ``no_steps`` says why, ``--estimate`` or ``--parallel``).
        no_steps: why no step was recorded, one line.
        command: the command whose page it is (``memfit demo`` shows its fit).
        fit_json: where the fit's JSON is in the command's (``""``: at the top, ``"fit."``:
            under ``fit``): the page reads the candidates there.
    """
    b, k, g = result.micro_batch, result.accumulation_steps, result.global_batch
    data = base(command, f"memfit {command}: global batch {g}", result.budget_bytes)
    data["fit_json"] = fit_json
    plan = result.plan
    if inputs is not None:
        data["title"] = f"memfit {command}: {inputs.model}, global batch {g}"
        costs, opt_s = inputs.costs, inputs.optimizer_s

        def window_s(step_s: float) -> float:  # one micro-step's prediction -> one optimizer step over G
            return (g / b) * max(0.0, step_s - opt_s) + opt_s

        # One time per plan: the fit's own prediction (its candidates table and JSON), not this profile's.
        chosen = {
            "label": f"chosen: micro-batch {b} x {k} (the fit's prediction)",
            "peak_bytes": result.predicted_peak_bytes,
            "step_s": g / result.predicted_samples_per_s,
        }
        measured = None
        if result.measured_peak_bytes is not None and result.measured_samples_per_s:
            measured = (result.measured_peak_bytes, g / result.measured_samples_per_s)
        data["frontier"] = frontier_panel(
            costs, chosen, anchor_points(inputs, window_s), measured=measured,
            time_label=f"predicted time per optimizer step ({g} samples, micro-batch {b})", to_time=window_s,
        )  # fmt: skip
        add_records(data, inputs, costs, plan, why=no_steps)
        add_blocks(data, plan, costs, inputs.records.explanation if inputs.records else None, inputs)
    else:
        data["unavailable"]["frontier"] = (
            f"{no_steps} The frontier is solved on a profile at the chosen micro-batch: `memfit plan --batch-size B --report FILE.html` draws it from the same stats."
        )
        add_records(data, None, None, plan, why=no_steps)
        add_blocks(data, plan, None, None, None)
    data["compare"] = [
        row("peak memory of a window", "bytes", result.predicted_peak_bytes, result.measured_peak_bytes),
        row("samples/s", "samples/s", result.predicted_samples_per_s, result.measured_samples_per_s),
    ]
    if result.estimated is not None:
        data["unavailable"]["compare"] = "--estimate: nothing runs, so nothing is measured."
    if not result.candidates:
        data["unavailable"]["grid"] = "the fit tried no candidates."
    return data


def verify_report_data(
    model: str,
    plan: Plan,
    records: StepRecords,
    checked: Mapping[str, Any],
    *,
    budget_bytes: int | None,
    accumulation: bool,
) -> dict[str, Any]:
    """The panels of ``memfit verify --report FILE.html``: both steps recorded and the plan
    explained; no cost model (verify solves nothing), so the frontier says where to get one.

    Args:
        model: the workload's name.
        plan: the plan verified.
        records: :func:`memfit.fitting.report_inputs.gather_step_records` for it.
        checked: verify's JSON (its measured peaks and times, where it measured them).
        budget_bytes: the budget, if one was given.
        accumulation: the steps are windows of gradient accumulation (``--global-batch``).
    """
    data = base("verify", f"memfit verify: {model}, {plan_name(plan)}", budget_bytes)
    data["unavailable"]["frontier"] = (
        "memfit verify checks one plan and solves nothing: `memfit plan --budget SIZE --report FILE.html` draws the frontier."
    )
    data["unavailable"]["grid"] = "memfit verify tries no micro-batches: `memfit fit --report FILE.html` does."
    if accumulation:
        data["notes"].append("the steps are accumulation windows of the global batch")
    timelines(data, records, None, plan)
    add_blocks(data, plan, None, records.explanation, None, explanation_error=records.explanation_error)
    data["compare"] = [
        row("peak memory with the plan", "bytes", plan.predicted_peak_bytes, checked.get("measured_peak_bytes")),
        row("step time with the plan", "s", plan.predicted_step_s, checked.get("measured_step_s") or None),
        row("no checkpointing: peak", "bytes", None, checked.get("baseline_peak_bytes")),
        row("no checkpointing: step time", "s", None, checked.get("baseline_step_s") or None),
    ]
    if plan.predicted_peak_bytes is None:
        data["notes"].append("the plan carries no prediction (a policy's plan): `memfit plan --policy P` predicts one.")
    return data


def estimate_report_data(est: Mapping[str, Any], plan: Plan | None) -> dict[str, Any]:
    """The panels of ``memfit estimate --report FILE.html``, from its JSON ``est`` (nothing ran:
    the peak per phase of the fake-tensor step stands in for a timeline)."""
    title = f"memfit estimate: {est.get('model')}, batch {est.get('batch_size')}"
    data = base("estimate", title, None)
    un = data["unavailable"]
    un["timeline"] = (
        "memfit estimate runs a fake-tensor step, nothing is recorded over time: its peak per phase is below."
    )
    un["frontier"] = (
        "memfit estimate predicts one policy: `memfit plan --estimate --device NAME --budget SIZE --report FILE.html` draws the frontier."
    )
    un["grid"] = "memfit estimate tries no micro-batches: `memfit fit --estimate --report FILE.html` does."
    un["compare"] = "memfit estimate measures nothing (no step runs)."
    if "breakdown" in est:
        b = est["breakdown"]
        data["phase_peaks"] = {"path": "breakdown.peak_bytes_by_phase", "peak_phase": b.get("peak_phase")}
        data["peak_parts"] = [
            {
                "label": f"estimated step (policy {est.get('policy')})",
                "total_path": "peak_bytes",
                "parts": [
                    {"part": "parameters", "path": "params_bytes"},
                    {"part": "optimizer state", "path": "optimizer_bytes"},
                    {"part": "gradients", "path": "grads_bytes"},
                    {"part": "activations & temporaries", "path": "activations_bytes"},
                ],
                "where": f"peak in {b.get('peak_phase')}; each part is its largest in the step (activations: above the "
                "step's start, gradients excluded), so together they can exceed the peak",
            }
        ]
    else:  # --parallel: the rank panel has it
        un["peak_parts"] = "with --parallel the rank panel below splits rank 0's memory by part and phase."
    if plan is not None:
        add_blocks(data, plan, None, None, None)
    else:
        un["blocks"] = (
            f"policy {est.get('policy')!r} without a plan file: give --plan PLAN.json for the blocks' options."
        )
    return data
