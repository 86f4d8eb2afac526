"""`memfit` command line: one module per subcommand in this package.

Each command is named in :data:`COMMANDS` with its one-line help, and its module defines
``add_arguments(parser)`` and ``run(args, out) -> dict``: the JSON object the command prints with
``--json``. Human output goes through ``out`` (a :class:`memfit.cli.common.Output`) and is suppressed
under ``--json``. A command signals failure by returning a dict with ``"exit_code"`` != 0 (removed
from the JSON) or by raising.

Start-up: a command's module imports torch and the library (seconds of CPU), so :func:`main`
imports only the module of the command it runs; ``memfit --version``, ``memfit --help`` and a
mistyped command import neither (tests/test_startup.py). A mistyped command, choice or option gets
the closest one memfit knows: ``memfit profle`` -> "did you mean 'profile'?".

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

Signals: while a command runs, SIGINT and SIGTERM raise :class:`~memfit.errors.Interrupted`, so
that an interruption at any stage (loading a workload, an auto-fit, measuring) leaves the one line
(``memfit train`` says what was saved and how to continue) and, with ``--json``, the JSON object;
``memfit train``'s loop handles them itself (NOTE [ Stopping a run ] in
:mod:`memfit.training.signals`). Before that, from :func:`main`'s first line, while torch and the
command's module are imported (seconds), a signal writes the line (``stopped by SIGTERM during
start-up``; with ``--json`` the object) and ends the process at once, nothing having run. Only a
signal in the tenths of a second Python takes to start, before :func:`main` runs, ends the process
as Python does.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

from memfit._version import __version__
from memfit.cli.options import check_options, given_options
from memfit.errors import Interrupted, MemfitError, SpecError, WorkloadError

# Exit codes of every command (the table is in this module's docstring).
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 70
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# Each command (the module memfit.cli.<name>) and its one-line help, in the order `memfit --help` lists them.
COMMANDS = {
    "demo": "the main job: auto-fit the built-in GPT to a memory budget, verify, and train it",
    "profile": "measure a training step of a workload, per block (bytes saved, seconds)",
    "plan": "choose the fastest checkpoint plan whose whole-step peak fits a memory budget",
    "verify": "check that a plan changes memory and time, not gradients or buffers (exit 1 when not)",
    "explain": "show, per block, every tensor autograd saves and whether a plan keeps, recomputes or offloads it",
    "fit": "choose micro-batch, accumulation steps and checkpoint plan that train fastest within a budget",
    "estimate": "estimate a training step's memory (and time on a GPU) without allocating the model",
    "train": "train a workload with exact gradient accumulation (progress, samples/s, peak memory; torchrun-aware)",
}


class UsageError(SpecError):
    """A command line argparse refused (unknown option, missing or malformed value)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors go through :func:`main`'s one error path instead of exiting, and a
    mistyped choice (a command, an option's value) gets the closest valid one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts with a minus and a digit is a value, not an option: `--budget -1MiB` reaches
        # the size's own check (argparse took it for an option and said "expected one argument").
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        message = message.rstrip(".")
        raise UsageError(f"{self.prog}: {message}{'' if message.endswith('?') else '.'} See `{self.prog} --help`.")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check (Python 3.14 adds suggest_on_error to it), with the suggestion.
        if action.choices is None or value in action.choices:
            return
        choices = [str(c) for c in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1)
        raise argparse.ArgumentError(
            action,
            f"invalid choice: {value!r} (choose from {', '.join(map(repr, choices))})"
            + (f"; did you mean {close[0]!r}?" if close else ""),
        )


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """memfit's parser: every command of :data:`COMMANDS`, with its options for ``commands`` only.

    Args:
        commands: the commands whose options to add (default: all). A command's options come from
            its module, which imports torch and the library: :func:`main` adds only the one it runs.
    """
    parser = _Parser(
        prog="memfit",
        description="Train deeper models and bigger batches in the memory you have: measure, plan, "
        "apply and verify activation checkpointing and gradient accumulation.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, print the full traceback")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = set(COMMANDS if commands is None else commands)
    for name, help_line in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name in wanted:
            _add_command(p, name)
    return parser


def _add_command(p: argparse.ArgumentParser, name: str) -> None:
    # The options only (memfit.cli.args.<name>, no torch): the command's module is imported to run it.
    options = importlib.import_module(f"memfit.cli.args.{name}")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    # SUPPRESS: a subcommand's default must not undo `memfit --debug COMMAND`.
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the full traceback"
    )
    options.add_arguments(p)


def main(argv: Sequence[str] | None = None) -> int:
    # First of all: a signal during the imports that follow (torch's take seconds) leaves memfit's line.
    previous = _handle_signals(_exit_at_start_up(list(sys.argv[1:] if argv is None else argv)))
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


