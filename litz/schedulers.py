"""Scheduling helpers built only on the public API: stale-synchronous and block-rotation drivers.

``SSPDriver``: iteration ``i`` of every executor is dispatched once iterations up to ``i - s - 1``
have fully completed (``s = 0`` is bulk-synchronous). Executors run their tasks in order, so
iterations complete in order, but for a failed task sent again (``Driver.retry``): the
iterations after it wait for it.

``BlockRotation``: model scheduling (as LDA uses). ``B >= E`` parameter blocks rotate over
``E`` executors; in round ``r`` executor ``e`` works on block ``(offset(e) + r) % B``, with the
executors spread evenly over the blocks (``offset(e) = e * B // E``). A block is used by one
executor at a time and in round order, and an executor starts its next round as soon as the
block it needs is released: there is no global barrier between rounds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from litz.api import Driver, TaskResult
from litz.errors import ConfigError


class SSPDriver(Driver):
    """A driver that runs ``iterations`` iterations of one task per executor with staleness ``staleness``.

    Set ``iterations`` and ``staleness`` as attributes (or config keys of those names) and
    override ``task_args``, ``on_iteration_end`` and ``result``.
    """

    iterations: int | None = None
    staleness: int | None = None

    def task_args(self, executor_id: int, iteration: int) -> Any:
        """The arguments of ``executor_id``'s task for ``iteration`` (default: the iteration)."""
        return {"iteration": iteration}

    def on_iteration_end(self, iteration: int, results: list[TaskResult]) -> None:
        """Called once every executor completed ``iteration``; results are in executor order."""

    def result(self) -> Any:
        """The job's result, returned by ``litz.run`` after the last iteration."""
        return None

    def resumed(self) -> None:
        """Back from a checkpoint: take the number of iterations and the staleness from the new
        launch (more epochs, another staleness); iterations go on from where the checkpoint stood.
        The tasks in flight then come back with it, so only iterations never dispatched are (before,
        a smaller staleness dispatched some twice, and more on each completion), and a job whose
        new count is already done finishes (it stopped, with nothing in flight)."""
        self._iters, self._stale = self._settings()
        self._top = max([*self._iteration_of.values(), self.iteration - 1, getattr(self, "_top", -1)])
        self._advance()

    @property
    def iteration(self) -> int:
        """Iterations every executor has completed (checkpoint policies count these)."""
        return getattr(self, "_completed_iterations", 0)

    def progress(self) -> str:
        done = getattr(self, "_completed_iterations", 0)
        return f"iteration {done}/{getattr(self, '_iters', '?')} (staleness {getattr(self, '_stale', '?')})"

    def _settings(self) -> tuple[int, int]:
        iters = self.iterations if self.iterations is not None else self.config.get("iterations")
        stale = self.staleness if self.staleness is not None else self.config.get("staleness", 0)
        if not isinstance(iters, int) or iters < 1:
            raise ConfigError(f"SSPDriver needs a positive number of iterations, got {iters!r}")
        if not isinstance(stale, int) or stale < 0:
            raise ConfigError(f"SSPDriver needs a staleness >= 0, got {stale!r}")
        return iters, stale

    def _dispatch_iteration(self, iteration: int) -> None:
        for e in range(self.num_executors):
            tid = self.dispatch_task(e, self.task_args(e, iteration))
            self._iteration_of[tid] = iteration
        self._top = iteration

    def dispatch_initial_tasks(self) -> None:
        self._iters, self._stale = self._settings()
        self._iteration_of: dict[int, int] = {}
        self._results: dict[int, list[TaskResult]] = defaultdict(list)
        self._top = -1  # the last iteration dispatched
        self._advance()

    def handle_task_completion(self, result: TaskResult) -> None:
        it = self._iteration_of.pop(result.task_id)
        if it < self._iters:  # (one beyond a count lowered on resume is dropped)
            self._results[it].append(result)
        self._advance()

    def _retried(self, old: int, new: int) -> None:
        self._iteration_of[new] = self._iteration_of.pop(old)

    def _advance(self) -> None:
        """End, in order, the iterations every executor has completed, then dispatch what the
        staleness allows: iteration ``i`` once every iteration up to ``i - s - 1`` has ended. A
        retried task (``Driver.retry``) completes after its executor's later iterations: those
        wait for it, in ``on_iteration_end``'s order and in what is dispatched (before, the
        iteration count jumped past it, the bound broke and the job could finish without it)."""
        done = self.iteration
        while not self._finished and done < self._iters and len(self._results.get(done, ())) == self.num_executors:
            results = sorted(self._results.pop(done), key=lambda r: r.executor_id)
            done = self._completed_iterations = done + 1
            self.on_iteration_end(done - 1, results)
        if self._finished:
            return
        if done >= self._iters:
            self.finish(self.result())
            return
        for i in range(self._top + 1, min(done + self._stale + 1, self._iters)):
            self._dispatch_iteration(i)


