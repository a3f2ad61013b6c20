"""Exceptions raised by ``pipeline_stages``; every one derives from :class:`PipelineError`."""

from __future__ import annotations

__all__ = ["PipelineError"]


class PipelineError(Exception):
    """Base class of every error ``pipeline_stages`` raises on purpose."""
