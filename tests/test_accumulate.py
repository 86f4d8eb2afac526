"""Accumulation equals the big batch: tokens, mean, sum, uneven windows, scaler, clipping, BN, resume."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from tiny_models import (
    TinyRegressor,
    TinyTokenLM,
    grads,
    max_rel_err,
    mean_workload,
    mse_mean,
    regression_batch,
    token_batch,
    token_count,
    token_loss,
    token_mean_loss,
    token_workload,
)
from torch import nn

from memfit.accumulate import (
    AccumulationError,
    Accumulator,
    BatchNormAccumulationWarning,
    convert_batchnorm_to_groupnorm,
    corrected_bn_momentum,
    disable_dropout,
    micro_batch_sizes,
    scale_lr,
)
from memfit.errors import SpecError
from memfit.verification import verify_accumulation

F64 = torch.float64


def _big_batch_grads(model: nn.Module, batch, loss_fn) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    s, c = loss_fn(model, batch) if loss_fn is token_loss else (loss_fn(model, batch), None)
    (s / c if c is not None else s).backward()
    return grads(model)


def _acc_grads(model: nn.Module, batch, micro_batch: int, **kw) -> tuple[list[torch.Tensor], object]:
    model.zero_grad(set_to_none=True)
    loss_fn = kw.pop("loss_fn", token_loss)
    count_fn = kw.pop("count_fn", None)
    acc = Accumulator(model, None, micro_batch=micro_batch, **kw)
    res = acc.step(batch, loss_fn, count_fn=count_fn)
    return grads(model), res


def _naive_token_mean_grads(model: nn.Module, batch, micro_batch: int) -> list[torch.Tensor]:
    """accelerate's / Lightning's documented loop: each micro-batch's own mean, divided by k."""
    from memfit.workload import batch_size_of, split_batch

    model.zero_grad(set_to_none=True)
    sizes = micro_batch_sizes(batch_size_of(batch), micro_batch)
    for piece in split_batch(batch, sizes):
        (token_mean_loss(model, piece) / len(sizes)).backward()
    return grads(model)


# -- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sort", [False, True], ids=["random-lengths", "length-sorted"])
@pytest.mark.parametrize("with_count_fn", [True, False], ids=["count_fn", "deferred-count"])
def test_tokens_fp64_equals_big_batch(sort: bool, with_count_fn: bool) -> None:
    torch.manual_seed(0)
    model = TinyTokenLM().to(F64)
    batch = token_batch(10, sort=sort)  # 10 = 4 + 4 + 2: uneven last micro-batch
    want = _big_batch_grads(model, batch, token_loss)
    model.zero_grad(set_to_none=True)
    acc = Accumulator(model, None, micro_batch=4, normalize="tokens")
    res = acc.step(batch, token_loss, count_fn=token_count if with_count_fn else None)
    assert res.micro_steps == 3 and res.count == token_count(batch)
    assert max_rel_err(grads(model), want) < 1e-12
    with torch.no_grad():
        s, c = token_loss(model, batch)
    assert res.loss == pytest.approx(float(s / c), rel=1e-12)
    # The same batches through the anchors' per-micro-batch token means are clearly off, so the
    # tolerance above is meaningful.
    assert max_rel_err(_naive_token_mean_grads(model, batch, 4), want) > 1e-2


def test_auto_normalisation_picks_tokens_and_mean() -> None:
    torch.manual_seed(1)
    model = TinyTokenLM().to(F64)
    batch = token_batch(7)
    want = _big_batch_grads(model, batch, token_loss)
    got, res = _acc_grads(model, batch, 3)  # auto, no count_fn -> tokens (deferred)
    assert max_rel_err(got, want) < 1e-12 and res.count == token_count(batch)

    reg = TinyRegressor().to(F64)
    x = tuple(t.to(F64) for t in regression_batch(7))
    want = _big_batch_grads(reg, x, mse_mean)
    got, res = _acc_grads(reg, x, 3, loss_fn=mse_mean)
    assert max_rel_err(got, want) < 1e-12 and res.count == 7


