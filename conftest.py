"""Repository-wide pytest hooks: the ``gpu`` marker skips without CUDA unless REQUIRE_GPU=1."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests on machines without CUDA; with REQUIRE_GPU=1 let them run (and fail)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("REQUIRE_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (set REQUIRE_GPU=1 to fail instead)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
