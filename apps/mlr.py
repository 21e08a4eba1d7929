"""Multinomial logistic regression on Fashion-MNIST, trained by stale-synchronous SGD on Litz.

Each executor owns a partition of the 60,000 training rows. A micro-task fetches the weight
matrix (a PS table split into row blocks), runs a few mini-batch SGD steps on a local copy
over 1/T of the executor's rows, and pushes the difference, which the servers add. The
driver is an ``SSPDriver``: clock ``i`` is dispatched once clock ``i - s - 1`` has completed
everywhere. After each epoch it reads the weights and evaluates them on the 10,000 test rows.

Run it:  ``litz launch apps/mlr.py [--workers 2] [--executors 16] [--epochs 10]``
Last line printed: ``test accuracy 0.8xx``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import litz
from apps import gpu
from apps.datasets import fashion_mnist_files, load_fashion_mnist, load_fashion_mnist_preconditioned, partition_rows
from apps.mlr_kernels import DEFAULTS, evaluate, gpu_batch_too_big, lr_at, sgd_steps, warmup
from apps.options import require_at_least, require_finite, seed

NUM_CLASSES = 10
TRAIN_ROWS = 60_000  # Fashion-MNIST's training set


def _block_rows(dim: int, blocks: int) -> int:
    return -(-(dim + 1) // blocks)


def load_data(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train and test sets; with ``rank > 0`` on spectrally preconditioned features.

    The summed, stale deltas of one SSP clock act as one large step; on raw pixels the mean-image
    direction is so stiff that such steps diverge unless the learning rate is tiny. Flattening
    the top principal directions (fitted on the training split, cached on disk) makes the
    sequential-SGD learning rate stable for any number of executors (see apps/mlr_kernels.py).
    """
    if rank > 0:
        return load_fashion_mnist_preconditioned(rank)[:4]
    return (*load_fashion_mnist("train"), *load_fashion_mnist("test"))


