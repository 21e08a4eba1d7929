"""The smallest Litz job: eight executors add their partitions into one parameter.

Shows the programming model (DESIGN.md §1) and nothing else: each executor loads a reloadable
input partition, one micro-task per executor reads the running sum and adds its partition's
total with an incremental update (the table's default ``add`` combiner), and the driver reads
the final value once every task has completed.

Run it either way (both start an embedded local cluster: a private etcd, 1 server, 2 workers):

    python examples/sum.py                # prints: sum 499500
    litz launch examples/sum.py           # the same, with the CLI's options (--workers, --executors...)
"""

from __future__ import annotations

from typing import Any

import numpy as np

import litz


class Counter(litz.Executor):
    def load_input(self) -> np.ndarray:  # reloadable: a pure function of the executor id
        return np.arange(self.executor_id, 1000, self.num_executors)

    def run_task(self, args: Any) -> float:
        before = self.ps.get("sum", 0)  # read through the worker's cache
        self.ps.update("sum", 0, np.array([self.input.sum()], np.float64))  # incremental: merged, never lost
        return float(before[0])


class SumDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        self.left = self.num_executors
        for e in range(self.num_executors):
            self.dispatch_task(e, {"round": 0})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.left -= 1
        if self.left == 0:  # every update is on the server before its task's completion arrives
            total = self.ps.get("sum", 0)
            print(f"sum {total[0]:.0f}", flush=True)
            self.finish(total)


app = litz.App(SumDriver, Counter, tables=[litz.Table("sum", shape=(1,), dtype="float64")],
               num_executors=8, name="sum")

if __name__ == "__main__":
    litz.run(app, workers=2, servers=1)
