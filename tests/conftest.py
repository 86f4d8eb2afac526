"""Shared test fixtures, and the tiers of the suite.

Tiers (markers registered in pyproject.toml): ``make test`` runs the fast tier, ``-m "not slow and not
zoo and not distributed and not browser"``; ``make test-all`` runs everything. Everything under
tests/zoo is ``zoo`` (added here from the path, as well as by each file). ``gpu`` tests are skipped
where there is no CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ZOO = Path(__file__).parent / "zoo"


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread for the whole session: the tests run tiny ops, where a second thread costs
    more than it gives, and a busy 2-core machine made two threads contend (test_guard.py took 51 s
    with two threads, 6 s with one; a 3-profile test in test_autofit.py 26 s against 3 s). Fixed for
    the session, so that a test's speed does not depend on which tests ran before it (several set one
    thread and leave it so) or on ``-k``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a file of tiny ops: what the session fixture already sets, kept for the
    files that ask for it by name."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests/zoo ``zoo``; skip tests marked ``gpu`` (allocator peaks, pinned-memory offload, CUDA
    OOM paths) where there is no CUDA device, such as CI: they run on a lent GPU."""
    for item in items:
        if ZOO in item.path.parents:
            item.add_marker(pytest.mark.zoo)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CI has none; run on a lent GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
