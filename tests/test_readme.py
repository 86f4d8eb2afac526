"""The README as written: every ```python block runs, and the front page stays a front page.

Each Python block is executed as it stands in README.md (a fresh namespace, the working directory a
temporary folder, ``src/`` importable as in an editable install), one test per block, named by the
block's first line. ```diff blocks (the framework adapters) are not run; their memfit imports are
checked with the Python blocks': a README imports from ``memfit`` and ``memfit.integrations.*`` only,
so that it shows the front door and not the rooms behind it.
"""

from __future__ import annotations

import ast
import re
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_BYTES = 15_000
# The module names a README may import from memfit: the package, and an integration module.
ALLOWED_MEMFIT = re.compile(r"memfit(\.integrations(\.[a-z_]+)?)?")

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of ``language`` in ``text``, in order."""
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def memfit_imports(source: str) -> list[str]:
    """Every memfit module an import statement in ``source`` names (``from memfit import x`` -> ``memfit``)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # ``from memfit import integrations`` / ``from memfit.integrations import accelerate``
            names += [f"{node.module}.{a.name}" for a in node.names if node.module.startswith("memfit.integrations")]
    return [n for n in names if n == "memfit" or n.startswith("memfit.")]


def diff_added_python(diff: str) -> str:
    """The import lines a ```diff block adds or keeps (``+`` and `` `` lines), as Python source."""
    lines = [line[1:] for line in diff.splitlines() if line[:1] in "+ "]
    return "\n".join(line.strip() for line in lines if re.match(r"\s*(import|from)\s+\S", line))


TEXT = README.read_text(encoding="utf-8")
PYTHON_BLOCKS = code_blocks(TEXT, "python")


def test_readme_has_python_blocks() -> None:
    assert PYTHON_BLOCKS, "README.md has no ```python block: the ten-line Python path is missing"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.splitlines()[0] for b in PYTHON_BLOCKS])
def test_python_block_runs(block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "src"))
    namespace: dict[str, object] = {"__name__": "__readme__"}
    try:
        exec(compile(block, "README.md", "exec"), namespace)
    except Exception:
        pytest.fail(f"this README block failed as written:\n\n{block}\n{traceback.format_exc()}", pytrace=False)


def test_readme_is_a_front_page() -> None:
    size = len(TEXT.encode("utf-8"))
    assert size <= MAX_BYTES, f"README.md is {size:,} bytes, over {MAX_BYTES:,}: move detail to docs/"
    for command in ("make demo", "make test"):
        assert command in TEXT, f"README.md does not show `{command}`"


def test_readme_imports_only_the_front_door() -> None:
    sources = PYTHON_BLOCKS + [diff_added_python(d) for d in code_blocks(TEXT, "diff")]
    names = [n for src in sources for n in memfit_imports(src)]
    assert any(n.startswith("memfit.integrations.") for n in names), "no framework adapter import found in README.md"
    wrong = sorted({n for n in names if not ALLOWED_MEMFIT.fullmatch(n)})
    assert not wrong, f"README.md imports {wrong}; use `import memfit` or `memfit.integrations.*`"


def test_readme_links_exist() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", TEXT)
    local = [t for t in targets if "://" not in t]
    assert local, "README.md links no file of the repository"
    missing = sorted({t for t in local if not (ROOT / t).exists()})
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_the_import_check_can_fail() -> None:
    assert memfit_imports("from memfit.verification.plans import verify") == ["memfit.verification.plans"]
    assert not ALLOWED_MEMFIT.fullmatch("memfit.verification.plans")
    assert memfit_imports("from memfit.integrations import lightning as L") == [
        "memfit.integrations",
        "memfit.integrations.lightning",
    ]
    assert diff_added_python("+import memfit.fitting\n-import memfit.x\n trainer.train()") == "import memfit.fitting"
