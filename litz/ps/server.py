"""Parameter-server shards: the socket-free store (``ShardStore``) and the server process loop.

Keys map to a fixed number of logical shards (``shard_of``); a server hosts a set of them.
Requests are validated item by item: an unknown table, a key of another shard, or an update
of the wrong dtype or shape is refused with a precise reason in the reply, and nothing else in
the message is affected (an item is applied whole or not at all).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable
from typing import Any

import cloudpickle
import numpy as np

from litz.errors import LitzError, TableError
from litz.ft.checkpoint import RoundOutcomes
from litz.ps.tables import Table, lookup, shard_of, table_index
from litz.runtime.node import Node, RecentIds, checked_shard_map, exit_process, main
from litz.runtime.protocol import Message

log = logging.getLogger(__name__)

ROLLED_BACK = "its server died and the job rolls back"  # a read forwarded to a server lost in a rollback


def _described(value: Any) -> str:
    """What a reply gave instead of rows, for an error."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r:.60}"


def item_error(item: Any, exc: Exception) -> str:
    """Why a request's item was refused: Litz's own check says it all; anything else was raised by
    the application's code for the table (its combiner or initializer), so name the table and keys."""
    if isinstance(exc, LitzError):
        return str(exc)
    try:
        name, keys = item[0], list(item[1])
        shown = ", ".join(map(repr, keys[:4])) + (f", ... ({len(keys)} keys)" if len(keys) > 4 else "")
        where = f"table {name!r} keys [{shown}]"
    except Exception:  # a malformed item: its shape is what is wrong
        where = "a malformed item"
    return f"{where}: {type(exc).__name__}: {exc}"


class AppliedOnce:
    """Which rows an update that may come twice has already changed here (no sockets).

    A server that forwards part of an update (its shard moved on) answers the worker only after
    the new owner did. Should it die in between, the worker never learns that any of it landed,
    and sends the whole update again, to the shards' owners now (SCAR partial recovery,
    ``on_server_lost``), as does a live server whose forward went to the one that died. The same
    holds for a server that dies with its answer unsent after a shard it updated left for another
    server. So every update names the update it belongs to: the server takes ``(sender, rid)`` of
    one sent straight to it, and forwarded and resent ones carry ``origin = [sender, rid, low]``
    (the rid the sender gave it, and the lowest rid it still holds unanswered, any of which it may
    still send again). Each server remembers, per origin, the keys it applied: a key already
    applied under that origin is not applied again. What is remembered travels with a shard that
    migrates, and is forgotten once the sender no longer holds the update, which is at its next
    message in the common case.

    Recording keeps a reference to the update's list of keys (no copy, no look at a key): every
    update is recorded, and a big one has tens of thousands. Only the rare paths look at them: an
    update that came again (``fresh``) and a migrating shard (``extract``).
    """

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        # (sender, rid) -> table -> the lists of keys applied here under that origin
        self.applied: dict[tuple[str, int], dict[str, list[list[Hashable]]]] = {}
        # sender -> the highest ``low`` its updates sent straight here named (``answered``)
        self.lows: dict[str, int] = {}

    def answered(self, sender: str, rid: int, low: int | None) -> bool:
        """Whether update ``rid``, sent straight here by ``sender`` (no ``origin``), was answered
        already: an update it sent here later named a lowest unanswered rid above it. Its updates
        reach this server in the order of their rids, one connection, and it never sends one
        again under its own rid (a resend after a server's loss, or a forward, is a new message
        with ``origin``, which this does not judge), so this one is the same message again: applied
        once, then pruned (``prune``), it would be applied twice. Records ``low`` otherwise."""
        seen = self.lows.get(sender)
        if seen is not None and rid < seen:
            return True
        if low is not None and (seen is None or low > seen):
            self.lows[sender] = low
        return False

    def prune(self, sender: str, low: int) -> None:
        """``sender`` holds no update below rid ``low`` any more: none of them can come again."""
        if not self.applied:  # (every update asks)
            return
        for origin in [o for o in self.applied if o[0] == sender and o[1] < low]:
            del self.applied[origin]

    def forget(self, sender: str) -> None:
        """``sender`` is gone for good (declared lost): none of its updates can come again."""
        self.lows.pop(sender, None)
        for origin in [o for o in self.applied if o[0] == sender]:
            del self.applied[origin]

    def fresh(self, origin: tuple[str, int], table: str, keys: list[Hashable]) -> list[int] | None:
        """Positions of ``keys`` not yet applied here under ``origin`` (None: all of them)."""
        seen = self.applied.get(origin, {}).get(table)
        if not seen:
            return None
        done = set().union(*seen)
        keep = [j for j, key in enumerate(keys) if key not in done]
        return None if len(keep) == len(keys) else keep

    def record(self, origin: tuple[str, int], table: str, keys: list[Hashable]) -> None:
        """``keys`` (a list nobody changes afterwards) were applied under ``origin``."""
        if keys:
            self.applied.setdefault(origin, {}).setdefault(table, []).append(keys)

    def extract(self, shards: Collection[int]) -> list[list[Any]]:
        """Remove what is remembered of ``shards`` (leaving): ``[sender, rid, table, shard, keys]`` each."""
        out: list[list[Any]] = []
        n = self.num_shards
        for (sender, rid), by_table in list(self.applied.items()):
            for table, lists in list(by_table.items()):
                leaving: dict[int, list[Hashable]] = {}
                staying: list[Hashable] = []
                for keys in lists:
                    for key in keys:
                        shard = shard_of(key, n)
                        if shard in shards:
                            leaving.setdefault(shard, []).append(key)
                        else:
                            staying.append(key)
                out.extend([sender, rid, table, shard, keys] for shard, keys in leaving.items())
                if staying:
                    by_table[table] = [staying]
                else:
                    del by_table[table]
            if not by_table:
                del self.applied[(sender, rid)]
        return out

    def install(self, entries: list[list[Any]]) -> None:
        """Take what came with migrated shards (``extract``)."""
        for sender, rid, table, _shard, keys in entries:
            self.record((sender, int(rid)), table, list(keys))

    def clear(self) -> None:
        self.applied.clear()


