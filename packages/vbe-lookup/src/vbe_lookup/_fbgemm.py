"""The one place ``vbe_lookup`` imports fbgemm-gpu.

fbgemm is ABI-locked to one torch release (see ``TORCH_FOR_FBGEMM``); a mismatched pair can fail at import
or crash the process, so the installed release is checked against torch *before* the import and a known
mismatch is never imported. ``VBE_LOOKUP_DISABLE_FBGEMM=1`` skips fbgemm altogether. Load errors warn
once; the package then uses its pure-PyTorch kernels. Nothing else in the package imports ``fbgemm_gpu``.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import torch

from vbe_lookup import _env

__all__ = [
    "TORCH_FOR_FBGEMM",
    "bounds_check_none",
    "fbgemm_available",
    "fbgemm_status",
    "generate_vbe_metadata",
    "install_vbe_metadata_cache",
    "is_fbgemm_tbe",
    "new_tbe",
    "tbe_feature_dims",
    "tbe_feature_num_embeddings",
    "tbe_output_dtype",
    "training_module",
]

_FALLBACK = "using the pure PyTorch kernels"


def _import() -> Any:
    """Import fbgemm-gpu's training-TBE module (raises when it does not load)."""
    import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as training

    return training


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


def training_module() -> Any:
    """fbgemm's training-TBE module, or ``None`` when fbgemm did not load."""
    return _load()[0]


def bounds_check_none() -> int:
    """The integer of fbgemm's ``BoundsCheckMode.NONE`` (fbgemm must have loaded)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    return int(BoundsCheckMode.NONE.value)


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


def generate_vbe_metadata(
    offsets: torch.Tensor,
    batch_sizes: list[list[int]],
    pooling_mode: Any,
    feature_dims_cpu: torch.Tensor,
    device: torch.device,
    vbe_output_offsets: torch.Tensor | None,
) -> Any:
    """fbgemm's VBE metadata of a lookup over features of dims ``feature_dims_cpu`` (what a TBE's
    ``_generate_vbe_metadata`` returns for its own features; fbgemm must have loaded)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training_common import (
        generate_vbe_metadata as generate,
    )

    return generate(offsets, batch_sizes, pooling_mode, feature_dims_cpu, device, None, vbe_output_offsets)
