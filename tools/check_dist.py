"""Check one package's built sdist and wheel for what PyPI users get: licence, URLs, a README that works there.

Usage:
    python tools/check_dist.py PACKAGE DIST_DIR      # DIST_DIR holds exactly that package's sdist and wheel

Run by ``nox -s build`` after ``twine check --strict`` and ``check-wheel-contents`` (which check the format,
not these). Exit status 0 when every check holds, 1 with one line per failed check otherwise.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import sys
import tarfile
import zipfile
from email.message import Message
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
URL_LABELS = ("Source", "Documentation", "Changelog", "Issues")
# A markdown link or image whose target is not absolute: broken on PyPI, which renders the README alone.
_RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)]+)\)")
# pip lines that only work inside a checkout of this repository.
_CHECKOUT_ONLY = re.compile(r"pip install[^\n]*(\./packages/|-c constraints/|--constraint constraints/)")


def source_version(package: str) -> str:
    """``__version__`` from ``packages/<package>/src/<module>/_version.py`` (read, not imported)."""
    path = ROOT / "packages" / package / "src" / package.replace("-", "_") / "_version.py"
    match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", path.read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(f"no __version__ in {path}")
    return match.group(1)


def _metadata(wheel: zipfile.ZipFile) -> Message:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return email.parser.Parser().parsestr(wheel.read(name).decode("utf-8"))


def check_wheel(package: str, path: Path, license_text: str) -> list[str]:
    """Problems with the wheel at ``path`` (empty when it is release-ready)."""
    module = package.replace("-", "_")
    problems = []
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        meta = _metadata(wheel)
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        if not licenses:
            problems.append("the wheel has no .dist-info/licenses/LICENSE")
        elif wheel.read(licenses[0]).decode("utf-8") != license_text:
            problems.append("the wheel's LICENSE differs from the repository's LICENSE")
        if f"{module}/py.typed" not in names:
            problems.append(f"the wheel has no {module}/py.typed")
        if any(n.startswith(("tests/", f"{module}/tests/")) for n in names):
            problems.append("the wheel ships tests")
    if meta["Name"] != package:
        problems.append(f"metadata Name is {meta['Name']!r}, expected {package!r}")
    if meta["Version"] != source_version(package):
        problems.append(f"metadata Version {meta['Version']} is not _version.py's {source_version(package)}")
    if meta["License-Expression"] != "BSD-3-Clause":
        problems.append(f"License-Expression is {meta['License-Expression']!r}, expected 'BSD-3-Clause'")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append("no License-File: LICENSE in the metadata")
    urls = {entry.split(",", 1)[0].strip() for entry in meta.get_all("Project-URL") or []}
    problems += [f"no Project-URL labelled {label!r}" for label in URL_LABELS if label not in urls]
    if "Typing :: Typed" not in (meta.get_all("Classifier") or []):
        problems.append("no 'Typing :: Typed' classifier")
    problems += check_readme(package, meta.get_payload())  # type: ignore[arg-type]  # a str for a non-multipart message
    return problems


def check_readme(package: str, text: str) -> list[str]:
    """Problems with the long description as PyPI renders it."""
    problems = [
        f"relative link `{m}` in the README (PyPI cannot follow it)" for m in _RELATIVE_LINK.findall(text)
    ]
    problems += [
        f"checkout-only install line in the README: `{m.group(0)}`" for m in _CHECKOUT_ONLY.finditer(text)
    ]
    if f"pip install {package}" not in text and f'pip install "{package}[' not in text:
        problems.append(f"the README has no `pip install {package}` line")
    if "constraint" not in text:
        problems.append("the README does not give the constraints advice (fbgemm is ABI-locked to torch)")
    return problems


def check_sdist(package: str, path: Path, license_text: str) -> list[str]:
    """Problems with the sdist at ``path``: it must carry the licence, docs, tests and the API snapshot."""
    module = package.replace("-", "_")
    with tarfile.open(path) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        member = next(
            (m for m in sdist.getmembers() if m.name.endswith("/LICENSE") and m.name.count("/") == 1), None
        )
        license_ok = (
            member is not None
            and (f := sdist.extractfile(member)) is not None
            and f.read().decode() == license_text
        )
    wanted = [
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "pyproject.toml",
        f"src/{module}/py.typed",
        "tests/api_surface.txt",
    ]
    problems = [f"the sdist has no {name}" for name in wanted if name not in names]
    if "LICENSE" in names and not license_ok:
        problems.append("the sdist's LICENSE differs from the repository's LICENSE")
    return problems


def check(package: str, dist: Path) -> list[str]:
    """Every problem with ``package``'s artifacts in ``dist`` and its LICENSE copy."""
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    problems = []
    if (ROOT / "packages" / package / "LICENSE").read_text(encoding="utf-8") != license_text:
        problems.append(f"packages/{package}/LICENSE differs from the root LICENSE")
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [*problems, f"{dist} must hold one wheel and one sdist, found {len(wheels)} and {len(sdists)}"]
    return (
        problems
        + check_wheel(package, wheels[0], license_text)
        + check_sdist(package, sdists[0], license_text)
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("package", choices=PACKAGES)
    parser.add_argument("dist", type=Path)
    args = parser.parse_args()
    problems = check(args.package, args.dist)
    for problem in problems:
        print(f"{args.package}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.package}: sdist and wheel are release-ready (licence, URLs, README, snapshot)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
