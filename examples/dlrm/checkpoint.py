"""Checkpoints of the DLRM run with ``torch.distributed.checkpoint`` (DCP); they reshard to another world size.

A checkpoint is the folder ``<run>/checkpoint/``:

| path | written by | content |
| --- | --- | --- |
| ``.metadata``, ``__<rank>_*.distcp`` | DCP (every rank its own items) | dense weights and Adagrad state (replicated: written once), the in-memory tables and their row-wise optimizer state as ``ShardedTensor`` s (vbe-lookup's ``sharded_state_dict()``: each rank writes its own rows), each rank's RNG states |
| ``kv/<table>/rank<r>.json``, ``kv/<table>/r<r>-<n>.pt`` | the rank holding the key-value table | its rows streamed from the store in chunks of ``chunk_rows`` (ids, weights, optimizer state), never the whole table in memory |
| ``ranks/rank<r>.json`` | every rank | its loss/samples/seconds history |
| ``meta.json`` | rank 0, last | format, step, world size, the model's configuration, the history over all ranks, the evaluations |

A checkpoint is written into ``checkpoint.tmp/`` and renamed over ``checkpoint/`` once every rank has finished, so
an interrupted save leaves the previous checkpoint intact. Loading on the same world size restores everything
exactly; on another world size DCP reads the rows each rank's new shards cover out of whatever ranks wrote them,
and each key-value table is restored by its new owner from its chunk files. The multi-host case needs the run
folder on a file system every host sees (DCP's ``FileSystemWriter``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from examples.dlrm.embeddings import KV_GROUP, ShardedTables
from examples.dlrm.errors import CheckpointError
from examples.dlrm.model import DLRM

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_dir",
    "load_checkpoint",
    "read_meta",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = 2
_TMP = "checkpoint.tmp"
_OLD = "checkpoint.old"


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    """DCP warns at every ShardedTensor that it is deprecated for DTensor; DTensor cannot express our shards yet
    (table-wise placement on one rank, row-wise splits at arbitrary offsets), so the warning says nothing here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


def checkpoint_dir(out: Path) -> Path:
    """The checkpoint folder of run folder ``out``."""
    return out / "checkpoint"


