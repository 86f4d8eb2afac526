"""``memfit profile``'s seconds as a decomposition: the blocks' forward and backward, the rest of the
forward and backward, and the rest of the step add up to the step (NOTE [ Per-block seconds add up to
the step ] in memfit.profiling.parts). Asserts on the arithmetic of the numbers reported, not on timings."""

from __future__ import annotations

import re

import pytest

from memfit.capture.step import StepSpec
from memfit.models.registry import load_workload
from memfit.profiling.blocks import profile
from memfit.profiling.parts import parts_line, step_parts

TINY = "demo?n_layer=3&n_embd=32&seq_len=32"


@pytest.fixture(scope="module")
def stats():
    wl = load_workload(TINY)
    return profile(wl, step=StepSpec(batch_size=2, repeats=1), options=("keep",), heads=False, tiling=False)


def test_parts_add_up_to_the_step(stats) -> None:
    parts = step_parts(stats)
    assert parts.blocks_fwd_s == sum(b.fwd_s for b in stats.blocks) > 0
    assert parts.blocks_bwd_s == sum(b.bwd_s for b in stats.blocks) > 0
    assert parts.total_s == pytest.approx(stats.step_s, rel=1e-12) and parts.step_s == stats.step_s
    # the blocks and the outside add up to the time passes' own forward and backward
    assert parts.blocks_fwd_s + parts.blocks_bwd_s + parts.outside_blocks_s == pytest.approx(
        stats.fwd_s + stats.bwd_s, rel=1e-12
    )
    assert parts.to_dict()["step_s"] == stats.step_s


def test_printed_line_adds_up_as_printed(stats) -> None:
    line = parts_line(step_parts(stats))
    step, f, b, o, r = (float(v) for v in re.findall(r"(-?\d+\.\d) ms", line))
    assert step == round(stats.step_s * 1e3, 1)
    assert round(f + b + o + r, 1) == step  # the sum shown is the step shown
    assert f == round(sum(x.fwd_s for x in stats.blocks) * 1e3, 1)
    assert abs(r - (stats.step_s - stats.fwd_s - stats.bwd_s) * 1e3) <= 0.2  # the rest within the rounding
