"""Workloads: what memfit measures, plans and trains.

A workload is ``(model, make_batch, loss_fn)`` (DESIGN.md, "Workload spec"):

- ``make_batch(batch_size)`` returns a tensor, or a dict/tuple/list of tensors with the batch on dim 0;
- ``loss_fn(model, batch)`` returns a scalar loss averaged over the batch, or a pair
  ``(loss_sum, count)`` for token-level losses, where the exact loss of a global batch is the sum of
  ``loss_sum`` over all its pieces divided by the sum of ``count``.

:func:`memfit.models.registry.load_workload` builds one from a ``--model`` spec: ``demo``,
``hf:TYPE?key=value&...`` or ``path/to/file.py:NAME`` (it lives beside the models it builds, so
that this module imports none of them).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import signal
import sysconfig
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from memfit.errors import Interrupted, MemfitError, SpecError, WorkloadError

Batch = Any  # a tensor, or a dict / tuple / list of tensors with the batch on dim 0
LossOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model with a way to make batches and a loss.

    Attributes:
        name: the spec it was built from (for reports and plan fingerprints).
        model: the ``nn.Module`` to train.
        make_batch: ``batch_size -> batch``; deterministic given the torch RNG state.
        loss_fn: ``(model, batch) -> loss`` or ``(loss_sum, count)``.
        count_fn: optional ``batch -> count`` giving the loss normaliser (valid tokens) without a
            forward pass; token-level workloads provide it so accumulation can normalise by the
            global count before the first backward.
        default_batch_size: the batch size used when a command is not given one.
        blocks: optional dotted path of the module list holding the blocks, or several paths of
            containers run one after another (overrides discovery; see
            :func:`memfit.capture.chain.set_blocks`).
        make_batch_at: optional ``(batch_size, seq_len) -> batch`` for token workloads: batches of
            another sequence length for the same model (:func:`with_seq_len`; what ``memfit fit
            --seq-len auto`` searches over). The built-in ``hf:`` and ``demo`` workloads have it.
        positions: the model's position limit, for a workload with ``make_batch_at``: ``None``
            (no limit known), or a :class:`PositionLimit`.
    """

    name: str
    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[nn.Module, Batch], LossOutput]
    count_fn: Callable[[Batch], int] | None = None
    default_batch_size: int = 4
    blocks: str | Sequence[str] | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    make_batch_at: Callable[[int, int], Batch] | None = None
    positions: PositionLimit | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PositionLimit:
    """How long a sequence the model's positions take.

    Attributes:
        max_positions: tokens per row the model was built for (``max_position_embeddings``,
            ``n_positions``; the demo's ``seq_len``).
        kind: ``"learned"`` (a table of position embeddings: nothing beyond it exists) or
            ``"rope"`` (rotary: any position computes, quality beyond the trained length depends
            on the rope scaling).
        rope_scaling: the rope type and factor when the config scales rotary positions
            (``"llama3 x8"``, ``"yarn x4"``); None for plain rope or learned positions.
    """

    max_positions: int
    kind: str
    rope_scaling: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"max_positions": self.max_positions, "kind": self.kind, "rope_scaling": self.rope_scaling}


def with_seq_len(workload: Workload, seq_len: int) -> Workload:
    """The same workload (same model, same loss) whose batches have ``seq_len`` tokens per row.

    Raises:
        SpecError: the workload cannot make batches of another length (no ``make_batch_at``), or
            ``seq_len`` is beyond a learned position table.
    """
    if workload.make_batch_at is None:
        raise SpecError(
            f"memfit.workload: {workload.name} makes batches of one length only (it has no make_batch_at). "
            "Use an hf: or demo workload, or return a Workload(..., make_batch_at=lambda batch_size, seq_len: ...) "
            "from your builder."
        )
    lim = workload.positions
    if lim is not None and lim.kind == "learned" and seq_len > lim.max_positions:
        raise SpecError(
            f"memfit.workload: {workload.name} has {lim.max_positions} learned positions; {seq_len} tokens per row "
            "would index past them. Build the model with more positions (hf: max_position_embeddings= or n_positions= in "
            "the spec; demo: seq_len=) or ask for at most that many tokens."
        )
    make_batch: Callable[[int], Batch] = functools.partial(_batch_at, workload.make_batch_at, seq_len)
    if isinstance(workload.make_batch, functools.partial) and workload.make_batch.func is _cast_made_batch:
        make_batch = functools.partial(_cast_made_batch, make_batch, workload.make_batch.args[1])
    if getattr(workload.loss_fn, "_memfit_guarded", False):
        make_batch = _guarded("make_batch", make_batch)
    return dataclasses.replace(workload, make_batch=make_batch, info={**workload.info, "seq_len": seq_len})


