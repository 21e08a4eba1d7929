"""Straggler relief (DESIGN.md §4): executors move off workers that run their tasks slower.

On a shared cluster one host may be slower than the others for a while (another job's load, an
older CPU, a noisy neighbour). Every executor of a worker waits its turn on that worker's
cores, so the job's slowest executors are those of the slowest worker, and a driver that keeps
its executors in step (BSP, SSP, block rotation) runs at their pace. Moving executors off it
until the workers take about as long for one task of each of their executors evens that out.

Each worker tells the master, with its completions, how long the tasks of each of its executors
have run in all there (wall time while a task runs, not while it waits for a read: a slow server
is not the worker's doing) and how many ran. This module, without sockets, turns those reports
into moves.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_FACTOR = 1.25  # a move must cut the slowest worker's time per round by at least this
DEFAULT_INTERVAL = 2.0  # seconds between decisions: each decision measures anew
DEFAULT_MIN_TASKS = 8  # tasks a worker must have run since the last decision for a measure


@dataclass
class _Executor:
    worker: str | None = None  # the worker whose totals these are (None: it was forgotten)
    busy: float = 0.0  # that worker's totals for this executor, the newest
    tasks: int = 0
    base_busy: float = 0.0  # the totals at the start of the current measure
    base_tasks: int = 0
    per_task: float | None = None  # seconds per task, as last measured (perhaps on the worker it came from)


@dataclass
class StragglerRelief:
    """Decides, every ``interval`` seconds, whether one executor should move, from where to where.

    Executors may differ in cost (a bigger data partition, a costlier model block), so each is
    measured on its own: a worker's *round*, the time it needs for one task of each of its
    executors, is the sum of their times per task. The decision takes the worker with the
    longest round, and predicts, for each of its executors and each other worker holding
    executors, the rounds after that executor moved: the source's less the executor's time per
    task, the destination's plus the same time. It moves the executor whose move gives the
    shortest longest round, if that is shorter than the job's longest round now by at least
    ``factor`` (1.25: a fifth less).

    The prediction assumes the executor runs as fast on the destination as on the source: with
    executors of unequal cost a worker's speed cannot be told from its executors' times (a worker
    holding a costly executor looks slow), and taking it for slow moved costly executors back
    and forth between workers of the same speed, or onto a worker where they made the longest
    round longer. Moving off a slower worker is then predicted more costly than it is, so relief
    moves less than it could, never so that the rounds come out worse for workers of one speed.
    Each decision needs at least ``min_tasks`` tasks measured on every worker holding executors
    since the last one. A worker holding none (just joined) takes none: its speed is unknown.
    Relief never takes a worker's last executor (with the destination's round growing by the
    executor's whole time, that move could not gain), so every worker stays measured: one that
    was slow for a while and is fast again takes executors back. Before, an emptied worker kept
    the time per task it had when slow, for good, and never took one back.
    """

    factor: float = DEFAULT_FACTOR
    interval: float = DEFAULT_INTERVAL
    min_tasks: int = DEFAULT_MIN_TASKS
    _executors: dict[int, _Executor] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)
    _rounds: dict[str, float] = field(default_factory=dict)  # each worker's round, at the last decision
    _since: float | None = None

    def __post_init__(self) -> None:
        if not (self.factor > 1.0 and math.isfinite(self.factor)):  # (inf: no move could ever gain enough)
            raise ValueError(f"the straggler factor must be > 1 (a move must gain something) and finite, "
                             f"got {self.factor}")
        if not (self.interval > 0 and math.isfinite(self.interval)) or not isinstance(self.min_tasks, int) \
                or self.min_tasks < 1:
            raise ValueError(f"interval must be finite and > 0 and min_tasks a whole number >= 1, "
                             f"got {self.interval} and {self.min_tasks!r}")

    def observe(self, worker: str, executor: int, busy: float, tasks: int) -> None:
        """``worker``'s totals so far for ``executor``: seconds its tasks ran there, and how many ran."""
        self._reported.add(worker)
        e = self._executors.setdefault(executor, _Executor())
        if e.worker != worker or tasks < e.tasks:  # it moved here (or came back: its new tasks count from now)
            e.worker, e.base_busy, e.base_tasks = worker, float(busy), int(tasks)
        e.busy, e.tasks = float(busy), int(tasks)

    def known(self) -> list[str]:
        """The workers that reported."""
        return list(self._reported)

    def describe(self, executor: int, src: str, dst: str) -> str:
        """Why ``executor`` moves from ``src`` to ``dst`` (for the log), from the last decision's figures."""
        cost = self._executors[executor].per_task
        assert cost is not None
        return (f"its task takes {cost * 1e3:.1f} ms; one task of each executor takes "
                f"{self._rounds[src] * 1e3:.1f} ms on {src}, {self._rounds[dst] * 1e3:.1f} ms on {dst}")

    def forget(self, worker: str) -> None:
        """``worker`` is gone (lost, or retired): its executors' measures start anew where they go."""
        self._reported.discard(worker)
        for e in self._executors.values():
            if e.worker == worker:
                e.worker = None

    def restart(self, now: float) -> None:
        """Measure anew from ``now`` (after moves made by others, a recovery or a scale: the
        counts the last measure saw are stale)."""
        self._since = now
        for e in self._executors.values():
            e.base_busy, e.base_tasks = e.busy, e.tasks

    def decide(self, now: float, held: dict[str, list[int]]) -> tuple[int, str, str] | None:
        """``(executor, from, to)`` for one executor to move, or None. ``held``: the executors each
        live worker holds now (those that may take part)."""
        if self._since is None:
            self.restart(now)
            return None
        if now - self._since < self.interval:
            return None
        for ident, eids in held.items():
            mine = [e for eid in eids if (e := self._executors.get(eid)) is not None and e.worker == ident]
            if eids and sum(e.tasks - e.base_tasks for e in mine) < self.min_tasks:
                return None  # not measured enough yet: wait (the measure goes on)
        cost: dict[int, float] = {}
        for ident, eids in held.items():
            for eid in eids:
                e = self._executors.get(eid)
                if e is not None and e.worker == ident and e.tasks > e.base_tasks:
                    e.per_task = (e.busy - e.base_busy) / (e.tasks - e.base_tasks)
                # one that ran no task since it came here counts as it last ran; one that never ran costs nothing
                cost[eid] = 0.0 if e is None or e.per_task is None else e.per_task
        self.restart(now)
        self._rounds = rounds = {ident: sum(cost[eid] for eid in eids) for ident, eids in held.items() if eids}
        if len(rounds) < 2:
            return None
        src = max(rounds, key=lambda i: rounds[i])
        if len(held[src]) < 2:  # its last executor stays (moving it could not shorten the longest round)
            return None
        longest = rounds[src]
        best: tuple[float, int, str] | None = None
        for eid in sorted(held[src], reverse=True):
            if cost[eid] <= 0.0:  # (never ran: moving it would gain nothing measurable)
                continue
            for dst in rounds:
                if dst == src:
                    continue
                worst = max([r for i, r in rounds.items() if i not in (src, dst)]
                            + [longest - cost[eid], rounds[dst] + cost[eid]])
                if best is None or worst < best[0]:
                    best = (worst, eid, dst)
        if best is None or best[0] * self.factor > longest:
            return None
        return best[1], src, best[2]


