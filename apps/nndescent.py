"""Approximate k-nearest-neighbour graph by NN-Descent, distributed over Litz executors.

Also a building block: any driver can run an :class:`NNDescentPhase` and any executor can serve
its tasks with :func:`nndescent_run_task` (apps/hdbscan.py builds its mutual-reachability graph so).

**Where the graph lives.** Table ``knn`` (:func:`knn_table`) holds every point's list of ``k``
neighbours; a row is a *block* of ``block`` consecutive points (default 64), shape
``(block, 3k)`` float32: per point ``[ids | squared Euclidean distances | new flags]``, sorted by
distance, padded with id -1 (layout and merge rule: apps/nndescent_kernels.py). Rows are blocks
because the runtime pays per key: 70,000 points are 1,094 keys, not 70,000. Ids are exact in
float32 below 2**24 points, far beyond what one host's executors can hold. The combiner
(:class:`KeepKNearest`) keeps the ``k`` nearest distinct ids; it is associative, commutative and
idempotent, so candidate lists from any executors merge in any order, in a worker's update log
or on a server, and a list sent twice does no harm.

**Who holds what.** Every executor holds the whole data matrix, read-only (:class:`NNDInput`):
the join compares a point's candidates, which are anywhere in the data set, so a partition of the
rows would force every distance through the network. On one host this costs nothing: Fashion-MNIST
is a memory map of the decoded cache shared by all processes, and synthetic data is regenerated
from its seed. The input is reloadable either way. An executor *owns* a partition of the points
(``owned``): it samples their candidates, joins them, and maintains their new/old flags.

**Initial lists** (one task per executor): the leaves of random-projection trees over all points
(``TREES`` = 8; on Fashion-MNIST they cut the rounds from 9 to 5 and the time by two thirds), then
random points for lists still short (none with leaves of 30 points), as pynndescent does. Every
worker process builds the trees once (they are pure functions of the data and the seed; its
executors share them), only the branches that hold its executors' points, and each executor offers
the leaves' pairs to its own points only, so it sends only its own rows. (Before, each executor
built one tree and offered its leaves to every point: eight full copies of the graph went through
the servers.) Data of more than
``TREE_DIMS`` dimensions is split in a random projection of it (:func:`tree_space`).

**Locality.** An app may renumber the points first with :func:`locality_order` (the leaves of one
random-projection tree, depth first; apps/hdbscan.py and this app's ``--order``, the default, do),
so that an executor's contiguous range of ids is a region of space. Most neighbours of an owned
point are then owned too: the offers to other executors' points fall on few blocks (at 2**18
blobs, 4 times fewer bytes per round), and the join's reads of the data and the lists hit the
cache (half the kernel time on the blobs; on Fashion-MNIST, whose 3 KB rows miss the cache at
random, a third less time per round). Every executor checks at its first task that it sees the
same points as the others (a digest of sampled rows, :func:`data_fingerprint`): processes that
renumbered differently would otherwise build a graph that mixes numberings without any error.

**One round = one task per executor** (pynndescent's algorithm, distributed). The executors own
contiguous ranges of points (:meth:`NNDInput.partition`), so each knows whose a point is.

1. read the executor's own lists and the lists its marks name (below): the lists of its points'
   neighbours, and those that point at its points (its reverse edges are there);
2. sample each owned point's candidates: its neighbours and its reverse neighbours (points that
   list it), new and old separately, ``max_candidates`` each by a priority hashed from
   (seed, round, edge), so every executor agrees on every edge's priority; mark the sampled new
   neighbours old;
3. local join: compare each owned point's new candidates with each other and with its old ones;
   offer each point of a pair to the other's list;
4. send what changed, the offers accepted and the flags, as updates of the ``knn`` table, and the
   marks of the new edges.

**Marks** (table ``knn-mark``): whoever makes an edge ``i -> j`` (the first lists, an offer) marks
``j``'s block for ``i``'s owner and ``i``'s block for ``j``'s owner, one flag per executor and
block. Marks are never taken back: an edge that leaves a list leaves a mark that costs a read, not
a wrong result. So every edge that touches an owned point is in the lists of step 1, and the
candidates, the offers and the update are exactly those of the same executor's round on the whole
graph (:func:`~apps.nndescent_kernels.nnd_round`, tested round after round). Marks lost with a
server cost reverse candidates, never correctness: an executor checks that it has its points'
neighbours' lists and reads the missing ones, and the refill after the loss marks every edge of
the owned lists again. The new/old flags live in the table, not in executor state: an executor
needs the flags of the edges that point *to* its points, and they belong to other points' lists;
executors keep no state between rounds, so they can move or be lost between them.

**The d_max filter.** ``d_max(x)``, the distance of ``x``'s k-th neighbour, reaches every executor
with the rows it reads in step 1 (it is the row's last distance). An offer ``(x, y, d)`` with
``d >= d_max(x)`` cannot enter ``x``'s list, so it is dropped before sending; offers that pass
tighten the executor's copy of the list, so later offers face a smaller ``d_max``. Without the
filter (``--no-filter``, for comparison) an executor sends, for every point it does not own, the
``k`` nearest offers it found (combined locally, which is what its update log would do anyway).
:attr:`NNDescentPhase.stats` counts the offers sent both ways.

**Stopping.** A round's *updates* are the offers that entered the lists as the executors read
them (an upper bound of the changes on the servers: two executors may find the same pair). The
phase stops after the first round with fewer than ``delta * n * k`` updates (pynndescent's rule,
``delta`` = 0.001) or after ``max_rounds``.

**Scaling.** A round reads each executor's own lists and the marked ones around them. Before, each
worker process read the whole graph every round (``3k`` floats per point) and each executor scanned
all of it for reverse neighbours: at 2**19 points and k = 15, 94 MB per worker process per round,
1.1 GB a round for 12 of them. Counted in one process at 2**19 points of HDBSCAN's 10-d blobs
(blocks of 64 points, 8,192 in all), rounds 1-5: with 12 executors each read 1,650-3,700 blocks
(median 2,570); with 2, a border in 10 dimensions is most of the graph (6,500-7,850 blocks).

Run it:  ``litz launch apps/nndescent.py [--data fashion-mnist|blobs] [--k 15] [--points N]``
Last line printed: ``recall 0.9xx`` (against exact neighbours of a sample of query points).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import litz
from apps import gpu
from apps import nndescent_kernels as nk
from apps.options import require_at_least, seed

#: Points per row of the ``knn`` table.
BLOCK = 64
#: Ids are stored in float32: exact below this.
MAX_POINTS = 2**24
#: Random-projection trees of the initial lists (each worker process builds them once, pruned to its points).
TREES = 8
#: Trees over data of more dimensions split a random Gaussian projection of it to this many
#: (:func:`tree_space`): as good leaves for a fraction of the cost.
TREE_DIMS = 128
#: Blocks per ``get_many`` when the driver reads the graph.
READ_CHUNK = 512

DEFAULTS: dict[str, Any] = {"k": 15, "delta": 0.001, "max_rounds": 30, "queries": 1000}


# ----------------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------------


class KeepKNearest(litz.Combiner):
    """Merge neighbour lists: per point, the ``k`` nearest distinct ids, sorted (Numba kernel).

    Associative, commutative and idempotent (see apps/nndescent_kernels.py): updates may merge in
    any grouping and order, and a repeated one changes nothing.
    """

    name = "keep-k-nearest"
    atomic = True  # ``_check`` raises before any list is merged

    def __init__(self, k: int) -> None:
        self.k = int(k)

    def _check(self, acc_shape: tuple[int, ...], upd_shape: tuple[int, ...]) -> int:
        """The list width ``3k``, once the shapes agree with it and with each other."""
        width = 3 * self.k
        if acc_shape[-1] != width or upd_shape != acc_shape:
            raise ValueError(f"keep-k-nearest(k={self.k}): lists of width {width} expected, "
                             f"got {acc_shape} and {upd_shape}")
        return width

    def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
        width = self._check(acc.shape, upd.shape)
        work = acc if acc.flags.c_contiguous and acc.dtype == np.float32 else np.ascontiguousarray(acc, np.float32)
        nk.merge_lists(work.reshape(-1, width), np.ascontiguousarray(upd, np.float32).reshape(-1, width), self.k)
        if work is not acc:
            acc[...] = work
        return acc

    def warm_up(self) -> None:
        nk.merge_lists(nk.empty_lists(1, self.k), nk.empty_lists(1, self.k), self.k)

    def merge_many(self, accs: list[np.ndarray], upds: np.ndarray) -> None:
        """All rows in one kernel call (a server merges thousands of blocks per round; a call per
        block costs about twice the kernel's time). Rows listed twice merge one at a time."""
        if len(accs) < 2 or len({id(a) for a in accs}) < len(accs):
            super().merge_many(accs, upds)
            return
        width = self._check(accs[0].shape, upds.shape[1:])
        work = np.stack(accs).astype(np.float32, copy=False)
        nk.merge_lists(work.reshape(-1, width), np.ascontiguousarray(upds, np.float32).reshape(-1, width), self.k)
        for acc, row in zip(accs, work, strict=True):
            acc[...] = row


def _empty_block(key: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The initial row: every list empty (id -1, distance +inf)."""
    return nk.empty_lists(shape[0], shape[1] // 3).astype(dtype, copy=False)


def num_blocks(n_points: int, block: int = BLOCK) -> int:
    return -(-n_points // block)


def lists_changed(value: np.ndarray, saved: np.ndarray) -> float:
    """A row's distance from its saved self, for priority checkpoints: how many of its lists'
    neighbours the saved row lacks, i.e. what restoring it would lose. (The default L2 would mix
    ids, distances and flags, and its ``inf - inf`` in empty slots made every partial round fail.)"""
    k = value.shape[-1] // 3
    ids = value[..., :k].reshape(-1, k, 1)
    was = saved[..., :k].reshape(-1, 1, k)
    found = (ids == was).any(axis=2)
    return float(((ids[..., 0] >= 0) & ~found).sum())


def knn_table(n_points: int, k: int, name: str = "knn", *, block: int = BLOCK) -> litz.Table:
    """The neighbour-list table: ``ceil(n / block)`` rows of shape ``(block, 3k)`` float32, combiner
    :class:`KeepKNearest`. Point ``i`` is list ``i % block`` of row ``i // block``."""
    if not 0 < k < n_points:
        raise litz.ConfigError(f"NN-Descent needs 0 < k < number of points, got k={k}, n={n_points}")
    if n_points >= MAX_POINTS:
        raise litz.ConfigError(f"NN-Descent stores ids in float32: at most {MAX_POINTS - 1} points, got {n_points}")
    return litz.Table(name, shape=(block, 3 * k), dtype="float32", init=_empty_block, combiner=KeepKNearest(k),
                      num_rows=num_blocks(n_points, block), distance=lists_changed)


def mark_table_name(table: str) -> str:
    """The name of the mark table that goes with the neighbour-list table ``table``."""
    return f"{table}-mark"


#: Blocks per row of the mark table.
MARK_ROW = 1024


def nndescent_tables(n_points: int, k: int, *, name: str = "knn", block: int = BLOCK) -> list[litz.Table]:
    """Every table the phase needs: the neighbour lists (:func:`knn_table`) and the marks (module
    docstring). Mark row ``e * c + r`` (``c`` rows per executor) says, for blocks ``r * MARK_ROW ..``,
    whether executor ``e`` reads the block's lists (int64 0 or 1, combiner max)."""
    return [knn_table(n_points, k, name, block=block),
            litz.Table(mark_table_name(name), shape=(MARK_ROW,), dtype="int64", combiner="max")]


# ----------------------------------------------------------------------------------------------------
# the executor side
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NNDInput:
    """What an executor serving NN-Descent tasks keeps in ``self.input`` (or in ``self.input.nnd``).

    ``data``: float32 ``(n, d)``, C-contiguous, every point (read-only is fine; a memory map is best);
    ``owned``: int64 ids of the points this executor owns, which must be
    ``NNDInput.partition(n, num_executors, executor_id)``: every executor then knows whose a point
    is. Each task checks its own, and the phase checks the count and the sum of the ids at its start.
    """

    data: np.ndarray
    owned: np.ndarray

    def __post_init__(self) -> None:
        _note_owned(self.data, self.owned)

    @staticmethod
    def bounds(n: int, num_executors: int) -> np.ndarray:
        """The executors' ranges of points: executor ``e`` owns ``bounds[e] .. bounds[e + 1] - 1``."""
        return np.linspace(0, n, num_executors + 1).round().astype(np.int64)

    @staticmethod
    def partition(n: int, num_executors: int, executor_id: int) -> np.ndarray:
        """Contiguous, nearly equal ranges (:meth:`bounds`): an executor's own lists then fill few table rows."""
        bounds = NNDInput.bounds(n, num_executors)
        return np.arange(bounds[executor_id], bounds[executor_id + 1], dtype=np.int64)


def _nnd_input(executor: litz.Executor) -> NNDInput:
    inp = executor.input
    inp = inp if isinstance(inp, NNDInput) else getattr(inp, "nnd", None)
    if not isinstance(inp, NNDInput):
        raise TypeError("an executor serving NN-Descent tasks needs self.input (or self.input.nnd) to be an "
                        f"apps.nndescent.NNDInput, got {type(executor.input).__name__}")
    return inp


def nndescent_run_task(executor: litz.Executor, args: dict[str, Any]) -> dict[str, Any]:
    """Run one NN-Descent task (``args["phase"] == "nnd"``) on ``executor``; return its counters.

    ``op == "init"``: first lists for the owned points (a refill marks the lists it reads, too).
    ``op == "round"``: read the lists around the owned points, sample, join, send (module docstring).
    Everything the task needs is in ``args`` and the input.
    """
    start = time.perf_counter()
    laps = Laps(start)
    inp = _nnd_input(executor)
    n, k, block = int(args["n"]), int(args["k"]), int(args["block"])
    data, owned = inp.data, inp.owned
    if data.shape[0] != n:
        raise ValueError(f"NN-Descent over {n} points, but this executor's data has {data.shape[0]} rows")
    bounds = _partition_bounds(executor, owned, n, int(args["executors"]))
    if args["op"] == "init":
        seed = int(args["seed"])
        trees = _trees(data, seed, int(args.get("trees", 0)), max(2 * k, 30), owned)
        laps.lap("trees")
        blocks, deltas, counts = _initial_lists(data, owned, k, seed, trees, block)
        laps.lap("lists")
        if args.get("refill"):  # marks lost with a server: mark every edge of the owned lists again
            own = _own_blocks(owned, block)
            _send_marks(executor, args, bounds, own, executor.ps.get_many(args["table"], own), new_only=False)
    else:
        blocks, deltas, counts = _round(executor, data, owned, bounds, args, laps)
    if len(blocks):
        executor.ps.update_many(args["table"], blocks, deltas)
        _send_marks(executor, args, bounds, blocks, deltas)
    laps.lap("send")
    out = {"phase": "nnd", "counts": counts.tolist(), "owned": len(owned), "owned_sum": int(owned.sum()),
           "device": gpu.process_device(args.get("device", "cpu")), "seconds": time.perf_counter() - start,
           "parts": laps.parts}
    if args["op"] == "init":
        out["fingerprint"] = data_fingerprint(data)
    return out


class Laps:
    """The seconds of successive parts of a piece of work, summed by name: a task's (``trees``,
    ``lists`` / ``read``, ``sample``, ``join``; then ``send``), whose phase prints its rounds'
    slowest task's (the 16-core host's first-list tasks took twice what one such task takes alone
    on 2 cores, and the parts say where), and the HDBSCAN driver's phases."""

    def __init__(self, start: float) -> None:
        self.parts: dict[str, float] = {}
        self._t = start

    def lap(self, name: str) -> float:
        """Charge the time since the last lap (or the start) to ``name``; returns that time."""
        now = time.perf_counter()
        seconds, self._t = now - self._t, now
        self.parts[name] = self.parts.get(name, 0.0) + seconds
        return seconds


def _partition_bounds(executor: litz.Executor, owned: np.ndarray, n: int, executors: int) -> np.ndarray:
    """The executors' ranges of points, ``bounds[e] .. bounds[e + 1]``; the owned points must be
    this executor's (:meth:`NNDInput.partition`), or no executor could tell whose a point is."""
    bounds = NNDInput.bounds(n, executors)
    e = int(executor.executor_id)
    lo, hi = int(bounds[e]), int(bounds[e + 1])
    if len(owned) != hi - lo or (len(owned) and (int(owned[0]) != lo or int(owned[-1]) != hi - 1)):
        raise ValueError(f"NN-Descent: executor {e} of {executors} must own points {lo} .. {hi - 1} "
                         f"(NNDInput.partition(n, num_executors, executor_id)), but owns {len(owned)} others")
    return bounds


def _own_blocks(owned: np.ndarray, block: int) -> np.ndarray:
    """The graph blocks of an executor's points, a contiguous range (``_partition_bounds`` checked it;
    ``np.unique`` of the ids took 40 ms a task at 2**19 points)."""
    if not len(owned):
        return np.empty(0, np.int64)
    return np.arange(int(owned[0]) // block, int(owned[-1]) // block + 1, dtype=np.int64)


def _send_marks(executor: litz.Executor, args: dict[str, Any], bounds: np.ndarray, blocks: np.ndarray,
                lists: np.ndarray, new_only: bool = True) -> None:
    """Mark, for the owners of both ends of every edge in ``lists`` (rows of graph blocks ``blocks``; of
    an update, the new entries only, unless ``new_only`` is False),
    the block of the other end (:func:`~apps.nndescent_kernels.edge_marks`): those are the lists
    each owner reads in its next round. A mark already made is made again (the combiner is a max):
    remembering what was sent would be wrong after a rollback to a checkpoint, which takes marks
    back with the lists, and the rows are few (at most one per executor and ``MARK_ROW`` blocks)."""
    n, k, block = int(args["n"]), int(args["k"]), int(args["block"])
    per = _mark_rows(n, block)
    marks = nk.edge_marks(np.ascontiguousarray(lists, np.float32), blocks, bounds, k, block, per * MARK_ROW, new_only)
    marks = marks.reshape(len(bounds) - 1, per, MARK_ROW)
    keys, rows = np.nonzero(marks.any(axis=2))
    if len(keys):
        executor.ps.update_many(mark_table_name(args["table"]), (keys * per + rows).tolist(),
                                marks[keys, rows].astype(np.int64))


def _mark_rows(n: int, block: int) -> int:
    """Mark rows per executor: executor ``e``'s are ``e * _mark_rows .. (e + 1) * _mark_rows - 1``."""
    return -(-num_blocks(n, block) // MARK_ROW)


#: A round whose marked blocks are at least this share of the range they span reads the whole range
#: into place: with 2 executors most blocks are marked, and the copy through ``_ROW_BUFFER`` (and
#: its first touch) cost more than the few blocks read in excess.
DENSE_READ = 0.75
#: This process's buffer for the rows a round reads, in the order of its blocks (see _graph_buffer).
_ROW_BUFFER: list[np.ndarray] = []


def _round(executor: litz.Executor, data: np.ndarray, owned: np.ndarray, bounds: np.ndarray, args: dict[str, Any],
           laps: Laps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One round of an executor (module docstring): read the marked lists and its own, sample, join, pack."""
    n, k, block = int(args["n"]), int(args["k"]), int(args["block"])
    nb = num_blocks(n, block)
    per = _mark_rows(n, block)
    me = int(executor.executor_id)
    marked = executor.ps.get_many(mark_table_name(args["table"]), range(me * per, (me + 1) * per)).reshape(-1)[:nb] > 0
    own = _own_blocks(owned, block)
    marked[own] = True
    read = np.flatnonzero(marked)
    G = _graph_buffer(nb, block, 3 * k)
    lo, hi = (int(read[0]), int(read[-1]) + 1) if len(read) else (0, 0)
    in_place = len(read) >= DENSE_READ * (hi - lo)
    if in_place:  # most of a range: read all of it, straight into place
        read = np.arange(lo, hi)
        rows = executor.ps.get_many(args["table"], read, out=G[lo:hi])
    else:
        if not _ROW_BUFFER or _ROW_BUFFER[0].shape[0] < len(read) or _ROW_BUFFER[0].shape[1:] != (block, 3 * k):
            _ROW_BUFFER[:] = [np.empty((max(len(read), nb // 4), block, 3 * k), np.float32)]
        rows = executor.ps.get_many(args["table"], read, out=_ROW_BUFFER[0][:len(read)])
    # the neighbours' lists must all be there (the join reads them): a mark lost with a server and not
    # yet given again by a refill means a second read, after which the shared buffers cannot be trusted
    have = np.zeros(nb, np.bool_)
    have[read] = True
    neighbours = nk.list_blocks(rows, read, int(owned[0]), int(owned[-1]) + 1, k, block, nb) if len(owned) else have
    missing = np.flatnonzero(neighbours & ~have)
    if len(missing):
        rows = rows.copy()  # before the read yields: another task may then fill the shared buffers
        extra = executor.ps.get_many(args["table"], missing)
        read, rows, in_place = np.concatenate([read, missing]), np.concatenate([rows, extra]), False
    # from here to the update nothing yields to another task of this process (see _graph_buffer)
    if not in_place:
        G[read] = rows
    graph = G.reshape(-1, 3 * k)[:n]
    laps.lap("read")
    pos, touched, counts = nk.bookkeeping(n, owned)
    counts[nk.COUNTERS.index("rows_read")] = len(read)
    new, old, counts[5] = nk.sample_candidates_into(graph, k, pos, int(args["seed"]), int(args["round"]), touched,
                                                    read, block, *_candidate_buffers(len(owned),
                                                                                     int(args["max_candidates"])))
    laps.lap("sample")
    blocks, deltas = nk.nnd_join(data, graph, owned, pos, touched, new, old, counts, k, bool(args["filter"]), block,
                                 _join_distances(args.get("device", "cpu")))
    laps.lap("join")
    return blocks, deltas, counts


def _join_distances(option: str) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None:
    """What computes a round's join distances in this process for ``--device option``: None is the CPU join."""
    if gpu.process_device(option) != "cuda":
        return None
    from apps import nndescent_cuda  # imported only where a GPU is wanted (apps/gpu.py)

    return nndescent_cuda.join_distances


_GRAPH_BUFFER: list[np.ndarray] = []
_CANDIDATE_BUFFER: list[np.ndarray] = []


def _candidate_buffers(m: int, mc: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's two ``(m, mc)`` uint64 arrays for a round's new and old candidate lists
    (:func:`~apps.nndescent_kernels.sample_candidates_into`), reused as the graph buffer is: a task is
    done with them when ``nnd_join`` returns, before it could yield to another."""
    if not _CANDIDATE_BUFFER or _CANDIDATE_BUFFER[0].shape[1] < m or _CANDIDATE_BUFFER[0].shape[2] != mc:
        _CANDIDATE_BUFFER[:] = [np.empty((2, m, mc), np.uint64)]
    return _CANDIDATE_BUFFER[0][0, :m], _CANDIDATE_BUFFER[0][1, :m]


def _graph_buffer(rows: int, block: int, width: int) -> np.ndarray:
    """This process's buffer for the lists a join reads, reused from round to round, indexed by point.

    A fresh array of the whole graph (47 MB at 2**18 points) costs a page fault per 4 KB on first
    touch, about as long as the copy into it. Only the rows a round reads are filled; the others
    hold whatever an earlier task left, and are never read. One buffer (and one for the rows as
    read, ``_ROW_BUFFER``) serves every executor of the process: a task's ``get_many`` fills the
    row buffer (or, for a dense read, this one) when the task resumes, and the task is done with
    both when ``nnd_join`` returns;
    nothing in between yields to another task (tasks are greenlets of one thread; the kernels and
    ``update_many`` never block), so no two tasks ever hold them at once.
    """
    shape = (rows, block, width)
    if not _GRAPH_BUFFER or _GRAPH_BUFFER[0].shape != shape:
        _GRAPH_BUFFER[:] = [np.empty(shape, np.float32)]
    return _GRAPH_BUFFER[0]


def data_fingerprint(data: np.ndarray, perm: np.ndarray | None = None) -> str:
    """A digest of 64 rows spread over ``data`` (renumbered by ``perm``, without copying the rest):
    executors that renumber the points on their own (:func:`ordered_points`) must all see the same
    matrix, and the driver the same numbering, or the graph would silently mix numberings."""
    import hashlib

    idx = np.linspace(0, len(data) - 1, 64).astype(np.int64)
    rows = np.ascontiguousarray(data[idx if perm is None else perm[idx]])
    return hashlib.sha1(rows.tobytes()).hexdigest()


def _initial_lists(data: np.ndarray, owned: np.ndarray, k: int, seed: int,
                   trees: list[tuple[np.ndarray, np.ndarray]], block: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The owned points' first lists, as row updates ``(blocks, deltas, counts)``: the pairs of
    every tree leaf offered to owned points, then random points for lists still short.

    The lists are built in this process's graph buffer (:func:`_graph_buffer`), of which only the
    owned points' rows are emptied and used: the kernels read and write no other list. A fresh
    ``(n, 3k)`` array, as :func:`~apps.nndescent_kernels.init_lists` makes, costs the first touch and
    the filling of the whole graph (94 MB at 2**19 points, k = 15) in every executor's first task."""
    n = len(data)
    G = _graph_buffer(num_blocks(n, block), block, 3 * k).reshape(-1, 3 * k)[:n]
    G[owned] = nk.empty_lists(1, k)
    pos, touched, counts = nk.bookkeeping(n, owned)
    for order, bounds in trees:
        nk.leaf_offers(data, G, order, bounds, k, pos, touched, counts)
    nk.fill_random(data, G, owned, k, seed, touched, counts)
    blocks, deltas = nk.pack_updates(G, nk.empty_lists(1, k), k, pos, True, touched, block, counts)
    return blocks, deltas, counts


def tree_space(data: np.ndarray, seed: int) -> np.ndarray:
    """The points the random-projection trees split: ``data`` itself up to :data:`TREE_DIMS` dimensions,
    else its product with a ``(d, TREE_DIMS)`` Gaussian matrix drawn from ``seed``.

    Why: a tree node projects every one of its points on a hyperplane's normal, so a tree costs
    ``depth · n · d``; on Fashion-MNIST (784-d) eight trees took 1.6 s in every worker process, more
    than a third of the whole graph. A random projection keeps distances within a small factor
    (Johnson–Lindenstrauss), and a tree only needs near points to fall on the same side of most
    hyperplanes; the leaves are still compared in the full space. Measured on Fashion-MNIST: the
    trees take 0.47 s instead of 1.6 s; the first lists are a little worse (6 rounds instead of 5)
    and the recall the same (0.982 against 0.981). At 64 dimensions the recall fell to 0.980.
    """
    x = np.ascontiguousarray(data, np.float32)
    if x.shape[1] <= TREE_DIMS:
        return x
    r = np.random.default_rng([seed, 0x7EE5]).standard_normal((x.shape[1], TREE_DIMS)).astype(np.float32)
    out = np.empty((len(x), TREE_DIMS), np.float32)
    for lo in range(0, len(x), 8192):  # row chunks: no float32 copy of a memory-mapped input at once
        np.matmul(x[lo:lo + 8192], r, out=out[lo:lo + 8192])
    return out


#: A process prunes the trees to its executors' points only if they are at most this share of all:
#: at 2**19 blobs a twelfth took 0.6 of the whole trees' time, a half as long as the whole trees.
PRUNE_SHARE = 0.25
#: Pruned trees kept per process (of its executors, for refills after a loss).
_TREES_KEPT = 64
_TREE_CACHE: dict[tuple[int, int, int, str], tuple[np.ndarray, np.ndarray]] = {}
_TREE_SPACE: dict[int, np.ndarray] = {}
_TREE_DATA: list[np.ndarray] = []
_TREE_LOCK = threading.Lock()


#: The owned points of the executors whose input was made in this process, per data set (by id,
#: with the data kept so that the id stays its own): ``id(data) -> (data, [owned, ...])``.
_LOCAL_OWNED: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}


def _note_owned(data: np.ndarray, owned: np.ndarray) -> None:
    with _TREE_LOCK:
        if id(data) not in _LOCAL_OWNED:  # only the latest data set's, as for the trees
            _LOCAL_OWNED.clear()
            _LOCAL_OWNED[id(data)] = (data, [])
        _LOCAL_OWNED[id(data)][1].append(np.asarray(owned))


def _trees(data: np.ndarray, seed: int, trees: int, leaf: int, owned: np.ndarray
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``trees`` random-projection trees of the initial lists, as far as this process's
    executors' points need them.

    An executor offers each leaf's pairs to its own points only (so that it sends only its own rows),
    so it needs only the leaves that hold one of them: the branches without are not split
    (:func:`~apps.nndescent_kernels.rp_tree` with ``keep``), and those leaves are exactly the whole
    tree's. The trees are pruned to the points of every executor whose :class:`NNDInput` was made in
    this process (and ``owned``), and built once for all of them: two executors of a process each
    pruning its own trees cost more than one whole set (0.31 s each against 0.42 s on Fashion-MNIST,
    where a 128-d projection leaves little to prune). The trees are pure functions of (data, seed,
    tree): they are kept per process, for the other executors and for refills after a loss. Only
    the latest data set's trees are kept. High-dimensional data is split in a projection of it
    (:func:`tree_space`).
    """
    with _TREE_LOCK:
        local = _LOCAL_OWNED.get(id(data))
        points = [owned, *local[1]] if local is not None and local[0] is data else [owned]
        mine = np.unique(np.concatenate([np.asarray(p, np.int64) for p in points]))
        prune = len(mine) <= PRUNE_SHARE * len(data)
        own_key = hashlib.sha1(mine.tobytes()).hexdigest() if prune else "all"
        if not _TREE_DATA or _TREE_DATA[0] is not data:
            _TREE_CACHE.clear()
            _TREE_SPACE.clear()
            _TREE_DATA[:] = [data]
        if seed not in _TREE_SPACE:
            _TREE_SPACE[seed] = tree_space(data, seed)
        keep = None
        out = []
        for t in range(trees):
            key = (seed, t, leaf, own_key)
            if key not in _TREE_CACHE:
                if keep is None and prune:
                    keep = np.zeros(len(data), np.uint8)
                    keep[mine] = 1
                _TREE_CACHE[key] = nk.rp_tree(_TREE_SPACE[seed], seed, t, leaf, keep)
                while len(_TREE_CACHE) > _TREES_KEPT:  # executors that moved here and on: oldest first
                    del _TREE_CACHE[next(iter(_TREE_CACHE))]
            out.append(_TREE_CACHE[key])
        return out


def locality_order(data: np.ndarray, seed: int = 0, space: np.ndarray | None = None) -> np.ndarray:
    """A permutation of the points (int64) under which near points have near ids (module docstring,
    "Locality"): apply it to the data before NN-Descent, and map ids back afterwards. The tree
    splits :func:`tree_space` (a projection of high-dimensional data), or ``space`` if given."""
    return nk.locality_order(tree_space(data, seed) if space is None else space, seed, BLOCK)


def renumbered(data: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(data[perm], perm)``, C-contiguous, with ``perm = locality_order(data, seed)``.

    The trees of the initial lists split the same projection as the locality order, of the renumbered
    points: with the same ``seed`` that is this projection's rows in the new order. So this process's
    tree cache gets it now, and a task's trees start at once instead of multiplying the data by the
    Gaussian matrix a second time (0.15 s of every worker process's initial lists on Fashion-MNIST).
    """
    space = tree_space(data, seed)
    perm = locality_order(data, seed, space)
    out = np.ascontiguousarray(data[perm])
    if space.shape[1] != data.shape[1]:  # a projection (else the trees split the points themselves)
        with _TREE_LOCK:
            _TREE_CACHE.clear()
            _TREE_DATA[:] = [out]
            _TREE_SPACE.clear()
            _TREE_SPACE[seed] = space[perm]
    return out, perm


def nndescent_warmup() -> None:
    """Compile (or load from Numba's cache) every kernel, for float32 data as a task passes it (the
    kernels make the points read-only: :func:`apps.kernel_util.read_only`)."""
    x = np.random.default_rng(0).standard_normal((40, 3)).astype(np.float32)
    owned = np.arange(20, dtype=np.int64)
    blocks, deltas, _ = _initial_lists(x, owned, 4, 0, [nk.rp_tree(x, 0, 0, 8)], 8)
    nk.locality_order(x, 0, 8)
    G = nk.empty_lists(len(x), 4)
    for b, d in zip(blocks, deltas, strict=True):
        nk.merge_lists(G[b * 8:(b + 1) * 8], d, 4)
    for use_filter in (True, False):
        nk.nnd_round(x, G.copy(), owned, 4, 4, 0, 0, use_filter, 8)
    # a job's round: sampling over the blocks it read, and the marks (other specializations: loaded
    # from Numba's cache at the first task, they held the initial lists and round 1 back by 0.5 s)
    blocks = np.arange(5, dtype=np.int64)
    nk.sample_candidates(G.copy(), 4, nk.own_index(len(x), owned), len(owned), 4, 0, 0, np.zeros(len(x), np.uint8),
                         blocks, 8)
    rows = np.ascontiguousarray(G.reshape(5, 8, 12))
    nk.edge_marks(rows, blocks, np.array([0, 20, 40], np.int64), 4, 8, MARK_ROW, True)
    nk.list_blocks(rows, blocks, 0, 20, 4, 8, 5)


class NNDescentExecutorMixin:
    """Serve NN-Descent tasks: call ``self.run_nnd_task(args)`` from ``run_task`` when
    ``NNDescentPhase.is_task(args)``, and ``nndescent_warmup()`` from ``setup``. A moved executor
    loads its input where it lands (``ship_input``): the input holds every point, which the
    process maps once for all its executors."""

    ship_input = False

    def run_nnd_task(self, args: dict[str, Any]) -> dict[str, Any]:
        return nndescent_run_task(self, args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------
# the driver side
# ----------------------------------------------------------------------------------------------------


class NNDescentPhase:
    """Driver-side state machine of NN-Descent, usable inside any ``litz.Driver``.

    ``start()`` dispatches the first tasks; pass every completion for which ``handles(result)`` is
    true to ``on_complete(result)``, which dispatches what follows and returns True once the graph
    has converged; then ``graph()`` reads it. Tasks go to executors ``0 .. num_executors - 1``,
    one per executor per round, and carry ``"phase": "nnd"`` in their args.
    """

    def __init__(self, driver: litz.Driver, n_points: int, k: int, *, num_executors: int, delta: float = 0.001,
                 max_rounds: int = 30, seed: int = 0, table: str = "knn", block: int = BLOCK,
                 max_candidates: int | None = None, use_filter: bool = True, trees: int | None = None,
                 device: str = "cpu", report: Callable[[str], None] | None = None) -> None:
        if num_executors < 1 or max_rounds < 1 or not delta >= 0:
            raise litz.ConfigError(f"NN-Descent needs executors >= 1, max_rounds >= 1 and delta >= 0, got "
                                   f"{num_executors}, {max_rounds}, {delta}")
        knn_table(n_points, k, table, block=block)  # checks n and k
        if device not in gpu.DEVICES:
            raise litz.ConfigError(f"NN-Descent: unknown device {device!r} (choose from {gpu.DEVICES})")
        self.device = device
        self.driver = driver
        self.n, self.k, self.E = int(n_points), int(k), int(num_executors)
        self.delta, self.max_rounds, self.seed = float(delta), int(max_rounds), int(seed)
        self.table, self.block = table, int(block)
        self.max_candidates = int(max_candidates or min(60, k))  # pynndescent's default
        self.use_filter = bool(use_filter)
        self.trees = TREES if trees is None else int(trees)  # in all (each process prunes them to its points)
        self.report = report
        self.round = -1  # -1: initial lists
        self.converged = False
        self._refilling = False  # the tasks out are a refill (initial lists again, after a loss)
        self._refill_wanted = False  # a server was lost during this round: refill after it
        self._first_round = 0  # the rounds since the last refill count against max_rounds
        self.stats: dict[str, Any] = {"rounds": 0, "updates": [], "distances": [], "proposed": [], "sent": [],
                                      "rows_sent": [], "marked": [], "rows_read": [], "seconds": [],
                                      "candidates_proposed": 0,
                                      "candidates_sent": 0, "candidates_filtered": 0, "filter": self.use_filter,
                                      "refills": 0, "devices": []}
        self._pending = 0
        self._counts = np.zeros(len(nk.COUNTERS), np.int64)
        self._slowest = 0.0  # the round's slowest task's own seconds, as it measured them
        self._slowest_parts: dict[str, float] = {}  # and its parts (Laps)
        self._fastest = np.inf  # and its fastest task's: all slow alike, or one straggler?
        self._owned = [0, 0]
        self._fingerprints: dict[str, int] = {}

    @staticmethod
    def is_task(args: Any) -> bool:
        """Whether task args belong to NN-Descent (what an executor's ``run_task`` tests)."""
        return isinstance(args, dict) and args.get("phase") == "nnd"

    def _dispatch(self, op: str) -> None:
        base = {"phase": "nnd", "op": op, "round": self.round, "n": self.n, "k": self.k, "block": self.block,
                "table": self.table, "seed": self.seed, "max_candidates": self.max_candidates,
                "filter": self.use_filter, "trees": self.trees, "device": self.device, "executors": self.E,
                "refill": self._refilling}
        self._counts[:] = 0
        self._slowest = 0.0
        self._slowest_parts = {}
        self._fastest = np.inf
        self._pending = self.E
        self._t = time.perf_counter()
        for e in range(self.E):
            self.driver.dispatch_task(e, dict(base))

    def start(self) -> None:
        """Dispatch the initial lists (one task per executor)."""
        self._t0 = time.perf_counter()
        self._dispatch("init")

    def recovered(self, recovery: litz.Recovery) -> None:
        """A partial recovery completed (pass on ``Driver.recovered``).

        A lost server's rows came back from the last checkpoint, or empty if there was none, so
        those lists lost what they gained since. Rounds alone refill an emptied list only from the
        offers of points that happen to list it, and some stay short (measured on Fashion-MNIST
        with half the rows emptied after round 2: recall 0.93 after 11 rounds; with the refill
        0.984 after 6). So the initial lists are offered again to every point, a *refill* (merging
        keeps the nearest, so intact lists lose nothing), and rounds go on until they converge
        again. During a round the refill waits for its end; after convergence it starts at once
        (``converged`` becomes False: the caller must wait for ``on_complete`` again). A lost
        worker needs nothing: the lists are all on the servers, and its tasks are dispatched again.
        """
        if recovery.role != "server":
            return
        self._say(f"recovered from the loss of {', '.join(recovery.lost)} ({len(recovery.shards)} shards from "
                  f"{recovery.checkpoint or 'scratch'}): the initial lists are offered again")
        if self._pending:
            self._refill_wanted = True
            return
        self.converged = False
        self._refill()

    def _refill(self) -> None:
        self._refill_wanted = False
        self._refilling = True
        self._dispatch("init")

    def handles(self, result: litz.TaskResult) -> bool:
        """Whether this completion is one of this phase's tasks."""
        return self.is_task(result.args) and result.args.get("table") == self.table

    def on_complete(self, result: litz.TaskResult) -> bool:
        """Account one completion; at the end of a round, stop or dispatch the next. True once converged."""
        v = result.value
        self._counts += np.asarray(v["counts"], np.int64)
        task_seconds = float(v.get("seconds", 0.0))
        if task_seconds >= self._slowest:
            self._slowest, self._slowest_parts = task_seconds, dict(v.get("parts", {}))
        self._fastest = min(self._fastest, task_seconds)
        device = v.get("device", "cpu")
        if device not in self.stats["devices"]:
            self.stats["devices"] = sorted({*self.stats["devices"], device})
        if self.round < 0 and not self._refilling:
            self._owned[0] += int(v["owned"])
            self._owned[1] += int(v["owned_sum"])
            self._fingerprints[v["fingerprint"]] = self._fingerprints.get(v["fingerprint"], 0) + 1
        self._pending -= 1
        if self._pending:
            return False
        c = dict(zip(nk.COUNTERS, self._counts.tolist(), strict=True))
        seconds = time.perf_counter() - self._t
        # the slowest task's own time (reads, kernels, sends): the rest of the round is the chain of
        # messages around the tasks, the servers' merges and the driver
        parts = ", ".join(f"{name} {t:.3f}" for name, t in self._slowest_parts.items())
        fastest = f"; fastest {self._fastest:.3f} s" if self.E > 1 else ""
        slowest = f"(slowest task {self._slowest:.3f} s{': ' + parts if parts else ''}{fastest})"
        if self._refilling:
            self._refilling = False
            self.stats["refills"] += 1
            # the refilled lists need rounds of their own: a refill after the cap got one (their
            # lists stayed near the initial ones' quality)
            self._first_round = self.round + 1
            self._say(f"refill of the initial lists    distances {c['distances']:10d}  {seconds:.3f} s {slowest}")
        elif self.round < 0:
            if self._owned != [self.n, self.n * (self.n - 1) // 2]:
                raise RuntimeError(f"the executors' owned points do not partition range({self.n}): "
                                   f"{self._owned[0]} points with id sum {self._owned[1]}")
            if len(self._fingerprints) != 1:
                raise RuntimeError(f"the executors do not all see the same points (data digests and how many "
                                   f"executors saw each: {self._fingerprints})")
            self.stats["data_fingerprint"] = next(iter(self._fingerprints))
            self.stats["init_seconds"] = seconds
            self._say(f"initial lists  {seconds:.3f} s {slowest}")
        else:
            st = self.stats
            st["rounds"] = self.round + 1
            for name in ("updates", "distances", "proposed", "sent", "rows_sent", "marked", "rows_read"):
                st[name].append(c[name])
            st["seconds"].append(seconds)
            st["candidates_proposed"] += c["proposed"]
            st["candidates_sent"] += c["sent"]
            st["candidates_filtered"] = st["candidates_proposed"] - st["candidates_sent"]
            self._say(f"round {self.round + 1:3d}  updates {c['updates']:9d}  distances {c['distances']:10d}  "
                      f"candidates sent {c['sent']:9d} of {c['proposed']:10d}  blocks read {c['rows_read']:7d}  "
                      f"{seconds:.3f} s {slowest}")
            if not self._refill_wanted and (c["updates"] < self.delta * self.n * self.k
                                            or self.round + 1 - self._first_round >= self.max_rounds):
                self.converged = True
                self.stats["seconds_total"] = time.perf_counter() - self._t0
                return True
        if self._refill_wanted:  # the round just ended lost rows: refill before the next
            self._refill()
            return False
        self.round += 1
        self._dispatch("round")
        return False

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)

    def progress(self) -> str:
        """One line for ``litz status``."""
        if self.round < 0:
            return "NN-Descent: initial lists"
        ups = self.stats["updates"]
        return f"NN-Descent round {self.round + 1}/{self.max_rounds}" + (f", {ups[-1]} updates" if ups else "")

    def graph(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(indices int64 (n, k), Euclidean distances float32 (n, k))``, rows sorted ascending, from
        the PS; missing neighbours (a list shorter than k) are id -1 at distance inf.

        None if a server was lost and recovered while the lists were read: some came back from the
        checkpoint (or empty). The driver's ``recovered``, called once its handler returns, then
        refills them (pass it on to :meth:`recovered`), and ``on_complete`` says when to read again.
        """
        nb = num_blocks(self.n, self.block)
        rows = np.empty((nb * self.block, 3 * self.k), np.float32)
        for lo in range(0, nb, READ_CHUNK):
            hi = min(nb, lo + READ_CHUNK)
            rows[lo * self.block:hi * self.block] = self.driver.ps.get_many(self.table, range(lo, hi)).reshape(
                -1, 3 * self.k)
        if any(r.role == "server" for r in self.driver.recoveries_pending):
            self._say("a server was recovered while the graph was read: its lists are refilled first")
            self.converged = False
            return None
        rows = rows[:self.n]
        return rows[:, :self.k].astype(np.int64), np.sqrt(rows[:, self.k:2 * self.k])


# ----------------------------------------------------------------------------------------------------
# data and the exact neighbours of a sample (for recall)
# ----------------------------------------------------------------------------------------------------


def blobs(n: int, dim: int = 10, centers: int = 10, seed: int = 0) -> np.ndarray:
    """Gaussian blobs (unit variance, centres uniform in [-10, 10]^dim), float32 ``(n, dim)``."""
    rng = np.random.default_rng([seed, 0xB10B])
    c = rng.uniform(-10.0, 10.0, (centers, dim))
    x = c[rng.integers(0, centers, n)] + rng.standard_normal((n, dim))
    return x.astype(np.float32)


def _fashion_mnist_all() -> np.ndarray:
    """Train then test rows (70,000 x 784), as a read-only memory map of one cached file.

    Every process maps the same file, so the executors of all workers share one copy in memory.
    """
    import hashlib

    from apps.datasets import _save_npy_atomic, cache_dir, load_fashion_mnist

    train, test = load_fashion_mnist("train")[0], load_fashion_mnist("test")[0]
    names = [getattr(a, "filename", None) for a in (train, test)]
    if None in names:  # no decoded cache (read-only home): keep it in memory
        return np.concatenate([train, test])
    path = cache_dir() / f"nnd-fashion-mnist-all-{hashlib.sha1(repr(names).encode()).hexdigest()[:16]}.npy"
    if not path.is_file():
        try:
            _save_npy_atomic(path, np.concatenate([train, test]))
        except OSError:
            return np.concatenate([train, test])
        for old in path.parent.glob("nnd-fashion-mnist-all-*.npy"):
            if old != path:
                old.unlink(missing_ok=True)
    return np.asarray(np.load(path, mmap_mode="r"))


@functools.lru_cache(maxsize=2)
def _load(name: str, points: int | None, dim: int, centers: int, seed: int) -> np.ndarray:
    if name == "blobs":
        return blobs(points or 10_000, dim, centers, seed)
    x = _fashion_mnist_all()
    return x[:points] if points else x


def load_points(config: dict[str, Any]) -> np.ndarray:
    """The job's points in the input's order, memoized per process (executors of one worker share them)."""
    return _load(config["data"], config["points"], config["dim"], config["centers"], config["data_seed"])


@functools.lru_cache(maxsize=1)
def _renumbered(name: str, points: int | None, dim: int, centers: int, data_seed: int, seed: int, order: bool
                ) -> tuple[np.ndarray, np.ndarray]:
    x = _load(name, points, dim, centers, data_seed)
    return renumbered(x, seed) if order else (x, np.arange(len(x), dtype=np.int64))


def _job_points(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    return _renumbered(config["data"], config["points"], config["dim"], config["centers"], config["data_seed"],
                       config["seed"], bool(config.get("order", True)))


def job_order(config: dict[str, Any]) -> np.ndarray:
    """The job's numbering of the points: point ``i`` of the job is ``load_points(config)[perm[i]]``.

    With ``--order`` (the default) ``perm`` is :func:`locality_order`, so that an executor's range of
    ids is a region of space: on Fashion-MNIST the joins then read rows that are in cache (1.5x faster
    rounds). A pure function of the data and the seed, memoized per process; the executors check that
    they all see the same points (:func:`data_fingerprint`), and the driver maps ids back.
    """
    return _job_points(config)[1]


def ordered_points(config: dict[str, Any]) -> np.ndarray:
    """The points in the job's numbering (:func:`job_order`), memoized per process (:func:`renumbered`)."""
    return _job_points(config)[0]


def exact_knn(data: np.ndarray, queries: np.ndarray, k: int, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest other points of ``queries`` (ids into ``data``): ``(ids, squared distances)``.

    Brute force: a float32 matrix product proposes ``3k + 10`` candidates, refined in float64 (the
    product's rounding could misorder near ties). A row's ``|q|^2`` is left out of the product's
    distances (the same for the whole row, it changes no row's order), and the product is changed
    in place: chunks of 64 queries keep it within the cache's reach.
    """
    x = np.asarray(data, np.float32)
    norms = np.einsum("ij,ij->i", x, x)
    m = min(len(x) - 1, 3 * k + 10)
    ids = np.empty((len(queries), k), np.int64)
    d2 = np.empty((len(queries), k))
    for lo in range(0, len(queries), chunk):
        q = queries[lo:lo + chunk]
        approx = x[q] @ x.T
        approx *= -2.0
        approx += norms[None, :]
        approx[np.arange(len(q)), q] = np.inf
        cand = nk.smallest_per_row(approx, m)
        exact = ((x[cand].astype(np.float64) - x[q][:, None, :].astype(np.float64)) ** 2).sum(-1)
        order = np.argsort(exact, axis=1, kind="stable")[:, :k]
        ids[lo:lo + chunk] = np.take_along_axis(cand, order, 1)
        d2[lo:lo + chunk] = np.take_along_axis(exact, order, 1)
    return ids, d2


def recall(data: np.ndarray, indices: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Share of the true k nearest neighbours found, on ``queries``; ties at the k-th distance count as found."""
    _, d2 = exact_knn(data, queries, k)
    x = np.asarray(data, np.float64)
    found = np.sort(indices[queries], axis=1)
    distinct = np.ones(found.shape, bool)
    distinct[:, 1:] = found[:, 1:] != found[:, :-1]  # a repeated id is found once
    got = ((x[found] - x[queries][:, None, :]) ** 2).sum(-1)
    ok = (got <= d2[:, -1:] * (1 + 1e-9)) & distinct & (found >= 0) & (found != queries[:, None])
    return float(ok.sum() / (len(queries) * k))


def query_sample(n: int, size: int, seed: int) -> np.ndarray:
    """All points when ``size >= n``, else a random sample of them (sorted)."""
    if size >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng([seed, 0x51]).choice(n, size, replace=False)).astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# the standalone app
# ----------------------------------------------------------------------------------------------------


class NNDDriver(litz.Driver):
    """Runs one NNDescentPhase, then measures recall on a sample of query points."""

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        t = time.perf_counter()
        # computed again, not from the memo, and timed: the executors computed it too, while loading their input
        self.perm = (locality_order(load_points(cfg), cfg["seed"]) if cfg["order"] else
                     np.arange(cfg["n"], dtype=np.int64))
        self.order_seconds = time.perf_counter() - t
        self.phase = NNDescentPhase(self, cfg["n"], cfg["k"], num_executors=self.num_executors, delta=cfg["delta"],
                                    max_rounds=cfg["max_rounds"], seed=cfg["seed"], block=cfg["block"],
                                    max_candidates=cfg["max_candidates"], use_filter=cfg["filter"],
                                    device=cfg.get("device", "cpu"), report=None if cfg["quiet"] else self._print)
        self.phase.start()

    @staticmethod
    def _print(line: str) -> None:
        print(line, flush=True)

    def recovered(self, recovery: litz.Recovery) -> None:
        self.phase.recovered(recovery)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        if not (self.phase.handles(result) and self.phase.on_complete(result)):
            return
        cfg = self.config
        t = time.perf_counter()
        graph = self.phase.graph()
        if graph is None:  # a server's lists came back from the checkpoint: refilled, then read again
            return
        ordered, dist_ordered = graph
        if data_fingerprint(load_points(cfg), self.perm) != self.phase.stats["data_fingerprint"]:
            raise RuntimeError("the driver's locality order differs from the executors': the graph cannot be "
                               "mapped back to the input's numbering")
        indices, distances = np.empty_like(ordered), np.empty_like(dist_ordered)
        indices[self.perm] = np.where(ordered >= 0, self.perm[ordered], -1)  # the input's numbering (-1: none)
        distances[self.perm] = dist_ordered
        read = time.perf_counter() - t
        data = load_points(cfg)
        queries = query_sample(cfg["n"], cfg["queries"], cfg["seed"])
        r = recall(data, indices, queries, cfg["k"])
        out: dict[str, Any] = {"recall": r, "stats": self.phase.stats, "read_seconds": read,
                               "order_seconds": self.order_seconds,
                               "seconds": self.order_seconds + self.phase.stats["seconds_total"] + read}
        if cfg["return_graph"]:
            out.update(indices=indices, distances=distances)
        if not cfg["quiet"]:
            devices = self.phase.stats["devices"]
            print(f"{cfg['n']} points, k={cfg['k']}: {self.phase.stats['rounds']} rounds, "
                  f"{out['seconds']:.2f} s, candidates sent {self.phase.stats['candidates_sent']} of "
                  f"{self.phase.stats['candidates_proposed']}"
                  + ("" if devices == ["cpu"] else f", join distances on {' and '.join(devices)}"), flush=True)
        print(f"recall {r:.3f}", flush=True)  # the result line, --quiet or not
        self.finish(out)

    def progress(self) -> str:
        phase = getattr(self, "phase", None)
        return phase.progress() if phase is not None else ""


class NNDExecutor(NNDescentExecutorMixin, litz.Executor):
    """Holds every point (read-only, in the job's order) and owns a contiguous range of them."""

    def load_input(self) -> NNDInput:
        data = ordered_points(self.config)
        return NNDInput(data, NNDInput.partition(len(data), self.num_executors, self.executor_id))

    def setup(self) -> None:
        nndescent_warmup()

    def run_task(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.run_nnd_task(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="litz launch apps/nndescent.py",
                                description="Approximate k-nearest-neighbour graph by NN-Descent on Litz; prints "
                                            "the recall against exact neighbours of a sample of points.")
    p.add_argument("--data", choices=("fashion-mnist", "blobs"), default="fashion-mnist",
                   help="Fashion-MNIST train + test (70,000 x 784, Debian package dataset-fashion-mnist) or "
                        "Gaussian blobs")
    p.add_argument("--k", type=int, default=DEFAULTS["k"], help="neighbours per point")
    p.add_argument("--points", type=int, default=None,
                   help="number of points (Fashion-MNIST: the first N; blobs: default 10,000)")
    p.add_argument("--dim", type=int, default=10, help="blobs: dimensions")
    p.add_argument("--centers", type=int, default=10, help="blobs: number of blobs")
    p.add_argument("--delta", type=float, default=DEFAULTS["delta"],
                   help="stop when a round makes fewer than delta * n * k updates")
    p.add_argument("--max-rounds", type=int, default=DEFAULTS["max_rounds"])
    p.add_argument("--max-candidates", type=int, default=None, help="join candidates per point and kind "
                                                                    "(default min(60, k))")
    p.add_argument("--block", type=int, default=BLOCK, help="points per parameter-server row")
    p.add_argument("--no-filter", dest="filter", action="store_false",
                   help="send candidates without the d_max filter (for comparison)")
    gpu.add_device_option(p, "the join's distances", "apps/nndescent_cuda.py")
    p.add_argument("--no-order", dest="order", action="store_false",
                   help="keep the input's numbering of the points (default: renumber them in a locality order "
                        "first, so that an executor's points are a region of space)")
    p.add_argument("--queries", type=int, default=DEFAULTS["queries"],
                   help="points whose exact neighbours measure the recall (all if fewer points)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the initial lists and the sampling")
    p.add_argument("--data-seed", type=seed, default=0, help="blobs: seed of the data")
    p.add_argument("--return-graph", action="store_true", help="litz.run returns the graph too (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the result line is printed)")
    return p


def make_app(argv: list[str]) -> litz.App:
    """Parse and check the options, load the data once to learn its size, declare the table."""
    args = parser().parse_args(argv)
    gpu.check_device(args.device)
    require_at_least(args, k=1, max_rounds=1, queries=1, block=1, dim=1, centers=1, points=2, max_candidates=1)
    if not args.delta >= 0:
        raise litz.ConfigError(f"--delta must be >= 0, got {args.delta}")
    config: dict[str, Any] = {
        "data": args.data, "k": args.k, "points": args.points, "dim": args.dim, "centers": args.centers,
        "delta": args.delta, "max_rounds": args.max_rounds, "max_candidates": args.max_candidates,
        "block": args.block, "filter": args.filter, "order": args.order, "queries": args.queries, "seed": args.seed,
        "device": args.device,
        "data_seed": args.data_seed, "return_graph": args.return_graph, "quiet": args.quiet}
    n = config["n"] = len(load_points(config))  # (data not installed: a ConfigError, MissingDataset)
    return litz.App(NNDDriver, NNDExecutor, tables=nndescent_tables(n, args.k, block=args.block), config=config,
                    name="nndescent")


if __name__ == "__main__":
    from litz.cli import launch

    sys.exit(launch([__file__, *sys.argv[1:]]))
