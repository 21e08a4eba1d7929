"""Executor over-partitioning: MLR epoch time with 1, 2, 4, 8, 16 executors per worker, as a ratio to 1.

Same data, same clocks per epoch (each executor covers 1/T of its partition per task), so
k executors per worker means k times as many, k times smaller micro-tasks. Epoch time is the
median over epochs 2..N (epoch 1 includes warm-up), each configuration run ``--repeats``
times in interleaved order, best median taken. Printed as ratios measured in one run.

Run: ``python bench/bench_overpartition.py [--workers 2] [--epochs 5]``
"""

from __future__ import annotations

import argparse
import statistics

import litz
from apps import mlr


def epoch_time(workers: int, per_worker: int, epochs: int) -> tuple[float, float]:
    app = mlr.make_app(["--epochs", str(epochs), "--quiet"])
    res = litz.run(app, workers=workers, servers=1, num_executors=workers * per_worker)
    hist = res.value["history"]
    return statistics.median(h["seconds"] for h in hist[1:]), hist[-1]["test_accuracy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-worker", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    best: dict[int, float] = {}
    acc: dict[int, float] = {}
    for _ in range(args.repeats):
        for k in args.per_worker:
            t, a = epoch_time(args.workers, k, args.epochs)
            best[k] = min(best.get(k, t), t)
            acc[k] = a
    base = best[args.per_worker[0]]
    print(f"MLR, Fashion-MNIST, {args.workers} workers, 1 server; median epoch time over epochs 2..{args.epochs}")
    print(f"{'executors/worker':>17} {'s/epoch':>8} {'ratio':>6} {'test acc':>9}")
    for k in args.per_worker:
        print(f"{k:>17} {best[k]:8.3f} {best[k] / base:6.2f} {acc[k]:9.4f}")


if __name__ == "__main__":
    main()
