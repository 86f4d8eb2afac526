"""memfit.integrations.accelerate: a plan fitted on a copy, and exact accumulation in an accelerate loop.

Reference for every check: one big-batch SGD step per window computed by hand (``loss_sum / count``
of the whole window, one backward) from the same weights; the control is accelerate's own
``accumulate()`` loop on the same micro-batches, which must miss it (the comparison can fail).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from tiny_models import TinyTokenLM, token_batch, token_count, token_loss, token_samples  # noqa: E402

from memfit.apply.engine import applied_plan, is_applied  # noqa: E402
from memfit.capture.tracker import MemoryTracker  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.integrations import accelerate as memfit_accelerate  # noqa: E402
from memfit.plan.policies import policy_plan  # noqa: E402
from memfit.workload import batch_size_of, split_batch  # noqa: E402

HERE = Path(__file__).parent
F64 = torch.float64
SEQ_LEN = 256  # long sequences: activations outweigh the parameters, so recompute pays
GLOBAL_BATCH = 6
SAMPLES = 16  # windows of 6, 6 and a short last one of 4 (3 + 1 samples on 2 processes)
BUDGET_BYTES = 1_450_000  # below a plain step at micro-batch 1 (1.6 MB), above the smallest plan (1.24 MB)
LR = 0.5


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    _reset_accelerate()
    yield
    _reset_accelerate()


def make_model() -> TinyTokenLM:
    torch.manual_seed(0)
    return TinyTokenLM(n_layer=4, d=32).to(F64)


def make_batch(b: int) -> dict[str, torch.Tensor]:
    return token_batch(b, seq_len=SEQ_LEN)


def dataset() -> list[dict[str, torch.Tensor]]:
    return token_samples(SAMPLES, SEQ_LEN)


def loader(batch_size: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=batch_size, shuffle=False)


def reference_weights(base: torch.nn.Module) -> list[torch.Tensor]:
    """One big-batch step per window, by hand: loss_sum / count of the window, one backward."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for window in loader(GLOBAL_BATCH):
        s, c = token_loss(model, window)
        (s / c).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """Largest weight difference relative to the largest change training made (per tensor)."""
    return max(
        float((g - w).abs().max() / (w - s).abs().max().clamp_min(1e-30))
        for g, w, s in zip(got, want, start, strict=True)
    )


@pytest.fixture(scope="module")
def fitted():
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(2)
    fit = memfit_accelerate.fit(
        Accelerator(cpu=True), model, BUDGET_BYTES, global_batch=GLOBAL_BATCH,
        make_batch=make_batch, loss_fn=token_loss, count_fn=token_count, optimizer="sgd",
    )  # fmt: skip
    _reset_accelerate()
    return model, before, fit


def run_memfit(model, fit, *, mixed_precision: str = "no", track: bool = False):
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    prepared, opt, dl = accelerator.prepare(model, opt, loader(GLOBAL_BATCH))
    acc = memfit_accelerate.ExactAccumulation(accelerator, prepared, micro_batch=fit.micro_batch)
    syncs, peaks = [], []
    for batch in dl:
        tracker = MemoryTracker(device="cpu").track(prepared, opt) if track else None
        with tracker if tracker is not None else _null():
            for micro in acc.window(batch, count_fn=token_count):
                micro.backward(token_loss(prepared, micro.batch))
                syncs.append(accelerator.sync_gradients)
            assert accelerator.sync_gradients
            opt.step()
            opt.zero_grad()
        if tracker is not None:
            peaks.append(tracker.peak_bytes)
    return [p.detach().clone() for p in model.parameters()], syncs, peaks


def _null():
    import contextlib

    return contextlib.nullcontext()


