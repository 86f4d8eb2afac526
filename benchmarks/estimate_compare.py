"""memfit's estimate beside other estimators and published per-GPU figures (the estimate report's table).

    PYTHONPATH=src .venv/bin/python benchmarks/estimate_compare.py \
        [--deepspeed-python /path/to/venv-with-deepspeed/bin/python] [--models gpt2,llama2-7b,llama3-8b] [--quick]

The DeepSpeed columns need deepspeed, which is not a memfit dependency: install it in a venv of
its own (CPU torch, no ops built) and pass that interpreter:

    python3.11 -m venv /tmp/venv-ds
    DS_BUILD_OPS=0 /tmp/venv-ds/bin/pip install torch==2.13.0 deepspeed==0.19.8

Writes ``benchmarks/results/estimate_compare.json``; ``benchmarks/make_reports.py`` draws the
report's tables from it. ``--rerun-memfit`` re-runs only memfit's per-rank columns and the small-Llama
FSDPMemTracker table in that file (a few minutes; no deepspeed, no 8B tracker runs), after a change
to memfit's accounting. Nothing is downloaded: every model is built from its config, with fake
tensors (memfit, FSDPMemTracker) or on ``meta`` (accelerate).

For each model, at one setting (bf16 with fp32 master weights and AdamW, each model's own
context length) it records:

- memfit's estimate (``memfit.estimation.estimate``: a whole fake-tensor step) for one GPU without
  and with full activation checkpointing, and, where ``memfit.plan.parallel`` exists (per-rank
  accounting), one rank of FSDP2 over 8 GPUs (``estimate_stats`` -> ``rank_stats``);
- ``accelerate estimate-memory``'s numbers from its own functions (``calculate_maximum_sizes`` on
  ``AutoModel.from_config`` built under ``init_empty_weights``, then ``estimate_training_usage``):
  its command builds the model from the hub, which this machine cannot reach;
- DeepSpeed's model-state estimators (``estimate_zero2_model_states_mem_needs``,
  ``estimate_zero3_model_states_mem_needs``), called in a separate interpreter that has
  deepspeed (``--deepspeed-python``); deepspeed is not a memfit dependency.

Then torch's ``FSDPMemTracker`` (fake process group, one process playing rank 0 of 8): on a small
Llama with real tensors beside memfit's per-rank prediction, and on torchtitan's published Llama
3.1 8B jobs with fake tensors, beside the published memory (torchtitan ``docs/performance.md``,
which logs ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``) and memfit's prediction.
Each FSDPMemTracker run is a subprocess of this script (``--tracker-worker``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from memfit.capture.chain import discover_chain
from memfit.capture.step import StepSpec
from memfit.estimation import estimate, estimate_stats, get_device, load_fake_workload
from memfit.estimation.allocator import allocator_model
from memfit.estimation.static import unique_parameters
from memfit.plan.costmodel import ChainCosts, predict
from memfit.plan.policies import Selective, policy_plan
from memfit.plan.types import BlockDecision, Option, Plan

try:  # per-rank accounting (memfit plan/fit --world-size N --parallel fsdp2)
    from memfit.plan.parallel import (
        Parallel,
        ParallelKind,
        param_table,
        rank_param_table,
        rank_stats,
    )
except ImportError as err:  # an older memfit: the FSDP2 columns say why they are empty
    PARALLEL_MISSING: str | None = f"memfit.plan.parallel not available ({err})"
else:
    PARALLEL_MISSING = None

RESULTS = Path(__file__).parent / "results"
DEVICE = "h100-sxm"
WORLD = 8
GIB = 2**30


def _llama(hidden: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, ctx: int, kind: str = "llama") -> str:
    return (
        f"hf:{kind}?hidden_size={hidden}&intermediate_size={ffn}&num_hidden_layers={layers}"
        f"&num_attention_heads={heads}&num_key_value_heads={kv}&vocab_size={vocab}&max_position_embeddings={ctx}"
    )


# name -> (spec, batch size, tokens per row). The published configs of each model.
MODELS: dict[str, tuple[str, int, int]] = {
    "gpt2": (
        "hf:gpt2?hidden_size=768&num_hidden_layers=12&num_attention_heads=12&intermediate_size=3072"
        "&vocab_size=50257&max_position_embeddings=1024",
        8,
        1024,
    ),
    "llama2-7b": (_llama(4096, 11008, 32, 32, 32, 32000, 4096), 1, 4096),
    "llama3-8b": (_llama(4096, 14336, 32, 32, 8, 128256, 8192), 1, 8192),
    "mistral-7b": (_llama(4096, 14336, 32, 32, 8, 32000, 4096, kind="mistral"), 1, 4096),
}
DEFAULT_MODELS = "gpt2,llama2-7b,llama3-8b"

# torchtitan's selective "op" activation checkpointing (torchtitan/parallelisms/parallelize_llama.py,
# Dec 2024): save mm outputs except every second mm of a block, and the attention outputs. A Llama
# block runs 7 mm (q, k, v, o, gate, up, down), so calls 0, 2, 4, 6 are saved. The attention op is
# the one the fake step runs (the CPU flash kernel, which saves what CUDA's flash kernel saves).
TORCHTITAN_SAC = "save:" + ",".join(
    [f"aten.mm.default@{k}" for k in (0, 2, 4, 6)] + ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
)

# torchtitan docs/performance.md (commit eaea6f6, versions of 2024-12-26): Llama 3.1 8B on 8 H100
# (96 GB HBM2e), FSDP2 with bf16 MixedPrecisionPolicy (fp32 reduce), AdamW, the default seq_len 8192.
PUBLISHED = [
    {
        "source": "torchtitan docs/performance.md, Table 1 (FSDP row)",
        "setting": "Llama 3.1 8B, FSDP 8, local batch 2 x 8192 tokens, selective op AC, bf16 mixed precision, AdamW",
        "published_gib": 82.4,
        "batch": 2,
        "seq_len": 8192,
        "ac": "torchtitan-op",
        "not_modelled": "nothing of the setting; memfit's per-rank accounting knows keep/recompute only, so the "
        "selective op policy enters through a one-GPU estimate (see notes)",
    },
    {
        "source": "torchtitan docs/performance.md, Table 2 (FSDP 8, CP 1 row)",
        "setting": "Llama 3.1 8B, FSDP 8, local batch 1 x 32768 tokens, full AC, torch.compile + Float8",
        "published_gib": 83.9,
        "batch": 1,
        "seq_len": 32768,
        "ac": "full",
        "not_modelled": "torch.compile (fuses elementwise ops: fewer temporaries) and Float8 linears (fp8 casts "
        "of weights and activations, amax history); CP 1 is no context parallelism",
    },
]


# ------------------------------------------------------------------ memfit


def _uniform_plan(names: list[str], chain_path: str, action: Option) -> Plan:
    return Plan(
        policy="none" if action is Option.KEEP else "all",
        chain_path=chain_path,
        blocks=tuple(BlockDecision(name=n, option=action) for n in names),
    )


def memfit_single(spec: str, batch: int, seq_len: int) -> dict[str, Any]:
    """One GPU: bf16 params and grads, fp32 master weights and AdamW state (16 B/param)."""
    out: dict[str, Any] = {}
    for policy in ("none", "all"):
        t0 = time.perf_counter()
        e = estimate(
            spec,
            seq_len=seq_len,
            master_weights=True,
            policy=policy,
            device=DEVICE,
            step=StepSpec(batch_size=batch, dtype=torch.bfloat16),
        )
        out[policy] = {
            k: getattr(e, k)
            for k in ("n_params", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes")
        } | {"peak_phase": e.breakdown["peak_phase"], "estimate_s": time.perf_counter() - t0}
    return out


def memfit_fsdp2(spec: str, batch: int, seq_len: int, world: int = WORLD) -> dict[str, Any]:
    """Rank 0 of FSDP2 over ``world`` GPUs for plans keep-all and recompute-all, under torchtitan's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on an fp32 model: fp32 parameter
    shards, gradient shards and AdamW state (16 B/param over the ranks), bf16 gathered units and
    activations, fp32 reduce-scatter inputs (``Parallel(param_dtype=..., reduce_dtype=...)``)."""
    if PARALLEL_MISSING:
        return {"not_run": PARALLEL_MISSING}
    t0 = time.perf_counter()
    wl = load_fake_workload(spec, seq_len=seq_len)  # fp32 parameters, as torchtitan builds them
    # the blocks run in param_dtype
    st = estimate_stats(wl, device=DEVICE, step=StepSpec(batch_size=batch, dtype=torch.bfloat16))
    names = [b.name for b in st.blocks]
    par = Parallel(kind=ParallelKind.FSDP2, world_size=world, param_dtype="bfloat16", reduce_dtype="float32")
    rank = rank_stats(st, rank_param_table(wl.model, st, par), par, 0)
    costs = ChainCosts.from_stats(rank)
    n_params = sum(p.numel() for p in unique_parameters(wl.model))
    out: dict[str, Any] = {"world_size": world, "memory": dict(rank.calibration.parallel.memory)}
    for policy, action in (("none", Option.KEEP), ("all", Option.RECOMPUTE)):
        plan = _uniform_plan(names, st.chain_path, action)
        out[policy] = {"peak_bytes": predict(costs, plan).peak_bytes}
    out["n_params"] = n_params
    out["estimate_s"] = time.perf_counter() - t0
    return out


def memfit_sac_single(spec: str, batch: int, seq_len: int) -> dict[str, int]:
    """One process, bf16, no master weights: the peak of forward and backward with full AC and with
    torchtitan's op policy. The optimizer step is left out: on one GPU its foreach temporaries
    over the whole model can set the step's peak (they do with full AC here), under FSDP2 they
    are an eighth as large."""
    wl = load_fake_workload(spec, seq_len=seq_len, dtype=torch.bfloat16)
    policy = Selective.from_save_text(TORCHTITAN_SAC)
    plan = policy_plan(wl.model, policy, chain=discover_chain(wl.model, wl.blocks))
    full = estimate(wl, policy="all", device=DEVICE, step=StepSpec(batch_size=batch, dtype=torch.bfloat16))
    sac = estimate(wl, plan=plan, device=DEVICE, step=StepSpec(batch_size=batch, dtype=torch.bfloat16))

    def fwd_bwd(e: Any) -> int:
        return max(e.breakdown["peak_bytes_by_phase"]["forward"], e.breakdown["peak_bytes_by_phase"]["backward"])

    return {
        "full_ac_fwd_bwd_peak_bytes": fwd_bwd(full),
        "sac_fwd_bwd_peak_bytes": fwd_bwd(sac),
        "sac_minus_full_bytes": fwd_bwd(sac) - fwd_bwd(full),
    }


# ------------------------------------------------------------------ accelerate, DeepSpeed


def accelerate_numbers(spec: str, seq_len: int) -> dict[str, Any]:
    """What ``accelerate estimate-memory`` computes, by its own functions, for the model's config.

    Its command builds ``AutoModel.from_config(config, torch_dtype=float32)`` under
    ``init_empty_weights`` (the base model: no LM head, so an untied head is not counted), takes
    ``calculate_maximum_sizes`` (fp32 bytes of every parameter and buffer) and, per dtype,
    ``estimate_training_usage``; its table's "Training using Adam" is the largest of those values.
    """
    import accelerate
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel

    config = load_fake_workload(spec, seq_len=seq_len).model.config
    with init_empty_weights():
        model = AutoModel.from_config(config, torch_dtype=torch.float32)
    total, largest = calculate_maximum_sizes(model)
    out: dict[str, Any] = {
        "version": accelerate.__version__,
        "model_class": type(model).__name__,
        "total_size_bytes": int(total),
    }
    out["largest_layer_bytes"] = int(largest[0])
    for dtype in ("float32", "bfloat16"):
        usage = estimate_training_usage(total, dtype)
        out[dtype] = {k: int(v) for k, v in usage.items()} | {"training_using_adam_bytes": int(max(usage.values()))}
    return out


_DS_CODE = """
import json, sys
import deepspeed
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
args = json.loads(sys.argv[1])
out = {"version": deepspeed.__version__, "rows": []}
for a in args:
    for g in a["gpus"]:
        _, zero2 = z2(a["total"], num_gpus_per_node=g, num_nodes=1, cpu_offload=False)
        _, zero3, _ = z3(a["total"], a["largest"], num_gpus_per_node=g, num_nodes=1, cpu_offload=False, cpu_offload_params=False)
        out["rows"].append({"name": a["name"], "gpus": g, "zero2_gpu_bytes": zero2, "zero3_gpu_bytes": zero3})
