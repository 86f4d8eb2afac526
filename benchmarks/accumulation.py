"""Gradient accumulation: memfit's overhead vs a hand-written loop, and the anchors' gradient error.

Part 1, overhead: the same exact accumulation (count tokens, split, scaled backward, one step)
written by hand and through ``memfit.accumulate.Accumulator``, timed side by side in one process
(A B A B ...), medians of the per-pair ratios. Also the fixed cost per micro-step on a tiny model,
where Python overhead is most visible.

Part 2, gradient error vs the big batch, on ``GPT2LMHeadModel`` (2 layers, d=64, float64, dropout
off) with variable-length, right-padded token batches (labels -100 on padding):

- HF Trainer: a real ``transformers.Trainer``; its own ``get_batch_samples`` (which counts
  ``num_items_in_batch``) and ``training_step`` are run for each window, exactly as
  ``_inner_training_loop`` does.
- HF Trainer + memfit: the same, after ``memfit.integrations.transformers.fit(trainer, policy="all")``
  (every block recomputed; Trainer's ``num_items_in_batch`` counted over the labels the loss sums).
- accelerate: the documented loop ``with accelerator.accumulate(model): loss = model(**batch).loss;
  accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()`` with a real
  ``Accelerator(gradient_accumulation_steps=k)`` over a DataLoader of micro-batches.
- Lightning: a real ``lightning.Trainer(accumulate_grad_batches=k)`` whose ``training_step``
  returns ``model(**batch).loss``; gradients read in ``on_before_optimizer_step``.
- per-micro-batch token mean / k: the plain hand-written loop those two document.
- accelerate + memfit: ``memfit.integrations.accelerate.ExactAccumulation`` in a real accelerate
  loop (the loader yields windows; memfit splits them and normalises by the window's tokens).
- Lightning + memfit: the same Lightning Trainer with ``memfit.integrations.lightning.
  ExactAccumulation(count_fn=...)`` in its callbacks; ``training_step`` returns its token mean.
- memfit: ``Accumulator(normalize="tokens")`` with the workload's token count.

Optimizers use lr=0 so every window is compared at the same weights against one pass over the
same samples. Scenarios: random lengths; batches sorted by length (what length-grouped samplers
produce); the short last window of an epoch (20 samples in windows of 16: the last has 4).

Run: ``python benchmarks/accumulation.py [--quick]`` (``--from-json`` reprints the tables from the last
results; ``benchmarks/make_reports.py`` writes the report). Needs transformers; accelerate and lightning
are used when installed (``pip install accelerate lightning``), else their rows say "not installed".
Writes ``benchmarks/results/accumulation.json`` and prints tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memfit.accumulate import Accumulator, micro_batch_sizes
from memfit.models.registry import load_workload
from memfit.workload import Workload, batch_size_of, split_batch

F64 = torch.float64
RESULTS = Path(__file__).parent / "results" / "accumulation.json"

# -- part 1: overhead --------------------------------------------------------------------------


def hand_written_step(model, opt, batch, loss_fn, count_fn, micro_batch: int) -> float:
    """Exact accumulation written out by hand: what memfit does, without memfit."""
    n = float(count_fn(batch))
    total = 0.0
    for piece in split_batch(batch, micro_batch_sizes(batch_size_of(batch), micro_batch)):
        s, _ = loss_fn(model, piece)
        (s / n).backward()
        total += float(s.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / n


def linear_workload() -> Workload:
    """A near-zero model: what is left of a step is the loops' own fixed cost."""
    torch.manual_seed(0)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(b, 4), "valid": torch.ones(b, dtype=torch.long)}

    def loss_fn(model, batch):
        return model(batch["x"]).sum(), batch["valid"].sum()

    return Workload(
        name="nn.Linear(4, 4), fixed cost",
        model=torch.nn.Linear(4, 4),
        make_batch=make_batch,
        loss_fn=loss_fn,
        count_fn=lambda batch: int(batch["valid"].sum()),
    )


