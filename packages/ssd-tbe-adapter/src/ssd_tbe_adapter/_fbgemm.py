"""The one place this package imports ``fbgemm_gpu`` (used by the benchmark and tests, never at runtime).

fbgemm is ABI-locked to one torch release (see ``TORCH_FOR_FBGEMM``); a mismatched pair can fail at import
(``OSError``/``RuntimeError`` from the C++ extension) or crash the process, so the installed release is
checked against torch *before* the import and a known mismatch is never imported.
``SSD_TBE_ADAPTER_DISABLE_FBGEMM=1`` skips fbgemm altogether. :func:`load` tries once, warns once, and
returns the TBE classes or ``None``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from ssd_tbe_adapter import _env

__all__ = ["TORCH_FOR_FBGEMM", "FbgemmTBE", "fbgemm_available", "fbgemm_status", "load"]

_FALLBACK = "the benchmark and tests run without the fbgemm TBE baseline"


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


def _import() -> FbgemmTBE:
    """Import fbgemm-gpu's training TBE and its enums (raises when they do not load)."""
    import fbgemm_gpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return FbgemmTBE(
        version=str(getattr(fbgemm_gpu, "__version__", "unknown")),
        codegen=SplitTableBatchedEmbeddingBagsCodegen,
        location=EmbeddingLocation,
        compute_device=ComputeDevice,
        optim_type=EmbOptimType,
        pooling_mode=PoolingMode,
        sparse_type=SparseType,
    )


# ---- the loader: the same code in every recsys-blocks package that uses fbgemm (only `_import` differs) ----

# fbgemm-gpu release (major.minor) -> the torch release (major.minor) it is built against.
TORCH_FOR_FBGEMM: dict[str, str] = {"1.6": "2.11", "1.7": "2.12", "1.8": "2.13", "1.9": "2.14"}
# The distributions that provide the ``fbgemm_gpu`` module (CUDA, CPU, nightlies).
DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu")


def _minor(version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _version_or_none(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _installed_version() -> str | None:
    """The version of the installed fbgemm-gpu distribution (read from its metadata: nothing is imported)."""
    versions = [v for v in map(_version_or_none, DISTRIBUTIONS) if v is not None]
    return versions[0] if versions else None


def _precheck(installed: str | None, torch_version: str, disabled: bool) -> str | None:
    """Why fbgemm must not be imported (checked before any import), or ``None`` when the import may be tried."""
    if disabled:
        return f"disabled by {_env.DISABLE_FBGEMM.name}=1"
    if installed is None:
        return "fbgemm-gpu is not installed"
    wanted = TORCH_FOR_FBGEMM.get(_minor(installed))
    if wanted is not None and wanted != _minor(torch_version):
        return (
            f"fbgemm-gpu {installed} is built for torch {wanted}, this is torch {torch_version}: not imported"
        )
    return None


@functools.cache
def _load() -> tuple[Any, str]:
    """``(what this package needs from fbgemm, or None; one status line)``, computed once.

    Steps: the switch, the installed distribution, its torch pairing (all before any import, since a
    mismatched pair can crash at import), then the import. An installed but unusable fbgemm warns once
    (``RuntimeWarning``); a disabled or absent one does not (the extra is optional).
    """
    installed = _installed_version()
    disabled = _env.DISABLE_FBGEMM.get() == "1"
    why_not = _precheck(installed, torch.__version__, disabled)
    if why_not is None:
        try:
            return _import(), f"fbgemm-gpu {installed} with torch {torch.__version__}"
        except (ImportError, OSError, RuntimeError, AttributeError) as exc:
            why_not = f"fbgemm-gpu {installed} failed to load ({type(exc).__name__}: {exc})"
    if installed is not None and not disabled:
        warnings.warn(f"{__package__}: {why_not}; {_FALLBACK}", RuntimeWarning, stacklevel=3)
    return None, why_not


def fbgemm_available() -> bool:
    """Whether fbgemm loaded (see :func:`_load` for the steps)."""
    return _load()[0] is not None


def fbgemm_status() -> str:
    """One line saying which fbgemm is in use, or why none is."""
    return _load()[1]


# ---- end of the shared loader ----


def load() -> FbgemmTBE | None:
    """fbgemm's training TBE when an ABI-matching ``fbgemm_gpu`` loads, else ``None`` (warned once)."""
    tbe: FbgemmTBE | None = _load()[0]
    return tbe
