"""Model states on the host, on the device memfit runs on: equality with plain training, peak, step time.

For a GPU session (its CUDA paths have run on no GPU yet; the CPU runs the same code with the host being
the device). An MLP chain trains ``--steps`` AdamW steps of two micro-steps each with:

- ``device``: plain ``torch.optim.AdamW(foreach=False)`` (the single-tensor kernels the host runs, so that
  the comparison can be bitwise on CUDA too);
- ``host-optimizer``: :class:`memfit.optim.HostOptimizer`;
- ``host-params``: :func:`memfit.optim.host_params.offload_parameters` (FSDP2 with CPUOffloadPolicy over a
  process group of one) and AdamW over the sharded parameters.

Per placement: whether the parameters after the steps equal the plain run's (bitwise, and the largest
difference), the device's peak over a step (``max_memory_allocated`` on CUDA, memfit's tracker on the
CPU, where the host placements' host bytes are counted apart), and the median step time.

Usage:
    python benchmarks/host_states_check.py [--device cuda] [--layers 8] [--width 2048] [--out host_states.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.capture.tracker import MemoryTracker
from memfit.optim.host import HostOptimizer
from memfit.optim.host_params import offload_parameters

LR = 1e-3


def build(layers: int, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]).to(device)


def one_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, width: int, device: torch.device) -> None:
    for micro in range(2):
        g = torch.Generator().manual_seed(10 * step + micro)
        x = torch.randn(16, width, generator=g).to(device)
        model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def measure(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, width: int, device: torch.device
) -> dict[str, Any]:
    """Peak of the last step, median step time over all but the first."""
    times, row = [], {}
    for step in range(steps):
        last = step == steps - 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        tracker = MemoryTracker(device=device).track(model, opt) if last and device.type == "cpu" else None
        t0 = time.perf_counter()
        if tracker is not None:
            with tracker:
                one_step(model, opt, step, width, device)
            row.update(device_peak_bytes=tracker.peak_bytes, host_peak_bytes=tracker.peak_host_bytes)
        else:
            one_step(model, opt, step, width, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if last:
                row["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if step > 0 and tracker is None:
            times.append(time.perf_counter() - t0)
    row["step_s"] = statistics.median(times) if times else None
    return row


def compare(plain: nn.Module, other: nn.Module) -> dict[str, Any]:
    diffs = []
    for p, q in zip(plain.parameters(), other.parameters(), strict=True):
        q = q.full_tensor() if hasattr(q, "full_tensor") else q
        diffs.append(float((p.detach() - q.detach().to(p.device)).abs().max()))
    return {"equal": max(diffs) == 0.0, "max_abs_diff": max(diffs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    say: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    plain = build(args.layers, args.width, device)
    out: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "layers": args.layers,
        "width": args.width,
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    out["device_placement"] = measure(
        plain, torch.optim.AdamW(plain.parameters(), lr=LR, foreach=False), args.steps, args.width, device
    )
    say(f"device: {out['device_placement']}")
    host = build(args.layers, args.width, device)
    with HostOptimizer(host.parameters(), torch.optim.AdamW, lr=LR) as opt:
        out["host_optimizer"] = {**measure(host, opt, args.steps, args.width, device), **compare(plain, host)}
    say(f"host-optimizer: {out['host_optimizer']}")
    sharded = copy.deepcopy(build(args.layers, args.width, device))
    try:
        with offload_parameters(sharded):
            opt = torch.optim.AdamW(sharded.parameters(), lr=LR, foreach=False)
            row = {**measure(sharded, opt, args.steps, args.width, device), **compare(plain, sharded)}
            row.pop("host_peak_bytes", None)  # FSDP2's resizes are not seen by the tracker
        out["host_params"] = row
    except Exception as err:  # a failed part is recorded, the others kept
        out["host_params"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    say(f"host-params: {out['host_params']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="host_states.json")
    args = p.parse_args()
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