@pytest.mark.parametrize("micro_batch", [1, 3, 5, 9])
def test_mean_loss_uneven_last_micro_batch(micro_batch: int) -> None:
    torch.manual_seed(2)
    model = TinyRegressor().to(F64)
    batch = tuple(t.to(F64) for t in regression_batch(9))
    want = _big_batch_grads(model, batch, mse_mean)
    got, res = _acc_grads(model, batch, micro_batch, loss_fn=mse_mean, normalize="mean")
    assert res.micro_steps == math.ceil(9 / micro_batch)
    assert max_rel_err(got, want) < 1e-12
    with torch.no_grad():
        assert res.loss == pytest.approx(float(mse_mean(model, batch)), rel=1e-12)
    # Dividing each micro-batch mean by k (the common mistake) is off when the last is short.
    if 9 % micro_batch:
        model.zero_grad(set_to_none=True)
        sizes = micro_batch_sizes(9, micro_batch)
        start = 0
        for s in sizes:
            (mse_mean(model, (batch[0][start : start + s], batch[1][start : start + s])) / len(sizes)).backward()
            start += s
        assert max_rel_err(grads(model), want) > 1e-3


def test_sum_normalisation() -> None:
    torch.manual_seed(3)
    model = TinyTokenLM().to(F64)
    batch = token_batch(6)
    model.zero_grad(set_to_none=True)
    token_loss(model, batch)[0].backward()
    want = grads(model)
    got, res = _acc_grads(model, batch, 4, normalize="sum", count_fn=token_count)
    assert max_rel_err(got, want) < 1e-12 and res.count == 1.0

    reg = TinyRegressor().to(F64)
    x = tuple(t.to(F64) for t in regression_batch(5))
    reg.zero_grad(set_to_none=True)
    (mse_mean(reg, x) * 5).backward()
    want = grads(reg)
    got, _ = _acc_grads(reg, x, 2, loss_fn=mse_mean, normalize="sum")
    assert max_rel_err(got, want) < 1e-12


def test_micro_step_flags_and_window_api() -> None:
    torch.manual_seed(4)
    model = TinyTokenLM().to(F64)
    acc = Accumulator(model, None, micro_batch=2)
    batch = token_batch(5)
    seen = []
    for micro in acc.window(batch, count_fn=token_count):
        seen.append((micro.index, micro.size, micro.sync_gradients))
        micro.backward(token_loss(model, micro.batch))
    assert seen == [(0, 2, False), (1, 2, False), (2, 1, True)]
    assert acc.last_result is not None and acc.windows == 1 and acc.samples_seen == 5
    assert micro_batch_sizes(10, 4) == [4, 4, 2] and micro_batch_sizes(3, 8) == [3]


def test_misuse_is_refused() -> None:
    torch.manual_seed(5)
    model = TinyTokenLM().to(F64)
    acc = Accumulator(model, None, micro_batch=2)
    with pytest.raises(AccumulationError, match="without micro.backward"):
        for _micro in acc.window(token_batch(4)):
            pass
    # count_fn that disagrees with loss_fn's count (HF's unshifted-label count): refused, with the factor
    with pytest.raises(AccumulationError, match="count_fn counted"):
        acc.step(token_batch(4), token_loss, count_fn=lambda b: int(b["mask"].sum()))
    with pytest.raises(AccumulationError, match="needs loss_fn to return"):
        Accumulator(model, None, micro_batch=2, normalize="tokens").step(token_batch(4), token_mean_loss)
    with pytest.raises(SpecError, match="unknown normalize"):
        Accumulator(model, None, micro_batch=2, normalize="avg")
    with pytest.raises(SpecError):
        Accumulator(model, None, micro_batch=0)


def test_optimizer_step_only_at_boundary() -> None:
    torch.manual_seed(6)
    model = TinyTokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = {"step": 0}
    opt.register_step_post_hook(lambda *_: calls.__setitem__("step", calls["step"] + 1))
    acc = Accumulator(model, opt, micro_batch=2, scheduler=sched)
    for micro in acc.window(token_batch(6), count_fn=token_count):
        micro.backward(token_loss(model, micro.batch))
        assert calls["step"] == 0  # no step inside the window
        assert all(p.grad is not None for p in model.parameters())  # no zero_grad inside either
    assert calls["step"] == 1 and acc.optimizer_steps == 1
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert acc.last_result.lr == pytest.approx(0.1)


