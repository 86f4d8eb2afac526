"""memfit.integrations.transformers: HF Trainer, TRL's SFTTrainer and a PEFT LoRA model, a few real steps.

Every run is compared with one big-batch step per window computed by hand from the same initial
weights on the same samples (the micro-batches Trainer fed, recorded by the collator and re-padded
into one batch): same SGD, same linear schedule, same clipping. Plain Trainer with the same
micro-batches is the control: on GPT2LMHeadModel its ``num_items_in_batch`` counts one label per
row too many (gradient scale 0.94 in benchmarks/accumulation.py), so the same comparison fails
there by percents.
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING

import pytest
import torch
import transformers

from memfit.apply import applied_plan, is_applied  # noqa: E402
from memfit.capture.tracker import MemoryTracker  # noqa: E402
from memfit.errors import MemfitError, SpecError  # noqa: E402
from memfit.integrations import transformers as mt  # noqa: E402
from memfit.plan import policy_plan  # noqa: E402

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel, TrainingArguments

# Trainer and the model classes are imported by the tests and helpers that use them, not here:
# `from transformers import Trainer` loads the trainer stack (datasets among it), ~2 s of every
# collection of the suite otherwise.

GLOBAL_BATCH = 8
STEPS = 2
LR = 0.5
VOCAB = 64
BUDGET = 1_300_000  # bytes; a step of micro-batch 1 needs 1.42 MB without recompute, 2 needs 1.44 MB
# A DDP rank holds the gradient buckets on top (330 KB here): at least 1.58 MB with recompute, 1.75 MB without.
DDP_BUDGET = 1_650_000


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
    torch.set_num_threads(n)


def gpt2(n_layer: int = 3) -> GPT2LMHeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).double()


def samples(n: int = GLOBAL_BATCH * STEPS, seed: int = 0) -> list[dict]:
    """Variable-length token rows (4..30 tokens) with an extra column Trainer must drop."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 31, (n,), generator=g)
    return [
        {"input_ids": torch.randint(3, VOCAB, (int(n_),), generator=g).tolist(), "text": "unused"} for n_ in lengths
    ]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels -100 on padding."""
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Recorder:
    """A collator that keeps what it returned (the micro-batches the model saw, in order)."""

    def __init__(self, fn):
        self.fn, self.batches = fn, []

    def __call__(self, rows):
        out = self.fn(rows)
        self.batches.append({k: v.clone() for k, v in out.items()})
        return out


def training_args(tmp_path, **kw) -> TrainingArguments:
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=GLOBAL_BATCH, gradient_accumulation_steps=1,
        report_to=[], use_cpu=True, optim="sgd", learning_rate=LR, lr_scheduler_type="linear", max_steps=STEPS,
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.0,
    )  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


def concat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch from micro-batches padded to different lengths (right padding: masks 0, labels -100)."""
    T = max(b["input_ids"].shape[1] for b in batches)
    pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {
        k: torch.cat([torch.nn.functional.pad(b[k], (0, T - b[k].shape[1]), value=v) for b in batches])
        for k, v in pad.items()
    }


def reference(model0: torch.nn.Module, windows: list[list[dict]]) -> tuple[dict, list[float]]:
    """One big-batch SGD step per window (the model's own mean token loss), linear LR decay.

    No clipping (``max_grad_norm=0`` in the runs): clipping rescales a too-small gradient back up
    and would hide the control's error.
    """
    model = copy.deepcopy(model0)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for t, w in enumerate(windows):
        model.zero_grad(set_to_none=True)
        loss = model(**concat(w)).loss
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-LR * (len(windows) - t) / len(windows))
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def update_error(model0, got: dict, want: dict) -> float:
    """max |update - reference update| / max |reference update| over all parameters."""
    start = model0.state_dict()
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    size = max(float((want[k] - start[k]).abs().max()) for k in want)
    return diff / size


def windows_of(batches: list[dict], k: int) -> list[list[dict]]:
    return [batches[i : i + k] for i in range(0, len(batches), k)]


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- HF Trainer ----------------------------------------------------------------------------------


