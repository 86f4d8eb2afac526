"""plan/options: which options a profile calibrates, checked against hand-worked expectations.

The selective options are built on a hand-made block whose best MILP choices are worked out by hand
below (and checked by brute force), so the test does not read the answer off the code.
"""

from __future__ import annotations

import itertools

import pytest
from torch import nn

from memfit.capture.opstats import BlockOps, OpCall, OpStats, SavedTensor
from memfit.errors import SpecError
from memfit.plan import Option, policy_plan
from memfit.plan.options import (
    MILP_FRACTIONS,
    BlockOption,
    option_plan,
    requested_options,
    rerun_fraction,
    selective_options,
)
from memfit.plan.segments import segment_tree
from memfit.plan.types import SELECTIVE_PRESETS, Segment


def test_option_names_parse_to_their_parts_and_back() -> None:
    cases = {
        "keep": BlockOption(Option.KEEP),
        "recompute": BlockOption(Option.RECOMPUTE),
        "offload": BlockOption(Option.OFFLOAD),
        "selective:save_matmuls": BlockOption(Option.SELECTIVE, policy="save_matmuls"),
        "selective:save:aten.mm.default,aten.add.Tensor@1": BlockOption(
            Option.SELECTIVE, policy="save:aten.mm.default,aten.add.Tensor@1"
        ),
        "selective:milp-25": BlockOption(Option.SELECTIVE, milp_percent=25),
    }
    for name, want in cases.items():
        got = BlockOption.parse(name)
        assert got == want and got.name == name == str(got)
    assert BlockOption.parse("selective:milp-25").milp_fraction == 0.25
    assert BlockOption.parse("selective:save_matmuls").milp_fraction is None


@pytest.mark.parametrize("name", ["selective", "selective:", "keeps", "offload:x", "", "milp-25"])
def test_unknown_option_names_are_refused_with_the_forms(name: str) -> None:
    with pytest.raises(SpecError, match="keep, recompute, offload, selective:PRESET"):
        BlockOption.parse(name)


