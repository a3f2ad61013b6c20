"""The one place ``vbe_lookup`` imports fbgemm-gpu.

fbgemm is ABI-locked to one torch release; a mismatched pair fails to load (or worse). The shim checks
the installed pair before importing, catches load errors, warns once and reports availability. Nothing
else in the package imports ``fbgemm_gpu``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import torch

__all__ = [
    "fbgemm_available",
    "fbgemm_status",
    "install_vbe_metadata_cache",
    "is_fbgemm_tbe",
    "new_tbe",
    "tbe_feature_dims",
    "tbe_feature_num_embeddings",
    "tbe_output_dtype",
]

# fbgemm-gpu minor release -> the torch minor release it is built against.
_ABI_PAIRS = {(1, 6): (2, 11), (1, 7): (2, 12), (1, 8): (2, 13), (1, 9): (2, 14)}
_DISABLE_ENV = "VBE_LOOKUP_DISABLE_FBGEMM"


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


@functools.cache
def _load() -> tuple[Any, str]:
    """Import fbgemm's TBE module once; ``(module or None, status line)``."""
    if os.environ.get(_DISABLE_ENV) == "1":
        return None, f"disabled by {_DISABLE_ENV}=1"
    installed = _installed_version()
    torch_minor = _minor(torch.__version__)
    if installed is not None:
        wanted = _ABI_PAIRS.get(_minor(installed) or (0, 0))
        if wanted is not None and wanted != torch_minor:
            return None, (
                f"fbgemm-gpu {installed} needs torch {wanted[0]}.{wanted[1]}, found torch {torch.__version__}"
            )
    try:
        import fbgemm_gpu
        from fbgemm_gpu import split_table_batched_embeddings_ops_training as training
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"fbgemm_gpu failed to import: {type(exc).__name__}: {exc}"
    version = getattr(fbgemm_gpu, "__version__", installed)
    return training, f"fbgemm_gpu {version} with torch {torch.__version__}"


@functools.cache
def _warn_once(status: str) -> None:
    warnings.warn(f"vbe_lookup: fbgemm unavailable ({status}); using the pure PyTorch kernels", stacklevel=3)


def fbgemm_available() -> bool:
    """Whether fbgemm's TBE imported (warns once, with the reason, when it did not)."""
    module, status = _load()
    if module is None and installed_anything():
        _warn_once(status)
    return module is not None


def installed_anything() -> bool:
    """Whether some fbgemm-gpu distribution is installed (a missing optional extra is not worth a warning)."""
    return _installed_version() is not None


_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu")


def _version_or_none(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _installed_version() -> str | None:
    """Version of the installed fbgemm-gpu distribution (CPU or CUDA flavour), if any."""
    versions = [v for v in map(_version_or_none, _DISTRIBUTIONS) if v is not None]
    return versions[0] if versions else None


def fbgemm_status() -> str:
    """One line saying which fbgemm is in use, or why none is."""
    return _load()[1]


def is_fbgemm_tbe(kernel: object) -> bool:
    """Whether ``kernel`` is fbgemm's training TBE (without importing fbgemm when it is absent)."""
    module = _load()[0]
    return module is not None and isinstance(kernel, module.SplitTableBatchedEmbeddingBagsCodegen)


def tbe_feature_dims(kernel: Any) -> list[int]:
    """Embedding dim of each feature of an fbgemm TBE."""
    return [int(kernel.embedding_specs[t][1]) for t in kernel.feature_table_map]


def tbe_feature_num_embeddings(kernel: Any) -> list[int]:
    """Rows of the table each feature of an fbgemm TBE reads."""
    return [int(kernel.embedding_specs[t][0]) for t in kernel.feature_table_map]


_SPARSE_TYPE_INTS = {0: torch.float32, 1: torch.float16, 5: torch.bfloat16}  # SparseType.as_int()


def tbe_output_dtype(kernel: Any) -> torch.dtype:
    """The torch dtype of an fbgemm TBE's output."""
    try:
        from fbgemm_gpu.split_embedding_configs import SparseType

        dtype = SparseType.from_int(int(kernel.output_dtype)).as_dtype()
    except (AttributeError, ValueError, KeyError, ImportError):
        dtype = _SPARSE_TYPE_INTS.get(int(kernel.output_dtype), torch.float32)
    assert isinstance(dtype, torch.dtype)
    return dtype


def tbe_uses_cpu(kernel: Any) -> bool:
    """Whether an fbgemm TBE runs its CPU kernels (those cannot write into ``vbe_output``)."""
    use_cpu = getattr(kernel, "use_cpu", None)
    if use_cpu is not None:
        return bool(use_cpu)
    device = getattr(kernel, "current_device", torch.device("cpu"))
    return torch.device(device).type == "cpu"


_BOUNDS_CHECK_MODES = {"warning": "WARNING", "fatal": "FATAL", "none": "NONE"}
_SPARSE_TYPES = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}


