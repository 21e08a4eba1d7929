"""MF by ALS, rank 10, MovieLens: seconds per iteration of Litz against its single-machine peers, in one run.

- **Litz**: ``apps/mf.py``, 2 workers, 1 server, 8 executors, in each layout asked for
  (``--layouts``; ``items``, the default, keeps the users' normal equations on the PS).
  Per iteration: the median over iterations 2..N of the driver's round times (iteration 1
  also includes start-up). We also print bytes and messages per iteration, all processes
  summed, from ``(run of N) - (run of 1)``. This is the measurement that decides the layout.
- **NumPy/SciPy**: ``apps.mf.NumpyALS``, the same math (biases, count-weighted L2, same
  initialization, same split) in one process: SciPy sparse products plus a batched
  ``np.linalg.solve``. Median of iterations 2..N; evaluation is not timed, although Litz's
  rounds include theirs.
- **Spark MLlib ALS** through ``pyspark``, ``local[2]``: rank 10, ``regParam`` = the same l2
  (Spark scales it by counts, as we do), on the same ratings centred on the same mean. There
  are no biases: MLlib has none, so its RMSE is that of a slightly different model. Per
  iteration: ``(fit(N) - fit(5)) / (N - 5)``, from the best fit of each length, which
  removes the fixed cost of a fit; ``fit(N) / N`` is printed too. One warm-up fit comes
  first. It runs with ``numBlocks`` 2 (best on 2 cores) and with the default 10.
  Without a JVM or pyspark, the output says so and the other rows still print.

Everything is warm before timing: Numba kernels come from the on-disk cache (a warm-up job
runs first) and the JVM has run one fit. Every configuration runs ``--repeats`` times,
interleaved, and the best of each timing is taken. Ratios divide by Litz's (items layout).

Run: ``python bench/bench_mf.py [--iterations 15] [--repeats 2] [--layouts items users] [--no-spark]``
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time
import warnings
from typing import Any

import numpy as np

import litz
from apps import mf
from apps.datasets import load_movielens
from apps.mf_kernels import warmup


def litz_run(layout: str, iterations: int, l2: float, workers: int) -> dict[str, float]:
    """s/iteration (median of rounds 2..N), RMSE, and per-iteration traffic of one layout."""
    base = litz.run(mf.make_app(["--iterations", "1", "--l2", str(l2), "--executors-own", layout, "--quiet"]),
                    workers=workers, servers=1)
    res = litz.run(mf.make_app(["--iterations", str(iterations), "--l2", str(l2), "--executors-own", layout,
                                "--quiet"]), workers=workers, servers=1)
    hist = res.value["history"]
    n = iterations - 1
    return {"s": statistics.median(h["seconds"] for h in hist[1:]), "rmse": res.value["test_rmse"],
            "all": sum(res.value["round_seconds"]) / iterations,
            "MB": (res.total("bytes_sent") - base.total("bytes_sent")) / n / 1e6,
            "msgs": (res.total("messages_sent") - base.total("messages_sent")) / n}


def numpy_run(iterations: int, l2: float) -> dict[str, float]:
    model = mf.NumpyALS(load_movielens(), 10, l2)
    times = []
    for _ in range(iterations):
        t = time.perf_counter()
        model.iterate()
        times.append(time.perf_counter() - t)
    return {"s": statistics.median(times[1:]), "all": sum(times) / iterations, "rmse": model.rmse()}


class Spark:
    """Spark MLlib ALS on ``local[2]`` with the training ratings cached as a DataFrame."""

    def __init__(self) -> None:
        warnings.filterwarnings("ignore", category=FutureWarning)  # pyspark warns about pandas 3
        from pyspark.ml.recommendation import ALS
        from pyspark.sql import SparkSession

        self.ALS = ALS
        self.spark = (SparkSession.builder.master("local[2]").appName("bench_mf")
                      .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                      .config("spark.sql.shuffle.partitions", "4").config("spark.driver.memory", "2g")
                      # ALS's RDD lineage grows with every iteration; serializing a task walks it
                      # recursively and overflowed the default 1 MB thread stack in 1 of 3 runs here
                      .config("spark.driver.extraJavaOptions", "-Xss64m")
                      .getOrCreate())
        self.spark.sparkContext.setLogLevel("ERROR")
        data = load_movielens()
        self.mu = mf.global_mean(data)
        self.train = self._frame(data.train_users, data.train_items, data.train_ratings).cache()
        self.test = self._frame(data.test_users, data.test_items, data.test_ratings).cache()
        self.train.count()
        self.test.count()

    def _frame(self, users: np.ndarray, items: np.ndarray, ratings: np.ndarray) -> Any:
        rows = zip(users.astype(int).tolist(), items.astype(int).tolist(), (ratings - self.mu).tolist(), strict=True)
        return self.spark.createDataFrame(list(rows), "user int, item int, rating double")

    def fit(self, iterations: int, l2: float, blocks: int) -> tuple[float, Any]:
        als = self.ALS(rank=10, maxIter=iterations, regParam=l2, userCol="user", itemCol="item", ratingCol="rating",
                       coldStartStrategy="nan", seed=0, numUserBlocks=blocks, numItemBlocks=blocks)
        t = time.perf_counter()
        model = als.fit(self.train)
        return time.perf_counter() - t, model

    def rmse(self, model: Any) -> float:
        pred = model.transform(self.test).select("rating", "prediction").collect()
        err = np.array([r["rating"] - (0.0 if r["prediction"] is None or np.isnan(r["prediction"])
                                       else r["prediction"]) for r in pred])
        return float(np.sqrt(np.mean(err**2)))

    def run(self, iterations: int, l2: float, blocks: int) -> dict[str, float]:
        short = min(5, iterations - 1)
        t_short, _ = self.fit(short, l2, blocks)
        t_long, model = self.fit(iterations, l2, blocks)
        return {"short": t_short, "long": t_long, "all": t_long / iterations, "rmse": self.rmse(model)}

    def stop(self) -> None:
        self.spark.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--l2", type=float, default=mf.DEFAULTS["l2"])
    ap.add_argument("--layouts", nargs="+", choices=("items", "users"), default=["items", "users"])
    ap.add_argument("--no-spark", action="store_true", help="skip Spark MLlib")
    args = ap.parse_args()
    if args.iterations < 7:
        ap.error("--iterations must be at least 7 (Spark's per-iteration time is fit(N) - fit(5))")
    logging.getLogger("py4j").setLevel(logging.ERROR)
    warmup()
    load_movielens()
    litz.run(mf.make_app(["--iterations", "2", "--quiet"]), workers=args.workers, servers=1)  # Numba cache, OS cache

    spark: Spark | None = None
    spark_error = ""
    if not args.no_spark:
        try:
            spark = Spark()
            spark.fit(5, args.l2, 2)  # JIT warm-up of the JVM
        except Exception as exc:  # no pyspark, no Java, a JVM that does not start: report and go on
            spark_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            spark = None

    best: dict[str, dict[str, float]] = {}

    def keep(name: str, r: dict[str, float]) -> None:
        """Best (smallest) of every timing over the repeats; the rest from the latest run."""
        old = best.setdefault(name, r)
        for key in ("s", "all", "short", "long"):
            if key in r:
                old[key] = min(old[key], r[key])
        for key in ("rmse", "MB", "msgs"):
            if key in r:
                old[key] = r[key]

    for _ in range(args.repeats):
        for layout in args.layouts:
            keep(f"Litz, {args.workers} workers, executors own {layout}", litz_run(layout, args.iterations, args.l2,
                                                                                   args.workers))
        keep("NumPy/SciPy, 1 process, same math", numpy_run(args.iterations, args.l2))
        if spark is not None:
            for blocks in (2, 10):
                try:
                    keep(f"Spark MLlib ALS local[2], numBlocks {blocks}", spark.run(args.iterations, args.l2, blocks))
                except Exception as exc:  # a failed fit is reported, it does not lose the other rows
                    spark_error += f"numBlocks {blocks}: {type(exc).__name__}: {str(exc).strip()[:200]}\n"
    if spark is not None:
        with contextlib.suppress(Exception):
            spark.stop()
    short = min(5, args.iterations - 1)
    for r in best.values():
        if "long" in r:  # Spark: the marginal cost of an iteration, from the best fit of each length
            r["s"] = (r["long"] - r["short"]) / (args.iterations - short)
            if r["s"] <= 0:  # fit(N) no slower than fit(5): noise swamped the difference; say so
                r["s"] = float("nan")

    data = load_movielens()
    ref_name = next(n for n in best if n.startswith("Litz"))
    ref = best[ref_name]["s"]
    print(f"MF ALS, rank 10, l2 {args.l2} (count-weighted), MovieLens {len(data.train_ratings):,} train / "
          f"{len(data.test_ratings):,} test ratings, {args.iterations} iterations, {os.cpu_count()} cores; "
          f"best of {args.repeats}")
    print(f"{'configuration':<46} {'s/iter':>8} {'ratio':>7} {'all/iter':>9} {'ratio':>7} {'test RMSE':>10} "
          f"{'MB/iter':>8} {'msgs/iter':>10}")
    ref_all = best[ref_name]["all"]
    for name, r in best.items():
        mb = f"{r['MB']:8.2f}" if "MB" in r else f"{'':>8}"
        msgs = f"{r['msgs']:10.0f}" if "msgs" in r else f"{'':>10}"
        print(f"{name:<46} {r['s']:8.4f} {r['s'] / ref:7.2f} {r['all']:9.4f} {r['all'] / ref_all:7.2f} "
              f"{r['rmse']:10.4f} {mb} {msgs}")
    print(f"s/iter: steady state (Litz, NumPy: median of iterations 2..N; Spark: (fit({args.iterations}) - "
          f"fit({short})) / {args.iterations - short}). all/iter: everything / N (Litz: all rounds, without "
          f"process start-up; NumPy: all iterations; Spark: fit({args.iterations}) / {args.iterations}). "
          f"ratio: divided by '{ref_name}'.\nSpark has no bias terms, so its RMSE is that of plain ALS on "
          f"the same centred ratings.")
    if args.no_spark:
        print("Spark MLlib: skipped (--no-spark)")
    elif spark_error:
        print(f"Spark MLlib: failed or not run here: {spark_error.strip()}")


if __name__ == "__main__":
    main()
