"""Files a command writes (``--out``, ``--report``, ``--snapshot``, ``--save``, ``--progress-jsonl``): checked
before any work.

argparse types that refuse a path memfit could not write, or a report name of a kind the command does
not write (``r.txt`` was written as ``r.txt.png`` or failed in matplotlib; ``/dev/full`` became
``/dev/full.png``), and the check that no output overwrites a file the command reads. The commands
import these from :mod:`memfit.cli.common`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from memfit.errors import SpecError


def output_path(text: str) -> str:
    """argparse type for a file memfit writes (``--out``, ``--report``): checked before any work."""
    try:
        check_output_path(text)
    except SpecError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("memfit: ")) from None
    return text


def html_path(text: str) -> str:
    """argparse type for ``--report`` of the commands that write only the HTML page (``verify``, ``estimate``)."""
    if not is_html(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: this command's report is one HTML page; give a name ending in .html, e.g. report.html"
        )
    return output_path(text)


def report_path(text: str) -> str:
    """argparse type for ``--report`` of ``plan`` and ``fit``: FILE.html (the page) or FILE.png (the plots)."""
    if not (is_html(text) or text.lower().endswith(".png")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the report is an HTML page or a PNG image; give a name ending in .html or .png, e.g. report.html"
        )
    return output_path(text)


def snapshot_path(text: str) -> str:
    """argparse type for ``--snapshot``: a ``.pickle`` file, the format of ``torch.cuda.memory._dump_snapshot``."""
    if not text.lower().endswith((".pickle", ".pkl")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the snapshot is a pickle in the format of torch.cuda.memory._dump_snapshot (PyTorch's "
            "memory_viz opens it); give a name ending in .pickle, e.g. step.pickle"
        )
    return output_path(text)


def png_path(text: str) -> str:
    """argparse type for ``memfit demo --report``: a PNG name, or '' for no report (the parent is made later)."""
    if text and not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the demo's report is a PNG image (its HTML page is written beside it); give a name ending in "
            ".png, e.g. out/memfit-demo.png, or '' for none"
        )
    return text


def check_output_path(text: str, *, create_dir: bool = False) -> None:
    """Refuse a path memfit could not write at the end of a command, before the command's work.

    Args:
        text: the file path.
        create_dir: create a missing parent directory (as ``memfit demo`` does for its plot).

    Raises:
        SpecError: the path is a directory, its directory is missing (and not created) or not writable.
    """
    path = Path(text)
    parent = path.parent
    if not text.strip() or path.is_dir():
        raise SpecError(
            f"memfit: {text!r} is a directory, not a file name; give a file path, e.g. {str(path / 'plan.json')!r}"
        )
    if create_dir and not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError(
                f"memfit: cannot create directory {str(parent)!r} for {text!r} ({err.strerror}); choose a writable location"
            ) from None
    if parent.exists() and not parent.is_dir():
        raise SpecError(
            f"memfit: cannot write {text!r}: {str(parent)!r} is a file, not a directory; choose a writable location"
        )
    if not parent.is_dir():
        raise SpecError(
            f"memfit: cannot write {text!r}: directory {str(parent)!r} does not exist; create it first (mkdir -p {parent})"
        )
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SpecError(f"memfit: cannot write {text!r}: permission denied; choose a writable location")


_OUTPUTS = ("out", "report", "snapshot", "save", "progress_jsonl")
"""The options naming a file a command writes."""


def check_outputs_are_not_inputs(args: argparse.Namespace) -> None:
    """Refuse a file to write that is one the command reads (the workload file of ``--model``,
    ``--plan``, ``--resume``) or another file it writes: ``plan --out wl.py`` must not overwrite the
    workload's code. ``train --save PATH --resume PATH`` (a run continued in place) is allowed.

    Raises:
        SpecError: naming both options and the fix.
    """
    model = getattr(args, "model", None)
    reads: list[tuple[str, str]] = []
    if isinstance(model, str) and ":" in model and model.rsplit(":", 1)[0].endswith(".py"):
        reads.append((f"the workload file of --model {model}", model.rsplit(":", 1)[0]))
    reads += [(f"--{k}", v) for k in ("plan", "resume") if isinstance(v := getattr(args, k, None), str)]
    writes = [(f"--{k.replace('_', '-')}", v) for k in _OUTPUTS if isinstance(v := getattr(args, k, None), str)]
    for i, (opt, path) in enumerate(writes):
        for what, other in reads + [(o, p) for o, p in writes[:i]]:
            if (opt, what) == ("--save", "--resume") or not _same_file(path, other):
                continue
            verb = "reads" if (what, other) in reads else "also writes"
            raise SpecError(
                f"memfit: {opt} {path!r} is {what}, which this command {verb}; writing it there would overwrite "
                f"that file. Give {opt} another path."
            )


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links and symlinks included
    except OSError:  # one does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def is_html(path: str | None) -> bool:
    """``--report FILE.html`` (the page) rather than a PNG."""
    return bool(path) and str(path).lower().endswith((".html", ".htm"))