# -- GradScaler, clipping, autocast ----------------------------------------------------------------


def test_grad_scaler_overflow_in_one_micro_step_skips_the_window() -> None:
    torch.manual_seed(7)
    model = TinyTokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = Accumulator(model, opt, micro_batch=2, scaler=scaler, scheduler=sched, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]

    def overflow_second(m, batch):
        s, c = token_loss(m, batch)
        overflow_second.calls += 1
        return (s * float("inf") if overflow_second.calls == 2 else s), c

    overflow_second.calls = 0
    res = acc.step(token_batch(6), overflow_second, count_fn=token_count)
    assert res.skipped and acc.skipped_steps == 1 and acc.optimizer_steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert scaler.get_scale() == 2.0**9  # scaler.update() ran and backed off
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # scheduler not stepped

    res = acc.step(token_batch(6), token_loss, count_fn=token_count)
    assert not res.skipped and acc.optimizer_steps == 1 and acc.skipped_steps == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_grad_scaler_gives_the_unscaled_gradient() -> None:
    torch.manual_seed(8)
    model = TinyTokenLM()
    batch = token_batch(6)
    want = _big_batch_grads(model, batch, token_loss)
    model.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    acc = Accumulator(model, None, micro_batch=4, scaler=scaler)
    acc.step(batch, token_loss, count_fn=token_count)
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))  # grads were scaled by 2^8
    assert max_rel_err(grads(model), want) < 1e-5


def test_clipping_at_boundary_equals_clipping_the_big_batch() -> None:
    torch.manual_seed(9)
    ref = TinyTokenLM().to(F64)
    model = copy.deepcopy(ref)
    batch = token_batch(10)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1.0)
    s, c = token_loss(ref, batch)
    (s / c).backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert norm_ref > 0.05  # clipping is active
    opt_ref.step()

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    res = Accumulator(model, opt, micro_batch=3, max_grad_norm=0.05).step(batch, token_loss, token_count)
    assert res.grad_norm == pytest.approx(float(norm_ref), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_autocast_bf16_runs_and_stays_close() -> None:
    torch.manual_seed(10)
    model = TinyTokenLM()
    batch = token_batch(8)
    want = _big_batch_grads(model, batch, token_loss)
    model.zero_grad(set_to_none=True)
    acc = Accumulator(model, None, micro_batch=4, autocast_dtype=torch.bfloat16)
    seen = []

    def loss_fn(m, b):
        seen.append(torch.is_autocast_enabled("cpu"))
        return token_loss(m, b)

    acc.step(batch, loss_fn, count_fn=token_count)
    assert seen == [True, True] and not torch.is_autocast_enabled("cpu")
    assert max_rel_err(grads(model), want) < 5e-2


# -- BatchNorm -----------------------------------------------------------------------------------


def test_batchnorm_warns_once_with_the_options() -> None:
    torch.manual_seed(11)
    model = TinyRegressor(bn=True)
    acc = Accumulator(model, None, micro_batch=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(regression_batch(8), mse_mean)
        acc.step(regression_batch(8), mse_mean)
    msgs = [str(w.message) for w in caught if issubclass(w.category, BatchNormAccumulationWarning)]
    assert len(msgs) == 1
    for option in ("'freeze'", "'momentum'", "'groupnorm'", "convert_batchnorm_to_groupnorm", "'ghost'"):
        assert option in msgs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormAccumulationWarning)
        Accumulator(model, None, micro_batch=8).step(regression_batch(8), mse_mean)  # k == 1
        Accumulator(model, None, micro_batch=2, bn="ghost").step(regression_batch(8), mse_mean)
        model.eval()
        Accumulator(model, None, micro_batch=2).step(regression_batch(8), mse_mean)  # BN in eval


def test_corrected_momentum_math_and_effect() -> None:
    m, k = 0.1, 4
    mk = corrected_bn_momentum(m, k)
    assert (1 - mk) ** k == pytest.approx(1 - m, rel=1e-14)
    assert corrected_bn_momentum(m, 1) == pytest.approx(m)
    # k micro-batches with the same statistics move the running mean exactly as one big batch.
    torch.manual_seed(12)
    model = TinyRegressor(bn=True).to(F64)
    piece = tuple(t.to(F64) for t in regression_batch(3))
    batch = (piece[0].repeat(k, 1), piece[1].repeat(k, 1))
    ref = copy.deepcopy(model)
    ref(batch[0])
    acc = Accumulator(model, None, micro_batch=3, bn="momentum")
    acc.step(batch, mse_mean)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-12, atol=1e-14)
    assert model.bn.momentum == 0.1  # restored after the window
    # without the correction it moves too far
    plain = copy.deepcopy(ref)
    plain.bn.reset_running_stats()
    Accumulator(plain, None, micro_batch=3, bn="ghost").step(batch, mse_mean)
    assert not torch.allclose(plain.bn.running_mean, ref.bn.running_mean, rtol=1e-3)


