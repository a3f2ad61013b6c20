"""The schema record: what a store's rows mean (tables, dims, precision, optimizer, record layout, seed).

A module writes it into its store the first time (one record, id 0 of the reserved table
:data:`SCHEMA_TABLE`, through the ordinary :class:`~ssd_tbe_adapter.interfaces.KVStore` methods, so every store
keeps one) and checks it on every later open: a store reopened with the tables reordered, another dim,
precision or optimizer raises :class:`~ssd_tbe_adapter.errors.SchemaMismatchError` naming the difference
instead of reading rows as something they are not. A store written before this record existed (rows, no
record) is trusted and gets the record.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import torch

from ssd_tbe_adapter.errors import SchemaMismatchError, StoreCorruptError
from ssd_tbe_adapter.interfaces import KVStore

__all__ = ["SCHEMA_TABLE", "check_schema", "describe_store", "ensure_schema"]

SCHEMA_TABLE = 2**32 - 2
"""Table number of the schema record (the highest a store accepts; modules number their tables from 0)."""

_SCHEMA_FORMAT = 1


def describe_store(store: KVStore) -> str:
    """``store 'PATH'`` for a store with a ``path``, else its type name (for messages)."""
    path = getattr(store, "path", None)
    return f"store {str(path)!r}" if path is not None else f"the {type(store).__name__}"


def _read(store: KVStore) -> dict[str, Any] | None:
    for _, rows in store.iter_chunks(table=SCHEMA_TABLE, chunk_rows=1):
        try:
            record: dict[str, Any] = json.loads(bytes(rows[0].numpy()).rstrip(b" ").decode())
        except ValueError as error:
            raise StoreCorruptError(
                f"{describe_store(store)} holds an unreadable schema record: {error}"
            ) from error
        return record
    return None


def _tables(schema: dict[str, Any]) -> str:
    return "[" + ", ".join(f"{name}:{dim}" for name, dim in schema["tables"]) + "]"


def check_schema(stored: dict[str, Any], mine: dict[str, Any], where: str) -> None:
    """Raise :class:`SchemaMismatchError` naming the first field of ``stored`` (from ``where``) that differs
    from ``mine``; ``store_id`` and ``format`` are not compared."""
    theirs_tables = [list(item) for item in stored.get("tables") or []]
    mine_tables = [list(item) for item in mine["tables"]]
    if theirs_tables != mine_tables:
        detail = ""
        for number, (theirs, ours) in enumerate(zip(theirs_tables, mine_tables, strict=False)):
            if theirs != ours:
                detail = f": table {number} is `{theirs[0]}` (dim {theirs[1]}) there, `{ours[0]}` (dim {ours[1]}) here"
                break
        else:
            detail = f": {len(theirs_tables)} tables there, {len(mine_tables)} here"
        raise SchemaMismatchError(
            f"{where} was written for tables {_tables({'tables': theirs_tables})}, this module has "
            f"{_tables(mine)}{detail}"
        )
    for key in mine:
        if key in ("tables", "store_id", "format"):
            continue
        if stored.get(key) != mine[key]:
            raise SchemaMismatchError(
                f"{where} was written with `{key}` = {stored.get(key)!r}, this module has {mine[key]!r}"
            )


def ensure_schema(store: KVStore, mine: dict[str, Any]) -> str:
    """Check the store's schema record against ``mine`` (written when the store has none); its ``store_id``.

    Raises:
        SchemaMismatchError: the store was written by a differently configured module.
    """
    stored = _read(store)
    if stored is not None:
        check_schema(stored, mine, describe_store(store))
        return str(stored.get("store_id", ""))
    record = {"format": _SCHEMA_FORMAT, "store_id": uuid.uuid4().hex, **mine}
    data = json.dumps(record, sort_keys=True).encode()
    store.put(
        torch.zeros(1, dtype=torch.int64),
        torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).view(1, -1),
        table=SCHEMA_TABLE,
    )
    return str(record["store_id"])
