"""Training state on disk: atomic saves, a lock per target, checked loads and resume checks.

A ``memfit train --save PATH`` run must never lose or corrupt a checkpoint, whatever happens to
the process. The functions here give these guarantees to the CLI and to Python users alike:

- :func:`check_writable`: the target is no device, FIFO or socket, and its directory exists and
  takes a file (a probe is written, fsynced and removed), checked before any training or fitting
  starts; links are resolved first (NOTE [ Save targets ] in :mod:`memfit.training.savepath`).
- :class:`StateLock`: ``fcntl.flock`` on ``PATH.lock`` for the whole run; a second run that
  wants the same path is refused with the other process's pid and command line.
- :func:`save_state`: refuses non-finite tensors, then writes the state with its checksum to a
  temporary file in the target's directory, flushes and fsyncs it, ``os.replace``-s it over the
  target and fsyncs the directory; a full disk is one line with the free space.
- :func:`load_state`: one-line errors for a missing, empty, truncated, foreign or damaged file
  (the zip's CRCs and the state's checksum, NOTE [ Checked resume files ] in
  :mod:`memfit.training.integrity`).
- :class:`RunSignature` / :func:`check_resume`: what must be equal for a resumed run to continue
  the saved one exactly (parameters, optimizer, sequence length, global batch, world size, dtype).

NOTE [ Atomic replace ]
``os.replace`` of a file in the same directory is atomic on POSIX: a reader (or a crash) sees the
old file or the new one, never a mix. The new file's data must be on disk *before* the rename
(``fsync`` of the file), or a power loss can leave the new name pointing at an empty file; the
rename itself is made durable by an ``fsync`` of the directory. A SIGKILL during the write leaves
the target as it was and a temporary ``.NAME.PID.XXXX.tmp`` beside it, removed by the next run
that takes the lock (only the lock holder writes, so any such file is stale). Only ``NAME``'s own
temporaries are removed: a run saving to ``ckpt.pt`` leaves those of ``ckpt.pt.bak`` alone.

Example:
    >>> import tempfile, os, torch, memfit
    >>> d = tempfile.mkdtemp()
    >>> path = os.path.join(d, "state.pt")
    >>> check_writable(path)
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = memfit.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=2)
    >>> with StateLock(path):
    ...     size_bytes = save_state(path, acc.state_dict())
    >>> load_state(path)["counters"]["optimizer_steps"]
    0

Known limitations:
    - The lock is advisory (``flock``): it keeps memfit runs apart, not other programs; on network
      file systems without ``flock`` support it may not exclude runs on other machines.
    - ``PATH.lock`` stays beside the checkpoint after the run (removing it would race with a run
      that is opening it); it is empty but for the last holder's pid and command line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import math
import os
import pickle
import re
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.accumulate.accumulator import STATE_FORMAT
from memfit.training.integrity import check_archive, check_seal, seal
from memfit.training.savepath import TrainStateError, check_target_kind, check_writable, disk_full_line, save_target

__all__ = [
    "NonFiniteStateError",
    "RunSignature",
    "StateLock",
    "TrainStateError",
    "check_resume",
    "check_writable",
    "load_state",
    "nonfinite_tensors",
    "save_state",
]


class NonFiniteStateError(TrainStateError):
    """A state to be saved holds NaN or infinite values."""


# -- writing -----------------------------------------------------------------------------------------


def save_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> int:
    """Write ``state`` to ``path`` atomically (NOTE [ Atomic replace ]); return the bytes written.

    Nothing is written when a tensor of the state is NaN or infinite: the file on disk stays the
    previous good one.

    Raises:
        NonFiniteStateError: the state holds non-finite values (names the first few).
        TrainStateError: the write failed (disk full, permissions); the target is unchanged.
    """
    bad = nonfinite_tensors(state)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteStateError(
            f"memfit.trainstate: not saving {str(path)!r}: {', '.join(bad[:3])}{more} hold NaN or inf "
            "values; the file on disk keeps the last finite state. Lower the learning rate or clip "
            "gradients (--max-grad-norm), and resume from the last saved state."
        )
    check_target_kind(path)  # a device, FIFO or socket would be replaced by the rename (NOTE [ Save targets ])
    p = save_target(path)  # through a link: the link stays, the file it names is replaced
    parent = p.parent if str(p.parent) else Path(".")
    had_state = p.exists()
    sealed = seal(state)  # the checksum a resume verifies (NOTE [ Checked resume files ])
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}.", suffix=".tmp", dir=parent)
        os.fchmod(fd, _file_mode(p))  # mkstemp's 0600, not what open() would have given
        with os.fdopen(fd, "wb") as f:
            torch.save(sealed, f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, p)
        tmp = None
        _fsync_dir(parent)
    except (OSError, RuntimeError) as err:
        # torch's zip writer reports a full disk as RuntimeError ("inline_container.cc ... unexpected pos").
        if _disk_full(err):
            reason = err.strerror if isinstance(err, OSError) else f"torch's writer: {str(err).splitlines()[0][-80:]}"
            raise TrainStateError(disk_full_line(path, had_state, reason or "")) from None
        if not isinstance(err, OSError):
            raise
        then = (
            f"the file on disk is unchanged (its last complete save). Free space or fix permissions, then continue with --resume {path}"
            if had_state
            else f"nothing was saved ({str(path)!r} did not exist and was not written). Free space or fix permissions, then run again"
        )
        raise TrainStateError(
            f"memfit.trainstate: saving {str(path)!r} failed ({err.strerror or err}); {then}."
        ) from None
    finally:
        if tmp is not None:  # an error or an interrupt (KeyboardInterrupt) during the write
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return size


def _disk_full(err: BaseException) -> bool:
    """An ENOSPC / EDQUOT, or torch's zip writer failing its write (it drops the OS's reason)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(err)
    return "unexpected pos" in text or "PytorchStreamWriter failed writing" in text or "inline_container" in text


