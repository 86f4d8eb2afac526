"""``--device`` (where a measuring command runs the model) and ``--target`` (the GPU an estimate is
for), shared by ``profile``, ``plan``, ``fit``, ``verify`` and ``explain``.

``--device`` takes ``cpu``, ``cuda`` or ``cuda:N`` (default: CUDA when it is available, else the
CPU); the command builds its workload there (:func:`memfit.models.registry.load_workload`'s
``device``) and says which device it ran on, in its text and as ``device`` in its JSON. Before
``--target`` existed, ``plan --estimate --device h100-sxm`` named the GPU to estimate for: a
``--device`` that names a GPU of the estimate's table is still taken as ``--target``, with a one-line
note (stderr, and ``warnings`` in the JSON).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from memfit.cli.common import Output, device_arg, settle_model
from memfit.errors import SpecError
from memfit.estimation.devices import DEVICES, get_device

ESTIMATE_TARGETS = tuple(d for d in DEVICES if d != "cpu")
"""The GPUs ``--target`` names (``cpu`` is a target too, for ``--calibrate`` on this machine)."""


def device_or_target_arg(text: str) -> str:
    """argparse type of ``--device`` beside ``--target``: a run device (:func:`device_arg`), or the
    name of an estimate target (the old spelling, aliases such as ``h100`` included; kept as the
    table names it, and :func:`resolve_device` moves it)."""
    t = text.strip().lower()
    if t in ("auto", "cpu") or t.startswith("cuda"):
        return device_arg(text)
    try:
        return get_device(t).name
    except SpecError:
        pass
    try:
        return device_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"unknown --device {text!r}. Use one of: {', '.join(ESTIMATE_TARGETS)} with --target (the GPU to estimate "
            "for), or cpu, cuda, cuda:N (where the model runs)"
        ) from None


def settle(args: argparse.Namespace, out: Output, *, command: str) -> dict[str, Any]:
    """``--model`` (:func:`memfit.cli.common.settle_model`), then ``--device`` (:func:`resolve_device`):
    :mod:`memfit.cli.main` calls a command module's ``settle`` before its ``run``."""
    settle_model(args)
    return resolve_device(args, out, command=command)


def resolve_device(args: argparse.Namespace, out: Output, *, command: str) -> dict[str, Any]:
    """Settle ``args.device`` to the torch device the command runs on (``auto`` and no option:
    CUDA when available) and, where ``--device`` named an estimate target, move it to
    ``args.target`` with the deprecation note. Prints which device runs.

    Returns:
        The command's JSON keys: ``device``, and ``warnings`` when there was a note.

    Raises:
        SpecError: ``--device NAME`` and ``--target`` both name an estimate target.
    """
    given = getattr(args, "device", None)
    warnings: list[str] = []
    estimating = getattr(args, "estimate", False)
    old_target = given in ESTIMATE_TARGETS or (estimating and given == "cpu" and hasattr(args, "target"))
    if given is not None and old_target:
        if getattr(args, "target", None) is not None:
            raise SpecError(
                f"memfit {command}: --device {given} names an estimate target and so does --target {args.target}; "
                f"give --target {args.target} alone (--device is where the model runs: cpu, cuda or cuda:N)."
            )
        args.target = given
        note = (
            f"--device {given} names the GPU to estimate for: that is --target {given} now (--device is where the "
            "model runs: cpu, cuda or cuda:N); the old spelling still works for now."
        )
        out.warn(note)
        warnings.append(note)
        given = None
    args.device = str(default_device() if given in (None, "auto") else torch.device(given))
    if estimating:  # nothing runs here but --calibrate's steps
        return {"device": args.device, **({"warnings": warnings} if warnings else {})}
    how = "" if given not in (None, "auto") else (" (the default: CUDA is available)" if args.device != "cpu" else "")
    out.print(f"device: {args.device}{_name(args.device)}{how}")
    return {"device": args.device, **({"warnings": warnings} if warnings else {})}


def default_device() -> torch.device:
    """``cuda`` (torch's current GPU) when CUDA is available, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _name(device: str) -> str:
    """`` (NVIDIA H100 80GB HBM3)`` for a CUDA device; empty elsewhere."""
    if not device.startswith("cuda"):
        return ""
    return f" ({torch.cuda.get_device_name(torch.device(device))})"
