"""Every bad input is one clear line (DESIGN.md "CLI": exit 2, `memfit <command>: what, facts, fix`).

A table of bad inputs runs through :func:`memfit.cli.main.main` in-process, each with and without
``--json``: the exit code, stderr of exactly one line and no traceback, the fix named in the message
(a fragment chosen per row), and under ``--json`` a stdout that is exactly one JSON object with
``"ok": false``. A few run through a real ``python -m memfit.cli.main`` for the exit codes end to end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.capture.step import StepSpec
from memfit.cli import main as cli_main
from memfit.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = "hf:gpt2?n_layer=2&n_embd=16&n_head=2&vocab_size=64&n_positions=32"

WORKLOAD = """
import torch
from torch import nn


def _model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)], nn.Linear(8, 4))


def _batch(b):
    return torch.randn(b, 8), torch.randn(b, 4)


def _loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def good():
    return _model(), _batch, _loss


def wrong_return():
    return _model()


def not_a_module():
    return "model", _batch, _loss


def builder_raises():
    raise ValueError("no config for size 'xxl'")


def make_batch_raises():
    def make_batch(b):
        raise KeyError("tokens")
    return _model(), make_batch, _loss


def loss_raises():
    def loss_fn(model, batch):
        return _loss(model, batch) / 0 + {}["scale"]
    return _model(), _batch, loss_fn


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, x):
        raise RuntimeError("forward exploded")


def forward_raises():
    return Exploding(), _batch, _loss


def make_batch_not_callable():
    return _model(), 8, _loss


def loss_not_callable():
    return _model(), _batch, "mse"


def loss_detached():
    return _model(), _batch, lambda model, batch: _loss(model, batch).detach()


def loss_item():
    return _model(), _batch, lambda model, batch: torch.tensor(_loss(model, batch).item())


def frozen():
    model = _model()
    model.requires_grad_(False)
    return model, _batch, _loss


def no_parameters():
    return nn.Sequential(nn.Tanh(), nn.Tanh()), _batch, _loss


def wrong_shape():
    return _model(), (lambda b: (torch.randn(b, 7), torch.randn(b, 4))), _loss


def hf_wrong_batch():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    )

    def make_batch(b):
        return {"input_ids": torch.randint(0, 64, (b, 64))}  # 64 tokens, 32 positions

    def loss_fn(model, batch):
        return model(**batch, labels=batch["input_ids"]).loss
    return model, make_batch, loss_fn


def exits_in_builder():
    import sys

    sys.exit("this workload needs a GPU")


def make_batch_exits():
    def make_batch(b):
        raise SystemExit(0)
    return _model(), make_batch, _loss


def interrupts_itself():
    raise KeyboardInterrupt


class Odd(BaseException):
    pass


def raises_base_exception():
    raise Odd("not an Exception")


def wrong_rows():
    return _model(), (lambda b: _batch(b + 1)), _loss


not_a_function = 3
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("workloads")
    (d / "wl.py").write_text(WORKLOAD)
    (d / "syntax.py").write_text("import torch\n\ndef build(:\n    pass\n")
    (d / "imports.py").write_text("import torch\nimport memfit_no_such_module_xyz\n")
    (d / "raises.py").write_text("import torch\nSIZES = {}\nWIDTH = SIZES['base']\n")
    (d / "corrupt.json").write_text('{"version": 1, "blocks": [')
    (d / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (d / "interrupts.py").write_text("raise KeyboardInterrupt\n")
    (d / "notaplan.json").write_text("[1, 2, 3]\n")
    plan = {"format": "memfit.plan", "version": 1, "policy": "all", "chain_path": "",
            "blocks": [{"name": str(i), "option": "recompute"} for i in range(3)]}  # fmt: skip
    for name, field, value in (("huge_peak", "predicted_peak_bytes", "1e308"), ("nan_time", "predicted_step_s", "NaN"),
                               ("digits", "budget_bytes", "9" * 5000)):  # fmt: skip
        (d / f"{name}.json").write_text(json.dumps({**plan, field: 0}).replace(f'"{field}": 0', f'"{field}": {value}'))
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "binary.json").write_bytes(b"\xff\xfe\x00\x01 not text")
    (d / "sub").mkdir()
    return d


