"""Criteo-schema data for the DLRM example: a synthetic generator, a Criteo TSV reader and the batch type.

Criteo's click logs (Kaggle Display Advertising Challenge, Criteo 1TB) have one label, 13 integer ("dense")
features and 26 hashed categorical ("sparse") features per line. Both sources here yield :class:`DLRMBatch` objects
with ``dense_features`` ``[B, 13]`` float32 (``log1p`` of the clamped counts), ``sparse_features`` a
:class:`vbe_lookup.VBEFeatures` holding one bag of ids per sample and feature (empty for a missing value) and
``labels`` ``[B]`` float32.

The synthetic generator draws Zipf-distributed ids over Criteo-like cardinalities, gives every rank and step a
different batch size (so after the sparse all-to-all each rank holds a *variable batch per feature and source rank*,
the VBE layout) and labels from a hidden logistic model of the dense values and of per-id scores, so that a DLRM can
learn them and the loss falls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vbe_lookup import VBEFeatures

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "DENSE_FEATURES",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_FEATURES",
    "CriteoTSVReader",
    "DLRMBatch",
    "SyntheticConfig",
    "SyntheticCriteo",
    "empty_batch",
    "make_features",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_FEATURES: tuple[str, ...] = tuple(f"int_{i}" for i in range(NUM_DENSE))
SPARSE_FEATURES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(NUM_SPARSE))

# Distinct values per categorical column of the Criteo Kaggle (7-day) data set, as published with DLRM's
# preprocessing; the generator caps them with `max_rows` so that a CPU run keeps small tables.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# Odd 63-bit constants for the multiplicative hashes that scramble Zipf ranks into ids and score ids.
_HASH_A = 0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF
_HASH_B = 0x2545F4914F6CDD1D


def _record(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
    # record_stream has no CPU kernel: on CPU there are no streams and nothing to record.
    if tensor.is_cuda:
        tensor.record_stream(stream)


def make_features(
    values: torch.Tensor,
    lengths: torch.Tensor,
    batch_size: int,
    keys: Sequence[str] = SPARSE_FEATURES,
) -> VBEFeatures:
    """Local sparse features of one batch: every feature has ``batch_size`` bags.

    Args:
        values: ``[sum(lengths)]`` int64 ids, laid out feature → sample.
        lengths: ``[len(keys) * batch_size]`` int64 bag sizes, feature-major.
        batch_size: samples in the local batch (the stride of every key).
        keys: feature names.
    """
    return VBEFeatures(
        keys=list(keys),
        values=values,
        lengths=lengths,
        stride_per_key_per_rank=[[batch_size] for _ in keys],
    )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DLRMBatch:
    """One training batch; fits pipeline-stages' ``Pipelineable``.

    Attributes:
        dense_features: ``[B, 13]`` float32.
        sparse_features: 26 features with ``B`` bags each (``VBEFeatures``, feature → sample layout).
        labels: ``[B]`` float32 in {0, 1}.
    """

    dense_features: torch.Tensor
    sparse_features: VBEFeatures
    labels: torch.Tensor

    def __post_init__(self) -> None:
        batch = self.labels.shape[0]
        if self.dense_features.dim() != 2 or self.dense_features.shape[0] != batch:
            raise ValueError(
                f"`dense_features` has shape {tuple(self.dense_features.shape)}, expected [{batch}, D] "
                f"(batch size taken from `labels`)"
            )

    @property
    def batch_size(self) -> int:
        """Samples in this batch."""
        return int(self.labels.shape[0])

    def to(self, device: torch.device, non_blocking: bool = False) -> DLRMBatch:
        """This batch on ``device`` (a new object; the copies are issued on the current stream)."""
        return DLRMBatch(
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor of the batch as used on ``stream`` (no-op for CPU tensors)."""
        _record(self.dense_features, stream)
        _record(self.labels, stream)
        self.sparse_features.record_stream(stream)

    def pin_memory(self) -> DLRMBatch:
        """This batch in pinned host memory (for asynchronous host-to-device copies)."""
        sparse = self.sparse_features
        return DLRMBatch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=VBEFeatures(
                keys=sparse.keys(),
                values=sparse.values().pin_memory(),
                lengths=sparse.lengths().pin_memory(),
                stride_per_key_per_rank=sparse.stride_per_key_per_rank(),
            ),
            labels=self.labels.pin_memory(),
        )