@pytest.mark.slow  # about 6 s on 2 cores: the fast tier keeps to about 4 minutes
def test_trainer_budget_fit_equals_big_batch_steps(tmp_path):
    from transformers import Trainer

    model0 = gpt2()
    rec = Recorder(collate)
    trainer = Trainer(
        model=copy.deepcopy(model0),
        args=training_args(tmp_path / "memfit", save_strategy="steps", save_steps=STEPS),
        train_dataset=samples(),
        data_collator=rec,
    )
    with pytest.warns(mt.MemfitTrainerWarning, match="num_items_in_batch"):
        fitted = mt.fit(trainer, budget=BUDGET, repeats=1)
    rec.batches.clear()  # planning's batches
    # Planning ran on a copy: the model's weights are bitwise the same.
    assert all(torch.equal(v, model0.state_dict()[k]) for k, v in trainer.model.state_dict().items())
    plan = fitted.plan
    assert not plan.is_plain, "the budget must make the plan recompute blocks (alone or in segments)"
    assert fitted.micro_batch < GLOBAL_BATCH and fitted.micro_batch * fitted.accumulation_steps == GLOBAL_BATCH
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (
        fitted.micro_batch,
        fitted.accumulation_steps,
    )
    # Control: plain Trainer, its own accumulation with the same micro-batches.
    rec_plain = Recorder(collate)
    plain_args = training_args(
        tmp_path / "plain",
        per_device_train_batch_size=fitted.micro_batch,
        gradient_accumulation_steps=fitted.accumulation_steps,
    )
    plain = Trainer(model=copy.deepcopy(model0), args=plain_args, train_dataset=samples(), data_collator=rec_plain)
    plain.train()
    want_plain, _ = reference(model0, windows_of(rec_plain.batches, fitted.accumulation_steps))
    plain_err = update_error(model0, state(plain.model), want_plain)

    tracker = MemoryTracker(device="cpu").track(trainer.model)
    with tracker:
        out = trainer.train()
    assert tracker.peak_bytes <= BUDGET, (tracker.peak_bytes, BUDGET)

    windows = windows_of(rec.batches, fitted.accumulation_steps)
    assert len(windows) == STEPS and all(len(w) == fitted.accumulation_steps for w in windows)
    want, want_losses = reference(model0, windows)
    err = update_error(model0, state(trainer.model), want)
    assert err < 1e-6, err
    # The control: the same comparison fails for Trainer's own accumulation (0.94 gradient scale).
    assert 0.03 < plain_err < 0.1, plain_err  # measured 0.06

    # Trainer's step counter, logged losses (exact window losses) and schedule as without memfit.
    assert out.global_step == trainer.state.global_step == STEPS
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["loss"] for h in logged] == pytest.approx(want_losses, rel=1e-6)
    assert [h["learning_rate"] for h in logged] == [h["learning_rate"] for h in plain.state.log_history if "loss" in h]
    # The checkpoint Trainer saved with the plan applied loads into a plain model, keys unchanged.
    fresh = gpt2()
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "memfit" / f"checkpoint-{STEPS}" / "model.safetensors"))
    missing, unexpected = fresh.load_state_dict(saved, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte, saved once
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state(trainer.model).items())


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_budget_fit_measures_the_trainers_model_in_place(tmp_path):
    """Auto-fit leaves the model bitwise as it was, so fit() plans on Trainer's model itself: no
    second copy on the device Trainer placed it on, and a model holding something deepcopy refuses
    (here a lock) fits too."""
    import threading

    from transformers import Trainer

    model = gpt2(n_layer=2)
    model.lock = threading.Lock()  # copy.deepcopy(model): TypeError: cannot pickle '_thread.lock'
    before = state(model)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, per_device_train_batch_size=2),
        train_dataset=samples(4),
        data_collator=collate,
    )
    with pytest.warns(mt.MemfitTrainerWarning):
        fitted = mt.fit(trainer, budget="1GiB", measure=False, repeats=1)
    assert is_applied(model) and fitted.global_batch == 2
    assert all(torch.equal(v, before[k]) for k, v in state(model).items())


