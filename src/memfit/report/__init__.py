"""Reports: the memory/time frontier, the PNG of ``--report FILE.png`` and the self-contained page of
``--report FILE.html`` (:mod:`memfit.report.html`), drawn from what :mod:`memfit.fitting.report_inputs`
measured (memory timelines of a step: :mod:`memfit.profiling.timeline`)."""

from memfit.report.frontier import FrontierPoint, frontier
from memfit.report.reports import fit_report, plan_report

__all__ = ["FrontierPoint", "fit_report", "frontier", "plan_report"]
