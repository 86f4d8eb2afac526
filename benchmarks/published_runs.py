"""memfit's predictions beside published multi-GPU training runs, with their full configurations.

For each published run memfit estimates rank 0 from fake-tensor steps (nothing of the model's size
is allocated): the per-rank live-tensor peak (NOTE [ Per-rank accounting ] in
memfit.plan.parallel), the CUDA caching allocator's reserved memory (NOTE [ A rank's reserved
memory ] in memfit.estimation.allocator: the rank's peak, a one-process replay's cached bytes and
FSDP2's all-gather stream pool), and tokens per second per GPU from the roofline and the simulated
collectives (memfit.plan.comm).

The time model's utilisation (mfu) is calibrated per device class on one published run and checked
on the others of that class: the H100 class on torchtitan's 8-GPU Llama 3.1 8B run (checked on the
128-GPU run), the A100 class on torchtitan's 64-GPU Llama 3 8B selective-op run (checked on the
other 64-GPU rows). Runs with what memfit does not model (torch.compile, Float8, tensor, pipeline or
context parallelism) are listed with the reason and not predicted.

    python benchmarks/published_runs.py [--quick]   # --quick: the H100 rows only

Writes benchmarks/results/published_runs.json (make_reports.py turns it into a report).
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

from memfit import StepSpec
from memfit.estimation import estimate
from memfit.estimation.allocator import AllocatorPrediction, collective_pool_bytes, rank_allocator_model
from memfit.estimation.devices import DEFAULT_MFU, get_device, interconnect
from memfit.estimation.stats import estimate_stats, load_fake_workload
from memfit.plan.comm import step_comm_time
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.parallel import Parallel, ParallelKind, rank_param_table, rank_stats
from memfit.plan.policies import parse_policy, policy_plan

GiB = 2**30
OUT = Path(__file__).parent / "results" / "published_runs.json"

TITAN_H100 = {
    "repo": "pytorch/torchtitan",
    "path": "benchmarks/llama3_h100_202412_torchtitan.md",
    "commit": "31a17bfdb70bab6f62a13d21816a5339b911d6e3",
    "hardware": "8 H100 per host (96 GB HBM2e, 2.4 TB/s, 500 W: between the SXM and NVL peaks, torchtitan's note), "
    "NVLink within a host, 400 Gb/s RDMA per GPU between hosts",
    "software": "torch 1963fc8 (2024-12-23), torchtitan 9dec370 (2024-12-26)",
    "memory": "torch.cuda.max_memory_reserved (torchtitan logs the allocator's reserved peak), GiB",
}
TITAN_A100 = {
    "repo": "pytorch/torchtitan",
    "path": "docs/performance.md",
    "commit": "041336434916bdc0f88c1f89fda176fd3c2092e4",
    "hardware": "64 A100 80GB (8 hosts); the network between hosts is not stated (memfit assumes DGX A100: 200 Gb/s per GPU)",
    "software": "torchtitan of early 2024 (FSDP2), bf16 mixed precision",
    "memory": "not reported",
}

# torchtitan's models (torchtitan/models/llama*/__init__.py): ffn = multiple_of-rounded 8/3 d (x ffn_dim_multiplier)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)  # fmt: skip
LLAMA2_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=40, vocab_size=32000)  # fmt: skip
# Llama 2 70B: ffn_dim_multiplier 1.3, multiple_of 4096 -> 28672; 8 key/value heads
LLAMA2_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000)  # fmt: skip

# memfit's spelling of torchtitan's activation checkpointing: selective op = selective:torchtitan
# (NOTE [ torchtitan's selective policy ]); selective layer with selective_ac_option "2" (its default)
# checkpoints every second block = every:2; full = all.
RUNS: list[dict[str, Any]] = [
    {"id": "h100-8b-fsdp8", "source": TITAN_H100, "table": "Table 1, FSDP row", "role": "calibrates h100",
     "model": "Llama 3.1 8B", "model_slug": "torchtitan-llama3-8b", "config": LLAMA3_8B, "device": "h100-sxm", "world": 8, "batch": 2, "seq": 8192,
     "policy": "selective:torchtitan", "ac": "selective op", "published_gib": 82.4, "published_tps": 5762},
    {"id": "h100-8b-fsdp128", "source": TITAN_H100, "table": "Table 3, FSDP row", "role": "checks h100",
     "model": "Llama 3.1 8B", "model_slug": "torchtitan-llama3-8b", "config": LLAMA3_8B, "device": "h100-sxm", "world": 128, "batch": 2, "seq": 8192,
     "policy": "selective:torchtitan", "ac": "selective op", "published_gib": 67.0, "published_tps": 5605},
    {"id": "a100-8b-op", "source": TITAN_A100, "table": "Llama 3 table, 8B selective op", "role": "calibrates a100",
     "model": "Llama 3 8B", "model_slug": "torchtitan-llama3-8b", "config": LLAMA3_8B, "device": "a100-80gb", "world": 64, "batch": 1, "seq": 8192,
     "policy": "selective:torchtitan", "ac": "selective op", "published_tps": 2973, "published_mfu": 0.582},
    {"id": "a100-8b-layer", "source": TITAN_A100, "table": "Llama 3 table, 8B selective layer", "role": "checks a100",
     "model": "Llama 3 8B", "model_slug": "torchtitan-llama3-8b", "config": LLAMA3_8B, "device": "a100-80gb", "world": 64, "batch": 1, "seq": 8192,
     "policy": "every:2", "ac": "selective layer (every 2nd block)", "published_tps": 2904, "published_mfu": 0.568},
    {"id": "a100-13b-none", "source": TITAN_A100, "table": "Llama 2 table, 13B no AC", "role": "checks a100",
     "model": "Llama 2 13B", "model_slug": "torchtitan-llama2-13b", "config": LLAMA2_13B, "device": "a100-80gb", "world": 64, "batch": 2, "seq": 4096,
     "policy": "none", "ac": "none", "published_tps": 2162, "published_mfu": 0.611},
    {"id": "a100-13b-layer", "source": TITAN_A100, "table": "Llama 2 table, 13B selective layer", "role": "checks a100",
     "model": "Llama 2 13B", "model_slug": "torchtitan-llama2-13b", "config": LLAMA2_13B, "device": "a100-80gb", "world": 64, "batch": 2, "seq": 4096,
     "policy": "every:2", "ac": "selective layer (every 2nd block)", "published_tps": 1914, "published_mfu": 0.541},
    {"id": "a100-13b-op", "source": TITAN_A100, "table": "Llama 2 table, 13B selective op", "role": "checks a100",
     "model": "Llama 2 13B", "model_slug": "torchtitan-llama2-13b", "config": LLAMA2_13B, "device": "a100-80gb", "world": 64, "batch": 2, "seq": 4096,
     "policy": "selective:torchtitan", "ac": "selective op", "published_tps": 1904, "published_mfu": 0.538},
    {"id": "a100-70b-op", "source": TITAN_A100, "table": "Llama 2 table, 70B selective op", "role": "checks a100",
     "model": "Llama 2 70B", "model_slug": "torchtitan-llama2-70b", "config": LLAMA2_70B, "device": "a100-80gb", "world": 64, "batch": 1, "seq": 4096,
     "policy": "selective:torchtitan", "ac": "selective op", "published_tps": 355, "published_mfu": 0.508,
     "trained_in_gib": 80},
]  # fmt: skip
"""A row with ``trained_in_gib`` reports no memory, but it trained on cards of that size: its predicted reserved
memory must fit them (the 70B selective-op run is the one at local batch 1; batch 2 ran out of memory, torchtitan's
footnote)."""

NOT_MODELLED = [
    ("h100", "Table 1: FSDP + torch.compile (6,667 TPS, 77.0 GiB) and + Float8 (8,532, 76.8)", "torch.compile, Float8"),
    ("h100", "Table 2: FSDP + CP + torch.compile + Float8, 8B, seq 32k-262k (83.9-84.5 GiB)", "context parallelism, torch.compile, Float8"),
    ("h100", "Table 3: 128 GPUs with torch.compile (6,514, 62.0) and + Float8 (8,380, 61.8)", "torch.compile, Float8"),
    ("h100", "Table 4: Llama 3.1 70B, FSDP 32 x TP 8, torch.compile + Float8 (829-876 TPS, 67.6-71.9 GiB)", "tensor parallelism, Float8"),
    ("h100", "Tables 5-6: Llama 3.1 405B, FSDP x TP x PP (x CP), Float8 (16-128 TPS, 72.7-84.9 GiB)", "pipeline, tensor and context parallelism, Float8"),
    ("a100", "Llama 3 70B full AC (331 TPS) and Llama 2 70B full AC at batch 2 (353 TPS), 64 GPUs", "modelled, left out here for time (a 70B fake step takes minutes on this CPU)"),
]  # fmt: skip


def spec_of(config: dict[str, Any], seq: int) -> str:
    return "hf:llama?" + "&".join(f"{k}={v}" for k, v in {**config, "max_position_embeddings": seq}.items())


def estimated(run: dict[str, Any], cache: dict[tuple, Any]) -> Any:
    """One-process estimated stats of a run's model and micro-batch (fp32 parameters, bf16 step as
    torchtitan's MixedPrecisionPolicy runs it), with the options every run of it needs; cached."""
    key = (json.dumps(run["config"], sort_keys=True), run["batch"], run["seq"])
    if key not in cache:
        t0 = time.perf_counter()
        # fp32 parameters, as torchtitan builds them; rows of seq tokens
        wl = load_fake_workload(spec_of(run["config"], run["seq"]), seq_len=run["seq"])
        opts = ("keep", "recompute", "selective:torchtitan")
        st = estimate_stats(wl, device=run["device"], options=opts, activations=False, mfu=DEFAULT_MFU,
                            step=StepSpec(batch_size=run["batch"], dtype=torch.bfloat16))  # fmt: skip
        cache[key] = (wl, st, time.perf_counter() - t0)
        print(
            f"  estimated {run['model']} b{run['batch']} x {run['seq']}: {cache[key][2]:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return cache[key]


def predict_run(run: dict[str, Any], cache: dict[tuple, Any], mfu: float | None) -> dict[str, Any]:
    wl, st, est_s = estimated(run, cache)
    dev = get_device(run["device"])
    par = Parallel(kind=ParallelKind.FSDP2, world_size=run["world"], param_dtype="bfloat16", reduce_dtype="float32")
    rs = rank_stats(st, rank_param_table(wl.model, st, par), par, 0)
    plan = policy_plan(wl.model, parse_policy(run["policy"]))
    pred = predict(ChainCosts.from_stats(rs), plan)
    opt_s = st.calibration.estimated.optimizer_s
    net = interconnect(dev, gpus_per_node=8)
    tokens = run["batch"] * run["seq"]

    def step_at(m: float, comm: bool = True) -> tuple[float, float]:
        """Seconds of the step at utilisation m: compute scaled from the stats' mfu, optimizer kept,
        plus (``comm``) the communication the simulation leaves exposed at that compute."""
        scale = DEFAULT_MFU / m
        exposed = step_comm_time(rs, plan, net, compute_scale=scale).exposed_s if comm else 0.0
        return (pred.step_s - opt_s) * scale + opt_s + exposed, exposed

    out: dict[str, Any] = {
        "spec": spec_of(run["config"], run["seq"]),
        "predicted_peak_bytes": pred.peak_bytes,
        "peak_event": pred.peak_event,
        "flops_per_step": st.calibration.estimated.flops_by_option.get(
            {"none": "keep", "all": "recompute"}.get(run["policy"], run["policy"]), None
        ),
        "estimate_s": est_s,
    }
    if run.get("published_tps"):
        t_pub = tokens / run["published_tps"]
        out["published_step_s"] = t_pub
        for key, comm in (("mfu_matching_published", True), ("mfu_matching_published_compute_only", False)):
            # the mfu with which the predicted step equals the published one (bisection: exposure depends on compute)
            lo, hi = 0.05, 1.0
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if step_at(mid, comm)[0] > t_pub else (lo, mid)
            out[key] = (lo + hi) / 2 if hi < 1.0 else None  # None: even at mfu 1 the step is longer
    for name, m in (("at_mfu_0.4", DEFAULT_MFU), ("at_calibrated_mfu", mfu)):
        if m is None:
            continue
        step_s, exposed = step_at(m)
        out[name] = {"mfu": m, "step_s": step_s, "exposed_comm_s": exposed, "tokens_per_s_per_gpu": tokens / step_s,
                     "tokens_per_s_per_gpu_compute_only": tokens / step_at(m, False)[0]}  # fmt: skip
    return out


def reserved_run(run: dict[str, Any], cache: dict[tuple, Any], peak_bytes: int) -> dict[str, Any]:
    """The allocator model for the rank: the one-process fake step of the plan with the model states at a
    rank's shard, replayed."""
    wl, st, _ = estimated(run, cache)
    key = ("alloc", run["policy"], run["batch"], run["seq"], json.dumps(run["config"], sort_keys=True))
    if key not in cache:
        plan = policy_plan(wl.model, parse_policy(run["policy"]))
        # the rank's own model states: FSDP2 shards them over the world (NOTE [ A rank's reserved memory ])
        one = estimate(
            wl, plan=plan, device=run["device"], step=StepSpec(batch_size=run["batch"], dtype=torch.bfloat16),
            states_shards=run["world"],
        )  # fmt: skip
        cache[key] = one
    one = cache[key]
    dev = get_device(run["device"])
    par = Parallel(kind=ParallelKind.FSDP2, world_size=run["world"], param_dtype="bfloat16", reduce_dtype="float32")
    rs = rank_stats(st, rank_param_table(wl.model, st, par), par, 0)
    single = AllocatorPrediction(
        tensor_peak_bytes=one.peak_bytes, workspace_bytes=0, method="replay",
        predicted_allocated_bytes=one.predicted_allocated_bytes, predicted_reserved_bytes=one.predicted_reserved_bytes,
    )  # fmt: skip
    mem = rs.calibration.parallel.memory
    pools = collective_pool_bytes("fsdp2", list(mem["unit_unsharded_bytes"]), int(mem["grads_bytes"]))
    alloc = rank_allocator_model(peak_bytes, dev, single=single, collective_pool_bytes=pools)
    return {
        "predicted_allocated_bytes": alloc.predicted_allocated_bytes,
        "predicted_reserved_bytes": alloc.predicted_reserved_bytes,
        "parts": {
            "rank_peak_bytes": peak_bytes,
            "cublas_workspaces_bytes": alloc.workspace_bytes,
            "one_process_cached_bytes": one.predicted_reserved_bytes - one.predicted_allocated_bytes,
            "collective_stream_pools_bytes": pools,
        },
        "one_process": {
            k: getattr(one, k) for k in ("peak_bytes", "predicted_allocated_bytes", "predicted_reserved_bytes")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the H100 rows only")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    t_start = time.perf_counter()
    runs = [r for r in RUNS if not args.quick or r["device"] == "h100-sxm"]
    cache: dict[tuple, Any] = {}
    calibrated: dict[str, dict[str, Any]] = {}
    rows = []
    for run in runs:  # calibrating runs come first in RUNS
        cls = run["device"].split("-")[0]
        print(f"{run['id']} ...", file=sys.stderr, flush=True)
        cal = calibrated.get(cls)
        res = predict_run(run, cache, cal["mfu"] if cal else None)
        if run["role"].startswith("calibrates"):
            # with the modelled communication; where the modelled network leaves no room for any mfu
            # (it is slower than the run's), on compute alone, and the JSON says so
            if res["mfu_matching_published"] is not None:
                calibrated[cls] = {
                    "mfu": res["mfu_matching_published"],
                    "run": run["id"],
                    "on": "compute + exposed communication",
                }
            else:
                calibrated[cls] = {"mfu": res["mfu_matching_published_compute_only"], "run": run["id"],
                                   "on": "compute only: with memfit's assumed network the communication alone is longer than the published step"}  # fmt: skip
            res = predict_run(run, cache, calibrated[cls]["mfu"])
        row = {k: v for k, v in run.items() if k not in ("source", "config")} | {
            "source": {k: run["source"][k] for k in ("repo", "path", "commit")},
            "config": run["config"],
            "prediction": res,
        }
        if run.get("published_gib"):
            row["prediction"]["allocator"] = reserved_run(run, cache, res["predicted_peak_bytes"])
            pub = run["published_gib"] * GiB
            row["reserved_error"] = row["prediction"]["allocator"]["predicted_reserved_bytes"] / pub - 1
            row["peak_error"] = res["predicted_peak_bytes"] / pub - 1
        elif run.get("trained_in_gib"):
            row["prediction"]["allocator"] = reserved_run(run, cache, res["predicted_peak_bytes"])
            row["fits_where_it_trained"] = (
                row["prediction"]["allocator"]["predicted_reserved_bytes"] <= run["trained_in_gib"] * GiB
            )
        if "at_calibrated_mfu" in res:
            row["tps_error"] = res["at_calibrated_mfu"]["tokens_per_s_per_gpu"] / run["published_tps"] - 1
            row["tps_error_compute_only"] = (
                res["at_calibrated_mfu"]["tokens_per_s_per_gpu_compute_only"] / run["published_tps"] - 1
            )
        row["tps_error_at_mfu_0.4"] = res["at_mfu_0.4"]["tokens_per_s_per_gpu"] / run["published_tps"] - 1
        rows.append(row)
        args.out.write_text(json.dumps(_report(rows, calibrated, t_start), indent=1) + "\n")
    args.out.write_text(json.dumps(_report(rows, calibrated, t_start), indent=1) + "\n")
    for r in rows:
        p = r["prediction"]
        mem = ""
        if "reserved_error" in r:
            mem = f"reserved {p['allocator']['predicted_reserved_bytes'] / GiB:.1f} GiB vs {r['published_gib']} ({r['reserved_error']:+.1%})"
        elif "allocator" in p:
            mem = (
                f"reserved {p['allocator']['predicted_reserved_bytes'] / GiB:.1f} GiB, trained in {r['trained_in_gib']}"
            )
        tps = p.get("at_calibrated_mfu", {}).get("tokens_per_s_per_gpu")
        print(
            f"{r['id']:18s} {mem:38s} tps {tps or 0:,.0f} vs {r['published_tps']:,} ({r.get('tps_error', 0):+.1%}; at 0.4 {r['tps_error_at_mfu_0.4']:+.1%})"
        )


def _report(rows: list[dict[str, Any]], calibrated: dict[str, Any], t_start: float) -> dict[str, Any]:
    return {
        "benchmark": "published_runs",
        "date": datetime.date.today().isoformat(),
        "models": " ".join(dict.fromkeys(r["model_slug"] for r in RUNS if r["id"] in {x["id"] for x in rows})),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": "this CPU (fake-tensor estimates: nothing of the models' size allocated)",
        "command": " ".join(["python", *sys.argv]),
        "calibrated_mfu": calibrated,
        "sources": {"torchtitan_h100": TITAN_H100, "torchtitan_a100": TITAN_A100},
        "runs": rows,
        "not_modelled": [{"device": d, "run": r, "why": w} for d, r, w in NOT_MODELLED],
        "seconds": time.perf_counter() - t_start,
    }


if __name__ == "__main__":
    main()
