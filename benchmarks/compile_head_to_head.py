"""Two compiled set-ups head to head: the compiler at two activation_memory_budget fractions, many rounds.

For a frontier budget where memfit's compiled mode and a torch.compile anchor land on different
fractions with step times inside the run's noise (frontier.py, 24-layer GPT-2 at 241 MiB: memfit's
f=0.25 against the anchor's f=0.3), this times the two alone, side by side in one process with
frontier.py's method (each compiled once on its own copy, interleaved rounds, the ratio as the
median over rounds of one's step time over the other's in the same round), with more rounds.

    OMP_NUM_THREADS=2 python benchmarks/compile_head_to_head.py --model "hf:gpt2?n_layer=24&n_embd=64&n_head=2" \
        --fractions 0.25 0.3 --rounds 41

``--first-plan PLAN.json`` applies a memfit plan to the first set-up before compiling it (a plan the
compiled planning mode chose: ``memfit plan --compile model --out PLAN.json``; its fraction is the
first of ``--fractions``), so memfit's compiled choice meets the anchor alone.

Writes benchmarks/results/compile_head_to_head.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from frontier import compiled_setup, measure  # noqa: E402

from memfit.apply.compiled import MemoryBudgetBackend  # noqa: E402
from memfit.models.registry import load_workload  # noqa: E402
from memfit.plan import Plan, policy_plan  # noqa: E402
from memfit.profiling.side_by_side import paired_ratio, plan_setup  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--fractions", type=float, nargs=2, required=True, metavar="F", help="the first is compared against the second"
    )
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--first-plan",
        default=None,
        metavar="PLAN.json",
        help="a memfit plan applied to the first set-up before compiling it",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_head_to_head.json"))
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    wl = load_workload(args.model)
    first_plan = Plan.load(args.first_plan) if args.first_plan else None
    a, b = (f"torch.compile budget={f:g}" for f in args.fractions)
    if first_plan is not None:
        a = f"memfit {first_plan.policy} compiled, budget={args.fractions[0]:g}"
    backends = {a: MemoryBudgetBackend(args.fractions[0]), b: MemoryBudgetBackend(args.fractions[1])}
    plans = {a: first_plan, b: None}
    setups = {
        "none": plan_setup(policy_plan(wl.model, "none")),
        **{n: compiled_setup(plans[n], be) for n, be in backends.items()},
    }
    rows = measure(wl, setups, backends, batch_size=args.batch_size, repeats=args.rounds, progress=lambda s: None)
    per = [x / y for x, y in zip(rows[a]["step_s_samples"], rows[b]["step_s_samples"], strict=True)]
    out = {
        "benchmark": "compile_head_to_head",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": f"python benchmarks/compile_head_to_head.py --model {args.model} --fractions {args.fractions[0]:g} {args.fractions[1]:g} --rounds {args.rounds}"
        + (f" --first-plan {args.first_plan}" if args.first_plan else ""),
        "first_plan": first_plan.to_dict() if first_plan is not None else None,
        "model": args.model,
        "batch_size": args.batch_size,
        "setups": [a, b],
        "rounds": len(per),
        "ratio_median": paired_ratio(rows[a]["step_s_samples"], rows[b]["step_s_samples"]),
        "rounds_first_faster": sum(p < 1 for p in per),
        "per_round": per,
        "rows": {
            n: {
                k: rows[n][k]
                for k in ("profiler_peak_bytes", "time_ratio", "step_s", "compile_s", "digest")
                if k in rows[n]
            }
            for n in (a, b)
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_round"}, indent=2))


if __name__ == "__main__":
    main()
