"""What each option needs to change a run: one table, checked after parsing and before any work.

The rule: an option given on the command line either changes the run or is refused with the
reason. :data:`NEEDS` names, per command, every option that changes the run only in a context
(``plan --mfu`` only with ``--estimate``; ``--bucket-cap-mb`` only with ``--parallel ddp``), and
:data:`CONTEXT_FREE` every option that changes any run it is given to. :func:`check_options` refuses
an option given without its context, and the values no run takes together (:data:`CHECKS`), as a
usage error: one line, exit 2 (:mod:`memfit.cli.main`). tests/test_options.py enumerates every
option of every command's parser against the two tables, so an option added without a decision
fails there.

"Given" means written on the command line (:func:`given_options`), whatever its value: ``--fsdp-units
blocks`` without ``--parallel fsdp2`` is refused although ``blocks`` is the default, as it would
change nothing. Runs the table cannot judge from the command line alone are checked where the
facts are: ``--seq-len`` on a workload that makes its own batches and a model spec that sets a key
twice (:func:`memfit.load_workload`),
and options whose combination the library refuses (:meth:`memfit.training.TrainConfig.check`).

Nothing here imports torch: a refusal answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from memfit.errors import SpecError


@dataclass(frozen=True, kw_only=True, slots=True)
class Given:
    """A parsed command line: the values (defaults included), the options written on it (by
    ``dest``) and the environment (``WORLD_SIZE`` under torchrun)."""

    args: argparse.Namespace
    options: frozenset[str]
    environ: Mapping[str, str]

    def value(self, dest: str) -> object:
        return getattr(self.args, dest, None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """Where an option changes the run: ``holds`` on a command line, said as ``what``; ``add`` is
    the options that make it hold (empty where the command line cannot, e.g. torchrun's ranks), and
    ``launch`` how to run it there instead (``under torchrun, give --parallel ddp``)."""

    what: str
    holds: Callable[[Given], bool]
    add: tuple[str, ...] = ()
    launch: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Need:
    """One option's context and what the option does there (the reason of a refusal)."""

    context: Context
    does: str


def _on(dest: str) -> Callable[[Given], bool]:
    return lambda g: bool(g.value(dest))


def _is(dest: str, *values: object) -> Callable[[Given], bool]:
    return lambda g: g.value(dest) in values


def _torchrun(g: Given) -> bool:
    """Whether the environment is torchrun's with more than one process (a malformed one counts:
    memfit train reports it with its fix)."""
    env = g.environ
    return any(k in env for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")) and env.get("WORLD_SIZE", "").strip() != "1"


ESTIMATE = Context(what="--estimate", holds=_on("estimate"), add=("--estimate", "--target", "h100-sxm"))
ESTIMATE_FOR_TARGET = Context(what="--estimate", holds=ESTIMATE.holds, add=("--estimate",))
MEASURED = Context(what="a measured step (it is left out with --estimate)", holds=lambda g: not g.value("estimate"))
BUDGET = Context(what="--budget", holds=lambda g: g.value("budget") is not None, add=("--budget", "1GiB"))
VERIFY_BUDGET = Context(what="--budget (a --plan or --policy fixes the plan)", holds=BUDGET.holds)
SEARCH = Context(
    what="a plan search for --budget (a --policy fixes the plan)",
    holds=lambda g: g.value("budget") is not None and g.value("policy") is None,
)
COMPILE = Context(what="--compile", holds=_on("compile"), add=("--compile", "block"))
MEASURE = Context(what="--measure", holds=_on("measure"), add=("--measure",))
FIT_WINDOW = Context(
    what="a measured window (auto-fit runs none with --no-measure, --estimate, --parallel or --seq-len auto)",
    holds=lambda g: (
        not (g.value("no_measure") or g.value("estimate") or g.value("parallel")) and g.value("seq_len") != "auto"
    ),
)
PARALLEL = Context(what="--parallel", holds=_on("parallel"), add=("--parallel", "ddp"))
DDP = Context(what="--parallel ddp", holds=_is("parallel", "ddp"), add=("--parallel", "ddp"))
FSDP2 = Context(what="--parallel fsdp2", holds=_is("parallel", "fsdp2"), add=("--parallel", "fsdp2"))
RANKS = Context(
    what="several processes (a torchrun launch)",
    holds=lambda g: bool(g.value("parallel")) or _torchrun(g),
    launch="launch the run with torchrun --nproc-per-node N",
)
# memfit train's layouts run under torchrun only (one process refuses --parallel): nothing to add here.
TRAIN_PARALLEL = Context(
    what="--parallel ddp|fsdp2 under torchrun",
    holds=_on("parallel"),
    launch="give --parallel ddp|fsdp2 too, under torchrun",
)
TRAIN_DDP = Context(
    what="--parallel ddp under torchrun", holds=_is("parallel", "ddp"), launch="give --parallel ddp too, under torchrun"
)
TRAIN_FSDP2 = Context(
    what="--parallel fsdp2 under torchrun",
    holds=_is("parallel", "fsdp2"),
    launch="give --parallel fsdp2 too, under torchrun",
)
ONE_PROCESS = Context(
    what="one process (ranks under --parallel or torchrun never replan)",
    holds=lambda g: not g.value("parallel") and not _torchrun(g),
)
GLOBAL_BATCH = Context(
    what="--global-batch", holds=lambda g: g.value("global_batch") is not None, add=("--global-batch", "8")
)
SAVE = Context(what="--save", holds=lambda g: g.value("save") is not None, add=("--save", "run.pt"))
SEQ_AUTO = Context(what="--seq-len auto", holds=_is("seq_len", "auto"), add=("--seq-len", "auto"))
HOST_STATES = Context(
    what="--states auto, host-optimizer or host-params (the placements that use host memory)",
    holds=_is("states", "auto", "host-optimizer", "host-params"),
    add=("--states", "auto"),
)
CHOICE = Context(
    what="--measure-choice (on by default on CUDA only)",
    holds=lambda g: (
        g.value("measure_choice") is True or (g.value("measure_choice") is None and g.value("device") != "cpu")
    ),
    add=("--measure-choice",),
)
HALF = Context(
    what="--dtype bfloat16 or float16 (a float32 model's weights are its master weights)",
    holds=lambda g: str(g.value("dtype") or "float32").lower() in ("bfloat16", "bf16", "float16", "fp16"),
    add=("--dtype", "bfloat16"),
)
CALIBRATE = Context(
    what="--calibrate (fake tensors hold no values)", holds=_on("calibrate"), add=("--calibrate", "--device", "cpu")
)
ESTIMATE_DEVICE = Context(
    what="--device NAME (--target)", holds=lambda g: g.value("device") is not None, add=("--device", "cpu")
)

_PLAN_SEARCH = {
    "--keep-head": Need(context=SEARCH, does="keeps the model's head out of the plan search"),
    "--keep-activations": Need(context=SEARCH, does="keeps activation modules out of the plan search"),
    "--no-tiling": Need(context=SEARCH, does="keeps tiled and host-held options out of the plan search"),
    "--tile-modules": Need(context=SEARCH, does="names the submodules the plan search may tile"),
}
_ESTIMATE = {
    "--target": Need(context=ESTIMATE_FOR_TARGET, does="names the GPU to estimate for"),
    "--mfu": Need(context=ESTIMATE, does="sets the fraction of peak FLOP/s of the estimate's step times"),
    "--calibrate": Need(context=ESTIMATE, does="fits the estimate's step times to steps measured here"),
    "--choice-rounds": Need(context=CHOICE, does="sets the timed rounds of the measured choice"),
}
_LAYOUT = {
    "--bucket-cap-mb": Need(context=DDP, does="sets DDP's gradient bucket size"),
    "--reshard-after-forward": Need(context=FSDP2, does="sets FSDP2's reshard_after_forward"),
    "--fsdp-units": Need(context=FSDP2, does="names FSDP2's units"),
    "--param-dtype": Need(context=FSDP2, does="sets FSDP2's MixedPrecisionPolicy param_dtype"),
    "--reduce-dtype": Need(context=FSDP2, does="sets FSDP2's MixedPrecisionPolicy reduce_dtype"),
}
_JOB = {
    **_LAYOUT,
    "--world-size": Need(context=PARALLEL, does="sets the ranks of a data-parallel layout"),
    "--gpus-per-node": Need(context=PARALLEL, does="sets where the ranks' collectives run (NVLink or network)"),
    "--link-gbps": Need(context=PARALLEL, does="sets the rate of the ranks' collectives"),
}
_HOST = {"--host-budget": Need(context=HOST_STATES, does="bounds the host memory of model states placed there")}

NEEDS: dict[str, dict[str, Need]] = {
    "demo": {},
    "profile": {},
    "plan": {
        **_PLAN_SEARCH,
        **_ESTIMATE,
        **_JOB,
        **_HOST,
        "--repeats": Need(context=MEASURED, does="sets the timed repeats of measured steps"),
        "--compile-backend": Need(context=COMPILE, does="names the compiler backend of --compile's candidates"),
        "--fraction-steps": Need(context=COMPILE, does="sets --compile's bisection steps"),
        "--min-gain": Need(context=COMPILE, does="sets when memfit's compiled candidates replace the compiler's own"),
        "--accumulation-steps": Need(context=PARALLEL, does="sets the micro-steps of a rank's window"),
        "--snapshot": Need(context=MEASURE, does="writes the step --measure tracks with the plan"),
    },
    "verify": {
        "--micro-batch": Need(context=GLOBAL_BATCH, does="splits --global-batch into micro-batches"),
        "--bn": Need(
            context=GLOBAL_BATCH, does="sets how BatchNorm is compared between accumulation and one big batch"
        ),
        "--options": Need(context=VERIFY_BUDGET, does="sets what the plan for --budget may use"),
        "--compile-backend": Need(context=COMPILE, does="names the torch.compile backend"),
    },
    "explain": {},
    "fit": {
        **{k: v for k, v in _PLAN_SEARCH.items() if k in ("--no-tiling", "--tile-modules")},
        **_ESTIMATE,
        **_JOB,
        **_HOST,
        "--repeats": Need(context=MEASURED, does="sets the timed repeats of measured steps"),
        "--seq-multiple": Need(context=SEQ_AUTO, does="rounds the searched sequence length"),
        "--max-seq-len": Need(context=SEQ_AUTO, does="bounds the searched sequence length"),
        "--snapshot": Need(context=FIT_WINDOW, does="writes the chosen plan's measured window"),
    },
    "estimate": {
        **_JOB,
        **_HOST,
        "--seed": Need(context=CALIBRATE, does="seeds the weights and data of measured steps"),
        "--master-weights": Need(context=HALF, does="keeps fp32 master weights and optimizer state"),
        "--calibrate": Need(context=ESTIMATE_DEVICE, does="fits the step time of --device to steps measured here"),
    },
    "train": {
        **_HOST,
        **{
            option: Need(context={DDP: TRAIN_DDP, FSDP2: TRAIN_FSDP2}[need.context], does=need.does)
            for option, need in _LAYOUT.items()
        },
        "--min-micro-batch": Need(context=BUDGET, does="bounds the micro-batches --budget's fit considers"),
        "--guard": Need(context=BUDGET, does="enforces --budget on every step"),
        "--keep-head": Need(context=BUDGET, does="keeps the model's head out of --budget's fit"),
        "--keep-activations": Need(context=BUDGET, does="keeps activation modules out of --budget's fit"),
        "--max-replans": Need(context=ONE_PROCESS, does="bounds the out-of-memory replans"),
        "--save-every": Need(context=SAVE, does="saves every N steps to --save"),
        "--world-size": Need(context=TRAIN_PARALLEL, does="checks the ranks a --parallel layout was planned for"),
        "--collective-timeout": Need(context=RANKS, does="bounds a rank's wait for the others"),
    },
}
"""Per command: every option that changes the run only in a context, and what it does there."""

_WORKLOAD = ("--model", "--batch-size", "--seq-len", "--dtype", "--seed")
_COMMON = ("--json", "--debug", "--help")
CONTEXT_FREE: dict[str, frozenset[str]] = {
    command: frozenset(_COMMON + options)
    for command, options in {
        "demo": (
            "--model", "--global-batch", "--budget", "--steps", "--lr", "--seed", "--all-options", "--policy", "--report",
        ),
        "profile": (*_WORKLOAD, "--optimizer", "--states", "--repeats", "--device", "--snapshot"),
        "plan": (
            *_WORKLOAD, "--budget", "--policy", "--measure", "--out", "--optimizer", "--states", "--margin", "--options",
            "--report", "--compile", "--estimate", "--device", "--measure-choice", "--parallel",
        ),
        "verify": (
            *_WORKLOAD, "--device", "--plan", "--policy", "--budget", "--global-batch", "--optimizer", "--states",
            "--repeats", "--compile", "--report", "--snapshot",
        ),
        "explain": (*_WORKLOAD, "--device", "--plan", "--budget", "--policy", "--blocks", "--repeats"),
        "fit": (
            *(o for o in _WORKLOAD if o != "--batch-size"), "--budget", "--policy", "--global-batch",
            "--max-micro-batch", "--min-micro-batch", "--optimizer", "--states", "--margin", "--options",
            "--keep-head", "--keep-activations", "--no-measure", "--out", "--report", "--estimate", "--device",
            "--measure-choice", "--parallel",
        ),
        "estimate": (
            *(o for o in _WORKLOAD if o != "--seed"), "--device", "--optimizer", "--policy", "--plan", "--mfu",
            "--report", "--budget", "--states", "--parallel",
        ),
        "train": (
            *(o for o in _WORKLOAD if o != "--batch-size"), "--global-batch", "--micro-batch", "--budget", "--steps",
            "--lr", "--optimizer", "--states", "--normalize", "--policy", "--plan", "--max-grad-norm", "--amp",
            "--device", "--resume", "--save", "--max-skips", "--parallel", "--progress-jsonl",
        ),
    }.items()
}  # fmt: skip
"""Per command: every option that changes any run it is given to (checked by value where :data:`CHECKS` says)."""


# Values no run takes, alone or together: (command or None for every command, check -> the refusal or None).
MAX_WORLD_SIZE = 1 << 20
"""The most ranks a --world-size may name (a million GPUs; the largest jobs run ~10^5)."""


def _seq_bounds(g: Given) -> str | None:
    limit, multiple = g.value("max_seq_len"), g.value("seq_multiple") or 1
    if limit is not None and limit < multiple:
        return (
            f"--max-seq-len {limit} is below --seq-multiple {multiple}: no length that is a multiple of {multiple} is "
            f"at most {limit} tokens; give --max-seq-len {multiple} or more, or a smaller --seq-multiple."
        )
    return None


def _blocks(g: Given) -> str | None:
    text = g.value("blocks")
    if text is not None and not re.sub(r"[\s,]", "", str(text)):
        return (
            f"--blocks {text!r} names no block; give indices such as --blocks 0,2, or leave out --blocks (every block)."
        )
    return None


def _world_size(g: Given) -> str | None:
    n = g.value("world_size")
    if isinstance(n, int) and n > MAX_WORLD_SIZE:
        return (
            f"--world-size {n} is more ranks than any job runs (memfit takes up to {MAX_WORLD_SIZE:,}); give the "
            "number of GPUs of the job, e.g. --world-size 64."
        )
    return None


def _amp(g: Given) -> str | None:
    amp, dtype = g.value("amp"), str(g.value("dtype") or "float32").lower()
    if amp and dtype not in ("float32", "fp32"):
        return (
            f"--amp {amp} autocasts a float32 model's matmuls to {amp}; a --dtype {g.value('dtype')} model has none to "
            f"cast, so it would change nothing. Leave out --amp, or train a float32 model (--dtype float32) with --amp {amp}."
        )
    return None


CHECKS: tuple[tuple[str | None, Callable[[Given], str | None]], ...] = (
    ("fit", _seq_bounds),
    ("explain", _blocks),
    (None, _world_size),
    ("train", _amp),
)
"""Values no run takes, per command (None: every command that has the option)."""


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """The ``dest`` of every option written in ``argv`` (a command's arguments), parsed again by
    ``parser`` with no defaults (so abbreviations and ``--opt=value`` count as argparse reads them)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(list(argv), argparse.Namespace())
    finally:
        for action, default in saved:
            action.default = default
    dests = {a.dest for a in parser._actions}
    return frozenset(d for d in vars(namespace) if d in dests)


def check_options(
    command: str,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    options: frozenset[str],
    environ: Mapping[str, str] | None = None,
) -> None:
    """Refuse an option of ``command`` given without its context, and values no run takes.

    Args:
        command: the command's name.
        parser: the command's parser (to name an option by what was written).
        args: the parsed arguments.
        options: the ``dest`` of the options written (:func:`given_options`).
        environ: the environment (default ``os.environ``: torchrun's ``WORLD_SIZE``).

    Raises:
        SpecError: one line: the option, what it does, the context it lacks, and the fix.
    """
    given = Given(args=args, options=options, environ=os.environ if environ is None else environ)
    needs = NEEDS.get(command, {})
    for action in parser._actions:
        if action.dest not in options or not action.option_strings:
            continue
        need = needs.get(action.option_strings[0])
        if need is None or need.context.holds(given):
            continue
        name = _written(action, getattr(args, action.dest, None))
        fix = (
            f"add {' '.join(need.context.add)}, or leave out {name}"
            if need.context.add
            else f"to use it, {need.context.launch}; else leave out {name}"
            if need.context.launch
            else f"leave out {name}"
        )
        raise SpecError(
            f"memfit {command}: {name} {need.does}, and needs {need.context.what}: without it, {name} "
            f"changes nothing; {fix}."
        )
    for only, check in CHECKS:
        if only in (None, command) and (line := check(given)):
            raise SpecError(f"memfit {command}: {line}")


def _written(action: argparse.Action, value: object) -> str:
    """An option's name as it was written (``--no-reshard-after-forward`` for the False of a flag pair)."""
    if isinstance(action, argparse.BooleanOptionalAction) and value is False:
        return action.option_strings[1]
    return action.option_strings[0]
