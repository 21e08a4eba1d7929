"""HDBSCAN on Litz (the Litz thesis §4.7): NN-Descent, then a minimum spanning tree of the kNN
mutual-reachability graph, then the condensed tree and excess-of-mass selection.

**Phases, all driven by one driver.**

1. *kNN graph*: :class:`apps.nndescent.NNDescentPhase` (distributed NN-Descent; the graph ends up in
   the PS table ``knn``). Every executor holds the whole data matrix read-only (``NNDInput``) and owns
   a contiguous range of points; this app uses the same ownership for the phases below.
2. *Core distances* (``--mst boruvka``): one task per executor reads its own rows of ``knn``, keeps
   them in its state, and returns its points' core distances; the driver writes them all to table
   ``hdb_core`` (combiner ``assign``) before round 0. Why through the driver: executors share
   blocks at the range edges, and a table each of them wrote a part of would need a ``max`` over
   zero rows, which can never be lowered again when a recovery recomputes the cores from a
   refilled graph. Core distance = distance to the ``min_samples``-th *other* neighbour, the
   ``hdbscan`` library's convention (see apps/hdbscan_kernels.py), so ``k >= min_samples``.
3. *Minimum spanning tree*, one of:

   - ``kruskal``: the driver reads the graph and runs Kruskal with a Numba union-find in the master.
     Fits one process up to millions of points (``n k`` edges, 12 bytes each) and is the fastest on
     one host, where the graph is already next to the master.
   - ``boruvka`` (default, distributed): one micro-task per executor and round. Round 0 builds, per
     owned point, its mutual-reachability edges sorted by ``(weight, id)`` (reading ``hdb_core``
     once) and keeps them in executor state. Every round the executor reads the component labels
     (table ``hdb_comp``, one fetch per worker process through the cache) and returns, for each
     component among its points, the cheapest edge leaving it. The driver keeps the union-find: it
     takes the cheapest per component over all executors, joins them in the total edge order
     ``(w, min, max)`` (no cycles, so the result is a minimum spanning forest), and writes the new
     labels to ``hdb_comp`` before it dispatches the next round; consistency rule 1 (DESIGN.md §2)
     makes every task of round r+1 see them. It stops when no component has an outgoing edge.
     The number of components at least halves per round, so there are at most log2(n) rounds
     (about 5-8 on kNN graphs). Each row keeps a cursor past its edges that are already inside the
     point's component (they stay inside), so every row is scanned once over all rounds.

   If the kNN graph is disconnected, its pieces are joined in the master (:func:`bridged`). Where
   the search is affordable (a round compares at most ``BRIDGE_PAIRS`` pairs of points), by their
   exact cheapest mutual-reachability edges: every piece while the points are few, else the pieces
   smaller than ``min_cluster_size``, which cannot be clusters alone, so where they join decides
   what they belong to. The other pieces are joined by edges of **infinite weight**, from one
   piece's root to every other. Exact nearest pairs for big pieces would cost a search over all
   cross-piece pairs (quadratic in the worst case), and they change little there: each big piece
   is isolated in the kNN graph, so in the exact MST it joins at the top of the hierarchy, above
   every merge inside it. The infinite edges keep every merge below them; they only move the
   pieces' split from lambda ``1/D`` (D larger than any of their kNN distances) to lambda 0.
   fast_hdbscan's NN-Descent path does the same. For small pieces that is wrong: 300 points of
   10 blobs (k = 15, ``min_cluster_size`` 50) are 10 pieces of 30 points, each split off at lambda
   0 as noise (FM 0.585 against the ``hdbscan`` library), where exact edges give its two clusters.
   *Losses* (``--recovery partial``; a full recovery rolls everything back consistently). During
   NN-Descent the phase refills the lists (``NNDescentPhase.recovered``). After it, the stages
   start over from the core distances, as a new *attempt*: every core and Borůvka task carries
   its attempt number, and the driver drops completions of an older one (tasks in flight on
   survivors, and those the runtime dispatched again to the restored executors, which may hold
   no core rows: they answer ``stale``). A lost worker costs only that restart: the graph,
   cores and labels are on the servers. A lost server may have taken rows of the graph (back
   from the checkpoint, or empty), so the driver first goes back to NN-Descent, which refills
   and converges again; the restart then writes the component labels back to the identity and
   the cores afresh. These stages are a small part of the job (1.6 of 17 s at 2^19 points).
4. *Tree* (in the master, Numba): single-linkage dendrogram, condensed tree (``min_cluster_size``),
   stabilities, excess-of-mass selection with an optional ``max_cluster_size`` (the ``hdbscan``
   library's), labels with noise -1. Edges of equal weight are cut at once (as HDBSCAN* defines
   the hierarchy; the library's binary dendrogram cuts them one at a time, in an arbitrary order),
   so given the same spanning tree the labels equal the ``hdbscan`` library's where no two
   mutual-reachability distances tie (tests/test_hdbscan_app.py); with ties they may differ.

**Data.** ``blobs``: Gaussian clusters (unit variance, centres uniform in [-10, 10]^d), no noise.
``thesis``: the thesis' synthetic set, 100,000 points by default, 1,000 Gaussian clusters, 20%
uniform noise. The centres are uniform in a cube of side ``10 C^(1/d)`` (C clusters), so the mean
spacing between centres is about 10 standard deviations in every dimension ``d``. Noise is uniform
over the same cube. ``FILE.npy``: any float matrix (no ground truth).

**k.** The spanning tree of a kNN graph misses edges of the exact one, more so in more
dimensions. On the thesis set in 6-10 dimensions ``--k 60`` keeps the FM index at or above 0.95
and ``--k 30`` does not, even with exact neighbours (bench/bench_hdbscan.py). Separated blobs
need only the default 15.

**The check.** The last line printed is ``FM index 0.9xx``. It is the Fowlkes–Mallows index
against the ``hdbscan`` library's labels (exact MST, see :func:`reference_hdbscan`), run with the
same ``min_cluster_size``, ``min_samples`` and ``max_cluster_size``, when the set has at most
``--reference-limit`` points. Otherwise it is against the generator's ground truth. The reference
runs in ``make_app``, before the job, so that its seconds of single-threaded Cython never hold up
the master. Noise (-1) counts as one more label.

Run it:  ``litz launch apps/hdbscan.py [--data blobs|thesis|FILE.npy] [--points N] [--dims D]
[--clusters C] [--k 15] [--min-samples 10] [--min-cluster-size 50] [--max-cluster-size 0]
[--mst kruskal|boruvka]``
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import litz
from apps import gpu
from apps import hdbscan_kernels as hk
from apps.nndescent import (
    BLOCK,
    READ_CHUNK,
    Laps,
    NNDescentExecutorMixin,
    NNDescentPhase,
    NNDInput,
    nndescent_tables,
    nndescent_warmup,
    num_blocks,
    renumbered,
)
from apps.options import require_at_least, require_finite, seed

DEFAULTS: dict[str, Any] = {"k": 15, "min_samples": 10, "min_cluster_size": 50, "max_cluster_size": 0,
                            "reference_limit": 100_000}
CORE_TABLE = "hdb_core"
COMP_TABLE = "hdb_comp"
#: The most points per row of the core-distance and component-label tables (:func:`label_block`).
LABEL_BLOCK = 4096
#: The rows those tables aim at, so that they spread over the servers.
LABEL_ROWS = 64


def label_block(n: int) -> int:
    """Points per row of the core-distance and component-label tables of ``n`` points: the smallest
    power of two that makes at most :data:`LABEL_ROWS` rows, between the kNN graph's ``BLOCK`` and
    :data:`LABEL_BLOCK`.

    Why not the graph's 64: every Borůvka round each executor reads all the labels and the driver
    writes them all. At 2**19 points that was 8,192 keys, and the per-key work of the process cache
    and the servers (microseconds a key) cost more than the 2 MB moved; 4,096 points a row (16 KB)
    make it 128 keys. Why not one row: the rows would all live on one server.
    """
    return int(min(LABEL_BLOCK, max(BLOCK, 1 << max(0, (-(-n // LABEL_ROWS) - 1).bit_length()))))


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------


def gaussian_mixture(n: int, dims: int, clusters: int, noise: float = 0.0, half_width: float = 10.0,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(points float32 (n, dims), truth int64 (n,))``: unit-variance Gaussian clusters with centres
    uniform in ``[-half_width, half_width]^dims``, plus a fraction ``noise`` of uniform points in the
    same cube (truth -1). A pure function of its arguments: every process regenerates the same set."""
    rng = np.random.default_rng([seed, 0x4DB5CA])
    n_noise = int(round(noise * n))
    centres = rng.uniform(-half_width, half_width, (clusters, dims))
    truth = np.full(n, -1, np.int64)
    truth[:n - n_noise] = rng.integers(0, clusters, n - n_noise)
    x = np.empty((n, dims))
    x[:n - n_noise] = centres[truth[:n - n_noise]] + rng.standard_normal((n - n_noise, dims))
    x[n - n_noise:] = rng.uniform(-half_width, half_width, (n_noise, dims))
    perm = rng.permutation(n)
    return np.ascontiguousarray(x[perm], np.float32), truth[perm]


