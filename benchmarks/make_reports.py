"""Turn each measured run in ``benchmarks/results/*.json`` into a Markdown report, and index them.

    .venv/bin/python benchmarks/make_reports.py            # benchmarks/reports/*.md and benchmarks/README.md
    .venv/bin/python benchmarks/make_reports.py --out DIR  # DIR/reports/*.md and DIR/README.md

One report per results file, named ``<benchmark>_<model>_<hardware>_<date>.md``; every table in it is
drawn from the JSON, so a report changes only when its run does. ``tests/test_benchmark_reports.py``
regenerates them and compares with the committed files. ``results/archive/`` holds superseded runs
and gets no report; a plan file (``"format": "memfit.plan"``) is an input of a run, not a run.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

HERE = Path(__file__).parent
RESULTS = HERE / "results"

# What the benchmark did not write into its JSON, taken from the script's own defaults and the commit that
# added the file. Only metadata: every number in a report comes from the JSON.
MISSING_FIELDS: dict[str, dict[str, str]] = {
    "accumulation.json": {
        "date": "2026-12-01",
        "command": "python benchmarks/accumulation.py",
        "models": "hf:gpt2 demo",
    },
    "comm_gloo.json": {"machine": "x86_64, 2 cores, CPU (gloo)"},
}

# Commands whose import paths have moved since the run: the command as recorded stays in the report, the
# one to run today beside it.
COMMAND_NOW: dict[str, str] = {
    "compiled_mode_24layer_241MiB_2026-12-01.json": (
        'OMP_NUM_THREADS=2 python -c "import memfit; print(memfit.plan_compiled(memfit.load_workload('
        "'hf:gpt2?n_layer=24&n_embd=64&n_head=2'), 252537968, batch_size=4, repeats=3, fraction_steps=3, "
        "kinds=('compiler',)).to_dict())\""
    ),
}

WHAT = {
    "measured_choice": "Per budget: the solver's plan, its next-best plans and the fixed policies predicted to fit, "
    "timed in interleaved rounds; the fastest measured within the budget is kept (memfit.fitting.choice). A second, "
    "independent set of paired rounds then times the kept plan against the fastest fixed policy.",
    "gpu_cli_check": "The command line end to end with --device: each command's exit code, device and what it "
    "measured (a dry run on the CPU runs the same commands at tiny shapes).",
    "checkpoint_baselines": "Whole-step peak (live tensors) and step time of memfit's fixed policies and HF gradient "
    "checkpointing, against no checkpointing.",
    "frontier": "memfit's plans for budgets from the minimum to store-all against the anchors (HF gradient "
    "checkpointing, fixed policies, torch's selective checkpointing, torch.compile's activation memory budget), "
    "all measured side by side in one process.",
    "selective_frontier": "Per budget: block-level plans, plans with every block option (selective, offload), and "
    "memfit's full planner (fused activations, the chunked head), measured side by side.",
    "autofit": "`memfit fit`'s choice of micro-batch, accumulation and plan against the best point of a measured "
    "grid, and against halving the micro-batch until a plain step fits.",
    "estimate_compare": "memfit's estimated peak for one training step beside accelerate's and DeepSpeed's "
    "estimators, torch's FSDPMemTracker and torchtitan's published per-GPU figures.",
    "gpu_check": "On a GPU: the allocator's peak, the live-tensor tracker's peak and the planner's prediction.",
    "compile_head_to_head": "Two compiled set-ups of one model alone, timed head to head in interleaved rounds.",
    "compiled_mode": "The compiled planning mode's candidates at one budget: compiled peaks and times.",
    "deep_targets": "memfit's minimum budget against `all` (every block recomputed) on 24-layer models.",
    "accumulation": "Gradients of accumulation loops (memfit and the frameworks' own) against one pass over the whole "
    "batch, and memfit's Accumulator against the same exact loop written by hand.",
    "comm_gloo": "gloo collectives on 2 CPU processes against memfit's ring model of communication time.",
    "soak": "1000 optimizer steps with recompute, accumulation and the out-of-memory guard: tracked peak and RSS "
    "over time.",
    "solver_timing": "The planner's solve time on 24-100-block chains at three budgets, and CPU copy bandwidth.",
    "startup": "CPU seconds of `memfit --version`, `--help` and a mistyped command (target: under 1 s each), beside "
    "a command's help, `import memfit` and `import torch`.",
    "long_context": "The longest sequence that trains within a budget, and its step time per token: no checkpointing, "
    "HF gradient checkpointing, every block recomputed with a chunked loss, memfit; and Llama-3.1-8B on one H100 "
    "estimated beside ALST's published length.",
    "allocator_check": "On a GPU: `max_memory_allocated` and `max_memory_reserved` of training steps against memfit's "
    "CUDA caching-allocator model, replaying the measured step's allocations and from the fake-step estimate.",
    "allocator_recorded": "The CUDA caching-allocator model, run on this CPU, against GPU runs recorded earlier: "
    "`max_memory_allocated` predicted from the fake-tensor estimate of the same model, batch, dtype and plan, and from "
    "the recorded tracker peak alone.",
    "allocator_reserved_budget": "On a GPU: a plan for a budget meaning live tensors and one meaning reserved "
    "memory (as `memfit plan` makes it on CUDA), each run: `max_memory_reserved` against the budget.",
    "model_states": "The least plan with every model state on the device against the optimizer step inside the "
    "backward: predicted and measured peak, and parameters after steps against plain training.",
    "model_states_estimate": "Llama-3.1-8B full fine-tuning with AdamW in bf16, estimated with each placement of its "
    "model states (device, step inside the backward, optimizer on the host, parameters on the host): least device peak, "
    "host memory and tokens/s on an RTX 4090 and an H100, beside torchtune's published run; the longest sequence on one "
    "H100 with the states on the host, beside ALST's.",
    "published_runs": "memfit's per-rank prediction (live tensors, the CUDA allocator's reserved memory, tokens/s) beside "
    "published multi-GPU runs with their full configurations; the time model's utilisation calibrated per device class "
    "on one published run and checked on the others.",
}

TITLE = {
    "measured_choice": "Choosing by measurement against the fixed policies",
    "gpu_cli_check": "The command line on a device, end to end",
    "checkpoint_baselines": "Checkpointing baselines",
    "frontier": "Frontier: memfit's plans against the anchors",
    "selective_frontier": "Selective checkpointing, fused activations and the chunked head",
    "autofit": "Auto-fit against a measured grid",
    "estimate_compare": "memfit's estimate beside other estimators and published figures",
    "gpu_check": "GPU check",
    "compile_head_to_head": "Compiled set-ups head to head",
    "compiled_mode": "Compiled planning mode at one budget",
    "deep_targets": "Deep models: memfit's minimum against `all`",
    "accumulation": "Gradient accumulation against the anchors",
    "comm_gloo": "Communication model against gloo",
    "soak": "Soak: 1000 steps with recompute, accumulation and the guard",
    "solver_timing": "Solver timing",
    "startup": "Start-up: CPU seconds before any work",
    "long_context": "Long context: the longest sequence within a budget",
    "published_runs": "Published multi-GPU runs against memfit's prediction",
    "model_states": "Model states: the optimizer step inside the backward, measured",
    "model_states_estimate": "Model states placed: Llama-3.1-8B estimated on an RTX 4090 and an H100",
    "allocator_check": "CUDA allocator model against a GPU",
    "allocator_recorded": "CUDA allocator model against recorded GPU runs",
    "allocator_reserved_budget": "A budget meaning reserved memory, on a GPU",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One results file and what its report is named by."""

    source: str  # file name under benchmarks/results/
    data: dict
    benchmark: str  # a key of WHAT
    variant: str  # tells apart runs of one benchmark on the same model, hardware and date ("" if none)
    models: tuple[str, ...]
    hardware: str
    date: str  # YYYY-MM-DD
    machine: str
    commands: tuple[str, ...]

    @property
    def name(self) -> str:
        bench = self.benchmark + (f"-{self.variant}" if self.variant else "")
        return f"{bench}_{model_slug(self.models)}_{self.hardware}_{self.date}.md"


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def model_slug(models: tuple[str, ...]) -> str:
    """``hf:gpt2?n_layer=24&n_embd=64`` -> ``gpt2-24l-w64``; several models joined by ``-``."""
    slugs: list[str] = []
    for spec in models:
        base, _, query = spec.partition("?")
        params = dict(parse_qsl(query))
        slug = base.split(":")[-1]
        layers = params.get("n_layer") or params.get("num_hidden_layers")
        width = params.get("n_embd") or params.get("hidden_size")
        slug += f"-{layers}l" if layers else ""
        slug += f"-w{width}" if width else ""
        slug = re.sub(r"[^a-z0-9.-]+", "", slug.lower())
        if slug not in slugs:
            slugs.append(slug)
    return "-".join(slugs)


# --------------------------------------------------------------------------------------------------
# Reading a results file


def describe(path: Path) -> Run | None:
    """What a results file is; None for a file that is not a benchmark run (a plan)."""
    d = json.loads(path.read_text())
    if d.get("format") == "memfit.plan":
        return None
    d = {**MISSING_FIELDS.get(path.name, {}), **d}
    stem = path.stem
    if stem.startswith("compiled_mode"):
        benchmark = "compiled_mode"
    else:
        benchmark = next(b for b in sorted(WHAT, key=len, reverse=True) if stem.startswith(b))
    machine = d.get("machine") or d.get("device") or "CPU"
    if isinstance(machine, dict):
        arch = "x86_64, " if "x86_64" in machine["platform"] else ""
        machine = f"{arch}{machine['threads']} thread(s), CPU"
    text = f"{machine} {d.get('device', '')}"
    hardware = "h200" if "H200" in text else "h100" if "H100" in text else "cpu"
    commands = tuple(d["commands"]) if "commands" in d else (_command(d, benchmark),)
    commands = tuple(_quote_specs(_public(c)) for c in commands)
    return Run(
        source=path.name,
        data=d,
        benchmark=benchmark,
        variant=_variant(d, benchmark),
        models=_models(d, benchmark),
        hardware=hardware,
        date=d["date"][:10],
        machine=machine,
        commands=commands,
    )


