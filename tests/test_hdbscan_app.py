"""HDBSCAN: the kernels against the ``hdbscan`` library on exact kNN graphs, Kruskal against Borůvka,
EOM on a hand-built condensed tree, max_cluster_size, and a distributed run through ``litz.run``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import make_blobs
from sklearn.neighbors import NearestNeighbors

import litz
from apps import gpu
from apps import hdbscan as hd
from apps import hdbscan_kernels as hk
from tests.hdbscan_reference import all_other_points, level_set_hdbscan, same_partition

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    """Compile every kernel here, once, into Numba's cache: the job's worker processes then load
    them instead of compiling in parallel during their start-up (on a fresh machine that took
    longer than the master waits for workers to initialise)."""
    hk.warmup()
    hd.nndescent_warmup()


def exact_graph(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest other points (sklearn), as the app's graph: int64 ids, float32 distances."""
    d, i = NearestNeighbors(n_neighbors=k + 1).fit(x).kneighbors(x)
    return i[:, 1:].astype(np.int64), d[:, 1:].astype(np.float32)


def separated_blobs(n: int, centers: int, seed: int) -> np.ndarray:
    return make_blobs(n, n_features=4, centers=centers, cluster_std=0.7, center_box=(-20, 20),
                      random_state=seed)[0].astype(np.float32)


# ----------------------------------------------------------------------------------------------------
# against the hdbscan library
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_labels_match_hdbscan_on_separated_blobs(seed: int) -> None:
    x = separated_blobs(2000, 6, seed)
    labels = hd.cluster_graph(*exact_graph(x, 15), min_samples=10, min_cluster_size=40)
    ref = hd.reference_hdbscan(x, 10, 40)
    assert labels.max() == ref.max() and labels.max() >= 4
    assert hd.fowlkes_mallows(ref, labels) >= 0.95


def test_tree_matches_hdbscan_given_its_spanning_tree_and_cuts_ties_together() -> None:
    """Dendrogram, condensed tree, EOM and labelling: fed the library's own minimum spanning tree of
    an overlapping, noisy set, the labels are exactly HDBSCAN*'s (the level-set reference). The
    library cuts tied edges one at a time; here that leaves 3 of its 1,500 points in a cluster
    that HDBSCAN* calls noise, so it agrees with us at FM 0.998, with the same clusters."""
    import hdbscan

    x, _ = hd.gaussian_mixture(1500, 2, 12, noise=0.2, half_width=12.0, seed=3)
    ref = hdbscan.HDBSCAN(min_cluster_size=25, min_samples=8, approx_min_span_tree=False,
                          gen_min_span_tree=True).fit(x)
    mst = ref.minimum_spanning_tree_.to_numpy()
    labels = hk.clusters_from_tree(mst[:, 0].astype(np.int64), mst[:, 1].astype(np.int64),
                                   mst[:, 2].astype(np.float32), len(x), 25)
    assert ref.labels_.max() >= 3 and (ref.labels_ < 0).sum() > 50
    assert same_partition(labels, level_set_hdbscan(x.astype(np.float64), 8, 25))
    assert hd.fowlkes_mallows(ref.labels_, labels) >= 0.99
    assert labels.max() == ref.labels_.max()