def measure_overhead(wl: Workload, global_batch: int, micro_batch: int, pairs: int) -> dict[str, Any]:
    model_a = wl.model
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-4)
    acc = Accumulator(model_b, opt_b, micro_batch=micro_batch)
    torch.manual_seed(0)
    batches = [wl.make_batch(global_batch) for _ in range(4)]
    for _ in range(5):  # warm-up (first calls allocate, fill caches)
        hand_written_step(model_a, opt_a, batches[0], wl.loss_fn, wl.count_fn, micro_batch)
        acc.step(batches[0], wl.loss_fn, count_fn=wl.count_fn)

    def run_a(b):
        hand_written_step(model_a, opt_a, b, wl.loss_fn, wl.count_fn, micro_batch)

    def run_b(b):
        acc.step(b, wl.loss_fn, count_fn=wl.count_fn)

    t_a, t_b, ratios = [], [], []
    for i in range(pairs):
        b = batches[i % len(batches)]
        first, second = (run_a, run_b) if i % 2 == 0 else (run_b, run_a)  # alternate the order too
        times = {}
        for fn in (first, second):
            t0 = time.perf_counter()
            fn(b)
            times[fn] = time.perf_counter() - t0
        t_a.append(times[run_a])
        t_b.append(times[run_b])
        ratios.append(times[run_b] / times[run_a])
    k = len(micro_batch_sizes(global_batch, micro_batch))
    med_a, med_b = statistics.median(t_a), statistics.median(t_b)
    return {
        "workload": wl.name,
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "micro_steps": k,
        "pairs": pairs,
        "hand_written_step_s": med_a,
        "memfit_step_s": med_b,
        "overhead_ratio_median": statistics.median(ratios) - 1.0,
        "overhead_per_step_us": (med_b - med_a) * 1e6,
    }


# -- part 2: anchors ---------------------------------------------------------------------------


def make_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(F64)
    model.train()
    return model


def gpt2_batch(n: int, seq_len: int = 32, *, sort: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, seq_len + 1, (n,), generator=g)
    if sort:
        lengths = lengths.sort().values
    ids = torch.randint(1, 128, (n, seq_len), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gpt2_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token losses over valid labels, and their count (the shifted labels)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    s = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return s, (labels != -100).sum()


def gpt2_count(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    rel = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, want, strict=True))
    flat_g = torch.cat([g.flatten() for g in got])
    flat_w = torch.cat([w.flatten() for w in want])
    scale = float(flat_g @ flat_w / (flat_w @ flat_w))  # best scalar fit: 1.0 = right magnitude
    l2 = float((flat_g - flat_w).norm() / flat_w.norm())
    return {"max_grad_rel_err": rel, "grad_rel_l2_err": l2, "grad_scale": scale}


