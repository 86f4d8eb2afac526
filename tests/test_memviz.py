"""A step's allocations as PyTorch's memory snapshot (memfit.report.memviz): the pickle has the structure
``torch.cuda.memory._snapshot()`` documents, PyTorch's own readers of snapshots (torch.cuda._memory_viz)
take it, and its trace replays to the peak the tracker measured, on a CPU step."""

from __future__ import annotations

import pickle

import torch
from torch import nn
from torch.cuda import _memory_viz

from memfit.capture.tracker import MemoryTracker
from memfit.report.memviz import allocation_snapshot, write_snapshot

EVENT_KEYS = {"action", "addr", "size", "stream", "frames"}
BLOCK_STATES = {"active_allocated", "active_awaiting_free", "inactive"}


def _step_allocations() -> tuple[list[tuple[int, int]], int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with MemoryTracker(device="cpu", record_allocations=True) as tracker:
        loss = model(x).square().mean()
        loss.backward()
        kept = loss.detach()  # alive at the end: one segment
    del kept
    return tracker.allocations, tracker.peak_bytes, tracker.current_bytes


def test_snapshot_has_torchs_structure_and_replays_to_the_tracked_peak(tmp_path) -> None:
    allocations, peak_bytes, end_bytes = _step_allocations()
    path = write_snapshot(tmp_path / "step.pickle", allocations)
    with open(path, "rb") as f:
        snap = pickle.load(f)

    assert set(snap) >= {"segments", "device_traces"}
    (trace,) = snap["device_traces"]
    assert trace and all(EVENT_KEYS <= set(e) for e in trace)
    assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed"}
    live: dict[int, int] = {}
    current = peak = 0
    for e in trace:  # every free completes an earlier allocation of its address and size
        if e["action"] == "alloc":
            assert e["addr"] not in live and e["addr"] % 512 == 0
            live[e["addr"]] = e["size"]
            current += e["size"]
            peak = max(peak, current)
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
            current -= e["size"]
    assert peak == peak_bytes and current == end_bytes  # the tracker's own peak and end, from the trace
    # segments: what is alive at the end, each block inside its segment, sizes adding up
    assert sorted(s["address"] for s in snap["segments"]) == sorted(live)
    for seg in snap["segments"]:
        assert {"address", "total_size", "stream", "segment_type", "allocated_size", "active_size", "blocks"} <= set(
            seg
        )
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"] == seg["allocated_size"]
        assert all(b["state"] in BLOCK_STATES for b in seg["blocks"])
    # PyTorch's readers of snapshot files take it (they raise on accounting errors)
    assert "segments: " in _memory_viz.segsum(snap)
    assert f"{len(trace)} entries" in _memory_viz.trace(snap)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)


def test_a_free_of_a_storage_made_before_recording_is_left_out() -> None:
    snap = allocation_snapshot([(1, 100), (7, -40), (1, -100)])
    assert [e["action"] for e in snap["device_traces"][0]] == ["alloc", "free_requested", "free_completed"]
    assert snap["memfit"]["frees_of_unrecorded_storages"] == 1 and snap["segments"] == []