def test_trainer_policy_keeps_columns_with_chunked_head_and_restores(tmp_path):
    """The issue's trap: a chunked head's forward(*args, **kwargs) made Trainer drop input_ids."""
    from transformers import Trainer

    model0 = gpt2(n_layer=2)
    model = copy.deepcopy(model0)
    rec = Recorder(collate)
    args = training_args(
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        use_cache=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=samples(), data_collator=rec)
    assert model.config.use_cache  # Trainer sets it from args.use_cache
    plan = policy_plan(model, "all").with_(head="chunked")
    with pytest.warns(mt.MemfitTrainerWarning, match="gradient_checkpointing|activation_checkpointing"):
        fitted = mt.fit(trainer, plan=plan)
    rec.batches.clear()
    assert not trainer.args.gradient_checkpointing and not model.config.use_cache
    assert applied_plan(model).head == "chunked"
    trainer.train()
    want, _ = reference(model0, windows_of(rec.batches, 2))
    assert update_error(model0, state(model), want) < 1e-6
    fitted.remove()
    assert not is_applied(model) and model.config.use_cache


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_budget_fit_with_a_policy_keeps_its_plan_and_the_budget(tmp_path):
    """fit(budget=, policy=): Trainer's batch arguments come from the fit, the applied plan is the
    policy's, and Trainer's own steps (tracker over trainer.train()) stay within the budget."""
    from transformers import Trainer

    budget = 2_300_000  # the policy keeps the model's own head: micro-batch 1 needs 1.55 MB, 2 2.08 MB, 4 3.2 MB
    model = gpt2()
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=samples(), data_collator=collate)
    with pytest.warns(mt.MemfitTrainerWarning):
        fitted = mt.fit(trainer, budget=budget, policy="every:2", measure=False, repeats=1)
    assert fitted.fit is not None and str(fitted.fit.policy) == "every:2"
    assert (
        applied_plan(model).blocks == policy_plan(model, "every:2").blocks and applied_plan(model).policy == "every:2"
    )
    assert fitted.micro_batch * fitted.accumulation_steps == GLOBAL_BATCH and fitted.micro_batch < GLOBAL_BATCH
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (
        fitted.micro_batch,
        fitted.accumulation_steps,
    )
    tracker = MemoryTracker(device="cpu").track(trainer.model)
    with tracker:
        trainer.train()
    assert tracker.peak_bytes <= budget, (tracker.peak_bytes, budget)


def test_fit_refuses(tmp_path):
    from transformers import Trainer

    trainer = Trainer(
        model=gpt2(n_layer=2), args=training_args(tmp_path), train_dataset=samples(), data_collator=collate
    )
    for kw in (
        {},
        {"budget": "1GiB", "plan": policy_plan(trainer.model, "all")},
        {"plan": policy_plan(trainer.model, "all"), "policy": "all"},
    ):
        with pytest.raises(
            SpecError, match="pass budget= .with policy= to keep a policy's plan., plan= .applied as it is. or policy="
        ):
            mt.fit(trainer, **kw)
    with pytest.raises(SpecError, match="unknown policy 'every:0'"):
        mt.fit(trainer, budget="1GiB", policy="every:0")
    with pytest.warns(mt.MemfitTrainerWarning):
        mt.fit(trainer, policy="all")
    with pytest.raises(MemfitError, match="already has a memfit plan"):
        mt.fit(trainer, policy="all")
    trainer.args.gradient_checkpointing = trainer.args.activation_checkpointing = True  # turned back on
    with pytest.raises(MemfitError, match="turned on after fit"):
        trainer.train()


# --- PEFT LoRA -------------------------------------------------------------------------------------


def test_peft_lora_without_input_require_grads(tmp_path):
    import peft
    from transformers import Trainer

    model0 = peft.get_peft_model(
        gpt2(n_layer=2), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    )
    frozen = {k: v.clone() for k, v in model0.state_dict().items() if "lora_" not in k}
    rec = Recorder(collate)
    model = copy.deepcopy(model0)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2),
        train_dataset=samples(),
        data_collator=rec,
    )
    with pytest.warns(mt.MemfitTrainerWarning):
        mt.fit(trainer, policy="all")
    rec.batches.clear()
    # Non-reentrant recompute: the inputs of the blocks need not require grad (no enable_input_require_grads).
    assert not model.get_input_embeddings().weight.requires_grad and not model.get_input_embeddings()._forward_hooks
    trainer.train()
    want, _ = reference(model0, windows_of(rec.batches, 2))
    got = state(model)
    assert update_error(model0, got, want) < 1e-6
    assert all(torch.equal(got[k], v) for k, v in frozen.items())


