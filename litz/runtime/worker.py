"""Worker process: hosts executors, runs their micro-tasks in greenlets, owns cache and update log.

The hub (the process's main greenlet) owns the sockets. Each micro-task runs in a greenlet;
``ps.get`` on a miss registers with the cache and switches back to the hub, which batches
the fetches of all tasks per server into one message, and resumes a task once every key it
waits for has arrived. An executor runs its tasks one at a time, in dispatch order.

Completions are buffered and sent to the master only after every update sent before them
has been acknowledged by the servers (DESIGN.md §2, rule 1). Updates are sent in flushes
of the update log: when nothing is runnable, when the log is large, or when a completion
has waited longer than the flush interval. A task's own updates join the log when it returns:
a task that raises leaves none behind (its retry would otherwise count them twice).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import greenlet
import numpy as np

from litz.api import Executor, ParameterServer, StateRows
from litz.errors import LitzError, TableError
from litz.ft.checkpoint import RoundOutcomes, RowSaves, RowScoring
from litz.ps.cache import ProcessCache
from litz.ps.tables import Table, lookup, shard_of, table_index
from litz.ps.update_log import UpdateLog
from litz.runtime.node import Node, RecentIds, checked_shard_map, exit_process, main, proc_key
from litz.runtime.protocol import Message, pack_object, snapshot, undecodable_in, unpack_object

log = logging.getLogger(__name__)

#: seconds a server named in a hint that could not be looked up (unknown, or etcd away) is not asked for again
UNKNOWN_SERVER_WAIT = 5.0
#: task ids a worker remembers having queued or run, to refuse one sent again (it ran twice, its
#: updates applied twice); past this many the oldest are forgotten
RECENT_TASKS = 1 << 14
#: migrations a worker or server remembers having received (to refuse one sent again)
RECENT_MIGRATIONS = 1 << 12

DEFAULT_OPTIONS: dict[str, Any] = {
    "cache": True,  # use the version-tagged process cache
    "update_log": True,  # merge updates in the log (False: one message per ps.update)
    "flush_bytes": 8 << 20,  # flush the log when it holds this much
    "flush_interval": 0.005,  # ... or when a completion has waited this long (seconds)
    # reads and updates are cut into items of at most this many bytes, each its own frame: buffers
    # this size are reused by malloc, where a frame of tens of MB is a fresh mapping every time
    # (a page fault per 4 KB, on the server, in transit and here)
    "frame_bytes": 8 << 20,
}


@dataclass
class Task:
    task_id: int
    executor_id: int
    version: int
    args: Any
    # its updates until it returns (``Worker.ps_update``): a log of its own, or, without the update
    # log, each ``ps.update`` call's rows as one message's worth
    staged: UpdateLog | None = None
    unmerged: list[tuple[str, list[Hashable], list[np.ndarray]]] | None = None


@dataclass
class Slot:
    """An executor hosted here, with its queue of dispatched tasks."""

    executor: Executor
    queue: deque[Task] = field(default_factory=deque)
    running: bool = False
    leaving: bool = False  # a migration is under way: start no new task, ship when idle and told
    glet: greenlet.greenlet | None = None  # the running task's runner greenlet (a rollback kills it)


@dataclass
class Outgoing:
    """A migration this worker is the source of (DESIGN.md §4)."""

    mid: int
    executors: list[int]
    dest: str
    ship_input: bool
    asked: bool = False  # ship_ready sent: the executors leave on the master's "ship"


def _described(value: Any) -> str:
    """What a reply gave instead of rows, for an error."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r:.60}"


def keeps_rows(ex: Executor) -> bool:
    """Whether partial checkpoints save this executor's state by rows (it overrides ``state_rows``)."""
    return type(ex).state_rows is not Executor.state_rows


class _Wait:
    """A task blocked in get_many: which keys it still waits for and what arrived."""

    __slots__ = ("glet", "task", "pending", "values", "error", "resumed")

    def __init__(self, glet: greenlet.greenlet, task: Task) -> None:
        self.glet = glet
        self.task = task
        self.pending: set[Hashable] = set()
        self.values: dict[Hashable, np.ndarray] = {}
        self.error: str | None = None
        self.resumed = False


class ExecutorPS(ParameterServer):
    """``self.ps`` of an executor: reads through the process cache, writes into the update log."""

    def __init__(self, worker: Worker) -> None:
        self._table = worker.table
        self._read = worker.ps_get
        self._write = worker.ps_update