def test_tied_distances_are_cut_together_as_hdbscan_star_defines() -> None:
    """Points on a small integer grid: mutual-reachability distances tie everywhere (core distances,
    duplicates). Cutting a level's tied edges one at a time, a cluster could split into two big
    parts and one of them at once into small ones: a cluster of zero stability, which excess of
    mass may select (the libraries do, on about a third of these sets; so did this code, which
    agreed with the reference on 170 of 300). Every set must give exactly HDBSCAN*'s labels."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        n, dims = int(rng.integers(12, 60)), int(rng.integers(1, 3))
        x = rng.integers(0, int(rng.integers(3, 12)), size=(n, dims)).astype(np.float64)
        if rng.random() < 0.5:
            x += rng.normal(0, 1e-3, x.shape)  # no coordinate ties; core distances still tie
        min_samples, min_cluster_size = int(rng.integers(2, 5)), int(rng.integers(2, 6))
        idx, dist = all_other_points(x)
        labels = hd.cluster_graph(idx, dist, min_samples, min_cluster_size)
        assert same_partition(labels, level_set_hdbscan(x, min_samples, min_cluster_size)), (n, dims, x.tolist())


def test_core_distance_is_hdbscan_convention() -> None:
    """min_samples counts the point itself out: hdbscan queries min_samples + 1 points including it."""
    x = np.array([[0.0], [1.0], [3.0], [7.0], [15.0]], np.float32)
    _, dist = exact_graph(x, 3)
    np.testing.assert_array_equal(hk.core_distances(dist, 2), [3.0, 2.0, 3.0, 6.0, 12.0])
    with pytest.raises(ValueError, match="min_samples"):
        hk.core_distances(dist, 4)


# ----------------------------------------------------------------------------------------------------
# spanning trees
# ----------------------------------------------------------------------------------------------------


def boruvka_in_process(idx: np.ndarray, dist: np.ndarray, min_samples: int, parts: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The app's Borůvka protocol without the runtime: ``parts`` executors' kernel, the driver's merge."""
    n = len(idx)
    core = hk.core_distances(dist, min_samples)
    owned = np.array_split(np.arange(n, dtype=np.int64), parts)
    rows = [hk.mutual_reachability_rows(o, idx[o], dist[o], core) for o in owned]
    starts = [np.zeros(len(o), np.int64) for o in owned]
    parent, size = np.arange(n), np.ones(n, np.int64)
    comp = hk.component_labels(parent)
    edges, rounds = [], 0
    while True:
        cand = [hk.cheapest_outgoing(o, nbr, w, s, comp) for o, (nbr, w), s in zip(owned, rows, starts, strict=True)]
        added, found = hd.merge_candidates(parent, size, cand)
        if not found:
            break
        edges.append(added)
        rounds += 1
        comp = hk.component_labels(parent)
    a, b, w = (np.concatenate(f) for f in zip(*edges, strict=True))
    return a, b, w, parent, rounds


def test_kruskal_and_boruvka_give_minimum_spanning_forests_of_equal_weight() -> None:
    import scipy.sparse as sp
    from scipy.sparse.csgraph import connected_components, minimum_spanning_tree

    # two far groups: the kNN graph is disconnected, so both build forests and the bridges matter
    x = np.vstack([hd.gaussian_mixture(1200, 3, 5, noise=0.1, seed=1)[0],
                   hd.gaussian_mixture(300, 3, 1, seed=2)[0] + 500]).astype(np.float32)
    n = len(x)
    idx, dist = exact_graph(x, 12)
    ids = np.arange(n, dtype=np.int64)
    nbr, w = hk.mutual_reachability_rows(ids, idx, dist, hk.core_distances(dist, 6))
    ka, kb, kw, kparent = hk.kruskal(ids, nbr, w, n)
    ba, bb, bw, bparent, rounds = boruvka_in_process(idx, dist, 6, parts=3)
    assert 2 <= rounds <= np.log2(n) + 1
    # the oracle: scipy's MST of the symmetric mutual-reachability graph
    graph = sp.coo_matrix((w[nbr >= 0].astype(np.float64), (np.repeat(ids, (nbr >= 0).sum(1)), nbr[nbr >= 0])),
                          shape=(n, n)).tocsr()
    graph = graph.maximum(graph.T)
    comps = connected_components(graph, directed=False)[0]
    assert comps == 2
    oracle = minimum_spanning_tree(graph).sum()
    assert len(ka) == len(ba) == n - comps
    assert kw.astype(np.float64).sum() == pytest.approx(oracle, rel=1e-9)
    assert bw.astype(np.float64).sum() == pytest.approx(oracle, rel=1e-9)
    for a, b, w, parent in ((ka, kb, kw, kparent), (ba, bb, bw, bparent)):
        fa, fb, fw, c = hd.bridged(a, b, w, parent)
        assert c == comps and len(fa) == n - 1 and np.isinf(fw).sum() == comps - 1
        labels = hk.clusters_from_tree(fa, fb, fw, n, 40)
        assert set(labels[1200:]) == {labels[1200]} and labels[1200] >= 0  # the far group is one cluster


