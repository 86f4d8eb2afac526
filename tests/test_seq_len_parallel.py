"""``memfit fit --seq-len auto --world-size N --parallel ddp|fsdp2``: the longest sequence for one rank
(memfit.fitting.seq_len with ``parallel=``), as ``memfit fit --world-size`` fits a rank.

References: the same search for one process at the same budget (bytes: a DDP rank holds its gradient
buckets besides, so it reaches no longer), and the rank's cost model at the length found, built here
from a profile of that length (``rank_stats`` and the window's costs): the need it gives is the try's."""

from __future__ import annotations

import json

import pytest
import torch

from memfit.capture.step import StepSpec
from memfit.cli.main import main
from memfit.fitting.seq_len import fit_seq_len
from memfit.models.registry import load_workload
from memfit.plan.costmodel import ChainCosts
from memfit.plan.options import BASE_OPTIONS
from memfit.plan.parallel import Parallel, ParallelKind, rank_param_table, rank_stats
from memfit.plan.solve import min_budget
from memfit.plan.window import window_costs
from memfit.profiling.blocks import profile
from memfit.workload import with_seq_len

LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&intermediate_size=64&vocab_size=64"
    "&seq_len=64&padding=false&max_position_embeddings=4096"
)
MiB = 2**20


@pytest.mark.slow
def test_a_ranks_search_uses_the_ranks_costs() -> None:
    torch.set_num_threads(1)
    wl = load_workload(LLAMA)
    par = Parallel(kind=ParallelKind.DDP, world_size=2, bucket_cap_bytes=2**18)
    budget = 3 * MiB
    kw = {"micro_batch": 1, "global_batch": 2, "multiple": 32, "max_tries": 4, "heads": False, "activations": False}
    step = StepSpec(repeats=1)
    rank = fit_seq_len(wl, budget, step=step, tiling=False, parallel=par, **kw)
    one = fit_seq_len(wl, budget, step=step, tiling=False, **kw)
    assert rank.fit.measured_peak_bytes is None  # one process measures no rank: predicted
    assert rank.fit.plan.parallel is not None and one.fit.plan.parallel is None
    assert rank.seq_len <= one.seq_len  # the rank also holds DDP's gradient buckets
    # the need recorded at a profiled length is the rank's window's, built here from its own profile
    tr = next(t for t in rank.tries if t.stats == "profiled")
    st = profile(with_seq_len(wl, tr.seq_len), step=StepSpec(batch_size=1, repeats=1), options=BASE_OPTIONS,
                 heads=False, activations=False, tiling=False, host_inputs=False)  # fmt: skip
    rs = rank_stats(st, rank_param_table(wl.model, st, par), par)
    need, _ = min_budget(window_costs(rs, 2, ChainCosts.from_stats(rs, margin=0.02)))
    assert tr.need_bytes == pytest.approx(need, rel=0.01)  # two profiles of one length: a few bytes apart


@pytest.mark.slow
def test_cli_seq_len_auto_with_world_size(capsys) -> None:
    code = main(
        ["fit", "--model", LLAMA, "--seq-len", "auto", "--budget", "3MiB", "--global-batch", "4", "--world-size", "2",
         "--parallel", "ddp", "--seq-multiple", "32", "--repeats", "1", "--json"]
    )  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0, d
    assert d["rank_share"] == 2 and d["parallel"]["world_size"] == 2 and d["measured_peak_bytes"] is None
    tries = d["seq_len_search"]["tries"]
    found = [t for t in tries if t["seq_len"] == d["seq_len"]]
    assert found and found[-1]["fits"] and found[-1]["need_bytes"] <= 3 * MiB
