"""The release tools: tag checks, distribution checks, the API snapshot's formatting, one fbgemm loader."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[1]
ROOT = TOOLS.parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


check_release = _load("check_release")
check_dist = _load("check_dist")
api_snapshot = _load("api_snapshot")


def _fake_package(root: Path, version: str, heading: str) -> None:
    pkg = root / "packages" / "demo-pkg"
    (pkg / "src" / "demo_pkg").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text("[project]\nname = 'demo-pkg'\n")
    (pkg / "src" / "demo_pkg" / "_version.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "CHANGELOG.md").write_text(
        f"# Changelog\n\n## [Unreleased]\n\n{heading}\n\n### Added\n\n- a thing\n"
    )


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(check_release, "ROOT", tmp_path)
    monkeypatch.setattr(check_release, "PACKAGES", ["demo-pkg"])
    return tmp_path


def test_tag_matching_version_and_dated_changelog_is_releasable(fake_root: Path) -> None:
    """`<package>-v<version>` with that version in _version.py and a dated section passes; notes are the section."""
    _fake_package(fake_root, "1.2.0", "## [1.2.0] - 2026-12-01")
    assert check_release.check_tag("demo-pkg-v1.2.0") == ("demo-pkg", "1.2.0")
    assert check_release.changelog_section("demo-pkg", "1.2.0") == "### Added\n\n- a thing\n"


@pytest.mark.parametrize(
    ("tag", "version", "heading", "message"),
    [
        ("demo-pkg-v1.3.0", "1.2.0", "## [1.3.0] - 2026-12-01", "_version.py says 1.2.0"),
        ("demo-pkg-v1.2.0.dev0", "1.2.0.dev0", "## [1.2.0.dev0] - 2026-12-01", "not a public release"),
        ("demo-pkg-v1.2.0", "1.2.0", "## [1.1.0] - 2026-12-01", "no `## [1.2.0] - YYYY-MM-DD` section"),
        ("demo-pkg-v1.2.0", "1.2.0", "## [1.2.0] - unreleased", "not dated"),
        ("other-v1.2.0", "1.2.0", "## [1.2.0] - 2026-12-01", "not one of demo-pkg"),
        ("demo-pkg-1.2.0", "1.2.0", "## [1.2.0] - 2026-12-01", "is not `<package>-v<version>`"),
    ],
    ids=["version-mismatch", "dev-release", "no-section", "undated", "unknown-package", "no-v"],
)
def test_unreleasable_tags_say_why(
    fake_root: Path, tag: str, version: str, heading: str, message: str
) -> None:
    """Each broken release condition raises ReleaseError naming what is wrong."""
    _fake_package(fake_root, version, heading)
    with pytest.raises(check_release.ReleaseError, match=re.escape(message)):
        check_release.check_tag(tag)


def test_every_package_changelog_has_a_dated_first_release() -> None:
    """Each package's CHANGELOG keeps [Unreleased] on top and a dated section for its first release."""
    for package in check_release.PACKAGES:
        text = (ROOT / "packages" / package / "CHANGELOG.md").read_text(encoding="utf-8")
        headings = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
        assert headings[0] == "Unreleased", package
        version = check_release.version_of(package).split(".dev")[0]
        assert check_release.changelog_section(package, version).strip(), package


def test_readme_check_flags_what_pypi_cannot_show() -> None:
    """Relative links and checkout-only pip lines are reported; absolute links and `pip install name` pass."""
    bad = "See [docs](../../docs/x.md).\n\n    pip install -c constraints/cpu.txt ./packages/demo\n"
    problems = check_dist.check_readme("demo", bad)
    assert any("relative link `../../docs/x.md`" in p for p in problems)
    assert any("checkout-only install line" in p for p in problems)
    assert any("no `pip install demo` line" in p for p in problems)
    good = "See [docs](https://example.org/x.md) and [below](#usage).\n\n    pip install demo  # use a constraints file\n"
    assert check_dist.check_readme("demo", good) == []


def test_signature_text_is_stable_and_complete() -> None:
    """Positional-only, keyword-only, defaults and string annotations are all written out."""

    def f(a: int, /, b: str = "x", *args: int, c: float | None = None, **kw: object) -> bool:
        return True

    def g(x: object, *, y: bool = False) -> None:
        return None

    assert api_snapshot._signature(f) == (
        "(a: int, /, b: str = 'x', *args: int, c: float | None = None, **kw: object) -> bool"
    )
    assert api_snapshot._signature(g) == "(x: object, *, y: bool = False) -> None"
    assert api_snapshot._value(object()) == "<object>"


def test_fbgemm_loaders_are_one_code() -> None:
    """The shared loader block is the same text in every package that imports fbgemm."""
    begin, end = "# ---- the loader:", "# ---- end of the shared loader ----"
    blocks = {}
    for shim in sorted(ROOT.glob("packages/*/src/*/_fbgemm.py")):
        text = shim.read_text(encoding="utf-8")
        assert begin in text, shim
        assert end in text, shim
        blocks[shim.parts[-4]] = text[text.index(begin) : text.index(end)]
    assert len(blocks) == 3
    first = next(iter(blocks.values()))
    assert all(block == first for block in blocks.values()), sorted(blocks)
