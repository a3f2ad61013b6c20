"""The one place ``kt_regroup`` imports fbgemm-gpu: ABI check, one warning, availability flag.

fbgemm-gpu is ABI-locked to one torch release (1.6 <-> 2.11, 1.7 <-> 2.12, 1.8 <-> 2.13, 1.9 <-> 2.14);
a mismatched pair can fail at import or crash later, so a known mismatch counts as "not available".
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["fbgemm_available", "fbgemm_status", "permute_multi_embedding", "permute_multi_embedding_function"]

_TORCH_FOR_FBGEMM = {(1, 6): (2, 11), (1, 7): (2, 12), (1, 8): (2, 13), (1, 9): (2, 14)}


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


@functools.lru_cache(maxsize=1)
def fbgemm_status() -> tuple[bool, str]:
    """``(available, reason)``; warns once (at the first call) when fbgemm is installed but unusable."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            fbgemm_version = version("fbgemm-gpu")
        except PackageNotFoundError:
            fbgemm_version = version("fbgemm-gpu-cpu")
    except Exception:  # not installed at all (or metadata unreadable): say so quietly
        return False, "fbgemm-gpu is not installed"
    try:
        expected = _TORCH_FOR_FBGEMM.get(_major_minor(fbgemm_version))
        have = _major_minor(torch.__version__)
        if expected is not None and expected != have:
            raise ImportError(
                f"fbgemm-gpu {fbgemm_version} is built for torch {expected[0]}.{expected[1]}, "
                f"not torch {torch.__version__}"
            )
        import fbgemm_gpu  # noqa: F401

        torch.ops.fbgemm.permute_multi_embedding_function  # noqa: B018 - resolves the op or raises
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        reason = f"fbgemm-gpu is installed but unusable ({exc}); kt_regroup uses its own kernels"
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
        return False, reason
    return True, f"fbgemm-gpu {fbgemm_version}"


def fbgemm_available() -> bool:
    """Whether fbgemm's ``permute_multi_embedding`` ops can be called here."""
    return fbgemm_status()[0]


def permute_multi_embedding_function(
    values: list[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: list[int],
    reverse: bool,
) -> list[torch.Tensor]:
    """fbgemm's autograd-free permute kernel (forward, or backward with ``reverse=True``)."""
    result: list[torch.Tensor] = torch.ops.fbgemm.permute_multi_embedding_function(
        values, permutes, in_shapes, out_shapes, out_lengths, reverse
    )
    return result


def permute_multi_embedding(
    values: list[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: list[int],
) -> list[torch.Tensor]:
    """fbgemm's public op with its own autograd (used by the benchmark as the baseline)."""
    result: list[torch.Tensor] = torch.ops.fbgemm.permute_multi_embedding(
        values, permutes, in_shapes, out_shapes, out_lengths
    )
    return result
