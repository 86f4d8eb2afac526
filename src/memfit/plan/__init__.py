"""Plans: types, typed policies, fingerprints (and, later, the budget solver)."""

from memfit.plan.policies import (
    EveryNth,
    KeepAll,
    Offload,
    Policy,
    RecomputeAll,
    Selective,
    Sqrt,
    check_fingerprint,
    make_fingerprint,
    parse_policy,
    policy_plan,
)
from memfit.plan.types import BlockDecision, Option, Plan, Segment

__all__ = [
    "Option",
    "BlockDecision",
    "EveryNth",
    "KeepAll",
    "Offload",
    "Plan",
    "Policy",
    "RecomputeAll",
    "Segment",
    "Selective",
    "Sqrt",
    "check_fingerprint",
    "make_fingerprint",
    "parse_policy",
    "policy_plan",
]
