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
from memfit.optim.build import implemented_states
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def nonneg_int(text: str) -> int:
    """argparse type: a whole number >= 0 (counts that may be zero, such as retries)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


SEED_MAX = 2**63 - 1
"""The largest ``--seed``: torch's generators take 64 bits, and memfit adds small offsets to a seed."""


def seed_arg(text: str) -> int:
    """argparse type: a seed, a whole number from 0 to :data:`SEED_MAX`."""
    value = nonneg_int(text)
    if value > SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} is larger than the largest seed, 2**63 - 1 = {SEED_MAX}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (learning rates, clipping norms)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be greater than 0")
    return value


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0 (margins, fractions)."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be 0 or more")
    return value


MAX_MARGIN = 1.0
MFU_HELP = "assumed fraction of the device's peak FLOP/s (default: the one fitted to a published run of its class, " + (
    ", ".join(f"{k} {v.mfu:.3g}" for k, v in PUBLISHED_MFU.items()) + f"; else {DEFAULT_MFU})"
)
"""``--margin`` must stay below this: a margin of 1 reserves the whole predicted peak again."""


def margin_arg(text: str) -> float:
    """argparse type for ``--margin``: a fraction of the predicted peak kept free, in [0, 1)."""
    value = nonneg_float(text)
    if value >= MAX_MARGIN:
        raise argparse.ArgumentTypeError(
            f"{value:g} is not a fraction below 1: the margin is the share of the predicted peak kept free "
            "(0.02 = 2 %), and 1 or more would plan for half the budget or less; give e.g. 0.05, or lower --budget"
        )
    return value


def policy_arg(text: str) -> Policy:
    """argparse type for ``--policy``: the typed policy (:func:`memfit.plan.policies.parse_policy`),
    checked before any work."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the policy is empty; use {POLICY_HELP}")
    try:
        return parse_policy(text)
    except SpecError as err:
        raise argparse.ArgumentTypeError(str(err).partition(": ")[2] or str(err)) from None


def dtype_arg(text: str) -> str:
    """argparse type for ``--dtype``: one of :data:`DTYPES` (returned as given, for :func:`parse_dtype`)."""
    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; memfit trains in floating point: use one of {', '.join(sorted(set(DTYPES)))}"
        )
    return text


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


def plan_file_arg(text: str) -> str:
    """argparse type for ``--plan``: an existing file (its content is checked by ``Plan.load``)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(
            f"no plan file {text!r}; write one with `memfit plan --model SPEC --budget SIZE --out {text}`"
        )
    return text


def seq_len_arg(text: str) -> int | str:
    """argparse type for ``memfit fit --seq-len``: tokens per row, or ``auto`` (the longest that trains)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a whole number of tokens nor auto (the longest sequence that trains in --budget)"
        ) from None


def add_workload_args(p: argparse.ArgumentParser, *, batch: bool = True, seq_auto: bool = False) -> None:
    """``--model``, ``--batch-size``, ``--seq-len``, ``--dtype``, ``--seed``; ``seq_auto``: ``--seq-len``
    also takes ``auto``."""
    p.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="workload: 'demo', 'hf:TYPE[?key=value&...]' or 'path/to/file.py:NAME' (default: the one a --plan "
        "file was made for, else demo)",
    )
    p.set_defaults(_settle_model=settle_model)  # memfit.cli.main calls it before the command runs
    if batch:
        p.add_argument(
            "--batch-size", type=positive_int, default=None, metavar="B", help="batch size (default: the workload's)"
        )
    p.add_argument(
        "--seq-len",
        type=seq_len_arg if seq_auto else positive_int,
        default=None,
        metavar="T",
        help="sequence length for token workloads"
        + (
            "; auto: the longest that trains within --budget at the micro-batch (see --seq-multiple)"
            if seq_auto
            else ""
        ),
    )
    p.add_argument(
        "--dtype", type=dtype_arg, default=None, metavar="D", help="float32 (default), float64, bfloat16, float16"
    )
    p.add_argument("--seed", type=seed_arg, default=0, help="seed for weights, data and dropout (default 0)")


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


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """The planner's options, the same on ``memfit plan`` and ``memfit fit`` (``--states`` among them)."""
    add_states_arg(p)
    p.add_argument(
        "--margin", type=margin_arg, default=0.02, help="safety margin on predicted peaks (default 0.02 = 2%%)"
    )
    p.add_argument(
        "--options",
        default="block",
        choices=["block", "all"],
        help="block: keep/recompute per block and segments (default); all: also selective variants and offload (slower to measure)",
    )
    p.add_argument(
        "--keep-head",
        action="store_true",
        help="never replace the model's head: without it, causal LMs may get the chunked loss (logits never materialised; see memfit.apply.head)",
    )
    p.add_argument(
        "--keep-activations",
        action="store_true",
        help="never fuse activation modules (GPT-2's gelu_new and other python-written activations run as one torch kernel otherwise; see memfit.apply.activations)",
    )
    p.add_argument(
        "--no-tiling",
        action="store_true",
        help="never tile position-wise submodules (MLPs) over the sequence, nor hold recomputed blocks' inputs on the host (see memfit.apply.tiling, memfit.apply.host_inputs)",
    )
    p.add_argument(
        "--tile-modules",
        type=tile_modules_arg,
        default=None,
        metavar="NAME[,NAME]",
        help="the blocks' submodules to tile, by name within a block or class name (default: classes named *MLP); each must be position-wise",
    )


def tile_modules_arg(text: str) -> tuple[str, ...]:
    """argparse type for ``--tile-modules``: comma-separated names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more submodule names, e.g. --tile-modules mlp")
    return names


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


def add_states_arg(p: argparse.ArgumentParser) -> None:
    """``--states``: where the measured step's model states live and when its optimizer steps
    (the placements that have an implementation, :class:`memfit.optim.ModelStates`)."""
    p.add_argument(
        "--states",
        default="device",
        choices=implemented_states(),
        help="model states' placement: device (default): parameters, gradients and optimizer state on the "
        "device, the optimizer step after the backward; step-in-backward: each parameter steps as soon as its "
        "gradient is complete, inside the backward, and its gradient is freed (lower peak, the same parameters; "
        "needs a window of one micro-step and no gradient clipping)",
    )


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
