"""Straggler relief against none, side by side (``python bench/bench_stragglers.py``).

A bulk-synchronous job: every iteration runs one task on each executor and waits for all of
them (as an SSP driver with staleness 0 does). One worker is a straggler, a host busy with
another job, modelled by its tasks taking ``--slow`` times as long: a task sleeps ``--task-ms``
on the other workers and ``--slow`` times that on w0 (sleeping, so that the 2 cores of this
machine do not decide who is slow). Without relief every iteration waits for w0's share; with
``straggler_relief`` the master moves executors off w0 until the workers' rounds even out.
The two run alternately (``--repeats`` each) and the ratio of the median job times is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_microtasks as micro  # the bench folder is on sys.path when run as a script
import numpy as np

import litz


class BSPDriver(micro.BigReadDriver):
    """``rounds`` rounds of one task per executor, each once the last is done; the result is the
    time from the first task to the last."""

    def dispatch_initial_tasks(self) -> None:
        self.began = time.perf_counter()
        super().dispatch_initial_tasks()

    def result(self) -> float:
        return time.perf_counter() - self.began


class BusyHostExecutor(litz.Executor):
    def run_task(self, args: None) -> None:
        with open("/proc/self/comm") as f:
            slow = f.read().strip() == "litz-w0"
        time.sleep(self.config["task_s"] * (self.config["slow"] if slow else 1.0))
        self.ps.update_many("t", [self.executor_id], np.ones((1, 1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--executors", type=int, default=8)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--task-ms", type=float, default=2.0)
    p.add_argument("--slow", type=float, default=4.0, help="how many times longer a task takes on w0")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    app = litz.App(BSPDriver, BusyHostExecutor, tables=[litz.Table("t", (1,), "float64")],
                   num_executors=args.executors,
                   config={"rounds": args.iterations, "task_s": args.task_ms / 1e3, "slow": args.slow})
    times: dict[str, list[float]] = {"off": [], "on": []}
    moves: list[int] = []
    for _ in range(args.repeats):  # timed by the driver: from its first task to its last
        for mode in ("off", "on"):
            options = {"straggler_relief": True, "straggler_interval": 0.5} if mode == "on" else {}
            res = litz.run(app, workers=args.workers, servers=1, options=options)
            times[mode].append(res.value)
            if mode == "on":
                moves.append(len(res.stats["master"]["straggler_moves"]))
            print(f"relief {mode:>3}: {res.value:6.2f} s for {args.iterations} iterations"
                  + (f" ({moves[-1]} executors moved)" if mode == "on" else ""), flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"median: {off:.2f} s without relief, {on:.2f} s with it: {off / on:.2f}x faster "
          f"({args.workers} workers, {args.executors} executors, w0 {args.slow:g}x slower)")


if __name__ == "__main__":
    main()
