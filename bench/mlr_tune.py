"""Tune MLR-on-Fashion-MNIST SGD hyper-parameters under simulated parameter-server execution.

Kept in the repository as the reproducible record behind ``apps.mlr_kernels.DEFAULTS``.

Simulation (one process, no networking, deterministic for a given seed):

* ``E`` executors; executor ``e`` owns ``partition_rows(60000, E, e)``.  Each epoch it shuffles its
  rows and cuts them into ``T`` consecutive slices, one per clock (micro-task).
* At clock ``c`` every executor copies the W it "fetched", runs :func:`apps.mlr_kernels.sgd_steps` on
  its slice and produces ``delta = W_local - W_fetched``; after the clock all deltas are *added* to the
  server's W (exactly what the parameter server does).
* Staleness ``s``: all deltas of clock ``c`` are computed from W as it was at the start of clock
  ``c - s`` (W_0 before that), i.e. every executor sees the oldest W that SSP with staleness ``s``
  allows.  This is the worst case; a real run sees a mixture of fresher W's.  ``s=0`` is BSP.

What governs stability (and why the recipe does not scale lr with E): per clock, all executors together
process N/T rows whatever E is, and the sum of their deltas is, to first order, one gradient step of
size ``eta_c = lr * (N / T) / B`` on those rows, applied to a W that is ``s`` clocks old.  Such a delayed
step is stable only while ``eta_c * lambda_max < 2 sin(pi / (2 (2 s + 1)))`` (2, 1, 0.62 for s = 0, 1,
2), where lambda_max is the largest Hessian eigenvalue.  E itself only decides how much of a clock's
work an executor sees locally (E=2: half, E=32: 1/32); large E is the worst case, small E converges to
it as s grows.  Dividing lr by E would keep large E stable but make it learn E times slower per epoch.
On raw [0, 1] pixels lambda_max ~ 11 (the mean-image direction), which caps eta_c at ~0.05 for s=2:
with T=20 that is 1/200 of the per-epoch progress of sequential SGD and tops out around 0.80-0.83
test accuracy in 10 epochs (try ``--precondition-rank 0``).  The recipe therefore trains on
spectrally preconditioned features (``apps.datasets.SpectralPreconditioner``: centre, then shrink the
top-r principal directions to the r-th eigenvalue), which cuts lambda_max by ~100x so the same
per-row learning rate as sequential SGD is stable under summed stale deltas.

Usage::

    python bench/mlr_tune.py                       # speed check + table for apps.mlr_kernels.DEFAULTS
    python bench/mlr_tune.py --grid --jobs 2       # hyper-parameter search (~3-4 min on 2 cores)
    python bench/mlr_tune.py --tasks-per-epoch 10 --lr0 0.3   # one configuration, all E x s
    python bench/mlr_tune.py --speed               # only kernel vs NumPy time per 60k-row epoch
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps import mlr_kernels as mk  # noqa: E402
from apps.datasets import load_fashion_mnist, load_fashion_mnist_preconditioned, partition_rows  # noqa: E402

ES = (2, 8, 32)
STALENESS = (0, 1, 2)
TARGET_ACC = 0.845
Data = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

# Search space for --grid: screened on the two extreme settings (E=32, s=2) and (E=2, s=0).
GRID: dict[str, tuple[float | int, ...]] = {
    "precondition_rank": (8, 16, 32),
    "tasks_per_epoch": (10, 20),
    "batch_size": (32, 64),
    "lr0": (0.1, 0.2, 0.3, 0.4),
    "lr_decay": (0.5, 1.0),
    "l2": (0.0, 1e-4),
}


@dataclass(frozen=True)
class Config:
    """One hyper-parameter setting (the fields of ``mk.DEFAULTS``)."""

    precondition_rank: int
    tasks_per_epoch: int
    batch_size: int
    lr0: float
    lr_decay: float
    l2: float
    epochs: int

    def label(self) -> str:
        """Compact one-line description for tables."""
        return (
            f"rank={self.precondition_rank} T={self.tasks_per_epoch} B={self.batch_size} lr0={self.lr0:g} "
            f"decay={self.lr_decay:g} l2={self.l2:g} epochs={self.epochs}"
        )


@dataclass
class Result:
    """Outcome of one simulated run."""

    E: int
    s: int
    test_acc: list[float] = field(default_factory=list)
    test_acc_avg: list[float] = field(default_factory=list)  # W averaged over the epoch's clocks
    kernel_s: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)

    def first_epoch_reaching(self, target: float) -> int | None:
        """1-based epoch after which the test accuracy first reaches ``target`` (None if never)."""
        for i, a in enumerate(self.test_acc):
            if a >= target:
                return i + 1
        return None


_DATA: dict[int, Data] = {}


def get_data(rank: int) -> Data:
    """(X, y, X_test, y_test), raw for rank 0 else preconditioned; memoized (mmap'd caches)."""
    if rank not in _DATA:
        if rank == 0:
            X, y = load_fashion_mnist("train")
            Xt, yt = load_fashion_mnist("test")
        else:
            X, y, Xt, yt, _ = load_fashion_mnist_preconditioned(rank)
        _DATA[rank] = (X, y, Xt, yt)
    return _DATA[rank]


def simulate(cfg: Config, E: int, s: int, seed: int = 0) -> Result:
    """Run the parameter-server simulation described in the module docstring for one (E, s)."""
    X, y, Xt, yt = get_data(cfg.precondition_rank)
    n, d = X.shape
    K = int(y.max()) + 1
    parts = [partition_rows(n, E, e, seed=seed) for e in range(E)]
    rngs = [np.random.default_rng([seed, E, s, e]) for e in range(E)]
    W = np.zeros((d + 1, K), np.float32)
    history = [W.copy()]  # history[-1 - i] = W at the start of the clock i clocks ago
    delta_sum = np.empty_like(W)
    w_avg = np.empty((d + 1, K), np.float64)
    res = Result(E, s)
    for epoch in range(cfg.epochs):
        lr = mk.lr_at(epoch, cfg.lr0, cfg.lr_decay)
        slices = [
            np.array_split(rng.permutation(p), cfg.tasks_per_epoch)
            for rng, p in zip(rngs, parts, strict=True)
        ]
        kernel = 0.0
        loss_sum = 0.0
        w_avg.fill(0.0)
        for t in range(cfg.tasks_per_epoch):
            fetched = history[max(0, len(history) - 1 - s)]
            delta_sum.fill(0.0)
            for e in range(E):
                w_local = fetched.copy()
                t0 = time.perf_counter()
                loss, _ = mk.sgd_steps(w_local, X, y, slices[e][t], cfg.batch_size, lr, cfg.l2)
                kernel += time.perf_counter() - t0
                loss_sum += loss
                w_local -= fetched
                delta_sum += w_local
            W += delta_sum
            w_avg += W
            history.append(W.copy())
            del history[: -(s + 1)]
        res.test_acc.append(mk.evaluate(W, Xt, yt)[1])
        res.test_acc_avg.append(mk.evaluate((w_avg / cfg.tasks_per_epoch).astype(np.float32), Xt, yt)[1])
        res.kernel_s.append(kernel)
        res.train_loss.append(loss_sum / n)
        if not np.isfinite(W).all():
            break
    return res


def _simulate_job(args: tuple[Config, int, int, int]) -> Result:
    """Process-pool entry point (workers warm up the kernels from the on-disk numba cache)."""
    mk.warmup()
    return simulate(*args)


def run_many(jobs: list[tuple[Config, int, int, int]], workers: int) -> list[Result]:
    """Run simulations, in parallel processes when ``workers > 1`` (results are deterministic)."""
    if workers <= 1:
        return [simulate(*j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_simulate_job, jobs, chunksize=2))


def print_table(cfg: Config, results: list[Result]) -> None:
    """Per-run table: test accuracy after every epoch plus mean kernel seconds per epoch."""
    print(f"\n== {cfg.label()}")
    hdr = " ".join(f"ep{i + 1:<4d}" for i in range(cfg.epochs))
    print(f"{'E':>3} {'s':>2} | {hdr} | avg-W | 1st>={TARGET_ACC} | kernel s/epoch")
    for r in results:
        accs = " ".join(f"{a:.4f}" for a in r.test_acc)
        first = r.first_epoch_reaching(TARGET_ACC)
        print(
            f"{r.E:>3} {r.s:>2} | {accs} | {r.test_acc_avg[-1]:.4f} | {first if first else '-':>10} "
            f"| {np.median(r.kernel_s):.3f}"
        )
    final = [r.test_acc[-1] for r in results]
    mn, mean, mx = min(final), float(np.mean(final)), max(final)
    print(f"final test accuracy over all (E, s): min {mn:.4f} mean {mean:.4f} max {mx:.4f}")


def numpy_sgd_steps(
    W: np.ndarray, X: np.ndarray, y: np.ndarray, rows: np.ndarray, batch_size: int, lr: float, l2: float
) -> None:
    """NumPy (BLAS) implementation of the same update, as the speed baseline."""
    lr32 = np.float32(lr)
    for b0 in range(0, len(rows), batch_size):
        idx = rows[b0 : b0 + batch_size]
        Xb = X[idx]
        Z = Xb @ W[:-1] + W[-1]
        Z -= Z.max(axis=1, keepdims=True)
        np.exp(Z, out=Z)
        Z /= Z.sum(axis=1, keepdims=True)
        Z[np.arange(len(idx)), y[idx]] -= 1.0
        Z *= lr32 / np.float32(len(idx))
        W[:-1] *= np.float32(1.0 - lr * l2)
        W[:-1] -= Xb.T @ Z
        W[-1] -= Z.sum(axis=0)


def speed(batch_sizes: tuple[int, ...] = (32, 64), reps: int = 7) -> None:
    """Seconds per 60k-row epoch, Numba kernel vs NumPy, interleaved so machine noise hits both."""
    X, y, Xt, yt = get_data(0)
    rows = np.random.default_rng(0).permutation(X.shape[0]).astype(np.int64)
    W = np.zeros((X.shape[1] + 1, 10), np.float32)
    for B in batch_sizes:
        times: dict[str, list[float]] = {"numba": [], "numpy": []}
        for _ in range(reps):
            for name, fn in (("numba", mk.sgd_steps), ("numpy", numpy_sgd_steps)):
                W = np.zeros((X.shape[1] + 1, 10), np.float32)
                t0 = time.perf_counter()
                fn(W, X, y, rows, B, 0.1, 1e-4)
                times[name].append(time.perf_counter() - t0)
        nb_t, np_t = min(times["numba"]), min(times["numpy"])
        nb_med, np_med = np.median(times["numba"]), np.median(times["numpy"])
        print(
            f"60k-row epoch, B={B:3d}: numba {nb_t * 1e3:6.1f} ms (median {nb_med * 1e3:6.1f})"
            f"  numpy {np_t * 1e3:6.1f} ms (median {np_med * 1e3:6.1f})  numpy/numba = {np_t / nb_t:.2f}"
        )
    t0 = time.perf_counter()
    for _ in range(reps):
        mk.evaluate(W, Xt, yt)
    print(f"evaluate on {Xt.shape[0]} test rows: {(time.perf_counter() - t0) / reps * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point; see module docstring."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="store_true", help="screen GRID on the extreme cases, then full tables")
    ap.add_argument("--speed", action="store_true", help="only time the kernel against NumPy")
    ap.add_argument("--jobs", type=int, default=1, help="parallel simulation processes")
    ap.add_argument("--top", type=int, default=3, help="--grid: configurations to run on all (E, s)")
    ap.add_argument("--seed", type=int, default=0, help="partitioning / shuffling seed")
    for key, val in mk.DEFAULTS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", dest=key, type=type(val), default=val)
    ap.add_argument("--es", type=lambda v: tuple(int(x) for x in v.split(",")), default=ES)
    ap.add_argument("--ss", type=lambda v: tuple(int(x) for x in v.split(",")), default=STALENESS)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    get_data(0)
    get_data(args.precondition_rank)
    t1 = time.perf_counter()
    mk.warmup()
    t2 = time.perf_counter()
    print(f"data load {t1 - t0:.3f} s, kernel warm-up {t2 - t1:.3f} s")
    speed()
    if args.speed:
        return

    base = Config(**{k: getattr(args, k) for k in mk.DEFAULTS})
    full = list(itertools.product(args.es, args.ss))
    if args.grid:
        keys = list(GRID)
        cfgs = [
            Config(**{**asdict(base), **dict(zip(keys, v, strict=True))})
            for v in itertools.product(*GRID.values())
        ]
        for rank in GRID["precondition_rank"]:
            get_data(int(rank))  # build caches once, before the workers start
        extremes = [(32, 2), (2, 0)]
        res = run_many([(c, E, s, args.seed) for c in cfgs for E, s in extremes], args.jobs)
        scored = []
        for i, cfg in enumerate(cfgs):
            r = res[2 * i : 2 * i + 2]
            score = min(x.test_acc[-1] for x in r)
            scored.append((score, cfg))
            accs = "  ".join(
                f"E={x.E} s={x.s}: {x.test_acc[-1]:.4f} (avg-W {x.test_acc_avg[-1]:.4f})" for x in r
            )
            print(f"{score:.4f}  {cfg.label()}  {accs}")
        scored.sort(key=lambda t: t[0], reverse=True)
        top = [cfg for _, cfg in scored[: args.top]]
        res = run_many([(c, E, s, args.seed) for c in top for E, s in full], args.jobs)
        for i, cfg in enumerate(top):
            print_table(cfg, res[i * len(full) : (i + 1) * len(full)])
        return
    print_table(base, run_many([(base, E, s, args.seed) for E, s in full], args.jobs))


if __name__ == "__main__":
    main()
