"""The DLRM's embedding tables: one table per Criteo feature, sharded table-wise over the ranks.

Placement: the features named in ``kv_features`` (by default Criteo's huge tables, at least 1M rows: ``cat_2``,
``cat_3``, ``cat_11``, ``cat_15``, ``cat_20`` of the Kaggle set) go to the kernel group ``"kv"``: ssd-tbe-adapter ``KeyValueEmbeddingBags`` on an
embedded RocksDB store under the run folder, with a cache of ``cache_rows`` rows in front and prefetch.
The other tables go to the group ``"tbe"``: one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` per rank when
fbgemm loads, else vbe-lookup's ``TorchEmbeddingKernel``. Tables are dealt to ranks largest first onto the
least loaded rank, key-value and in-memory tables balanced separately. Both kernel kinds fuse row-wise Adagrad
(or SGD) into the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.dlrm._fbgemm import new_fbgemm_tbe
from examples.dlrm.data import SPARSE_FEATURES
from vbe_lookup import TorchEmbeddingKernel
from vbe_lookup.sharding import KernelSpec, ShardedEmbeddingBags, ShardingPlan, TableConfig, TableWise

__all__ = ["EmbeddingConfig", "ShardedTables", "build_sharded_tables", "plan_tables"]

TBE_GROUP = "tbe"
KV_GROUP = "kv"


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """Tables and kernels of the DLRM's sparse part.

    Attributes:
        embedding_dim: width of every table (the dot interaction needs one width).
        table_rows: rows (id space) of the table of each of the 26 sparse features.
        kv_features: features whose tables live in key-value tables (the others in TBEs).
        cache_rows: cache rows of each rank's key-value kernel.
        host_cache_rows: rows of the host-DRAM tier under a key-value kernel's device cache (CUDA only: the
            device cache is the only one with a tier below it; 0 for none).
        kv_store: ``"rocksdb"`` (on disk under the run folder) or ``"memory"``.
        kv_cache_on_device: the key-value kernels' ``cache_on_device`` (``None``: on CUDA only; ``True`` runs
            the device-managed cache, and its host-DRAM tier, on the CPU too).
        tbe: ``"auto"`` (fbgemm on CUDA when it loads, TorchEmbeddingKernel on CPU), ``"fbgemm"`` or
            ``"torch"`` for the in-memory tables.
        optimizer: ``"rowwise_adagrad"`` or ``"sgd"``, fused into the backward of every kernel.
        learning_rate: the fused optimizer's step size.
        seed: initialisation seed of the in-memory tables (key-value rows initialise per id).
    """

    embedding_dim: int
    table_rows: tuple[int, ...]
    kv_features: tuple[str, ...] = ()
    cache_rows: int = 4096
    host_cache_rows: int = 0
    kv_store: str = "rocksdb"
    kv_cache_on_device: bool | None = None
    tbe: str = "auto"
    optimizer: str = "rowwise_adagrad"
    learning_rate: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.table_rows) != len(SPARSE_FEATURES):
            raise ValueError(
                f"`table_rows` has {len(self.table_rows)} entries, expected {len(SPARSE_FEATURES)}"
            )
        if self.kv_store not in ("rocksdb", "memory"):
            raise ValueError(f"`kv_store` is {self.kv_store!r}, expected 'rocksdb' or 'memory'")
        if self.tbe not in ("auto", "fbgemm", "torch"):
            raise ValueError(f"`tbe` is {self.tbe!r}, expected 'auto', 'fbgemm' or 'torch'")
        if self.optimizer not in ("rowwise_adagrad", "sgd"):
            raise ValueError(f"`optimizer` is {self.optimizer!r}, expected 'rowwise_adagrad' or 'sgd'")
        if self.host_cache_rows < 0:
            raise ValueError(f"`host_cache_rows` is {self.host_cache_rows}, expected >= 0")


def _table_name(feature: str) -> str:
    return f"t_{feature}"


def plan_tables(config: EmbeddingConfig, world_size: int) -> tuple[list[TableConfig], ShardingPlan]:
    """One table per feature and a table-wise plan: key-value and in-memory tables balanced separately."""
    tables = [
        TableConfig(
            name=_table_name(feature),
            num_embeddings=rows,
            embedding_dim=config.embedding_dim,
            feature_names=(feature,),
        )
        for feature, rows in zip(SPARSE_FEATURES, config.table_rows, strict=True)
    ]
    placements: dict[str, TableWise] = {}
    for group in (KV_GROUP, TBE_GROUP):
        members = [t for t in tables if (t.feature_names[0] in config.kv_features) == (group == KV_GROUP)]
        load = [0] * world_size
        for table in sorted(members, key=lambda t: (-t.num_embeddings, t.name)):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            # Key-value tables are balanced by count (their rows live on disk), in-memory ones by rows.
            load[rank] += 1 if group == KV_GROUP else table.num_embeddings
            placements[table.name] = TableWise(rank=rank, group=group)
    return tables, ShardingPlan(world_size=world_size, placements=placements)


class ShardedTables:
    """The sharded module of one rank and the kernels it built (for checkpoints, metrics and the summary)."""

    def __init__(
        self,
        config: EmbeddingConfig,
        tables: list[TableConfig],
        plan: ShardingPlan,
        *,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None,
        device: torch.device,
        workdir: Path,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.tables = tables
        self.plan = plan
        self.device = device
        self.workdir = workdir
        self.kernels: dict[str, Any] = {}
        self.kernel_kinds: dict[str, str] = {}
        self.specs: dict[str, KernelSpec] = {}
        self.module = ShardedEmbeddingBags(
            tables, plan, process_group, kernel_factory=self._new_kernel, device=device
        )

    def _new_kernel(self, spec: KernelSpec) -> Any:
        cfg = self.config
        if spec.group == KV_GROUP:
            from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, RocksDBStore, TableSpec

            # The host-DRAM tier sits under the device-managed cache (CUDA's default; the CPU's on request).
            on_device = (
                self.device.type == "cuda" if cfg.kv_cache_on_device is None else cfg.kv_cache_on_device
            )
            host_tier = cfg.host_cache_rows if on_device else 0
            if cfg.kv_store == "rocksdb":
                store: Any = RocksDBStore(self.workdir / f"rank{spec.rank}")
            else:
                store = MemoryStore()
            kernel: Any = KeyValueEmbeddingBags(
                [
                    TableSpec(name=name, dim=dim)
                    for name, dim in zip(spec.table_names, spec.embedding_dims, strict=True)
                ],
                list(spec.feature_table_map),
                store,
                cache_rows=cfg.cache_rows,
                host_cache_rows=host_tier,
                optimizer="rowwise_adagrad" if cfg.optimizer == "rowwise_adagrad" else "sgd",
                learning_rate=cfg.learning_rate,
                seed=cfg.seed,
                device=self.device,
                cache_on_device=on_device,
            )
            kind = f"key-value ({cfg.kv_store}, cache {cfg.cache_rows} rows"
            kind += f", host tier {host_tier} rows)" if host_tier else ")"
        else:
            kernel = None
            # "auto" takes fbgemm on CUDA only: fbgemm-gpu-cpu rebuilds its VBE metadata on the host at every
            # call (~150 ms per step in the main job), TorchEmbeddingKernel is ~2x faster there.
            if cfg.tbe == "fbgemm" or (cfg.tbe == "auto" and self.device.type == "cuda"):
                kernel = new_fbgemm_tbe(
                    spec.num_embeddings,
                    spec.embedding_dims,
                    spec.feature_table_map,
                    optimizer=cfg.optimizer,
                    learning_rate=cfg.learning_rate,
                    device=self.device,
                )
                if kernel is None and cfg.tbe == "fbgemm":
                    raise RuntimeError("`--tbe fbgemm` given but fbgemm TBEs cannot be built here")
                if kernel is not None:
                    # fbgemm's TBE has a `prefetch` for its UVM cache; these tables have none (HBM / host
                    # memory), and on CPU that method asks for a CUDA stream. The sharded module prefetches
                    # every kernel that has a callable `prefetch`, so shadow it on this instance.
                    kernel.prefetch = None
            kind = "fbgemm TBE"
            if kernel is None:
                kernel = TorchEmbeddingKernel(
                    list(spec.num_embeddings),
                    list(spec.embedding_dims),
                    feature_table_map=list(spec.feature_table_map),
                    optimizer="rowwise_adagrad" if cfg.optimizer == "rowwise_adagrad" else "sgd",
                    learning_rate=cfg.learning_rate,
                    device=self.device,
                )
                kind = "TorchEmbeddingKernel"
            self._init_weights(kernel, spec)
        self.kernels[spec.group] = kernel
        self.kernel_kinds[spec.group] = kind
        self.specs[spec.group] = spec
        return kernel

    def _init_weights(self, kernel: Any, spec: KernelSpec) -> None:
        """Seeded uniform(±1/sqrt(rows)) per table, independent of the kernel kind and of the global RNG."""
        with torch.no_grad():
            for weight, name, rows in zip(
                kernel.split_embedding_weights(), spec.table_names, spec.num_embeddings, strict=True
            ):
                gen = torch.Generator().manual_seed(self.config.seed * 1009 + _feature_index(name))
                bound = 1.0 / math.sqrt(rows)
                values = torch.empty(weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
                weight.copy_(values.to(weight.dtype))

    # ---------------------------------------------------------------- checkpoint and metrics

    def flush(self) -> None:
        """Write every dirty key-value row to its store."""
        kernel = self.kernels.get(KV_GROUP)
        if kernel is not None:
            kernel.flush()

    def local_state(self, *, include_kv: bool = False) -> dict[str, torch.Tensor]:
        """This rank's in-memory tables and their optimizer state (copies on the host).

        Key-value rows are not copied unless ``include_kv`` (tests): a checkpoint flushes them into the
        store, which a resume reopens. With ``include_kv``, ``{table}.kv_ids`` (sorted), ``.kv_weights``
        and ``.kv_state`` hold every stored row.
        """
        state: dict[str, torch.Tensor] = {}
        kv = self.kernels.get(KV_GROUP)
        if include_kv and kv is not None:
            chunks: dict[str, list[Any]] = {}
            for chunk in kv.checkpoint():
                chunks.setdefault(chunk.table, []).append(chunk)
            for name, parts in chunks.items():
                ids = torch.cat([c.ids for c in parts])
                order = torch.argsort(ids)
                state[f"{name}.kv_ids"] = ids[order]
                state[f"{name}.kv_weights"] = torch.cat([c.weights for c in parts])[order].float()
                if parts[0].optimizer_state is not None:
                    state[f"{name}.kv_state"] = torch.cat([c.optimizer_state for c in parts])[order]
        kernel = self.kernels.get(TBE_GROUP)
        if kernel is None:
            return state
        spec = self.specs[TBE_GROUP]
        for name, weight in zip(spec.table_names, kernel.split_embedding_weights(), strict=True):
            state[f"{name}.weight"] = weight.detach().to("cpu", copy=True)
        optimizer_states = kernel.split_optimizer_states()
        for name, states in zip(spec.table_names, optimizer_states, strict=True):
            for i, s in enumerate(states if isinstance(states, (list, tuple)) else [states]):
                state[f"{name}.optimizer_state.{i}"] = s.detach().to("cpu", copy=True)
        return state

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`local_state` returned (same world size and plan)."""
        kernel = self.kernels.get(TBE_GROUP)
        if kernel is None:
            return
        spec = self.specs[TBE_GROUP]
        with torch.no_grad():
            for name, weight in zip(spec.table_names, kernel.split_embedding_weights(), strict=True):
                weight.copy_(state[f"{name}.weight"])
            for name, states in zip(spec.table_names, kernel.split_optimizer_states(), strict=True):
                for i, s in enumerate(states if isinstance(states, (list, tuple)) else [states]):
                    s.copy_(state[f"{name}.optimizer_state.{i}"])

    def kv_metrics(self) -> dict[str, float]:
        """This rank's key-value metrics (``hits`` and ``lookups`` for the cache hit rate), empty without one."""
        kernel = self.kernels.get(KV_GROUP)
        if kernel is None:
            return {}
        metrics = kernel.metrics()
        return {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

    def close(self) -> None:
        """Flush the key-value kernel, stop its prefetch thread and close its store."""
        kernel = self.kernels.get(KV_GROUP)
        if kernel is not None:
            kernel.close()

    def describe(self) -> list[list[object]]:
        """One row per table: name, rows, rank, kernel kind (as seen from this rank's plan)."""
        rows: list[list[object]] = []
        for table in self.tables:
            placement = self.plan.placements[table.name]
            assert isinstance(placement, TableWise)
            kind = "key-value" if placement.group == KV_GROUP else self.kernel_kinds.get(TBE_GROUP, "TBE")
            rows.append([table.name, table.num_embeddings, placement.rank, kind])
        return rows


def _feature_index(table_name: str) -> int:
    return SPARSE_FEATURES.index(table_name.removeprefix("t_"))


def build_sharded_tables(
    config: EmbeddingConfig,
    *,
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
    device: torch.device,
    workdir: Path,
) -> ShardedTables:
    """Plan the tables and build this rank's sharded module (collective: every rank calls it)."""
    tables, plan = plan_tables(config, world_size)
    return ShardedTables(
        config,
        tables,
        plan,
        rank=rank,
        world_size=world_size,
        process_group=process_group,
        device=device,
        workdir=workdir,
    )