def test_a_knn_graph_in_pieces_smaller_than_a_cluster_is_joined_by_exact_edges() -> None:
    """300 points of 10 blobs with k = 15: the kNN graph is 10 pieces of about 30 points, each
    smaller than min_cluster_size 50, so where they join decides the clusters. Joined by infinite
    edges every point came out noise (FM 0.585); by their exact cheapest edges the labels are the
    ``hdbscan`` library's, which finds two clusters and 122 noise points."""
    cfg = hd.make_app(["--points", "300", "--reference", "none"]).config
    x, perm = hd.job_points(cfg)
    idx, dist = exact_graph(x, 15)
    a, b, w, comps = hd.spanning_tree(idx, dist, 10, x, 50)
    assert comps == 10 and len(a) == 299 and np.isfinite(w).all()  # one tree, of real edges only
    labels = np.empty(300, np.int64)
    labels[perm] = hk.clusters_from_tree(a, b, w, 300, 50)
    reference = hd.reference_hdbscan(hd.load_points(cfg)[0], 10, 50)  # the points in the input's order
    assert hd.fowlkes_mallows(reference, labels) == pytest.approx(1.0)
    assert (labels >= 0).any() and set(np.bincount(labels[labels >= 0])) == {100, 78}
    # without the points (as before), the same pieces all fall to noise
    fa, fb, fw, _ = hd.spanning_tree(idx, dist, 10)
    assert (hk.clusters_from_tree(fa, fb, fw, 300, 50) < 0).all()


# ----------------------------------------------------------------------------------------------------
# excess of mass
# ----------------------------------------------------------------------------------------------------


def hand_tree(fall15: float, fall16: float) -> tuple[np.ndarray, ...]:
    """14 points, root 14: noise points 12, 13 leave it at lambda 0.5; it splits at lambda 1 into
    cluster 15 (points 0-3, which fall out at lambda 5) and 16 (8 points), which splits at lambda 2
    into 17 (points 4-7, out at ``fall15``) and 18 (points 8-11, out at ``fall16``)."""
    rows = [(14, 12, 0.5, 1), (14, 13, 0.5, 1), (14, 15, 1.0, 4), (14, 16, 1.0, 8), (16, 17, 2.0, 4),
            (16, 18, 2.0, 4)]
    rows += [(15, p, 5.0, 1) for p in range(4)] + [(17, p, fall15, 1) for p in range(4, 8)]
    rows += [(18, p, fall16, 1) for p in range(8, 12)]
    p, c, lam, s = (np.array(col) for col in zip(*rows, strict=True))
    return p.astype(np.int64), c.astype(np.int64), lam.astype(np.float64), s.astype(np.int64)


@pytest.mark.parametrize(("components", "width", "spread", "cores"),
                         [(7, 12, 3, (0, 3)), (30, 12, 1, (0, 3)), (7, 12, 3, (0, 9)), (7, 2, 1, (10, 11)),
                          (200, 12, 3, (0, 3))])
def test_each_components_cheapest_edge_outside_it_is_the_brute_force_one(components: int, width: int, spread: int,
                                                                         cores: tuple[int, int]) -> None:
    """``cheapest_outside`` searches a component's members nearest another component first and skips
    what a bound rules out (7 blobs; 30 tight ones, whose bounds are close to their edges; 7 blobs
    whose core distances, up to 8, make many edges weigh the same; 7 blobs close together whose
    core distances, all 10, make the cheapest edges all weigh 10, so the order of the points decides),
    or searches every member over every point (200 components of 600 points are too many to bound).
    Either way its edges must be true edges, and the cheapest of each component's, in the order (w,
    a, b), that of the plain search over every member and every point outside. A component that
    holds every point has no edge."""
    rng = np.random.default_rng(3)
    label = rng.integers(0, components, 600).astype(np.int32)  # as bridged passes them
    centres = rng.integers(-width, width + 1, (components, 5))
    x = (centres[label] + rng.integers(-spread, spread + 1, (600, 5))).astype(np.float32)
    core = rng.integers(*cores, 600).astype(np.float32)
    members = np.sort(rng.choice(600, 250, replace=False)).astype(np.int64)
    a, b, w = hk.cheapest_outside(x, core, label, members)

    def weight(p: int, q: np.ndarray) -> np.ndarray:  # float32, as the kernel and the tree keep them
        d = np.sqrt(((x[q] - x[p]).astype(np.float64) ** 2).sum(axis=1))
        return np.maximum(np.maximum(core[p], core[q]), d).astype(np.float32)

    assert set(a.tolist()) <= set(members.tolist()) and (b >= 0).all() and (label[a] != label[b]).all()
    assert all(wq == weight(p, np.array([q]))[0] for p, q, wq in zip(a, b, w, strict=True))
    for c in np.unique(label[members]):
        mine = members[label[members] == c]  # ascending, as ``out``: the first minimum is the smallest (a, b)
        out = np.flatnonzero(label != c)
        weights = np.stack([weight(p, out) for p in mine])
        i, j = np.unravel_index(np.argmin(weights), weights.shape)
        got = min((float(wq), int(p), int(q)) for p, q, wq in zip(a, b, w, strict=True) if label[p] == c)
        assert got == (float(weights[i, j]), int(mine[i]), int(out[j])), c
    a, b, w = hk.cheapest_outside(x, core, np.zeros(600, np.int32), members)
    assert (b == -1).all() and np.isinf(w).all()