# Words in a few recorded notes about the project's own working sessions, not about the run.
PRIVATE_WORDING = {"at the session's deadline": "at the run's deadline", " (8 helpers)": ""}


def _public(text: str) -> str:
    for private, public in PRIVATE_WORDING.items():
        text = text.replace(private, public)
    return text


def _quote_specs(command: str) -> str:
    """Quote the model specs with ``&`` that the runs recorded bare, so that the command can be pasted into a shell."""
    return re.sub(r"(?<=\s)((?:hf:|demo)[^\s'\"]*[&?][^\s'\"]*)", r'"\1"', command)


def _command(d: dict, benchmark: str) -> str:
    if "command" in d:
        cmd = d["command"]
        if benchmark == "soak":
            return f"python benchmarks/soak.py  (runs: {cmd})"
        if benchmark == "gpu_check":
            return f"bash benchmarks/gpu_check.sh  (runs: python {cmd})"
        return cmd
    if benchmark == "comm_gloo":
        return f"python benchmarks/comm_gloo.py --repeats {d['repeats']}"
    if benchmark == "solver_timing":
        blocks = sorted({r["blocks"] for r in d["rows"]})
        return f"python benchmarks/solver_timing.py --repeats {d['repeats']} --blocks {' '.join(map(str, blocks))}"
    raise KeyError(f"make_reports: no command for a {benchmark} run; add it to MISSING_FIELDS")


def _models(d: dict, benchmark: str) -> tuple[str, ...]:
    if "models" in d and isinstance(d["models"], str):
        return tuple(d["models"].split())
    if benchmark == "estimate_compare":
        return tuple(m["name"] for m in d["models"])
    if "models" in d:
        return tuple(m["model"] for m in d["models"])
    if "runs" in d:
        return tuple(r["model"] for r in d["runs"])
    if "model" in d:
        return (d["model"],)
    if isinstance(d.get("rows"), list) and "model" in d["rows"][0]:
        return tuple(r["model"] for r in d["rows"])
    if benchmark == "soak":
        return (d["command"].split("--model ")[1].split()[0],)
    if benchmark == "compiled_mode":
        return (re.search(r"load_workload\('([^']+)'\)", d["command"]).group(1),)
    if benchmark == "comm_gloo":
        return ("collectives",)
    if benchmark == "solver_timing":
        return ("synthetic-chains",)
    raise KeyError(f"make_reports: no model in a {benchmark} run")


def _variant(d: dict, benchmark: str) -> str:
    if benchmark == "allocator_check" and "expandable_segments:True" in d.get("alloc_conf", ""):
        return "expandable"
    if benchmark == "compile_head_to_head":
        first, second = (s.split("budget=")[-1] for s in d["setups"])
        return f"{'memfit' if d.get('first_plan') else first}-vs-{second}"
    return ""


# --------------------------------------------------------------------------------------------------
# Tables, one renderer per benchmark. Each takes the JSON and the results file's name, returns lines.


def checkpoint_baselines(d: dict, source: str) -> list[str]:
    out = ["Medians of interleaved rounds; ratios against no checkpointing in the same rounds.", ""]
    for m in d["models"]:
        out.append(f"**{m['model']}** (batch {m['batch_size']}, {m['num_params'] / 1e6:.1f} M parameters)\n")
        out.append("| setup | peak | peak vs none | step (median) | time vs none |\n|---|---|---|---|---|")
        for r in m["results"]:
            out.append(
                f"| {r['name']} | {mib(r['peak_bytes'])} | {r['peak_ratio']:.2f} | {r['step_s'] * 1e3:.0f} ms | {r['time_ratio']:.2f}x |"
            )
        for name, why in m.get("not_run", {}).items():
            out.append(f"| {name} | n/a: {why.split(':', 1)[-1].strip()[:90]} | | | |")
        out.append("")
    return out


