"""The import-linter independence contract is live: a sibling import breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["kt_regroup", "pipeline_stages", "vbe_lookup", "ssd_tbe_adapter"]


def run_lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports with the root config over the package sources copied under ``tree``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / module) for module in MODULES)
    lint_imports = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(lint_imports), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    """A copy of the four packages' import packages, one folder per package (as on PYTHONPATH)."""
    for src in (ROOT / "packages").glob("*/src/*"):
        if src.name in MODULES:
            shutil.copytree(src, tmp_path / src.name / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_contract_holds_on_the_real_tree(source_tree: Path) -> None:
    """The packages as committed keep the independence contract."""
    result = run_lint_imports(source_tree)
    assert result.returncode == 0, result.stdout + result.stderr


def test_contract_fails_when_a_package_imports_a_sibling(source_tree: Path) -> None:
    """Adding `import vbe_lookup` to kt_regroup makes lint-imports fail and name both packages."""
    init = source_tree / "kt_regroup" / "kt_regroup" / "__init__.py"
    init.write_text(init.read_text() + "\nimport vbe_lookup  # noqa: F401\n")
    result = run_lint_imports(source_tree)
    assert result.returncode != 0
    assert "kt_regroup" in result.stdout, result.stdout
    assert "vbe_lookup" in result.stdout, result.stdout
