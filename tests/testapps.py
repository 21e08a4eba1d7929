"""Small applications that the multi-process tests run (importable by the worker processes)."""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np

import litz


class CausalDriver(litz.Driver):
    """Chains read-then-increment tasks over random executors and keys, checking rule 1.

    At dispatch, it records how many increments of the key had *completed*; the task must
    read at least that many. Several tasks are kept in flight so the cache is exercised.
    """

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        self.rng = random.Random(cfg.get("seed", 0))
        self.keys = cfg["keys"]
        self.total = cfg["tasks"]
        self.completed = [0] * self.keys
        self.required: dict[int, tuple[int, int]] = {}
        self.violations: list[tuple[int, int, float, int]] = []
        self.dispatched = 0
        self.done = 0
        for _ in range(cfg["inflight"]):
            self._next()

    def _next(self) -> None:
        if self.dispatched >= self.total:
            return
        key = self.rng.randrange(self.keys)
        e = self.rng.randrange(self.num_executors)
        tid = self.dispatch_task(e, {"key": key})
        self.required[tid] = (key, self.completed[key])
        self.dispatched += 1

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        key, need = self.required.pop(result.task_id)
        if result.value < need:
            self.violations.append((result.task_id, key, result.value, need))
        self.completed[key] += 1
        self.done += 1
        if self.done == self.total:
            final = self.ps.get_many("c", range(self.keys))[:, 0]
            self.finish({"violations": self.violations, "completed": self.completed, "final": final.tolist()})
            return
        self._next()


class CausalExecutor(litz.Executor):
    def run_task(self, args: dict) -> float:
        key = args["key"]
        value = float(self.ps.get("c", key)[0])
        self.ps.update("c", key, np.ones(2))
        return value


class PrefetchingCausalExecutor(CausalExecutor):
    """Hints the key it will read; for some keys the hint names an unknown table or raises,
    which must only cost the task its prefetch."""

    def prefetch(self, args: dict) -> list:
        if args["key"] % 3 == 0:
            return [("no-such-table", [0])]
        if args["key"] % 3 == 1:
            raise ValueError("a broken hint")
        return [("c", [args["key"]])]


def causal_app(keys: int = 8, tasks: int = 600, inflight: int = 6, executors: int = 8, seed: int = 0,
               executor: type[litz.Executor] = CausalExecutor) -> litz.App:
    return litz.App(CausalDriver, executor, tables=[litz.Table("c", (2,), "float64", num_rows=keys)],
                    num_executors=executors,
                    config={"keys": keys, "tasks": tasks, "inflight": inflight, "seed": seed})


class RoundsDriver(litz.Driver):
    """Rounds of one task per executor, all dispatched at once (same version): exercises the cache."""

    def dispatch_initial_tasks(self) -> None:
        self.round = 0
        self.left = 0
        self.reads = 0
        self._round()

    def _round(self) -> None:
        self.left = self.num_executors
        for e in range(self.num_executors):
            self.dispatch_task(e, {"round": self.round})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.reads += result.value
        self.left -= 1
        if self.left == 0:
            self.round += 1
            if self.round == self.config["rounds"]:
                self.finish({"reads": self.reads})
            else:
                self._round()


class RoundsExecutor(litz.Executor):
    def run_task(self, args: dict) -> int:
        rows = self.ps.get_many("w", range(4))
        again = self.ps.get_many("w", range(4))  # same version: must come from the cache
        assert rows.shape == again.shape == (4, 16)
        return 8


class FramesDriver(RoundsDriver):
    """Rounds in which every executor reads the whole table and adds one to every row."""

    def dispatch_initial_tasks(self) -> None:
        self.results: list[dict] = []
        super().dispatch_initial_tasks()

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.results.append(result.value)
        self.left -= 1
        if self.left == 0:
            self.round += 1
            if self.round == self.config["rounds"]:
                self.finish({"results": self.results, "final": self.ps.get_many("f", range(self.config["rows"]))})
            else:
                self._round()


class FramesExecutor(litz.Executor):
    """Reads every row into a buffer it reuses (``get_many(out=...)``), checks that it sees every
    earlier round's increments, adds one to every row; also tries an ``out`` of the wrong shape."""

    def run_task(self, args: dict) -> dict:
        n = self.config["rows"]
        if not hasattr(self, "buf"):
            self.buf = np.zeros((n, 8))
        rows = self.ps.get_many("f", range(n), out=self.buf)
        seen = float(rows.min())
        self.ps.update_many("f", range(n), np.ones((n, 8)))
        try:
            self.ps.get_many("f", range(n), out=np.empty((n, 7)))
            refused = None
        except litz.TableError as exc:
            refused = str(exc)
        return {"round": args["round"], "same_buffer": rows is self.buf, "seen": seen, "refused": refused}


