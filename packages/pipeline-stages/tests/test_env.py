"""pipeline-stages reads no environment variables (its README says so): a new one needs an ``_env`` module."""

from __future__ import annotations

import re
from pathlib import Path

import pipeline_stages


def test_no_module_reads_the_environment() -> None:
    """No module of the installed package touches ``os.environ`` or ``os.getenv``."""
    sources = sorted(Path(pipeline_stages.__file__).parent.rglob("*.py"))
    readers = [p.name for p in sources if re.search(r"os\.environ|getenv\(", p.read_text(encoding="utf-8"))]
    assert sources
    assert not readers, f"modules reading the environment: {readers}"
