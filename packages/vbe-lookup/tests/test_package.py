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


def test_readme_usage_runs() -> None:
    """The README's usage example runs as written."""
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("## Usage", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)
    # rank 0: user 1x8, item 1x8, query 2x16; rank 1: user 1x8, item 1x8
    assert namespace["out"].values().numel() == 64  # type: ignore[attr-defined]


def test_sharding_names_are_reexported() -> None:
    """Every public name of `vbe_lookup.sharding` is importable from `vbe_lookup` itself (same object)."""
    from vbe_lookup import sharding

    for name in sharding.__all__:
        assert name in vbe_lookup.__all__, name
        assert getattr(vbe_lookup, name) is getattr(sharding, name), name
