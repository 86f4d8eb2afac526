"""Applying plans to models (the one stage that touches the model)."""

from memfit.apply.engine import applied_plan, apply_plan, is_applied, plan_applied, remove_plan

__all__ = ["applied_plan", "apply_plan", "is_applied", "plan_applied", "remove_plan"]
