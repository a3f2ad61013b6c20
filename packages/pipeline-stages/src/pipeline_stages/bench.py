"""Benchmark: ``python -m pipeline_stages.bench [--quick] [--json PATH] [--plot PATH] [--device cpu|cuda]``.

Cases (implementations compared in one run, interleaved, medians over repeats):

* ``overlap/<costs>``: synthetic stages of known cost (CPU: a busy wait on the host; CUDA: ``torch.cuda._sleep``
  on each stage's stream) plus a model step of known cost. Rows: ``staged`` (this package) and ``sequential``
  (every stage then the model, one after the other: the sum). Extra keys ``sum_ms`` (stages + model),
  ``max_ms`` (the slowest of them) and ``target_ms`` (1.05 x (slowest stage + model), the issue's target). On CUDA the staged step approaches ``max_ms``; on CPU stages run inline, so
  the step is ``sum_ms`` plus the pipeline's overhead.
* ``progress_overhead/3_stages``: three identity stages; the time of one ``progress()`` (host time per step).
  Rows: ``staged`` (this package), ``direct`` (calling the three runnables and ``next()`` by hand: the floor),
  and ``torchrec`` (torchrec's ``StagedTrainPipeline``) when torchrec is importable and the device is CUDA
  (torchrec's pipeline needs streams).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline_stages._pipeline import StagedTrainPipeline
from pipeline_stages._stage import PipelineStage
from pipeline_stages._version import __version__

__all__ = ["main"]


def _spin_ms(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class _Device:
    """Timing and busy work for one device."""

    def __init__(self, kind: str) -> None:
        self.cuda = kind == "cuda"
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]  # unannotated in torch
        torch.cuda.synchronize()
        start, end = self.event(), self.event()
        start.record()
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # unannotated in torch
        end.record()
        end.synchronize()
        elapsed: float = start.elapsed_time(end)
        return 20_000_000 / elapsed

    @staticmethod
    def event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated in torch

    def work(self, ms: float) -> None:
        """Busy work of ``ms`` on the current stream (CUDA) or the host (CPU)."""
        if self.cuda:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))  # type: ignore[no-untyped-call]  # unannotated
        else:
            _spin_ms(ms)

    def stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream() if self.cuda else None  # type: ignore[no-untyped-call]  # unannotated

    def time_block(self, body: Callable[[], None], steps: int) -> float:
        """Milliseconds per step of ``body`` run ``steps`` times (CUDA: event time on the current stream)."""
        if self.cuda:
            torch.cuda.synchronize()
            start, end = self.event(), self.event()
            start.record()
            for _ in range(steps):
                body()
            end.record()
            end.synchronize()
            elapsed: float = start.elapsed_time(end)
            return elapsed / steps
        begin = time.perf_counter()
        for _ in range(steps):
            body()
        return (time.perf_counter() - begin) * 1e3 / steps

    def host_block(self, body: Callable[[], None], steps: int) -> float:
        """Host milliseconds per step (the launch cost; the device is synchronized before and after)."""
        if self.cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(steps):
            body()
        elapsed = (time.perf_counter() - begin) * 1e3 / steps
        if self.cuda:
            torch.cuda.synchronize()
        return elapsed


def _batches(device: _Device) -> Iterator[torch.Tensor]:
    template = torch.zeros(16, device="cuda" if device.cuda else "cpu")
    while True:
        yield template


class _Batch:
    """A DLRM-like batch of several tensors (dense, ids, lengths, weights, labels, ...): torchrec's Pipelineable."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def to(self, device: torch.device, non_blocking: bool = False) -> _Batch:
        return _Batch([t.to(device, non_blocking=non_blocking) for t in self.tensors])

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in self.tensors:
            t.record_stream(stream)


def _multi_tensor_batches(device: _Device, count: int) -> Iterator[_Batch]:
    batch = _Batch([torch.zeros(16, device="cuda" if device.cuda else "cpu") for _ in range(count)])
    while True:
        yield batch


