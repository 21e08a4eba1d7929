"""The update log: one per worker process; ``ps.update`` merges into it with the table's combiner.

The worker flushes it to the servers and sends the buffered task completions to the master
only once the servers have acknowledged the flush (DESIGN.md §2, rule 1). The log holds no
sockets: ``drain`` hands the merged updates over, grouped per table, ready to be split by
server and sent.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from litz.ps.tables import Table


class UpdateLog:
    """Per-key merge of updates with each table's combiner; counts what it absorbed."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[Hashable, np.ndarray]] = {}
        self._tables: dict[str, Table] = {}
        self.nbytes = 0
        self.updates_in = 0
        self.rows_out = 0

    def _table_rows(self, table: Table) -> dict[Hashable, np.ndarray]:
        """The buffered rows of ``table`` (registered on first use)."""
        rows = self._rows.get(table.name)
        if rows is None:
            rows = self._rows[table.name] = {}
            self._tables[table.name] = table
        return rows

    def _first(self, table: Table, rows: dict[Hashable, np.ndarray], key: Hashable, delta: np.ndarray) -> None:
        """Buffer the first delta of ``key`` (a copy: the caller may reuse its array)."""
        rows[key] = np.array(delta, dtype=table.dtype, copy=True)
        self.nbytes += table.row_nbytes

    def add(self, table: Table, key: Hashable, delta: np.ndarray) -> None:
        """Merge one validated row delta (the log copies it: the caller may reuse its array)."""
        rows = self._table_rows(table)
        self.updates_in += 1
        acc = rows.get(key)
        if acc is None:
            self._first(table, rows, key, delta)
        else:
            out = table.comb.merge_into(acc, delta)
            if out is not acc:  # a combiner that returns its result instead of merging in place
                acc[...] = out

    def add_many(self, table: Table, keys: list[Hashable], deltas: np.ndarray) -> None:
        """``add`` for every key; the rows already in the log merge in one ``merge_many`` call."""
        rows = self._table_rows(table)
        self.updates_in += len(keys)
        accs: list[np.ndarray] = []
        idx: list[int] = []
        for i, key in enumerate(keys):
            acc = rows.get(key)
            if acc is None:
                self._first(table, rows, key, deltas[i])
            else:
                accs.append(acc)
                idx.append(i)
        if len(idx) == len(keys):
            table.comb.merge_many(accs, deltas)
        elif idx:
            table.comb.merge_many(accs, deltas[idx])

    def absorb(self, other: UpdateLog) -> None:
        """Merge everything ``other`` holds into this log and empty ``other``: all of it or, when a
        combiner raises, none of it (this log is then as it was, and the exception propagates).

        Why: a micro-task's updates go to a log of its own and join the process's log only when
        the task returns, so a task that raises leaves no update behind (a retried task would
        otherwise count its first run's updates twice). Rows both logs hold merge into copies, and
        the copies replace this log's rows only once every table merged: any combiner may raise
        (an ``atomic`` one before it writes a row of its call, but an earlier table's call would
        have been merged in place already). Tables whose rows this log does not hold yet are moved
        over, not copied.
        """
        merged: list[tuple[dict[Hashable, np.ndarray], str, list[Hashable], list[np.ndarray]]] = []
        for name, theirs in other._rows.items():
            mine = self._rows.get(name)
            both = [key for key in theirs if key in mine] if mine else []
            if both:
                accs = [mine[key].copy() for key in both]  # type: ignore[index]
                other._tables[name].comb.merge_many(accs, np.stack([theirs[key] for key in both]))  # may raise
                merged.append((mine, name, both, accs))  # type: ignore[arg-type]
        for mine, name, both, accs in merged:
            mine.update(zip(both, accs, strict=True))
            theirs = other._rows[name]
            for key in both:
                del theirs[key]
        for name, theirs in other._rows.items():  # the keys new to this log
            if theirs:
                rows = self._table_rows(other._tables[name])
                if rows:
                    rows.update(theirs)
                else:
                    self._rows[name] = theirs
                self.nbytes += len(theirs) * other._tables[name].row_nbytes
        self.updates_in += other.updates_in
        other._rows = {}
        other.nbytes = other.updates_in = 0

    def discard(self) -> None:
        """Drop everything buffered (a rollback abandons these updates)."""
        self._rows.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return sum(len(r) for r in self._rows.values())

    def __bool__(self) -> bool:
        return any(self._rows.values())

    def drain(self) -> dict[str, tuple[list[Hashable], list[np.ndarray]]]:
        """Take everything: table -> (keys, row deltas); the log is empty afterwards."""
        out = {name: (list(rows.keys()), list(rows.values())) for name, rows in self._rows.items() if rows}
        self.rows_out += sum(len(k) for k, _ in out.values())
        self._rows.clear()
        self.nbytes = 0
        return out
