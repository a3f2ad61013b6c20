"""Check that a package installs alone: it imports and pulls in none of its siblings.

Usage:
    python tools/check_install_alone.py --current-env kt-regroup   # inspect the running interpreter's env
    python tools/check_install_alone.py --fresh-venv kt-regroup    # build a fresh venv, install through the pins

Exit status 0 when the check holds, 1 with a message naming the sibling otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import venv
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"


def siblings_installed(package: str) -> list[str]:
    """Distributions of this repo, other than ``package``, installed in the running environment."""
    found = []
    for other in PACKAGES:
        if other == package:
            continue
        try:
            metadata.distribution(other)
        except metadata.PackageNotFoundError:
            continue
        found.append(other)
    return found


def check_current_env(package: str) -> int:
    """Verify the running environment has ``package`` importable and no sibling installed."""
    if package not in PACKAGES:
        print(f"`package` must be one of {', '.join(PACKAGES)}; got {package!r}", file=sys.stderr)
        return 2
    module = __import__(package.replace("-", "_"))
    siblings = siblings_installed(package)
    if siblings:
        print(f"{package}: siblings installed alongside it: {', '.join(siblings)}", file=sys.stderr)
        return 1
    print(f"{package} {module.__version__} imports alone (no sibling installed)")
    return 0


def check_fresh_venv(package: str) -> int:
    """Create a fresh venv, ``pip install`` the package through the pins, and re-run the check inside."""
    with tempfile.TemporaryDirectory(prefix=f"alone-{package}-") as tmp:
        venv.create(tmp, with_pip=True)
        python = str(Path(tmp) / "bin" / "python")
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--quiet",
                "-c",
                str(CONSTRAINTS),
                str(ROOT / "packages" / package),
            ],
            check=True,
        )
        return subprocess.run([python, __file__, "--current-env", package], check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--current-env", metavar="PACKAGE")
    mode.add_argument("--fresh-venv", metavar="PACKAGE")
    args = parser.parse_args()
    if args.current_env:
        return check_current_env(args.current_env)
    return check_fresh_venv(args.fresh_venv)


if __name__ == "__main__":
    raise SystemExit(main())