class BlockRotation:
    """Which executor may work on which block when: a state machine with no sockets.

    ``start()`` gives the first assignments; ``complete(e, r)`` reports that executor ``e``
    finished round ``r`` and returns the assignments ``(executor, round, block)`` that became
    possible. At every moment a block has at most one user, and each block is visited in
    round order.

    ``depth`` is how many tasks an executor may have dispatched and not completed. With the
    default 1 an executor gets its next round only once its last one completed, so every
    round pays the whole chain between processes (flush, acknowledgement, completion,
    dispatch) before it starts. With ``depth = 2`` and more blocks than executors, an
    executor's next round is dispatched as soon as the block it needs is released (by the
    completion of that block's previous use, as always), even while the executor still works
    on its current round: the task waits in the executor's queue and starts the moment the
    current one returns, and the chain overlaps with sampling. A task then runs before the
    driver has seen its own executor's previous completion; its block's rows are still
    exact (they were released by a completion the driver saw), but anything the driver
    accumulates from completions (LDA's topic totals) lacks that executor's latest rounds,
    which the executor can add itself (apps/lda.py does).

    Executor ``e`` starts at block ``offset(e) = e * B // E``, so the executors lie spread over
    the blocks with the spare blocks between them: the block an executor needs next was last
    held by the executor ``B // E`` places behind it, ``B // E`` rounds earlier. With packed
    offsets (``e``) it would be held by its neighbour in the current round, so with ``B = 2E``
    every executor's next round would wait for that neighbour's current one to complete, and
    ``depth = 2`` could never queue it early. With ``B = E`` both are the same rotation.
    """

    def __init__(self, num_executors: int, num_blocks: int | None = None, num_rounds: int | None = None,
                 depth: int = 1) -> None:
        blocks = num_blocks or num_executors
        if num_executors < 1 or blocks < num_executors:
            raise ConfigError(f"block rotation needs at least as many blocks ({blocks}) as executors "
                              f"({num_executors})")
        if depth < 1:
            raise ConfigError(f"block rotation needs a depth of at least 1 task per executor, got {depth}")
        self.E = num_executors
        self.B = blocks
        self.rounds = num_rounds
        self.depth = depth
        self._by_offset = {self.offset(e): e for e in range(num_executors)}
        self._next_round = {b: self._next_use(b, 0) for b in range(blocks)}
        self._next_dispatch = dict.fromkeys(range(num_executors), 0)  # the executor's next round to hand out
        self._completed = dict.fromkeys(range(num_executors), 0)  # rounds it completed (in order)
        self._in_flight = dict.fromkeys(range(num_executors), 0)
        self.active: dict[int, tuple[int, int]] = {}  # block -> (executor, round)

    def offset(self, executor: int) -> int:
        """The block ``executor`` holds in round 0."""
        return executor * self.B // self.E

    def block(self, executor: int, rnd: int) -> int:
        return (self.offset(executor) + rnd) % self.B

    def user(self, block: int, rnd: int) -> int | None:
        """The executor that works on ``block`` in round ``rnd``, or None (a spare block then)."""
        return self._by_offset.get((block - rnd) % self.B)

    def _next_use(self, block: int, rnd: int) -> int:
        """The first round >= rnd in which some executor works on ``block``."""
        r = rnd
        while self.user(block, r) is None:
            r += 1
        return r

    def _try(self, executor: int) -> list[tuple[int, int, int]]:
        """Hand ``executor`` its next rounds while its depth allows and their blocks are free."""
        out = []
        while self._in_flight[executor] < self.depth:
            rnd = self._next_dispatch[executor]
            if self.rounds is not None and rnd >= self.rounds:
                break
            b = self.block(executor, rnd)
            if self._next_round[b] != rnd or b in self.active:
                break
            self.active[b] = (executor, rnd)
            self._in_flight[executor] += 1
            self._next_dispatch[executor] = rnd + 1
            out.append((executor, rnd, b))
        return out

    def start(self) -> list[tuple[int, int, int]]:
        return [a for e in range(self.E) for a in self._try(e)]

    def complete(self, executor: int, rnd: int) -> list[tuple[int, int, int]]:
        b = self.block(executor, rnd)
        if self.active.get(b) != (executor, rnd):
            raise ConfigError(f"executor {executor} did not hold block {b} in round {rnd}")
        del self.active[b]
        self._in_flight[executor] -= 1
        self._completed[executor] = rnd + 1
        self._next_round[b] = self._next_use(b, rnd + 1)
        out = self._try(executor)
        # the executor that needs block b next may now start
        nxt = self._next_round[b]
        user = self.user(b, nxt)
        if user is not None and user != executor and self._next_dispatch[user] == nxt:
            out += self._try(user)
        return out

    def finished(self) -> bool:
        return self.rounds is not None and all(r >= self.rounds for r in self._completed.values())


