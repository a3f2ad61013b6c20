"""Check a release tag against the package it names, and print that release's changelog notes.

Usage:
    python tools/check_release.py TAG                  # e.g. vbe-lookup-v0.1.0; prints the package name
    python tools/check_release.py TAG --notes FILE     # also writes the CHANGELOG section of that version

The tag must be ``<package>-v<version>`` with ``<package>`` one of ``packages/*``, ``<version>`` equal to
``__version__`` in that package's ``_version.py``, a public release (no ``.dev``, no ``+local``), and the
package's ``CHANGELOG.md`` must have a dated ``## [<version>] - YYYY-MM-DD`` section. The release workflow
runs this before building anything. Exit status 0 when the tag is releasable, 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
_TAG = re.compile(r"^(?P<package>[a-z0-9-]+?)-v(?P<version>\d.*)$")
# PEP 440 public releases, pre-releases and post-releases; no dev releases, no local versions.
_RELEASE = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?$")


class ReleaseError(ValueError):
    """The tag cannot be released as it stands."""


def version_of(package: str) -> str:
    """``__version__`` of ``package`` read from its ``_version.py`` (not imported)."""
    path = ROOT / "packages" / package / "src" / package.replace("-", "_") / "_version.py"
    match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", path.read_text(encoding="utf-8"))
    if match is None:
        raise ReleaseError(f"no __version__ in {path.relative_to(ROOT)}")
    return match.group(1)


def changelog_section(package: str, version: str) -> str:
    """The body of ``## [<version>] - <date>`` in the package's CHANGELOG (raises when it is missing or undated)."""
    text = (ROOT / "packages" / package / "CHANGELOG.md").read_text(encoding="utf-8")
    heading = re.search(rf"^## \[{re.escape(version)}\](.*)$", text, flags=re.M)
    if heading is None:
        raise ReleaseError(f"packages/{package}/CHANGELOG.md has no `## [{version}] - YYYY-MM-DD` section")
    if not re.fullmatch(r" - \d{4}-\d{2}-\d{2}", heading.group(1)):
        raise ReleaseError(
            f"the CHANGELOG heading `## [{version}]{heading.group(1)}` is not dated ` - YYYY-MM-DD`"
        )
    end = re.compile(r"^## \[|^\[[^\]]+\]: ", flags=re.M).search(text, heading.end())
    return text[heading.end() : end.start() if end else len(text)].strip() + "\n"


def check_tag(tag: str) -> tuple[str, str]:
    """``(package, version)`` named by ``tag`` once every release condition holds."""
    match = _TAG.match(tag)
    if match is None:
        raise ReleaseError(f"`tag` {tag!r} is not `<package>-v<version>` (e.g. kt-regroup-v0.1.0)")
    package, version = match["package"], match["version"]
    if package not in PACKAGES:
        raise ReleaseError(f"`tag` {tag!r} names package {package!r}, not one of {', '.join(PACKAGES)}")
    source = version_of(package)
    if version != source:
        raise ReleaseError(
            f"`tag` {tag!r} says version {version}, but packages/{package}/src/"
            f"{package.replace('-', '_')}/_version.py says {source}"
        )
    if not _RELEASE.match(version):
        raise ReleaseError(f"version {version} of {package} is not a public release (no .dev, no +local)")
    changelog_section(package, version)
    return package, version


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tag")
    parser.add_argument("--notes", type=Path, help="write the version's CHANGELOG section here")
    args = parser.parse_args()
    try:
        package, version = check_tag(args.tag)
    except ReleaseError as error:
        print(f"check_release: {error}", file=sys.stderr)
        return 1
    if args.notes:
        args.notes.write_text(changelog_section(package, version), encoding="utf-8")
    print(package)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
