"""Choosing by measurement against the fixed policies, at three budgets.

For each budget (evenly spaced between the least any plan needs and the no-checkpointing peak):
solve, then :func:`memfit.fitting.choice.choose_by_measurement` times the solver's plan, its
next-best plans and the fixed policies predicted to fit (``none``, two ``every:k``, ``sqrt``,
``all``) in interleaved rounds and keeps the fastest measured. The target: the chosen plan is
never slower than the fastest fixed policy within the budget. The choice's own rounds decide the
choice, so they cannot test it; a second, independent set of paired rounds (``--confirm-rounds``)
then times the chosen plan against the fastest fixed policy of the first rounds, and that ratio is
what the report's verdict reads. Each candidate's measured over predicted step time (the time
model's error) is recorded too.

    .venv/bin/python benchmarks/measured_choice.py [--model hf:gpt2] [--seq-len 512] [--batch-size 1]
        [--budgets 3] [--rounds 3] [--confirm-rounds 3] [--device cpu] [--dtype float32]
        [--out benchmarks/results/measured_choice.json]

On CUDA (``--device cuda``, run by benchmarks/gpu_check.sh on the real shapes) the peaks are the
allocator's and the budgets are still compared with them (reserved memory is allocator_check's).

Writes the JSON after each budget (a run stopped part way keeps what ran); ``make_reports.py``
turns it into benchmarks/reports/measured_choice_*.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from memfit.capture.step import StepSpec
from memfit.fitting.budget import plan_for_budget, plan_for_policy
from memfit.fitting.choice import choose_by_measurement
from memfit.models.registry import load_workload
from memfit.plan.policies import KeepAll
from memfit.profiling.side_by_side import measure_setups, paired_ratio, plan_setup

HERE = Path(__file__).parent


def budgets_between(low: int, high: int, n: int) -> list[int]:
    """``n`` budgets evenly spaced strictly inside ``[low, high]``."""
    return [round(low + (high - low) * (i + 1) / (n + 1)) for i in range(n)]


def confirm(wl: Any, chosen: Any, rival: Any, *, batch_size: int, rounds: int, seed: int) -> dict[str, Any]:
    """Chosen against ``rival`` in fresh paired rounds: the median ratio of the chosen's time over the rival's."""
    rows = measure_setups(
        wl,
        {"chosen": plan_setup(chosen.plan), rival.label: plan_setup(rival.plan)},
        batch_size=batch_size,
        repeats=rounds,
        seed=seed,
    )
    return {
        "rival": rival.label,
        "chosen_step_s": rows[0].step_s,
        "rival_step_s": rows[1].step_s,
        "chosen_over_rival": paired_ratio(list(rows[0].step_s_samples), list(rows[1].step_s_samples)),
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf:gpt2")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--budgets", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--confirm-rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--dtype", default=None, help="build the model in this dtype, e.g. bfloat16 (default: float32)")
    ap.add_argument("--out", default=str(HERE / "results" / "measured_choice.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    wl = load_workload(args.model, seq_len=args.seq_len, seed=args.seed, dtype=dtype, device=args.device)
    step = StepSpec(batch_size=args.batch_size, seed=args.seed, repeats=args.rounds)
    first = plan_for_budget(wl, 1 << 50, step=step)  # the profile every budget is solved on
    policy_stats = plan_for_policy(wl, KeepAll(), step=step).stats  # the model's own activations
    budgets = budgets_between(first.min_budget_bytes, first.stats.peak_bytes, args.budgets)
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/measured_choice.py "
        + f"--model {args.model} --seq-len {args.seq_len} --batch-size {args.batch_size} --budgets {args.budgets} "
        + f"--rounds {args.rounds} --confirm-rounds {args.confirm_rounds}"
        + (f" --device {args.device}" if args.device != "cpu" else "")
        + (f" --dtype {args.dtype}" if args.dtype else ""),
        "model": args.model,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU"
        if args.device == "cpu"
        else torch.cuda.get_device_name(torch.device(args.device)),
        "device": args.device,
        "dtype": args.dtype or "float32",
        "torch": torch.__version__,
        "min_budget_bytes": first.min_budget_bytes,
        "baseline_peak_bytes": first.stats.peak_bytes,
        "profile_s": time.perf_counter() - t0,
        "budgets": [],
    }
    for budget in budgets:
        t = time.perf_counter()
        res = plan_for_budget(wl, budget, step=step, stats=first.stats)
        ch = choose_by_measurement(
            wl, res.plan, res.stats, budget, step=step, rounds=args.rounds, policy_stats=policy_stats,
            progress=lambda s, b=budget: print(f"[{b / 2**20:.0f} MiB] {s}", flush=True),
        )  # fmt: skip
        row: dict[str, Any] = {"budget_bytes": budget, **ch.to_dict()}
        policies = [c for c in ch.candidates if c.kind == "policy" and c.fits_budget]
        chosen = next(c for c in ch.candidates if c.label == ch.chosen)
        if policies:
            rival = min(policies, key=lambda c: c.vs_solver)
            row["fastest_policy"] = rival.label
            if rival is not chosen and args.confirm_rounds > 0:
                row["confirm"] = confirm(
                    wl, chosen, rival, batch_size=args.batch_size, rounds=args.confirm_rounds, seed=args.seed
                )
        row["wall_s"] = time.perf_counter() - t
        out["budgets"].append(row)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "measured_choice"}, indent=1), flush=True)
    out["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