def _batch_at(make_batch_at: Callable[[int, int], Batch], seq_len: int, batch_size: int) -> Batch:
    return make_batch_at(batch_size, seq_len)


def with_dtype(workload: Workload, dtype: torch.dtype | None) -> Workload:
    """The workload in ``dtype``: its model converted (in place) and its ``make_batch`` returning
    batches whose floating tensors are converted, so that every command and entry point feeds the
    model batches of its own dtype. ``None`` returns the workload as it is.

    Example:
        >>> wl = with_dtype(load_workload("examples/convnet.py:build"), torch.float64)
        >>> wl.make_batch(2)[0].dtype
        torch.float64
    """
    if dtype is None:
        return workload
    workload.model.to(dtype=dtype)
    make_batch = workload.make_batch
    if isinstance(make_batch, functools.partial) and make_batch.func is _cast_made_batch:
        make_batch = make_batch.args[0]  # cast once, to the latest dtype
    return dataclasses.replace(workload, make_batch=functools.partial(_cast_made_batch, make_batch, dtype))


def _cast_made_batch(make_batch: Callable[[int], Batch], dtype: torch.dtype, batch_size: int) -> Batch:
    return cast_batch(make_batch(batch_size), dtype=dtype)


# --- the user's code ------------------------------------------------------------------------------

# NOTE [ Whose error is it ]
# memfit calls into a workload's code at a few places: importing its file, its ``NAME()`` builder,
# ``make_batch``, ``loss_fn`` (which runs the model's forward) and ``count_fn``. An exception raised
# there is the user's to fix, and deserves one line that says so and where, not a traceback through
# memfit's internals. :func:`call_user` runs such a call and re-raises what it raises as a
# :class:`WorkloadError` (chained: ``raise ... from err``, so the full traceback stays available),
# blaming the innermost frame of the traceback that is neither torch's nor memfit's. The forward
# also runs memfit's code (the checkpoint wrappers, the memory tracker's dispatch mode): when the
# innermost frame that is not torch's is memfit's, the exception is memfit's and is re-raised
# unchanged. The tracker's ``__torch_dispatch__`` runs every op, so it is seen through, as torch is.
# Exceptions memfit handles on purpose pass through untouched: its own errors, out-of-memory
# (the OutOfMemoryGuard replans on it) and the fake-tensor errors the estimator explains.
# The file and the builder are the user's whatever frame raised, so those stages always convert.
# So are raises that are not ``Exception``s (``sys.exit()`` must not end memfit without its line),
# and a ``KeyboardInterrupt`` under memfit's own signal handlers, where a real signal arrives as
# :class:`~memfit.errors.Interrupted` (under Python's or a notebook's handler it may be a Ctrl-C).

_T = TypeVar("_T")

_HINTS = {
    "import": "Fix {what} so that it imports on its own (`python {what}` runs without error)",
    "builder": "Fix {what} in the workload file: it must return (model, make_batch, loss_fn)",
    "make_batch": "make_batch(batch_size) must return a tensor, or a dict/tuple/list of tensors with the batch on dim 0",
    "loss_fn": "Check that loss_fn(model, make_batch(B)) runs without memfit: the batch must fit the model's forward "
    "(shapes, dtypes, keys, sequence length)",
    "count_fn": "count_fn(batch) must return the number of items (e.g. valid tokens) the loss is normalised by",
}
_MAX_MESSAGE_CHARS = 300


def call_user(stage: str, fn: Callable[..., _T], *args: Any, what: str = "", **kwargs: Any) -> _T:
    """Call the workload's own code; what it raises becomes a :class:`WorkloadError` that says where.

    Args:
        stage: ``import``, ``builder``, ``make_batch``, ``loss_fn`` or ``count_fn`` (picks the hint).
        fn: the user's callable.
        *args: its arguments.
        what: the file or function name, for the hint of ``import`` and ``builder``.
        **kwargs: its keyword arguments.

    Raises:
        WorkloadError: ``fn`` raised in the user's code (see NOTE [ Whose error is it ]); the
            original exception is the ``__cause__`` and :attr:`WorkloadError.original`.
    """
    try:
        return fn(*args, **kwargs)
    except _PASS_THROUGH:
        raise
    except Exception as err:
        users, where = _blame(err, always=stage in ("import", "builder"))
        if not users:
            raise
        raise _workload_error(stage, err, where, what) from err
    except KeyboardInterrupt as err:
        if isinstance(err, Interrupted) or not getattr(
            signal.getsignal(signal.SIGINT), "_memfit_signal_handler", False
        ):
            raise  # a signal (see NOTE [ Whose error is it ])
        raise _workload_error(stage, err, _blame(err, always=True)[1], what) from err
    except GeneratorExit:
        raise
    except BaseException as err:  # sys.exit() and other non-Exception raises of the user's code
        raise _workload_error(stage, err, _blame(err, always=True)[1], what) from err


