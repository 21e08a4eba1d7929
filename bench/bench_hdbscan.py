"""HDBSCAN: Litz against the ``hdbscan`` library and ``fast_hdbscan``, side by side in one run.

Two parts (each can be skipped):

- **speed** (``--sizes``, exponents of 2; default 14..20): 10 Gaussian blobs in 10-d (``apps/hdbscan.py``'s
  ``blobs``), min_cluster_size 50, min_samples 10, Litz's k 15 (``--k-speed``). Per size:

  - **Litz**: ``apps/hdbscan.py`` through ``litz.run``, ``--workers`` workers (default 2), ``--servers``
    servers (default 1), ``--executors-per-worker`` (default 4), ``--mst boruvka`` (and ``kruskal`` with
    ``--both-msts``). Time: the driver's seconds from its first dispatch to the labels (NN-Descent, core
    distances, MST, tree). Excluded: process start-up and Numba compilation. A warm-up job runs first;
    every kernel is ``cache=True`` and executors compile (or load) theirs in ``setup`` before their
    first task. The whole job wall time is printed too. Several values of these three options (each
    one value for all layouts or one per layout) time Litz in each layout beside one run of each
    peer: how far scaling out takes it on a host with the cores for it. ``--rounds`` prints each
    job's progress (NN-Descent's rounds); ``--hdbscan-limit -1`` skips hdbscan, ``--no-fast-hdbscan``
    fast_hdbscan.
  - **hdbscan** ``HDBSCAN(min_cluster_size=50, min_samples=10)``, its defaults (``algorithm='best'``:
    Borůvka on a KD-tree, ``approx_min_span_tree=True``, ``core_dist_n_jobs=4``). A size is skipped
    when the previous one took more than ``--hdbscan-limit / 2.2`` seconds (the time roughly doubles
    and a bit), or ``/ 2.2**j`` for a size ``j`` steps above it, so that no run exceeds the limit (10
    minutes by default).
  - **fast_hdbscan** ``HDBSCAN(min_cluster_size=50, min_samples=10, metric='l2')``: ``'l2'`` is not
    ``'euclidean'``, so it takes its pynndescent kNN-graph path, the peer of our design
    (DESIGN.md §8). With ``--fast-euclidean`` also ``metric='euclidean'`` (KD-tree Borůvka). It is
    warmed up on a small set first (Numba compilation excluded).

  - **pynndescent** (``--pynndescent``): its kNN graph alone, ``NNDescent(x, n_neighbors=k + 1)`` (its
    lists include the point itself), all cores, against Litz's NN-Descent phase (the ``knn`` phase
    time). It tells how much of the 40x target a kNN graph as fast as the best single-machine one
    would leave for the rest.

  Ratios are peer seconds / Litz seconds. The FM index of Litz's labels is against hdbscan's labels
  where hdbscan ran, else against the ground truth (noise as one label).
- **accuracy** (``--thesis-dims``, default 1..10): the thesis set (``--thesis-points`` points, default
  100,000; 1,000 Gaussian clusters; 20% uniform noise) per dimension. Litz runs with k = 60
  (``--k-accuracy``). The spanning tree of a kNN graph misses edges of the exact one, and more
  so in more dimensions: with an *exact* kNN graph (scikit-learn) the FM index against hdbscan
  was 0.928 / 0.965 / 0.993 for k = 15 / 30 / 60 in 6-d, and 0.953 / 0.964 / 0.974 for
  k = 30 / 45 / 60 in 10-d (at 10,000 points in 2-d, k = 15 gave 0.962 and k = 30 0.996).
  With k = 30 (fast_hdbscan's choice for min_samples 10) Litz stayed below 0.95 in 6-10
  dimensions. FM of Litz (Borůvka, 2 workers)
  against the ``hdbscan`` library with its exact MST (``apps.hdbscan.reference_hdbscan``; why exact:
  its docstring), and the library's seconds.

Run: ``python bench/bench_hdbscan.py [--sizes 14 15 16] [--thesis-dims 1 2 3] [--thesis-points N]
[--no-speed] [--no-accuracy] [--workers 2 [8 ...]] [--servers 1 [2 ...]] [--executors-per-worker 4 [1 ...]]
[--rounds] [--no-fast-hdbscan] [--pynndescent]``
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
import warnings
from typing import Any

import numpy as np

import litz
from apps import hdbscan as hd

MCS, MS = 50, 10


Layout = tuple[int, int, int]  # workers, servers, executors per worker


def litz_job(argv: list[str], layout: Layout, k: int, verbose: bool = False) -> dict[str, Any]:
    """One Litz job returning labels: the driver's seconds, the job's wall time, the labels. Quiet
    unless ``verbose`` (then the app prints its progress: NN-Descent's rounds, Borůvka's)."""
    workers, servers, per_worker = layout
    res = litz.run(hd.make_app([*argv, "--reference", "none", "--return-labels", *([] if verbose else ["--quiet"]),
                                "--min-cluster-size", str(MCS), "--min-samples", str(MS), "--k", str(k)]),
                   workers=workers, servers=servers, num_executors=per_worker * workers)
    return {**res.value, "job_seconds": res.elapsed}


def layout_name(layout: Layout) -> str:
    workers, servers, per_worker = layout
    return (f"{workers} worker{'s' * (workers != 1)} of {per_worker} executor{'s' * (per_worker != 1)}, "
            f"{servers} server{'s' * (servers != 1)}")


def timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def hdbscan_default(x: np.ndarray) -> np.ndarray:
    import hdbscan

    return hdbscan.HDBSCAN(min_cluster_size=MCS, min_samples=MS).fit(x).labels_


def fast_hdbscan_labels(x: np.ndarray, metric: str) -> np.ndarray:
    import fast_hdbscan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fast_hdbscan.HDBSCAN(min_cluster_size=MCS, min_samples=MS, metric=metric).fit(x).labels_


def pynndescent_graph(x: np.ndarray, k: int) -> None:
    from pynndescent import NNDescent

    NNDescent(x, n_neighbors=k + 1, random_state=0).neighbor_graph  # noqa: B018 (built by the constructor)


def speed(sizes: list[int], layouts: list[Layout], k: int, both_msts: bool, fast_euclidean: bool,
          hdbscan_limit: float, pynnd: bool = False, rounds: bool = False, no_fast: bool = False) -> None:
    """Per size: Litz in every layout and MST, then the peers once, then the ratios."""
    msts = ["boruvka", "kruskal"] if both_msts else ["boruvka"]
    metrics = [] if no_fast else ["l2", "euclidean"] if fast_euclidean else ["l2"]
    warm_x, _ = hd.gaussian_mixture(3000, 10, 10, seed=1)
    for metric in metrics:
        fast_hdbscan_labels(warm_x, metric)
    if pynnd:
        pynndescent_graph(warm_x, k)
    for layout in layouts:
        for mst in msts:
            litz_job(["--points", "3000", "--mst", mst], layout, k)
    print(f"speed: 10 blobs in 10-d, min_cluster_size {MCS}, min_samples {MS}; Litz k={k}; "
          f"compile time excluded (warm-up first); {os.cpu_count()} CPUs", flush=True)
    last_hdbscan, last_e = 0.0, None
    for e in sizes:
        n = 2 ** e
        x, truth = hd.gaussian_mixture(n, 10, 10, seed=0)
        print(f"{n} points:", flush=True)
        runs: dict[tuple[int, Layout, str], dict[str, Any]] = {}  # by position: a layout given twice is run twice
        for at, layout in enumerate(layouts):
            for mst in msts:
                ours = runs[at, layout, mst] = litz_job(["--points", str(n), "--mst", mst], layout, k, rounds)
                print(f"  litz, {layout_name(layout)}, {mst}: {ours['seconds']:.2f} s "
                      f"(job wall {ours['job_seconds']:.1f} s); phases: "
                      + ", ".join(f"{name} {v:.2f} s" for name, v in ours["times"].items())
                      + f"; {ours['nnd_rounds']} NN-Descent rounds, {ours.get('boruvka_rounds', '-')} Borůvka rounds, "
                      f"{ours['clusters']} clusters", flush=True)
        ref, t_h = (None, float("nan"))
        # its time roughly doubles per size, so a size 2**e after 2**last_e takes 2.2**(e - last_e) times as long
        if last_hdbscan * 2.2 ** (1 if last_e is None else max(e - last_e, 1)) <= hdbscan_limit:
            # said before the fit: a run stopped during it (a call's time limit) still tells how long it ran
            print(f"  hdbscan: fit started {time.strftime('%H:%M:%S')}", flush=True)
            ref, t_h = timed(hdbscan_default, x)
            last_hdbscan, last_e = t_h, e
        t_f = {m: timed(fast_hdbscan_labels, x, m)[1] for m in metrics}
        print(("  hdbscan not run" if math.isnan(t_h) else f"  hdbscan {t_h:.2f} s")
              + "".join(f", fast_hdbscan ({m}) {t:.2f} s" for m, t in t_f.items()),
              flush=True)
        for (_, layout, mst), ours in runs.items():
            fm = hd.fowlkes_mallows(ref if ref is not None else truth, ours["labels"])
            vs_h = "hdbscan not run" if math.isnan(t_h) else f"{t_h / ours['seconds']:.1f}x hdbscan"
            print(f"  litz, {layout_name(layout)}, {mst}: {vs_h}"
                  + "".join(f", {t / ours['seconds']:.2f}x fast_hdbscan ({m})" for m, t in t_f.items())
                  + f"; FM {fm:.3f} against {'hdbscan' if ref is not None else 'the truth'}", flush=True)
        if pynnd:
            knn = min(ours["times"]["knn"] for ours in runs.values())
            t_p = timed(pynndescent_graph, x, k)[1]
            vs_hdbscan = "hdbscan not run" if math.isnan(t_h) else f"{t_h / t_p:.1f}x"
            print(f"  kNN graph alone: pynndescent {t_p:.2f} s, Litz NN-Descent {knn:.2f} s (fastest layout; "
                  f"{knn / t_p:.2f}x pynndescent's time); hdbscan / pynndescent's graph alone: {vs_hdbscan}",
                  flush=True)


def accuracy(dims: list[int], points: int, layout: Layout, k: int) -> None:
    print(f"accuracy: thesis set, {points} points, 1,000 clusters, 20% noise; FM of Litz (Borůvka, k={k}, "
          f"{layout_name(layout)}) against hdbscan with its exact MST", flush=True)
    print(f"{'dims':>4} {'FM':>6} {'litz':>9} {'hdbscan':>9} {'clusters litz/hdbscan':>22} {'noise litz/hdbscan':>19}",
          flush=True)
    for d in dims:
        argv = ["--data", "thesis", "--points", str(points), "--dims", str(d)]
        config = hd.make_app([*argv, "--reference", "none"]).config
        x, _ = hd.load_points(config)
        ref, t_h = timed(hd.reference_hdbscan, x, MS, MCS)
        ours = litz_job(argv, layout, k)
        fm = hd.fowlkes_mallows(ref, ours["labels"])
        print(f"{d:>4} {fm:>6.3f} {ours['seconds']:>7.2f} s {t_h:>7.2f} s {ours['clusters']:>11}/{ref.max() + 1:<10} "
              f"{ours['noise']:>9}/{(ref < 0).sum():<9}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=list(range(14, 21)), help="exponents of 2")
    p.add_argument("--thesis-dims", type=int, nargs="*", default=list(range(1, 11)))
    p.add_argument("--thesis-points", type=int, default=100_000)
    p.add_argument("--workers", type=int, nargs="+", default=[2],
                   help="worker processes; several values time Litz in each layout (scale-out), the peers once")
    p.add_argument("--servers", type=int, nargs="+", default=[1],
                   help="servers: one value for all layouts or one per layout")
    p.add_argument("--executors-per-worker", type=int, nargs="+", default=[4],
                   help="executors per worker: one value for all layouts or one per layout")
    p.add_argument("--rounds", action="store_true", help="print each Litz job's progress (NN-Descent's rounds)")
    p.add_argument("--k-speed", type=int, default=15, help="Litz's k in the speed part (blobs are separated)")
    p.add_argument("--k-accuracy", type=int, default=60,
                   help="Litz's k on the thesis set (30 keeps the FM index below 0.95 in 6-10 dimensions)")
    p.add_argument("--both-msts", action="store_true", help="time Litz with Kruskal too")
    p.add_argument("--fast-euclidean", action="store_true", help="also fast_hdbscan with metric='euclidean'")
    p.add_argument("--no-fast-hdbscan", action="store_true", help="leave fast_hdbscan out")
    p.add_argument("--pynndescent", action="store_true", help="also time pynndescent's kNN graph alone")
    p.add_argument("--hdbscan-limit", type=float, default=600.0,
                   help="hdbscan is skipped at a size once the last size it ran took more than LIMIT / 2.2 "
                        "seconds per doubling between them (its time roughly doubles per size); -1 skips it")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--no-accuracy", action="store_true")
    args = p.parse_args()
    columns = [args.workers, args.servers, args.executors_per_worker]
    count = max(map(len, columns))
    if any(len(c) not in (1, count) for c in columns):
        p.error(f"--workers, --servers and --executors-per-worker take one value each or one per layout ({count})")
    layouts = list(zip(*(c * count if len(c) == 1 else c for c in columns), strict=True))
    logging.getLogger("litz").setLevel(logging.WARNING)
    if not args.no_speed:
        speed(args.sizes, layouts, args.k_speed, args.both_msts, args.fast_euclidean, args.hdbscan_limit,
              args.pynndescent, args.rounds, args.no_fast_hdbscan)
    if not args.no_accuracy:
        accuracy(args.thesis_dims, args.thesis_points, layouts[0], args.k_accuracy)


if __name__ == "__main__":
    main()
