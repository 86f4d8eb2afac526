"""`memfit train`'s saves and resume files: special targets, full disks, checked resumes, seeds.

References: the file system's own view of a node (``os.stat`` kinds before and after), a state saved
and reloaded unchanged (bitwise), runs of the same seed, and an uninterrupted run of the same steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import memfit
from memfit.training import TrainConfig, train
from memfit.training.integrity import seal, state_digest
from memfit.training.state import StateLock, TrainStateError, check_writable, load_state, save_state

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = "demo?n_layer=1&n_embd=16&n_head=2&seq_len=16"
TWO = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=16"  # a chain to plan


def _config(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = {"global_batch": 4, "micro_batch": 2, "steps": 2, "device": "cpu"}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real save of two steps of AdamW (moments, counters, RNG states)."""
    path = tmp_path_factory.mktemp("saved") / "s.pt"
    train(TINY, _config(save=str(path)))
    return path


# -- special files and links --------------------------------------------------------------------------


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "fifo")
    return d / "fifo"


def _socket(d: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "sock"))
    s.close()  # the node stays after the socket is closed
    return d / "sock"


def _chardev(d: Path) -> Path:
    os.mknod(d / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the device /dev/null is
    return d / "null"


def _blockdev(d: Path) -> Path:
    os.mknod(d / "loop", stat.S_IFBLK | 0o600, os.makedev(7, 200))
    return d / "loop"


MAKERS = {"fifo": _fifo, "socket": _socket, "char-device": _chardev, "block-device": _blockdev}
ROOT = os.geteuid() == 0


@pytest.mark.parametrize("through_link", [False, True], ids=["direct", "symlink"])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_special_file_is_refused_as_a_save_target_and_left_as_it_was(
    tmp_path: Path, kind: str, through_link: bool
) -> None:
    if kind.endswith("device") and not ROOT:
        pytest.skip("creating a device node needs root")
    node = MAKERS[kind](tmp_path)
    mode = os.stat(node).st_mode
    target = node
    if through_link:
        target = tmp_path / "link.pt"
        target.symlink_to(node)
    with pytest.raises(TrainStateError, match="not a regular file") as err:
        check_writable(target)
    assert "\n" not in str(err.value) and str(target) in str(err.value)
    model = nn.Linear(2, 1)
    acc = memfit.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=1)
    with pytest.raises(TrainStateError, match="not a regular file"):
        save_state(target, acc.state_dict())  # Python users who skip check_writable
    assert os.stat(node).st_mode == mode  # still the same kind of node
    assert not through_link or target.is_symlink()


@pytest.mark.skipif(not ROOT, reason="creating a device node needs root")
def test_a_device_as_save_is_refused_by_the_command_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As root, --save /dev/null was replaced by a regular file. The node here is /dev/null's device
    (1, 3) made in a temporary directory: a regression must not replace the machine's /dev/null."""
    from memfit.cli.main import main

    node = _chardev(tmp_path)
    before = os.stat(node)
    argv = ["train", "--model", TINY, "--global-batch", "2", "--steps", "1", "--device", "cpu", "--save", str(node)]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "a character device, not a regular file" in err and "train ━" not in err  # refused before a step
    after = os.stat(node)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino
    with pytest.raises(TrainStateError, match="a character device, not a regular file"):
        check_writable("/dev/null")  # the real one: checked, never written


def test_a_save_through_a_symlink_writes_the_file_it_names_and_keeps_the_link(tmp_path: Path) -> None:
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = real_dir / "state.pt"
    link = tmp_path / "link.pt"
    link.symlink_to(real)  # dangling until the first save
    res = train(TINY, _config(save=str(link)))
    assert res.ok and link.is_symlink() and real.is_file() and not real.is_symlink()
    assert load_state(link)["counters"]["windows"] == 2
    assert not list(tmp_path.glob(".link.pt*"))  # the temporary was beside the real file, not the link
    # One lock for the file, whichever name a run gives it.
    with StateLock(link), pytest.raises(TrainStateError, match="another run is writing"):
        StateLock(real).acquire()
    res = train(TINY, _config(steps=3, save=str(link), resume=str(link)))
    assert res.ok and link.is_symlink() and load_state(real)["counters"]["windows"] == 3