# (id, argv, exit code, fragment of the message that names the fix); {d} is the files' directory.
W = "{d}/wl.py"
PROFILE = ["profile", "--batch-size", "2", "--repeats", "1", "--model"]
CASES = [
    # workload specs and files
    ("unknown-spec", ["profile", "--model", "nonsense"], 2, "hf:TYPE"),
    ("unknown-hf-override", ["profile", "--model", "hf:gpt2?num_layerz=2"], 2, "num_layer"),
    ("missing-file", [*PROFILE, "{d}/missing.py:build"], 2, "Give an existing Python file"),
    ("no-such-name", [*PROFILE, W + ":nothere"], 2, "Define nothere() returning (model, make_batch, loss_fn)"),
    ("name-not-a-function", [*PROFILE, W + ":not_a_function"], 2, "Define not_a_function()"),
    ("name-returns-wrong-thing", [*PROFILE, W + ":wrong_return"], 2, "it must return (model, make_batch, loss_fn)"),
    ("model-not-a-module", [*PROFILE, W + ":not_a_module"], 2, "must be a torch.nn.Module"),
    ("syntax-error", [*PROFILE, "{d}/syntax.py:build"], 2, "raised SyntaxError"),
    ("import-error", [*PROFILE, "{d}/imports.py:build"], 2, "imports on its own"),
    ("exception-on-import", [*PROFILE, "{d}/raises.py:build"], 2, "raised KeyError: 'base' (at "),
    ("sys-exit-on-import", [*PROFILE, "{d}/exits.py:build"], 2, "called sys.exit(3) (at "),
    ("keyboard-interrupt-on-import", [*PROFILE, "{d}/interrupts.py:build"], 2, "raised KeyboardInterrupt (at "),
    ("sys-exit-in-builder", [*PROFILE, W + ":exits_in_builder"], 2, "called sys.exit('this workload needs a GPU')"),
    ("sys-exit-in-make-batch", [*PROFILE, W + ":make_batch_exits"], 2, "called sys.exit(0)"),
    ("keyboard-interrupt-in-builder", [*PROFILE, W + ":interrupts_itself"], 2, "raised KeyboardInterrupt (at "),
    ("base-exception-in-builder", [*PROFILE, W + ":raises_base_exception"], 2, "raised Odd: not an Exception"),
    ("make-batch-wrong-rows", [*PROFILE, W + ":wrong_rows"], 2, "make_batch(2) returned a batch of 3 rows"),
    (
        "make-batch-wrong-rows-in-train",
        ["train", "--global-batch", "4", "--micro-batch", "2", "--steps", "1", "--model", W + ":wrong_rows"],
        2,
        "make_batch(4) returned a batch of 5 rows (dim 0 of its tensors), expected 4",
    ),
    ("builder-raises", [*PROFILE, W + ":builder_raises"], 2, "Fix builder_raises() in the workload file"),
    ("make-batch-raises", [*PROFILE, W + ":make_batch_raises"], 2, "make_batch(batch_size) must return"),
    ("loss-raises", [*PROFILE, W + ":loss_raises"], 2, "loss_fn(model, make_batch(B)) runs without memfit"),
    ("forward-raises", [*PROFILE, W + ":forward_raises"], 2, "in forward). Check that loss_fn"),
    ("make-batch-not-callable", [*PROFILE, W + ":make_batch_not_callable"], 2, "make_batch is a int, not a function"),
    ("loss-not-callable", [*PROFILE, W + ":loss_not_callable"], 2, "loss_fn is a str, not a function"),
    ("loss-detached", [*PROFILE, W + ":loss_detached"], 2, ".detach() on the loss"),
    ("loss-item", [*PROFILE, W + ":loss_item"], 2, ".item()"),
    ("frozen-model", [*PROFILE, W + ":frozen"], 2, "Unfreeze the ones to train"),
    ("model-without-parameters", [*PROFILE, W + ":no_parameters"], 2, "has no parameters"),
    ("wrong-batch-shape", [*PROFILE, W + ":wrong_shape"], 2, "the batch must fit the model's forward"),
    ("hf-model-wrong-batch", [*PROFILE, W + ":hf_wrong_batch"], 2, "the batch must fit the model's forward"),
    (
        "wrong-batch-in-verify",
        ["verify", "--repeats", "0", "--batch-size", "2", "--model", W + ":wrong_shape"],
        2,
        "raised RuntimeError",
    ),
    (
        "wrong-batch-in-plan",
        ["plan", "--budget", "1GiB", "--repeats", "1", "--batch-size", "2", "--model", W + ":wrong_shape"],
        2,
        "raised RuntimeError",
    ),
    (
        "demo-seq-len-beyond-corpus",
        ["profile", "--model", "demo", "--seq-len", "100000000"],
        2,
        "Use a smaller --seq-len",
    ),
    # sizes and numbers
    ("budget-1e400", ["plan", "--budget", "1e400"], 2, "Give a size below 8 EiB"),
    ("budget-negative", ["plan", "--budget", "-5"], 2, "is negative. Give a size >= 0 such as 300MiB"),
    (
        "budget-abc",
        ["fit", "--budget", "abc", "--global-batch", "4"],
        2,
        "Use a number of bytes or a number with a unit",
    ),
    ("margin-nan", ["plan", "--budget", "1GiB", "--margin", "nan"], 2, "is not a finite number"),
    ("margin-negative", ["plan", "--budget", "1GiB", "--margin", "-0.5"], 2, "must be 0 or more"),
    ("margin-one-or-more", ["fit", "--budget", "1GiB", "--global-batch", "4", "--margin", "1.5"], 2, "give e.g. 0.05"),
    ("batch-size-zero", ["profile", "--batch-size", "0"], 2, "must be at least 1"),
    ("seq-len-not-a-number", ["profile", "--seq-len", "long"], 2, "is not a whole number"),
    ("mfu-zero", ["estimate", "--mfu", "0"], 2, "must be greater than 0"),
    ("demo-lr-negative", ["demo", "--lr", "-1"], 2, "must be greater than 0"),
    (
        "demo-budget-zero",
        ["demo", "--model", "demo?n_layer=2&n_embd=16&n_head=2", "--budget", "0"],
        2,
        "Raise the budget",
    ),
    ("verify-repeats-negative", ["verify", "--repeats", "-1"], 2, "must be 0 or more"),
    ("explain-repeats-negative", ["explain", "--policy", "all", "--repeats", "-1"], 2, "must be 0 or more"),
    # devices and dtypes
    (
        "train-device-tpu",
        ["train", "--global-batch", "2", "--steps", "1", "--device", "tpu"],
        2,
        "memfit runs on cpu, cuda or cuda:N",
    ),
    ("estimate-device-tpu", ["estimate", "--device", "tpu"], 2, "h100-sxm"),
    (
        "estimate-parallel-master-weights",
        [
            "estimate",
            "--model",
            TINY_GPT2,
            "--seq-len",
            "32",
            "--parallel",
            "ddp",
            "--world-size",
            "2",
            "--device",
            "h100-sxm",
            "--dtype",
            "bf16",
            "--master-weights",
        ],
        2,
        "--parallel ddp does not model --master-weights yet",
    ),
    (
        "estimate-parallel-without-device",
        ["estimate", "--model", TINY_GPT2, "--seq-len", "32", "--parallel", "ddp", "--world-size", "2"],
        2,
        "--parallel needs --device NAME",
    ),
    ("dtype-int8", ["profile", "--dtype", "int8"], 2, "use one of bf16, bfloat16"),
    # policies and plans
    ("policy-empty", ["verify", "--policy", ""], 2, "'every:K'"),
    ("policy-blank", ["verify", "--policy", "   "], 2, "the policy is empty"),
    ("policy-every-0", ["verify", "--policy", "every:0"], 2, "'every:K'"),
    ("policy-unknown-estimate", ["estimate", "--policy", "half"], 2, "'every:K'"),
    ("policy-empty-explain", ["explain", "--policy", ""], 2, "the policy is empty"),
    ("plan-missing", ["verify", "--plan", "{d}/missing.json"], 2, "write one with `memfit plan"),
    (
        "plan-corrupt",
        ["verify", "--batch-size", "2", "--model", W + ":good", "--plan", "{d}/corrupt.json"],
        2,
        "Make a new plan with `memfit plan",
    ),
    ("plan-not-a-plan", ["estimate", "--plan", "{d}/notaplan.json"], 2, "memfit plan"),
    ("plan-peak-1e308", ["estimate", "--plan", "{d}/huge_peak.json"], 2, '"predicted_peak_bytes" is 1e+308'),
    ("plan-step-time-nan", ["verify", "--plan", "{d}/nan_time.json"], 2, '"predicted_step_s" is NaN'),
    ("plan-5000-digits", ["estimate", "--plan", "{d}/digits.json"], 2, "more than 4300 digits"),
    ("plan-deep-nesting", ["verify", "--plan", "{d}/deep.json"], 2, "nests JSON too deeply"),
    ("plan-binary", ["estimate", "--plan", "{d}/binary.json"], 2, "is not text"),
    # output paths, checked before any measuring
    (
        "out-missing-directory",
        ["plan", "--budget", "1GiB", "--out", "{d}/nodir/plan.json"],
        2,
        "create it first (mkdir -p",
    ),
    (
        "out-is-a-directory",
        ["fit", "--budget", "1GiB", "--global-batch", "4", "--out", "{d}/sub"],
        2,
        "give a file path",
    ),
    (
        "out-over-the-workload-file",
        ["plan", "--budget", "1GiB", "--model", W + ":good", "--out", W],
        2,
        "is the workload file of --model",
    ),
    (
        "progress-over-the-workload-file",
        ["train", "--global-batch", "2", "--steps", "1", "--model", W + ":good", "--progress-jsonl", "{d}/./wl.py"],
        2,
        "Give --progress-jsonl another path",
    ),
    (
        "report-over-out",
        ["fit", "--budget", "1GiB", "--global-batch", "4", "--out", "{d}/r.html", "--report", "{d}//r.html"],
        2,
        "is --out, which this command also writes",
    ),
    ("report-missing-directory", ["plan", "--budget", "1GiB", "--report", "{d}/nodir/plan.png"], 2, "create it first"),
    ("demo-report-not-creatable", ["demo", "--report", "{d}/wl.py/demo.png"], 2, "choose a writable location"),
    # command lines argparse refuses
    ("unknown-option", ["profile", "--bogus"], 2, "See `memfit profile --help`"),
    ("missing-required", ["plan"], 2, "one of the arguments --budget --policy is required"),
    (
        "verify-half-accumulation",
        ["verify", "--global-batch", "8"],
        2,
        "give --global-batch and --micro-batch together",
    ),
    ("unknown-command", ["nosuch"], 2, "invalid choice"),
    ("size-in-bits", ["plan", "--budget", "1Gb"], 2, "is in bits (a lower-case b), and sizes are bytes. Write 1GB"),
    ("size-negative", ["plan", "--budget", "-1MiB"], 2, "size '-1MiB' is negative. Give a size >= 0"),
    # estimate beyond what 64-bit sizes describe
    # a batch no allocator can give (8e14 bytes of token ids: beyond the address space, fails at once)
    (
        "train-batch-out-of-memory",
        ["train", "--model", "demo?n_layer=2&n_embd=16&n_head=2", "--global-batch", str(10**14), "--steps", "1"],
        2,
        "out of memory",
    ),
    (
        "estimate-batch-1e17",
        ["estimate", "--model", TINY_GPT2, "--seq-len", "32", "--batch-size", str(10**17)],
        2,
        "Lower --batch-size or --seq-len",
    ),
]