def run_accelerate_accumulate(base, micro_batch: int, k: int) -> list[torch.Tensor]:
    """accelerate's documented loop over micro-batches (the control)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    micro = [mb for w in loader(GLOBAL_BATCH) for mb in split_batch(w, _sizes(batch_size_of(w), micro_batch))]
    model, opt, dl = accelerator.prepare(model, opt, torch.utils.data.DataLoader(micro, batch_size=None))
    for batch in dl:
        with accelerator.accumulate(model):
            s, c = token_loss(model, batch)
            accelerator.backward(s / c)
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _sizes(n: int, b: int) -> list[int]:
    return [b] * (n // b) + ([n % b] if n % b else [])


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fit_measures_a_copy_and_applies_a_plan_that_recomputes(fitted) -> None:
    model, before, fit = fitted
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and buffers untouched
    assert is_applied(model) and applied_plan(model) == fit.plan
    assert not fit.plan.is_plain  # recompute, selective or segments, as timing picks
    assert fit.micro_batch < GLOBAL_BATCH and fit.measured_peak_bytes <= BUDGET_BYTES


def test_exact_accumulation_equals_one_big_batch_step_per_window(fitted) -> None:
    model, before, fit = fitted
    base = make_model()
    start = [p.detach().clone() for p in base.parameters()]
    want = reference_weights(base)
    got, syncs, _ = run_memfit(copy.deepcopy(model), fit)
    assert rel_err(got, want, start) < 1e-10  # float64: rounding only
    # accelerate.sync_gradients: False inside a window, True on its last micro-step
    k = -(-GLOBAL_BATCH // fit.micro_batch)
    assert syncs[:k] == [False] * (k - 1) + [True]
    # the control: accelerate's own accumulate() on the same micro-batches misses it
    _reset_accelerate()
    control = run_accelerate_accumulate(base, fit.micro_batch, k)
    assert rel_err(control, want, start) > 0.05


def test_measured_peak_of_each_window_is_within_the_budget(fitted) -> None:
    model, _, fit = fitted
    _, _, peaks = run_memfit(copy.deepcopy(model), fit, track=True)
    assert len(peaks) == 3 and max(peaks) <= BUDGET_BYTES
    # the same loop without the plan, one pass per window, needs more than the budget
    plain = make_model()
    opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
    window = next(iter(loader(GLOBAL_BATCH)))
    with MemoryTracker(device="cpu").track(plain, opt) as tracker:
        s, c = token_loss(plain, window)
        (s / c).backward()
        opt.step()
    assert tracker.peak_bytes > BUDGET_BYTES


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fit_with_a_policy_keeps_its_plan_within_the_budget() -> None:
    """fit(..., policy="all"): the applied plan recomputes every block, and the loop's windows
    (tracker) stay within the budget at the fitted micro-batch."""
    model = make_model()
    fit = memfit_accelerate.fit(
        Accelerator(cpu=True), model, BUDGET_BYTES, global_batch=GLOBAL_BATCH,
        make_batch=make_batch, loss_fn=token_loss, count_fn=token_count, optimizer="sgd", policy="all",
    )  # fmt: skip
    _reset_accelerate()
    assert str(fit.policy) == "all" and applied_plan(model).blocks == policy_plan(make_model(), "all").blocks
    _, _, peaks = run_memfit(copy.deepcopy(model), fit, track=True)
    assert max(peaks) <= BUDGET_BYTES


def test_bf16_mixed_precision_matches_the_big_batch_under_autocast(fitted) -> None:
    model, _, fit = fitted
    base = make_model().float()
    fp32 = copy.deepcopy(model).float()
    start = [p.detach().clone() for p in base.parameters()]
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for window in loader(GLOBAL_BATCH):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s, c = token_loss(ref, window)
        (s.float() / c).backward()
        opt.step()
        opt.zero_grad()
    want = [p.detach().clone() for p in ref.parameters()]
    got, _, _ = run_memfit(fp32, fit, mixed_precision="bf16")
    err = rel_err(got, want, start)
    assert err < 0.03  # bf16 rounds each micro-step's matmuls on its own
    _reset_accelerate()
    k = -(-GLOBAL_BATCH // fit.micro_batch)
    control = run_accelerate_accumulate(base, fit.micro_batch, k)
    assert rel_err(control, want, start) > 3 * max(err, 0.03)


def test_a_gradscaler_scales_each_micro_step_once_and_accelerate_unscales_once(fitted) -> None:
    # accelerate makes no GradScaler on CPU (fp16 autocast is GPU-only there); give it one by hand so
    # that the fp16 path runs: memfit scales each micro-step's loss, accelerate's optimizer
    # unscales, checks for inf/NaN and steps.
    model, _, fit = fitted
    base = make_model().float()
    start = [p.detach().clone() for p in base.parameters()]
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for window in loader(GLOBAL_BATCH):
        s, c = token_loss(ref, window)
        (s / c).backward()
        opt.step()
        opt.zero_grad()
    want = [p.detach().clone() for p in ref.parameters()]
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    fp32 = copy.deepcopy(model).float()
    opt = torch.optim.SGD(fp32.parameters(), lr=LR, momentum=0.9)
    prepared, opt, dl = accelerator.prepare(fp32, opt, loader(GLOBAL_BATCH))
    acc = memfit_accelerate.ExactAccumulation(accelerator, prepared, micro_batch=fit.micro_batch)
    for batch in dl:
        for micro in acc.window(batch, count_fn=token_count):
            micro.backward(token_loss(prepared, micro.batch))
        opt.step()
        opt.zero_grad()
    assert not opt.step_was_skipped and accelerator.scaler.get_scale() == 2.0**12
    assert rel_err([p.detach() for p in fp32.parameters()], want, start) < 1e-4  # float32 rounding


def test_refuses_accelerate_accumulation_and_prepared_models(fitted) -> None:
    model, _, fit = fitted
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    with pytest.raises(MemfitError, match="gradient_accumulation_steps=4"):
        memfit_accelerate.ExactAccumulation(accelerator, model, micro_batch=2)
    from torch.nn.parallel import DistributedDataParallel

    fake = DistributedDataParallel.__new__(DistributedDataParallel)
    with pytest.raises(MemfitError, match="before accelerator.prepare"):
        memfit_accelerate.fit(
            accelerator, fake, BUDGET_BYTES, global_batch=4, make_batch=make_batch, loss_fn=token_loss
        )


# -- 2 processes under torchrun (gloo) ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_worker(tmp_path: Path, *extra: str) -> dict:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), str(HERE), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", str(HERE / "integration_accelerate_worker.py"), str(tmp_path), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "rank0.json").read_text())


@pytest.mark.distributed
def test_two_processes_under_torchrun_equal_one_process(fitted, tmp_path) -> None:
    model, _, fit = fitted
    torch.save({"plan": fit.plan.to_dict(), "micro_batch": fit.micro_batch}, tmp_path / "fit.pt")
    out = _torchrun_worker(tmp_path)
    assert out["world_size"] == 2 and out["ddp"]
    got = torch.load(tmp_path / "weights.pt")
    one, _, _ = run_memfit(copy.deepcopy(model), fit)
    base = make_model()
    start = [p.detach().clone() for p in base.parameters()]
    want = reference_weights(base)
    assert rel_err(got, want, start) < 1e-10
    assert rel_err(got, one, start) < 1e-10


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_under_torchrun_plans_a_ddp_rank_within_the_budget(tmp_path) -> None:
    """fit() under torchrun (2 gloo ranks): rank 0 plans one DDP rank, whose gradient buckets
    (the trainable parameters' bytes, 153 KB here) come on top of a process's step; the rank's
    peak over the loop (tracker plus buckets) is within the budget."""
    out = _torchrun_worker(tmp_path, str(BUDGET_BYTES))
    assert out["world_size"] == 2 and out["ddp"]
    trainable = sum(p.numel() * p.element_size() for p in make_model().parameters())
    assert out["buckets_bytes"] == trainable
    assert out["rank_peak_bytes"] <= BUDGET_BYTES, out
    assert out["predicted_peak_bytes"] >= out["rank_peak_bytes"] - 0.03 * BUDGET_BYTES, out


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_memfit_imports_neither_framework_and_a_missing_one_names_the_extra(monkeypatch) -> None:
    code = (
        "import sys, memfit, memfit.integrations, memfit.integrations.accelerate; "
        "print(sorted(m for m in ('accelerate', 'lightning') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "src"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    with pytest.raises(MemfitError, match=r"pip install memfit\[accelerate\]"):
        memfit_accelerate.ExactAccumulation(object(), torch.nn.Linear(2, 2), micro_batch=1)


# -- token batches of a transformers model, without count_fn -------------------------------------

HF_VOCAB = 64


def hf_causal_lm() -> torch.nn.Module:
    """GPT-2 as transformers builds it from a config (float32: transformers' loss is float32 anyway)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=HF_VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def hf_loader(batch_size: int, n: int = 12) -> torch.utils.data.DataLoader:
    """Right-padded rows of 3..40 tokens, labels -100 on padding (as DataCollatorForLanguageModeling)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, HF_VOCAB, (int(t),), generator=g) for t in torch.randint(3, 41, (n,), generator=g)]

    def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        T = max(len(r) for r in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=collate)


def hf_reference(base: torch.nn.Module) -> list[torch.Tensor]:
    """One big-batch SGD step per window with the model's own loss (its mean over the window's tokens)."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for window in hf_loader(GLOBAL_BATCH):
        model(**window).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def run_hf_loop(base: torch.nn.Module, **acc_kw) -> tuple[list[torch.Tensor], list]:
    """The accelerate loop as users write it with memfit: the model's ``.loss``, no count_fn."""
    accelerator = Accelerator(cpu=True)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    prepared, opt, dl = accelerator.prepare(model, opt, hf_loader(GLOBAL_BATCH))
    acc = memfit_accelerate.ExactAccumulation(accelerator, prepared, micro_batch=2, **acc_kw)
    counts = []
    for batch in dl:
        for micro in acc.window(batch):
            micro.backward(prepared(**micro.batch).loss)
        counts.append(acc.last_result.count)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], counts


