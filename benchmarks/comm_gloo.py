"""Collective times on 2 CPU processes (gloo) against memfit's ring model (memfit.plan.comm).

Measures ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_reduce`` of float32
tensors from 1 MiB to 32 MiB between two local processes, fits a "cpu-gloo" link to the
all-reduce times alone (least squares of ``t = latency + S * 2(N-1)/N / busbw``), and predicts
the all-gather and reduce-scatter times from that link with the same formulas memfit uses for
NVLink and InfiniBand (``(N-1)/N`` instead of ``2(N-1)/N``). The all-gather and reduce-scatter
rows are the check: they were not used in the fit. gloo has no ring reduce-scatter: torch's
``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones the input, all-reduces all of it and
copies out the rank's chunk, so its reduce-scatter of S bytes costs an all-reduce of S (the
``gloo`` column); NCCL, which memfit models, runs a ring reduce-scatter. Times are the fastest of ``--repeats`` runs (the least disturbed); the
machine is shared, so the table is a benchmark, not a test.

Run: ``python benchmarks/comm_gloo.py [--repeats 11]``. Writes ``benchmarks/results/comm_gloo.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memfit.plan.comm import Collective, Interconnect, Link, collective_seconds

SIZES = [2**20 * 2**i for i in range(6)]  # 1 MiB .. 32 MiB
WORLD = 2
OUT = Path(__file__).parent / "results" / "comm_gloo.json"


def _worker(rank: int, store: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    rows = {}
    for size in SIZES:
        n = size // 4
        full, shard = torch.randn(n), torch.randn(n // WORLD)
        ops = {
            "all_gather": lambda f=full, s=shard: dist.all_gather_into_tensor(f, s),
            "reduce_scatter": lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f),
            "all_reduce": lambda f=full: dist.all_reduce(f),
        }
        for name, op in ops.items():
            op()  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            rows[f"{name}:{size}"] = min(times)  # the least disturbed run: this machine is shared
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _fit(sizes: list[int], times: list[float], factor: float) -> tuple[float, float]:
    """Least squares ``t = a + b x`` with ``x = S * factor`` (nccl-tests' bus-bandwidth factor of the
    collective): ``(latency_s, bus_bytes_per_s)``."""
    xs = [s * factor for s in sizes]
    mx, mt = statistics.mean(xs), statistics.mean(times)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, times, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, mt - b * mx), 1.0 / b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args.repeats, out), nprocs=WORLD)
        rows = json.loads(Path(out).read_text())
    factors = {k: (2 if k is Collective.ALL_REDUCE else 1) * (WORLD - 1) / WORLD for k in Collective}
    fits = {k.value: _fit(SIZES, [rows[f"{k.value}:{s}"] for s in SIZES], factors[k]) for k in Collective}
    latency_s, bus = fits["all_reduce"]
    # The fitted latency is the whole collective's at N = 2 (two ring steps for an all-reduce, one for the others).
    net = Interconnect(
        intra=Link(kind="cpu-gloo", bandwidth_bytes_per_s=bus, efficiency=1.0, step_latency_s=latency_s / 2),
        base_latency_s=0.0,
    )
    table = []
    print(
        f"cpu-gloo link fitted to the all-reduce rows: bus bandwidth {bus / 1e9:.2f} GB/s, latency {latency_s * 1e6:.0f} us"
    )
    for k, (lat, bw) in fits.items():
        print(f"  each collective fitted alone: {k:<15} bus bandwidth {bw / 1e9:.2f} GB/s, latency {lat * 1e6:.0f} us")
    print(f"{'collective':<15}{'size':>10}{'measured ms':>13}{'ring ms':>9}{'error':>8}{'gloo ms':>9}{'error':>8}")
    for kind in Collective:
        for s in SIZES:
            measured = rows[f"{kind.value}:{s}"]
            model = collective_seconds(kind, s, WORLD, net)
            gloo = collective_seconds(
                Collective.ALL_REDUCE if kind is Collective.REDUCE_SCATTER else kind, s, WORLD, net
            )
            table.append(
                {
                    "collective": kind.value,
                    "size_bytes": s,
                    "measured_s": measured,
                    "model_s": model,
                    "gloo_model_s": gloo,
                }
            )
            print(
                f"{kind.value:<15}{s / 2**20:>8.2f}Mi{measured * 1e3:>13.3f}{model * 1e3:>9.3f}{(model - measured) / measured:>+8.0%}"
                f"{gloo * 1e3:>9.3f}{(gloo - measured) / measured:>+8.0%}"
            )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "world_size": WORLD, "torch": torch.__version__, "repeats": args.repeats,
        "fitted": {"bus_bytes_per_s": bus, "latency_s": latency_s, "fitted_on": "all_reduce"},
        "fitted_each": {k: {"latency_s": lat, "bus_bytes_per_s": bw} for k, (lat, bw) in fits.items()}, "rows": table,
    }, indent=1))  # fmt: skip
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
