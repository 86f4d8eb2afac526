"""Long sequences: which attention kernel runs and what it keeps (memfit.capture.attention), batches of
another length (memfit.workload.with_seq_len), and the longest sequence that trains
(memfit.fitting.seq_len, memfit fit --seq-len auto)."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from memfit.capture.attention import AttentionKernel, cuda_kernel, inspect_attention
from memfit.capture.step import StepSpec
from memfit.cli.main import main
from memfit.errors import BudgetInfeasibleError, SpecError
from memfit.fitting.seq_len import SeqLenTry, _Search
from memfit.models.registry import load_workload
from memfit.workload import PositionLimit, with_seq_len

LLAMA = "hf:llama?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&intermediate_size=64&vocab_size=64"


# --- attention ----------------------------------------------------------------------------------


def test_fused_attention_is_linear_and_names_the_cpu_kernel() -> None:
    rep = inspect_attention(load_workload("demo?n_layer=2&n_embd=32&seq_len=32"), batch_size=2)
    assert [(c.kernel, c.calls, c.seq_len) for c in rep.calls] == [(AttentionKernel.CPU_FLASH, 2, 32)]
    assert rep.memory == "linear" and rep.quadratic_bytes == 0
    assert "linear" in rep.summary()


def test_padding_mask_is_quadratic_and_padding_false_removes_it() -> None:
    B, T, layers = 2, 48, 2
    rep = inspect_attention(load_workload(f"{LLAMA}&seq_len={T}"), batch_size=B)
    (call,) = rep.calls
    assert call.kernel is AttentionKernel.CPU_FLASH and call.mask == f"bool ({B}, 1, {T}, {T})"
    # SDPA turns the boolean mask into an additive float32 one per layer and keeps it for backward
    assert rep.memory == "quadratic" and rep.quadratic_bytes == layers * B * T * T * 4
    assert "padding=false" in rep.summary()
    assert call.cuda_kernel is AttentionKernel.EFFICIENT  # CUDA's flash kernel takes no mask
    packed = inspect_attention(load_workload(f"{LLAMA}&seq_len={T}&padding=false"), batch_size=B)
    assert packed.memory == "linear" and packed.calls[0].mask is None


def test_eager_attention_is_quadratic_with_the_sdpa_fix() -> None:
    B, T, heads, layers = 2, 40, 2, 2
    wl = load_workload(f"{LLAMA}&seq_len={T}&padding=false")
    wl.model.set_attn_implementation("eager")
    rep = inspect_attention(wl, batch_size=B)
    (call,) = rep.calls
    assert call.kernel is AttentionKernel.EAGER and call.calls == layers and call.cuda_kernel is None
    # the softmax's (B, heads, T, T) probabilities, float32, kept by the matmul with v
    assert rep.quadratic_bytes == layers * B * heads * T * T * 4
    assert rep.attn_implementation == "eager" and 'attn_implementation="sdpa"' in rep.summary()


def test_attention_dropout_on_cpu_runs_the_math_path() -> None:
    rep = inspect_attention(
        load_workload("hf:gpt2?n_layer=1&n_embd=32&n_head=2&vocab_size=64&seq_len=32&padding=false")
    )
    (call,) = rep.calls
    assert call.kernel is AttentionKernel.MATH and call.dropout_p > 0
    assert rep.memory == "quadratic" and any("dropout" in r for r in call.reasons)
    assert AttentionKernel.MATH.quadratic and not AttentionKernel.CPU_FLASH.quadratic


@pytest.mark.parametrize(
    ("dtype", "mask", "head_dim", "kernel"),
    [
        (torch.bfloat16, False, 64, AttentionKernel.FLASH),
        (torch.float16, False, 256, AttentionKernel.FLASH),
        (torch.bfloat16, False, 512, AttentionKernel.EFFICIENT),
        (torch.bfloat16, True, 64, AttentionKernel.EFFICIENT),
        (torch.float32, False, 64, AttentionKernel.EFFICIENT),
        (torch.float64, False, 64, AttentionKernel.MATH),
    ],
)
def test_cuda_kernel_follows_the_dispatcher_order(dtype, mask, head_dim, kernel) -> None:
    assert cuda_kernel(dtype, mask=mask, head_dim=head_dim) is kernel


def test_fake_step_keeps_cuda_math_probabilities_for_float64() -> None:
    from memfit.estimation.kernels import CudaKernels

    q = torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    with CudaKernels():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert "FlashAttentionForCpu" not in type(out.grad_fn).__name__  # CUDA has no fused float64 kernel


# --- batches of another length ------------------------------------------------------------------


def test_with_seq_len_makes_batches_of_that_length_for_the_same_model() -> None:
    wl = load_workload(f"{LLAMA}&seq_len=16&padding=false", dtype=torch.float64)
    w2 = with_seq_len(wl, 40)
    assert w2.model is wl.model and w2.info["seq_len"] == 40
    batch = w2.make_batch(3)
    assert batch["input_ids"].shape == (3, 40) and bool(batch["attention_mask"].all())
    loss_sum, count = w2.loss_fn(w2.model, batch)
    assert loss_sum.dtype == torch.float64 and int(count) == 3 * 39


def test_positions_learned_rope_and_scaled_rope() -> None:
    assert load_workload("hf:gpt2?n_layer=1&n_embd=32&n_head=2&vocab_size=64").positions == PositionLimit(
        max_positions=512, kind="learned"
    )
    assert load_workload(LLAMA).positions == PositionLimit(max_positions=2048, kind="rope")  # LlamaConfig's own
    from memfit.models.hf import position_limit

    wl = load_workload(LLAMA)  # a spec cannot carry rope parameters (a dict): set on the config
    wl.model.config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    assert position_limit(wl.model) == PositionLimit(max_positions=2048, kind="rope", rope_scaling="linear x4.0")
    demo = load_workload("demo?n_layer=1&n_embd=32&seq_len=64")
    with pytest.raises(SpecError, match="64 learned positions"):
        with_seq_len(demo, 65)


def test_a_workload_of_one_length_is_refused_with_the_fix() -> None:
    wl = load_workload("examples/convnet.py:build")
    with pytest.raises(SpecError, match="make_batch_at"):
        with_seq_len(wl, 128)


# --- the search against brute force on hand-built needs ------------------------------------------


class _Table(_Search):
    """The search with ``need(T)`` from a formula instead of profiles."""

    def __init__(self, need_fn, budget_bytes: int) -> None:
        super().__init__(
            workload=load_workload("demo?n_layer=1&n_embd=16&seq_len=16"),
            budget_bytes=budget_bytes, micro_batch=1, global_batch=1, step=StepSpec(), margin=0.0, options=None,
            heads=True, activations=True, policy=None, tiling=True, tile_modules=None, estimate=None, say=lambda s: None,
        )  # fmt: skip
        self.need_fn = need_fn

    def need(self, seq_len: int, predicted: int | None = None) -> SeqLenTry:
        n = int(self.need_fn(seq_len))
        tr = SeqLenTry(seq_len=seq_len, need_bytes=n, fits=n <= self.budget_bytes, predicted_seq_len=predicted)
        self.tries.append(tr)
        return tr


def _search(need_fn, budget: int, *, multiple: int, cap: int | None = None, quadratic: bool = False, start: int = 256):
    s = _Table(need_fn, budget)
    lo, hi = s.bracket(start, multiple, cap)
    lo, hi = s.narrow(lo, hi, multiple, cap, tolerance=1e-9, max_tries=20, quadratic=quadratic)
    return lo, hi, s.tries


def _brute(need_fn, budget: int, multiple: int, cap: int = 10**6) -> int:
    return max(t for t in range(multiple, cap + 1, multiple) if need_fn(t) <= budget)


@pytest.mark.parametrize("budget", [10_000_000, 37_000_000, 123_456_789])
def test_search_finds_the_brute_force_length_linear(budget: int) -> None:
    def need(t: int) -> float:
        return 5_000_000 + 1234 * t + (t % 7) * 100  # affine, with measurement noise

    lo, hi, tries = _search(need, budget, multiple=64)
    assert lo == _brute(need, budget, 64) and hi == lo + 64
    assert len(tries) <= 6  # the line predicts the answer in one or two measurements


def test_search_finds_the_brute_force_length_quadratic() -> None:
    def need(t: int) -> float:
        return 3_000_000 + 800 * t + 0.5 * t * t

    budget = 60_000_000
    lo, hi, tries = _search(need, budget, multiple=16, quadratic=True)
    assert lo == _brute(need, budget, 16) and hi == lo + 16
    assert len(tries) <= 8


def test_search_stops_at_the_position_cap_and_halves_below_the_start() -> None:
    def need(t: int) -> float:
        return 1000 * t

    lo, hi, _ = _search(need, 10**9, multiple=32, cap=2048)
    assert (lo, hi) == (2048, None)
    lo, hi, tries = _search(need, 100 * 1000, multiple=8, start=512)
    assert lo == 96 and hi == 104 and tries[1].seq_len == 256  # halved from 512 while over the budget
    with pytest.raises(BudgetInfeasibleError, match="not even 8 tokens"):
        _search(need, 1000, multiple=8, start=64)


# --- end to end -----------------------------------------------------------------------------------


def test_cli_seq_len_refusals(capsys) -> None:
    assert (
        main(["fit", "--model", "demo?n_layer=1", "--budget", "10MiB", "--global-batch", "2", "--seq-multiple", "8"])
        == 2
    )
    assert "--seq-len auto" in capsys.readouterr().err
    assert main(["fit", "--model", "demo?n_layer=1", "--budget", "10MiB"]) == 2
    assert "--global-batch G is required" in capsys.readouterr().err
    assert main(["fit", "--model", "demo", "--budget", "10MiB", "--seq-len", "long"]) == 2
    assert "neither a whole number of tokens nor auto" in capsys.readouterr().err
    assert main(["fit", "--model", "examples/convnet.py:build", "--budget", "1GiB", "--seq-len", "auto"]) == 2
    assert "make_batch_at" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_seq_len_auto_measured_fits_and_one_multiple_more_does_not(capsys, tmp_path) -> None:
    spec = f"{LLAMA}&seq_len=64&padding=false&max_position_embeddings=4096"
    budget = 3 * 2**20
    out = tmp_path / "plan.json"
    code = main(["fit", "--model", spec, "--seq-len", "auto", "--budget", str(budget), "--seq-multiple", "32",
                 "--repeats", "1", "--out", str(out), "--json"])  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and out.is_file()
    T = d["seq_len"]
    assert T % 32 == 0 and d["measured_peak_bytes"] <= budget
    search = d["seq_len_search"]
    assert search["limited_by"] == "budget" and search["upper_seq_len"] is not None
    assert d["attention"]["memory"] == "linear"
    # one multiple more needs more than the budget by its own stats (profiled, or scaled where its
    # profile would pass the budget: NOTE [ Bounded measurement ])
    assert any(t["seq_len"] == search["upper_seq_len"] and not t["fits"] for t in search["tries"])
    assert search["upper_seq_len"] - T <= max(32, 0.02 * T)


@pytest.mark.slow
def test_cli_seq_len_auto_estimated_for_a_gpu(capsys) -> None:
    spec = f"{LLAMA}&seq_len=256&padding=false&max_position_embeddings=1048576"
    code = main(["fit", "--model", spec, "--seq-len", "auto", "--budget", "64MiB", "--seq-multiple", "256",
                 "--estimate", "--target", "h100-sxm", "--dtype", "bfloat16", "--json"])  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["estimated"]["device"] == "h100-sxm" and d["measured_peak_bytes"] is None
    assert d["seq_len"] % 256 == 0 and d["predicted_peak_bytes"] <= 64 * 2**20
    assert d["seq_len_search"]["upper_seq_len"] > d["seq_len"]


def test_profile_json_says_which_attention_runs(capsys) -> None:
    spec = f"{LLAMA}&seq_len=32"
    code = main(["profile", "--model", spec, "--repeats", "1", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["attention"]["memory"] == "quadratic"  # the padding mask
    assert d["attention"]["calls"][0]["kernel"] == "cpu_flash"
    assert d["attention"]["quadratic_bytes"] == 2 * 4 * 32 * 32 * 4  # two layers' float masks, batch 4


class _Below:
    """The part of the search that ``_Search.below`` reads: tries, profiles, budget and margin;
    ``need`` records a length's try from a table of uncorrected needs."""

    def __init__(self, needs: dict[int, int], budget: int, profiled: tuple[int, ...]) -> None:
        self.needs, self.budget_bytes, self.margin = needs, budget, 0.02
        self.profiles = {1: dict.fromkeys(profiled)}
        self.tries = [
            SeqLenTry(seq_len=t, need_bytes=n, fits=n <= budget, stats="profiled" if t in profiled else "scaled")
            for t, n in needs.items()
            if t != 10_000
        ]
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)

    def need(self, seq_len: int) -> SeqLenTry:
        tr = SeqLenTry(seq_len=seq_len, need_bytes=self.needs.get(seq_len, 0), fits=True)
        self.tries.append(tr)
        return tr

    def below(self, over: int, measured: int | None) -> int:
        return _Search.below(self, over, measured, 64)  # type: ignore[arg-type]

    def _below(self, over: int, true_need_bytes: int, multiple: int) -> int:
        return _Search._below(self, over, true_need_bytes, multiple)  # type: ignore[arg-type]

    def _tried(self, seq_len: int) -> int:
        return _Search._tried(self, seq_len)  # type: ignore[arg-type]


