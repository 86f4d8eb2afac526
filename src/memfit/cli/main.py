"""`memfit` command line: one module per subcommand in this package.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args, out) -> dict``: the JSON object the command prints with ``--json``. Human output goes
through ``out`` (a :class:`memfit.cli.common.Output`) and is suppressed under ``--json``. A command
signals failure by returning a dict with ``"exit_code"`` != 0 (removed from the JSON) or by raising
:class:`memfit.errors.MemfitError` (exit 2, message on stderr, or ``{"error": ...}`` with ``--json``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence

from memfit.cli.common import Output, to_jsonable
from memfit.errors import MemfitError

# In the order `memfit --help` lists them; a module that does not exist yet is left out.
COMMANDS = ["demo", "profile", "plan", "verify", "explain", "fit", "estimate", "train"]


def build_parser() -> argparse.ArgumentParser:
    from memfit import __version__

    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Train deeper models and bigger batches in the memory you have: measure, plan, "
        "apply and verify activation checkpointing and gradient accumulation.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if importlib.util.find_spec(f"memfit.cli.{name}") is None:
            continue
        mod = importlib.import_module(f"memfit.cli.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    out = Output(json_mode=args.json)
    try:
        result = args._run(args, out)
    except MemfitError as err:
        if args.json:
            print(json.dumps({"ok": False, "error": str(err), "error_type": type(err).__name__}))
        else:
            out.error(str(err))
        return 2
    except KeyboardInterrupt:
        out.error("interrupted")
        return 130
    result = dict(result or {})
    code = int(result.pop("exit_code", 0))
    if args.json:
        try:
            print(json.dumps(to_jsonable(result), indent=2))
        except BrokenPipeError:  # `memfit ... --json | head`
            sys.stderr.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
