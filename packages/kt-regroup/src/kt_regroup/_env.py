"""Every environment variable ``kt_regroup`` reads, in one place (listed in the README).

Nothing else in the package touches ``os.environ``: a module asks its :class:`EnvVar` here, at the moment it
needs the value (a test checks both, and that the README names every variable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "BACKEND",
    "DISABLE_FBGEMM",
    "ENV_VARS",
    "HOST_POOL_MB",
    "TRITON_BLOCK_B",
    "TRITON_FAST_LAUNCH",
    "TRITON_NUM_WARPS",
    "EnvVar",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvVar:
    """One environment variable: its name, the value used when it is unset, and what it does."""

    name: str
    default: str
    meaning: str

    def get(self) -> str:
        """The current value (read now, not cached), stripped; ``default`` when unset or empty."""
        return os.environ.get(self.name, "").strip() or self.default


BACKEND = EnvVar(
    name="KT_REGROUP_BACKEND",
    default="",
    meaning="Forces one backend (`auto`, `torch`, `triton`, `fbgemm`) for every call, overriding `backend=`; "
    "read at each call (part of the plan cache key). A forced backend that cannot run here warns once and uses torch.",
)
DISABLE_FBGEMM = EnvVar(
    name="KT_REGROUP_DISABLE_FBGEMM",
    default="",
    meaning="`1`: never import fbgemm-gpu (the `fbgemm` backend is unavailable); read once, at the first backend choice.",
)
HOST_POOL_MB = EnvVar(
    name="KT_REGROUP_HOST_POOL_MB",
    default="4096",
    meaning="MiB of recycled CPU output buffers the host pool may retain; `0` turns the pool off. Read at every "
    "pooled allocation.",
)
TRITON_BLOCK_B = EnvVar(
    name="KT_REGROUP_TRITON_BLOCK_B",
    default="32",
    meaning="Rows per Triton program (tuning sweeps only); read when the Triton kernels are first imported.",
)
TRITON_FAST_LAUNCH = EnvVar(
    name="KT_REGROUP_TRITON_FAST_LAUNCH",
    default="1",
    meaning="`1` (default): launch compiled Triton kernels directly with a prebuilt argument list (about half the "
    "host time per call on an H200); `0`: always through Triton's JIT launcher. Read when the Triton kernels are "
    "first imported.",
)
TRITON_NUM_WARPS = EnvVar(
    name="KT_REGROUP_TRITON_NUM_WARPS",
    default="4",
    meaning="Warps per Triton program (tuning sweeps only); read when the Triton kernels are first imported.",
)

ENV_VARS = (BACKEND, DISABLE_FBGEMM, HOST_POOL_MB, TRITON_BLOCK_B, TRITON_FAST_LAUNCH, TRITON_NUM_WARPS)
