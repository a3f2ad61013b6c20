"""Exceptions raised by ``vbe_lookup``; every one derives from :class:`VBELookupError`."""

from __future__ import annotations

__all__ = ["VBELookupError"]


class VBELookupError(Exception):
    """Base class of every error ``vbe_lookup`` raises on purpose."""
