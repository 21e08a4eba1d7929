"""Why priority checkpoints gain little on MLR: a one-process simulation of bench_scar.py's training.

The same model, data, clocks and rework measure as ``bench_scar.py`` (8 executors' SGD deltas of
one clock summed into the weights, one weight row per feature, the objective on 5,000 training
rows averaged over 20 clocks, the target at clock 90 of 120), without processes: a run takes a
second, so checkpoint policies the servers could not compute can be compared too. Two questions:

* ``--staleness``: half the rows go back to a full checkpoint taken s clocks before the failure.
  If restored rows corrected themselves faster than training had moved them, the rework would be
  well below s/2; it is s/2.
* otherwise: partial recovery of half the rows from priority checkpoints of 1/8 of the rows every
  C/8 clocks, ranked by L2 distance (what Litz does), by the L2 distance scaled by the feature's
  root mean square (a diagonal-Hessian weight), by the first-order share of the objective's
  decrease since the row was saved (the gradient times the change: the best ranking for a rework
  that is proportional to lost progress, which a server cannot compute), and round-robin; against
  full recovery from full checkpoints and partial recovery from full checkpoints.

Run: ``python bench/scar_mlr_sim.py [--staleness] [--reps 10] [--every 24]``. Defaults are the
constant-learning-rate regime of the README (batches of 1,024, no decay), where partial recovery
gains most on the real system.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scar import OBJECTIVE_ROWS, SMOOTHING, first_reaching, interval, smoothed  # noqa: E402

from apps.mlr import load_data  # noqa: E402
from apps.mlr_kernels import DEFAULTS, evaluate, lr_at, sgd_steps  # noqa: E402

CLOCKS_PER_EPOCH = 20
EXECUTORS = 8


class Training:
    """MLR's clocks in one process: each clock, every executor runs SGD on its 1/20 of its
    partition from the same weights, and the deltas are summed (SSP with staleness 0)."""

    def __init__(self, batch: int, lr: float, decay: float) -> None:
        X, y = load_data(int(DEFAULTS["precondition_rank"]))[:2]
        self.X, self.y = np.ascontiguousarray(X, np.float32), np.ascontiguousarray(y, np.int64)
        step = len(X) // OBJECTIVE_ROWS
        self.X_obj = np.ascontiguousarray(self.X[::step][:OBJECTIVE_ROWS])
        self.y_obj = np.ascontiguousarray(self.y[::step][:OBJECTIVE_ROWS])
        self.X1 = np.c_[self.X_obj, np.ones(len(self.X_obj), np.float32)].astype(np.float64)
        self.rms = np.sqrt((self.X1 ** 2).mean(axis=0))
        self.parts = np.array_split(np.random.default_rng(0).permutation(len(X)), EXECUTORS)
        self.batch, self.lr, self.decay = batch, lr, decay
        self._orders: dict[int, list[np.ndarray]] = {}
        self.shape = (self.X.shape[1] + 1, 10)

    def clock(self, W: np.ndarray, c: int) -> None:
        """Clock ``c`` (0-based) on ``W`` in place; the same rows for a clock however often it runs."""
        epoch, i = divmod(c, CLOCKS_PER_EPOCH)
        if epoch not in self._orders:
            rng = np.random.default_rng(1000 + epoch)
            self._orders[epoch] = [p[rng.permutation(len(p))] for p in self.parts]
        lr = lr_at(epoch, self.lr, self.decay)
        delta = np.zeros_like(W)
        for order in self._orders[epoch]:
            local = W.copy()
            sgd_steps(local, self.X, self.y, np.array_split(order, CLOCKS_PER_EPOCH)[i], self.batch, lr,
                      float(DEFAULTS["l2"]))
            delta += local - W
        W += delta

    def objective(self, W: np.ndarray) -> float:
        return evaluate(W, self.X_obj, self.y_obj)[0]

    def gradient(self, W: np.ndarray) -> np.ndarray:
        z = self.X1 @ W
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(p)), self.y_obj] -= 1.0
        return self.X1.T @ p / len(p)


def run(tr: Training, clocks: int, every: int, fail: int | None = None, lost: np.ndarray | None = None,
        policy: str = "none", staleness: int | None = None) -> list[tuple[int, int, float]]:
    """One training of ``clocks`` executed clocks: ``(executed, clock, objective)`` per clock, as
    bench_scar's traces. ``policy``: none, full (full recovery), partial-full, or a priority
    ranking (l2, rms, progress, round-robin) of 1/8 of the rows every ``every // 8`` clocks."""
    W = np.zeros(tr.shape, np.float32)
    saved, saved_clock = W.copy(), 0
    progress = np.zeros(tr.shape[0])
    part_every, share = max(1, every // 8), max(1, round(tr.shape[0] / 8))
    trace, c, failed = [], 0, False
    while len(trace) < clocks:
        before = W.copy() if policy == "progress" else None
        tr.clock(W, c)
        c += 1
        if before is not None:
            progress -= (tr.gradient(before) * (W - before)).sum(axis=1)
        trace.append((len(trace) + 1, c, tr.objective(W)))
        if staleness is not None:
            if c == fail - staleness:
                saved = W.copy()
        elif policy in ("full", "partial-full"):
            if c % every == 0:
                saved, saved_clock = W.copy(), c
        elif policy != "none" and c % part_every == 0:
            if policy == "round-robin":
                pick = (np.arange(share) + (c // part_every) * share) % tr.shape[0]
            else:
                if policy == "progress":
                    score = progress
                else:
                    score = np.linalg.norm(W.astype(np.float64) - saved, axis=1)
                    if policy == "rms":
                        score = score * tr.rms
                pick = np.argsort(-score, kind="stable")[:share]
            saved[pick] = W[pick]
            progress[pick] = 0.0
        if fail is not None and not failed and c == fail:
            failed = True
            if policy == "full":
                W, c = saved.copy(), saved_clock
            else:
                W[lost] = saved[lost]
    return trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--staleness", action="store_true", help="rework against the age of the restored rows")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--every", type=int, default=24, help="C: clocks between full checkpoints")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=float(DEFAULTS["lr0"]))
    p.add_argument("--lr-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    tr = Training(args.batch_size, args.lr, args.lr_decay)
    total, length = 6 * CLOCKS_PER_EPOCH, 10 * CLOCKS_PER_EPOCH
    free = run(tr, length, args.every)
    target = dict(smoothed(free))[round(0.75 * total)]
    base = first_reaching(free, target)
    assert base is not None
    rng = np.random.default_rng(args.seed)
    rows = tr.shape[0]

    def rework(trace: list[tuple[int, int, float]]) -> float:
        got = first_reaching(trace, target, SMOOTHING)
        return got - base if got is not None else float("nan")

    if args.staleness:
        for fail in (40, 55):
            lost = np.sort(rng.permutation(rows)[:rows // 2])
            for s in (1, 2, 4, 8, 16):
                r = rework(run(tr, length, args.every, fail, lost, staleness=s))
                print(f"failure at clock {fail}, half the rows {s:2d} clocks old: rework {r:5.2f} clocks "
                      f"(s/2 = {s / 2:.1f})", flush=True)
        return
    fails = rng.integers(round(1.25 * args.every), round(0.55 * total) + 1, size=args.reps)
    losts = [np.sort(rng.permutation(rows)[:rows // 2]) for _ in fails]
    means = {}
    for policy in ("full", "partial-full", "l2", "rms", "progress", "round-robin"):
        reworks = [rework(run(tr, length, args.every, int(f), lost, policy))
                   for f, lost in zip(fails, losts, strict=True)]
        mean, half = interval(reworks)
        means[policy] = mean
        cut = f"{100 * (1 - mean / means['full']):3.0f}% less than full" if policy != "full" else ""
        print(f"{policy:<13} rework {mean:5.2f} ± {half:4.2f} clocks  {cut}", flush=True)


if __name__ == "__main__":
    main()
