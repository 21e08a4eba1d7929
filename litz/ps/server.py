"""Parameter-server shards: the socket-free store (``ShardStore``) and the server process loop.

Keys map to a fixed number of logical shards (``shard_of``); a server hosts a set of them.
Requests are validated item by item: an unknown table, a key of another shard, or an update
of the wrong dtype or shape is refused with a precise reason in the reply, and nothing else in
the message is affected (an item is applied whole or not at all).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Hashable
from typing import Any

import cloudpickle
import numpy as np

from litz.errors import LitzError, TableError
from litz.ps.tables import Table, lookup, shard_of, table_index
from litz.runtime.node import Node, main
from litz.runtime.protocol import Message

log = logging.getLogger(__name__)


class ShardStore:
    """The rows of the logical shards one server hosts: shard -> table -> key -> row."""

    def __init__(self, tables: dict[str, Table], shards: list[int], num_shards: int) -> None:
        self.tables = tables
        self.num_shards = num_shards
        self.shards: dict[int, dict[str, dict[Hashable, np.ndarray]]] = {
            s: {name: {} for name in tables} for s in shards
        }
        self.gets = 0
        self.updates = 0

    def _rows(self, table: Table, key: Hashable) -> dict[Hashable, np.ndarray]:
        shard = shard_of(key, self.num_shards)
        tables = self.shards.get(shard)
        if tables is None:
            raise TableError(f"table {table.name!r} key {key!r}: shard {shard} is not on this server")
        return tables[table.name]

    def _row(self, table: Table, key: Hashable) -> np.ndarray:
        rows = self._rows(table, key)
        row = rows.get(key)
        if row is None:
            row = rows[key] = table.initial_row(key)
        return row

    def get(self, table_name: Any, keys: list[Any]) -> np.ndarray:
        """The rows for ``keys`` stacked into one array (n, *row_shape)."""
        table = lookup(self.tables, table_name)
        keys = table.check_keys(keys)
        out = np.empty((len(keys), *table.shape), table.dtype)
        for i, key in enumerate(keys):
            out[i] = self._row(table, key)
        self.gets += len(keys)
        return out

    def update(self, table_name: Any, keys: list[Any], deltas: Any) -> None:
        """Apply stacked deltas to ``keys``: validated whole first, so a refused item changes nothing."""
        table = lookup(self.tables, table_name)
        keys = table.check_keys(keys)
        if not isinstance(deltas, np.ndarray):
            raise TableError(f"table {table.name!r}: deltas must be an array, got {type(deltas).__name__}")
        deltas = table.check_delta(deltas, n=len(keys), what="update")
        rows = [self._row(table, key) for key in keys]  # raises before anything is applied
        comb = table.comb
        for i, row in enumerate(rows):
            comb.apply_into(row, deltas[i])
        self.updates += len(keys)

    def handle_get(self, items: list[Any]) -> tuple[list[Any], list[Any]]:
        """Serve a batched get: one value (or None) and one error (or None) per item."""
        values: list[Any] = []
        errors: list[Any] = []
        for item in items:
            try:
                table_name, keys = item
                values.append(self.get(table_name, keys))
                errors.append(None)
            except (LitzError, TypeError, ValueError) as exc:
                values.append(None)
                errors.append(str(exc))
        return values, errors

    def handle_update(self, items: list[Any]) -> list[Any]:
        """Apply a batched update: one error (or None) per item."""
        errors: list[Any] = []
        for item in items:
            try:
                table_name, keys, deltas = item
                self.update(table_name, keys, deltas)
                errors.append(None)
            except (LitzError, TypeError, ValueError) as exc:
                errors.append(str(exc))
                log.warning("refused an update: %s", exc)
        return errors

    def snapshot(self, table_name: str) -> dict[Hashable, np.ndarray]:
        """Every materialised row of a table on this server (copies)."""
        out: dict[Hashable, np.ndarray] = {}
        for tables in self.shards.values():
            for key, row in tables[table_name].items():
                out[key] = row.copy()
        return out


class ServerNode(Node):
    """A server process: hosts a ShardStore and answers get/update requests."""

    role = "server"
    store: ShardStore | None = None

    def on_init_server(self, msg: Message) -> None:
        try:
            tables = table_index(cloudpickle.loads(msg["tables"]))
            self.store = ShardStore(tables, list(msg["shards"]), msg["num_shards"])
            self.master = msg["master"]
            self.endpoint.send(msg.sender, "ready", role=self.role)
        except Exception as exc:
            self.endpoint.send(msg.sender, "ready", role=self.role, error=f"{type(exc).__name__}: {exc}")

    def _store(self) -> ShardStore:
        if self.store is None:
            raise LitzError("server not initialised yet")
        return self.store

    def on_get(self, msg: Message) -> None:
        values, errors = self._store().handle_get(msg["items"])
        self.endpoint.send(msg.sender, "get_reply", rid=msg["rid"], values=values, errors=errors)

    def on_update(self, msg: Message) -> None:
        errors = self._store().handle_update(msg["items"])
        self.endpoint.send(msg.sender, "update_ack", rid=msg["rid"], errors=errors)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.store is not None:
            out.update(rows_read=self.store.gets, rows_updated=self.store.updates)
        return out

    def loop(self) -> None:
        while not self.stopping:
            self.poll(500)


if __name__ == "__main__":
    sys.exit(main(ServerNode))
