"""Scale-in with large executor state: effective transfer rate against loopback bandwidth (issue 3).

An application whose executors hold ``--state-mib`` MiB each (16 executors, 1.5 GiB in all by
default) runs on 4 workers; ``litz scale --workers 1`` then moves 12 executors (1.1 GiB) onto
the one that stays. Measured in the same run:

* the loopback bandwidth, as plain TCP between two processes moving the same number of bytes
  in chunks of one executor's state (the ceiling for any transfer on this machine);
* the scale-in latency, from the command to the exit of the last leaving process, and the
  effective rate = state bytes moved / that latency, as a fraction of the loopback figure.

Run: ``python bench/bench_state_transfer.py [--state-mib 96] [--executors 16] [--workers 4]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import litz
from litz.cli import job_status, scale


class BigStateExecutor(litz.Executor):
    """Holds a large array as state (moved with the executor); each task bumps one element."""

    def init_state(self) -> Any:
        return np.full(self.config["state_mib"] << 17, float(self.executor_id))  # float64: 2^17 per MiB

    def run_task(self, args: Any) -> Any:
        self.state[args["i"] % self.state.size] += 1.0
        time.sleep(0.002)
        return float(self.state[0])


class UntilStoppedDriver(litz.Driver):
    """Keeps every executor busy with tiny tasks until the file ``stop_file`` exists."""

    def dispatch_initial_tasks(self) -> None:
        self.count = 0
        self.inflight = 0
        for e in range(self.num_executors):
            self._send(e)

    def _send(self, e: int) -> None:
        if os.path.exists(self.config["stop_file"]):
            return
        self.inflight += 1
        self.count += 1
        self.dispatch_task(e, {"i": self.count})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.inflight -= 1
        if result.value < result.executor_id:  # the state travelled intact: element 0 holds the id
            raise AssertionError(f"executor {result.executor_id} lost its state")
        self._send(result.executor_id)
        if self.inflight == 0:
            self.finish(self.count)


def _sink(port_q: mp.Queue, total: int, chunk: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    while got < total:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()


def loopback_bandwidth(total: int, chunk: int) -> float:
    """Bytes per second of plain TCP over loopback, from this process to a child."""
    ctx = mp.get_context("spawn")  # no fork: etcd's gRPC threads run in this process
    q = ctx.Queue()
    child = ctx.Process(target=_sink, args=(q, total, chunk))
    child.start()
    port = q.get(timeout=10)
    data = np.ones(chunk // 8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        sent = 0
        while sent < total:
            s.sendall(memoryview(data).cast("B"))
            sent += chunk
        s.recv(1)
        elapsed = time.perf_counter() - t0
    child.join()
    return sent / elapsed


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def scale_in(state_mib: int, executors: int, workers: int) -> dict[str, float]:
    job = f"bench-state-{time.time_ns()}"
    stop = Path(tempfile.mkdtemp()) / "stop"
    app = litz.App(UntilStoppedDriver, BigStateExecutor, tables=[], num_executors=executors,
                   config={"state_mib": state_mib, "stop_file": str(stop)})
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["res"] = litz.run(app, workers=workers, servers=1, job=job, startup_timeout=120)
        except BaseException as exc:  # printed below
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    try:
        while True:
            try:
                st = job_status(job)
                if st["master"].get("phase") == "running" and st["master"].get("completed", 0) > 5 * executors:
                    break
            except litz.LitzError:
                pass
            if "error" in out:
                raise RuntimeError(out["error"])
            time.sleep(0.05)
        procs = [p for p in st["processes"] if p["role"] == "worker"]
        leaving = [p for p in procs if p["id"] != "w0"]
        moved = sum(len(p["executors"]) for p in leaving)
        issued = time.monotonic()
        assert scale(["--job", job, "--workers", "1"]) == 0  # returns once accepted
        while any(_alive(p["pid"]) for p in leaving):
            time.sleep(0.002)
        latency = time.monotonic() - issued
        while not (hist := job_status(job)["master"].get("scale_history")):
            time.sleep(0.1)
        master_s = hist[-1]["seconds"]
    finally:
        stop.touch()
        t.join()
    if "error" in out:
        raise RuntimeError(out["error"])
    return {"moved_bytes": moved * (state_mib << 20), "moved": moved, "latency": latency, "master_s": master_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=96, help="MiB of state per executor (default 96)")
    ap.add_argument("--executors", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("LITZ_JOBS_DIR", tempfile.mkdtemp(prefix="litz-jobs-"))
    total_gib = args.executors * args.state_mib / 1024
    res = scale_in(args.state_mib, args.executors, args.workers)
    bw = loopback_bandwidth(res["moved_bytes"], args.state_mib << 20)
    rate = res["moved_bytes"] / res["latency"]
    print(f"executor state {total_gib:.2f} GiB ({args.executors} x {args.state_mib} MiB) on {args.workers} workers")
    print(f"scale-in {args.workers} -> 1: {res['moved']} executors, {res['moved_bytes'] / 2**30:.2f} GiB moved")
    print(f"  command -> exit of the last leaving process: {res['latency']:.2f} s "
          f"(master: command received -> goodbyes {res['master_s']:.2f} s)")
    print(f"  effective transfer rate {rate / 2**20:.0f} MiB/s; loopback TCP in the same run "
          f"{bw / 2**20:.0f} MiB/s; ratio {rate / bw:.2f}")


if __name__ == "__main__":
    main()