def guard_workload(wl: Workload) -> Workload:
    """The same workload whose ``make_batch``, ``loss_fn`` and ``count_fn`` go through :func:`call_user`.

    ``loss_fn`` is also checked to return a loss that requires grad whenever grad is enabled (one
    attribute read per call), since a loss without one fails later in ``backward`` with a message
    that does not say why.
    """
    if getattr(wl.loss_fn, "_memfit_guarded", False):
        return wl
    return dataclasses.replace(
        wl,
        make_batch=_guarded("make_batch", wl.make_batch),
        loss_fn=_guarded("loss_fn", wl.loss_fn, check=_check_loss),
        count_fn=None if wl.count_fn is None else _guarded("count_fn", wl.count_fn),
    )


def _guarded(stage: str, fn: Callable[..., _T], *, check: Callable[[Any], None] | None = None) -> Callable[..., _T]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> _T:
        out = call_user(stage, fn, *args, **kwargs)
        if check is not None:
            check(out)
        if stage == "make_batch" and args and isinstance(args[0], int):
            check_batch_rows(out, args[0])
        return out

    guarded._memfit_guarded = True  # type: ignore[attr-defined]
    return guarded


def _check_loss(out: Any) -> None:
    loss = out[0] if isinstance(out, tuple | list) and out else out
    if isinstance(loss, torch.Tensor) and loss.is_complex():
        raise WorkloadError(
            f"memfit.workload: loss_fn returned a complex-valued loss ({str(loss.dtype).removeprefix('torch.')}); "
            "backward needs a real number to minimise. Return a real loss, e.g. loss.real or loss.abs().",
            stage="loss_fn",
        )
    if torch.is_grad_enabled() and isinstance(loss, torch.Tensor) and not loss.requires_grad:
        raise WorkloadError(
            "memfit.workload: loss_fn returned a loss that does not require grad, so backward cannot "
            "compute gradients. Typical causes: .item() or .detach() on the loss, torch.no_grad() or "
            "torch.inference_mode() in loss_fn or forward, or a model whose parameters are all frozen. "
            "Return the loss tensor as the forward computed it.",
            stage="loss_fn",
        )


_PASS_THROUGH = (
    MemfitError,
    torch.OutOfMemoryError,
    MemoryError,
    DataDependentOutputException,
    DynamicOutputShapeException,
)
_MEMFIT_DIR = os.path.realpath(Path(__file__).parent) + os.sep
_TORCH_DIR = os.path.realpath(Path(torch.__file__).parent) + os.sep
_STDLIB_DIR = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
_SEE_THROUGH = ("__torch_dispatch__", "__torch_function__")


@functools.lru_cache(maxsize=1024)
def _owner(filename: str) -> str:
    """``torch``, ``memfit``, ``python`` (the standard library) or ``user`` (anything else)."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return "python"
    path = os.path.realpath(filename)
    if path.startswith(_TORCH_DIR):
        return "torch"
    if path.startswith(_MEMFIT_DIR):
        return "memfit"
    if path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path:
        return "python"
    return "user"


def _blame(err: BaseException, *, always: bool) -> tuple[bool, tuple[str, int, str] | None]:
    """Whether ``err`` is the user's (see NOTE [ Whose error is it ]) and its innermost user frame."""
    frames: list[tuple[str, int, str]] = []
    tb: types.TracebackType | None = err.__traceback__
    tb = tb.tb_next if tb is not None else None  # skip call_user's own frame
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    if isinstance(err, SyntaxError) and err.filename:
        frames.append((err.filename, err.lineno or 0, "<module>"))
    innermost = None  # the innermost frame that is memfit's or the user's
    where = None  # the innermost frame that is the user's
    for frame in reversed(frames):
        owner = _owner(frame[0])
        if owner == "memfit" and frame[2] in _SEE_THROUGH:
            continue
        if innermost is None and owner in ("memfit", "user"):
            innermost = owner
        if owner == "user":
            where = frame
            break
    return always or innermost != "memfit", where


