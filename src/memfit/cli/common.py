"""Shared CLI pieces: workload options, output (rich tables / JSON), progress."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memfit.capture.attention import inspect_attention
from memfit.capture.step import StepSpec
from memfit.cli.args.values import (  # noqa: F401  (argparse types without torch; the commands import them from here)
    SEED_MAX,
    nonneg_float,
    nonneg_int,
    plan_file_arg,
    positive_float,
    positive_int,
    seed_arg,
    tile_modules_arg,
)
from memfit.cli.lines import LineConsole

# The output paths' checks live in memfit.cli.outputs; the commands import them from here.
from memfit.cli.outputs import (
    check_output_path,  # noqa: F401
    check_outputs_are_not_inputs,  # noqa: F401
    html_path,  # noqa: F401
    is_html,  # noqa: F401
    output_path,  # noqa: F401
    png_path,  # noqa: F401
    report_path,  # noqa: F401
)
from memfit.errors import SpecError
from memfit.estimation.devices import DEFAULT_MFU, PUBLISHED_MFU
from memfit.models.registry import load_workload
from memfit.plan.policies import POLICY_HELP, Policy, parse_policy
from memfit.report.html import write_html
from memfit.training.signals import EXIT_DIVERGED  # noqa: F401  (memfit train's exit code for a diverged run)
from memfit.units import DTYPES, format_bytes, parse_dtype, parse_size  # noqa: F401  (parse_dtype: the CLI commands import it from here)
from memfit.workload import Workload


def size_arg(text: str) -> int:
    """argparse type for sizes: ``300MiB`` -> bytes (errors become argparse errors)."""
    try:
        return parse_size(text)
    except SpecError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("memfit.units: ")) from None


MFU_HELP = "assumed fraction of the device's peak FLOP/s (default: the one fitted to a published run of its class, " + (
    ", ".join(f"{k} {v.mfu:.3g}" for k, v in PUBLISHED_MFU.items()) + f"; else {DEFAULT_MFU})"
)


def policy_arg(text: str) -> Policy:
    """argparse type for ``--policy``: the typed policy (:func:`memfit.plan.policies.parse_policy`),
    checked before any work."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the policy is empty; use {POLICY_HELP}")
    try:
        return parse_policy(text)
    except SpecError as err:
        raise argparse.ArgumentTypeError(str(err).partition(": ")[2] or str(err)) from None


def device_arg(text: str) -> str:
    """argparse type for a device to run on: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked here."""
    t = text.strip().lower()
    if t == "auto":
        return t
    try:
        device = torch.device(t)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; memfit runs on cpu, cuda or cuda:N (auto: cuda when available, else cpu)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: CUDA is not available here (torch {torch.__version__}"
                f"{', built without CUDA' if torch.version.cuda is None else ', no GPU visible'}); use --device cpu"
            )
        n = torch.cuda.device_count()
        if device.index is not None and device.index >= n:
            raise argparse.ArgumentTypeError(
                f"{text!r} does not exist: {n} GPU{'s' if n != 1 else ''} visible (cuda:0..cuda:{n - 1}); "
                "use one of those, or set CUDA_VISIBLE_DEVICES"
            )
    return str(device)


_PLAN_FILE_MAX_BYTES = 64 << 20  # a plan of a model with 100,000 blocks is a few MiB


def settle_model(args: argparse.Namespace) -> None:
    """``args.model`` when ``--model`` was not given: the workload a ``--plan`` file names (``memfit plan
    --out`` and ``fit --out`` write it), else ``demo``. A file that cannot be read is left to the command."""
    if args.model is not None:
        return
    named, path = None, getattr(args, "plan", None) or ""
    with contextlib.suppress(OSError, ValueError, RecursionError):  # the command reports a bad file itself
        if os.path.isfile(path) and os.path.getsize(path) <= _PLAN_FILE_MAX_BYTES:  # not a FIFO or /dev/zero
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            named = data.get("workload") if isinstance(data, dict) else None
    args.model = named if isinstance(named, str) and named.strip() else "demo"