print(json.dumps(out))
"""


def ds_counts(spec: str, seq_len: int) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` as deepspeed's ``model_to_params`` counts them.

    deepspeed dedupes tied parameters by ``data_ptr()``, which is 0 for every fake or meta
    tensor: here they are deduped by identity instead (what ``data_ptr`` means on real weights).
    """
    model = load_fake_workload(spec, seq_len=seq_len).model
    total = sum(p.numel() for p in unique_parameters(model))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def deepspeed_numbers(python: str | None, counts: dict[str, tuple[int, int]]) -> dict[str, Any]:
    if not python:
        return {"not_run": "no --deepspeed-python given (deepspeed is not a memfit dependency)"}
    args = [{"name": n, "total": t, "largest": lg, "gpus": [1, WORLD]} for n, (t, lg) in counts.items()]
    env = dict(os.environ, DS_BUILD_OPS="0", OMP_NUM_THREADS="1")
    res = subprocess.run(
        [python, "-c", _DS_CODE, json.dumps(args)], capture_output=True, text=True, env=env, timeout=600
    )
    if res.returncode != 0:
        return {
            "not_run": f"{python} failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}"
        }
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ FSDPMemTracker


def run_tracker(cfg: dict[str, Any], timeout_s: int = 3000) -> dict[str, Any]:
    """One FSDPMemTracker run in a subprocess (``--tracker-worker``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, __file__, "--tracker-worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    if res.returncode != 0:
        tail = [line for line in res.stderr.strip().splitlines() if "Error" in line or "error" in line][-1:] or [
            str(res.returncode)
        ]
        return {"not_run": f"tracker worker failed: {tail[0][:300]}"}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def _sac_context():  # torchtitan's policy, as it writes it (TORCHTITAN_SAC is memfit's spelling)
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,  # what runs here
    }
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def tracker_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 of ``cfg["world"]`` (fake process group) under FSDPMemTracker, two steps.

    ``cfg["kind"]``: ``memfit`` runs memfit's workload (``load_workload``) with a memfit plan, real
    tensors, no mixed precision, as memfit's per-rank prediction assumes; ``torchtitan`` builds
    ``LlamaForCausalLM`` from a config on fake tensors with torchtitan's wrapping: AC per block
    (``checkpoint_wrapper``), ``fully_shard`` per block then the root with a bf16/fp32
    ``MixedPrecisionPolicy``, AdamW (per parameter, see below), labels = inputs.
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    world = cfg["world"]
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    t0 = time.perf_counter()
    try:
        if cfg["kind"] == "memfit":
            from memfit.apply.engine import apply_plan
            from memfit.capture.step import make_optimizer, training_step
            from memfit.models.registry import load_workload

            torch.manual_seed(0)
            wl = load_workload(cfg["spec"])
            chain = discover_chain(wl.model, wl.blocks)
            model = wl.model
            if cfg["policy"] != "none":
                apply_plan(model, policy_plan(model, cfg["policy"], chain=chain))
            for block in chain.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = make_optimizer(model, "adamw")
            batch = wl.make_batch(cfg["batch"])
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs(tuple(t for t in batch.values() if isinstance(t, torch.Tensor)))
            with tracker:
                for i in range(2):
                    training_step(model, batch, wl.loss_fn, opt, seed=i)
                    opt.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
        else:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(**cfg["config"], use_cache=False)
            with FakeTensorMode():
                model = LlamaForCausalLM(config)
                layers = model.model.layers
                for i, block in enumerate(layers):
                    if cfg["ac"] == "full":
                        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
                    elif cfg["ac"] == "torchtitan-op":
                        layers[i] = checkpoint_wrapper(block, context_fn=_sac_context, preserve_rng_state=False)
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in layers:
                    fully_shard(block, mesh=mesh, mp_policy=mp)
                fully_shard(model, mesh=mesh, mp_policy=mp)
                # Per-parameter AdamW: under fake tensors FSDPMemTracker counted ~100 GiB of
                # "OptState" in a foreach step on DTensors (27x the AdamW shards), which no real
                # run could have held; the per-parameter loop's temporaries are one parameter's.
                opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
                tokens = torch.randint(0, config.vocab_size, (cfg["batch"], cfg["seq_len"]))
                tracker = FSDPMemTracker(model, opt)
                tracker.track_inputs((tokens,))
                with tracker:
                    for _ in range(2):  # the second step runs with AdamW's state allocated
                        model(input_ids=tokens, labels=tokens).loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    finally:
        dist.destroy_process_group()
    return {
        "peak_bytes": int(snap["Total"]),
        "by_kind_bytes": {str(k).rsplit(".", 1)[-1]: int(v) for k, v in snap.items() if k != "Total"},
        "seconds": time.perf_counter() - t0,
    }


SMALL = _llama(256, 688, 4, 4, 2, 2048, 256)
SMALL_BATCH = 2


def tracker_small(world: int) -> list[dict[str, Any]]:
    """memfit's per-rank prediction against FSDPMemTracker on a small Llama (real tensors, fp32)."""
    rows = []
    pred: dict[str, int] = {}
    if not PARALLEL_MISSING:
        wl = load_fake_workload(SMALL)
        # the CPU kernels the tracker runs
        st = estimate_stats(wl, device=DEVICE, gpu_kernels=False, step=StepSpec(batch_size=SMALL_BATCH))
        names = [b.name for b in st.blocks]
        costs = ChainCosts.from_stats(
            rank_stats(st, param_table(wl.model, names), Parallel(kind=ParallelKind.FSDP2, world_size=world), 0)
        )
        for policy, action in (("none", Option.KEEP), ("all", Option.RECOMPUTE)):
            pred[policy] = predict(costs, _uniform_plan(names, st.chain_path, action)).peak_bytes
    for policy in ("none", "all"):
        got = run_tracker({"kind": "memfit", "spec": SMALL, "batch": SMALL_BATCH, "policy": policy, "world": world})
        row = {"model": SMALL, "batch": SMALL_BATCH, "world_size": world, "policy": policy, "fsdp_mem_tracker": got}
        if policy in pred:
            row["memfit_peak_bytes"] = pred[policy]
            if "peak_bytes" in got:
                row["memfit_vs_tracker"] = pred[policy] / got["peak_bytes"] - 1
        else:
            row["memfit_not_run"] = PARALLEL_MISSING
        rows.append(row)
    return rows


