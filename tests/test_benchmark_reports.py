"""The benchmark reports are generated from benchmarks/results/*.json: regenerate them and compare with the
committed files, so that a report cannot drift from its run (nor a run lack its report)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _make_reports():
    spec = importlib.util.spec_from_file_location("make_reports", BENCHMARKS / "make_reports.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_committed_reports_equal_the_generated_ones(tmp_path):
    written = _make_reports().write(tmp_path)
    generated = {p.relative_to(tmp_path).as_posix(): p.read_text() for p in written}
    committed = {
        p.relative_to(BENCHMARKS).as_posix(): p.read_text()
        for p in [BENCHMARKS / "README.md", *(BENCHMARKS / "reports").glob("*.md")]
    }
    assert sorted(generated) == sorted(committed), "run `python benchmarks/make_reports.py` and commit the reports"
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"stale reports {stale}: run `python benchmarks/make_reports.py` and commit them"


def test_every_current_run_has_one_report_and_plans_have_none():
    make_reports = _make_reports()
    runs = make_reports.runs()
    sources = {r.source for r in runs}
    results = {p.name for p in (BENCHMARKS / "results").glob("*.json")}
    plans = {name for name in results if name.startswith("plan_")}
    assert sources == results - plans
    for run in runs:  # benchmark_model_hardware_date.md
        bench, model, hardware, date = _fields(run.name)
        assert bench.startswith(run.benchmark) and model and hardware in {"cpu", "h200"} and date == run.date


def _fields(name: str) -> tuple[str, str, str, str]:
    stem = name.removesuffix(".md")
    head, model, hardware, date = stem.rsplit("_", 3)
    return head, model, hardware, date
