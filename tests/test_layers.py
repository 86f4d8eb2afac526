"""memfit's import layers (docs/design.md, "Layers"), checked by reading the source.

Each module lives in a room (a package, or a ground-floor module) on a floor, and imports only
rooms on lower floors, or its own room:

    errors, units, workload, models/*, optim/*, _version   ground floor                0
    capture/*                                        measures what it is given         1
    plan/*                                           types, policies, solvers          2
    apply/*                                          wrappers only                     3
    accumulate/*                                     the accumulation loop             4   library tier
    profiling/*                                      a step measured                   5
    fitting/*, verification/*                        planning for a budget; checks     6
    estimation/*, training/*                         fake-tensor stats; the loop       7
    report/*                                         draws data it is given            8
    integrations/*                                                                     9
    cli/*                                            parses and prints only           10
    memfit/__init__.py (the package: the front door)                                  11

and, read with :mod:`ast` from every file under ``src/memfit``:

- no import of a higher floor (imports under ``if TYPE_CHECKING:`` and inside functions included);
- no import between two rooms of the same floor of the library tier (they are independent);
- no module outside a room (a loose module in ``src/memfit`` or a new package must be given one);
- ``report/`` imports from the library tier only its data modules (``types``), but under
  ``TYPE_CHECKING`` (annotations): it draws what it is given and runs nothing that measures;
- no import of the package ``memfit`` itself (its ``__init__`` names everything): import the
  submodule that defines the name;
- no import cycle between modules (strongly connected components of the import graph; imports
  under ``TYPE_CHECKING`` do not run and are left out, imports inside functions are in);
- no import inside a function, unless of an optional dependency that a plain install lacks (the
  extras of pyproject.toml: transformers, accelerate, lightning, matplotlib, ...) or one of
  :data:`IN_FUNCTION_EXCEPTIONS` (torch's distributed and compiler modules, imported on first use);
- no module over :data:`MAX_LINES` lines without a reason at its top: a line ``size: <reason>`` in
  its docstring or a ``# size: <reason>`` comment before its first import.

Each failure names ``module:line -> target`` for every violation. The checker itself is tested on
synthetic packages written to ``tmp_path`` (a clean one passes; each kind of violation fails).
"""

from __future__ import annotations

import ast
import re
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"

MAX_LINES = 500

# Floor of each room, by the first part of a module's name below the package.
GROUND, CAPTURE, PLAN, APPLY, ACCUMULATE, PROFILING, FITTING, TRAINING, REPORT, INTEGRATIONS, CLI, PACKAGE = range(12)
LIBRARY = ACCUMULATE  # the library tier's first floor
ROOMS = {
    "errors": GROUND,
    "units": GROUND,
    "workload": GROUND,
    "models": GROUND,
    "_version": GROUND,
    "optim": GROUND,
    "capture": CAPTURE,
    "plan": PLAN,
    "apply": APPLY,
    "accumulate": ACCUMULATE,
    "profiling": PROFILING,
    "fitting": FITTING,
    "verification": FITTING,
    "estimation": TRAINING,
    "training": TRAINING,
    "report": REPORT,
    "integrations": INTEGRATIONS,
    "cli": CLI,
}
FLOOR_NAMES = [
    "ground floor",
    "capture",
    "plan",
    "apply",
    "accumulate",
    "profiling",
    "fitting/verification",
    "estimation/training",
    "report",
    "integrations",
    "cli",
    "package",
]
UNKNOWN = -1
DATA_MODULE = "types"  # the only library modules report/ imports at run time


# Imports inside functions allowed besides the optional dependencies, with the reason; every other
# import goes at the top of its module.
IN_FUNCTION_EXCEPTIONS: dict[str, str] = {
    "torch._inductor": "importing the compiler takes ~3 s; only `memfit verify --compile` pays it (memfit.verification.runs)",
    "torch.distributed.fsdp": "loads DTensor (~1 s); only an FSDP2 run pays it (memfit.training.distributed)",
    "torch.distributed.checkpoint.state_dict": "loads DTensor and FSDP (~1.5 s); only an FSDP2 save or resume pays it "
    "(memfit.training.saving)",
    "memfit.training.fsdp_peak": "torch's FSDPMemTracker loads DTensor, _dynamo and _inductor (~1.5 s); only a measured "
    "FSDP2 step pays it (memfit.training.distributed.fsdp2_peak)",
    "scipy.optimize": "~0.7 s of CPU; only a plan with selective options solves a MILP (memfit.plan.milp)",
    "memfit.cli.common": "imports torch and the library (seconds); memfit.cli.main imports it when a command runs, and "
    "memfit.cli.args when an option's value needs the library's check (a size, a policy, a device), so `memfit --version`, "
    "`--help`, a command's `--help` and a mistyped option answer without them (tests/test_startup.py)",
    "memfit.cli.device": "imports torch: memfit.cli.args checks a --device value with it only when one is given",
}


