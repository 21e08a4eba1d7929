"""The master: hosts the driver, owns the version counter and the executor/shard maps.

``MasterState`` is the socket-free bookkeeping (versions, tasks in flight, placement) that
tests drive directly. ``Master`` connects it to the endpoint, etcd membership and the
driver: it waits for the job's processes to register, initialises servers and workers,
runs the driver's callbacks as completions arrive, and shuts everything down.

The version is incremented *before* ``handle_task_completion`` runs, so every task the
handler dispatches carries a version greater than that of any task that could have read
parameters before the completed task's updates were applied (DESIGN.md §2).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
import zmq

from litz.api import App, Driver, JobResult, ParameterServer, Recovery, TaskFailure, TaskResult
from litz.errors import ConfigError, JobStopped, LitzError, ProcessLost, TableError
from litz.ft.checkpoint import DEFAULT_TIMEOUT, CheckpointCoordinator, CheckpointRound, select_top
from litz.ft.driver_state import dump_driver, load_driver
from litz.ps.tables import Table, is_int, lookup, shard_of, table_index
from litz.runtime import security, spawner, stragglers
from litz.runtime.elastic import AGENT_PROCS, AGENTS, COMMANDS, JOINS, RESULTS, SCALE_KEY, Elasticity
from litz.runtime.membership import Event, Membership, lease_ttl
from litz.runtime.node import PROCS, kill_job_process, proc_key, register_exclusively
from litz.runtime.protocol import Message, snapshot, undecodable_in
from litz.runtime.transport import Endpoint, host_name

log = logging.getLogger(__name__)

DEFAULT_NUM_SHARDS = 64
STATUS_KEY = "status"
STATUS_PERIOD = 0.5  # seconds between status updates in etcd


@dataclass
class TaskRecord:
    task_id: int
    executor_id: int
    version: int
    args: Any
    worker: str


class MasterState:
    """Versions, placement and tasks in flight; no sockets."""

    def __init__(self, num_executors: int, workers: list[str], servers: list[str],
                 num_shards: int = DEFAULT_NUM_SHARDS) -> None:
        if num_executors < 1 or not workers or not servers:
            raise LitzError("a job needs at least one executor, one worker and one server")
        self.version = 0
        self.num_executors = num_executors
        self.num_shards = num_shards
        self.workers = list(workers)
        self.servers = list(servers)
        # contiguous blocks of executors per worker, as even as possible
        self.placement: dict[int, str] = {
            e: workers[e * len(workers) // num_executors] for e in range(num_executors)
        }
        self.shard_map: list[str] = [servers[s % len(servers)] for s in range(num_shards)]
        self.inflight: dict[int, TaskRecord] = {}
        self.outbox: dict[str, list[list[Any]]] = {}
        self.paused = False
        self.paused_items: list[list[Any]] = []  # tasks held while a checkpoint is taken
        self._next_id = 0
        self.completed = 0
        # executor migrations under way: mid -> (executors, source, dest); tasks dispatched to a
        # moving executor are held here and sent to its new worker once it has arrived
        self.migrations: dict[int, tuple[list[int], str, str]] = {}
        self.moving: dict[int, int] = {}  # executor -> mid
        self.held: dict[int, list[list[Any]]] = {}
        self._next_mid = 0
        # shard migrations under way: mid -> (shards, source, dest)
        self.shard_migrations: dict[int, tuple[list[int], str, str]] = {}
        self.shards_moving: set[int] = set()

    @property
    def last_mid(self) -> int:
        """The id of the last migration started (ids are never reused)."""
        return self._next_mid

    def executors_of(self, worker: str) -> list[int]:
        return [e for e, w in self.placement.items() if w == worker]

    def shards_of(self, server: str) -> list[int]:
        return [s for s, srv in enumerate(self.shard_map) if srv == server]

    def holds_shards(self, server: str) -> bool:
        """Whether a server hosts a shard or is about to receive one."""
        return server in self.shard_map or any(dest == server for _, _, dest in self.shard_migrations.values())

    def dispatch(self, executor_id: int, args: Any) -> int:
        """Queue a task for its executor's worker, tagged with the current version."""
        worker = self.placement.get(int(executor_id)) if is_int(executor_id) else None
        if worker is None:
            raise LitzError(f"dispatch_task: no executor {executor_id!r} (executors are 0..{self.num_executors - 1})")
        executor_id = int(executor_id)  # an id computed with NumPy is welcome; the task's record holds an int
        try:  # sent as they are now (the driver may reuse them), and refused now if they cannot be sent
            args = snapshot(args, pickle=False)
        except Exception as exc:
            raise LitzError(f"dispatch_task: the arguments of a task for executor {executor_id} cannot be sent "
                            f"({type(exc).__name__}: {exc}); pass msgpack values, arrays or picklable objects") from exc
        self._next_id += 1
        rec = TaskRecord(self._next_id, executor_id, self.version, args, worker)
        self.inflight[rec.task_id] = rec
        item = [rec.task_id, executor_id, rec.version, args]
        if self.paused:  # a checkpoint waits for the running tasks: hold new ones at the master
            self.paused_items.append(item)
        elif executor_id in self.moving:
            self.held.setdefault(executor_id, []).append(item)
        else:
            self.outbox.setdefault(worker, []).append(item)
        return rec.task_id

    def running(self) -> int:
        """Tasks dispatched to workers and not completed yet (held ones excluded)."""
        return len(self.inflight) - len(self.paused_items)

    def quiescent(self) -> bool:
        """Nothing runs and nothing moves: a consistent cut for a checkpoint."""
        return self.running() == 0 and not self.moving and not self.shard_migrations

    def release_paused(self) -> None:
        """End of a checkpoint's pause: send the held tasks on."""
        self.paused = False
        items, self.paused_items = self.paused_items, []
        for item in items:
            if item[1] in self.moving:
                self.held.setdefault(item[1], []).append(item)
            else:  # its executor may have moved during the pause: it completes where it is now
                self.inflight[item[0]].worker = self.placement[item[1]]
                self.outbox.setdefault(self.placement[item[1]], []).append(item)

    def plan_takeover(self, losts: list[str], role: str, prior: dict[str, list[int]] | None = None,
                      avoid: set[str] | frozenset[str] = frozenset()) -> dict[str, list[int]]:
        """Who takes the dead processes' shards (server) or executors (worker): each item to the
        least loaded survivor, those in ``avoid`` (retiring ones) only if no other is left. The
        dead must already be out of their group. ``prior``: a plan not yet carried out when these
        processes died; its survivors keep their part and the dead ones' parts are planned
        again, so no item ends up in two places."""
        group = self.servers if role == "server" else self.workers
        targets = [p for p in group if p not in avoid] or group

        def held(p: str) -> list[int]:
            return self.shards_of(p) if role == "server" else self.executors_of(p)

        prior = prior or {}
        items = sorted(i for lost in losts for i in held(lost) + prior.get(lost, []))
        assign = {p: list(v) for p, v in prior.items() if p in group}
        load = {p: len(held(p)) + len(assign.get(p, [])) for p in targets}
        for item in items:
            dest = min(targets, key=lambda p: (load[p], p))
            load[dest] += 1
            assign.setdefault(dest, []).append(item)
        return assign

    def roll_back(self, lost: str, role: str, avoid: set[str] | frozenset[str] = frozenset()) -> dict[str, list[int]]:
        """Full recovery: the dead process leaves, the survivors take its part, and every task of
        the abandoned timeline is forgotten (the checkpoint's tasks come back by restore_tasks)."""
        (self.servers if role == "server" else self.workers).remove(lost)
        assign = self.plan_takeover([lost], role, avoid=avoid)
        for dest, items in assign.items():
            for item in items:
                if role == "server":
                    self.shard_map[item] = dest
                else:
                    self.placement[item] = dest
        self.inflight.clear()
        self.outbox.clear()
        self.held.clear()
        # migrations under way are abandoned: their items reload where the placement says
        # (the sources), and what they shipped is dropped on arrival (abandoned_mids)
        self.migrations.clear()
        self.moving.clear()
        self.shard_migrations.clear()
        self.shards_moving.clear()
        self.paused = False
        self.paused_items = []
        self.version = self.completed = 0
        return assign

    def restore_tasks(self, items: list[list[Any]], version: int, completed: int, next_id: int) -> None:
        """Resume from a checkpoint: its counters, and its held tasks with their original ids
        (new ids continue after every id ever given, so none is reused)."""
        self.version, self.completed, self._next_id = version, completed, max(next_id, self._next_id)
        for task_id, executor_id, task_version, args in items:
            worker = self.placement[executor_id]
            self.inflight[task_id] = TaskRecord(task_id, executor_id, task_version, args, worker)
            self.outbox.setdefault(worker, []).append([task_id, executor_id, task_version, args])

    def complete(self, task_id: int) -> TaskRecord:
        """A task finished: forget it and advance the version (before the driver is told)."""
        rec = self.inflight.pop(task_id)
        self.version += 1
        self.completed += 1
        return rec

    def fail(self, task_id: int) -> TaskRecord:
        return self.inflight.pop(task_id)

    def start_migration(self, executors: list[int], dest: str) -> list[tuple[int, str, list[int]]]:
        """Plan moving ``executors`` to worker ``dest``: one migration per source worker.

        Executors already on ``dest`` or already moving are left out. Returns
        ``(mid, source, executors)`` for each migrate_out message to send.
        """
        if dest not in self.workers:
            raise LitzError(f"cannot move executors to {dest!r}: not a worker of this job")
        by_source: dict[str, list[int]] = {}
        for e in executors:
            if e not in self.placement:
                raise LitzError(f"cannot move executor {e!r}: no such executor")
            if self.placement[e] != dest and e not in self.moving and self.placement[e] in self.workers:
                by_source.setdefault(self.placement[e], []).append(e)  # (one on a dead worker is being restored)
        out = []
        for source, eids in by_source.items():
            self._next_mid += 1
            self.migrations[self._next_mid] = (eids, source, dest)
            for e in eids:
                self.moving[e] = self._next_mid
            # tasks queued for the source and not sent yet are held too: every task the source
            # gets for these executors then arrives before migrate_out and ships with them, so
            # none is forwarded behind the executor (a forward from a source that dies next is lost)
            queued = self.outbox.pop(source, [])
            for item in queued:
                if item[1] in eids:
                    self.held.setdefault(item[1], []).append(item)
            if rest := [item for item in queued if item[1] not in eids]:
                self.outbox[source] = rest
            out.append((self._next_mid, source, eids))
        return out

    def start_shard_migration(self, shards: list[int], dest: str) -> list[tuple[int, str, list[int]]]:
        """Plan moving logical shards to server ``dest``; one migration per source server."""
        if dest not in self.servers:
            raise LitzError(f"cannot move shards to {dest!r}: not a server of this job")
        by_source: dict[str, list[int]] = {}
        for s in shards:
            if not (isinstance(s, int) and 0 <= s < self.num_shards):
                raise LitzError(f"cannot move shard {s!r}: shards are 0..{self.num_shards - 1}")
            if self.shard_map[s] != dest and s not in self.shards_moving and self.shard_map[s] in self.servers:
                by_source.setdefault(self.shard_map[s], []).append(s)
        out = []
        for source, ss in by_source.items():
            self._next_mid += 1
            self.shard_migrations[self._next_mid] = (ss, source, dest)
            self.shards_moving.update(ss)
            out.append((self._next_mid, source, ss))
        return out

    def finish_shard_migration(self, mid: int, arrived: bool = True) -> None:
        """Shard migration ``mid`` ended: its shards are served by the destination, or (not
        ``arrived``: the source died before the destination installed them) still the source's."""
        shards, _, dest = self.shard_migrations.pop(mid)
        for s in shards:
            if arrived:
                self.shard_map[s] = dest
            self.shards_moving.discard(s)

    def finish_migration(self, mid: int, arrived: bool = True) -> None:
        """Executor migration ``mid`` ended: its executors run on the destination or (not
        ``arrived``: cancelled when one end died) stay on the source. Held tasks go there.
        Which worker each task in flight completes on decides where a loss dispatches it
        again: the source reported every task it ran before it was told to ship, and the
        queued ones it ships were recorded at the destination then (``tasks_moved``); if the
        executors never arrived, all their tasks are the source's."""
        eids, source, dest = self.migrations.pop(mid)
        worker = dest if arrived else source
        for e in eids:
            del self.moving[e]
            self.placement[e] = worker
            held = self.held.pop(e, [])
            if held:
                self.outbox.setdefault(worker, []).extend(held)
            for item in held:
                self.inflight[item[0]].worker = worker
        if not arrived:
            eset = set(eids)
            for task in self.inflight.values():
                if task.executor_id in eset:
                    task.worker = source

    def tasks_moved(self, task_ids: list[int], dest: str) -> None:
        """Queued tasks shipped along with their executor: they complete on ``dest`` now."""
        for task_id in task_ids:
            task = self.inflight.get(task_id)
            if task is not None:
                task.worker = dest

    def migrations_of(self, ident: str) -> list[tuple[str, int, list[int], str, str]]:
        """Migrations ``ident`` takes part in: ``(kind, mid, items, source, dest)``, kind
        ``"executors"`` or ``"shards"``."""
        return [(kind, mid, items, source, dest)
                for kind, migs in (("executors", self.migrations), ("shards", self.shard_migrations))
                for mid, (items, source, dest) in migs.items() if ident in (source, dest)]

    def plan_balance(self, workers: list[str] | None = None) -> dict[str, list[int]]:
        """Moves that spread the executors evenly over ``workers`` (default: all), with few moves."""
        return even_moves({e: self.moving_dest(e) for e in self.placement},
                          list(workers if workers is not None else self.workers))

    def plan_shard_balance(self, servers: list[str] | None = None) -> dict[str, list[int]]:
        """Moves that spread the logical shards evenly over ``servers`` (default: all)."""
        where = {}
        for mid_shards, _, dest in self.shard_migrations.values():
            where.update(dict.fromkeys(mid_shards, dest))
        return even_moves({s: where.get(s, owner) for s, owner in enumerate(self.shard_map)},
                          list(servers if servers is not None else self.servers))

    def moving_dest(self, executor: int) -> str:
        """Where an executor is, or is going."""
        mid = self.moving.get(executor)
        return self.migrations[mid][2] if mid is not None else self.placement[executor]

    def take_outbox(self) -> dict[str, list[list[Any]]]:
        out, self.outbox = self.outbox, {}
        return out


def _id_order(ident: str) -> tuple[str, int, str]:
    """Process ids in a stable, human order: ``s2`` before ``s10`` (reports list several losses so)."""
    stem = ident.rstrip("0123456789")
    digits = ident[len(stem):]
    return stem, int(digits) if digits else -1, ident


def describe_recovering(r: dict[str, Any]) -> str:
    """One line on a recovery in progress (``Master._recovering``, ``_RollingBack.status``), for
    ``litz status`` and the log."""
    if r.get("strategy") == "full":
        text = f"rolling the whole job back after the loss of {', '.join(r['lost'])} for {r['seconds']:.1f} s: "
        if r.get("store_error"):
            return text + f"waiting for the checkpoint storage to answer ({r['store_error']})"
        if r["step"] == "reading":
            return text + "reading the last checkpoint"
        if r["step"] == "reloading":
            return text + (f"{', '.join(r['waiting'])} reloading from "
                           f"{r['restored_from'] or 'scratch (no checkpoint yet)'}")
        return text + f"{', '.join(r['waiting'])} abandoning their tasks"
    kind = "shards" if r["role"] == "server" else "executors"
    text = f"recovering from the loss of {r['role']} {', '.join(r['lost'])} for {r['seconds']:.1f} s: "
    if r["settling"]:
        return text + f"{', '.join(r['settling'])} settling the migrations it interrupted"
    if r.get("store_error"):  # the plan's read, or a survivor's, failed: asked again until --checkpoint-timeout
        return text + f"waiting for the checkpoint storage to answer ({r['store_error']})"
    if r.get("reading"):
        return text + "reading the running checkpoint"
    if r["waiting"]:
        return text + (f"{', '.join(r['waiting'])} restoring its {kind} from "
                       f"{r['restored_from'] or 'scratch (no checkpoint yet)'}")
    return text + "planning"