class MLRDriver(litz.SSPDriver):
    """Dispatches SSP clocks, reports progress per epoch, evaluates on the test set."""

    transient = ("X_test", "y_test")  # reloaded on resume, not checkpointed

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        if cfg.get("rows_per_task"):  # fixed work per task: more executors means fewer clocks per epoch
            rows = min(cfg["train_rows"] or TRAIN_ROWS, TRAIN_ROWS)  # as load_input takes them
            self.T = max(1, round(rows / (self.num_executors * cfg["rows_per_task"])))
        else:
            self.T = int(cfg["tasks_per_epoch"])
        self.iterations = int(cfg["epochs"]) * self.T
        self.staleness = int(cfg["staleness"])
        self.X_test, self.y_test = load_data(cfg["precondition_rank"])[2:]
        self.history: list[dict[str, float]] = []
        self._epoch_loss = 0.0
        self._epoch_correct = 0
        self._epoch_rows = 0
        self._timed_from = 0  # rows of the epoch seen before its clock started (a resume mid-epoch)
        self._epoch_start = self._start = time.perf_counter()
        self.test_accuracy = float("nan")
        self.devices: set[str] = set()  # where the executors ran their SGD steps
        super().dispatch_initial_tasks()

    def resumed(self) -> None:
        """Back from a checkpoint: this process's clock restarts, so time the epoch from now."""
        self.X_test, self.y_test = load_data(self.config["precondition_rank"])[2:]
        self.devices = getattr(self, "devices", set())  # a checkpoint of an older Litz has none
        self.iterations = int(self.config["epochs"]) * self.T  # the new launch may ask for more epochs
        super().resumed()
        now = time.perf_counter()
        self._start = now - sum(h["seconds"] for h in self.history)
        self._epoch_start = now
        # the checkpoint holds the epoch's rows so far but not its time: rate it by the rows from now
        self._timed_from = self._epoch_rows
        if not self.config.get("quiet"):
            print(f"resumed after epoch {len(self.history)}", flush=True)

    def task_args(self, executor_id: int, iteration: int) -> Any:
        cfg = self.config
        return {"iteration": iteration, "T": self.T,
                "lr": lr_at(iteration // self.T, cfg["lr0"], cfg["lr_decay"])}

    def weights(self) -> np.ndarray:
        """The current weight matrix (d+1, K), read from the parameter servers."""
        cfg = self.config
        blocks = self.ps.get_many("W", range(cfg["blocks"]))
        return np.ascontiguousarray(blocks.reshape(-1, NUM_CLASSES)[: cfg["dim"] + 1])

    def on_iteration_end(self, iteration: int, results: list[litz.TaskResult]) -> None:
        for r in results:
            loss, correct, rows, device = r.value
            self.devices.add(device)
            self._epoch_loss += loss
            self._epoch_correct += correct
            self._epoch_rows += rows
        if (iteration + 1) % self.T:
            return
        now = time.perf_counter()
        rate = (self._epoch_rows - self._timed_from) / max(now - self._epoch_start, 1e-9)
        seconds = self._epoch_rows / rate if rate > 0 else now - self._epoch_start  # of a whole epoch at that rate
        test_loss, self.test_accuracy = evaluate(self.weights(), self.X_test, self.y_test)
        epoch = (iteration + 1) // self.T
        stats = {"epoch": epoch, "seconds": seconds, "train_loss": self._epoch_loss / self._epoch_rows,
                 "train_accuracy": self._epoch_correct / self._epoch_rows, "test_loss": test_loss,
                 "test_accuracy": self.test_accuracy}
        self.history.append(stats)
        if not self.config.get("quiet"):
            print(f"epoch {epoch:3d}/{self.config['epochs']}  loss {stats['train_loss']:.4f}  "
                  f"train acc {stats['train_accuracy']:.4f}  test acc {self.test_accuracy:.4f}  "
                  f"{rate / 1e3:8.1f}k samples/s  {seconds:.3f} s/epoch", flush=True)
        self._epoch_loss, self._epoch_correct, self._epoch_rows, self._timed_from = 0.0, 0, 0, 0
        self._epoch_start = time.perf_counter()

    def progress(self) -> str:
        if not getattr(self, "history", None):
            return f"epoch 0/{self.config['epochs']}"
        h = self.history[-1]
        return (f"epoch {h['epoch']}/{self.config['epochs']}, test accuracy {h['test_accuracy']:.4f}, "
                f"{h['seconds']:.3f} s/epoch")

    def result(self) -> dict[str, Any]:
        print(f"test accuracy {self.test_accuracy:.4f}", flush=True)  # the result line, --quiet or not
        return {"test_accuracy": self.test_accuracy, "history": self.history,
                "seconds": time.perf_counter() - self._start, "devices": sorted(self.devices)}


class MLRExecutor(litz.Executor):
    """Owns a partition of the training rows (reloadable: indices into the shared memory-mapped set)."""

    def load_input(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This executor's rows (a copy of its partition: what a scale-out ships from memory)."""
        X, y = load_data(self.config["precondition_rank"])[:2]
        n = min(int(self.config.get("train_rows") or len(y)), len(y))
        rows = partition_rows(n, self.num_executors, self.executor_id, seed=self.config["seed"])
        return np.ascontiguousarray(X[rows]), np.ascontiguousarray(y[rows]), np.arange(len(rows), dtype=np.int64)

    def setup(self) -> None:
        warmup()  # compile or load the Numba kernels before the first task, here or after a move

    def prefetch(self, args: dict[str, Any]) -> list[tuple[str, range]]:
        """Every task reads the whole weight table: a task queued behind this executor's current
        one (SSP lets several clocks be in flight) has it fetched while it waits."""
        return [("W", range(self.config["blocks"]))]

    def run_task(self, args: dict[str, Any]) -> list[float]:
        cfg = self.config
        X, y, rows = self.input
        T = args["T"]
        it = args["iteration"]
        epoch, clock = divmod(it, T)
        order = self._order(epoch)
        chunk = order[clock * len(order) // T: (clock + 1) * len(order) // T]
        blocks = cfg["blocks"]
        full = self.ps.get_many("W", range(blocks)).reshape(-1, NUM_CLASSES)
        before = full.copy()
        W = full[: cfg["dim"] + 1]
        device = gpu.process_device(cfg.get("device", "cpu"))
        if device == "cuda":
            from apps import mlr_cuda  # imported only where a GPU is wanted (apps/gpu.py)

            loss, correct = mlr_cuda.sgd_steps(W, self._device_rows(), chunk, cfg["batch_size"], args["lr"], cfg["l2"])
        else:
            loss, correct = sgd_steps(W, X, y, chunk, cfg["batch_size"], args["lr"], cfg["l2"])
        delta = (full - before).reshape(blocks, -1, NUM_CLASSES)
        self.ps.update_many("W", range(blocks), delta)
        return [loss, correct, len(chunk), device]

    def _device_rows(self) -> Any:
        """This executor's rows on the GPU (``apps.mlr_cuda.DeviceRows``), copied at its first task there
        (again if its input changed)."""
        from apps import mlr_cuda

        cached = getattr(self, "_gpu_rows", None)
        if cached is None or cached[0] is not self.input:
            X, y, _ = self.input
            cached = self._gpu_rows = (self.input, mlr_cuda.DeviceRows(X, y))
        return cached[1]

    def _order(self, epoch: int) -> np.ndarray:
        """This epoch's visiting order of the executor's rows (deterministic: seed, executor, epoch)."""
        cached = getattr(self, "_order_cache", None)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.config["seed"], self.executor_id, epoch])
            cached = (epoch, rng.permutation(self.input[2]).astype(np.int64))
            self._order_cache = cached
        return cached[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="litz launch apps/mlr.py",
                                description="Softmax regression on Fashion-MNIST with SSP SGD on Litz.")
    p.add_argument("--epochs", type=int, default=int(DEFAULTS["epochs"]))
    p.add_argument("--staleness", type=int, default=1, help="SSP staleness in clocks (0 = BSP)")
    p.add_argument("--tasks-per-epoch", type=int, default=int(DEFAULTS["tasks_per_epoch"]),
                   help="clocks per epoch: each task covers 1/T of an executor's rows")
    p.add_argument("--rows-per-task", type=int, default=0,
                   help="fix the rows per task instead (clocks per epoch = rows / (executors * this))")
    p.add_argument("--batch-size", type=int, default=int(DEFAULTS["batch_size"]))
    p.add_argument("--lr", type=float, default=float(DEFAULTS["lr0"]), help="initial learning rate")
    p.add_argument("--lr-decay", type=float, default=float(DEFAULTS["lr_decay"]))
    p.add_argument("--l2", type=float, default=float(DEFAULTS["l2"]))
    p.add_argument("--precondition-rank", type=int, default=int(DEFAULTS["precondition_rank"]),
                   help="principal directions flattened before training (0 = raw pixels)")
    p.add_argument("--blocks", type=int, default=8, help="row blocks of the weight table")
    p.add_argument("--train-rows", type=int, default=0, help="use only the first N training rows (0 = all)")
    p.add_argument("--seed", type=seed, default=0)
    gpu.add_device_option(p, "the SGD steps", "apps/mlr_cuda.py")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the result line is printed)")
    return p


def make_app(argv: list[str]) -> litz.App:
    """Parse and check the options (a bad one is a ConfigError here, not a task failing later)."""
    args = parser().parse_args(argv)
    dim = 784
    require_at_least(args, epochs=1, staleness=0, tasks_per_epoch=1, rows_per_task=0, batch_size=1,
                     precondition_rank=0, blocks=1, train_rows=0)
    require_finite(args, positive=("lr",), non_negative=("lr_decay", "l2"))
    too_big = gpu_batch_too_big(dim, NUM_CLASSES, args.batch_size)
    if too_big and args.device == "cuda":  # (every task would fail)
        raise litz.ConfigError(too_big)
    if too_big and args.device == "auto":  # a GPU cannot run it: the CPU does (said where one would have)
        if gpu.available():
            print(f"--device auto: {too_big}: the SGD steps run on the CPU", file=sys.stderr)
        args.device = "cpu"
    gpu.check_device(args.device)
    for split in ("train", "test"):  # the data is read by the processes: refuse before starting one
        fashion_mnist_files(split)
    if args.precondition_rank >= dim:
        raise litz.ConfigError(f"--precondition-rank must be below {dim}, got {args.precondition_rank}")
    if args.train_rows and not args.rows_per_task and args.tasks_per_epoch > args.train_rows:  # (tasks of no rows)
        raise litz.ConfigError(f"--tasks-per-epoch ({args.tasks_per_epoch}) must not exceed --train-rows "
                               f"({args.train_rows}): each task covers 1/T of an executor's rows")
    if args.blocks > dim + 1:
        raise litz.ConfigError(f"--blocks must not exceed the {dim + 1} weight rows (bias included), got {args.blocks}")
    table = litz.Table("W", shape=(_block_rows(dim, args.blocks), NUM_CLASSES), dtype="float32",
                       num_rows=args.blocks)
    config = {"epochs": args.epochs, "staleness": args.staleness, "tasks_per_epoch": args.tasks_per_epoch,
              "rows_per_task": args.rows_per_task,
              "batch_size": args.batch_size, "lr0": args.lr, "lr_decay": args.lr_decay, "l2": args.l2,
              "blocks": args.blocks, "dim": dim, "precondition_rank": args.precondition_rank,
              "train_rows": args.train_rows, "seed": args.seed, "device": args.device,
              "quiet": args.quiet}
    return litz.App(MLRDriver, MLRExecutor, tables=[table], config=config, name="mlr")


if __name__ == "__main__":
    from litz.cli import launch

    sys.exit(launch([__file__, *sys.argv[1:]]))
