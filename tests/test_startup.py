"""Start-up: what ``import memfit`` and ``memfit --version`` / ``--help`` / a typo import, and the
suggestions a typo gets.

Import checks run in a fresh interpreter and assert on ``sys.modules``, never on seconds (the CPU
time is measured by benchmarks/startup.py). Without the lazy imports, ``import memfit`` loaded
FSDP/DTensor, ``torch._dynamo`` and ``torch._inductor`` (~2 s of CPU on top of torch's 1.7 s), and
``memfit --version`` imported torch and every command.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from memfit.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]

# torch's compiler and FSDP/DTensor: imported on first use only (docs/design.md, "Layers").
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed._tools",
)


def modules_after(*steps: str) -> list[set[str]]:
    """The modules a fresh interpreter holds after each of ``steps`` (code, run in turn; SystemExit
    caught)."""
    script = "import json, sys\n"
    for step in steps:
        script += (
            f"try:\n    exec({step!r})\nexcept SystemExit:\n    pass\n"
            "print('\\nMODULES', json.dumps(sorted(sys.modules)), flush=True)\n"
        )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [
        set(json.loads(line[len("MODULES ") :])) for line in proc.stdout.splitlines() if line.startswith("MODULES ")
    ]


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_torch_compiler_and_fsdp_load_on_first_use_only() -> None:
    """``import memfit`` imports no torch; a command's ``--help`` imports its options only (no torch);
    the whole front door, every command's parser and every command's module import none of torch's
    compiler or FSDP/DTensor (the code that uses them imports them)."""
    bare, one_command, everything = modules_after(
        "import memfit",
        "from memfit.cli.main import main\nmain(['profile', '--help'])",
        "names = [getattr(memfit, n) for n in memfit.__all__]\nimport importlib\n"
        "from memfit.cli.main import COMMANDS, build_parser\nbuild_parser()\n"
        "commands = [importlib.import_module(f'memfit.cli.{c}') for c in COMMANDS]",
    )
    assert "memfit" in bare and not {m for m in bare if m.split(".")[0] in ("torch", "numpy", "scipy")}
    assert "memfit.cli.args.profile" in one_command and "torch" not in one_command
    assert not {f"memfit.cli.{c}" for c in COMMANDS} & one_command
    assert not {f"memfit.cli.args.{c}" for c in COMMANDS if c != "profile"} & one_command
    assert "scipy.optimize" not in one_command  # the MILP of selective options imports it
    assert {"torch", "memfit.training.loop", "memfit.cli.train", "memfit.fitting"} <= everything
    assert [m for m in HEAVY if m in everything] == []


# What `memfit --version`, `--help` and a mistyped command may import of memfit; a command's `--help`
# and a mistyped option also import that command's options (memfit.cli.args.<command>).
ALLOWED = {"memfit._version", "memfit.errors", "memfit.cli", "memfit.cli.main", "memfit.cli.options"}
OPTIONS = {"memfit.cli.args", "memfit.cli.args.shared", "memfit.cli.args.values", "memfit.cli.outputs"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["--help"],
        [],
        ["profle"],
        ["--verison"],
        ["tran", "--json"],
        ["plan", "--modle", "x"],
        ["fit", "--help"],
        ["train", "--help"],
        ["verify", "--bn", "freeze", "--json"],  # an option without what it needs (--global-batch)
    ],
    ids=" ".join,
)
def test_version_help_and_a_mistyped_command_or_option_import_no_torch(argv: list[str]) -> None:
    (loaded,) = modules_after(f"from memfit.cli.main import main\nmain({argv!r})")
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "numpy", "scipy", "rich")}
    command = next((a for a in argv if a in COMMANDS), None)
    allowed = ALLOWED | ({f"memfit.cli.args.{command}"} | OPTIONS if command else set())
    assert not {m for m in loaded if m.startswith("memfit.") and m not in allowed}, loaded


def test_help_lists_every_command_with_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name, line in COMMANDS.items():
        assert re.search(rf"^\s+{name}\s+{re.escape(line[:40])}", out, re.M), name


def suggestion(line: str) -> str:
    """What a ``did you mean X?`` message suggests."""
    match = re.search(r"did you mean '?([^'?]+)'?\?", line)
    assert match, line
    return match.group(1)


CASES = [
    # (mistyped command line, the word to replace, what memfit should suggest)
    (["profle", "--model", "demo"], "profle", "profile"),
    (["plan", "--modle", "demo", "--budget", "1GiB"], "--modle", "--model"),
    (["plan", "--model", "demo", "--polcy=all"], "--polcy", "--policy"),
    (["--verison"], "--verison", "--version"),
    (["plan", "--model", "demo", "--budget", "1GiB", "--world-size", "2", "--parallel", "fsdp"], "fsdp", "fsdp2"),
]


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(("argv", "typo", "want"), CASES, ids=[c[1] for c in CASES])
def test_a_typo_gets_a_suggestion_memfit_accepts(
    capsys: pytest.CaptureFixture[str], argv: list[str], typo: str, want: str, json_mode: bool
) -> None:
    code = main(argv + (["--json"] if json_mode else []))
    out, err = capsys.readouterr()
    line = json.loads(out)["error"] if json_mode else err.strip()
    assert code == 2 and "\n" not in line
    command = next((a for a in argv if not a.startswith("-")), None)  # the first word (here the model may be "demo")
    command = command if command in COMMANDS else None
    assert line.startswith(f"memfit {command}: " if command else "memfit: "), line
    assert suggestion(line) == want, line
    fixed = [a.replace(typo, want, 1) if a.split("=")[0] == typo else a for a in argv]
    try:  # accepted as written: argparse raises UsageError otherwise
        assert build_parser().parse_args(fixed).command == (command or want)
    except SystemExit as exit_:  # --version prints it and exits 0
        assert exit_.code == 0 and fixed == ["--version"]


def test_an_unknown_option_without_a_close_one_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """Named before argparse's own complaint (here: the missing --budget or --policy it hides)."""
    assert main(["plan", "--model", "demo", "--zzz", "3"]) == 2
    assert capsys.readouterr().err.strip() == "memfit plan: unrecognized option --zzz. See `memfit plan --help`."


def test_abbreviations_argparse_accepts_are_not_typos() -> None:
    args = build_parser(["plan"]).parse_args(["plan", "--mod", "demo", "--budg", "1GiB"])
    assert (args.model, args.budget) == ("demo", 2**30)


def test_lazy_names_are_the_type_checking_imports() -> None:
    """``memfit.__init__``'s table of where each name lives agrees with the imports type checkers
    read, and every name of ``__all__`` resolves to the object its module defines."""
    tree = ast.parse(Path(memfit.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert declared == memfit._WHERE
    assert set(memfit.__all__) == set(declared) | {n for n in memfit.__all__ if n in vars(memfit.errors)} | {
        "__version__"
    }
    for name, where in declared.items():
        assert getattr(memfit, name) is getattr(sys.modules[where], name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        memfit.nope  # noqa: B018


def test_the_parser_for_help_has_every_command_but_not_their_options() -> None:
    """A command's options exist only where its module was imported: the parser main builds for
    `memfit --help` knows the commands but none of their options."""
    parser = build_parser([])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    assert all(len(p._actions) == 1 for p in sub.choices.values())  # -h only
