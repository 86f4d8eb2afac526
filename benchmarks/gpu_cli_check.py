"""The command line on CUDA, end to end: every measuring command with ``--device cuda``.

Run by benchmarks/gpu_check.sh on a lent GPU; ``--dry-run`` runs the same commands on the CPU at tiny
shapes (``--device cpu``, ``--measure-choice`` given where CUDA turns it on by default), so that the
script itself is tested where there is no GPU. For each command it records the exit code, the wall
time and the JSON keys that say what ran where, and checks:

- every command ran on the device asked for (``device`` in its JSON) and exited 0;
- ``plan --measure``: the measured peak within the budget; on CUDA the budget means reserved memory,
  and the plan's predicted reserved bytes are recorded;
- ``plan`` and ``fit`` without ``--measure-choice``: on CUDA the measured choice ran by default (it
  lists its candidates; the chosen is the least ``vs_solver`` among those within the budget);
- ``verify``: gradients equal to the unmodified model's; ``explain`` and ``profile`` ran;
- ``train --device cuda --budget``: the steps ran and the loss is finite;
- ``plan --estimate --device h100-sxm``: the old spelling still names the estimate target, with a warning.

    python benchmarks/gpu_cli_check.py --out gpu_cli_check.json [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from memfit.capture.step import StepSpec
from memfit.cli.main import main as memfit_main
from memfit.fitting.budget import plan_for_budget
from memfit.models.registry import load_workload

MODEL = "demo?n_layer=6&n_embd=256&n_head=4"
TINY = "demo?n_layer=3&n_embd=32&n_head=2"


def run_cli(argv: list[str]) -> dict[str, Any]:
    """``memfit ARGV --json`` in this process: exit code, wall seconds, the JSON (or the error)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = memfit_main([*argv, "--json"])
    except BaseException as e:  # a crash is a result too
        code = 99
        err.write(traceback.format_exc() + repr(e))
    wall = time.perf_counter() - t0
    try:
        data = json.loads(out.getvalue())
    except json.JSONDecodeError:
        data = {"unparsed_stdout": out.getvalue()[-2000:]}
    kept = {k: v for k, v in data.items() if k in KEPT or k.startswith("measured_choice")}
    return {"argv": ["memfit", *argv], "rc": code, "wall_s": wall, "json": kept, "stderr_tail": err.getvalue()[-1500:]}


KEPT = (
    "ok", "error", "device", "warnings", "within_budget", "budget_bytes", "measured_peak_bytes", "predicted_peak_bytes",
    "baseline_peak_bytes", "measured_step_s", "predicted_step_s", "budget_means", "predicted_reserved_bytes",
    "live_target_bytes", "time_model_ratio", "recomputed_blocks", "losses", "micro_batch", "accumulation_steps",
    "peak_bytes", "peak_measured_by", "max_grad_rel_err", "estimated",
)  # fmt: skip
"""The JSON keys a run keeps (the rest, such as per-block tables, stays out of the file)."""


def budget_between(model: str, seq_len: int, batch_size: int, device: str) -> tuple[int, int, int]:
    """Least budget, no-checkpointing peak and their midpoint for the model at this batch."""
    wl = load_workload(model, seq_len=seq_len, device=device)
    first = plan_for_budget(wl, 1 << 50, step=StepSpec(batch_size=batch_size, repeats=1))
    low, high = first.min_budget_bytes, first.stats.peak_bytes
    return low, high, (low + high) // 2


def choice_ok(d: dict[str, Any]) -> bool | None:
    """The chosen candidate is the least ``vs_solver`` among those within the budget (None: no choice ran)."""
    timed = d.get("measured_choice")
    if not timed:
        return None
    fits = [c for c in timed if c["fits_budget"]]
    return not fits or d["measured_choice_chosen"] == min(fits, key=lambda c: c["vs_solver"])["label"]


