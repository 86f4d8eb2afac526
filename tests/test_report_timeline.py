"""The memory timeline on a time axis: the tracker stamps each timeline sample with the time it was
recorded, a recorded step carries seconds from its start, and the report's panel draws milliseconds
(with the op count only where a step has no times)."""

from __future__ import annotations

import time

import torch
from torch import nn

from memfit.capture.tracker import MemoryTracker
from memfit.profiling.timeline import record_timeline
from memfit.profiling.types import StepTimeline
from memfit.report.panels import timeline
from memfit.workload import Workload


def test_tracker_stamps_each_timeline_sample() -> None:
    with MemoryTracker(record_timeline=True) as tracker:
        a = torch.empty(10)
        time.sleep(0.05)
        b = torch.empty(20)
        del a, b
    times = tracker.timeline_times_s
    assert len(times) == len(tracker.timeline) == 4
    assert times == sorted(times)
    assert times[1] - times[0] >= 0.05  # the sleep between the two allocations
    assert MemoryTracker(record_timeline=True).timeline_times_s == []


def _steps(n: int, *, times: bool) -> StepTimeline:
    live = [1000 + 10 * i for i in range(n)]
    live[n // 2] += 5000
    return StepTimeline(
        op_index=tuple(range(n)), live_bytes=tuple(live), phase=("forward",) * (n // 2) + ("backward",) * (n - n // 2),
        grads_bytes=(0,) * n, params_bytes=100, optimizer_bytes=0, peak_bytes=max(live), batch_size=2, micro_batch=2,
        micro_steps=1, time_s=tuple(0.25 * i / n for i in range(n)) if times else (),
    )  # fmt: skip


def test_panel_x_is_milliseconds_from_the_steps_times() -> None:
    tl = _steps(3000, times=True)
    d = timeline("plan", tl)
    assert d["x_unit"] == "ms"
    assert d["x"][0] == 0.0 and 249.0 <= d["x"][-1] <= 251.0 and d["x"] == sorted(d["x"])
    peak = tl.live_bytes.index(tl.peak_bytes)
    assert d["peak_x"] == round(tl.time_s[peak] * 1e3, 3) and d["peak_op"] == peak
    assert max(d["live_bytes"]) == tl.peak_bytes  # the one-sample peak survives the columns
    # without times (a step recorded before they existed): the op count, said so
    old = timeline("plan", _steps(300, times=False))
    assert old["x_unit"] == "op" and old["x"][-1] >= 299


def test_recorded_step_carries_its_times() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).square().mean()

    wl = Workload(name="mlp", model=model, make_batch=lambda b: torch.randn(b, 16), loss_fn=loss_fn)
    tl = record_timeline(wl, None, batch_size=8, micro_batch=4)
    assert len(tl.time_s) == len(tl.op_index) > 0
    assert tl.time_s[0] >= 0 and list(tl.time_s) == sorted(tl.time_s)
    assert tl.to_dict()["time_s"] == list(tl.time_s)
