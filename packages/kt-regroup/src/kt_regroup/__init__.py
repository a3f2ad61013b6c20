"""Regroup pooled embeddings (KeyedTensors) into feature groups: fbgemm, Triton and pure-PyTorch paths with one plan."""

from __future__ import annotations

from kt_regroup._version import __version__
from kt_regroup.errors import KTRegroupError

__all__ = ["KTRegroupError", "__version__"]
