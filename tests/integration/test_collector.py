"""The trainer's garbage-collection schedule (examples/dlrm/collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from examples.dlrm.collector import StepCollector
from examples.dlrm.errors import ArgumentError
from examples.dlrm.train import TrainConfig, train, validate


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    gc.unfreeze()
    if was:
        gc.enable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_freezes_setup_and_turns_automatic_collection_off() -> None:
    collector = StepCollector(3)
    setup_object = _Cycle()
    collector.start()
    assert not gc.isenabled()
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(setup_object)
    collector.stop()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_after_step_collects_young_garbage_on_its_steps_only() -> None:
    collector = StepCollector(3)
    collector.start()
    try:
        for step in (1, 2):
            _Cycle()
            collector.after_step(step)
        assert collector.collections == 0
        assert any(type(o) is _Cycle for o in gc.get_objects(0))  # not collected yet
        collector.after_step(3)
        assert collector.collections == 1
        assert not any(type(o) is _Cycle for o in gc.get_objects())
    finally:
        collector.stop()


def test_every_zero_leaves_the_collector_alone() -> None:
    collector = StepCollector(0)
    collector.start()
    collector.after_step(100)
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert collector.collections == 0


def test_stop_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    collector = StepCollector(5)
    collector.start()
    collector.stop()
    assert not gc.isenabled()


def test_negative_every_is_rejected() -> None:
    with pytest.raises(ValueError, match="`every`"):
        StepCollector(-1)
    with pytest.raises(ArgumentError, match="--gc-every"):
        validate(TrainConfig(out=Path("unused"), gc_every=-1), check_resume=False)


def test_train_gives_the_collector_back_when_a_step_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_after_step(self: StepCollector, step: int) -> None:
        assert not gc.isenabled()  # the trainer's schedule was on during the step
        raise RuntimeError("step failed")

    monkeypatch.setattr(StepCollector, "after_step", failing_after_step)
    # A small run of the default model (its key-value tables included): the failure comes at the first step.
    config = TrainConfig(out=tmp_path / "run", steps=2, eval_batches=0, progress=False, tensorboard=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="step failed"):
            train(config, rank=0, world_size=1)
    finally:
        dist.destroy_process_group()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
