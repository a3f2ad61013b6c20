"""The example's data: Criteo TSV reader on a file the test writes, and the synthetic Criteo-schema generator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import pytest
import torch

from examples.dlrm.data import (
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_FEATURES,
    CriteoTSVReader,
    DLRMBatch,
    SyntheticConfig,
    SyntheticCriteo,
)

ROWS = tuple(range(100, 100 + NUM_SPARSE))


def _line(label: int, dense: list[str], sparse: list[str]) -> str:
    assert len(dense) == NUM_DENSE
    assert len(sparse) == NUM_SPARSE
    return "\t".join([str(label), *dense, *sparse])


def _bags(batch: DLRMBatch) -> list[list[int]]:
    """Ids per (feature, sample), feature-major."""
    lengths = batch.sparse_features.lengths().tolist()
    values = batch.sparse_features.values().tolist()
    out, at = [], 0
    for n in lengths:
        out.append(values[at : at + n])
        at += n
    return out


@pytest.fixture
def tsv(tmp_path: Path) -> Path:
    """Five Criteo lines: missing integers and categoricals, a negative count, a trailing newline."""
    hexes = [f"{0xA0 + i:08x}" for i in range(NUM_SPARSE)]
    lines = [
        _line(1, [str(i) for i in range(NUM_DENSE)], hexes),
        _line(0, ["", "-3", *["7"] * (NUM_DENSE - 2)], ["", *hexes[1:]]),
        _line(0, ["1"] * NUM_DENSE, [""] * NUM_SPARSE),
        _line(1, ["2"] * NUM_DENSE, hexes[::-1]),
        _line(0, ["0"] * NUM_DENSE, hexes),
    ]
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_tsv_reader_parses_labels_dense_and_sparse(tsv: Path) -> None:
    """Labels, log1p of clamped counts (missing → 0), hex ids modulo the table rows, missing → empty bag."""
    batches = list(CriteoTSVReader([tsv], batch_size=2, table_rows=ROWS))
    assert [b.batch_size for b in batches] == [2, 2, 1]
    first = batches[0]
    torch.testing.assert_close(first.labels, torch.tensor([1.0, 0.0]))
    expected_dense = torch.tensor(
        [[math.log1p(i) for i in range(NUM_DENSE)], [0.0, 0.0, *[math.log1p(7)] * (NUM_DENSE - 2)]]
    )
    torch.testing.assert_close(first.dense_features, expected_dense)
    assert first.dense_features.dtype == torch.float32
    bags = _bags(first)
    assert len(bags) == NUM_SPARSE * 2
    for f in range(NUM_SPARSE):
        sample0, sample1 = bags[2 * f], bags[2 * f + 1]
        assert sample0 == [(0xA0 + f) % ROWS[f]]
        assert sample1 == ([] if f == 0 else [(0xA0 + f) % ROWS[f]])
    assert first.sparse_features.keys() == list(SPARSE_FEATURES)
    assert first.sparse_features.stride_per_key_per_rank() == [[2]] * NUM_SPARSE
    assert _bags(batches[1])[0::2] == [[]] * NUM_SPARSE  # line 3: every categorical missing


def test_tsv_reader_deals_batches_round_robin_over_ranks(tsv: Path) -> None:
    """Rank r of w reads batches r, r + w, ...; together the ranks read every line once."""
    rank0 = list(CriteoTSVReader([tsv], batch_size=2, table_rows=ROWS, rank=0, world_size=2))
    rank1 = list(CriteoTSVReader([tsv], batch_size=2, table_rows=ROWS, rank=1, world_size=2))
    assert [b.batch_size for b in rank0] == [2, 1]
    assert [b.batch_size for b in rank1] == [2]
    labels = torch.cat([rank0[0].labels, rank1[0].labels, rank0[1].labels])
    torch.testing.assert_close(labels, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]))


def test_tsv_reader_names_the_bad_line(tmp_path: Path) -> None:
    """A line with the wrong number of fields raises ValueError naming its line number."""
    path = tmp_path / "bad.tsv"
    path.write_text(_line(1, ["1"] * NUM_DENSE, ["a"] * NUM_SPARSE) + "\n1\t2\t3\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 has 3 tab-separated fields"):
        list(CriteoTSVReader([path], batch_size=4, table_rows=ROWS))


def test_tsv_reader_rejects_a_missing_file(tmp_path: Path) -> None:
    """A path that is not a file fails at construction with FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match=r"nope\.tsv"):
        CriteoTSVReader([tmp_path / "nope.tsv"], batch_size=4, table_rows=ROWS)


