"""Auto-fit ranks candidates by their window with exposed communication (memfit.plan.comm), against
hand arithmetic on the ring and the two-stream timeline.

The model is tests/test_parallel_estimate's 2-block ``_Tiny`` under DDP on 2 ranks, profiled at
micro-batches 1 and 2 with its seconds replaced by round numbers (as in tests/test_comm.py), so that
every window below is worked out by hand in the comments.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_parallel_estimate import _tiny_workload

from memfit import StepSpec
from memfit.cli.main import main
from memfit.estimation.devices import get_device, interconnect
from memfit.fitting.candidates import gradient_bytes, predict_candidates
from memfit.plan.comm import Interconnect, Link
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, ParallelKind, param_table, rank_stats
from memfit.profiling.blocks import profile

US = 1e-6
# Buckets of 32, 48 and 72 B (tests/test_comm.py's test_ddp_buckets_hand_computed): complete after
# the head's backward, block 1's and block 0's.
DDP = Parallel(kind=ParallelKind.DDP, world_size=2, first_bucket_bytes=16, bucket_cap_bytes=40)
# 100 kB/s bus bandwidth, no latency: an all-reduce of S bytes over 2 ranks moves 2(N-1)/N S = S bytes:
# 10 S us (320, 480 and 720 us for the three buckets).
SLOW = Interconnect(
    intra=Link(kind="test", bandwidth_bytes_per_s=1e5, efficiency=1.0, step_latency_s=0.0), base_latency_s=0.0
)


def _round(stats, block_fwd_us: float, block_bwd_us: float, head_us: float):
    """``stats`` with round seconds: each block ``block_fwd_us`` forward and ``block_bwd_us`` backward
    (recompute adds a forward), the head ``head_us`` forward and ``head_us`` backward, the optimizer 300 us."""
    f, b = block_fwd_us * US, block_bwd_us * US
    blocks = tuple(
        replace(x, fwd_s=f, bwd_s=b, options={"keep": replace(x.options["keep"], fwd_s=f, bwd_s=b), "recompute": replace(x.options["recompute"], fwd_s=f, bwd_s=b + f)})
        for x in stats.blocks
    )  # fmt: skip
    fwd, bwd = 2 * f + head_us * US, 2 * b + head_us * US
    step = fwd + bwd + 300 * US
    return replace(
        stats,
        blocks=blocks,
        fwd_s=fwd,
        bwd_s=bwd,
        step_s=step,
        step_s_by_option={"keep": step, "recompute": step + 2 * f},
    )


@pytest.fixture(scope="module")
def ranked():
    """Rank 0's Stats at micro-batches 1 and 2. Micro-batch 1: blocks 100 / 200 us, head 50 / 50 us
    (a pass 700 us); micro-batch 2: blocks 220 / 440 us, head 60 / 60 us (a pass 1440 us): per
    sample, micro-batch 1 computes faster (as small micro-batches do on CPUs)."""
    torch.set_num_threads(1)
    wl = _tiny_workload()
    table = None
    out = []
    for b, times in ((1, (100, 200, 50)), (2, (220, 440, 60))):
        st = _round(
            profile(wl, step=StepSpec(batch_size=b, repeats=1), options=BASE_OPTIONS, heads=False, activations=False),
            *times,
        )
        table = table or param_table(wl.model, [x.name for x in st.blocks])
        out.append(rank_stats(st, table, DDP, 0))
    grads, later = gradient_bytes(wl.model)
    return out, grads, later


def _fit(ranked, net: Interconnect | None):
    profiles, grads, later = ranked
    cands = predict_candidates(profiles, 2**30, 2, grads_bytes=grads, later_grads_bytes=later, margin=0.02, net=net)
    return {(c.micro_batch, c.accumulation_steps): c for c in cands}, cands[0]


def test_slow_link_turns_the_choice_to_one_larger_micro_batch(ranked) -> None:
    # Compute only (global batch 2 per rank, everything kept within 1 GiB):
    #   1 x 2: two passes of 700 us + the optimizer 300 = 1700 us;  2 x 1: 1440 + 300 = 1740 us -> 1 x 2 wins.
    by, best = _fit(ranked, None)
    assert by[1, 2].predicted_window_s == pytest.approx(1700 * US) and by[2, 1].predicted_window_s == pytest.approx(
        1740 * US
    )
    assert (best.micro_batch, best.accumulation_steps) == (1, 2) and best.communication is None
    assert best.ranked_samples_per_s == pytest.approx(2 / (1700 * US))
    # Over SLOW, DDP all-reduces its buckets on the last micro-step only (320, 480, 720 us), each issued
    # when the backward completing it ends, one at a time on the link; the optimizer waits for the last.
    # 2 x 1: forward 0-500, head backward 500-560 -> AR 560-880; block 1's backward 560-1000 -> AR 1000-1480;
    #   block 0's backward 1000-1440 -> AR 1480-2200 (link busy); optimizer 2200-2500: exposed 760 us.
    # 1 x 2: the first micro-step 0-700 without sync; the second: forward 0-250, head backward 250-300 ->
    #   AR 300-620; block 1's 300-500 -> AR 620-1100; block 0's 500-700 -> AR 1100-1820; optimizer 1820-2120:
    #   exposed 2120 - 1000 = 1120 us (a shorter backward hides less). Windows: 2 x 1 1740 + 760 = 2500 us,
    #   1 x 2 1700 + 1120 = 2820 us -> 2 x 1 wins.
    by, best = _fit(ranked, SLOW)
    assert by[2, 1].communication.exposed_s == pytest.approx(760 * US)
    assert by[1, 2].communication.exposed_s == pytest.approx(1120 * US)
    assert by[2, 1].predicted_window_with_comm_s == pytest.approx(2500 * US)
    assert by[1, 2].predicted_window_with_comm_s == pytest.approx(2820 * US)
    assert (best.micro_batch, best.accumulation_steps) == (2, 1)
    assert best.predicted_samples_per_s_with_comm == pytest.approx(2 / (2500 * US))
    # compute-only fields keep their meaning
    assert best.predicted_window_s == pytest.approx(1740 * US)
    d = best.to_dict()
    assert d["communication"]["comm_s"] == pytest.approx((320 + 480 + 720) * US) and d[
        "predicted_samples_per_s_with_comm"
    ] == pytest.approx(800.0)


def test_fast_link_agrees_with_compute_only(ranked) -> None:
    # H100 NVLink within a node: an all-reduce over 2 ranks takes NCCL's 8.4 us + 2 steps of 3.4 us
    # + S / 360 GB/s (15.2 us and a fraction of a ns): each hidden behind the backward still to run except the
    # last bucket's (72 B), which the optimizer waits for. Both windows expose one all-reduce: the order stays.
    h100 = interconnect(get_device("h100-sxm"))
    last_ar_s = 8.4e-6 + 2 * 3.4e-6 + 72 / 360e9
    by, best = _fit(ranked, h100)
    assert (best.micro_batch, best.accumulation_steps) == (1, 2)
    assert by[1, 2].predicted_window_with_comm_s == pytest.approx(1700 * US + last_ar_s)
    assert by[2, 1].predicted_window_with_comm_s == pytest.approx(1740 * US + last_ar_s)


TINY = "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4&num_key_value_heads=4&vocab_size=512"


@pytest.mark.slow
def test_cli_fit_and_estimate_report_communication(capsys) -> None:
    torch.set_num_threads(1)
    base = [
        "--model",
        TINY,
        "--seq-len",
        "64",
        "--dtype",
        "bfloat16",
        "--device",
        "h100-sxm",
        "--world-size",
        "8",
        "--parallel",
        "fsdp2",
    ]
    assert (
        main(["fit", *base, "--estimate", "--global-batch", "32", "--budget", "1GiB", "--gpus-per-node", "1", "--json"])
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    feasible = [c for c in d["candidates"] if c["feasible"]]
    assert all("communication" in c for c in feasible)
    # the choice is the candidate with the most samples/s once communication is added, and the output's
    # communication is that candidate's (one computation)
    best = max(feasible, key=lambda c: c["predicted_samples_per_s_with_comm"])
    assert (d["micro_batch"], d["accumulation_steps"]) == (best["micro_batch"], best["accumulation_steps"])
    assert (
        d["communication"]["exposed_s"] == best["communication"]["exposed_s"]
        and d["communication"]["link"] == "network"
    )
    assert d["communication"]["window_s"] == pytest.approx(best["predicted_window_with_comm_s"])
    # estimate --parallel: tokens/s from the batch's sequence length (64 tokens a sample)
    assert main(["estimate", *base, "--batch-size", "2", "--policy", "all", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["predicted_tokens_per_s"] == pytest.approx(64 * e["predicted_samples_per_s"])
    assert e["predicted_samples_per_s"] == pytest.approx(2 * 8 / e["predicted_step_s"])
    c = e["communication"]
    assert c["predicted_tokens_per_s"] == pytest.approx(64 * c["predicted_samples_per_s"]) and c[
        "window_s"
    ] == pytest.approx(e["predicted_step_s"] + c["exposed_s"])