# torchrun's environment, malformed: (id, variables, fragment of the message). The last one names a
# rendezvous nobody serves: it must fail within --collective-timeout, not torch's 30 minutes.
ENV_CASES = [
    ("world-size-not-a-number", {"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not a whole number"),
    ("local-rank-not-a-number", {"LOCAL_RANK": "x"}, "LOCAL_RANK='x' in the environment is not a whole number"),
    ("world-size-without-rank", {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    (
        "rank-beyond-world",
        {"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        "RANK=5 is not below WORLD_SIZE=2",
    ),  # fmt: skip
    (
        "master-port-not-a-port",
        {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"},
        "MASTER_PORT='abc' is not a port number",
    ),  # fmt: skip
    (
        "nobody-at-master",
        {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"},
        "rank 1 of 2 could not join the torchrun group at 127.0.0.1:9 within 1 s",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("env", "fix"), [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_bad_torchrun_environment_is_one_line(capsys, monkeypatch, env: dict[str, str], fix: str) -> None:
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["train", "--model", "demo?n_layer=2&n_embd=16&n_head=2&seq_len=8", "--global-batch", "2", "--steps", "1"]
    code, out, err = run_case(capsys, [*argv, "--device", "cpu", "--collective-timeout", "1", "--json"])
    assert code == 2, (out, err)
    line = json.loads(out)["error"]
    assert line.startswith("memfit train: ") and fix in line, line
    assert "unset WORLD_SIZE" in line or "raise --collective-timeout" in line, line  # the fix


def run_case(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(("argv", "code", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.slow  # about 7 s on 2 cores: the fast tier keeps to about 4 minutes
def test_bad_input_is_one_line_with_the_fix(
    capsys, files: Path, argv: list[str], code: int, fix: str, json_mode: bool
) -> None:
    argv = [a.format(d=files) for a in argv] + (["--json"] if json_mode else [])
    got, out, err = run_case(capsys, argv)
    assert got == code, (got, out, err)
    assert "Traceback" not in out + err
    command = next((a for a in argv if a in cli_main.COMMANDS), None)
    if json_mode:
        assert err == ""
        obj = json.loads(out)  # the whole stdout is one JSON object
        assert obj["ok"] is False and obj["exit_code"] == code
        line = obj["error"]
    else:
        # Off a terminal a command's phases come first, one line each (`memfit: profiling ...`); the
        # error is the last line, and the only other one.
        *phases, line = err.splitlines()
        assert err.endswith("\n") and all(re.fullmatch(r"memfit: [^\n]*", p) for p in phases), err
        assert not any(p.startswith(f"memfit {command}: ") for p in phases), err
    assert "\n" not in line
    assert line.startswith(f"memfit {command}: " if command else "memfit: "), line
    assert fix in line, line
    assert not re.search(r"(?<!\.)\.\.(?!\.)", line), line  # a message that ends in a period gets no second one


def test_the_workload_file_survives_the_refused_outputs(capsys, files: Path) -> None:
    code, _, _ = run_case(
        capsys, ["plan", "--budget", "1GiB", "--model", f"{files}/wl.py:good", "--out", f"{files}/wl.py"]
    )
    assert code == 2 and (files / "wl.py").read_text() == WORKLOAD


def test_workload_error_names_the_users_file_and_line(capsys, files: Path) -> None:
    """The blamed frame is the user's raising line, not memfit's or torch's."""
    code, out, _ = run_case(capsys, [*PROFILE, f"{files}/wl.py:forward_raises", "--json"])
    obj = json.loads(out)
    line_no = WORKLOAD.splitlines().index('        raise RuntimeError("forward exploded")') + 1
    assert code == 2 and obj["stage"] == "loss_fn"
    assert obj["where"] == {"file": str(files / "wl.py"), "line": line_no, "function": "forward"}
    assert "your workload raised RuntimeError: forward exploded" in obj["error"]
    assert "run with --debug for the full traceback" in obj["error"]


def test_debug_prints_the_full_traceback(capsys, files: Path) -> None:
    code, out, err = run_case(capsys, [*PROFILE, f"{files}/wl.py:forward_raises", "--debug"])
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert 'raise RuntimeError("forward exploded")' in err  # the user's frame, from the chained original
    assert "The above exception was the direct cause" in err  # raise WorkloadError(...) from err
    assert err.strip().splitlines()[-1].startswith("memfit profile: your workload raised RuntimeError")


def test_debug_is_accepted_before_the_command(capsys) -> None:
    code, _, err = run_case(capsys, ["--debug", "plan", "--budget", "1GiB", "--margin", "nan"])
    assert code == 2 and err.strip().splitlines()[-1].startswith("memfit plan: argument --margin")


def test_internal_error_is_one_line_with_exit_3(capsys, monkeypatch) -> None:
    """A bug in memfit (here: a command that divides by zero) is not blamed on the user."""
    from memfit.cli import profile

    def broken(args, out):
        return {"x": 1 / 0}

    monkeypatch.setattr(profile, "run", broken)
    code, out, err = run_case(capsys, ["profile"])
    assert code == cli_main.EXIT_INTERNAL_ERROR == 70
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "internal error, a bug in memfit: ZeroDivisionError" in err and "Rerun with --debug" in err
    code, out, err = run_case(capsys, ["profile", "--json", "--debug"])
    assert code == 70 and json.loads(out)["error_type"] == "ZeroDivisionError"
    assert "Traceback (most recent call last)" in err


def test_error_in_memfit_code_inside_the_forward_is_not_blamed_on_the_user() -> None:
    """call_user blames the innermost frame that is not torch's: the same failing op called from a
    user's file is a WorkloadError, called from a file of memfit's package it passes through as is."""
    import torch

    from memfit.capture import tracker
    from memfit.errors import WorkloadError
    from memfit.workload import call_user

    source = "def op(_):\n    return torch.ones(2) @ torch.ones(3)\n"
    for filename, blamed in (("user_model.py", True), (tracker.__file__, False)):
        ns = {"torch": torch}
        exec(compile(source, filename, "exec"), ns)
        with pytest.raises(RuntimeError, match="inconsistent tensor size") as info:
            call_user("loss_fn", ns["op"], 1)
        assert isinstance(info.value, WorkloadError) is blamed, filename
        if blamed:
            assert info.value.where == ("user_model.py", 2, "op")
            assert isinstance(info.value.__cause__, RuntimeError)


def test_keyboard_interrupt_exits_130(capsys, monkeypatch) -> None:
    from memfit.cli import profile

    def interrupted(args, out):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile, "run", interrupted)
    code, out, err = run_case(capsys, ["profile", "--json"])
    assert code == 130 and json.loads(out)["error"] == "memfit profile: interrupted."


def test_estimate_of_a_huge_batch_is_exact_without_allocating() -> None:
    """The demo at 10^12..3*10^12 samples: fake tensors allocate nothing, and every batch-sized
    tensor grows linearly, so the activations' second difference is exactly zero."""
    from memfit.estimation import estimate

    acts = [
        estimate("demo?n_layer=1&n_embd=16&n_head=2&seq_len=8", step=StepSpec(batch_size=k * 10**12)).activations_bytes
        for k in (1, 2, 3)
    ]
    assert acts[0] > 10**12 * 8 * 16 * 4  # at least one (B, T, C) fp32 tensor
    assert acts[2] - acts[1] == acts[1] - acts[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "code", "fix"),
    [
        (["profile", "--model", "{d}/syntax.py:build"], 2, "raised SyntaxError"),
        (["plan", "--budget", "1GiB", "--margin", "nan", "--json"], 2, "is not a finite number"),
    ],
    ids=["syntax-error", "margin-nan-json"],
)
def test_exit_codes_end_to_end(files: Path, argv: list[str], code: int, fix: str) -> None:
    argv = [a.format(d=files) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "memfit.cli.main", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    if "--json" in argv:
        obj = json.loads(proc.stdout)
        assert obj["ok"] is False and fix in obj["error"]
    else:
        assert proc.stderr.count("\n") == 1 and fix in proc.stderr