def reference_grads(base, window: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model = copy.deepcopy(base)
    s, c = gpt2_loss(model, window)
    (s / c).backward()
    return grads_of(model)


def windows_of(samples: dict[str, torch.Tensor], global_batch: int) -> list[dict[str, torch.Tensor]]:
    n = batch_size_of(samples)
    sizes = micro_batch_sizes(n, global_batch)
    return split_batch(samples, sizes)


def run_memfit(base, windows, micro_batch):
    out = []
    for w in windows:
        model = copy.deepcopy(base)
        acc = Accumulator(model, None, micro_batch=micro_batch, normalize="tokens")
        acc.step(w, gpt2_loss, count_fn=gpt2_count)
        out.append(grads_of(model))
    return out


def run_token_mean(base, windows, micro_batch, k):
    """for each micro-batch: (model(**mb).loss / k).backward() -- the loop accelerate/Lightning document."""
    out = []
    for w in windows:
        model = copy.deepcopy(base)
        for mb in split_batch(w, micro_batch_sizes(batch_size_of(w), micro_batch)):
            (model(**mb).loss / k).backward()
        out.append(grads_of(model))
    return out


def run_hf_trainer(base, windows, micro_batch, k):
    from transformers import Trainer, TrainingArguments

    out = []
    with tempfile.TemporaryDirectory() as tmp, _quiet():
        model = copy.deepcopy(base)
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=k,
            report_to=[], use_cpu=True, learning_rate=0.0, disable_tqdm=True, save_strategy="no",
        )  # fmt: skip
        trainer = Trainer(model=model, args=args)
        trainer.create_optimizer_and_scheduler(num_training_steps=10)
        micro = [mb for w in windows for mb in split_batch(w, micro_batch_sizes(batch_size_of(w), micro_batch))]
        it = iter(micro)
        # As Trainer._inner_training_loop: windows of k batches (fewer for the last), one
        # num_items_in_batch per window from get_batch_samples, training_step per batch.
        steps = math_ceil(len(micro), k)
        for step in range(steps):
            n = k if step != steps - 1 else (len(micro) - k * (steps - 1))
            batch_samples, num_items = trainer.get_batch_samples(it, n, torch.device("cpu"))
            trainer.current_gradient_accumulation_steps = len(batch_samples)
            model.zero_grad(set_to_none=True)
            for inputs in batch_samples:
                trainer.training_step(model, inputs, num_items)
            out.append(grads_of(model))
    return out


def run_hf_trainer_memfit(base, windows, micro_batch, k):
    """As run_hf_trainer, after ``memfit.integrations.transformers.fit(trainer, policy="all")``:
    every block recomputed, Trainer's num_items_in_batch counted as the loss sums."""
    from transformers import Trainer, TrainingArguments

    from memfit.integrations.transformers import fit

    out = []
    with tempfile.TemporaryDirectory() as tmp, _quiet():
        model = copy.deepcopy(base)
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=k,
            report_to=[], use_cpu=True, learning_rate=0.0, disable_tqdm=True, save_strategy="no",
        )  # fmt: skip
        trainer = Trainer(model=model, args=args)
        fit(trainer, policy="all", make_batch=lambda b: split_batch(windows[0], [b, batch_size_of(windows[0]) - b])[0])
        trainer.create_optimizer_and_scheduler(num_training_steps=10)
        micro = [mb for w in windows for mb in split_batch(w, micro_batch_sizes(batch_size_of(w), micro_batch))]
        it = iter(micro)
        steps = math_ceil(len(micro), k)
        for step in range(steps):
            n = k if step != steps - 1 else (len(micro) - k * (steps - 1))
            batch_samples, num_items = trainer.get_batch_samples(it, n, torch.device("cpu"))
            trainer.current_gradient_accumulation_steps = len(batch_samples)
            model.zero_grad(set_to_none=True)
            for inputs in batch_samples:
                trainer.training_step(model, inputs, num_items)
            out.append(grads_of(model))
    return out


def run_accelerate(base, windows, micro_batch, k):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    out = []
    with _quiet():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(gradient_accumulation_steps=k, cpu=True)
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        micro = [mb for w in windows for mb in split_batch(w, micro_batch_sizes(batch_size_of(w), micro_batch))]
        loader = torch.utils.data.DataLoader(micro, batch_size=None)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        for batch in loader:  # the documented loop
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    out.append(grads_of(model))
                opt.step()
                opt.zero_grad()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return out


def run_lightning(base, windows, micro_batch, k):
    import lightning as L

    captured: list[list[torch.Tensor]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(base)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def on_before_optimizer_step(self, optimizer) -> None:
            captured.append(grads_of(self.model))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    micro = [mb for w in windows for mb in split_batch(w, micro_batch_sizes(batch_size_of(w), micro_batch))]
    loader = torch.utils.data.DataLoader(micro, batch_size=None)
    with _quiet():
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=k, precision="64-true",
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Module(), loader)
    return captured


