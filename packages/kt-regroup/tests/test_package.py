"""Package-level facts every release must keep."""

from __future__ import annotations

import re
from importlib.metadata import version

import kt_regroup


def test_version_matches_installed_metadata() -> None:
    """`__version__` is the version the installed distribution reports (one source of truth)."""
    assert kt_regroup.__version__ == version("kt-regroup")
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", kt_regroup.__version__)


def test_all_is_sorted_and_exported() -> None:
    """`__all__` is sorted and names only attributes that exist."""
    assert list(kt_regroup.__all__) == sorted(kt_regroup.__all__)
    for name in kt_regroup.__all__:
        assert hasattr(kt_regroup, name), name
