"""Backend choice: ``"auto"`` picks the fastest correct path; ``KT_REGROUP_BACKEND`` forces one."""

from __future__ import annotations

import functools
import warnings

import torch

from kt_regroup import _env
from kt_regroup._fbgemm import fbgemm_available
from kt_regroup._plan import TRITON_MAX_TENSORS
from kt_regroup.errors import BackendUnavailableError, UnknownBackendError

__all__ = ["BACKENDS", "ENV_VAR", "available_backends", "resolve_backend"]

BACKENDS = ("auto", "fbgemm", "torch", "triton")
ENV_VAR = _env.BACKEND.name
_FBGEMM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton imports (it is only ever imported for CUDA tensors)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can run on ``device`` here, ``"torch"`` always among them."""
    device = torch.device(device)
    names = ["torch"]
    if fbgemm_available():
        names.append("fbgemm")
    if device.type == "cuda" and torch.cuda.is_available() and triton_available():
        names.append("triton")
    return sorted(names)


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise UnknownBackendError(f"{where} is {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def _serves(name: str, device: torch.device, key_dim: int, dtype: torch.dtype, n_in: int, n_out: int) -> bool:
    """Whether backend ``name`` has a kernel for this layout (else the torch backend serves it)."""
    if name == "fbgemm":
        return key_dim == 1 and dtype in _FBGEMM_DTYPES
    if name == "triton":
        return (
            device.type == "cuda"
            and key_dim == 1
            and dtype in _TRITON_DTYPES
            and n_in <= TRITON_MAX_TENSORS
            and n_out <= TRITON_MAX_TENSORS
        )
    return True


def _installed(name: str, device: torch.device) -> bool:
    if name == "fbgemm":
        return fbgemm_available()
    if name == "triton":
        return device.type == "cuda" and triton_available()
    return True


@functools.lru_cache(maxsize=16)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def resolve_backend(
    backend: str, device: torch.device, key_dim: int, dtype: torch.dtype, n_in: int, n_out: int
) -> str:
    """The backend that runs one regroup: ``"torch"``, ``"fbgemm"`` or ``"triton"``.

    ``KT_REGROUP_BACKEND`` (when set and not empty) overrides ``backend``, so a bad kernel can be switched
    off without a code change; a forced backend that cannot run here warns once and falls back to torch.
    An explicitly requested backend that is not installed raises; one that has no kernel for this layout
    (``key_dim == 0``, fp64 on fbgemm, more than 8 inputs or groups on Triton) is served by torch.

    Raises:
        UnknownBackendError: ``backend`` or the environment variable names no backend.
        BackendUnavailableError: ``backend`` names a backend that cannot run on ``device`` here.
    """
    _check_name(backend, "`backend`")
    forced = _env.BACKEND.get()
    if forced:
        _check_name(forced, f"environment variable `{ENV_VAR}`")
        if forced != "auto":
            if not _installed(forced, device):
                _warn_once(f"{ENV_VAR}={forced} cannot run on {device.type} here; using the torch backend")
                return "torch"
            return forced if _serves(forced, device, key_dim, dtype, n_in, n_out) else "torch"
        backend = "auto"
    if backend == "auto":
        if device.type == "cuda":
            for name in ("triton", "fbgemm"):
                if _installed(name, device) and _serves(name, device, key_dim, dtype, n_in, n_out):
                    return name
        # On CPU the block gather beats fbgemm's per-row memcpy loop (see docs/bench/kt-regroup-cpu.json).
        return "torch"
    if not _installed(backend, device):
        why = (
            "fbgemm-gpu is not importable with this torch"
            if backend == "fbgemm"
            else "Triton kernels need CUDA tensors and an importable triton"
        )
        raise BackendUnavailableError(f"`backend` is {backend!r} but {why} (values on {device})")
    return backend if _serves(backend, device, key_dim, dtype, n_in, n_out) else "torch"
