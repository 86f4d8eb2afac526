"""A step's allocations as PyTorch's memory snapshot: ``pytorch.org/memory_viz`` opens the pickle.

PyTorch's viewer reads what ``torch.cuda.memory._dump_snapshot`` writes: a pickled dict with
``segments`` (the allocator's state when the snapshot was taken) and ``device_traces`` (one list per
device of events: ``alloc``, ``free_requested``, ``free_completed``, each with ``addr``, ``size``,
``stream`` and ``frames``), documented by ``torch.cuda.memory._snapshot``. memfit's tracker records the
same stream on any device, the CPU included (:attr:`memfit.capture.tracker.MemoryTracker.allocations`:
``(storage key, bytes)``, negative for a free), so a CPU step gets the viewer's timeline too.

What is not CUDA's: addresses are made up (each allocation gets the next free address, never reused,
so two live tensors never share one); there is no caching allocator, so each storage alive at the
end is its own segment of exactly its size; no stack frames are recorded (``frames`` is empty). A free
of a storage the stream never allocated (made before recording began) is left out, and counted.
"""

from __future__ import annotations

import pickle
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["allocation_snapshot", "open_command", "snapshot_line", "write_snapshot"]

_ALIGN_BYTES = 512  # CUDA's allocator rounds blocks to 512 bytes; made-up addresses keep that alignment


def allocation_snapshot(allocations: Iterable[tuple[int, int]], *, device: int = 0) -> dict[str, Any]:
    """The snapshot dict of an allocation stream, as ``torch.cuda.memory._snapshot()`` returns one.

    Args:
        allocations: ``(storage key, bytes)`` in order, bytes negative for a free (the tracker's
            ``allocations``).
        device: the device index whose trace it is (the list ``device_traces[device]``).

    Returns:
        ``{"segments": [...], "device_traces": [[...], ...], "memfit": {...}}``: the last key is
        memfit's (events left out), which the viewer ignores.
    """
    live: dict[int, tuple[int, int]] = {}  # storage key -> (address, bytes)
    trace: list[dict[str, Any]] = []
    next_addr, unmatched = _ALIGN_BYTES, 0
    for key, n in allocations:
        if n >= 0:
            addr = next_addr
            next_addr += max(_ALIGN_BYTES, -(-n // _ALIGN_BYTES) * _ALIGN_BYTES)
            live[key] = (addr, n)
            trace.append(_event("alloc", addr, n, len(trace)))
        elif key in live:
            addr, size = live.pop(key)
            trace.append(_event("free_requested", addr, size, len(trace)))
            trace.append(_event("free_completed", addr, size, len(trace)))
        else:
            unmatched += 1
    segments = [
        {
            "device": device,
            "address": addr,
            "total_size": size,
            "allocated_size": size,
            "active_size": size,
            "requested_size": size,
            "stream": 0,
            "segment_type": "large" if size > 2**20 else "small",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": [
                {"address": addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": []}
            ],
        }
        for addr, size in sorted(live.values())
    ]
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    traces[device] = trace
    return {"segments": segments, "device_traces": traces, "memfit": {"frees_of_unrecorded_storages": unmatched}}


def write_snapshot(path: str | Path, allocations: Iterable[tuple[int, int]], *, device: int | str = 0) -> str:
    """Pickle :func:`allocation_snapshot` to ``path`` (as ``torch.cuda.memory._dump_snapshot`` does).

    Args:
        device: the device index, or the device's name (``"cuda:1"`` is index 1; ``"cpu"`` and
            ``"cuda"`` are 0).

    Returns:
        The path written.
    """
    if isinstance(device, str):
        device = int(device.rsplit(":", 1)[1]) if ":" in device else 0
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:
        pickle.dump(allocation_snapshot(allocations, device=device), f)
    return str(out)


def open_command(path: str) -> str:
    """The command that turns a snapshot into PyTorch's memory_viz page, offline (torch's own tool)."""
    html = str(Path(path).with_suffix(".html"))
    return f"python -m torch.cuda._memory_viz trace_plot {shlex.quote(path)} -o {shlex.quote(html)}"


def snapshot_line(path: str) -> str:
    """The line a command prints for ``--snapshot``: where it is and how to open it."""
    return (
        f"snapshot: {path} (the measured step's allocations; drop it on pytorch.org/memory_viz, or run "
        f"{open_command(path)})"
    )


def _event(action: str, addr: int, size: int, time_us: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [], "time_us": time_us}