def test_eom_selects_by_stability_on_a_hand_built_tree() -> None:
    n = 14
    # stabilities: 15: 4 * (5 - 1) = 16; 16: 8 * (2 - 1) = 8; 17: 4 * (3 - 2) = 4; 18: 4 * (4 - 2) = 8
    labels, stab = hk.select_clusters(*hand_tree(3.0, 4.0), n, 0)
    np.testing.assert_allclose(stab[1:], [16.0, 8.0, 4.0, 8.0])
    np.testing.assert_array_equal(labels, [0] * 4 + [1] * 4 + [2] * 4 + [-1, -1])  # 4 + 8 > 8: the children
    # 17 and 18 now sum to 2 + 4 < 8: cluster 16 is kept whole
    labels, _ = hk.select_clusters(*hand_tree(2.5, 3.0), n, 0)
    np.testing.assert_array_equal(labels, [0] * 4 + [1] * 8 + [-1, -1])
    # ... unless it is larger than max_cluster_size
    labels, _ = hk.select_clusters(*hand_tree(2.5, 3.0), n, 6)
    np.testing.assert_array_equal(labels, [0] * 4 + [1] * 4 + [2] * 4 + [-1, -1])
    # nothing small enough: all noise
    labels, _ = hk.select_clusters(*hand_tree(2.5, 3.0), n, 3)
    assert (labels == -1).all()


def test_max_cluster_size_is_respected_and_matches_hdbscan() -> None:
    # two groups of two close blobs: without a limit EOM takes the groups, with one the blobs
    centres = np.array([[0, 0], [4.5, 0], [40, 0], [44.5, 0]], float)
    x = make_blobs(1600, centers=centres, cluster_std=1.0, random_state=5)[0].astype(np.float32)
    graph = exact_graph(x, 15)
    free = hd.cluster_graph(*graph, 10, 40)
    limited = hd.cluster_graph(*graph, 10, 40, max_cluster_size=500)
    assert free.max() + 1 == 2
    assert limited.max() + 1 == 4
    assert np.bincount(limited[limited >= 0]).max() <= 500
    assert hd.fowlkes_mallows(hd.reference_hdbscan(x, 10, 40, 500), limited) >= 0.95


class AssignedRows:
    """Tables in this process with the servers' checks, rows replaced on update (``assign``)."""

    def __init__(self, tables: dict[str, litz.Table]) -> None:
        self.tables = tables
        self.rows: dict[tuple[str, int], np.ndarray] = {}

    def get_many(self, name: str, keys: object) -> np.ndarray:
        t = self.tables[name]
        return np.stack([self.rows.get((name, key), t.initial_row(key)) for key in t.check_keys(keys)])

    def update_many(self, name: str, keys: object, deltas: np.ndarray) -> None:
        t = self.tables[name]
        checked = t.check_keys(keys)
        for key, row in zip(checked, t.check_delta(deltas, n=len(checked)), strict=True):
            self.rows[name, key] = row


