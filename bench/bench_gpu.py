"""The GPU kernels against the CPU kernels, side by side in one run (needs an NVIDIA GPU).

* **MLR SGD** (apps/mlr_cuda.py): one epoch of Fashion-MNIST (60,000 rows, batches of 32) by the
  CPU kernel (one thread) and by the GPU kernel (one block), kernel alone, best of ``--repeats``;
  then whole jobs, ``litz launch apps/mlr.py`` with ``--device cpu`` and ``--device cuda``
  (2 workers, 1 server, 8 executors), seconds per epoch after the first.
* **NN-Descent join** (apps/nndescent_cuda.py): one executor's round on Fashion-MNIST (a quarter
  of the points) from the same initial lists, CPU join against GPU distances + CPU join; then
  ``python bench/bench_nndescent.py --gpu`` times whole jobs.

Compilation is excluded (every kernel runs once first). Without a GPU the script says so and exits 2.

Run: ``python bench/bench_gpu.py [--repeats 3] [--no-jobs]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

import litz
from apps import gpu, mlr, mlr_cuda, nndescent, nndescent_cuda
from apps import mlr_kernels as mk
from apps import nndescent_kernels as nk


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def mlr_kernels(repeats: int) -> None:
    X, y = mlr.load_data(16)[:2]
    X, y = np.ascontiguousarray(X), np.ascontiguousarray(y)
    rows = np.random.default_rng(0).permutation(len(y)).astype(np.int64)
    on_gpu = mlr_cuda.DeviceRows(X, y)
    W = np.zeros((X.shape[1] + 1, 10), np.float32)
    mk.sgd_steps(W.copy(), X, y, rows[:64], 32, 0.2, 1e-4)
    mlr_cuda.sgd_steps(W.copy(), on_gpu, rows[:64], 32, 0.2, 1e-4)
    cpu = best(lambda: mk.sgd_steps(W.copy(), X, y, rows, 32, 0.2, 1e-4), repeats)
    dev = best(lambda: mlr_cuda.sgd_steps(W.copy(), on_gpu, rows, 32, 0.2, 1e-4), repeats)
    print(f"MLR SGD, one epoch (60,000 rows, batch 32): CPU kernel {cpu * 1e3:.1f} ms, GPU kernel {dev * 1e3:.1f} ms, "
          f"CPU / GPU {cpu / dev:.2f}")


def mlr_jobs(repeats: int) -> None:
    per_epoch: dict[str, list[float]] = {"cpu": [], "cuda": []}
    accuracy: dict[str, float] = {}
    for _ in range(repeats):  # interleaved: the machine may be shared
        for device in per_epoch:
            app = mlr.make_app(["--quiet", "--epochs", "4", "--device", device])
            out = litz.run(app, workers=2, servers=1).value
            assert out["devices"] == [device], out["devices"]
            per_epoch[device].append(statistics.median(h["seconds"] for h in out["history"][1:]))
            accuracy[device] = out["test_accuracy"]
    cpu, dev = min(per_epoch["cpu"]), min(per_epoch["cuda"])
    print(f"MLR job, s/epoch after the first: --device cpu {cpu:.3f} (test accuracy {accuracy['cpu']:.4f}), "
          f"--device cuda {dev:.3f} (test accuracy {accuracy['cuda']:.4f}), cpu / cuda {cpu / dev:.2f}")


def nndescent_round(repeats: int) -> None:
    cfg = {"data": "fashion-mnist", "points": None, "dim": 0, "centers": 0, "data_seed": 0, "seed": 0, "order": True}
    x = np.ascontiguousarray(nndescent.ordered_points(cfg))
    n, k = len(x), 15
    everyone = np.arange(n, dtype=np.int64)
    G = nk.empty_lists(n, k)
    blocks, deltas, _ = nndescent._initial_lists(x, everyone, k, 0, nndescent._trees(x, 0, 8, 30), nndescent.BLOCK)
    for b, d in zip(blocks, deltas, strict=True):
        rows = G[b * nndescent.BLOCK:(b + 1) * nndescent.BLOCK]
        nk.merge_lists(rows, d[:len(rows)], k)
    owned = everyone[: n // 4]
    for distances in (None, nndescent_cuda.join_distances):  # compile both
        nk.nnd_round(x, G.copy(), owned[:100], k, k, 0, 0, True, nndescent.BLOCK, distances)
    cpu = best(lambda: nk.nnd_round(x, G.copy(), owned, k, k, 0, 0, True, nndescent.BLOCK), repeats)
    dev = best(lambda: nk.nnd_round(x, G.copy(), owned, k, k, 0, 0, True, nndescent.BLOCK,
                                    nndescent_cuda.join_distances), repeats)
    print(f"NN-Descent round 1, one executor of 4 on Fashion-MNIST: CPU {cpu:.3f} s, GPU distances + CPU join "
          f"{dev:.3f} s, CPU / GPU {cpu / dev:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-jobs", action="store_true", help="kernels only, no whole jobs")
    args = ap.parse_args()
    if not gpu.available() or gpu.simulated():
        print("bench_gpu: no CUDA GPU here (numba.cuda.is_available() is False, or the simulator is on)",
              file=sys.stderr)
        sys.exit(2)
    mlr_kernels(args.repeats)
    nndescent_round(args.repeats)
    if not args.no_jobs:
        mlr_jobs(args.repeats)


if __name__ == "__main__":
    main()
