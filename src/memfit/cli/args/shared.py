"""Options several commands share, and the library's names they offer, without importing torch.

The names (optimizers, placements, layouts, dtypes, estimate targets) are the library's, repeated
here so that parsing a command line imports neither torch nor the library; tests/test_options.py
checks each against the library's own. A value that only the library can check (a size, a
policy, a device) is checked by the parser of :mod:`memfit.cli.common`, imported when such a value
is given.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.args.values import (
    margin_arg,
    nonneg_int,  # noqa: F401  (the commands' modules import it from here)
    positive_float,
    positive_int,
    positive_number,
    seed_arg,
    seq_len_arg,
    tile_modules_arg,
)
from memfit.cli.outputs import snapshot_path

# The library's names (tests/test_options.py checks each against its source, named beside it).
OPTIMIZERS = ("adamw", "adam", "sgd")  # memfit.capture.step.OPTIMIZERS
STATES = ("device", "step-in-backward", "host-optimizer")  # memfit.optim.build.implemented_states()
ESTIMATE_STATES = (
    "auto",
    "device",
    "step-in-backward",
    "host-optimizer",
    "host-params",
)  # estimate_states.STATES_CHOICES
COMPILE_MODES = ("block", "model")  # memfit.apply.compiled.COMPILE_MODES
PARALLEL_KINDS = ("ddp", "fsdp2")  # memfit.plan.parallel.ParallelKind
DDP_BUCKET_CAP_MB = 25.0  # memfit.plan.parallel.DDP_BUCKET_CAP_BYTES / 2**20
NORMALIZE = ("auto", "tokens", "mean", "sum")  # memfit.accumulate.Normalize
DTYPE_NAMES = ("bf16", "bfloat16", "float16", "float32", "float64", "fp16", "fp32", "fp64")  # memfit.units.DTYPES
DEFAULT_MAX_SKIPS = 5  # memfit.training.config.DEFAULT_MAX_SKIPS
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # memfit.training.distributed.DEFAULT_COLLECTIVE_TIMEOUT_S
EXIT_DIVERGED = 3  # memfit.training.signals.EXIT_DIVERGED
ESTIMATE_DEVICES = (  # memfit.estimation.devices.DEVICES
    "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4", "l40s", "rtx4090", "rtx3090", "a10g",
    "v100-32gb", "t4", "cpu",
)  # fmt: skip
POLICY_HELP = (  # memfit.plan.policies.POLICY_HELP
    "'none' (keep everything), 'all' (recompute every block, as HF gradient checkpointing does), 'sqrt' "
    "(checkpoint_sequential-style segments of about sqrt(N) blocks, each recomputed as one unit), 'every:K' "
    "(recompute every K-th block), 'selective:PRESET' (save_matmuls, save_attention, save_matmuls_and_attention, "
    "torchtitan), 'selective:save:OP[@K],...' (op overloads whose outputs every block keeps, e.g. "
    "selective:save:aten.addmm.default@1) or 'offload' (what every block saves waits in host memory)"
)
MFU_HELP = (  # memfit.cli.common.MFU_HELP, from memfit.estimation.devices.PUBLISHED_MFU
    "assumed fraction of the device's peak FLOP/s (default: the one fitted to a published run of its class, "
    "h100 0.387, a100 0.634; else 0.4)"
)
DEVICE_HELP = "where the model runs and is measured: cpu, cuda or cuda:N (default: cuda when available, else cpu)"


# argparse types checked by the library's parsers (memfit.cli.common), imported when a value is given.


def size_arg(text: str) -> int:
    """argparse type for sizes: ``300MiB`` -> bytes (:func:`memfit.cli.common.size_arg`)."""
    from memfit.cli import common

    return common.size_arg(text)


def policy_arg(text: str) -> Any:
    """argparse type for ``--policy``: the typed policy (:func:`memfit.cli.common.policy_arg`)."""
    from memfit.cli import common

    return common.policy_arg(text)


def device_arg(text: str) -> str:
    """argparse type for a device to run on (:func:`memfit.cli.common.device_arg`)."""
    from memfit.cli import common

    return common.device_arg(text)


def device_or_target_arg(text: str) -> str:
    """argparse type of ``--device`` beside ``--target`` (:func:`memfit.cli.device.device_or_target_arg`)."""
    from memfit.cli import device

    return device.device_or_target_arg(text)


def dtype_arg(text: str) -> str:
    """argparse type for ``--dtype``: one of :data:`DTYPE_NAMES` (returned as given, for ``parse_dtype``)."""
    if text.lower() not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; memfit trains in floating point: use one of {', '.join(sorted(DTYPE_NAMES))}"
        )
    return text


# Options of several commands.


def add_workload_args(p: argparse.ArgumentParser, *, batch: bool = True, seq_auto: bool = False) -> None:
    """``--model``, ``--batch-size``, ``--seq-len``, ``--dtype``, ``--seed``; ``seq_auto``: ``--seq-len``
    also takes ``auto``."""
    p.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="workload: 'demo', 'hf:TYPE[?key=value&...]' or 'path/to/file.py:NAME' (default: the one a --plan "
        "file was made for, else demo)",
    )
    if batch:
        p.add_argument(
            "--batch-size", type=positive_int, default=None, metavar="B", help="batch size (default: the workload's)"
        )
    p.add_argument(
        "--seq-len",
        type=seq_len_arg if seq_auto else positive_int,
        default=None,
        metavar="T",
        help="sequence length for token workloads"
        + (
            "; auto: the longest that trains within --budget at the micro-batch (see --seq-multiple)"
            if seq_auto
            else ""
        ),
    )
    p.add_argument(
        "--dtype", type=dtype_arg, default=None, metavar="D", help="float32 (default), float64, bfloat16, float16"
    )
    p.add_argument("--seed", type=seed_arg, default=0, help="seed for weights, data and dropout (default 0)")


def add_states_arg(p: argparse.ArgumentParser, *, auto: bool = False) -> None:
    """``--states``: where the measured step's model states live and when its optimizer steps
    (the placements that have an implementation, :class:`memfit.optim.ModelStates`); with ``auto``
    (plan, fit, train) also ``auto``, their default (:mod:`memfit.cli.states`), ``host-params``
    (refused there with the estimate that prices it) and ``--host-budget``."""
    p.add_argument(
        "--states",
        default="auto" if auto else "device",
        choices=ESTIMATE_STATES if auto else STATES,
        help=(
            "model states' placement: auto (default): device when the step fits --budget that way, else the "
            "fastest placement that fits (said in the output as states_reason); device: parameters, gradients and "
            "optimizer state on the device, the optimizer step after the backward (the opt-out of auto)"
            if auto
            else "model states' placement: device (default): parameters, gradients and optimizer state on the "
            "device, the optimizer step after the backward"
        )
        + "; step-in-backward: each parameter steps as soon as its gradient is complete, inside the backward, and "
        "its gradient is freed (lower peak, the same parameters; needs a window of one micro-step and no gradient "
        "clipping)" + ("; host-optimizer: optimizer state and step on the host" if auto else ""),
    )
    if auto:
        p.add_argument(
            "--host-budget",
            type=size_arg,
            default=None,
            metavar="SIZE",
            help="with --states auto: host memory the model states may use (default: this machine's available "
            "memory less 10 %%)",
        )


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """The planner's options, the same on ``memfit plan`` and ``memfit fit`` (``--states`` among them)."""
    add_states_arg(p, auto=True)
    p.add_argument(
        "--margin", type=margin_arg, default=0.02, help="safety margin on predicted peaks (default 0.02 = 2%%)"
    )
    p.add_argument(
        "--options",
        default="block",
        choices=["block", "all"],
        help="block: keep/recompute per block and segments (default); all: also selective variants and offload (slower to measure)",
    )
    p.add_argument(
        "--keep-head",
        action="store_true",
        help="never replace the model's head: without it, causal LMs may get the chunked loss (logits never materialised; see memfit.apply.head)",
    )
    p.add_argument(
        "--keep-activations",
        action="store_true",
        help="never fuse activation modules (GPT-2's gelu_new and other python-written activations run as one torch kernel otherwise; see memfit.apply.activations)",
    )
    p.add_argument(
        "--no-tiling",
        action="store_true",
        help="never tile position-wise submodules (MLPs) over the sequence, nor hold recomputed blocks' inputs on the host (see memfit.apply.tiling, memfit.apply.host_inputs)",
    )
    p.add_argument(
        "--tile-modules",
        type=tile_modules_arg,
        default=None,
        metavar="NAME[,NAME]",
        help="the blocks' submodules to tile, by name within a block or class name (default: classes named *MLP); each must be position-wise",
    )


