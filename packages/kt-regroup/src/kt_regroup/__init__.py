"""Regroup pooled embeddings (KeyedTensors) into feature groups: fbgemm, Triton and pure-PyTorch paths with one plan.

>>> import torch
>>> from kt_regroup import KeyedTensor, regroup
>>> kt = KeyedTensor(["a", "b"], [2, 3], torch.arange(10.0).view(2, 5))
>>> [t.shape for t in regroup([kt], [["b", "a"], ["a"]])]
[torch.Size([2, 5]), torch.Size([2, 2])]
"""

from __future__ import annotations

from kt_regroup._backend import available_backends
from kt_regroup._host_pool import release_host_buffers
from kt_regroup._keyed_tensor import KeyedTensor
from kt_regroup._regroup import KTRegroupAsDict, regroup, regroup_as_dict
from kt_regroup._version import __version__
from kt_regroup.errors import (
    AmbiguousKeyError,
    ArgumentTypeError,
    BackendUnavailableError,
    InvalidGroupsError,
    KTRegroupError,
    LayoutMismatchError,
    LengthMismatchError,
    UnknownBackendError,
    UnknownKeyError,
)
from kt_regroup.interfaces import KeyedTensorLike

__all__ = [
    "AmbiguousKeyError",
    "ArgumentTypeError",
    "BackendUnavailableError",
    "InvalidGroupsError",
    "KTRegroupAsDict",
    "KTRegroupError",
    "KeyedTensor",
    "KeyedTensorLike",
    "LayoutMismatchError",
    "LengthMismatchError",
    "UnknownBackendError",
    "UnknownKeyError",
    "__version__",
    "available_backends",
    "regroup",
    "regroup_as_dict",
    "release_host_buffers",
]
