"""`memfit train` never loses or corrupts a run and never trains silently wrong.

Real processes are killed (SIGKILL during a save, SIGINT/SIGTERM mid-run) and the file on disk is
checked against an uninterrupted run of the same steps (bitwise weights, identical losses); bad
options and damaged or mismatched ``--resume`` files are one-line errors with exit 2; NaN/inf
losses or gradients and windows without tokens are skipped without touching the weights.

Subprocesses run with one thread (``OMP_NUM_THREADS=1``), as this file does in-process, so that a
run split across processes is bitwise comparable with one that is not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import memfit
import memfit.errors
import memfit.fitting
from memfit.cli.main import main
from memfit.training.state import StateLock, load_state, nonfinite_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = "demo?n_layer=2&n_embd=32&n_head=2&seq_len=32"
# Saves of a few MB (weights and AdamW moments), so that a save takes milliseconds, not microseconds.
WIDE = "demo?n_layer=2&n_embd=192&n_head=2&seq_len=32"
COMMON = ["--global-batch", "4", "--micro-batch", "2"]
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _popen(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-m", "memfit.cli.main", "train", *argv],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["train", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    torch.testing.assert_close(a["optimizer"]["state"], b["optimizer"]["state"], rtol=0, atol=0)
    assert a["counters"] == b["counters"]


# -- killed processes ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_last_complete_state_and_resume_is_exact(tmp_path: Path, capsys) -> None:
    steps = 16
    path = tmp_path / "state.pt"
    proc = _popen("--model", WIDE, *COMMON, "--steps", str(steps), "--save", str(path), "--save-every", "1")
    killed_during_save = False
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            # A temporary file beside a complete state: a save is in progress, and not the first.
            if path.exists() and any(n.endswith(".tmp") for n in os.listdir(tmp_path)):
                proc.send_signal(signal.SIGSTOP)  # freeze it, then make sure the save is still going
                time.sleep(0.05)
                if any(n.endswith(".tmp") for n in os.listdir(tmp_path)):
                    proc.send_signal(signal.SIGKILL)
                    killed_during_save = True
                    break
                proc.send_signal(signal.SIGCONT)  # the save finished in between: watch the next one
    finally:
        if proc.poll() is None and not killed_during_save:
            proc.kill()
        proc.communicate(timeout=TIMEOUT_S)
    assert killed_during_save, "the run finished before a save could be caught in progress"
    assert proc.returncode == -signal.SIGKILL
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # the interrupted write is left over
    state = load_state(path)  # the target is the previous complete state
    done = state["counters"]["windows"]
    assert 1 <= done < steps

    code, rest = run_json(
        capsys, "--model", WIDE, *COMMON, "--steps", str(steps), "--resume", str(path), "--save", str(path)
    )
    assert code == 0 and rest["start_step"] == done
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # the stale temporary was removed
    code, full = run_json(capsys, "--model", WIDE, *COMMON, "--steps", str(steps), "--save", str(tmp_path / "full.pt"))
    assert code == 0
    assert rest["losses"] == full["losses"][done:]
    assert_same_state(load_state(path), load_state(tmp_path / "full.pt"))


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_window_saves_and_resume_continues_exactly(
    tmp_path: Path, capsys, sig: int, exit_code: int
) -> None:
    steps = 400
    path, log = tmp_path / "state.pt", tmp_path / "progress.jsonl"
    proc = _popen("--model", TINY, *COMMON, "--steps", str(steps), "--save", str(path), "--progress-jsonl", str(log))
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            proc.send_signal(sig)
            break
        time.sleep(0.01)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == exit_code, err[-2000:]
    done = len(log.read_text().splitlines())  # the window running at the signal finished
    state = load_state(path)
    assert state["counters"]["windows"] == done and 2 <= done < steps
    last = err.strip().splitlines()[-1]
    assert f"stopped by {signal.Signals(sig).name} after step {done}" in last and f"--resume {path}" in last

    code, rest = run_json(
        capsys,
        "--model",
        TINY,
        *COMMON,
        "--steps",
        str(done + 2),
        "--resume",
        str(path),
        "--save",
        str(tmp_path / "resumed.pt"),
    )
    assert code == 0 and rest["start_step"] == done
    code, full = run_json(
        capsys, "--model", TINY, *COMMON, "--steps", str(done + 2), "--save", str(tmp_path / "full.pt")
    )
    assert code == 0
    assert rest["losses"] == full["losses"][done:]
    assert_same_state(load_state(tmp_path / "resumed.pt"), load_state(tmp_path / "full.pt"))


@pytest.mark.slow
def test_a_second_signal_aborts_at_once_and_leaves_a_complete_state(tmp_path: Path) -> None:
    path, log = tmp_path / "state.pt", tmp_path / "progress.jsonl"
    # Windows of 8 micro-steps: the first signal's window is still running when the second comes.
    proc = _popen("--model", WIDE, "--global-batch", "8", "--micro-batch", "1", "--steps", "400", "--save", str(path),
                  "--save-every", "1", "--progress-jsonl", str(log))  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    # Two signals sent back to back can merge into one: wait until the first was handled.
    while proc.poll() is None and time.monotonic() < deadline and not any("SIGINT received" in ln for ln in lines):
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=TIMEOUT_S)
    reader.join(timeout=TIMEOUT_S)
    assert proc.returncode == 130, "".join(lines)[-2000:]
    last = [ln for ln in lines if ln.strip()][-1]
    assert "aborted at once by a second SIGINT" in last and f"--resume {path}" in last
    state = load_state(path)  # a complete state, whatever the second signal interrupted
    assert state["counters"]["windows"] >= 1  # step 2's save may be the one the second signal cut
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # an interrupted save cleaned up


def test_the_accumulator_skips_a_nan_window_for_python_users_too() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = memfit.Accumulator(model, opt, micro_batch=2, scheduler=sched)
    x, y = torch.randn(4, 4), torch.randn(4, 1)

    def mse(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return ((m(b[0]) - b[1]) ** 2).mean()

    assert not acc.step((x, y), mse).skipped
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    bad = x.clone()
    bad[3, 0] = float("inf")
    res = acc.step((bad, y), mse)
    assert res.skipped and res.skip_reason == "nonfinite_loss"
    assert (acc.skipped_steps, acc.consecutive_skips, acc.optimizer_steps) == (1, 1, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(opt_before[k], v) for k, v in opt.state[model.weight].items())
    assert opt.param_groups[0]["lr"] == 0.05  # the scheduler stepped once, for the good window
    assert all(p.grad is None for p in model.parameters())
    assert not acc.step((x, y), mse).skipped and acc.consecutive_skips == 0
    with pytest.raises(memfit.errors.SpecError, match="max_grad_norm"):
        memfit.Accumulator(model, opt, micro_batch=2, max_grad_norm=-1.0)


def test_a_second_run_on_the_same_save_path_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "state.pt"
    with StateLock(path):  # another run holds the path
        code, got = run_json(capsys, "--model", TINY, *COMMON, "--steps", "1", "--save", str(path))
    assert code == 2 and got["ok"] is False
    assert "another run is writing" in got["error"] and f"pid {os.getpid()}" in got["error"]
    assert "another --save path" in got["error"] and not path.exists()
    code, _ = run_json(capsys, "--model", TINY, *COMMON, "--steps", "1", "--save", str(path))
    assert code == 0 and path.exists()  # released: the next run may write


# -- bad inputs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good state of TINY after 2 steps, and damaged copies of it."""
    d = tmp_path_factory.mktemp("states")
    good = d / "good.pt"
    assert main(["train", "--model", TINY, *COMMON, "--steps", "2", "--save", str(good), "--json"]) == 0
    data = good.read_bytes()
    (d / "empty.pt").write_bytes(b"")
    (d / "truncated.pt").write_bytes(data[: len(data) // 2])
    (d / "garbage.pt").write_bytes(b"not a checkpoint at all\n" * 10)
    torch.save({"weights": torch.ones(3)}, d / "foreign.pt")
    (d / "file").write_text("a file, not a directory")
    return {"good": good, **{p.stem: p for p in d.iterdir()}}


# (id, argv after the common ones, words the error must contain (the fix), error from argparse)
BAD_INPUTS: list[tuple[str, list[str], list[str], bool]] = [
    ("max-grad-norm-negative", ["--max-grad-norm", "-1"], ["--max-grad-norm", "greater than 0"], True),
    ("max-grad-norm-zero", ["--max-grad-norm", "0"], ["--max-grad-norm", "greater than 0"], True),
    ("lr-negative", ["--lr", "-1"], ["--lr", "greater than 0"], True),
    ("lr-nan", ["--lr", "nan"], ["--lr", "finite"], True),
    ("save-every-zero", ["--save-every", "0", "--save", "{tmp}/s.pt"], ["--save-every", "at least 1"], True),
    ("max-skips-zero", ["--max-skips", "0"], ["--max-skips", "at least 1"], True),
    ("max-replans-negative", ["--max-replans", "-1"], ["--max-replans", "0 or more"], True),
    ("policy-empty", ["--policy", ""], ["--policy", "the policy is empty", "'every:K'"], True),
    ("policy-unknown", ["--policy", "every:0"], ["--policy", "unknown policy", "'every:K'"], True),
    ("save-every-without-save", ["--save-every", "2"], ["add --save run.pt"], False),
    (
        "micro-batch-above-global",
        ["--micro-batch", "8"],
        ["--micro-batch 8", "Use --micro-batch <= --global-batch"],
        False,
    ),
    ("resume-empty", ["--resume", "{empty}"], ["empty.pt", "empty (0 bytes)", "start without --resume"], False),
    ("resume-truncated", ["--resume", "{truncated}"], ["truncated.pt", "truncated", "start without --resume"], False),
    (
        "resume-garbage",
        ["--resume", "{garbage}"],
        ["garbage.pt", "not a torch checkpoint", "start without --resume"],
        False,
    ),
    (
        "resume-foreign",
        ["--resume", "{foreign}"],
        ["foreign.pt", "not a memfit training state", "memfit train --save"],
        False,
    ),
    ("resume-missing", ["--resume", "{tmp}/nothing.pt"], ["nothing.pt", "--save PATH"], False),
    (
        "resume-other-model",
        ["--resume", "{good}", "--model", "demo?n_layer=3&n_embd=32&n_head=2&seq_len=32"],
        ["good.pt", "another model", "Resume with the model"],
        False,
    ),
    (
        "resume-other-optimizer",
        ["--resume", "{good}", "--optimizer", "sgd"],
        ["good.pt", "adamw", "Resume with --optimizer adamw"],
        False,
    ),
    (
        "resume-other-seq-len",
        ["--resume", "{good}", "--model", "demo?n_layer=2&n_embd=32&n_head=2", "--seq-len", "16"],
        ["good.pt", "sequence length 32", "--seq-len 32"],
        False,
    ),
    (
        "resume-other-global-batch",
        ["--resume", "{good}", "--global-batch", "6"],
        ["good.pt", "--global-batch 4", "Resume with --global-batch 4"],
        False,
    ),
    (
        "save-missing-directory",
        ["--save", "{tmp}/missing/s.pt", "--budget", "64MiB"],
        ["does not exist", "mkdir -p"],
        False,
    ),
    ("save-under-a-file", ["--save", "{file}/s.pt", "--budget", "64MiB"], ["not a directory"], False),
    # /proc takes no new files, even from root (a read-only directory that root cannot override).
    (
        "save-read-only-directory",
        ["--save", "/proc/memfit-state.pt", "--budget", "64MiB"],
        ["probe file", "writable directory"],
        False,
    ),
    ("save-is-a-directory", ["--save", "{tmp}", "--budget", "64MiB"], ["is a directory"], False),
]


def _argv(extra: list[str], saved: dict[str, Path], tmp: Path) -> list[str]:
    names = {k: str(v) for k, v in saved.items()} | {"tmp": str(tmp)}
    argv = [a.format(**names) for a in extra]
    base = ["--model", TINY, *COMMON, "--steps", "3", "--progress-jsonl", str(tmp / "progress.jsonl")]
    if "--budget" in argv:  # --budget and --micro-batch exclude each other
        base = [a for a in base if a not in ("--micro-batch", "2")]
    return base + argv


@pytest.mark.parametrize(
    ("extra", "words", "from_argparse"),
    [pytest.param(e, w, a, id=i) for i, e, w, a in BAD_INPUTS],
)
@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_bad_train_inputs_are_one_line_errors_before_any_work(
    extra: list[str],
    words: list[str],
    from_argparse: bool,
    saved: dict[str, Path],
    tmp_path: Path,
    capsys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_fit(*a: Any, **kw: Any) -> None:
        raise AssertionError("the auto-fit ran before the input was checked")

    monkeypatch.setattr(memfit.fitting, "autofit", no_fit)
    argv = _argv(extra, saved, tmp_path)
    for json_mode in (False, True):
        try:
            code = main(["train", *argv, *(["--json"] if json_mode else [])])
        except SystemExit as exc:  # argparse
            code = exc.code
        out, err = capsys.readouterr()
        assert code == 2
        assert not (tmp_path / "progress.jsonl").exists()  # no training step ran
        if json_mode:
            obj = json.loads(out)  # exactly one JSON object
            assert obj["ok"] is False
            message = obj["error"]
        else:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            message = lines[-1]
            assert len(lines) == 1, err
        for w in words:
            assert w in message, message


# -- non-finite losses and empty windows ---------------------------------------------------------------

WORKLOAD = textwrap.dedent(
    '''
    import torch
    from torch import nn

    def _build(bad_steps, kind):
        """A tiny token regressor whose window number n (1-based) is bad when n is in bad_steps:
        kind "loss" (NaN in the data), "grad" (finite loss, NaN gradient), "empty" (no valid tokens)."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        calls = [0]

        def make_batch(n):
            calls[0] += 1
            x = torch.randn(n, 3, 4)
            mask = torch.ones(n, 3)
            bad = torch.full((n,), float(calls[0] in bad_steps))
            if calls[0] in bad_steps and kind == "empty":
                mask = torch.zeros(n, 3)
            if calls[0] in bad_steps and kind == "loss":
                x[0, 0, 0] = float("nan")
            return {"x": x, "mask": mask, "bad": bad}

        def loss_fn(m, b):
            per_token = (m(b["x"]).squeeze(-1) - 1.0) ** 2 * b["mask"]
            loss = per_token.sum()
            if kind == "grad" and bool(b["bad"].any()):
                # sqrt'(0) is inf and inf * 0 is NaN: a finite loss with a NaN gradient
                loss = loss + (0.0 * m[0].weight.sum()).sqrt()
            return loss, b["mask"].sum()

        def count_fn(b):
            return int(b["mask"].sum())

        return model, make_batch, loss_fn, count_fn

    def nan_loss_3_4():
        return _build({3, 4}, "loss")

    def nan_grad_3():
        return _build({3}, "grad")

    def empty_2():
        return _build({2}, "empty")

    def diverge_from_3():
        return _build(set(range(3, 100)), "loss")
    '''
)


@pytest.fixture
def poisoned(tmp_path: Path) -> Path:
    f = tmp_path / "poisoned.py"
    f.write_text(WORKLOAD)
    return f


def _train_file(capsys, spec: str, steps: int, save: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    return run_json(
        capsys,
        "--model",
        spec,
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
        "--steps",
        str(steps),
        "--save",
        str(save),
        *extra,
    )


@pytest.mark.parametrize(
    ("name", "before", "after", "reasons"),
    [
        pytest.param("nan_loss_3_4", 2, 4, {"nonfinite_loss": 2}, marks=pytest.mark.slow),
        ("nan_grad_3", 2, 3, {"nonfinite_grad_norm": 1}),
        pytest.param("empty_2", 1, 2, {"no_tokens": 1}, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_bad_windows_are_skipped_and_leave_weights_and_optimizer_bitwise_unchanged(
    capsys, poisoned: Path, tmp_path: Path, name: str, before: int, after: int, reasons: dict[str, int]
) -> None:
    spec = f"{poisoned}:{name}"
    code, a = _train_file(capsys, spec, before, tmp_path / "before.pt")
    assert code == 0 and a["skipped_steps"] == 0
    code, b = _train_file(capsys, spec, after, tmp_path / "after.pt")
    assert code == 0 and b["ok"] is True
    assert b["skip_reasons"] == reasons and b["skipped_steps"] == after - before
    assert b["optimizer_steps"] == before
    sa, sb = load_state(tmp_path / "before.pt"), load_state(tmp_path / "after.pt")
    for k in sa["model"]:  # AdamW's weight decay alone would have moved them
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    torch.testing.assert_close(sa["optimizer"]["state"], sb["optimizer"]["state"], rtol=0, atol=0)
    assert nonfinite_tensors(sb) == []
    # and the run goes on: the next good window steps
    code, c = _train_file(capsys, spec, after + 1, tmp_path / "next.pt")
    assert code == 0 and c["optimizer_steps"] == before + 1


@pytest.mark.slow
def test_a_diverged_run_stops_after_max_skips_and_saves_only_finite_weights(
    capsys, poisoned: Path, tmp_path: Path
) -> None:
    spec = f"{poisoned}:diverge_from_3"
    code, good = _train_file(capsys, spec, 2, tmp_path / "good.pt")
    assert code == 0
    code, got = _train_file(capsys, spec, 50, tmp_path / "diverged.pt", "--max-skips", "3")
    assert code == 3 and got["ok"] is False and got["stopped"] == "diverged"
    assert got["end_step"] == 5 and got["skipped_steps"] == 3 and got["consecutive_skips"] == 3
    assert "3 consecutive windows skipped" in got["error"] and "--resume" in got["error"] and "--lr" in got["error"]
    state = load_state(tmp_path / "diverged.pt")
    assert nonfinite_tensors(state) == []
    ref = load_state(tmp_path / "good.pt")
    for k in ref["model"]:
        assert torch.equal(ref["model"][k], state["model"][k]), k


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_lr_on_resume_is_applied_and_reported(capsys, tmp_path: Path) -> None:
    code, _ = run_json(capsys, "--model", TINY, *COMMON, "--steps", "2", "--save", str(tmp_path / "a.pt"))
    assert code == 0
    assert load_state(tmp_path / "a.pt")["optimizer"]["param_groups"][0]["lr"] == 3e-4
    code, got = run_json(
        capsys,
        "--model",
        TINY,
        *COMMON,
        "--steps",
        "3",
        "--resume",
        str(tmp_path / "a.pt"),
        "--lr",
        "0.01",
        "--save",
        str(tmp_path / "b.pt"),
    )
    assert code == 0 and got["lr"] == 0.01 and got["lr_saved"] == 3e-4
    groups = load_state(tmp_path / "b.pt")["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [0.01] * len(groups)


# -- disks, temporary files and start-up --------------------------------------------------------------


def test_a_full_progress_log_disk_warns_once_and_the_run_trains_and_saves(capsys, tmp_path: Path) -> None:
    """/dev/full takes the open and fails every write with ENOSPC, as a full disk does."""
    save = tmp_path / "state.pt"
    code, got = run_json(
        capsys, "--model", TINY, *COMMON, "--steps", "3", "--save", str(save), "--progress-jsonl", "/dev/full"
    )
    assert code == 0 and got["ok"] is True and got["end_step"] == 3
    assert load_state(save)["counters"]["windows"] == 3
    logged = [w for w in got["warnings"] if "--progress-jsonl /dev/full" in w]
    assert len(logged) == 1 and "writing step 1 failed (No space left on device)" in logged[0], got["warnings"]


def test_taking_the_lock_removes_only_its_own_stale_temporaries(tmp_path: Path) -> None:
    """A run saving to ckpt.pt must not delete the temporary of a run saving to ckpt.pt.bak."""
    mine = tmp_path / ".ckpt.pt.4242.k3j_x9ab.tmp"  # a killed writer of ckpt.pt left it
    others = [tmp_path / n for n in (".ckpt.pt.bak.4343.abcdefgh.tmp", ".ckpt.pt.5.4444.abcdefgh.tmp")]
    for f in (mine, *others):
        f.write_bytes(b"partial")
    with StateLock(tmp_path / "ckpt.pt"):
        pass
    assert not mine.exists() and all(f.exists() for f in others)


def test_a_failed_first_save_says_nothing_was_saved(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import memfit.training.state as state

    def full(*a: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    save = tmp_path / "state.pt"
    monkeypatch.setattr(state.torch, "save", full)
    code, got = run_json(capsys, "--model", TINY, *COMMON, "--steps", "2", "--save", str(save))
    assert code == 2 and not save.exists()
    assert "No space left on device" in got["error"] and "nothing was saved" in got["error"], got["error"]
    assert "--resume" not in got["error"]  # there is no file to resume from
    monkeypatch.undo()
    code, _ = run_json(capsys, "--model", TINY, *COMMON, "--steps", "2", "--save", str(save))
    assert code == 0
    monkeypatch.setattr(state.torch, "save", full)
    code, got = run_json(capsys, "--model", TINY, *COMMON, "--steps", "3", "--resume", str(save), "--save", str(save))
    assert code == 2 and f"continue with --resume {save}" in got["error"], got["error"]
    assert load_state(save)["counters"]["windows"] == 2  # the last complete save


def test_a_stop_before_any_save_does_not_offer_a_file_to_resume(tmp_path: Path) -> None:
    from memfit.training.config import TrainConfig
    from memfit.training.signals import Stop

    missing = str(tmp_path / "never.pt")
    line = Stop(kind="abort", step=0, signum=signal.SIGINT).describe(
        TrainConfig(global_batch=2, steps=5, save=missing),
        None,
        None,  # type: ignore[arg-type]
    )
    assert "nothing was saved" in line and "--resume" not in line, line


STARTUP = textwrap.dedent(
    """
    import pathlib, time
    from torch import nn
    import torch

    def slow():
        pathlib.Path(__file__).with_suffix(".ready").write_text("building")
        time.sleep(120)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), (lambda b: torch.randn(b, 4)), (lambda m, b: m(b).mean())
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_leaves_the_line_and_the_json(tmp_path: Path, sig: int, exit_code: int) -> None:
    wl = tmp_path / "slow.py"
    wl.write_text(STARTUP)
    proc = _popen("--model", f"{wl}:slow", *COMMON, "--steps", "2", "--save", str(tmp_path / "s.pt"), "--json")
    deadline = time.monotonic() + TIMEOUT_S
    while not wl.with_suffix(".ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == exit_code, err[-2000:]
    got = json.loads(out)  # the one JSON object
    name = signal.Signals(sig).name
    assert got["ok"] is False and got["exit_code"] == exit_code and got["signal"] == name
    assert f"stopped by {name} during start-up (loading the workload)" in got["error"], got["error"]
    assert "nothing was trained or saved" in got["error"] and not (tmp_path / "s.pt").exists()