def add_device_arg(p: argparse.ArgumentParser, *, target: bool = False) -> None:
    """``--device`` (:mod:`memfit.cli.device`); ``target``: also ``--target NAME`` (the commands with
    ``--estimate``), and ``--device NAME`` of a GPU in the estimate's table is read as ``--target NAME``."""
    p.add_argument(
        "--device",
        type=device_or_target_arg if target else device_arg,
        default=None,
        metavar="DEV",
        help=DEVICE_HELP + ("; a GPU of the estimate's table here is the old spelling of --target" if target else ""),
    )
    if target:
        p.add_argument(
            "--target",
            default=None,
            metavar="NAME",
            help=f"with --estimate: the GPU to estimate for: {', '.join(ESTIMATE_DEVICES)}",
        )


def add_choice_args(p: argparse.ArgumentParser) -> None:
    """``--measure-choice`` / ``--no-measure-choice`` and ``--choice-rounds`` (:mod:`memfit.cli.choice`)."""
    p.add_argument(
        "--measure-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after solving, time the plan beside its next-best plans and the fixed policies that fit the budget "
        "(none, every:k, sqrt, all) in interleaved rounds and keep the fastest measured (default: on with --device cuda, "
        "off on the CPU)",
    )
    p.add_argument(
        "--choice-rounds",
        type=int,
        default=3,
        metavar="N",
        help="with --measure-choice: interleaved timed rounds per candidate (default 3)",
    )