class BlockRotationDriver(Driver):
    """A driver that rotates ``num_blocks`` blocks over the executors for ``rounds`` rounds.

    Override ``task_args(executor, round, block)``, ``on_round_end`` and ``result``. A round
    ends (``on_round_end(r, results)``) when every executor has finished it.
    """

    rounds: int | None = None
    num_blocks: int | None = None
    depth: int = 1  #: tasks in flight per executor (see BlockRotation)

    def task_args(self, executor_id: int, rnd: int, block: int) -> Any:
        return {"round": rnd, "block": block}

    def on_round_end(self, rnd: int, results: list[TaskResult]) -> None:
        """Called once every executor finished round ``rnd``."""

    def result(self) -> Any:
        return None

    def _dispatch(self, assignments: list[tuple[int, int, int]]) -> None:
        for e, r, b in assignments:
            tid = self.dispatch_task(e, self.task_args(e, r, b))
            self._assignment[tid] = (e, r)

    def dispatch_initial_tasks(self) -> None:
        rounds = self.rounds if self.rounds is not None else self.config.get("rounds")
        if not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(f"BlockRotationDriver needs a positive number of rounds, got {rounds!r}")
        self._rotation = BlockRotation(self.num_executors, self.num_blocks or self.config.get("num_blocks"),
                                       rounds, self.depth)
        self._assignment: dict[int, tuple[int, int]] = {}
        self._round_results: dict[int, list[TaskResult]] = defaultdict(list)
        self._dispatch(self._rotation.start())

    def _retried(self, old: int, new: int) -> None:
        self._assignment[new] = self._assignment.pop(old)  # its block stays held until it completes

    def handle_task_completion(self, result: TaskResult) -> None:
        e, r = self._assignment.pop(result.task_id)
        done = self._round_results[r]
        done.append(result)
        if len(done) == self.num_executors:
            del self._round_results[r]
            done.sort(key=lambda x: x.executor_id)
            self.on_round_end(r, done)
        if self._finished:
            return
        self._dispatch(self._rotation.complete(e, r))
        if self._rotation.finished() and not self._assignment:
            self.finish(self.result())