def test_freeze_and_groupnorm_are_exact() -> None:
    torch.manual_seed(13)
    model = TinyRegressor(bn=True).to(F64)
    model.bn.running_mean.normal_()
    batch = tuple(t.to(F64) for t in regression_batch(9))
    ref = copy.deepcopy(model)
    ref.bn.eval()
    want = _big_batch_grads(ref, batch, mse_mean)
    stats = model.bn.running_mean.clone()
    got, _ = _acc_grads(model, batch, 2, loss_fn=mse_mean, bn="freeze")
    assert max_rel_err(got, want) < 1e-12
    assert torch.equal(model.bn.running_mean, stats) and model.bn.training

    gn_model = TinyRegressor(bn=True).to(F64)
    weight = gn_model.bn.weight
    opt = torch.optim.SGD(gn_model.parameters(), lr=0.1)
    acc = Accumulator(gn_model, opt, micro_batch=2, bn="groupnorm")
    assert isinstance(gn_model.bn, nn.GroupNorm) and gn_model.bn.weight is weight
    assert not any(isinstance(m, nn.BatchNorm1d) for m in gn_model.modules())
    ref = copy.deepcopy(gn_model)
    want = _big_batch_grads(ref, batch, mse_mean)
    got, _ = _acc_grads(gn_model, batch, 2, loss_fn=mse_mean)
    assert max_rel_err(got, want) < 1e-12
    assert acc.bn.value == "groupnorm"
    conv = convert_batchnorm_to_groupnorm(nn.Sequential(nn.Conv2d(3, 48, 1), nn.BatchNorm2d(48)))
    assert conv[1].num_groups == 24


# -- LR, resume, dropout -------------------------------------------------------------------------


def test_scale_lr_rules() -> None:
    assert scale_lr(0.1, 256, 1024) == pytest.approx(0.4)
    assert scale_lr(0.1, 256, 64, rule="linear") == pytest.approx(0.025)
    assert scale_lr(1e-3, 32, 128, rule="sqrt") == pytest.approx(2e-3)
    with pytest.raises(SpecError):
        scale_lr(0.1, 256, 1024, rule="cubic")
    with pytest.raises(SpecError):
        scale_lr(0.1, 0, 1024)


def _train(acc: Accumulator, model: nn.Module, steps: int) -> None:
    for _ in range(steps - acc.windows):
        acc.step(token_batch(6), token_loss, count_fn=token_count)  # data drawn from the torch RNG


def _fresh(seed: int) -> tuple[nn.Module, Accumulator]:
    torch.manual_seed(seed)
    model = TinyTokenLM(dropout=0.2)  # dropout: the RNG state matters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = Accumulator(model, opt, micro_batch=4, scheduler=sched, max_grad_norm=1.0)
    return model, acc