def tiling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``tiling=`` and ``tile_modules=`` of :func:`memfit.fitting.budget.plan_for_budget` and
    :func:`memfit.fitting.autofit` from ``--no-tiling`` and ``--tile-modules``.

    Raises:
        SpecError: both flags given.
    """
    names = getattr(args, "tile_modules", None)
    if names and getattr(args, "no_tiling", False):
        raise SpecError("--no-tiling and --tile-modules contradict each other; give one of them.")
    return {"tiling": not getattr(args, "no_tiling", False), "tile_modules": names}


def attention_json(out: Output, wl: Workload, *, batch_size: int, seed: int, peak_bytes: int) -> dict[str, Any]:
    """``{"attention": ...}``: the attention kernels one forward of ``wl`` runs
    (:func:`memfit.capture.attention.inspect_attention`); memory quadratic in the sequence is warned
    about, with why and the fix, when its bytes are 1 % of the step's peak or more."""
    rep = inspect_attention(wl, batch_size=batch_size, seed=seed)
    if rep.memory == "quadratic" and rep.quadratic_bytes >= 0.01 * peak_bytes:
        out.warn(rep.summary())
    return {"attention": rep.to_dict()}


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload ``--model``, ``--seq-len``, ``--dtype`` and ``--seed`` describe (built in that dtype),
    on ``--device`` (settled by :func:`memfit.cli.device.resolve_device`; None: where it is built)."""
    seq_len = None if args.seq_len == "auto" else args.seq_len  # auto: built at its own length, then searched
    device = getattr(args, "device", None)
    return load_workload(args.model, seq_len=seq_len, dtype=parse_dtype(args.dtype), seed=args.seed, device=device)


def step_from_args(args: argparse.Namespace, **changes: Any) -> StepSpec:
    """The :class:`~memfit.capture.step.StepSpec` a command's ``--batch-size``, ``--optimizer``,
    ``--seed`` and ``--repeats`` describe (what the command lacks takes the verb's default), with
    ``changes``. ``--dtype`` builds the model in that dtype (:func:`memfit.load_workload`): it is
    not the step's cast."""
    return StepSpec(
        **{
            "batch_size": getattr(args, "batch_size", None),
            "optimizer": getattr(args, "optimizer", "adamw"),
            "seed": getattr(args, "seed", 0),
            "repeats": getattr(args, "repeats", None),
            "states": getattr(args, "states", "device"),
            "device": getattr(args, "device", None),  # where the model is: built there (workload_from_args)
            **changes,
        }
    )


def write_html_report(
    path: str, result: dict[str, Any], data: dict[str, Any], *, settled: Mapping[str, Any] | None = None
) -> str:
    """``--report FILE.html``: the page's JSON is ``result`` as ``--json`` prints it (its
    ``report`` key set to ``path`` first, and the keys ``settled`` before the command ran, such as
    ``device``, where ``result`` has none of its own) plus the panels' ``data`` (:mod:`memfit.report.html`)."""
    result["report"] = path
    page = {**(settled or {}), **{k: v for k, v in result.items() if k != "exit_code"}}
    return write_html(path, to_jsonable(page), data)


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, enums, tuples, paths, dtypes and non-finite floats into plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_dict"):
            return to_jsonable(obj.to_dict())
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return obj


class Output:
    """Human output with rich, silent under ``--json`` (the JSON goes to stdout alone)."""

    def __init__(self, *, json_mode: bool) -> None:
        self.json_mode = json_mode
        self.console = LineConsole(
            stderr=json_mode, quiet=json_mode, highlight=False
        )  # a line per phase off a terminal
        self._err = Console(stderr=True, highlight=False)

    def print(self, *objs: Any, **kw: Any) -> None:
        self.console.print(*objs, **kw)

    def error(self, message: str) -> None:
        self._err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        self._err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        t = Table(title=title, title_justify="left")
        for i, c in enumerate(columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in rows:
            t.add_row(*(str(x) for x in r))
        self.console.print(t)

    def progress(self, *, transient: bool = False):  # -> rich.progress.Progress
        """A progress bar bound to stderr; disabled under ``--json`` or when stderr is not a terminal."""
        bar = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            transient=transient,
            disable=self.json_mode,
            console=self._err if not sys.stderr.isatty() else None,
        )
        return _cleared_on_error(bar)


@contextlib.contextmanager
def _cleared_on_error(bar: Any) -> Iterator[Any]:
    """``with bar``, but an exception leaves no half-drawn bar: the error is stderr's one line.

    A terminal erases a transient bar; a file or pipe (no terminal) would get its last frame, so
    that final frame goes nowhere.
    """
    console = bar.live.console
    file = None
    try:
        with bar:
            try:
                yield bar
            except BaseException:
                bar.live.transient = True
                if not console.is_terminal:
                    file, console.file = console.file, io.StringIO()
                raise
    finally:
        if file is not None:
            console.file = file


def mib(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)
