"""Print the README's results tables (markdown) from benchmarks/results/*.json.

.venv/bin/python benchmarks/readme_tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def baselines() -> None:
    path = RESULTS / "checkpoint_baselines.json"
    if not path.exists():
        return
    d = json.loads(path.read_text())
    print(
        f"### Checkpointing baselines\n\n`{d['command']}` ({d['date']}, {d['machine']}): whole-step peak (live tensors) and step time vs no checkpointing, medians of interleaved rounds.\n"
    )
    for m in d["models"]:
        print(f"**{m['model']}** (batch {m['batch_size']}, {m['num_params'] / 1e6:.1f} M parameters)\n")
        print("| setup | peak | peak vs none | step (median) | time vs none |\n|---|---|---|---|---|")
        for r in m["results"]:
            print(
                f"| {r['name']} | {mib(r['peak_bytes'])} | {r['peak_ratio']:.2f} | {r['step_s'] * 1e3:.0f} ms | {r['time_ratio']:.2f}x |"
            )
        for name, why in m.get("not_run", {}).items():
            print(f"| {name} | n/a: {why.split(':', 1)[-1].strip()[:90]} | | | |")
        print()


def frontier() -> None:
    for path in sorted(RESULTS.glob("frontier*.json")):
        _frontier(json.loads(path.read_text()), path.name)


def _frontier(d: dict, filename: str) -> None:
    compiled = any(
        m.get("memfit_compiled") or any("torch.compile" in a for a in m.get("anchors", [])) for m in d["models"]
    )
    print(
        f"### Frontier: memfit's plans against the anchors{' (eager and compiled)' if compiled else ''}\n\n`{d['command']}` ({d['date']}, {d['machine']}, "
        f"torch {d['torch']}{', transformers ' + d['transformers'] if d.get('transformers') else ''}) -> `benchmarks/results/{filename}`. memfit plans for "
        "budgets from the minimum to store-all; every plan and anchor measured side by side in one process, in interleaved rounds; "
        + (
            "a time ratio is the median over rounds of the step time over no checkpointing's in the same round, and memfit against an "
            "anchor the same (a set-up of memfit's compiled to an anchor's very graphs is that anchor's program, timed once)."
            if any("memfit_vs_anchor" in t for m in d["models"] for t in m.get("targets", []))
            else "times as medians of interleaved rounds relative to no checkpointing in the same rounds."
        )
        + (
            " Compiled rows: inductor, the whole model, its first step (which compiles) timed apart as `compile`; their peaks come from "
            "the profiler (`torch.profiler` allocation events), because the live-tensor tracker is a dispatch mode and compiled code run "
            "under one falls back to eager. Eager rows show both methods; which anchors fit a budget is judged on the profiler's peaks."
            if compiled
            else ""
        )
        + f" ![frontier](benchmarks/results/{filename.removesuffix('.json')}.png)\n"
    )
    for m in d["models"]:
        if "error" in m:
            print(f"**{m['model']}**: not measured ({m['error'][:160]})\n")
            continue
        res = m["results"]
        noise = (m.get("time_noise") or 0) * 100
        agree = (
            f"; tracker vs profiler on eager rows: within {m['tracker_vs_profiler_max_rel'] * 100:.2f} %"
            if "tracker_vs_profiler_max_rel" in m
            else ""
        )
        blocks = f", {m['n_blocks']} blocks" if "n_blocks" in m else ""
        print(
            f"**{m['model']}** (batch {m['batch_size']}{blocks}; spread of the no-checkpointing step times: {noise:.0f} %{agree})\n"
        )
        by_plan = {res[c].get("compiled_from"): res[c] for c in m.get("memfit_compiled", [])}
        if by_plan:
            print(
                "| budget | measured peak | predicted | time vs none | compiled: peak (profiler) | compiled: time vs none | compile | best anchor within the budget | its time |\n"
                "|---|---|---|---|---|---|---|---|---|"
            )
        else:
            print(
                "| budget | measured peak | predicted | time vs none | best anchor within the budget | its time |\n|---|---|---|---|---|---|"
            )
        for n in m["memfit"]:
            r = res[n]
            best = r.get("best_anchor_within_budget")
            best_t = f"{r['best_anchor_time_ratio']:.2f}x" if best else "-"
            c = by_plan.get(n)
            comp = ""
            if by_plan:
                comp = (
                    f"{mib(c['profiler_peak_bytes'])} | {c['time_ratio']:.2f}x | {c['compile_s']:.0f} s | "
                    if c
                    else "- | - | - | "
                )
            print(
                f"| {mib(r['budget_bytes'])} | {mib(r['peak_bytes'])} | {mib(r['predicted_peak_bytes'])} | {r['time_ratio']:.2f}x | {comp}{best or 'none fits'} | {best_t} |"
            )
        if compiled:
            print("\n| anchor | peak (tracker) | peak (profiler) | time vs none | compile |\n|---|---|---|---|---|")
            for a in m["anchors"]:
                r = res[a]
                tracker = mib(r["peak_bytes"]) if r.get("peak_method", "tracker") == "tracker" else "-"
                print(
                    f"| {a} | {tracker} | {mib(r.get('profiler_peak_bytes', r['peak_bytes']))} | {r['time_ratio']:.2f}x | {str(round(r['compile_s'])) + ' s' if 'compile_s' in r else ''} |"
                )
        else:
            print("\n| anchor | measured peak | time vs none |\n|---|---|---|")
            for a in m["anchors"]:
                print(f"| {a} | {mib(res[a]['peak_bytes'])} | {res[a]['time_ratio']:.2f}x |")
        for a, why in m.get("not_run", {}).items():
            print(f"| {a} | not run: {why[:120]} |" + " |" * (3 if compiled else 1))
        print()
        _compiled_mode(m)


def _compiled_mode(m: dict) -> None:
    """memfit's compiled planning mode (`memfit plan --compile model`) per budget, and the issue's target:
    memfit's fastest way to run the budget (eager plan or compiled mode) against the fastest anchor that fits."""
    if not m.get("targets"):
        return
    res = m["results"]
    print(
        "memfit's compiled planning mode (`memfit plan --compile model`: the fastest of the compiler's `activation_memory_budget` "
        "fraction, memfit's block plan, both, and memfit's chunked head / fused activations under a fraction, whose compiled peak fits "
        "the budget; peaks by the profiler):\n"
    )
    print(
        "| budget | compiled mode chose | fraction | recomputed blocks | peak | time vs none | memfit eager | best anchor within the budget | its time "
        "| memfit's best / anchor, round by round | memfit <= anchor |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for t in m["targets"]:
        r, e = res[t["compiled_mode"]], res[t["eager"]]
        cp = r["compiled_plan"]
        c = cp["compile"]
        recomputed = cp.get("recomputed_blocks", "-")
        anchor = f"{t['best_anchor_time_ratio']:.2f}x" if t["best_anchor"] else "-"
        win = {True: "yes", False: "**no**", None: "memfit does not fit"}[t["memfit_wins"]]
        vs = t.get("memfit_vs_anchor")
        paired = "-" if vs is None else "1 (the same program)" if t.get("same_program") else f"{vs:.3f}x"
        print(
            f"| {mib(t['budget_bytes'])} | {c['candidate']} | {c['activation_memory_budget']:g} | {recomputed} | {mib(r['profiler_peak_bytes'])} | "
            f"{r['time_ratio']:.2f}x | {mib(e['profiler_peak_bytes'])}, {e['time_ratio']:.2f}x | {t['best_anchor'] or 'none fits'} | {anchor} | {paired} | {win} |"
        )
    for a, why in m.get("not_run", {}).items():
        if a.startswith("memfit compiled-mode"):
            print(f"| {a.split('@')[-1]} | not run: {why[:140]} | | | | | | | | | |")
    print()


def selective() -> None:
    path = RESULTS / "selective_frontier.json"
    if not path.exists():
        return
    d = json.loads(path.read_text())
    print(
        f"### Selective checkpointing, fused activations and the chunked head (issue 4's checks)\n\n`{d['command']}` ({d['date']}, {d['machine']}): "
        "per budget, three plans, all measured side by side: block-level options only and every block option (selective, "
        "offload off the CPU), both for the model as it is, and memfit's full planner (every block option, fused "
        "activations where the model has python-written activation modules, and the chunked head: fused linear "
        "cross-entropy, logits never materialised). Plans: `.` keep, `R` recompute, `S` selective, `+chunked head`, "
        "`+fused act`. Budgets, store-all and times are the unmodified model's: times are ratios to it without "
        "checkpointing, in the same run.\n"
    )
    for m in d["models"]:
        print(
            f"**{m['model']}** (batch {m['batch_size']}, {m['n_blocks']} blocks): store-all peak {mib(m['store_all_peak_bytes'])}, "
            f"activations {mib(m['store_all_activations_bytes'])}; head (logits and loss) {mib(m.get('head_peak_bytes', 0))}"
            + (
                f", chunked {mib(m['head_options']['chunked']['head_peak_bytes'])}"
                if m.get("head_options", {}).get("chunked")
                else ""
            )
            + "\n"
        )
        kinds = [k for k in ("block_only", "selective", "memfit") if k in m["frontier"][0]]
        print("| budget | " + " | ".join(f"{k.replace('_', '-')} plan | peak | time" for k in kinds) + " | check |")
        print("|---|" + "---|---|---|" * len(kinds) + "---|")
        for r in m["frontier"]:
            cells = []
            for k in kinds:
                c = r.get(k) or {}
                if not c.get("feasible"):
                    cells.append("infeasible | | ")
                else:
                    cells.append(
                        f"`{c['plan']}` | {mib(c['measured_peak_bytes'])}{'' if c['fits'] else ' (over)'} | {c['time_ratio']:.2f}x"
                    )
            checks = {"half_activations": "half of the activations", "all_peak": "peak of `all`"}
            print(
                f"| {mib(r['budget_bytes'])} | "
                + " | ".join(cells)
                + f" | {', '.join(checks[c] for c in r['checks'])} |"
            )
        print("\n| anchor | measured peak | time vs none |\n|---|---|---|")
        for n, a in m["anchors"].items():
            print(f"| {n} | {mib(a['peak_bytes'])} | {a['time_ratio']:.2f}x |")
        dw = m["done_when"]
        h, a = dw["half_activations"], dw["all_peak"]
        hp, ap = h[h["planner"]], a[a["planner"]]
        print(
            f"\nAt half of the activations ({mib(h['budget_bytes'])}) memfit ran {hp.get('time_ratio', float('nan')):.2f}x of no "
            f"checkpointing (target 1.05x: {'met' if h['memfit_within_5_percent_of_none'] else 'not met'}); at the peak of `all` "
            f"({mib(a['budget_bytes'])}) {ap.get('time_ratio', float('nan')):.2f}x against `all`'s {a['all_time_ratio']:.2f}x "
            f"({'faster' if a['memfit_faster_than_all'] else 'not faster'}).\n"
        )


def gpu() -> None:
    for path in sorted(RESULTS.glob("gpu_check_*.json")):
        d = json.loads(path.read_text())
        print(
            f"### GPU check ({d['device']}, {d['date']}, torch {d['torch']}, bf16)\n\n`bash benchmarks/gpu_check.sh` -> `{path.relative_to(RESULTS.parent.parent)}`. Allocator peak (`torch.cuda.max_memory_allocated`), live-tensor tracker peak and the planner's prediction.\n"
        )
        print("| model | setup | allocator peak | tracker peak | predicted | time vs none |\n|---|---|---|---|---|---|")
        for m in d["models"]:
            if "error" in m:
                continue
            for name, r in m["results"].items():
                print(
                    f"| {m['model']} | {name.split('@')[0] if '@' in name else name}{' @ ' + mib(r['budget_bytes']) if 'budget_bytes' in r else ''} | {mib(r['allocator_peak_bytes'])} | {mib(r['tracker_peak_bytes'])} | {mib(r['predicted_peak_bytes'])} | {r['time_ratio']:.2f}x |"
                )
        print()


def autofit() -> None:
    for path in sorted(RESULTS.glob("autofit*.json")):
        _autofit(json.loads(path.read_text()))


def _recheck(row: dict) -> str:
    """A row re-measured side by side (benchmarks/autofit_recheck.py): its ratio, in brackets."""
    r = row.get("recheck")
    if not r:
        return ""
    return f" (side by side: {r['memfit_vs_best']:.0%}, {r['memfit_micro_batch']} x {r['memfit_accumulation_steps']})"


def _autofit(d: dict) -> None:
    print(
        f"### Auto-fit against a measured grid\n\n`{d['command']}` ({d['date']}, {d['machine']}): the best measured (micro-batch, policy in none/all/sqrt/every:2"
        + (
            " or the planner's plan for that micro-batch"
            if any(row.get("planner_grid") is not None for r in d["runs"] for row in r["budgets"])
            else ""
        )
        + f") within the budget, `memfit fit`'s choice measured the same way, and halving the micro-batch until a plain step fits. Budget violations: {d['budget_violations']}."
        + (
            " Rows in brackets were re-measured by `python benchmarks/autofit_recheck.py`: the fit run again and its choice measured interleaved with the best grid point (medians of 3 pairs)."
            if any(row.get("recheck") for r in d["runs"] for row in r["budgets"])
            else ""
        )
        + "\n"
    )
    print(
        "| model | global batch | budget | best grid point | its samples/s | memfit fit | samples/s | vs best | halving | samples/s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in d["runs"]:
        for row in r["budgets"]:
            best, m, h = row["best_grid"], row["memfit"], row["halving"]
            print(
                f"| {r['model']} | {r['global_batch']} | {mib(row['budget_bytes'])} | "
                + (
                    f"{best['micro_batch']} / {best['policy']} | {best['samples_per_s']:.1f} | "
                    if best
                    else "none fits | - | "
                )
                + (
                    f"{m['micro_batch']} x {m['accumulation_steps']}, {m['recomputed_blocks']} recomputed{', segments' if m.get('segments') else ''}{', chunked head' if m.get('head') else ''}{', fused act' if m.get('activations') else ''} | {m['samples_per_s']:.1f} | {row['memfit_vs_best']:.0%}{_recheck(row)} | "
                    if "micro_batch" in m
                    else "error | - | - | "
                )
                + (f"{h['micro_batch']} | {h['samples_per_s']:.1f} |" if h else "out of memory | - |")
            )
    print()


ESTIMATE_NOTES = """
Why the columns differ:
- **accelerate** (`estimate-memory`) counts the weights of `AutoModel` (the base model: an untied LM head, 0.5 B
  parameters of Llama 3 8B, is left out) in fp32 and multiplies: 4x for fp32 training with Adam (weights, gradients, two
  moments); for mixed precision it reports the *largest* single part (the Adam moments, 2x), not their sum. No
  activations, no batch or sequence length, no temporaries.
- **DeepSpeed** counts model states only: ZeRO-2 keeps bf16 weights on every GPU plus 18 B/param (bf16 and fp32
  gradients, fp32 weights, Adam) split over the GPUs; ZeRO-3 splits everything and adds 4 x the largest layer (the
  embedding or LM head here) for the gathered parameters. No activations, no logits, no temporaries.
- **memfit** runs the whole step on fake tensors: activations at the given batch and sequence length, the head (bf16
  logits, their fp32 copy and log-softmax: 2 x 8192 x 128256 tokens x 10 B = 19.6 GiB for Llama 3 8B at batch 2), the
  optimizer's foreach temporaries (on one GPU with fp32 master weights they can set the peak: "optimizer step" in the
  table), and under FSDP2 the gathered units (root, own block, prefetched block, the kept reduce-scatter
  input). Under FSDP2 it takes torchtitan's `MixedPrecisionPolicy` as `--param-dtype bfloat16 --reduce-dtype float32`:
  fp32 parameter shards, gradient shards and AdamW state (16 B/param over the ranks), bf16 gathered units and
  activations, fp32 reduce-scatter inputs.
- **memfit vs FSDPMemTracker** on the 8B jobs: within 0.3 and 0.5 MB (of 69-71 GiB). Both peak at the loss, which
  HF computes inside the model's forward: FSDP2 still holds the last block's all-gather output there (freed in the
  root's post-forward; `ALL_GATHER` 436,224,000 B), and memfit's accounting holds it from the last block's output
  until the model's forward returns, and from the start of backward (the root prefetches the last block). On the
  small Llama memfit is 156 bytes below the tracker with and without recompute: the head's peak is taken from the
  calibration step of the plan's own option (with every layer kept, transformers' KV cache, 2 MiB here and filled by
  kept layers only, is freed before the loss's backward, while recomputed layers hold the causal mask until their
  backward; NOTE [ The head's peak per option ]).
- **Tensors vs reserved**: memfit and FSDPMemTracker count live tensor bytes; torchtitan logs the caching allocator's
  reserved peak, which adds block rounding, cuBLAS/NCCL workspaces, memory cached for FSDP2's all-gather and
  reduce-scatter streams, and fragmentation (the "published / tracker" column). memfit's allocator model
  (`memfit.estimation.allocator`) adds only what is known without the allocation order (two cuBLAS workspaces, whole
  2 MiB segments): a lower bound of the reserve, 64 MiB above the tensors on an H100, far below the "published / tracker" gap.
- **Not modelled**: torch.compile (its fused kernels keep fewer temporaries) and Float8 linears (fp8 copies of weights
  and activations, scales) of torchtitan's Table 2; context parallelism (CP 1 in that row is none). The selective op
  policy enters memfit's FSDP2 number through one-GPU estimates (the forward/backward peak with the policy minus the
  one with full AC), because the per-rank accounting takes estimated stats with keep/recompute options only.
"""


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def _peak(e: dict) -> str:
    return gib(e["peak_bytes"]) + (" (optimizer step)" if e.get("peak_phase") == "optimizer" else "")


def estimate_compare() -> None:
    path = RESULTS / "estimate_compare.json"
    if not path.exists():
        return
    d = json.loads(path.read_text())
    print(
        f"### memfit's estimate beside other estimators and published figures\n\n`{d['command']}` ({d['date']}, {d['machine']}). "
        f"One training step: {d['setting']}; memfit's peaks are live tensor bytes on the device (`{d['device']}` kernels). "
        "accelerate's numbers come from its own functions (`calculate_maximum_sizes`, `estimate_training_usage`) on the "
        "model its `estimate-memory` command builds; DeepSpeed's from `estimate_zero2/zero3_model_states_mem_needs` "
        f"(deepspeed {d['deepspeed'].get('version', 'not run')}, no offload)."
        + "".join(
            f" memfit's FSDP2 columns and the small-Llama FSDPMemTracker table re-run {r['date']} (`{r['command']}`, {r['machine']})."
            for r in d.get("reruns", [])[-1:]
        )
        + "\n"
    )
    print(
        '| model | batch x tokens | params | accelerate "Training using Adam" (float32 / float16 row) | DeepSpeed ZeRO-2, 1 / 8 GPUs | '
        "ZeRO-3, 8 GPUs | memfit params+grads+optimizer | memfit peak, 1 GPU, no AC / full AC | memfit FSDP2 x8 rank 0 (bf16/fp32 MixedPrecisionPolicy), no AC / full AC |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in d["models"]:
        acc, ds, one, fs = m["accelerate"], m["deepspeed"], m["memfit_single"], m["memfit_fsdp2"]
        states = one["none"]["params_bytes"] + one["none"]["grads_bytes"] + one["none"]["optimizer_bytes"]
        if "not_run" in ds:
            ds2 = ds3 = "not run"
        else:
            ds2 = f"{gib(ds['gpus_1']['zero2_gpu_bytes'])} / {gib(ds['gpus_8']['zero2_gpu_bytes'])}"
            ds3 = gib(ds["gpus_8"]["zero3_gpu_bytes"])
        if "not_run" in fs:
            fsdp = "not run"
        else:  # the same 16 B/param as the other columns: fp32 shards, gradient shards and AdamW state
            x = fs.get("mixed_precision_extra_bytes", 0)  # results from before --param-dtype added them by hand
            fsdp = f"{gib(fs['none']['peak_bytes'] + x)} / {gib(fs['all']['peak_bytes'] + x)}"
        print(
            f"| {m['name']} | {m['batch']} x {m['seq_len']} | {m['n_params'] / 1e9:.2f} B | "
            f"{gib(acc['float32']['training_using_adam_bytes'])} / {gib(acc['bfloat16']['training_using_adam_bytes'])} | {ds2} | {ds3} | "
            f"{gib(states)} | {_peak(one['none'])} / {_peak(one['all'])} | {fsdp} |"
        )
    if d.get("tracker_small"):
        r0 = d["tracker_small"][0]
        print(
            f"\n**torch's FSDPMemTracker against memfit's per-rank prediction** (rank 0 of {r0['world_size']}, fake process "
            f"group, real tensors, fp32, `{r0['model']}`, batch {r0['batch']}):\n"
        )
        print("| plan | FSDPMemTracker peak | memfit predicted | difference |\n|---|---|---|---|")
        for r in d["tracker_small"]:
            t = r["fsdp_mem_tracker"]
            got = mib(t["peak_bytes"]) if "peak_bytes" in t else t.get("not_run", "not run")
            pred = mib(r["memfit_peak_bytes"]) if "memfit_peak_bytes" in r else "not run"
            diff = "-"
            if "memfit_vs_tracker" in r:
                diff = f"{r['memfit_peak_bytes'] - t['peak_bytes']:+,} B ({r['memfit_vs_tracker'] * 100:+.2f} %)"
            print(f"| {r['policy']} | {got} | {pred} | {diff} |")
    if d.get("published"):
        print(
            "\n**Published per-GPU memory** (torchtitan `docs/performance.md`, 8 x H100 96 GB; torchtitan logs "
            '`torch.cuda.memory_stats()["reserved_bytes.all.peak"]`, the allocator\'s reserve). FSDPMemTracker ran '
            "the same job on fake tensors (HF `LlamaForCausalLM`, torchtitan's AC wrapping and "
            "`MixedPrecisionPolicy`):\n"
        )
        print(
            "| source | setting | published (reserved) | FSDPMemTracker (tensors) | published / tracker | memfit rank 0 | memfit / tracker | not modelled |\n|---|---|---|---|---|---|---|---|"
        )
        for p in d["published"]:
            t, f = p["fsdp_mem_tracker"], p["memfit_fsdp2"]
            got = gib(t["peak_bytes"]) if "peak_bytes" in t else t.get("not_run", "not run")
            pub_vs = f"{p['published_gib'] * 2**30 / t['peak_bytes']:.2f}" if "peak_bytes" in t else "-"
            ours_vs = "-"
            r0 = p.get("memfit_rank0")
            if r0 is None:
                pred = f.get("not_run", "not run")
            else:
                q = r0["parts"]
                parts = [f"full AC {gib(q['fsdp2_full_ac_bytes'])}"]
                if q["op_ac_minus_full_ac_bytes"]:
                    parts.append(f"op AC - full AC {gib(q['op_ac_minus_full_ac_bytes'])}")
                if q.get("fp32_shards_bytes"):  # results from before --param-dtype
                    parts.append(f"fp32 shards {gib(q['fp32_shards_bytes'])}")
                pred = f"{gib(r0['peak_bytes'])} ({' + '.join(parts)}); allocator model: reserved >= {gib(r0['allocator']['predicted_reserved_bytes'])}"
                if "peak_bytes" in t:
                    ours_vs = f"{r0['peak_bytes'] / t['peak_bytes'] - 1:+.1%}"
            print(
                f"| {p['source']} | {p['setting']} | {p['published_gib']:.1f} GiB | {got} | {pub_vs} | {pred} | {ours_vs} | {p['not_modelled']} |"
            )
    print(ESTIMATE_NOTES)


if __name__ == "__main__":
    baselines()
    frontier()
    selective()
    autofit()
    estimate_compare()
    gpu()
