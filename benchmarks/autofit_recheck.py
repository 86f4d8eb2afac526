"""Re-check one auto-fit benchmark row side by side: `memfit fit` now vs the row's best grid point.

    .venv/bin/python benchmarks/autofit_recheck.py

Runs the fit for hf:gpt2 at global batch 32 and the smallest budget of benchmarks/results/autofit.json,
then the fit's choice and micro-batch 4 without checkpointing, interleaved twice (samples/s, fits).
"""
import json
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import torch
from autofit import run_window

from memfit.autofit import autofit
from memfit.capture.profile import MODES
from memfit.plan import policy_plan
from memfit.workload import load_workload

d = json.load(open("benchmarks/results/autofit.json"))
run = next(r for r in d["runs"] if r["model"] == "hf:gpt2" and r["global_batch"] == 32)
budget = run["budgets"][0]["budget_bytes"]
wl = load_workload("hf:gpt2")
torch.manual_seed(0)
batch = wl.make_batch(32)
t0 = time.time()
fit = autofit(wl, budget, 32, repeats=2, modes=MODES)
print("fit", fit.micro_batch, fit.accumulation_steps, len(fit.plan.recomputed), fit.plan.head, round(fit.predicted_samples_per_s, 2), round(time.time() - t0), "s")
for _ in range(2):
    p1, w1 = run_window(wl, fit.plan.with_(fingerprint={}), fit.micro_batch, batch, 3)
    p2, w2 = run_window(wl, policy_plan(wl.model, "none"), 4, batch, 3)
    print("fit", round(32 / w1, 2), p1 <= budget, " grid 4/none", round(32 / w2, 2), p2 <= budget)
