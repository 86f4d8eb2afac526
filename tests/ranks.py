"""Run a worker script as two (or more) gloo ranks on this machine, for the distributed tests.

The worker gets ``RANK WORLD_SIZE STORE_FILE OUT_DIR [extra args]`` and writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def rank_env() -> dict[str, str]:
    """The environment of a rank: loopback gloo, one thread, memfit's sources and tests/ importable."""
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), str(HERE), env.get("PYTHONPATH", "")])
    return env


def run_ranks(worker: str, tmp: Path, *extra: str, world_size: int = 2, timeout_s: float = 120) -> list[dict]:
    """Start ``tests/<worker>`` as ``world_size`` processes, wait, and return each rank's JSON."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / worker), str(r), str(world_size), str(tmp / "store"), str(tmp), *extra],
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world_size)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world_size)]


def assert_rank_peaks_within(got: dict, predicted: int, rel: float = 0.03) -> None:
    """Each rank's measured peak (``memfit train --json``) within ``rel`` of ``predicted``, plus, above
    it, what a collective's thread held at that peak (``collective_held_bytes_by_rank``: gloo frees a
    collective's buffers on its worker threads, a timing-dependent while after the main thread went
    on; NOTE [ Buffers a collective's thread frees ] in memfit.training.distributed)."""
    measured = got["measured_peak_bytes_by_rank"]
    held = got.get("collective_held_bytes_by_rank") or [None] * len(measured)
    assert len(measured) == len(held) >= 2 and all(m is not None for m in measured), got
    for rank, (m, h) in enumerate(zip(measured, held, strict=True)):
        assert -rel * predicted <= m - predicted <= rel * predicted + (h or 0), (rank, m, h, predicted)