def commands(device: str, model: str, seq_len: int, budget: int, dry: bool) -> dict[str, list[str]]:
    """The commands, by name. On CUDA the measured choice is left to its default (on)."""
    m = ["--model", model, "--seq-len", str(seq_len), "--device", device]
    choice = ["--measure-choice", "--choice-rounds", "2"] if dry else []
    return {
        "profile": ["profile", *m, "--batch-size", "4", "--repeats", "2"],
        "plan": ["plan", *m, "--batch-size", "4", "--budget", str(budget), "--measure", "--repeats", "2", *choice],
        "fit": ["fit", *m, "--global-batch", "8", "--max-micro-batch", "4", "--budget", str(budget), "--repeats", "1", *choice],
        "verify": ["verify", *m, "--batch-size", "4", "--budget", str(budget)],
        "explain": ["explain", *m, "--batch-size", "4", "--policy", "all"],
        "train": ["train", "--model", model, "--seq-len", str(seq_len), "--device", device, "--budget", str(budget),
                  "--global-batch", "8", "--steps", "3"],
        "estimate_old_spelling": ["plan", "--model", model, "--budget", "2GiB", "--estimate", "--device", "h100-sxm"],
    }  # fmt: skip


def check(name: str, r: dict[str, Any], device: str, budget: int) -> list[str]:
    """What is wrong with one command's result (empty: it passed)."""
    d, bad = r["json"], []
    if r["rc"] != 0:
        bad.append(f"exit {r['rc']}: {d.get('error') or r['stderr_tail'][-300:]}")
    if name == "estimate_old_spelling":
        if "--target h100-sxm" not in " ".join(d.get("warnings", [])):
            bad.append("no deprecation warning for --device h100-sxm")
        return bad
    if name != "train" and d.get("device") != str(torch.device(device)):
        bad.append(f"ran on {d.get('device')!r}, asked {device!r}")
    if name == "plan" and d.get("within_budget") is False:
        bad.append(f"measured peak {d.get('measured_peak_bytes')} over the budget {budget}")
    if name in ("plan", "fit") and choice_ok(d) is False:
        bad.append("the chosen candidate is not the fastest measured within the budget")
    if name in ("plan", "fit") and choice_ok(d) is None and device.startswith("cuda"):
        bad.append("no measured choice on CUDA (it is on by default there)")
    if name == "verify" and not d.get("ok"):
        bad.append("verify failed")
    if name == "train" and not all(math.isfinite(x) for x in d.get("losses", [0.0]) if x is not None):
        bad.append("a non-finite loss")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="the same commands on the CPU at tiny shapes")
    ap.add_argument("--model", default=None, help=f"default: {MODEL} (dry run: {TINY})")
    ap.add_argument("--seq-len", type=int, default=None, help="default 256 (dry run: 16)")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_cli_check: no CUDA device (use --dry-run on the CPU)")
    model = args.model or (TINY if args.dry_run else MODEL)
    seq_len = args.seq_len or (16 if args.dry_run else 256)
    low, high, budget = budget_between(model, seq_len, 4, device)
    report: dict[str, Any] = {
        "benchmark": "gpu_cli_check",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "python": platform.python_version(),
        "command": " ".join(["python", "benchmarks/gpu_cli_check.py", *sys.argv[1:]]),
        "model": model,
        "seq_len": seq_len,
        "min_budget_bytes": low,
        "baseline_peak_bytes": high,
        "budget_bytes": budget,
        "runs": [],
    }
    out, failed = Path(args.out), 0
    for name, argv in commands(device, model, seq_len, budget, args.dry_run).items():
        r = run_cli(argv)
        r["name"], r["problems"] = name, check(name, r, device, budget)
        failed += bool(r["problems"])
        report["runs"].append(r)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"{name:22s} rc {r['rc']:3d} {r['wall_s']:7.1f} s  {'; '.join(r['problems']) or 'ok'}", flush=True)
    report["ok"] = failed == 0
    out.write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
