"""Numba kernels of HDBSCAN on a k-nearest-neighbour graph (apps/hdbscan.py): mutual reachability,
minimum spanning trees (Kruskal, and the two halves of a distributed Borůvka step), the single-linkage
hierarchy, the condensed tree, excess-of-mass selection and the labels.

**Conventions (those of the ``hdbscan`` library, so that the labels can be compared).**

- A kNN graph here lists, per point, its ``k`` nearest *other* points, sorted ascending, id -1 for a
  missing entry. The ``hdbscan`` library computes the core distance as the last of the
  ``min_samples + 1`` nearest points *counting the point itself* (``tree.query(X, k=min_samples + 1)``
  in both its Prim and Borůvka paths; ``match_reference_implementation=True`` subtracts one). So the
  core distance is the distance to the ``min_samples``-th other point: column ``min_samples - 1`` of
  our graph, which needs ``k >= min_samples``.
- Mutual reachability ``mr(a, b) = max(d(a, b), core(a), core(b))`` (``alpha`` = 1).
- Edges are ordered totally by ``(weight, min(a, b), max(a, b))``. Borůvka needs one total order so
  that the cheapest edges chosen by different components never close a cycle; Kruskal's total weight
  does not depend on it.
- Condensed tree: cluster ids start at ``n`` (the root) and children get larger ids than their
  parent, so descending id order is children-before-parents (what EOM needs) and ascending is
  parents-first (what labelling needs). ``lambda = 1 / distance``; an infinite distance (the bridges
  between components of a disconnected graph) gives lambda 0, i.e. a split at the very top.
- A point is labelled with the selected cluster it falls out of, or of any descendant of it; points
  that fall out of the unselected root are noise (-1). Labels are numbered by ascending cluster id,
  as the ``hdbscan`` library numbers them.

Weights are float32 (the graph's distances): Kruskal and Borůvka see bit-identical weights, so their
total weights agree exactly up to the float64 summation. Every kernel is ``cache=True, nogil=True``.
"""

from __future__ import annotations

import numba
import numpy as np

from apps.kernel_util import insert_sorted

_jit = numba.njit(cache=True, nogil=True)
_inline = numba.njit(cache=True, nogil=True, inline="always")


# ----------------------------------------------------------------------------------------------------
# mutual reachability
# ----------------------------------------------------------------------------------------------------


def core_distances(knn_dist: np.ndarray, min_samples: int) -> np.ndarray:
    """Core distance of every row: its ``min_samples``-th other neighbour (``hdbscan``'s convention)."""
    if not 1 <= min_samples <= knn_dist.shape[1]:
        raise ValueError(f"min_samples must be in [1, k={knn_dist.shape[1]}], got {min_samples}")
    return np.ascontiguousarray(knn_dist[:, min_samples - 1], np.float32)


@_jit
def mutual_reachability_rows(ids: np.ndarray, knn_idx: np.ndarray, knn_dist: np.ndarray, core: np.ndarray
                             ) -> tuple[np.ndarray, np.ndarray]:
    """The mutual-reachability edges of points ``ids`` (rows of ``knn_idx``/``knn_dist``).

    Returns ``(nbr int32 (m, k), w float32 (m, k))``, each row sorted by ``(w, nbr)``; missing
    entries, self-loops and infinite distances become ``(-1, +inf)`` at the row's end. With one ``u``
    per row, sorting by ``(w, v)`` is the global total order ``(w, min, max)`` restricted to the row,
    so the first edge of a row leaving ``u``'s component is ``u``'s cheapest in that order.
    """
    m, k = knn_idx.shape
    nbr = np.full((m, k), -1, np.int32)
    w = np.full((m, k), np.inf, np.float32)
    key_w = np.empty(k, np.float32)
    key_v = np.empty(k, np.int64)
    for i in range(m):
        u = ids[i]
        cu = core[u]
        c = 0
        for s in range(k):
            v = knn_idx[i, s]
            d = knn_dist[i, s]
            if v < 0 or v == u or not np.isfinite(d):
                continue
            insert_sorted(key_w, key_v, c, max(d, cu, core[v]), v)  # by (w, v): rows are short (k ~ 15)
            c += 1
        for s in range(c):
            nbr[i, s] = key_v[s]
            w[i, s] = key_w[s]
    return nbr, w


