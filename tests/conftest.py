"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for files of tiny ops: faster, and immune to a busy machine's contention
    (test_guard.py took 51 s with two threads on a loaded 2-core machine, 6 s with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` (allocator peaks, pinned-memory offload, CUDA OOM paths) need a CUDA
    device: skipped where there is none, such as CI; they run on a lent GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CI has none; run on a lent GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
