"""Reports: the memory/time frontier, memory timelines of a step, and the PNG of ``--report``."""

from memfit.report.frontier import FrontierPoint, frontier
from memfit.report.reports import fit_report, plan_report
from memfit.report.timeline import StepTimeline, record_timeline

__all__ = ["FrontierPoint", "StepTimeline", "fit_report", "frontier", "plan_report", "record_timeline"]