def frontier(d: dict, source: str) -> list[str]:
    out: list[str] = []
    compiled = any(
        m.get("memfit_compiled") or any("torch.compile" in a for a in m.get("anchors", [])) for m in d["models"]
    )
    paired = any("memfit_vs_anchor" in t for m in d["models"] for t in m.get("targets", []))
    out.append(
        "memfit plans for budgets from the minimum to store-all; every plan and anchor measured side by side in one "
        "process, in interleaved rounds; "
        + (
            "a time ratio is the median over rounds of the step time over no checkpointing's in the same round, and "
            "memfit against an anchor the same (a set-up of memfit's compiled to an anchor's very graphs is that "
            "anchor's program, timed once)."
            if paired
            else "times as medians of interleaved rounds relative to no checkpointing in the same rounds."
        )
        + (
            " Compiled rows: inductor, the whole model, its first step (which compiles) timed apart as `compile`; "
            "their peaks come from the profiler (`torch.profiler` allocation events), because the live-tensor tracker "
            "is a dispatch mode and compiled code run under one falls back to eager. Eager rows show both methods; "
            "which anchors fit a budget is judged on the profiler's peaks."
            if compiled
            else ""
        )
    )
    png = RESULTS / source.replace(".json", ".png")
    if png.exists():
        out.append(f"\n![frontier](../results/{png.name})")
    out.append("")
    for m in d["models"]:
        if "error" in m:
            out.append(f"**{m['model']}**: not measured ({m['error'][:160]})\n")
            continue
        res = m["results"]
        noise = (m.get("time_noise") or 0) * 100
        agree = (
            f"; tracker vs profiler on eager rows: within {m['tracker_vs_profiler_max_rel'] * 100:.2f} %"
            if "tracker_vs_profiler_max_rel" in m
            else ""
        )
        blocks = f", {m['n_blocks']} blocks" if "n_blocks" in m else ""
        out.append(
            f"**{m['model']}** (batch {m['batch_size']}{blocks}; spread of the no-checkpointing step times: {noise:.0f} %{agree})\n"
        )
        by_plan = {res[c].get("compiled_from"): res[c] for c in m.get("memfit_compiled", [])}
        if by_plan:
            out.append(
                "| budget | measured peak | predicted | time vs none | compiled: peak (profiler) | compiled: time vs none | compile | best anchor within the budget | its time |\n"
                "|---|---|---|---|---|---|---|---|---|"
            )
        else:
            out.append(
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
            out.append(
                f"| {mib(r['budget_bytes'])} | {mib(r['peak_bytes'])} | {mib(r['predicted_peak_bytes'])} | {r['time_ratio']:.2f}x | {comp}{best or 'none fits'} | {best_t} |"
            )
        if compiled:
            out.append(
                "\n| anchor | peak (tracker) | peak (profiler) | time vs none | compile |\n|---|---|---|---|---|"
            )
            for a in m["anchors"]:
                r = res[a]
                tracker = mib(r["peak_bytes"]) if r.get("peak_method", "tracker") == "tracker" else "-"
                out.append(
                    f"| {a} | {tracker} | {mib(r.get('profiler_peak_bytes', r['peak_bytes']))} | {r['time_ratio']:.2f}x | {str(round(r['compile_s'])) + ' s' if 'compile_s' in r else ''} |"
                )
        else:
            out.append("\n| anchor | measured peak | time vs none |\n|---|---|---|")
            for a in m["anchors"]:
                out.append(f"| {a} | {mib(res[a]['peak_bytes'])} | {res[a]['time_ratio']:.2f}x |")
        for a, why in m.get("not_run", {}).items():
            out.append(f"| {a} | not run: {why[:120]} |" + " |" * (3 if compiled else 1))
        out.append("")
        out += _compiled_mode_targets(m)
    return out


def _compiled_mode_targets(m: dict) -> list[str]:
    """memfit's compiled planning mode per budget, and memfit's fastest way to run the budget (eager plan or
    compiled mode) against the fastest anchor that fits."""
    if not m.get("targets"):
        return []
    res = m["results"]
    out = [
        "memfit's compiled planning mode (`memfit plan --compile model`: the fastest of the compiler's "
        "`activation_memory_budget` fraction, memfit's block plan, both, and memfit's chunked head / fused activations "
        "under a fraction, whose compiled peak fits the budget; peaks by the profiler):\n",
        "| budget | compiled mode chose | fraction | recomputed blocks | peak | time vs none | memfit eager | best anchor within the budget | its time "
        "| memfit's best / anchor, round by round | memfit <= anchor |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in m["targets"]:
        r, e = res[t["compiled_mode"]], res[t["eager"]]
        cp = r["compiled_plan"]
        c = cp["compile"]
        recomputed = cp.get("recomputed_blocks", "-")
        anchor = f"{t['best_anchor_time_ratio']:.2f}x" if t["best_anchor"] else "-"
        win = {True: "yes", False: "**no**", None: "memfit does not fit"}[t["memfit_wins"]]
        vs = t.get("memfit_vs_anchor")
        paired = "-" if vs is None else "1 (the same program)" if t.get("same_program") else f"{vs:.3f}x"
        out.append(
            f"| {mib(t['budget_bytes'])} | {c['candidate']} | {c['activation_memory_budget']:g} | {recomputed} | {mib(r['profiler_peak_bytes'])} | "
            f"{r['time_ratio']:.2f}x | {mib(e['profiler_peak_bytes'])}, {e['time_ratio']:.2f}x | {t['best_anchor'] or 'none fits'} | {anchor} | {paired} | {win} |"
        )
    for a, why in m.get("not_run", {}).items():
        if a.startswith("memfit compiled-mode"):
            out.append(f"| {a.split('@')[-1]} | not run: {why[:140]} | | | | | | | | | |")
    out.append("")
    return out


def selective_frontier(d: dict, source: str) -> list[str]:
    out = [
        "Per budget, three plans, all measured side by side: block-level options only and every block option "
        "(selective, offload off the CPU), both for the model as it is, and memfit's full planner (every block option, "
        "fused activations where the model has python-written activation modules, and the chunked head: fused linear "
        "cross-entropy, logits never materialised). Plans: `.` keep, `R` recompute, `S` selective, `+chunked head`, "
        "`+fused act`. Budgets, store-all and times are the unmodified model's: times are ratios to it without "
        "checkpointing, in the same run.",
        "",
    ]
    if d.get("note"):
        out += [d["note"], ""]
    for m in d["models"]:
        out.append(
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
        out.append(
            "| budget | " + " | ".join(f"{k.replace('_', '-')} plan | peak | time" for k in kinds) + " | check |"
        )
        out.append("|---|" + "---|---|---|" * len(kinds) + "---|")
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
            out.append(
                f"| {mib(r['budget_bytes'])} | "
                + " | ".join(cells)
                + f" | {', '.join(checks[c] for c in r['checks'])} |"
            )
        out.append("\n| anchor | measured peak | time vs none |\n|---|---|---|")
        for n, a in m["anchors"].items():
            out.append(f"| {n} | {mib(a['peak_bytes'])} | {a['time_ratio']:.2f}x |")
        dw = m["done_when"]
        h, a = dw["half_activations"], dw["all_peak"]
        planner = h.get("planner", "selective")  # runs before the full planner judged its selective plans
        hp, ap = h[planner], a[planner]
        who = "memfit" if planner == "memfit" else f"memfit's {planner} plan"
        out.append(
            f"\nAt half of the activations ({mib(h['budget_bytes'])}) {who} ran {hp.get('time_ratio', float('nan')):.2f}x of no "
            f"checkpointing (target 1.05x: {'met' if h[f'{planner}_within_5_percent_of_none'] else 'not met'}); at the peak of `all` "
            f"({mib(a['budget_bytes'])}) {ap.get('time_ratio', float('nan')):.2f}x against `all`'s {a['all_time_ratio']:.2f}x "
            f"({'faster' if a[f'{planner}_faster_than_all'] else 'not faster'}).\n"
        )
    return out


def gpu_check(d: dict, source: str) -> list[str]:
    # the run of 2026-11-30 predicted live tensors (its predictions equal the tracker's peaks); later runs predict
    # what the allocator holds (the profile on CUDA counts what the process holds before the step)
    vs_alloc = d["date"] > "2026-11-30"
    tf = f", transformers {d['transformers']}" if "transformers" in d else ""
    out = [
        f"{d['device']}, torch {d['torch']}{tf}, bf16. Allocator peak (`torch.cuda.max_memory_allocated`, reset before "
        "the step), live-tensor tracker peak and the planner's prediction"
        + (
            ", which on CUDA includes what the process holds before the step (other models' tensors, cuBLAS "
            "workspaces): error = predicted / allocator peak - 1. Reserved memory is not compared here (the models "
            "run one after another in one process, whose reserve only grows): the allocator-check report does that."
            if vs_alloc
            else "."
        ),
        "",
        "| model | setup | allocator peak | predicted | "
        + ("error | " if vs_alloc else "")
        + "tracker peak | time vs none |\n|---|---|---|---|"
        + ("---|" if vs_alloc else "")
        + "---|---|",
    ]
    under = []
    for m in d["models"]:
        if "error" in m:
            continue
        for name, r in m["results"].items():
            setup = (name.split("@")[0] if "@" in name else name) + (
                " @ " + mib(r["budget_bytes"]) if "budget_bytes" in r else ""
            )
            err = r["predicted_peak_bytes"] / r["allocator_peak_bytes"] - 1
            if vs_alloc and err < -0.02:
                under.append(f"`{m['model']}` {setup} ({err:+.1%})")
            out.append(
                f"| `{m['model']}` | {setup} | {mib(r['allocator_peak_bytes'])} | {mib(r['predicted_peak_bytes'])} | "
                + (f"{err:+.1%} | " if vs_alloc else "")
                + f"{mib(r['tracker_peak_bytes'])} | {r['time_ratio']:.2f}x |"
            )
    out.append("")
    failed = [m for m in d["models"] if "error" in m]
    for m in failed:
        out.append(f"- `{m['model']}`: not measured: {m['error']}")
    if failed:
        out.append("")
    if vs_alloc:
        out += [
            f"Rows predicted more than 2 % below the allocator peak: {', '.join(under)}."
            if under
            else "Every row is predicted within 2 % of the allocator peak or above it.",
            "",
        ]
        if under and any("policies_predicted_from" not in m for m in d["models"] if "error" not in m):
            out += [
                "This run predicted the fixed policies (none, all, every:2, sqrt) from the profile memfit's plans "
                "use, which runs fused activations (GPT-2's tanh GELU as one kernel); the policies ran the model's "
                "own GELU, whose four saved tensors per block that profile does not see. A profile of the model's "
                "own activations predicts GPT-2's policies exactly (checked on the CPU, bf16 and float32); "
                "`gpu_check.py` now predicts them from one.",
                "",
            ]
    long = d.get("long_sequence")
    if long and "error" in long:
        out += [f"Long-sequence case (`{long['model']}`): not measured: {long['error']}", ""]
    elif long:
        out += [
            f"**Long sequence**: `{long['model']}` at {long['seq_len']} tokens, batch 1, {long['blocks']} blocks; "
            f"each block's input {mib(long['input_bytes_per_block'])}; host link measured at "
            f"{long['host_bandwidth_bytes_per_s'][0] / 1e9:.1f} GB/s to the host and "
            f"{long['host_bandwidth_bytes_per_s'][1] / 1e9:.1f} GB/s back. Every block recomputed (`all`), its inputs held in "
            "pinned host memory (`+host`: side-stream copies, prefetched one block ahead), its MLPs tiled, and memfit's "
            "plan at its least budget; verify against the unmodified model's gradients (float32).",
            "",
            "| setup | options | allocator peak | predicted | error | time vs all | verify |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in long["results"].items():
            pred = r.get("predicted_peak_bytes")
            err = f"{pred / r['allocator_peak_bytes'] - 1:+.1%}" if pred else ""
            v = r.get("verify")
            out.append(
                f"| {name} | {', '.join(r.get('options', [])) or '-'} | {mib(r['allocator_peak_bytes'])} | "
                f"{mib(pred) if pred else 'not predicted'} | {err} | {r['time_ratio_vs_all']:.2f}x | "
                + (("passed" if v["ok"] else "FAILED") + f" (max rel. error {v['max_grad_rel_err']:.1e})" if v else "")
                + " |"
            )
        out.append("")
    return out


def _recheck(row: dict) -> str:
    """A row re-measured side by side (benchmarks/autofit_recheck.py): its ratio, in brackets."""
    r = row.get("recheck")
    if not r:
        return ""
    return f" (side by side: {r['memfit_vs_best']:.0%}, {r['memfit_micro_batch']} x {r['memfit_accumulation_steps']})"


def autofit(d: dict, source: str) -> list[str]:
    out = [
        "The best measured (micro-batch, policy in none/all/sqrt/every:2"
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
        ),
        "",
        "| model | global batch | budget | best grid point | its samples/s | memfit fit | samples/s | vs best | halving | samples/s |\n|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["runs"]:
        for row in r["budgets"]:
            best, m, h = row["best_grid"], row["memfit"], row["halving"]
            out.append(
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
    out.append("")
    return out


ESTIMATE_NOTES = """Why the columns differ:

- **accelerate** (`estimate-memory`) counts the weights of `AutoModel` (the base model: an untied LM head, 0.5 B
  parameters of Llama 3 8B, is left out) in fp32 and multiplies: 4x for fp32 training with Adam (weights, gradients, two
  moments); for mixed precision it reports the *largest* single part (the Adam moments, 2x), not their sum. No
  activations, no batch or sequence length, no temporaries.
- **DeepSpeed** counts model states only: ZeRO-2 keeps bf16 weights on every GPU plus 18 B/param (bf16 and fp32
  gradients, fp32 weights, Adam) split over the GPUs; ZeRO-3 splits everything and adds 4 x the largest layer (the
  embedding or LM head here) for the gathered parameters. No activations, no logits, no temporaries.
- **memfit** runs the whole step on fake tensors: activations at the given batch and sequence length, the head (bf16
  logits, their fp32 copy and log-softmax), the optimizer's foreach temporaries (on one GPU with fp32 master weights
  they can set the peak: "optimizer step" in the table), and under FSDP2 the gathered units (root, own block,
  prefetched block, the kept reduce-scatter input). Under FSDP2 it takes torchtitan's `MixedPrecisionPolicy` as
  `--param-dtype bfloat16 --reduce-dtype float32`: fp32 parameter shards, gradient shards and AdamW state (16 B/param
  over the ranks), bf16 gathered units and activations, fp32 reduce-scatter inputs.
- **Tensors vs reserved**: memfit and FSDPMemTracker count live tensor bytes; torchtitan logs the caching allocator's
  reserved peak, which adds block rounding, cuBLAS/NCCL workspaces, memory cached for FSDP2's all-gather and
  reduce-scatter streams, and fragmentation (the "published / tracker" column). memfit's allocator model
  (`memfit.estimation.allocator`) adds only what is known without the allocation order (cuBLAS workspaces, whole
  2 MiB segments): a lower bound of the reserve.
- **Not modelled**: torch.compile (its fused kernels keep fewer temporaries) and Float8 linears (fp8 copies of weights
  and activations, scales); context parallelism. The selective op policy enters memfit's FSDP2 number through
  one-GPU estimates (the forward/backward peak with the policy minus the one with full AC), because the per-rank
  accounting takes estimated stats with keep/recompute options only.
"""


def _peak(e: dict) -> str:
    return gib(e["peak_bytes"]) + (" (optimizer step)" if e.get("peak_phase") == "optimizer" else "")


def estimate_compare(d: dict, source: str) -> list[str]:
    out = [
        f"One training step: {d['setting']}; memfit's peaks are live tensor bytes on the device (`{d['device']}` kernels). "
        "accelerate's numbers come from its own functions (`calculate_maximum_sizes`, `estimate_training_usage`) on the "
        "model its `estimate-memory` command builds; DeepSpeed's from `estimate_zero2/zero3_model_states_mem_needs` "
        f"(deepspeed {d['deepspeed'].get('version', 'not run')}, no offload)."
        + "".join(
            f" memfit's FSDP2 columns and the small-Llama FSDPMemTracker table re-run {r['date']} (`{r['command']}`, {r['machine']})."
            for r in d.get("reruns", [])[-1:]
        ),
        "",
        '| model | batch x tokens | params | accelerate "Training using Adam" (float32 / float16 row) | DeepSpeed ZeRO-2, 1 / 8 GPUs | '
        "ZeRO-3, 8 GPUs | memfit params+grads+optimizer | memfit peak, 1 GPU, no AC / full AC | memfit FSDP2 x8 rank 0 (bf16/fp32 MixedPrecisionPolicy), no AC / full AC |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
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
        out.append(
            f"| {m['name']} | {m['batch']} x {m['seq_len']} | {m['n_params'] / 1e9:.2f} B | "
            f"{gib(acc['float32']['training_using_adam_bytes'])} / {gib(acc['bfloat16']['training_using_adam_bytes'])} | {ds2} | {ds3} | "
            f"{gib(states)} | {_peak(one['none'])} / {_peak(one['all'])} | {fsdp} |"
        )
    if d.get("tracker_small"):
        r0 = d["tracker_small"][0]
        out.append(
            f"\n**torch's FSDPMemTracker against memfit's per-rank prediction** (rank 0 of {r0['world_size']}, fake process "
            f"group, real tensors, fp32, `{r0['model']}`, batch {r0['batch']}):\n"
        )
        out.append("| plan | FSDPMemTracker peak | memfit predicted | difference |\n|---|---|---|---|")
        for r in d["tracker_small"]:
            t = r["fsdp_mem_tracker"]
            got = mib(t["peak_bytes"]) if "peak_bytes" in t else t.get("not_run", "not run")
            pred = mib(r["memfit_peak_bytes"]) if "memfit_peak_bytes" in r else "not run"
            diff = "-"
            if "memfit_vs_tracker" in r:
                diff = f"{r['memfit_peak_bytes'] - t['peak_bytes']:+,} B ({r['memfit_vs_tracker'] * 100:+.2f} %)"
            out.append(f"| {r['policy']} | {got} | {pred} | {diff} |")
    if d.get("published"):
        out.append(
            "\n**Published per-GPU memory** (torchtitan `docs/performance.md`, 8 x H100 96 GB; torchtitan logs "
            '`torch.cuda.memory_stats()["reserved_bytes.all.peak"]`, the allocator\'s reserve). FSDPMemTracker ran '
            "the same job on fake tensors (HF `LlamaForCausalLM`, torchtitan's AC wrapping and "
            "`MixedPrecisionPolicy`):\n"
        )
        out.append(
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
            out.append(
                f"| {p['source']} | {p['setting']} | {p['published_gib']:.1f} GiB | {got} | {pub_vs} | {pred} | {ours_vs} | {p['not_modelled']} |"
            )
    out += ["", ESTIMATE_NOTES]
    return out


def compile_head_to_head(d: dict, source: str) -> list[str]:
    first, second = d["setups"]
    out = [
        f"`{d['model']}`, batch {d['batch_size']}, {d['rounds']} interleaved rounds; peaks by the profiler. "
        f"{first} / {second}, median of the per-round ratios: **{d['ratio_median']:.3f}x**; "
        f"the first faster in {d['rounds_first_faster']} of {d['rounds']} rounds.",
        "",
        "| set-up | peak (profiler) | time vs none | step | compile |\n|---|---|---|---|---|",
    ]
    for name in d["setups"]:
        r = d["rows"][name]
        out.append(
            f"| {name} | {mib(r['profiler_peak_bytes'])} | {r['time_ratio']:.3f}x | {r['step_s'] * 1e3:.0f} ms | {r['compile_s']:.0f} s |"
        )
    if d.get("first_plan"):
        p = d["first_plan"]
        recomputed = sum(b.get("option", b.get("action")) != "keep" for b in p["blocks"])
        out.append(
            f"\nThe first set-up runs memfit's plan (`--first-plan`, the plan the compiled mode chose): policy "
            f"`{p['policy']}`, {recomputed} of {len(p['blocks'])} blocks recomputed, head `{p.get('head')}`, activations "
            f"`{p.get('activations')}`, budget {mib(p['budget_bytes'])}, predicted peak {mib(p['predicted_peak_bytes'])}."
        )
    out.append("\nPer-round ratios: " + ", ".join(f"{x:.3f}" for x in d["per_round"]) + ".")
    out.append("")
    return out


def compiled_mode(d: dict, source: str) -> list[str]:
    out = [
        f"Budget {mib(d['budget_bytes'])} ({d['budget_bytes']:,} B); chosen: **{d['chosen']}**. {d['note']}.",
        "",
        "| candidate | fraction | peak (profiler) | fits | compile | step | time vs the compiler's own |\n|---|---|---|---|---|---|---|",
    ]
    for c in d["candidates"]:
        fits = "yes" if c["peak_bytes"] is not None and c["peak_bytes"] <= d["budget_bytes"] else "no"
        step = f"{c['step_s'] * 1e3:.0f} ms" if c["step_s"] is not None else "-"
        vs = f"{c['time_vs_compiler']:.3f}x" if c["time_vs_compiler"] is not None else "-"
        out.append(
            f"| {c['name']} | {c['activation_memory_budget']:g} | {mib(c['peak_bytes'])} ({c['peak_bytes']:,} B) | {fits} | "
            f"{c['compile_s']:.0f} s | {step} | {vs} |"
        )
    out.append("")
    return out


def deep_targets(d: dict, source: str) -> list[str]:
    out = [
        f"Machine: {_public(d['machine'].get('note', ''))}. `all` recomputes every block; memfit plans at its minimum budget "
        "and at `all`'s measured peak. Peaks measured by the tracker.",
        "",
        "| model | batch | `all` measured | memfit minimum: measured | vs `all` | its peak event | time vs `all` "
        "| memfit at `all`'s peak | time vs `all` | code |\n|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        me = r["measured"]
        mn, at = me["memfit@min"], me["memfit@all_peak"]
        out.append(
            f"| {r['model']} | {r['batch_size']} | {mib(me['all']['peak_bytes'])} | {mib(mn['peak_bytes'])} | "
            f"{mn['peak_bytes'] / me['all']['peak_bytes'] - 1:+.1%} | {r['plans']['memfit@min']['peak_event']} | "
            f"{mn['time_vs_all']:.2f}x | {mib(at['peak_bytes'])} | {at['time_vs_all']:.2f}x | {r.get('commit', '')} |"
        )
    out.append("")
    return out


def accumulation(d: dict, source: str) -> list[str]:
    cases = list(next(iter(d["anchors"].values())))
    out = [
        "GPT2LMHeadModel (2 layers, width 64), float64, global batch 16 in micro-batches of 4 "
        "(`benchmarks/accumulation.py`'s set-up); "
        f"torch {d['torch']}, {d['threads']} thread(s), "
        + ", ".join(f"{k} {v}" for k, v in d["versions"].items())
        + ". Each cell: max relative error / relative L2 error / best-fit gradient scale, against one pass over the "
        "whole batch.",
        "",
        "| loop | " + " | ".join(cases) + " |",
        "|---|" + "---|" * len(cases),
    ]
    for name, by_case in d["anchors"].items():
        cells = [
            f"{c['max_grad_rel_err']:.2g} / {c['grad_rel_l2_err']:.2g} / {c['grad_scale']:.3f}"
            for c in by_case.values()
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += [
        "",
        "memfit's Accumulator against the same exact loop written by hand (median of per-pair ratios):",
        "",
        "| workload | global batch | micro-batch x steps | pairs | by hand | memfit | overhead | per step |\n"
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in d["overhead"]:
        out.append(
            f"| {o['workload']} | {o['global_batch']} | {o['micro_batch']} x {o['micro_steps']} | {o['pairs']} | "
            f"{o['hand_written_step_s'] * 1e3:.1f} ms | {o['memfit_step_s'] * 1e3:.1f} ms | {o['overhead_ratio_median']:+.1%} | "
            f"{o['overhead_per_step_us']:.0f} us |"
        )
    out.append("")
    return out


def comm_gloo(d: dict, source: str) -> list[str]:
    f = d["fitted"]
    out = [
        f"{d['world_size']} processes, torch {d['torch']}, medians of {d['repeats']} repeats. The model's link is fitted "
        f"to the {f['fitted_on']} rows: {f['bus_bytes_per_s'] / 1e9:.2f} GB/s bus bandwidth, {f['latency_s'] * 1e3:.2f} ms "
        "latency. gloo has no ring reduce-scatter (it all-reduces the whole input), so the `gloo model` column models "
        "what gloo runs; the comparison is a shape check, not a fit of NCCL.",
        "",
        "| collective | size | measured | ring model | gloo model |\n|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['collective']} | {mib(r['size_bytes'])} | {r['measured_s'] * 1e3:.2f} ms | {r['model_s'] * 1e3:.2f} ms | "
            f"{r['gloo_model_s'] * 1e3:.2f} ms |"
        )
    out += ["", "Fitted to each collective alone:", "", "| collective | bus bandwidth | latency |\n|---|---|---|"]
    for name, e in d["fitted_each"].items():
        out.append(f"| {name} | {e['bus_bytes_per_s'] / 1e9:.3f} GB/s | {e['latency_s'] * 1e3:.2f} ms |")
    out.append("")
    return out


def soak(d: dict, source: str) -> list[str]:
    out = [
        f"The fit chose {d['micro_batch']} x {d['accumulation_steps']} with {d['recomputed_blocks']} blocks recomputed "
        f"(budget {d['budget_bytes']:,} B); {d['optimizer_steps']} optimizer steps, {d['skipped_steps']} skipped, "
        f"{d['replans']} replans, median step {d['median_step_s'] * 1e3:.0f} ms, {d['wall_s']:.0f} s in all. "
        f"Tracked peak growth: {d['tracked_peak_growth_bytes']:,} B; RSS growth {d['rss_growth_bytes'] / 2**20:.1f} MiB.",
        "",
        "| steps | tracked peak (max) | process RSS | loss | skipped |\n|---|---|---|---|---|",
    ]
    for r in d["intervals"]:
        out.append(
            f"| {r['steps']} | {r['tracked_peak_bytes']:,} B | {r['rss_bytes'] / 2**20:.1f} MiB | {r['loss']:.2f} | {r['skipped']} |"
        )
    out.append("")
    return out


def solver_timing(d: dict, source: str) -> list[str]:
    c = d["cpu_copy_bytes_per_s"]
    out = [
        f"{d['repeats']} solve(s) per budget; CPU seconds beside wall seconds (the machine is shared). CPU copy "
        f"bandwidth: device to host {c['device_to_host'] / 1e9:.1f} GB/s, host to device {c['host_to_device'] / 1e9:.1f} GB/s.",
        "",
        "Targets: " + "; ".join(f"{k}: {'met' if v else '**not met**'}" for k, v in d["targets"].items()) + ".",
        "",
        "| chain | blocks | segments | budget | solve (wall) | solve (CPU) | recomputed | segments used | nested | search |\n"
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['chain']} | {r['blocks']} | {'yes' if r['segments_allowed'] else 'no'} | {r['budget']} | "
            f"{r['solve_s']:.3f} s | {r['solve_cpu_s']:.3f} s | {r['recomputed_blocks']} | {r['segments']} | "
            f"{r['nested_segments']} | {r['search']} |"
        )
    out.append("")
    return out


def startup(d: dict, source: str) -> list[str]:
    out = [
        f"Each case in a fresh process, {d['repeats']} runs in rounds; CPU seconds (user + system, "
        f"`getrusage(RUSAGE_CHILDREN)`) beside wall seconds (the machine is shared: load average "
        f"{d['load_average_1min_after']} at the end). Python {d['python']}.",
        "",
        "| case | CPU s (median) | wall s (median) | target |\n|---|---:|---:|---|",
    ]
    for r in d["rows"]:
        met = "met" if r["ok"] else "**not met**"
        target = "" if r["target_cpu_s"] is None else f"< {r['target_cpu_s']:g} s: {met}"
        out.append(f"| `{r['case']}` | {r['cpu_s_median']:.2f} | {r['wall_s_median']:.2f} | {target} |")
    out.append("")
    return out


def allocator_check(d: dict, source: str) -> list[str]:
    lines = [
        f"`PYTORCH_CUDA_ALLOC_CONF={d.get('alloc_conf', '')}`; {d['rows'][0].get('steps', '?') if d['rows'] else '?'} steps after "
        "`torch.cuda.empty_cache()`, peaks reset.",
        "",
        "| model | policy | tracker peak | max allocated | max reserved | replay of the measured stream | error | "
        "fake-step estimate | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        if "error" in r:
            lines.append(f"| `{r['model']}` | {r['policy']} | {r['error']} | | | | | | |")
            continue
        m, rep, est = r["measured"], r["replay_of_measured_stream"], r.get("fake_step_estimate", {})
        lines.append(
            f"| `{r['model']}` | {r['policy']} | {mib(m['tracker_peak_bytes'])} | {mib(m['max_memory_allocated'])} | "
            f"{mib(m['max_memory_reserved'])} | {mib(rep['max_reserved_bytes'])} | {r['reserved_error_replay']:+.1%} | "
            f"{mib(est.get('predicted_reserved_bytes', 0))} | {r['reserved_error_estimate']:+.1%} |"
        )
    return lines


def allocator_recorded(d: dict, source: str) -> list[str]:
    def err(pred: int, rec: int | None) -> str:
        return "" if not rec else f"{pred / rec - 1:+.1%}"

    lines = [
        "Recorded: the tracker's live-tensor peak and `torch.cuda.max_memory_allocated` (peaks reset before the step). "
        "Estimated here: the fake step's tensor peak, and its allocations replayed through the allocator model with "
        "two cuBLAS workspaces (predicted allocated and reserved). Bound: the model from the recorded tracker peak "
        "alone (peak + workspaces). `memfit@B` plans are solved again here on estimated stats; equal tensor peaks say "
        "the plans agree.",
        "",
        "| source | model | plan | dtype | tracker peak (rec.) | tensor peak (est.) | max allocated (rec.) | "
        "predicted allocated | error | bound | error | predicted reserved |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gaps, errs, before, mismatched = [], [], [], 0
    for r in d["rows"]:
        rec, est, bound = r["recorded"], r["estimate"], r["from_recorded_tracker_peak"]
        alloc = rec["max_memory_allocated"]
        lines.append(
            f"| {r['source']} | `{r['model']}` | {r['plan']} | {r['dtype']} | {mib(rec['tracker_peak_bytes'])} | "
            f"{mib(est['tensor_peak_bytes'])} | {mib(alloc) if alloc else 'not recorded'} | "
            f"{mib(est['predicted_allocated_bytes'])} | {err(est['predicted_allocated_bytes'], alloc)} | "
            f"{mib(bound['predicted_allocated_bytes'])} | {err(bound['predicted_allocated_bytes'], alloc)} | "
            f"{mib(est['predicted_reserved_bytes'])} |"
        )
        if not alloc:
            continue
        if abs(est["tensor_peak_bytes"] / rec["tracker_peak_bytes"] - 1) > 0.01:  # another plan than the run's
            mismatched += 1
            continue
        ws, replay = est["workspace_bytes"], est["predicted_allocated_bytes"]
        gaps.append((alloc - rec["tracker_peak_bytes"], ws, replay - est["tensor_peak_bytes"] - ws, alloc - replay))
        errs.append(replay / alloc - 1)
        before.append(rec["allocated_before_step_bytes"] - est["start_bytes"] - ws)
    if gaps:

        def span(values: list[float]) -> str:
            return f"{min(values) / 2**20:.1f} to {max(values) / 2**20:.1f} MiB"

        lines += [
            "",
            f"Over the {len(gaps)} recorded rows whose plan was estimated as it ran (tensor peaks within 1 %; "
            f"{mismatched} row{'s' if mismatched != 1 else ''} left out), `max_memory_allocated` is "
            f"{span([g[0] for g in gaps])} above the tracker's peak. The model puts {mib(gaps[0][1])} of it in the two "
            f"cuBLAS workspaces and {span([g[2] for g in gaps])} in 512 B rounding and blocks handed out whole (the "
            f"replay); {span([g[3] for g in gaps])} is left unexplained, and {span(before)} of it is allocated before "
            "the step already (recorded allocated before the step, less the estimate's parameters, optimizer state "
            f"and batch and the workspaces): held through the step, not made by it. Predicted allocated against "
            f"recorded: {min(errs):+.1%} to {max(errs):+.1%}. Reserved memory was not recorded in these runs.",
        ]
    cpu = [r for r in d["rows"] if "cpu_replay" in r]
    if cpu:
        lines += [
            "",
            "The same step run here on the CPU (its tracker stream replayed through the model for the recorded GPU): "
            "the CPU's kernels allocate differently where they differ from CUDA's (attention with dropout takes the "
            "math path here), which the tracker peak beside the recorded one shows.",
            "",
            "| model | plan | tracker peak here | tracker peak (rec.) | replay allocated | max allocated (rec.) | error |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in cpu:
            c, rec = r["cpu_replay"], r["recorded"]
            lines.append(
                f"| `{r['model']}` | {r['plan']} | {mib(c['tracker_peak_bytes'])} | {mib(rec['tracker_peak_bytes'])} | "
                f"{mib(c['max_allocated_bytes'])} | {mib(rec['max_memory_allocated']) if rec['max_memory_allocated'] else 'not recorded'} | "
                f"{err(c['max_allocated_bytes'], rec['max_memory_allocated'])} |"
            )
    return lines


def allocator_reserved_budget(d: dict, source: str) -> list[str]:
    lines = [
        "| model | budget | budget means | predicted peak | predicted reserved | max allocated | max reserved | within |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        if "error" in r:
            lines.append(f"| `{r['model']}` | {r['error']} | | | | | | |")
            continue
        for meaning in ("live", "reserved"):
            m = r[meaning]
            lines.append(
                f"| `{r['model']}` | {mib(r['budget_bytes'])} | {meaning} | {mib(m['predicted_peak_bytes'])} | "
                f"{mib(m['predicted_reserved_bytes'])} | {mib(m['max_memory_allocated'])} | "
                f"{mib(m['max_memory_reserved'])} | {'yes' if m['reserved_within_budget'] else 'NO'} |"
            )
    return lines


def published_runs(d: dict, source: str) -> list[str]:
    def pct(x: float | None) -> str:
        return "" if x is None else f"{x:+.1%}"

    lines = ["## The runs", ""]
    for s in d["sources"].values():
        lines.append(
            f"- `{s['repo']}` `{s['path']}` at `{s['commit'][:12]}`: {s['hardware']}; {s['software']}; memory: {s['memory']}."
        )
    lines += [
        "",
        "| run | published table | model | GPUs | local batch x tokens | activation checkpointing (memfit policy) | device in memfit |",
        "|---|---|---|---:|---|---|---|",
    ]
    for r in d["runs"]:
        lines.append(
            f"| {r['id']} | {r['table']} | {r['model']} | {r['world']} | {r['batch']} x {r['seq']} | {r['ac']} (`{r['policy']}`) | "
            f"{r['device']} |"
        )
    lines += [
        "",
        "All runs: FSDP2 on every block and the root, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fp32 "
        "parameters and AdamW, no torch.compile, no Float8 (the rows that use them are listed below, not predicted).",
        "",
        "## Memory per GPU",
        "",
        "| run | published (reserved) | memfit live tensors (peak event) | memfit reserved | = peak + workspaces + one-process cache (the rank's model states) + collective streams' pools | error (reserved) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in d["runs"]:
        p = r["prediction"]
        if "allocator" not in p:
            continue
        a = p["allocator"]
        parts = a["parts"]
        published = (
            f"{r['published_gib']} GiB"
            if r.get("published_gib")
            else f"not reported; trained in {r['trained_in_gib']} GiB cards"
        )
        error = (
            pct(r["reserved_error"])
            if "reserved_error" in r
            else ("fits" if r.get("fits_where_it_trained") else "DOES NOT FIT")
        )
        lines.append(
            f"| {r['id']} | {published} | {gib(p['predicted_peak_bytes'])} ({p['peak_event']}) | "
            f"{gib(a['predicted_reserved_bytes'])} | {gib(parts['rank_peak_bytes'])} + {gib(parts['cublas_workspaces_bytes'])} + "
            f"{gib(parts['one_process_cached_bytes'])} + {gib(parts['collective_stream_pools_bytes'])} | {error} |"
        )
    cal = d["calibrated_mfu"]
    lines += [
        "",
        "## Tokens per second per GPU",
        "",
        "Calibrated utilisation (mfu, on the FLOPs memfit counts, recompute included): "
        + "; ".join(
            f"{k}: {v['mfu']:.3f} from `{v['run']}` ({v.get('on', 'compute + exposed communication')})"
            for k, v in cal.items()
        )
        + ". The calibrating run matches by construction (on what it was calibrated on); the others check it. "
        "'Compute only' leaves the communication out (hidden behind compute).",
        "",
        "| run | role | published | memfit at the calibrated mfu | error | compute only | error | memfit at mfu 0.4 | error | "
        "mfu that matches it (with communication / compute only) | exposed communication |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]

    def m3(x: float | None) -> str:
        return "none up to 1" if x is None else f"{x:.3f}"

    for r in d["runs"]:
        p = r["prediction"]
        c, f = p.get("at_calibrated_mfu", {}), p["at_mfu_0.4"]
        lines.append(
            f"| {r['id']} | {r['role']} | {r['published_tps']:,} | {c.get('tokens_per_s_per_gpu', 0):,.0f} | {pct(r.get('tps_error'))} | "
            f"{c.get('tokens_per_s_per_gpu_compute_only', 0):,.0f} | {pct(r.get('tps_error_compute_only'))} | "
            f"{f['tokens_per_s_per_gpu']:,.0f} | {pct(r['tps_error_at_mfu_0.4'])} | "
            f"{m3(p.get('mfu_matching_published'))} / {m3(p.get('mfu_matching_published_compute_only'))} | "
            f"{c.get('exposed_comm_s', 0) * 1e3:.0f} ms |"
        )
    lines += ["", "## Published runs memfit does not model", "", "| device | run | not modelled |", "|---|---|---|"]
    lines += [f"| {n['device']} | {n['run']} | {n['why']} |" for n in d["not_modelled"]]
    return lines


def model_states(d: dict, source: str) -> list[str]:
    out = [
        f"`{d['model']}`, batch {d['batch_size']}, {d['optimizer']}, float32, measured on this CPU (the live-tensor "
        "tracker). Per placement: the model profiled with it (keep and recompute per block, the chunked head, fused "
        "activations), the plan at the planner's minimum budget, then one steady-state step of that plan with the "
        "placement's optimizer.",
        "",
        "| placement | minimum budget | predicted peak | measured peak | predicted / measured - 1 | peak event | "
        "gradients after the backward |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in d.get("peaks", {}).items():
        out.append(
            f"| {name} | {mib(r['min_budget_bytes'])} | {mib(r['predicted_peak_bytes'])} | {mib(r['measured_peak_bytes'])} | "
            f"{r['error']:+.2%} | {r['peak_event']} | {mib(r['grads_bytes_after_backward'])} |"
        )
    peaks = d.get("peaks", {})
    if "device" in peaks and "step-in-backward" in peaks:
        dev, sib = peaks["device"]["measured_peak_bytes"], peaks["step-in-backward"]["measured_peak_bytes"]
        saved = f"{mib(dev - sib)} ({sib / dev - 1:+.1%})"
        out += ["", f"The step inside the backward lowers the least plan's measured peak by {saved}."]
    e = d.get("equality")
    if e:
        pa, pp = e["placement_alone"], e["against_plain"]
        out += [
            "",
            f"After {e['steps']} AdamW steps (lr {e['lr']:g}) from the same weights and batches: "
            f"{pa['tensors_compared']}.",
            "",
            "| compared | bitwise equal | max relative error | max parameter difference |",
            "|---|---|---|---|",
            f"| the plan stepping in the backward vs the same plan with plain AdamW | {pa['bitwise_equal']} | "
            f"{pa['max_rel_err']:.3g} | {pa['max_param_abs_err']:.3g} |",
            f"| the plan stepping in the backward vs the unmodified model with plain AdamW | {pp['bitwise_equal']} | "
            f"{pp['max_rel_err']:.3g} | {pp['max_param_abs_err']:.3g} |",
            "",
            f"The second row includes the plan's own reordered sums (head {e['plan_head']}, activations "
            f"{e['plan_activations']}): gradients equal to rounding, which an AdamW step can turn into a difference of up "
            "to about lr per element and step where a gradient is near zero.",
        ]
    out.append("")
    return out


def model_states_estimate(d: dict, source: str) -> list[str]:
    b, t = d["batch"], d.get("table", {})
    out = [
        f"`{d['model']}`, batch {b[0]} x {b[1]} tokens, bf16, AdamW (its state in bf16, as torch keeps it), fake tensors "
        f"(nothing allocated). Least device peak over the policies `none` and `all`; host AdamW at "
        f"{d['host_optimizer_bytes_per_s'] / 1e9:.2f} GB/s of parameters (torch's CPU AdamW measured on this machine).",
        "",
        "| device | placement | policy | device peak | fits | host memory | step | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dev, v in t.get("devices", {}).items():
        for name, r in v["rows"].items():
            step, tps = r.get("step_s"), r.get("tokens_per_s")
            out.append(
                f"| {dev} ({mib(v['memory_bytes'])}) | {name} | {r['policy']} | {mib(r['device_peak_bytes'])} | "
                f"{'yes' if r['fits'] else 'no'} | {mib(r['host_bytes'])} | {f'{step:.2f} s' if step else '-'} | "
                f"{f'{tps:,.0f}' if tps else '-'} |"
            )
    sizes, rate = t.get("sizes", {}), d["host_optimizer_bytes_per_s"]
    if sizes:
        host_s = sizes["trainable_bytes"] / rate
        out += ["", f"Of the host placements' step, {host_s:.0f} s is torch's AdamW on the host stepping "
                f"{mib(sizes['trainable_bytes'])} of parameters at {rate / 1e9:.2f} GB/s (2 cores); it scales with the host's "
                f"rate: at 2 GB/s it would be {sizes['trainable_bytes'] / 2e9:.0f} s. The activations are those of the "
                "plain estimate (no chunked head: most of them are the head's logits)."]  # fmt: skip
    tt, alst = d["published"]["torchtune"], d["published"]["alst"]
    out += ["", f"Published: torchtune {tt['peak_gib']} GiB, {tt['tokens_per_s']:,} tokens/s ({tt['setting']}; {tt['source']}). "
            f"Not the same step: {tt['differs']}.", ""]  # fmt: skip
    rec = d.get("longest_recorded")
    if rec:
        (t1, n1), (t2, n2) = rec["points"]
        out.append(
            f"Longest sequence on one H100 with the model states on the host (host-params), within {mib(rec['budget_bytes'])}: "
            f"about {rec['seq_len']:,} tokens, by the line through the needs that `long_context.py` estimated at "
            f"{t1:,} ({mib(n1)}) and {t2:,} tokens ({mib(n2)}) for its row '{rec['source_row']}' ({rec.get('source', 'results/long_context.json')}; plan there: "
            f"{rec['plan_at_source']}), {rec['per_token_bytes'] / 1e3:.1f} KB per token; its fixed part, "
            f"{mib(rec['fixed_bytes'])}, is that row's less its parameters and optimizer state, plus what host-params keeps "
            f"on the device (the embeddings, the head, two blocks and their gradients). ALST: {alst['seq_len']:,} tokens ({alst['setting']}; {alst['source']}). "
            f"What keeps it short: {rec['limited_by']}. A line, not a search: the planner's bytes per token change "
            "with its plan at longer lengths."
        )
    se = d.get("longest_searched")
    if se:
        probes = ", ".join(
            f"{r['seq_len']:,} ({gib(r['device_peak_bytes'])}{'' if r['fits'] else ', over'})"
            for r in sorted(se["probes"], key=lambda r: r["seq_len"])
        )
        short = alst["seq_len"] - se["seq_len"]
        at = next(r for r in se["probes"] if r["seq_len"] == se["seq_len"])
        phase, share = at["peak_phase"] or "step", se["device_states_bytes"] / at["device_peak_bytes"]
        out += [
            "",
            f"**Longest sequence on one H100 with the model states on the host (host-params), searched**: "
            f"{se['seq_len']:,} tokens ({se['over_seq_len']:,} did not fit; resolution {se['resolution_tokens']:,} tokens), "
            f"{se['method']}, plan {se['plan']}, batch 1; one fake step of the 8B model per probe, "
            f"{se['search_s'] / 60:.0f} min in all on 2 shared cores. Probes (device peak): {probes}. "
            f"Model states on the device {gib(se['device_states_bytes'])} (the embeddings, the head, two blocks' "
            f"parameters and one block's gradients), on the host {gib(se['host_bytes'])}.",
            "",
            f"ALST: {alst['seq_len']:,} tokens ({alst['setting']}; {alst['source']})."
            + (
                f" memfit's search stops {short:,} tokens short. What keeps it short: activations, not model states: the "
                f"device peak grows by {se['per_token_bytes'] / 1e3:.0f} KB per token between the last fitting and the first "
                f"failing probe ({se['per_token_bytes'] / 8192:.0f} bf16 vectors of the hidden size 4096 per token; fixed part "
                f"{gib(se['fixed_bytes'])}), the activations live at the step's peak, which the fake step places in the "
                f"{phase} (every block's kept input is already on the host and the model states are {share:.0%} of the peak; this "
                f"run does not split the activations at the peak further). At that rate ALST's {alst['seq_len']:,} tokens "
                f"would need {gib(se['fixed_bytes'] + se['per_token_bytes'] * alst['seq_len'])} on the device. The budget is "
                f"the device table's {gib(se['device_memory_bytes'])} of live tensors; the allocator's reserved memory is more."
                if short > 0
                else ""
            ),
        ]
    lo = d.get("longest")
    if lo:
        if lo.get("error"):
            out.append(f"Longest sequence on one H100 (host-params): not found: {lo['error'][:300]}")
        else:
            over = f"{lo['over_seq_len']:,} tokens did not fit" if lo.get("over_seq_len") else "no longer length tried"
            out.append(
                f"Longest sequence on one H100 with the model states on the host (host-params): {lo['seq_len']:,} tokens "
                f"({over}), limited by {lo['limited_by']}; device peak {mib(lo['device_peak_bytes'])}. "
                f"ALST: {alst['seq_len']:,} tokens ({alst['setting']}; {alst['source']})."
            )
    return out


def long_context(d: dict, source: str) -> list[str]:
    out = [
        f"`{d['model']}` ({d.get('num_params', 0) / 1e6:.1f} M parameters), micro-batch {d['micro_batch']}, float32, "
        f"{ {'sgd': 'SGD with momentum', 'adamw': 'AdamW'}.get(d.get('optimizer', 'adamw'), d.get('optimizer')) }, full-length rows (no padding mask: SDPA's fused kernel). Peaks by the live-tensor tracker; lengths "
        f"are multiples of {d['step_tokens']} tokens; a baseline's longest length is measured, and so is the next "
        "step beyond it where the column says so.",
        "",
    ]
    for b in d.get("budgets", []):
        ms = b["methods"]
        hf = ms.get("HF gradient checkpointing", {}).get("seq_len") or 0
        out += [
            f"**Budget {mib(b['budget_bytes'])}**",
            "",
            "| method | longest sequence | over at | peak at it | step | per 1k tokens | vs HF checkpointing |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, m in ms.items():
            if m.get("error"):
                out.append(f"| {name} | n/a: {m['error'][:120]} | | | | | |")
                continue
            T = m.get("seq_len") or 0
            over = m.get("over_seq_len")
            step = m.get("step_s")
            at_over = next((t for t in m.get("tries", []) if t.get("seq_len") == over), None)
            how = " (predicted)" if at_over is not None and at_over.get("measured_peak_bytes") is None else ""
            out.append(
                f"| {name} | {T:,} | {f'{over:,}{how}' if over else '-'} | {mib(m['peak_bytes']) if m.get('peak_bytes') else '-'} | "
                f"{f'{step:.1f} s' if step else '-'} | {f'{step / T * 1e3:.2f} s' if step and T else '-'} | "
                f"{f'{T / hf:.1f}x' if hf and T else '-'} |"
            )
        mf = ms.get("memfit", {})
        at0 = b.get("at_hf_length")
        if at0 and ms.get("HF gradient checkpointing", {}).get("step_s"):
            out += [
                "",
                "Step times: one untracked step at each method's own length (memfit's: its measured window), taken "
                "at different moments on a shared machine whose load changed: HF's step at "
                f"{at0['seq_len']} tokens took {ms['HF gradient checkpointing']['step_s']:.2f} s during the search and "
                f"{at0['hf_step_s']:.2f} s in the interleaved comparison below, so compare times only there.",
            ]
        out += ["", f"memfit's plan at {mf.get('seq_len', 0):,} tokens: {mf.get('plan', '-')}."]
        if mf.get("attention"):
            out += ["", f"Attention (at the workload's own length): {mf['attention']}"]
        if mf.get("tries"):
            out += [
                "",
                "memfit's search (NOTE [ Longest sequence ]): each length profiled where its profile's largest step "
                "was predicted within the budget, else scaled from two profiles (NOTE [ Bounded measurement ]); "
                "*predicted longest* is where the extrapolated need met the budget before that length was tried."
                + (
                    f" `memfit {mf['command']}` took {mf['search_s']:.0f} s, peak resident memory "
                    f"{mib(mf['max_rss_bytes'])}, load average {mf['loadavg_before'][0]:.1f} before and "
                    f"{mf['loadavg_after'][0]:.1f} after on this 2-core machine."
                    if mf.get("command")
                    else ""
                ),
                "",
                "| length | stats | profile's largest step: predicted | measured | a plan needs | fits | predicted longest | measured window peak |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for t in mf["tries"]:
                how = t.get("stats", "profiled")
                if how == "scaled":
                    how = "scaled from " + ", ".join(map(str, t.get("scaled_from", [])))
                out.append(
                    f"| {t['seq_len']:,} | {how} | {mib(t['predicted_profile_peak_bytes']) if t.get('predicted_profile_peak_bytes') else '-'} | "
                    f"{mib(t['profile_peak_bytes']) if t.get('profile_peak_bytes') else '-'} | {mib(t['need_bytes'])} | {'yes' if t['fits'] else 'no'} | "
                    f"{t['predicted_seq_len'] or '-'} | {mib(t['measured_peak_bytes']) if t.get('measured_peak_bytes') else '-'} |"
                )
        rc = ms.get("every block recomputed + chunked loss", {}).get("seq_len") or 0
        at = b.get("at_hf_length")
        targets = []
        if hf and mf.get("seq_len"):
            targets.append(
                f"memfit {mf['seq_len'] / hf:.1f}x HF gradient checkpointing's length (target 8x): "
                f"{'met' if mf['seq_len'] >= 8 * hf else '**not met**'}"
            )
        if rc and mf.get("seq_len"):
            targets.append(
                f"{mf['seq_len'] / rc:.2f}x every-block recompute with a chunked loss (target 1.5x): "
                f"{'met' if mf['seq_len'] >= 1.5 * rc else '**not met**'}"
            )
        if at:
            targets.append(
                f"step time at HF's length ({at['seq_len']} tokens), memfit's plan for the budget "
                f"({at['memfit_plan']}) over HF's, median of interleaved steps: {at['ratio']:.2f}x (target at most 1.3x): "
                f"{'met' if at['ratio'] <= 1.3 else '**not met**'}"
            )
        for c in b.get("checks", []):
            if "error" in c and c["error"] is not None:
                targets.append(
                    f"{c['what']} at {c['seq_len']:,}: predicted {mib(c['predicted_peak_bytes'])}, measured "
                    f"{mib(c['measured_peak_bytes'])} ({c['error']:+.1%}; target within 2 %): "
                    f"{'met' if abs(c['error']) <= 0.02 else '**not met**'}"
                )
            elif "verify_ok" in c:
                targets.append(f"{c['what']} at {c['seq_len']:,}: {'passed' if c['verify_ok'] else '**failed**'}")
        out += ["", "Targets:", ""] + [f"- {t}" for t in targets] + [""]
    e = d.get("estimate")
    if e:
        out += [
            f"**Estimate: Llama-3.1-8B on one H100-80GB** (`{e['model']}`, bf16, AdamW, fake tensors: nothing allocated; "
            f"budget {e['budget_bytes'] / 1e9:.0f} GB; rope positions taken as Llama-3.1's llama3 x8 scaling)",
            "",
            "| setup | longest sequence | limited by | predicted peak | plan | parameters + gradients + optimizer |",
            "|---|---|---|---|---|---|",
        ]
        for label, r in e["rows"].items():
            if "error" in r:
                out.append(f"| {label} | n/a: {r['error'][:140]} | | | | |")
                continue
            fx = r.get("fixed_bytes") or {}
            fixed = sum(v for v in fx.values() if v) if fx else None
            over = f" ({r['over_seq_len']:,} does not fit)" if r.get("over_seq_len") else ""
            out.append(
                f"| {label} | {r['seq_len']:,} | {r['limited_by']}{over} | "
                f"{r['predicted_peak_bytes'] / 1e9:.1f} GB | {r['plan']} | {f'{fixed / 1e9:.1f} GB' if fixed else '-'} |"
            )
        out += [
            "| ALST, published (Bekman et al., arXiv 2506.13996): Llama-8B, one H100-80GB | 500,000 | | | tiled MLP and loss, "
            "checkpointed inputs offloaded to the host | |",
            "| plain Hugging Face pipeline, as ALST reports it (same paper) | 32,000 | | | | |",
            "",
        ]
        for label, r in e["rows"].items():
            tries = [t for t in r.get("tries", []) if t.get("need_bytes")]
            if len(tries) >= 2 and "error" not in r:
                ts = sorted(tries, key=lambda t: t["seq_len"])
                fit_ts, over_ts = [t for t in ts if t["fits"]], [t for t in ts if not t["fits"]]
                a, b2 = (fit_ts[-1], over_ts[0]) if fit_ts and over_ts else ts[-2:]
                per_token = (b2["need_bytes"] - a["need_bytes"]) / (b2["seq_len"] - a["seq_len"])
                base = b2["need_bytes"] - per_token * b2["seq_len"]
                out.append(
                    f"- {label}: a plan needs {base / 1e9:.1f} GB plus {per_token / 1e3:.0f} kB per token (the line through "
                    f"the longest estimated length that fits and the shortest that does not); at 500,000 tokens that is {(base + per_token * 5e5) / 1e9:.0f} GB."
                )
        cfg = dict(parse_qsl(e["model"].partition("?")[2]))
        layers, hidden = int(cfg.get("num_hidden_layers", 0)), int(cfg.get("hidden_size", 0))
        if any("terms" in r for r in e["rows"].values()):
            out += _long_context_terms(e["rows"], layers, hidden)
        elif layers and hidden:
            out.append(
                f"- What keeps it short: with AdamW, parameters, gradients and the two moment buffers (bf16) and the "
                "optimizer step's temporaries exceed the budget before any activation (the first row's error gives the "
                f"need); with one state buffer (SGD with momentum), the kept inputs of {layers} recomputed blocks are "
                f"{layers * hidden * 2 / 1e3:.0f} kB per token (bf16), and the rest of the per-token slope is one block's "
                "working set during its recompute and the model's own head (bf16 logits and their float32 loss: "
                "estimates take no chunked head, tiling or host-held inputs, which need measured values)."
            )
        out.append("")
    return out


def _long_context_terms(rows: dict, layers: int, hidden: int) -> list[str]:
    """What each estimated row's peak is made of, and the term that keeps it short of ALST's length."""
    gb = 1e9
    out = ["", "What the estimated peaks are made of:", ""]
    for label, r in rows.items():
        t = r.get("terms")
        if not t:
            continue
        fixed = t["params_bytes"] + t["grads_bytes"] + t["optimizer_bytes"]
        if "error" in r:
            out.append(
                f"- {label}: does not fit at 1,024 tokens. Parameters {t['params_bytes'] / gb:.1f} GB + gradients "
                f"{t['grads_bytes'] / gb:.1f} GB + optimizer state {t['optimizer_bytes'] / gb:.1f} GB = {fixed / gb:.1f} GB "
                f"before any activation, and the optimizer step peaks at {(t['optimizer_phase_peak_bytes'] or 0) / gb:.1f} GB "
                "(its multi-tensor temporaries): host-held inputs and tiling lower activations, not this. memfit keeps "
                "parameters, gradients and optimizer state on the GPU (no ZeRO offload)."
            )
            continue
        head = t.get("chunked_head_peak_bytes")
        out.append(
            f"- {label}: at {r['seq_len']:,} tokens the predicted peak {t['peak_bytes'] / gb:.1f} GB ({t['peak_event']}) is the "
            f"step's start {t['start_bytes'] / gb:.1f} GB (parameters {t['params_bytes'] / gb:.1f}, optimizer state "
            f"{t['optimizer_bytes'] / gb:.1f}) + activations the blocks hold then {t['peak_kept_bytes'] / gb:.1f} GB + "
            f"that event's working set and the gradients made so far {t['working_bytes'] / gb:.1f} GB; the head's peak is "
            f"{t['head_peak_bytes'] / gb:.1f} GB plain" + (f", {head / gb:.1f} GB chunked" if head else "") + "."
        )
    if layers and hidden:
        out.append(
            f"- One layer's kept input is {hidden * 2 / 1e3:.1f} kB per token (bf16), {layers * hidden * 2 / 1e3:.0f} kB "
            f"for {layers} layers: {layers * hidden * 2 * 5e5 / gb:.0f} GB at 500,000 tokens, which only host-held "
            "inputs take off the GPU."
        )
    out.append(
        "- ALST's single-GPU result keeps model states off the GPU: by the paper, Llama-3.1-8B's weights, gradients and Adam "
        "states take 144 GiB without offloading (bf16 with fp32 optimizer states), more than the 80 GB it trains on, and "
        "ALST runs on DeepSpeed ZeRO-3, whose CPU offload holds them in host memory. memfit does not offload parameters, "
        "gradients or optimizer state: its AdamW rows stop before any activation, and its SGD rows hold the parameters, "
        "gradients and momentum on the GPU."
    )
    return out


def measured_choice(d: dict, source: str) -> list[str]:
    def mib2(n: float) -> str:  # tiny models differ below a MiB
        return f"{n / 2**20:.2f} MiB"

    lines = [
        f"Least budget {mib2(d['min_budget_bytes'])}, no checkpointing {mib2(d['baseline_peak_bytes'])}; "
        f"batch {d['batch_size']} x {d['seq_len']} tokens.",
        "",
        *([d["note"], ""] if d.get("note") else []),
    ]
    for b in d["budgets"]:
        lines += [
            f"## Budget {mib2(b['budget_bytes'])}",
            "",
            "| candidate | predicted peak | measured peak | predicted step | measured step | vs memfit (paired) "
            "| measured / predicted |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c in b["measured_choice"]:
            kept = " (kept)" if c["label"] == b["measured_choice_chosen"] else ""
            over = "" if c["fits_budget"] else " (over)"
            lines.append(
                f"| {c['label']}{kept} | {mib2(c['predicted_peak_bytes'])} | {mib2(c['measured_peak_bytes'])}{over} | "
                f"{c['predicted_step_s'] * 1e3:.0f} ms | {c['measured_step_s'] * 1e3:.0f} ms | {c['vs_solver']:.3f}x | "
                f"{c['time_model_ratio']:.2f} |"
            )
        lines += ["", f"Kept {b['measured_choice_chosen']}: {b['measured_choice_reason']}."]
        if b.get("fastest_policy") == b["measured_choice_chosen"]:
            lines.append(f"The kept plan is {b['fastest_policy']}, the fastest fixed policy within the budget itself.")
        if "confirm" in b:
            c = b["confirm"]
            verdict = "not slower" if c["chosen_over_rival"] <= 1 else "SLOWER"
            lines.append(
                f"Confirmation ({c['rounds']} fresh paired rounds): the kept plan took {c['chosen_over_rival']:.3f}x "
                f"the time of {c['rival']}, the fastest fixed policy within the budget: {verdict}."
            )
        lines.append("")
    if len(d["budgets"]) < 3:
        lines.append(f"The run stopped after {len(d['budgets'])} of its budgets (the file keeps what ran).")
    return lines


def gpu_cli_check(d: dict, source: str) -> list[str]:
    lines = [
        f"Model `{d['model']}` at {d['seq_len']} tokens; budget {mib(d['budget_bytes'])} (least "
        f"{mib(d['min_budget_bytes'])}, no checkpointing {mib(d['baseline_peak_bytes'])}).",
        "",
        "| command | exit | seconds | device | result |",
        "|---|---:|---:|---|---|",
    ]
    for r in d["runs"]:
        cmd = " ".join(r["argv"][1:3])
        lines.append(
            f"| `{cmd}` ({r['name']}) | {r['rc']} | {r['wall_s']:.1f} | {r['json'].get('device', '-')} | "
            f"{'; '.join(r['problems']) or 'ok'} |"
        )
    return [*lines, ""]


RENDER: dict[str, Callable[[dict, str], list[str]]] = {
    "measured_choice": measured_choice,
    "gpu_cli_check": gpu_cli_check,
    "checkpoint_baselines": checkpoint_baselines,
    "frontier": frontier,
    "selective_frontier": selective_frontier,
    "autofit": autofit,
    "estimate_compare": estimate_compare,
    "gpu_check": gpu_check,
    "compile_head_to_head": compile_head_to_head,
    "compiled_mode": compiled_mode,
    "deep_targets": deep_targets,
    "accumulation": accumulation,
    "comm_gloo": comm_gloo,
    "soak": soak,
    "solver_timing": solver_timing,
    "startup": startup,
    "long_context": long_context,
    "model_states": model_states,
    "model_states_estimate": model_states_estimate,
    "published_runs": published_runs,
    "allocator_check": allocator_check,
    "allocator_recorded": allocator_recorded,
    "allocator_reserved_budget": allocator_reserved_budget,
}


# --------------------------------------------------------------------------------------------------
# Pages


def report(run: Run) -> str:
    d = run.data
    versions = [f"torch {d['torch']}"] if "torch" in d else []
    versions += [f"transformers {d['transformers']}"] if d.get("transformers") else []
    lines = [
        f"# {TITLE[run.benchmark]}",
        "",
        "<!-- generated by benchmarks/make_reports.py from benchmarks/results/"
        f"{run.source}; edit the script, not this file -->",
        "",
        WHAT[run.benchmark],
        "",
        f"- Model(s): {', '.join(f'`{m}`' for m in dict.fromkeys(run.models))}",
        f"- Hardware: {run.machine}" + (f" ({', '.join(versions)})" if versions else ""),
        f"- Date: {run.date}",
    ]
    for cmd in run.commands:
        lines.append(f"- Command: `{cmd}`")
    if run.source in COMMAND_NOW:
        lines.append(f"- The same with today's import paths: `{COMMAND_NOW[run.source]}`")
    lines += [f"- Data: [`results/{run.source}`](../results/{run.source})", ""]
    lines += RENDER[run.benchmark](d, run.source)
    return "\n".join(lines).rstrip() + "\n"


def index(runs: list[Run]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by benchmarks/make_reports.py; edit the script, not this file -->",
        "",
        "Each script here measures memfit against the anchors (torch's checkpoint, HF gradient checkpointing, "
        "torch.compile's memory budget, the frameworks' accumulation loops, other estimators) side by side in one "
        "run, prints tables and writes JSON to `results/`. Every run has a report under `reports/`, generated from "
        "its JSON:",
        "",
        "    .venv/bin/python benchmarks/make_reports.py",
        "",
        "Times on the CPU machines (2 shared cores) are medians of interleaved rounds, as ratios taken in the same "
        "process; peaks are live tensor bytes unless a report says otherwise. `results/archive/` keeps superseded "
        "runs.",
        "",
        "Runs dated before 2026-12-03 built an `hf:` spec that gives a width but no feed-forward width with "
        "memfit's former default of 1024 for it; specs are now the library's defaults plus the values given "
        "(`hf:gpt2?n_embd=64` has GPT-2's 4 x 64). To rebuild the model such a run measured, add `&n_inner=1024` "
        "(GPT-2) or `&intermediate_size=1024` (Llama) to its command's spec.",
        "",
        "| report | what it measures | model(s) | hardware | date | command to reproduce |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        models = ", ".join(f"`{m}`" for m in dict.fromkeys(run.models))
        commands = (COMMAND_NOW[run.source],) if run.source in COMMAND_NOW else run.commands
        cmd = "<br>".join(f"`{c}`" for c in commands)
        lines.append(
            f"| [{run.name.removesuffix('.md')}](reports/{run.name}) | {TITLE[run.benchmark]} | {models} | "
            f"{run.machine} | {run.date} | {cmd} |"
        )
    return "\n".join(lines) + "\n"


def runs(results: Path = RESULTS) -> list[Run]:
    found = [r for p in sorted(results.glob("*.json")) if (r := describe(p)) is not None]
    names = [r.name for r in found]
    clash = {n for n in names if names.count(n) > 1}
    if clash:
        raise ValueError(f"make_reports: two runs would write {sorted(clash)}; give them a variant in _variant")
    return sorted(found, key=lambda r: (r.benchmark, r.date, r.name))


def write(out: Path, results: Path = RESULTS) -> list[Path]:
    """Write ``out/reports/*.md`` and ``out/README.md``; remove reports whose run is gone. Returns the written files."""
    all_runs = runs(results)
    reports = out / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    written = []
    for run in all_runs:
        path = reports / run.name
        path.write_text(report(run))
        written.append(path)
    for stale in set(reports.glob("*.md")) - set(written):
        stale.unlink()
    (out / "README.md").write_text(index(all_runs))
    return [*written, out / "README.md"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE, help="folder for README.md and reports/ (default: benchmarks/)")
    args = ap.parse_args()
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