def even_moves(where: dict[int, str], targets: list[str]) -> dict[str, list[int]]:
    """Moves (target -> items) that make the items' spread over ``targets`` even, moving few.

    Items on owners outside ``targets`` all move; otherwise only the excess of the most loaded
    targets moves to the least loaded (the most loaded keep the spare ones).
    """
    if not targets:
        raise LitzError("cannot spread work over zero processes")
    load: dict[str, list[int]] = {t: [] for t in targets}
    homeless: list[int] = []
    for item in sorted(where):
        (load[where[item]] if where[item] in load else homeless).append(item)
    n, k = len(where), len(targets)
    by_load = sorted(targets, key=lambda t: -len(load[t]))
    quota = {t: n // k + (1 if i < n % k else 0) for i, t in enumerate(by_load)}
    for t in targets:
        while len(load[t]) > quota[t]:
            homeless.append(load[t].pop())
    moves: dict[str, list[int]] = {}
    for t in targets:
        while len(load[t]) < quota[t] and homeless:
            moves.setdefault(t, []).append(homeless.pop())
            load[t].append(moves[t][-1])
    return moves


class DriverPS(ParameterServer):
    """The driver's synchronous view of the parameters (reads bypass every cache)."""

    def __init__(self, master: Master) -> None:
        self._table = master.table
        self._read = master.read
        self._write = master.write


class EtcdWrites:
    """Writes to etcd that the master's loop makes without waiting, tried again until they land:
    the answers to ``litz`` commands and the requests to node agents (start processes, leave).

    The loop rides out etcd outages (``test_an_etcd_restart_or_outage_does_not_stop_a_job``), but
    these writes were synchronous: one made while etcd was away (a commanded checkpoint finishing,
    a scale or a join starting, a drain ending) held the loop for the call deadline and then raised
    EtcdUnreachable out of it, and the whole job failed. Now each is handed to the etcd thread
    (``Membership.put_soon``); one that fails is sent again every ``retry`` seconds, from the loop
    (``tick``). Writes to one key land in the order they were made, one at a time: two spawn
    requests to one agent are both seen. A write is idempotent for its readers (a command's
    answer, a spawn request whose ids are started once, an exit request), so one whose outcome
    was lost (it landed, then the answer timed out) may land twice."""

    def __init__(self, membership: Membership, retry: float = 1.0) -> None:
        self.membership = membership
        self.retry = retry
        # key -> values still to write, oldest first; the first one is the one under way
        self._queued: dict[str, list[dict[str, Any]]] = {}
        self._under_way: dict[str, concurrent.futures.Future[None]] = {}
        self._next_try: dict[str, float] = {}
        self._failing = False  # said once per outage

    @property
    def pending(self) -> int:
        """How many writes have not landed yet."""
        return sum(len(v) for v in self._queued.values())

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Write ``value`` at ``key`` soon; never waits for etcd, never raises EtcdUnreachable."""
        self._queued.setdefault(key, []).append(value)
        self.tick()

    def tick(self) -> None:
        """From the loop: take the outcomes of writes under way, and start the next ones (a failed
        one again, ``retry`` s after it failed)."""
        now = time.monotonic()
        for key in list(self._queued):
            fut = self._under_way.get(key)
            if fut is not None:
                if not fut.done():
                    continue
                del self._under_way[key]
                error = None if fut.cancelled() else fut.exception()
                if error is None and not fut.cancelled():
                    self._queued[key].pop(0)
                    if self._failing and not self._under_way:
                        self._failing = False
                        log.warning("etcd answers again: the master's pending writes go through")
                    if not self._queued[key]:
                        del self._queued[key]
                        continue
                else:
                    if not self._failing:
                        self._failing = True
                        log.warning("could not write %s to etcd (%s); trying again every %.0f s", key, error,
                                    self.retry)
                    self._next_try[key] = now + self.retry
            if now < self._next_try.get(key, 0.0):
                continue
            try:
                self._under_way[key] = self.membership.put_soon(key, self._queued[key][0])
            except LitzError as exc:  # closed: nothing can be written any more
                log.warning("could not write %s to etcd: %s", key, exc)
                del self._queued[key]

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every write to land (the job's last answers, before it ends);
        whether they did. What is left is said in the log."""
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            self.tick()
            waiting = list(self._under_way.values())
            if waiting:
                concurrent.futures.wait(waiting, timeout=max(0.0, min(0.1, deadline - time.monotonic())),
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            else:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self.tick()
        if self._queued:
            log.warning("etcd did not take %d write(s) before the job ended: %s", self.pending,
                        ", ".join(sorted(self._queued)))
            return False
        return True


CHECKPOINT_KEY = "commands/checkpoint"  # `litz checkpoint` writes {"id": ...} here
STOP_KEY = "commands/stop"  # `litz stop` writes {"id": ..., "checkpoint": bool} here


@dataclass
class _Restoring:
    """A partial recovery (SCAR) in progress: who died, the migrations being settled, and the
    plan of who restores what."""

    role: str  # "server" or "worker": losses of one role recover together
    started: float
    losts: list[str] = field(default_factory=list)
    planned: list[str] = field(default_factory=list)  # losts whose items are in assign
    assign: dict[str, list[int]] = field(default_factory=dict)  # survivor -> items it restores
    settling: dict[int, str] = field(default_factory=dict)  # migration id -> the survivor asked
    settled: list[dict[str, Any]] = field(default_factory=list)  # where each settled migration's items were
    waiting: set[str] = field(default_factory=set)  # survivors still restoring their part
    round: int | None = None  # of the plan sent; None while (re)planning
    source: str | None = None  # the checkpoint restored from
    partials: list[str] = field(default_factory=list)  # partial checkpoints applied after it
    warned: int = 0  # slow-recovery warnings logged (``Master._warn_slow_recovery``)
    # the checkpoint storage failed to answer the plan's read: the error, and when to try again
    store_error: str | None = None
    retry_at: float | None = None
    reading: bool = False  # the running checkpoint is being read, off the loop (``Master._read_running``)
    read: list[Any] | None = None  # what the read found ([None]: no checkpoint yet), until a plan uses it
    where: dict[str, Any] | None = None  # the plan's "restore" field: where the running checkpoint is
    resend: dict[str, float] = field(default_factory=dict)  # survivors whose store failed -> when to ask again


#: Seconds between the log's warnings that a partial recovery still waits (``Master._warn_slow_recovery``).
SLOW_RECOVERY = 30.0

def _gave_up(timeout: float) -> str:
    """How an error that stops the job ends when the checkpoint storage did not answer a recovery
    (the job's checkpoints are still there: what to do once it does)."""
    return (f", tried for {timeout:g} s (--checkpoint-timeout); once the storage answers, launch the job again "
            f"with --resume")


#: Seconds between a recovery's attempts to read the running checkpoint from a store that failed to
#: answer (until ``--checkpoint-timeout`` from the loss, or from the full recovery's reload).
STORE_RETRY = 1.0
#: The reply to each request the master makes (``Master._request``).
_REPLY_TO = {"get": "get_reply", "update": "update_ack", "stats_request": "stats"}


def _next_try(deadline: float) -> float:
    """When to ask a checkpoint store that failed to answer again: ``STORE_RETRY`` s from now,
    the last time at ``deadline`` (``--checkpoint-timeout`` after the recovery began)."""
    return min(time.monotonic() + STORE_RETRY, deadline)

#: The phases of a checkpoint round before any process saved anything for it.
_UNSAVED = ("preparing", "pausing", "scoring")

#: Seconds a finished job waits for a worker still running a task it abandoned (statistics, goodbye).
ABANDONED_GRACE = 1.0


@dataclass
class _RollingBack:
    """A full recovery in progress, as ``litz status`` shows it (``Master._roll_back``)."""

    lost: list[str]
    started: float
    step: str = "abandoning"  # then "reading" (the last checkpoint), then "reloading"
    waiting: set[str] = field(default_factory=set)  # who the step waits for (the rollback's own set)
    source: str | None = None  # the checkpoint it reloads, once read (None: from scratch)
    store_error: str | None = None  # the store failed to answer: asked again until --checkpoint-timeout

    def status(self) -> dict[str, Any]:
        return {"strategy": "full", "lost": sorted(self.lost, key=_id_order), "step": self.step,
                "waiting": sorted(self.waiting, key=_id_order), "restored_from": self.source,
                "seconds": time.monotonic() - self.started, "store_error": self.store_error}


class WaitTimeout(LitzError):
    """The master waited longer than allowed for processes to answer."""


class StartupTimeout(WaitTimeout):
    """Some processes registered but never answered the initialisation; ``silent`` names them, so the
    launcher can add what they were doing (their stacks, from their logs) to the report."""

    def __init__(self, message: str, silent: list[str]) -> None:
        super().__init__(message)
        self.silent = silent


class _Rollback(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """A process died and the job recovers by rolling everything back (``--recovery full``).

    Raised where the death is noticed, possibly deep inside a driver callback that waits for
    a read; caught by the master's loop. A BaseException, so that a driver's ``except
    Exception`` cannot swallow it: whatever the driver was doing belongs to the abandoned
    timeline and its state is replaced from the checkpoint."""

    def __init__(self, ident: str, role: str, reason: str) -> None:
        super().__init__(reason)
        self.ident, self.role, self.reason = ident, role, reason
        self.received: list[Message] = []  # messages taken off the socket with the news


@dataclass
class Resume:
    """A complete checkpoint to start the job from (``litz launch --resume``)."""

    location: str  # as the user gave it (local path or URI): processes open the filesystem from it
    path: str  # the checkpoint's directory in that filesystem
    manifest: dict[str, Any]
    _driver_state: tuple[Driver, dict[str, Any]] | None = field(default=None, repr=False)

    @classmethod
    def find(cls, location: str, app: App, num_executors: int | None, num_shards: int) -> Resume:
        """The newest complete checkpoint at ``location``, checked against the job being started
        (not in a directory every user may write: its pickles are loaded)."""
        from litz.ft import storage  # pyarrow: imported by the first checkpoint or restore, not at start
        storage.refuse_public(location)
        fs, path, manifest = storage.find_checkpoint(location)
        storage.refuse_checkpoint_public(fs, path, manifest)  # (its directory and files too)
        return cls._checked(location, path, manifest, app, num_executors, num_shards)

    @classmethod
    def newest_usable(cls, location: str, app: App, num_executors: int | None, num_shards: int,
                      driver: Driver) -> Resume | None:
        """``--resume auto``: the newest complete full checkpoint of the run that last ran with
        ``location`` as its checkpoint directory (one it wrote, else the one it resumed from or
        rolled back to: ``storage.write_timeline``; the directory's newest where that run left no
        record) whose files are all there and whole and whose driver state loads (read into
        ``driver``); None if there is none. A damaged one is skipped with a warning that names
        what is wrong: the checkpoints before it are as good as they were, and a restart loop
        must not stop on one bad file. Storage that does not answer, a checkpoint of another
        shape than this job (an older one would not be any better), or only damaged ones, raise."""
        from litz.ft import storage

        storage.refuse_public(location)  # (as find)
        shown = storage.redact(location)  # what messages name: no credentials
        damaged: list[str] = []
        for where, fs, path, manifest in cls._timeline(location):
            try:
                if manifest is None:  # the anchor: read here, where its damage is skipped as the others'
                    if not storage.has_manifest(fs, path):
                        raise storage.DamagedCheckpoint(f"the checkpoint the last run in {shown} went on from, "
                                                        f"{path}, has no {storage.MANIFEST} any more")
                    manifest = storage.read_manifest(fs, path)
                    if manifest.get("partial_of"):
                        raise storage.DamagedCheckpoint(f"{path} is a partial checkpoint, not a full one")
                storage.refuse_checkpoint_public(fs, path, manifest)  # refused, not skipped: someone must look
                resume = cls._checked(where, path, manifest, app, num_executors, num_shards)
                storage.verify_files(fs, path, manifest)
                resume.read_driver(driver)
            except storage.DamagedCheckpoint as exc:
                log.warning("%s; that checkpoint is skipped, an older one is tried", exc)
                damaged.append(str(exc))
                continue
            return resume
        if damaged:  # starting afresh would throw the job's progress away without a word
            raise storage.DamagedCheckpoint(f"no usable checkpoint in {shown}: {'; '.join(damaged)} (remove "
                                            "them, or choose another --checkpoint-dir, to start from scratch)")
        return None

    @staticmethod
    def _timeline(location: str) -> Iterator[tuple[str, Any, str, dict[str, Any] | None]]:
        """The full checkpoints ``--resume auto`` may take at ``location``, newest first, as
        ``(location, filesystem, path, manifest)``: those the last run there wrote, then the one it
        went on from (its manifest None: not read yet). Every complete one if it left no record."""
        from litz.ft import storage

        record = storage.read_timeline(location)
        after, anchor = record if record is not None else (-1, None)
        for fs, path, manifest in storage.full_checkpoints(location, since=after + 1):
            yield location, fs, path, manifest
        if anchor is not None:
            where, path = anchor
            storage.refuse_public(where)
            yield where, storage.filesystem(where)[0], path, None

    @classmethod
    def _checked(cls, location: str, path: str, manifest: dict[str, Any], app: App, num_executors: int | None,
                 num_shards: int) -> Resume:
        """The checkpoint at ``path`` if the job being started fits it (tables, executors, shards)."""
        from litz.ft import storage

        # rows per table too, where the checkpoint says (those of before session 31 do not)
        with_rows = all("num_rows" in t for t in manifest["tables"])
        declared = {t.name: [list(t.shape), str(np.dtype(t.dtype)), *([t.num_rows] if with_rows else [])]
                    for t in app.tables}
        saved = {t["name"]: [t["shape"], t["dtype"], *([t["num_rows"]] if with_rows else [])]
                 for t in manifest["tables"]}
        if declared != saved:
            raise storage.CheckpointError(f"checkpoint {path} holds tables {saved}, "
                                          f"the application declares {declared}")
        for what, mine, theirs in (("executors", num_executors, manifest["num_executors"]),
                                   ("shards", num_shards, manifest["num_shards"])):
            if mine is not None and mine != theirs:
                raise storage.CheckpointError(f"checkpoint {path} was taken with {theirs} {what}, not {mine}")
        return cls(location, path, manifest)

    def read_driver(self, driver: Driver) -> None:
        """Read the driver's saved state now, bound to ``driver``: ``litz.run`` does before any process
        starts, so that a damaged ``driver.pkl`` is refused at once; the master takes it at start."""
        self._driver_state = (driver, Master._read_driver_file(self.location, self.path, self.manifest, driver))

    def take_driver_state(self, driver: Driver) -> dict[str, Any]:
        """The driver's saved state bound to ``driver``: what :meth:`read_driver` read (handed out
        once: training changes those objects afterwards), else read now."""
        held, self._driver_state = self._driver_state, None
        if held is not None and held[0] is driver:
            return held[1]
        return Master._read_driver_file(self.location, self.path, self.manifest, driver)


class Master:
    """Runs one job's driver over registered worker and server processes."""

    _rolling_back: _RollingBack | None = None  # the full recovery in progress (for litz status)
    _progress_failed = False  # the driver's progress() raised once (said once in the log)

    def __init__(self, app: App, job: str, membership: Membership, *, workers: int, servers: int,
                 num_executors: int, options: dict[str, Any] | None = None,
                 health_check: Callable[[], None] | None = None, startup_timeout: float = 60.0,
                 num_shards: int = DEFAULT_NUM_SHARDS, resume: Resume | None = None) -> None:
        self.app = app
        self.job = job
        self.membership = membership
        self.want_workers = workers
        self.want_servers = servers
        self.num_executors = num_executors
        self.options = dict(options or {})
        self.health_check = health_check
        self.startup_timeout = startup_timeout
        self.num_shards = num_shards
        self.tables: dict[str, Table] = table_index(app.tables)
        self.endpoint = Endpoint("master")
        self.ps = DriverPS(self)
        self.state: MasterState | None = None  # type: ignore[assignment]
        self.procs: dict[str, dict[str, Any]] = {}
        # node agents by name (``procs/agent/<name>``), kept from the PROCS watch: looked up without
        # asking etcd, which the loop must never wait for (``local_agent``, joins and drains)
        self.agents: dict[str, dict[str, Any]] = {}
        self.etcd_writes = EtcdWrites(membership)  # answers and agents' requests, written without waiting
        self._rid = 0
        self._replies: dict[int, Message] = {}
        self._asked: dict[int, tuple[str, str]] = {}  # request id -> (whom, the reply's type), until answered
        self._deferred: list[Message] = []
        self._byes: dict[str, dict[str, Any]] = {}
        self._events: collections.deque[Event] = collections.deque()  # etcd events not handled yet
        self._commands_taken: dict[tuple[str, str], float] = {}  # (key, id) of signed commands taken, when
        self._started_at = time.time()  # a command signed before it is an earlier run's (_command_refused)
        self._unresponsive: set[str] = set()  # never answered the initialisation: not waited for again
        # workers still in a task the finished job abandoned when it ended (``shutdown``): the
        # launcher kills them rather than wait seconds for them to leave
        self.stuck: list[str] = []
        self._stats: dict[int, dict[str, Any]] = {}
        self._last_health = 0.0
        self._last_status = 0.0
        self.driver: Driver | None = None
        self.errors: list[str] = []
        self.migrations_done = 0
        self.elastic = Elasticity(self)
        self.resume = resume
        ckpt_dir = self.options.get("checkpoint_dir")
        self.checkpoints = CheckpointCoordinator(
            ckpt_dir, self.options.get("checkpoint_every"), self.options.get("checkpoint_policy", "full"),
            float(self.options.get("checkpoint_fraction", 1.0)),
            float(self.options.get("checkpoint_timeout", DEFAULT_TIMEOUT)),
            self.options.get("checkpoint_keep")) if ckpt_dir else None
        if self.checkpoints is not None and resume is not None:  # recoveries go back no further, nor elsewhere
            self.checkpoints.anchored((resume.location, resume.path, resume.manifest))
        self._ckpt_commands: list[str] = []  # `litz checkpoint` / `litz stop` ids waiting for a full round
        # `litz stop`: {"id", "checkpoint": wanted, "path": the checkpoint it waits for (once written)}
        self._stop: dict[str, Any] | None = None
        self._stop_signals = self._stop_signals_seen = 0  # SIGTERMs received / acted on (request_stop)
        # outcomes of checkpoint steps run off the loop (``_in_background``): (round, step, value, error);
        # each also writes a byte to the wake-up pipe, which the loop polls beside its socket
        self._background: queue.SimpleQueue[tuple[int, str, Any, str | None]] = queue.SimpleQueue()
        # a partial recovery's read of the running checkpoint, done off the loop (``_read_running``)
        self._restore_reads: queue.SimpleQueue[tuple[int, str, Any, str | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()  # a thread that ends after shutdown must not write to a reused fd
        self._wake_open = True
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self.endpoint.router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # None: a lost process stops the job; "partial": SCAR; "full": everything rolls back
        self.recovery = self.options.get("recovery")
        self.lost: set[str] = set()  # fenced: declared lost, never heard again (see _fence)
        self._fenced_told: set[str] = set()
        self.recoveries: list[dict[str, Any]] = []  # what was lost and how it was recovered
        self._status_unpublished = False  # the last status write failed (etcd unreachable)
        self._status_put: concurrent.futures.Future[None] | None = None  # the status write under way
        self._restoring: _Restoring | None = None  # the partial recovery in progress
        self._waiting_losses: list[tuple[str, str]] = []  # (ident, role) lost during the other role's recovery
        self._restore_round = 0  # numbers recovery plans: answers to a replaced plan are ignored
        # completed partial recoveries the driver has not been told of yet (``Driver.recovered``):
        # told from the main loop, never from inside a driver's own read that pumps messages
        self._recovered: list[Recovery] = []
        self._initial_driver: bytes | None = None  # the driver before its first task: full recovery
                                                   # without any checkpoint starts from it
        self.retiring: set[str] = set()  # processes told to leave that have not said goodbye yet
        self._route_rid = 0
        self._route_waits: dict[int, set[str]] = {}  # routes request -> processes yet to answer
        self._init_blobs: tuple[bytes, bytes] | None = None
        self.relief = stragglers.from_options(self.options)  # None: off
        self.straggler_moves: list[dict[str, Any]] = []  # executors moved off slower workers

    def table(self, name: str) -> Table:
        return lookup(self.tables, name)

    # -- the loop's plumbing ------------------------------------------------------------------
    def _poll(self, timeout_ms: int) -> list[Message]:
        """Wait for messages (and check the processes' health); return those received."""
        out: list[Message] = []
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:  # the outcome it announces is queued, taken below or by the main loop:
            self._drain_wake()  # left unread, every later poll (a sub-loop's wait) would return at once
        if self.endpoint.router in events:
            while True:
                try:
                    msg = self.endpoint.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if msg is not None and msg.sender in self.lost:
                    self._from_fenced(msg)
                elif msg is not None:
                    out.append(msg)
        self._signalled_stop()
        self._running_read()
        self.etcd_writes.tick()
        now = time.monotonic()
        if now - self._last_health > 0.2:
            self._last_health = now
            try:
                self._check_health()
            except _Rollback as rb:
                rb.received.extend(out)  # handled (or dropped, if of the abandoned timeline) by the rollback
                raise
        if now - self._last_status > STATUS_PERIOD:
            self._last_status = now
            self._warn_slow_recovery()
            self._retry_restore()
            self.publish_status("starting" if self.driver is None else "stopping" if self._stop else "running")
        return out

    def _from_fenced(self, msg: Message) -> None:
        """A message from a process declared lost (it stalled past its lease and came back):
        dropped, and the process is told to leave, once."""
        if msg.sender in self._fenced_told:
            return
        self._fenced_told.add(msg.sender)
        log.warning("%s is back after it was declared lost and its work recovered elsewhere: its messages "
                    "are ignored and it is told to leave", msg.sender)
        with contextlib.suppress(Exception):
            self.endpoint.send(msg.sender, "shutdown", reason="declared lost: its work was recovered elsewhere")

    def _registered_after_fence(self, ident: str, addr: str) -> None:
        """A process declared lost registered again: it only stalled past its lease (here, or on
        another host, where ``_fence`` cannot kill it) and its keep-alive put its keys back. It is
        told to leave, and not counted as a process of the job again. Before, it was added back to
        ``procs`` and lived on as a zombie until the job ended, handed to later joiners as a peer
        (``init_worker``); a server, which speaks only when spoken to, never heard ``_from_fenced``."""
        log.warning("%s registered again after it was declared lost and its work recovered elsewhere: "
                    "it is told to leave", ident)
        self._fenced_told.add(ident)  # (what it sends before it leaves is dropped without another word)
        if self.endpoint.connect(ident, addr):
            with contextlib.suppress(Exception):
                self.endpoint.send(ident, "shutdown", reason="declared lost: its work was recovered elsewhere")

    def publish_status(self, phase: str, final: bool = False) -> None:
        """Write the job's status to etcd (``status`` under the job prefix) for ``litz status``.

        Written in the background, one write at a time: the loop never waits on etcd for it (while
        etcd was away each write held the loop for the call deadline, and the job crawled). A
        status due while the last one is still on its way is skipped, before it is even built; the
        next period sends a newer one. The job's last status (final=True) waits, within one call
        deadline in all, for the write before it (so that its own lands last) and for its own; not
        for its own when the one before failed or is still trying: etcd is away, and the job need
        not wait for it.
        """
        deadline = time.monotonic() + self.membership.timeout + 1.0
        pending = self._status_put
        if pending is not None and not pending.done():
            if not final:
                return
            concurrent.futures.wait([pending], timeout=deadline - time.monotonic())
        etcd_away = pending is not None and (not pending.done() or pending.cancelled()
                                             or pending.exception() is not None)
        try:
            self._status_put = put = self.membership.put_soon(STATUS_KEY, self._status(phase))
        except LitzError as exc:  # closed already: nothing to publish to
            log.debug("could not publish the job status: %s", exc)
            return
        put.add_done_callback(self._status_written)
        if final and not etcd_away:
            concurrent.futures.wait([put], timeout=max(0.0, deadline - time.monotonic()))

    def _progress(self, driver: Driver) -> str:
        """``driver.progress()`` as text. It only feeds ``litz status``: one that raises (an attribute
        not set yet) or returns another type (a NumPy float) must not end the job, as it did."""
        try:
            text = driver.progress()
        except Exception as exc:
            if not self._progress_failed:
                log.warning("the driver's progress() raised (litz status shows the error):", exc_info=True)
                self._progress_failed = True
            return f"progress() raised {type(exc).__name__}: {exc}"
        return text if isinstance(text, str) else str(text)

    def _status(self, phase: str) -> dict[str, Any]:
        """The job's status as ``litz status`` shows it."""
        st = self.state
        status: dict[str, Any] = {"phase": phase, "job": self.job, "updated": time.time()}
        if st is not None:
            status.update(version=st.version, completed=st.completed, inflight=len(st.inflight),
                          num_executors=st.num_executors, num_shards=st.num_shards,
                          executors={w: st.executors_of(w) for w in st.workers},
                          shards={s: st.shards_of(s) for s in st.servers})
        if self.driver is not None:
            status["progress"] = self._progress(self.driver)
        status["scaling"] = self.elastic.op is not None
        status["scale_history"] = self.elastic.history[-5:]
        if self.recoveries:
            status["recoveries"] = self.recoveries[-5:]
        if self.straggler_moves:
            status["straggler_moves"] = len(self.straggler_moves)
            status["last_straggler_move"] = self.straggler_moves[-1]
        if self.lost:
            status["lost"] = sorted(self.lost, key=_id_order)
        if self._byes:  # their registrations last until their leases end when etcd could not be told
            status["left"] = sorted(self._byes, key=_id_order)
        if self.elastic.unjoined:  # their agents stop them when the job ends (they cannot hear the master)
            status["unjoined"] = sorted(self.elastic.unjoined, key=_id_order)
        if (rec := self._restoring) is not None:
            status["recovering"] = self._recovering(rec)
        elif self._rolling_back is not None:
            status["recovering"] = self._rolling_back.status()
        if self.checkpoints is not None:
            status["checkpoint_running"] = self.checkpoints.round is not None
            status["checkpoints"] = list(itertools.islice(reversed(self.checkpoints.completed), 5))[::-1]
            # said apart: the last complete round may be older than the last five, all failed
            status["last_checkpoint"] = self.checkpoints.last_complete()
            status["checkpoints_failing"] = self.checkpoints.failed_in_a_row()
        return status

    @staticmethod
    def _recovering(rec: _Restoring) -> dict[str, Any]:
        """A partial recovery in progress, as ``litz status`` shows it: who it waits for and how
        long it has (restoring a large model from a network store takes a while)."""
        return {"lost": sorted(rec.losts, key=_id_order), "role": rec.role,
                "settling": sorted(set(rec.settling.values()), key=_id_order),
                "waiting": sorted(rec.waiting, key=_id_order) if rec.round is not None else [],
                "restored_from": rec.source, "seconds": time.monotonic() - rec.started,
                "store_error": rec.store_error, "reading": rec.reading}

    def _warn_slow_recovery(self) -> None:
        """Say in the log, every ``SLOW_RECOVERY`` s, what a partial recovery still waits for: the
        job's tasks on the lost items wait with it."""
        rec = self._restoring
        if rec is None:
            return
        waited = time.monotonic() - rec.started
        if waited < SLOW_RECOVERY * (rec.warned + 1):
            return
        rec.warned = int(waited // SLOW_RECOVERY)
        log.warning("still %s", describe_recovering(self._recovering(rec)))

    def _status_written(self, put: concurrent.futures.Future[None]) -> None:
        """A status write ended (on the etcd thread): say once per outage that it failed, and once
        that it works again. Status is informative: a failure never stops the job."""
        if put.cancelled():
            return
        exc = put.exception()
        if exc is not None:
            # said once per outage: the status is published twice a second
            (log.debug if self._status_unpublished else log.warning)("could not publish the job status: %s", exc)
            self._status_unpublished = True
        elif self._status_unpublished:
            self._status_unpublished = False
            log.warning("the job status is published again")

    def _check_health(self) -> None:
        if self.membership.lost_any:  # (exclusive: register_exclusively)
            [(key, holder)] = list(self.membership.lost_keys.items())[:1]
            raise LitzError(f"the master's registration {key} was taken by pid {holder.get('pid')} on "
                            f"{holder.get('host')} (another master of job {self.job!r}) while this one was cut off "
                            "from etcd longer than its lease: it gives way and stops")
        while self.health_check is not None:  # each failure is reported once: all of them, in turn
            try:
                self.health_check()
                break
            except ProcessLost as exc:
                self._process_lost(exc.ident, str(exc))
        self.elastic.tick()  # time-outs of scale operations
        self._relieve_stragglers()
        # one event at a time from a queue: a loss under full recovery raises (a rollback) out of
        # this loop, and the events after it in the batch (another loss, a command) wait for the
        # next pass instead of being dropped with the batch
        self._events.extend(self.membership.poll_events())
        while self._events:
            ev = self._events.popleft()
            if ev.key.startswith(AGENT_PROCS):
                self._learn_agent(ev.key, ev.value if ev.kind == "put" else None)
            elif ev.kind == "delete" and ev.key.startswith(PROCS) and self.state is not None:
                ident = ev.key.rsplit("/", 1)[-1]
                self.endpoint.forget(ident)  # (first: a full recovery raises out of _process_lost)
                if ident in self.state.workers or ident in self.state.servers:
                    if ident not in self._byes:
                        self._process_lost(ident, f"process {ident} left the job (its etcd lease ended)")
            elif ev.kind == "put" and ev.key.startswith(PROCS) and ev.value and "addr" in ev.value:
                if ev.value["id"] in self.lost:
                    self._registered_after_fence(ev.value["id"], ev.value["addr"])
                    continue
                self.procs[ev.value["id"]] = ev.value
                self.endpoint.connect(ev.value["id"], ev.value["addr"])
                self.elastic.on_registered(ev.value["id"])
            elif ev.kind == "put" and ev.value is not None and self._command_refused(ev.key, ev.value):
                continue
            elif ev.kind == "put" and ev.key == SCALE_KEY and ev.value is not None:
                self.elastic.on_command(ev.value)
            elif ev.kind == "put" and ev.key.startswith(JOINS) and ev.value is not None:
                self.elastic.on_join(ev.value)
            elif ev.kind == "put" and ev.key == CHECKPOINT_KEY and ev.value is not None:
                self.on_checkpoint_command(ev.value)
            elif ev.kind == "put" and ev.key == STOP_KEY and ev.value is not None:
                self.on_stop_command(ev.value)
        self.elastic.offers_due()

    def _command_refused(self, key: str, value: dict[str, Any]) -> bool:
        """Whether the command found at etcd ``key`` (``litz scale``, ``stop``, ``checkpoint``, a host's
        join offer or drain) is refused, and said so. A secured job takes only commands signed with
        its secret (``security.command_refusal``), each id once: anyone who can write a shared etcd
        could stop, scale or drain it before. An unsigned one is answered (a user who forgot
        ``--secret-file`` learns why); a replay is not (its answer would overwrite the first's)."""
        if key not in (SCALE_KEY, CHECKPOINT_KEY, STOP_KEY) and not key.startswith(JOINS):
            return False
        cid = value.get("id")
        why = security.command_refusal(self.endpoint.secret, key, value, since=self._started_at)
        if why is None and self.endpoint.secret is not None:
            now = time.time()
            if len(self._commands_taken) > 1000:  # (older than a signature lasts: cannot come again)
                self._commands_taken = {c: t for c, t in self._commands_taken.items()
                                        if now - t < 2 * security.COMMAND_TTL}
            if (key, str(cid)) in self._commands_taken:
                log.warning("refused the command at %s (id %r): it was taken already (a replay)", key, cid)
                return True
            self._commands_taken[(key, str(cid))] = now
        if why is None:
            return False
        log.warning("refused the command at %s (id %r): %s", key, cid, why)
        if isinstance(cid, str) and 0 < len(cid) <= 64:
            self.reply_command(cid, False, f"refused: {why}")
        return True

    def request_agent(self, agent: str, kind: str, value: dict[str, Any]) -> None:
        """Ask node agent ``agent`` for something (``spawn`` processes, ``exit``) through etcd, signed
        with the job secret in a secured job (agents take no other), written soon (``EtcdWrites``)."""
        key = f"{AGENTS}{agent}/{kind}"
        self.etcd_writes.put(key, security.sign_command(self.endpoint.secret, key, value))

    def _learn_agent(self, key: str, value: dict[str, Any] | None) -> None:
        """A node agent registered (``value``) or left (None)."""
        name = key[len(AGENT_PROCS):]
        if value is None:
            self.agents.pop(name, None)
        else:
            self.agents[name] = value

    def _wait(self, done: Callable[[], bool], what: str | Callable[[], str], timeout: float,
              handle: Callable[[Message], None]) -> None:
        """Handle messages until ``done()``; LitzError saying ``what`` was awaited (a callable is asked
        then, so it can name who has not answered) if ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
            for msg in self._poll(100):
                handle(msg)

    def _off_loop(self, work: Callable[[], Any], what: str, timeout: float,
                  handle: Callable[[Message], None]) -> Any:
        """``work()`` on a thread while the loop handles messages (``handle``), watches the
        processes and publishes the status; its value, or its exception raised here. WaitTimeout
        saying ``what`` was awaited after ``timeout`` s: the thread is left to a store that never
        answers (a daemon, it holds nothing of the job's)."""
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def run() -> None:
            try:
                box.put((True, work()))
            except Exception as exc:
                box.put((False, exc))

        threading.Thread(target=run, daemon=True, name="master-off-loop").start()
        self._wait(lambda: not box.empty(), what, timeout, handle)
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def _handle_aside(self, msg: Message) -> None:
        """While waiting for replies, keep completions (and ``ship_ready``, which must follow
        its sender's completions) for the main loop, and record replies."""
        if msg.sender in self.lost:  # received before it was declared lost: it no longer counts
            return
        if msg.type in ("get_reply", "update_ack", "stats") or (msg.type == "error" and "rid" in msg.fields):
            asked = self._asked.get(msg["rid"])  # only the one asked answers, and once, with what was asked
            if asked is None or asked[0] != msg.sender or msg.type not in (asked[1], "error"):
                log.warning("%s sent a %s for request %r, which it was not asked: dropped", msg.sender, msg.type,
                            msg["rid"])
                return
            del self._asked[msg["rid"]]
            self._replies[msg["rid"]] = msg
        elif msg.type == "bye":
            self._byes[msg.sender] = msg["stats"]
            self.retiring.discard(msg.sender)
            self._part_never_written(msg.sender, f"{msg.sender} left the job (scale-in) before writing its part "
                                                 "of the checkpoint")
            self.elastic.tick()
        elif msg.type == "migrated":
            self.on_migrated(msg)
            self.elastic.tick()
        elif msg.type == "shards_moved":
            assert self.state is not None
            moving = self.state.shard_migrations.get(msg["mid"])
            if moving is not None and msg.sender != moving[2]:  # (only its destination installed them)
                log.warning("shards_moved for migration %d from %s, which is not its destination %s; dropped",
                            msg["mid"], msg.sender, moving[2])
            elif moving is not None:
                self.state.finish_shard_migration(msg["mid"])
                self.elastic.tick()
        elif msg.type == "settled":
            self.on_settled(msg)
        elif msg.type in ("shards_restored", "executors_restored"):
            if msg.get("error"):
                self._restore_failed(msg.sender, msg.get("round"), msg["error"])
            else:
                self._restored(msg.sender, msg.get("round"))
        elif msg.type == "checkpoint_snapshot":
            if self.checkpoints is not None and self.checkpoints.snapshot_taken(msg["cid"], msg.sender):
                assert self.state is not None
                self.state.release_paused()
                self.elastic.tick()
        elif msg.type == "ckpt_scores_reply":
            self._scores_in(msg["cid"], msg.sender, msg["scores"], msg.get("error"))
        elif msg.type == "checkpoint_written":
            # a written part implies its snapshot: the snapshot message may still wait in an outer
            # batch while a driver's synchronous read handles this one first
            if self.checkpoints is not None and self.checkpoints.snapshot_taken(msg["cid"], msg.sender):
                assert self.state is not None
                self.state.release_paused()
            if self.checkpoints is not None and self.checkpoints.written(msg["cid"], msg.sender, msg["files"],
                                                                         msg.get("error")):
                self._finish_checkpoint()
        elif msg.type == "routes_ack":
            self._route_waits.get(msg["rid"], set()).discard(msg.sender)
            self.elastic.tick()
        elif msg.type == "ready":
            self.elastic.on_ready(msg.sender, msg.get("error"))
        elif msg.type == "error":
            self._report_error(msg)
        elif msg.type in ("done", "ship_ready"):
            self._deferred.append(msg)
        else:  # kept, it would be deferred again and again, and the job never seen stalled
            log.warning("unexpected %r message from %s; dropped", msg.type, msg.sender)

    def _report_error(self, msg: Message) -> None:
        if self.state is not None and msg.sender not in self.state.workers + self.state.servers:
            log.warning("error report from %s, which is not a worker or server of this job; ignored: %s",
                        msg.sender, msg.get("reason"))
            return
        if msg.get("about") in ("executor_state", "migrate_out", "ship"):  # executors would be lost: stop cleanly
            raise LitzError(f"executor migration failed on {msg.sender}: {msg['reason']}")
        if msg.get("about") in ("migrate_shards", "shard_data"):  # it would wait for ever, or rows are lost
            raise LitzError(f"shard migration failed on {msg.sender}: {msg['reason']}")
        if msg.get("about") == "update":  # the worker sends it before the completions that made the update
            raise LitzError(f"updates sent by {msg.sender} were refused, so the tables lack them and the job "
                            f"stops: {msg['reason']}")
        if msg.get("about") in ("routes", "server_lost", "shard_map"):  # it routes to where it did: requests
            # there would wait for ever (and a scale-in for its routes_ack)
            raise LitzError(f"{msg.sender} refused the new routes ({msg['about']}): {msg['reason']}")
        if msg.get("about") in ("restore_executors", "restore_shards", "reload_executors", "reload_shards"):
            # the recovery would wait for this process forever
            raise LitzError(f"recovery failed on {msg.sender} ({msg['about']}): {msg['reason']}")
        text = f"{msg.sender}: {msg['reason']}"
        self.errors.append(text)
        log.error("error reported by %s", text)

    # -- start-up -------------------------------------------------------------------------------
    def _wait_for_processes(self) -> tuple[list[str], list[str]]:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            procs = self.membership.get_prefix(PROCS)
            workers = sorted(v["id"] for k, v in procs.items() if k.startswith(proc_key("worker", "")))
            servers = sorted(v["id"] for k, v in procs.items() if k.startswith(proc_key("server", "")))
            if len(workers) >= self.want_workers and len(servers) >= self.want_servers:
                for k, v in procs.items():
                    if "addr" in v:
                        self.procs[v["id"]] = v
                        self.endpoint.connect(v["id"], v["addr"])
                    elif k.startswith(AGENT_PROCS):
                        self._learn_agent(k, v)
                return workers[: self.want_workers], servers[: self.want_servers]
            if time.monotonic() > deadline:
                raise LitzError(f"timed out after {self.startup_timeout:.0f} s waiting for "
                                f"{self.want_workers} workers and {self.want_servers} servers to register "
                                f"(have {len(workers)} and {len(servers)})")
            if self.health_check is not None:
                self.health_check()
            time.sleep(0.02)

    def _initialise(self, workers: list[str], servers: list[str]) -> None:
        state = self.state = MasterState(self.num_executors, workers, servers, self.num_shards)
        try:  # (pickled once, here: a big config is not pickled twice to check it before the start)
            tables_blob = cloudpickle.dumps(list(self.tables.values()))
            app_blob = cloudpickle.dumps({"executor": self.app.executor, "config": self.app.config})
        except Exception as exc:
            raise ConfigError(f"the application cannot be sent to the workers (its executor class, config or "
                              f"tables do not pickle): {type(exc).__name__}: {exc}") from exc
        self._init_blobs = (app_blob, tables_blob)
        restore = self._restore_fields()
        for srv in servers:
            self.endpoint.send(srv, "init_server", tables=tables_blob, shards=state.shards_of(srv),
                               num_shards=state.num_shards, master="master", **self._server_options(),
                               **restore.get("shards", {}))
        for w in workers:
            self.init_worker(w)
        ready: dict[str, Message] = {}

        def on_msg(msg: Message) -> None:
            if msg.type == "ready":
                ready[msg.sender] = msg
            else:
                self._handle_aside(msg)

        def silent() -> list[str]:
            return sorted({*workers, *servers} - ready.keys(), key=_id_order)

        try:
            self._wait(lambda: len(ready) == len(workers) + len(servers),
                       lambda: f"workers and servers to initialise (no answer from {', '.join(silent())})",
                       self.startup_timeout, on_msg)
        except WaitTimeout as exc:
            stuck = silent()
            self._unresponsive.update(stuck)  # the shutdown does not wait for their goodbyes
            raise StartupTimeout(str(exc), stuck) from None
        failures = [m.get("error") for m in ready.values() if m.get("error")]
        if failures:
            raise LitzError("initialisation failed:\n" + "\n".join(failures))

    # -- the driver's synchronous PS access -----------------------------------------------------
    def _request(self, server: str, type_name: str, **fields: Any) -> int:
        self._rid += 1
        self._asked[self._rid] = (server, _REPLY_TO[type_name])
        self.endpoint.send(server, type_name, rid=self._rid, **fields)
        return self._rid

    def read(self, table: Table, keys: list[Hashable]) -> np.ndarray:
        """Read rows of checked keys straight from the servers (used by the driver)."""
        out = np.empty((len(keys), *table.shape), table.dtype)
        self._sync(table, keys, None, out)
        return out

    def write(self, table: Table, keys: list[Hashable], deltas: np.ndarray) -> None:
        """Apply updates from the driver and wait until the servers acknowledge them. The version
        then advances, as after a completion: a task dispatched after the write must not be served
        a row that a worker's cache holds for a task dispatched before it (DESIGN.md §2's rule,
        with the driver's write in the place of a task's)."""
        self._sync(table, keys, deltas, None)
        if self.state is not None:
            self.state.version += 1

    def _sync(self, table: Table, keys: list[Hashable], deltas: np.ndarray | None, out: np.ndarray | None) -> None:
        """Send a read (``out``) or an update (``deltas``) to the owners of the keys and wait.

        If an owner dies meanwhile and is recovered (SCAR), its part is sent again to the new
        owners of its shards; the other parts are not repeated. A part of an update sent again
        names the update it was first sent in (``origin``, as a worker's do): the dead owner may
        have forwarded some of it, applied by now, and the new owners skip those
        (``AppliedOnce``). Every request of the call may be sent again until the call returns, so
        each, first sends included, names the call's first request as the lowest the driver may
        still send again (``low``): a server prunes what it remembers below that. Before, a first
        send's own rid was taken for it, and a part sent straight to a server dropped what that
        server remembered of another part of the same write, forwarded to it by a server that
        then died: resent, that part was applied twice.
        """
        assert self.state is not None
        what = f"{'reading' if deltas is None else 'updating'} table {table.name!r}"
        pending = list(range(len(keys)))
        first: dict[int, int] = {}  # key position -> the request its update was first sent in
        low = self._rid + 1  # this call's first request
        while pending:
            groups: dict[tuple[str, int | None], list[int]] = {}
            for i in pending:
                owner = self.state.shard_map[shard_of(keys[i], self.num_shards)]
                groups.setdefault((owner, first.get(i)), []).append(i)
            sent: dict[int, tuple[str, list[int]]] = {}
            for (srv, again), idx in groups.items():
                item = [table.name, [keys[i] for i in idx]] + ([] if deltas is None else [deltas[idx]])
                extra = ({} if deltas is None else {"low": low}) if again is None else \
                    {"origin": [self.endpoint.ident, again, low]}
                rid = self._request(srv, "get" if deltas is None else "update", items=[item], **extra)
                sent[rid] = (srv, idx)
                if deltas is not None:
                    first.update((i, rid) for i in idx if i not in first)

            def settled(sent: dict[int, tuple[str, list[int]]] = sent) -> bool:
                return all(r in self._replies or (srv in self.lost and self._restoring is None)
                           for r, (srv, _) in sent.items())

            self._wait(settled, what, 60.0, self._handle_aside)
            pending = []
            for rid, (_, idx) in sent.items():
                self._asked.pop(rid, None)  # (its server died: never answered)
                reply = self._replies.pop(rid, None)
                if reply is None:  # its server died: send this part again to the new owners
                    pending.extend(idx)
                    continue
                if reply.type == "error":
                    raise LitzError(f"{what} failed on {reply.sender}: {reply['reason']}")
                if reply["errors"][0] is not None:
                    raise TableError(reply["errors"][0])
                if out is not None:
                    out[idx] = reply["values"][0]

    def collect_stats(self) -> dict[str, dict[str, Any]]:
        """Ask every process for its counters (benchmarks). A process lost before it answers is
        left out: its counters died with it, and waiting for them held a finished job for the
        whole timeout (a worker killed just as the driver finished)."""
        assert self.state is not None
        procs = self.state.workers + self.state.servers
        rids = {p: self._request(p, "stats_request") for p in procs}
        busy = self._busy_workers()
        grace = time.monotonic() + ABANDONED_GRACE

        def answered() -> bool:
            late = time.monotonic() > grace
            return all(r in self._replies or p in self.lost or (late and p in busy) for p, r in rids.items())

        try:
            self._wait(answered, "statistics", 60.0, self._handle_aside)
        except WaitTimeout as exc:  # the job is done: its result must not be lost for want of counters
            log.warning("%s; the statistics leave them out", exc)
        if missing := sorted(p for p, r in rids.items() if r not in self._replies and p in busy):
            log.warning("statistics leave out %s, still running tasks abandoned when the job ended", ", ".join(missing))
        out = {}
        for p, rid in rids.items():
            self._asked.pop(rid, None)
            reply = self._replies.pop(rid, None)
            if reply is None:
                continue
            if reply.type == "error":
                raise LitzError(f"statistics failed on {reply.sender}: {reply['reason']}")
            out[p] = reply["stats"]
        out["master"] = {"role": "master", **self.endpoint.counters()}
        return out

    # -- dispatch and completion ------------------------------------------------------------------
    def dispatch(self, executor_id: int, args: Any) -> int:
        assert self.state is not None
        return self.state.dispatch(executor_id, args)

    # -- failures (SCAR partial recovery) ------------------------------------------------------
    def _process_lost(self, ident: str | None, reason: str) -> None:
        """A process died: recover if the job asked for it and it can be done, else stop the job.

        Several may die at once (a machine, a rack): a loss noticed while the recovery of
        others of the same role is under way joins it, planned again as one."""
        st = self.state
        if ident is None or ident in self.lost or st is None:
            if ident in self.lost:
                return
            raise ProcessLost(reason, ident)
        if self.driver is not None and self.driver._finished:
            # the result is in: nothing it held is needed any more, so nothing is recovered and
            # the job does not fail; it only ends without the dead one's statistics
            log.warning("%s after the driver finished: the job ends without it", reason)
            self._fence(ident)
            return
        group = st.servers if ident in st.servers else st.workers if ident in st.workers else None
        if group is None and ident in self.elastic.retiring() and ident not in self.retiring \
                and self.procs.get(ident, {}).get("role") == "server":
            # a server a scale-in emptied, waiting for everyone to route around it: requests may
            # still reach it, and it forwards them. Recovered as a server that holds nothing:
            # partial, the others send again what it never answered; full, the job rolls back.
            # (Before, the job failed: it was neither a server of the job nor told to leave.)
            st.servers.append(ident)
            group = st.servers
        role = "server" if group is st.servers else "worker"
        if group is None and (ident in self.retiring or self.elastic.joining(ident)):
            # it held nothing: one retired by a scale-in (told to leave), or one still joining
            log.error("%s; it held nothing (it was %s): the job goes on without it", reason,
                      "leaving" if ident in self.retiring else "joining")
            self._fence(ident)
            self.retiring.discard(ident)
            self._part_never_written(ident, f"{ident} was lost while it left the job, before writing its part "
                                            "of the checkpoint")
            self.elastic.on_lost(ident)
            return
        recoverable = self.recovery is not None and group is not None and len(group) > 1
        if not recoverable:
            why = "" if self.recovery else (" (launch with --recovery partial or full and --checkpoint-dir "
                                            "to survive this)")
            self._unresponsive.add(ident)  # the shutdown does not wait for its goodbye
            raise ProcessLost(reason + why, ident)
        self.elastic.on_lost(ident)  # a scale operation under way goes on without it
        if self.recovery == "full":  # unwinds to the main loop (or the rollback), even out of a driver's read
            raise _Rollback(ident, role, reason)
        if self._restoring is not None and self._restoring.role != role:
            # a machine with a worker and a server died: one role's recovery at a time; the other
            # waits, fenced at once so nothing it still sends counts
            log.error("%s; its recovery waits for the %ss' one under way", reason, self._restoring.role)
            self._fence(ident)
            self._waiting_losses.append((ident, role))
            return
        log.error("%s; restoring its %s on the others", reason, "shards" if role == "server" else "executors")
        self._recover(ident, role)

    @property
    def recovering(self) -> bool:
        """Whether a recovery is under way: partial (or waiting for one) or a full rollback. Scale
        commands are refused meanwhile and hosts' offers wait: a scale-in's moves, sent while the
        workers dropped their executors to reload them, failed the job ("w2 cannot migrate
        executors [5]: not hosted here")."""
        return self._restoring is not None or bool(self._waiting_losses) or self.rolling_back

    def _fence(self, ident: str) -> None:
        """Declare ``ident`` lost for good: its work is being recovered elsewhere, so it must
        never act again. A process that only stalled past its lease (a long pause, swapping,
        SIGSTOP) would otherwise come back and report tasks and send updates that others now
        redo. One on this machine is killed. Every other process is told to drop its messages
        (``fence``), as the master does (``_poll``), and it is told to leave if it speaks again.
        The fence goes out before anything of the recovery, so it precedes, on each connection,
        the restored work the stalled process could otherwise collide with."""
        self.lost.add(ident)
        for waiting in self._route_waits.values():  # it will never acknowledge new routes
            waiting.discard(ident)
        info = self.procs.pop(ident, None) or {}
        if info.get("pid") and info.get("host") == host_name(self.endpoint.host):
            if kill_job_process(int(info["pid"]), ident, self.job):
                log.warning("killed %s (pid %s): declared lost, it must not come back", ident, info["pid"])
        for peer, about in self.procs.items():  # one elsewhere cannot be killed: nobody listens to it
            if about.get("role") in ("worker", "server") and peer not in self.lost:
                with contextlib.suppress(Exception):
                    self.endpoint.send(peer, "fence", ident=ident)

    def _recover(self, lost: str, role: str, plan: bool = True) -> None:
        """SCAR: restore only what the dead held, from the running checkpoint, on the survivors.

        A server's shards get their checkpointed rows; a worker's executors their checkpointed
        states (input reloaded) and their unfinished tasks are dispatched again. Nothing else
        rolls back, the driver included. Migrations the dead took part in are settled first
        (``_settle``): their items count as the dead's only if they were there. Placement and
        routes change only once every part is restored, so a second loss during the recovery
        can still re-plan everything: its round number tells the answers to the first plan from
        those to the second. ``plan=False``: more losses join this recovery at once; the last one
        plans for all.
        """
        st = self.state
        assert st is not None
        self._await_manifest()  # a round with all its parts written is part of the running checkpoint
        self._fence(lost)
        (st.servers if role == "server" else st.workers).remove(lost)
        rec = self._restoring = self._restoring or _Restoring(role, time.monotonic())
        rec.losts.append(lost)
        rec.round = None  # answers to an earlier plan no longer count: it is planned again
        self._settle(lost, rec)
        ck = self.checkpoints
        r = ck.round if ck is not None else None
        if r is not None and r.phase == "scoring":
            self._scores_in(r.cid, lost, np.empty(0))  # a partial round goes on without it
        self._part_never_written(lost, f"{lost} died during the checkpoint")
        if plan and not rec.settling:
            self._plan_restore(rec)

    def _settle(self, lost: str, rec: _Restoring) -> None:
        """Decide where the items of migrations ``lost`` took part in are, before planning.

        A dead destination server had its shards already: the source sends them as soon as
        it is asked. Otherwise the surviving end is asked (``settle``), after the fence, so
        its answer is final: a destination holds the items if they arrived before; a source
        holds them if it had not shipped them yet, and then keeps them. A survivor asked
        that dies before it answers leaves the items with the migration's source (dead too)."""
        st = self.state
        assert st is not None
        for mid in [mid for mid, asked in rec.settling.items() if asked == lost]:
            del rec.settling[mid]
            self._end_migration(mid, arrived=False)
        for kind, mid, items, source, dest in st.migrations_of(lost):
            if mid in rec.settling:
                continue
            if kind == "shards" and dest == lost:
                self._end_migration(mid, arrived=True)
                continue
            survivor = dest if source == lost else source
            if survivor in self.lost:  # both ends died: the items are lost either way
                self._end_migration(mid, arrived=False)
                continue
            rec.settling[mid] = survivor
            self.endpoint.send(survivor, "settle", mid=mid, kind=kind, items=items)
            log.warning("%s died during migration %d of %s %s (%s -> %s): asking %s where they are",
                        lost, mid, kind, items, source, dest, survivor)

    def _end_migration(self, mid: int, arrived: bool) -> None:
        """A migration settled during a recovery: its items are on its destination or source."""
        st, rec = self.state, self._restoring
        assert st is not None and rec is not None
        kind = "executors" if mid in st.migrations else "shards"
        items, source, dest = st.migrations[mid] if kind == "executors" else st.shard_migrations[mid]
        rec.settled.append({"mid": mid, kind: list(items), "on": dest if arrived else source})
        if kind == "executors":
            st.finish_migration(mid, arrived)
        else:
            st.finish_shard_migration(mid, arrived)

    def on_settled(self, msg: Message) -> None:
        """The surviving end of a migration said whether it holds the items; with every such
        answer in, the recovery is planned."""
        st, rec = self.state, self._restoring
        mid = msg["mid"]
        if st is None or rec is None or rec.settling.get(mid) != msg.sender:
            return
        del rec.settling[mid]
        mig = st.migrations.get(mid) or st.shard_migrations.get(mid)
        if mig is not None:
            self._end_migration(mid, arrived=msg["holds"] == (msg.sender == mig[2]))
        else:  # it finished meanwhile: the destination said "migrated" before it answered
            rec.settled.append({"mid": mid, "on": msg.sender})
        log.warning("migration %d settled: its items are on %s", mid, rec.settled[-1]["on"])
        if not rec.settling:
            self._plan_restore(rec)

    def _plan_restore(self, rec: _Restoring) -> None:
        """Plan who takes the dead's items and send them there, rows or states from the running
        checkpoint (SCAR); processes leaving by a scale-in take none. The running checkpoint is
        read first, off the loop (``_read_running``): on a network store that takes requests,
        and the job goes on meanwhile; the plan is made once it is read."""
        from litz.ft import storage  # pyarrow: imported by the first checkpoint or restore, not at start
        st = self.state
        assert st is not None
        kind = "shards" if rec.role == "server" else "executors"
        where = None
        rec.retry_at = None
        if self.checkpoints is not None:
            if rec.read is None:
                if not rec.reading:
                    self._read_running(rec)
                return
            [running], rec.read = rec.read, None
            if running is not None:
                location, path, manifest, partials = running
                where = {**self._where(location, path, manifest, kind), "partials": partials}
            else:
                log.error("no complete checkpoint yet: the %s of %s start afresh", kind, ", ".join(rec.losts))
        fresh = [p for p in rec.losts if p not in rec.planned]
        rec.assign = st.plan_takeover(fresh, rec.role, rec.assign, avoid=self.elastic.retiring())
        rec.planned.extend(fresh)
        rec.source = storage.display(where["location"], where["path"]) if where else None
        rec.partials = [path for path, _ in where["partials"]] if where else []
        rec.where, rec.resend = where, {}
        self._restore_round += 1
        rec.round = self._restore_round
        rec.waiting = set(rec.assign)
        for dest in rec.assign:
            self._send_restore(rec, dest)
        if not rec.assign:
            self._restored("", rec.round)

    def _read_running(self, rec: _Restoring) -> None:
        """Read the running checkpoint for recovery ``rec`` on a thread; ``_running_read`` takes
        the outcome on the loop (from ``_poll``: a driver waiting for a lost row waits there)."""
        from litz.ft import storage

        assert self.checkpoints is not None
        rec.reading = True
        ck, kind = self.checkpoints, "shards" if rec.role == "server" else "executors"

        def read() -> tuple[Any, Exception | None]:
            try:
                return ck.running(kind), None  # this run's, never another timeline's
            except storage.CheckpointError as exc:  # judged on the loop: asked again, or the job stops
                return None, exc

        self._in_background(0, "running", read, "master: cannot read the running checkpoint", self._restore_reads)

    def _running_read(self) -> None:
        """Take what ``_read_running`` read: plan the recovery (once its migrations are settled),
        or, the store failing to answer, read again every ``STORE_RETRY`` s (``_retry_restore``)
        until ``--checkpoint-timeout`` from the loss: an outage of a few seconds must not end the
        job. A read whose recovery is over (a rollback took over) is dropped."""
        from litz.ft import storage

        while not self._restore_reads.empty():
            _, _, value, error = self._restore_reads.get()
            rec, ck = self._restoring, self.checkpoints
            if rec is None or ck is None or not rec.reading:
                continue
            rec.reading = False
            if error is not None:
                raise LitzError(f"the recovery from the loss of {', '.join(rec.losts)}: {error}")
            running, exc = value
            if exc is not None:  # the storage does not answer: nothing to restore from yet
                if not storage.store_failed(exc) or time.monotonic() - rec.started >= ck.timeout:
                    raise LitzError(f"the recovery from the loss of {', '.join(rec.losts)} cannot read the running "
                                    f"checkpoint ({exc}){_gave_up(ck.timeout)}") from exc
                if rec.store_error is None:
                    log.warning("the recovery from the loss of %s cannot read the running checkpoint (%s); trying "
                                "again every %g s for up to %g s", ", ".join(rec.losts), exc, STORE_RETRY, ck.timeout)
                rec.store_error = str(exc)
                rec.retry_at = _next_try(rec.started + ck.timeout)
                continue
            if rec.store_error is not None:
                log.warning("the checkpoint storage answers again: the recovery from the loss of %s goes on",
                            ", ".join(rec.losts))
                rec.store_error = None
            rec.read = [running]
            if not rec.settling:
                self._plan_restore(rec)

    def _send_restore(self, rec: _Restoring, dest: str) -> None:
        """Ask survivor ``dest`` to take its part of the plan, from the running checkpoint."""
        kind = "shards" if rec.role == "server" else "executors"
        self.endpoint.send(dest, f"restore_{kind}", **{kind: rec.assign[dest]}, round=rec.round,
                           **({"restore": rec.where} if rec.where else {}))

    def _restore_failed(self, sender: str, round_: int | None, error: str) -> None:
        """A survivor could not read its part of the running checkpoint, the storage failing to
        answer: it is asked again every ``STORE_RETRY`` s (``_retry_restore``) until
        ``--checkpoint-timeout`` from the loss, then the job stops."""
        rec, ck = self._restoring, self.checkpoints
        if rec is None or ck is None or round_ is None or round_ != rec.round or sender not in rec.waiting:
            return  # an answer to a plan that a later loss replaced
        kind = "shards" if rec.role == "server" else "executors"
        if time.monotonic() - rec.started >= ck.timeout:
            raise LitzError(f"recovery failed on {sender} (restore_{kind}): {error}{_gave_up(ck.timeout)}")
        if rec.store_error is None:
            log.warning("the recovery from the loss of %s: %s; asking again every %g s for up to %g s",
                        ", ".join(rec.losts), error, STORE_RETRY, ck.timeout)
        rec.store_error = error
        rec.resend[sender] = _next_try(rec.started + ck.timeout)

    def _retry_restore(self) -> None:
        """Read the running checkpoint again for a partial recovery whose store failed to answer,
        once ``STORE_RETRY`` s have passed (not while migrations are being settled: their answers
        plan it), and ask survivors whose store failed again."""
        rec = self._restoring
        if rec is not None and rec.retry_at is not None and time.monotonic() >= rec.retry_at and not rec.settling:
            self._plan_restore(rec)
        for dest, at in list(rec.resend.items()) if rec is not None and rec.round is not None else []:
            if time.monotonic() >= at:  # a survivor whose store failed: asked again
                del rec.resend[dest]
                self._send_restore(rec, dest)

    def _joining_initialised(self) -> list[str]:
        """The new processes of a scale-out that registered (so were initialised, with the shard map
        as it stood then) and are not ready yet: not among the job's workers and servers, but they
        will get executors or shards once ready, so a server's loss must re-route them too (else
        their first reads go to the dead server and wait for ever: a stress run found it)."""
        return sorted(i for i in self.procs if self.elastic.joining(i) and i not in self.lost)

    def _leaving(self) -> list[str]:
        """Processes a scale-in took out of the job's workers and servers that have not said goodbye:
        empty, but a server among them may still have forwarded requests to answer, and a worker
        updates to see acknowledged. A server's loss must reach them too, or what they sent to it
        keeps them waiting until they leave anyway (``LEAVE_TIMEOUT``; a stress run saw 10 s)."""
        st = self.state
        assert st is not None
        return sorted(i for i in self.elastic.retiring() | self.retiring
                      if i not in st.workers and i not in st.servers and i in self.procs
                      and i not in self.lost and i not in self._byes)

    def _restored(self, sender: str, round_: int | None) -> None:
        """A survivor took its part; once all did, route to them and carry on."""
        rec, st = self._restoring, self.state
        if rec is None or st is None or round_ is None or round_ != rec.round:
            return  # an answer to a plan that a later loss replaced
        rec.waiting.discard(sender)
        if not rec.resend:  # no survivor waits to be asked again: the store answers
            rec.store_error = None
        if rec.waiting:
            return
        if rec.role == "server":
            for dest, shards in rec.assign.items():
                for shard in shards:
                    st.shard_map[shard] = dest
            # only now may requests reach the new owners
            for ident in st.workers + st.servers + self._joining_initialised() + self._leaving():
                if ident in self.lost:  # a worker lost meanwhile, its recovery waiting for this one
                    continue
                for lost in rec.losts:
                    self.endpoint.send(ident, "server_lost", server=lost, shard_map=st.shard_map)
        else:
            for dest, eids in rec.assign.items():
                for eid in eids:
                    st.placement[eid] = dest
            held = {item[0] for item in st.paused_items}
            for lost in rec.losts:
                st.outbox.pop(lost, None)
            for task in st.inflight.values():  # their unfinished tasks run again, with their ids
                if task.worker in rec.losts and task.task_id not in held:
                    task.worker = st.placement[task.executor_id]
                    st.outbox.setdefault(task.worker, []).append(
                        [task.task_id, task.executor_id, task.version, task.args])
        self._restoring = None
        restored = tuple(sorted(i for part in rec.assign.values() for i in part))
        losts = tuple(sorted(rec.losts, key=_id_order))  # in id order, not the order the losses were noticed in
        self._recovered.append(Recovery(rec.role, losts,
                                        restored if rec.role == "worker" else (),
                                        restored if rec.role == "server" else (), rec.source))
        lost = ", ".join(losts)
        self.recoveries.append({"lost": lost, "role": rec.role, "strategy": "partial",
                                "restored": len(restored), "restored_from": rec.source, "partials": rec.partials,
                                "onto": sorted(rec.assign), "settled": rec.settled,
                                "seconds": time.monotonic() - rec.started, "time": time.time()})
        log.warning("recovered from the loss of %s: %d %s restored from %s", lost, len(restored),
                    "shards" if rec.role == "server" else "executors", rec.source or "scratch")
        if self._waiting_losses:  # the other role's losses, noticed meanwhile, recover together now
            # Taken off the list first, and planned once with all of them: a recovery with nothing
            # to restore (a worker that held no executor) completes inside ``_recover``, and comes
            # back here, which must neither recover them again nor end before the rest were added
            waiting, self._waiting_losses = self._waiting_losses, []
            for n, (ident, role) in enumerate(waiting):
                self._recover(ident, role, plan=n == len(waiting) - 1)
            return
        self.elastic.recovered()

    # -- failures (full recovery: everything rolls back) ---------------------------------------
    @property
    def rolling_back(self) -> bool:
        """Whether a full recovery is in progress (new processes join after it)."""
        return self._rolling_back is not None

    def _roll_back(self, driver: Driver, rb: _Rollback, leftover: list[Message]) -> None:
        """Roll the whole job back (``_roll_back_all``); ``litz status`` shows it meanwhile."""
        try:
            self._roll_back_all(driver, rb, leftover)
        finally:
            self._rolling_back = None

    def _roll_back_all(self, driver: Driver, rb: _Rollback, leftover: list[Message]) -> None:
        """Litz's full recovery: the whole job goes back to its last consistent checkpoint.

        1. The dead process leaves; survivors take its executors or shards; tasks in flight
           are forgotten and a checkpoint round in progress is abandoned.
        2. Every worker kills its tasks and drops its executors, buffers and cache, and answers
           once its updates already sent to live servers were acknowledged: after that, no
           update of the abandoned timeline can reach a server.
        3. Servers reload their shards and workers their executors from the checkpoint (or
           start afresh without one); the driver gets its checkpointed state and tasks back.
        Completions of the abandoned timeline (``done``) are dropped all along.
        """
        st = self.state
        assert st is not None
        started, version_before = time.monotonic(), st.version
        ck = self.checkpoints
        self._await_manifest()  # a round with all its parts written stays a checkpoint
        if ck is not None and ck.round is not None:
            ck.round.errors.append(f"{rb.ident} died during the checkpoint: the job rolled back")
            self._finish_checkpoint()
        waiting: set[str] = set()
        # A new process that becomes ready meanwhile (a scale-out under way) joins once the rollback
        # is over: joining spreads executors onto it, and moves sent while the workers drop their
        # executors to reload them failed the job ("cannot migrate executors [2]: not hosted here")
        ready_later: list[Message] = []

        def on_msg(msg: Message) -> None:
            if msg.type in ("rolled_back", "reloaded"):
                if msg["round"] == self._restore_round:  # not an answer to a round a loss restarted
                    waiting.discard(msg.sender)
            elif msg.type == "ready":
                ready_later.append(msg)
            elif msg.type != "done":
                self._handle_aside(msg)

        losses, lost, moved, lost_servers = [rb], [], set(), []
        saved: dict[str, Any] | None = None
        where: dict[str, Any] = {}
        progress = self._rolling_back = _RollingBack(lost, started, waiting=waiting)
        while losses:  # more may die meanwhile (a machine, a rack): they join this rollback
            rb = losses.pop(0)
            progress.step, progress.store_error = "abandoning", None
            log.error("%s; rolling the whole job back to its last checkpoint", rb.reason)
            lost.append(rb.ident)
            self._fence(rb.ident)
            moved |= {(rb.role, i) for items in st.roll_back(rb.ident, rb.role, self.elastic.retiring()).values()
                      for i in items}
            if rb.role == "server":
                lost_servers.append(rb.ident)
            try:
                for msg in leftover:
                    on_msg(msg)
                leftover = []
                self._deferred = [m for m in self._deferred if m.type != "done"]
                waiting.clear()  # answers still owed by the dead are never coming
                waiting.update(st.workers + st.servers)  # servers: once what they forwarded landed
                self._restore_round += 1
                # servers first: workers may wait for their acks. A scale-in's processes that are
                # empty but not gone abandon the timeline too: a server answers what it forwarded to
                # the dead, a worker drops its updates sent there (it is in nobody's `waiting`)
                for p in st.servers + self._leaving() + st.workers:
                    self.endpoint.send(p, "rollback", lost=lost_servers, round=self._restore_round,
                                       abandoned=st.last_mid)
                self._wait(lambda: not waiting, "workers to abandon their tasks and servers their forwards", 60.0,
                           on_msg)
                saved, where = self._reload(st, lost_servers, waiting, on_msg)
            except _Rollback as again:
                losses.append(again)
                leftover = again.received
        for ident in self._joining_initialised():  # they roll nothing back, but must route around the dead
            for lost_server in lost_servers:
                self.endpoint.send(ident, "server_lost", server=lost_server, shard_map=st.shard_map)
        # Every worker routes by the map as reloaded. One still joining, or one that became ready
        # while the rollback ran (so not asked to reload), has the map of its start, corrected as
        # its requests were forwarded, and the reload dropped the forwards (stress runs found
        # fetches answered "shard 8 is not on this server"); for the others it changes nothing.
        for ident in st.workers + [i for i in self._joining_initialised() if self.procs[i].get("role") == "worker"]:
            self.endpoint.send(ident, "shard_map", shard_map=st.shard_map)
        if saved is not None:
            self._set_driver_state(driver, saved["driver"])
            st.restore_tasks(saved["tasks"], saved["version"], saved["completed"], saved["next_id"])
        else:
            assert self._initial_driver is not None
            self._set_driver_state(driver, load_driver(self._initial_driver, driver)["driver"])
        onto = {st.shard_map[i] if role == "server" else st.placement[i] for role, i in moved}
        from litz.ft import storage  # imported already by the reload

        source = storage.display(where["location"], where["path"]) if where.get("path") else None
        self.recoveries.append({"lost": ", ".join(sorted(lost, key=_id_order)), "role": rb.role, "strategy": "full",
                                "restored": len(moved), "restored_from": source, "onto": sorted(onto),
                                "rolled_back_from_version": version_before, "rolled_back_to_version": st.version,
                                "seconds": time.monotonic() - started, "time": time.time()})
        log.warning("rolled back from version %d to %d (%s) after the loss of %s", version_before, st.version,
                    source or "the beginning", ", ".join(lost))
        if saved is not None:
            driver.resumed()
        else:
            driver.dispatch_initial_tasks()
        if self.checkpoints is not None:  # a period counted in iterations starts again where the job went back
            self.checkpoints.restarted(driver.iteration)
        self._rolling_back = None  # over: scale commands and hosts' offers go on (``recovering``)
        self.elastic.recovered()
        for msg in ready_later:
            self._handle_aside(msg)

    def _reload(self, st: MasterState, lost_servers: list[str], waiting: set[str],
                on_msg: Callable[[Message], None]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """Full recovery's second phase: servers reload their shards and workers their executors
        from the last full checkpoint (fresh without one). Returns the driver's saved file and
        where the checkpoint is (both empty without one)."""
        from litz.ft import storage  # pyarrow: imported by the first checkpoint or restore, not at start
        ck, progress = self.checkpoints, self._rolling_back
        assert progress is not None
        saved: dict[str, Any] | None = None
        where: dict[str, Any] = {}
        if ck is not None:
            deadline, said = time.monotonic() + ck.timeout, False
            progress.step = "reading"

            def read() -> tuple[str, str, dict[str, Any], dict[str, Any]]:
                location, path, manifest = ck.last_full()  # this run's, never another timeline's
                return location, path, manifest, self._read_driver_file(location, path, manifest, self.driver)

            def stop(exc: Exception) -> LitzError:
                return LitzError(f"the full recovery cannot use the job's last checkpoint, so the job stops rather "
                                 f"than start again from the beginning ({exc}){_gave_up(ck.timeout)}")

            while True:  # a store that fails to answer is asked again until --checkpoint-timeout
                try:  # off the loop: a store that hangs must not stop the master answering meanwhile
                    location, path, manifest, saved = self._off_loop(
                        read, "the checkpoint storage to answer", max(STORE_RETRY, deadline - time.monotonic()), on_msg)
                    where = {"location": location, "path": path, "manifest": manifest}
                    progress.source, progress.store_error = storage.display(location, path), None
                except storage.NoCheckpoint:
                    log.error("no complete checkpoint yet: the job starts again from the beginning")
                except WaitTimeout as exc:  # the read hangs
                    raise stop(exc) from None
                except storage.CheckpointError as exc:  # never taken for "none": all the job's progress would go
                    if not storage.store_failed(exc) or time.monotonic() >= deadline:
                        raise stop(exc) from exc
                    if not said:
                        log.warning("the full recovery cannot read the job's last checkpoint (%s); trying again "
                                    "every %g s for up to %g s", exc, STORE_RETRY, ck.timeout)
                        said = True
                    progress.store_error = str(exc)
                    until = _next_try(deadline)
                    self._wait(lambda until=until: time.monotonic() >= until, "the checkpoint storage",
                               STORE_RETRY + 1, on_msg)
                    continue
                break
            ck.rolled_back((where["location"], where["path"], where["manifest"]) if where else None)
            try:  # off the loop as the read; a store that hangs here costs a restart's choice, not the job
                self._off_loop(ck.record_timeline, "the checkpoint storage to answer", ck.timeout, on_msg)
            except WaitTimeout as exc:
                log.warning("%s: a restart with --resume auto may take a checkpoint of the abandoned timeline", exc)
        progress.step = "reloading"

        def restore(kind: str) -> dict[str, Any]:
            return {"restore": self._where(where["location"], where["path"], where["manifest"], kind)} if where else {}

        waiting.clear()
        waiting.update(st.workers + st.servers)
        self._restore_round += 1
        asks = {srv: ("reload_shards", {"shards": st.shards_of(srv), "round": self._restore_round,
                                        "abandoned": st.last_mid, **restore("shards")}) for srv in st.servers}
        asks.update({w: ("reload_executors", {"executors": st.executors_of(w), "shard_map": st.shard_map,
                                               "lost": lost_servers, "round": self._restore_round,
                                               **restore("executors")}) for w in st.workers})
        for ident, (kind, fields) in asks.items():
            self.endpoint.send(ident, kind, **fields)
        # a process whose checkpoint storage failed to answer is asked again until --checkpoint-timeout
        started, again = time.monotonic(), {}

        def handle(msg: Message) -> None:
            if msg.type != "reloaded" or not msg.get("error") or msg["round"] != self._restore_round:
                if msg.type == "reloaded" and not again:  # the store answers again (litz status)
                    progress.store_error = None
                on_msg(msg)
                return
            assert ck is not None  # (a process restores only from a checkpoint)
            if time.monotonic() - started >= ck.timeout:
                raise LitzError(f"the full recovery failed on {msg.sender}: {msg['error']}{_gave_up(ck.timeout)}")
            if not again:
                log.warning("the full recovery: %s; asking again every %g s for up to %g s", msg["error"], STORE_RETRY,
                            ck.timeout)
            progress.store_error = msg["error"]
            again[msg.sender] = _next_try(started + ck.timeout)

        while waiting:
            self._wait(lambda: not waiting or any(time.monotonic() >= at for at in again.values()),
                       "workers and servers to reload the checkpoint", 120.0, handle)
            for ident, at in list(again.items()):
                if time.monotonic() >= at:
                    del again[ident]
                    self.endpoint.send(ident, asks[ident][0], **asks[ident][1])
        return saved, where

    # -- checkpoints (litz.ft.checkpoint) ------------------------------------------------------
    @staticmethod
    def _where(location: str, path: str, manifest: dict[str, Any], kind: str) -> dict[str, Any]:
        """The ``restore`` field of a message: where a checkpoint's shard or executor files are."""
        return {"location": location, "path": path, "files": manifest[f"{kind}_files"]}

    def _restore_fields(self) -> dict[str, dict[str, Any]]:
        """The ``restore`` fields of init messages when resuming: where the shards' and executors' files are."""
        if self.resume is None:
            return {}
        r = self.resume
        return {kind: {"restore": self._where(r.location, r.path, r.manifest, kind)}
                for kind in ("shards", "executors")}

    @staticmethod
    def _set_driver_state(driver: Driver, saved: dict[str, Any]) -> None:
        """Make the driver exactly as saved; transient attributes and the binding stay."""
        keep = {"_master", "config", "num_executors", *type(driver).transient}
        for k in [k for k in driver.__dict__ if k not in keep]:
            del driver.__dict__[k]
        driver.__dict__.update({k: v for k, v in saved.items() if k not in keep})

    @staticmethod
    def _read_driver_file(location: str, path: str, manifest: dict[str, Any], driver: Driver) -> dict[str, Any]:
        from litz.ft import storage  # pyarrow: imported by the first checkpoint or restore, not at start
        fs, _ = storage.filesystem(location)
        where = f"{path}/{manifest['driver']}"
        blob = storage.read_bytes(fs, where)
        try:
            return load_driver(blob, driver)
        except Exception as exc:  # truncated, damaged, or of a driver class the application no longer has
            raise storage.DamagedCheckpoint(f"cannot load the driver's state from {where}: "
                                            f"{type(exc).__name__}: {exc}") from exc

    def _resume_driver(self, driver: Driver) -> None:
        """Give the driver back its checkpointed attributes and the tasks it had dispatched."""
        assert self.resume is not None and self.state is not None
        saved = self.resume.take_driver_state(driver)
        self._set_driver_state(driver, saved["driver"])
        self.state.restore_tasks(saved["tasks"], saved["version"], saved["completed"], saved["next_id"])
        driver.resumed()
        if self.checkpoints is not None:  # not a checkpoint at once of the state it just resumed from
            self.checkpoints.restarted(driver.iteration)
        from litz.ft import storage

        log.warning("resumed job %s from %s (version %d, %d tasks re-dispatched)", self.job,
                    storage.display(self.resume.location, self.resume.path), saved["version"], len(saved["tasks"]))

    def checkpoint(self, reason: str = "driver") -> bool:
        """Start a checkpoint now (asynchronous); False if none is configured or one is running."""
        if self.checkpoints is None or self.state is None:
            return False
        iteration = self.driver.iteration if self.driver is not None else None
        r = self.checkpoints.begin(reason, iteration)
        if r is None:
            return False
        r.commands, self._ckpt_commands = self._ckpt_commands, []  # it answers the commands made so far
        self._make_checkpoint_dir(r)  # training goes on meanwhile; it pauses once the directory exists
        return True

    def reply_command(self, cid: str, ok: bool, reason: str = "", **extra: Any) -> None:
        """Answer a command of the ``litz`` CLI (``litz checkpoint``, ``stop``, ``scale``), which
        waits for ``commands/result/<id>``: written without waiting, and again until etcd takes it
        (``EtcdWrites``), so an etcd outage delays the answer and never ends the job."""
        self.etcd_writes.put(f"{RESULTS}{cid}", {"ok": ok, "reason": reason, "time": time.time(), **extra})

    def _commands_reason(self) -> str:
        """The reason a round begun for the waiting commands records: the stop's, if it is one of them."""
        stop = self._stop
        if stop is not None and stop["id"] in self._ckpt_commands:
            return f"stop {stop['id']}"
        return "command " + " ".join(self._ckpt_commands)

    def on_checkpoint_command(self, cmd: dict[str, Any]) -> None:
        cid = str(cmd.get("id", ""))
        if self.checkpoints is None:
            self.reply_command(cid, False, "this job has no --checkpoint-dir")
            return
        self._ckpt_commands.append(cid)  # answered by the next full round, not by one already running
        if self.checkpoints.round is None:
            self.checkpoint(self._commands_reason())

    def on_stop_command(self, cmd: dict[str, Any]) -> None:
        """``litz stop``: end the job now, or after a consistent checkpoint taken for the purpose
        (a round that began after the command, so it holds everything done until then). If that
        checkpoint fails, the job is not stopped: the command's answer says why, and the job
        trains on (the operator may stop it without a checkpoint)."""
        cid = str(cmd.get("id", ""))
        want = bool(cmd.get("checkpoint"))
        if self._stop is not None and not want and self._stop["checkpoint"] and self._stop["path"] is None:
            # a plain stop cuts short one that waits for its checkpoint (a store that hangs held it for
            # --checkpoint-timeout, refusing it), as a second SIGTERM does; both are answered at the stop
            log.warning("stop requested again (command %s): stopping now, without waiting for the checkpoint", cid)
            self._stop["checkpoint"] = False
            self._stop.setdefault("also", []).append(cid)
            return
        if self._stop is not None:
            self.reply_command(cid, False, f"already stopping (command {self._stop['id']})")
            return
        if want and self.checkpoints is None:
            self.reply_command(cid, False, "this job has no --checkpoint-dir: stop it without --checkpoint, "
                                           "or launch it with one")
            return
        self._stop = {"id": cid, "checkpoint": want, "path": None}
        log.warning("stop requested (command %s)%s", cid, ", after a checkpoint" if want else "")
        if want:
            self.on_checkpoint_command({"id": cid})

    def request_stop(self) -> None:
        """What SIGTERM does (``launcher._on_sigterm``): safe in a signal handler, since it only
        counts; the loop acts on it. The first asks for a stop after a checkpoint when the job has a
        checkpoint directory (else at once); a second one stops at once."""
        self._stop_signals += 1

    def _signalled_stop(self) -> None:
        """Act on ``request_stop`` from the loop (see there)."""
        if self._stop_signals == self._stop_signals_seen:
            return
        self._stop_signals_seen = self._stop_signals
        if self._stop is None:
            log.warning("SIGTERM: stopping the job%s", " after a checkpoint" if self.checkpoints else "")
            self.on_stop_command({"id": "sigterm", "checkpoint": self.checkpoints is not None})
        elif self._stop["checkpoint"] and self._stop["path"] is None:
            log.warning("SIGTERM again: stopping now, without waiting for the checkpoint")
            self._stop["checkpoint"] = False

    def _stop_ready(self) -> bool:
        """Whether a ``litz stop`` may end the job now (its checkpoint, if it wanted one, is written)."""
        return self._stop is not None and (not self._stop["checkpoint"] or self._stop["path"] is not None)

    def _checkpoint_tick(self) -> None:
        """Start a checkpoint the policy asks for; take the snapshot once nothing runs or moves."""
        ck, st = self.checkpoints, self.state
        if ck is None or st is None or self.driver is None:
            return
        self._background_done()
        if ck.round is not None and (waiting := ck.overdue()) is not None:
            self._checkpoint_timed_out(waiting)
        if ck.round is None and self._ckpt_commands:
            self.checkpoint(self._commands_reason())
        elif ck.round is None and ck.due(self.driver.iteration):
            if not ck.partial_next():
                self.checkpoint("policy")
            elif (r := ck.begin("policy", self.driver.iteration, kind="partial")) is not None:
                r.asked = set(st.servers + st.workers)
                for ident in sorted(r.asked):  # SCAR: no pause; servers and workers score their rows
                    self.endpoint.send(ident, "ckpt_scores", cid=r.cid, policy=ck.policy)
                self._make_checkpoint_dir(r)
        r = ck.round
        # not while a partial recovery restores a lost process's executors or shards on the
        # survivors: they would copy only what they hosted before, and the checkpoint, complete to
        # every check, would hold no state for those (a resume then failed, or rows came back as
        # initial values)
        if r is None or r.phase != "pausing" or r.dir_path is None or not st.quiescent() \
                or self.elastic.op is not None or self._restoring is not None or self._waiting_losses:
            return
        from litz.ft import storage  # pyarrow: imported by the first checkpoint, not at start

        location, path = ck.location, r.dir_path
        processes = sorted(st.workers + st.servers)
        ck.snapshotting(path, st.servers, st.workers)
        r.version = st.version
        for ident in processes:
            self.endpoint.send(ident, "checkpoint", cid=r.cid, location=ck.location, path=path)
        blob = dump_driver(self.driver, tasks=st.paused_items, version=st.version, completed=st.completed,
                           next_id=st._next_id)
        r.waiting_written.add("master")  # the driver's file is written in the background too
        self._in_background(r.cid, "driver",
                            lambda: storage.write_bytes(storage.filesystem(location)[0], f"{path}/driver.pkl", blob),
                            "master: cannot save the driver")

    def _checkpoint_timed_out(self, waiting: str) -> None:
        """The round waited longer than ``--checkpoint-timeout`` for ``waiting``: it fails as a round
        with a part that failed to write does (the checkpoints before it stay the running ones),
        training goes on, the next round may begin. Its step may still be hanging on its thread
        (a stuck store cannot be interrupted); what it delivers later is ignored."""
        ck = self.checkpoints
        assert ck is not None and ck.round is not None
        error = f"timed out after {ck.timeout:g} s waiting for {waiting}"
        if ck.round.phase == "manifest":  # the write may yet land, with every part in: the checkpoint is complete
            error += " (should the write still succeed, the checkpoint is complete and usable)"
        self._fail_round(error)

    def _fail_round(self, error: str) -> None:
        """End the round in progress as failed with ``error``; a full round that held new tasks
        (waiting for the running ones, or for snapshots) sends them on."""
        ck, st = self.checkpoints, self.state
        assert ck is not None and ck.round is not None and st is not None
        r = ck.round
        r.errors.append(error)
        held = r.kind == "full" and r.phase in ("pausing", "snapshot")
        if r.phase == "manifest":  # its write goes on, out of reach: it may still complete the checkpoint
            self._close_checkpoint(unusable="")
        else:
            self._finish_checkpoint()  # with an error: closes the round at once
        if held:
            st.release_paused()
            self.elastic.tick()

    def _make_checkpoint_dir(self, r: CheckpointRound) -> None:
        """Make the round's ``ckpt-*`` directory off the loop, before a full round pauses or while a
        partial one scores: on a network store (S3) that takes requests (and retries them for
        seconds when the store is down), and the loop must go on dispatching and answering
        meanwhile. ``_background_done`` takes the outcome: the round goes on, or fails without a
        number taken. Training runs on throughout: a full round holds new tasks only once its
        directory exists (with a dead store, holding them from the round's start paused the job
        for the 12 s each attempt took, again and again)."""
        from litz.ft import storage  # pyarrow: imported by the first checkpoint, not at start

        ck = self.checkpoints
        assert ck is not None
        # ``last``: the directory made before. If a round ends before its directory is made and the
        # next one begins, both threads may make the same number: the first round saved nothing in it
        location, last = ck.location, ck.last_dir

        def make() -> str:
            fs, root = storage.filesystem(location)
            return storage.new_checkpoint_dir(fs, root, last)

        self._in_background(r.cid, "dir", make, "master")

    def _in_background(self, cid: int, what: str, work: Callable[[], Any], failing: str,
                       results: queue.SimpleQueue[tuple[int, str, Any, str | None]] | None = None) -> None:
        """Run a storage step of round ``cid`` on a thread; its outcome (value, or the error prefixed
        with ``failing``) reaches the loop through ``results`` (default ``_background``) and wakes it."""

        def run() -> None:
            try:
                outcome: tuple[Any, str | None] = (work(), None)
            except Exception as exc:
                text = str(exc) if isinstance(exc, LitzError) else f"{type(exc).__name__}: {exc}"
                outcome = (None, f"{failing}: {text}")
            (self._background if results is None else results).put((cid, what, *outcome))
            with self._wake_lock, contextlib.suppress(OSError):  # full: the loop has a wake-up pending anyway
                if self._wake_open:
                    os.write(self._wake_w, b"x")

        threading.Thread(target=run, daemon=True, name=f"checkpoint-{what}").start()

    def _scores_in(self, cid: int, sender: str, scores: np.ndarray, error: str | None = None) -> None:
        """A server scored its rows, or a worker its executors' state rows, for a partial
        checkpoint; with all scores in, pick the top fraction of the servers' rows and, apart,
        of the workers' rows (the same share of each, so the bytes written per iteration match a
        full checkpoint's), and have each process save its chosen rows. A process that could
        not score (say, the application's distance function raised) fails the round: nothing is
        saved, the previous checkpoints stay the running one, training goes on."""
        ck, st = self.checkpoints, self.state
        r = ck.round if ck is not None else None
        if r is None or st is None or r.cid != cid or r.phase != "scoring" or r.chosen is not None:
            return
        assert ck is not None
        if error:
            r.errors.append(error)
            self._finish_checkpoint()
            return
        r.scores[sender] = scores
        if not r.asked <= set(r.scores):
            return
        chosen: dict[str, list[int]] = {}
        for pool in (st.servers, st.workers):  # a process lost meanwhile scored nothing and is gone
            chosen.update(select_top({p: r.scores[p] for p in pool if p in r.scores}, ck.fraction))
        r.chosen = chosen
        self._save_partial()

    def _save_partial(self) -> None:
        """Have the processes save a partial round's chosen rows, once they are chosen and the
        round's directory is made (whichever comes last calls this)."""
        ck, st = self.checkpoints, self.state
        r = ck.round if ck is not None else None
        if r is None or st is None or r.phase != "scoring" or r.chosen is None or r.dir_path is None:
            return
        assert ck is not None
        chosen = r.chosen
        # a process lost since it scored is gone (its rows too), one told to leave holds none any more
        # (a scale-in moved them); a worker without state rows saves nothing
        savers = sorted(p for p in chosen if p not in self.retiring
                        and (p in st.servers or (p in st.workers and len(r.scores[p]))))
        ck.snapshotting(r.dir_path, [p for p in savers if p in st.servers], [p for p in savers if p in st.workers])
        for ident in savers:
            self.endpoint.send(ident, "ckpt_save", cid=r.cid, location=ck.location, path=r.dir_path,
                               rows=chosen[ident])
        if not savers:  # no rows anywhere: an empty partial checkpoint
            self._finish_checkpoint()

    def _complete_checkpoint_being_written(self, timeout: float = 60.0) -> None:
        """The job has finished while a checkpoint was being written: let the processes finish their
        files and write its manifest, so that the job leaves its checkpoint usable (a round not
        yet snapshotting saved nothing, and is dropped). Only checkpoint messages are handled;
        a process that died meanwhile leaves the round without a manifest, as any failed one."""
        ck = self.checkpoints
        r = ck.round if ck is not None else None
        if r is not None and r.phase in _UNSAVED:
            self._drop_unsaved_round()
        if r is None or r.phase not in ("snapshot", "writing", "manifest"):
            return
        assert ck is not None
        for msg in [m for m in self._deferred if m.type in ("checkpoint_snapshot", "checkpoint_written")]:
            self._deferred.remove(msg)  # received with the completion that finished the job
            self._handle_aside(msg)
        deadline = time.monotonic() + timeout
        while ck.round is r and time.monotonic() < deadline:
            self._background_done()
            if ck.round is r and (waiting := ck.overdue()) is not None:
                self._checkpoint_timed_out(waiting)  # a hung store: the job ends now, not after ``timeout``
            if ck.round is r and self.endpoint.router.poll(50):
                while True:
                    try:
                        msg = self.endpoint.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if msg is not None and msg.type in ("checkpoint_snapshot", "checkpoint_written"):
                        self._handle_aside(msg)
        if ck.round is r:
            log.warning("checkpoint %s was still being written when the job finished; it has no manifest and "
                        "will never be used", r.path)

    def _drop_unsaved_round(self, wait: float = 5.0) -> None:
        """The job finished while a round had saved nothing yet (its directory being made, training
        pausing for it, its rows being scored): drop it, and remove the directory it made. Empty,
        and never to be reused (numbers are not), it would stay under the checkpoint root for
        ever, one per job that checkpoints. Waits at most ``wait`` seconds in all: a store that
        stopped answering keeps the directory, as a failed round's."""
        from litz.ft import storage

        ck = self.checkpoints
        assert ck is not None
        r = ck.drop()
        deadline = time.monotonic() + wait
        path = r.dir_path
        while path is None and (left := deadline - time.monotonic()) > 0:  # still being made
            try:
                cid, what, value, error = self._background.get(timeout=left)
            except queue.Empty:
                break
            if cid == r.cid and what == "dir":
                if error is not None:
                    return  # it took no number: nothing to remove
                path = value
        if path is None:
            log.warning("checkpoint round %d was dropped when the job finished; its directory was not made "
                        "within %g s, and may be left empty", r.cid, wait)
            return
        location, outcome = ck.location, queue.SimpleQueue()

        def remove() -> None:
            try:
                outcome.put(storage.remove_if_empty(storage.filesystem(location)[0], path))
            except storage.CheckpointError as exc:
                outcome.put(exc)

        threading.Thread(target=remove, daemon=True, name="checkpoint-drop").start()
        try:
            removed = outcome.get(timeout=max(0.0, deadline - time.monotonic()) + 0.1)
        except queue.Empty:
            removed = TimeoutError(f"the store did not answer within {wait:g} s")
        shown = storage.display(location, path)
        if isinstance(removed, Exception):
            log.warning("checkpoint %s was dropped when the job finished, before it saved anything; its "
                        "directory stays, empty: %s", shown, removed)
        else:
            log.info("checkpoint %s was dropped when the job finished, before it saved anything%s", shown,
                     "; its empty directory was removed" if removed else "")

    def _part_never_written(self, ident: str, error: str) -> None:
        """``ident`` died, or left the job (its goodbye after a scale-in; a retiring process writes
        the parts it was asked for before it says goodbye, so one asked later never saw the request):
        a round still waiting for its part will not get it, and fails; training goes on."""
        ck, st = self.checkpoints, self.state
        r = ck.round if ck is not None else None
        if r is None or st is None or ident not in r.waiting_written:
            return
        assert ck is not None
        if ck.snapshot_taken(r.cid, ident):
            st.release_paused()
        if ck.written(r.cid, ident, [], error):
            self._finish_checkpoint()

    def _await_manifest(self, timeout: float = 60.0) -> None:
        """Let a round whose manifest is being written finish first (a loss noticed meanwhile rolls
        back or restores from the checkpoints as they then are: with it, as when the manifest was
        written on the loop)."""
        ck = self.checkpoints
        r = ck.round if ck is not None else None
        deadline = time.monotonic() + timeout
        while r is not None and ck is not None and ck.round is r and r.phase == "manifest" \
                and time.monotonic() < deadline:
            self._background_done()
            if ck.round is r and (waiting := ck.overdue()) is not None:
                self._checkpoint_timed_out(waiting)
            elif ck.round is r:  # the writer's thread writes the wake-up pipe when it is done
                wait = min(deadline, r.since + ck.timeout) - time.monotonic()
                select.select([self._wake_r], [], [], max(0.0, wait) + 0.01)

    def _drain_wake(self) -> None:
        """Empty the wake-up pipe that threads write when they queue an outcome for the loop."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _background_done(self) -> None:
        """Take the outcomes of the checkpoint steps run off the loop (``_in_background``): the
        round's directory, the driver's file, the manifest."""
        from litz.ft import storage

        self._drain_wake()
        ck, st = self.checkpoints, self.state
        while not self._background.empty():
            cid, what, value, error = self._background.get()
            if ck is None or st is None:
                continue
            r = ck.round
            if what == "dir":
                # taken, even by a round gone meanwhile: numbers are never reused. A late answer of an
                # earlier round must not take the count back (the next round would reuse a number)
                if value is not None and storage.checkpoint_seq(value) > storage.checkpoint_seq(ck.last_dir):
                    ck.last_dir = value
                if r is None or r.cid != cid:
                    continue
                if error is not None:
                    self._fail_round(error)  # a failed round took no number, saved nothing
                elif ck.directory_made(value):  # a full round holds new tasks now, and snapshots once
                    st.paused = True            # the running ones are done (``_checkpoint_tick``)
                else:
                    self._save_partial()
            elif what == "driver":
                if ck.written(cid, "master", ["driver.pkl"], error):
                    self._finish_checkpoint()
            elif what == "manifest" and r is not None and r.cid == cid and r.phase == "manifest":
                if error is not None:
                    r.errors.append(error)
                self._close_checkpoint()

    def _finish_checkpoint(self) -> None:
        """Every part is in (or the round failed): write the manifest off the loop, which makes the
        checkpoint exist, then close the round (``_close_checkpoint``); a failed round closes now."""
        ck, st = self.checkpoints, self.state
        assert ck is not None and ck.round is not None and st is not None
        r = ck.round
        if r.phase == "manifest":  # already being written
            return
        base = ck.base() if r.kind == "partial" and not r.errors else None
        if r.kind == "partial" and base is None and not r.errors:
            r.errors.append("a partial checkpoint needs a complete full one before it")
        if r.errors or r.path is None:
            if r.path is None and not r.errors:
                r.errors.append("the round ended before anything was saved")
            self._close_checkpoint()
            return
        # the files of the processes that took part, gone since (a scale-in) or not: they hold the cut
        manifest: dict[str, Any] = {"job": self.job, "created": time.time(), "reason": r.reason,
                                    "num_shards": st.num_shards,
                                    "shards_files": sorted(f for p in r.servers for f in r.files.get(p, []))}
        executor_files = sorted(f for p in r.workers for f in r.files.get(p, []))
        if base is not None:
            manifest.update(partial_of=base, policy=ck.policy, fraction=ck.fraction,
                            executor_rows_files=executor_files)
        else:
            manifest.update(version=r.version, num_executors=st.num_executors, driver="driver.pkl",
                            tables=[{"name": t.name, "shape": list(t.shape), "dtype": str(np.dtype(t.dtype)),
                                     "num_rows": t.num_rows} for t in self.tables.values()],
                            executors_files=executor_files)
        from litz.ft import storage

        location, path = ck.location, r.path
        # --checkpoint-keep: a full round, once written, removes what the newest ones supersede; not
        # while a recovery restores from the checkpoints (a rollback or restore waits for the round)
        keep = ck.keep if r.kind == "full" and self._restoring is None else None
        since = ck.own_from  # this run's full checkpoints are those counted as kept

        def write() -> None:
            fs, root = storage.filesystem(location)
            storage.write_manifest(fs, path, manifest)
            if keep is not None:
                try:  # the checkpoint exists: a failure to clean up is said, and fails nothing
                    removed = storage.prune_checkpoints(fs, root, keep, since=since)
                except storage.CheckpointError as exc:
                    log.warning("%s; it is tried again after the next full checkpoint", exc)
                else:
                    if removed:
                        log.info("removed %d checkpoint directories older than the newest %d full checkpoints",
                                 len(removed), keep)

        r.enter("manifest")
        self._in_background(r.cid, "manifest", write, "master: cannot write the manifest")

    def _close_checkpoint(self, unusable: str = ", it has no manifest and will never be used") -> None:
        """The round is over: record it, log it (a failed one with ``unusable``), answer the
        commands it was for."""
        from litz.ft import storage

        ck = self.checkpoints
        assert ck is not None and ck.round is not None
        r = ck.round
        record = ck.finish()
        if self.state is not None:  # what the processes copied for it counts as saved, or not
            for ident in sorted(set(self.state.servers) | set(self.state.workers)):
                self.endpoint.send(ident, "checkpoint_done", cid=record["cid"], ok=record["ok"])
        # what --resume takes (``path`` is the filesystem's, which partial rounds name as their base)
        shown = record["name"] = storage.display(ck.location, record["path"]) if record["path"] else None
        if record["ok"]:
            log.info("checkpoint %s written in %.2f s (training paused %.3f s)", shown, record["seconds"],
                     record["paused_seconds"])
        else:
            log.error("checkpoint %s failed%s: %s", shown or f"round {record['cid']}", unusable,
                      "; ".join(record["errors"]))
            self.errors.extend(record["errors"])
        stop = self._stop
        for cid in r.commands:
            if stop is not None and cid == stop["id"]:
                if record["ok"]:
                    stop["path"] = shown  # answered when the job has stopped
                else:
                    self._stop = None
                    self.reply_command(cid, False, "the checkpoint failed, so the job was not stopped: "
                                       + "; ".join(record["errors"]))
                continue
            self.reply_command(cid, record["ok"], shown if record["ok"] else "; ".join(record["errors"]))

    def init_server(self, ident: str) -> None:
        """Send a server joining the running job the tables; it gets shards by migration."""
        assert self.state is not None and self._init_blobs is not None
        self.endpoint.send(ident, "init_server", tables=self._init_blobs[1], shards=[],
                           num_shards=self.state.num_shards, master="master", **self._server_options())
        self._tell_fenced(ident)

    def _tell_fenced(self, ident: str) -> None:
        """Tell a process that joins the running job whom to ignore: the processes declared lost
        so far (``_fence`` told only those there then). It learns their addresses from etcd, where
        one that only stalled may register again, and must not take what it sends. After the init,
        which tells it who its master is: a ``fence`` before it is not taken (``Node.on_fence``)."""
        for lost in sorted(self.lost, key=_id_order):
            self.endpoint.send(ident, "fence", ident=lost)

    def _server_options(self) -> dict[str, bool]:
        """What a server is told of the job's checkpoints: whether it takes any (the server readies
        its storage), and whether partial ones (it keeps a copy of what each row last saved)."""
        ck = self.checkpoints
        return {"checkpoints": ck is not None, "partial": ck is not None and ck.policy != "full"}

    def rebalance_shards(self, servers: list[str] | None = None) -> list[int]:
        """Spread the shards evenly over ``servers`` (default: all) with few moves; as ``rebalance``,
        nothing moves to or from a server declared lost."""
        st = self.state
        assert st is not None
        return self._spread(servers if servers is not None else st.servers, st.plan_shard_balance,
                            st.shard_map.__getitem__, self.move_shards)

    def _spread(self, group: list[str], plan: Callable[[list[str]], dict[str, list[int]]],
                where: Callable[[int], str], move: Callable[[list[int], str], list[int]]) -> list[int]:
        """The moves ``plan`` makes over the live processes of ``group``, started with ``move``,
        leaving out items on (or going to) processes declared lost (``where``: an item's place)."""
        targets = [p for p in group if p not in self.lost]
        if not targets:
            return []
        return [mid for dest, items in plan(targets).items()
                for mid in move([i for i in items if where(i) not in self.lost], dest)]

    def init_worker(self, ident: str) -> None:
        """Send a worker the application, its executors (none for one joining later) and the maps."""
        assert self.state is not None and self._init_blobs is not None
        app_blob, tables_blob = self._init_blobs
        peers = {i: p["addr"] for i, p in self.procs.items()}
        self.endpoint.send(ident, "init_worker", app=app_blob, tables=tables_blob,
                           executors=self.state.executors_of(ident), num_executors=self.num_executors,
                           num_shards=self.state.num_shards, shard_map=self.state.shard_map, peers=peers,
                           options=self.options, master="master",
                           **(self._restore_fields().get("executors", {}) if self.driver is None else {}))
        self._tell_fenced(ident)

    def retire(self, ident: str) -> None:
        """Tell a worker without executors, or a server without shards, to leave (scale-in).

        It leaves once it owes nothing (acknowledgements, forwarded replies); its goodbye
        completes the retirement.
        """
        self.retiring.add(ident)
        self.endpoint.send(ident, "shutdown", reason="scale-in", settle=True)

    def flush_routes(self, gone: list[str]) -> int:
        """Tell every other worker and server that the ``gone`` servers hold no shard any more.

        Workers learn shard moves lazily, from hints in replies; a server may only leave once
        nobody can still send to it. Each process answers when it has re-routed and has no
        request pending at the gone servers. Returns the id to pass to ``routes_settled``.
        """
        assert self.state is not None
        self._route_rid += 1
        targets = {p for p in self.state.workers + self.state.servers if p not in gone}
        for ident in sorted(targets):
            self.endpoint.send(ident, "routes", rid=self._route_rid, shard_map=self.state.shard_map, gone=gone)
        self._route_waits[self._route_rid] = targets
        return self._route_rid

    def routes_settled(self, rid: int) -> bool:
        return not self._route_waits.get(rid)

    def said_goodbye(self, ident: str) -> bool:
        return ident in self._byes

    def local_agent(self) -> str | None:
        """The node agent that starts processes for ``litz scale``: the master's host's, else the first
        (as the PROCS watch tells: no etcd read on the loop)."""
        names = sorted(self.agents)
        mine = [k for k in names if self.agents[k].get("host") == host_name(self.endpoint.host)]
        return (mine or names or [None])[0]

    def move_executors(self, executors: list[int], dest: str, ship_input: bool = True) -> list[int]:
        """Start migrating executors to worker ``dest`` (asynchronous); returns the migration ids.

        ``ship_input``: send the input partition from memory (scale-out: the new process starts
        fast) or let the destination reload it from shared storage (scale-in: the leaving host
        is freed fast).
        """
        assert self.state is not None
        mids = []
        for mid, source, eids in self.state.start_migration(list(executors), dest):
            self.endpoint.send(source, "migrate_out", mid=mid, executors=eids, dest=dest, ship_input=ship_input,
                               dest_addr=self.procs[dest]["addr"])
            mids.append(mid)
        return mids

    def move_shards(self, shards: list[int], dest: str) -> list[int]:
        """Start migrating logical shards to server ``dest`` (asynchronous; executors never pause)."""
        assert self.state is not None
        mids = []
        for mid, source, ss in self.state.start_shard_migration(list(shards), dest):
            self.endpoint.send(source, "migrate_shards", mid=mid, shards=ss, dest=dest,
                               dest_addr=self.procs[dest]["addr"])
            mids.append(mid)
        return mids

    def rebalance(self, workers: list[str] | None = None, ship_input: bool = True) -> list[int]:
        """Spread executors evenly over ``workers`` (default: all) with few moves. Nothing moves to
        or from a worker declared lost: one whose recovery waits for the other role's (a server's)
        is still in the group, and a worker joining meanwhile spread executors onto it (the job
        failed, `KeyError: 'w0'`, a stress run found). Its recovery places its executors; the
        spread that follows a recovery takes them into account."""
        st = self.state
        assert st is not None
        return self._spread(workers if workers is not None else st.workers, st.plan_balance, st.moving_dest,
                            lambda eids, dest: self.move_executors(eids, dest, ship_input))

    def _relieve_stragglers(self) -> None:
        """Move one executor off a worker that runs its tasks slower than the others, when
        straggler relief is on (``stragglers.py``) and nothing else moves executors: not while the
        job starts or stops, recovers, scales, pauses for a checkpoint, or has migrations in flight
        (the driver's own included); the measure starts over after those."""
        relief, st = self.relief, self.state
        if relief is None or st is None:
            return
        now = time.monotonic()
        if (self.driver is None or self.driver._finished or self._stop is not None or self.recovering
                or self.elastic.op is not None or st.moving or st.paused):
            relief.restart(now)
            return
        for gone in [w for w in relief.known() if w not in st.workers or w in self.lost]:
            relief.forget(gone)
        held: dict[str, list[int]] = {w: [] for w in st.workers if w not in self.lost and w not in self.retiring}
        for eid, worker in sorted(st.placement.items()):
            if worker in held:
                held[worker].append(eid)
        move = relief.decide(now, held)
        if move is None:
            return
        eid, src, dst = move
        if self.move_executors([eid], dst):
            log.warning("straggler relief: executor %d moves from %s to %s (%s)", eid, src, dst,
                        relief.describe(eid, src, dst))
            self.straggler_moves.append({"executor": eid, "from": src, "to": dst, "time": time.time()})

    def on_ship_ready(self, msg: Message) -> None:
        """The source of a migration reported every completion of its executors: they may leave.

        Only the main loop handles this message, in order (``_handle_aside`` defers it), so
        every report the source sent before it has been handled in full, not left half-done by
        a driver waiting for a read. Had the source shipped first and died, a report still on
        its way would be lost, and its task would run again on a state that counts it. From
        here the queued tasks complete on the destination: if it dies, they run again.
        """
        st = self.state
        assert st is not None
        mig = st.migrations.get(msg["mid"])
        if msg.sender in self.lost or mig is None or mig[2] in self.lost:
            return  # cancelled, abandoned, or a loss being settled: the settle decides
        eids, source, dest = mig
        tasks = msg["tasks"]
        if msg.sender != source:  # only the source knows its executors' queued tasks and may ship them
            log.warning("ship_ready for migration %d from %s, which is not its source %s; dropped", msg["mid"],
                        msg.sender, source)
            return
        if not all(is_int(t) for t in tasks):  # (a list as a task id raised out of the job's loop)
            log.warning("ship_ready for migration %d from %s names malformed task ids %.200r; dropped", msg["mid"],
                        msg.sender, tasks)
            return
        others = {t for t in tasks if (rec := st.inflight.get(t)) is not None and rec.executor_id not in eids}
        if others:  # tasks of other executors: they do not leave with these
            log.warning("ship_ready for migration %d from %s names tasks %s, which are not of its executors %s; "
                        "they stay where they are", msg["mid"], msg.sender, sorted(others)[:10], eids)
        st.tasks_moved([t for t in tasks if t not in others], dest)
        self.endpoint.send(msg.sender, "ship", mid=msg["mid"])

    def on_migrated(self, msg: Message) -> None:
        """The destination of executor migration ``mid`` hosts its executors. Only the destination:
        another process's word placed the executors where they are not (their tasks lost)."""
        assert self.state is not None
        if msg["mid"] not in self.state.migrations:
            log.warning("migrated message for unknown migration %r from %s", msg["mid"], msg.sender)
            return
        if msg.sender != (dest := self.state.migrations[msg["mid"]][2]):
            log.warning("migrated message for migration %d from %s, which is not its destination %s; dropped",
                        msg["mid"], msg.sender, dest)
            return
        self.state.finish_migration(msg["mid"])
        self.migrations_done += 1

    def _send_outbox(self) -> None:
        assert self.state is not None
        for worker, tasks in self.state.take_outbox().items():
            self.endpoint.send(worker, "tasks", tasks=tasks)

    def _on_done(self, driver: Driver, msg: Message) -> None:
        """Hand the driver a worker's completions. A report from a process declared lost (taken
        off the socket before, or lost while the driver handled its first completions) never
        counts: its tasks are dispatched again, perhaps already."""
        assert self.state is not None
        busy = msg.get("busy")
        if self.relief is not None and busy is not None and msg.sender not in self.lost:
            if isinstance(busy, list) and all(
                    isinstance(b, list) and len(b) == 3 and is_int(b[0]) and isinstance(b[1], (int, float))
                    and not isinstance(b[1], bool) and math.isfinite(b[1]) and b[1] >= 0
                    and is_int(b[2]) and b[2] >= 0 for b in busy):
                for eid, seconds, tasks in busy:
                    if self.state.placement.get(int(eid)) == msg.sender:  # (a report sent before a move, read
                        self.relief.observe(msg.sender, int(eid), seconds, int(tasks))  # after: its measure stays)
            else:
                log.warning("malformed busy report from %s: %.100r; ignored", msg.sender, busy)
        for task_id, tb in self._reports(msg, "failed"):
            if driver._finished or msg.sender in self.lost:  # (a handler may have finished the job)
                return
            rec = self.state.fail(task_id)
            driver.handle_task_failure(TaskFailure(rec.executor_id, rec.args, tb, task_id, msg.sender))
        for task_id, value in self._reports(msg, "completed"):
            if driver._finished or msg.sender in self.lost:  # (a handler may wait for a read)
                return
            if task_id not in self.state.inflight:  # (it failed, or came twice, in this very message)
                log.warning("%s reported task %d again; dropped", msg.sender, task_id)
                continue
            if msg.undecodable and (bad := undecodable_in(value)) is not None:  # that task fails, no other
                rec = self.state.fail(task_id)
                driver.handle_task_failure(TaskFailure(rec.executor_id, rec.args, f"its result, sent by "
                                                       f"{msg.sender}, does not load on the master: {bad.error}",
                                                       task_id, msg.sender))
                continue
            rec = self.state.complete(task_id)
            driver.handle_task_completion(TaskResult(rec.executor_id, rec.args, value, task_id, rec.version))

    def _reports(self, msg: Message, field_name: str) -> list[tuple[int, Any]]:
        """The ``[task id, value]`` pairs of a ``done`` message's field that name tasks in flight on its
        sender; any other entry (malformed, a task this job does not have, or one another worker
        runs) is logged and dropped, so that a bad report never ends the job nor counts.

        The sender must be the worker the task was sent to (or moved to with its queued executor:
        ``tasks_moved``), or the one its executor is placed on now (a task that reached an executor's
        old worker after it left was forwarded to the new one). Before, any process's report of a
        task in flight was taken: its driver counted a result the task never produced."""
        st = self.state
        assert st is not None
        out = []
        entries = msg[field_name]
        for entry in entries if isinstance(entries, list) else [entries]:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and is_int(entry[0])):
                log.warning("malformed %s report from %s: %.200r; dropped", field_name, msg.sender, entry)
            elif (rec := st.inflight.get(entry[0])) is None:
                log.warning("%s reported %s task %d, which is not in flight; dropped", msg.sender, field_name,
                            entry[0])
            elif msg.sender != rec.worker and msg.sender != st.placement.get(rec.executor_id):
                log.warning("%s reported %s task %d, which runs on %s (its executor %d is on %s); dropped", msg.sender,
                            field_name, entry[0], rec.worker, rec.executor_id, st.placement.get(rec.executor_id))
            else:
                out.append((entry[0], entry[1]))
        return out

    def _tell_recovered(self, driver: Driver) -> None:
        """Hand the driver the partial recoveries completed since it was last told, in order."""
        while self._recovered and not driver._finished:
            driver.recovered(self._recovered.pop(0))

    def run(self, driver: Driver) -> JobResult:
        """Run the job to the driver's ``finish``; always shuts the processes down."""
        started = time.monotonic()
        self.membership.watch_prefix(PROCS)
        self.membership.watch_prefix(COMMANDS)
        register_exclusively(self.membership, proc_key("master", "master"), {
            "role": "master", "id": "master", "host": host_name(self.endpoint.host), "addr": self.endpoint.address,
            "pid": os.getpid(), "started": time.time(),
            "numba": spawner.numba_loaded(),  # a joining host's agent warms its zygote up for our kernels
            "secured": self.endpoint.secret is not None,  # a joining host without the secret is refused at once
            # how long a lapsed lease of the master's may take to come back (node.MasterPresence)
            "lease_ttl": lease_ttl(),
        })
        stats: dict[str, dict[str, Any]] = {}
        stopped: dict[str, Any] | None = None  # a `litz stop` that ended the job
        try:
            self.publish_status("starting")
            workers, servers = self._wait_for_processes()
            self._initialise(workers, servers)
            if self.checkpoints is not None:  # before its first checkpoint: a restart goes on from this run
                self.checkpoints.record_timeline()
            self.driver = driver
            driver._bind(self, self.num_executors, self.app.config)
            if self.recovery == "full":
                self._initial_driver = dump_driver(driver)
            try:
                if self.resume is not None:
                    self._resume_driver(driver)
                else:
                    driver.dispatch_initial_tasks()
            except _Rollback as rb:
                raise ProcessLost(f"{rb.reason} (before the job started: nothing to roll back to)", rb.ident) from None
            self._send_outbox()
            assert self.state is not None
            while not driver._finished and not self._stop_ready():
                if not self.state.inflight and not self._deferred:
                    raise LitzError("the driver has no task in flight and has not called finish(): "
                                    "the job cannot make progress")
                batch: list[Message] = []
                try:
                    batch, self._deferred = self._deferred, []
                    batch.extend(self._poll(200))
                    while batch and not driver._finished:
                        msg = batch.pop(0)
                        if msg.type == "done":
                            self._on_done(driver, msg)
                        elif msg.type == "ship_ready":
                            self.on_ship_ready(msg)
                        else:
                            self._handle_aside(msg)
                        self._tell_recovered(driver)
                    self._tell_recovered(driver)
                    if not driver._finished:
                        self._checkpoint_tick()
                    elif batch:  # the rest of the batch: a checkpoint being written may wait for its answers
                        self._deferred = batch + self._deferred
                except _Rollback as rb:
                    leftover = batch + rb.received
                    while True:  # a loss noticed while the driver resumes: roll back again
                        try:
                            self._roll_back(driver, rb, leftover)
                            break
                        except _Rollback as again:
                            rb, leftover = again, again.received
                self._send_outbox()
            if driver._finished:
                self._complete_checkpoint_being_written()
            elif (r := self.checkpoints.round if self.checkpoints else None) is not None and r.phase in _UNSAVED:
                self._drop_unsaved_round()  # stopped: a round being written stays unfinished, as the stop asked
            if self.options.get("collect_stats", True):
                stats = self.collect_stats()
            stats.setdefault("master", {"role": "master"}).update({"recoveries": list(self.recoveries),
                               "checkpoints": list(self.checkpoints.completed) if self.checkpoints else [],
                               "scale_history": list(self.elastic.history),
                               "straggler_moves": list(self.straggler_moves)})
            if not driver._finished and self._stop is not None:
                stopped = self._stop
                self.publish_status("stopped", final=True)
                for cid in [stopped["id"], *stopped.get("also", ())]:
                    self.reply_command(cid, True, f"stopped after checkpoint {stopped['path']}"
                                       if stopped["path"] else "stopped (no checkpoint taken)")
            else:
                self.publish_status("finished", final=True)
                if self._stop is not None:  # it finished before the stop's checkpoint was written
                    for cid in [self._stop["id"], *self._stop.get("also", ())]:
                        self.reply_command(cid, True, "finished on its own before it could stop")
        except BaseException:
            self.publish_status("failed", final=True)
            raise
        finally:
            self.shutdown(stats)
        assert self.state is not None
        if stopped is not None:
            raise JobStopped(self.job, stopped["path"], "SIGTERM" if stopped["id"] == "sigterm" else "litz stop")
        return JobResult(driver._result, time.monotonic() - started, stats, self.job, self.state.completed)

    def _busy_workers(self) -> set[str]:
        """Workers running tasks the job no longer waits for (the driver finished, or a stop): a
        task that blocks holds its worker's whole loop, which answers nothing until it returns."""
        return {rec.worker for rec in self.state.inflight.values()} if self.state is not None else set()

    def shutdown(self, stats: dict[str, dict[str, Any]], timeout: float = 5.0) -> None:
        """Tell every process to leave and wait (briefly) for their goodbyes: a worker still in an
        abandoned task only ``ABANDONED_GRACE`` s (the launcher then terminates what is left). Not
        for processes that never joined: they cannot hear it (their agent stops them). Those of a
        scale still joining are told but not waited for: one that cannot hear the master (a host
        without the job secret) would hold the launcher for the whole ``timeout``, and one that
        can has done no work to report."""
        busy = self._busy_workers()
        joining = self.elastic.op.joining if self.elastic.op is not None else set()
        told = [p for p in self.procs if p != "master" and p not in self._byes and p not in self._unresponsive
                and p not in self.lost and p not in self.elastic.unjoined
                and self.procs[p].get("role") in ("worker", "server")]
        targets = [p for p in told if p not in joining]
        for p in told:
            try:
                self.endpoint.send(p, "shutdown", reason="job finished")
            except Exception:
                log.warning("cannot reach %s to shut it down", p)
        started = time.monotonic()

        def waited_for(p: str) -> bool:
            return p in self._byes or (p in busy and time.monotonic() > started + ABANDONED_GRACE)

        while time.monotonic() < started + timeout and not all(waited_for(p) for p in targets):
            if self.endpoint.router.poll(100):
                try:
                    msg = self.endpoint.recv(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if msg is not None and msg.type == "bye":
                    self._byes[msg.sender] = msg["stats"]
        self.stuck = sorted(p for p in targets if p in busy and p not in self._byes)
        for p, s in self._byes.items():
            stats.setdefault(p, s)
        # the last answers (a stop's) and requests land before the master leaves, if etcd lets them
        if self.etcd_writes.pending:
            self.etcd_writes.flush(self.membership.timeout + 1.0)
        try:
            self.membership.deregister()
        except LitzError:
            log.warning("could not deregister the master from etcd")
        self.endpoint.close()
        with self._wake_lock:
            self._wake_open = False
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