def test_resume_is_bitwise(tmp_path) -> None:
    model, acc = _fresh(0)
    _train(acc, model, 6)
    want = [p.detach().clone() for p in model.parameters()]

    model, acc = _fresh(0)
    _train(acc, model, 3)
    torch.save(acc.state_dict(extra={"note": "half"}), tmp_path / "state.pt")
    torch.manual_seed(123)  # the process that resumes is in another RNG state
    model, acc = _fresh(99)  # and starts from other weights
    extra = acc.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert extra == {"note": "half"} and acc.windows == 3 and acc.optimizer_steps == 3
    _train(acc, model, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, model.parameters(), strict=True))

    # Without the RNG states (data order and dropout masks) the run would differ: the test can fail.
    model, acc = _fresh(0)
    _train(acc, model, 3)
    state = acc.state_dict()
    model, acc = _fresh(99)
    rng = torch.get_rng_state()
    acc.load_state_dict(state)
    torch.set_rng_state(rng)
    _train(acc, model, 6)
    assert not all(torch.equal(a, b) for a, b in zip(want, model.parameters(), strict=True))


def test_state_dict_refused_inside_a_window() -> None:
    model, acc = _fresh(0)
    with pytest.raises(AccumulationError, match="inside a window"):
        for micro in acc.window(token_batch(6), count_fn=token_count):
            micro.backward(token_loss(model, micro.batch))
            acc.state_dict()


def test_disable_dropout_covers_modules_and_config_attributes() -> None:
    class Cfg:  # HF configs keep their values as instance attributes
        def __init__(self) -> None:
            self.attention_dropout = 0.1
            self.hidden_size = 8

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = Cfg()
            self.attention_dropout = 0.3
            self.drop = nn.Dropout(0.5)

    m = nn.Sequential(Attn(), nn.Dropout1d(0.2))
    assert disable_dropout(m) == 4
    assert m[0].drop.p == 0 and m[0].attention_dropout == 0 and m[0].config.attention_dropout == 0
    assert m[1].p == 0 and m[0].config.hidden_size == 8


# -- verify_accumulation and built-in workloads ----------------------------------------------------


def test_verify_accumulation_tiny_workloads() -> None:
    for wl in (token_workload(sort=True, dropout=0.3), mean_workload()):
        out = verify_accumulation(wl, 10, 4)
        assert out["max_grad_rel_err"] < 1e-12, out
        assert out["micro_steps"] == 3 and out["buffers_equal"] and not out["missing_grads"]
    out = verify_accumulation(token_workload(), 10, 4, normalize="mean")
    assert out["max_grad_rel_err"] > 1e-3  # per-micro-batch token means are not the big batch


@pytest.mark.parametrize("policy", ["all", "every:2"])
def test_verify_accumulation_with_a_checkpoint_plan(policy: str) -> None:
    wl = token_workload(dropout=0.1, seed=3)
    wl.model.blocks.extend(TinyTokenLM(n_layer=2).blocks)  # 4 blocks
    out = verify_accumulation(wl, 9, 4, plan=policy)
    assert out["max_grad_rel_err"] < 1e-12, out


BUILTIN_SPECS = [
    "demo?n_layer=2&n_embd=32&n_head=2&seq_len=32",
    "hf:gpt2?num_hidden_layers=2&hidden_size=64&num_attention_heads=2&vocab_size=128",
    "hf:llama?num_hidden_layers=2&hidden_size=64&num_attention_heads=2&num_key_value_heads=2&intermediate_size=128&vocab_size=128",
]


@pytest.mark.parametrize("spec", BUILTIN_SPECS, ids=["demo", "hf-gpt2", "hf-llama"])
@pytest.mark.parametrize("policy", [None, "all"])
@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_builtin_workloads_fp64(spec: str, policy: str | None) -> None:
    from memfit.models.registry import load_workload

    wl = load_workload(spec, seq_len=32)
    out = verify_accumulation(wl, 8, 3, plan=policy)
    assert out["max_grad_rel_err"] <= 1e-10, out
    assert out["normalize"] == "tokens" and out["micro_steps"] == 3


# -- memfit train (one process; torchrun is in test_distributed.py) --------------------------------


