"""Staged train pipeline (H2D copy, sparse data dist, prefetch) on CPU and CUDA streams, with torchrec's order."""

from __future__ import annotations

from pipeline_stages._version import __version__
from pipeline_stages.errors import PipelineError

__all__ = ["PipelineError", "__version__"]
