"""The direct fbgemm path reads a module's state from the dictionaries that hold it: the same objects as
``getattr``, read again on every call (so a replaced parameter or buffer is seen), and ``getattr`` for names
held elsewhere (properties) or nowhere (an ``AttributeError`` when read, as before)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vbe_lookup._fbgemm_direct import _reader


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("offsets", torch.arange(3))
        self.total = 7

    @property
    def doubled(self) -> int:
        return 2 * self.total


def test_reads_are_getattr_and_follow_replacements() -> None:
    """Parameters, buffers and plain attributes are the objects ``getattr`` returns, after replacements too."""
    module = _Module()
    read = _reader(module, ("weight", "offsets", "total"))
    assert all(a is b for a, b in zip(read(), (module.weight, module.offsets, 7), strict=True))
    module.weight = nn.Parameter(torch.zeros(3))
    module.offsets = torch.arange(5)
    module.total = 8
    module.to(torch.float64)
    got = read()
    assert got[0] is module.weight
    assert got[0].dtype == torch.float64
    assert got[1] is module.offsets
    assert got[2] == 8


def test_properties_and_missing_names_fall_back_to_getattr() -> None:
    """A property is read through ``getattr``; a name the module lacks raises when read."""
    module = _Module()
    read = _reader(module, ("total", "doubled"))
    module.total = 5
    assert read() == (5, 10)
    missing = _reader(module, ("total", "nowhere"))
    with pytest.raises(AttributeError, match="nowhere"):
        missing()
    assert _reader(module, ("doubled",))() == (10,)