def test_token_batches_of_a_transformers_model_need_no_count_fn() -> None:
    """``micro.backward(model(**b).loss)`` without count_fn: each micro-batch's mean is weighted by
    the tokens GPT-2's loss averages over (labels[:, 1:] != -100), so the windows equal the big batch."""
    base = hf_causal_lm()
    start = [p.detach().clone() for p in base.parameters()]
    want = hf_reference(base)
    got, counts = run_hf_loop(base)
    assert rel_err(got, want, start) < 1e-5  # float32
    windows = list(hf_loader(GLOBAL_BATCH))
    assert counts == [float((w["labels"][:, 1:] != -100).sum()) for w in windows]
    # The control: micro-batch means weighted by samples (what the window did before) miss it.
    _reset_accelerate()
    control, _ = run_hf_loop(base, normalize="mean")
    assert rel_err(control, want, start) > 0.3  # measured 0.89 (memfit 2e-6)


def test_token_batches_of_another_model_need_count_fn() -> None:
    """A plain module gets the same batches: its mean cannot be weighted without knowing its
    tokens, so the first backward refuses with the fix; with count_fn the scalar mean is exact."""
    from memfit.accumulate import AccumulationError

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(HF_VOCAB, 16)
            self.out = torch.nn.Linear(16, HF_VOCAB)

        def forward(self, input_ids, labels, attention_mask=None):
            logits = self.out(self.emb(input_ids))[:, :-1]
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    base = Plain()
    accelerator = Accelerator(cpu=True)
    acc = memfit_accelerate.ExactAccumulation(accelerator, copy.deepcopy(base), micro_batch=2)
    window = next(iter(hf_loader(GLOBAL_BATCH)))
    with pytest.raises(AccumulationError, match="Pass count_fn= to acc.window"):
        for micro in acc.window(window):
            micro.backward(acc.model(**micro.batch))
    # with count_fn, the same scalar losses give the big batch's gradient
    model = copy.deepcopy(base)
    acc = memfit_accelerate.ExactAccumulation(accelerator, model, micro_batch=2)
    for micro in acc.window(window, count_fn=lambda b: int((b["labels"][:, 1:] != -100).sum())):
        micro.backward(model(**micro.batch))
    ref = copy.deepcopy(base)
    ref(**window).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_ddp_layout_is_read_from_the_accelerator() -> None:
    """The layout fit plans under: one DDP rank with the accelerator's bucket cap; none for one
    process or for engines that do not wrap the model in DDP."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    from memfit.integrations._fit import ddp_layout
    from memfit.plan.parallel import Parallel, ParallelKind

    ddp = SimpleNamespace(
        distributed_type=DistributedType.MULTI_GPU,
        num_processes=4,
        ddp_handler=DistributedDataParallelKwargs(bucket_cap_mb=10),
    )
    assert ddp_layout(ddp) == Parallel(kind=ParallelKind.DDP, world_size=4, bucket_cap_bytes=10 * 2**20)
    ddp.ddp_handler = None
    assert ddp_layout(ddp).bucket_cap_bytes == 25 * 2**20  # torch's default
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.NO):
        assert ddp_layout(SimpleNamespace(distributed_type=kind, num_processes=4, ddp_handler=None)) is None
    assert ddp_layout(Accelerator(cpu=True)) is None  # one process


def test_float_labels_are_not_token_batches() -> None:
    """Multi-label targets (B, C) of floats keep the sample mean; integer (B, T) labels are tokens."""
    from memfit.integrations._tokens import is_token_batch

    assert not is_token_batch({"input_ids": torch.zeros(2, 3), "labels": torch.rand(2, 5)})
    assert not is_token_batch({"labels": torch.tensor([1, 0])})
    assert is_token_batch({"labels": torch.ones(2, 3, dtype=torch.long)})
    assert is_token_batch({"shift_labels": torch.ones(2, 3, dtype=torch.long)})
