"""Dependent rounds without computation: what one round trip through the runtime costs, in time and CPU.

LDA on a small corpus (apps/lda.py on fortunes) is bound by its rounds: a round is dispatch,
a fetch of the block's rows, an update, its acknowledgement and the completion, and the next
round waits for all of it. This bench runs exactly that chain with no sampling: 2 executors
on 2 workers and 1 server, a ``BlockRotation`` of 2 blocks, each task reading its block
(``--keys`` rows of 229 × 20 int16, fortunes' shape at K = 20), changing it, writing the change
and the topic totals back, and returning a small array, as LDA's tasks do. It prints

* the time per round, and
* the CPU per task spent in each process and thread kind, read from ``/proc`` over the timed
  rounds (all threads of the master, the workers, the server, and their ZeroMQ I/O threads);

and, side by side, a bare pyzmq ping-pong between two processes (DEALER to ROUTER over
loopback TCP): its round trip, and its CPU per one-way message. A Litz task makes 6 messages
(tasks, get, reply, update, ack, done), so the difference is what the runtime's own code
adds per message.

Run: ``python bench/bench_rounds.py [--rounds 2000] [--keys 16] [--repeats 2]`` (Linux: reads /proc).

``--compare PATH`` measures this checkout and the Litz checkout at PATH (a ``git worktree`` of an
older commit, say) alternately, each run in a fresh process, and prints the mean CPU per task of
each process kind for both: on a shared host, only numbers taken side by side compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

import litz

K, CHUNK_WORDS = 20, 229  # fortunes at K = 20: 32 chunks of 229 words


def thread_cpu(pids: dict[int, str]) -> dict[tuple[str, str], float]:
    """CPU seconds so far per (process label, thread kind) of the given processes."""
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for pid, label in pids.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            kind = "main" if tid == str(pid) else "zmq I/O" if comm.startswith("ZMQbg/IO") else "other"
            out[(label, kind)] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def job_pids() -> dict[int, str]:
    """This process (the master) and the worker and server processes below it, labelled by role
    (their thread names are ``litz-<id>``; forked ones are its grandchildren, by the spawner)."""
    parent: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    pids = {os.getpid(): "master"}
    for pid in parent:
        up = parent[pid]
        while up not in (0, 1, os.getpid()):
            up = parent.get(up, 0)
        if up != os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith(("litz-w", "litz-s")):
            pids[pid] = "worker" if comm.startswith("litz-w") else "server"
    return pids


class RoundExecutor(litz.Executor):
    def run_task(self, args: dict[str, Any]) -> dict[str, Any]:
        n = self.config["keys"]
        keys = range(args["block"] * n, (args["block"] + 1) * n)
        rows = self.ps.get_many("wt", keys)
        before = rows.copy()
        rows[:, 0, 0] += 1
        rows[:, 1, 1] -= 1
        delta = rows - before
        moved = np.flatnonzero(delta.reshape(n, -1).any(axis=1))
        self.ps.update_many("wt", np.asarray(keys)[moved], delta[moved])
        self.ps.update("totals", 0, np.zeros(K, np.int64))
        return {"changed": int(len(moved)), "totals": np.zeros(K, np.int64)}


class RoundDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        self.rotation = litz.BlockRotation(2, 2, self.config["rounds"] + 1)
        self.totals = np.zeros(K, np.int64)
        self._go(self.rotation.start())

    def _go(self, assignments: list[tuple[int, int, int]]) -> None:
        for e, r, b in assignments:
            self.dispatch_task(e, {"round": r, "block": b, "totals": self.totals.copy()})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.totals += result.value["totals"]
        if result.args["round"] == 0 and not hasattr(self, "t0"):  # round 0 warms up; timing starts here
            self.pids = job_pids()
            self.cpu0, self.t0 = thread_cpu(self.pids), time.perf_counter()
        self._go(self.rotation.complete(result.executor_id, result.args["round"]))
        if self.rotation.finished():
            wall = time.perf_counter() - self.t0
            cpu1 = thread_cpu(self.pids)
            self.finish({"wall": wall, "cpu": {k: v - self.cpu0.get(k, 0.0) for k, v in cpu1.items()}})


def litz_rounds(rounds: int, keys: int) -> dict[str, Any]:
    app = litz.App(RoundDriver, RoundExecutor, num_executors=2, name="rounds",
                   tables=[litz.Table("wt", (CHUNK_WORDS, K), "int16", num_rows=2 * keys),
                           litz.Table("totals", (K,), "int64", num_rows=1)],
                   config={"rounds": rounds, "keys": keys})
    return litz.run(app, workers=2, servers=1).value


def _echo(port_q: Any, n: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port_q.put(router.bind_to_random_port("tcp://127.0.0.1"))
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    for _ in range(n):
        poller.poll(5000)
        router.send_multipart(router.recv_multipart())


def ping_pong(n: int) -> tuple[float, float]:
    """(round trip in seconds, CPU seconds per one-way message) of a bare pyzmq ping-pong."""
    spawn = mp.get_context("spawn")  # no fork: this process runs gRPC threads (etcd clients)
    q: Any = spawn.Queue()
    echo = spawn.Process(target=_echo, args=(q, n + 1))
    echo.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{q.get()}")
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    payload = b"x" * 100
    dealer.send(payload)
    poller.poll(5000)
    dealer.recv()
    pids = {os.getpid(): "a", echo.pid: "b"}
    c0, t0 = sum(thread_cpu(pids).values()), time.perf_counter()
    for _ in range(n):
        dealer.send(payload)
        poller.poll(5000)
        dealer.recv()
    wall, cpu = time.perf_counter() - t0, sum(thread_cpu(pids).values()) - c0
    echo.join()
    dealer.close(linger=0)
    ctx.term()
    return wall / n, cpu / (2 * n)


def per_task(rounds: int, keys: int) -> dict[str, float]:
    """One Litz run: milliseconds per round and µs of CPU per task by "process thread-kind" (and "total")."""
    out = litz_rounds(rounds, keys)
    tasks = 2 * rounds
    cpu: collections.Counter[str] = collections.Counter()
    for (label, kind), v in out["cpu"].items():
        cpu[f"{label} {kind}"] += v / tasks * 1e6
    return {"round ms": out["wall"] / rounds * 1e3, **cpu, "total": sum(cpu.values())}


def compare(other: str, rounds: int, keys: int, repeats: int) -> None:
    """Alternate runs of this checkout and ``other`` in fresh processes; print the means side by side."""
    here = str(Path(__file__).resolve().parent.parent)
    bench = str(Path(here) / "bench")  # this file, with the other checkout's litz
    runs: dict[str, list[dict[str, float]]] = {here: [], other: []}
    for rep in range(repeats):
        for root in (other, here) if rep % 2 else (here, other):
            code = (f"import json, sys; sys.path.insert(0, {root!r}); sys.path.insert(1, {bench!r}); "
                    f"import bench_rounds; print(json.dumps(bench_rounds.per_task({rounds}, {keys})))")
            proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": root}, cwd=root,
                                  capture_output=True, text=True, check=True)
            runs[root].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    names = sorted({k for r in runs.values() for x in r for k in x}, key=lambda k: (k != "round ms", k == "total", k))
    print(f"{repeats} alternating runs each, {rounds} rounds of 2 tasks, {keys} rows per task; medians "
          f"(CPU in µs per task), and the ratio of the medians and of the means")
    print(f"  {'':<18} {'this':>9} {Path(other).name:>12} {'this/other':>11} {'(means)':>8}")
    for name in names:
        a, b = ([x.get(name, 0.0) for x in runs[root]] for root in (here, other))
        ma, mb = statistics.median(a), statistics.median(b)
        ratio_means = statistics.mean(a) / statistics.mean(b) if statistics.mean(b) else float("nan")
        print(f"  {name:<18} {ma:9.2f} {mb:12.2f} {ma / mb if mb else float('nan'):11.2f} {ratio_means:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--keys", type=int, default=16, help="rows per block (fortunes at 32 chunks: 16)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compare", metavar="PATH", help="another Litz checkout, run alternately with this one")
    args = ap.parse_args()
    if args.compare:
        compare(str(Path(args.compare).resolve()), args.rounds, args.keys, args.repeats)
        return
    for rep in range(args.repeats):
        out = litz_rounds(args.rounds, args.keys)
        rtt, per_msg = ping_pong(args.rounds)
        tasks = 2 * args.rounds
        print(f"\nrun {rep + 1}: Litz, {args.rounds} dependent rounds of 2 tasks ({args.keys} rows each): "
              f"{out['wall'] / args.rounds * 1e3:.2f} ms per round")
        print("  CPU per task, µs (all tasks; each worker runs half of them):")
        by: collections.Counter[tuple[str, str]] = collections.Counter()
        for (label, kind), v in out["cpu"].items():
            by[(label, kind)] += v
        for (label, kind), v in sorted(by.items(), key=lambda kv: -kv[1]):
            if v > 0:
                print(f"    {label:<7} {kind:<8} {v / tasks * 1e6:8.1f}")
        total = sum(by.values()) / tasks
        print(f"    total            {total * 1e6:8.1f}")
        print(f"  bare pyzmq ping-pong: {rtt * 1e6:.0f} µs per round trip, {per_msg * 1e6:.0f} µs of CPU per message;"
              f" 6 messages = {6 * per_msg * 1e6:.0f} µs, {6 * per_msg / total:.0%} of Litz's CPU per task")


if __name__ == "__main__":
    main()
