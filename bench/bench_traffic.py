"""Messages and bytes sent for the same MLR training, with and without the cache and the update log.

All processes' counters are summed (master, workers, servers). The process cache coalesces
the fetches of executors whose tasks carry the same version; the update log merges their
deltas before they leave the worker. Printed as ratios to the full configuration.

Run: ``python bench/bench_traffic.py [--workers 2] [--executors 16] [--epochs 2]``
"""

from __future__ import annotations

import argparse

import litz
from apps import mlr

CONFIGS = {
    "cache + update log": {},
    "no cache": {"cache": False},
    "no update log": {"update_log": False},
    "neither": {"cache": False, "update_log": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--executors", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for name, options in CONFIGS.items():
        app = mlr.make_app(["--epochs", str(args.epochs), "--quiet"])
        res = litz.run(app, workers=args.workers, servers=1, num_executors=args.executors, options=options)
        hist = res.value["history"]
        rows.append((name, res.total("messages_sent") / args.epochs, res.total("bytes_sent") / args.epochs,
                     sum(h["seconds"] for h in hist) / len(hist), hist[-1]["test_accuracy"]))
    base_m, base_b = rows[0][1], rows[0][2]
    print(f"MLR, Fashion-MNIST, {args.workers} workers, {args.executors} executors, 1 server; per epoch")
    print(f"{'configuration':>20} {'messages':>9} {'ratio':>6} {'MB':>8} {'ratio':>6} {'s/epoch':>8} {'test acc':>9}")
    for name, m, b, s, a in rows:
        print(f"{name:>20} {m:9.0f} {m / base_m:6.1f} {b / 1e6:8.1f} {b / base_b:6.1f} {s:8.3f} {a:9.4f}")


if __name__ == "__main__":
    main()