# ----------------------------------------------------------------------------------------------------
# union-find
# ----------------------------------------------------------------------------------------------------


@_inline
def _find(parent: np.ndarray, x: int) -> int:
    """Root of ``x``, halving the path on the way."""
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


@_inline
def _union(parent: np.ndarray, size: np.ndarray, a: int, b: int) -> None:
    """Join two roots, the smaller under the larger (keeps the trees shallow)."""
    if size[a] < size[b]:
        a, b = b, a
    parent[b] = a
    size[a] += size[b]


@_jit
def component_labels(parent: np.ndarray) -> np.ndarray:
    """Every point's root (int32): the component labels that a Borůvka round sends to the executors."""
    n = parent.shape[0]
    out = np.empty(n, np.int32)
    for i in range(n):
        out[i] = _find(parent, i)
    return out


# ----------------------------------------------------------------------------------------------------
# minimum spanning forests
# ----------------------------------------------------------------------------------------------------


@_jit
def _join_in_order(parent: np.ndarray, size: np.ndarray, eu: np.ndarray, ev: np.ndarray, ew: np.ndarray,
                   limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kruskal's step, shared by Kruskal and Borůvka's merge: take the edges by increasing weight
    (stable), keep those joining two trees of ``parent`` (updated in place), at most ``limit``."""
    order = np.argsort(ew, kind="mergesort")
    oa = np.empty(limit, np.int64)
    ob = np.empty(limit, np.int64)
    ow = np.empty(limit, np.float32)
    e = 0
    for t in order:
        if e == limit:
            break
        ra = _find(parent, eu[t])
        rb = _find(parent, ev[t])
        if ra != rb:
            _union(parent, size, ra, rb)
            oa[e] = eu[t]
            ob[e] = ev[t]
            ow[e] = ew[t]
            e += 1
    return oa[:e], ob[:e], ow[:e]


@_jit
def kruskal(ids: np.ndarray, nbr: np.ndarray, w: np.ndarray, n: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Minimum spanning forest of the rows' edges (one process): ``(a, b, w, parent)``.

    ``parent`` is the final union-find forest, for :func:`bridge_components`. Each undirected edge
    may appear twice (once from each end); the second is a cycle and is skipped.
    """
    m, k = nbr.shape
    total = 0
    for i in range(m):
        for s in range(k):
            if nbr[i, s] >= 0:
                total += 1
    eu = np.empty(total, np.int64)
    ev = np.empty(total, np.int64)
    ew = np.empty(total, np.float32)
    c = 0
    for i in range(m):
        for s in range(k):
            if nbr[i, s] >= 0:
                eu[c] = ids[i]
                ev[c] = nbr[i, s]
                ew[c] = w[i, s]
                c += 1
    parent = np.arange(n)
    size = np.ones(n, np.int64)
    a, b, ww = _join_in_order(parent, size, eu, ev, ew, max(n - 1, 0))
    return a, b, ww, parent


@_inline
def _before(w1: float, a1: int, b1: int, w2: float, a2: int, b2: int) -> bool:
    """The total edge order ``(w, min, max)`` (callers pass ``a <= b``)."""
    return w1 < w2 or (w1 == w2 and (a1 < a2 or (a1 == a2 and b1 < b2)))


@_jit
def _best_per_component(comp: np.ndarray, w: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Indices of the first edge, in the total order, of each distinct ``comp`` (``a <= b``)."""
    order = np.argsort(comp, kind="mergesort")
    keep = np.empty(len(comp), np.int64)
    c = 0
    i = 0
    while i < len(order):
        best = order[i]
        j = i + 1
        while j < len(order) and comp[order[j]] == comp[best]:
            t = order[j]
            if _before(w[t], a[t], b[t], w[best], a[best], b[best]):
                best = t
            j += 1
        keep[c] = best
        c += 1
        i = j
    return keep[:c]


@_jit
def cheapest_outgoing(ids: np.ndarray, nbr: np.ndarray, w: np.ndarray, start: np.ndarray, comp: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One executor's half of a Borůvka round: for each component among its points ``ids``, the
    cheapest edge leaving it: ``(comp, a, b, w)`` with ``a < b``.

    ``start[i]`` (updated in place) skips the front of row ``i`` whose edges are inside the point's
    component: components only grow, so an edge inside stays inside and each row is scanned once
    over all rounds, not once per round. Rows are sorted by ``(w, v)``, so the first edge leaving
    is the row's cheapest.
    """
    m, k = nbr.shape
    cc = np.empty(m, np.int64)
    ca = np.empty(m, np.int64)
    cb = np.empty(m, np.int64)
    cw = np.empty(m, np.float32)
    c = 0
    for i in range(m):
        u = ids[i]
        cu = comp[u]
        s = start[i]
        while s < k and nbr[i, s] >= 0 and comp[nbr[i, s]] == cu:
            s += 1
        start[i] = s
        if s < k and nbr[i, s] >= 0:
            v = nbr[i, s]
            cc[c] = cu
            ca[c] = min(u, v)
            cb[c] = max(u, v)
            cw[c] = w[i, s]
            c += 1
    keep = _best_per_component(cc[:c], cw[:c], ca[:c], cb[:c])
    return cc[keep], ca[keep], cb[keep], cw[keep]


@_jit
def boruvka_merge(parent: np.ndarray, size: np.ndarray, comp: np.ndarray, a: np.ndarray, b: np.ndarray,
                  w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The driver's half of a Borůvka round: the executors' candidates ``(comp, a, b, w)`` (several per
    component when its points span executors) -> the cheapest per component, joined in the total
    order; returns the edges added to the forest (``parent``/``size`` updated in place).

    Two components may choose the same edge, and with the total order no set of chosen edges closes
    a cycle; the union-find check skips the duplicates."""
    keep = _best_per_component(comp, w, a, b)  # equal weights: keep's order is by component, fine
    return _join_in_order(parent, size, a[keep], b[keep], w[keep], len(keep))


#: :func:`cheapest_outside` bounds balls of at most this many points of one component (consecutive
#: ids, which the locality order makes near points).
BALL_POINTS = 64
#: ... and only while there are at most this share of a ball per point (bounds per ball and member
#: cost more than they save when the components are nearly single points).
BOUND_BALLS = 1 / 8
#: ... and only when at least this share of the points are members (``bridged`` joining every piece
#: of a small graph). Building the balls costs about a microsecond per point, as much as scanning
#: every point for 150-200 members at 2**20 points; and where the pieces are not compact the bounds
#: rule out little: 400 members of 256 pieces of random points at 2**20 took 3.6 s instead of 2.6 s.
BOUND_MEMBERS = 1 / 4


def cheapest_outside(data: np.ndarray, core: np.ndarray, label: np.ndarray, members: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges ``(a, b, w)`` from points of ``members`` to points of other components (``label[b] !=
    label[a]``), mutual-reachability weights ``max(core[a], core[b], |a - b|)`` in float32, among them,
    for each component of the members, its cheapest in the order ``(w, a, b)``, exactly (``b = -1``,
    ``w = inf``: no point outside). What :func:`boruvka_merge` then takes, as ``bridged`` does.

    A brute-force search over all points, with shortcuts that change no answer. The points of each
    component are cut into balls of at most :data:`BALL_POINTS` consecutive ids (centre, radius,
    smallest core distance). A component is searched ball by ball, nearest another component
    first: each of its balls visits the other components' balls in the order of a lower bound of
    the edges between them (the distance of the centres less both radii, and the smallest core
    distances), and stops at the first bound above the component's best edge so far; a ball whose
    smallest bound is above it is not searched at all; inside a pair of balls, a member whose bound
    to the other ball is above it is skipped, and a distance stops adding dimensions once its sum is
    past the best edge's square. Margins far above the rounding keep every edge that could still
    win or tie. Components are searched in parallel. At 2**14 points of 10 blobs in 10 dimensions (a
    kNN graph in 10 pieces, every point a member) the search of every member over every point took
    1.8-2.9 s of one core; bounding each member's edges to every ball, 0.05-0.07 and 0.15-0.18 s
    for the two rounds of joins (the bounds themselves, a member times a ball, were most of it);
    bounding pairs of balls first, 0.02-0.03 and 0.05-0.07 s. (In 10 dimensions a ball of 64 of a
    blob's 1,600 points is most of the blob's width, so the bounds of balls rule out little by
    themselves; balls of 16, 32 and 128 points were slower.) With many small components (more than
    :data:`BOUND_BALLS` of a ball per point) or few members (:data:`BOUND_MEMBERS`), each member scans
    every point (one edge per member)."""
    n = data.shape[0]
    members = np.ascontiguousarray(members, np.int64)
    comps, inverse = np.unique(np.asarray(label), return_inverse=True)
    inverse = inverse.astype(np.int64)
    order = np.argsort(inverse, kind="stable").astype(np.int64)  # each component's points in id order
    starts = np.searchsorted(inverse[order], np.arange(len(comps) + 1))
    sizes = np.diff(starts)
    per = -(-sizes // BALL_POINTS)  # balls per component
    if per.sum() > BOUND_BALLS * max(n, 1) or len(members) < BOUND_MEMBERS * n:
        return _nearest_outside_all(data, core, label, members)
    comp_balls = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)  # component c: balls comp_balls[c]..
    first = np.repeat(starts[:-1] - comp_balls[:-1] * BALL_POINTS, per)
    ball_starts = np.minimum(first + np.arange(comp_balls[-1]) * BALL_POINTS, np.repeat(starts[1:], per))
    ball_starts = np.append(ball_starts, n).astype(np.int64)  # ball t: order[ball_starts[t]:ball_starts[t + 1]]
    ball = np.repeat(np.arange(comp_balls[-1]), np.diff(ball_starts))  # the ball of order[i]
    x = np.asarray(data, np.float64)[order]
    centres = np.add.reduceat(x, ball_starts[:-1], axis=0) / np.diff(ball_starts).astype(np.float64)[:, None]
    radius = np.maximum.reduceat(np.sqrt(((x - centres[ball]) ** 2).sum(axis=1)), ball_starts[:-1])
    radius = radius * (1 + 1e-6) + 1e-12  # above the rounding of the distances the kernel computes
    min_core = np.minimum.reduceat(np.asarray(core, np.float64)[order], ball_starts[:-1])
    member = np.zeros(n, np.uint8)
    member[members] = 1
    a, b, w = _cheapest_outside_bounded(data, core, member, order, ball_starts, comp_balls, centres, radius,
                                        min_core)
    has = a >= 0
    return a[has], b[has], w[has]


@numba.njit(cache=True, nogil=True)
def _edge_to(data: np.ndarray, core: np.ndarray, p: int, q: int, cp: float, best: float, bp: int, bq: int
             ) -> tuple[float, int, int]:
    """The better of the edge ``(best, bp, bq)`` and ``p - q`` in the order ``(w, a, b)``, weights in
    float32, measuring the distance only as far as it can still win or tie."""
    floor = max(cp, core[q])
    if floor > best:  # the edge cannot beat the best one, whatever the distance
        return best, bp, bq
    limit = np.float64(best) * best * (1.0 + 1e-6)  # past it, the weight rounds above best: no win, no tie
    acc = 0.0
    for j in range(data.shape[1]):
        t = data[p, j] - data[q, j]
        acc += t * t
        if acc > limit:
            return best, bp, bq
    mr = np.float32(max(floor, np.sqrt(acc)))  # weights compare as the tree keeps them (float32)
    if mr < best or (mr == best and (p < bp or (p == bp and q < bq))):
        return mr, p, q
    return best, bp, bq


@numba.njit(cache=True, nogil=True, parallel=True)
def _nearest_outside_all(data: np.ndarray, core: np.ndarray, label: np.ndarray, members: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`cheapest_outside` for each member: its cheapest edge over every point, in id order."""
    n = data.shape[0]
    m = members.shape[0]
    b = np.full(m, -1, np.int64)
    w = np.full(m, np.inf, np.float32)
    for i in numba.prange(m):
        p = members[i]
        lp, cp = label[p], core[p]
        best, bp, bq = np.float32(np.inf), p, -1
        for q in range(n):
            if label[q] != lp:
                best, bp, bq = _edge_to(data, core, p, q, cp, best, bp, bq)
        b[i] = bq
        w[i] = best
    return members.copy(), b, w


@numba.njit(cache=True, nogil=True)
def _ball_bounds(own: int, lo: int, hi: int, centres: np.ndarray, radius: np.ndarray, min_core: np.ndarray,
                 out: np.ndarray) -> float:
    """Lower bounds of the edges between ball ``own`` and each ball into ``out`` (``inf`` for the balls
    ``lo .. hi - 1``, its component's); returns the smallest."""
    low = np.inf
    for c in range(centres.shape[0]):
        if lo <= c < hi:
            out[c] = np.inf
            continue
        acc = 0.0
        for j in range(centres.shape[1]):
            t = centres[own, j] - centres[c, j]
            acc += t * t
        out[c] = max(np.sqrt(acc) - radius[own] - radius[c], min_core[own], min_core[c])
        low = min(low, out[c])
    return low


@numba.njit(cache=True, nogil=True, parallel=True)
def _cheapest_outside_bounded(data: np.ndarray, core: np.ndarray, member: np.ndarray, order: np.ndarray,
                              ball_starts: np.ndarray, comp_balls: np.ndarray, centres: np.ndarray,
                              radius: np.ndarray, min_core: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`cheapest_outside` by pairs of balls (ball ``t`` holds the points ``order[ball_starts[t]:
    ball_starts[t + 1]]``; component ``c``'s balls are ``comp_balls[c] .. comp_balls[c + 1] - 1``;
    ``member`` flags the members): one edge per component, ``a = -1`` for a component without members."""
    C = comp_balls.shape[0] - 1
    a = np.full(C, -1, np.int64)
    b = np.full(C, -1, np.int64)
    w = np.full(C, np.inf, np.float32)
    for c0 in numba.prange(C):
        lo, hi = comp_balls[c0], comp_balls[c0 + 1]
        bound = np.empty(centres.shape[0])
        low = np.full(hi - lo, np.inf)
        first = -1  # the component's first member (its smallest id: order is by id within a component)
        for t in range(hi - lo):
            for r in range(ball_starts[lo + t], ball_starts[lo + t + 1]):
                if member[order[r]]:
                    if first < 0:
                        first = order[r]
                    low[t] = _ball_bounds(lo + t, lo, hi, centres, radius, min_core, bound)
                    break
        if first < 0:
            continue
        best, bp, bq = np.float32(np.inf), first, -1
        for t in np.argsort(low):  # the component's balls nearest another component first
            if low[t] == np.inf or low[t] > best * (1.0 + 1e-5):
                break
            _ball_bounds(lo + t, lo, hi, centres, radius, min_core, bound)
            for c in np.argsort(bound):
                if bound[c] == np.inf or bound[c] > best * (1.0 + 1e-5):
                    break
                for r in range(ball_starts[lo + t], ball_starts[lo + t + 1]):
                    p = order[r]
                    if not member[p]:
                        continue
                    cp = core[p]
                    acc = 0.0
                    for j in range(data.shape[1]):
                        d = data[p, j] - centres[c, j]
                        acc += d * d
                    if max(np.sqrt(acc) - radius[c], cp, min_core[c]) > best * (1.0 + 1e-5):
                        continue
                    for q in range(ball_starts[c], ball_starts[c + 1]):
                        best, bp, bq = _edge_to(data, core, p, order[q], cp, best, bp, bq)
        a[c0], b[c0], w[c0] = bp, bq, best
    return a, b, w


@_jit
def bridge_components(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges of infinite weight that join the components of a spanning forest into one tree: the
    first component's root to every other root. In the hierarchy they are the last merges, at
    lambda 0: the components split apart at the very top and every merge below is kept."""
    n = parent.shape[0]
    roots = np.empty(n, np.int64)
    r = 0
    for i in range(n):
        if _find(parent, i) == i:
            roots[r] = i
            r += 1
    m = max(r - 1, 0)
    a = np.full(m, roots[0] if r else 0, np.int64)
    b = roots[1:r].copy()
    return a, b, np.full(m, np.inf, np.float32)


# ----------------------------------------------------------------------------------------------------
# the hierarchy
# ----------------------------------------------------------------------------------------------------


@_jit
def single_linkage(a: np.ndarray, b: np.ndarray, w: np.ndarray, n: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Single-linkage dendrogram of a spanning tree (scipy's layout): merge ``i`` joins nodes
    ``left[i]`` and ``right[i]`` at ``dist[i]`` into node ``n + i`` of ``size[i]`` points."""
    order = np.argsort(w, kind="mergesort")
    parent = np.arange(2 * n - 1)
    count = np.ones(2 * n - 1, np.int64)
    left = np.empty(n - 1, np.int64)
    right = np.empty(n - 1, np.int64)
    dist = np.empty(n - 1, np.float64)
    size = np.empty(n - 1, np.int64)
    for i in range(n - 1):
        t = order[i]
        ra = _find(parent, a[t])
        rb = _find(parent, b[t])
        node = n + i
        left[i] = ra
        right[i] = rb
        dist[i] = w[t]
        size[i] = count[ra] + count[rb]
        count[node] = size[i]
        parent[ra] = node
        parent[rb] = node
    return left, right, dist, size


@_jit
def condense_tree(left: np.ndarray, right: np.ndarray, dist: np.ndarray, size: np.ndarray, min_cluster_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The condensed tree (``hdbscan``'s): ``(parent, child, lambda, child_size)`` rows.

    Walks the dendrogram top-down (descending node ids). At a node, every edge of its distance
    is cut at once: children at the same distance (a tie, which the binary dendrogram orders
    arbitrarily) are opened, down to the parts below that distance. If two or more parts have at
    least ``min_cluster_size`` points, each becomes a new cluster; if one does, it continues the
    current cluster; smaller parts' points fall out of the current cluster at this lambda
    (recorded as ``drop`` on a subtree and emitted at its leaves).

    Cutting tied edges one at a time, as ``hdbscan`` and ``fast_hdbscan`` do, can split a
    cluster into two big parts and, at the same lambda, one of them into small ones: a cluster
    born and dead at once, of zero stability, that excess of mass may then select (HDBSCAN*
    removes all edges of a level together; see ``tests/test_hdbscan_app.py``).
    """
    n = left.shape[0] + 1
    rows = 2 * n
    rp = np.empty(rows, np.int64)
    rc = np.empty(rows, np.int64)
    rl = np.empty(rows, np.float64)
    rs = np.empty(rows, np.int64)
    label = np.full(2 * n - 1, -1, np.int64)  # cluster of a node that is not dropped
    drop_to = np.full(2 * n - 1, -1, np.int64)  # cluster its points fall out of, if dropped
    drop_lam = np.zeros(2 * n - 1, np.float64)
    opened = np.zeros(2 * n - 1, np.bool_)  # a node cut together with an ancestor at its distance
    parts = np.empty(n, np.int64)  # a node's parts below its distance
    stack = np.empty(n, np.int64)
    label[2 * n - 2] = n
    nxt = n + 1
    pos = 0
    for node in range(2 * n - 2, n - 1, -1):
        if opened[node]:
            continue
        i = node - n
        if drop_to[node] >= 0:
            for c in (left[i], right[i]):
                if c < n:
                    rp[pos] = drop_to[node]
                    rc[pos] = c
                    rl[pos] = drop_lam[node]
                    rs[pos] = 1
                    pos += 1
                else:
                    drop_to[c] = drop_to[node]
                    drop_lam[c] = drop_lam[node]
            continue
        d = dist[i]
        lam = 1.0 / d if d > 0.0 else np.inf
        cl = label[node]
        m = 0
        big = 0
        stack[0] = right[i]
        stack[1] = left[i]
        sp = 2
        while sp > 0:
            sp -= 1
            c = stack[sp]
            if c >= n and dist[c - n] == d:
                opened[c] = True
                stack[sp] = right[c - n]
                stack[sp + 1] = left[c - n]
                sp += 2
            else:
                parts[m] = c
                m += 1
                big += (size[c - n] if c >= n else 1) >= min_cluster_size
        for j in range(m):
            c = parts[j]
            cnt = size[c - n] if c >= n else 1
            if cnt >= min_cluster_size and big >= 2:
                label[c] = nxt
                rp[pos] = cl
                rc[pos] = nxt
                rl[pos] = lam
                rs[pos] = cnt
                pos += 1
                nxt += 1
            elif cnt >= min_cluster_size:
                label[c] = cl
            elif c < n:
                rp[pos] = cl
                rc[pos] = c
                rl[pos] = lam
                rs[pos] = 1
                pos += 1
            else:
                drop_to[c] = cl
                drop_lam[c] = lam
    return rp[:pos], rc[:pos], rl[:pos], rs[:pos]


@_jit
def select_clusters(parent: np.ndarray, child: np.ndarray, lam: np.ndarray, csize: np.ndarray, n: int,
                    max_cluster_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Excess-of-mass selection and the labels: ``(labels int64 (n,), stability of each cluster id - n)``.

    Stability of a cluster: the sum over the rows leaving it of ``(lambda - birth) * size``. From the
    leaves up, a cluster is kept if its stability is at least that of its selected descendants and
    it holds at most ``max_cluster_size`` points (0: no limit); otherwise it passes the sum of its
    children's up. The root is never selected (``hdbscan``'s ``allow_single_cluster=False``).
    """
    n_clusters = 1
    for t in range(len(child)):
        if child[t] >= n:
            n_clusters = max(n_clusters, child[t] - n + 1)
    birth = np.zeros(n_clusters, np.float64)
    cparent = np.full(n_clusters, -1, np.int64)
    size = np.zeros(n_clusters, np.int64)
    point_parent = np.full(n, -1, np.int64)
    for t in range(len(child)):
        if child[t] >= n:
            birth[child[t] - n] = lam[t]
            cparent[child[t] - n] = parent[t] - n
            size[child[t] - n] = csize[t]
        else:
            point_parent[child[t]] = parent[t] - n
    stability = np.zeros(n_clusters, np.float64)
    for t in range(len(child)):
        p = parent[t] - n
        stability[p] += (lam[t] - birth[p]) * csize[t]
    limit = max_cluster_size if max_cluster_size > 0 else n + 1
    kept = np.zeros(n_clusters, np.bool_)
    passed = stability.copy()  # what a cluster offers its parent
    children_sum = np.zeros(n_clusters, np.float64)
    for c in range(n_clusters - 1, 0, -1):  # children before parents; the root (0) is never selected
        if children_sum[c] > stability[c] or size[c] > limit:
            passed[c] = children_sum[c]
        else:
            kept[c] = True
        children_sum[cparent[c]] += passed[c]
    sel_of = np.full(n_clusters, -1, np.int64)
    number = np.full(n_clusters, -1, np.int64)
    k = 0
    for c in range(1, n_clusters):  # parents first: the topmost kept cluster wins
        above = sel_of[cparent[c]]
        if above >= 0:
            sel_of[c] = above
        elif kept[c]:
            sel_of[c] = c
            number[c] = k
            k += 1
    labels = np.full(n, -1, np.int64)
    for p in range(n):
        s = sel_of[point_parent[p]] if point_parent[p] >= 0 else -1
        if s >= 0:
            labels[p] = number[s]
    return labels, stability


def clusters_from_tree(a: np.ndarray, b: np.ndarray, w: np.ndarray, n: int, min_cluster_size: int,
                       max_cluster_size: int = 0) -> np.ndarray:
    """Labels (-1 = noise) from a spanning tree of ``n`` points: dendrogram, condensed tree, EOM."""
    if len(a) != n - 1:
        raise ValueError(f"a spanning tree of {n} points has {n - 1} edges, got {len(a)} (bridge the forest first)")
    if n < 2:
        return np.full(n, -1, np.int64)
    left, right, dist, size = single_linkage(np.asarray(a, np.int64), np.asarray(b, np.int64),
                                             np.asarray(w, np.float32), n)
    tree = condense_tree(left, right, dist, size, int(min_cluster_size))
    return select_clusters(*tree, n, int(max_cluster_size))[0]


def warmup() -> None:
    """Compile (or load from Numba's cache) every kernel with the argument types the app passes."""
    rng = np.random.default_rng(0)
    n, k = 40, 5
    x = rng.standard_normal((n, 2))
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    idx = np.argsort(d, 1)[:, 1:k + 1].astype(np.int64)
    dist = np.take_along_axis(d, idx, 1).astype(np.float32)
    ids = np.arange(n, dtype=np.int64)
    nbr, w = mutual_reachability_rows(ids, idx, dist, core_distances(dist, 3))
    a, b, ww, parent = kruskal(ids, nbr, w, n)
    comp = component_labels(np.arange(n))
    cc, ca, cb, cw = cheapest_outgoing(ids, nbr, w, np.zeros(n, np.int64), comp)
    boruvka_merge(np.arange(n), np.ones(n, np.int64), cc, ca, cb, cw)
    ba, bb, bw = bridge_components(parent)
    clusters_from_tree(np.concatenate([a, ba]), np.concatenate([b, bb]), np.concatenate([ww, bw]), n, 5)
    for points in (x.astype(np.float32), x):  # the app's points (float32), and a file's float64
        cheapest_outside(points, core_distances(dist, 3), (ids % 2).astype(np.int32), ids)  # by balls; labels as
        cheapest_outside(points, core_distances(dist, 3), ids.astype(np.int32), ids[:4])  # bridged's; a scan