def published_rows(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for pub in PUBLISHED:
        spec = MODELS["llama3-8b"][0].replace(
            "max_position_embeddings=8192", f"max_position_embeddings={pub['seq_len']}"
        )
        row: dict[str, Any] = dict(pub, spec=spec)
        fsdp = memfit_fsdp2(spec, pub["batch"], pub["seq_len"])
        row["memfit_fsdp2"] = fsdp
        if pub["ac"] == "torchtitan-op":
            row["memfit_sac_single"] = memfit_sac_single(spec, pub["batch"], pub["seq_len"])
        if "not_run" not in fsdp:
            # memfit's rank 0 for the job: the FSDP2 accounting with full AC under torchtitan's mixed
            # precision, and the selective op policy's extra over full AC on one GPU (memfit_sac_single).
            parts = {
                "fsdp2_full_ac_bytes": fsdp["all"]["peak_bytes"],
                "op_ac_minus_full_ac_bytes": row.get("memfit_sac_single", {}).get("sac_minus_full_bytes", 0),
            }
            total = sum(parts.values())
            row["memfit_rank0"] = {"peak_bytes": total, "parts": parts} | {
                "allocator": allocator_model(total, get_device(DEVICE)).to_dict()
            }
        config = {
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": pub["seq_len"],
        }  # fmt: skip
        if quick:
            row["fsdp_mem_tracker"] = {"not_run": "--quick"}
        else:
            row["fsdp_mem_tracker"] = run_tracker(
                {
                    "kind": "torchtitan",
                    "config": config,
                    "batch": pub["batch"],
                    "seq_len": pub["seq_len"],
                    "ac": pub["ac"],
                    "world": WORLD,
                }
            )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default=DEFAULT_MODELS, help=f"comma-separated, of {', '.join(MODELS)} (default {DEFAULT_MODELS})"
    )
    ap.add_argument("--deepspeed-python", default=None, metavar="PATH", help="an interpreter with deepspeed installed")
    ap.add_argument("--quick", action="store_true", help="skip the FSDPMemTracker runs of 8B models (minutes each)")
    ap.add_argument("--no-published", action="store_true", help="skip the published-figure rows")
    ap.add_argument("--out", default=str(RESULTS / "estimate_compare.json"))
    ap.add_argument(
        "--rerun-memfit", action="store_true",
        help="re-run only memfit's FSDP2 columns and the small-Llama FSDPMemTracker table, in the results at --out",
    )  # fmt: skip
    ap.add_argument("--tracker-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tracker_worker:
        print(json.dumps(tracker_worker(json.loads(args.tracker_worker))))
        return
    torch.set_num_threads(1)
    if args.rerun_memfit:
        rerun_memfit(Path(args.out))
        return
    t0 = time.perf_counter()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    models = []
    counts: dict[str, tuple[int, int]] = {}
    for name in names:
        spec, batch, seq_len = MODELS[name]
        print(f"{name}: memfit one GPU ...", flush=True)
        row: dict[str, Any] = {"name": name, "spec": spec, "batch": batch, "seq_len": seq_len}
        row["memfit_single"] = memfit_single(spec, batch, seq_len)
        print(f"{name}: memfit FSDP2 x{WORLD} ...", flush=True)
        row["memfit_fsdp2"] = memfit_fsdp2(spec, batch, seq_len)
        row["accelerate"] = accelerate_numbers(spec, seq_len)
        counts[name] = ds_counts(spec, seq_len)
        row["n_params"], row["largest_layer_params"] = counts[name]
        models.append(row)
    ds = deepspeed_numbers(args.deepspeed_python, counts)
    for row in models:
        row["deepspeed"] = {"not_run": ds["not_run"]} if "not_run" in ds else {
            "version": ds["version"], **{f"gpus_{r['gpus']}": r for r in ds["rows"] if r["name"] == row["name"]}
        }  # fmt: skip
    print(f"FSDPMemTracker on a small Llama, world {WORLD} ...", flush=True)
    small = tracker_small(WORLD)
    published = [] if args.no_published else published_rows(args.quick)
    result = {
        "command": "python benchmarks/estimate_compare.py " + " ".join(_args_shown(sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}",
        "device": DEVICE,
        "setting": "bf16 parameters and gradients, fp32 master weights and AdamW state (16 B/param) on one GPU",
        "models": models,
        "deepspeed": {k: v for k, v in ds.items() if k != "rows"},
        "tracker_small": small,
        "published": published,
        "seconds": time.perf_counter() - t0,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    print(f"wrote {args.out} in {result['seconds']:.0f} s")


def rerun_memfit(path: Path) -> None:
    """Re-run memfit's per-rank columns (``memfit_fsdp2`` of every model and published row) and the
    small-Llama FSDPMemTracker table in the results at ``path``, keeping the other estimators' and
    the 8B FSDPMemTracker runs; ``reruns`` records when and what."""
    t0 = time.perf_counter()
    result = json.loads(path.read_text())
    for row in [*result["models"], *result["published"]]:
        print(f"{row.get('name') or row['source']}: memfit FSDP2 x{WORLD} ...", flush=True)
        spec = row.get("spec")
        row["memfit_fsdp2"] = memfit_fsdp2(spec, row["batch"], row["seq_len"])
        if "memfit_rank0" in row and "not_run" not in row["memfit_fsdp2"]:
            parts = row["memfit_rank0"]["parts"]
            parts["fsdp2_full_ac_bytes"] = row["memfit_fsdp2"]["all"]["peak_bytes"]
            total = sum(parts.values())
            row["memfit_rank0"] = {
                "peak_bytes": total,
                "parts": parts,
                "allocator": allocator_model(total, get_device(DEVICE)).to_dict(),
            }
    print(f"FSDPMemTracker on a small Llama, world {WORLD} ...", flush=True)
    result["tracker_small"] = tracker_small(WORLD)
    result.setdefault("reruns", []).append({
        "command": "python benchmarks/estimate_compare.py --rerun-memfit",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}",
        "parts": ["memfit_fsdp2", "memfit_rank0", "tracker_small"],
        "seconds": time.perf_counter() - t0,
    })  # fmt: skip
    path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    print(f"updated {path} in {time.perf_counter() - t0:.0f} s")


def _args_shown(argv: list[str]) -> list[str]:
    """The command line without ``--out PATH`` and with the deepspeed interpreter's path shortened."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            shown.append("PYTHON_WITH_DEEPSPEED" if shown and shown[-1] == "--deepspeed-python" else a)
    return shown


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


if __name__ == "__main__":
    main()