class SumDriver(litz.Driver):
    """Random integer-valued updates (exact in float64) from many tasks; the driver keeps the truth."""

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        self.truth = np.zeros((cfg["rows"], 3))
        self.left = cfg["tasks"]
        self.failures: list[litz.TaskFailure] = []
        for i in range(cfg["tasks"]):
            self.dispatch_task(i % self.num_executors, {"seed": i, "bad": i in cfg.get("bad", ())})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        keys, deltas = result.value
        np.add.at(self.truth, np.asarray(keys), np.asarray(deltas))
        self._one_done()

    def handle_task_failure(self, failure: litz.TaskFailure) -> None:
        # the failed task's valid updates, made before it raised, are discarded: nothing to count
        self.failures.append(failure)
        if self.config.get("retry"):  # its second run succeeds (SumExecutor) and is counted then
            self.retry(failure)
            return
        self._one_done()

    def _one_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            final = self.ps.get_many("s", range(self.config["rows"]))
            self.finish({"truth": self.truth, "final": final,
                         "failures": [(f.executor_id, f.args, f.traceback) for f in self.failures]})


def task_updates(seed: int, rows: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, rows, size=5).tolist()
    return keys, rng.integers(-50, 50, size=(5, 3)).astype(np.float64)


class SumExecutor(litz.Executor):
    def run_task(self, args: dict) -> tuple[list[int], np.ndarray]:
        keys, deltas = task_updates(args["seed"], self.config["rows"])
        self.ps.update_many("s", keys, deltas)
        if args["bad"] and args["seed"] not in self.__dict__.setdefault("failed", set()):
            self.failed.add(args["seed"])  # a retry of this task (SumDriver, ``retry``) succeeds
            self.ps.update("s", 0, np.ones(7))  # wrong shape: refused before anything is sent
        return keys, deltas


class KernelSumExecutor(SumExecutor):
    """A SumExecutor that loads Numba kernels before its first task, as an application's executor does
    (MLR's, from Numba's cache): what a job of an application with kernels starts with."""

    def setup(self) -> None:
        from apps.mlr_kernels import warmup

        warmup()


def sum_app(rows: int = 20, tasks: int = 400, executors: int = 6, bad: tuple[int, ...] = (),
            kernels: bool = False, retry: bool = False) -> litz.App:
    return litz.App(SumDriver, KernelSumExecutor if kernels else SumExecutor,
                    tables=[litz.Table("s", (3,), "float64", num_rows=rows)],
                    num_executors=executors,
                    config={"rows": rows, "tasks": tasks, "bad": list(bad), "retry": retry})


class CrashDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        for e in range(self.num_executors):
            self.dispatch_task(e, {"n": e, "crash": e == self.config["crash_on"]})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        pass


class CrashExecutor(litz.Executor):
    def run_task(self, args: dict) -> None:
        if args["crash"]:
            raise ZeroDivisionError("boom in run_task")
        time.sleep(0.01)


class UnknownTableExecutor(litz.Executor):
    def run_task(self, args: dict) -> None:
        self.ps.get("no_such_table", 0)


class UnsendableExecutor(litz.Executor):
    def run_task(self, args: dict) -> object:
        if args["crash"]:
            import threading

            return threading.Lock()  # cannot be pickled: this task fails, the others complete
        return args["n"]


class CountingDriver(litz.Driver):
    """One task per executor; failures are recorded instead of stopping the job."""

    def dispatch_initial_tasks(self) -> None:
        self.left = self.num_executors
        self.values: list[object] = []
        self.results: list[litz.TaskResult] = []
        self.failures: list[litz.TaskFailure] = []
        for e in range(self.num_executors):
            self.dispatch_task(e, {"n": e, "crash": e == self.config["crash_on"]})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.values.append(result.value)
        self.results.append(result)
        self._done()

    def handle_task_failure(self, failure: litz.TaskFailure) -> None:
        self.failures.append(failure)
        self._done()

    def _done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.finish({"values": sorted(self.values, key=repr), "failures": [(f.executor_id, f.traceback)
                                                                                for f in self.failures],
                         "by_executor": {**{r.executor_id: r.value for r in self.results},
                                         **{f.executor_id: f.traceback for f in self.failures}}})