def optional_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """Top-level import names of pyproject's extras that a plain install does not bring."""
    project = tomllib.loads(pyproject.read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("-", "_") for r in reqs}

    extras = set().union(*(names(reqs) for reqs in project["optional-dependencies"].values()))
    return extras - names(project["dependencies"]) - {project["name"]}


@dataclass(frozen=True, kw_only=True, slots=True)
class Import:
    """One import statement's target, resolved to a module name where it is one of the package's."""

    module: str  # the importing module, e.g. "memfit.capture.profile"
    line: int
    target: str  # "memfit.apply.engine", or a foreign name such as "torch.distributed"
    in_function: bool
    type_checking: bool

    def __str__(self) -> str:
        return f"{self.module}:{self.line} -> {self.target}"


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str]) -> None:
        self.module, self.modules = module, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.in_function = self.type_checking = False
        self.imports: list[Import] = []

    def _resolve(self, name: str) -> str:
        """The longest prefix of ``name`` that is one of the package's modules (else ``name``)."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.modules:
                return ".".join(parts[:n])
        return name

    def _add(self, node: ast.stmt, name: str) -> None:
        self.imports.append(
            Import(
                module=self.module,
                line=node.lineno,
                target=self._resolve(name),
                in_function=self.in_function,
                type_checking=self.type_checking,
            )
        )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            pkg = self.package.split(".")[: len(self.package.split(".")) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        for alias in node.names:  # `from pkg import submodule` imports the submodule
            sub = f"{base}.{alias.name}"
            self._add(node, sub if sub in self.modules else base)

    def _function(self, node: ast.AST) -> None:
        outer, self.in_function = self.in_function, True
        self.generic_visit(node)
        self.in_function = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            outer, self.type_checking = self.type_checking, True
            for stmt in node.body:
                self.visit(stmt)
            self.type_checking = outer
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)


def read_imports(root: Path) -> list[Import]:
    """Every import statement of every module of the package at ``root``."""
    files = module_files(root)
    out: list[Import] = []
    for module, path in files.items():
        visitor = _ImportVisitor(module, path.name == "__init__.py", set(files))
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        out += dict.fromkeys(visitor.imports)  # one per line and target, in order
    return out


def room(module: str) -> str | None:
    """The room of one of the package's modules: the first part of its name below the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer(module: str) -> int:
    """The floor of one of the package's modules (see the module docstring); UNKNOWN outside a room."""
    r = room(module)
    return PACKAGE if r is None else ROOMS.get(r, UNKNOWN)


def _own(imp: Import, root: Path) -> bool:
    return imp.target == root.name or imp.target.startswith(root.name + ".")


def upward_imports(root: Path) -> list[str]:
    """Imports of the package ``memfit`` itself, of a higher floor, of a sibling room, or by report/
    of a library module that is not data."""
    out = []
    for imp in read_imports(root):
        if not _own(imp, root) or imp.module == root.name:
            continue
        a, b = layer(imp.module), layer(imp.target)
        if imp.target == root.name:
            out.append(f"{imp} (the package itself: import the submodule that defines the name)")
        elif UNKNOWN in (a, b):
            continue  # reported once per module by modules_outside_rooms
        elif b > a:
            out.append(f"{imp} ({FLOOR_NAMES[a]} imports {FLOOR_NAMES[b]}, a floor above)")
        elif b == a >= LIBRARY and room(imp.module) != room(imp.target):
            out.append(f"{imp} ({room(imp.module)} imports {room(imp.target)}, a room on the same floor)")
        elif (
            a == REPORT
            and LIBRARY <= b < REPORT
            and not imp.type_checking
            and imp.target.rpartition(".")[2] != DATA_MODULE
        ):
            out.append(
                f"{imp} (report imports library code that runs: import its `{DATA_MODULE}` module, or only under TYPE_CHECKING)"
            )
    return out


