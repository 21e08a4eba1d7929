"""Least-squares regression by stale-synchronous SGD: ``litz.SSPDriver``, row tables, batched reads.

A model of ``dim`` weights lives in table ``w`` as rows of ``ROW`` weights (``num_rows`` set, so
keys are checked against it). Every executor regenerates its own rows of a synthetic data set
from the seed (reloadable input: nothing is shipped when it moves) and, per iteration, reads all
of ``w`` with one ``get_many``, takes one SGD step on its next mini-batch and sends the step with
one ``update_many``. ``SSPDriver`` dispatches iteration ``i`` once iteration ``i - s - 1`` has
completed everywhere (``--staleness s``; 0 is bulk-synchronous), so a task may read weights that
miss the last ``s`` iterations of the others: the consistency rule of DESIGN.md §2 says exactly
which updates it is guaranteed to see.

    python examples/ssp_regression.py [--iterations 200] [--staleness 2]
    litz launch examples/ssp_regression.py --executors 4 --staleness 0

Last line: ``weight error E`` (relative L2 distance of the learned weights from the true ones).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import litz

ROW = 8  # weights per table row: a task's read is dim / ROW keys in one message


def partition(config: dict[str, Any], executor_id: int, num_executors: int) -> tuple[np.ndarray, np.ndarray]:
    """Executor ``executor_id``'s rows (x, y): a pure function of the seed, so any process can rebuild them."""
    rng = np.random.default_rng([config["seed"], executor_id])
    n = max(1, config["rows"] // num_executors)
    x = rng.standard_normal((n, config["dim"]))
    y = x @ true_weights(config) + config["noise"] * rng.standard_normal(n)
    return x, y


def true_weights(config: dict[str, Any]) -> np.ndarray:
    return np.random.default_rng(config["seed"]).uniform(-1.0, 1.0, config["dim"])


class RegressionExecutor(litz.Executor):
    def load_input(self) -> tuple[np.ndarray, np.ndarray]:
        return partition(self.config, self.executor_id, self.num_executors)

    def keys(self) -> range:
        return range(self.config["dim"] // ROW)

    def prefetch(self, args: dict[str, Any]) -> list[tuple[str, range]]:
        return [("w", self.keys())]  # the next task's read leaves while this one runs

    def run_task(self, args: dict[str, Any]) -> float:
        x, y = self.input
        batch = self.config["batch"]
        lo = (args["iteration"] * batch) % len(y)  # the mini-batches cycle through the partition
        xb, yb = x[lo:lo + batch], y[lo:lo + batch]
        w = self.ps.get_many("w", self.keys()).ravel()
        residual = xb @ w - yb
        grad = xb.T @ residual / len(yb)
        step = -self.config["lr"] / self.num_executors * grad  # the executors' steps add up to one
        self.ps.update_many("w", self.keys(), step.reshape(-1, ROW))
        return float(np.mean(residual ** 2))


class RegressionDriver(litz.SSPDriver):
    def on_iteration_end(self, iteration: int, results: list[litz.TaskResult]) -> None:
        every = self.config["iterations"] // 10 or 1
        if not self.config["quiet"] and (iteration + 1) % every == 0:
            loss = np.mean([r.value for r in results])
            print(f"iteration {iteration + 1:4d}/{self.config['iterations']}  mean squared error {loss:.4f}",
                  flush=True)

    def result(self) -> dict[str, Any]:
        w = self.ps.get_many("w", range(self.config["dim"] // ROW)).ravel()
        truth = true_weights(self.config)
        error = float(np.linalg.norm(w - truth) / np.linalg.norm(truth))
        if not self.config["quiet"]:
            print(f"weight error {error:.4f}", flush=True)
        return {"weights": w, "error": error}


def make_app(argv: list[str]) -> litz.App:
    ap = argparse.ArgumentParser(prog="litz launch examples/ssp_regression.py", description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64, help=f"weights (a multiple of {ROW})")
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--batch", type=int, default=250, help="rows per task")
    ap.add_argument("--iterations", type=int, default=100, help="tasks per executor")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.dim < ROW or args.dim % ROW:
        raise litz.ConfigError(f"--dim must be a positive multiple of {ROW}, got {args.dim}")
    for name in ("rows", "batch", "iterations"):
        if getattr(args, name) < 1:
            raise litz.ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.staleness < 0 or not args.lr > 0:
        raise litz.ConfigError("--staleness must be >= 0 and --lr > 0")
    config = {"dim": args.dim, "rows": args.rows, "batch": args.batch, "lr": args.lr, "noise": args.noise,
              "seed": args.seed, "quiet": args.quiet, "staleness": args.staleness, "iterations": args.iterations}
    return litz.App(RegressionDriver, RegressionExecutor, name="ssp-regression", config=config, num_executors=8,
                    tables=[litz.Table("w", shape=(ROW,), dtype="float64", num_rows=args.dim // ROW)])


if __name__ == "__main__":
    litz.run(make_app(sys.argv[1:]), workers=2, servers=1)
