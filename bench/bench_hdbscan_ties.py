"""HDBSCAN on sets full of tied distances: Litz, ``hdbscan`` and ``fast_hdbscan`` against HDBSCAN*
from its definition (``tests/hdbscan_reference.py``: level sets of the minimum spanning tree, each
level's tied edges removed together, by brute force).

Mutual-reachability distances tie whenever an edge's weight is one endpoint's core distance. A
binary dendrogram orders tied merges arbitrarily, and cutting them one at a time can make a cluster
that is born and dies at the same lambda (zero stability), which excess of mass may select. Litz's
condensed tree cuts a level's tied edges together, as HDBSCAN* defines.

The sets: ``--sets`` random ones of 12–59 points on an integer grid in 1 or 2 dimensions (so with
repeated points and equal distances), ``min_samples`` 2–4, ``min_cluster_size`` 2–5; once as they are
and once with a jitter of 0.001 on every coordinate (no equal distances left, but core distances
still tie). Litz is given the exact kNN graph (all other points, sklearn) and runs in this process
(``apps.hdbscan.cluster_graph``: its spanning tree, condensed tree and selection, no runtime).
Printed: how many sets each gives exactly the reference's labels for (the same noise points and
the same clusters), and how many the two libraries agree on.

Run: ``python bench/bench_hdbscan_ties.py [--sets 300] [--seed 1]`` (about 10 seconds).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # apps/ and tests/ from a checkout

import numpy as np  # noqa: E402

from apps import hdbscan as hd  # noqa: E402
from tests.hdbscan_reference import all_other_points, level_set_hdbscan, same_partition  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # the libraries warn about tiny sets
    import fast_hdbscan

    for jitter in (0.0, 1e-3):
        rng = np.random.default_rng(args.seed)
        agree = {"Litz = HDBSCAN*": 0, "hdbscan = HDBSCAN*": 0, "fast_hdbscan = HDBSCAN*": 0,
                 "hdbscan = fast_hdbscan": 0}
        for _ in range(args.sets):
            n, dims = int(rng.integers(12, 60)), int(rng.integers(1, 3))
            x = rng.integers(0, int(rng.integers(3, 12)), size=(n, dims)).astype(np.float64)
            if jitter:
                x += rng.normal(0, jitter, x.shape)
            ms, mcs = int(rng.integers(2, 5)), int(rng.integers(2, 6))
            truth = level_set_hdbscan(x, ms, mcs)
            idx, dist = all_other_points(x)
            ours = hd.cluster_graph(idx, dist, ms, mcs)
            lib = hd.reference_hdbscan(x, ms, mcs)
            fast = fast_hdbscan.HDBSCAN(min_cluster_size=mcs, min_samples=ms).fit(x).labels_
            agree["Litz = HDBSCAN*"] += same_partition(ours, truth)
            agree["hdbscan = HDBSCAN*"] += same_partition(lib, truth)
            agree["fast_hdbscan = HDBSCAN*"] += same_partition(fast, truth)
            agree["hdbscan = fast_hdbscan"] += same_partition(lib, fast)
        print(f"{args.sets} sets, jitter {jitter:g}: " + ", ".join(f"{k} {v}" for k, v in agree.items()),
              flush=True)


if __name__ == "__main__":
    main()
