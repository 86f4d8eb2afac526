"""What the planner recorded about a plan besides its decisions: the typed optional fields of
:class:`memfit.plan.types.Plan` that a plan file keeps under ``"extra"`` (margins, the step times
the measured steps scaled, a parallel rank's window, compile settings).

The file's ``"extra"`` object keeps the flat keys memfit has always written (``margin``,
``time_scale[offload]``, ``accumulation``, ``compile``, ...), so plan files made before these
fields load unchanged and are written back key for key; :func:`extra_fields` reads them and names
any key it does not know.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeScales:
    """How the measured steps scaled the cost model's times (NOTE [ Cost model ] in
    :mod:`memfit.plan.costmodel`).

    Attributes:
        recompute_time_scale: a recompute's seconds per second of the block's forward, as used
            (clamped to :data:`memfit.plan.costmodel.RECOMPUTE_SCALE_RANGE`).
        recompute_time_scale_measured: the same ratio as measured, before clamping.
        head_extra_s_measured: per head option, the seconds it added to the measured step.
        time_scale_by_option: per other option (``selective:...``, ``offload``), the factor on
            its op-level time estimates, as used.
        time_scale_measured_by_option: the same factors as measured.
    """

    recompute_time_scale: float
    recompute_time_scale_measured: float
    head_extra_s_measured: dict[str, float] = field(default_factory=dict)
    time_scale_by_option: dict[str, float] = field(default_factory=dict)
    time_scale_measured_by_option: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        """The flat keys a plan file's ``"extra"`` carries them under."""
        d = {
            "recompute_time_scale": self.recompute_time_scale,
            "recompute_time_scale_measured": self.recompute_time_scale_measured,
        }
        d.update({f"head_extra_s_measured[{k}]": v for k, v in self.head_extra_s_measured.items()})
        for k, v in self.time_scale_by_option.items():
            d[f"time_scale[{k}]"] = v
            if k in self.time_scale_measured_by_option:
                d[f"time_scale_measured[{k}]"] = self.time_scale_measured_by_option[k]
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class AccumulationWindow:
    """A rank's window of ``steps`` micro-steps (gradients kept between them) and its predicted peak."""

    steps: int
    predicted_peak_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "predicted_peak_bytes": self.predicted_peak_bytes}


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileSettings:
    """How a plan's step is compiled (:func:`memfit.apply.compiled.compile_plan`).

    Attributes:
        mode: ``model`` (the whole model) or ``block`` (each block).
        backend: the ``torch.compile`` backend (``inductor``).
        activation_memory_budget: the compiler's partitioner fraction (1.0: its default).
        candidate: the chosen candidate's name (``memfit plan --compile``), with what it measured:
        measured_peak_bytes: the compiled step's peak.
        measured_step_s: the compiled step's time.
        compile_s: seconds of the first step, which compiles.
    """

    mode: str
    backend: str
    activation_memory_budget: float
    candidate: str | None = None
    measured_peak_bytes: int | None = None
    measured_step_s: float | None = None
    compile_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "mode": self.mode,
            "backend": self.backend,
            "activation_memory_budget": self.activation_memory_budget,
        }
        if self.candidate is not None:
            d.update(
                candidate=self.candidate,
                measured_peak_bytes=self.measured_peak_bytes,
                measured_step_s=self.measured_step_s,
                compile_s=self.compile_s,
            )
        return d


EXTRA_PLAIN = (
    "margin",
    "predicted_peak_with_margin_bytes",
    "peak_event",
    "search",
    "min_budget_bytes",
    "baseline_peak_bytes",
    "baseline_step_s",
    "micro_batch",
    "accumulation_steps",
    "parallel",
)
"""The plan fields a file's ``"extra"`` carries under their own names, in the order written."""
_EXTRA_TYPES: dict[str, tuple[type, ...]] = {
    "margin": (int, float),
    "predicted_peak_with_margin_bytes": (int,),
    "peak_event": (str,),
    "search": (str,),
    "min_budget_bytes": (int,),
    "baseline_peak_bytes": (int,),
    "baseline_step_s": (int, float),
    "micro_batch": (int,),
    "accumulation_steps": (int,),
    "parallel": (dict,),
}
_KEYED = re.compile(r"^(?P<kind>head_extra_s_measured|time_scale|time_scale_measured)\[(?P<key>[^\]]+)\]$")


def extra_fields(extra: Any, bad: Any) -> dict[str, Any]:
    """The typed plan fields a file's ``"extra"`` object gives (files before these fields wrote
    the same object)."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise bad('"extra" must be an object')
    out: dict[str, Any] = {}
    scales: dict[str, Any] = {"head_extra_s_measured": {}, "time_scale": {}, "time_scale_measured": {}}

    def number(key: str, value: Any) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise bad(f'"extra" field {key!r} must be a number')
        return float(value)

    for key, value in extra.items():
        if key in _EXTRA_TYPES:
            if value is None:
                continue
            kinds = _EXTRA_TYPES[key]
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise bad(f'"extra" field {key!r} must be {" or ".join(k.__name__ for k in kinds)}, not {value!r}')
            out[key] = value
        elif key in ("recompute_time_scale", "recompute_time_scale_measured"):
            scales[key] = number(key, value)
        elif m := _KEYED.match(key):
            scales[m["kind"]][m["key"]] = number(key, value)
        elif key == "accumulation":
            if not (
                isinstance(value, dict)
                and isinstance(value.get("steps"), int)
                and isinstance(value.get("predicted_peak_bytes"), int | float)
            ):
                raise bad('"extra" field "accumulation" needs integer "steps" and "predicted_peak_bytes"')
            out["accumulation_window"] = AccumulationWindow(
                steps=value["steps"], predicted_peak_bytes=int(value["predicted_peak_bytes"])
            )
        elif key == "compile":
            try:
                out["compile_settings"] = CompileSettings(**value)
            except TypeError:
                raise bad(
                    '"extra" field "compile" needs "mode", "backend" and "activation_memory_budget" (and, from '
                    f"memfit plan --compile, {', '.join(CompileSettings.__slots__[3:])}), got {value!r}"
                ) from None
        else:
            raise bad(
                f'"extra" has an unknown field {key!r} (known: {", ".join((*EXTRA_PLAIN, "accumulation", "compile"))} '
                "and the time scales); remove it"
            )
    if "recompute_time_scale" in scales:
        out["time_scales"] = TimeScales(
            recompute_time_scale=scales["recompute_time_scale"],
            recompute_time_scale_measured=scales.get("recompute_time_scale_measured", scales["recompute_time_scale"]),
            head_extra_s_measured=scales["head_extra_s_measured"],
            time_scale_by_option=scales["time_scale"],
            time_scale_measured_by_option=scales["time_scale_measured"],
        )
    return out