def _no_row_5(key: object, shape: tuple[int, ...], dtype: object) -> np.ndarray:
    if key == 5:
        raise ValueError("no row 5")
    return np.full(shape, 7.0, dtype)


class _LoadsNowhere:
    """Pickles, but does not load (as a class importable only where it was made)."""

    def __reduce__(self) -> tuple:
        return int, ("n/a",)


class BadValuesExecutor(litz.Executor):
    """Each executor's task does one thing the job must survive, reporting only that task:
    0 reads a row whose initializer raises (in one fetch with 3's good row), 1 returns a value
    that does not load on the master, 2 returns object and structured arrays, 3 reads a good
    row, 4 updates a key that is not valid text."""

    def run_task(self, args: object) -> object:
        e = self.executor_id
        if e in (0, 3):
            return float(self.ps.get("t", 5 if e == 0 else 6)[0])
        if e == 1:
            return _LoadsNowhere()
        if e == 2:
            return np.array([{"a": 1}, None], dtype=object), np.array([(1, 2.5)], dtype=[("i", "i4"), ("x", "f8")])
        self.ps.update("s", "bad-\udcff", np.ones(1))
        return None


def bad_values_app() -> litz.App:
    return litz.App(CountingDriver, BadValuesExecutor, num_executors=5, config={"crash_on": -1},
                    tables=[litz.Table("t", (1,), init=_no_row_5), litz.Table("s", (1,))])


class SlowDriver(litz.Driver):
    """Keeps every executor busy with short sleeping tasks until ``stop_after`` seconds have passed,
    or until the file ``stop_file`` exists (a test that is done with the job ends it at once)."""

    def dispatch_initial_tasks(self) -> None:
        self.t0 = time.monotonic()
        for e in range(self.num_executors):
            self.dispatch_task(e, {"sleep": 0.02})

    def progress(self) -> str:
        return f"slow job, {time.monotonic() - self.t0:.1f} s"

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        stop_file = self.config.get("stop_file")
        if time.monotonic() - self.t0 > self.config["stop_after"] or (stop_file and os.path.exists(stop_file)):
            self.finish("done")
        else:
            self.dispatch_task(result.executor_id, {"sleep": 0.02})


class SleepExecutor(litz.Executor):
    def run_task(self, args: dict) -> None:
        time.sleep(args["sleep"])


def slow_app(executors: int, stop_after: float, stop_file: str | None = None) -> litz.App:
    """Sleeping tasks on every executor for ``stop_after`` seconds, or until ``stop_file`` exists
    (:class:`SlowDriver`): a job to look at, scale or disturb while it runs."""
    return litz.App(SlowDriver, SleepExecutor, tables=[litz.Table("t", (1,))], num_executors=executors,
                    config={"stop_after": stop_after, "stop_file": stop_file})


class MigratingDriver(litz.Driver):
    """Keeps two tasks per executor in flight and moves random executors between workers all the time.

    Each executor counts its tasks in its (migrating) state; task k of an executor must see count k,
    so a task lost, run twice or run on stale state shows up as a wrong count.
    """

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        self.rng = random.Random(cfg["seed"])
        self.truth = np.zeros((cfg["rows"], 3))
        self.next_seq = [0] * self.num_executors
        self.done_seq: list[list[int]] = [[] for _ in range(self.num_executors)]
        self.moves = 0
        self.shard_moves = 0
        self.left = cfg["tasks"]
        for e in range(self.num_executors):
            for _ in range(2):
                self._send(e)

    def _maybe_read(self) -> None:
        if self.config.get("driver_reads"):  # the driver reads the table all the time (recovery tests)
            self.ps.get_many("s", range(self.config["rows"]))

    def _send(self, e: int) -> None:
        if sum(self.next_seq) >= self.config["tasks"]:
            return  # exactly `tasks` tasks: at the end none is in flight, so the sums are final
        seq = self.next_seq[e]
        self.next_seq[e] += 1
        self.dispatch_task(e, {"seq": seq, "seed": e * 100_000 + seq})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        seen, keys, deltas = result.value
        np.add.at(self.truth, np.asarray(keys), np.asarray(deltas))
        self.done_seq[result.executor_id].append(seen)
        self.left -= 1
        if self.left == 0:
            final = self.ps.get_many("s", range(self.config["rows"]))
            self.finish({"truth": self.truth, "final": final, "done_seq": self.done_seq, "moves": self.moves,
                         "shard_moves": self.shard_moves})
            return
        self._send(result.executor_id)
        self._maybe_read()
        self._maybe_move()

    def _maybe_move(self) -> None:
        if self.rng.random() < self.config.get("shard_move_prob", 0.0):
            master = self._master  # test-only, as below
            shard = self.rng.randrange(self.config["rows"])  # the shards that hold rows (key % 64)
            if master.move_shards([shard], self.rng.choice(master.state.servers)):
                self.shard_moves += 1
        if self.rng.random() < self.config["move_prob"]:
            master = self._master  # test-only: elasticity is driven by the framework, not by apps
            workers = master.state.workers
            e = self.rng.randrange(self.num_executors)
            if master.move_executors([e], self.rng.choice(workers), ship_input=self.rng.random() < 0.5):
                self.moves += 1