def new_tbe(
    num_embeddings: Sequence[int],
    embedding_dims: Sequence[int],
    *,
    feature_table_map: Sequence[int] | None = None,
    pooling: str = "sum",
    optimizer: str = "sgd",
    learning_rate: float = 0.01,
    eps: float = 1.0e-8,
    weights_dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    bounds_check: str = "warning",
) -> Any:
    """An fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` described in this package's terms.

    Tables live in device memory (``EmbeddingLocation.DEVICE``) on CUDA, on the host on CPU.
    ``bounds_check`` is fbgemm's ``BoundsCheckMode`` by name: ``"warning"`` (fbgemm's default: out-of-range
    ids become 0 with a warning), ``"fatal"`` or ``"none"`` (no check: ids must be valid). Raises
    ``RuntimeError`` when fbgemm is unavailable, ``ValueError`` for an unknown ``bounds_check``.
    """
    if bounds_check not in _BOUNDS_CHECK_MODES:
        raise ValueError(f"`bounds_check` must be one of {sorted(_BOUNDS_CHECK_MODES)}, got {bounds_check!r}")
    module, status = _load()
    if module is None:
        raise RuntimeError(f"fbgemm is unavailable: {status}")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        ComputeDevice,
        EmbeddingLocation,
        PoolingMode,
    )

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
    optim = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    specs = [(int(e), int(d), location, compute) for e, d in zip(num_embeddings, embedding_dims, strict=True)]
    return module.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=specs,
        feature_table_map=None if feature_table_map is None else list(feature_table_map),
        optimizer=optim,
        learning_rate=learning_rate,
        eps=eps,
        weights_precision=getattr(SparseType, _SPARSE_TYPES[weights_dtype]),
        output_dtype=getattr(SparseType, _SPARSE_TYPES[output_dtype]),
        pooling_mode={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[pooling],
        device=device,
        bounds_check_mode=getattr(BoundsCheckMode, _BOUNDS_CHECK_MODES[bounds_check]),
    )


_METADATA_CACHE_SIZE = 64


def install_vbe_metadata_cache(kernel: Any) -> None:
    """Memoise an fbgemm TBE's host-side VBE metadata per batch-size layout.

    fbgemm rebuilds its VBE metadata (a few small CPU tensors, ``.item()`` calls and host-to-device
    copies) on every forward. The metadata depends only on the batch sizes, the feature dims and the
    ``vbe_output_offsets`` tensor, so it is cached keyed on the layout and on that tensor's identity
    (the grouped lookup keeps one offsets tensor per layout alive); only ``vbe_output`` is swapped per call.
    Idempotent.
    """
    if getattr(kernel, "_vbe_lookup_metadata_cache", None) is not None:
        return
    original = getattr(kernel, "_generate_vbe_metadata", None)
    if not callable(original):
        return  # another fbgemm release: leave it alone
    cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def cached(*args: Any, **kwargs: Any) -> Any:
        # fbgemm calls it as (offsets, batch_size_per_feature_per_rank[, vbe_output, vbe_output_offsets]).
        names = ("offsets", "batch_size_per_feature_per_rank", "vbe_output", "vbe_output_offsets")
        bound = dict(zip(names, args, strict=False)) | kwargs
        offsets = bound.get("offsets")
        batch_sizes = bound.get("batch_size_per_feature_per_rank")
        if batch_sizes is None or not isinstance(offsets, torch.Tensor) or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        vbe_output_offsets = bound.get("vbe_output_offsets")
        key = (
            tuple(map(tuple, batch_sizes)),
            offsets.device,
            None if vbe_output_offsets is None else (id(vbe_output_offsets), vbe_output_offsets.data_ptr()),
        )
        hit = cache.get(key)
        if hit is None:
            metadata = original(*args, **kwargs)
            # Keep the offsets tensor alive so its id cannot be reused by another tensor.
            cache[key] = (metadata, vbe_output_offsets)
            if len(cache) > _METADATA_CACHE_SIZE:
                cache.popitem(last=False)
            return metadata
        cache.move_to_end(key)
        metadata = hit[0]
        if "vbe_output" in getattr(metadata, "_fields", ()):
            metadata = metadata._replace(vbe_output=bound.get("vbe_output"))
        return metadata

    kernel._generate_vbe_metadata = cached
    kernel._vbe_lookup_metadata_cache = cache
