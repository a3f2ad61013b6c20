"""Package-level facts every release must keep."""

from __future__ import annotations

import re
from importlib.metadata import version

import pipeline_stages


def test_version_matches_installed_metadata() -> None:
    """`__version__` is the version the installed distribution reports (one source of truth)."""
    assert pipeline_stages.__version__ == version("pipeline-stages")
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", pipeline_stages.__version__)


def test_all_is_sorted_and_exported() -> None:
    """`__all__` is sorted and names only attributes that exist."""
    assert list(pipeline_stages.__all__) == sorted(pipeline_stages.__all__)
    for name in pipeline_stages.__all__:
        assert hasattr(pipeline_stages, name), name