# --- TRL SFTTrainer --------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_trainer_equals_big_batch_steps(tmp_path):
    """TRL's fused LM head computes its loss in its own kernel, which differs from the model's loss
    by 2.6e-3 in the update even without accumulation; the reference here is therefore
    SFTTrainer's own step on the whole window (batch 8, no accumulation, its token count made
    right), from the same weights."""
    import datasets
    import trl
    from tokenizers import Tokenizer, models

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3")),
        pad_token="t0", eos_token="t2", bos_token="t1", unk_token="t3",
    )  # fmt: skip
    model0 = gpt2()
    ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in samples()])

    def sft(name: str, micro_batch: int) -> trl.SFTTrainer:
        args = trl.SFTConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=GLOBAL_BATCH // micro_batch, report_to=[], use_cpu=True, optim="sgd",
            learning_rate=LR, lr_scheduler_type="linear", max_steps=STEPS, logging_steps=1, save_strategy="no",
            disable_tqdm=True, max_length=None, seed=0, max_grad_norm=0.0,
        )  # fmt: skip
        assert args.gradient_checkpointing  # TRL's default: fit takes it over
        return trl.SFTTrainer(model=copy.deepcopy(model0), args=args, train_dataset=ds, processing_class=tok)

    big = sft("big", GLOBAL_BATCH)
    big._loss_shifts_labels = True  # else TRL normalises even one big batch by one label per row too many
    big.train()
    plain = sft("plain", 4)  # the control: TRL's own accumulation on GPT-2
    plain.train()
    trainer = sft("memfit", 4)
    with pytest.warns(mt.MemfitTrainerWarning, match="num_items_in_batch"):  # TRL's loss shifts labels too
        fitted = mt.fit(trainer, policy="all")
    assert fitted.plan.recomputed and not trainer.args.gradient_checkpointing
    trainer.train()
    want = state(big.model)
    assert update_error(model0, state(trainer.model), want) < 1e-6
    assert 0.03 < update_error(model0, state(plain.model), want) < 0.1  # measured 0.06
    assert trainer.state.global_step == STEPS
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == pytest.approx([h["loss"] for h in big.state.log_history if "loss" in h], rel=1e-6)


# --- DDP: torchrun, 2 processes, gloo ------------------------------------------------------------

_WORKER = """
import copy, json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed as dist
import test_integration_transformers as T
from transformers import Trainer
from memfit.integrations import transformers as mt

torch.set_num_threads(1)
out = sys.argv[1]
rec = T.Recorder(T.collate)
args = T.training_args(out, per_device_train_batch_size=T.GLOBAL_BATCH // 2)  # 2 ranks: global batch kept
trainer = Trainer(model=T.gpt2(), args=args, train_dataset=T.samples(), data_collator=rec)
fitted = mt.fit(trainer, budget=T.DDP_BUDGET, repeats=1)  # rank 0 plans, the other takes its choice
rec.batches.clear()
from memfit.capture.tracker import MemoryTracker
tracker = MemoryTracker(device="cpu").track(trainer.model)
with tracker:
    trainer.train()
# DDP's gradient buckets are allocated by its C++ reducer when the model is wrapped, before the
# tracker runs; it may count the buckets DDP rebuilds at the second step: the sum is an upper bound.
buckets = sum(map(int, trainer.model_wrapped._get_ddp_logging_data()["bucket_sizes"].split(", ")))
every = [None] * dist.get_world_size()
dist.all_gather_object(every, rec.batches)
if dist.get_rank() == 0:
    torch.save({"state": T.state(trainer.model), "batches": every}, out + "/result.pt")
    json.dump({
        "world_size": dist.get_world_size(), "micro_batch": fitted.micro_batch, "steps": fitted.accumulation_steps,
        "recomputed": len(fitted.plan.recomputed), "global_step": trainer.state.global_step,
        "find_unused_parameters": trainer.model_wrapped.find_unused_parameters,
        "rank_peak_bytes": tracker.peak_bytes + buckets, "buckets_bytes": buckets,
        "predicted_peak_bytes": fitted.fit.predicted_peak_bytes,
    }, open(out + "/result.json", "w"))
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_under_torchrun_equals_big_batch_steps(tmp_path):
    """fit(budget=) under DDP: rank 0 plans one DDP rank (its gradient buckets included), both ranks
    run its choice within the budget; the weights after the steps equal one big-batch step per
    window over the micro-batches of both ranks."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    (tmp_path / "worker.py").write_text(_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # the worker imports this file as a module: the tests folder goes on its path
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent / "src"), str(here), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={port}", str(tmp_path / "worker.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    info = json.loads((tmp_path / "result.json").read_text())
    assert info["world_size"] == 2 and info["global_step"] == STEPS and info["recomputed"] >= 1
    assert info["micro_batch"] * info["steps"] == GLOBAL_BATCH // 2 and info["find_unused_parameters"] is False
    # Rank 0 was planned as a DDP rank: its peak (the tracker's, plus DDP's buckets) is within the budget.
    trainable = sum(p.numel() * p.element_size() for p in gpt2().parameters() if p.requires_grad)
    assert info["buckets_bytes"] == trainable
    assert info["rank_peak_bytes"] <= DDP_BUDGET, info
    res = torch.load(tmp_path / "result.pt", weights_only=False)
    k = info["steps"]
    # Window t: the k micro-batches of window t of every rank.
    windows = [[b for rank in res["batches"] for b in rank[t * k : (t + 1) * k]] for t in range(STEPS)]
    want, _ = reference(gpt2(), windows)
    assert update_error(gpt2(), res["state"], want) < 1e-6