def _train_cli(capsys, *extra: str) -> dict:
    import json

    from memfit.cli.main import main

    argv = ["train", "--model", BUILTIN_SPECS[0], "--global-batch", "6", "--micro-batch", "4", "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_train_cli_resume_is_bitwise(tmp_path, capsys) -> None:
    full = _train_cli(capsys, "--steps", "4", "--save", str(tmp_path / "full.pt"))
    assert full["optimizer_steps"] == 4 and full["accumulation_steps"] == 2 and len(full["losses"]) == 4
    assert full["peak_bytes"] > 0 and full["peak_measured_by"].startswith("MemoryTracker")
    _train_cli(capsys, "--steps", "2", "--save", str(tmp_path / "half.pt"))
    rest = _train_cli(
        capsys, "--steps", "4", "--resume", str(tmp_path / "half.pt"), "--save", str(tmp_path / "resumed.pt")
    )
    assert rest["start_step"] == 2 and rest["losses"] == full["losses"][2:]
    a = torch.load(tmp_path / "full.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["counters"] == b["counters"]


def test_train_cli_with_a_policy_trains_like_without(capsys) -> None:
    plain = _train_cli(capsys, "--steps", "2", "--dtype", "float64")
    planned = _train_cli(capsys, "--steps", "2", "--dtype", "float64", "--policy", "all")
    assert planned["policy"] == "all"
    assert planned["losses"] == pytest.approx(plain["losses"], rel=1e-12)


def test_an_exception_mid_window_restores_state_and_the_next_step_is_exact() -> None:
    torch.manual_seed(14)
    model = TinyRegressor(bn=True).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt, micro_batch=2, bn="momentum")
    batch = tuple(t.to(F64) for t in regression_batch(6))

    def failing(m, b):
        failing.calls += 1
        if failing.calls == 2:
            raise RuntimeError("out of memory (simulated)")
        return mse_mean(m, b)

    failing.calls = 0
    with pytest.raises(RuntimeError, match="simulated"):
        acc.step(batch, failing)
    assert model.bn.momentum == 0.1 and acc.windows == 0 and acc.optimizer_steps == 0
    # a low-level window abandoned half-way is closed by the next one
    for micro in acc.window(batch):
        micro.backward(mse_mean(model, micro.batch))
        break
    assert model.bn.momentum != 0.1  # still inside the abandoned window
    captured = []
    opt.register_step_pre_hook(lambda *_: captured.append(grads(model)))
    model.bn.eval()  # BN frozen so that the big batch is an exact reference
    ref = copy.deepcopy(model)
    want = _big_batch_grads(ref, batch, mse_mean)
    result = acc.step(batch, mse_mean)  # closes the abandoned window; starts from zero gradients
    assert model.bn.momentum == 0.1 and result.step == 1 and acc.windows == 1
    assert max_rel_err(captured[-1], want) < 1e-12


def _hf_workload(kind: str) -> object:
    """A transformers model built from a tiny config (no download), trained on padded token rows."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, vocab_size=64, max_position_embeddings=32, attention_dropout=0.1,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        lengths = torch.randint(3, 17, (b,))
        mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, 64, (b, 16)) * mask
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def loss_fn(m, batch):
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        s = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        return s, (labels != -100).sum()

    from memfit.workload import Workload

    return Workload(
        name=f"test-{kind}",
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        count_fn=lambda batch: int((batch["labels"][:, 1:] != -100).sum()),
    )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_models_fp64(kind: str) -> None:
    out = verify_accumulation(_hf_workload(kind), 10, 4)
    assert out["ok"] and out["max_grad_rel_err"] <= 1e-12, out
    assert out["dropout_disabled"] > 0  # GPT-2's dropout modules, Llama's attention_dropout attribute


# -- progress, mark / rewind, the saved RNG state ---------------------------------------------------


def test_progress_says_where_a_window_stopped() -> None:
    torch.manual_seed(3)
    model = TinyRegressor().to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, micro_batch=2)
    batch = tuple(t.to(F64) for t in regression_batch(6))  # 3 micro-steps
    assert acc.progress is None
    calls = []

    def failing(m, b):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure in micro-step 2")
        return mse_mean(m, b)

    with pytest.raises(RuntimeError, match="simulated"):
        acc.step(batch, failing)
    p = acc.progress
    assert (p.window, p.backpropagated, p.micro_steps, p.describe()) == (0, 1, 3, "micro-step 2 of 3")
    handle = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("simulated in step")))
    with pytest.raises(RuntimeError, match="in step"):
        acc.step(batch, mse_mean)
    assert acc.progress.at_boundary and acc.progress.describe() == "optimizer step" and len(calls) == 2
    handle.remove()


@pytest.mark.parametrize("where", ["micro-step", "optimizer step"])
def test_rewind_then_redo_equals_an_uninterrupted_run(where: str) -> None:
    """A window that fails, rewound to its mark and run again, ends bitwise where a run without the
    failure ends: dropout masks (RNG put back), counters and gradients (dropped) included."""

    def run(fail: bool) -> tuple[nn.Module, Accumulator]:
        torch.manual_seed(0)
        model = TinyTokenLM(dropout=0.2).to(F64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        acc = Accumulator(model, opt, micro_batch=3)
        torch.manual_seed(1)
        batches = [token_batch(8) for _ in range(3)]
        calls = []

        def failing(m, x):
            calls.append(1)
            if where == "micro-step" and len(calls) == 2:
                raise RuntimeError("simulated failure")
            return token_loss(m, x)

        torch.manual_seed(2)  # the training RNG: dropout
        for i, b in enumerate(batches):
            if fail and i == 1:
                mark = acc.mark()
                hook = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("simulated failure")))
                if where == "micro-step":
                    hook.remove()
                with pytest.raises(RuntimeError, match="simulated"):
                    acc.step(b, failing, count_fn=token_count)
                hook.remove()
                if where == "optimizer step":  # the boundary had counted the window already
                    assert acc.windows == mark.counters.windows + 1
                acc.rewind(mark)
                assert acc.counters == mark.counters and acc.progress is None
                assert all(p.grad is None for p in model.parameters())
            acc.step(b, token_loss, count_fn=token_count)
        return model, acc

    (m1, acc1), (m2, acc2) = run(fail=True), run(fail=False)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert acc1.counters == acc2.counters and acc1.counters.windows == 3
    assert acc1.last_result == acc2.last_result


def test_saved_rng_state_keeps_its_format_and_restores_every_generator(tmp_path) -> None:
    """The ``rng`` part of ``memfit.accumulate/1`` states, written out here as memfit wrote it before
    the RNG capture moved to ``RngSnapshot``; a saved state puts torch, Python and NumPy back."""
    import random

    import numpy as np

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    random.gauss(0, 1)  # a cached Gaussian in both
    np.random.standard_normal()
    model = nn.Linear(2, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=1)
    state = acc.state_dict()
    rng = state["rng"]
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    assert list(rng) == ["torch", "python", "numpy"] or list(rng) == ["torch", "python", "cuda", "numpy"]
    assert torch.equal(rng["torch"], torch.get_rng_state())
    assert rng["python"] == {"version": version, "internal": list(internal), "gauss_next": gauss}
    assert type(rng["python"]["internal"]) is list and gauss is not None
    assert {k: type(v) for k, v in rng["numpy"].items()} == {
        "name": str, "keys": torch.Tensor, "pos": int, "has_gauss": int, "cached_gaussian": float
    }  # fmt: skip
    assert rng["numpy"]["keys"].dtype == torch.int64 and np.array_equal(rng["numpy"]["keys"].numpy(), keys)
    assert (rng["numpy"]["name"], rng["numpy"]["pos"], rng["numpy"]["has_gauss"], rng["numpy"]["cached_gaussian"]) == (
        name,
        pos,
        has_gauss,
        cached,
    )
    torch.save(state, tmp_path / "s.pt")
    want = (torch.rand(4), random.random(), random.gauss(0, 1), np.random.rand(4), np.random.standard_normal())
    acc.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    got = (torch.rand(4), random.random(), random.gauss(0, 1), np.random.rand(4), np.random.standard_normal())
    assert torch.equal(got[0], want[0]) and got[1:3] == want[1:3]
    assert np.array_equal(got[3], want[3]) and got[4] == want[4]
