"""The wheel as a user gets it: built from the repository, installed into a fresh venv that holds
only torch, and run through its ``memfit`` entry point (``--version``, ``--help``, a short demo).

NOTE [ A clean venv, cheaply ]
The venv is made without pip (the test's own pip installs into it with ``pip --python``), and torch
goes in first, at the version this test runs on (from the local wheel or pip's cache, as the
Makefile's install does), with ``--no-compile``: byte-compiling all of torch is most of a plain
install's minute. The CLI runs then write bytecode only for the modules they import
(PYTHONDONTWRITEBYTECODE is dropped for them). memfit's other dependencies (rich, scipy, numpy)
come from the index as for any user; no extra is installed, so matplotlib is absent.

The wheel is built from a copy of what the build reads (pyproject.toml, README.md, LICENSE, src/),
not in the working tree: setuptools' build/lib keeps the files of a module deleted since an
earlier build and packs them into the next wheel, and the tree stays free of build outputs.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memfit._version import __version__
from memfit.cli.main import COMMANDS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE")
DEMO = ["demo", "--model", "demo?n_layer=2&n_embd=32&seq_len=32", "--steps", "2", "--report", ""]


def _run(cmd: list[str], *, timeout: float, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the repository (NOTE [ A clean venv, cheaply ])."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "memfit"
    tree.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), "."], timeout=600, cwd=tree)
    (whl,) = (tmp / "dist").glob("memfit-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with torch, then the wheel and its dependencies; returns its ``bin``."""
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], timeout=120, cwd=tmp)
    python = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    _run([*pip, f"torch=={importlib.metadata.version('torch')}"], timeout=600, cwd=tmp)
    _run([*pip, str(wheel)], timeout=600, cwd=tmp)
    return env_dir / "bin"


def _user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["COLUMNS"] = "200"  # rich wraps table cells at the terminal's width (80 without one)
    return env


def _memfit(venv: Path, *args: str, timeout: float = 300) -> str:
    return _run([str(venv / "memfit"), *args], timeout=timeout, cwd=venv.parent, env=_user_env())


def test_wheel_holds_every_module_and_no_tests(wheel: Path) -> None:
    src = ROOT / "src"
    want = {p.relative_to(src).as_posix() for p in (src / "memfit").rglob("*.py") if "__pycache__" not in p.parts}
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    got = {n for n in names if n.endswith(".py")}
    assert got == want, f"only in src/: {sorted(want - got)}; only in the wheel: {sorted(got - want)}"
    assert {n.split("/")[0] for n in names} == {"memfit", dist_info}  # no tests, benchmarks or examples
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "memfit/report/report.html" in names  # package data: the HTML report's page

    fields = [line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines()]
    assert ["Version", __version__] in fields
    assert ["License-Expression", "Apache-2.0"] in fields
    requires = [v for k, v in fields if k == "Requires-Dist" and "extra ==" not in v]
    (torch_req,) = [r for r in requires if r.startswith("torch")]
    assert "<" not in torch_req, f"an upper bound on torch: {torch_req}"  # a user's newer torch is kept


def test_installed_wheel_runs_version_help_and_a_short_demo(venv: Path) -> None:
    python = str(venv / "python")
    where = _run(
        [python, "-c", "import importlib.util as u, memfit; print(memfit.__file__, u.find_spec('matplotlib'))"],
        timeout=300,
        cwd=venv.parent,
        env=_user_env(),
    ).split()
    assert Path(where[0]).is_relative_to(venv.parent), f"memfit imported from {where[0]}, not the venv"
    assert where[1] == "None", "matplotlib is in the venv: the demo must run without the plot extra"

    assert _memfit(venv, "--version").strip() == f"memfit {__version__}"

    help_text = _memfit(venv, "--help")
    listed = set(re.findall(r"^ {4}(\S+) {2,}\S", help_text, flags=re.M))  # "    demo      the main job ..."
    assert set(COMMANDS) <= listed, f"--help leaves out {sorted(set(COMMANDS) - listed)}"

    out = _memfit(venv, *DEMO)
    assert "auto-fit: micro-batch" in out, out
    err = re.search(r"max rel\. error (\S+), buffers equal", out)
    assert err is not None and float(err.group(1)) < 1e-5, out  # the plan changes memory, not gradients
    assert re.search(r"^loss \d+\.\d+ -> \d+\.\d+ ", out, flags=re.M), out