def test_even_micro_batches_divide_the_global_batch():
    from memfit.fitting import micro_batch_options

    assert [b for b, _ in micro_batch_options(10, even=True)] == [10, 5, 2, 1]
    assert all(len(set(sizes)) == 1 for _, sizes in micro_batch_options(10, even=True))
    assert (4, (4, 4, 2)) in micro_batch_options(10)  # without even: a short last micro-batch


def test_missing_transformers_names_the_extra(monkeypatch, tmp_path):
    from transformers import Trainer

    trainer = Trainer(
        model=gpt2(n_layer=1), args=training_args(tmp_path), train_dataset=samples(4), data_collator=collate
    )
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(MemfitError, match=r"memfit\[transformers\]"):
        mt.fit(trainer, policy="all")


# --- a Trainer subclass with a compute_loss of its own ---------------------------------------------


def _mean_loss_trainer():
    """A subclass whose compute_loss is each micro-batch's own mean (it drops num_items_in_batch)."""
    from transformers import Trainer

    class MeanLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            return (out.loss, out) if return_outputs else out.loss

    return MeanLossTrainer


def _sum_loss_trainer():
    """A subclass that follows Trainer's contract: summed token loss / num_items_in_batch."""
    from transformers import Trainer

    class SumLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            logits = out.logits[:, :-1].flatten(0, 1).float()
            loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum")
            n = num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum()
            loss = loss / n * self.accelerator.num_processes
            return (loss, out) if return_outputs else loss

    return SumLossTrainer


