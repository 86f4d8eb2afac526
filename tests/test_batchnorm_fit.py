"""Auto-fit starts at the smallest micro-batch a model with BatchNorm accepts.

BatchNorm in train mode refuses a batch with one value per channel (``BatchNorm1d`` on ``(1, C)``:
``ValueError: Expected more than 1 value per channel when training``). A fit that tried micro-batch
1 failed with that error, as if the user's code were wrong; it now starts at the smallest
micro-batch the forward runs, says so, and takes ``min_micro_batch`` / ``--min-micro-batch``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import StepSpec, Workload
from memfit.accumulate.batchnorm import smallest_micro_batch
from memfit.cli.main import main
from memfit.errors import SpecError
from memfit.fitting import micro_batch_options
from memfit.training.config import TrainConfig

MODEL_SOURCE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return x + F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """A conv net with a SimCLR-style projection head: BatchNorm1d on (B, C) refuses B = 1."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(4)])
        self.head = nn.Sequential(nn.Linear(c, c), nn.BatchNorm1d(c), nn.ReLU(), nn.Linear(c, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def make_batch(b: int):
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def build():
    torch.manual_seed(0)
    return ConvNet(), make_batch, loss_fn
'''


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "bn_convnet.py"
    path.write_text(textwrap.dedent(MODEL_SOURCE))
    return f"{path}:build"


def _workload(model_file: str) -> Workload:
    return memfit.load_workload(model_file)


def test_smallest_micro_batch_tries_upwards_only_on_batchnorms_error() -> None:
    bn = nn.BatchNorm1d(4)
    assert smallest_micro_batch(lambda b: bn(torch.randn(b, 4)), cap=8) == 2
    assert smallest_micro_batch(lambda b: bn(torch.randn(b, 4)), cap=1) == 2  # cap + 1: nothing runs
    assert smallest_micro_batch(lambda b: F.batch_norm(torch.randn(b, 4, 3), None, None, training=True), cap=8) == 1

    def other(b: int) -> None:
        raise ValueError("a bug in the user's model")

    with pytest.raises(ValueError, match="user's model"):
        smallest_micro_batch(other, cap=8)


def test_micro_batch_options_keep_the_last_micro_batch_above_the_minimum() -> None:
    got = micro_batch_options(9, min_micro_batch=2)
    assert all(min(sizes) >= 2 for _, sizes in got)
    assert (4, (4, 4, 1)) not in got and (3, (3, 3, 3)) in got and (1, (1,) * 9) not in got
    assert micro_batch_options(9) == micro_batch_options(9, min_micro_batch=1)


def test_autofit_starts_where_batchnorm_runs_and_says_so(model_file: str) -> None:
    wl = _workload(model_file)
    # What the fit tried first: the workload's guard reports it as the user's error.
    with pytest.raises(memfit.WorkloadError, match="Expected more than 1 value per channel"):
        wl.loss_fn(wl.model, wl.make_batch(1))
    res = memfit.autofit(wl, 64 * 2**20, 6, step=StepSpec(repeats=1), max_tries=1)
    assert res.min_micro_batch == 2 and res.micro_batch >= 2
    assert res.min_micro_batch_reason is not None and "BatchNorm" in res.min_micro_batch_reason
    assert "--min-micro-batch" in res.min_micro_batch_reason and "\n" not in res.min_micro_batch_reason
    assert min(res.profiled_batch_sizes) == 2
    assert all(min(c.sizes) >= 2 for c in res.candidates)
    d = res.to_dict()
    assert d["min_micro_batch"] == 2 and "BatchNorm" in d["min_micro_batch_reason"]
    # A replan from the fit's profiles keeps the minimum.
    assert res.resolve(res.budget_bytes).min_micro_batch == 2


def test_min_micro_batch_is_taken_as_given(model_file: str) -> None:
    wl = _workload(model_file)
    res = memfit.autofit(wl, 64 * 2**20, 6, step=StepSpec(repeats=1), min_micro_batch=3, measure=False)
    assert res.min_micro_batch == 3 and all(min(c.sizes) >= 3 for c in res.candidates)
    assert res.min_micro_batch_reason == "micro-batches start at 3 (min_micro_batch)"
    with pytest.raises(SpecError, match="at least 3 samples.*allow at most 2"):
        memfit.autofit(wl, 64 * 2**20, 6, min_micro_batch=3, max_micro_batch=2, measure=False)
    with pytest.raises(SpecError, match="BatchNorm in train mode refuses fewer.*at most 1"):
        memfit.autofit(wl, 64 * 2**20, 1, measure=False)
    with pytest.raises(SpecError, match="min_micro_batch 0 must be at least 1"):
        memfit.autofit(wl, 64 * 2**20, 6, min_micro_batch=0)


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_cli_fit_min_micro_batch_and_json(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fit", "--model", model_file, "--budget", "64MiB", "--global-batch", "6", "--no-measure", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["min_micro_batch"] == 2 and "BatchNorm" in out["min_micro_batch_reason"]
    code = main(
        [
            "fit",
            "--model",
            model_file,
            "--budget",
            "64MiB",
            "--global-batch",
            "6",
            "--no-measure",
            "--min-micro-batch",
            "3",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0 and "micro-batches start at 3" in text
    bad = ["fit", "--model", model_file, "--budget", "64MiB", "--global-batch", "6", "--min-micro-batch", "0"]
    assert main(bad) == 2


def test_train_config_wants_a_budget_with_min_micro_batch() -> None:
    with pytest.raises(SpecError, match="--min-micro-batch.*--budget"):
        TrainConfig(global_batch=8, steps=1, min_micro_batch=2).check(1)
    TrainConfig(global_batch=8, steps=1, min_micro_batch=2, budget_bytes=2**26).check(1)


@pytest.mark.parametrize(
    "framework", ["accelerate", pytest.param("lightning", marks=pytest.mark.slow)]
)  # importing lightning: 10 s
def test_integrations_fit_a_batchnorm_model(model_file: str, framework: str) -> None:
    wl = _workload(model_file)
    if framework == "accelerate":
        accelerate = pytest.importorskip("accelerate")
        from accelerate.state import AcceleratorState, GradientState

        from memfit.integrations.accelerate import fit

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        try:
            res = fit(
                accelerate.Accelerator(cpu=True), wl.model, "64MiB", global_batch=6, make_batch=wl.make_batch,
                loss_fn=wl.loss_fn, optimizer="sgd", min_micro_batch=3,
            )  # fmt: skip
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        assert res.min_micro_batch == 3 and res.micro_batch >= 3
    else:
        pytest.importorskip("lightning")
        from memfit.integrations.lightning import fit

        res = fit(wl.model, "64MiB", global_batch=6, make_batch=wl.make_batch, loss_fn=wl.loss_fn, optimizer="sgd")
        assert res.min_micro_batch == 2 and res.micro_batch >= 2 and "BatchNorm" in res.min_micro_batch_reason
    memfit.remove_plan(wl.model)


def test_the_smallest_micro_batch_probe_runs_where_the_model_is() -> None:
    """The probe's batch goes to the model's device, as a profile's does (on a GPU the probe ran the
    model on a CPU batch and `memfit train --device cuda` failed). The meta device stands in for a GPU."""
    from memfit.fitting.search import _smallest_micro_batch
    from memfit.models.registry import load_workload

    wl = load_workload("demo")
    wl.model.to("meta")
    assert _smallest_micro_batch(wl, 4, None, seed=0, measure=True) == (1, None)
