"""Held-out metrics: AUC and normalized entropy (torchmetrics states, reduced over the ranks)."""

from __future__ import annotations

import math

import torch

from examples.dlrm.data import SyntheticConfig, SyntheticCriteo, empty_batch
from examples.dlrm.evaluation import EvalMetrics, NormalizedEntropy


def test_normalized_entropy_is_log_loss_over_label_entropy() -> None:
    """NE = mean BCE / H(label rate); predicting the base rate scores exactly 1."""
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    base = math.log(0.25 / 0.75)
    ne = NormalizedEntropy()
    ne.update(torch.full((4,), base), labels)
    values = ne.compute()
    assert math.isclose(float(values["ne"]), 1.0, rel_tol=1e-9)
    logits = torch.tensor([2.0, -1.0, -3.0, 0.5])
    ne.reset()
    ne.update(logits, labels)
    bce = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert math.isclose(float(ne.compute()["ne"]), bce / entropy, rel_tol=1e-6)


def test_eval_metrics_rank_perfect_and_reversed_predictions() -> None:
    """AUC is 1 for logits that order the labels, 0 for the reverse; batches accumulate until reset."""
    metrics = EvalMetrics(torch.device("cpu"))
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    metrics.update(torch.tensor([-2.0, -1.0]), labels[:2])
    metrics.update(torch.tensor([1.0, 2.0]), labels[2:])
    values = metrics.compute()
    assert values["auc"] == 1.0
    assert values["samples"] == 4.0
    assert values["ctr"] == 0.5
    metrics.reset()
    metrics.update(torch.tensor([2.0, 1.0, -1.0, -2.0]), labels)
    assert metrics.compute()["auc"] == 0.0


def test_eval_metrics_without_samples_are_nan() -> None:
    """No sample (empty batches only): NaN metrics, zero samples, no error."""
    metrics = EvalMetrics(torch.device("cpu"))
    batch = empty_batch()
    metrics.update(torch.zeros(0), batch.labels)
    values = metrics.compute()
    assert values["samples"] == 0.0
    assert math.isnan(values["auc"])
    assert math.isnan(values["ne"])


def test_held_out_stream_shares_the_label_model_but_not_the_batches() -> None:
    """Stream 1 batches differ from stream 0's, and the hidden logistic model is the same (same id scores)."""
    config = SyntheticConfig(batch_size=64, max_rows=1000, seed=5)
    train, held_out = SyntheticCriteo(config), SyntheticCriteo(config, stream=1)
    a, b = train.batch(0), held_out.batch(0)
    assert not torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(train._dense_weight, held_out._dense_weight)
    assert torch.equal(held_out.batch(3).labels, SyntheticCriteo(config, stream=1).batch(3).labels)
