"""Micro-task and parameter-server throughput of the runtime.

* empty micro-tasks per second through master -> worker -> master (several in flight);
* ``ps.get`` and ``ps.update`` operations per second per worker process (distinct keys per
  task, so every get is a real fetch from a server; updates merge in the log and are flushed);
* big reads: rounds in which every executor reads a whole 47 MB table (NN-Descent's graph at
  2**18 points) and updates half of it, with reads and updates cut into frames of at most 8 MB
  (the default ``frame_bytes``) and as one frame each, alternating, and with ``get_many`` into a
  fresh array or into a reused one (``out=``).

Run: ``python bench/bench_microtasks.py [--workers 2] [--tasks 20000] [--big-repeats 3]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import litz


class EmptyDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        self.t0 = time.perf_counter()
        self.left = self.config["tasks"]
        self.sent = 0
        for _ in range(self.config["inflight"]):
            self._send()

    def _send(self) -> None:
        if self.sent < self.config["tasks"]:
            self.dispatch_task(self.sent % self.num_executors, None)
            self.sent += 1

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.left -= 1
        if self.left == 0:
            self.finish(time.perf_counter() - self.t0)
        else:
            self._send()


class EmptyExecutor(litz.Executor):
    def run_task(self, args: object) -> None:
        return None


class PSExecutor(litz.Executor):
    """Each task reads and updates ``ops`` distinct rows (one at a time, as scalar calls)."""

    def run_task(self, args: dict) -> int:
        ops = self.config["ops"]
        base = args["i"] * ops
        rows = self.config["rows"]
        one = np.ones(4, np.float32)
        for k in range(ops):
            key = (base + k) % rows
            self.ps.get("p", key)
            self.ps.update("p", key, one)
        return ops


class PSDriver(EmptyDriver):
    def _send(self) -> None:
        if self.sent < self.config["tasks"]:
            self.dispatch_task(self.sent % self.num_executors, {"i": self.sent})
            self.sent += 1


BIG_ROWS, BIG_SHAPE = 4096, (64, 45)  # 47 MB of float32


class BigReadExecutor(litz.Executor):
    """Reads the whole table (into a reused buffer if ``reuse``), then updates every other row."""

    def run_task(self, args: dict) -> None:
        buf = None
        if self.config["reuse"]:
            buf = getattr(self, "buf", None)
            if buf is None:
                buf = self.buf = np.empty((BIG_ROWS, *BIG_SHAPE), np.float32)
        self.ps.get_many("g", range(BIG_ROWS), out=buf)
        mine = range(self.executor_id, BIG_ROWS, self.num_executors)
        self.ps.update_many("g", mine, np.ones((len(mine), *BIG_SHAPE), np.float32))


class BigReadDriver(litz.Driver):
    """Rounds of one task per executor; the result is the median round time."""

    def dispatch_initial_tasks(self) -> None:
        self.times: list[float] = []
        self._round()

    def _round(self) -> None:
        self.t0 = time.perf_counter()
        self.left = self.num_executors
        for e in range(self.num_executors):
            self.dispatch_task(e, None)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.left -= 1
        if self.left:
            return
        self.times.append(time.perf_counter() - self.t0)
        if len(self.times) == self.config["rounds"]:
            self.finish(self.result())
        else:
            self._round()

    def result(self) -> float:
        return float(np.median(self.times[1:]))  # the first round also compiles and warms up


def big_reads(workers: int, repeats: int) -> None:
    table = litz.Table("g", BIG_SHAPE, "float32", num_rows=BIG_ROWS)
    variants = {"frames of 8 MB": ({}, False), "frames of 8 MB, get_many(out=)": ({}, True),
                "one frame per read/update": ({"frame_bytes": 1 << 40}, False)}
    got: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (options, reuse) in variants.items():
            app = litz.App(BigReadDriver, BigReadExecutor, tables=[table], num_executors=workers,
                           config={"rounds": 11, "reuse": reuse})
            got[name].append(litz.run(app, workers=workers, servers=1, options=options).value)
    base = float(np.median(got["one frame per read/update"]))
    for name, times in got.items():
        med = float(np.median(times))
        print(f"big reads, {name:<32} median round {med:.3f} s ({base / med:.2f}x one frame; "
              f"runs {', '.join(f'{t:.3f}' for t in times)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=20000)
    ap.add_argument("--ps-tasks", type=int, default=400)
    ap.add_argument("--ops", type=int, default=50)
    ap.add_argument("--big-repeats", type=int, default=3, help="runs of each big-read variant (0: skip)")
    args = ap.parse_args()

    table = litz.Table("p", (4,), "float32", num_rows=100_000)
    empty = litz.App(EmptyDriver, EmptyExecutor, tables=[table], num_executors=4 * args.workers,
                     config={"tasks": args.tasks, "inflight": 16 * args.workers})
    res = litz.run(empty, workers=args.workers, servers=1)
    rate = args.tasks / res.value
    print(f"empty micro-tasks: {rate:,.0f} tasks/s through master->worker->master "
          f"({args.workers} workers, {16 * args.workers} in flight, {args.tasks} tasks in {res.value:.2f} s)")

    ps = litz.App(PSDriver, PSExecutor, tables=[table], num_executors=4 * args.workers,
                  config={"tasks": args.ps_tasks, "inflight": 4 * args.workers, "ops": args.ops,
                          "rows": 100_000})
    res = litz.run(ps, workers=args.workers, servers=1)
    ops = args.ps_tasks * args.ops
    per_worker = ops / args.workers / res.value
    print(f"ps.get + ps.update: {per_worker:,.0f} get+update pairs/s per worker process "
          f"({ops} of each over {args.workers} workers in {res.value:.2f} s; "
          f"messages sent by workers: {res.total('messages_sent', 'worker')})")
    if args.big_repeats:
        big_reads(args.workers, args.big_repeats)


if __name__ == "__main__":
    main()
