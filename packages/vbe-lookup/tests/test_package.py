"""Package-level facts every release must keep."""

from __future__ import annotations

import re
from importlib.metadata import version

import vbe_lookup


def test_version_matches_installed_metadata() -> None:
    """`__version__` is the version the installed distribution reports (one source of truth)."""
    assert vbe_lookup.__version__ == version("vbe-lookup")
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", vbe_lookup.__version__)


def test_all_is_sorted_and_exported() -> None:
    """`__all__` is sorted and names only attributes that exist."""
    assert list(vbe_lookup.__all__) == sorted(vbe_lookup.__all__)
    for name in vbe_lookup.__all__:
        assert hasattr(vbe_lookup, name), name