def modules_outside_rooms(root: Path) -> list[str]:
    """Modules whose first name below the package is no room (a loose module, a new package)."""
    return [
        f"{m} (in no room: move it into a package of its floor, or give it a floor in ROOMS)"
        for m in module_files(root)
        if layer(m) == UNKNOWN
    ]


def import_cycles(root: Path) -> list[str]:
    """One line per import cycle: its modules, then every import between them."""
    imports = [i for i in read_imports(root) if _own(i, root) and not i.type_checking]
    graph: dict[str, set[str]] = {m: set() for m in module_files(root)}
    for imp in imports:
        if imp.target in graph:  # a name that is no module fails at import time, not here
            graph[imp.module].add(imp.target)
    out = []
    for scc in _strongly_connected(graph):
        if len(scc) == 1 and next(iter(scc)) not in graph[next(iter(scc))]:
            continue
        edges = sorted({str(i) for i in imports if i.module in scc and i.target in scc})
        out.append(f"cycle {sorted(scc)}: " + "; ".join(edges))
    return out


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    scc.add(member)
                    if member == node:
                        break
                out.append(scc)
    return out


def imports_in_functions(root: Path, optional: set[str]) -> list[str]:
    """Imports inside functions other than of an optional dependency (or a listed exception)."""
    out = []
    for imp in read_imports(root):
        top = imp.target.split(".")[0]
        if imp.in_function and top not in optional and imp.target not in IN_FUNCTION_EXCEPTIONS:
            out.append(f"{imp} (inside a function: move it to the top of the module)")
    return out


_SIZE_REASON = re.compile(r"^\s*(#\s*)?size:\s*\S", re.IGNORECASE | re.MULTILINE)


def oversized_modules(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """Modules longer than ``max_lines`` without a ``size: <reason>`` line at their top."""
    out = []
    for module, path in module_files(root).items():
        text = path.read_text()
        n_lines = len(text.splitlines())
        if n_lines <= max_lines:
            continue
        tree = ast.parse(text)
        first_import = next((n.lineno for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)), n_lines)
        head = "\n".join(text.splitlines()[: first_import - 1])
        if not _SIZE_REASON.search(head):
            out.append(
                f"{module}: {n_lines} lines (over {max_lines}) and no `size: <reason>` line at its top: "
                "split it, or say why it is one module"
            )
    return out


# --- memfit itself --------------------------------------------------------------------------------


def test_no_import_of_a_higher_layer_or_of_the_package() -> None:
    violations = upward_imports(SRC)
    if violations:
        pytest.fail(f"{len(violations)} imports against the layers:\n" + "\n".join(violations), pytrace=False)


def test_every_module_is_in_a_room() -> None:
    violations = modules_outside_rooms(SRC)
    if violations:
        pytest.fail(f"{len(violations)} modules outside the rooms:\n" + "\n".join(violations), pytrace=False)


def test_the_front_door_names_every_verb_from_the_package() -> None:
    """``import memfit`` gives the verbs and the types a user holds: functions, not modules."""
    import memfit

    verbs = (
        "profile",
        "plan_for_budget",
        "plan_for_policy",
        "plan_compiled",
        "autofit",
        "verify",
        "verify_accumulation",
        "explain",
        "estimate",
        "train",
        "apply_plan",
        "remove_plan",
        "set_blocks",
        "load_workload",
    )
    assert [
        v for v in verbs if not callable(getattr(memfit, v, None)) or isinstance(getattr(memfit, v), type(memfit))
    ] == []
    assert set(verbs) <= set(memfit.__all__)
    assert all(hasattr(memfit, n) for n in memfit.__all__)


def test_no_import_cycle() -> None:
    violations = import_cycles(SRC)
    if violations:
        pytest.fail(f"{len(violations)} import cycles:\n" + "\n".join(violations), pytrace=False)


def test_no_import_inside_functions_but_optional_dependencies() -> None:
    violations = imports_in_functions(SRC, optional_dependencies())
    if violations:
        pytest.fail(f"{len(violations)} imports inside functions:\n" + "\n".join(violations), pytrace=False)


