"""NN-Descent k-NN graph, Fashion-MNIST (70,000 x 784), k = 15: Litz against pynndescent, in one run.

- **pynndescent** ``NNDescent(X, n_neighbors=k, metric="euclidean", random_state=0)`` with its
  defaults (RP-forest initialisation, ``delta`` 0.001, ``n_jobs`` = all cores), timed from the
  constructor call to its return (the graph is built there).
- **Litz** ``apps/nndescent.py``, 2 workers, 1 server, 4 executors: the driver's computation of
  the locality order of the points, plus the NN-Descent phase's own clock, from dispatching the
  initial lists to convergence, plus reading the graph back (cluster start-up and data loading,
  the executors' renumbered copies of the data included, are not counted; the job's wall time
  is printed too).
  Once with the d_max filter and once without (``--no-filter``): candidates sent, bytes sent by
  all processes, and time.

Every system runs ``--repeats`` times, interleaved, and its best time is kept (the machine may be shared).

Initial lists: 8 random-projection trees in all, over a 128-d projection of the data (pynndescent starts
from a forest too, in the full space), then random points for short lists.
Numba compilation is excluded: both run once on a small set first (pynndescent compiles ~30 s,
Litz's kernels come from Numba's on-disk cache). Recall of both against exact neighbours of the
same 1,000 random query points (ties at the k-th distance count as found). Ratios are
Litz time / pynndescent time.

With ``--gpu``, a third Litz configuration computes the join's distances on the GPU
(``--device cuda``, apps/nndescent_cuda.py), and its time is compared with the CPU join's.

Run: ``python bench/bench_nndescent.py [--points N] [--k 15] [--executors 4] [--repeats 2] [--no-peer] [--gpu]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import litz
from apps import nndescent as nd

#: Litz's configurations: label and extra options of apps/nndescent.py.
CONFIGS = {"filter": ("Litz, d_max filter", []), "no-filter": ("Litz, no filter", ["--no-filter"]),
           "gpu": ("Litz, d_max filter, GPU join", ["--device", "cuda"])}


def litz_run(points: int | None, k: int, executors: int, config: str) -> dict[str, Any]:
    argv = ["--data", "fashion-mnist", "--k", str(k), "--quiet"] + (["--points", str(points)] if points else [])
    res = litz.run(nd.make_app(argv + CONFIGS[config][1]), workers=2, servers=1, num_executors=executors)
    v = res.value
    return {"s": v["seconds"], "recall": v["recall"], "rounds": v["stats"]["rounds"],
            "sent": v["stats"]["candidates_sent"], "proposed": v["stats"]["candidates_proposed"],
            "MB": res.total("bytes_sent") / 1e6, "wall": res.elapsed}


def peer_run(x: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    from pynndescent import NNDescent

    t = time.perf_counter()
    index = NNDescent(x, n_neighbors=k + 1, metric="euclidean", random_state=0)
    seconds = time.perf_counter() - t
    ind = index.neighbor_graph[0]
    rows = [r[r != i][:k] for i, r in enumerate(ind)]  # its lists include the point itself
    return seconds, np.array([np.pad(r, (0, k - len(r)), constant_values=-1) for r in rows], np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=None, help="first N points (default all 70,000)")
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--executors", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="Litz runs per configuration (best time kept)")
    ap.add_argument("--no-peer", action="store_true", help="skip pynndescent")
    ap.add_argument("--gpu", action="store_true", help="also run Litz with the join's distances on the GPU")
    args = ap.parse_args()
    configs = ["filter", "no-filter"] + (["gpu"] if args.gpu else [])
    x = np.ascontiguousarray(nd.load_points({"data": "fashion-mnist", "points": args.points, "dim": 0,
                                             "centers": 0, "data_seed": 0}))
    queries = nd.query_sample(len(x), 1000, 0)
    print(f"Fashion-MNIST {x.shape[0]} x {x.shape[1]}, k={args.k}; warming up (compilation not timed)", flush=True)
    for config in configs[::2]:  # compiles the CPU kernels (and the GPU's)
        litz_run(2000, args.k, args.executors, config)
    rows = []
    peer: list[tuple[float, np.ndarray]] = []
    if not args.no_peer:
        peer_run(x[:2000], args.k)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(args.repeats):  # interleaved, best time of each: the machine may be shared
        if not args.no_peer:
            peer.append(peer_run(x, args.k))
        for config in configs:
            runs[config].append(litz_run(args.points, args.k, args.executors, config))
    if peer:
        s, ind = min(peer, key=lambda p: p[0])
        rows.append(("pynndescent (n_jobs=-1, RP-forest init)", s, nd.recall(x, ind, queries, args.k), {}))
    best = {c: min(runs[c], key=lambda r: r["s"]) for c in configs}
    for c in configs:
        rows.append((CONFIGS[c][0], best[c]["s"], best[c]["recall"], best[c]))
    print(f"{'':40s} {'seconds':>8s} {'recall':>7s} {'rounds':>6s} {'cand. sent':>12s} {'of':>12s} {'MB':>8s}")
    for name, s, rec, r in rows:
        extra = (f"{r['rounds']:6d} {r['sent']:12d} {r['proposed']:12d} {r['MB']:8.0f}   (job wall {r['wall']:.1f} s)"
                 if r else "")
        print(f"{name:40s} {s:8.2f} {rec:7.3f} {extra}")
    on, off = best["filter"], best["no-filter"]
    print(f"d_max filter: {1 - on['sent'] / off['sent']:.0%} fewer candidates sent, "
          f"{1 - on['MB'] / off['MB']:.0%} fewer bytes, {1 - on['s'] / off['s']:.0%} less time")
    if not args.no_peer:
        print(f"Litz (filter) / pynndescent time: {on['s'] / rows[0][1]:.2f}")
    if args.gpu:
        print(f"Litz GPU join / CPU join time: {best['gpu']['s'] / on['s']:.2f}")


if __name__ == "__main__":
    main()
