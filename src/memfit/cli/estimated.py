"""``--estimate`` on ``memfit plan`` and ``memfit fit``: the fake-built workload for ``--target``, its
``stats_fn`` for one placement of the model states, and ``--calibrate``'s fit of the roofline."""

from __future__ import annotations

import argparse
from typing import Any

from memfit.capture.step import StepSpec
from memfit.cli.common import Output, parse_dtype, tiling_from_args
from memfit.cli.estimate_states import check_floor
from memfit.errors import SpecError
from memfit.estimation import DEFAULT_MFU, DEVICES, estimate_stats, get_device, load_fake_workload, stats_fn
from memfit.estimation.calibrate_time import TimeCalibration, calibrate_mfu, host_device
from memfit.fitting.budget import policy_options
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.policies import Selective, parse_policy

__all__ = [
    "calibrate_from_args",
    "estimate_fn",
    "estimate_setup",
    "estimate_workload",
    "show_calibration",
]


def estimate_setup(
    args: argparse.Namespace, *, command: str, real_step_options: dict[str, bool]
) -> tuple[Any, Any] | None:
    """With ``--estimate``: the fake-built workload and its ``stats_fn``; None without it
    (:func:`estimate_workload`, then :func:`estimate_fn` for ``--states``' placement).

    Raises:
        SpecError: ``--target`` missing, unknown (the names are listed) or given without
            ``--estimate``, or an option that runs a real step given with ``--estimate``.
    """
    setup = estimate_workload(args, command=command, real_step_options=real_step_options)
    return None if setup is None else (setup[0], estimate_fn(args, *setup))


def estimate_workload(
    args: argparse.Namespace, *, command: str, real_step_options: dict[str, bool]
) -> tuple[Any, Any, TimeCalibration | None] | None:
    """With ``--estimate``: the fake-built workload, the target device and ``--calibrate``'s fit;
    None without it. Model states alone over the budget with every placement ``--states`` allows are
    refused here, before any fake step.

    Raises:
        SpecError: as :func:`estimate_setup`.
    """
    if not getattr(args, "estimate", False):
        if getattr(args, "target", None) is not None:
            raise SpecError(
                f"memfit {command}: --target names the GPU to estimate for; add --estimate (e.g. --estimate --target {args.target})."
            )
        if getattr(args, "calibrate", False):
            raise SpecError(
                f"memfit {command}: --calibrate fits the estimate's step time; add --estimate --target NAME (this machine's, e.g. --target cpu)."
            )
        return None
    if getattr(args, "target", None) is None:
        raise SpecError(
            f"memfit {command}: --estimate needs --target NAME, one of: {', '.join(d for d in DEVICES if d != 'cpu')}."
        )
    try:
        device = get_device(args.target)
    except SpecError:
        raise SpecError(
            f"memfit {command}: unknown --target {args.target!r}. Use one of: {', '.join(d for d in DEVICES if d != 'cpu')} (e.g. --target h100-sxm)."
        ) from None
    bad = [opt for opt, given in real_step_options.items() if given]
    if bad:
        raise SpecError(
            f"memfit {command}: {', '.join(bad)} run(s) the model for real; leave it out with --estimate (nothing runs then)."
        )
    cal = calibrate_from_args(args, device)
    seq_len = None if args.seq_len == "auto" else args.seq_len  # fit --seq-len auto: built at its own length
    wl = load_fake_workload(args.model, seq_len=seq_len, dtype=parse_dtype(args.dtype), seed=args.seed)
    # model states alone over the budget: refused here, before any fake step (memfit.estimation.states)
    check_floor(args, wl, command=command, budget_bytes=getattr(args, "budget", None))
    return wl, device, cal


def estimate_fn(args: argparse.Namespace, wl: Any, device: Any, cal: TimeCalibration | None) -> Any:
    """The ``stats_fn`` of fake-tensor steps for ``--target`` with ``--states``' placement (one placement:
    ``auto`` is resolved before)."""
    # FSDP2 MixedPrecisionPolicy: the blocks run in param_dtype
    step_dtype = parse_dtype(args.param_dtype) if getattr(args, "param_dtype", None) else None
    return stats_fn(
        wl, device=cal.device if cal else device, mfu=cal.mfu if cal else getattr(args, "mfu", None),
        activations=not getattr(args, "keep_activations", False),
        step=StepSpec(optimizer=getattr(args, "optimizer", "adamw"), seed=args.seed, dtype=step_dtype, states=getattr(args, "states", "device")),
        # a selective policy (selective:torchtitan, ...) is estimated as its own option
        options=policy_options(pol) if isinstance(pol := parse_policy(getattr(args, "policy", None) or "none"), Selective) else BASE_OPTIONS,
        # tiled, host-held and chunked-head options unless --no-tiling / --keep-head (none under a fixed --policy)
        heads=not getattr(args, "keep_head", False) and not getattr(args, "policy", None),
        **({"tiling": False} if getattr(args, "policy", None) else tiling_from_args(args)),
    )  # fmt: skip


def calibrate_from_args(args: argparse.Namespace, device: Any) -> TimeCalibration | None:
    """``--calibrate``: the mfu fitted to steps measured here (None without the flag); also kept as
    ``args.time_calibration`` for the report (:func:`show_calibration`)."""
    args.time_calibration = None
    if not getattr(args, "calibrate", False):
        return None
    args.time_calibration = calibrate_mfu(
        args.model, device, batch_size=getattr(args, "batch_size", None) or 1, seq_len=None if args.seq_len == "auto" else args.seq_len,
        dtype=parse_dtype(args.dtype), optimizer=getattr(args, "optimizer", "adamw"), mfu_before=getattr(args, "mfu", None) or DEFAULT_MFU,
        seed=args.seed, budget_bytes=getattr(args, "budget", None),  # its step is predicted within the budget first
    )  # fmt: skip
    return args.time_calibration


def show_calibration(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    """Print ``--calibrate``'s fit; its JSON (``{"calibrated": ...}``, empty without the flag)."""
    cal = getattr(args, "time_calibration", None)
    if cal is None:
        return {}
    out.print(
        f"calibrated on this machine ({cal.device.name}): measured step {cal.measured_step_s * 1e3:.3g} ms at micro-batch "
        f"{cal.batch_size} (median of {cal.repeats}); roofline {cal.predicted_step_s_before * 1e3:.3g} ms at mfu {cal.mfu_before:.2f} "
        f"-> {cal.predicted_step_s_after * 1e3:.3g} ms at the fitted mfu {cal.mfu:.3f}"
    )
    return {"calibrated": {k: v for k, v in cal.to_dict().items() if k not in ("device", "repeats")}}


def profile_peak_fn(args: argparse.Namespace, wl: Any, *, dtype: Any = None) -> Any:
    """``batch size -> bytes``: the keep-all step a profile of ``wl`` runs, estimated on fake tensors
    before it runs (NOTE [ Bounded measurement ] in :mod:`memfit.fitting.bounded`): what bounds the
    first profile of ``fit --seq-len auto`` and, given to ``plan_for_budget(predict_profile_peak=)``, a
    plan's profile. The rates of this machine's device (a GPU the table does not list: an H100's; the
    bytes do not depend on them)."""
    try:
        device = host_device()
    except SpecError:
        device = get_device("h100-sxm")

    def peak(batch_size: int) -> int:
        step = StepSpec(
            batch_size=batch_size, optimizer=getattr(args, "optimizer", "adamw"), seed=args.seed, dtype=dtype
        )
        return estimate_stats(wl, device=device, step=step, options=("keep",), heads=False, tiling=False).peak_bytes

    return peak