def run_accelerate_memfit(base, windows, micro_batch, k):
    """accelerate with memfit.integrations.accelerate.ExactAccumulation: the loader yields windows."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from memfit.integrations.accelerate import ExactAccumulation

    out = []
    with _quiet():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True)
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loader = torch.utils.data.DataLoader(windows, batch_size=None)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        acc = ExactAccumulation(accelerator, model, micro_batch=micro_batch)
        for batch in loader:
            for micro in acc.window(batch, count_fn=gpt2_count):
                micro.backward(gpt2_loss(model, micro.batch))
            out.append(grads_of(model))
            opt.step()
            opt.zero_grad()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return out


def run_lightning_memfit(base, windows, micro_batch, k):
    """Lightning's accumulate_grad_batches with memfit's ExactAccumulation callback."""
    import lightning as L

    from memfit.integrations.lightning import ExactAccumulation

    captured: list[list[torch.Tensor]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(base)

        def training_step(self, batch, batch_idx):
            # The micro-batch's token mean (gpt2_loss: HF's own .loss computes in float32, which
            # would add 1e-8 of rounding to a float64 comparison).
            s, c = gpt2_loss(self.model, batch)
            return s / c

        def on_before_optimizer_step(self, optimizer) -> None:  # runs after the callbacks'
            captured.append(grads_of(self.model))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    micro = [mb for w in windows for mb in split_batch(w, micro_batch_sizes(batch_size_of(w), micro_batch))]
    loader = torch.utils.data.DataLoader(micro, batch_size=None)
    with _quiet():
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=k, precision="64-true",
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ExactAccumulation(count_fn=gpt2_count)],
        )  # fmt: skip
        trainer.fit(Module(), loader)
    return captured


def math_ceil(a: int, b: int) -> int:
    return -(-a // b)


@contextlib.contextmanager
def _quiet():
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)


ANCHORS = {
    "memfit (tokens, global count)": (run_memfit, None),
    "HF Trainer (num_items_in_batch)": (run_hf_trainer, "transformers"),
    "HF Trainer + memfit (integrations.transformers.fit, policy all)": (run_hf_trainer_memfit, "transformers"),
    "accelerate accumulate() loop": (run_accelerate, "accelerate"),
    "Lightning accumulate_grad_batches": (run_lightning, "lightning"),
    "accelerate + memfit (ExactAccumulation)": (run_accelerate_memfit, "accelerate"),
    "Lightning + memfit (ExactAccumulation callback)": (run_lightning_memfit, "lightning"),
    "per-micro-batch token mean / k": (run_token_mean, None),
}


def measure_anchors(global_batch: int, micro_batch: int, only: tuple[str, ...] = ()) -> dict[str, Any]:
    import importlib.util

    base = make_gpt2()
    k = global_batch // micro_batch
    scenarios = {
        "random lengths": [gpt2_batch(global_batch, seed=1), gpt2_batch(global_batch, seed=2)],
        "length-sorted": [gpt2_batch(global_batch, sort=True, seed=3), gpt2_batch(global_batch, sort=True, seed=4)],
        # 20 samples in windows of 16: the last window has 4 samples (1 micro-batch of a nominal k)
        "short last window": windows_of(gpt2_batch(global_batch + micro_batch, seed=5), global_batch),
    }
    out: dict[str, Any] = {}
    for name, (fn, pkg) in ANCHORS.items():
        if only and not name.startswith(only):
            continue
        row: dict[str, Any] = {}
        if pkg and importlib.util.find_spec(pkg) is None:
            out[name] = {"error": f"{pkg} not installed"}
            continue
        for scen, windows in scenarios.items():
            # The anchors see one stream of micro-batches; they are fed all windows of the scenario.
            try:
                got = fn(base, windows, micro_batch) if fn is run_memfit else fn(base, windows, micro_batch, k)
            except Exception as err:  # report, do not hide: the row says what failed
                row[scen] = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            if len(got) != len(windows):
                row[scen] = {"error": f"{len(got)} optimizer steps for {len(windows)} windows"}
                continue
            # Reported: the worst window (for the short-last-window scenario, the last one).
            results = [compare(g, reference_grads(base, w)) for g, w in zip(got, windows, strict=True)]
            worst = max(results, key=lambda r: r["max_grad_rel_err"])
            row[scen] = worst
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timing pairs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stabler on shared machines)")
    ap.add_argument("--from-json", action="store_true", help=f"only print the tables of {RESULTS.name}")
    ap.add_argument(
        "--anchors",
        nargs="+",
        metavar="NAME",
        help="only measure the anchor rows whose name starts with one of these (e.g. 'HF Trainer'); prints them, writes nothing",
    )
    args = ap.parse_args()
    if args.from_json:
        print(format_tables(json.loads(RESULTS.read_text())))
        return
    torch.set_num_threads(args.threads)
    pairs = 6 if args.quick else 20
    if args.anchors:
        rows = measure_anchors(global_batch=16, micro_batch=4, only=tuple(args.anchors))
        print(format_tables({"anchors": rows, "overhead": []}))
        return

    print("measuring anchor gradient errors (GPT2LMHeadModel, float64) ...", file=sys.stderr)
    anchors = measure_anchors(global_batch=16, micro_batch=4)
    print("timing memfit vs a hand-written loop (A B A B ...) ...", file=sys.stderr)
    overhead = [
        measure_overhead(load_workload("demo?n_layer=4&dropout=0", seq_len=128), 16, 4, pairs),
        measure_overhead(load_workload("demo?n_layer=1&n_embd=32&n_head=2&dropout=0", seq_len=16), 16, 4, pairs * 5),
        measure_overhead(linear_workload(), 16, 4, pairs * 20),
    ]
    result = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "versions": _versions(),
        "anchors": anchors,
        "overhead": overhead,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(format_tables(result))
    print(f"\nwrote {RESULTS}")


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for pkg in ("transformers", "accelerate", "lightning"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def format_tables(result: dict[str, Any]) -> str:
    """Markdown tables (the accumulation report's anchor table)."""
    scen = ["random lengths", "length-sorted", "short last window"]
    lines = [
        "Gradient error vs one pass over the whole batch (GPT2LMHeadModel, float64, global batch 16, "
        "micro-batch 4). Each cell: max over parameters of max|g - g_ref| / max|g_ref| (what `memfit "
        "verify` reports) / ||g - g_ref|| / ||g_ref|| over all parameters / best-fit scale "
        "<g, g_ref> / <g_ref, g_ref> (1.000 = right magnitude). Worst window of each scenario.",
        "",
        "| loop | " + " | ".join(scen) + " |",
        "|---|" + "---|" * len(scen),
    ]
    for name, row in result["anchors"].items():
        if "error" in row:
            lines.append(f"| {name} | " + " | ".join([row["error"]] * len(scen)) + " |")
            continue
        cells = []
        for s in scen:
            r = row.get(s, {})
            cells.append(
                r["error"]
                if "error" in r
                else f"{r['max_grad_rel_err']:.2g} / {r['grad_rel_l2_err']:.2g} / {r['grad_scale']:.3f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "memfit Accumulator vs the same exact loop written by hand (median of per-pair ratios, A B A B):",
        "",
        "| workload | micro-steps | hand-written step | memfit step | overhead (median ratio) | difference of medians |",
        "|---|---|---|---|---|---|",
    ]
    for o in result["overhead"]:
        lines.append(
            f"| {o['workload']} (G={o['global_batch']}, b={o['micro_batch']}) | {o['micro_steps']} | "
            f"{o['hand_written_step_s'] * 1e3:.2f} ms | {o['memfit_step_s'] * 1e3:.2f} ms | "
            f"{o['overhead_ratio_median'] * 100:+.2f} % | {o['overhead_per_step_us']:+.0f} us per step |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
