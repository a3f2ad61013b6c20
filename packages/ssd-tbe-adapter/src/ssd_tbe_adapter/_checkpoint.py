"""Checkpoint directories: one ``torch.save`` file per :class:`~ssd_tbe_adapter.TableChunk` plus ``manifest.json``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ssd_tbe_adapter._specs import TableChunk

__all__ = ["read_chunks", "read_manifest", "write_checkpoint"]

_CHECKPOINT_FORMAT = 1


def write_checkpoint(directory: str | Path, chunks: Iterable[TableChunk], config: dict[str, Any]) -> int:
    """Write ``chunks`` to ``directory``, one file per chunk as it comes, then the manifest (``config``,
    the file names and the row count).

    Returns:
        The number of rows written.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    rows = 0
    for number, chunk in enumerate(chunks):
        name = f"chunk-{number:06d}.pt"
        torch.save(
            {
                "table": chunk.table,
                "ids": chunk.ids,
                "weights": chunk.weights,
                "state": chunk.optimizer_state,
            },
            path / name,
        )
        files.append(name)
        rows += chunk.ids.numel()
    manifest = {"format": _CHECKPOINT_FORMAT, **config, "files": files, "rows": rows}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return rows


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a :func:`write_checkpoint` directory.

    Raises:
        FileNotFoundError: ``directory`` has no ``manifest.json``.
        ValueError: the manifest has another format number.
    """
    path = Path(directory)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"checkpoint `directory` {str(path)!r} has no manifest.json")
    manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    if manifest.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint format {manifest.get('format')!r} in {str(path)!r}, expected {_CHECKPOINT_FORMAT}"
        )
    return manifest


def read_chunks(directory: str | Path, manifest: dict[str, Any]) -> Iterator[TableChunk]:
    """The chunks the manifest lists, loaded one at a time."""
    path = Path(directory)
    for name in manifest["files"]:
        data = torch.load(path / name, weights_only=True)
        yield TableChunk(
            table=data["table"],
            ids=data["ids"],
            weights=data["weights"],
            optimizer_state=data["state"],
        )