def _overlap_impls(
    device: _Device, costs: list[float], model_ms: float, steps: int
) -> dict[str, Callable[[], float]]:
    def staged() -> float:
        stages = []
        for i, cost in enumerate(costs):

            def run(batch: torch.Tensor, cost: float = cost) -> torch.Tensor:
                device.work(cost)
                return batch

            stages.append(PipelineStage(f"stage{i}", run, stream=device.stream()))
        pipeline = StagedTrainPipeline(stages)
        it = _batches(device)
        for _ in range(len(costs) + 2):  # fill and warm up
            pipeline.progress(it)
            device.work(model_ms)

        def step() -> None:
            pipeline.progress(it)
            device.work(model_ms)

        return device.time_block(step, steps)

    def sequential() -> float:
        it = _batches(device)

        def step() -> None:
            next(it)
            for cost in costs:
                device.work(cost)
            device.work(model_ms)

        return device.time_block(step, steps)

    return {"staged": staged, "sequential": sequential}


def _overhead_impls(
    device: _Device, steps: int, batches: Callable[[], Iterator[Any]]
) -> dict[str, Callable[[], float]]:
    def identity(batch: Any) -> Any:
        return batch

    def staged() -> float:
        pipeline = StagedTrainPipeline(
            [PipelineStage(f"stage{i}", identity, stream=device.stream()) for i in range(3)]
        )
        it = batches()
        for _ in range(5):
            pipeline.progress(it)
        return device.host_block(lambda: pipeline.progress(it), steps)

    def direct() -> float:
        it = batches()

        def step() -> None:
            batch = next(it)
            for _ in range(3):
                batch = identity(batch)

        return device.host_block(step, steps)

    impls: dict[str, Callable[[], float]] = {"staged": staged, "direct": direct}
    torchrec_pipeline = _torchrec_pipeline_factory(device, identity)
    if torchrec_pipeline is not None:

        def torchrec() -> float:
            assert torchrec_pipeline is not None
            pipeline = torchrec_pipeline()
            it = batches()
            for _ in range(5):
                pipeline.progress(it)
            return device.host_block(lambda: pipeline.progress(it), steps)

        impls["torchrec"] = torchrec
    return impls


def _torchrec_pipeline_factory(device: _Device, identity: Callable[[Any], Any]) -> Callable[[], Any] | None:
    """torchrec's StagedTrainPipeline over the same identity stages, when torchrec imports (CUDA only)."""
    if not device.cuda:
        return None  # torchrec's StagedTrainPipeline needs stage streams (record_stream has no CPU kernel)
    try:
        from torchrec.distributed.train_pipeline import (  # optional baseline, benchmark only
            StagedTrainPipeline as TorchrecPipeline,
        )
    except Exception:  # torchrec missing or broken against this torch/fbgemm: skip the row
        return None
    try:  # torchrec >= 1.3 keeps the stage in its own module
        from torchrec.distributed.train_pipeline.pipeline_stage import (
            PipelineStage as TorchrecStage,
        )
    except ImportError:
        try:
            from torchrec.distributed.train_pipeline.utils import (
                PipelineStage as TorchrecStage,
            )
        except ImportError:
            return None

    def make() -> Any:
        return TorchrecPipeline([TorchrecStage(f"stage{i}", identity, device.stream()) for i in range(3)])

    return make


def _summarise(case: str, impl: str, samples: list[float], peak: int | None, **extra: Any) -> dict[str, Any]:
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "case": case,
        "impl": impl,
        "median_ms": statistics.median(ordered),
        "p10_ms": quantile(0.1),
        "p90_ms": quantile(0.9),
        "peak_mem_bytes": peak,
        **extra,
    }