class CountingStateExecutor(litz.Executor):
    def load_input(self) -> np.ndarray:
        return np.full(3, self.executor_id, np.float64)  # reloadable: derived from the id

    def init_state(self) -> dict:
        return {"count": 0, "trail": np.zeros(4)}

    def run_task(self, args: dict) -> tuple[int, list[int], np.ndarray]:
        seen = self.state["count"]
        self.state["count"] += 1
        self.state["trail"] += 1  # mutable arrays in state must stay writable after a move
        assert self.input[0] == self.executor_id
        keys, deltas = task_updates(args["seed"], self.config["rows"])
        rows = self.ps.get_many("s", keys)  # reads go through forwarding too
        assert rows.shape == (len(keys), 3)
        self.ps.update_many("s", keys, deltas)
        if args["seq"] % 3 == 0:
            time.sleep(0.001)
        if self.executor_id == 0:
            time.sleep(self.config.get("slow_task", 0.0))
        return seen, keys, deltas

    def setup(self) -> None:
        if self.state["count"]:  # arriving by a migration (or restored): slowly, if the test says so
            time.sleep(self.config.get("slow_arrival", 0.0))


def failing_distance(value: np.ndarray, saved: np.ndarray) -> float:
    """A table distance with a bug, for the checkpoint error path."""
    raise RuntimeError("no distance today")


def migrating_app(tasks: int = 1500, executors: int = 12, move_prob: float = 0.25, seed: int = 0,
                  shard_move_prob: float = 0.0, distance: Any = "l2") -> litz.App:
    return litz.App(MigratingDriver, CountingStateExecutor,
                    tables=[litz.Table("s", (3,), "float64", num_rows=16, distance=distance)],
                    num_executors=executors,
                    config={"rows": 16, "tasks": tasks, "move_prob": move_prob, "seed": seed,
                            "shard_move_prob": shard_move_prob})


class TimedMigratingDriver(MigratingDriver):
    """MigratingDriver that stops dispatching after ``stop_after`` seconds (or once the file
    ``stop_file`` exists, if configured) and finishes when all are done."""

    def dispatch_initial_tasks(self) -> None:
        self.t0 = time.monotonic()
        self.inflight = 0
        super().dispatch_initial_tasks()

    def _stopping(self) -> bool:
        stop_file = self.config.get("stop_file")
        return time.monotonic() - self.t0 > self.config["stop_after"] or bool(stop_file and os.path.exists(stop_file))

    def _send(self, e: int) -> None:
        if self._stopping():
            return
        self.inflight += 1
        super()._send(e)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.inflight -= 1
        seen, keys, deltas = result.value
        np.add.at(self.truth, np.asarray(keys), np.asarray(deltas))
        self.done_seq[result.executor_id].append(seen)
        if self.inflight == 0 and self._stopping():
            final = self.ps.get_many("s", range(self.config["rows"]))
            self.finish({"truth": self.truth, "final": final, "done_seq": self.done_seq, "moves": self.moves})
            return
        self._send(result.executor_id)
        self._maybe_read()
        if not self._stopping():
            self._maybe_move()


