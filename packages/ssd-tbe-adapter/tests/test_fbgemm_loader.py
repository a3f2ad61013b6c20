"""The fbgemm loader: one switch, the torch pairing checked before any import, one warning when unusable."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from ssd_tbe_adapter import _fbgemm


@pytest.fixture
def fresh_load() -> Iterator[None]:
    """Forget the cached load before and after the test (the real one is redone on the next call)."""
    _fbgemm._load.cache_clear()
    yield
    _fbgemm._load.cache_clear()


def _never_import() -> object:
    raise AssertionError("fbgemm_gpu was imported")


def _mismatched_release() -> str:
    """An fbgemm release the table pairs with another torch than this one."""
    here = _fbgemm._minor(torch.__version__)
    return next(f"{fb}.0" for fb, pt in _fbgemm.TORCH_FOR_FBGEMM.items() if pt != here)


def test_precheck_follows_the_table() -> None:
    """Every table pair passes, a crossed pair is refused naming both torch releases, an unknown release may try."""
    for fb, pt in _fbgemm.TORCH_FOR_FBGEMM.items():
        assert _fbgemm._precheck(f"{fb}.0", f"{pt}.0+cpu", disabled=False) is None
    why = _fbgemm._precheck("1.6.0", "2.13.0", disabled=False)
    assert why is not None
    assert "torch 2.11" in why
    assert "2.13.0" in why
    assert _fbgemm._precheck("2026.1.1", "2.13.0", disabled=False) is None
    assert _fbgemm._precheck(None, "2.13.0", disabled=False) == "fbgemm-gpu is not installed"


def test_mismatched_pair_is_never_imported(monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    """A release built for another torch is refused from its metadata alone, with one RuntimeWarning."""
    monkeypatch.delenv("SSD_TBE_ADAPTER_DISABLE_FBGEMM", raising=False)
    monkeypatch.setattr(_fbgemm, "_installed_version", _mismatched_release)
    monkeypatch.setattr(_fbgemm, "_import", _never_import)
    with pytest.warns(RuntimeWarning, match="built for torch"):
        assert not _fbgemm.fbgemm_available()
    assert "not imported" in _fbgemm.fbgemm_status()


def test_switch_skips_fbgemm_silently(monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    """``SSD_TBE_ADAPTER_DISABLE_FBGEMM=1`` means no import and no warning, whatever is installed."""
    monkeypatch.setenv("SSD_TBE_ADAPTER_DISABLE_FBGEMM", "1")
    monkeypatch.setattr(_fbgemm, "_installed_version", lambda: "1.8.0")
    monkeypatch.setattr(_fbgemm, "_import", _never_import)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _fbgemm.fbgemm_available()
    assert _fbgemm.fbgemm_status() == "disabled by SSD_TBE_ADAPTER_DISABLE_FBGEMM=1"


def test_absent_fbgemm_is_silent(monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    """Without the optional extra there is nothing to warn about."""
    monkeypatch.delenv("SSD_TBE_ADAPTER_DISABLE_FBGEMM", raising=False)
    monkeypatch.setattr(_fbgemm, "_installed_version", lambda: None)
    monkeypatch.setattr(_fbgemm, "_import", _never_import)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _fbgemm.fbgemm_available()
    assert _fbgemm.fbgemm_status() == "fbgemm-gpu is not installed"


def test_failed_import_warns_once(monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    """A load error (an undefined symbol is an OSError) is reported once, then the result is cached."""

    def broken() -> object:
        raise OSError("undefined symbol: _ZN3c10")

    monkeypatch.delenv("SSD_TBE_ADAPTER_DISABLE_FBGEMM", raising=False)
    monkeypatch.setattr(_fbgemm, "_installed_version", lambda: "2026.1.1")
    monkeypatch.setattr(_fbgemm, "_import", broken)
    with pytest.warns(RuntimeWarning, match="undefined symbol"):
        assert not _fbgemm.fbgemm_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _fbgemm.fbgemm_available()
