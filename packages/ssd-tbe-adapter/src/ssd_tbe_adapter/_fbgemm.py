"""The one place this package imports ``fbgemm_gpu`` (used by the benchmark and tests, never at runtime).

fbgemm is ABI-locked to one torch release; importing a mismatched pair raises ``OSError`` or
``RuntimeError`` from the C++ extension, not just ``ImportError``. :func:`load` tries once, warns once,
and returns the TBE classes or ``None``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FbgemmTBE", "load"]

# fbgemm-gpu release (major.minor) -> the torch release (major.minor) it is built against.
_ABI = {"1.6": "2.11", "1.7": "2.12", "1.8": "2.13", "1.9": "2.14"}


@dataclass(frozen=True, slots=True, kw_only=True)
class FbgemmTBE:
    """The fbgemm names the benchmark and tests need."""

    version: str
    codegen: Any  # SplitTableBatchedEmbeddingBagsCodegen
    location: Any  # EmbeddingLocation
    compute_device: Any  # ComputeDevice
    optim_type: Any  # EmbOptimType
    pooling_mode: Any  # PoolingMode
    sparse_type: Any  # SparseType


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


@functools.cache
def load() -> FbgemmTBE | None:
    """fbgemm's training TBE when an ABI-matching ``fbgemm_gpu`` imports, else ``None`` (warned once)."""
    try:
        import fbgemm_gpu
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except (ImportError, OSError, RuntimeError) as error:
        warnings.warn(
            f"fbgemm_gpu unavailable ({type(error).__name__}: {error})", RuntimeWarning, stacklevel=2
        )
        return None
    version = str(getattr(fbgemm_gpu, "__version__", "unknown"))
    expected = _ABI.get(_minor(version))
    if expected is not None and _minor(torch.__version__) != expected:
        warnings.warn(
            f"fbgemm_gpu {version} is built for torch {expected}, this is torch {torch.__version__}: not used",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return FbgemmTBE(
        version=version,
        codegen=SplitTableBatchedEmbeddingBagsCodegen,
        location=EmbeddingLocation,
        compute_device=ComputeDevice,
        optim_type=EmbOptimType,
        pooling_mode=PoolingMode,
        sparse_type=SparseType,
    )