def run(device_kind: str, *, quick: bool) -> dict[str, Any]:
    """Run every case; return the JSON document."""
    device = _Device(device_kind)
    repeats = 5 if quick else 15
    steps = 10 if quick else 40
    overhead_steps = 200 if quick else 2000
    cases: list[tuple[str, dict[str, Callable[[], float]], dict[str, Any]]] = []
    for costs, model_ms in (([0.2, 0.5, 0.3], 0.5), ([1.0, 1.0, 1.0], 1.0)):
        label = "overlap/" + "+".join(f"{c:g}" for c in costs) + f"+model{model_ms:g}ms"
        extra = {
            "sum_ms": sum(costs) + model_ms,
            "max_ms": max([*costs, model_ms]),
            # the target: a steady-state step within 5% of max(stage) + model
            "target_ms": round(1.05 * (max(costs) + model_ms), 4),
        }
        cases.append((label, _overlap_impls(device, costs, model_ms, steps), extra))
    cases.append(
        ("progress_overhead/3_stages", _overhead_impls(device, overhead_steps, lambda: _batches(device)), {})
    )
    cases.append(
        (
            "progress_overhead/3_stages_8_tensors",
            _overhead_impls(device, overhead_steps, lambda: _multi_tensor_batches(device, 8)),
            {},
        )
    )

    results: list[dict[str, Any]] = []
    for case, impls, extra in cases:
        samples: dict[str, list[float]] = {name: [] for name in impls}
        peaks: dict[str, int | None] = dict.fromkeys(impls)
        for _ in range(repeats):  # interleaved: one block of every impl per repeat
            for name, impl in impls.items():
                if device.cuda:
                    torch.cuda.reset_peak_memory_stats()
                samples[name].append(impl())
                if device.cuda:
                    peaks[name] = max(peaks[name] or 0, torch.cuda.max_memory_allocated())
        results.extend(_summarise(case, name, samples[name], peaks[name], **extra) for name in impls)
    name = torch.cuda.get_device_name() if device.cuda else (platform.processor() or platform.machine())
    return {
        "package": "pipeline-stages",
        "version": __version__,
        "device": f"{device_kind}: {name}",
        "torch": torch.__version__,
        "date": dt.date.today().isoformat(),
        "command": "python -m pipeline_stages.bench"
        + (" --quick" if quick else "")
        + f" --device {device_kind}",
        "results": results,
    }


def _print_table(document: dict[str, Any]) -> None:
    print(f"pipeline-stages {document['version']} on {document['device']} (torch {document['torch']})")
    header = f"{'case':<40} {'impl':<11} {'median ms':>10} {'p10':>9} {'p90':>9} {'sum ms':>8} {'max ms':>8}"
    print(header)
    print("-" * len(header))
    for row in document["results"]:
        sum_ms = f"{row['sum_ms']:.2f}" if "sum_ms" in row else ""
        max_ms = f"{row['max_ms']:.2f}" if "max_ms" in row else ""
        print(
            f"{row['case']:<40} {row['impl']:<11} {row['median_ms']:>10.4f} {row['p10_ms']:>9.4f} "
            f"{row['p90_ms']:>9.4f} {sum_ms:>8} {max_ms:>8}"
        )


def _plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib  # optional, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overlap = [r for r in document["results"] if r["case"].startswith("overlap/")]
    overhead = [r for r in document["results"] if r["case"].startswith("progress_overhead/")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cases = sorted({r["case"] for r in overlap})
    width = 0.2
    for offset, key in enumerate(["staged", "sequential"]):
        values = [next(r["median_ms"] for r in overlap if r["case"] == c and r["impl"] == key) for c in cases]
        left.bar([i + offset * width for i in range(len(cases))], values, width, label=key)
    for offset, key in enumerate(["sum_ms", "max_ms"], start=2):
        values = [next(r[key] for r in overlap if r["case"] == c) for c in cases]
        left.bar(
            [i + offset * width for i in range(len(cases))],
            values,
            width,
            label=key.replace("_ms", ""),
            alpha=0.5,
        )
    left.set_xticks(
        [i + 1.5 * width for i in range(len(cases))], [c.removeprefix("overlap/") for c in cases], fontsize=7
    )
    left.set_ylabel("ms per step")
    left.set_title("step time vs sum / max of stage times")
    left.legend(fontsize=7)
    right.bar([r["impl"] for r in overhead], [r["median_ms"] * 1e3 for r in overhead])
    right.set_ylabel("µs per progress()")
    right.set_title("progress() overhead, 3 identity stages")
    fig.suptitle(f"pipeline-stages {document['version']} — {document['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pipeline_stages.bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline_stages.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke run)")
    parser.add_argument("--json", type=Path, help="write the results JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)
    document = run(args.device, quick=args.quick)
    _print_table(document)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot is not None:
        _plot(document, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