def read_meta(out: Path, model_config: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, checked against this run's ``model_config`` (no collective).

    Raises:
        CheckpointError: no checkpoint in ``out``, an older format, or another model configuration.
    """
    folder = checkpoint_dir(out)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        if any(folder.glob("rank*.pt")):
            raise CheckpointError(
                f"`--resume`: {folder} holds a checkpoint of the old per-rank torch.save format; this trainer "
                "reads DCP checkpoints only (train again, or resume with the version that wrote it)"
            )
        raise CheckpointError(f"`--resume`: {out} holds no checkpoint ({meta_path} does not exist)")
    try:
        meta: dict[str, Any] = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"`--resume`: {meta_path} is not valid JSON ({exc})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"`--resume`: {meta_path} has checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}"
        )
    saved = meta.get("model", {})
    changed = [
        f"{key}={_short(saved.get(key))} in the checkpoint, {_short(value)} now"
        for key, value in model_config.items()
        if _jsonable(value) != saved.get(key)
    ]
    if changed:
        raise CheckpointError(
            f"`--resume`: the checkpoint in {folder} is incompatible with this run: " + "; ".join(changed)
        )
    return meta


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dense_state(model: DLRM, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Dense weights and the dense optimizer's per-parameter state, flat string keys (DCP-friendly)."""
    state = {f"dense/{k}": v for k, v in model.dense_state_dict().items()}
    for index, param_state in optimizer.state_dict()["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                state[f"dense_optimizer/{index}/{key}"] = value.detach().to("cpu", copy=True)
    return state


def _rng_keys(rank: int) -> list[str]:
    keys = [f"rng/rank{rank}/cpu"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # unannotated in torch
        keys.append(f"rng/rank{rank}/cuda")
    return keys


def _rng_state(rank: int) -> dict[str, torch.Tensor]:
    state = {f"rng/rank{rank}/cpu": torch.get_rng_state()}
    if f"rng/rank{rank}/cuda" in _rng_keys(rank):
        state[f"rng/rank{rank}/cuda"] = torch.cuda.get_rng_state()
    return state


def _write_kv(tables: ShardedTables, folder: Path, rank: int, chunk_rows: int) -> None:
    """Stream this rank's key-value rows into ``folder/<table>/`` (store flushed first by ``checkpoint()``)."""
    kernel = tables.kernels.get(KV_GROUP)
    if kernel is None:
        return
    names = list(tables.specs[KV_GROUP].table_names)
    files: dict[str, list[str]] = {name: [] for name in names}
    rows: dict[str, int] = dict.fromkeys(names, 0)
    for name in names:
        (folder / name).mkdir(parents=True, exist_ok=True)
    for chunk in kernel.checkpoint(chunk_rows=chunk_rows):
        file = f"r{rank}-{len(files[chunk.table]):06d}.pt"
        torch.save(
            {"ids": chunk.ids, "weights": chunk.weights, "state": chunk.optimizer_state},
            folder / chunk.table / file,
        )
        files[chunk.table].append(file)
        rows[chunk.table] += int(chunk.ids.numel())
    for name in names:
        manifest = {"table": name, "rank": rank, "files": files[name], "rows": rows[name]}
        (folder / name / f"rank{rank}.json").write_text(json.dumps(manifest), encoding="utf-8")


def _read_kv(tables: ShardedTables, folder: Path) -> None:
    """Restore this rank's key-value tables from the chunk files of whichever ranks wrote them."""
    kernel = tables.kernels.get(KV_GROUP)
    if kernel is None:
        return
    from ssd_tbe_adapter import TableChunk

    names = list(tables.specs[KV_GROUP].table_names)
    manifests: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        found = sorted((folder / name).glob("rank*.json"))
        if not found:
            raise CheckpointError(f"`--resume`: the checkpoint has no rows of key-value table `{name}`")
        manifests[name] = [json.loads(p.read_text(encoding="utf-8")) for p in found]
    dim = dict(zip(names, tables.specs[KV_GROUP].embedding_dims, strict=True))

    def chunks() -> Iterator[Any]:
        for name in names:
            # An empty chunk first: `restore` clears every table it sees, also one saved without rows.
            width = 1 if tables.config.optimizer == "rowwise_adagrad" else 0
            yield TableChunk(
                table=name,
                ids=torch.zeros(0, dtype=torch.int64),
                weights=torch.zeros(0, dim[name]),
                optimizer_state=torch.zeros(0, width),
            )
            for manifest in manifests[name]:
                for file in manifest["files"]:
                    data = torch.load(folder / name / file, weights_only=True)
                    yield TableChunk(
                        table=name, ids=data["ids"], weights=data["weights"], optimizer_state=data["state"]
                    )

    kernel.restore(chunks())


def save_checkpoint(
    out: Path,
    *,
    rank: int,
    world_size: int,
    step: int,
    model: DLRM,
    tables: ShardedTables,
    optimizer: torch.optim.Optimizer,
    history: dict[str, list[float]],
    evals: list[dict[str, Any]],
    model_config: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    chunk_rows: int = 65_536,
) -> Path:
    """Write the checkpoint of step ``step`` (collective: every rank calls it at the same step).

    Args:
        history: this rank's per-step ``loss``, ``samples`` and ``seconds``.
        evals: the evaluations so far (the same on every rank).
        model_config: what a resume must match (see :func:`read_meta`).
        extra: more JSON for ``meta.json`` (the data position of a TSV run).
        chunk_rows: rows per key-value chunk file.

    Returns:
        The checkpoint folder.
    """
    final, tmp, old = checkpoint_dir(out), out / _TMP, out / _OLD
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    state: dict[str, Any] = {**_dense_state(model, optimizer), **_rng_state(rank)}
    state.update({f"embeddings/{k}": v for k, v in tables.module.sharded_state_dict().items()})
    with _quiet_sharded_tensor():
        dcp_save(state, storage_writer=FileSystemWriter(str(tmp)))
    _write_kv(tables, tmp / "kv", rank, chunk_rows)
    (tmp / "ranks").mkdir(parents=True, exist_ok=True)
    (tmp / "ranks" / f"rank{rank}.json").write_text(json.dumps({"history": history}), encoding="utf-8")
    # The history over all ranks (loss: mean, samples: sum, step time: slowest), for a resume on another
    # world size, where per-rank histories do not map onto the new ranks.
    # Reduced through the tables' device: NCCL reduces CUDA tensors only.
    series = torch.tensor(
        [history["loss"], history["samples"], history["seconds"]], dtype=torch.float64, device=tables.device
    )
    totals = series[:2].clone()
    slowest = series[2:].clone()
    dist.all_reduce(totals)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    totals, slowest = totals.cpu(), slowest.cpu()
    dist.barrier()
    if rank == 0:
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "world_size": world_size,
            "model": _jsonable(dict(model_config)),
            "history": {
                "loss": (totals[0] / world_size).tolist(),
                "samples": totals[1].tolist(),
                "seconds": slowest[0].tolist(),
            },
            "evals": evals,
            **(dict(extra) if extra else {}),
        }
        (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(
    out: Path,
    *,
    rank: int,
    world_size: int,
    model: DLRM,
    tables: ShardedTables,
    optimizer: torch.optim.Optimizer,
    model_config: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Restore the checkpoint in ``out`` into this rank's model, tables and optimizer (collective).

    Any world size: the sharded tables and the key-value tables are resharded to this run's plan. RNG states
    are restored on ranks that existed in the saved run.

    Returns:
        ``(meta, history)``: the checkpoint's ``meta.json`` and this rank's history (on another world size,
        the saved all-rank history with the samples split evenly over the new ranks).

    Raises:
        CheckpointError: see :func:`read_meta`.
    """
    meta = read_meta(out, model_config)
    folder = checkpoint_dir(out)
    reader = FileSystemReader(str(folder))
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    state: dict[str, Any] = _dense_state(model, optimizer)
    state.update({k: v for k, v in _rng_state(rank).items() if k in saved_keys})
    sharded = tables.module.sharded_state_dict()
    state.update({f"embeddings/{k}": v for k, v in sharded.items()})
    missing = sorted(k for k in state if k not in saved_keys)
    if missing:
        raise CheckpointError(
            f"`--resume`: the checkpoint in {folder} lacks {len(missing)} entries this run needs "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
        )
    with _quiet_sharded_tensor():
        dcp_load(state, storage_reader=reader)
    model.load_dense_state_dict(
        {k.removeprefix("dense/"): v for k, v in state.items() if k.startswith("dense/")}
    )
    optimizer_state = optimizer.state_dict()
    for index, param_state in optimizer_state["state"].items():
        for key in list(param_state):
            loaded = state.get(f"dense_optimizer/{index}/{key}")
            if isinstance(loaded, torch.Tensor):
                param_state[key] = loaded
    optimizer.load_state_dict(optimizer_state)
    tables.module.load_sharded_state_dict(
        {k.removeprefix("embeddings/"): v for k, v in state.items() if k.startswith("embeddings/")}
    )
    _read_kv(tables, folder / "kv")
    cpu_rng = state.get(f"rng/rank{rank}/cpu")
    if isinstance(cpu_rng, torch.Tensor):
        torch.set_rng_state(cpu_rng)
    cuda_rng = state.get(f"rng/rank{rank}/cuda")
    if isinstance(cuda_rng, torch.Tensor):
        torch.cuda.set_rng_state(cuda_rng)
    dist.barrier()
    if int(meta["world_size"]) == world_size:
        ranks = json.loads((folder / "ranks" / f"rank{rank}.json").read_text(encoding="utf-8"))
        history: dict[str, list[float]] = ranks["history"]
    else:
        saved = meta["history"]
        history = {
            "loss": list(saved["loss"]),
            "samples": [s / world_size for s in saved["samples"]],
            "seconds": list(saved["seconds"]),
        }
    return meta, history
