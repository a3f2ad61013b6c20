"""The one place the example imports fbgemm-gpu: builds fbgemm TBEs when the installed pair loads.

fbgemm is ABI-locked to one torch release (1.6 ↔ 2.11, 1.7 ↔ 2.12, 1.8 ↔ 2.13, 1.9 ↔ 2.14); a mismatched
pair is not imported at all. Any import failure is reported once and the example uses vbe-lookup's
``TorchEmbeddingKernel`` instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import torch

__all__ = ["fbgemm_status", "new_fbgemm_tbe"]

_ABI_PAIRS = {(1, 6): (2, 11), (1, 7): (2, 12), (1, 8): (2, 13), (1, 9): (2, 14)}


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


@functools.cache
def _load() -> tuple[Any, str]:
    """``(fbgemm's training-TBE module or None, one status line)``, computed once."""
    if os.environ.get("DLRM_DISABLE_FBGEMM") == "1":
        return None, "disabled by DLRM_DISABLE_FBGEMM=1"
    installed = None
    for dist in ("fbgemm-gpu", "fbgemm-gpu-cpu"):
        try:
            installed = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    if installed is None:
        return None, "fbgemm-gpu is not installed"
    wanted = _ABI_PAIRS.get(_minor(installed) or (0, 0))
    if wanted is not None and wanted != _minor(torch.__version__):
        return None, f"fbgemm-gpu {installed} needs torch {wanted[0]}.{wanted[1]}, found {torch.__version__}"
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
        from fbgemm_gpu import split_table_batched_embeddings_ops_training as training
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"fbgemm_gpu failed to import: {type(exc).__name__}: {exc}"
    return training, f"fbgemm-gpu {installed} with torch {torch.__version__}"


@functools.cache
def _report(status: str) -> None:
    print(
        f"examples.dlrm: fbgemm TBEs unavailable ({status}); using vbe_lookup.TorchEmbeddingKernel",
        file=sys.stderr,
    )


def fbgemm_status() -> tuple[bool, str]:
    """Whether fbgemm TBEs can be built here, and why (or why not)."""
    module, status = _load()
    return module is not None, status


def new_fbgemm_tbe(
    num_embeddings: Sequence[int],
    embedding_dims: Sequence[int],
    feature_table_map: Sequence[int],
    *,
    optimizer: str,
    learning_rate: float,
    device: torch.device,
) -> Any:
    """An fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` (sum pooling, fused optimizer), or None.

    Tables live in host memory on CPU and in HBM on CUDA. fbgemm's own bounds check is off: the sharded
    input dist checks every id against its table before any kernel runs (one check for the whole batch,
    read in the step's one host sync), so a second check per TBE call would only cost host time (~0.14 ms
    a call on the H200) and a kernel.
    """
    module, status = _load()
    if module is None:
        _report(status)
        return None
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )

    cuda = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
    compute = module.ComputeDevice.CUDA if cuda else module.ComputeDevice.CPU
    optim = EmbOptimType.EXACT_ROWWISE_ADAGRAD if optimizer == "rowwise_adagrad" else EmbOptimType.EXACT_SGD
    return module.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            (int(r), int(d), location, compute) for r, d in zip(num_embeddings, embedding_dims, strict=True)
        ],
        feature_table_map=list(feature_table_map),
        optimizer=optim,
        learning_rate=learning_rate,
        eps=1.0e-8,
        pooling_mode=PoolingMode.SUM,
        device=device,
        bounds_check_mode=BoundsCheckMode.NONE,
    )
