"""Exceptions raised by ``kt_regroup``; every one derives from :class:`KTRegroupError`."""

from __future__ import annotations

__all__ = ["KTRegroupError"]


class KTRegroupError(Exception):
    """Base class of every error ``kt_regroup`` raises on purpose."""
