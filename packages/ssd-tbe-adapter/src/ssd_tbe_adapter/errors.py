"""Exceptions raised by ``ssd_tbe_adapter``; every one derives from :class:`SSDTBEAdapterError`."""

from __future__ import annotations

__all__ = ["SSDTBEAdapterError"]


class SSDTBEAdapterError(Exception):
    """Base class of every error ``ssd_tbe_adapter`` raises on purpose."""
