"""Where a training state is saved: links resolved, special files refused, free space checked.

NOTE [ Save targets ]
A save writes a temporary file beside its target and renames it over the target (NOTE [ Atomic
replace ] in :mod:`memfit.training.state`). Renamed over a device, a FIFO or a socket, that would
replace the node with a regular file (as root, ``--save /dev/null`` left ``/dev/null`` a regular
file), and renamed over a symbolic link it would replace the link. So:

- :func:`save_target` resolves links first (``os.path.realpath``): the lock, the temporary file and
  the rename act on the file the link points to, the link stays a link, and two runs that name
  one file through different links take the same lock;
- :func:`check_target_kind` refuses anything that exists and is not a regular file (checked before
  any work and again at every save);
- :func:`check_free_space` compares an estimate of the save's size with the free space of the
  target's file system, before any work; a disk that fills during the run still fails the save
  with one line naming the path and the free space (:func:`disk_full_line`).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from memfit.errors import MemfitError
from memfit.units import format_bytes

__all__ = [
    "TrainStateError",
    "check_free_space",
    "check_target_kind",
    "check_writable",
    "disk_full_line",
    "free_bytes",
    "save_target",
]


class TrainStateError(MemfitError):
    """A training state cannot be written, read or resumed from."""


_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def save_target(path: str | os.PathLike[str]) -> Path:
    """The file a save to ``path`` writes: ``path`` with every symbolic link resolved (NOTE [ Save targets ])."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() or any(q.is_symlink() for q in p.parents) else p


def check_target_kind(path: str | os.PathLike[str]) -> None:
    """Refuse a target that exists and is not a regular file (a device, FIFO, socket or directory).

    Raises:
        TrainStateError: one line naming what ``path`` is and the fix.
    """
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file, or a path under a file (check_writable says so)
        return
    except OSError as err:
        raise TrainStateError(
            f"memfit.trainstate: cannot save to {str(p)!r} ({err.strerror}). Give another --save path."
        ) from None
    if stat.S_ISREG(mode):
        return
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    target = save_target(p)
    via = f" (through a link to {str(target)!r})" if target != p else ""
    if stat.S_ISDIR(mode):
        raise TrainStateError(
            f"memfit.trainstate: {str(p)!r}{via} is a directory; give a file path such as {str(p / 'state.pt')!r}."
        )
    raise TrainStateError(
        f"memfit.trainstate: cannot save to {str(p)!r}{via}: it is {kind}, not a regular file, and a save would "
        "replace it. Give --save a path to a regular file (or a new one)."
    )


def check_writable(path: str | os.PathLike[str]) -> None:
    """Check that ``path`` can be written as a checkpoint, before any work is done.

    Refuses a special file (:func:`check_target_kind`), then writes, fsyncs and removes a probe file
    in the target's directory (links resolved), so a missing or read-only directory, a full disk or a
    path under a file fails now rather than after the run.

    Raises:
        TrainStateError: the directory is missing or not a directory, ``path`` is a directory or a
            special file, or the probe could not be written (the OS's reason is in the message).
    """
    p = Path(path)
    check_target_kind(p)
    target = save_target(p)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        raise TrainStateError(
            f"memfit.trainstate: cannot save to {str(p)!r}: directory {str(parent)!r} does not exist. Create it (mkdir -p {parent}) or give another path."
        )
    if not parent.is_dir():
        raise TrainStateError(
            f"memfit.trainstate: cannot save to {str(p)!r}: {str(parent)!r} is not a directory. Give a path in a directory."
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe.", dir=parent)
        try:
            os.write(fd, b"memfit probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        raise TrainStateError(
            f"memfit.trainstate: cannot save to {str(p)!r}: writing a probe file in {str(parent)!r} failed "
            f"({err.strerror or err}). Give a writable directory (check permissions and free space)."
        ) from None


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path``'s directory."""
    target = save_target(path)
    try:
        st = os.statvfs(target.parent if str(target.parent) else ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_free_space(path: str | os.PathLike[str], need_bytes: int) -> None:
    """Refuse a run whose save of about ``need_bytes`` cannot fit beside ``path`` (NOTE [ Save targets ]).

    The file being replaced stays until the new one is complete, so the whole new save must fit in
    the free space.

    Raises:
        TrainStateError: the free space is below ``need_bytes``.
    """
    free = free_bytes(path)
    if free is not None and free < need_bytes:
        parent = save_target(path).parent
        raise TrainStateError(
            f"memfit.trainstate: cannot save to {str(path)!r}: a save of this run needs about {format_bytes(need_bytes)} "
            f"and {str(parent)!r} has {format_bytes(free)} free. Free space there or give --save a path on another disk."
        )


def disk_full_line(path: str | os.PathLike[str], had_state: bool, reason: str) -> str:
    """The line of a save that ran out of space: the path, the OS's or torch's ``reason``, the free
    space left, what is on disk."""
    free = free_bytes(path)
    left = (
        f"{format_bytes(free)} free in {str(save_target(path).parent)!r}" if free is not None else "free space unknown"
    )
    then = (
        f"the file keeps its last complete save. Free space, then continue with --resume {path}"
        if had_state
        else f"nothing was saved ({str(path)!r} was not written). Free space and run again"
    )
    return f"memfit.trainstate: saving {str(path)!r} failed: the disk is full ({reason}; {left}); {then}."
