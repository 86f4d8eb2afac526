"""Long context: the longest sequence that trains within a fixed budget, and its step time per token.

A Llama-shaped model with a real vocabulary (default 4 layers, hidden 256, vocab 32000, full-length
rows: no padding mask, so SDPA runs its fused kernel), micro-batch 1, float32, on this CPU, with SGD
with momentum by default: one state buffer, so the budget holds the parameters, their gradients, the
momentum and the activations (AdamW's second buffer adds the same fixed bytes to every method, and
its optimizer step's peak is the floor at short lengths; ``--optimizer adamw`` runs it).
At each budget, for each way of training:

- no checkpointing;
- HF ``gradient_checkpointing_enable()`` (transformers 5: ``activation_checkpointing_enable``), and
  with its ``offload=True`` (``save_on_cpu`` of each checkpointed layer's input; on a CPU the host
  is the device, so it can free nothing here);
- every block recomputed with a chunked loss (the Liger / TRL style: memfit's policy ``all`` with
  its fused linear cross-entropy head, logits never materialised);
- memfit: ``memfit fit --seq-len auto --global-batch 1 --json`` as a user runs it (a child process:
  its wall time, its peak resident memory and the machine's load are recorded, and its progress lines),
  with sequence tiling and all its block options.

The baselines' longest length: peaks measured by the live-tensor tracker at two short lengths, the
line through them predicts the longest, which is measured, then the next step of 64 tokens (or
2 %) is measured too; memfit's comes from its own search (NOTE [ Longest sequence ]), whose final
length runs one measured window. Step time per token: one untracked step at each method's own
longest length; at HF's longest length, HF and memfit's plan for the budget are timed interleaved
(medians) for the ratio. memfit's predicted peak is compared with the measured one at every length
memfit runs here, and ``verify`` (gradients against the unmodified model) runs at HF's length.

Then an estimate (fake tensors, nothing allocated): Llama-3.1-8B (bf16, AdamW) on one H100-80GB,
the longest sequence memfit predicts with its block options, with and without host-held inputs,
beside the published single-GPU results it is compared with.

    .venv/bin/python benchmarks/long_context.py [--budgets 352MiB] [--skip-estimate]

Writes benchmarks/results/long_context.json; ``benchmarks/make_reports.py`` turns it into
benchmarks/reports/long_context.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from memfit.capture.snapshot import leave_unchanged
from memfit.capture.step import StepSpec, make_optimizer, measure_step, training_step, warm_up
from memfit.fitting.budget import plan_for_budget
from memfit.fitting.seq_len import fit_seq_len
from memfit.models.registry import load_workload
from memfit.plan import Plan, policy_plan
from memfit.profiling.side_by_side import hf_gradient_checkpointing_setup, plan_setup
from memfit.units import format_bytes, parse_size
from memfit.verification.plans import verify
from memfit.workload import PositionLimit, Workload, cast_batch, with_seq_len

RESULTS = Path(__file__).parent / "results"
STEP = 64  # tokens: the lengths are multiples of it


def spec(layers: int, hidden: int) -> str:
    return (
        f"hf:llama?num_hidden_layers={layers}&hidden_size={hidden}&num_attention_heads={hidden // 64}"
        f"&intermediate_size={4 * hidden}&vocab_size=32000&padding=false&max_position_embeddings=131072&seq_len=256"
    )


# --- baselines: measured peaks and the longest length -------------------------------------------


def _no_setup(model: torch.nn.Module) -> Any:
    return lambda: None


def _recompute_chunked(model: torch.nn.Module) -> Any:
    return plan_setup(policy_plan(model, "all").with_(head="chunked"))(model)


def _hf_offload(model: torch.nn.Module) -> Any:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    return model.activation_checkpointing_disable


BASELINES = {
    "no checkpointing": _no_setup,
    "HF gradient checkpointing": hf_gradient_checkpointing_setup,
    "HF gradient checkpointing, offload=True": _hf_offload,
    "every block recomputed + chunked loss": _recompute_chunked,
}


class Runner:
    """Steps of one workload at any length, the optimizer state made once."""

    def __init__(self, wl: Workload, optimizer: str) -> None:
        self.wl = wl
        self.opt = make_optimizer(wl.model, optimizer, lr=1e-6)
        warm_up(wl.model, self.batch(64), wl.loss_fn, self.opt, seed=0)

    def batch(self, T: int) -> Any:
        torch.manual_seed(0)
        return cast_batch(with_seq_len(self.wl, T).make_batch(1))

    def peak(self, setup: Any, T: int) -> tuple[int, int]:
        """The step's peak, and the peak of its forward and backward (the part that grows with T;
        the optimizer step's peak does not)."""
        undo = setup(self.wl.model)
        try:
            mem = measure_step(self.wl.model, self.batch(T), self.wl.loss_fn, self.opt, seed=0)
        finally:
            self.opt.zero_grad(set_to_none=True)
            undo()
        phases = mem.peak_bytes_by_phase
        return mem.device_peak_bytes, max(phases.get("forward", 0), phases.get("backward", 0))

    def step_s(self, setup: Any, T: int) -> float:
        undo = setup(self.wl.model)
        try:
            batch = self.batch(T)
            t0 = time.perf_counter()
            training_step(self.wl.model, batch, self.wl.loss_fn, self.opt, seed=0)
            return time.perf_counter() - t0
        finally:
            self.opt.zero_grad(set_to_none=True)
            undo()


