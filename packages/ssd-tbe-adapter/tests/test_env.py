"""Environment variables: every one is read through ``ssd_tbe_adapter._env`` and documented in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ssd_tbe_adapter
from ssd_tbe_adapter import _env

SOURCES = sorted(Path(ssd_tbe_adapter.__file__).parent.rglob("*.py"))
README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_variable_is_documented_in_the_readme() -> None:
    """The README names each variable of ``ENV_VARS`` (in backticks)."""
    text = README.read_text(encoding="utf-8")
    missing = [var.name for var in _env.ENV_VARS if f"`{var.name}`" not in text]
    assert not missing, f"README.md does not document {missing}"


def test_only_the_env_module_reads_the_environment() -> None:
    """No other module of the installed package touches ``os.environ`` or ``os.getenv``."""
    readers = [
        path.name
        for path in SOURCES
        if path.name != "_env.py" and re.search(r"os\.environ|getenv\(", path.read_text(encoding="utf-8"))
    ]
    assert not readers, f"modules reading the environment outside _env.py: {readers}"


def test_every_variable_named_in_the_sources_is_listed() -> None:
    """A ``SSD_TBE_ADAPTER_*`` name anywhere in the sources is one of ``ENV_VARS``."""
    named = {
        m
        for path in SOURCES
        for m in re.findall(r"\bSSD_TBE_ADAPTER_[A-Z0-9_]+\b", path.read_text(encoding="utf-8"))
    }
    assert named <= {var.name for var in _env.ENV_VARS}


def test_get_reads_the_current_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EnvVar.get`` reads at call time; unset or blank gives the default."""
    var = _env.ENV_VARS[0]
    monkeypatch.setenv(var.name, " x ")
    assert var.get() == "x"
    monkeypatch.setenv(var.name, "  ")
    assert var.get() == var.default
    monkeypatch.delenv(var.name)
    assert var.get() == var.default
