"""A ``torchrun`` rank that stops answering ends the run in bounded time, with the resume line.

Two real gloo ranks of ``memfit train``; rank 1 is frozen with SIGSTOP mid-run. Rank 0 must leave
within a few ``--collective-timeout`` (not gloo's default 30 minutes), name the last complete save,
release the save lock, and obey a SIGTERM sent while it waits. The waits of :class:`Ranks`' own
collectives are checked in-process against a collective that never completes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit.training import distributed
from memfit.training.distributed import CollectiveInterrupted, CollectiveTimeout, Ranks
from memfit.training.state import StateLock, load_state

SRC = str(Path(__file__).resolve().parents[1] / "src")
TIMEOUT_S = 3  # --collective-timeout of the runs below
SPEC = "demo?n_layer=2&n_embd=32&n_head=2&seq_len=32"


class _NeverDone:
    """A collective whose other ranks never come."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:  # pragma: no cover - never reached
        raise AssertionError


def _ranks(timeout_s: float) -> Ranks:
    import torch

    return Ranks(0, 2, torch.device("cpu"), owned=False, timeout_s=timeout_s)


def test_a_wait_for_the_other_ranks_ends_at_the_timeout() -> None:
    ranks = _ranks(0.2)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"waited 0 s \(--collective-timeout\) for the other ranks \(agreeing"):
        ranks._run(_NeverDone(), "agreeing on a stop")
    assert time.monotonic() - t0 < 2 and ranks.lost


def test_a_signal_while_waiting_ends_the_wait_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "SIGNAL_GRACE_S", 0.2)
    ranks = _ranks(600)
    ranks.signal_received = lambda: signal.SIGTERM
    t0 = time.monotonic()
    with pytest.raises(CollectiveInterrupted, match="when SIGTERM arrived") as info:
        ranks._run(_NeverDone(), "agreeing on a stop")
    assert info.value.signum == signal.SIGTERM and time.monotonic() - t0 < 2


def test_a_save_counts_once_written_when_a_rank_is_lost_at_its_closing_barrier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from memfit.accumulate import Accumulator
    from memfit.training.saving import save_run
    from memfit.training.state import RunSignature

    ranks = _ranks(3)
    monkeypatch.setattr(ranks, "gather_objects", lambda obj, what="": [obj, obj])

    def lost(what: str = "") -> None:
        raise CollectiveTimeout("lost", what=what, waited_s=3.0)

    monkeypatch.setattr(ranks, "barrier", lost)
    model = torch.nn.Linear(4, 2)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=1)
    signature = RunSignature(model="m", optimizer="sgd", seq_len=None, global_batch=2, world_size=2, dtype="float32")
    written: list[bool] = []
    save = tmp_path / "state.pt"
    with pytest.raises(CollectiveTimeout):
        save_run(str(save), acc, ranks, torch.get_rng_state(), signature, on_written=lambda: written.append(True))
    assert written == [True]  # the run names this save in its resume line
    assert torch.equal(load_state(save)["model"]["weight"], model.weight.detach())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_ranks(tmp: Path) -> tuple[list[subprocess.Popen[str]], Path, Path]:
    save, log = tmp / "state.pt", tmp / "progress.jsonl"
    port = _free_port()
    argv = [sys.executable, "-m", "memfit.cli.main", "train", "--model", SPEC, "--global-batch", "4", "--micro-batch", "1",
            "--steps", "100000", "--save", str(save), "--save-every", "2", "--progress-jsonl", str(log),
            "--collective-timeout", str(TIMEOUT_S), "--device", "cpu", "--json"]  # fmt: skip
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")  # fmt: skip
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 240
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):  # a save (step 2) is on disk
        assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()[1][-3000:]
        time.sleep(0.05)
    return procs, save, log


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [None, signal.SIGTERM], ids=["timeout", "SIGTERM"])
def test_a_stopped_rank_ends_the_run_in_bounded_time_with_the_resume_line(tmp_path: Path, sig: int | None) -> None:
    procs, save, _ = _start_two_ranks(tmp_path)
    try:
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        if sig is not None:
            time.sleep(0.5)  # rank 0 is now waiting for rank 1
            procs[0].send_signal(sig)
        out, err = procs[0].communicate(timeout=60)
        waited = time.monotonic() - t0
        # Inside DDP's backward the wait is gloo's: one timeout there, one at the next collective.
        assert waited < 4 * TIMEOUT_S + 5, waited
        assert procs[0].returncode == (75 if sig is None else 128 + sig), err[-3000:]
        got = json.loads(out)
        assert got["ok"] is False and got["stopped"] == "ranks_lost"
        line = got["error"]
        # Where the wait ends depends on where rank 1 stopped: in torch's collective (gloo's timeout:
        # "another rank stopped answering within --collective-timeout 3 s") or in memfit's own
        # ("rank 0 waited 3 s (--collective-timeout) for the other ranks"; with the signal arriving during
        # it, "... when SIGTERM arrived, and the other ranks did not come within --collective-timeout 3 s").
        assert re.search(
            rf"(within --collective-timeout {TIMEOUT_S} s|waited {TIMEOUT_S} s \(--collective-timeout\))", line
        ), line
        assert f"state of step {got['saved_step']} saved to {save}" in line and f"--resume {save}" in line, line
        assert load_state(save)["counters"]["windows"] == got["saved_step"] >= 2
        with StateLock(save):  # released: a restarted run may take it
            pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate(timeout=60)
