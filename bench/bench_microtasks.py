"""Micro-task and parameter-server throughput of the runtime.

* empty micro-tasks per second through master -> worker -> master (several in flight);
* ``ps.get`` and ``ps.update`` operations per second per worker process (distinct keys per
  task, so every get is a real fetch from a server; updates merge in the log and are flushed).

Run: ``python bench/bench_microtasks.py [--workers 2] [--tasks 20000]``
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=20000)
    ap.add_argument("--ps-tasks", type=int, default=400)
    ap.add_argument("--ops", type=int, default=50)
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


if __name__ == "__main__":
    main()