def _real(x: Any) -> bool:
    """A finite number, not a bool (which Python counts as one)."""
    return (isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
            and (isinstance(x, numbers.Integral) or math.isfinite(x)))  # (a huge int overflows a float)


def from_options(options: dict[str, Any]) -> StragglerRelief | None:
    """The job's straggler relief: ``straggler_relief`` None or False (off), True (the default
    factor) or a factor > 1; ``straggler_interval`` seconds > 0 and ``straggler_min_tasks`` a
    whole number >= 1, as above. Raises ValueError, naming the option, for a bad setting (the
    launcher makes it a ConfigError before anything starts): an infinite factor or interval
    was taken, and relief then never acted; ``inf`` tasks raised a bare OverflowError; 2.9
    tasks became 2."""
    relief = options.get("straggler_relief")
    if relief is None or relief is False:
        return None
    interval = options.get("straggler_interval", DEFAULT_INTERVAL)
    min_tasks = options.get("straggler_min_tasks", DEFAULT_MIN_TASKS)
    if relief is not True and not (_real(relief) and relief > 1):
        raise ValueError(f"the straggler factor must be > 1 (a move must gain something) and finite, "
                         f"got straggler_relief={relief!r}")
    if not (_real(interval) and interval > 0):
        raise ValueError(f"straggler_interval must be a finite number of seconds > 0, got {interval!r}")
    if not (_real(min_tasks) and (isinstance(min_tasks, numbers.Integral) or float(min_tasks).is_integer())
            and min_tasks >= 1):
        raise ValueError(f"straggler_min_tasks must be a whole number >= 1, got {min_tasks!r}")
    return StragglerRelief(DEFAULT_FACTOR if relief is True else float(relief), float(interval), int(min_tasks))
