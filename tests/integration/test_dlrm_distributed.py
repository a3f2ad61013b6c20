"""The DLRM example on gloo processes: the loss falls and held-out AUC rises, the pipeline changes nothing,
resume continues exactly, and a DCP checkpoint reshards to another world size.

One 2-process world trains a tiny DLRM (fbgemm TBE or TorchEmbeddingKernel tables plus RocksDB key-value
tables, sharded table-wise, VBE batches of different sizes per rank and step) four times over the same batches:
through the ``StagedTrainPipeline`` (data_copy → start_sparse_data_dist → prefetch), with a plain loop, and
as 2 x half the steps through a checkpoint and ``resume``. Dense weights, in-memory tables with their optimizer
state, every key-value row and every evaluation must be equal after the same steps. Another run saves on 2
ranks and resumes on 3, then on 1: every table (rows, optimizer state, key-value rows) is the one saved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.dlrm.harness import run_world, train_configs
from examples.dlrm.train import TrainConfig, TrainResult

STEPS = 24
pytestmark = [pytest.mark.distributed]


def _config(out: Path, **changes: Any) -> TrainConfig:
    base = TrainConfig(
        out=out,
        steps=STEPS,
        batch_size=48,
        min_batch_size=8,
        embedding_dim=8,
        bottom_layers=(16,),
        top_layers=(16,),
        max_rows=400,
        kv_rows_threshold=1_000_000,  # Criteo's 5 biggest tables → key-value tables
        kv_max_rows=50_000,
        cache_rows=48,  # smaller than the unique ids of a batch: evictions and scratch rows happen
        kv_store="rocksdb",
        dense_lr=0.05,
        sparse_lr=0.1,
        log_every=10_000,
        seed=3,
        eval_every=STEPS // 2,
        eval_batches=8,
        progress=False,
        # Batches made in this process: a DataLoader worker costs ~16 s of start-up per run on 2 shared cores.
        # The "pipelined" run keeps one worker, so the worker path is compared with the in-process one.
        data_workers=0,
    )
    return dataclasses.replace(base, **changes)


def _write_criteo_tsv(path: Path, lines: int) -> Path:
    """``lines`` random Criteo lines (label, 13 counts, 26 hex hashes; some fields missing)."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(lines):
        label = str(int(torch.randint(0, 2, (1,), generator=gen)))
        dense = [str(int(v)) if v >= 0 else "" for v in torch.randint(-2, 50, (13,), generator=gen).tolist()]
        sparse = [
            f"{v:08x}" if v % 10 else "" for v in torch.randint(0, 2**31, (26,), generator=gen).tolist()
        ]
        rows.append("\t".join([label, *dense, *sparse]))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from None


