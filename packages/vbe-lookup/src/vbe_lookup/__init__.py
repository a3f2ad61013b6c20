"""Variable-batch (VBE) pooled embedding lookup over several kernels into one pre-allocated output.

- :class:`VBEFeatures`: immutable variable-batch sparse features (feature → rank → sample).
- :class:`TorchEmbeddingKernel`: pure-PyTorch table-batched kernel with fbgemm TBE's forward signature
  and a fused optimizer (the reference, and the fallback without fbgemm).
- :class:`KernelGroup`, :class:`GroupedVBELookup`, :class:`VBEOutput`: one lookup over several kernels
  (fbgemm TBEs, key-value tables, ...) writing one 1-D output, rank → kernel → feature → sample → dim.
- :mod:`vbe_lookup.interfaces`: the Protocols consumed (``KeyedJaggedTensorLike``, ``EmbeddingKernel``,
  ``PrefetchableKernel``); :mod:`vbe_lookup.errors`: the exceptions.
- :mod:`vbe_lookup.sharding` (re-exported here): :class:`ShardedEmbeddingBags` and
  :class:`ShardedSequenceEmbeddings`, table-wise and row-wise sharding over ``torch.distributed``.
"""

from __future__ import annotations

from vbe_lookup._features import VBEFeatures
from vbe_lookup._grouped import GroupedVBELookup, KernelGroup, VBEOutput
from vbe_lookup._torch_kernel import TorchEmbeddingKernel
from vbe_lookup._version import __version__
from vbe_lookup.errors import VBELookupError
from vbe_lookup.interfaces import EmbeddingKernel, KeyedJaggedTensorLike, PrefetchableKernel
from vbe_lookup.sharding import (
    CollectiveOrderError,
    CollectiveTimeoutError,
    DistributedFeatures,
    InputDistHandle,
    KernelFactory,
    KernelSpec,
    PeerRankError,
    PooledEmbeddings,
    RowWise,
    SequenceEmbeddings,
    ShardedEmbeddingBags,
    ShardedSequenceEmbeddings,
    ShardingPlan,
    ShardingPlanError,
    TableConfig,
    TableWise,
    UnknownFeatureError,
    torch_kernel_factory,
)

__all__ = [
    "CollectiveOrderError",
    "CollectiveTimeoutError",
    "DistributedFeatures",
    "EmbeddingKernel",
    "GroupedVBELookup",
    "InputDistHandle",
    "KernelFactory",
    "KernelGroup",
    "KernelSpec",
    "KeyedJaggedTensorLike",
    "PeerRankError",
    "PooledEmbeddings",
    "PrefetchableKernel",
    "RowWise",
    "SequenceEmbeddings",
    "ShardedEmbeddingBags",
    "ShardedSequenceEmbeddings",
    "ShardingPlan",
    "ShardingPlanError",
    "TableConfig",
    "TableWise",
    "TorchEmbeddingKernel",
    "UnknownFeatureError",
    "VBEFeatures",
    "VBELookupError",
    "VBEOutput",
    "__version__",
    "torch_kernel_factory",
]