def add_device_and_choice_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--target`` (:func:`add_device_arg`), and :func:`add_choice_args`."""
    add_device_arg(p, target=True)
    add_choice_args(p)


def add_estimate_args(p: argparse.ArgumentParser) -> None:
    """``--estimate``, ``--target``, ``--device``, ``--measure-choice``, ``--mfu``, ``--calibrate``
    (``memfit plan`` and ``memfit fit``)."""
    p.add_argument(
        "--estimate",
        action="store_true",
        help="plan from fake-tensor steps for --target instead of measuring here: nothing of the model's size is allocated, so models that do not fit this machine plan too (keep/recompute options; times from the device's roofline)",
    )
    add_device_and_choice_args(p)
    p.add_argument("--mfu", type=positive_float, default=None, help="with --estimate: " + MFU_HELP)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="with --estimate: when --target is this machine, measure real steps at a small micro-batch and fit the roofline's mfu to them (memfit.estimation.calibrate_time)",
    )


def add_parallel_args(p: argparse.ArgumentParser, *, accumulation: bool = False) -> None:
    """The data-parallel options (names as torch's DDP and ``fully_shard`` have them); with
    ``accumulation``, also ``--accumulation-steps`` (the window the launch command runs)."""
    g = p.add_argument_group("data parallelism: plan one rank of a multi-GPU job (--budget is per rank)")
    g.add_argument("--world-size", type=positive_int, default=1, metavar="N", help="ranks (GPUs) of the job")
    if accumulation:
        g.add_argument("--accumulation-steps", type=positive_int, default=1, metavar="K", help="with --parallel: micro-steps per optimizer step "
                       "in the launch command; the plan is solved so that a rank's window (gradients kept between micro-steps) fits --budget")  # fmt: skip
    add_layout_args(g)
    g.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="N", help="GPUs per node: a job of more ranks runs its collectives over the network "
                   "link (the device table's), else over NVLink/PCIe (default 8); used for the communication time")  # fmt: skip
    g.add_argument("--link-gbps", type=positive_number, default=None, metavar="GBIT_S", help="the rate of the link the collectives' ring runs over, in Gbit/s "
                   "per GPU and direction (400 for one NDR InfiniBand NIC per GPU, 3600 for NVLink 4's 450 GB/s); default: the device table's "
                   "published rate, which the output names")  # fmt: skip


def add_layout_args(g: Any) -> None:
    """``--parallel`` and its options (``memfit train`` takes them too, with the world size from torchrun)."""
    g.add_argument(
        "--parallel",
        choices=list(PARALLEL_KINDS),
        default=None,
        help="ddp: every rank holds the model, plus DDP's gradient buckets; fsdp2: fully_shard on every block, then the root",
    )
    g.add_argument(
        "--bucket-cap-mb",
        type=positive_number,
        default=DDP_BUCKET_CAP_MB,
        metavar="MB",
        help="DDP's bucket_cap_mb (default 25)",
    )
    g.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FSDP2's reshard_after_forward for the blocks (default: on; the root is never resharded after forward)",
    )
    g.add_argument(
        "--fsdp-units",
        choices=["blocks"],
        default="blocks",
        help="FSDP2 units: fully_shard on each block of the chain, then on the root (torchtitan's wrapping; the only layout modelled)",
    )
    g.add_argument(
        "--param-dtype",
        default=None,
        metavar="DTYPE",
        help="FSDP2 MixedPrecisionPolicy(param_dtype=...): units gathered and run in DTYPE (e.g. bfloat16); shards, gradient shards and optimizer state keep --dtype (default float32); needs --estimate on plan and fit; train applies it (default: the plan file's)",
    )
    g.add_argument(
        "--reduce-dtype",
        default=None,
        metavar="DTYPE",
        help="FSDP2 MixedPrecisionPolicy(reduce_dtype=...): the reduce-scatter's dtype (e.g. float32; default: --param-dtype)",
    )


def add_snapshot_arg(p: argparse.ArgumentParser) -> None:
    """``--snapshot FILE.pickle``: the measured step's allocations for PyTorch's memory_viz."""
    p.add_argument(
        "--snapshot",
        type=snapshot_path,
        default=None,
        metavar="FILE.pickle",
        help="write the measured step's allocations and frees in the format of torch.cuda.memory._dump_snapshot "
        "(open it at pytorch.org/memory_viz, or: python -m torch.cuda._memory_viz trace_plot FILE.pickle -o FILE.html)",
    )
