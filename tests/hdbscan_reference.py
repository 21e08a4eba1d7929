"""HDBSCAN* from its definition, by brute force: the oracle of ``tests/test_hdbscan_app.py`` and
``bench/bench_hdbscan_ties.py`` (small sets only: all pairs' distances are held)."""

from __future__ import annotations

import numpy as np
from sklearn.neighbors import NearestNeighbors


def _find(root: list[int], a: int) -> int:
    while root[a] != a:
        root[a] = root[root[a]]
        a = root[a]
    return a


def level_set_hdbscan(x: np.ndarray, min_samples: int, min_cluster_size: int) -> np.ndarray:
    """HDBSCAN* from its definition (Campello et al. 2015), by brute force, for small sets: the
    labels ``apps.hdbscan_kernels`` must give. Mutual-reachability distances of all pairs, a minimum spanning tree
    by Prim's algorithm, then each level of the tree's weights from the top: remove every edge of
    that weight at once, and look at the connected parts of each cluster (ties are cut together,
    unlike a binary dendrogram). Excess of mass with the root excluded, ties kept by the parent."""
    n = len(x)
    dist = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    core = np.sort(dist, axis=1)[:, min_samples]  # column 0 is the point itself
    mr = np.maximum(dist, np.maximum(core[:, None], core[None, :]))
    inside, best, src, edges = np.zeros(n, bool), mr[0].copy(), np.zeros(n, int), []
    inside[0] = True
    for _ in range(n - 1):
        v = int(np.argmin(np.where(inside, np.inf, best)))
        edges.append((src[v], v, best[v]))
        inside[v] = True
        closer = ~inside & (mr[v] < best)
        best[closer], src[closer] = mr[v][closer], v
    clusters = [{"points": set(range(n)), "birth": 0.0, "parent": -1, "children": [], "stability": 0.0}]
    live, fell_from = [0], {}
    for level in sorted({w for _, _, w in edges}, reverse=True):
        lam = 1.0 / level if level > 0 else np.inf
        root = list(range(n))
        for a, b, w in edges:
            if w < level:
                root[_find(root, a)] = _find(root, b)
        still = []
        for c in live:
            cl = clusters[c]
            parts: dict[int, set[int]] = {}
            for p in cl["points"]:
                parts.setdefault(_find(root, p), set()).add(p)
            if len(parts) == 1:
                still.append(c)
                continue
            big = [q for q in parts.values() if len(q) >= min_cluster_size]
            keep = big[0] if len(big) == 1 else None
            for q in parts.values():
                if q is keep:
                    continue
                cl["stability"] += (lam - cl["birth"]) * len(q)
                if len(big) >= 2 and len(q) >= min_cluster_size:
                    cl["children"].append(len(clusters))
                    still.append(len(clusters))
                    clusters.append({"points": q, "birth": lam, "parent": c, "children": [], "stability": 0.0})
                else:
                    fell_from.update(dict.fromkeys(q, c))
            if keep is not None:
                cl["points"] = keep
                still.append(c)
        live = still
    selected: set[int] = set()

    def excess_of_mass(c: int) -> float:
        below = sum(excess_of_mass(k) for k in clusters[c]["children"])
        if c != 0 and (not clusters[c]["children"] or clusters[c]["stability"] >= below):
            selected.add(c)
            return clusters[c]["stability"]
        return below

    excess_of_mass(0)
    labels = np.full(n, -1)
    names: dict[int, int] = {}
    for p, c in fell_from.items():
        top = -1
        while c >= 0:  # the topmost selected cluster above the one p fell out of
            top = c if c in selected else top
            c = clusters[c]["parent"]
        if top >= 0:
            labels[p] = names.setdefault(top, len(names))
    return labels


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """The same noise points and the same clusters, whatever their numbers."""
    if not np.array_equal(a < 0, b < 0):
        return False
    pairs = set(zip(a[a >= 0].tolist(), b[b >= 0].tolist(), strict=True))
    return len(pairs) == len({p for p, _ in pairs}) == len({q for _, q in pairs})


def all_other_points(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every other point of each point, nearest first (ties by id), as the app's graph."""
    n = len(x)
    d, i = NearestNeighbors(n_neighbors=n).fit(x).kneighbors(x)
    idx, dist = np.empty((n, n - 1), np.int64), np.empty((n, n - 1), np.float32)
    for r in range(n):  # drop the point itself, which a repeated point need not list first
        keep = sorted((dd, ii) for dd, ii in zip(d[r], i[r], strict=True) if ii != r)
        idx[r] = [ii for _, ii in keep]
        dist[r] = [dd for dd, _ in keep]
    return idx, dist
