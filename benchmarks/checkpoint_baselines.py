"""Checkpointing baselines, measured side by side in one process.

For `demo` and `hf:gpt2` (12 layers, d=256, B=4, T=256): the whole-step peak (live tensor bytes,
forward + backward + AdamW) and the step-time ratio to no checkpointing, for memfit's policies
`none`, `all`, `sqrt`, `every:2` and HF's own `gradient_checkpointing_enable()`.
Times are medians of interleaved rounds; ratios come from the same run.

    .venv/bin/python benchmarks/checkpoint_baselines.py [--repeats 7] [--models demo hf:gpt2]

Writes benchmarks/results/checkpoint_baselines.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from memfit.errors import UnsupportedModelError
from memfit.models.registry import load_workload
from memfit.plan import policy_plan
from memfit.profiling.side_by_side import (
    hf_gradient_checkpointing_setup,
    measure_setups,
    plan_setup,
)
from memfit.units import format_bytes

POLICIES = ["none", "all", "sqrt", "every:2"]
RESULTS = Path(__file__).parent / "results"


def bench_model(spec: str, batch_size: int | None, repeats: int, console: Console) -> dict:
    wl = load_workload(spec)
    setups = {}
    skipped = {}
    for pol in POLICIES:
        try:
            setups[f"memfit {pol}"] = plan_setup(policy_plan(wl.model, pol))
        except UnsupportedModelError as err:
            skipped[f"memfit {pol}"] = str(err).split(". ")[0]
    if hasattr(wl.model, "gradient_checkpointing_enable"):
        setups["HF gradient_checkpointing_enable"] = hf_gradient_checkpointing_setup
    with console.status(f"{spec}") as status:
        rows = measure_setups(
            wl, setups, batch_size=batch_size, repeats=repeats, progress=lambda s: status.update(f"{spec}: {s}")
        )
    return {
        "model": spec,
        "batch_size": batch_size or wl.default_batch_size,
        "num_params": sum(p.numel() for p in wl.model.parameters()),
        "results": [r.to_dict() for r in rows],
        "not_run": skipped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "hf:gpt2"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_baselines.json"))
    args = ap.parse_args()
    console = Console()
    report = {
        "benchmark": "checkpoint_baselines",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "command": f"python benchmarks/checkpoint_baselines.py --repeats {args.repeats}",
        "models": [bench_model(m, None, args.repeats, console) for m in args.models],
    }
    for m in report["models"]:
        t = Table(
            title=f"{m['model']} (batch {m['batch_size']}, {m['num_params'] / 1e6:.1f} M params)", title_justify="left"
        )
        for c in ("setup", "peak", "peak vs none", "step (median)", "time vs none"):
            t.add_column(c, justify="left" if c == "setup" else "right")
        for r in m["results"]:
            t.add_row(
                r["name"],
                format_bytes(r["peak_bytes"]),
                f"{r['peak_ratio']:.2f}",
                f"{r['step_s'] * 1e3:.0f} ms",
                f"{r['time_ratio']:.2f}x",
            )
        for name, why in m["not_run"].items():
            t.add_row(name, "n/a", "", "", why[:60])
        console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