def test_a_measured_window_over_the_budget_corrects_the_next_length() -> None:
    """Within 512 MiB the line through two short profiles read 5-8 % low at 11,000-12,500 tokens;
    the search then fell back to the longest length predicted to fit below (4,096 tokens, less than
    400 MiB gave). The next length comes from the measured error instead: a needs table that is
    affine in the length, extrapolated with the error growing from the last profile, lands where
    the corrected line meets the budget, between the longest corrected fit and the next length."""
    MiB = 2**20
    needs = {512: 384 * MiB, 4096: 400 * MiB, 11264: 492 * MiB, 12480: 512 * MiB - 1}
    s = _Below(needs, 512 * MiB, profiled=(256, 512))
    measured = int(540 * MiB)  # 7.6 % above the prediction without the margin
    t = s.below(12480, measured)
    error = measured * 1.02 / needs[12480] - 1
    corrected = {x: n * (1 + error * (x - 512) / (12480 - 512)) for x, n in needs.items()}
    assert corrected[4096] <= 512 * MiB < corrected[11264]  # 11,264 no longer fits once corrected
    want = 4096 + (512 * MiB - corrected[4096]) * (11264 - 4096) / (corrected[11264] - corrected[4096])
    assert t == int(want // 64 * 64) and 4096 < t < 11264
    assert s.tries[-1].seq_len == t and "above the line" in s.lines[-1]
    assert next(tr for tr in s.tries if tr.seq_len == 12480).measured_peak_bytes == measured


def test_without_a_measured_peak_the_search_takes_the_longest_length_predicted_to_fit() -> None:
    MiB = 2**20
    s = _Below({512: 384 * MiB, 4096: 400 * MiB, 8192: 450 * MiB}, 512 * MiB, profiled=(512,))
    assert s.below(8192, None) == 4096
    assert s.below(4096, None) == 512


class _Confirm:
    """The parts of the search that :meth:`_Search.confirm` uses: a need on the line through the
    profiles (``line``) and the need on a fake-tensor step's bytes at each length (``true``)."""

    def __init__(self, line, true, budget: int, lengths: tuple[int, ...]) -> None:
        self.line, self.true, self.budget_bytes, self.margin = line, true, budget, 0.02
        self.profiles = {1: dict.fromkeys((256, 512))}
        self.tries = [SeqLenTry(seq_len=t, need_bytes=line(t), fits=line(t) <= budget, stats="scaled") for t in lengths]
        self.notes = {t: {"stats": "scaled"} for t in lengths}
        self.confirmed: set[int] = set()
        self.stats: dict = collections.defaultdict(lambda: None)  # the scaled stats: made by need()
        self.micro_batch, self.workload, self.step, self.max_confirms = 1, None, StepSpec(), 3
        self.estimated: list[int] = []
        self.lines: list[str] = []

    def estimate_bytes(self, wl: int, step: StepSpec, **options) -> int:
        self.estimated.append(wl)
        return wl

    def say(self, line: str) -> None:
        self.lines.append(line)

    def _profile_options(self) -> dict:
        return {}

    def need_bytes(self, seq_len: int) -> int:  # on the stats confirm just gave it: the estimate's bytes
        assert self.stats[(seq_len, 1)] == seq_len
        return self.true(seq_len)

    def need(self, seq_len: int) -> SeqLenTry:
        tr = SeqLenTry(seq_len=seq_len, need_bytes=self.line(seq_len), fits=True, stats="scaled")
        self.notes[seq_len] = {"stats": "scaled"}
        self.tries.append(tr)
        return tr

    def _below(self, over: int, true_need_bytes: int, multiple: int) -> int:
        return _Search._below(self, over, true_need_bytes, multiple)  # type: ignore[arg-type]

    def _tried(self, seq_len: int) -> int:
        return _Search._tried(self, seq_len)  # type: ignore[arg-type]


def test_the_length_fitted_takes_its_bytes_from_a_fake_step_and_moves_below_when_over(monkeypatch) -> None:
    """The line through two short profiles read 7.6 % low at 12,491 tokens within 512 MiB, and the
    measured window there had to be followed by a second one. The length to fit is confirmed on the
    bytes of a fake-tensor step at its own length first: over the budget there, the next length is
    where the line corrected by that error meets the budget, and it is confirmed in turn (fits)."""
    import memfit.fitting.seq_len as seq_len_mod

    monkeypatch.setattr(seq_len_mod, "with_seq_len", lambda wl, t: t)  # the estimate sees the length
    monkeypatch.setattr(seq_len_mod, "with_bytes_of", lambda st, est: est)
    MiB = 2**20
    budget = 512 * MiB

    def line(x: int) -> int:  # 384 MiB at 512 tokens, the budget less a byte at 12,480
        return int(384 * MiB + (x - 512) * (128 * MiB - 1) / (12480 - 512))

    error = 540 * 1.02 * MiB / line(12480) - 1  # a window measured at 540 MiB: 7.6 % above the line

    def true(x: int) -> int:  # the error grows from nothing at the longest profile
        return int(line(x) * (1 + error * (x - 512) / (12480 - 512)))

    s = _Confirm(line, true, budget, lengths=(512, 4096, 12480))
    s.tries[0] = SeqLenTry(seq_len=512, need_bytes=line(512), fits=True, stats="profiled")
    s.notes[512] = {"stats": "profiled"}
    lo, hi = _Search.confirm(s, 12480, None, 64)  # type: ignore[arg-type]
    assert hi == 12480 and 4096 < lo < 12480 and s.estimated == [12480, lo]
    over = next(t for t in s.tries if t.seq_len == 12480)
    assert (over.scaled_need_bytes, over.need_bytes, over.fits) == (line(12480), true(12480), False)
    fitted = next(t for t in s.tries if t.seq_len == lo)
    assert fitted.need_bytes == true(lo) <= budget
    longest = max(x for x in range(512, 12480, 64) if true(x) <= budget)
    assert lo >= 0.95 * longest  # the corrected line's chord, a little below the longest that fits
    assert sum("from a fake-tensor step" in x for x in s.lines) == 2
    # a length already confirmed, or not scaled, is fitted as it is (no estimate)
    assert _Search.confirm(s, lo, hi, 64) == (lo, hi) and _Search.confirm(s, 512, hi, 64) == (512, hi)  # type: ignore[arg-type]
    assert s.estimated == [12480, lo]


def test_every_profile_is_predicted_by_the_callers_estimate_before_it_runs() -> None:
    """Not only the first: the line through the model's states and one profile read 439.05 MiB at 512
    tokens where the keep-all step measured (and the fake-tensor estimate said) 476.83 MiB; a profile
    the estimate puts over the budget is not run, and the length is marked too long to profile."""
    wl = with_seq_len(load_workload("demo?n_layer=1&n_embd=16&n_head=2&seq_len=256"), 64)
    budget = 64 * 2**20
    asked: list[int] = []

    def predict(w, b: int) -> int:
        asked.append(w.info["seq_len"])
        return budget + 1

    s = _Search(
        workload=wl, budget_bytes=budget, micro_batch=1, global_batch=1, step=StepSpec(), margin=0.02, options=None,
        heads=True, activations=True, policy=None, tiling=True, tile_modules=None, estimate=None, say=lambda _s: None,
        predict_profile_peak=predict,
    )  # fmt: skip
    s.profiles[1] = {64: None}  # a profile made already (its stats are not read here)
    s._profile(128, 1)
    assert asked == [128] and 128 not in s.profiles[1] and s.too_long[1] == 128