@functools.lru_cache(maxsize=2)
def _load(data: str, points: int, dims: int, clusters: int, noise: float, seed: int
          ) -> tuple[np.ndarray, np.ndarray | None]:
    if data == "blobs":
        return gaussian_mixture(points, dims, clusters, noise, 10.0, seed)
    if data == "thesis":
        return gaussian_mixture(points, dims, clusters, noise, 5.0 * clusters ** (1.0 / dims), seed)
    try:
        x = np.load(data, mmap_mode="r")
    except (OSError, ValueError) as exc:  # not a .npy file, or one of Python objects
        raise ValueError(f"{data}: not a NumPy .npy file of numbers ({exc})") from None
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"{data}: a 2-d matrix of points expected, got shape {x.shape}")
    if x.dtype.kind not in "biuf":  # complex parts would be dropped, strings cannot be distances
        raise ValueError(f"{data}: real-valued points expected, got dtype {x.dtype}")
    x = x[:points] if points else x
    return _scaled_to_float32(x, data), None


#: Coordinates are brought within [2^-SCALE_BITS, 2^SCALE_BITS] in magnitude (by a power of two) when
#: they lie beyond: squared distances in float32 overflow from differences of about 1.8e19 (all points
#: became noise) and vanish below about 1e-19 (all distances tie).
SCALE_BITS = 40


