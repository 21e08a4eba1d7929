"""Straggler relief (DESIGN.md §4): executors move off workers that run their tasks slower.

On a shared cluster one host may be slower than the others for a while (another job's load, an
older CPU, a noisy neighbour). Every executor of a worker waits its turn on that worker's
cores, so the job's slowest executors are those of the slowest worker, and a driver that keeps
its executors in step (BSP, SSP, block rotation) runs at their pace. Moving executors off it
until the workers take about as long for one task of each of their executors evens that out.

Each worker tells the master, with its completions, how long its tasks have run in all (wall
time while a task runs, not while it waits for a read: a slow server is not the worker's doing)
and how many ran. This module, without sockets, turns those reports into moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_FACTOR = 1.25  # a move must cut the slowest worker's time per round by at least this
DEFAULT_INTERVAL = 2.0  # seconds between decisions: each decision measures anew
DEFAULT_MIN_TASKS = 8  # tasks a worker must have run since the last decision for a measure


@dataclass
class _Worker:
    busy: float = 0.0  # its reported totals, the newest
    tasks: int = 0
    base_busy: float = 0.0  # the totals at the start of the current measure
    base_tasks: int = 0
    per_task: float | None = None  # seconds per task, as last measured


@dataclass
class StragglerRelief:
    """Decides, every ``interval`` seconds, whether one executor should move and from where to where.

    A worker holding n executors whose tasks take t seconds each needs n·t for one task of each:
    its *round*. The executor moves from the worker with the longest round to the worker whose
    round, with one executor more, stays shortest, if that shortens the longest round of the job
    by at least ``factor`` (1.25: a fifth less). So a worker that is twice as slow ends up with
    about half as many executors, and moves stop once the rounds are within ``factor`` of each
    other: no executor bounces between two workers of the same speed. Each decision needs at
    least ``min_tasks`` tasks measured on every worker holding executors since the last one;
    a worker holding none (just joined, or emptied) may take an executor once its speed is known.
    """

    factor: float = DEFAULT_FACTOR
    interval: float = DEFAULT_INTERVAL
    min_tasks: int = DEFAULT_MIN_TASKS
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _since: float | None = None

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"the straggler factor must be > 1 (a move must gain something), got {self.factor}")
        if not self.interval > 0 or self.min_tasks < 1:
            raise ValueError(f"interval must be > 0 and min_tasks >= 1, got {self.interval} and {self.min_tasks}")

    def observe(self, worker: str, busy: float, tasks: int) -> None:
        """``worker``'s totals so far: seconds its tasks ran, and how many ran."""
        w = self._workers.setdefault(worker, _Worker())
        if tasks < w.tasks:  # (cannot happen: totals only grow; a replaced process starts a new record)
            self._workers[worker] = w = _Worker()
        w.busy, w.tasks = float(busy), int(tasks)

    def known(self) -> list[str]:
        """The workers that reported."""
        return list(self._workers)

    def describe(self, src: str, dst: str) -> str:
        """Why an executor moves from ``src`` to ``dst`` (for the log)."""
        a, b = self._workers[src].per_task, self._workers[dst].per_task
        assert a is not None and b is not None
        return f"a task takes {a * 1e3:.1f} ms on {src}, {b * 1e3:.1f} ms on {dst}"

    def forget(self, worker: str) -> None:
        """``worker`` is gone (lost, or retired)."""
        self._workers.pop(worker, None)

    def restart(self, now: float) -> None:
        """Measure anew from ``now`` (after moves made by others, a recovery or a scale: the
        counts the last measure saw are stale)."""
        self._since = now
        for w in self._workers.values():
            w.base_busy, w.base_tasks = w.busy, w.tasks

    def decide(self, now: float, executors: dict[str, int]) -> tuple[str, str] | None:
        """``(from, to)`` for one executor to move, or None. ``executors``: how many each live
        worker holds now (those that may take part)."""
        if self._since is None:
            self.restart(now)
            return None
        if now - self._since < self.interval:
            return None
        for ident, n in executors.items():
            w = self._workers.get(ident)
            ran = 0 if w is None else w.tasks - w.base_tasks
            if w is not None and ran >= self.min_tasks:
                w.per_task = (w.busy - w.base_busy) / ran
            elif n > 0:
                return None  # not measured enough yet: wait (the measure goes on)
        self.restart(now)
        speed = {ident: w.per_task for ident in executors
                 if (w := self._workers.get(ident)) is not None and w.per_task is not None}
        rounds = {ident: executors[ident] * t for ident, t in speed.items() if executors[ident] > 0}
        if len(speed) < 2 or not rounds:
            return None
        src = max(rounds, key=lambda i: rounds[i])
        longest = rounds[src]
        best: tuple[float, str] | None = None
        for dst in speed:
            if dst == src:
                continue
            after = dict(rounds)
            after[src] = (executors[src] - 1) * speed[src]
            after[dst] = (executors[dst] + 1) * speed[dst]
            worst = max(after.values())
            if best is None or worst < best[0]:
                best = (worst, dst)
        if best is None or best[0] * self.factor > longest:
            return None
        return src, best[1]


def from_options(options: dict[str, Any]) -> StragglerRelief | None:
    """The job's straggler relief: ``straggler_relief`` None or False (off), True (the default
    factor) or a factor > 1; ``straggler_interval`` and ``straggler_min_tasks`` as above. Raises
    ValueError (or TypeError) for a bad setting."""
    relief = options.get("straggler_relief")
    if relief is None or relief is False:
        return None
    return StragglerRelief(DEFAULT_FACTOR if relief is True else float(relief),
                           float(options.get("straggler_interval", DEFAULT_INTERVAL)),
                           int(options.get("straggler_min_tasks", DEFAULT_MIN_TASKS)))