def test_synthetic_batches_have_criteo_schema_and_are_deterministic() -> None:
    """13 dense, 26 sparse features, ids inside each table, the same batches for the same seed and rank."""
    config = SyntheticConfig(batch_size=64, min_batch_size=16, num_batches=6, max_rows=5000, multi_hot=3)
    data = SyntheticCriteo(config, rank=1, world_size=2)
    batches = list(data)
    again = list(SyntheticCriteo(config, rank=1, world_size=2))
    other_rank = list(SyntheticCriteo(config, rank=0, world_size=2))
    assert len(batches) == 6
    sizes = {b.batch_size for b in batches}
    assert len(sizes) > 1, "batch size varies per step"
    assert all(16 <= s <= 64 for s in sizes)
    for batch, twin, other in zip(batches, again, other_rank, strict=True):
        b = batch.batch_size
        assert batch.dense_features.shape == (b, NUM_DENSE)
        assert batch.labels.shape == (b,)
        assert set(torch.unique(batch.labels).tolist()) <= {0.0, 1.0}
        features = batch.sparse_features
        assert features.stride_per_key_per_rank() == [[b]] * NUM_SPARSE
        assert int(features.lengths().max()) <= 3
        torch.testing.assert_close(batch.dense_features, twin.dense_features)
        assert torch.equal(features.values(), twin.sparse_features.values())
        assert not torch.equal(batch.dense_features[:1], other.dense_features[:1])
        per_feature = features.lengths().view(NUM_SPARSE, b).sum(1).tolist()
        values = torch.split(features.values(), per_feature)
        for f, ids in enumerate(values):
            if ids.numel():
                assert int(ids.min()) >= 0
                assert int(ids.max()) < config.table_rows[f]


def test_synthetic_ids_are_zipf_skewed() -> None:
    """The hottest id of a large table takes a large share of its lookups (Zipf ~1.05), far above uniform."""
    config = SyntheticConfig(batch_size=512, num_batches=4, max_rows=1_000_000, missing_rate=0.0)
    data = SyntheticCriteo(config)
    ids = torch.cat([b.sparse_features.values().view(NUM_SPARSE, -1)[2] for b in data])  # cat_2: 1M rows
    counts = torch.bincount(ids - ids.min())
    share = float(counts.max()) / ids.numel()
    assert share > 0.02, share  # uniform over 1M rows would give ~1e-6
    assert torch.unique(ids).numel() > 100


def test_batch_to_returns_a_batch_on_the_device() -> None:
    """`to` moves every tensor and keeps the layout; `record_stream` is a no-op on CPU tensors."""
    batch = SyntheticCriteo(SyntheticConfig(batch_size=8, num_batches=1)).batch(0)
    moved = batch.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, DLRMBatch)
    assert moved.sparse_features.stride_per_key_per_rank() == batch.sparse_features.stride_per_key_per_rank()
    torch.testing.assert_close(moved.dense_features, batch.dense_features)
    if torch.cuda.is_available():
        batch.to(torch.device("cuda")).record_stream(torch.cuda.current_stream())
    else:
        batch.record_stream(cast(torch.cuda.Stream, object()))  # CPU tensors: nothing is recorded


def _lines_file(path: Path, labels: list[int]) -> Path:
    path.write_text("".join(_line(y, ["1"] * 13, ["ab"] * 26) + "\n" for y in labels), encoding="utf-8")
    return path


def test_tsv_held_out_tail_is_not_trained_on(tmp_path: Path) -> None:
    """`--eval-fraction 0.25` of 20 lines: training reads lines 0-14, evaluation lines 15-19 (labels tell)."""
    from examples.dlrm.train import TrainConfig, _tsv_split

    data = _lines_file(tmp_path / "day.tsv", [0] * 15 + [1] * 5)
    config = TrainConfig(
        out=tmp_path / "run",
        data=(data,),
        batch_size=4,
        min_batch_size=None,
        eval_fraction=0.25,
        max_rows=100,
    )
    train_stop, reader = _tsv_split(config, 0, 1)
    assert train_stop == 15
    assert reader is not None
    held_out = torch.cat([b.labels for b in reader])
    assert held_out.tolist() == [1.0] * 5
    trained = CriteoTSVReader(
        [data], batch_size=4, table_rows=config.embedding_config(1).table_rows, lines=(0, train_stop)
    )
    assert torch.cat([b.labels for b in trained]).tolist() == [0.0] * 15


def test_tsv_eval_data_files_are_the_held_out_split(tmp_path: Path) -> None:
    """With `--eval-data` the training files are read whole and the eval reader reads the eval files."""
    from examples.dlrm.train import TrainConfig, _tsv_split

    data = _lines_file(tmp_path / "day0.tsv", [0] * 6)
    held = _lines_file(tmp_path / "day1.tsv", [1] * 3)
    config = TrainConfig(
        out=tmp_path / "run", data=(data,), eval_data=(held,), batch_size=2, min_batch_size=None, max_rows=100
    )
    train_stop, reader = _tsv_split(config, 0, 1)
    assert train_stop is None
    assert reader is not None
    assert torch.cat([b.labels for b in reader]).tolist() == [1.0] * 3
