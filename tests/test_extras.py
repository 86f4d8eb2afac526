"""The extras users install ask for the transformers versions the tests run (dev's bound)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_extra_bounds_transformers_as_the_tests_do() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds = {
        name: re.search(r"<\s*([\d.]+)", req)
        for name, reqs in extras.items()
        for req in reqs
        if re.match(r"transformers\b", req)
    }
    assert {"hf", "transformers", "dev"} <= set(bounds)
    assert all(bounds.values()), bounds  # no extra leaves the upper bound open
    assert {m[1] for m in bounds.values()} == {bounds["dev"][1]}, {k: m[1] for k, m in bounds.items()}
