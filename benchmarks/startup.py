"""Start-up: the CPU seconds memfit takes to answer before it does any work.

Each case runs in a fresh process; its CPU time (user + system) is read with
``resource.getrusage(RUSAGE_CHILDREN)`` before and after, and the median over ``--repeats`` runs
is reported (the cases take turns, round by round, so that a busy spell of the machine spreads
over all of them). CPU time rather than wall time: on a loaded machine the wall time grows with
the load, the CPU time much less.

Targets: ``memfit --version``, ``memfit --help``, a mistyped command (``memfit profle``), a mistyped
option of a command (``memfit plan --modle demo``), a command's ``--help`` and an option given without
what it needs under 1 s of CPU each; they import no torch (tests/test_startup.py checks that on
``sys.modules``): a command's options are defined in :mod:`memfit.cli.args`, without torch. The
other rows are for reference: ``import memfit`` imports no torch until a name is used, and
``import torch`` is the floor of any command that runs.

Run: ``python benchmarks/startup.py [--repeats 5]``. Writes ``benchmarks/results/startup.json``
and prints a table; exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "startup.json"
TARGET_CPU_S = 1.0


def memfit_command() -> list[str]:
    """The console script beside this Python (what a user runs), else ``python -m memfit.cli.main``."""
    script = Path(sys.executable).parent / "memfit"
    if script.exists():
        return [str(script)]
    found = shutil.which("memfit")
    return [found] if found else [sys.executable, "-m", "memfit.cli.main"]


def cases() -> list[tuple[str, list[str], float | None]]:
    """(name, command line, CPU target in seconds or None for a reference row)."""
    memfit, py = memfit_command(), [sys.executable, "-c"]
    return [
        ("memfit --version", [*memfit, "--version"], TARGET_CPU_S),
        ("memfit --help", [*memfit, "--help"], TARGET_CPU_S),
        ("memfit profle (mistyped command)", [*memfit, "profle"], TARGET_CPU_S),
        ("memfit plan --modle demo (mistyped option)", [*memfit, "plan", "--modle", "demo"], TARGET_CPU_S),
        ("memfit plan --help", [*memfit, "plan", "--help"], TARGET_CPU_S),
        ("memfit fit --help", [*memfit, "fit", "--help"], TARGET_CPU_S),
        ("memfit verify --bn freeze (option without its context)", [*memfit, "verify", "--bn", "freeze"], TARGET_CPU_S),
        ("import memfit", [*py, "import memfit"], None),
        (
            "import memfit, every public name",
            [*py, "import memfit; [getattr(memfit, n) for n in memfit.__all__]"],
            None,
        ),
        ("import torch", [*py, "import torch"], None),
    ]


def run_once(argv: list[str]) -> tuple[float, float, int]:
    """CPU seconds (user + system) and wall seconds of one run of ``argv``, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, cwd=ROOT, check=False)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu_s, wall_s, proc.returncode


def measure(repeats: int) -> list[dict[str, Any]]:
    """Every case ``repeats`` times, in rounds; one row per case with its medians."""
    todo = cases()
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _, _ in todo}
    for _ in range(repeats):
        for name, argv, _ in todo:
            runs[name].append(run_once(argv))
    rows = []
    for name, argv, target in todo:
        cpu = [r[0] for r in runs[name]]
        rows.append(
            {
                "case": name,
                "argv": argv,
                "cpu_s_median": round(statistics.median(cpu), 3),
                "cpu_s_runs": [round(c, 3) for c in cpu],
                "wall_s_median": round(statistics.median(r[1] for r in runs[name]), 3),
                "exit_codes": sorted({r[2] for r in runs[name]}),
                "target_cpu_s": target,
                "ok": None if target is None else statistics.median(cpu) < target,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each case (the median is reported)")
    args = parser.parse_args()
    rows = measure(args.repeats)
    result = {
        "benchmark": "startup",
        "model": "memfit-cli",
        "command": f"python benchmarks/startup.py --repeats {args.repeats}",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)",
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "load_average_1min_after": round(os.getloadavg()[0], 2),
        "repeats": args.repeats,
        "target_cpu_s": TARGET_CPU_S,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'case':48} {'CPU s (median)':>14} {'wall s':>8}  target")
    for r in rows:
        verdict = "" if r["target_cpu_s"] is None else f"< {r['target_cpu_s']:g} s {'ok' if r['ok'] else 'MISSED'}"
        print(f"{r['case']:48} {r['cpu_s_median']:14.2f} {r['wall_s_median']:8.2f}  {verdict}")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
