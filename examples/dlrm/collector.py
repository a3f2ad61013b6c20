"""Python's garbage collector on the trainer's schedule instead of its own.

Left automatic, CPython runs a full (generation 2) collection whenever enough objects survived the younger
ones: it walks every object the process holds (torch, the model, the tables' bookkeeping), ~180 ms here,
at whatever step it lands on: on one rank it stalls the others at their next collective. The trainer
instead freezes what setup built (``gc.freeze``: never scanned again), turns the automatic collector off,
and collects the young generations itself every ``every`` steps, at the same step on every rank (what
torchtitan's ``gc_freq`` and Megatron's manual GC do). A full collection runs at the end of each segment
(before an evaluation or a checkpoint, already a pause).
"""

from __future__ import annotations

import gc

__all__ = ["StepCollector"]


class StepCollector:
    """Collects garbage every ``every`` training steps; ``every=0`` leaves Python's automatic collector alone.

    Use :meth:`start` once setup is done, :meth:`after_step` after each step, :meth:`segment_end` at a pause,
    :meth:`stop` at the end (the collector's previous state comes back).
    """

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"`every` must be >= 0 (0: Python's automatic collection), got {every}")
        self.every = every
        self.collections = 0  # young-generation collections run by after_step
        self._was_enabled = gc.isenabled()
        self._started = False

    def start(self) -> None:
        """Collect once, freeze the survivors (setup's objects) and turn the automatic collector off."""
        if not self.every or self._started:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        self._started = True

    def after_step(self, step: int) -> None:
        """Collect the young generations when ``step`` is a multiple of ``every``."""
        if self._started and step % self.every == 0:
            gc.collect(1)
            self.collections += 1

    def segment_end(self) -> None:
        """A full collection (the pipeline is empty here; an evaluation or checkpoint follows)."""
        if self._started:
            gc.collect()

    def stop(self) -> None:
        """Unfreeze and give the collector back its previous state; idempotent."""
        if not self._started:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._started = False
