"""Plans: types, baseline policies, fingerprints (and, later, the budget solver)."""

from memfit.plan.policies import check_fingerprint, make_fingerprint, parse_policy, policy_plan
from memfit.plan.types import Action, BlockDecision, Plan, Segment

__all__ = [
    "Action",
    "BlockDecision",
    "Plan",
    "Segment",
    "check_fingerprint",
    "make_fingerprint",
    "parse_policy",
    "policy_plan",
]
