"""The programming model (DESIGN.md §1): Driver, Executor, App and what they exchange.

The driver runs in the master and only dispatches micro-tasks and reacts to their
completion; executors run the micro-tasks next to the data they own. Neither sees
processes, hosts or sockets: the framework moves executors and shards underneath.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from litz.errors import LitzError, TableError, TaskError
from litz.ps.tables import Table

if TYPE_CHECKING:  # pragma: no cover
    from litz.runtime.master import Master


class ParameterServer:
    """What ``self.ps`` offers (to executors inside a task, and to the driver).

    Values returned by ``get`` are read-only views shared through the process cache:
    copy before modifying. ``get_many`` returns a fresh stacked array ``(n, *row_shape)``.
    Every call checks the table, the keys and the deltas' dtype and shape first, and raises
    ``TableError`` naming the table and the key, before anything is sent.
    """

    # -- what an implementation provides -----------------------------------------------------------
    def _table(self, name: str) -> Table:
        raise NotImplementedError

    def _read(self, table: Table, keys: list[Hashable]) -> list[np.ndarray]:
        """The rows of already-checked keys, in order."""
        raise NotImplementedError

    def _write(self, table: Table, keys: list[Hashable], deltas: np.ndarray) -> None:
        """Apply already-checked stacked deltas."""
        raise NotImplementedError

    # -- the API ----------------------------------------------------------------------------------------
    def get(self, table: str, key: Hashable) -> np.ndarray:
        t = self._table(table)
        return self._read(t, [t.check_key(key)])[0]

    def get_many(self, table: str, keys: Iterable[Hashable], out: np.ndarray | None = None) -> np.ndarray:
        """The rows of ``keys`` stacked, shape ``(len(keys), *row_shape)``: a fresh array, or ``out``
        filled and returned. Reusing ``out`` matters for big reads (a whole graph each round): a
        fresh array of tens of MB costs a page fault per 4 KB page on first touch, often more than
        the copy itself."""
        t = self._table(table)
        rows = self._read(t, t.check_keys(keys))
        shape = (len(rows), *t.shape)
        if out is None:
            out = np.empty(shape, t.dtype)
        elif out.shape != shape or out.dtype != t.dtype or not out.flags.writeable:
            raise TableError(f"table {t.name!r}: get_many(out=...) needs a writeable {t.dtype} array of shape "
                             f"{shape}, got {out.dtype} {out.shape}{'' if out.flags.writeable else ' (read-only)'}")
        for i, row in enumerate(rows):
            out[i] = row
        return out

    def update(self, table: str, key: Hashable, delta: Any) -> None:
        t = self._table(table)
        key = t.check_key(key)
        self._write(t, [key], t.check_delta(delta, what=f"update of key {key!r}")[None])

    def update_many(self, table: str, keys: Iterable[Hashable], deltas: Any) -> None:
        t = self._table(table)
        keys = t.check_keys(keys)
        self._write(t, keys, t.check_delta(deltas, n=len(keys)))


@dataclass(frozen=True)
class TaskResult:
    """A finished micro-task, as ``handle_task_completion`` receives it."""

    executor_id: int
    args: Any
    value: Any
    task_id: int
    version: int


@dataclass(frozen=True)
class TaskFailure:
    """A micro-task whose ``run_task`` raised."""

    executor_id: int
    args: Any
    traceback: str
    task_id: int
    worker: str


@dataclass(frozen=True)
class Recovery:
    """A partial (SCAR) recovery that has just completed, as ``Driver.recovered`` receives it.

    The lost processes' executors (a worker's) or shards (a server's) were restored on the
    survivors from ``checkpoint`` (None: there was none yet, they started afresh), while
    everything else went on where it was.
    """

    role: str  # "worker" or "server": what was lost
    lost: tuple[str, ...]  # the lost processes' ids
    executors: tuple[int, ...]  # executors restored from the checkpoint (a worker's loss)
    shards: tuple[int, ...]  # shards restored from the checkpoint (a server's loss)
    checkpoint: str | None


@dataclass(frozen=True)
class StateRows:
    """An executor's state seen as rows, for SCAR priority checkpoints of executor state.

    Row ``i`` is ``values[ptr[i]:ptr[i + 1]]``: rows may differ in length (an LDA document's
    token topics), but an executor keeps the same rows for its whole life, so that a row saved
    long ago can still be compared with its value now and restored in place.
    """

    values: np.ndarray  # 1-D, a copy the executor will not change afterwards
    ptr: np.ndarray  # int64, one more than the rows: ptr[0] == 0, ptr[-1] == len(values)

    @property
    def num_rows(self) -> int:
        return len(self.ptr) - 1

    def values_of(self, rows: np.ndarray) -> np.ndarray:
        """A mask over ``values`` that selects the rows ``rows`` (positions), in row order."""
        mask = np.zeros(self.num_rows, bool)
        mask[np.asarray(rows, np.int64)] = True
        return np.repeat(mask, np.diff(self.ptr))


class Executor:
    """A logical executor: owns an input partition (reloadable) and mutable state (serializable).

    Override ``load_input`` (how to read partition ``executor_id`` of ``num_executors`` from
    shared storage), ``init_state`` and ``run_task``. Keep input and state apart: input is
    never shipped when an executor moves away from a leaving host, it is reloaded.
    Attributes set by the framework: ``executor_id``, ``num_executors``, ``config``, ``ps``,
    ``input`` and ``state``.
    """

    executor_id: int
    num_executors: int
    config: dict[str, Any]
    ps: ParameterServer
    input: Any = None
    state: Any = None
    #: Whether a move to a new process (scale-out, rebalancing) sends ``input`` from memory. Set
    #: False where loading it at the destination is cheaper than sending it: NN-Descent's input is
    #: the whole data set, memory-mapped and shared by every executor of a process, and shipping
    #: it gave each moved executor a private copy (219 MB each on Fashion-MNIST).
    ship_input: bool = True

    def load_input(self) -> Any:
        """Load this executor's input partition; the result is stored in ``self.input``."""
        return None

    def init_state(self) -> Any:
        """Create this executor's mutable state; the result is stored in ``self.state``."""
        return None

    def setup(self) -> None:
        """Called once the executor has its input and state in a process, whether it was created
        there or arrived by migration: warm up kernels here (not in ``load_input``, which a
        migration that ships the input from memory skips)."""

    def run_task(self, args: Any) -> Any:
        """Run one micro-task; returning is the completion signal, the value goes to the driver."""
        raise NotImplementedError

    def prefetch(self, args: Any) -> Iterable[tuple[str, Iterable[Hashable]]]:
        """``(table, keys)`` pairs that a task with ``args`` will read (default: none).

        The worker asks when a task arrives while this executor is still busy with an earlier
        one, and fetches those rows right away, tagged with the waiting task's version: when
        the task starts, its reads hit the process cache instead of waiting for a round trip.
        That is consistent (DESIGN.md §2): the fetch leaves after the task's dispatch, so it
        sees every update the task must see. Called in the worker's event loop, so it must be
        quick and must not use ``self.ps``; a hint that raises or names an unknown table is
        logged and ignored (the task then fetches as usual).
        """
        return ()

    def get_state(self) -> Any:
        """The state to ship or checkpoint (default: ``self.state``)."""
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state

    # -- SCAR priority checkpoints of executor state (optional, DESIGN.md §5) --------------------
    # An executor whose model lives in its own state (LDA's token topics) may let partial
    # checkpoints save that state a few rows at a time, the rows that moved most first, as
    # servers do with table rows. Override all three; the default keeps the state whole, saved
    # by full checkpoints only.

    def state_rows(self) -> StateRows | None:
        """This executor's state as rows (a copy), or None: partial checkpoints leave it alone.

        Called between tasks (never while one of this executor's tasks runs), at each partial
        checkpoint and each full one. The rows must be the same in number and length for the
        executor's whole life."""
        return None

    def row_distances(self, now: StateRows, saved: StateRows) -> np.ndarray:
        """How far each row moved from its saved copy: the ``priority`` policy saves the rows
        with the largest distances first. Default: the L2 norm of the difference."""
        diff = (now.values.astype(np.float64) - saved.values) ** 2
        sums = np.add.reduceat(np.append(diff, 0.0), now.ptr[:-1]) if now.num_rows else np.zeros(0)
        sums[np.diff(now.ptr) == 0] = 0.0  # reduceat gives an empty row the next element
        return np.sqrt(sums)

    def restore_rows(self, rows: dict[int, np.ndarray]) -> None:
        """Overwrite rows of the state (just set by ``set_state`` from the last full checkpoint,
        after ``setup``) with their copies from the partial checkpoints taken since, and make
        whatever is derived from them agree (LDA rebuilds its document-topic counts). Called
        when the executor is restored after its worker died under ``--recovery partial``."""
        raise NotImplementedError(f"{type(self).__name__} defines state_rows but not restore_rows")


class Driver:
    """The job's control logic, run in the master.

    Override ``dispatch_initial_tasks`` and ``handle_task_completion``; call
    ``dispatch_task`` to queue micro-tasks and ``finish`` to end the job with a result.
    ``self.ps`` reads and writes parameters synchronously (e.g. to evaluate or to read the
    final model). ``self.config`` holds the application's options.
    """

    num_executors: int
    config: dict[str, Any]
    #: attributes left out of checkpoints (large reloadable data): set them again in ``resumed``.
    #: Every other attribute is saved; objects in them that refer back to the driver (a helper
    #: holding it, a bound method) are saved as that reference and come back bound to the live one.
    transient: tuple[str, ...] = ()
    _master: Master | None = None
    _finished: bool = False
    _result: Any = None

    # -- framework side ---------------------------------------------------------
    def _bind(self, master: Master, num_executors: int, config: dict[str, Any]) -> None:
        self._master = master
        self.num_executors = num_executors
        self.config = config

    @property
    def ps(self) -> ParameterServer:
        assert self._master is not None, "the driver is not running"
        return self._master.ps

    @property
    def version(self) -> int:
        """The master's version counter: incremented at each task completion."""
        assert self._master is not None
        return self._master.state.version

    def dispatch_task(self, executor_id: int, args: Any = None) -> int:
        """Queue a micro-task for one executor; returns its task id. Refused once the driver has
        called ``finish``: the job's result is fixed, and the task would run after it (it did)."""
        assert self._master is not None, "dispatch_task called before the job started"
        if self._finished:
            raise LitzError(f"dispatch_task({executor_id}, ...) after finish(): the job is over")
        return self._master.dispatch(executor_id, args)

    def retry(self, failure: TaskFailure) -> int:
        """Dispatch a failed task again, with its arguments, to its executor (from
        ``handle_task_failure``); returns the new task id. Use this rather than ``dispatch_task``:
        a helper that keeps books by task id (``SSPDriver``, ``BlockRotationDriver``) carries the
        task's place over to the new id (with ``dispatch_task`` its completion was unknown to them:
        a KeyError ended the job). The failed run's parameter-server updates were discarded; what it changed in
        the executor's own state before it raised was not undone."""
        new = self.dispatch_task(failure.executor_id, failure.args)
        self._retried(failure.task_id, new)
        return new

    def _retried(self, old: int, new: int) -> None:
        """Task ``old`` failed and goes again as ``new`` (:meth:`retry`); helpers move their books."""

    def finish(self, result: Any = None) -> None:
        """End the job: ``litz.run`` returns ``result`` (tasks still in flight are abandoned)."""
        self._finished = True
        self._result = result

    def progress(self) -> str:
        """A one-line description of the job's progress, shown by ``litz status`` (override)."""
        return ""

    @property
    def iteration(self) -> int | None:
        """Iterations completed so far, for checkpoint policies counted in iterations (override;
        None: this driver has no iterations, use a policy in seconds)."""
        return None

    def checkpoint(self) -> bool:
        """Take a consistent checkpoint now (asynchronous); False if the job has no
        checkpoint directory or a checkpoint is already being taken."""
        assert self._master is not None
        return self._master.checkpoint("driver")

    # -- application side -----------------------------------------------------------
    def dispatch_initial_tasks(self) -> None:
        raise NotImplementedError

    def handle_task_completion(self, result: TaskResult) -> None:
        raise NotImplementedError

    def resumed(self) -> None:
        """Called instead of ``dispatch_initial_tasks`` when the job resumes from a checkpoint:
        the driver's attributes are back (``config`` is the new launch's) and the tasks it had
        dispatched are dispatched again. Override to report or adjust (default: nothing)."""

    def recovered(self, recovery: Recovery) -> None:
        """Called once a partial recovery (``--recovery partial``) has completed.

        Only what the lost processes held went back to the checkpoint; the driver, the other
        executors and the other shards did not. That is right for parameters that SGD simply
        keeps improving (MLR: default, nothing to do). An application whose tables must agree
        exactly with its executors' states (counts of assignments, as in LDA) reconciles them
        here: the restored executors' tasks that were in flight are already dispatched again,
        and the driver may hold its next tasks until it has recounted. (Full recovery rolls
        the driver back too and calls ``resumed`` instead.)
        """

    @property
    def recoveries_pending(self) -> list[Recovery]:
        """Partial recoveries that completed but that :meth:`recovered` has not been told of yet (it
        is, in order, as soon as the handler running now returns).

        Why: a driver's ``ps.get`` that a server's loss interrupted waits for the recovery and then
        reads the lost shards as restored from the checkpoint. A driver about to ``finish`` with
        what it read (a final model, a graph) checks this first: a pending server recovery means
        some rows went back, and ``recovered`` will be its chance to redo their work."""
        assert self._master is not None
        return list(self._master._recovered)

    def handle_task_failure(self, failure: TaskFailure) -> None:
        """Called when ``run_task`` raised; the default stops the job with a TaskError."""
        raise TaskError(failure.executor_id, failure.args, failure.traceback, failure.worker)


@dataclass
class App:
    """Everything a job needs: the two classes, the tables, how many executors, the options."""

    driver: type[Driver]
    executor: type[Executor]
    tables: list[Table] = field(default_factory=list)
    num_executors: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    name: str = "app"


@dataclass
class JobResult:
    """What ``litz.run`` returns: the driver's result, wall time, and per-process counters."""

    value: Any
    elapsed: float
    stats: dict[str, dict[str, Any]]
    job: str
    tasks_completed: int

    def total(self, counter: str, role: str | None = None) -> int:
        """Sum a counter over processes (optionally of one role)."""
        return sum(int(s.get(counter, 0)) for s in self.stats.values() if role is None or s.get("role") == role)
