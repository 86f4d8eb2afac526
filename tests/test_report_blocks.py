"""The report's blocks panel and names: what each block does is written out (tiles, host-held inputs,
segments), and a solver's plan is not called ``plan None``."""

from __future__ import annotations

from memfit.plan.types import BlockDecision, Option, Plan, Segment
from memfit.report.panels import add_blocks, base, plan_name


def _plan(policy: str) -> Plan:
    return Plan(
        policy=policy,
        chain_path="h",
        blocks=(
            BlockDecision(name="h.0", option=Option.KEEP, tiles=4, tiled=("mlp",)),
            BlockDecision(name="h.1", option=Option.RECOMPUTE, host_input=True),
            BlockDecision(name="h.2", option=Option.KEEP),
            BlockDecision(name="h.3", option=Option.KEEP),
        ),
        segments=(Segment(start=2, stop=4),),
    )


def test_blocks_say_their_tiles_host_inputs_and_segments() -> None:
    data = base("plan", "t", None)
    add_blocks(data, _plan("memfit"), None, None, None)
    assert [b["option"] for b in data["blocks"]] == [
        "keep, mlp in 4 tiles",  # a tiled block is not a plain "keep"
        "recompute, input held on the host",
        "keep (in a segment)",
        "keep (in a segment)",
    ]


def test_a_plan_without_a_policy_is_not_called_none() -> None:
    assert plan_name(_plan("all")) == "plan 'all'"
    assert plan_name(_plan("")) == "the plan"  # not "plan ''" nor "plan None"
