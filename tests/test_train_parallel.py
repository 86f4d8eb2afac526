"""``memfit train --plan PLAN.json --parallel ddp|fsdp2``: the torchrun line ``memfit plan --world-size 2
--parallel ...`` prints runs the planned job (2 gloo ranks on CPU, 127.0.0.1 only).

References: a one-process big-batch ``memfit train`` run (losses and saved weights, float64, dropout
off), and each rank's peak measured in the run (torch's ``FSDPMemTracker`` under FSDP2, which follows
FSDP2's storage resizes; memfit's tracker under DDP) against the plan's per-rank prediction for the
window it runs (2 micro-steps, gradient sync only on the last).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import assert_rank_peaks_within, rank_env
from test_distributed import _free_port

from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.plan.parallel import Parallel, ParallelKind, launch_command
from memfit.plan.types import Plan
from memfit.training import TrainConfig
from memfit.training.distributed import Ranks
from memfit.training.saving import load_run
from memfit.training.state import TrainStateError

PY = sys.executable
HERE = Path(__file__).parent
TIMEOUT_S = 180
# Odd width: FSDP2 pads dim 0 (63 rows -> 32 + 31), so the ranks hold different optimizer rows.
SPEC = "demo?n_layer=4&n_embd=63&n_head=3&dropout=0"
MICRO = 4
COMMON = ["--seq-len", "32", "--dtype", "float64"]


def _plan(capsys: pytest.CaptureFixture[str], tmp_path, kind: str, budget: str, *extra: str) -> tuple[dict, list[str]]:
    """``memfit plan`` for 2 ranks and a window of 2 micro-steps; its JSON and the launch command's argv.
    (Activations kept: whether fusing them pays is decided by measured times, which would make the
    plan, and whether it recomputes anything, depend on the machine's load.)"""
    out = str(tmp_path / f"{kind}.json")
    argv = ["plan", "--model", SPEC, *COMMON, "--batch-size", str(MICRO), "--budget", budget, "--world-size", "2",
            "--parallel", kind, "--accumulation-steps", "2", "--out", out, "--repeats", "1", "--keep-activations", *extra, "--json"]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert not Plan.load(out).is_plain, d["blocks"]  # the checks run under a plan that recomputes blocks
    cmd = shlex.split(d["launch_command"])
    assert cmd[:3] == ["torchrun", "--nproc-per-node", "2"] and cmd[cmd.index("--plan") + 1] == out
    assert cmd[cmd.index("--parallel") + 1] == kind and cmd[cmd.index("--global-batch") + 1] == str(2 * 2 * MICRO)
    return d, cmd


def _torchrun(cmd: list[str], *more: str) -> dict:
    """The printed command, run: torchrun as ``python -m torch.distributed.run`` on a free loopback port."""
    argv = [
        PY,
        "-m",
        "torch.distributed.run",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        *cmd[1:],
        *more,
        "--json",
    ]
    r = subprocess.run(argv, env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    try:
        return json.loads(r.stdout)  # rank 0 prints the one JSON object
    except json.JSONDecodeError:
        pytest.fail(f"not one JSON object on stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")


def _one_process(steps: int, save: str) -> dict:
    argv = [PY, "-m", "memfit.cli.main", "train", "--model", SPEC, *COMMON, "--global-batch", str(4 * MICRO),
            "--micro-batch", str(4 * MICRO), "--steps", str(steps), "--save", save, "--json"]  # fmt: skip
    r = subprocess.run(argv, env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def big_batch(tmp_path_factory) -> tuple[dict, dict]:
    """One process, the whole global batch in one micro-step, no plan: 3 steps, weights saved after them."""
    tmp = tmp_path_factory.mktemp("one")
    d = _one_process(3, str(tmp / "one.pt"))
    return d, torch.load(tmp / "one.pt", weights_only=True)["model"]


@pytest.mark.distributed
def test_fsdp2_printed_command_trains_the_planned_job(capsys, tmp_path, big_batch) -> None:
    plan, cmd = _plan(
        capsys, tmp_path, "fsdp2", "7.5MiB"
    )  # the window of 2 micro-steps fits it (one micro-step fits 7 MiB)
    window = plan["rank"]["predicted_peak_bytes_with_accumulation"]
    assert window > plan["predicted_peak_bytes"]  # unsharded gradients kept between the micro-steps
    save = str(tmp_path / "fsdp2.pt")
    got = _torchrun(cmd, "--steps", "2", "--save", save)
    one, one_weights = big_batch
    assert got["world_size"] == 2 and got["accumulation_steps"] == 2 and got["parallel"]["kind"] == "fsdp2"
    assert got["recomputed_blocks"] == len(Plan.load(cmd[cmd.index("--plan") + 1]).recomputed)
    assert got["losses"] == pytest.approx(one["losses"][:2], rel=1e-10)
    # Each rank's measured peak (torch's FSDPMemTracker over whole windows) against rank 0's predicted
    # window (rank 0 holds the most); train compares with the same number and reports the drift.
    assert got["predicted_peak_bytes"] == window and got["peak_measured_by"].startswith("FSDPMemTracker")
    assert_rank_peaks_within(got, window)
    # The save holds full (gathered) state dicts: the weights load in one process and resume under FSDP2.
    resumed = _torchrun(cmd, "--steps", "3", "--resume", save, "--save", save)
    assert resumed["start_step"] == 2 and resumed["losses"] == pytest.approx(one["losses"][2:], rel=1e-10)
    weights = torch.load(save, weights_only=True)["model"]
    assert weights.keys() == one_weights.keys()
    assert max(float((weights[k] - one_weights[k]).abs().max()) for k in weights) < 1e-10


@pytest.mark.distributed
def test_ddp_printed_command_trains_the_planned_job(capsys, tmp_path, big_batch) -> None:
    plan, cmd = _plan(capsys, tmp_path, "ddp", "11MiB", "--bucket-cap-mb", "0.25")
    assert cmd[cmd.index("--bucket-cap-mb") + 1] == "0.25"
    window = plan["rank"]["predicted_peak_bytes_with_accumulation"]
    got = _torchrun(cmd, "--steps", "2")
    assert got["parallel"]["kind"] == "ddp" and got["parallel"]["bucket_cap_bytes"] == 2**18
    assert got["losses"] == pytest.approx(big_batch[0]["losses"][:2], rel=1e-10)
    assert got["predicted_peak_bytes"] == window
    assert_rank_peaks_within(got, window)


@pytest.mark.distributed
def test_fsdp2_mixed_precision_printed_command(capsys, tmp_path) -> None:
    """bf16 parameters / fp32 reduce (``MixedPrecisionPolicy``) on 2 gloo ranks, a fixed policy planned
    for an estimated H100 (a budget there means reserved memory, which CPU ranks do not have): the plan's launch line
    carries the policy, train applies it (here read from the plan file, the flags left out), each rank's
    peak is within 3 % of the plan's, and the losses equal one process running the same policy
    (tests/fsdp1_workload.py: ``fully_shard`` over a one-process group)."""
    out = str(tmp_path / "mp.json")
    argv = ["plan", "--model", SPEC, "--seq-len", "32", "--dtype", "float32", "--batch-size", str(MICRO), "--policy", "every:2",
            "--world-size", "2", "--parallel", "fsdp2", "--param-dtype", "bfloat16", "--reduce-dtype", "float32",
            "--estimate", "--device", "h100-sxm", "--out", out, "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not Plan.load(out).is_plain, plan["blocks"]
    cmd = shlex.split(plan["launch_command"])
    assert cmd[cmd.index("--param-dtype") + 1] == "bfloat16" and cmd[cmd.index("--reduce-dtype") + 1] == "float32"
    bare = cmd[: cmd.index("--param-dtype")] + cmd[cmd.index("--reduce-dtype") + 2 :]
    got = _torchrun(bare, "--steps", "3")
    assert got["parallel"]["param_dtype"] == "bfloat16" and got["parallel"]["reduce_dtype"] == "float32"
    assert got["predicted_peak_bytes"] == plan["predicted_peak_bytes"]
    assert_rank_peaks_within(got, plan["predicted_peak_bytes"])
    # One process, same policy, same micro-batches (rank r's share is its micro-step r), so the bf16 forward and
    # backward are the same; the gradients are added in fp32 on both (the loss scaled by the world size, 2, and
    # the reduce-scatter's average: exact powers of two). Only fp32 rounding of that sum may differ: 1e-6.
    one = subprocess.run(
        [PY, "-m", "memfit.cli.main", "train", "--model", str(HERE / "fsdp1_workload.py") + ":demo_bf16", "--global-batch", str(2 * MICRO),
         "--micro-batch", str(MICRO), "--steps", "3", "--json"], env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-4000:]
    assert got["losses"] == pytest.approx(json.loads(one.stdout)["losses"], rel=1e-6)
    # The policy ran: the same run in float32 without it (one process) has losses 0.06-0.3 % away.
    fp32 = subprocess.run(
        [PY, "-m", "memfit.cli.main", "train", "--model", SPEC, "--seq-len", "32", "--dtype", "float32", "--global-batch", str(2 * MICRO),
         "--micro-batch", str(MICRO), "--steps", "3", "--json"], env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert fp32.returncode == 0, fp32.stderr[-4000:]
    assert all(
        abs(a - b) > 3e-4 * abs(b) for a, b in zip(got["losses"], json.loads(fp32.stdout)["losses"], strict=True)
    )


def test_launch_command_carries_plan_and_layout() -> None:
    fsdp = Parallel(kind=ParallelKind.FSDP2, world_size=8, reshard_after_forward=False)
    assert launch_command(fsdp, ["--steps", "10"], plan_file="p l.json") == (
        "torchrun --nproc-per-node 8 -m memfit.cli.main train --steps 10 --plan 'p l.json' --world-size 8 --parallel fsdp2 --no-reshard-after-forward"
    )
    ddp = Parallel(kind=ParallelKind.DDP, world_size=2)
    assert launch_command(ddp, []).endswith("train --world-size 2 --parallel ddp")  # torch's default buckets: no flag
    mp = Parallel(kind=ParallelKind.FSDP2, world_size=2, param_dtype="bfloat16", reduce_dtype="float32")
    assert launch_command(mp, []).endswith("--parallel fsdp2 --param-dtype bfloat16 --reduce-dtype float32")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({}, "needs several processes"),
        ({"world": 4}, "torchrun started 4"),
        ({"budget_bytes": 2**20}, "--budget fits one process"),
        ({"autocast_dtype": torch.float16}, "--amp fp16 under --parallel fsdp2"),
    ],
)
def test_train_config_refuses_what_does_not_run(changes: dict, fragment: str) -> None:
    world = changes.pop("world", 2 if changes else 1)
    cfg = TrainConfig(global_batch=8, steps=1, parallel=Parallel(kind=ParallelKind.FSDP2, world_size=2), **changes)
    with pytest.raises(SpecError, match=fragment):
        cfg.check(world)


def test_cli_train_refusals(capsys) -> None:
    for argv, fragment in [
        (["--parallel", "fsdp2"], "needs several processes"),  # no torchrun here
        (["--world-size", "2"], "give --parallel"),
    ]:
        code = main(["train", "--model", SPEC, "--global-batch", "4", "--steps", "1", *argv, "--json"])
        d = json.loads(capsys.readouterr().out)
        assert code == 2 and fragment in d["error"], d


def test_resume_refuses_another_layout() -> None:
    state = {"format": "memfit.accumulate.state", "extra": {"parallel": "fsdp2"}}
    with pytest.raises(TrainStateError, match="saved by an FSDP2 run"):
        load_run(state, acc=None, dist=Ranks(0, 1, torch.device("cpu"), owned=False), parallel=None)  # type: ignore[arg-type]