class ShardStore:
    """The rows of the logical shards one server hosts: shard -> table -> key -> row."""

    def __init__(self, tables: dict[str, Table], shards: list[int], num_shards: int,
                 keeps_saved: bool = True) -> None:
        """``keeps_saved``: keep a copy of each row as last saved (what partial checkpoints score
        rows against). A job without partial checkpoints keeps none: a second copy of every row."""
        self.tables = tables
        self.keeps_saved = keeps_saved
        self.num_shards = num_shards
        self.shards: dict[int, dict[str, dict[Hashable, np.ndarray]]] = {
            s: {name: {} for name in tables} for s in shards
        }
        self.gets = 0
        self.updates = 0
        self.forward: dict[int, str] = {}  # shards that moved away -> where they went
        self.once = AppliedOnce(num_shards)  # the keys that updates which may come twice changed here
        # SCAR: each row's value as last saved in a checkpoint, and the round (its cid) it was saved in
        self.saved: dict[tuple[str, Hashable], np.ndarray] = {}
        self.saved_round: dict[tuple[str, Hashable], int] = {}
        # what a round still being written replaced of the saved copies, by its cid, to put back if
        # the master says it failed (``settle``): it saved nothing (a part the store refused, a
        # time-out), and rows ranked by their distance from values no checkpoint holds would be
        # passed over while the running checkpoint keeps them stale. The copies count as saved
        # from the round's copy on, so that they travel with a shard that migrates meanwhile (and
        # so do these entries: ``extract_staged``)
        self.staged: dict[int, list[tuple[str, int, Hashable, np.ndarray | None, int | None]]] = {}
        self.ended = RoundOutcomes()  # for entries that arrive with a shard after their round ended

    def split(self, keys: list[Hashable]) -> tuple[list[int] | None, dict[str, list[int]]]:
        """Positions of keys served here (None: all of them), and of keys whose shard moved
        (grouped by new server)."""
        if not self.forward:  # nothing ever moved away: the common case needs no look at the keys
            return None, {}
        local: list[int] = []
        remote: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            dest = self.forward.get(shard_of(key, self.num_shards))
            if dest is None:
                local.append(i)
            else:
                remote.setdefault(dest, []).append(i)
        return (None if len(local) == len(keys) else local), remote

    def extract(self, shards: list[int], dest: str) -> list[list[Any]]:
        """Remove shards for migration: ``[table, shard, keys, stacked rows]`` per non-empty table.

        From now on requests for them are forwarded to ``dest``. All or nothing: every shard is
        checked first (one not hosted here, or named twice, raised after the shards before it had
        been taken out, and their rows were lost).
        """
        absent = [shard for shard in shards if not (type(shard) is int and shard in self.shards)]
        if absent or len(set(shards)) != len(shards):
            raise TableError(f"cannot move shards {list(shards)!r:.200} to {dest}: "
                             + (f"{absent[:10]!r} not on this server" if absent else "some named twice"))
        out: list[list[Any]] = []
        for shard in shards:
            tables = self.shards.pop(shard)
            for name, rows in tables.items():
                if rows:
                    out.append([name, shard, list(rows), np.stack(list(rows.values()))])
            self.forward[shard] = dest
        return out

    def extract_saved(self, data: list[list[Any]]) -> list[list[Any]]:
        """Remove the saved copies of the rows ``extract`` gave (``data``), to travel with them:
        ``[table, keys, stacked copies, rounds saved in]`` per table and shard holding some. On
        the new server a row that arrived without its copy would count as never saved and come
        first in every partial round until saved again: after a scale-out, rows that did not
        move would fill the rounds while the rows that moved waited."""
        out: list[list[Any]] = []
        for name, _shard, keys, _rows in data:
            have = [k for k in keys if (name, k) in self.saved]
            if have:
                out.append([name, have, np.stack([self.saved.pop((name, k)) for k in have]),
                            np.array([self.saved_round.pop((name, k)) for k in have], np.int64)])
        return out

    def install_saved(self, saved: list[list[Any]]) -> None:
        """Take the saved copies that came with migrated rows (``extract_saved``)."""
        if not self.keeps_saved:
            return
        for name, keys, copies, rounds in saved:
            table = lookup(self.tables, name)
            for key, copy, round_ in zip(keys, copies, rounds, strict=True):
                self.saved[(table.name, key)] = np.array(copy, dtype=table.dtype, copy=True)
                self.saved_round[(table.name, key)] = int(round_)

    def extract_staged(self, shards: list[int]) -> list[list[Any]]:
        """Remove the undo entries of rounds still open for the rows of ``shards`` (leaving with
        them): ``[round, table, shard, key, copy replaced, round it was saved in]`` each, copy and
        round None where the row had none. Should the round fail, the new server puts them back:
        left here, they would be undone where the rows no longer are, and the copies the round made
        would stay the saved ones on the new server."""
        out: list[list[Any]] = []
        for round_, entries in self.staged.items():
            out.extend([round_, *e] for e in entries if e[1] in shards)
            entries[:] = [e for e in entries if e[1] not in shards]
        return out

    def install_staged(self, entries: list[list[Any]]) -> None:
        """Take the undo entries that came with migrated shards (``extract_staged``), after their
        rows and saved copies: kept for their round's end, or applied now if it already failed."""
        if not self.keeps_saved:
            return
        for round_, name, shard, key, row, saved_in in entries:
            table = lookup(self.tables, name)
            entry = (table.name, shard, key, None if row is None else np.array(row, dtype=table.dtype, copy=True),
                     None if saved_in is None else int(saved_in))
            ended = self.ended.ended(round_)
            if ended is None:
                self.staged.setdefault(round_, []).append(entry)
            elif not ended:
                self._undo([entry])

    def checked_arrival(self, shards: Any, data: Any, saved: Any, staged: Any, once: Any
                        ) -> tuple[list[list[Any]], list[list[Any]], list[list[Any]]]:
        """What a ``shard_data`` brings, every entry checked before anything is installed (as an
        update's rows are, ``Table.check_delta``): its shards, new here; rows ``[table, shard, keys,
        rows]`` of those shards, each key of its shard, the rows of the table's shape and a dtype
        that casts to its own; saved copies, undo entries and applied-once records of the same.
        Returns the rows, saved copies and undo entries, arrays in the tables' dtypes; TableError
        names the first entry that is wrong (a bad one raised part-way: installed in part, the
        rest of the shards' rows were lost)."""
        n = self.num_shards
        if not (all(type(s) is int and 0 <= s < n for s in shards) and len(set(shards)) == len(shards)):
            raise TableError(f"its shards {shards!r:.100} are not distinct shards of 0..{n - 1}")
        arriving = set(shards)

        def entry(kind: str, e: Any, size: int) -> list[Any]:
            if not ((type(e) is list or type(e) is tuple) and len(e) == size):
                raise TableError(f"a {kind} entry is not {size} fields: {e!r:.100}")
            return list(e)

        def keys_of(table: Table, keys: Any, shard: int | None, kind: str) -> list[Hashable]:
            checked = table.check_keys(keys)
            wrong = [k for k in checked if (at := shard_of(k, n)) not in arriving
                     or (shard is not None and at != shard)]
            if wrong:
                raise TableError(f"{kind} of table {table.name!r}: keys {wrong[:4]!r} are not of shard "
                                 f"{shard if shard is not None else sorted(arriving)}")
            return checked

        rows_out = []
        for e in data:
            name, shard, keys, rows = entry("rows", e, 4)
            table = lookup(self.tables, name)
            if not (type(shard) is int and shard in arriving):
                raise TableError(f"rows of table {table.name!r} for shard {shard!r:.20}, which does not arrive")
            keys = keys_of(table, keys, shard, "rows")
            rows_out.append([table.name, shard, keys,
                             table.check_delta(rows, n=len(keys), what=f"rows of shard {shard}")])
        saved_out = []
        for e in saved:
            name, keys, copies, rounds = entry("saved", e, 4)
            table = lookup(self.tables, name)
            keys = keys_of(table, keys, None, "saved copies")
            rounds = np.asarray(rounds)
            if rounds.shape != (len(keys),) or rounds.dtype.kind not in "iu":
                raise TableError(f"saved copies of table {table.name!r}: rounds {rounds!r:.60} are not an int per key")
            saved_out.append([table.name, keys, table.check_delta(copies, n=len(keys), what="saved copies"), rounds])
        staged_out = []
        for e in staged:
            round_, name, shard, key, row, saved_in = entry("undo", e, 6)
            table = lookup(self.tables, name)
            if not (type(round_) is int and type(shard) is int and shard in arriving
                    and (saved_in is None or type(saved_in) is int)):
                raise TableError(f"an undo entry of table {table.name!r} is malformed: {e!r:.100}")
            [key] = keys_of(table, [key], shard, "an undo entry")
            staged_out.append([round_, table.name, shard, key,
                               None if row is None else table.check_delta(row, what="an undo entry's row"), saved_in])
        for e in once:
            sender, rid, name, shard, keys = entry("applied-once", e, 5)
            if not (isinstance(sender, str) and type(rid) is int and type(shard) is int and shard in arriving):
                raise TableError(f"an applied-once entry is malformed: {e!r:.100}")
            keys_of(lookup(self.tables, name), keys, shard, "an applied-once entry")
        return rows_out, saved_out, staged_out

    def install(self, shards: list[int], data: list[list[Any]]) -> None:
        """Take over migrated shards (copies: received frames are read-only)."""
        for shard in shards:
            self.forward.pop(shard, None)
            self.shards.setdefault(shard, {name: {} for name in self.tables})
        for name, shard, keys, rows in data:
            table = lookup(self.tables, name)
            target = self.shards[shard][table.name]
            for key, row in zip(keys, rows, strict=True):
                target[key] = np.array(row, dtype=table.dtype, copy=True)

    def rows_snapshot(self) -> list[tuple[str, int, Hashable, np.ndarray]]:
        """A copy of every row: ``(table, shard, key, row)``."""
        return [(name, shard, key, row.copy()) for shard, tables in self.shards.items()
                for name, rows in tables.items() for key, row in rows.items()]

    def reload(self, shards: list[int], where: dict[str, Any] | None) -> None:
        """Full recovery: serve exactly ``shards``, every row as the checkpoint holds it (or
        fresh), forgetting what partial checkpoints had saved. Read first: a store that fails
        leaves the server as it was, to be asked again."""
        rows = self.read_rows(where, set(shards)) if where is not None else None
        self.forward.clear()
        self.saved.clear()
        self.saved_round.clear()
        self.staged.clear()
        self.once.clear()  # the workers dropped every update of the abandoned timeline
        self.shards = {}
        self.adopt(shards, rows)

    def adopt(self, shards: list[int], rows: list[tuple[str, int, Hashable, np.ndarray]] | None) -> None:
        """Take over shards whose server died: empty, then filled with ``rows`` from a checkpoint
        (``read_rows``) if there is one."""
        for shard in shards:
            self.forward.pop(shard, None)
            self.shards[shard] = {name: {} for name in self.tables}
        if rows is not None:
            self.install_rows(rows)

    def restore(self, where: dict[str, Any]) -> None:
        """Load the rows of the shards hosted here from a checkpoint (a resume)."""
        self.install_rows(self.read_rows(where, set(self.shards)))

    def read_rows(self, where: dict[str, Any], shards: set[int]) -> list[tuple[str, int, Hashable, np.ndarray]]:
        """The rows of ``shards`` in a checkpoint: the base's, then each partial one's after it
        (SCAR), in order, so that installed in order a later copy of a row replaces an earlier
        one. Every file is read; rows of other shards are skipped. It only reads (the tables'
        declarations): a partial recovery runs it on a thread while the loop serves."""
        from litz.ft import storage  # only here and where checkpoints are written (see litz.runtime.node)

        fs, _ = storage.filesystem(where["location"])
        out = []
        for path, files in [(where["path"], where["files"]), *where.get("partials", [])]:
            for name in files:
                for table_name, shard, key, raw in storage.read_shards(fs, f"{path}/{name}"):
                    if shard in shards:
                        table = lookup(self.tables, table_name)
                        out.append((table.name, shard, key, np.frombuffer(raw, dtype=table.dtype).reshape(table.shape)))
        return out

    def install_rows(self, rows: list[tuple[str, int, Hashable, np.ndarray]]) -> None:
        """Host rows read from a checkpoint (``read_rows``) in their shards, which are hosted here.
        They are what the running checkpoint holds: saved at some round before now, counted as the oldest."""
        restored = []
        for name, shard, key, raw in rows:
            row = raw.copy()  # (writable: read rows are views of the file's buffers)
            self.shards[shard][name][key] = row
            if self.keeps_saved:
                restored.append((name, shard, key, row.copy()))
        self.remember(restored, 0)

    def remember(self, rows: list[tuple[str, int, Hashable, np.ndarray]], round_: int) -> None:
        """These copies are now what the checkpoint holds for their rows, saved in round ``round_``
        (a checkpoint's cid: rounds are numbered by the master, so ages compare across servers)."""
        if not self.keeps_saved:
            return
        for name, _, key, row in rows:
            self.saved[(name, key)] = row
            self.saved_round[(name, key)] = round_

    def stage(self, rows: list[tuple[str, int, Hashable, np.ndarray]], round_: int) -> None:
        """These copies are being written in round ``round_``: saved now, put back as they were if
        the round fails (``settle``)."""
        if not self.keeps_saved:
            return
        self.staged.setdefault(round_, []).extend(  # (a shard that arrived may have brought some)
            (name, shard, key, self.saved.get((name, key)), self.saved_round.get((name, key)))
            for name, shard, key, _ in rows)
        self.remember(rows, round_)

    def settle(self, round_: int, ok: bool) -> None:
        """Round ``round_`` ended: complete (its copies stay the saved ones) or failed (the saved
        copies it replaced are put back; a shard that moved away since took its entries along)."""
        self.ended.record(round_, ok)
        undo = self.staged.pop(round_, None)
        if not ok and undo:
            self._undo(undo)

    def _undo(self, entries: list[tuple[str, int, Hashable, np.ndarray | None, int | None]]) -> None:
        for name, shard, key, row, saved_in in reversed(entries):  # the latest first: the earliest copy stays
            if shard not in self.shards:
                continue
            if row is None or saved_in is None:
                self.saved.pop((name, key), None)
                self.saved_round.pop((name, key), None)
            else:
                self.saved[(name, key)], self.saved_round[(name, key)] = row, saved_in

    def scores(self, policy: str, round_: int, skip: Collection[int] = ()
               ) -> tuple[list[tuple[str, int, Hashable]], np.ndarray]:
        """Every row hosted here (but in the shards ``skip``) with its claim to be saved next:
        ``priority``, the table's distance (L2 unless the table says otherwise) from its saved
        value; ``round-robin``, the rounds since it was saved (``round_`` is this one's);
        ``random``, a draw. A row never saved comes first under the first two."""
        entries = [(name, shard, key) for shard, tables in self.shards.items() if shard not in skip
                   for name, rows in tables.items() for key in rows]
        if policy == "random":
            return entries, np.random.default_rng(round_).random(len(entries))
        out = np.empty(len(entries))
        for i, (name, shard, key) in enumerate(entries):
            saved = self.saved.get((name, key))
            if saved is None:
                out[i] = np.inf
            elif policy == "priority":
                out[i] = self.tables[name].distance_from_saved(self.shards[shard][name][key], saved)
            else:
                out[i] = round_ - self.saved_round[(name, key)]
        return entries, out

    def _stored(self, table: Table, keys: list[Hashable]) -> list[np.ndarray]:
        """The stored rows of checked keys (created on first touch), in order; raises, before
        anything is created, if a key's shard is not here."""
        n, shards, name = self.num_shards, self.shards, table.name
        out: list[Any] = []
        absent: list[tuple[int, dict[Hashable, np.ndarray], Hashable]] = []
        for key in keys:  # one pass, the shard inlined for int keys: every row a task reads or updates comes here
            shard = key % n if type(key) is int else shard_of(key, n)
            tables = shards.get(shard)
            if tables is None:
                raise TableError(f"table {name!r} key {key!r}: shard {shard} is not on this server")
            rows = tables[name]
            row = rows.get(key)
            if row is None:
                absent.append((len(out), rows, key))
            out.append(row)
        for i, rows, key in absent:  # created only once every key's shard was found here
            row = rows.get(key)  # a key listed twice is created once
            if row is None:
                row = rows[key] = table.initial_row(key)
            out[i] = row
        return out

    def get(self, table_name: Any, keys: list[Any]) -> np.ndarray:
        """The rows for ``keys`` stacked into one array (n, *row_shape)."""
        table = lookup(self.tables, table_name)
        return self.get_checked(table, table.check_keys(keys))

    def get_checked(self, table: Table, keys: list[Hashable]) -> np.ndarray:
        """``get`` of keys already checked by ``table.check_keys``."""
        out = np.empty((len(keys), *table.shape), table.dtype)
        for i, row in enumerate(self._stored(table, keys)):
            out[i] = row
        self.gets += len(keys)
        return out

    def update(self, table_name: Any, keys: list[Any], deltas: Any) -> None:
        """Apply stacked deltas to ``keys``: validated whole first, so a refused item changes nothing."""
        table = lookup(self.tables, table_name)
        keys = table.check_keys(keys)
        if not isinstance(deltas, np.ndarray):
            raise TableError(f"table {table.name!r}: deltas must be an array, got {type(deltas).__name__}")
        self.update_checked(table, keys, table.check_delta(deltas, n=len(keys), what="update"))

    def update_checked(self, table: Table, keys: list[Hashable], deltas: np.ndarray) -> None:
        """``update`` of keys and deltas already checked by the table."""
        rows = self._stored(table, keys)
        if table.comb.atomic:  # raises before anything is applied, or applies everything
            table.comb.apply_many(rows, deltas)
        else:  # one that may raise part-way works on copies (a key listed twice: one copy), then they land
            copies = {id(row): row.copy() for row in rows}
            table.comb.apply_many([copies[id(row)] for row in rows], deltas)
            for row in rows:
                row[...] = copies[id(row)]
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
            except Exception as exc:
                values.append(None)
                errors.append(item_error(item, exc))
        return values, errors

    def handle_update(self, items: list[Any]) -> list[Any]:
        """Apply a batched update: one error (or None) per item."""
        errors: list[Any] = []
        for item in items:
            try:
                table_name, keys, deltas = item
                self.update(table_name, keys, deltas)
                errors.append(None)
            except Exception as exc:
                errors.append(item_error(item, exc))
                log.warning("refused an update: %s", errors[-1])
        return errors

    def snapshot(self, table_name: str) -> dict[Hashable, np.ndarray]:
        """Every materialised row of a table on this server (copies)."""
        out: dict[Hashable, np.ndarray] = {}
        for tables in self.shards.values():
            for key, row in tables[table_name].items():
                out[key] = row.copy()
        return out


