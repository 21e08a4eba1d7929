"""What CURVE (authentication + encryption of every message) costs: the same jobs with and without a job secret.

Runs side by side, alternating plain and secured runs so that drift (cache warm-up, CPU
frequency, other load) hits both alike, and reports medians and the ratio secured / plain:

* empty micro-tasks per second through master -> worker -> master (the per-message cost);
* ``ps.get`` + ``ps.update`` pairs per second per worker (many small messages to a server);
* MLR on Fashion-MNIST (``apps.mlr``): seconds per epoch after the first (bulk array traffic);
* the transport alone, two endpoints in one process: small-message round trips per second and
  one-way bandwidth of 4 MB array messages (what encryption costs per message and per byte).

"Plain" endpoints (no secret) are private Unix-domain sockets; CURVE runs over TCP. Two last rows
compare the private sockets with plain loopback TCP (what endpoints without a secret used
before they became private; any local user could reach them), the same messages through raw
sockets made by ``make_socket``.

Run: ``python bench/bench_security.py [--repeats 3] [--tasks 20000] [--epochs 4] [--workers 2]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # apps/ from a checkout

import bench_microtasks as micro  # noqa: E402 - the bench folder is on sys.path when run as a script
import numpy as np  # noqa: E402
import zmq  # noqa: E402

import litz  # noqa: E402
from litz.runtime import protocol  # noqa: E402
from litz.runtime.etcd_server import LocalEtcd  # noqa: E402
from litz.runtime.protocol import Message  # noqa: E402
from litz.runtime.security import generate_secret_file, load_secret  # noqa: E402
from litz.runtime.transport import Endpoint, make_socket  # noqa: E402


class LoopbackTCP:
    """A plain loopback-TCP mailbox with the endpoint's send/recv (no CURVE, not private): the
    baseline the private sockets replaced, for comparison only."""

    def __init__(self, ident: str) -> None:
        ctx = zmq.Context.instance()
        self.ident, self.router = ident, make_socket(ctx, zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.dealer = make_socket(ctx, zmq.DEALER, identity=ident)

    def connect(self, peer: str, address: str) -> None:
        self.dealer.connect(address)

    def send(self, peer: str, type_name: str, **fields: object) -> None:
        self.dealer.send_multipart(protocol.encode(type_name, **fields), copy=False)

    def recv(self) -> Message:
        frames = self.router.recv_multipart(copy=False)
        return protocol.decode(frames[1:], frames[0].bytes.decode())

    def close(self) -> None:
        self.dealer.close(linger=1000)
        self.router.close(linger=0)


TCP = "loopback TCP"  # a pseudo-secret: the raw TCP baseline instead of endpoints


def _pair(secret: str | None) -> tuple[Endpoint | LoopbackTCP, Endpoint | LoopbackTCP]:
    if secret == TCP:
        a, b = LoopbackTCP("a"), LoopbackTCP("b")
    else:
        key = load_secret(secret) if secret else None
        a, b = Endpoint("a", secret=key), Endpoint("b", secret=key)
    a.connect("b", b.address)
    b.connect("a", a.address)
    return a, b


def roundtrip_rate(n: int, secret: str | None) -> float:
    a, b = _pair(secret)
    try:
        for rounds in (100, n):  # the first 100 connect and warm up
            t0 = time.perf_counter()
            for i in range(rounds):
                a.send("b", "stats_request", rid=i)
                b.recv()
                b.send("a", "stats_request", rid=i)
                a.recv()
        return n / (time.perf_counter() - t0)
    finally:
        a.close()
        b.close()


def bandwidth(n: int, secret: str | None) -> float:
    """MB/s of 4 MB float32 arrays sent one way (a get_reply carrying one array)."""
    a, b = _pair(secret)
    array = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    try:
        a.send("b", "get_reply", rid=0, values=[array], errors=[None])
        b.recv()
        t0 = time.perf_counter()
        for i in range(n):
            a.send("b", "get_reply", rid=i, values=[array], errors=[None])
        for _ in range(n):
            b.recv()
        return n * array.nbytes / 1e6 / (time.perf_counter() - t0)
    finally:
        a.close()
        b.close()


def empty_rate(workers: int, tasks: int, etcd: str, secret: str | None) -> float:
    app = litz.App(micro.EmptyDriver, micro.EmptyExecutor, tables=[litz.Table("p", (4,), "float32", num_rows=16)],
                   num_executors=4 * workers, config={"tasks": tasks, "inflight": 16 * workers})
    res = litz.run(app, workers=workers, servers=1, etcd=etcd, secret_file=secret)
    return tasks / res.value


def ps_rate(workers: int, tasks: int, ops: int, etcd: str, secret: str | None) -> float:
    table = litz.Table("p", (4,), "float32", num_rows=100_000)
    app = litz.App(micro.PSDriver, micro.PSExecutor, tables=[table], num_executors=4 * workers,
                   config={"tasks": tasks, "inflight": 4 * workers, "ops": ops, "rows": 100_000})
    res = litz.run(app, workers=workers, servers=1, etcd=etcd, secret_file=secret)
    return tasks * ops / workers / res.value


def mlr_epoch(workers: int, epochs: int, etcd: str, secret: str | None) -> float:
    from apps.mlr import make_app

    res = litz.run(make_app(["--epochs", str(epochs), "--quiet"]), workers=workers, servers=1, etcd=etcd,
                   secret_file=secret)
    seconds = [h["seconds"] for h in res.value["history"][1:]]  # the first epoch warms up (Numba, caches)
    return statistics.median(seconds)


def compare(name: str, unit: str, repeats: int, measure: Callable[[str | None], float], secret: str,
            higher_is_better: bool, labels: tuple[str, str] = ("plain", "CURVE"), base: str | None = None) -> None:
    """Alternate ``measure(base)`` and ``measure(secret)``; print medians and their ratio."""
    plain: list[float] = []
    secured: list[float] = []
    for _ in range(repeats):
        plain.append(measure(base))
        secured.append(measure(secret))
    p, s = statistics.median(plain), statistics.median(secured)
    cost = (p / s - 1) if higher_is_better else (s / p - 1)
    a, b = labels
    print(f"{name:<34} {a} {p:12,.3f} {unit:<14} {b} {s:12,.3f} {unit:<14} "
          f"ratio {b}/{a} {s / p:5.3f}  ({cost:+.1%} cost)", flush=True)
    print(f"{'':<34} runs {a} {[round(x, 3) for x in plain]}  {b} {[round(x, 3) for x in secured]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=20000, help="empty micro-tasks per run")
    ap.add_argument("--ps-tasks", type=int, default=400)
    ap.add_argument("--ops", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=4, help="MLR epochs per run (0 = skip MLR)")
    args = ap.parse_args()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, LocalEtcd() as etcd:
        secret = str(generate_secret_file(Path(tmp) / "job.secret"))
        w = args.workers
        print(f"{w} workers, 1 server; medians of {args.repeats} alternating runs each", flush=True)
        compare("empty micro-tasks", "tasks/s", args.repeats,
                lambda s: empty_rate(w, args.tasks, etcd.url, s), secret, higher_is_better=True)
        compare("ps.get+ps.update per worker", "pairs/s", args.repeats,
                lambda s: ps_rate(w, args.ps_tasks, args.ops, etcd.url, s), secret, higher_is_better=True)
        compare("transport round trips", "trips/s", args.repeats,
                lambda s: roundtrip_rate(5000, s), secret, higher_is_better=True)
        compare("transport 4 MB arrays one way", "MB/s", args.repeats,
                lambda s: bandwidth(100, s), secret, higher_is_better=True)
        for name, unit, measure in (("round trips, private vs TCP", "trips/s", lambda s: roundtrip_rate(5000, s)),
                                    ("4 MB arrays, private vs TCP", "MB/s", lambda s: bandwidth(100, s))):
            compare(name, unit, args.repeats, measure, TCP, higher_is_better=True, labels=("private", "TCP"))
        if args.epochs >= 2:
            compare("MLR Fashion-MNIST epoch", "s/epoch", args.repeats,
                    lambda s: mlr_epoch(w, args.epochs, etcd.url, s), secret, higher_is_better=False)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