def test_no_module_over_max_lines_without_a_reason() -> None:
    violations = oversized_modules(SRC)
    if violations:
        pytest.fail(f"{len(violations)} modules too long:\n" + "\n".join(violations), pytrace=False)


def test_optional_dependencies_are_the_extras_not_the_requirements() -> None:
    optional = optional_dependencies()
    assert {"transformers", "accelerate", "lightning", "matplotlib", "peft", "trl"} <= optional
    assert not optional & {"torch", "numpy", "scipy", "rich", "memfit"}


# --- the checker on synthetic packages ------------------------------------------------------------

CLEAN = {
    "__init__.py": "from memfit.verification.plans import verify\nfrom memfit.errors import MemfitError\n",
    "errors.py": "class MemfitError(RuntimeError):\n    pass\n",
    "workload.py": "from memfit.errors import MemfitError\n",
    "models/__init__.py": "",
    "models/registry.py": "from memfit.workload import MemfitError\n",
    "capture/__init__.py": "from memfit.capture.tracker import track\n",
    "capture/tracker.py": "from memfit.errors import MemfitError\n\n\ndef track():\n    import transformers\n",
    "plan/__init__.py": "",
    "plan/types.py": (
        "from typing import TYPE_CHECKING\n\nfrom memfit.capture import tracker\n\n"
        "if TYPE_CHECKING:\n    from memfit.plan import solve\n"
    ),
    "plan/solve.py": "from .types import tracker\nfrom . import types\n",
    "apply/__init__.py": "",
    "apply/engine.py": "from ..plan.types import tracker\n",
    "accumulate/__init__.py": "import memfit.apply.engine as engine\nfrom memfit.capture.tracker import track\n",
    "verification/__init__.py": "",
    "verification/plans.py": "from memfit.accumulate import engine\n",
    "fitting/__init__.py": "",
    "fitting/types.py": "from memfit.accumulate import engine\n",
    "report/__init__.py": "from memfit.fitting.types import engine\n",
    "cli/__init__.py": "",
    "cli/main.py": "import argparse\n\nfrom memfit.report import engine\n\n\ndef main():\n    import matplotlib.pyplot\n",
}
OPTIONAL = {"transformers", "matplotlib"}


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "src" / "memfit"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def all_violations(root: Path) -> list[str]:
    return (
        upward_imports(root)
        + import_cycles(root)
        + modules_outside_rooms(root)
        + imports_in_functions(root, OPTIONAL)
        + oversized_modules(root)
    )


def test_checker_passes_a_clean_package(tmp_path: Path) -> None:
    """Layers respected, relative imports, a TYPE_CHECKING import back to the package (a cycle that
    never runs), lazy imports of optional dependencies: nothing to report."""
    root = write_package(tmp_path, CLEAN)
    assert all_violations(root) == []
    imports = {str(i) for i in read_imports(root)}
    assert "memfit.plan.solve:1 -> memfit.plan.types" in imports  # relative, resolved
    assert "memfit.plan.solve:2 -> memfit.plan.types" in imports  # `from . import types`
    assert "memfit.apply.engine:1 -> memfit.plan.types" in imports  # `from ..plan.types`
    assert "memfit.verification.plans:1 -> memfit.accumulate" in imports


@pytest.mark.parametrize(
    ("rel", "text", "want"),
    [
        (
            "capture/tracker.py",
            "\nfrom memfit.apply.engine import tracker\n",
            "memfit.capture.tracker:2 -> memfit.apply.engine (capture imports apply, a floor above)",
        ),
        (
            "workload.py",
            "from memfit.plan.types import tracker\n",
            "memfit.workload:1 -> memfit.plan.types (ground floor imports plan, a floor above)",
        ),
        (
            "report/__init__.py",
            "from memfit.cli import main\n",
            "memfit.report:1 -> memfit.cli.main (report imports cli, a floor above)",
        ),
        (
            "verification/plans.py",
            "from memfit import MemfitError\n",
            "memfit.verification.plans:1 -> memfit (the package itself: import the submodule that defines the name)",
        ),
        (
            "plan/types.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from memfit.apply import engine\n",
            "memfit.plan.types:4 -> memfit.apply.engine (plan imports apply, a floor above)",
        ),
        (
            "fitting/types.py",
            "from memfit.verification.plans import engine\n",
            "memfit.fitting.types:1 -> memfit.verification.plans (fitting imports verification, a room on the same floor)",
        ),
        (
            "report/__init__.py",
            "from memfit.verification.plans import engine\n",
            "memfit.report:1 -> memfit.verification.plans (report imports library code that runs: import its `types` module, or only under TYPE_CHECKING)",
        ),
    ],
    ids=["capture->apply", "ground->plan", "report->cli", "package", "type-checking", "sibling-room", "report-runs"],
)
def test_checker_finds_an_upward_import(tmp_path: Path, rel: str, text: str, want: str) -> None:
    root = write_package(tmp_path, {**CLEAN, rel: text})
    assert upward_imports(root) == [want]


