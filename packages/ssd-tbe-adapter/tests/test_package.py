"""Package-level facts every release must keep."""

from __future__ import annotations

import re
from importlib.metadata import version

import ssd_tbe_adapter


def test_version_matches_installed_metadata() -> None:
    """`__version__` is the version the installed distribution reports (one source of truth)."""
    assert ssd_tbe_adapter.__version__ == version("ssd-tbe-adapter")
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", ssd_tbe_adapter.__version__)


def test_all_is_sorted_and_exported() -> None:
    """`__all__` is sorted and names only attributes that exist."""
    assert list(ssd_tbe_adapter.__all__) == sorted(ssd_tbe_adapter.__all__)
    for name in ssd_tbe_adapter.__all__:
        assert hasattr(ssd_tbe_adapter, name), name