def empty_batch() -> DLRMBatch:
    """A batch of 0 samples (a rank out of held-out data still joins the collective forwards with it)."""
    return DLRMBatch(
        dense_features=torch.zeros(0, NUM_DENSE),
        sparse_features=make_features(
            torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 0
        ),
        labels=torch.zeros(0),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticConfig:
    """Shape of the synthetic Criteo-like data.

    Attributes:
        batch_size: largest local batch per rank and step.
        min_batch_size: smallest local batch; each rank and step draws its size uniformly in
            ``[min_batch_size, batch_size]`` (variable batch per rank → VBE after the input dist).
        num_batches: batches per rank and epoch.
        max_rows: cap on every table's cardinality (Criteo's own are up to 10M rows).
        zipf_alpha: exponent of the id distribution (about 1.05 in click logs).
        missing_rate: probability that a categorical value is missing (empty bag).
        multi_hot: largest bag size; bags draw 1..multi_hot ids (Criteo itself is one-hot).
        seed: base seed; rank ``r`` of ``w`` draws its own stream from ``(seed, r)``.
        cardinalities: per-feature cardinalities before the cap.
    """

    batch_size: int = 256
    min_batch_size: int | None = None
    num_batches: int = 100
    max_rows: int = 100_000
    zipf_alpha: float = 1.05
    missing_rate: float = 0.05
    multi_hot: int = 1
    seed: int = 0
    cardinalities: tuple[int, ...] = field(default=CRITEO_KAGGLE_CARDINALITIES)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"`batch_size` is {self.batch_size}, expected >= 1")
        low = self.batch_size if self.min_batch_size is None else self.min_batch_size
        if not 0 <= low <= self.batch_size:
            raise ValueError(f"`min_batch_size` is {low}, expected 0..batch_size ({self.batch_size})")
        if len(self.cardinalities) != NUM_SPARSE:
            raise ValueError(f"`cardinalities` has {len(self.cardinalities)} entries, expected {NUM_SPARSE}")
        if self.zipf_alpha <= 0 or self.zipf_alpha == 1.0:
            raise ValueError(f"`zipf_alpha` is {self.zipf_alpha}, expected > 0 and != 1")
        if self.multi_hot < 1:
            raise ValueError(f"`multi_hot` is {self.multi_hot}, expected >= 1")

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows per table: Criteo's cardinalities capped at ``max_rows``."""
        return tuple(min(c, self.max_rows) for c in self.cardinalities)


def _zipf(rows: torch.Tensor, u: torch.Tensor, alpha: float) -> torch.Tensor:
    """Ranks in ``[0, rows)`` distributed like Zipf(alpha): inverse CDF of a power law on ``[1, rows + 1)``.

    Args:
        rows: ``[N]`` int64 cardinality per draw.
        u: ``[N]`` float64 uniform in [0, 1).
    """
    n = rows.to(torch.float64)
    power = 1.0 - alpha
    x = ((torch.pow(n + 1.0, power) - 1.0) * u + 1.0).pow(1.0 / power)
    return torch.minimum((x - 1.0).floor().to(torch.int64), rows - 1)