class _Pending:
    """A request partly forwarded to the servers its shards moved to: its reply waits for theirs."""

    __slots__ = ("requester", "rid", "kind", "values", "errors", "outstanding", "moved", "origin")

    def __init__(self, requester: str, rid: int, kind: str, n: int, origin: list[Any] | None = None) -> None:
        self.requester = requester
        self.rid = rid
        self.kind = kind
        self.origin = origin  # an update's [worker, rid, low] (AppliedOnce), which its forwarded parts carry
        self.values: list[Any] = [None] * n
        self.errors: list[Any] = [None] * n
        self.outstanding = 0
        self.moved: dict[int, str] = {}


class ServerNode(Node):
    """A server process: hosts a ShardStore, answers get/update requests, migrates shards.

    A request for a shard that moved away is forwarded to where it went (which may forward
    again), and the answer is sent back to the requester as one reply, with a hint of the
    new location so that workers learn the new map lazily. Updates that reach the old owner
    are forwarded in order behind the shard itself, so none is lost or applied twice (nor when
    the forwarding server dies before it answers and the worker sends the update again:
    ``AppliedOnce``).
    """

    role = "server"
    store: ShardStore | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sub_rid = 0
        # forwarded request id -> (the request, its parts [(item, positions)], where to, the sub-items)
        self._subs: dict[int, tuple[_Pending, list[tuple[int, list[int]]], str, list[Any]]] = {}
        self._route_acks: list[tuple[str, int, set[str]]] = []  # (master, rid, gone) to answer
        self._scored: dict[int, list[tuple[str, int, Hashable]]] = {}  # partial round -> rows scored
        # shard -> the last partial round that scored it, here or on the server it came from
        self._scored_in: dict[int, int] = {}
        # rows of the round in ``_scored`` whose shard migrated before the round's save, as they
        # left: the round chose among them here, and their new server does not score them again
        self._left: dict[tuple[str, Hashable], np.ndarray] = {}
        self.abandoned_mids = 0  # migrations up to this id belong to a timeline rolled back
        self._mids_in = RecentIds(1 << 12)  # shard migrations received (one sent again is refused)
        self._abandoned_to: set[str] = set()  # dead servers of a rollback under way: forward nothing there
        self._rollback_from: tuple[str, int] | None = None  # (master, round) owed "rolled_back" (on_rollback)
        self.forwarded = 0
        self.shards_out = 0
        self.shards_in = 0

    def on_init_server(self, msg: Message) -> None:
        try:
            tables = table_index(cloudpickle.loads(msg["tables"]))
            for table in tables.values():
                table.warm_up()
            self.store = ShardStore(tables, list(msg["shards"]), msg["num_shards"],
                                    keeps_saved=msg.get("partial", False))
            if msg.get("restore"):
                self.store.restore(msg["restore"])
            self.master = msg["master"]
            if msg.get("checkpoints"):
                from litz.ft import storage

                self.in_background(storage.warm_up, lambda _r, _e: None)
            self.endpoint.send(msg.sender, "ready", role=self.role)
        except Exception as exc:
            self.endpoint.send(msg.sender, "ready", role=self.role, error=f"{type(exc).__name__}: {exc}")

    def _store(self) -> ShardStore:
        if self.store is None:
            raise LitzError("server not initialised yet")
        return self.store

    def on_fence(self, msg: Message) -> None:
        """A process declared lost sends nothing again: what is remembered of its updates goes
        (``AppliedOnce``; it is pruned only by the sender's own later messages)."""
        super().on_fence(msg)
        if msg.sender == self.master and self.store is not None:
            self.store.once.forget(str(msg["ident"]))

    # -- requests ------------------------------------------------------------------------------
    def on_get(self, msg: Message) -> None:
        self._serve(msg, "get")

    def on_update(self, msg: Message) -> None:
        self._serve(msg, "update")

    def _serve(self, msg: Message, kind: str) -> None:
        store = self._store()
        items = msg["items"]
        origin = msg.get("origin")  # a forwarded or resent update: it names its first sending (AppliedOnce)
        once = None if origin is None else (str(origin[0]), int(origin[1]))
        if once is not None:
            store.once.prune(once[0], int(origin[2]))
        elif kind == "update":  # straight from its sender: it is this origin, which its forwarded parts name
            if store.once.answered(msg.sender, msg["rid"], msg.get("low")):
                reason = (f"{self.ident} refused update {msg['rid']} from {msg.sender}: it was answered already (a "
                          f"later update said {store.once.lows[msg.sender]} was the lowest unanswered); not applied "
                          "again")
                log.warning("%s", reason)
                self.endpoint.send(msg.sender, "error", rid=msg["rid"], reason=reason, about="update")
                return
            origin = [msg.sender, msg["rid"], msg.get("low", msg["rid"])]
            once = (msg.sender, int(msg["rid"]))
            store.once.prune(msg.sender, origin[2])
        pend = _Pending(msg.sender, msg["rid"], kind, len(items), origin)
        subs: dict[str, list[tuple[int, list[int], list[Any]]]] = {}
        for i, item in enumerate(items):
            try:
                name, keys = item[0], item[1]
                table = lookup(store.tables, name)
                keys = table.check_keys(keys)
                if kind == "update":
                    deltas = item[2]
                    if not isinstance(deltas, np.ndarray):
                        raise TableError(f"table {table.name!r}: deltas must be an array")
                    deltas = table.check_delta(deltas, n=len(keys), what="update")
                    if once is not None and (keep := store.once.fresh(once, table.name, keys)) is not None:
                        if not keep:  # all applied already: an application's combiner need not take 0 rows
                            continue
                        keys, deltas = [keys[j] for j in keep], deltas[keep]
                local, remote = store.split(keys)
                if kind == "get":
                    if local is None:  # the common case: no second copy of a big read
                        pend.values[i] = store.get_checked(table, keys)
                    else:
                        out = np.empty((len(keys), *table.shape), table.dtype)
                        if local:
                            out[local] = store.get_checked(table, [keys[j] for j in local])
                        pend.values[i] = out
                else:
                    if local is None:
                        store.update_checked(table, keys, deltas)
                    elif local:
                        store.update_checked(table, [keys[j] for j in local], deltas[local])
                    if once is not None:
                        store.once.record(once, table.name, keys if local is None else [keys[j] for j in local])
                for dest, idx in remote.items():
                    sub = [table.name, [keys[j] for j in idx]]
                    if kind == "update":
                        sub.append(deltas[idx])
                    subs.setdefault(dest, []).append((i, idx, sub))
                    for j in idx:
                        pend.moved[shard_of(keys[j], store.num_shards)] = dest
            except Exception as exc:  # Litz's checks, or the application's combiner or initializer raising
                pend.values[i] = None
                pend.errors[i] = item_error(item, exc)
                if kind == "update":
                    log.warning("refused an update: %s", pend.errors[i])
        self._send_subs(pend, subs)
        if not pend.outstanding:
            self._reply(pend)

    def _send_subs(self, pend: _Pending, subs: dict[str, list[tuple[int, list[int], list[Any]]]]) -> None:
        """Forward parts of a request: to each server, ``(item, positions, sub-item)`` triples."""
        for dest, parts in subs.items():
            if dest in self._abandoned_to:  # (on_rollback)
                if pend.kind == "get":
                    for i, _, _ in parts:
                        pend.values[i], pend.errors[i] = None, ROLLED_BACK
                continue
            self._sub_rid += 1
            items = [sub for _, _, sub in parts]
            try:
                self.endpoint.send(dest, pend.kind, rid=self._sub_rid, items=items,
                                   **({"origin": pend.origin} if pend.origin is not None else {}))
            except Exception as exc:  # (no address for it, say): these items fail, naming it; the rest go on
                why = f"forwarding to {dest}, where its shard moved, failed: {type(exc).__name__}: {exc}"
                log.error("%s: %s %s of %s (request %r): %s", self.ident, pend.kind, [sub[:2] for sub in items],
                          pend.requester, pend.rid, why)
                for i, _, sub in parts:
                    pend.values[i], pend.errors[i] = None, f"table {sub[0]!r} keys {sub[1][:4]!r}: {why}"
                continue
            self._subs[self._sub_rid] = (pend, [(i, idx) for i, idx, _ in parts], dest, items)
            pend.outstanding += 1
            self.forwarded += 1

    def _reply(self, pend: _Pending) -> None:
        extra: dict[str, Any] = {"moved": pend.moved} if pend.moved else {}
        try:
            if pend.kind == "get":
                self.endpoint.send(pend.requester, "get_reply", rid=pend.rid, values=pend.values, errors=pend.errors,
                                   **extra)
            else:
                self.endpoint.send(pend.requester, "update_ack", rid=pend.rid, errors=pend.errors, **extra)
        except Exception as exc:  # (a stranger, with no address): nobody to answer; the caller goes on
            log.error("%s: cannot answer %s request %r of %s: %s: %s", self.ident, pend.kind, pend.rid, pend.requester,
                      type(exc).__name__, exc)

    def _sub_done(self, rid: int, values: list[Any] | None, errors: list[Any], moved: dict[int, str],
                  sender: str | None = None) -> None:
        """The answer to forwarded request ``rid`` (from ``sender``; None: this server's own verdict):
        its parts go into the original request, answered once every part is in.

        Checked before it is taken: only the server it went to may answer it, and it must give an
        error (or, for a read, a value) per item, each value the rows asked for (an array of the
        table's row shape and dtype, one row per key). The entry was taken out first, and a reply
        that was short or held the wrong rows raised: the original requester was never answered.
        A malformed reply fails its items, naming the server, the request, the table and the keys."""
        entry = self._subs.get(rid)
        if entry is None:
            log.warning("%s: reply to unknown forwarded request %r", self.ident, rid)
            return
        pend, parts, dest, items = entry
        if sender is not None and sender != dest:
            log.warning("%s: %s answered forwarded request %r, which went to %s: dropped", self.ident, sender, rid,
                        dest)
            return
        del self._subs[rid]
        bad = None
        if len(errors) != len(parts) or (values is not None and len(values) != len(parts)):
            bad = (f"{len(errors)} errors" + (f" and {len(values)} values" if values is not None else "")
                   + f" for {len(parts)} items")
        tables = self.store.tables if self.store is not None else {}
        for n, (i, idx) in enumerate(parts):
            why = bad
            if why is None and errors[n] is None and values is not None and pend.values[i] is not None:
                rows, table = values[n], tables.get(items[n][0])
                if table is None or not (type(rows) is np.ndarray and rows.shape[:1] == (len(idx),)
                                         and rows.shape[1:] == table.shape and rows.dtype == table.dtype):
                    why = (f"{_described(rows)} for {len(idx)} rows"
                           + (f" of shape {table.shape} and dtype {table.dtype}" if table is not None else ""))
            if why is not None:
                why = f"table {items[n][0]!r} keys {items[n][1][:4]!r}: forwarded to {dest} as request {rid}, " \
                      f"its reply was malformed: {why}"
                log.error("%s: %s (for %s's %s %r)", self.ident, why, pend.requester, pend.kind, pend.rid)
                pend.errors[i], pend.values[i] = why, None
            elif errors[n] is not None:
                pend.errors[i] = errors[n]
                pend.values[i] = None
            elif values is not None and pend.values[i] is not None:
                pend.values[i][idx] = values[n]
        n = self.store.num_shards if self.store is not None else 0
        hints = {s: d for s, d in moved.items() if type(s) is int and 0 <= s < n and isinstance(d, str)}
        if len(hints) != len(moved):
            log.warning("%s: ignored malformed hints in %s's answer to forwarded request %r: %.100r", self.ident,
                        dest, rid, moved)
        pend.moved.update(hints)
        pend.outstanding -= 1
        if not pend.outstanding:
            self._reply(pend)
        self._answer_routes()
        self._answer_rollback()

    def on_get_reply(self, msg: Message) -> None:
        self._sub_done(msg["rid"], msg["values"], msg["errors"], msg.get("moved") or {}, msg.sender)

    def on_update_ack(self, msg: Message) -> None:
        self._sub_done(msg["rid"], None, msg["errors"], msg.get("moved") or {}, msg.sender)

    def on_error(self, msg: Message) -> None:
        rid = msg.get("rid")
        entry = self._subs.get(rid) if isinstance(rid, int) else None
        if entry is not None:
            self._sub_done(rid, None, [msg["reason"]] * len(entry[1]), {}, msg.sender)
        else:
            log.error("%s: error from %s: %s", self.ident, msg.sender, msg["reason"])

    # -- shard migration ---------------------------------------------------------------------------
    def on_routes(self, msg: Message) -> None:
        """Servers left: forward what went to them where the master says; answer when none is pending."""
        store = self._store()
        smap, gone = checked_shard_map(msg, store.num_shards), set(msg["gone"])
        targets = {smap[shard] for shard, dest in store.forward.items() if dest in gone}
        if targets & gone:
            raise LitzError(f"routes from {msg.sender} sends shards of the leaving servers {sorted(gone)} to "
                            f"{sorted(targets & gone)}, which leave too")
        if self.awaits_peers(msg, targets):
            return
        for shard, dest in list(store.forward.items()):
            if dest in gone:
                if smap[shard] == self.ident:  # cannot happen once installed here; be safe
                    del store.forward[shard]
                else:
                    store.forward[shard] = smap[shard]
        self._route_acks.append((msg.sender, msg["rid"], gone))
        self._answer_routes()

    def _answer_routes(self) -> None:
        if not self._route_acks:
            return
        busy = {entry[2] for entry in self._subs.values()}
        for entry in [e for e in self._route_acks if not (e[2] & busy)]:
            self._route_acks.remove(entry)
            self.endpoint.send(entry[0], "routes_ack", rid=entry[1])

    def on_migrate_shards(self, msg: Message) -> None:
        if msg.get("dest_addr"):
            self.endpoint.connect(msg["dest"], msg["dest_addr"])
        store = self._store()
        if msg["dest"] == self.ident or not self.endpoint.knows(msg["dest"]):  # the shards would go nowhere
            raise TableError(f"cannot move shards {msg['shards']!r:.200} of migration {msg['mid']} to {msg['dest']!r}: "
                             + ("it is this server" if msg["dest"] == self.ident else "no address known for it"))
        data = store.extract(list(msg["shards"]), msg["dest"])
        saved, staged = store.extract_saved(data), store.extract_staged(list(msg["shards"]))
        scored = [[s, self._scored_in.pop(s)] for s in msg["shards"] if s in self._scored_in]
        if self._scored:  # a round scored these rows and has not saved them yet
            self._left.update(((name, key), row) for name, _, keys, rows in data
                              for key, row in zip(keys, rows, strict=True))
        once = store.once.extract(set(msg["shards"]))
        self.shards_out += len(msg["shards"])
        self.endpoint.send(msg["dest"], "shard_data", mid=msg["mid"], shards=msg["shards"], data=data,
                           source=self.ident, **({"saved": saved} if saved else {}),
                           **({"staged": staged} if staged else {}), **({"scored": scored} if scored else {}),
                           **({"once": once} if once else {}))

    def on_settle(self, msg: Message) -> None:
        """The source of shard migration ``mid`` died: say whether its shards arrived here."""
        store = self._store()
        self.endpoint.send(msg.sender, "settled", mid=msg["mid"], holds=all(s in store.shards for s in msg["items"]))

    def on_shard_data(self, msg: Message) -> None:
        if msg["mid"] <= self.abandoned_mids:  # sent before a rollback reloaded every shard
            log.warning("%s: dropped shards %s of migration %d, abandoned by a rollback", self.ident,
                        msg["shards"], msg["mid"])
            return
        if msg["mid"] in self._mids_in:  # sent again: installed, it put back rows updated since
            log.warning("%s: refused shards %.100r of migration %d from %s: they arrived already", self.ident,
                        msg["shards"], msg["mid"], msg.sender)
            return
        self._mids_in.take(msg["mid"])
        hosted = [s for s in msg["shards"] if type(s) is int and s in self._store().shards]
        if hosted:
            self._shard_data_refused(msg, f"shards {hosted} are hosted here already")
            return
        store = self._store()
        try:  # every entry first: a bad one raised part-way, some rows installed, others lost
            data, saved, staged = store.checked_arrival(msg["shards"], msg["data"], msg.get("saved", []),
                                                        msg.get("staged", []), msg.get("once", []))
            scored = [(int(s), int(cid)) for s, cid in msg.get("scored", []) if type(s) is int and type(cid) is int]
            if len(scored) != len(msg.get("scored", [])):
                raise TableError(f"its scored entries are not [shard, round] each: {msg['scored']!r:.100}")
        except (TableError, TypeError, ValueError) as exc:
            self._shard_data_refused(msg, str(exc))
            return
        store.install(list(msg["shards"]), data)
        store.install_saved(saved)
        store.install_staged(staged)
        self._scored_in.update(scored)
        store.once.install(msg.get("once", []))
        self.shards_in += len(msg["shards"])
        assert self.master is not None
        self.endpoint.send(self.master, "shards_moved", mid=msg["mid"], shards=msg["shards"])

    def _shard_data_refused(self, msg: Message, why: str) -> None:
        """Refuse shard migration ``msg`` whole, telling the master (which waits for the shards, and
        stops the job: their rows travelled in this message only)."""
        reason = (f"{self.ident} refused the shards {msg['shards']!r:.100} of migration {msg['mid']} from "
                  f"{msg.sender}: {why}")
        log.error("%s", reason)
        assert self.master is not None
        self.endpoint.send(self.master, "error", reason=reason, about="shard_data")

    # -- SCAR partial checkpoints -----------------------------------------------------------------
    def on_ckpt_scores(self, msg: Message) -> None:
        """Score every row for a partial checkpoint; the master picks the global top fraction.
        Not the rows of a shard that arrived already scored in this round (by the server it left,
        whose message came first): the round would choose among them twice, and save more than
        its fraction."""
        cid = msg["cid"]
        try:
            store = self._store()
            entries, scores = store.scores(msg["policy"], cid, {s for s, c in self._scored_in.items() if c == cid})
        except LitzError as exc:  # e.g. an application's distance function failed: this round is lost
            self.endpoint.send(msg.sender, "ckpt_scores_reply", cid=msg["cid"], scores=np.empty(0),
                               error=f"{self.ident}: {exc}")
            return
        self._scored = {cid: entries}  # one round at a time: an earlier one failed, or ended
        self._left.clear()
        self._scored_in.update(dict.fromkeys(store.shards, cid))
        self.endpoint.send(msg.sender, "ckpt_scores_reply", cid=cid, scores=scores)

    def on_ckpt_save(self, msg: Message) -> None:
        """Save the chosen rows (as they are now) into a partial checkpoint, in the background.
        A row whose shard migrated since it was scored is saved as it left (a value it had);
        only its new server's copies say what is saved (it is chosen again in a later round)."""
        left, self._left = self._left, {}
        if self.part_refused(msg):
            return
        store = self._store()
        entries = self._scored.pop(msg["cid"], [])
        chosen = [entries[i] for i in msg["rows"]]
        rows = [(name, shard, key, store.shards[shard][name][key].copy())
                for name, shard, key in chosen if shard in store.shards]
        store.stage(rows, msg["cid"])
        rows += [(name, shard, key, left[(name, key)]) for name, shard, key in chosen
                 if shard not in store.shards and (name, key) in left]
        from litz.ft import storage

        self.checkpoint_part(msg, f"shards-{self.ident}.arrow", lambda fs, path: storage.write_shards(fs, path, rows))

    def on_checkpoint_done(self, msg: Message) -> None:
        """A round ended, complete or failed: what it copied counts as saved, or not (``settle``)."""
        if self._scored.pop(msg["cid"], None) is not None:  # failed before its save reached here
            self._left.clear()
        if self.store is not None:
            self.store.settle(msg["cid"], msg["ok"])

    # -- SCAR partial recovery --------------------------------------------------------------------
    def on_restore_shards(self, msg: Message) -> None:
        """Host shards of a server that died, with their rows from the running checkpoint (or
        fresh rows if there is none yet); answer once they are served here. The rows are read on
        a thread: meanwhile this server serves its own shards."""
        store, shards, where = self._store(), list(msg["shards"]), msg.get("restore")

        def host(rows: list[tuple[str, int, Hashable, np.ndarray]] | None) -> None:
            store.adopt(shards, rows)
            self.shards_in += len(shards)
            self.endpoint.send(msg.sender, "shards_restored", shards=msg["shards"], round=msg.get("round", 0))

        if where is None:
            host(None)
        else:
            self.restore_on_thread(msg, lambda: store.read_rows(where, set(shards)), host, "shards_restored")

    def on_rollback(self, msg: Message) -> None:
        """Full recovery begins: parts of requests forwarded to a lost server (a shard that had
        moved there) would never be answered, and the worker that sent the request waits for its
        acknowledgement before it may say it rolled back. They count as answered now, and so
        does any part forwarded there later (an update still on its way here): the timeline is
        abandoned and every shard reloads from the checkpoint."""
        self._abandoned_to |= set(msg["lost"])
        self.restore_gen += 1  # a partial recovery's read under way is abandoned with its timeline
        self._rollback_from = (msg.sender, int(msg["round"]))
        for rid, (pend, parts, dest, _) in list(self._subs.items()):
            if dest in self._abandoned_to:  # an update is dropped with its timeline; a read fails
                self._sub_done(rid, None, [ROLLED_BACK if pend.kind == "get" else None] * len(parts), {})
        self._answer_rollback()

    def _answer_rollback(self) -> None:
        """Say "rolled back" once nothing this server forwarded to a live server is unanswered: an
        update it forwarded (the driver's, say, for a shard that had moved on) must land before
        the servers reload, or it lands on the reloaded rows, from the abandoned timeline (the
        master used to wait for the workers only, whose own updates are acknowledged first)."""
        if self._rollback_from is not None and not self._subs:
            master, round_ = self._rollback_from
            self._rollback_from = None
            self.endpoint.send(master, "rolled_back", round=round_)

    def on_reload_shards(self, msg: Message) -> None:
        """Full recovery: every worker has stopped and its updates have landed; start the new
        timeline from the checkpoint."""
        self._subs.clear()
        self._abandoned_to.clear()  # (no update of the abandoned timeline is still on its way)
        self._rollback_from = None
        self._scored.clear()
        self._scored_in.clear()
        self._left.clear()
        self.restore_gen += 1
        self.abandoned_mids = max(self.abandoned_mids, msg.get("abandoned", 0))
        try:
            self._store().reload(list(msg["shards"]), msg.get("restore"))
        except Exception as exc:  # asked again, the reload starts over
            if not self.restore_failed(msg, exc, "reloaded"):
                raise
            return
        self.endpoint.send(msg.sender, "reloaded", round=msg["round"])

    def on_server_lost(self, msg: Message) -> None:
        """A server died: forward to the new owners of its shards, and send again what it never answered."""
        store = self._store()
        lost, shard_map = msg["server"], checked_shard_map(msg, store.num_shards)
        resent = any(dest == lost for _, _, dest, _ in self._subs.values())  # to any owner of their keys
        targets = set(shard_map) if resent else {shard_map[s] for s, dest in store.forward.items() if dest == lost}
        if lost in targets:
            raise LitzError(f"server_lost from {msg.sender} sends the shards of the lost {lost} to {lost}")
        if self.awaits_peers(msg, targets):
            return
        for shard, dest in list(store.forward.items()):
            if dest == lost:
                store.forward[shard] = shard_map[shard]
        for rid, (pend, parts, dest, items) in list(self._subs.items()):
            if dest != lost:
                continue
            del self._subs[rid]
            pend.outstanding -= 1
            subs: dict[str, list[tuple[int, list[int], list[Any]]]] = {}
            for (i, idx), sub in zip(parts, items, strict=True):
                by_owner: dict[str, list[int]] = {}
                for j, key in enumerate(sub[1]):
                    by_owner.setdefault(shard_map[shard_of(key, store.num_shards)], []).append(j)
                for owner, js in by_owner.items():
                    part = [sub[0], [sub[1][j] for j in js], *([sub[2][js]] if pend.kind == "update" else [])]
                    subs.setdefault(owner, []).append((i, [idx[j] for j in js], part))
            self._send_subs(pend, subs)
            if not pend.outstanding:
                self._reply(pend)

    # -- checkpoints ---------------------------------------------------------------------------
    def on_checkpoint(self, msg: Message) -> None:
        """Copy every row now (training resumes at once), write the copy in the background."""
        if self.part_refused(msg):
            return
        rows = self._store().rows_snapshot()
        self._store().stage(rows, msg["cid"])
        from litz.ft import storage

        self.checkpoint_part(msg, f"shards-{self.ident}.arrow",
                             lambda fs, path: storage.write_shards(fs, path, rows))

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.store is not None:
            out.update(rows_read=self.store.gets, rows_updated=self.store.updates, shards=sorted(self.store.shards))
        out.update(forwarded=self.forwarded, shards_out=self.shards_out, shards_in=self.shards_in,
                   pending_forwards=len(self._subs))
        return out

    def owed(self) -> int:
        """Forwarded requests whose replies this server still has to pass on."""
        return len(self._subs)

    def loop(self) -> None:
        while not self.stopping:
            self.poll(50 if self._leaving else 500)
            self.leave_when_settled()


if __name__ == "__main__":
    exit_process(main(ServerNode))