class StrikingDriver(TimedMigratingDriver):
    """Strikes once (``strike``), 0.4 s after a checkpoint is complete, so that there is work
    after the checkpoint to redo. Test-only: it drives the framework from inside the master."""

    transient = ("struck", "checkpointed")  # a full recovery must not make it strike again

    def dispatch_initial_tasks(self) -> None:
        self.struck: dict[str, Any] | None = None
        self.checkpointed: float | None = None
        super().dispatch_initial_tasks()

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        super().handle_task_completion(result)
        master = self._master
        if self.checkpointed is None and any(c.get("ok") for c in master.checkpoints.completed):
            self.checkpointed = time.monotonic()
        if self.struck is None and not self._finished and self.checkpointed is not None \
                and time.monotonic() - self.checkpointed >= 0.4:
            self.struck = self.strike(master)

    def strike(self, master: Any) -> dict[str, Any]:
        raise NotImplementedError

    def recovered(self, recovery: litz.Recovery) -> None:
        super().recovered(recovery)
        if self.struck is not None:
            self.struck.setdefault("restored_shards", []).extend(recovery.shards)

    @staticmethod
    def kill(master: Any, ident: str) -> list[int]:
        """SIGKILL ``ident``; returns the executors it hosted."""
        os.kill(master.procs[ident]["pid"], signal.SIGKILL)
        return master.state.executors_of(ident)

    def finish(self, result: object = None) -> None:
        assert isinstance(result, dict)
        super().finish({**result, "struck": self.struck})


class KillMidMigrationDriver(StrikingDriver):
    """Starts one migration (executor 0 to another worker, or shard 0 to another server:
    ``kind``) and SIGKILLs one end of it (``victim``: source or dest): at once, or with
    ``after_ship`` at the first completion that many seconds after the master told the source
    to ship (shards: after the move started). With ``slow_task`` executor 0 is always in a
    task, so at once means before the source ships it; with ``slow_arrival`` the destination
    takes that long to install it, so ``after_ship`` means shipped but not yet reported."""

    def strike(self, master: Any) -> dict[str, Any]:
        st, kind = master.state, self.config["kind"]
        if kind == "executors":
            source = st.placement[0]
            dest = next(w for w in st.workers if w != source)
            mids = master.move_executors([0], dest, ship_input=False)
        else:
            source = st.shard_map[0]
            dest = next(s for s in st.servers if s != source)
            mids = master.move_shards([0], dest)
        struck = {"mid": mids[0], "source": source, "dest": dest}
        if kind == "executors":
            on_ship_ready = master.on_ship_ready

            def spy(msg: Any) -> None:  # test-only: note when the master says "ship"
                on_ship_ready(msg)
                if msg["mid"] == struck["mid"]:
                    struck.setdefault("ship", time.monotonic())

            master.on_ship_ready = spy
        else:
            struck["ship"] = time.monotonic()
        self._maybe_kill(master, struck)
        return struck

    def _maybe_kill(self, master: Any, struck: dict[str, Any]) -> None:
        after = self.config.get("after_ship")
        if "victim" in struck or (after is not None and time.monotonic() - struck.get("ship", math.inf) < after):
            return
        victim = struck[self.config["victim"]]
        hosted = self.kill(master, victim)
        struck.update(victim=victim, restored=[e for e in hosted if e != 0])

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        super().handle_task_completion(result)
        if self.struck is not None and not self._finished:
            self._maybe_kill(self._master, self.struck)


class KillDuringScaleDriver(StrikingDriver):
    """SIGKILLs ``victim`` and at once starts a scale-in to ``scale`` (``{"workers": 2}``, say):
    the master learns of the death only after the scale-in started its migrations, some of
    them from or to the dead process."""

    def strike(self, master: Any) -> dict[str, Any]:
        hosted = self.kill(master, self.config["victim"])
        master.elastic.on_command({"id": "test-scale", **self.config["scale"]})
        return {"victim": self.config["victim"], "hosted": hosted}


_LOADS = [0]


class OneLoadPerProcessExecutor(litz.Executor):
    """Its input cannot be loaded twice in one process (simulates unreadable shared storage)."""

    def load_input(self) -> None:
        _LOADS[0] += 1
        if _LOADS[0] > 1:
            raise OSError("shared storage unreachable")

    def run_task(self, args: dict) -> None:
        time.sleep(0.01)


class MoveOnceDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        self.moved = False
        for e in range(self.num_executors):
            self.dispatch_task(e, {})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        if not self.moved:
            self.moved = True
            master = self._master  # test-only
            master.move_executors([1], master.state.placement[0], ship_input=False)
        self.dispatch_task(result.executor_id, {})