def nonfinite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in ``state`` (nested dicts/lists) with NaN or inf."""
    bad: list[str] = []
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() or state.is_complex():
            if not bool(torch.isfinite(state).all()):
                bad.append(prefix or "<tensor>")
    elif isinstance(state, Mapping):
        for k, v in state.items():
            if k == "rng":  # RNG states are byte tensors, and not weights
                continue
            bad += nonfinite_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            bad += nonfinite_tensors(v, f"{prefix}[{i}]")
    elif isinstance(state, float) and not math.isfinite(state) and prefix.startswith(("model", "optimizer")):
        bad.append(prefix)
    return bad


def _file_mode(p: Path) -> int:
    """The target's mode when it exists, else what ``open()`` creates under the current umask."""
    try:
        return p.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


class StateLock:
    """An exclusive lock on ``PATH.lock`` while a run writes ``PATH`` (a context manager).

    Taking the lock also removes temporary files that a killed writer left beside ``PATH``
    (only the lock holder writes there, so they are stale).

    Raises:
        TrainStateError: another process holds the lock (its pid and command line are named), or
            the lock file cannot be created.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = save_target(path)  # links resolved: two links to one file take one lock
        self.lock_path = Path(f"{self.path}.lock")
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise TrainStateError(
                f"memfit.trainstate: cannot create the lock file {str(self.lock_path)!r} ({err.strerror}). "
                "Give a --save path in a writable directory."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TrainStateError(
                    f"memfit.trainstate: cannot lock {str(self.lock_path)!r} ({err.strerror})."
                ) from None
            raise TrainStateError(
                f"memfit.trainstate: another run is writing {str(self.path)!r} ({holder or 'holder unknown'}); "
                "two runs saving to one file would overwrite each other. Wait for it to finish, or give "
                "this run another --save path."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}: {' '.join(sys.argv)}\n".encode())
        self._fd = fd
        self._remove_stale_temporaries()
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _remove_stale_temporaries(self) -> None:
        parent = self.path.parent if str(self.path.parent) else Path(".")
        for tmp in parent.glob(f".{glob.escape(self.path.name)}.*.tmp"):
            if _temporary_of(tmp.name) == self.path.name:  # not the temporary of `PATH.bak`, another run's
                with contextlib.suppress(OSError):
                    tmp.unlink()


_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.(?P<rand>[^.]+)\.tmp$")


def _temporary_of(name: str) -> str | None:
    """The target whose temporary :func:`save_state` named ``name`` (``.TARGET.PID.RANDOM.tmp``),
    or None. Exactly two dot-free parts follow the target, so ``.ckpt.pt.bak.PID.RANDOM.tmp``
    belongs to ``ckpt.pt.bak`` and never to ``ckpt.pt``."""
    m = _TEMPORARY.match(name)
    return m["target"] if m else None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text.splitlines()[0] if text else ""


# -- reading ----------------------------------------------------------------------------------------


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state saved by :func:`save_state` (or ``torch.save(acc.state_dict(), path)``).

    Raises:
        TrainStateError: the file is missing, empty, truncated, not a torch file, or not a memfit
            training state; one line naming the file, the cause and the fix.
    """
    p = Path(path)
    fix = "Resume from another saved state, or start without --resume."
    if not p.exists():
        raise TrainStateError(f"memfit.trainstate: no saved state at {str(p)!r}. Save one with --save PATH first.")
    if p.is_dir():
        raise TrainStateError(
            f"memfit.trainstate: {str(p)!r} is a directory, not a saved state. Give the file --save wrote."
        )
    if not p.is_file():  # a device (/dev/zero), a FIFO or a socket: never read, a save is a regular file
        raise TrainStateError(
            f"memfit.trainstate: {str(p)!r} is a special file (a device, FIFO or socket), not a saved state. "
            "Give the file --save wrote."
        )
    size = p.stat().st_size
    if size == 0:
        raise TrainStateError(f"memfit.trainstate: {str(p)!r} is empty (0 bytes), not a saved state. {fix}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        ValueError,
        KeyError,
        AttributeError,
        TypeError,
        IndexError,
        UnicodeDecodeError,
    ) as err:
        cause = _load_cause(p, err)
        raise TrainStateError(f"memfit.trainstate: cannot read {str(p)!r} ({size} bytes): {cause}. {fix}") from None
    except OSError as err:
        raise TrainStateError(f"memfit.trainstate: cannot read {str(p)!r} ({err.strerror or err}). {fix}") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        what = f"format {state.get('format')!r}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise TrainStateError(
            f"memfit.trainstate: {str(p)!r} is a torch file but not a memfit training state ({what}, "
            f"expected format {STATE_FORMAT!r}). Give a file written by memfit train --save."
        )
    for part in ("counters", "rng", "extra"):
        if part not in state:
            raise TrainStateError(
                f"memfit.trainstate: {str(p)!r} is a memfit state without its {part!r} part (damaged or hand-made). {fix}"
            )
    check_archive(p)  # torch reads without checking the zip's CRCs
    check_seal(p, state)
    return state


