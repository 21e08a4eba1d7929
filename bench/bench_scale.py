"""Elasticity of MLR: scale-out against the ideal, and scale-in latency (issue 3 benchmarks).

* Scale-out: MLR from 2 to 4 workers at ~30% of training, against static 2 and static 4
  workers, all in one run. Ideal = time until the command + static-4 time for the remaining
  epochs. (On a 2-core machine 4 workers are not faster than 2: the ratio to ideal is what
  measures the cost of the move.)
* Scale-in latency: from the scale command (4 -> 2 workers) to the exit of the last leaving
  process, and the master's own figure (command received -> goodbyes).

The command is issued when the driver says the epoch ended (a byte on a pipe): polling the job's
status every 10 ms from this process, as this bench did at first, took CPU from the master and etcd
and made the epochs before the switch a third slower than the static run's, which the ratio counted
as the move's cost.

Run: ``python bench/bench_scale.py [--epochs 40] [--executors 8]``
"""

from __future__ import annotations

import argparse
import os
import select
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import litz
from apps import mlr
from litz.cli import job_status, scale


def run_static(workers: int, epochs: int, executors: int) -> float:
    res = litz.run(mlr.make_app(["--epochs", str(epochs), "--quiet"]), workers=workers, num_executors=executors)
    return res.value["seconds"]


class TriggeredMLRDriver(mlr.MLRDriver):
    """MLR's driver, writing a byte to ``config["trigger_fd"]`` once epoch ``config["trigger_epoch"]``
    has ended (the driver runs in this process): the moment to scale, without polling."""

    _fired = False  # the byte was written

    def on_iteration_end(self, iteration: int, results: list[litz.TaskResult]) -> None:
        super().on_iteration_end(iteration, results)
        if len(self.history) == self.config["trigger_epoch"] and not self._fired:
            self._fired = True
            os.write(self.config["trigger_fd"], b"x")


def triggered(app: litz.App, epoch: int) -> tuple[int, int]:
    """Give ``app`` (MLR's) the driver that writes a byte when ``epoch`` ends: the pipe's ``(read end,
    write end)``; close the write end after the job."""
    trigger, fired = os.pipe()
    app.driver = TriggeredMLRDriver
    app.config.update(trigger_fd=fired, trigger_epoch=epoch)
    return trigger, fired


def wait_for_epoch(trigger: int, job: threading.Thread, epoch: int) -> None:
    """Block until the driver wrote its byte (then close ``trigger``); raise if the job ended first."""
    try:
        while not select.select([trigger], [], [], 0.5)[0]:
            if not job.is_alive():
                raise RuntimeError(f"the job ended before epoch {epoch}")
    finally:
        os.close(trigger)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (it may vanish between two reads)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:  # gone (FileNotFoundError, or ProcessLookupError mid-read)
        return False


def run_dynamic(start: int, target: int, at_epoch: int, epochs: int, executors: int) -> dict:
    job = f"bench-scale-{time.time_ns()}"
    out: dict[str, Any] = {}
    app = mlr.make_app(["--epochs", str(epochs), "--quiet"])
    trigger, fired = triggered(app, at_epoch)
    t = threading.Thread(target=lambda: out.update(res=litz.run(app, workers=start, num_executors=executors,
                                                                job=job)))
    t.start()
    wait_for_epoch(trigger, t, at_epoch)
    st = job_status(job)
    leaving = [p["pid"] for p in st["processes"] if p["role"] == "worker"][target:]
    issued = time.monotonic()
    scale(["--job", job, "--workers", str(target)])  # returns once accepted; then watch the processes
    while any(_running(pid) for pid in leaving):
        time.sleep(0.002)
    exited = time.monotonic() - issued
    t.join()
    os.close(fired)
    res = out["res"].value
    return {"total": res["seconds"], "exited": exited, "switch_epoch": at_epoch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--executors", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("LITZ_JOBS_DIR", tempfile.mkdtemp(prefix="litz-jobs-"))
    e = args.epochs
    t2 = run_static(2, e, args.executors)
    t4 = run_static(4, e, args.executors)
    at = max(1, round(0.3 * e))
    dyn = run_dynamic(2, 4, at, e, args.executors)
    switch_time = t2 * at / e
    ideal = switch_time + t4 * (e - at) / e
    print(f"MLR {e} epochs, {args.executors} executors: static 2 workers {t2:.2f} s, static 4 workers {t4:.2f} s")
    print(f"scale-out 2->4 at epoch {at}: {dyn['total']:.2f} s; ideal {ideal:.2f} s; ratio {dyn['total'] / ideal:.3f}")
    sin = run_dynamic(4, 2, at, e, args.executors)
    print(f"scale-in 4->2 at epoch {at}: command to exit of the last leaving process {sin['exited'] * 1e3:.0f} ms "
          f"(job total {sin['total']:.2f} s)")


if __name__ == "__main__":
    main()
