"""Every CUDA-only branch of memfit is listed in docs/limitations.md with whether a GPU has run it.

The tests run on CPU, so a branch taken only on CUDA is never exercised here; the table is where a
reader (and the next session lent a GPU) finds what is unproven. The source is read with ``ast``:
a function has a CUDA-only branch when its code (not its docstring or comments) calls into
``torch.cuda`` or compares something with the string ``"cuda"``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"
DOC = ROOT / "docs" / "limitations.md"
SECTION = "## CUDA-only code paths"


def _is_cuda_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        inner = node.value
        return (
            isinstance(inner, ast.Attribute)
            and inner.attr == "cuda"
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "torch"
        )
    if isinstance(node, ast.Compare):
        return any(isinstance(c, ast.Constant) and c.value == "cuda" for c in (node.left, *node.comparators))
    return False


class _Scan(ast.NodeVisitor):
    """Collects the qualified names of the functions (and classes) holding a CUDA-only node."""

    def __init__(self, rel: str, found: set[tuple[str, str]]) -> None:
        self.rel, self.found, self.scope = rel, found, []

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def generic_visit(self, node: ast.AST) -> None:
        if _is_cuda_node(node):
            self.found.add((self.rel, ".".join(self.scope) or "<module>"))
        super().generic_visit(node)


def cuda_functions(root: Path = SRC) -> set[tuple[str, str]]:
    """``(path under memfit/, qualified function name)`` of every function with a CUDA-only branch."""
    found: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        _Scan(path.relative_to(root).as_posix(), found).visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def listed_functions(doc: Path = DOC) -> dict[tuple[str, str], str]:
    """The table's rows: ``(file, function) -> whether a GPU ran it``."""
    text = doc.read_text()
    assert SECTION in text, f"{doc.name} has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.+?) \|$", section, flags=re.M)
    return {(f, fn): ran for f, fn, ran in rows}


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_the_scan_finds_known_cuda_branches() -> None:
    """The scan itself works: branches known to exist are found (a scan that finds nothing would
    make the table test pass vacuously)."""
    found = cuda_functions()
    assert ("capture/step.py", "measure_step") in found
    assert ("optim/host.py", "HostOptimizer._take") in found
    assert ("training/guard.py", "_free_memory") in found


def test_a_docstring_mention_is_not_a_branch(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        'def f(x):\n    """Like torch.cuda.synchronize, on "cuda"."""\n    return x\n\n'
        'def g(d):\n    return d.type == "cuda"\n\n'
        "class C:\n    def h(self):\n        torch.cuda.synchronize()\n"
    )
    assert cuda_functions(tmp_path) == {("m.py", "g"), ("m.py", "C.h")}


def test_every_cuda_branch_is_listed_with_whether_a_gpu_ran_it() -> None:
    found = cuda_functions()
    listed = listed_functions()
    missing = sorted(found - listed.keys())
    gone = sorted(listed.keys() - found)
    assert not missing, f"CUDA-only branches not in docs/limitations.md '{SECTION}': {missing}"
    assert not gone, f"rows of docs/limitations.md '{SECTION}' with no CUDA branch (renamed or removed?): {gone}"
    for key, ran in listed.items():
        assert ran.startswith(("yes", "no", "not recorded")), f"{key}: say yes (where, when) or no: {ran!r}"
