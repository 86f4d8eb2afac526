"""Soak: 1000 optimizer steps of ``memfit train`` with a recomputing plan, accumulation and the guard.

Runs one real ``memfit train`` process (the small demo GPT, ``--budget`` tight enough that the
auto-fit recomputes blocks and accumulates over micro-batches, ``--guard`` so that every step runs
under the memory tracker with the budget as its limit) with ``--progress-jsonl``, which records
per step the tracker's peak of that step and the process's resident set size
(``/proc/self/statm``). Every ``--every`` steps the table shows the highest tracked peak of the
interval, the RSS at its end and the loss; a leak would show as a rising tracked peak (tensors
kept alive from step to step) or a rising RSS (memory held outside tensors).

Run: ``python benchmarks/soak.py [--steps 1000] [--every 100]``. Writes
``benchmarks/results/soak.json`` and prints a table. One intra-op thread (``OMP_NUM_THREADS=1``):
about 0.2-0.3 s per step on a shared 2-core machine, 4-6 minutes in all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "soak.json"
MODEL = "demo?n_layer=4&n_embd=64&n_head=2&seq_len=64"
BUDGET = "6MiB"  # the auto-fit answers micro-batch 4 x 2 with 3 of 4 blocks recomputed
GLOBAL_BATCH = 8
MiB = 1024 * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--budget", default=BUDGET)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "progress.jsonl"
        cmd = [
            sys.executable, "-m", "memfit.cli.main", "train", "--model", args.model,
            "--global-batch", str(args.global_batch), "--budget", args.budget, "--guard",
            "--steps", str(args.steps), "--progress-jsonl", str(log), "--save", str(Path(tmp) / "state.pt"),
            "--save-every", str(args.every), "--json",
        ]  # fmt: skip
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"memfit train failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        summary = json.loads(proc.stdout)
        records = [json.loads(line) for line in log.read_text().splitlines()]

    rows = intervals(records, args.every)
    first, last = rows[0], rows[-1]
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 intra-op thread",
        "python": platform.python_version(),
        "torch": _torch_version(),
        "command": "memfit "
        + " ".join(cmd[3:]).replace(str(log), "PROGRESS.jsonl").replace(str(Path(log).parent / "state.pt"), "STATE.pt"),
        "wall_s": wall_s,
        "micro_batch": summary["micro_batch"],
        "accumulation_steps": summary["accumulation_steps"],
        "recomputed_blocks": summary["recomputed_blocks"],
        "policy": summary["policy"],
        "budget_bytes": summary["budget_bytes"],
        "optimizer_steps": summary["optimizer_steps"],
        "skipped_steps": summary["skipped_steps"],
        "replans": summary["replans"],
        "median_step_s": summary["step_s"],
        "intervals": rows,
        "tracked_peak_growth_bytes": last["tracked_peak_bytes"] - first["tracked_peak_bytes"],
        "rss_growth_bytes": last["rss_bytes"] - first["rss_bytes"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def intervals(records: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """Per ``every`` steps: the highest tracked peak, the RSS and loss at the last step."""
    rows = []
    for end in range(every, len(records) + 1, every):
        chunk = records[end - every : end]
        peaks = [r["tracked_peak_bytes"] for r in chunk if r["tracked_peak_bytes"] is not None]
        rows.append(
            {
                "steps": f"{end - every + 1}-{end}",
                "tracked_peak_bytes": max(peaks) if peaks else None,
                "rss_bytes": chunk[-1]["rss_bytes"],
                "loss": chunk[-1]["loss"],
                "skipped": sum(r["skip_reason"] is not None for r in chunk),
                "elapsed_s": chunk[-1]["elapsed_s"],
            }
        )
    return rows


def print_table(r: dict[str, Any]) -> None:
    print(f"`python benchmarks/soak.py` ({r['date']}, {r['machine']}, torch {r['torch']}): `{r['command']}`")
    print(
        f"micro-batch {r['micro_batch']} x {r['accumulation_steps']}, {r['recomputed_blocks']} blocks recomputed, "
        f"guard on (limit {r['budget_bytes'] / MiB:.2f} MiB); {r['optimizer_steps']} optimizer steps, "
        f"{r['skipped_steps']} skipped, {r['replans']} replans; median step {r['median_step_s'] * 1e3:.0f} ms, {r['wall_s']:.0f} s in all\n"
    )
    print("| steps | tracked peak (max) | process RSS | loss |")
    print("|---|---|---|---|")
    for row in r["intervals"]:
        print(
            f"| {row['steps']} | {row['tracked_peak_bytes']:,} B ({row['tracked_peak_bytes'] / MiB:.2f} MiB) | {row['rss_bytes'] / MiB:.1f} MiB | {row['loss']:.3f} |"
        )
    print(
        f"\ngrowth from the first interval to the last: tracked peak {r['tracked_peak_growth_bytes']:+,} B, "
        f"RSS {r['rss_growth_bytes'] / MiB:+.1f} MiB"
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