class CheckpointingDriver(MigratingDriver):
    """MigratingDriver that asks for a checkpoint after ``checkpoint_at`` completions and, if
    ``stop_at`` is set, ends early (abandoning its tasks) once that many completed and the
    checkpoint is written. Resumed, it records the tables as it finds them."""

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.completions = getattr(self, "completions", 0) + 1
        if self.completions == self.config.get("checkpoint_at"):
            assert self.checkpoint()
        stop_at = self.config.get("stop_at")
        if stop_at and self.completions >= stop_at and self._master.checkpoints.completed:  # test-only access
            self.finish({"stopped_early": True})
            return
        super().handle_task_completion(result)

    def resumed(self) -> None:
        self.at_resume = self.ps.get_many("s", range(self.config["rows"]))
        self.resumed_at = self.completions

    def finish(self, result: object = None) -> None:
        if isinstance(result, dict) and hasattr(self, "at_resume"):
            result = {**result, "at_resume": self.at_resume, "resumed_at": self.resumed_at}
        super().finish(result)


# -- SCAR priority checkpoints of executor state (Executor.state_rows) ---------------------------

def rows_value(k: int, rows: int) -> np.ndarray:
    """Each state row's value after an executor's first ``k`` tasks: task t adds t + 1 to the
    rows i with (i + t) % 3 == 0 (every element of a row holds that value)."""
    out = np.zeros(rows, np.int64)
    for t in range(k):
        out[(np.arange(rows) + t) % 3 == 0] += t + 1
    return out


class RowsExecutor(litz.Executor):
    """State: ``rows`` rows of lengths 0, 1, 2, 3, 0, ... (``values`` and ``ptr``) and ``done``,
    the tasks run. Each task first reports its state as it found it; after its first k tasks an
    executor's row i holds ``rows_value(k)[i]`` until a restore mixes rows of different ages."""

    def init_state(self) -> dict:
        n = self.config["rows"]
        ptr = np.concatenate([[0], np.cumsum(np.arange(n) % 4)]).astype(np.int64)
        return {"values": np.zeros(ptr[-1], np.int64), "ptr": ptr, "done": 0}

    def run_task(self, args: dict) -> dict:
        st = self.state
        start = st["values"].copy()
        k = st["done"]
        lengths = np.diff(st["ptr"])
        st["values"] += np.repeat(np.where((np.arange(len(lengths)) + k) % 3 == 0, k + 1, 0), lengths)
        st["done"] = k + 1
        time.sleep(self.config["sleep"])
        return {"start": start, "k": k}

    def state_rows(self) -> litz.StateRows:
        return litz.StateRows(self.state["values"].copy(), self.state["ptr"])

    def restore_rows(self, rows: dict[int, np.ndarray]) -> None:
        ptr = self.state["ptr"]
        for i, values in rows.items():
            self.state["values"][ptr[i]:ptr[i + 1]] = values


class RowsDriver(litz.Driver):
    """Runs ``tasks`` tasks on every executor, one at a time each; an iteration is 3 tasks of every
    executor (then every non-empty row has changed). Keeps the state the first task after a partial
    recovery found on each restored executor (``after``); until iteration ``move_until``, moves an
    executor with probability ``move_prob`` per completion."""

    def dispatch_initial_tasks(self) -> None:
        self.done = [0] * self.num_executors
        self.after: dict[int, np.ndarray] = {}
        self.waiting_after: set[int] = set()
        self.rng = random.Random(0)
        self.moves = 0
        for e in range(self.num_executors):
            self.dispatch_task(e, {})

    @property
    def iteration(self) -> int:
        return min(self.done) // 3

    def recovered(self, recovery: litz.Recovery) -> None:
        self.waiting_after |= set(recovery.executors)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        e = result.executor_id
        if e in self.waiting_after:
            self.waiting_after.discard(e)
            self.after[e] = result.value["start"]
        self.done[e] += 1
        if self.done[e] < self.config["tasks"]:
            self.dispatch_task(e, {})
        elif min(self.done) >= self.config["tasks"]:
            self.finish({"after": self.after, "done": self.done, "moves": self.moves})
            return
        if self.iteration < self.config["move_until"] and self.rng.random() < self.config["move_prob"]:
            master = self._master  # test-only: elasticity is driven by the framework, not by apps
            if master.move_executors([self.rng.randrange(self.num_executors)], self.rng.choice(master.state.workers)):
                self.moves += 1

    def progress(self) -> str:
        return f"iteration {self.iteration}"