def _load_cause(p: Path, err: BaseException) -> str:
    with p.open("rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        if not zipfile.is_zipfile(p):
            return "truncated or damaged (a torch zip archive without its end; was a save interrupted?)"
        if "weights only load failed" in str(err).lower():
            return "a torch file holding Python objects (a pickled model?), not a memfit training state"
        return f"a damaged torch archive ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"
    return "not a torch checkpoint (it does not start like a file torch.save writes)"


# -- resuming ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSignature:
    """What a resumed run must share with the saved one to continue it exactly.

    Attributes:
        model: the workload spec (reported, not compared: parameters are compared instead).
        optimizer: optimizer name (``adamw``, ``adam``, ``sgd``).
        seq_len: tokens per sample, or None when the workload does not say.
        global_batch: samples per optimizer step.
        world_size: data-parallel processes.
        dtype: the parameters' dtype.
    """

    model: str
    optimizer: str
    seq_len: int | None
    global_batch: int
    world_size: int
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_resume(
    path: str | os.PathLike[str], state: Mapping[str, Any], run: RunSignature, model: torch.nn.Module
) -> None:
    """Refuse a resume that cannot continue the saved run exactly; one line: what differs, the fix.

    Compares the run signature stored in ``state["extra"]["run"]`` (when there is one) with
    ``run``, then the parameter and buffer names and shapes of ``state["model"]`` with ``model``'s.

    Raises:
        TrainStateError: the first difference found.
    """
    saved = dict(state.get("extra", {}).get("run") or {})
    where = f"memfit.trainstate: {str(path)!r} was saved"
    if saved.get("optimizer") not in (None, run.optimizer):
        raise TrainStateError(
            f"{where} with --optimizer {saved['optimizer']}, this run uses {run.optimizer}; its optimizer state cannot continue in another optimizer. Resume with --optimizer {saved['optimizer']}."
        )
    if saved.get("seq_len") is not None and run.seq_len is not None and saved["seq_len"] != run.seq_len:
        raise TrainStateError(
            f"{where} with sequence length {saved['seq_len']}, this run uses {run.seq_len}; the data stream would differ. Resume with --seq-len {saved['seq_len']}."
        )
    if saved.get("global_batch") not in (None, run.global_batch):
        raise TrainStateError(
            f"{where} with --global-batch {saved['global_batch']}, this run uses {run.global_batch}; the data stream and the step size would differ. Resume with --global-batch {saved['global_batch']}."
        )
    saved_world = saved.get("world_size", state.get("extra", {}).get("world_size"))
    if saved_world not in (None, run.world_size):
        raise TrainStateError(
            f"{where} by {saved_world} process(es), this run has {run.world_size}; the per-rank random streams cannot continue exactly. Resume with the same number of processes (torchrun --nproc_per_node={saved_world})."
        )
    if saved.get("dtype") not in (None, run.dtype):
        raise TrainStateError(
            f"{where} with dtype {saved['dtype']}, this run uses {run.dtype}. Resume with --dtype {saved['dtype'].removeprefix('torch.')}."
        )
    if "optimizer" in state and state["optimizer"] is not None and not saved.get("optimizer"):
        _check_optimizer_layout(where, state["optimizer"], run.optimizer)
    if "model" in state:
        _check_model(where, state["model"], model, saved.get("model"), run.model)


def _check_model(
    where: str, saved: Mapping[str, Any], model: torch.nn.Module, saved_spec: str | None, spec: str
) -> None:
    have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    of = f" (--model {saved_spec})" if saved_spec and saved_spec != spec else ""
    fix = f"Resume with the model it was saved with{of}."
    missing = sorted(have.keys() - got.keys())
    extra = sorted(got.keys() - have.keys())
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} of this model's tensors are not in it ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            )
        if extra:
            parts.append(
                f"it has {len(extra)} tensors this model lacks ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})"
            )
        raise TrainStateError(f"{where} from another model{of}: {'; '.join(parts)}. {fix}")
    shapes = [k for k in have if have[k] != got[k]]
    if shapes:
        k = shapes[0]
        raise TrainStateError(
            f"{where} from another model{of}: {k} is {list(got[k])} there and {list(have[k])} here ({len(shapes)} tensors differ in shape). {fix}"
        )


_OPTIMIZER_KEYS = {"sgd": "momentum", "adam": "betas", "adamw": "betas"}


def _check_optimizer_layout(where: str, saved: Mapping[str, Any], name: str) -> None:
    """States without a run signature: tell SGD from Adam(W) by their hyper-parameter names."""
    groups = saved.get("param_groups") or [{}]
    keys = set(groups[0])
    want = _OPTIMIZER_KEYS.get(name)
    if want is not None and want not in keys:
        other = "sgd" if "momentum" in keys else "adam or adamw" if "betas" in keys else "another optimizer"
        raise TrainStateError(
            f"{where} with {other}, this run uses {name}. Resume with the optimizer it was saved with (--optimizer)."
        )