# -- a full disk --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(d: Path, size_bytes: int) -> Iterator[Path]:
    d.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(d)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_disk_that_fills_during_the_run_fails_the_save_in_one_line_and_keeps_the_last_save(
    tmp_path: Path, saved: Path
) -> None:
    size = saved.stat().st_size  # one save of this run; the disk takes one and a half
    with _tmpfs(tmp_path / "small", size * 3 // 2) as d:
        path = d / "s.pt"
        with pytest.raises(TrainStateError) as err:
            train(TINY, _config(steps=3, save=str(path), save_every=1))
        line = str(err.value)
        assert "\n" not in line and "the disk is full" in line and str(path) in line and "free" in line
        assert "keeps its last complete save" in line and f"--resume {path}" in line
        assert load_state(path)["counters"]["windows"] == 1  # the first save, complete
        assert [p.name for p in d.iterdir()] == ["s.pt", "s.pt.lock"]  # no temporary left


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_disk_without_room_for_one_save_is_refused_before_training(tmp_path: Path, saved: Path) -> None:
    with _tmpfs(tmp_path / "small", saved.stat().st_size // 2) as d:
        with pytest.raises(TrainStateError, match=r"a save of this run needs about .* free") as err:
            train(TINY, _config(save=str(d / "s.pt")))
        assert str(d / "s.pt") in str(err.value) and not (d / "s.pt").exists()


def test_torch_s_writer_error_on_a_full_disk_is_a_one_line_error(
    tmp_path: Path, saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.pt"
    path.write_bytes(saved.read_bytes())
    real_save = torch.save

    def full(obj: Any, f: Any, *args: Any, **kw: Any) -> None:
        real_save({"half": torch.zeros(100)}, f)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 320 vs 256")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(TrainStateError) as err:
        save_state(path, load_state(saved))
    assert "the disk is full" in str(err.value) and "free in" in str(err.value) and "\n" not in str(err.value)
    assert path.read_bytes() == saved.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["s.pt"]


# -- checked resume files -----------------------------------------------------------------------------


def _tensors_equal(a: Any, b: Any) -> bool:
    return state_digest({"x": a}) == state_digest({"x": b})


def _record_offsets(path: Path) -> dict[str, int]:
    """The byte offset of the middle of each record's data in the zip."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            with path.open("rb") as f:
                f.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            start = info.header_offset + 30 + name_len + extra_len
            if info.file_size:
                out[info.filename] = start + info.file_size // 2
    return out


def test_flipped_bytes_in_a_real_save_are_refused_or_change_nothing(tmp_path: Path, saved: Path) -> None:
    data = saved.read_bytes()
    original = load_state(saved)
    records = _record_offsets(saved)
    tensors = [off for name, off in records.items() if "/data/" in name]
    tensors = tensors[:: max(1, len(tensors) // 8)]  # weights, moments, RNG states: a few of each
    pickled = [off for name, off in records.items() if name.endswith("data.pkl")]
    spread = list(range(0, len(data), max(1, len(data) // 12)))
    refused = 0
    for pos in sorted({*tensors, *pickled, *spread, len(data) - 10}):
        bad = tmp_path / "bad.pt"
        bad.write_bytes(data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :])
        try:
            got = load_state(bad)
        except TrainStateError as err:
            assert "\n" not in str(err) and str(bad) in str(err)
            refused += 1
            continue
        assert pos not in tensors and pos not in pickled, f"a flip at {pos} inside a record loaded"
        assert _tensors_equal(got, original), f"a flip at {pos} changed the state and it loaded"
    assert refused >= len(tensors) + len(pickled)


def test_a_flipped_weight_with_a_valid_zip_fails_the_checksum(tmp_path: Path, saved: Path) -> None:
    """Rewritten by torch (the zip's CRCs right): only the checksum sees the change."""
    state = torch.load(saved, weights_only=True)
    name = next(k for k in state["model"] if k.endswith("weight"))
    state["model"][name].view(-1)[0] += 1.0
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(TrainStateError, match="fails its checksum"):
        load_state(tmp_path / "bad.pt")


def _tamper_counters(s: dict[str, Any], value: Any) -> None:
    s["counters"]["windows"] = value


def _first_moment(s: dict[str, Any], key: str) -> torch.Tensor:
    return s["optimizer"]["state"][0][key]


TAMPER = {
    "negative step counter": (lambda s: _tamper_counters(s, -3), "counters.windows = -3"),
    "string step counter": (lambda s: _tamper_counters(s, "3"), "counters.windows = '3'"),
    "bool step counter": (lambda s: _tamper_counters(s, True), "counters.windows = True"),
    "NaN weight": (lambda s: s["model"][next(iter(s["model"]))].view(-1).__setitem__(0, float("nan")), "NaN or infinite"),
    "negative exp_avg_sq": (lambda s: _first_moment(s, "exp_avg_sq").view(-1).__setitem__(0, -1.0), "negative values"),
    "float64 weight": (lambda s: s["model"].__setitem__(next(iter(s["model"])), s["model"][next(iter(s["model"]))].double()), "in float64 and this run's is float32"),
    "float64 moment": (lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", _first_moment(s, "exp_avg").double()), "exp_avg in float64"),
    "negative optimizer step": (lambda s: s["optimizer"]["state"][0].__setitem__("step", torch.tensor(-1.0)), "step = -1.0"),
    "torch RNG garbage": (lambda s: s["rng"].__setitem__("torch", torch.zeros(7, dtype=torch.uint8)), "rng.torch"),
    "python RNG garbage": (lambda s: s["rng"]["python"].__setitem__("internal", [1, 2, 3]), "rng.python"),
    "numpy RNG garbage": (lambda s: s["rng"]["numpy"].__setitem__("keys", torch.zeros(3, dtype=torch.int64)), "rng.numpy"),
    "data RNG garbage": (lambda s: s["extra"].__setitem__("data_rng", "seed"), "extra.data_rng"),
    "micro_batch 0": (lambda s: s["config"].__setitem__("micro_batch", 0), "config.micro_batch = 0"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TAMPER))
def test_a_tampered_state_with_a_valid_checksum_is_refused_before_training(
    tmp_path: Path, saved: Path, case: str
) -> None:
    change, words = TAMPER[case]
    state = torch.load(saved, weights_only=True)
    change(state)
    bad = tmp_path / "bad.pt"
    torch.save(seal(state), bad)  # a checksum that matches: the value checks must see it
    with pytest.raises(TrainStateError) as err:
        train(TINY, _config(steps=3, resume=str(bad)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_every_changed_option_on_resume_is_one_warning_and_fp16_scaler_is_refused(saved: Path) -> None:
    res = train(
        TINY, _config(steps=3, resume=str(saved), seed=5, normalize="sum", autocast_dtype=torch.bfloat16, max_grad_norm=1.0, micro_batch=1)
    )  # fmt: skip
    text = "\n".join(res.warnings)
    for flag in ("--seed 5", "--normalize sum", "--amp bf16", "--max-grad-norm 1.0", "--micro-batch 1"):
        assert f"with {flag}, saved " in text, text
    assert len([w for w in res.warnings if w.startswith("resuming")]) == 5
    same = train(TINY, _config(steps=3, resume=str(saved)))
    assert not [w for w in same.warnings if w.startswith("resuming")]
    with pytest.raises(TrainStateError, match="GradScaler"):
        train(TINY, _config(steps=3, resume=str(saved), autocast_dtype=torch.float16))


def test_a_state_without_checksum_loads_with_a_warning(tmp_path: Path, saved: Path) -> None:
    state = torch.load(saved, weights_only=True)
    del state["checksum"]
    torch.save(state, tmp_path / "old.pt")
    res = train(TINY, _config(steps=3, resume=str(tmp_path / "old.pt")))
    assert res.ok and any("has no checksum" in w for w in res.warnings)


# -- seeds ----------------------------------------------------------------------------------------------


class _Noisy(nn.Module):
    """Draws from Python's random and NumPy in its forward (as SpecAugment or LayerDrop do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (1 + random.random()) + float(np.random.rand())


def _noisy() -> memfit.Workload:
    torch.manual_seed(0)
    return memfit.Workload(
        name="noisy", model=_Noisy(), make_batch=lambda b: torch.randn(b, 4), loss_fn=lambda m, b: m(b).pow(2).mean()
    )


@pytest.mark.slow  # about 5 s on 2 cores: the fast tier keeps to about 4 minutes
def test_seed_fixes_python_and_numpy_draws_and_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    random.seed(123)
    np.random.seed(123)
    a = train(_noisy(), _config(steps=4, optimizer="sgd"))
    random.seed(456)  # what ran before must not matter
    np.random.seed(456)
    b = train(_noisy(), _config(steps=4, optimizer="sgd"))
    assert a.losses == b.losses
    c = train(_noisy(), _config(steps=4, optimizer="sgd", seed=1))
    assert c.losses[0] != a.losses[0]
    path = tmp_path / "s.pt"
    first = train(_noisy(), _config(steps=2, optimizer="sgd", save=str(path)))
    random.seed(789)
    np.random.seed(789)
    rest = train(_noisy(), _config(steps=4, optimizer="sgd", resume=str(path)))
    assert first.losses + rest.losses == a.losses


# -- signals during start-up ----------------------------------------------------------------------------

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _handles_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (Python has one for SIGINT from its start; memfit's main
    sets SIGTERM's first of all, before it imports torch)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads handlers from /proc")
@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.5, 4.0])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_the_first_seconds_leaves_memfit_s_line_and_json(tmp_path: Path, sig: int, delay_s: float) -> None:
    """Whatever the moment (importing torch, the command's modules, loading, training), the exit code is
    128 + the signal and the output memfit's one line, never a traceback or a silent death."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "memfit.cli.main", "train", "--model", TINY, "--global-batch", "2"]
    for json_mode in (False, True):
        proc = subprocess.Popen(
            [*argv, "--steps", "100000", "--device", "cpu", *(["--json"] if json_mode else [])],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not _handles_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.002)
        time.sleep(delay_s)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        name = signal.Signals(sig).name
        assert proc.returncode == 128 + sig, (out, err)
        assert "Traceback" not in err, err
        if json_mode:
            got = json.loads(out[out.index("{") :])  # the run's header lines go to stderr; one object here
            assert got["ok"] is False and got["exit_code"] == 128 + sig
            assert f"stopped by {name}" in got["error"], got
        else:
            assert f"memfit train: stopped by {name}" in err.strip().splitlines()[-1], err


# -- user input that was exit 70 --------------------------------------------------------------------------

WORKLOADS = """
import torch
from torch import nn


def complex_loss():
    return nn.Linear(4, 1), (lambda b: torch.randn(b, 4)), (lambda m, b: m(b).mean() * (1 + 1j))


def on_meta():
    with torch.device("meta"):
        model = nn.Linear(4, 1)
    return model, (lambda b: torch.randn(b, 4)), (lambda m, b: m(b).mean())
"""


def _zero_peak_plan(d: Path) -> Path:
    wl = memfit.load_workload(TWO)
    plan = memfit.policy_plan(wl.model, memfit.RecomputeAll())
    plan.save(d / "p.json")
    data = json.loads((d / "p.json").read_text())
    data["predicted_peak_bytes"] = 0
    (d / "p.json").write_text(json.dumps(data))
    return d / "p.json"


BAD_INPUTS = {
    "huge seed": (["train", "--model", TINY, "--global-batch", "2", "--steps", "1", "--seed", "1180591620717411303424"], "largest seed, 2**63 - 1"),
    "complex loss": (["train", "--model", "{wl}:complex_loss", "--global-batch", "2", "--steps", "1", "--device", "cpu"], "complex-valued loss"),
    "meta model": (["train", "--model", "{wl}:on_meta", "--global-batch", "2", "--steps", "1", "--device", "cpu"], "on the meta device"),
    "zero predicted peak": (["verify", "--model", TWO, "--batch-size", "2", "--plan", "{plan}"], '"predicted_peak_bytes" is 0'),
    "unknown compile backend": (["verify", "--model", TWO, "--batch-size", "2", "--compile", "model", "--compile-backend", "nosuch"], "'nosuch' is not a torch.compile backend"),
    "plan report txt": (["plan", "--model", TWO, "--budget", "100MiB", "--report", "{d}/r.txt"], "ending in .html or .png"),
    "fit report dev-full": (["fit", "--model", TWO, "--budget", "100MiB", "--report", "/dev/full"], "ending in .html or .png"),
    "demo report txt": (["demo", "--report", "{d}/r.txt"], "ending in .png"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_user_input_is_exit_2_with_one_line_not_an_internal_error(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli.main import main

    (tmp_path / "wl.py").write_text(WORKLOADS)
    argv, words = BAD_INPUTS[case]
    plan = _zero_peak_plan(tmp_path) if "{plan}" in argv else None
    argv = [a.format(wl=tmp_path / "wl.py", plan=plan, d=tmp_path) for a in argv]
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir("/dev"))
    for json_mode in (False, True):
        code = main([*argv, *(["--json"] if json_mode else [])])
        out, err = capsys.readouterr()
        line = json.loads(out)["error"] if json_mode else err.strip().splitlines()[-1]
        assert code == 2 and words in line and "internal error" not in line, (out, err)
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir("/dev"))) == before  # no report written anywhere
    if case == "huge seed":  # the Python API refuses it too
        with pytest.raises(memfit.SpecError, match="2\\*\\*63 - 1"):
            train(TINY, _config(seed=2**70))


def test_a_state_saved_on_another_device_is_resumed_with_a_warning(tmp_path: Path, saved: Path) -> None:
    state = torch.load(saved, weights_only=True)
    assert state["extra"]["options"]["device"] == "cpu"
    state["extra"]["options"]["device"] = "cuda"  # as a GPU run would have saved it
    torch.save(seal(state), tmp_path / "gpu.pt")
    res = train(TINY, _config(steps=3, resume=str(tmp_path / "gpu.pt")))
    assert res.ok and any("with --device cpu, saved with --device cuda" in w for w in res.warnings), res.warnings


@pytest.mark.parametrize(
    "make",
    [_fifo, _socket, pytest.param(_chardev, marks=pytest.mark.skipif(not ROOT, reason="mknod of a device needs root"))],
    ids=["fifo", "socket", "chardev"],
)
def test_a_special_file_as_resume_is_refused_without_reading_it(tmp_path: Path, make: Any) -> None:
    # /dev/zero or a FIFO read as "is empty (0 bytes)"; a FIFO with a writer would have been read whole.
    path = make(tmp_path)
    with pytest.raises(TrainStateError, match="is a special file"):
        load_state(path)