def rows_app(tasks: int = 150, rows: int = 40, executors: int = 4, sleep: float = 0.01,
             move_prob: float = 0.0, move_until: int = 0) -> litz.App:
    return litz.App(RowsDriver, RowsExecutor, tables=[litz.Table("t", (1,), "float64", num_rows=1)],
                    num_executors=executors,
                    config={"tasks": tasks, "rows": rows, "sleep": sleep, "move_prob": move_prob,
                            "move_until": move_until})


class BrokenRowsExecutor(RowsExecutor):
    """A row distance with a bug, for the partial checkpoint error path."""

    def row_distances(self, now: litz.StateRows, saved: litz.StateRows) -> np.ndarray:
        raise RuntimeError("no rows today")


class UnrestorableRowsExecutor(RowsExecutor):
    """Rows that cannot be restored, for the recovery error path."""

    def restore_rows(self, rows: dict[int, np.ndarray]) -> None:
        raise RuntimeError("no restore today")


class BrokenWarmUp(litz.Combiner):
    """A combiner whose kernel cannot be prepared (``warm_up`` raises): the job must not start."""

    name = "broken"

    def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
        acc += upd
        return acc

    def warm_up(self) -> None:
        raise RuntimeError("kernel library missing")


class StuckWarmUp(BrokenWarmUp):
    """A combiner whose preparation never ends on server s0 (the job must not wait for ever)."""

    name = "stuck"

    def warm_up(self) -> None:
        if "s0" in sys.argv:  # the launcher starts it with ``--id s0``
            time.sleep(600)


class NumbaStateDriver(litz.Driver):
    """One task per executor; finishes with what each reported (executor id -> value)."""

    def dispatch_initial_tasks(self) -> None:
        self.values: dict[int, Any] = {}
        for e in range(self.num_executors):
            self.dispatch_task(e, {})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.values[result.executor_id] = result.value
        if len(self.values) == self.num_executors:
            self.finish(self.values)


class NumbaStateExecutor(litz.Executor):
    """Reports whether its process found Numba's CPU target initialised (without touching Numba): a
    process forked from a zygote that warmed Numba up did (litz/runtime/spawner.py)."""

    def run_task(self, args: dict) -> dict[str, Any]:
        registry = sys.modules.get("numba.core.registry")
        # Numba's typing context is created empty and fills its registries at the first compilation
        # or cache load (what costs 0.6 s): look without creating it
        typing = vars(registry.cpu_target).get("_toplevel_typing_context") if registry is not None else None
        return {"pid": os.getpid(), "numba_imported": "numba" in sys.modules,
                "target_ready": typing is not None and len(typing._functions) > 0}


def numba_state_app(executors: int = 2) -> litz.App:
    return litz.App(NumbaStateDriver, NumbaStateExecutor, num_executors=executors)


# -- the application's own code failing inside the runtime --------------------------------------

class StatelessExecutor(CountingStateExecutor):
    """CountingStateExecutor whose ``get_state`` raises: checkpoints and migrations cannot take it."""

    def get_state(self) -> object:
        raise RuntimeError(f"get_state boom on executor {self.executor_id}")