class Worker(Node):
    role = "worker"

    def __init__(self, ident: str, job: str, etcd: str, host: str = "127.0.0.1") -> None:
        super().__init__(ident, job, etcd, host)
        self.hub = greenlet.getcurrent()
        self.tables: dict[str, Table] = {}
        self.slots: dict[int, Slot] = {}
        self.options = dict(DEFAULT_OPTIONS)
        self.cache = ProcessCache()
        self.log = UpdateLog()
        self.num_shards = 1
        self.shard_map: list[str] = []
        # tasks to start (greenlet None) and blocked tasks to resume (their runner)
        self.runnable: deque[tuple[greenlet.greenlet | None, Task]] = deque()
        self._idle_runners: list[greenlet.greenlet] = []  # parked in _runner, ready for a task
        self.current: Task | None = None
        self._rid = 0
        # fetches to send: table -> [(key, version)], routed only as they are sent (``_send_fetches``):
        # servers may leave or die in between, and a fetch addressed before then would go to them
        self._to_fetch: dict[str, list[tuple[Hashable, int]]] = {}
        # keys to fetch each in an item of its own: those of an item that failed as a whole (one
        # key's initializer raising fails its item), so that only the tasks waiting for a key
        # that fails are failed, and by that key
        self._fetch_alone: list[tuple[str, Hashable, int]] = []
        self._fetching: dict[int, list[tuple[str, list[Hashable], list[int]]]] = {}
        self._sent_to: dict[int, str] = {}  # request id -> server, until answered
        self._update_items: dict[int, list[Any]] = {}  # update rid -> its items, until answered
        self._replaces: dict[int, int] = {}  # rid of an update sent again -> the rid it stands for
        self._parts: dict[int, int] = {}  # original rid -> parts still unanswered (when sent again)
        self._gone: set[str] = set()  # servers that left: never route to them again
        self._server_lookups: set[str] = set()  # servers named in hints, being looked up (_look_up_server)
        self._unknown_servers: dict[str, float] = {}  # servers not found in etcd -> until when not asked again
        self._route_acks: list[tuple[str, int, set[str]]] = []  # (master, rid, gone) to answer
        # completion barrier: update rids not yet acknowledged, and completions waiting on them
        self._unacked: set[int] = set()
        self._last_update_rid = 0
        # completions not yet reported, with their executor: (kind, item, eid) whose updates are
        # still in the log, and (barrier rid, kind, item, eid) waiting for acknowledgements
        self._waiting_flush: list[tuple[str, list[Any], int]] = []
        self._waiting_ack: deque[tuple[int, str, list[Any], int]] = deque()
        self._oldest_unsent: float | None = None
        self.app: dict[str, Any] = {}
        self.num_executors = 0
        self.outgoing: list[Outgoing] = []
        self._ship_due = False  # a leaving executor's task ended or was reported: check after the next poll
        self.moved_to: dict[int, str] = {}  # executors shipped away: late tasks are forwarded there
        # the ids of the last RECENT_TASKS tasks queued here (those shipped away since excepted), in order
        self._task_ids = RecentIds(RECENT_TASKS)
        self._mids_in = RecentIds(RECENT_MIGRATIONS)  # executor migrations received (one sent again is refused)
        self.abandoned_mids = 0  # migrations up to this id belong to a timeline rolled back
        self.migrations_out = 0
        self.migrations_in = 0
        self.tasks_forwarded = 0
        self.tasks_run = 0
        self.busy = 0.0  # seconds tasks have run here, not counting their waits for reads (stragglers.py)
        # the same, and how many ran, for each executor: executors may differ in cost (stragglers.py)
        self.busy_by: dict[int, list[float]] = {}
        self.tasks_failed = 0
        self.update_errors: list[str] = []
        self._rollback_from: tuple[str, int] | None = None  # the master waiting for rolled_back, its round
        self.rollbacks = 0
        self.rows_restored = 0  # executor state rows restored from partial checkpoints
        # SCAR partial checkpoints of executor state: what the running checkpoint holds of each
        # executor's rows, rounds being scored, and the rows scored per round (saved on ckpt_save)
        self.row_saves: dict[int, RowSaves] = {}
        self._scoring = RowScoring()
        self._scored: dict[int, list[tuple[int, StateRows]]] = {}
        # what a round still being written replaced of the executors' saved rows, until it ends
        # (``on_checkpoint_done``), to put back if it fails: (executor, the saves it set or changed,
        # a full round's previous saves or a partial one's ``RowSaves.remember`` token); an executor
        # that migrates takes its entries along
        self._staged: dict[int, list[tuple[int, RowSaves | None, Any]]] = {}
        self._ended = RoundOutcomes()  # for entries that arrive with an executor after their round ended

    # -- set-up -------------------------------------------------------------------------
    def on_init_worker(self, msg: Message) -> None:
        self.master = msg["master"]
        making: int | None = None
        try:
            for peer, addr in msg["peers"].items():
                self.endpoint.connect(peer, addr)
            self.options.update(msg["options"])
            self.cache = ProcessCache(enabled=bool(self.options["cache"]))
            self.tables = table_index(cloudpickle.loads(msg["tables"]))
            for table in self.tables.values():  # the update log merges with the combiners too
                table.warm_up()
            self.num_shards = msg["num_shards"]
            self.shard_map = list(msg["shard_map"])
            self.app = cloudpickle.loads(msg["app"])
            self.num_executors = msg["num_executors"]
            saved = self._saved_states(msg["restore"], msg["executors"]) if msg.get("restore") else {}
            if self.options.get("checkpoint_dir"):  # the first checkpoint must not wait for Arrow's set-up
                # after the restore's reads, not beside them: Arrow's first use is not made from two threads
                from litz.ft import storage

                self.in_background(storage.warm_up, lambda _r, _e: None)
            for making in msg["executors"]:  # the executor being made: its load_input or setup may raise
                self.slots[making] = Slot(self._make_executor(making, saved[making]) if making in saved
                                          else self._make_executor(making))
        except Exception as exc:  # Litz's own refusals (an unreadable checkpoint) say it all in a line;
            # anything else is the application's code (load_input, setup) and needs its traceback
            what = f"worker {self.ident} failed to initialise" + (f" executor {making}" if making is not None else "")
            err = (f"{what}: {exc}" if isinstance(exc, LitzError) else f"{what}:\n{traceback.format_exc()}")
            log.error(err)
            self.endpoint.send(msg.sender, "ready", role=self.role, error=err)
            return
        self.endpoint.send(msg.sender, "ready", role=self.role)

    @staticmethod
    def _saved_states(where: dict[str, Any], executors: list[int]) -> dict[int, list[Any]]:
        """States of ``executors`` from a checkpoint, as [state, None] (their input is reloaded)."""
        from litz.ft import storage

        fs, _ = storage.filesystem(where["location"])
        out: dict[int, list[Any]] = {}
        for name in where["files"]:
            for eid, blob in storage.read_executors(fs, f"{where['path']}/{name}").items():
                if eid in executors:
                    out[eid] = [[blob, []], None]
        missing = sorted(set(executors) - set(out))
        if missing:
            raise LitzError(f"checkpoint {where['path']} holds no state for executors {missing}")
        return out

    @staticmethod
    def _saved_rows(where: dict[str, Any], executors: list[int]) -> dict[int, dict[int, np.ndarray]]:
        """Rows of ``executors``' states saved by the partial checkpoints after the base
        (``where["partials"]``, oldest first: a later copy of a row replaces an earlier one)."""
        from litz.ft import storage

        fs, _ = storage.filesystem(where["location"])
        out: dict[int, dict[int, np.ndarray]] = {}
        for path, files in where.get("partials", []):
            for name in files:
                for eid, rows in storage.read_executor_rows(fs, f"{path}/{name}", set(executors)).items():
                    out.setdefault(eid, {}).update(rows)
        return out

    def _host_from_checkpoint(self, msg: Message) -> list[int]:
        """Host ``msg["executors"]``: their states from the checkpoint in ``msg["restore"]``
        (fresh ones without it) with the rows partial checkpoints saved since, their input reloaded."""
        return self._host_executors(msg, self._read_executors(msg))

    def _read_executors(self, msg: Message) -> tuple[dict[int, list[Any]], dict[int, dict[int, np.ndarray]]]:
        """The states of ``msg["executors"]`` in the checkpoint in ``msg["restore"]`` and the rows
        the partial checkpoints after it saved (nothing without one). Reads only: a partial
        recovery runs it on a thread while the loop serves."""
        eids, where = list(msg["executors"]), msg.get("restore")
        return (self._saved_states(where, eids), self._saved_rows(where, eids)) if where else ({}, {})

    def _host_executors(self, msg: Message, read: tuple[dict[int, list[Any]], dict[int, dict[int, np.ndarray]]]
                        ) -> list[int]:
        """Host ``msg["executors"]`` from what ``_read_executors`` read, their input reloaded."""
        eids, where = list(msg["executors"]), msg.get("restore")
        saved, patches = read
        for eid in eids:
            self.moved_to.pop(eid, None)
            ex = self._make_executor(eid, saved.get(eid))
            if patches.get(eid):
                try:
                    ex.restore_rows(patches[eid])
                except Exception as exc:
                    raise LitzError(f"executor {eid}: restore_rows failed on {len(patches[eid])} rows from "
                                    f"{where['path']}'s partial checkpoints: {type(exc).__name__}: {exc}") from exc
                self.rows_restored += len(patches[eid])
            self.slots[eid] = Slot(ex)
            if where:  # the running checkpoint holds exactly this state (saved at rounds before now)
                self._keep_saves(eid, self._saves_now(eid, 0))
        return eids

    def on_restore_executors(self, msg: Message) -> None:
        """Take over executors of a worker that died (SCAR): states from the running checkpoint,
        input reloaded from shared storage. The master then dispatches their tasks again. The
        checkpoint is read on a thread: meanwhile this worker runs its own executors' tasks."""

        def host(read: tuple[dict[int, list[Any]], dict[int, dict[int, np.ndarray]]]) -> None:
            eids = self._host_executors(msg, read)
            self.migrations_in += len(eids)
            self.endpoint.send(msg.sender, "executors_restored", executors=eids, round=msg.get("round", 0))

        self.restore_on_thread(msg, lambda: self._read_executors(msg), host, "executors_restored")

    # -- full recovery: roll back to the last consistent checkpoint -------------------------
    def on_rollback(self, msg: Message) -> None:
        """Abandon the current timeline: kill every task, drop every executor and everything
        buffered (queued tasks, update log, cache, completions not yet reported). Updates
        already sent to live servers must land before the servers reload, so the answer waits
        for their acknowledgements; those sent to the dead server are dropped."""
        self.restore_gen += 1  # a partial recovery's read under way is abandoned with its timeline
        for slot in self.slots.values():
            if slot.glet is not None and not slot.glet.dead:
                slot.glet.throw(greenlet.GreenletExit)  # unwinds the task where it blocked
        self.slots.clear()
        self._idle_runners.clear()
        self.runnable.clear()
        self.current = None
        self.outgoing.clear()
        self.row_saves.clear()
        self._scoring.clear()
        self._scored.clear()
        self._staged.clear()
        self.moved_to.clear()
        self._task_ids.clear()  # (the checkpoint's tasks come again, with their ids)
        self.cache = ProcessCache(enabled=bool(self.options["cache"]))
        self.log.discard()
        self._to_fetch.clear()
        self._fetch_alone.clear()
        self._fetching.clear()  # late replies are recognised as unknown and ignored
        self._waiting_flush.clear()
        self._waiting_ack.clear()
        self._oldest_unsent = None
        lost = set(msg["lost"])  # servers that died
        self._gone |= lost
        for rid, server in list(self._sent_to.items()):
            if server in lost or rid not in self._update_items:
                del self._sent_to[rid]
                if rid in self._update_items:
                    self._acked(rid)
        self.abandoned_mids = max(self.abandoned_mids, msg.get("abandoned", 0))
        self.rollbacks += 1
        self._rollback_from = (msg.sender, msg["round"])
        self._answer_rollback()

    def _answer_rollback(self) -> None:
        if self._rollback_from is not None and not self._update_items:
            master, round_ = self._rollback_from
            self.endpoint.send(master, "rolled_back", round=round_)
            self._rollback_from = None

    def on_reload_executors(self, msg: Message) -> None:
        """Start the new timeline: these executors, from the checkpoint (or fresh), routing by
        the master's shard map."""
        if self.awaits_peers(msg, checked_shard_map(msg, len(self.shard_map))):
            return
        self.restore_gen += 1
        self._gone |= set(msg["lost"])
        self.shard_map = list(msg["shard_map"])
        try:
            self._host_from_checkpoint(msg)
        except Exception as exc:  # the states and rows are read before any executor is made
            if self.restore_failed(msg, exc, "reloaded"):
                return
            raise
        self.endpoint.send(msg.sender, "reloaded", round=msg["round"])

    # -- checkpoints ----------------------------------------------------------------------
    def on_checkpoint(self, msg: Message) -> None:
        """Pickle every executor's state now (no task runs: the master waited for them all),
        answer at once, and write the file in the background."""
        busy = [eid for eid, slot in self.slots.items() if slot.running or slot.queue]
        if busy:  # the master only asks when every task completed: this is a bug, not a race
            raise LitzError(f"worker {self.ident} asked to checkpoint while executors {busy} have tasks")
        if self.part_refused(msg):
            return
        try:
            states = {eid: self._pickled_state(eid, cloudpickle.dumps) for eid in self.slots}
        except LitzError as exc:  # the round fails (no manifest); training goes on
            log.error("%s: %s", self.ident, exc)
            self.endpoint.send(msg.sender, "checkpoint_snapshot", cid=msg["cid"])
            self.endpoint.send(msg.sender, "checkpoint_written", cid=msg["cid"], files=[],
                               error=f"worker {self.ident}: {exc}")
            return
        staged = self._staged[msg["cid"]] = []
        for eid in self.slots:  # saved now (the copies travel with an executor that moves), undone if it fails
            before, now = self.row_saves.get(eid), self._saves_now(eid, msg["cid"])
            self._keep_saves(eid, now)
            staged.append((eid, now, before))
        from litz.ft import storage

        self.checkpoint_part(msg, f"executors-{self.ident}.arrow",
                             lambda fs, path: storage.write_executors(fs, path, states))

    def _pickled_state(self, eid: int, pickle: Callable[[Any], Any]) -> Any:
        """Executor ``eid``'s ``get_state()`` serialized by ``pickle``; LitzError naming the executor
        if the application's ``get_state`` raises or returns what cannot be serialized."""
        try:
            return pickle(self.slots[eid].executor.get_state())
        except Exception as exc:
            raise LitzError(f"executor {eid}'s state cannot be saved: {type(exc).__name__}: {exc}") from exc

    # -- SCAR partial checkpoints of executor state (Executor.state_rows) -----------------
    def _state_rows(self, eid: int) -> StateRows:
        """Executor ``eid``'s state rows, checked (a wrong shape would save or restore garbage)."""
        rows = self.slots[eid].executor.state_rows()
        if not isinstance(rows, StateRows):
            raise LitzError(f"executor {eid}: state_rows returned {type(rows).__name__}, expected litz.StateRows")
        ptr = np.asarray(rows.ptr)
        if (rows.values.ndim != 1 or ptr.ndim != 1 or len(ptr) < 1 or ptr[0] != 0
                or ptr[-1] != len(rows.values) or np.any(np.diff(ptr) < 0)):
            raise LitzError(f"executor {eid}: state_rows must give 1-D values and offsets ptr from 0 to "
                            f"len(values), got values of shape {rows.values.shape} and ptr {ptr[:3]}...{ptr[-3:]}")
        return StateRows(rows.values, ptr.astype(np.int64, copy=False))

    def _keep_saves(self, eid: int, saves: RowSaves | None) -> None:
        """Executor ``eid``'s rows as the running checkpoint now holds them (None: none kept)."""
        if saves is None:
            self.row_saves.pop(eid, None)
        else:
            self.row_saves[eid] = saves

    def _saves_now(self, eid: int, round_: int) -> RowSaves | None:
        """Executor ``eid``'s rows as they are now, as saved in round ``round_`` (None: the job
        takes no partial checkpoints, or the executor keeps no rows, or they cannot be read)."""
        if self.options.get("checkpoint_policy", "full") == "full" or not keeps_rows(self.slots[eid].executor):
            return None
        try:
            return RowSaves(self._state_rows(eid), round_)
        except Exception as exc:  # the next partial round reports it, and fails, for this executor
            log.error("%s: executor %d's state rows cannot be remembered: %s: %s", self.ident, eid,
                      type(exc).__name__, exc)
            return None

    def on_checkpoint_done(self, msg: Message) -> None:
        """A round ended. Complete: what it copied of the executors' rows stays what partial
        rounds score against. Failed: it saved nothing, and the saved copies it replaced are put
        back (scored against values no checkpoint holds, rows that changed would be passed over
        while the checkpoint keeps them stale). An executor that moved away since took its saved
        copies and these entries along: its new host puts them back."""
        self._ended.record(msg["cid"], msg["ok"])
        for eid, saves, replaced in reversed([] if msg["ok"] else self._staged.get(msg["cid"], [])):
            self._undo(eid, saves, replaced)
        self._staged.pop(msg["cid"], None)

    def _undo(self, eid: int, saves: RowSaves | None, replaced: Any) -> None:
        """Put back what a failed round replaced of executor ``eid``'s saved rows (unless they were
        replaced since, by a restore, say)."""
        if self.row_saves.get(eid) is not saves or eid not in self.slots:
            return
        if isinstance(replaced, tuple):  # partial: the rows chosen
            assert saves is not None
            saves.forget(replaced)
        else:  # full: every row
            self._keep_saves(eid, replaced)

    def _take_staged(self, eid: int, saves: RowSaves | None) -> list[list[Any]]:
        """Remove executor ``eid``'s undo entries of rounds still open, to travel with it:
        ``[round, what was replaced (packed)]`` each. Left here, a failed round would undo them
        where the executor no longer is, and its copies would stay the saved ones on the new host."""
        out: list[list[Any]] = []
        for cid, entries in self._staged.items():
            mine = [e for e in entries if e[0] == eid]
            entries[:] = [e for e in entries if e[0] != eid]
            out.extend([cid, pack_object(replaced)] for _, was, replaced in mine
                       if was is saves and not (saves is None and replaced is None))
        return out

    def _staged_arrived(self, eid: int, undo: list[list[Any]]) -> None:
        """Take the undo entries that came with executor ``eid`` (``_take_staged``), after its saved
        rows: kept for their round's end, or applied now if it already failed."""
        saves = self.row_saves.get(eid)
        for cid, packed in undo:
            ended = self._ended.ended(cid)
            if ended is None:
                self._staged.setdefault(cid, []).append((eid, saves, unpack_object(packed)))
            elif not ended:
                self._undo(eid, saves, unpack_object(packed))

    def on_ckpt_scores(self, msg: Message) -> None:
        """Score the state rows of every executor that keeps some, each between two of its tasks:
        those idle now, the others as their running task ends (``_score_ready``). One that arrived
        already scored in this round (on the worker it left) is not scored again: the round would
        choose among its rows twice, save more than its fraction, and write the executor twice."""
        eids = {eid for eid, slot in self.slots.items() if keeps_rows(slot.executor)
                and ((saves := self.row_saves.get(eid)) is None or saves.scored_in != msg["cid"])}
        self._scored.clear()  # the master runs one round at a time: an earlier one failed, or ended
        self._scoring.request(msg["cid"], msg.sender, msg["policy"], eids)
        self._score_ready()

    def _score_ready(self) -> None:
        """Score the executors that partial rounds wait for and that run no task now; answer the
        rounds that are complete (or failed)."""
        for cid, master, scored, scores, error in self._scoring.ready(self._busy, self._score_rows):
            if error is not None:
                self.endpoint.send(master, "ckpt_scores_reply", cid=cid, scores=scores,
                                   error=f"worker {self.ident}: {error}")
                continue
            self._scored[cid] = scored
            self.endpoint.send(master, "ckpt_scores_reply", cid=cid, scores=scores)

    def _busy(self, eid: int) -> bool | None:
        """Whether executor ``eid`` runs a task now; None if it is not hosted here."""
        return self.slots[eid].running if eid in self.slots else None

    def _score_rows(self, cid: int, eid: int, policy: str) -> tuple[StateRows, np.ndarray]:
        rows = self._state_rows(eid)
        saves = self.row_saves.get(eid)
        if saves is None:  # never saved (say, its state could not be read at the last full checkpoint)
            saves = self.row_saves[eid] = RowSaves(rows, None)
        elif not saves.matches(rows):
            raise LitzError(f"state_rows changed shape since the last checkpoint ({saves.saved.num_rows} rows "
                            f"then, {rows.num_rows} now): an executor's rows must stay the same")
        return rows, saves.scores(rows, policy, cid, [cid, eid], self.slots[eid].executor.row_distances)

    def on_ckpt_save(self, msg: Message) -> None:
        """Save the chosen rows, as they were scored, into a partial checkpoint in the background.
        An executor that migrated away since took its saved copies along: its rows are written
        all the same (values it had), but only its new host's copies say what is saved."""
        scored = self._scored.pop(msg["cid"], [])
        if self.part_refused(msg):
            return
        starts = np.cumsum([0, *(rows.num_rows for _, rows in scored)])
        chosen = np.asarray(msg["rows"], np.int64)
        out: list[tuple[int, np.ndarray, StateRows]] = []
        for k, (eid, rows) in enumerate(scored):
            mine = chosen[(chosen >= starts[k]) & (chosen < starts[k + 1])] - starts[k]
            out.append((eid, mine, rows))
        # saved now (the copies travel with an executor that moves), undone if the round fails
        self._staged[msg["cid"]] = [(eid, saves, saves.remember(rows, mine, msg["cid"])) for eid, mine, rows in out
                                    if len(mine) and eid in self.slots and (saves := self.row_saves.get(eid))]
        from litz.ft import storage

        self.checkpoint_part(msg, f"executor-rows-{self.ident}.arrow",
                             lambda fs, path: storage.write_executor_rows(fs, path, out))

    def _make_executor(self, eid: int, shipped: list[Any] | None = None) -> Executor:
        """Create executor ``eid``: fresh, or from a migration's [state, input or None]."""
        ex: Executor = self.app["executor"]()
        ex.executor_id = eid
        ex.num_executors = self.num_executors
        ex.config = self.app["config"]
        ex.ps = ExecutorPS(self)
        if shipped is None:
            ex.input = ex.load_input()
            ex.state = ex.init_state()
        else:
            state, inp = shipped
            # input shipped from memory on scale-out; reloaded from shared storage on scale-in
            ex.input = unpack_object(inp) if inp is not None else ex.load_input()
            ex.set_state(unpack_object(state))
        ex.setup()
        return ex

    def table(self, name: str) -> Table:
        return lookup(self.tables, name)

    # -- tasks --------------------------------------------------------------------------
    def on_tasks(self, msg: Message) -> None:
        """Queue each task for its executor (or forward it after an executor that left). Each item
        is checked on its own: a malformed one raised and dropped the rest of the message, whose
        tasks then stayed in flight for ever. It fails alone now, reported to the master as its
        task's failure, or, if no task id can be read in it, as an error naming the message."""
        for n, item in enumerate(msg["tasks"]):
            if not ((type(item) is list or type(item) is tuple) and len(item) == 4 and type(item[0]) is int
                    and type(item[1]) is int and type(item[2]) is int):
                self._malformed_task(msg, n, item)
                continue
            task_id, eid, version, args = item
            if msg.undecodable and (bad := undecodable_in(args)) is not None:  # this task fails, no other
                self.tasks_failed += 1
                self._record("failed", [task_id, f"its arguments do not load on worker {self.ident}: {bad.error}"],
                             eid)
                continue
            slot = self.slots.get(eid)
            if slot is None and eid in self.moved_to:  # a late task for an executor that left: forward it
                try:
                    self.endpoint.send(self.moved_to[eid], "tasks", tasks=[item])
                except Exception as exc:  # (the rest of the message goes on)
                    self.tasks_failed += 1
                    self._record("failed", [task_id, f"worker {self.ident} could not forward task {task_id} to "
                                            f"{self.moved_to[eid]}, where executor {eid} moved: "
                                            f"{type(exc).__name__}: {exc}"], eid)
                    continue
                self.tasks_forwarded += 1
                continue
            if slot is None:
                self._record("failed", [task_id, f"executor {eid} is not hosted by worker {self.ident}"], eid)
                continue
            if not self._new_task(task_id, eid, msg.sender):
                continue
            task = Task(task_id, eid, version, args)
            slot.queue.append(task)
            if not slot.running and not slot.leaving:
                self._start_next(slot)
            elif len(slot.queue) == 1:  # next in line
                self._prefetch(slot, task)
        self._send_fetches()

    def _new_task(self, task_id: int, eid: int, sender: str) -> bool:
        """Whether task ``task_id`` may be queued here: not if it is queued, running or ran here
        already (a duplicated message ran it twice, and its updates counted twice), which is
        logged; it is remembered otherwise (the last ``RECENT_TASKS``). A task shipped away with
        its executor is forgotten (``on_ship``): it may come back with it, or be forwarded back."""
        if not self._task_ids.take(task_id):
            log.warning("%s: refused task %d for executor %d from %s: it is queued, running or ran here already",
                        self.ident, task_id, eid, sender)
            return False
        return True

    def _malformed_task(self, msg: Message, n: int, item: Any) -> None:
        """Item ``n`` of tasks message ``msg`` is not ``[task id, executor id, version, arguments]``
        (ints but the arguments): its task fails, reported to the master; an item without a
        readable task id is reported as an error naming the message."""
        reason = (f"item {n} of a tasks message from {msg.sender} is not [task id, executor id, version, "
                  f"arguments] (ints but the arguments): {item!r:.200}")
        task_id = item[0] if type(item) in (list, tuple) and item and type(item[0]) is int else None
        if task_id is None:
            log.error("%s: %s; no task id can be read in it: dropped", self.ident, reason)
            if self.master is not None:
                self.endpoint.send(self.master, "error", reason=f"worker {self.ident}: {reason}; no task id can be "
                                   "read in it: dropped", about="tasks")
            return
        eid = item[1] if len(item) > 1 and type(item[1]) is int else -1
        self.tasks_failed += 1
        log.error("%s: task %d fails: %s", self.ident, task_id, reason)
        self._record("failed", [task_id, f"task {task_id} cannot run on worker {self.ident}: {reason}"], eid)

    def _prefetch(self, slot: Slot, task: Task) -> None:
        """Fetch what the task next in line says it will read (``Executor.prefetch``), at its version.

        Only the next one: a task further back would fetch at its (older) version rows that a
        later task's fetch, at a newer version, may serve anyway (prefetching every queued task
        was slower in one measurement with 16 MLR executors per worker: 0.137 against 0.118 s
        per epoch without any prefetching)."""
        try:
            for name, keys in slot.executor.prefetch(task.args) or ():
                table = self.table(name)
                self._queue_fetches(table.name, [key for key in table.check_keys(keys)
                                                 if self.cache.prefetch(table.name, key, task.version)], task.version)
        except Exception as exc:  # a hint must never cost the task anything: it fetches as usual
            log.warning("%s: executor %d's prefetch hint for task %d was ignored: %s: %s", self.ident,
                        task.executor_id, task.task_id, type(exc).__name__, exc)

    # -- migration ------------------------------------------------------------------------------
    def on_migrate_out(self, msg: Message) -> None:
        eids = [e for e in msg["executors"] if e in self.slots]
        missing = [e for e in msg["executors"] if e not in self.slots]
        if missing:
            raise LitzError(f"worker {self.ident} cannot migrate executors {missing}: not hosted here")
        if msg.get("dest_addr"):  # the destination may have joined too recently for our etcd watch
            self.endpoint.connect(msg["dest"], msg["dest_addr"])
        for e in eids:
            self.slots[e].leaving = True
        self.outgoing.append(Outgoing(msg["mid"], eids, msg["dest"], msg["ship_input"]))
        self._ship_ready()

    def _ship_ready(self) -> None:
        """Tell the master which outgoing migrations may leave: their executors finished their
        running tasks and every completion they ran here was reported (updates acknowledged).
        The executors then wait for the master's ``ship``, sent once it has handled those
        reports: a source that dies just after shipping can no longer take a report with it,
        which would make the task run again on a state that already counts it."""
        owing = {entry[-1] for entry in (*self._waiting_flush, *self._waiting_ack)}
        waiting = False
        for mig in self.outgoing:
            if mig.asked or any(self.slots[e].running for e in mig.executors):
                continue
            if any(e in owing for e in mig.executors):
                waiting = True
                continue
            mig.asked = True
            assert self.master is not None
            self.endpoint.send(self.master, "ship_ready", mid=mig.mid,
                               tasks=[t.task_id for e in mig.executors for t in self.slots[e].queue])
        if waiting:
            self.flush()  # (their acknowledgement reports them and sets _ship_due)

    def on_ship(self, msg: Message) -> None:
        """The master has every completion of the executors of migration ``mid``: send them
        with their queued tasks. (None if a ``settle`` cancelled it first.)"""
        mig = next((m for m in self.outgoing if m.mid == msg["mid"] and m.asked), None)
        if mig is None or msg.sender != self.master:
            return
        try:  # every state first: an executor whose state cannot be taken stays, and the job stops
            states = {e: self._pickled_state(e, pack_object) for e in mig.executors}
        except LitzError as exc:
            assert self.master is not None
            self.endpoint.send(self.master, "error", about="ship",
                               reason=f"migration {mig.mid} of executors {mig.executors} to {mig.dest}: {exc}")
            return
        self.outgoing.remove(mig)
        payload = []
        for e in mig.executors:
            slot = self.slots.pop(e)
            saves = self.row_saves.pop(e, None)
            queued = [[t.task_id, t.executor_id, t.version, t.args] for t in slot.queue]
            for t in slot.queue:
                self._task_ids.forget(t.task_id)
            ship = mig.ship_input and slot.executor.ship_input  # else the destination loads it
            payload.append([e, states[e], pack_object(slot.executor.input) if ship else None, queued,
                            pack_object(saves) if saves is not None else None, self._take_staged(e, saves)])
            self.moved_to[e] = mig.dest
        self.endpoint.send(mig.dest, "executor_state", mid=mig.mid, executors=payload, source=self.ident)
        self.migrations_out += len(mig.executors)

    def on_settle(self, msg: Message) -> None:
        """The other end of migration ``mid`` died: say whether its executors are here. As the
        source that has not shipped them yet, keep them (the migration is cancelled; a late
        ``ship`` finds nothing) and go on with their queued tasks; as the destination, they are
        here if they arrived."""
        out = next((m for m in self.outgoing if m.mid == msg["mid"]), None)
        if out is not None:
            self.outgoing.remove(out)
            for e in out.executors:
                slot = self.slots[e]
                slot.leaving = False
                if slot.queue and not slot.running:
                    self._start_next(slot)
            self._send_fetches()
            holds = True
        else:
            holds = all(e in self.slots for e in msg["items"])
        self.endpoint.send(msg.sender, "settled", mid=msg["mid"], holds=holds)

    def on_executor_state(self, msg: Message) -> None:
        if msg["mid"] <= self.abandoned_mids:  # shipped before a rollback that dropped them
            log.warning("%s: dropped executors %s of migration %d, abandoned by a rollback", self.ident,
                        [e[0] for e in msg["executors"]], msg["mid"])
            return
        if msg["source"] != msg.sender:  # (the source ships them, naming itself: any other is not the move)
            log.warning("%s: refused executors of migration %d from %s, which names %r as their source", self.ident,
                        msg["mid"], msg.sender, msg["source"])
            return
        if msg["mid"] in self._mids_in:  # sent again: its executors run here, or ran and moved on
            log.warning("%s: refused executors %.100r of migration %d from %s: it arrived already", self.ident,
                        [e[0] if type(e) in (list, tuple) and e else e for e in msg["executors"]], msg["mid"],
                        msg.sender)
            return
        self._mids_in.take(msg["mid"])
        try:
            self._receive_executors(msg)
        except LitzError as exc:  # refused before anything was taken: the master must know, or it would hang
            reason = f"worker {self.ident} could not take executors of migration {msg['mid']} from {msg.sender}: {exc}"
            log.error(reason)
            assert self.master is not None
            self.endpoint.send(self.master, "error", reason=reason, about="executor_state")
        except Exception:  # the executors cannot run here: the master must know, or the job would hang
            reason = f"worker {self.ident} could not take executors of migration {msg['mid']}:\n" \
                     f"{traceback.format_exc()}"
            log.error(reason)
            assert self.master is not None
            self.endpoint.send(self.master, "error", reason=reason, about="executor_state")

    def _receive_executors(self, msg: Message) -> None:
        """Host the executors a migration shipped here, with their queued tasks. One this worker
        hosts already is refused (LitzError), before any is taken: it replaced the one running
        here, state and queued tasks lost."""
        entries = msg["executors"]
        if not all((type(e) is list or type(e) is tuple) and len(e) == 6 and type(e[0]) is int for e in entries):
            raise LitzError(f"its executors are not [executor id, state, input, queued tasks, saved rows, undo "
                            f"entries] each: {entries!r:.200}")
        hosted = [e[0] for e in entries if e[0] in self.slots]
        if hosted:
            raise LitzError(f"executors {hosted} run here already")
        if len({e[0] for e in entries}) != len(entries):
            raise LitzError(f"it names executors twice: {[e[0] for e in entries]}")
        arrived = []
        for eid, state, inp, tasks, saves, undo in entries:
            self.moved_to.pop(eid, None)
            slot = self.slots[eid] = Slot(self._make_executor(eid, [state, inp]))
            if saves is not None:  # what the running checkpoint holds of its rows
                self.row_saves[eid] = unpack_object(saves)
            self._staged_arrived(eid, undo)
            slot.queue.extend(Task(*t) for t in tasks if self._new_task(t[0], eid, msg.sender))
            if slot.queue:
                self._start_next(slot)
            arrived.append(eid)
        self.migrations_in += len(arrived)
        assert self.master is not None
        self.endpoint.send(self.master, "migrated", mid=msg["mid"], executors=arrived)

    def _start_next(self, slot: Slot) -> None:
        task = slot.queue.popleft()
        slot.running = True
        self.runnable.append((None, task))  # the hub hands it to an idle runner
        if slot.queue:
            self._prefetch(slot, slot.queue[0])

    def _runner(self, task: Task) -> None:
        """A greenlet that runs task after task, parking among the idle runners in between.

        Why not a greenlet per task: a new greenlet gets a fresh 16 KB chunk for its Python
        frames, which CPython maps with ``mmap`` and the greenlet's end unmaps, and in a process
        with threads (ZeroMQ's) that cost 25-50 µs per task here against 1-4 µs for switching
        into a parked one. A task killed by a rollback (``GreenletExit``) ends its runner.
        """
        while True:
            self._task_body(task)
            del task  # a parked runner must not keep the finished task's arguments alive
            self._idle_runners.append(greenlet.getcurrent())
            task = self.hub.switch()

    def _ran(self, eid: int) -> None:
        """A task of executor ``eid`` ended (completed or failed): one more for its measure."""
        self.busy_by.setdefault(eid, [0.0, 0])[1] += 1

    def _task_body(self, task: Task) -> None:
        slot = self.slots[task.executor_id]
        slot.glet = greenlet.getcurrent()
        try:
            value = slot.executor.run_task(task.args)
        except greenlet.GreenletExit:
            raise
        except BaseException:  # SystemExit from user code is a task failure too, not the worker's end
            self._fail(task, traceback.format_exc())
        else:
            try:  # as it is now: it leaves after the updates' acknowledgement, when the next task may have changed it
                item = [task.task_id, snapshot(value)]
            except Exception as exc:
                self._fail(task, self._unsendable(task.task_id, exc))
            else:
                try:
                    if task.staged is not None:
                        self.log.absorb(task.staged)
                except Exception:  # a combiner raised merging it into the log, which is as it was
                    self._fail(task, traceback.format_exc())
                else:
                    task.staged = None
                    self._send_unmerged(task)
                    self.tasks_run += 1
                    self._ran(task.executor_id)
                    self._record("completed", item, task.executor_id)
                    if self.log.nbytes >= self.options["flush_bytes"]:
                        self.flush()
        slot.running = False
        slot.glet = None  # its runner parks: a rollback must not kill it
        if self._scoring.rounds:  # before anything else runs or it leaves: a partial checkpoint waits for it
            self._score_ready()
        if slot.leaving:  # the loop says ship_ready once its completions are reported
            self._ship_due = True
        elif slot.queue:
            self._start_next(slot)

    def _fail(self, task: Task, reason: str) -> None:
        """Task ``task`` raised (or its result cannot be sent): its updates are dropped, so that the
        tables hold none of a failed task's work (a retry would count it twice), and it is reported."""
        dropped = task.staged.updates_in if task.staged is not None else 0
        dropped += sum(len(keys) for _, keys, _ in task.unmerged or ())
        task.staged = task.unmerged = None
        if dropped:
            reason += f"\n(the {dropped} row update{'s it made were' if dropped > 1 else ' it made was'} discarded)"
        self.tasks_failed += 1
        self._ran(task.executor_id)
        log.error("task %d on executor %d failed:\n%s", task.task_id, task.executor_id, reason)
        self._record("failed", [task.task_id, reason], task.executor_id)

    def _send_unmerged(self, task: Task) -> None:
        """Without the update log: send the updates of task ``task``, which returned, one message's
        worth per ``ps.update`` call as it made them."""
        for name, keys, rows in task.unmerged or ():
            self._send_updates({name: (keys, rows)})
        task.unmerged = None

    def _record(self, kind: str, item: list[Any], eid: int) -> None:
        """Buffer a completion until the updates made before it are acknowledged."""
        if self._oldest_unsent is None:
            self._oldest_unsent = time.monotonic()
        if self.log:
            self._waiting_flush.append((kind, item, eid))
        else:
            self._waiting_ack.append((self._last_update_rid, kind, item, eid))

    # -- ps from inside a task --------------------------------------------------------
    def ps_get(self, table: Table, keys: list[Hashable]) -> list[np.ndarray]:
        """Rows for checked keys: cached ones at once, the rest after one batched fetch."""
        task = self.current
        if task is None:
            raise LitzError("ps.get called outside a micro-task")
        version, name, lookup = task.version, table.name, self.cache.lookup
        out: list[Any] = [lookup(name, key, version) for key in keys]
        missing = [key for key, value in zip(keys, out, strict=True) if value is None]
        if not missing:
            return out
        wait = _Wait(greenlet.getcurrent(), task)
        request, fetch = self.cache.request, []
        for key in missing:
            if key not in wait.pending:
                wait.pending.add(key)
                if request(name, key, version, wait):
                    fetch.append(key)
        self._queue_fetches(name, fetch, version)
        self.hub.switch()  # the hub resumes us once every key arrived or a fetch failed
        if wait.error is not None:
            raise TableError(wait.error)
        for i, key in enumerate(keys):
            if out[i] is None:
                out[i] = wait.values[key]
        return out

    def ps_update(self, table: Table, keys: list[Hashable], deltas: np.ndarray) -> None:
        """Checked updates, held with the task until it returns (``_commit``; dropped if it fails)."""
        task = self.current
        if task is None:
            raise LitzError("ps.update called outside a micro-task")
        if self.options["update_log"]:
            if task.staged is None:
                task.staged = UpdateLog()
            task.staged.add_many(table, keys, deltas)
        else:
            if task.unmerged is None:
                task.unmerged = []
            task.unmerged.append((table.name, keys, [np.array(d, copy=True) for d in deltas]))

    # -- hub: fetches ---------------------------------------------------------------------
    def _owners(self, keys: list[Hashable]) -> list[str]:
        """The server of each key's shard, in one pass (every key fetched or updated goes through it)."""
        smap, n = self.shard_map, self.num_shards
        return [smap[shard_of(k, n)] for k in keys]

    def _queue_fetches(self, name: str, keys: list[Hashable], version: int) -> None:
        """Fetch these keys of table ``name`` at ``version`` with the next ``_send_fetches``."""
        self._to_fetch.setdefault(name, []).extend((key, version) for key in keys)

    def _send_fetches(self) -> None:
        """Send the queued fetches, each to its key's owner by the shard map as it is now (a server
        that left, or died, after a fetch was queued is never sent one: its answer would never come,
        and a ``routes_ack`` has promised it nothing more)."""
        by_server: dict[str, dict[str, list[tuple[Hashable, int]]]] = {}
        for name, keyver in self._to_fetch.items():
            for kv, server in zip(keyver, self._owners([k for k, _ in keyver]), strict=True):
                by_server.setdefault(server, {}).setdefault(name, []).append(kv)
        self._to_fetch.clear()
        alone: dict[str, list[tuple[str, Hashable, int]]] = {}
        for entry, server in zip(self._fetch_alone, self._owners([k for _, k, _ in self._fetch_alone]), strict=True):
            alone.setdefault(server, []).append(entry)
            by_server.setdefault(server, {})
        self._fetch_alone.clear()
        for server, by_table in by_server.items():
            self._rid += 1
            record = [(name, [key], [version]) for name, key, version in alone.get(server, ())]
            items = [[name, [key]] for name, key, _ in alone.get(server, ())]
            for name, keyver in by_table.items():
                step = self._rows_per_frame(name)
                for lo in range(0, len(keyver), step):
                    part = keyver[lo:lo + step]
                    keys = [k for k, _ in part]
                    record.append((name, keys, [v for _, v in part]))
                    items.append([name, keys])
            self._fetching[self._rid] = record
            self._sent_to[self._rid] = server
            try:
                self.endpoint.send(server, "get", rid=self._rid, items=items)
            except Exception as exc:  # (no address for it, say): its reads fail, the others go on
                self._fetch_unsent(self._rid, server, exc)

    def _fetch_unsent(self, rid: int, server: str, exc: Exception) -> None:
        """Read request ``rid`` could not be sent to ``server``: fail the tasks waiting for its keys,
        naming the server, the request, the table and the key. Before, the error escaped the
        loop and the worker died (exit 70), or, in a handler, the other servers' reads were lost."""
        self._sent_to.pop(rid, None)
        why = f"{type(exc).__name__}: {exc}"
        self._fail_fetches(self._fetching.pop(rid, []), f"from {server} (request {rid}) could not be sent: {why}")

    def _fail_fetches(self, record: list[tuple[str, list[Hashable], list[int]]], what: str) -> None:
        """Fail the tasks waiting for the keys of ``record`` (a read request's items, no longer
        awaited): each fails with ``fetch of table T key K <what>``, which is logged once."""
        shown = ", ".join(f"table {name!r} ({len(keys)} keys from {keys[0]!r})" for name, keys, _ in record[:3])
        log.error("%s: the reads of %s %s", self.ident, shown, what)
        for name, keys, _ in record:
            for key in keys:
                for wait in self.cache.fail(name, key):
                    wait.error = f"fetch of table {name!r} key {key!r} {what}"
                    self._resume(wait)

    def _learn_moves(self, msg: Message) -> None:
        """A server forwarded part of our request: send the next ones straight to the new owner.
        Not from the answer to a request of a timeline a full recovery abandoned (no longer
        awaited): its hints name where shards were before the servers reloaded, and followed they
        lead to a server without the shard and with no forward for it (a stress run found one)."""
        if self._sent_to.pop(msg["rid"], None) is None:
            return
        for shard, server in (msg.get("moved") or {}).items():
            at = shard if type(shard) is int else int(shard) if isinstance(shard, str) and shard.isdigit() else -1
            if not (0 <= at < len(self.shard_map) and isinstance(server, str)):  # (it raised: the reply was lost)
                log.warning("%s: ignored a malformed hint in %s's %s %r: shard %.40r moved to %.40r", self.ident,
                            msg.sender, msg.type, msg["rid"], shard, server)
                continue
            if server in self._gone:  # a hint older than the server's departure
                continue
            if server not in self.endpoint.peers:  # joined too recently for our etcd watch: ask etcd
                self._look_up_server(server, shard)  # meanwhile the old route forwards
                continue  # (sending there would fail: no address)
            self.shard_map[at] = server

    def _look_up_server(self, server: str, shard: str) -> None:
        """Read the registration of ``server``, named in a hint, off the loop; its address lets later
        hints be followed. It was read on the loop: during an etcd outage every hint of an unknown
        server held the loop, and every task of the process, for the call deadline (5 s). A server
        not found, or a read that failed, is not asked for again for ``UNKNOWN_SERVER_WAIT`` s: the
        hints keep coming while the old route forwards."""
        if server in self._server_lookups or time.monotonic() < self._unknown_servers.get(server, 0.0):
            return
        self._server_lookups.add(server)

        def then(value: dict | None, error: BaseException | None) -> None:
            self._server_lookups.discard(server)
            if value:
                self._learn(proc_key("server", server), value)
                return
            self._unknown_servers[server] = time.monotonic() + UNKNOWN_SERVER_WAIT
            if error is not None:  # before, the reply was dropped with it, and its task hung
                log.warning("cannot look up %s, to which shard %s moved (%s): the old route forwards",
                            server, shard, error)

        self.on_thread(lambda: self.membership.get(proc_key("server", server)), then, f"lookup-{server}")

    def on_routes(self, msg: Message) -> None:
        """Servers left: route their shards as the master says, and answer once nothing waits on them.

        The answer tells the master that this worker will never send to them again and has no
        request there unanswered, so they may exit without losing anything.
        """
        smap, gone = checked_shard_map(msg, len(self.shard_map)), set(msg["gone"])
        targets = {smap[shard] for shard, server in enumerate(self.shard_map) if server in gone}
        if targets & gone:
            raise LitzError(f"routes from {msg.sender} sends shards of the leaving servers {sorted(gone)} to "
                            f"{sorted(targets & gone)}, which leave too")
        if self.awaits_peers(msg, targets):
            return
        self._gone |= gone
        for shard, server in enumerate(smap):
            if self.shard_map[shard] in gone:
                self.shard_map[shard] = server
        self._route_acks.append((msg.sender, msg["rid"], gone))
        self._answer_routes()

    def _answer_routes(self) -> None:
        if not self._route_acks:
            return
        busy = set(self._sent_to.values())
        for entry in [e for e in self._route_acks if not (e[2] & busy)]:
            self._route_acks.remove(entry)
            self.endpoint.send(entry[0], "routes_ack", rid=entry[1])

    def _from_asked(self, msg: Message) -> bool:
        """Whether a reply comes from the server its request went to (an unknown request is said
        by its handler); any other sender's is dropped, said in the log."""
        asked = self._sent_to.get(msg["rid"])
        if asked is not None and asked != msg.sender:
            log.warning("%s: %s sent a %s for request %r, which went to %s: dropped", self.ident, msg.sender,
                        msg.type, msg["rid"], asked)
            return False
        return True

    def on_get_reply(self, msg: Message) -> None:
        """Fill the cache with a server's rows and resume the tasks waiting for them. A reply is
        checked before it is taken (it raised part-way, after its request was forgotten, and its
        tasks waited for ever): one that does not give a value or an error per item fails the
        request's tasks, a value that is not the rows asked for (an array of the table's row shape
        and dtype, one row per key) fails its item's; each failure names the server, the request,
        the table and the key."""
        if not self._from_asked(msg):
            return
        rid, values, errors = msg["rid"], msg["values"], msg["errors"]
        record = self._fetching.get(rid)
        if record is not None and not len(values) == len(errors) == len(record):
            self._sent_to.pop(rid, None)
            del self._fetching[rid]
            self._fail_fetches(record, f"from {msg.sender} (request {rid}) failed: its reply has {len(values)} values "
                                       f"and {len(errors)} errors for {len(record)} items")
            return
        self._learn_moves(msg)
        record = self._fetching.pop(rid, None)
        if record is None:
            log.warning("%s: get_reply for unknown request %r", self.ident, rid)
            return
        tables = self.tables
        for (name, keys, versions), rows, error in zip(record, values, errors, strict=True):
            table = tables[name]
            if error is None and not (type(rows) is np.ndarray and rows.shape[:1] == (len(keys),)
                                      and rows.shape[1:] == table.shape and rows.dtype == table.dtype):
                self._fail_fetches([(name, keys, versions)], f"from {msg.sender} (request {rid}) failed: its reply "
                                   f"gave {_described(rows)} for {len(keys)} rows of shape {table.shape} and "
                                   f"dtype {table.dtype}")
                continue
            if error is not None and len(keys) > 1:  # perhaps one key's failure: each is asked again alone
                self._fetch_alone.extend((name, key, version) for key, version in zip(keys, versions, strict=True))
                continue
            for j, key in enumerate(keys):
                if error is not None:
                    for wait in self.cache.fail(name, key):
                        wait.error = f"fetch of table {name!r} key {key!r} failed: {error}"
                        self._resume(wait)
                    continue
                row = rows[j]
                row.flags.writeable = False  # shared by every task of the process through the cache
                for wait, value in self.cache.fill(name, key, row, versions[j]):
                    wait.values[key] = value
                    wait.pending.discard(key)
                    if not wait.pending:
                        self._resume(wait)
        if self._fetch_alone:
            self._send_fetches()

    def _resume(self, wait: _Wait) -> None:
        """Make a blocked task runnable again (once, however many keys fail)."""
        if not wait.resumed:
            wait.resumed = True
            self.runnable.append((wait.glet, wait.task))

    # -- hub: updates and completions -----------------------------------------------------
    def _send_updates(self, drained: dict[str, tuple[list[Hashable], list[np.ndarray]]]) -> None:
        items = [[name, keys, rows] for name, (keys, rows) in drained.items()]
        for rid in self._send_update_groups(self._by_owner(items)):
            self._unacked.add(rid)
            self._last_update_rid = rid

    def _by_owner(self, items: list[list[Any]]) -> dict[str, list[Any]]:
        """Split update items ``[table, keys, rows]`` by the server that owns each key's shard."""
        by_server: dict[str, list[Any]] = {}
        for name, keys, rows in items:
            owners = self._owners(keys)
            groups: dict[str, tuple[list[Hashable], list[np.ndarray]]] = {}
            if owners and owners.count(owners[0]) == len(owners):  # one server (always, with one)
                groups[owners[0]] = (keys, rows)
            else:
                for key, row, owner in zip(keys, rows, owners, strict=True):
                    g = groups.setdefault(owner, ([], []))
                    g[0].append(key)
                    g[1].append(row)
            step = self._rows_per_frame(name)
            for server, (gkeys, grows) in groups.items():
                for lo in range(0, len(gkeys), step):
                    by_server.setdefault(server, []).append([name, gkeys[lo:lo + step], np.stack(grows[lo:lo + step])])
        return by_server

    def _rows_per_frame(self, name: str) -> int:
        """Rows of table ``name`` per message item (see the ``frame_bytes`` option)."""
        table = self.tables.get(name)
        return max(1, self.options["frame_bytes"] // table.row_nbytes) if table is not None else 1 << 30

    def _send_update_groups(self, by_server: dict[str, list[Any]], again: int | None = None) -> list[int]:
        """Send update items to their servers; ``again``: they are those of update ``again`` (as first
        sent), whose server died unanswered: it may have forwarded some of them, applied by now,
        and the new owners skip those by this origin (``AppliedOnce``). ``low``, the lowest update
        still unanswered (or being sent again), lets the servers forget origins that cannot come again."""
        rids = []
        low = min(min(self._update_items, default=self._rid + 1), min(self._parts, default=self._rid + 1))
        extra: dict[str, Any] = {"low": low} if again is None else {"origin": [self.ident, again, low]}
        for server, items in by_server.items():
            self._rid += 1
            self._sent_to[self._rid] = server
            self._update_items[self._rid] = items  # kept until acknowledged: a lost server's are sent again
            try:
                self.endpoint.send(server, "update", rid=self._rid, items=items, **extra)
            except Exception as exc:  # (no address for it, say): refused, as a server refuses an update
                del self._sent_to[self._rid], self._update_items[self._rid]
                self._update_unsent(self._rid, server, items, exc)
                continue
            rids.append(self._rid)
        return rids

    def _update_unsent(self, rid: int, server: str, items: list[Any], exc: Exception) -> None:
        """Update ``rid`` could not be sent to ``server``: the tables lack it, so the master is told,
        before the completions it would release, and stops the job saying why (as for an update a
        server refused). Before, the error escaped the loop and the worker died (exit 70)."""
        shown = ", ".join(f"table {name!r} ({len(keys)} keys from {keys[0]!r})" for name, keys, _ in items[:3])
        reason = f"update {rid} ({shown}) could not be sent to {server}: {type(exc).__name__}: {exc}"
        self.update_errors.append(reason)
        log.error("%s: %s", self.ident, reason)
        if self.master:
            self.endpoint.send(self.master, "error", reason=reason, about="update")

    def _acked(self, rid: int) -> None:
        """An update message was answered; its barrier lifts once every part of it was."""
        self._update_items.pop(rid, None)
        orig = self._replaces.pop(rid, rid)
        left = self._parts.get(orig, 1) - 1
        if left > 0:
            self._parts[orig] = left
        else:
            self._parts.pop(orig, None)
            self._unacked.discard(orig)

    def on_shard_map(self, msg: Message) -> None:
        """After a full recovery: route by exactly this map (the servers dropped their forwards)."""
        if msg.sender == self.master and not self.awaits_peers(msg, checked_shard_map(msg, len(self.shard_map))):
            self.shard_map = list(msg["shard_map"])

    def on_server_lost(self, msg: Message) -> None:
        """A server died and its shards were restored on others (SCAR partial recovery): route
        to their new owners and send again what it never answered, fetches and updates alike.
        The updates land on the restored rows, which predate them."""
        lost, smap = msg["server"], checked_shard_map(msg, len(self.shard_map))
        targets = {smap[shard] for shard, server in enumerate(self.shard_map) if server == lost}
        if lost in targets:
            raise LitzError(f"server_lost from {msg.sender} sends the shards of the lost {lost} to {lost}")
        if self.awaits_peers(msg, targets):
            return
        self._gone.add(lost)
        for shard, server in enumerate(smap):
            if self.shard_map[shard] == lost:
                self.shard_map[shard] = server
        for rid, server in list(self._sent_to.items()):
            if server != lost:
                continue
            del self._sent_to[rid]
            if rid in self._fetching:
                for name, keys, versions in self._fetching.pop(rid):
                    self._to_fetch.setdefault(name, []).extend(zip(keys, versions, strict=True))
            elif rid in self._update_items:
                orig = self._replaces.pop(rid, rid)
                new = self._send_update_groups(self._by_owner(self._update_items[rid]), again=orig)
                del self._update_items[rid]
                self._replaces.update(dict.fromkeys(new, orig))
                self._parts[orig] = self._parts.get(orig, 1) - 1 + len(new)
                if not self._parts[orig]:
                    del self._parts[orig]
                    self._unacked.discard(orig)
        self._send_fetches()
        self._release()

    def flush(self) -> None:
        """Send the update log; completions recorded so far wait for its acknowledgement."""
        if self.log:
            self._send_updates(self.log.drain())
        for kind, item, eid in self._waiting_flush:
            self._waiting_ack.append((self._last_update_rid, kind, item, eid))
        self._waiting_flush.clear()
        self._release()

    def on_update_ack(self, msg: Message) -> None:
        if not self._from_asked(msg):
            return
        self._learn_moves(msg)
        self._acked(msg["rid"])
        for err in msg["errors"]:
            if err is not None:
                self.update_errors.append(err)
                log.error("%s: a server refused an update: %s", self.ident, err)
                if self.master:  # before the completions it releases: the master stops the job first
                    self.endpoint.send(self.master, "error", reason=f"update refused by {msg.sender}: {err}",
                                       about="update")
        self._release()

    def _release(self) -> None:
        low = min(self._unacked) if self._unacked else self._rid + 1
        ready: list[tuple[str, list[Any]]] = []
        while self._waiting_ack and self._waiting_ack[0][0] < low:
            _, kind, item, eid = self._waiting_ack.popleft()
            slot = self.slots.get(eid)
            if slot is not None and slot.leaving:  # its executor may be ready to leave now
                self._ship_due = True
            ready.append((kind, item))
        self._report(ready)
        if not self._waiting_ack and not self._waiting_flush:
            self._oldest_unsent = None

    def _report(self, reports: list[tuple[str, list[Any]]]) -> None:
        """Tell the master these tasks completed (or failed), in one message."""
        completed = [item for kind, item in reports if kind == "completed"]
        failed = [item for kind, item in reports if kind != "completed"]
        if completed or failed:
            assert self.master is not None
            try:
                busy = [[eid, *self.busy_by[eid]] for eid in self.slots if eid in self.busy_by]
                self.endpoint.send(self.master, "done", completed=completed, failed=failed, busy=busy)
            except Exception:  # a result that cannot be serialized fails its own task, not the batch
                self._send_done_one_by_one(completed, failed)

    def _send_done_one_by_one(self, completed: list[Any], failed: list[Any]) -> None:
        assert self.master is not None
        for task_id, value in completed:
            try:
                self.endpoint.send(self.master, "done", completed=[[task_id, value]], failed=[])
            except Exception as exc:
                failed.append([task_id, self._unsendable(task_id, exc)])
        self.endpoint.send(self.master, "done", completed=[], failed=failed)

    def _unsendable(self, task_id: int, exc: Exception) -> str:
        """Why task ``task_id`` fails: its result cannot be sent to the driver (logged here)."""
        reason = (f"the result of task {task_id} cannot be sent to the driver "
                  f"({type(exc).__name__}: {exc}); return msgpack values, arrays or picklable objects")
        log.error("%s: %s", self.ident, reason)
        return reason

    def on_error(self, msg: Message) -> None:
        rid = msg.get("rid")
        if isinstance(rid, int):
            self._sent_to.pop(rid, None)
        record = self._fetching.pop(rid, None) if isinstance(rid, int) else None
        if record is not None:
            for name, keys, _ in record:
                for key in keys:
                    for wait in self.cache.fail(name, key):
                        wait.error = f"fetch of table {name!r} key {key!r} failed: {msg['reason']}"
                        self._resume(wait)
        elif isinstance(rid, int) and (rid in self._unacked or rid in self._replaces):
            self._acked(rid)
            self.update_errors.append(msg["reason"])
            if self.master:  # before the completions it releases: the master stops the job first
                self.endpoint.send(self.master, "error", reason=f"update refused by {msg.sender}: {msg['reason']}",
                                   about="update")
            self._release()
        log.error("%s: error from %s: %s", self.ident, msg.sender, msg["reason"])

    # -- the hub loop -----------------------------------------------------------------------
    def _run_runnable(self) -> None:
        interval = self.options["flush_interval"]
        while self.runnable:
            glet, task = self.runnable.popleft()
            self.current = task
            began = time.perf_counter()
            if glet is None:  # a task to start
                runners = self._idle_runners
                glet = runners.pop() if runners else greenlet.greenlet(self._runner, parent=self.hub)
                glet.switch(task)
            elif not glet.dead:  # resume it where it blocked in ps_get
                glet.switch()
            took = time.perf_counter() - began  # until it ended or blocked in a read
            self.busy += took
            self.busy_by.setdefault(task.executor_id, [0.0, 0])[0] += took
            self.current = None
            if self._oldest_unsent is not None and time.monotonic() - self._oldest_unsent > interval:
                self.flush()
        self._send_fetches()

    def loop(self) -> None:
        while not self.stopping:
            self._run_runnable()
            if not self.runnable and (self.log or self._waiting_flush or self._waiting_ack):
                self.flush()
            self._answer_routes()
            self._answer_rollback()
            self.leave_when_settled()
            if self.stopping:
                break
            self.poll(0 if self.runnable or self._ship_due else 50 if self._leaving else 200)
            if self._ship_due:
                self._ship_due = False
                self._ship_ready()

    def before_exit(self) -> None:
        self.flush()

    def owed(self) -> int:
        """Unacknowledged update messages and completions not yet reported to the master."""
        return len(self._unacked) + len(self._waiting_ack) + len(self._waiting_flush) + len(self.log)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(self.cache.counters())
        out.update(pending_fetches=len(self._fetching), unacked_updates=len(self._unacked),
                   waiting_completions=len(self._waiting_ack) + len(self._waiting_flush),
                   shard_map_servers=sorted(set(self.shard_map)))
        out.update(migrations_out=self.migrations_out, migrations_in=self.migrations_in,
                   tasks_forwarded=self.tasks_forwarded, executors=sorted(self.slots), rollbacks=self.rollbacks,
                   rows_restored=self.rows_restored)
        out.update(tasks_run=self.tasks_run, tasks_failed=self.tasks_failed, busy_seconds=self.busy,
                   updates_logged=self.log.updates_in, update_rows_sent=self.log.rows_out,
                   update_errors=len(self.update_errors))
        return out


if __name__ == "__main__":
    exit_process(main(Worker))