def check_batch_rows(batch: Batch, batch_size: int) -> None:
    """Refuse a batch from ``make_batch(batch_size)`` whose tensors agree on another dim 0: memfit
    would measure, plan or train at that size without saying so. (Tensors that disagree among
    themselves are refused where the batch is split, :func:`batch_size_of`.)

    Raises:
        WorkloadError: expected and got rows, and the fix.
    """
    rows = {t.shape[0] for t in iter_tensors(batch) if t.dim() > 0}
    if len(rows) == 1 and (got := rows.pop()) != batch_size:
        raise WorkloadError(
            f"memfit.workload: make_batch({batch_size}) returned a batch of {got} rows (dim 0 of its tensors), "
            f"expected {batch_size}; memfit would run at {got} without saying so. Return exactly batch_size rows "
            "(make_batch(batch_size) must use its argument).",
            stage="make_batch",
        )


def _workload_error(stage: str, err: BaseException, where: tuple[str, int, str] | None, what: str) -> WorkloadError:
    if isinstance(err, SystemExit):
        code = err.code if err.code is not None else 0
        at = _at(where)
        return WorkloadError(
            f"memfit.workload: your workload called sys.exit({code!r}){at}, which would end memfit without a word. "
            "Raise an exception that says why instead, and memfit reports it as your workload's error.",
            stage=stage,
            original=err,
            where=where,
        )
    message = " ".join(str(err).split()).rstrip(".")
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    at = _at(where)
    hint = _HINTS.get(stage, "Fix the workload's code").format(what=what or "the workload file")
    return WorkloadError(
        f"memfit.workload: your workload raised {type(err).__name__}{': ' + message if message else ''}{at}. {hint}.",
        stage=stage,
        original=err,
        where=where,
    )


def _at(where: tuple[str, int, str] | None) -> str:
    """`` (at FILE:LINE in FUNCTION)``, the file relative to the working directory when below it."""
    if where is None:
        return ""
    file, line, function = where
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        rel = file
    if not rel.startswith(".."):
        file = rel
    return f" (at {file}:{line} in {function})"


# --- batches -------------------------------------------------------------------------------------


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """Apply ``fn`` to every tensor of a batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def iter_tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor of a batch, in a stable order."""
    out: list[torch.Tensor] = []
    map_tensors(batch, lambda t: out.append(t) or t)
    return out


def cast_batch(batch: Batch, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Batch:
    """Move a batch to ``device`` and convert its floating tensors to ``dtype``."""

    def conv(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        return t

    return map_tensors(batch, conv)


def batch_size_of(batch: Batch) -> int:
    """The batch size (dim 0 of every tensor, which must agree)."""
    sizes = {t.shape[0] for t in iter_tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise SpecError(
            f"memfit.workload: the batch's tensors disagree on dim 0 ({sorted(sizes)}). make_batch "
            "must return tensors with the batch on dim 0."
        )
    return sizes.pop()


def split_batch(batch: Batch, sizes: Sequence[int]) -> list[Batch]:
    """Split a batch on dim 0 into pieces of the given sizes (which must add up to its size)."""
    total = batch_size_of(batch)
    if sum(sizes) != total or any(s <= 0 for s in sizes):
        raise SpecError(
            f"memfit.workload: cannot split a batch of {total} into pieces {list(sizes)}; the pieces "
            "must be positive and add up to the batch size."
        )
    pieces: list[Batch] = []
    start = 0
    for s in sizes:
        pieces.append(map_tensors(batch, lambda t, a=start, b=start + s: t[a:b] if t.dim() > 0 else t))
        start += s
    return pieces


def batch_signature(batch: Batch) -> list[dict[str, Any]]:
    """Shapes and dtypes of a batch's tensors: what a plan's batch fingerprint records."""
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in iter_tensors(batch)]


def reduce_loss(out: LossOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read a loss_fn result as ``(loss, count)``; ``count`` is None for a mean loss.

    Raises:
        SpecError: the result is neither a scalar tensor nor a ``(loss_sum, count)`` pair.
    """
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        loss_sum, count = out
        if not isinstance(count, torch.Tensor):
            count = torch.tensor(float(count))
        return loss_sum, count
    raise SpecError(
        "memfit.workload: loss_fn must return a scalar tensor (mean loss) or a pair (loss_sum, count); "
        f"it returned {type(out).__name__}"
        + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
        + ". Reduce the loss to a scalar, e.g. loss.mean()."
    )


def mean_loss(out: LossOutput) -> torch.Tensor:
    """The scalar loss of one batch: the mean, or ``loss_sum / count``."""
    loss, count = reduce_loss(out)
    return loss if count is None else loss / count.to(loss.dtype)


def signature_digest(obj: Any) -> str:
    """A short stable hash of a JSON-serialisable object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