def _handle_signals(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """SIGINT and SIGTERM go to ``handler`` while :func:`main` runs; the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _exit_at_start_up(argv: Sequence[str]) -> Callable[[int, Any], None]:
    """The handler while the command line is read and torch and the command's modules are imported.

    Nothing ran and nothing was written yet, so it writes the line (or the JSON object) and leaves at
    once: an exception raised there would travel through the imports, and torch's C++ code swallows
    one raised while it imports NumPy (the signal was lost, or NumPy left half-imported).
    """
    command, json_mode = _command_of(argv), "--json" in argv

    def leave(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        line = (
            f"memfit{' ' + command if command else ''}: stopped by {name} during start-up (importing torch and "
            "memfit), before any work; nothing was run or written. Run the same command again."
        )
        code = 128 + signum
        if json_mode:
            obj = {"ok": False, "error": line, "error_type": "Interrupted", "exit_code": code, "signal": name}
            os.write(sys.stdout.fileno(), (json.dumps(obj) + "\n").encode())
        else:
            os.write(sys.stderr.fileno(), (line + "\n").encode())
        os._exit(code)

    leave._memfit_signal_handler = True  # type: ignore[attr-defined]
    return leave


def _command_of(argv: Sequence[str]) -> str | None:
    """The command of a command line: its first word (memfit's own options take no value)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command if command in COMMANDS else None


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    json_mode, debug = "--json" in argv, "--debug" in argv
    parser = build_parser([command] if command else [])
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        return _fail(_usage_error(err, parser, argv, command), command, json_mode=json_mode, debug=debug)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    try:  # an option without what it needs, or values no run takes: refused before any work (memfit.cli.options)
        sub = _subparsers(parser).choices[args.command]
        check_options(args.command, sub, args, given_options(sub, argv[argv.index(args.command) + 1 :]))
    except SpecError as err:
        return _fail(err, args.command, json_mode=json_mode, debug=debug)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit code."""
    # A command's first line, before torch is imported (seconds): `memfit demo` says what it runs at once.
    first_line = getattr(importlib.import_module(f"memfit.cli.args.{args.command}"), "first_line", None)
    if first_line is not None and not args.json:
        print(first_line(args), file=sys.stderr, flush=True)
    # The commands' shared module imports torch and the library: only a command that runs pays it.
    from memfit.cli.common import Output, check_outputs_are_not_inputs, to_jsonable

    # Imported under the start-up handler (torch's imports must not be interrupted by an exception).
    command = importlib.import_module(f"memfit.cli.{args.command}")
    _handle_signals(_raise_interrupted)  # the command runs: a signal is an exception its code can act on
    out = Output(json_mode=args.json)
    warned: list[str] = []
    try:
        with _python_warnings(out, warned):
            check_outputs_are_not_inputs(args)
            # --model and --device: settled (and said) before the command builds its workload (memfit.cli.device)
            settle = getattr(command, "settle", None)
            settled = settle(args, out, command=args.command) if settle is not None else {}
            args.settled_json = settled  # an --report page's JSON has them too (write_html_report)
            result = command.run(args, out)
    except (Exception, KeyboardInterrupt) as err:
        return _fail(err, args.command, json_mode=args.json, debug=args.debug, warned=warned)
    result = dict(result or {})
    for key, value in settled.items():
        result.setdefault(key, value)
    if warned:
        result["warnings"] = [*result.get("warnings", []), *warned]
    code = int(result.pop("exit_code", EXIT_OK))
    if args.json:
        _print_json(to_jsonable(result), indent=2)
    return code


def _usage_error(err: UsageError, parser: argparse.ArgumentParser, argv: list[str], command: str | None) -> UsageError:
    """The error to report for a command line argparse refused: an unknown ``--option`` first (with
    the closest known one), else argparse's, pointing to the command's help."""
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))  # the command's place
    sub = _subparsers(parser).choices[command] if command else None
    unknown = _unknown_option(parser, argv[:at]) or (sub is not None and _unknown_option(sub, argv[at + 1 :]))
    if unknown:
        return unknown
    if command is not None:  # argparse's top level refuses a subcommand's extra arguments
        return UsageError(str(err).replace("See `memfit --help`", f"See `memfit {command} --help`"))
    return err


_LONG_OPTION = re.compile(r"--[A-Za-z][\w-]*")


def _unknown_option(parser: argparse.ArgumentParser, args: Sequence[str]) -> UsageError | None:
    """The first ``--option`` of ``args`` that ``parser`` does not know (nor as an abbreviation)."""
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    for arg in args:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if not _LONG_OPTION.fullmatch(name) or any(o.startswith(name) for o in known):
            continue
        # Compared without the dashes, which every option shares.
        close = difflib.get_close_matches(name[2:], [o[2:] for o in known], n=1, cutoff=0.7)
        hint = f"; did you mean --{close[0]}?" if close else "."
        return UsageError(f"{parser.prog}: unrecognized option {name}{hint} See `{parser.prog} --help`.")
    return None


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


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
    # torch's CPU allocator reports a failed allocation as a plain RuntimeError; without torch imported
    # no torch error was raised.
    torch = sys.modules.get("torch")
    if isinstance(err, (MemoryError, *([torch.OutOfMemoryError] if torch else []))) or (
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


@contextlib.contextmanager
def _python_warnings(out: Any, warned: list[str]) -> Iterator[None]:
    """Python warnings raised while a command runs (torch's, a library's, the workload's), each as
    one line with its path relative (``torch/serialization.py:1024: FutureWarning: ...``) appended to
    ``warned``: the JSON's ``warnings`` with ``--json`` (nothing raw on stderr), memfit's warning
    line on stderr without. Python would print two lines with the absolute path."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
        line = f"{_short_path(filename)}:{lineno}: {category.__name__}: {_one_line(str(message))}"
        warned.append(line)
        if not out.json_mode:
            out.warn(line)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _short_path(filename: str) -> str:
    """A source file's path as a user reads it: relative to the site-packages it is installed in
    (``torch/serialization.py``), else to the working directory."""
    path = os.path.abspath(filename)
    for packages in ("site-packages", "dist-packages"):
        at = path.rfind(f"{os.sep}{packages}{os.sep}")
        if at >= 0:
            return path[at + len(packages) + 2 :]
    if path.startswith(os.getcwd() + os.sep):
        return os.path.relpath(path)
    return os.path.basename(path)


def _fail(err: BaseException, command: str | None, *, json_mode: bool, debug: bool, warned: Sequence[str] = ()) -> int:
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
        if warned:
            obj["warnings"] = list(warned)
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
