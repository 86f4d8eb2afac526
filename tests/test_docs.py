"""The docs site's generated pages (docs/hooks.py): the CLI reference lists every command and option of
the parser `memfit` runs, and the zoo table every family tests/zoo/test_zoo.py runs. `make docs` builds
the whole site with warnings as errors; these checks run in the fast tier without MkDocs."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from memfit.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location("memfit_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cli_reference_has_every_command_and_option():
    page = _hooks().cli_reference()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices, "the parser has no commands"
    for name, parser in sub.choices.items():
        section = page.split(f"## memfit {name}\n", 1)[1].split("\n## memfit ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section, (name, flag)


def test_zoo_table_has_every_family_and_refusal():
    table = _hooks().zoo_table()
    tree = ast.parse((ROOT / "tests" / "zoo" / "test_zoo.py").read_text())
    names = {}
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id in ("FAMILIES", "REFUSED"):
            names[target.id] = [k.value for k in node.value.keys]
    assert len(names.get("FAMILIES", [])) >= 2 and names.get("REFUSED")
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert set(names["FAMILIES"]) | set(names["REFUSED"]) <= rows


def test_zoo_towers_table_has_every_family_and_its_chain():
    table = _hooks().zoo_towers_table()
    tree = ast.parse((ROOT / "tests" / "zoo" / "test_zoo_towers.py").read_text())
    families = next(
        [k.value for k in node.value.keys]
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "FAMILIES"
    )
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert len(families) >= 5 and set(families) <= set(rows)
    assert "`vision_model.encoder.layers,text_model.encoder.layers`" in rows["clip"]


def _python_blocks(page: str) -> list[str]:
    """The page's ```python blocks, in order."""
    text = (ROOT / "docs" / page).read_text()
    return [part.split("```", 1)[0].split("\n", 1)[1] for part in text.split("```python")[1:]]


def _text_blocks(page: str) -> list[str]:
    """The page's ```text blocks, in order."""
    text = (ROOT / "docs" / page).read_text()
    return [part.split("```", 1)[0].split("\n", 1)[1] for part in text.split("```text")[1:]]


@pytest.mark.slow  # about 6 s on 2 cores: the fast tier keeps to about 4 minutes
def test_quickstart_runs_as_written_and_shows_its_numbers(tmp_path, monkeypatch, capsys):
    # The page's Python runs as written, and the numbers its text gives are the ones it computes here:
    # the peak without the plan, verify's peak to the byte, and the refusal of a budget too small, verbatim.
    monkeypatch.chdir(tmp_path)
    plan_and_verify, refusal = _python_blocks("quickstart.md")
    namespace: dict = {}
    exec(compile(plan_and_verify, "docs/quickstart.md", "exec"), namespace)
    capsys.readouterr()
    exec(compile(refusal, "docs/quickstart.md", "exec"), namespace)
    printed = capsys.readouterr().out
    page = (ROOT / "docs" / "quickstart.md").read_text()
    check, plan = namespace["check"], namespace["plan"]
    baseline = re.search(r"against\s+([\d,]+) B without the plan", page)
    assert baseline and int(baseline[1].replace(",", "")) == check.baseline_peak_bytes
    assert check.measured_peak_bytes == plan.predicted_peak_bytes  # "to the byte"
    assert plan.predicted_peak_bytes <= 8 * 2**20
    (shown,) = [t for t in _text_blocks("quickstart.md") if t.startswith("memfit.plan: budget")]
    assert " ".join(printed.split()) == " ".join(shown.split())


def test_accumulator_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in _python_blocks("accumulation.md")[:2]:  # the Accumulator, then its window loop
        exec(compile(code, "docs/accumulation.md", "exec"), namespace)
    assert capsys.readouterr().out.startswith("3 False 1")  # what the page says it prints
    assert namespace["acc"].optimizer_steps == 2
