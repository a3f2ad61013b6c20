"""Variable-batch (VBE) pooled embedding lookup over several kernels into one pre-allocated output, and a table-wise sharded module."""

from __future__ import annotations

from vbe_lookup._version import __version__
from vbe_lookup.errors import VBELookupError

__all__ = ["VBELookupError", "__version__"]
