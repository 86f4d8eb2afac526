"""Every option either changes the run or is refused with the reason (memfit.cli.options).

The table test enumerates every option of every command's parser: each is in ``NEEDS`` (with the
context it needs) or in ``CONTEXT_FREE``, so an option added without a decision fails here. The
cases are the options that were silently ignored without their context; each is refused before any
work (exit 2, one line naming the option), passes without the option, and passes with the fix the
message suggests, as written.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

from memfit.cli import options as cli_options
from memfit.cli.args import shared
from memfit.cli.main import COMMANDS, build_parser, main
from memfit.errors import SpecError

TRAIN = ["train", "--global-batch", "4", "--steps", "1"]
PLAN = ["plan", "--budget", "1GiB"]
FIT = ["fit", "--budget", "1GiB", "--global-batch", "4"]

# (command line, the tokens that are refused there)
CASES = [
    (TRAIN, ["--keep-head"]),
    (TRAIN, ["--keep-activations"]),
    ([*TRAIN, "--parallel", "ddp"], ["--max-replans", "2"]),
    (TRAIN, ["--bucket-cap-mb", "10"]),
    (TRAIN, ["--no-reshard-after-forward"]),
    (TRAIN, ["--fsdp-units", "blocks"]),
    (TRAIN, ["--collective-timeout", "5"]),
    (TRAIN, ["--world-size", "2"]),
    (TRAIN, ["--save-every", "2"]),
    (TRAIN, ["--min-micro-batch", "2"]),
    (TRAIN, ["--guard"]),
    (TRAIN, ["--param-dtype", "bfloat16"]),
    (PLAN, ["--mfu", "0.5"]),
    (PLAN, ["--target", "h100-sxm"]),
    (PLAN, ["--calibrate"]),
    (PLAN, ["--min-gain", "0.1"]),
    (PLAN, ["--compile-backend", "aot_eager"]),
    (PLAN, ["--fraction-steps", "2"]),
    (PLAN, ["--bucket-cap-mb", "10"]),
    (PLAN, ["--param-dtype", "bfloat16"]),
    (PLAN, ["--reduce-dtype", "float32"]),
    (PLAN, ["--world-size", "2"]),
    (PLAN, ["--accumulation-steps", "2"]),
    (PLAN, ["--gpus-per-node", "4"]),
    ([*PLAN, "--states", "device"], ["--host-budget", "1GiB"]),  # the default, auto, uses it
    ([*PLAN, "--device", "cpu"], ["--choice-rounds", "2"]),
    ([*PLAN, "--estimate", "--target", "h100-sxm"], ["--repeats", "5"]),
    (["plan", "--policy", "all"], ["--keep-head"]),
    (["plan", "--policy", "all"], ["--no-tiling"]),
    ([*FIT, "--policy", "all"], ["--tile-modules", "mlp"]),
    (FIT, ["--link-gbps", "400"]),
    (FIT, ["--max-seq-len", "64"]),
    (FIT, ["--seq-multiple", "16"]),
    (["verify"], ["--bn", "freeze"]),
    (["verify"], ["--micro-batch", "2"]),
    (["verify", "--policy", "all"], ["--options", "all"]),
    (["verify"], ["--compile-backend", "aot_eager"]),
    (["estimate"], ["--master-weights"]),
    (["estimate"], ["--seed", "3"]),
    (["estimate"], ["--calibrate"]),
    (["estimate", "--device", "h100-sxm"], ["--fsdp-units", "blocks"]),
    # values no run takes
    ([*FIT, "--seq-len", "auto", "--seq-multiple", "16"], ["--max-seq-len", "8"]),
    (["explain", "--policy", "all"], ["--blocks", ""]),
    (["explain", "--policy", "all"], ["--blocks", " , "]),
    (["estimate", "--parallel", "ddp", "--device", "h100-sxm"], ["--world-size", str(10**12)]),
    ([*TRAIN, "--dtype", "float64"], ["--amp", "bf16"]),
]


def refusal(argv: list[str], environ: dict[str, str] | None = None) -> str | None:
    """The table's refusal of a command line (None: it passes), without running anything."""
    parser = build_parser([argv[0]])
    args = parser.parse_args(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    try:
        cli_options.check_options(argv[0], sub, args, cli_options.given_options(sub, argv[1:]), environ or {})
    except SpecError as err:
        return str(err)
    return None


def test_every_option_of_every_command_is_decided() -> None:
    """Each option of each command is in NEEDS (with its context) or CONTEXT_FREE, not both, and
    the tables name no option a command lacks."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) == set(COMMANDS) == set(cli_options.NEEDS) == set(cli_options.CONTEXT_FREE)
    for command, sub in subs.items():
        names = {a.option_strings[0] for a in sub._actions if a.option_strings}
        names = {"--help" if n == "-h" else n for n in names}
        needs, free = set(cli_options.NEEDS[command]), cli_options.CONTEXT_FREE[command]
        assert not needs & free, (command, needs & free)
        assert names - needs - free == set(), f"memfit {command}: options without a decision"
        assert (needs | free) - names == set(), f"memfit {command}: the table names options the command lacks"


@pytest.mark.parametrize(("argv", "refused"), CASES, ids=[" ".join(c[0][:1] + c[1]) for c in CASES])
def test_an_option_without_what_it_needs_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], argv: list[str], refused: list[str]
) -> None:
    code = main([*argv, *refused, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["exit_code"] == 2 and out["error_type"] == "SpecError", out
    line = out["error"]
    assert "\n" not in line and line.startswith(f"memfit {argv[0]}: "), line
    assert refused[0] in line, line
    assert refusal(argv) is None  # without the option, the same command line passes


@pytest.mark.parametrize(("argv", "refused"), [c for c in CASES if c[1][0] != "--blocks"], ids=str)
def test_the_fix_a_refusal_suggests_is_accepted_as_written(argv: list[str], refused: list[str]) -> None:
    line = refusal([*argv, *refused])
    assert line is not None
    added = re.search(r"; add (.+?), or leave out", line)
    if added:
        assert refusal([*argv, *refused, *shlex.split(added.group(1))]) is None, line
    given = re.search(r"give (--[\w-]+ \d+)", line)  # a value to give instead
    if given:
        option, value = given.group(1).split()
        fixed = [*argv, *refused]
        fixed[fixed.index(option) + 1] = value
        assert refusal(fixed) is None, line


def test_ranks_under_torchrun_are_a_context() -> None:
    """``--collective-timeout`` bounds the waits of a torchrun job, also without --parallel (DDP then)."""
    argv = [*TRAIN, "--collective-timeout", "5"]
    assert refusal(argv, {"WORLD_SIZE": "1"}) is not None
    assert refusal(argv, {"WORLD_SIZE": "2"}) is None
    assert refusal([*TRAIN, "--max-replans", "2"], {"WORLD_SIZE": "2"}) is not None


def test_an_option_written_as_its_default_is_still_refused_where_it_changes_nothing() -> None:
    """Given means written: ``--bucket-cap-mb 25`` (the default) without DDP is refused, left out it is not."""
    assert "--bucket-cap-mb" in (refusal([*PLAN, "--bucket-cap-mb", "25"]) or "")
    assert refusal([*PLAN, "--bucket-cap-mb", "25", "--parallel", "ddp"]) is None
    assert refusal([*PLAN, "--buck", "25"]) is not None  # an abbreviation argparse accepts counts as given


def test_a_no_flag_is_named_as_written() -> None:
    line = refusal([*PLAN, "--no-reshard-after-forward"]) or ""
    assert line.startswith("memfit plan: --no-reshard-after-forward "), line


def test_the_library_names_repeated_without_torch_are_the_librarys() -> None:
    from memfit.accumulate import Normalize
    from memfit.apply.compiled import COMPILE_MODES
    from memfit.capture.step import OPTIMIZERS
    from memfit.cli.common import MFU_HELP
    from memfit.estimation.devices import DEVICES
    from memfit.optim.build import implemented_states
    from memfit.optim.states import ModelStates
    from memfit.plan.parallel import DDP_BUCKET_CAP_BYTES, ParallelKind
    from memfit.plan.policies import POLICY_HELP
    from memfit.training.config import DEFAULT_MAX_SKIPS
    from memfit.training.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S
    from memfit.training.signals import EXIT_DIVERGED
    from memfit.units import DTYPES

    assert shared.OPTIMIZERS == tuple(OPTIMIZERS)
    assert shared.STATES == tuple(implemented_states())
    assert shared.ESTIMATE_STATES == ("auto", *(m.value for m in ModelStates))
    assert shared.COMPILE_MODES == tuple(COMPILE_MODES)
    assert shared.PARALLEL_KINDS == tuple(k.value for k in ParallelKind)
    assert shared.DDP_BUCKET_CAP_MB == DDP_BUCKET_CAP_BYTES / 2**20
    assert shared.NORMALIZE == tuple(n.value for n in Normalize)
    assert set(shared.DTYPE_NAMES) == set(DTYPES)
    assert shared.ESTIMATE_DEVICES == tuple(DEVICES)
    assert (shared.POLICY_HELP, shared.MFU_HELP) == (POLICY_HELP, MFU_HELP)
    assert (shared.DEFAULT_MAX_SKIPS, shared.DEFAULT_COLLECTIVE_TIMEOUT_S, shared.EXIT_DIVERGED) == (
        DEFAULT_MAX_SKIPS,
        DEFAULT_COLLECTIVE_TIMEOUT_S,
        EXIT_DIVERGED,
    )


def test_command_modules_define_no_options() -> None:
    """A command's options live in memfit.cli.args.<command> only (parsed without torch)."""
    import importlib

    for command in COMMANDS:
        assert not hasattr(importlib.import_module(f"memfit.cli.{command}"), "add_arguments"), command


def test_a_spec_that_sets_a_key_twice_is_refused() -> None:
    from memfit.models.registry import load_workload

    with pytest.raises(SpecError, match="sets 'n_layer' more than once"):
        load_workload("demo?n_layer=2&n_layer=3")
    with pytest.raises(SpecError, match="more than once"):
        load_workload("hf:gpt2?n_layer=1&n_embd=32&n_layer=2")


def test_seq_len_on_a_workload_of_one_shape_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A file's workload without ``make_batch_at`` makes its own batches: ``--seq-len`` would change nothing."""
    from memfit.models.registry import load_workload

    with pytest.raises(SpecError, match="would change nothing"):
        load_workload("examples/convnet.py:build", seq_len=16)
    assert main(["profile", "--model", "examples/convnet.py:build", "--seq-len", "16", "--json"]) == 2
    assert "--seq-len" in json.loads(capsys.readouterr().out)["error"]
