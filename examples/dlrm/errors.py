"""The trainer's own errors: a bad flag or checkpoint is reported as one line (``error: ...``), not a traceback."""

from __future__ import annotations

__all__ = ["ArgumentError", "CheckpointError", "DLRMError"]


class DLRMError(Exception):
    """Base of the DLRM example's errors."""


class ArgumentError(DLRMError, ValueError):
    """A command-line option is wrong (unknown data path, evaluation without held-out data, ...)."""


class CheckpointError(DLRMError, ValueError):
    """``--resume`` names no checkpoint, or one written by an incompatible configuration."""