def test_label_tables_hold_up_to_4096_points_a_row_and_round_trip_every_value() -> None:
    """Borůvka's label and core-distance tables: every round each executor reads all the labels and
    the driver writes them all, so their rows are wide (at most 64 rows, at most 4,096 points a row,
    128 rows at 2**19), and what the driver writes, padded to whole rows, is what an executor reads
    back, value for value, whatever ``n``; before the first write the labels are the identity."""
    assert [hd.label_block(n) for n in (1, 3000, 4096, 4097, 100_000, 2 ** 19, 2 ** 20)] == [
        64, 64, 64, 128, 2048, 4096, 4096]
    for n in (3000, 5001, 70_000):
        tables = {t.name: t for t in hd.hdbscan_tables(n, 5)}
        ps = AssignedRows(tables)
        lb = hd.label_block(n)
        for name in (hd.CORE_TABLE, hd.COMP_TABLE):
            assert tables[name].shape == (lb,) and tables[name].num_rows == -(-n // lb) <= hd.LABEL_ROWS
        np.testing.assert_array_equal(hd._read_all(ps, hd.COMP_TABLE, n), np.arange(n))
        labels = np.random.default_rng(n).integers(0, n, n)
        core = np.random.default_rng(n + 1).random(n).astype(np.float32)
        hd._write_all(ps, hd.COMP_TABLE, labels, np.int32)
        hd._write_all(ps, hd.CORE_TABLE, core, np.float32)
        np.testing.assert_array_equal(hd._read_all(ps, hd.COMP_TABLE, n), labels)
        np.testing.assert_array_equal(hd._read_all(ps, hd.CORE_TABLE, n), core)


# ----------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mst", ["boruvka", "kruskal"])
def test_distributed_run_matches_hdbscan(etcd, mst: str) -> None:
    argv = ["--data", "blobs", "--points", "3000", "--dims", "5", "--clusters", "8", "--min-cluster-size", "30",
            "--mst", mst, "--reference", "none", "--return-labels", "--quiet"]
    res = litz.run(hd.make_app(argv), workers=2, servers=1, num_executors=6, etcd=etcd.url)
    x, _ = hd.load_points(hd.make_app(argv).config)
    ref = hd.reference_hdbscan(x, 10, 30)
    assert hd.fowlkes_mallows(ref, res.value["labels"]) >= 0.95
    assert res.value["clusters"] == ref.max() + 1
    if mst == "boruvka":
        assert 1 <= res.value["boruvka_rounds"] <= 12


def test_cli_help_and_option_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "litz.cli", "launch", "apps/hdbscan.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--min-cluster-size" in out.stdout and "--mst" in out.stdout
    with pytest.raises(litz.ConfigError, match="must not exceed --k"):
        hd.make_app(["--k", "5", "--min-samples", "10"])
    with pytest.raises(litz.ConfigError, match="--data"):
        hd.make_app(["--data", "nowhere.npy"])
    with pytest.raises(litz.ConfigError, match="--points must be a positive integer, got -5"):
        hd.make_app(["--points", "-5"])
    with pytest.raises(litz.ConfigError, match="--delta must be a number >= 0, got -1.0"):  # failed in the job
        hd.make_app(["--delta", "-1", "--reference", "none"])
    with pytest.raises(litz.ConfigError, match="--min-cluster-size must be at least 2, got 1"):
        hd.make_app(["--min-cluster-size", "1", "--reference", "none"])
    with pytest.raises(SystemExit):  # argparse: a seed must be a non-negative integer (NumPy's rule)
        hd.make_app(["--data-seed", "-1"])
    with pytest.raises(litz.ConfigError, match="--clusters must be a positive integer, got 0"):
        hd.make_app(["--clusters", "0"])
    assert "--device" in out.stdout
    if not gpu.available():  # the GPU join (apps/nndescent_cuda.py) is refused before anything starts
        with pytest.raises(litz.ConfigError, match="--device cuda: no CUDA GPU"):
            hd.make_app(["--device", "cuda"])


class LoseAProcessInBoruvka(hd.HDBDriver):
    """HDBDriver that SIGKILLs ``config["victim"]`` at the first completion of Borůvka round 0, with
    the other tasks of the round still out (once: ``struck`` survives a full recovery's rollback)."""

    transient = ("struck",)

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        strike = self.stage == "boruvka" and self.attempt == 0 and not getattr(self, "struck", False)
        super().handle_task_completion(result)
        if strike:
            self.struck = True
            os.kill(self._master.procs[self.config["victim"]]["pid"], signal.SIGKILL)  # test-only access


@pytest.mark.parametrize("victim, recovery", [("w1", "partial"), ("s1", "partial"), ("w1", "full")])
def test_a_loss_in_the_spanning_tree_stage_recovers_and_the_labels_match(etcd, tmp_path: Path, victim: str,
                                                                         recovery: str) -> None:
    """Partial recovery: a worker lost during Borůvka comes back without its executors' core rows,
    and the stages start over from the core distances. A server lost there takes graph rows, cores
    and labels with it (no checkpoint yet: they come back empty): NN-Descent refills the lists first.
    The clusters must be the reference's, which fails if the restart keeps the abandoned attempt's
    component labels (round 0 then skips edges inside old components) or its tasks' answers.
    Full recovery rolls the job back to a checkpoint taken every 0.2 s: the driver, whose NN-Descent
    phase holds it, must checkpoint (it failed on the master's lock) and come back bound."""
    argv = ["--data", "blobs", "--points", "3000", "--dims", "5", "--clusters", "8", "--min-cluster-size", "30",
            "--reference", "none", "--return-labels", "--quiet"]
    app = hd.make_app(argv)
    app.driver = LoseAProcessInBoruvka
    app.config["victim"] = victim
    res = litz.run(app, workers=2, servers=2, num_executors=6, etcd=etcd.url, checkpoint_dir=str(tmp_path / "ck"),
                   checkpoint_every="600s" if recovery == "partial" else "0.2s", recovery=recovery)
    (rec,) = res.stats["master"]["recoveries"]
    assert rec["lost"] == victim and rec["strategy"] == recovery
    out = res.value
    if recovery == "partial":
        assert out["mst_restarts"] == 1 and out["nnd_refills"] == (victim == "s1")
    else:
        assert res.stats["master"]["checkpoints"] and out["mst_restarts"] == 0
    x, _ = hd.load_points(app.config)
    ref = hd.reference_hdbscan(x, 10, 30)
    assert out["clusters"] == ref.max() + 1
    assert hd.fowlkes_mallows(ref, out["labels"]) >= 0.95
    assert 1 <= out["boruvka_rounds"] <= 12


def test_a_points_file_that_is_not_a_matrix_of_reals_is_refused_naming_it(tmp_path: Path) -> None:
    text = tmp_path / "notes.npy"
    text.write_text("hello")
    cases = {text: "not a NumPy .npy file of numbers"}
    for name, array, why in (
            ("complex.npy", np.ones((50, 3), complex), "real-valued points expected, got dtype complex128"),  # (its
            # imaginary part was dropped in silence)
            ("empty.npy", np.ones((100, 0)), r"a 2-d matrix of points expected, got shape \(100, 0\)"),
            # (a NaN or an infinity made the kNN graph's random projections loop for ever: the job hung)
            ("nan.npy", np.r_[np.ones((3, 2)), [[np.nan, 0.0]]], "point 3 has a coordinate that is NaN or infinite"),
            ("inf.npy", np.r_[[[0.0, -np.inf]], np.ones((3, 2))], "point 0 has a coordinate that is NaN or infinite")):
        np.save(tmp_path / name, array)
        cases[tmp_path / name] = why
    for path, why in cases.items():
        with pytest.raises(litz.ConfigError, match=f"{path}: {why}"):
            hd.make_app(["--data", str(path), "--reference", "none"])


def test_points_too_large_or_small_for_float32_distances_are_scaled_and_cluster_as_given(tmp_path: Path) -> None:
    """Coordinates of 1e20 made every squared distance overflow in float32 (all points noise), and
    of 1e-25 vanish (all distances tie). They are scaled by a power of two, which keeps every
    distance's order and ratios: the labels are those of the data at a usual scale."""
    x = separated_blobs(600, 3, 0).astype(np.float64)
    want = hd.cluster_graph(*exact_graph(x, 15), min_samples=10, min_cluster_size=40)
    assert want.max() == 2
    for scale in (1e20, 1e-25):
        np.save(tmp_path / "far.npy", x * scale)
        points, _ = hd.load_points(hd.make_app(["--data", str(tmp_path / "far.npy"), "--reference", "none"]).config)
        assert points.dtype == np.float32 and 2.0 ** -hd.SCALE_BITS < np.abs(points).max() < 2.0 ** hd.SCALE_BITS
        np.testing.assert_array_equal(hd.cluster_graph(*exact_graph(points, 15), min_samples=10,
                                                       min_cluster_size=40), want)
        hd._load.cache_clear()  # (one file name, two contents)
