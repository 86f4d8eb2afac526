"""Model states placed, estimated (fake tensors, nothing allocated): Llama-3.1-8B full fine-tuning with
AdamW in bf16, batch 2 x 2048 tokens, on an RTX 4090 (24 GB) and an H100-80GB.

For each placement of the model states (every state on the device; the optimizer step inside the
backward; optimizer state and step on the host; parameters on the host between uses: NOTE [ Model states
by placement ] in memfit.estimation.states) the least device peak over the checkpoint policies ``none``
and ``all`` (the fake step of every state on the device, the placement's states by arithmetic), the step
time and tokens/s the time model predicts (roofline at the device class's mfu, the host link at the device
table's PCIe rate, torch's CPU AdamW at the rate measured on this 2-core machine), and the host memory
each needs; beside torchtune's published single-RTX-4090 full fine-tune (18.9 GiB, 1,650 tokens/s).

Then the longest sequence on one H100 with parameters, gradients and AdamW's state on the host
(``host-params``): by default (``--part recorded``) from the line through the fake-step estimates that
benchmarks/long_context.py recorded for the same model (:func:`longest_recorded`); ``--part seq`` runs
memfit's own search instead (``fit_seq_len``: tiling, host-held inputs, the chunked head; tens of minutes
of fake steps of the 8B model, which did not finish on the loaded 2-core machine of the recorded run):
the planner holds every model state on the device, so the budget it searches with is the H100's memory
plus the bytes that ``host-params`` takes off the device (parameters and optimizer state less what it
keeps there; gradients as the planner counts them, on the safe side). Both beside ALST's 500K tokens.

    .venv/bin/python benchmarks/model_states_estimate.py [--part table|seq|recorded|both] [--max-tries 5]

Writes benchmarks/results/model_states_estimate.json (the table part and the sequence part merge into it);
``benchmarks/make_reports.py`` turns it into a report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from memfit.capture.chain import discover_chain
from memfit.capture.step import StepSpec
from memfit.estimation import estimate, load_fake_workload, stats_fn
from memfit.estimation.devices import get_device, step_seconds
from memfit.estimation.states import (
    HOST_OPTIMIZER_BYTES_PER_S,
    place,
    placed_peak_bytes,
    placed_step_s,
    state_sizes,
)
from memfit.fitting.seq_len import fit_seq_len
from memfit.optim.states import ModelStates
from memfit.plan.types import BlockDecision, Option, Plan
from memfit.workload import PositionLimit, with_seq_len

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30

# Llama-3.1-8B (as benchmarks/long_context.py spells it), full-length rows of 2048 tokens
LLAMA_31_8B = (
    "hf:llama?num_hidden_layers=32&hidden_size=4096&num_attention_heads=32&num_key_value_heads=8"
    "&intermediate_size=14336&vocab_size=128256&max_position_embeddings=131072&padding=false&seq_len=2048"
)
BATCH, SEQ = 2, 2048

PUBLISHED = {
    "torchtune": {
        "setting": "Llama-3.1-8B full fine-tune, one RTX 4090, batch 2, packed 2048 tokens, torch.compile, the optimizer "
        "step inside the backward, activation checkpointing, 8-bit paged AdamW",
        "peak_gib": 18.9,
        "tokens_per_s": 1650,
        "source": "torchtune's README (its single-device full fine-tune of Llama-3.1-8B on an RTX 4090)",
        "differs": "8-bit paged AdamW keeps 2 bytes of state per parameter and pages it to host memory under pressure; "
        "memfit estimates torch's AdamW in the parameters' bf16 (4 bytes per parameter), which training reproduces "
        "exactly; 8-bit state is not exact",
    },
    "alst": {
        "setting": "Llama-3.1-8B on one H100-80GB: ZeRO-3 offload of model states to the host, tiled MLP and loss, "
        "activation checkpoint offload",
        "seq_len": 500_000,
        "source": "Arctic Long Sequence Training (ALST), arXiv 2506.13996",
    },
}


def _sizes(wl: Any) -> Any:
    return state_sizes(wl.model, optimizer="adamw", blocks=discover_chain(wl.model, wl.blocks).blocks)


def table(say: Any, host_rate: float) -> dict[str, Any]:
    """Per device and placement: the least device peak over the policies and its time. Memory does not
    depend on the GPU (CUDA kernels for both): per policy one fake step with every state on the device and
    one with the step inside the backward (memfit.optim's wrapper); the host placements by arithmetic
    (NOTE [ Model states by placement ]); the time per device from the step's FLOPs (roofline)."""
    wl = load_fake_workload(LLAMA_31_8B, dtype=torch.bfloat16)
    sizes = _sizes(wl)
    traffic = 2 * sizes.params_bytes + sizes.grads_bytes + 2 * sizes.optimizer_bytes  # as the estimate prices it
    devices = ("rtx4090", "h100-sxm")
    out: dict[str, Any] = {"sizes": dataclasses.asdict(sizes), "devices": {d: {"rows": {}} for d in devices}}
    for policy in ("none", "all"):
        steps = {}
        for states in ("device", "step-in-backward"):
            t0 = time.perf_counter()
            steps[states] = estimate(
                LLAMA_31_8B, device="h100-sxm", step=StepSpec(batch_size=BATCH, dtype=torch.bfloat16, optimizer="adamw"),
                policy=policy, states=states,
            )  # fmt: skip
            say(
                f"policy {policy}, {states}: fake step {time.perf_counter() - t0:.0f} s, peak {steps[states].peak_bytes / GIB:.2f} GiB"
            )
        est = steps["device"]
        for device in devices:
            dev = get_device(device)
            t = step_seconds(dev, dtype=torch.bfloat16, flops=est.flops, optimizer_traffic_bytes=traffic)
            out["devices"][device] |= {"memory_bytes": dev.memory_bytes, "host_bytes_per_s": dev.host_bytes_per_s}
            rows = out["devices"][device]["rows"]
            for m in ModelStates:
                p = place(sizes, m)
                peak = placed_peak_bytes(
                    p, sizes, device_peak_bytes=est.peak_bytes, start_bytes=est.breakdown["start_bytes"],
                    activations_bytes=est.activations_bytes,
                )  # fmt: skip
                bound = peak
                if m is ModelStates.STEP_IN_BACKWARD:
                    peak = steps["step-in-backward"].peak_bytes
                step_s = placed_step_s(
                    p, compute_s=t.compute_s, backward_s=t.compute_s * est.breakdown["backward_flops"] / est.flops,
                    device_optimizer_s=t.optimizer_s, host_link_bytes_per_s=dev.host_bytes_per_s,
                    host_optimizer_bytes_per_s=host_rate,
                )  # fmt: skip
                row = {
                    "policy": policy,
                    "device_peak_bytes": peak,
                    "arithmetic_peak_bytes": bound,
                    "peak_from": "fake step"
                    if m in (ModelStates.DEVICE, ModelStates.STEP_IN_BACKWARD)
                    else "arithmetic",
                    "device_states_bytes": p.device_states_bytes,
                    "activations_bytes": est.activations_bytes,
                    "host_bytes": p.host_bytes,
                    "host_link_bytes_per_step": p.link_bytes,
                    "step_s": step_s,
                    "compute_s": t.compute_s,
                    "tokens_per_s": BATCH * SEQ / step_s if step_s else None,
                    "fits": peak <= dev.memory_bytes,
                }
                best = rows.get(m.value)
                if best is None or peak < best["device_peak_bytes"]:
                    rows[m.value] = row
    return out


def longest(say: Any, max_tries: int) -> dict[str, Any]:
    """The longest sequence on one H100 with the model states on the host (``host-params``)."""
    wl = load_fake_workload(LLAMA_31_8B.replace("seq_len=2048", "seq_len=1024"), dtype=torch.bfloat16)
    wl = dataclasses.replace(wl, positions=PositionLimit(max_positions=131072, kind="rope", rope_scaling="llama3 x8"))
    sizes = _sizes(wl)
    memory = get_device("h100-sxm").memory_bytes
    hp = place(sizes, ModelStates.HOST_PARAMS)
    freed = sizes.params_bytes + sizes.optimizer_bytes - hp.device_states_bytes
    budget = memory + freed
    say(f"longest sequence: budget {memory / GIB:.0f} GiB + {freed / GIB:.2f} GiB host-params takes off the device")

    def estimator(w: Any) -> Any:
        return stats_fn(w, device="h100-sxm", step=StepSpec(optimizer="adamw"), host_inputs=True)

    t0 = time.perf_counter()
    try:
        res = fit_seq_len(
            wl, budget, multiple=1024, tolerance=0.05, max_tries=max_tries, estimate=estimator, measure=False,
            max_seq_len=1 << 20, progress=lambda s: say("  " + s),
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001  (recorded, not hidden)
        return {"error": f"{type(err).__name__}: {str(err)[:400]}", "budget_bytes": budget, "freed_bytes": freed}
    return {
        "states": "host-params",
        "seq_len": res.seq_len,
        "over_seq_len": res.upper_seq_len,
        "limited_by": res.limited_by,
        "predicted_peak_bytes": res.fit.predicted_peak_bytes,
        "device_peak_bytes": res.fit.predicted_peak_bytes - freed,
        "budget_bytes": budget,
        "freed_bytes": freed,
        "tries": [t.to_dict() for t in res.tries],
        "search_s": time.perf_counter() - t0,
    }


def longest_searched(say: Any, multiple: int = 8192, start: int = 262144) -> dict[str, Any]:
    """The longest sequence on one H100 with the model states on the host (``host-params``), found by a
    search over fake-step estimates (no line): each probe is one fake step of Llama-3.1-8B at that length
    (batch 1) with the long-context plan memfit's searches chose (every block recomputed, its MLP in 4
    tiles of the sequence, its kept input on the host; the chunked head), its device peak with the states
    placed by arithmetic (NOTE [ Model states by placement ]); doubling or halving from ``start`` until a
    length that fits and one that does not bracket the answer, then bisection to ``multiple`` tokens.
    The term that bounds it: the device peak's growth per token between the last two probes."""
    wl0 = load_fake_workload(LLAMA_31_8B, dtype=torch.bfloat16)
    wl0 = dataclasses.replace(wl0, positions=PositionLimit(max_positions=131072, kind="rope", rope_scaling="llama3 x8"))
    sizes = _sizes(wl0)
    hp = place(sizes, ModelStates.HOST_PARAMS)
    chain = discover_chain(wl0.model, wl0.blocks)
    plan = Plan(
        policy="long-context",
        chain_path=chain.path,
        blocks=tuple(
            BlockDecision(name=n, option=Option.RECOMPUTE, tiles=4, tiled=("mlp",), host_input=True)
            for n in chain.names
        ),
        head="chunked",
    )
    memory = get_device("h100-sxm").memory_bytes
    probes: list[dict[str, Any]] = []

    def probe(seq: int) -> bool:
        t0 = time.perf_counter()
        e = estimate(
            with_seq_len(wl0, seq), device="h100-sxm", plan=plan,
            step=StepSpec(batch_size=1, dtype=torch.bfloat16, optimizer="adamw"),
        )  # fmt: skip
        peak = placed_peak_bytes(
            hp, sizes, device_peak_bytes=e.peak_bytes, start_bytes=e.breakdown["start_bytes"],
            activations_bytes=e.activations_bytes,
        )  # fmt: skip
        fits = peak <= memory
        probes.append(
            {"seq_len": seq, "device_peak_bytes": peak, "activations_bytes": e.activations_bytes,
             "peak_phase": e.breakdown.get("peak_phase"), "fits": fits, "estimate_s": time.perf_counter() - t0}
        )  # fmt: skip
        say(
            f"  {seq:,} tokens: device peak {peak / GIB:.2f} GiB ({'fits' if fits else 'over'}), {time.perf_counter() - t0:.0f} s"
        )
        return fits

    t0 = time.perf_counter()
    lo, hi = None, None
    seq = start
    while lo is None or hi is None:
        if probe(seq):
            lo = seq
            seq *= 2
        else:
            hi = seq
            seq //= 2
        if seq < multiple:
            break
    while lo is not None and hi is not None and hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        if probe(mid):
            lo = mid
        else:
            hi = mid
    near = sorted(probes, key=lambda r: r["seq_len"])
    fit_rows = [r for r in near if r["fits"]]
    over_rows = [r for r in near if not r["fits"]]
    a, b = (fit_rows[-1], over_rows[0]) if fit_rows and over_rows else (near[-2], near[-1])
    per_token = (b["device_peak_bytes"] - a["device_peak_bytes"]) / (b["seq_len"] - a["seq_len"])
    return {
        "states": "host-params",
        "method": "search over fake-step estimates (doubling, then bisection)",
        "plan": "every block recompute:tiles-4:host, head chunked",
        "seq_len": lo,
        "over_seq_len": hi,
        "resolution_tokens": multiple,
        "device_memory_bytes": memory,
        "device_states_bytes": hp.device_states_bytes,
        "host_bytes": hp.host_bytes,
        "per_token_bytes": per_token,
        "fixed_bytes": a["device_peak_bytes"] - per_token * a["seq_len"],
        "probes": probes,
        "search_s": time.perf_counter() - t0,
    }


RECORDED_ROW = "memfit, SGD with momentum, inputs held on the host"
RECORDED_COMMIT = "cf6a13a"  # the long-context estimate the line is drawn through


def longest_recorded(say: Any) -> dict[str, Any]:
    """The longest sequence on one H100 with ``host-params``, from the fake-step estimates
    ``benchmarks/long_context.py`` recorded (its row with SGD and host-held inputs, the one row that fit):
    the line through its last two lengths' needs, with the model states that row held on the device
    (parameters and SGD's state) replaced by what ``host-params`` keeps there. Gradients held at that row's
    peak stay counted (``host-params`` holds fewer): on the safe side. Not a search (a search of 8B lengths
    takes tens of minutes of fake steps), and a line: the planner's per-token bytes change with the plan."""
    lc = json.loads((RESULTS / "long_context.json").read_text()).get("estimate")
    if lc is None:
        raise SystemExit(
            "model_states_estimate: results/long_context.json has no estimate section; take it from the commit the "
            f"recorded run used: git show {RECORDED_COMMIT}:benchmarks/results/long_context.json"
        )
    row = lc["rows"][RECORDED_ROW]
    (t1, n1), (t2, n2) = sorted((t["seq_len"], t["need_bytes"]) for t in row["tries"])[-2:]
    per_token = (n2 - n1) / (t2 - t1)
    wl = load_fake_workload(LLAMA_31_8B, dtype=torch.bfloat16)
    sizes = _sizes(wl)
    hp = place(sizes, ModelStates.HOST_PARAMS)
    sgd_states = row["fixed_bytes"]["params"] + row["fixed_bytes"]["optimizer"]
    fixed = n1 - per_token * t1 - sgd_states + hp.device_states_bytes
    budget = lc["budget_bytes"]
    seq = int((budget - fixed) // per_token) // 1024 * 1024
    say(f"longest (recorded line): {per_token / 1e3:.1f} KB per token, {fixed / GIB:.2f} GiB fixed -> {seq:,} tokens")
    return {
        "states": "host-params",
        "method": "line through recorded fake-step estimates",
        "source_row": RECORDED_ROW,
        "source": f"benchmarks/results/long_context.json at commit {RECORDED_COMMIT}",
        "points": [[t1, n1], [t2, n2]],
        "per_token_bytes": per_token,
        "fixed_bytes": fixed,
        "budget_bytes": budget,
        "seq_len": seq,
        "plan_at_source": row["plan"],
        "limited_by": "the recomputed blocks' working set in the backward (the per-token bytes above: a block's "
        "attention and MLP tensors at full length, tiled MLP, the chunked head's hidden states)",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("table", "seq", "search", "recorded", "both"), default="both")
    ap.add_argument("--max-tries", type=int, default=5)
    ap.add_argument("--host-rate", type=float, default=HOST_OPTIMIZER_BYTES_PER_S, help="host AdamW bytes/s")
    ap.add_argument("--out", default=str(RESULTS / "model_states_estimate.json"))
    args = ap.parse_args()
    path = Path(args.out)
    report = json.loads(path.read_text()) if path.exists() else {}
    report |= {
        "benchmark": "model_states_estimate",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU (estimates: fake tensors)",
        "command": "python benchmarks/model_states_estimate.py",
        "model": "Llama-3.1-8B",
        "spec": LLAMA_31_8B,
        "batch": [BATCH, SEQ],
        "host_optimizer_bytes_per_s": args.host_rate,
        "published": PUBLISHED,
        "torch": torch.__version__,
    }

    def say(text: str) -> None:
        print(text, flush=True)

    if args.part in ("table", "both"):
        report["table"] = table(say, args.host_rate)
        path.write_text(json.dumps(report, indent=1) + "\n")
    if args.part == "seq":  # a search: tens of minutes of fake steps of the 8B model
        report["longest"] = longest(say, args.max_tries)
    if args.part in ("search", "both"):  # one fake step per probe: about 10 minutes on 2 cores
        report["longest_searched"] = longest_searched(say)
    if args.part in ("recorded", "both"):
        report["longest_recorded"] = longest_recorded(say)
    path.write_text(json.dumps(report, indent=1) + "\n")
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
