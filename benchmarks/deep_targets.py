"""The 24-layer targets: memfit's minimum feasible peak against policy `all`, and where it crosses.

For each model and batch size: profile once (as ``memfit plan --budget`` does: keep/recompute per
block, segments, the chunked head, fused activations), take memfit's minimum feasible budget,
plan for it and for the measured peak of `all` (every block recomputed, HF gradient
checkpointing's layout, the model as it is), then measure no checkpointing, `all` and both memfit
plans side by side in one process (times: medians of interleaved rounds, as ratios to `all` in
the same rounds). The same numbers come from the CLI, one profile per command:

    memfit plan --model M --batch-size B --policy all --measure --json
    memfit plan --model M --batch-size B --budget <memfit's minimum> --measure --json

Models: ``hf:gpt2?n_layer=24`` and ``hf:llama?num_hidden_layers=24`` at memfit's registry widths
(hidden 256, 4 heads, intermediate 1024, vocabulary 8192, 256 tokens per row, AdamW, float32).
Where `all`'s peak is set by parameters, gradients and AdamW state (the backward of the first
block, the embeddings' backward or the optimizer step), no plan of the activations goes below it:
memfit's minimum equals `all`'s there. The activations grow with batch x tokens, the fixed part
does not, so past a batch size the loss-time event (every block's input plus the head) sets
`all`'s peak. In the runs of 2026-12-01 memfit's chunked head (and on GPT-2 its fused GELU) took
that event down to the fixed floor; the minimum plans needed no segments (they pay only once the
saved block inputs outweigh the parameters: about 9k tokens per micro-batch at width 256).

    OMP_NUM_THREADS=1 python benchmarks/deep_targets.py [--models ...] [--batch-sizes 4 8] [--repeats 3]

``min_budget_flat_search_bytes`` is the minimum the search of chains over 16 blocks found before
this session (segments of at most 8 blocks, not nested), from the same profile.

Writes benchmarks/results/deep_targets.json (one run per (model, batch) row, appended as it goes).
The machine is shared: times are noisy; peaks are exact (the live-tensor tracker).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from solver_timing import flat_search  # benchmarks/, the script's directory

from memfit import StepSpec
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.types import PlanResult
from memfit.models.registry import load_workload
from memfit.plan import KeepAll, Plan, RecomputeAll, policy_plan
from memfit.plan.costmodel import predict
from memfit.plan.solve import min_budget
from memfit.profiling.side_by_side import measure_setups, plan_setup

RESULTS = Path(__file__).resolve().parent / "results" / "deep_targets.json"
MODELS = ("hf:gpt2?n_layer=24", "hf:llama?num_hidden_layers=24")
NO_LIMIT_BYTES = 1 << 50


def describe(res: PlanResult) -> dict[str, Any]:
    plan = res.plan
    return {
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "peak_event": plan.peak_event,
        "recomputed_blocks": sum(b.option.value == "recompute" for b in plan.blocks),
        "segments": [(s.start, s.stop) for s in plan.segments],
        "head": plan.head,
        "activations": plan.activations,
        "search": plan.search,
    }


def run_one(spec: str, batch_size: int, seq_len: int | None, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    wl = load_workload(spec, seq_len=seq_len)
    base = plan_for_budget(wl, NO_LIMIT_BYTES, step=StepSpec(batch_size=batch_size, repeats=repeats))
    need = base.min_budget_bytes
    with flat_search():  # the search chains over 16 blocks had before: non-nested segments <= 8 blocks
        flat_need, flat_sol = min_budget(base.costs)
    at_min = plan_for_budget(wl, need, stats=base.stats, step=StepSpec(batch_size=batch_size))
    all_plan = policy_plan(wl.model, RecomputeAll())
    first = measure_setups(wl, {"all": plan_setup(all_plan)}, batch_size=batch_size, repeats=1)
    all_peak = first[0].peak_bytes
    # `all`'s peak as the budget; where the 2 % margin puts it below memfit's minimum, the minimum.
    at_all = plan_for_budget(wl, max(all_peak, need), stats=base.stats, step=StepSpec(batch_size=batch_size))
    setups: dict[str, Plan] = {
        "none": policy_plan(wl.model, KeepAll()),
        "all": all_plan,
        "memfit@min": at_min.plan,
        "memfit@all_peak": at_all.plan,
    }
    rows = measure_setups(wl, {k: plan_setup(p) for k, p in setups.items()}, batch_size=batch_size, repeats=repeats)
    by = {r.name: r for r in rows}
    # `all` through the cost model of the profile above (with memfit's fused activations where the
    # model has python-written ones): where its peak would be if only the activations were fused.
    all_pred = predict(base.costs, all_plan.with_(activations=base.costs.activations))
    measured = {
        name: {
            "peak_bytes": r.peak_bytes,
            "step_s": r.step_s,
            "step_s_samples": list(r.step_s_samples),
            "time_vs_all": r.step_s / by["all"].step_s,
        }
        for name, r in by.items()
    }
    return {
        "model": spec,
        "batch_size": base.stats.batch_size,
        "seq_len": seq_len,
        "repeats": repeats,
        "min_budget_bytes": need,
        "min_budget_flat_search_bytes": flat_need,
        "flat_search_min_plan": {
            "segments": list(flat_sol.segments),
            "recomputed_blocks": flat_sol.options.count("recompute"),
            "head": flat_sol.head,
        },
        "all_measured_peak_bytes": all_peak,
        "all_fused_predicted_peak_event": all_pred.peak_event,
        "memfit_min_below_all": by["memfit@min"].peak_bytes < by["all"].peak_bytes,
        "memfit_min_vs_all_peak": by["memfit@min"].peak_bytes / by["all"].peak_bytes,
        "plans": {"memfit@min": describe(at_min), "memfit@all_peak": describe(at_all)},
        "measured": measured,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: the workload's, 256)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds (medians)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/deep_targets.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "note": "shared 2-core CPU: times noisy",
        },
        "rows": [],
    }
    for spec in args.models:
        for b in args.batch_sizes:
            row = run_one(spec, b, args.seq_len, args.repeats)
            result["rows"].append(row)
            m = row["measured"]
            print(
                f"{spec} batch {row['batch_size']}: all {m['all']['peak_bytes'] / 2**20:.1f} MiB, "
                f"memfit min {m['memfit@min']['peak_bytes'] / 2**20:.1f} MiB ({m['memfit@min']['time_vs_all']:.2f}x all's time; "
                f"{row['plans']['memfit@min']['segments']}, head {row['plans']['memfit@min']['head']}), "
                f"memfit at all's peak {m['memfit@all_peak']['peak_bytes'] / 2**20:.1f} MiB ({m['memfit@all_peak']['time_vs_all']:.2f}x)",
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