def test_a_compute_loss_that_ignores_num_items_is_refused(tmp_path):
    """With accumulation, Trainer does not divide a loss it believes normalised by num_items_in_batch:
    a subclass returning its own mean trains with gradients k times too large. fit() refuses it."""
    k = 4
    args = dict(per_device_train_batch_size=GLOBAL_BATCH // k, gradient_accumulation_steps=k)
    model0 = gpt2(n_layer=2)
    trainer = _mean_loss_trainer()(
        model=copy.deepcopy(model0),
        args=training_args(tmp_path, **args),
        train_dataset=samples(),
        data_collator=collate,
    )
    before = state(trainer.model)
    with pytest.raises(MemfitError, match="ignores num_items_in_batch .* about 4 times too large"):
        mt.fit(trainer, policy="all")
    assert not is_applied(trainer.model) and all(torch.equal(v, before[k_]) for k_, v in state(trainer.model).items())
    # The fix the message gives: each micro-batch's mean divided by the steps (warned: inexact).
    trainer.loss_is_scaled_for_ga = False
    with pytest.warns(mt.MemfitTrainerWarning, match="returns each micro-batch's mean"):
        mt.fit(trainer, policy="all")


@pytest.mark.slow
def test_a_refused_budget_fit_leaves_the_batch_arguments(tmp_path):
    """With budget=, the probe runs once the fit has chosen its accumulation steps (here more than
    one, so the subclass's own mean would be 4x off): refused, and Trainer's batch arguments and
    model are as before."""
    trainer = _mean_loss_trainer()(
        model=gpt2(), args=training_args(tmp_path), train_dataset=samples(), data_collator=collate
    )
    with pytest.raises(MemfitError, match="ignores num_items_in_batch"):
        mt.fit(trainer, budget=BUDGET, measure=False, repeats=1)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (GLOBAL_BATCH, 1)
    assert trainer._train_batch_size == GLOBAL_BATCH and not is_applied(trainer.model)


@pytest.mark.slow
def test_a_compute_loss_that_ignores_num_items_trains_k_times_too_far_without_memfit(tmp_path):
    """The control of the refusal above: the same Trainer, trained without memfit, misses the big
    batch's update by about the accumulation steps."""
    k = 4
    model0 = gpt2(n_layer=2)
    rec = Recorder(collate)
    plain = _mean_loss_trainer()(
        model=copy.deepcopy(model0),
        args=training_args(tmp_path, per_device_train_batch_size=GLOBAL_BATCH // k, gradient_accumulation_steps=k),
        train_dataset=samples(),
        data_collator=rec,
    )
    plain.train()
    want, _ = reference(model0, windows_of(rec.batches, k))
    assert update_error(model0, state(plain.model), want) > 1.5  # gradients about 4x (3.98 in one step)


def test_a_compute_loss_that_follows_the_contract_trains_the_big_batch(tmp_path):
    """A subclass that divides its summed loss by num_items_in_batch passes the check, and the
    accumulated steps equal one big-batch step per window."""
    k = 4
    model0 = gpt2(n_layer=2)
    rec = Recorder(collate)
    trainer = _sum_loss_trainer()(
        model=copy.deepcopy(model0),
        args=training_args(tmp_path, per_device_train_batch_size=GLOBAL_BATCH // k, gradient_accumulation_steps=k),
        train_dataset=samples(),
        data_collator=rec,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mt.fit(trainer, policy="all")
    assert not [w for w in caught if "compute_loss" in str(w.message)]
    rec.batches.clear()
    trainer.train()
    want, _ = reference(model0, windows_of(rec.batches, k))
    assert update_error(model0, state(trainer.model), want) < 1e-5  # float32 logits in the loss
    # compute_loss told Trainer it is normalised, and says so again: divided twice, refused.
    trainer2 = _sum_loss_trainer()(
        model=copy.deepcopy(model0),
        args=training_args(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=k),
        train_dataset=samples(),
        data_collator=collate,
    )
    trainer2.loss_is_scaled_for_ga = False
    with pytest.raises(MemfitError, match="4 times too small"):
        mt.fit(trainer2, policy="all")


# --- the step TRL runs: bf16 autocast, LoRA, its fused head --------------------------------------


@pytest.mark.slow
def test_sft_trainer_lora_bf16_is_planned_as_it_runs(tmp_path):
    """SFTTrainer (bf16=True by default) with a LoRA Llama: fit plans the step under Trainer's
    autocast, so a budget the fp32 step exceeds fits, and the real run stays within it.

    At 9 MiB: the bf16 step of micro-batch 1 peaks at 7.7 MiB, the fp32 step needs 13.4 MiB (the
    control below: the same trainer without bf16 is refused)."""
    import datasets
    import peft
    import trl
    from tokenizers import Tokenizer, models

    from memfit.errors import BudgetInfeasibleError

    vocab, budget = 256, 9 * 2**20
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3")),
        pad_token="t0", eos_token="t2", bos_token="t1", unk_token="t3",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(16, 97, (8,), generator=g)]
    ds = datasets.Dataset.from_list([{"input_ids": r} for r in rows])

    def sft(name: str, **kw) -> trl.SFTTrainer:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(cfg),
            peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )
        args = trl.SFTConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, report_to=[], use_cpu=True,
            max_steps=1, save_strategy="no", disable_tqdm=True, max_length=None, seed=0, **kw,
        )  # fmt: skip
        return trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)

    trainer = sft("bf16")
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # TRL's defaults
    with pytest.warns(mt.MemfitTrainerWarning):
        fitted = mt.fit(trainer, budget=budget, repeats=1)
    assert trainer._metrics["train"] == {} or not any(trainer._metrics["train"].values())  # planning logged nothing
    tracker = MemoryTracker(device="cpu").track(trainer.model)
    with tracker:
        trainer.train()
    assert tracker.peak_bytes <= budget
    # what fit measured is the step TRL ran (not 1.2-1.8x of it)
    assert abs(fitted.fit.measured_peak_bytes - tracker.peak_bytes) <= 0.03 * tracker.peak_bytes
    with pytest.raises(BudgetInfeasibleError):
        mt.fit(sft("fp32", bf16=False), budget=budget, repeats=1)
