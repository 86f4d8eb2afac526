"""`memfit` command line: one module per subcommand in this package.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args, out) -> dict``: the JSON object the command prints with ``--json``. Human output goes
through ``out`` (a :class:`memfit.cli.common.Output`) and is suppressed under ``--json``. A command
signals failure by returning a dict with ``"exit_code"`` != 0 (removed from the JSON) or by raising.

Every failure leaves through :func:`main` as one line on stderr, ``memfit <command>: what, facts,
fix`` (with ``--json``: one object ``{"ok": false, "error": <that line>, ...}`` on stdout instead),
and the full traceback only with ``--debug``. Exit codes:

====  =================================================================================================
0     success
1     the command ran and its check failed (``memfit verify`` found a difference)
2     a user error: a bad option, spec, file, path or budget (:class:`~memfit.errors.MemfitError`),
      an exception raised in the workload's own code (:class:`~memfit.errors.WorkloadError`), a
      file system error (:class:`OSError`), or out of memory
3     ``memfit train`` only: the run diverged (``--max-skips`` consecutive non-finite windows; the
      last finite state is saved)
70    an internal error: a bug in memfit (any other exception); rerun with ``--debug`` and report it
      (70 is ``EX_SOFTWARE`` of sysexits.h)
75    ``memfit train`` under ``torchrun`` only: another rank stopped answering within
      ``--collective-timeout`` (75 is ``EX_TEMPFAIL``: restart the ranks and resume)
130   interrupted by SIGINT (Ctrl-C)
143   stopped by SIGTERM (``memfit train``: after finishing the window and saving)
====  =================================================================================================

Signals: from :func:`main`'s start SIGINT and SIGTERM raise :class:`~memfit.errors.Interrupted`, so
that an interruption at any stage (loading a workload, an auto-fit, measuring) leaves the one line
(``memfit train`` says what was saved and how to continue) and, with ``--json``, the JSON object;
``memfit train``'s loop handles them itself (NOTE [ Stopping a run ] in
:mod:`memfit.training.signals`). A signal while Python imports torch, before :func:`main` runs, ends
the process as Python does.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from memfit._version import __version__
from memfit.cli.common import (
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USER_ERROR,
    Output,
    check_outputs_are_not_inputs,
    to_jsonable,
)
from memfit.errors import Interrupted, MemfitError, SpecError, WorkloadError

# In the order `memfit --help` lists them; a module that does not exist yet is left out.
COMMANDS = ["demo", "profile", "plan", "verify", "explain", "fit", "estimate", "train"]


class UsageError(SpecError):
    """A command line argparse refused (unknown option, missing or malformed value)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors go through :func:`main`'s one error path instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message.rstrip('.')}. See `{self.prog} --help`.")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memfit",
        description="Train deeper models and bigger batches in the memory you have: measure, plan, "
        "apply and verify activation checkpointing and gradient accumulation.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, print the full traceback")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if importlib.util.find_spec(f"memfit.cli.{name}") is None:
            continue
        mod = importlib.import_module(f"memfit.cli.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        # SUPPRESS: a subcommand's default must not undo `memfit --debug COMMAND`.
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the full traceback"
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    previous = _handle_signals()
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


# A signal under this handler arrives as Interrupted: a plain KeyboardInterrupt was raised by code
# (memfit.workload.call_user reads this mark).
_raise_interrupted._memfit_signal_handler = True  # type: ignore[attr-defined]


def _handle_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise :class:`Interrupted` while :func:`main` runs; the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), None)
    json_mode, debug = "--json" in argv, "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        if command is not None:  # argparse's top level refuses a subcommand's extra arguments
            err = UsageError(str(err).replace("See `memfit --help`", f"See `memfit {command} --help`"))
        return _fail(err, command, json_mode=json_mode, debug=debug)
    if not getattr(args, "_run", None):
        build_parser().print_help()
        return EXIT_USER_ERROR
    out = Output(json_mode=args.json)
    try:
        check_outputs_are_not_inputs(args)
        result = args._run(args, out)
    except (Exception, KeyboardInterrupt) as err:
        return _fail(err, args.command, json_mode=args.json, debug=args.debug)
    result = dict(result or {})
    code = int(result.pop("exit_code", EXIT_OK))
    if args.json:
        _print_json(to_jsonable(result), indent=2)
    return code


def describe_error(err: BaseException, command: str | None) -> tuple[int, str]:
    """The exit code and the one line that report ``err`` for ``memfit <command>``."""
    prefix = f"memfit {command}" if command else "memfit"
    if isinstance(err, Interrupted):
        return 128 + err.signum, err.message or f"{prefix}: interrupted by {signal.Signals(err.signum).name}."
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED, f"{prefix}: interrupted."
    if isinstance(err, MemfitError):
        body = _one_line(str(err))
        if isinstance(err, WorkloadError) and err.original is not None:
            body = body.rstrip(".") + "; run with --debug for the full traceback."
        return EXIT_USER_ERROR, f"{prefix}: {body}"
    if isinstance(err, OSError):
        path = f" {err.filename!r}" if err.filename else ""
        what = err.strerror or _one_line(str(err))
        return EXIT_USER_ERROR, f"{prefix}: {what}{path}. Check the path, its permissions and the free space."
    # torch's CPU allocator reports a failed allocation as a plain RuntimeError.
    if isinstance(err, torch.OutOfMemoryError | MemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err)
    ):
        batch = "--micro-batch or --global-batch" if command in ("train", "fit", "demo") else "--batch-size"
        return EXIT_USER_ERROR, (
            f"{prefix}: out of memory ({type(err).__name__}: {_one_line(str(err))[:200]}). Lower {batch} "
            "or --seq-len, or plan for the memory you have with --budget (`memfit estimate` needs none)."
        )
    where = ""
    tb = traceback.extract_tb(err.__traceback__)
    if tb:
        where = f" (at {tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name})"
    return EXIT_INTERNAL_ERROR, (
        f"{prefix}: internal error, a bug in memfit: {type(err).__name__}: {_one_line(str(err))[:300]}{where}. "
        "Rerun with --debug and report the full traceback."
    )


def _fail(err: BaseException, command: str | None, *, json_mode: bool, debug: bool) -> int:
    code, line = describe_error(err, command)
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    if json_mode:
        obj: dict[str, Any] = {"ok": False, "error": line, "error_type": type(err).__name__, "exit_code": code}
        if isinstance(err, Interrupted):
            obj["signal"] = signal.Signals(err.signum).name
        if isinstance(err, WorkloadError):
            obj["stage"] = err.stage
            if err.where is not None:
                obj["where"] = dict(zip(("file", "line", "function"), err.where, strict=True))
        _print_json(obj)
    else:
        print(line, file=sys.stderr)
    return code


_SUBSYSTEM = re.compile(r"^memfit(\.[\w.]+| [\w-]+)?: ")


def _one_line(text: str) -> str:
    """``text`` on one line, without a leading ``memfit.<subsystem>: `` (the command says it)."""
    return _SUBSYSTEM.sub("", " ".join(text.split()), count=1)


def _print_json(obj: Any, indent: int | None = None) -> None:
    try:
        print(json.dumps(obj, indent=indent))
    except BrokenPipeError:  # `memfit ... --json | head`
        sys.stderr.close()


if __name__ == "__main__":
    sys.exit(main())