def _scaled_to_float32(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` as float32 points, refused if any coordinate is NaN or infinite (the kNN graph's random
    projections then cannot split the points: the job hung), and scaled by a power of two when its
    magnitudes would overflow or vanish in float32 distances. A power of two scales every distance
    exactly, and the clustering depends on distances only through their order and ratios: the
    labels are those of the data as given."""
    span = 0.0
    for lo in range(0, len(x), 1 << 16):  # in pieces: a memory-mapped file is not read whole at once
        part = np.asarray(x[lo:lo + (1 << 16)], np.float64)
        if not np.isfinite(part).all():
            bad = lo + int(np.flatnonzero(~np.isfinite(part).all(axis=1))[0])
            raise ValueError(f"{name}: point {bad} has a coordinate that is NaN or infinite")
        span = max(span, float(np.abs(part).max(initial=0.0)))
    if span > 2.0 ** SCALE_BITS or 0.0 < span < 2.0 ** -SCALE_BITS:
        return np.ascontiguousarray(np.ldexp(np.asarray(x, np.float64), -int(np.ceil(np.log2(span)))), np.float32)
    return np.ascontiguousarray(x, np.float32)


def load_points(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """The job's points and ground truth (None for a file), memoized per process."""
    return _load(config["data"], config["points"], config["dims"], config["clusters"], config["noise"],
                 config["data_seed"])


@functools.lru_cache(maxsize=2)
def _ordered(data: str, points: int, dims: int, clusters: int, noise: float, seed: int, order: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    x, _ = _load(data, points, dims, clusters, noise, seed)
    return renumbered(x) if order else (x, np.arange(len(x), dtype=np.int64))


def job_points(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(points, perm)``: the points as the job numbers them, ``points[i] = load_points(config)[0][perm[i]]``.

    With ``--order`` (the default) ``perm`` is :func:`apps.nndescent.locality_order`: near points get
    near ids, so an executor's contiguous range of points is a region of space. NN-Descent then finds
    most neighbours among the executor's own points (far fewer rows to send: the offers to others'
    points concentrate on few blocks) and its reads of the graph and the data hit the cache. A pure
    function of the data, memoized per process: every process computes the same. The driver maps
    the labels back to the input's order.
    """
    return _ordered(config["data"], config["points"], config["dims"], config["clusters"], config["noise"],
                    config["data_seed"], bool(config.get("order", True)))


def fowlkes_mallows(a: np.ndarray, b: np.ndarray) -> float:
    """Fowlkes–Mallows index of two labelings (noise -1 is one more label)."""
    from sklearn.metrics import fowlkes_mallows_score

    return float(fowlkes_mallows_score(a, b))


def reference_hdbscan(x: np.ndarray, min_samples: int, min_cluster_size: int, max_cluster_size: int = 0
                      ) -> np.ndarray:
    """The ``hdbscan`` library's labels with our parameters and its exact minimum spanning tree.

    Its default, ``approx_min_span_tree=True``, stops Borůvka early with a tree that is not always
    minimal; on the thesis set (20,000 points, 2-d) its labels agree with its own exact run at only
    FM 0.93, so the approximate run would measure the library's approximation rather than ours.
    """
    import hdbscan

    return hdbscan.HDBSCAN(min_cluster_size=min_cluster_size, min_samples=min_samples,
                           max_cluster_size=max_cluster_size, approx_min_span_tree=False).fit(x).labels_


# ----------------------------------------------------------------------------------------------------
# single process (tests, and the driver's kruskal path)
# ----------------------------------------------------------------------------------------------------


def spanning_tree(knn_idx: np.ndarray, knn_dist: np.ndarray, min_samples: int, points: np.ndarray | None = None,
                  min_cluster_size: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Kruskal on the graph's mutual-reachability edges, bridged: ``(a, b, w, components)``."""
    n = len(knn_idx)
    ids = np.arange(n, dtype=np.int64)
    core = hk.core_distances(knn_dist, min_samples)
    nbr, w = hk.mutual_reachability_rows(ids, knn_idx, knn_dist, core)
    a, b, ww, parent = hk.kruskal(ids, nbr, w, n)
    return bridged(a, b, ww, parent, points, core, min_cluster_size)


#: The most (point, point) pairs :func:`bridged` lets a round's search cover to join components
#: exactly (all of them at first sight, as a brute force would: 1.5-3 s of one core in 10 dimensions;
#: :func:`~apps.hdbscan_kernels.cheapest_outside` rules most out by bounds, 0.02-0.07 s a round at
#: 2**14 blobs); beyond it they are joined like the others, by infinite edges.
BRIDGE_PAIRS = 300_000_000


def bridged(a: np.ndarray, b: np.ndarray, w: np.ndarray, parent: np.ndarray, points: np.ndarray | None = None,
            core: np.ndarray | None = None, min_cluster_size: int = 0
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A spanning forest of the kNN graph joined into one tree: ``(a, b, w, components)``, where
    ``components`` is the forest's number of trees (the kNN graph's components).

    With ``points`` and ``core``, components are joined by their exact cheapest mutual-reachability
    edges to the other points (Borůvka over the complete graph, each component's edge found by
    brute force over all points), as long as a round compares at most :data:`BRIDGE_PAIRS` pairs:
    all components while the points are few, else those smaller than ``min_cluster_size``. Such a
    component cannot be a cluster alone, so where it joins decides what it belongs to. Joined at
    lambda 0 instead, 300 points of 10 blobs (a kNN graph of 10 pieces of 30 points, with
    ``min_cluster_size`` 50) came out all noise, where the exact tree finds two clusters. The
    components left, each big enough to be a cluster, are joined by edges of infinite weight
    (module docstring)."""
    forest = hk.component_labels(parent)
    components = int(np.count_nonzero(np.bincount(forest, minlength=len(parent))))
    parts = [(a, b, w)]
    if points is not None and core is not None and components > 1:
        parent = parent.copy()
        n = len(parent)
        while True:
            label = hk.component_labels(parent)
            size = np.bincount(label, minlength=n).astype(np.int64)
            if np.count_nonzero(size) <= 1:
                break
            if n * n <= BRIDGE_PAIRS:  # few points: every component's exact cheapest edge
                members = np.arange(n, dtype=np.int64)
            else:
                small = np.flatnonzero((size > 0) & (size < min_cluster_size))
                members = np.flatnonzero(np.isin(label, small)).astype(np.int64)
                if not len(members) or len(members) * n > BRIDGE_PAIRS:
                    break
            ea, eb, ew = hk.cheapest_outside(points, core, label, members)
            keep = eb >= 0
            added = hk.boruvka_merge(parent, size, label[ea[keep]].astype(np.int64), ea[keep], eb[keep], ew[keep])
            if not len(added[0]):
                break
            parts.append(added)
    ba, bb, bw = hk.bridge_components(parent)
    parts.append((ba, bb, bw))
    return (*(np.concatenate([p[i] for p in parts]) for i in range(3)), components)


def merge_candidates(parent: np.ndarray, size: np.ndarray, candidates: list[tuple[np.ndarray, ...]]
                     ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int]:
    """The driver's step of a Borůvka round: the executors' ``(comp, a, b, w)`` candidates -> the edges
    joined into the forest ``parent``/``size`` (in place) and how many candidates there were (0: done)."""
    comp, a, b, w = (np.concatenate([np.asarray(c[i]) for c in candidates]) if candidates else np.empty(0)
                     for i in range(4))
    edges = hk.boruvka_merge(parent, size, comp.astype(np.int64), a.astype(np.int64), b.astype(np.int64),
                             w.astype(np.float32))
    return edges, len(comp)


def cluster_graph(knn_idx: np.ndarray, knn_dist: np.ndarray, min_samples: int, min_cluster_size: int,
                  max_cluster_size: int = 0) -> np.ndarray:
    """HDBSCAN labels from a kNN graph (``(n, k)`` other points, ascending), in one process."""
    a, b, w, _ = spanning_tree(knn_idx, knn_dist, min_samples)
    return hk.clusters_from_tree(a, b, w, len(knn_idx), min_cluster_size, max_cluster_size)


# ----------------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------------


def _identity_labels(key: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Round 0's labels: every point its own component."""
    return (int(key) * shape[0] + np.arange(shape[0])).astype(dtype)


def hdbscan_tables(n: int, k: int) -> list[litz.Table]:
    """The kNN graph, the core distances and the component labels (both written whole by the driver,
    :func:`label_block` points a row)."""
    lb = label_block(n)
    nb = num_blocks(n, lb)
    return [*nndescent_tables(n, k),
            litz.Table(CORE_TABLE, shape=(lb,), dtype="float32", combiner="assign", num_rows=nb),
            litz.Table(COMP_TABLE, shape=(lb,), dtype="int32", init=_identity_labels, combiner="assign",
                       num_rows=nb)]


def _write_all(ps: litz.api.ParameterServer, table: str, values: np.ndarray, dtype: Any) -> None:
    """One value per point into every row of a block table (``assign``), in chunks of keys."""
    lb = label_block(len(values))
    nb = num_blocks(len(values), lb)
    padded = np.zeros(nb * lb, dtype)
    padded[:len(values)] = values
    blocks = padded.reshape(nb, lb)
    for lo in range(0, nb, READ_CHUNK):
        hi = min(nb, lo + READ_CHUNK)
        ps.update_many(table, range(lo, hi), blocks[lo:hi])


def _read_all(ps: litz.api.ParameterServer, table: str, n: int) -> np.ndarray:
    """Every row of a block table, flattened to one value per point (in chunks of keys)."""
    nb = num_blocks(n, label_block(n))
    return np.concatenate([ps.get_many(table, range(lo, min(nb, lo + READ_CHUNK))).reshape(-1)
                           for lo in range(0, nb, READ_CHUNK)])[:n]


# ----------------------------------------------------------------------------------------------------
# executors
# ----------------------------------------------------------------------------------------------------


class HDBExecutor(NNDescentExecutorMixin, litz.Executor):
    """Holds every point (read-only), owns a contiguous range; serves NN-Descent, core and Borůvka tasks.

    State after the core task: its rows of the kNN graph; after Borůvka round 0: its mutual-reachability
    rows and their cursors (plain arrays, so the executor can move or be checkpointed between rounds).
    """

    def load_input(self) -> NNDInput:
        x, _ = job_points(self.config)
        return NNDInput(x, NNDInput.partition(len(x), self.num_executors, self.executor_id))

    def setup(self) -> None:
        nndescent_warmup()
        hk.warmup()

    def run_task(self, args: dict[str, Any]) -> Any:
        if NNDescentPhase.is_task(args):
            return self.run_nnd_task(args)
        if args["phase"] == "core":
            return self._core(args)
        return self._boruvka(args)

    def _core(self, args: dict[str, Any]) -> dict[str, Any]:
        owned, k = self.input.owned, int(args["k"])
        if not len(owned):
            self.state = {"idx": np.empty((0, k), np.int64), "dist": np.empty((0, k), np.float32)}
            return {"phase": "core", "lo": 0, "core": np.empty(0, np.float32)}
        b0, b1 = int(owned[0]) // BLOCK, int(owned[-1]) // BLOCK + 1  # owned is a contiguous range
        rows = self.ps.get_many(args["knn"], range(b0, b1)).reshape(-1, 3 * k)[owned - b0 * BLOCK]
        idx, dist = rows[:, :k].astype(np.int64), np.sqrt(rows[:, k:2 * k])
        self.state = {"idx": idx, "dist": dist}
        return {"phase": "core", "lo": int(owned[0]), "core": hk.core_distances(dist, int(args["min_samples"]))}

    def _boruvka(self, args: dict[str, Any]) -> dict[str, Any]:
        n = len(self.input.data)
        owned = self.input.owned
        st = self.state if isinstance(self.state, dict) else {}
        if "nbr" not in st and "idx" not in st:
            # an executor restored by a recovery without its core rows, running a task of the attempt
            # that recovery abandoned (dispatched again before the driver heard of the loss): the
            # driver drops the answer, and the new attempt's core task comes next
            return {"phase": "boruvka", "round": args["round"], "stale": True}
        if "nbr" not in st:  # round 0: build the sorted mutual-reachability rows once
            core = _read_all(self.ps, CORE_TABLE, n)
            nbr, w = hk.mutual_reachability_rows(owned, st["idx"], st["dist"], core)
            self.state = st = {"nbr": nbr, "w": w, "start": np.zeros(len(owned), np.int64)}
        comp = _read_all(self.ps, COMP_TABLE, n)
        c, a, b, w = hk.cheapest_outgoing(owned, st["nbr"], st["w"], st["start"], comp)
        return {"phase": "boruvka", "round": args["round"], "comp": c, "a": a, "b": b, "w": w}


# ----------------------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------------------


class HDBDriver(litz.Driver):
    """NN-Descent phase, then the core/Borůvka rounds (or Kruskal in the master), then the tree."""

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        self.n = cfg["n"]
        self._t0 = time.perf_counter()
        self.laps = Laps(self._t0)  # the phases' seconds
        self.perm = job_points(cfg)[1]  # timed: the executors computed it too, while loading their input
        self.stage = "nnd"
        self.attempt = 0  # of the core and Borůvka stages: a recovery after NN-Descent starts them over
        self.nnd = NNDescentPhase(self, self.n, cfg["k"], num_executors=self.num_executors, delta=cfg["delta"],
                                  max_rounds=cfg["max_rounds"], seed=cfg["seed"], device=cfg.get("device", "cpu"),
                                  report=self._say)
        self.nnd.start()

    def _say(self, line: str) -> None:
        if not self.config["quiet"]:
            print(line, flush=True)

    def recovered(self, recovery: litz.Recovery) -> None:
        """During NN-Descent the phase refills the lists (``NNDescentPhase.recovered``). After it, the
        core and Borůvka stages start over as a new attempt (module docstring): at once after a
        worker's loss, after NN-Descent has refilled and converged again after a server's."""
        if self.stage == "nnd":
            self.nnd.recovered(recovery)
            return
        self.attempt += 1
        self._say(f"recovered from the loss of {', '.join(recovery.lost)} in the {self.stage} stage: "
                  + ("NN-Descent refills the lost lists, then " if recovery.role == "server" else "")
                  + "the spanning tree starts over")
        if recovery.role == "server":
            self.stage = "nnd"
            self.nnd.recovered(recovery)
        else:
            self._start_mst()

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        if self.nnd.handles(result):
            if self.nnd.on_complete(result):
                self._say(f"kNN graph: {self.nnd.stats['rounds']} NN-Descent rounds, {self.laps.lap('knn'):.2f} s")
                self._after_graph()
            return
        if self.stage == "nnd" or result.args["attempt"] != self.attempt:
            return  # a task of an attempt a recovery abandoned
        if result.value.get("stale"):
            raise RuntimeError(f"executor {result.executor_id} lost its core rows within attempt {self.attempt}")
        self._pending -= 1
        self._parts.append(result.value)
        if self._pending:
            return
        if self.stage == "core":
            self._write_cores()
            self.laps.lap("core")
            self._round()
        else:
            self._merge()

    def _dispatch_all(self, args: dict[str, Any]) -> None:
        self._pending = self.num_executors
        self._parts: list[dict[str, Any]] = []
        for e in range(self.num_executors):
            self.dispatch_task(e, {**args, "attempt": self.attempt})

    def _write_cores(self) -> None:
        """The executors' core distances, one contiguous range each, into ``hdb_core``."""
        core = np.zeros(self.n, np.float32)
        covered = 0
        for part in self._parts:
            lo, values = part["lo"], np.asarray(part["core"], np.float32)
            core[lo:lo + len(values)] = values
            covered += len(values)
        if covered != self.n:
            raise RuntimeError(f"the executors returned core distances for {covered} of {self.n} points")
        _write_all(self.ps, CORE_TABLE, core, np.float32)
        self.core = core  # for joining the kNN graph's small components exactly (bridged)

    def _after_graph(self) -> None:
        cfg = self.config
        if cfg["mst"] == "kruskal":
            graph = self.nnd.graph()
            if graph is None:  # a server was recovered during the read: refill and converge first
                return
            idx, dist = graph
            self.laps.lap("read graph")
            a, b, w, comps = spanning_tree(idx, dist, cfg["min_samples"], job_points(cfg)[0], cfg["min_cluster_size"])
            self._say(f"Kruskal MST in the master: {self.laps.lap('mst'):.2f} s")
            self._tree(a, b, w, comps)
            return
        self._start_mst()

    def _start_mst(self) -> None:
        """The core stage, then Borůvka from every point its own component (again, after a loss)."""
        cfg = self.config
        if self.attempt:  # the labels of the abandoned attempt's rounds are in the table
            _write_all(self.ps, COMP_TABLE, np.arange(self.n), np.int32)
        self.stage = "core"
        self.parent = np.arange(self.n)
        self.size = np.ones(self.n, np.int64)
        self.edges: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.components = self.n
        self.rounds = 0
        self._dispatch_all({"phase": "core", "knn": self.nnd.table, "k": cfg["k"], "min_samples": cfg["min_samples"]})

    def _round(self) -> None:
        self.stage = "boruvka"
        self._dispatch_all({"phase": "boruvka", "round": self.rounds})

    def _merge(self) -> None:
        (a, b, w), found = merge_candidates(self.parent, self.size,
                                            [tuple(c[f] for f in ("comp", "a", "b", "w")) for c in self._parts])
        self.edges.append((a, b, w))
        before, self.components = self.components, self.components - len(a)
        self.rounds += 1
        self._say(f"Borůvka round {self.rounds}: {before} -> {self.components} components, {found} candidates")
        if found and self.components > 1:
            _write_all(self.ps, COMP_TABLE, hk.component_labels(self.parent), np.int32)
            self._round()
            return
        self._say(f"Borůvka MST: {self.rounds} rounds, {self.laps.lap('mst'):.2f} s")
        a, b, w = (np.concatenate(p) for p in zip(*self.edges, strict=True))
        self._tree(*bridged(a, b, w, self.parent, job_points(self.config)[0], self.core,
                            self.config["min_cluster_size"]))

    def _tree(self, a: np.ndarray, b: np.ndarray, w: np.ndarray, components: int) -> None:
        cfg = self.config
        ordered = hk.clusters_from_tree(a, b, w, self.n, cfg["min_cluster_size"], cfg["max_cluster_size"])
        labels = np.empty_like(ordered)
        labels[self.perm] = ordered  # back to the input's order
        self.laps.lap("tree")
        total = time.perf_counter() - self._t0
        n_clusters = int(labels.max()) + 1
        finite = np.isfinite(w)
        out: dict[str, Any] = {"clusters": n_clusters, "noise": int((labels < 0).sum()), "seconds": total,
                               "times": dict(self.laps.parts), "components": components,
                               "mst_weight": float(w[finite].astype(np.float64).sum()),
                               "nnd_rounds": self.nnd.stats["rounds"], "nnd_refills": self.nnd.stats["refills"]}
        if cfg["mst"] == "boruvka":
            out["boruvka_rounds"] = self.rounds
            out["mst_restarts"] = self.attempt  # one attempt more per restart
        if cfg["return_labels"]:
            out["labels"] = labels
        self._say(f"{self.n} points: {n_clusters} clusters, {out['noise']} noise points, kNN graph in "
                  f"{components} component(s), {total:.2f} s")
        ref = cfg.get("reference_labels")
        if ref is not None:
            out["fm"] = fowlkes_mallows(np.asarray(ref), labels)
            if not cfg["quiet"]:
                print(f"Fowlkes-Mallows against {cfg['reference_name']}", flush=True)
            print(f"FM index {out['fm']:.3f}", flush=True)  # the result line, --quiet or not
        self.finish(out)

    def progress(self) -> str:
        stage = getattr(self, "stage", "")
        if stage == "nnd" and hasattr(self, "nnd"):  # (the phase may have failed to start)
            return self.nnd.progress()
        if stage == "boruvka":
            return f"Borůvka round {self.rounds + 1}, {self.components} components"
        return stage


# ----------------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="litz launch apps/hdbscan.py",
                                description="HDBSCAN on Litz: NN-Descent kNN graph, minimum spanning tree of the "
                                            "mutual-reachability graph (Borůvka micro-tasks or Kruskal), condensed "
                                            "tree, excess of mass. Last line: the Fowlkes-Mallows index against the "
                                            "hdbscan library (small sets) or the ground truth.")
    p.add_argument("--data", default="blobs",
                   help="blobs (Gaussian clusters), thesis (1,000 clusters + 20%% uniform noise) or FILE.npy")
    p.add_argument("--points", type=int, default=None, help="number of points (default 10,000; thesis 100,000; "
                                                            "a file: all its rows, or the first N)")
    p.add_argument("--dims", type=int, default=10, help="dimensions of the generated sets")
    p.add_argument("--clusters", type=int, default=None, help="Gaussian clusters (default blobs 10, thesis 1,000)")
    p.add_argument("--noise", type=float, default=None,
                   help="fraction of uniform noise points (default blobs 0, thesis 0.2)")
    p.add_argument("--k", type=int, default=DEFAULTS["k"], help="neighbours per point in the kNN graph")
    p.add_argument("--min-samples", type=int, default=DEFAULTS["min_samples"],
                   help="core distance = distance to the min_samples-th other point (hdbscan's convention)")
    p.add_argument("--min-cluster-size", type=int, default=DEFAULTS["min_cluster_size"])
    p.add_argument("--max-cluster-size", type=int, default=DEFAULTS["max_cluster_size"],
                   help="EOM never selects a larger cluster (0: no limit), as hdbscan's max_cluster_size")
    p.add_argument("--mst", choices=("kruskal", "boruvka"), default="boruvka",
                   help="boruvka: distributed rounds of micro-tasks; kruskal: one process (the master)")
    p.add_argument("--delta", type=float, default=0.001, help="NN-Descent stops below delta * n * k updates")
    p.add_argument("--max-rounds", type=int, default=30, help="NN-Descent rounds at most")
    p.add_argument("--seed", type=seed, default=0, help="seed of NN-Descent")
    p.add_argument("--data-seed", type=seed, default=0, help="seed of the generated set")
    p.add_argument("--reference", choices=("auto", "hdbscan", "truth", "none"), default="auto",
                   help="what the FM index compares with (auto: hdbscan up to --reference-limit points, else the "
                        "ground truth; a file has no ground truth)")
    p.add_argument("--reference-limit", type=int, default=DEFAULTS["reference_limit"])
    gpu.add_device_option(p, "NN-Descent's join distances", "apps/nndescent_cuda.py")
    p.add_argument("--no-order", dest="order", action="store_false",
                   help="keep the input's order of points (default: renumber them in a locality order first, "
                        "which makes NN-Descent faster; labels are reported in the input's order either way)")
    p.add_argument("--return-labels", action="store_true", help="litz.run returns the labels too (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the result line is printed)")
    return p


def make_app(argv: list[str]) -> litz.App:
    """Parse and check the options, load the data, run the reference if asked, declare the tables."""
    args = parser().parse_args(argv)
    generated = args.data in ("blobs", "thesis")
    if not generated and not Path(args.data).is_file():
        raise litz.ConfigError(f"--data must be blobs, thesis or an existing .npy file, got {args.data!r}")
    require_at_least(args, k=1, min_samples=1, dims=1, max_rounds=1, points=1, clusters=1)
    require_finite(args, non_negative=("delta",))
    gpu.check_device(args.device)
    if args.min_samples > args.k:
        raise litz.ConfigError(f"--min-samples ({args.min_samples}) must not exceed --k ({args.k}): the core "
                               "distance is read from the kNN graph")
    require_at_least(args, min_cluster_size=2, max_cluster_size=0)
    thesis = args.data == "thesis"
    config: dict[str, Any] = {
        "data": args.data, "points": args.points or (100_000 if thesis else 10_000 if generated else None),
        "dims": args.dims, "clusters": args.clusters or (1000 if thesis else 10),
        "noise": args.noise if args.noise is not None else (0.2 if thesis else 0.0), "data_seed": args.data_seed,
        "k": args.k, "min_samples": args.min_samples, "min_cluster_size": args.min_cluster_size,
        "max_cluster_size": args.max_cluster_size, "mst": args.mst, "delta": args.delta,
        "max_rounds": args.max_rounds, "seed": args.seed, "return_labels": args.return_labels, "quiet": args.quiet,
        "order": args.order, "device": args.device}
    if not 0 <= config["noise"] < 1:
        raise litz.ConfigError(f"--noise must be in [0, 1), got {config['noise']}")
    try:
        x, truth = load_points(config)
    except (OSError, ValueError) as exc:
        raise litz.ConfigError(str(exc).splitlines()[0]) from None
    n = len(x)
    if n <= args.k:
        raise litz.ConfigError(f"need more points than --k ({args.k}), got {n}")
    config["n"] = n
    ref = args.reference
    if ref == "auto":
        ref = "hdbscan" if n <= args.reference_limit or truth is None else "truth"
    if ref == "truth" and truth is None:
        raise litz.ConfigError("--reference truth: a file has no ground truth")
    if ref == "hdbscan":
        t = time.perf_counter()
        config["reference_labels"] = reference_hdbscan(x, args.min_samples, args.min_cluster_size,
                                                       args.max_cluster_size).astype(np.int32)
        config["reference_name"] = (f"the hdbscan library's labels (exact MST, "
                                    f"min_cluster_size={args.min_cluster_size}, min_samples={args.min_samples})")
        if not args.quiet:
            print(f"reference: hdbscan library on {n} points, {time.perf_counter() - t:.1f} s", flush=True)
    elif ref == "truth":
        config["reference_labels"] = truth.astype(np.int32)
        config["reference_name"] = "the ground truth (noise points as one label)"
    return litz.App(HDBDriver, HDBExecutor, tables=hdbscan_tables(n, args.k), config=config, name="hdbscan")


if __name__ == "__main__":
    from litz.cli import launch

    sys.exit(launch([__file__, *sys.argv[1:]]))