def _id_score(ids: torch.Tensor, feature: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed pseudo-random score in [-1, 1) per (feature, id): the hidden signal the model learns."""
    mixed = (ids * _HASH_B + feature * 1_000_003 + seed * 7919) & 0x7FFFFFFF
    mixed = (mixed * 48271) % 2147483647
    return mixed.to(torch.float64) / 1073741823.5 - 1.0


class SyntheticCriteo:
    """An iterable of :class:`DLRMBatch` with Criteo's schema for one rank (deterministic per seed and rank).

    Ids of feature ``f`` are Zipf ranks scrambled by a multiplicative hash modulo the table's rows, so that hot
    ids are spread over the table. Iterating twice yields the same batches. ``stream`` picks an independent
    sequence of batches with the same hidden label model: stream 0 trains, stream 1 is the held-out split.
    """

    def __init__(
        self, config: SyntheticConfig, *, rank: int = 0, world_size: int = 1, stream: int = 0
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` is {rank}, expected 0..{world_size - 1}")
        if not 0 <= stream < 2**15:
            raise ValueError(f"`stream` is {stream}, expected 0..32767")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.stream = stream
        self._rows = torch.tensor(config.table_rows, dtype=torch.int64)
        dense_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + 17)
        self._dense_weight = torch.randn(NUM_DENSE, generator=dense_gen, dtype=torch.float64) * 0.5

    def __len__(self) -> int:
        return self.config.num_batches

    def batch(self, index: int) -> DLRMBatch:
        """Batch ``index`` of this rank (random access: the generator is seeded per batch)."""
        cfg = self.config
        base = (cfg.seed * 65_537 + self.rank) * 1_000_003 + index
        if self.stream:
            # Another stream: a multiplicative mix whose low 32 bits differ (the CPU generator's Mersenne
            # twister seeds from those), so held-out batches are not training batches.
            base = (base * 0x9E3779B1 + self.stream * 0x85EBCA77 + 0x165667B1) % (2**61 - 1)
        gen = torch.Generator().manual_seed(base)
        low = cfg.batch_size if cfg.min_batch_size is None else cfg.min_batch_size
        batch = int(torch.randint(low, cfg.batch_size + 1, (1,), generator=gen))

        # Dense: heavy-tailed counts like Criteo's integer columns, then log1p.
        counts = torch.floor(
            torch.exp(torch.randn(batch, NUM_DENSE, generator=gen, dtype=torch.float64) * 1.5)
        )
        dense = torch.log1p(counts)

        # Sparse: bag sizes (0 = missing), then Zipf ids per bag.
        if cfg.multi_hot > 1:
            lengths = torch.randint(1, cfg.multi_hot + 1, (NUM_SPARSE, batch), generator=gen)
        else:
            lengths = torch.ones(NUM_SPARSE, batch, dtype=torch.int64)
        missing = torch.rand(NUM_SPARSE, batch, generator=gen) < cfg.missing_rate
        lengths = lengths.masked_fill(missing, 0).reshape(-1)
        feature_of_id = torch.repeat_interleave(torch.arange(NUM_SPARSE).repeat_interleave(batch), lengths)
        rows = self._rows[feature_of_id]
        u = torch.rand(feature_of_id.numel(), generator=gen, dtype=torch.float64)
        ranks = _zipf(rows, u, cfg.zipf_alpha)
        ids = (ranks * _HASH_A) % rows

        # Labels: Bernoulli(sigmoid(dense . w + mean id score of the sample)), fixed across ranks and steps.
        sample_of_id = torch.repeat_interleave(torch.arange(batch).repeat(NUM_SPARSE), lengths)
        score = torch.zeros(batch, dtype=torch.float64).index_add_(
            0, sample_of_id, _id_score(ids, feature_of_id, cfg.seed)
        )
        logit = (dense - 1.0) @ self._dense_weight + 3.0 * score / math.sqrt(NUM_SPARSE)
        labels = (torch.rand(batch, generator=gen, dtype=torch.float64) < torch.sigmoid(logit)).to(
            torch.float32
        )
        return DLRMBatch(
            dense_features=dense.to(torch.float32),
            sparse_features=make_features(ids, lengths, batch),
            labels=labels,
        )

    def __iter__(self) -> Iterator[DLRMBatch]:
        for index in range(self.config.num_batches):
            yield self.batch(index)


class CriteoTSVReader:
    """Reads Criteo's TSV format: ``label \\t 13 integers \\t 26 hex hashes``, empty fields for missing values.

    Lines are dealt round-robin over ranks in batches: rank ``r`` of ``w`` gets batches ``r, r + w, ...`` of
    ``batch_size`` lines (the last one may be short). ``lines=(start, stop)`` keeps only the non-empty lines
    ``start`` to ``stop - 1`` (0-based, over all files): the training part and the held-out tail of one file set. Integers become ``log1p(max(x, 0))`` (missing → 0);
    categorical hashes become ``int(hex, 16) % rows[f]`` (missing → empty bag).
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        batch_size: int,
        table_rows: Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        lines: tuple[int, int | None] = (0, None),
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"`batch_size` is {batch_size}, expected >= 1")
        if lines[0] < 0 or (lines[1] is not None and lines[1] < lines[0]):
            raise ValueError(f"`lines` is {lines}, expected (start >= 0, stop >= start or None)")
        if len(table_rows) != NUM_SPARSE:
            raise ValueError(f"`table_rows` has {len(table_rows)} entries, expected {NUM_SPARSE}")
        self.paths = [Path(p) for p in paths]
        for path in self.paths:
            if not path.is_file():
                raise FileNotFoundError(f"`paths` names {str(path)!r}, which is not a file")
        self.batch_size = batch_size
        self.table_rows = tuple(table_rows)
        self.rank = rank
        self.world_size = world_size
        self.lines = lines

    def _lines(self) -> Iterator[tuple[int, str]]:
        number = 0
        kept = 0
        start, stop = self.lines
        for path in self.paths:
            with path.open("r", encoding="utf-8") as handle:
                for line in handle:
                    number += 1
                    stripped = line.rstrip("\r\n")
                    if not stripped:
                        continue
                    kept += 1
                    if stop is not None and kept > stop:
                        return
                    if kept > start:
                        yield number, stripped

    def _parse(self, rows: list[tuple[int, str]]) -> DLRMBatch:
        batch = len(rows)
        labels = torch.empty(batch, dtype=torch.float32)
        dense = torch.zeros(batch, NUM_DENSE, dtype=torch.float64)
        bags: list[list[int]] = [[] for _ in range(NUM_SPARSE * batch)]
        for sample, (number, line) in enumerate(rows):
            fields = line.split("\t")
            if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
                raise ValueError(
                    f"line {number} has {len(fields)} tab-separated fields, expected {1 + NUM_DENSE + NUM_SPARSE}"
                )
            labels[sample] = float(int(fields[0]))
            for i, text in enumerate(fields[1 : 1 + NUM_DENSE]):
                if text:
                    dense[sample, i] = math.log1p(max(int(text), 0))
            for f, text in enumerate(fields[1 + NUM_DENSE :]):
                if text:
                    bags[f * batch + sample].append(int(text, 16) % self.table_rows[f])
        lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64)
        values = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
        return DLRMBatch(
            dense_features=dense.to(torch.float32),
            sparse_features=make_features(values, lengths, batch),
            labels=labels,
        )

    def count_lines(self) -> int:
        """Non-empty lines of all files (ignoring ``lines``): a pass over the data, no parsing."""
        total = 0
        for path in self.paths:
            with path.open("rb") as handle:
                total += sum(1 for line in handle if line.strip(b"\r\n"))
        return total

    def __iter__(self) -> Iterator[DLRMBatch]:
        pending: list[tuple[int, str]] = []
        index = 0
        for item in self._lines():
            pending.append(item)
            if len(pending) == self.batch_size:
                if index % self.world_size == self.rank:
                    yield self._parse(pending)
                pending = []
                index += 1
        if pending and index % self.world_size == self.rank:
            yield self._parse(pending)
