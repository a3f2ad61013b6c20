"""The public API matches ``api_surface.txt``: a changed export or signature is a deliberate, reviewed diff.

After an intended change, regenerate the snapshot with ``python tools/api_snapshot.py vbe-lookup`` and commit it
with the change (see RELEASING.md).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

PACKAGE = "vbe-lookup"
SNAPSHOT = Path(__file__).resolve().parent / "api_surface.txt"
TOOL = Path(__file__).resolve().parents[3] / "tools" / "api_snapshot.py"


def _tool() -> ModuleType:
    """``tools/api_snapshot.py`` of the repository checkout (the sdist ships the tests but not the tools)."""
    if not TOOL.exists():
        pytest.skip("tools/api_snapshot.py is in the repository checkout, not in the sdist")
    spec = importlib.util.spec_from_file_location("api_snapshot", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_public_api_matches_the_snapshot() -> None:
    """Every exported name, signature, property and dataclass field is as recorded."""
    diff = _tool().check(PACKAGE, SNAPSHOT)
    assert not diff, f"public API changed; if intended run `python tools/api_snapshot.py {PACKAGE}`:\n{diff}"


def test_a_changed_signature_fails_the_freeze(tmp_path: Path) -> None:
    """A copy of the package with one public method given an extra parameter no longer matches the snapshot."""
    tool = _tool()
    changed = tool.probe_copy(PACKAGE, tmp_path)
    path = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    command = [sys.executable, str(TOOL), "--installed", "--check", PACKAGE, "--snapshot", str(SNAPSHOT)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    added = [line for line in result.stdout.splitlines() if line.startswith("+") and tool.PROBE in line]
    assert added, result.stdout
    assert changed.split(".")[1] in added[0]