def longest(run: Runner, setup: Any, budget: int, say: Any) -> dict[str, Any]:
    """The longest multiple of STEP whose measured peak fits: a line through two short lengths,
    then measured at the prediction and one step beyond."""
    pts: dict[int, int] = {}
    grows: dict[int, int] = {}  # forward/backward peak: what the line is drawn through

    def at(T: int) -> int:
        if T not in pts:
            pts[T], grows[T] = run.peak(setup, T)
            say(f"  T={T}: peak {format_bytes(pts[T])} (forward/backward {format_bytes(grows[T])})")
        return pts[T]

    a, b = 128, 256
    while at(a) > budget and a > STEP:
        a, b = a // 2, a
    if at(a) > budget:
        return {"seq_len": 0, "peaks": pts, "note": f"not even {a} tokens fit"}
    for _ in range(8):
        fits = sorted(t for t, p in pts.items() if p <= budget)
        over = sorted(t for t, p in pts.items() if p > budget)
        lo, hi = fits[-1], (over[0] if over else None)
        if hi is not None and hi - lo <= max(STEP, 0.02 * lo):
            return {"seq_len": lo, "over_seq_len": hi, "peak_bytes": pts[lo], "peaks": pts}
        x = sorted(pts)[-2:] if len(pts) >= 2 else [a, b]
        at(x[0]), at(x[1])
        slope = (grows[x[1]] - grows[x[0]]) / (x[1] - x[0])
        pred = x[1] + (budget - grows[x[1]]) / max(slope, 1.0)
        T = min(max(lo + STEP, int(pred) // STEP * STEP), 4 * lo)  # at most x4 past a length that fits
        if hi is not None:
            T = min(T, hi - STEP) if T >= hi else T
            if T <= lo:
                T = (lo + hi) // 2 // STEP * STEP
        if T <= lo:
            T = lo + STEP
        if at(T) <= budget:
            nxt = T + max(STEP, int(0.02 * T) // STEP * STEP)
            at(nxt)
    fits = sorted(t for t, p in pts.items() if p <= budget)
    return {"seq_len": fits[-1], "peak_bytes": pts[fits[-1]], "peaks": pts, "note": "search stopped after 8 rounds"}


# --- one budget ------------------------------------------------------------------------------------


def bench_budget(
    wl: Workload,
    budget: int,
    say: Any,
    *,
    verify_long: bool,
    optimizer: str,
    save: Any,
    skip_baselines: bool = False,
    skip_memfit: bool = False,
    model: str,
) -> dict[str, Any]:
    out: dict[str, Any] = {"budget_bytes": budget, "methods": {}}
    with leave_unchanged(wl.model):
        run = Runner(wl, optimizer)
        for name, setup in ({} if skip_baselines else BASELINES).items():
            say(f"{format_bytes(budget)}: {name}")
            try:
                r = longest(run, setup, budget, say)
            except Exception as err:  # noqa: BLE001  (a baseline this machine cannot run: reported)
                out["methods"][name] = {"seq_len": 0, "error": f"{type(err).__name__}: {str(err)[:300]}"}
                continue
            if r["seq_len"]:
                r["step_s"] = run.step_s(setup, r["seq_len"])
                r["s_per_token"] = r["step_s"] / r["seq_len"]
            r["peaks"] = {str(k): v for k, v in sorted(r["peaks"].items())}
            out["methods"][name] = r
            save(out)  # a run stopped later keeps what it measured
    if skip_memfit:  # the baselines only (memfit's search at this budget ran on its own)
        return out
    say(f"{format_bytes(budget)}: memfit fit --seq-len auto")
    m, plan = cli_seq_len(model, budget, optimizer, say)
    out["methods"]["memfit"] = m
    save(out)
    if plan is None:
        out["checks"] = []
        return out
    res_T = m["seq_len"]
    checks = [_predicted_vs_measured(m["predicted_peak_bytes"], m["peak_bytes"], res_T, "fit window")]
    if verify_long:
        say(f"  verify at {res_T}")
        v = verify(
            with_seq_len(wl, res_T),
            plan,
            step=StepSpec(batch_size=1, dtype=torch.float32, optimizer=optimizer, repeats=1),
        )
        checks.append({"seq_len": res_T, "verify_ok": v.ok, "what": "verify (float32)"})
    # at HF's own longest length: memfit's plan for the budget beside HF, timed interleaved
    hf_T = out["methods"].get("HF gradient checkpointing", {}).get("seq_len")
    if hf_T:
        say(f"  at HF's length {hf_T}: memfit's plan, timed beside HF")
        wl_hf = with_seq_len(wl, hf_T)
        pres = plan_for_budget(wl_hf, budget, step=StepSpec(batch_size=1, optimizer=optimizer, repeats=1))
        with leave_unchanged(wl.model):
            run = Runner(wl, optimizer)
            peak, _ = run.peak(plan_setup(pres.plan), hf_T)
            checks.append(_predicted_vs_measured(pres.plan.predicted_peak_bytes, peak, hf_T, "plan at HF's length"))
            hf_s, mf_s = [], []
            for _ in range(3):
                hf_s.append(run.step_s(hf_gradient_checkpointing_setup, hf_T))
                mf_s.append(run.step_s(plan_setup(pres.plan), hf_T))
        v = verify(wl_hf, pres.plan, step=StepSpec(batch_size=1, optimizer=optimizer, repeats=1))
        checks.append({"seq_len": hf_T, "verify_ok": v.ok, "what": "verify (float64)"})
        out["at_hf_length"] = {
            "seq_len": hf_T,
            "hf_step_s": statistics.median(hf_s),
            "memfit_step_s": statistics.median(mf_s),
            "ratio": statistics.median(b / a for a, b in zip(hf_s, mf_s, strict=True)),
            "memfit_plan": _plan_summary(pres.plan),
        }
    out["checks"] = checks
    return out


def cli_seq_len(model: str, budget: int, optimizer: str, say: Any) -> tuple[dict[str, Any], Any]:
    """``memfit fit --seq-len auto`` as a user runs it (a child process, its progress lines on stderr):
    the answer, the search's wall time, the child's peak resident memory and the machine's load."""
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "plan.json"
        cmd = [str(Path(sys.executable).with_name("memfit")), "fit", "--model", model, "--budget", f"{budget // 2**20}MiB",
               "--global-batch", "1", "--seq-len", "auto", "--optimizer", optimizer, "--out", str(plan_file), "--json"]  # fmt: skip
        load0, t0 = os.getloadavg(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        assert proc.stderr is not None and proc.stdout is not None
        for line in proc.stderr:  # one line per length tried
            lines.append(line.rstrip())
            say("  " + line.rstrip())
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        m: dict[str, Any] = {
            "command": " ".join(c if c.isidentifier() or c.startswith("-") else repr(c) for c in cmd[1:]),
            "search_s": time.perf_counter() - t0,
            "max_rss_bytes": usage.ru_maxrss * 1024,
            "loadavg_before": load0,
            "loadavg_after": os.getloadavg(),
            "returncode": proc.returncode,
            "progress": lines,
        }
        if proc.returncode != 0:
            return {"seq_len": 0, "error": (lines[-1] if lines else stdout)[-300:], **m}, None
        d = json.loads(stdout)
        plan = Plan.load(plan_file)
    m |= {
        "seq_len": d["seq_len"],
        "over_seq_len": d["seq_len_search"]["upper_seq_len"],
        "limited_by": d["seq_len_search"]["limited_by"],
        "peak_bytes": d["measured_peak_bytes"],
        "predicted_peak_bytes": d["predicted_peak_bytes"],
        "tries": d["seq_len_search"]["tries"],
        "plan": _plan_summary(plan),
        "attention": f"memory {(d.get('attention') or {}).get('memory')} in the sequence",
    }
    if d.get("measured_samples_per_s"):
        m["step_s"] = 1.0 / d["measured_samples_per_s"]
        m["s_per_token"] = m["step_s"] / d["seq_len"]
    return m, plan


def _predicted_vs_measured(pred: int | None, meas: int | None, T: int, what: str) -> dict[str, Any]:
    err = None if not pred or not meas else (pred - meas) / meas
    return {"seq_len": T, "what": what, "predicted_peak_bytes": pred, "measured_peak_bytes": meas, "error": err}


def _plan_summary(plan: Any) -> str:
    opts: dict[str, int] = {}
    for b in plan.blocks:
        name = b.option.value + (f":tiles-{b.tiles}" if getattr(b, "tiles", None) else "")
        name += ":host" if getattr(b, "host_input", False) else ""
        opts[name] = opts.get(name, 0) + 1
    head = f", head {plan.head}" if plan.head else ""
    return ", ".join(f"{n} x{k}" for n, k in opts.items()) + head


# --- the estimate ----------------------------------------------------------------------------------

LLAMA_8B = (
    "hf:llama?num_hidden_layers=32&hidden_size=4096&num_attention_heads=32&num_key_value_heads=8"
    "&intermediate_size=14336&vocab_size=128256&max_position_embeddings=131072&padding=false&seq_len=1024"
)


def bench_estimate(say: Any, budget: int, only: str | None = None) -> dict[str, Any]:
    from memfit.estimation import estimate_stats, load_fake_workload, stats_fn

    wl = load_fake_workload(LLAMA_8B, dtype=torch.bfloat16)
    # Llama-3.1's rope: llama3 scaling x8 over 8192 original positions (a spec cannot carry the dict)
    wl = dataclasses.replace(wl, positions=PositionLimit(max_positions=131072, kind="rope", rope_scaling="llama3 x8"))
    rows = {}
    for label, host, optimizer in (
        ("memfit, AdamW, inputs on the GPU", False, "adamw"),
        ("memfit, AdamW, inputs held on the host", True, "adamw"),
        ("memfit, SGD with momentum (one state buffer, half of AdamW's), inputs on the GPU", False, "sgd"),
        ("memfit, SGD with momentum, inputs held on the host", True, "sgd"),
    ):
        if only is not None and only not in label:
            continue
        say(f"estimate: Llama-3.1-8B on h100-sxm, {label}")
        t0 = time.perf_counter()

        def estimator(w: Workload, host: bool = host, optimizer: str = optimizer) -> Any:
            # every block option memfit estimates: tiling and the chunked head; host-held inputs in the host rows
            return stats_fn(w, device="h100-sxm", step=StepSpec(optimizer=optimizer), host_inputs=host)

        try:
            res = fit_seq_len(
                wl, budget, multiple=1024, tolerance=0.05, max_tries=5, estimate=estimator, measure=False,
                progress=lambda s: say("  " + s),
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001  (an option the estimate cannot take: reported, not hidden)
            rows[label] = {
                "error": f"{type(err).__name__}: {str(err)[:300]}",
                "min_budget_bytes": getattr(err, "min_budget_bytes", None),
                # what needs it: the fixed bytes and the optimizer step (one fake step, every block kept)
                "terms": _terms(
                    estimate_stats(
                        with_seq_len(wl, 1024),
                        device="h100-sxm",
                        step=StepSpec(optimizer=optimizer, batch_size=1),
                        options=("keep",),
                        heads=False,
                        tiling=False,
                        host_inputs=False,
                    )
                ),
            }
            continue
        st = res.fit.profiles.get(res.fit.micro_batch)
        rows[label] = {
            "seq_len": res.seq_len,
            "over_seq_len": res.upper_seq_len,
            "limited_by": res.limited_by,
            "predicted_peak_bytes": res.fit.predicted_peak_bytes,
            "plan": _plan_summary(res.fit.plan),
            "tries": [t.to_dict() for t in res.tries],
            "fixed_bytes": None
            if st is None
            else {"params": st.params_bytes, "grads": st.grads_bytes, "optimizer": st.optimizer_bytes},
            "warnings": list(res.warnings),
            "search_s": time.perf_counter() - t0,
            "terms": None if st is None else _terms(st, res.fit.plan),
        }
    return {"model": LLAMA_8B, "device": "h100-sxm", "budget_bytes": budget, "dtype": "bfloat16", "rows": rows}


def _terms(st: Any, plan: Any = None) -> dict[str, Any]:
    """What a step's peak is made of: the fixed bytes, the optimizer step's peak, and for ``plan`` its
    predicted peak split into the step's start (parameters, optimizer state, batch), the activations blocks
    hold at the peak event (``peak_kept_bytes``) and the rest (that event's working set: a block's recompute
    and backward, or the head, with the gradients made so far)."""
    from memfit.plan.costmodel import ChainCosts, predict

    out: dict[str, Any] = {
        "params_bytes": st.params_bytes,
        "grads_bytes": st.grads_bytes,
        "optimizer_bytes": st.optimizer_bytes,
        "optimizer_phase_peak_bytes": st.peak_bytes_by_phase.get("optimizer"),
        "head_peak_bytes": st.head_peak_bytes,
        "chunked_head_peak_bytes": st.head_options["chunked"].head_peak_bytes if "chunked" in st.head_options else None,
    }
    if plan is not None:
        pred = predict(ChainCosts.from_stats(st, margin=0.0), plan)
        out |= {
            "peak_bytes": pred.peak_bytes,
            "peak_event": pred.peak_event,
            "start_bytes": st.start_bytes,
            "peak_kept_bytes": pred.peak_kept_bytes,
            "working_bytes": pred.peak_bytes - st.start_bytes - pred.peak_kept_bytes,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", nargs="+", default=["200MiB"])
    ap.add_argument(
        "--optimizer", default="sgd", help="the step's optimizer (default sgd, with momentum: one state buffer)"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--skip-estimate", action="store_true")
    ap.add_argument("--skip-measured", action="store_true")
    ap.add_argument("--skip-baselines", action="store_true", help="memfit's search only (no baseline lengths)")
    ap.add_argument(
        "--skip-memfit",
        action="store_true",
        help="the baselines only: memfit's search, a timed run of its own, is run apart (--skip-baselines) on a quiet machine",
    )
    ap.add_argument("--estimate-rows", help="estimate only the rows whose label contains this text")
    ap.add_argument("--verify-long", action="store_true", help="also verify memfit's plan at its longest length")
    ap.add_argument("--out", default=str(RESULTS / "long_context.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {text}", flush=True)

    model = spec(args.layers, args.hidden)
    report: dict[str, Any] = {
        "benchmark": "long_context",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "command": f"python benchmarks/long_context.py --budgets {' '.join(args.budgets)} --optimizer {args.optimizer}"
        + (" --skip-baselines" if args.skip_baselines else "")
        + (" --skip-memfit" if args.skip_memfit else ""),
        "optimizer": args.optimizer,
        "model": model,
        "micro_batch": 1,
        "step_tokens": STEP,
    }
    if not args.skip_measured:
        wl = load_workload(model)
        report["num_params"] = sum(p.numel() for p in wl.model.parameters())
        report["budgets"] = []
        for b in args.budgets:

            def save(part: dict[str, Any]) -> None:
                Path(args.out).write_text(
                    json.dumps({**report, "budgets": [*report["budgets"], part]}, indent=1) + "\n"
                )

            report["budgets"].append(
                bench_budget(
                    wl,
                    parse_size(b),
                    say,
                    verify_long=args.verify_long,
                    optimizer=args.optimizer,
                    save=save,
                    skip_baselines=args.skip_baselines,
                    skip_memfit=args.skip_memfit,
                    model=model,
                )  # fmt: skip
            )
    if not args.skip_estimate:
        report["estimate"] = bench_estimate(say, 80 * 10**9, only=args.estimate_rows)
    report["seconds"] = time.perf_counter() - t_start
    old = Path(args.out)
    if old.exists() and (args.skip_measured or args.skip_estimate):  # keep the part not rerun
        prev = json.loads(old.read_text())
        for key in ("budgets", "num_params", "estimate"):
            if key not in report and key in prev:
                report[key] = prev[key]
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