def _refusing_merge(acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
    raise RuntimeError("combiner boom")


class RefusedUpdateDriver(litz.Driver):
    """One task per executor, each adding to row 0 of a table whose combiner raises (on the server):
    records every completion it is handed in ``seen`` (the driver runs in the test's process)."""

    seen: list[int] = []

    def dispatch_initial_tasks(self) -> None:
        for e in range(self.num_executors):
            self.dispatch_task(e, None)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        RefusedUpdateDriver.seen.append(result.executor_id)
        if len(RefusedUpdateDriver.seen) == self.num_executors:
            self.finish(self.ps.get("t", 0))


class AddOneExecutor(litz.Executor):
    def run_task(self, args: object) -> None:
        self.ps.update("t", 0, np.ones(2))


def refused_update_app(executors: int = 2) -> litz.App:
    return litz.App(RefusedUpdateDriver, AddOneExecutor, num_executors=executors,
                    tables=[litz.Table("t", (2,), combiner=litz.Combiner.of(_refusing_merge, name="refusing"))])


class AbandoningDriver(litz.Driver):
    """Executor 1 sleeps for ``sleep`` s; the driver finishes on executor 0's completion, abandoning
    it, with the executor and when it finished (``time.monotonic()``)."""

    def dispatch_initial_tasks(self) -> None:
        self.dispatch_task(1, {"sleep": self.config["sleep"]})
        self.dispatch_task(0, {"sleep": 0.0})

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.finish({"executor": result.executor_id, "at": time.monotonic()})


class StrayMessagesDriver(MigratingDriver):
    """MigratingDriver that, at its 20th completion, has a peer outside the job send well-formed but
    wrong messages to the master and to worker w0: reports of tasks that do not exist, a malformed
    report, an error about a migration, a message the master never takes, a shutdown."""

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.completions = getattr(self, "completions", 0) + 1
        if self.completions == 20:
            from litz.runtime.transport import Endpoint

            master = self._master  # test-only access: the addresses
            stray = Endpoint("stray")
            try:
                stray.connect("master", master.endpoint.address)
                stray.connect("w0", master.procs["w0"]["addr"])
                stray.send("master", "done", completed=[[987654321, None]], failed=[])
                stray.send("master", "done", completed=[5], failed=[[123456789, "tb"]])
                stray.send("master", "error", reason="evil", about="migrate_out")
                stray.send("master", "tasks", tasks=[])
                stray.send("w0", "shutdown", reason="evil")
                time.sleep(0.3)  # delivered before the endpoint closes
            finally:
                stray.close()
        super().handle_task_completion(result)

    def finish(self, result: object = None) -> None:
        if isinstance(result, dict):
            result = {**result, "deferred": list(self._master._deferred)}
        super().finish(result)


class AliasingExecutor(litz.Executor):
    """Returns its own state array (changed again by its next task) and tries to write into a row
    it read (shared with every task of the process through the cache)."""

    def init_state(self) -> np.ndarray:
        return np.zeros(3)

    def run_task(self, args: object) -> dict:
        self.state += 1
        self.ps.update("t", 0, np.ones(1))
        row = self.ps.get("t", 0)
        try:
            row[0] = 99.0
            wrote = True
        except ValueError:
            wrote = False
        return {"state": self.state, "wrote": wrote}


class QueueFiveDriver(litz.Driver):
    def dispatch_initial_tasks(self) -> None:
        self.results: dict[int, object] = {}
        for i in range(5):
            self.dispatch_task(0, i)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.results[result.args] = result.value
        if len(self.results) == 5:
            self.finish(self.results)



class BadInputExecutor(litz.Executor):
    """Executor 1 cannot load its input."""

    def load_input(self) -> None:
        if self.executor_id == 1:
            raise FileNotFoundError("no partition 1 on this host")


class StragglerDriver(litz.Driver):
    """Keeps every executor busy, one task at a time each, for ``stop_after`` seconds; then
    reads the table, in which each task of executor e added 1 to row e."""

    def dispatch_initial_tasks(self) -> None:
        self.t0 = time.monotonic()
        self.seqs: list[list[int]] = [[] for _ in range(self.num_executors)]
        self.running = self.num_executors
        for e in range(self.num_executors):
            self.dispatch_task(e, None)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.seqs[result.executor_id].append(result.value)
        if time.monotonic() - self.t0 < self.config["stop_after"]:
            self.dispatch_task(result.executor_id, None)
            return
        self.running -= 1
        if not self.running:
            table = self.ps.get_many("t", list(range(self.num_executors)))[:, 0]
            self.finish({"seqs": self.seqs, "table": table.tolist()})


class SlowHostExecutor(litz.Executor):
    """A task sleeps ``slow`` seconds on the worker named ``slow_worker`` (a busy host), else
    ``fast``; it counts its tasks in its state and adds 1 to row ``executor_id``."""

    def init_state(self) -> dict:
        return {"count": 0}

    def run_task(self, args: None) -> int:
        with open("/proc/self/comm") as f:
            here = f.read().strip()
        time.sleep(self.config["slow"] if here == f"litz-{self.config['slow_worker']}" else self.config["fast"])
        self.state["count"] += 1
        self.ps.update_many("t", [self.executor_id], np.ones((1, 1)))
        return self.state["count"]


def straggler_app(executors: int, stop_after: float, slow: float, fast: float, slow_worker: str = "w0") -> litz.App:
    return litz.App(StragglerDriver, SlowHostExecutor, tables=[litz.Table("t", (1,), "float64")],
                    num_executors=executors,
                    config={"stop_after": stop_after, "slow": slow, "fast": fast, "slow_worker": slow_worker})
