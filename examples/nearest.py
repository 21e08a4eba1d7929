"""Exact k nearest neighbours of a few queries: a custom ``litz.Combiner`` merging partial answers.

The points are split over the executors; each one finds, for every query, the ``k`` nearest of
*its* points and sends them as an update of the query's row. Table ``nearest`` holds per query
``[k distances | k ids]``, and its combiner keeps the ``k`` nearest distinct ids of the two lists it
merges. That merge is associative and commutative (and sending a list twice changes nothing), so
partial answers may meet in any order: in a worker's update log when two executors share a
process, or on the server. An executor keeps only its own share of the points (here it draws the
whole set from the seed and slices it, as a loader reads its part of a shared file), and the
driver reads one row per query at the end. NN-Descent (apps/nndescent.py) builds a whole kNN
graph with the same kind of combiner, compiled with Numba.

    python examples/nearest.py [--points 20000] [--queries 50] [--k 5]

Last line: ``agree with brute force: 50/50 queries``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import litz


def points(config: dict[str, Any], executor_id: int | None = None, num_executors: int = 1) -> np.ndarray:
    """All the points (``executor_id`` None), or one executor's share: every ``num_executors``-th
    point from ``executor_id`` on, so point ``i`` of the share has id ``executor_id + i * num_executors``."""
    rng = np.random.default_rng(config["seed"])
    data = rng.standard_normal((config["points"], config["dim"]))
    if executor_id is None:
        return data
    return data[executor_id::num_executors]


def queries(config: dict[str, Any]) -> np.ndarray:
    return np.random.default_rng(config["seed"] + 1).standard_normal((config["queries"], config["dim"]))


def keep_k_nearest(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Merge two rows ``[k distances | k ids]`` into the ``k`` nearest distinct ids (ties by id)."""
    k = len(a) // 2
    dist = np.concatenate([a[:k], b[:k]])
    ids = np.concatenate([a[k:], b[k:]])
    order = np.lexsort((ids, dist))
    dist, ids = dist[order], ids[order]
    first = np.ones(len(ids), bool)  # a point offered twice appears once
    seen: set[float] = set()
    for i, p in enumerate(ids):
        if p >= 0 and p in seen:
            first[i] = False
        seen.add(p)
    dist, ids = dist[first][:k], ids[first][:k]
    out = np.empty_like(a)
    out[:k] = np.inf
    out[k:] = -1.0
    out[:len(dist)], out[k:k + len(ids)] = dist, ids
    return out


def empty_row(key: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """No neighbour yet: distances +inf, ids -1 (the combiner's identity)."""
    k = shape[0] // 2
    return np.concatenate([np.full(k, np.inf), np.full(k, -1.0)]).astype(dtype)


class NearestExecutor(litz.Executor):
    def load_input(self) -> np.ndarray:
        return points(self.config, self.executor_id, self.num_executors)

    def run_task(self, args: Any) -> int:
        k, q = self.config["k"], queries(self.config)
        mine = self.input
        ids = np.arange(self.executor_id, self.config["points"], self.num_executors, dtype=np.float64)
        d2 = (q ** 2).sum(1)[:, None] - 2 * q @ mine.T + (mine ** 2).sum(1)[None, :]
        kk = min(k, len(ids))
        best = np.argpartition(d2, kk - 1, axis=1)[:, :kk]  # this executor's k nearest per query
        rows = np.tile(empty_row(None, (2 * k,), np.float64), (len(q), 1))
        rows[:, :kk] = np.take_along_axis(d2, best, 1)
        rows[:, k:k + kk] = ids[best]
        self.ps.update_many("nearest", range(len(q)), rows)
        return len(ids)


class NearestDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        self.left = self.num_executors
        for e in range(self.num_executors):
            self.dispatch_task(e)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.left -= 1
        if self.left:
            return
        k = self.config["k"]
        found = self.ps.get_many("nearest", range(self.config["queries"]))[:, k:].astype(np.int64)
        q, data = queries(self.config), points(self.config)
        d2 = (q ** 2).sum(1)[:, None] - 2 * q @ data.T + (data ** 2).sum(1)[None, :]
        exact = np.argsort(d2, axis=1, kind="stable")[:, :k]
        agree = int(sum(set(f) == set(e) for f, e in zip(found, exact, strict=True)))
        if not self.config["quiet"]:
            print(f"agree with brute force: {agree}/{len(q)} queries", flush=True)
        self.finish({"neighbours": found, "agree": agree})


def make_app(argv: list[str]) -> litz.App:
    ap = argparse.ArgumentParser(prog="litz launch examples/nearest.py", description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    for name in ("points", "queries", "dim", "k"):
        if getattr(args, name) < 1:
            raise litz.ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.k > args.points:
        raise litz.ConfigError(f"--k {args.k} exceeds --points {args.points}")
    table = litz.Table("nearest", shape=(2 * args.k,), dtype="float64", num_rows=args.queries, init=empty_row,
                       combiner=litz.Combiner.of(keep_k_nearest, "keep-k-nearest"))
    return litz.App(NearestDriver, NearestExecutor, tables=[table], num_executors=8, name="nearest",
                    config=vars(args))


if __name__ == "__main__":
    litz.run(make_app(sys.argv[1:]), workers=2, servers=1)
