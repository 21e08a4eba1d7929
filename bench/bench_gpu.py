"""The GPU kernels against the CPU kernels, side by side in one run (needs an NVIDIA GPU).

* **MLR SGD** (apps/mlr_cuda.py): one epoch of Fashion-MNIST (60,000 rows, batches of 32) by the
  CPU kernel (one thread) and by the GPU kernel (one block), kernel alone, best of ``--repeats``;
  then whole jobs, ``litz launch apps/mlr.py`` with ``--device cpu`` and ``--device cuda``
  (2 workers, 1 server, 8 executors), seconds per epoch after the first.
* **NN-Descent join** (apps/nndescent_cuda.py): one executor's round on Fashion-MNIST (a quarter
  of the points) from the same initial lists, CPU join against GPU distances + CPU join; then
  ``python bench/bench_nndescent.py --gpu`` times whole jobs.
* **MF ALS** (apps/mf_gpu.py, CuPy): one executor's task (solve the PS side from its sums, squared
  errors, solve its rows, their contributions), Numba kernels against CuPy with the host-device
  copies the app makes, on synthetic ratings of two shapes: MovieLens (671 users, 9,066 items,
  100,004 ratings; one executor of 8) and MovieLens-1M (6,040 users, 3,706 items, 1,000,209
  ratings; one executor of 4), at several ranks; then whole jobs on them, ``--device cpu``
  against ``--device cuda`` (2 workers, 1 server, 8 executors), seconds per iteration. Synthetic
  because MovieLens comes in a 50 MB wheel that the GPU machine does not have; the sizes, not the
  values, set the time.

Compilation is excluded (every kernel runs once first). Without a GPU the script says so and exits 2.

Run: ``python bench/bench_gpu.py [--repeats 3] [--no-jobs] [--only mlr,nndescent,mf]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import litz
from apps import gpu, mf, mlr, mlr_cuda, nndescent, nndescent_cuda
from apps import mlr_kernels as mk
from apps import nndescent_kernels as nk
from apps.datasets import synthetic_ratings


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


MF_SHAPES = {"movielens": ((671, 9066, 100004), 8), "movielens-1m": ((6040, 3706, 1000209), 4)}


def mf_steps(repeats: int, ranks: tuple[int, ...]) -> None:
    from apps import mf_gpu

    for name, (shape, executors) in MF_SHAPES.items():
        data = synthetic_ratings(*shape)
        items = mf.to_csr(data.train_items, data.train_users, data.train_ratings - mf.global_mean(data),
                          data.num_items)
        mine = np.arange(data.num_items // executors)  # one executor's items, with their ratings
        end = items[0][len(mine)]
        train = (items[0][:len(mine) + 1], items[1][:end], items[2][:end])
        test = (np.zeros(len(mine) + 1, np.int64), np.zeros(0, np.int64), np.zeros(0))
        for rank in ranks:
            d = rank + 1
            rng = np.random.default_rng(rank)
            rows = rng.standard_normal((len(mine), d)) / np.sqrt(rank)
            # the users' sums of an iteration: every item's contributions
            ne = mf.normal_equations(*items, rng.standard_normal((data.num_items, d)) / np.sqrt(rank),
                                     data.num_users, tag=3.0)
            steps = {"cpu": mf.KernelSteps(d, train, test, data.num_users),
                     "cuda": mf_gpu.DeviceSteps(d, train, test, data.num_users)}

            def task(s: Any, ne: np.ndarray = ne, rows: np.ndarray = rows) -> None:
                ps_rows = s.solve_sums(ne, 3.0, 0.15)
                s.squared_errors(rows, ps_rows)
                s.normal_equations(s.solve_rows(ps_rows, 0.15), 4.0)

            times = {}
            for device, s in steps.items():
                task(s)
                times[device] = best(lambda s=s: task(s), repeats)
            print(f"MF task, {name} shape, one executor of {executors} ({end:,} ratings), rank {rank}: "
                  f"Numba kernels {times['cpu'] * 1e3:.1f} ms, CuPy {times['cuda'] * 1e3:.1f} ms, "
                  f"CPU / GPU {times['cpu'] / times['cuda']:.2f}", flush=True)


def mf_jobs(repeats: int, jobs: list[tuple[str, int]], iterations: int = 6) -> None:
    for name, rank in jobs:
        shape = MF_SHAPES[name][0]
        per_iter: dict[str, list[float]] = {"cpu": [], "cuda": []}
        rmse: dict[str, float] = {}
        for _ in range(repeats):  # interleaved: the machine may be shared
            for device in per_iter:
                app = mf.make_app(["--quiet", "--synthetic", ",".join(map(str, shape)), "--rank", str(rank),
                                   "--iterations", str(iterations), "--device", device])
                out = litz.run(app, workers=2, servers=1, num_executors=8).value
                assert out["devices"] == [device], out["devices"]
                per_iter[device].append(statistics.median(h["seconds"] for h in out["history"][1:]))
                rmse[device] = out["test_rmse"]
        cpu, dev = min(per_iter["cpu"]), min(per_iter["cuda"])
        print(f"MF job, {name} shape, rank {rank}, s/iteration: --device cpu {cpu:.3f} (test RMSE "
              f"{rmse['cpu']:.4f}), --device cuda {dev:.3f} (test RMSE {rmse['cuda']:.4f}), "
              f"cpu / cuda {cpu / dev:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-jobs", action="store_true", help="kernels only, no whole jobs")
    ap.add_argument("--only", default="mlr,nndescent,mf", help="comma-separated: mlr, nndescent, mf")
    ap.add_argument("--mf-ranks", default="10,32,64", help="ranks of the MF task timings")
    ap.add_argument("--mf-jobs", default="movielens:10,movielens:64,movielens-1m:10",
                    help="the MF jobs, SHAPE:RANK, comma-separated (shapes: " + ", ".join(MF_SHAPES) + ")")
    args = ap.parse_args()
    only = set(args.only.split(","))
    toolkits = (["numba"] if only & {"mlr", "nndescent"} else []) + (["cupy"] if "mf" in only else [])
    missing = [f"{t}: {gpu.why_unavailable(t)}" for t in toolkits if not gpu.available(t)]
    if missing or gpu.simulated() or gpu.cupy_standin():
        print(f"bench_gpu: no CUDA GPU here ({'; '.join(missing) or 'a stand-in is on'})", file=sys.stderr)
        sys.exit(2)
    if "mlr" in only:
        mlr_kernels(args.repeats)
    if "nndescent" in only:
        nndescent_round(args.repeats)
    if "mf" in only:
        mf_steps(args.repeats, tuple(int(r) for r in args.mf_ranks.split(",")))
    if not args.no_jobs:
        if "mlr" in only:
            mlr_jobs(args.repeats)
        if "mf" in only:
            mf_jobs(args.repeats, [(j.split(":")[0], int(j.split(":")[1])) for j in args.mf_jobs.split(",")])


if __name__ == "__main__":
    main()