def test_requested_options_expand_selective_in_measuring_order() -> None:
    got = [o.name for o in requested_options(("keep", "offload", "selective", "recompute", "selective:save_matmuls"))]
    want = [
        "keep",
        "recompute",
        "selective:save_matmuls",
        "selective:save_attention",
        "selective:save_matmuls_and_attention",
        "selective:milp-25",
        "selective:milp-50",
        "selective:milp-75",
        "offload",
    ]
    assert got == want
    assert len(want) == 3 + len(SELECTIVE_PRESETS) + len(MILP_FRACTIONS)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ((), "must start with 'keep'"),
        (("recompute", "keep"), "must start with 'keep'"),
        (("keep", "bogus"), r"unknown option\(s\) \['bogus'\]"),
    ],
)
def test_requested_options_refuse_bad_requests(options: tuple[str, ...], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        requested_options(options)


# --- selective options on a hand-made block ----------------------------------------------------------


def _call(op: str, index: int, out_bytes: int, time_s: float, *, cacheable: bool = True) -> OpCall:
    return OpCall(
        op=op, index=index, category="other", shapes=((out_bytes // 4,),), dtype="float32", out_bytes=out_bytes,
        saved_bytes=out_bytes, time_s=time_s, flops=0, cheap=True, cacheable=cacheable,
    )  # fmt: skip


def _block(name: str) -> BlockOps:
    """Two matmuls, a mul, and a gelu whose output the block mutates afterwards (not cacheable).

    The block saves 300 bytes, so the MILP allotments are 75 B (25 %), 150 B (50 %), 225 B (75 %).
    By hand: at 75 B only the mul fits (40 B, 1 s); at 150 B the first matmul and the mul (140 B,
    4 s) beat both matmuls (200 B, too big); at 225 B both matmuls (200 B, 5 s) win, which caches
    exactly what ``save_matmuls`` caches.
    """
    calls = (
        _call("aten.mm.default", 0, 100, 3.0),
        _call("aten.mul.Tensor", 0, 40, 1.0),
        _call("aten.mm.default", 1, 100, 2.0),
        _call("aten.gelu.default", 0, 60, 0.5, cacheable=False),
    )
    saved = (SavedTensor(op="aten.mm.default", call=0, shape=(25,), dtype="float32", bytes=300),)
    return BlockOps(name=name, calls=calls, saved=saved, fwd_s=6.5)


def _brute_force(block: BlockOps, allotment_bytes: int) -> set[int]:
    cand = [j for j, c in enumerate(block.calls) if c.cacheable]
    best = max(
        (
            sub
            for r in range(len(cand) + 1)
            for sub in itertools.combinations(cand, r)
            if sum(block.calls[j].out_bytes for j in sub) <= allotment_bytes
        ),
        key=lambda sub: sum(block.calls[j].time_s for j in sub),
    )
    return set(best)


def test_selective_options_keep_distinct_caches_and_say_why_others_are_dropped() -> None:
    ops = OpStats(model="hand", batch_size=1, device="cpu", dtype="float32", blocks=(_block("b0"), _block("b1")))
    assert _brute_force(ops.blocks[0], 75) == {1} and _brute_force(ops.blocks[0], 150) == {0, 1}
    assert _brute_force(ops.blocks[0], 225) == {0, 2}
    requested = [*requested_options(("keep", "selective")), BlockOption.parse("selective:save:aten.gelu.default")]
    options, dropped = selective_options(ops, requested)
    assert {o.name: pols[0] for o, pols in options.items()} == {
        "selective:save_matmuls": "save_matmuls",
        "selective:milp-25": "save:aten.mul.Tensor",
        "selective:milp-50": "save:aten.mm.default@0,aten.mul.Tensor",
    }
    assert all(len(set(pols)) == 1 and len(pols) == 2 for pols in options.values())
    assert set(dropped) == {
        "selective:save_attention",
        "selective:save_matmuls_and_attention",
        "selective:milp-75",
        "selective:save:aten.gelu.default",
    }
    assert "caches nothing" in dropped["selective:save_attention"]
    assert "same op outputs as selective:save_matmuls" in dropped["selective:save_matmuls_and_attention"]
    assert "same op outputs as selective:save_matmuls" in dropped["selective:milp-75"]
    assert (
        "mutate in place" in dropped["selective:save:aten.gelu.default"]
        and "aten.gelu.default" in dropped["selective:save:aten.gelu.default"]
    )


def test_rerun_fraction_is_the_share_of_op_time_not_cached() -> None:
    blk = _block("b")
    assert rerun_fraction(blk, "save_matmuls") == pytest.approx((6.5 - 5.0) / 6.5)
    assert rerun_fraction(blk, "save:aten.mul.Tensor") == pytest.approx(5.5 / 6.5)
    assert rerun_fraction(blk, "save_attention") == pytest.approx(1.0)


def test_option_plan_puts_every_block_in_the_option() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    base = policy_plan(model, "none")
    sel = option_plan(
        base,
        BlockOption.parse("selective:milp-50"),
        ["save:aten.mm.default", "save_matmuls", "save:aten.addmm.default@0"],
    )
    assert sel.policy == "selective:milp-50"
    assert [(b.name, b.option, b.policy) for b in sel.blocks] == [
        ("0", Option.SELECTIVE, "save:aten.mm.default"),
        ("1", Option.SELECTIVE, "save_matmuls"),
        ("2", Option.SELECTIVE, "save:aten.addmm.default@0"),
    ]
    off = option_plan(base, BlockOption(Option.OFFLOAD))
    assert off.policy == "offload" and all(b.option is Option.OFFLOAD and b.policy is None for b in off.blocks)
    assert off.fingerprint == base.fingerprint and off.chain_path == base.chain_path


def test_segment_tree_nests_segments_as_written_by_hand() -> None:
    segs = [Segment(start=0, stop=4), Segment(start=1, stop=3), Segment(start=5, stop=7)]
    assert segment_tree(segs, 0, 8) == ((0, 4, (0, (1, 3, (1, 2)), 3)), 4, (5, 7, (5, 6)), 7)
    assert segment_tree([], 2, 5) == (2, 3, 4)