def _assert_same_evals(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Same evaluation steps and samples; AUC and NE within float rounding (the weights compared elsewhere are
    equal within ``assert_close``'s tolerance, not bit for bit)."""
    assert [(e["step"], e["samples"]) for e in a] == [(e["step"], e["samples"]) for e in b]
    for x, y in zip(a, b, strict=True):
        assert x["auc"] == pytest.approx(y["auc"], rel=1e-5), (x, y)
        assert x["ne"] == pytest.approx(y["ne"], rel=1e-5), (x, y)


def _assert_same_state(a: TrainResult, b: TrainResult) -> None:
    assert a.dense_state.keys() == b.dense_state.keys()
    for key in a.dense_state:
        _assert_close(key, a.dense_state[key], b.dense_state[key])
    assert a.embedding_state.keys() == b.embedding_state.keys()
    for key in a.embedding_state:
        _assert_close(key, a.embedding_state[key], b.embedding_state[key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[TrainResult]]:
    """Per mode, the two ranks' results (one 2-process world runs every mode)."""
    root = tmp_path_factory.mktemp("dlrm")
    tsv = _write_criteo_tsv(root / "day_0.tsv", lines=5 * 8)
    configs = [
        _config(root / "pipelined", data_workers=1),
        _config(root / "plain", pipeline=False),
        _config(root / "resumed", steps=STEPS // 2),
        _config(root / "resumed", resume=True),
        _config(root / "tsv_pipelined", data=(tsv,), batch_size=8),
        _config(root / "tsv_plain", data=(tsv,), batch_size=8, pipeline=False),
    ]
    per_rank = run_world(train_configs, 2, (configs,), timeout_s=480)
    modes = ["pipelined", "plain", "first_half", "resumed", "tsv_pipelined", "tsv_plain"]
    return {mode: [per_rank[rank][i] for rank in range(2)] for i, mode in enumerate(modes)}


def test_loss_falls(runs: dict[str, list[TrainResult]]) -> None:
    """The mean loss of the last quarter of the steps is clearly below that of the first quarter, on each rank."""
    for result in runs["pipelined"]:
        quarter = STEPS // 4
        first = sum(result.losses[:quarter]) / quarter
        last = sum(result.losses[-quarter:]) / quarter
        assert last < first - 0.02, (result.rank, first, last, result.losses)


def test_held_out_auc_rises_above_chance(runs: dict[str, list[TrainResult]]) -> None:
    """After 24 steps the held-out AUC (all ranks, ~450 samples of a separate seed stream) is above 0.6, which a
    random model reaches with probability < 1e-4 at this size (sd ≈ 0.027); NE is below 1 (beats the base rate)."""
    evals = runs["pipelined"][0].evals
    assert [e["step"] for e in evals] == [STEPS // 2, STEPS]
    final = evals[-1]
    assert final["samples"] > 300
    assert final["auc"] > 0.6, evals
    assert final["ne"] < 1.0, evals
    _assert_same_evals(runs["pipelined"][1].evals, evals)  # the metrics are reduced over the ranks


def test_metrics_file_and_summary_hold_the_evaluation(runs: dict[str, list[TrainResult]]) -> None:
    """metrics.jsonl has a train record per step and the eval records; summary.json the last AUC/NE."""
    out = runs["pipelined"][0].summary["config"]["out"]
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert {"loss", "qps", "phase_ms", "kv_hit_rate", "samples"} <= set(train[0])
    assert [r["auc"] for r in records if r["kind"] == "eval"] == [
        e["auc"] for e in runs["pipelined"][0].evals
    ]
    summary = runs["pipelined"][0].summary
    assert summary["eval_auc"] == runs["pipelined"][0].evals[-1]["auc"]
    assert "held-out AUC / NE" in (Path(out) / "summary.md").read_text()


def test_ranks_train_different_batch_sizes(runs: dict[str, list[TrainResult]]) -> None:
    """Batches vary per rank and step (VBE after the input dist), and both ranks ran every step."""
    rank0, rank1 = runs["pipelined"]
    assert rank0.steps == rank1.steps == STEPS
    assert rank0.samples != rank1.samples
    assert len(set(rank0.samples)) > 1


def test_pipelined_run_equals_plain_loop(runs: dict[str, list[TrainResult]]) -> None:
    """StagedTrainPipeline (sparse dist and key-value prefetch ahead of the forward) gives the plain loop's weights."""
    for pipelined, plain in zip(runs["pipelined"], runs["plain"], strict=True):
        torch.testing.assert_close(torch.tensor(pipelined.losses), torch.tensor(plain.losses))
        _assert_same_state(pipelined, plain)
        _assert_same_evals(pipelined.evals, plain.evals)


def test_key_value_tables_were_trained(runs: dict[str, list[TrainResult]]) -> None:
    """Every rank holds key-value rows whose Adagrad state moved (the comparison above is not vacuous)."""
    for result in runs["pipelined"]:
        states = [v for k, v in result.embedding_state.items() if k.endswith(".kv_state")]
        assert states, sorted(result.embedding_state)
        assert all(bool((s > 0).any()) for s in states)
        assert any(k.endswith(".optimizer_state.0") for k in result.embedding_state)


def test_resume_continues_exactly(runs: dict[str, list[TrainResult]]) -> None:
    """Half the steps, a checkpoint (TBE weights, optimizer, key-value flush), then `resume`: same as one run."""
    for first_half, resumed, straight in zip(
        runs["first_half"], runs["resumed"], runs["pipelined"], strict=True
    ):
        assert first_half.steps == STEPS // 2
        assert resumed.steps == STEPS
        torch.testing.assert_close(
            torch.tensor(first_half.losses + resumed.losses), torch.tensor(straight.losses)
        )
        _assert_same_state(resumed, straight)
        _assert_same_evals(resumed.evals, straight.evals)


def test_criteo_tsv_training_stops_all_ranks_together(runs: dict[str, list[TrainResult]]) -> None:
    """5 TSV batches dealt round-robin (3 to rank 0, 2 to rank 1): both ranks train 2 steps, pipelined or not,
    with the same result."""
    for mode in ("tsv_pipelined", "tsv_plain"):
        assert [r.steps for r in runs[mode]] == [2, 2], mode
        assert all(s == 8 for r in runs[mode] for s in r.samples)
    for pipelined, plain in zip(runs["tsv_pipelined"], runs["tsv_plain"], strict=True):
        _assert_same_state(pipelined, plain)


def test_criteo_tsv_run_evaluates_on_the_held_out_tail(runs: dict[str, list[TrainResult]]) -> None:
    """Without `--eval-data` the last 10% of the lines (4 of 40) are held out: one eval over all of them, the
    rank without held-out lines joining with empty batches."""
    for mode in ("tsv_pipelined", "tsv_plain"):
        evals = runs[mode][0].evals
        assert [(e["step"], e["samples"]) for e in evals] == [(2, 4.0)], evals
        _assert_same_evals(runs[mode][1].evals, evals)