def test_checker_finds_a_cycle_also_through_a_function(tmp_path: Path) -> None:
    cyclic = {
        **CLEAN,
        "verification/plans.py": "from memfit.verification.checks import engine\n",
        "verification/checks.py": "import memfit.apply.engine as engine\n\n\ndef f():\n    from memfit.verification.plans import engine\n",
    }
    root = write_package(tmp_path, cyclic)
    assert import_cycles(root) == [
        "cycle ['memfit.verification.checks', 'memfit.verification.plans']: memfit.verification.checks:5 -> "
        "memfit.verification.plans; memfit.verification.plans:1 -> memfit.verification.checks"
    ]
    assert imports_in_functions(root, OPTIONAL) == [
        "memfit.verification.checks:5 -> memfit.verification.plans (inside a function: move it to the top of the module)"
    ]


def test_checker_finds_a_module_outside_the_rooms(tmp_path: Path) -> None:
    root = write_package(tmp_path, {**CLEAN, "gather.py": "from memfit.errors import MemfitError\n"})
    assert modules_outside_rooms(root) == [
        "memfit.gather (in no room: move it into a package of its floor, or give it a floor in ROOMS)"
    ]


def test_checker_finds_a_longer_cycle_and_a_self_import(tmp_path: Path) -> None:
    files = {
        **CLEAN,
        "plan/types.py": "from memfit.plan.solve import x\n",
        "plan/solve.py": "from memfit.plan.costs import x\n",
        "plan/costs.py": "from memfit.plan.types import x\n",
        "units.py": "import memfit.units\n",
    }
    cycles = import_cycles(write_package(tmp_path, files))
    assert sorted(cycles) == [
        "cycle ['memfit.plan.costs', 'memfit.plan.solve', 'memfit.plan.types']: "
        "memfit.plan.costs:1 -> memfit.plan.types; memfit.plan.solve:1 -> memfit.plan.costs; "
        "memfit.plan.types:1 -> memfit.plan.solve",
        "cycle ['memfit.units']: memfit.units:1 -> memfit.units",
    ]


def test_checker_finds_imports_in_functions_but_optional_ones(tmp_path: Path) -> None:
    src = textwrap.dedent(
        """\
        import os


        def f():
            import json
            import matplotlib.pyplot as plt
            from torch.distributed import init_process_group


        class C:
            async def g(self):
                from memfit.errors import MemfitError

            h = lambda: __import__("os")
        """
    )
    root = write_package(tmp_path, {**CLEAN, "cli/main.py": src})
    assert imports_in_functions(root, OPTIONAL) == [
        "memfit.cli.main:5 -> json (inside a function: move it to the top of the module)",
        "memfit.cli.main:7 -> torch.distributed (inside a function: move it to the top of the module)",
        "memfit.cli.main:12 -> memfit.errors (inside a function: move it to the top of the module)",
    ]


def test_checker_finds_a_long_module_without_a_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * 600
    files = {
        **CLEAN,
        "apply/engine.py": '"""Wrappers."""\n\nimport os\n' + body,
        "apply/head.py": '"""The head.\n\nSize: one NOTE and its code.\n"""\n\nimport os\n' + body,
        "apply/offload.py": "# size: the offload hooks read as one\nimport os\n" + body,
        "apply/short.py": "import os\n" + "x = 1\n" * 499,
    }
    assert oversized_modules(write_package(tmp_path, files)) == [
        "memfit.apply.engine: 603 lines (over 500) and no `size: <reason>` line at its top: split it, "
        "or say why it is one module"
    ]
