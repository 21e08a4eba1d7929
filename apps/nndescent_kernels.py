"""Numba kernels of distributed NN-Descent (apps/nndescent.py): list merging, candidate sampling,
local join and packing of the parameter-server updates.

**Neighbour lists.** A list of ``k`` neighbours is one float32 vector of length ``3k``:
``[ids (k) | squared Euclidean distances (k) | flags (k)]``, sorted ascending by
``(distance, id)``, without duplicate ids, padded at the end with ``(id -1, distance +inf, flag 0)``.
Ids are stored as floats, exactly (float32 holds every integer below 2**24; apps/nndescent.py
refuses larger data sets). The flag is 1 for a *new* neighbour (not yet used as a join
candidate by the list's owner) and 0 for an old one. Inside one kernel call two more values mark
what changed in the executor's copy: 2, "proposed by this executor in this call", and -1, "marked
old by its owner in this call". They never leave the executor: ``pack_updates`` sends them as 1
and 0, and only them.

**Merging** (:func:`merge_lists`, the table combiner) keeps, per id, its smallest
``(distance, flag)`` entry and then the ``k`` smallest entries by ``(distance, id)``. That is the
top-k of a totally ordered set with per-id minimum, hence associative, commutative and idempotent:
merging a list into itself, or an update twice, changes nothing; an "old" mark for an id and a new
candidate for the same id meet as "old" in any order.

Every kernel is ``cache=True, nogil=True``. Distances are computed in float32 (the data's type).
The small helpers (``_push``, ``_sqdist``, the hashes) are plain kernels, not Numba's IR-level
``inline="always"``: with IR inlining of all of them a cold Numba cache took 64 s to compile this
module (``nndescent_warmup``: every caller and both data layouts, writeable and read-only), 17 s
without, and the join, packing, trees and leaf offers ran as fast (measured at 2**19 points). LLVM
inlines most of them by itself. One it left as a call is IR-inlined: ``_push_candidate``, which
sampling calls twice per edge of the graph and which mostly returns at once, so the call was most of
its cost (sampling 1.14x faster at 2**18 10-d points, 1.28x on Fashion-MNIST, the same candidates;
the cold compile did not change). ``_sqdists`` also stays a call in the join and the leaf offers,
where it computes a point's distances to all its partners: inlining it measured 2-5% slower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

from apps.kernel_util import NO_REFCOUNTS, insert_sorted, prefetch, read_only

FLAG_OLD = 0
FLAG_NEW = 1
FLAG_PROPOSED = 2  # only inside one kernel call: an entry this executor found (sent with FLAG_NEW)
FLAG_MARKED = -1  # only inside one kernel call: a new entry its owner joins now (sent with FLAG_OLD)

#: Counters returned by the round and init kernels, in this order.
COUNTERS = ("distances", "proposed", "sent", "updates", "rows_sent", "marked", "rows_read")

_jit = numba.njit(cache=True, nogil=True)
_jit_fast = numba.njit(cache=True, nogil=True, fastmath=True)
# The hot loops that push into row views, without reference counts (apps/kernel_util.NO_REFCOUNTS):
# they allocate nothing, their callers pass the scratch arrays.
_jit_bare = numba.njit(cache=True, nogil=True, **NO_REFCOUNTS)
_jit_fast_bare = numba.njit(cache=True, nogil=True, fastmath=True, **NO_REFCOUNTS)

K = TypeVar("K", bound=Callable[..., Any])


def _points_read_only(kernel: K) -> K:
    """The kernel, called with its first argument (the points) made :func:`~apps.kernel_util.read_only`
    (executors hold the points read-only, and memory maps are so: one specialization for all)."""

    def call(data: np.ndarray, *args: Any) -> Any:
        return kernel(read_only(data), *args)

    functools.update_wrapper(call, kernel, updated=())
    return call  # type: ignore[return-value]


@_jit
def empty_lists(m: int, k: int) -> np.ndarray:
    """``m`` empty neighbour lists (ids -1, distances +inf, flags 0), shape ``(m, 3k)`` float32."""
    out = np.zeros((m, 3 * k), np.float32)
    out[:, :k] = -1.0
    out[:, k:2 * k] = np.inf
    return out


# ----------------------------------------------------------------------------------------------------
# one list
# ----------------------------------------------------------------------------------------------------


@_jit
def _push(r: np.ndarray, k: int, q: float, d: float, f: float) -> int:
    """Merge the entry ``(q, d, f)`` into the sorted list ``r`` (length 3k); 1 if ``q`` entered the list.

    An id already present keeps its smallest ``(distance, flag)``: a lower flag (an "old" mark) is
    set in place, a smaller distance replaces the entry, which is then re-inserted at its place;
    neither is a new entry. (A lower flag used to take the entry out and insert it again, at the
    same place: a server merges millions of such marks in a round's first rounds.)
    The search for ``q`` reads the whole id row without an exit (empty slots, -1, never match), and
    :func:`_insert` counts its place: no loop ends on a data-dependent branch but the shift (an
    executor's round at 2**18 10-d points 1-5% faster, the combiner 0-8%, the same lists).
    """
    worst = r[2 * k - 1]
    if d > worst:
        return 0
    s = -1
    for t in range(k):
        if r[t] == q:
            s = t
    if s >= 0:
        ds = r[k + s]
        if d == ds:  # the same entry: only a lower flag changes it, in place (flags do not order a list)
            if f < r[2 * k + s]:
                r[2 * k + s] = f
            return 0
        if d < ds:
            for t in range(s, k - 1):  # take it out, then insert it again below
                r[t] = r[t + 1]
                r[k + t] = r[k + t + 1]
                r[2 * k + t] = r[2 * k + t + 1]
            r[k - 1] = -1.0
            r[2 * k - 1] = np.inf
            r[3 * k - 1] = 0.0
            _insert(r, k, q, d, f)
        return 0
    if d == worst and r[k - 1] >= 0 and q > r[k - 1]:
        return 0  # ties are ordered by id
    _insert(r, k, q, d, f)
    return 1


@_jit
def _insert(r: np.ndarray, k: int, q: float, d: float, f: float) -> None:
    """Insert a new id at its sorted place, dropping the last entry (the caller checked it belongs).
    The place is a count of the entries before it (by distance, then id), with no data-dependent exit."""
    pos = 0
    for t in range(k - 1):
        dp = r[k + t]
        pos += (dp < d) | ((dp == d) & (r[t] >= 0) & (r[t] < q))
    for t in range(k - 1, pos, -1):
        r[t] = r[t - 1]
        r[k + t] = r[k + t - 1]
        r[2 * k + t] = r[2 * k + t - 1]
    r[pos] = q
    r[k + pos] = d
    r[2 * k + pos] = f


@_jit_bare
def merge_lists(acc: np.ndarray, upd: np.ndarray, k: int) -> None:
    """Merge every list of ``upd`` into the list of ``acc`` at the same row, in place (both ``(m, 3k)``).

    An empty list of ``acc`` takes a valid list of ``upd`` (:func:`_valid_list`) as it is: what pushing
    its entries one by one makes. Why: a server merges the first lists into empty rows, and there
    each push was an insertion (half the first lists of 2**19 points: 0.17-0.20 s pushed)."""
    for i in range(acc.shape[0]):
        r = acc[i]
        u = upd[i]
        if r[0] < 0 and _valid_list(u, k):
            for s in range(3 * k):
                r[s] = u[s]
            continue
        for s in range(k):
            q = u[s]
            if q >= 0:
                _push(r, k, q, u[k + s], u[2 * k + s])


@_jit
def _valid_list(u: np.ndarray, k: int) -> bool:
    """Whether ``u`` is a list as the module docstring says: ids sorted by (distance, id), distinct,
    then padding (-1, +inf, 0) to the end."""
    m = 0
    while m < k and u[m] >= 0:
        m += 1
    for s in range(m, k):
        if u[s] != -1.0 or u[k + s] != np.inf or u[2 * k + s] != 0.0:
            return False
    for s in range(1, m):
        d0, d1 = u[k + s - 1], u[k + s]
        if not (d0 < d1 or (d0 == d1 and u[s - 1] < u[s])):  # also false for a NaN
            return False
    for s in range(m):  # sorted by (distance, id) does not make the ids distinct
        for t in range(s + 1, m):
            if u[s] == u[t]:
                return False
    return True


# ----------------------------------------------------------------------------------------------------
# helpers: distances and deterministic randomness
# ----------------------------------------------------------------------------------------------------


@_jit_fast
def _sqdist4(data: np.ndarray, p: int, q0: int, q1: int, q2: int, q3: int
             ) -> tuple[float, float, float, float]:
    """Squared distances from ``p`` to four points at once: each of ``p``'s values is loaded once for
    four distances instead of once each. A distance is bound by its loads (two rows of 3 KB on
    Fashion-MNIST), so four take about 0.7 of the time of four single ones (37 against 50 ns each,
    rows in cache). Every lane does the same operations in the same order, so a pair's distance
    does not depend on its lane, on the other lanes or on which point is ``p``. Every kernel here
    computes distances through :func:`_sqdist` or :func:`_sqdists`, which use this function from
    :data:`BLOCKED_DIMS` dimensions on and :func:`_sqdist1` below, so an id met twice always comes
    with the same distance (tested). Otherwise two roundings of one distance would make a list take
    the second one as an improvement and mark an old neighbour new again."""
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    for t in range(data.shape[1]):
        a = data[p, t]
        d0 = a - data[q0, t]
        d1 = a - data[q1, t]
        d2 = a - data[q2, t]
        d3 = a - data[q3, t]
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
    return s0, s1, s2, s3


#: From this many dimensions on, distances are computed four at a time (:func:`_sqdist4`). Below, a
#: distance is a few instructions and loads do not bind it: at 10 dimensions four at a time made the
#: join 1.6 times slower.
BLOCKED_DIMS = 32


@_jit_fast
def _sqdist1(data: np.ndarray, p: int, q: int) -> float:
    s = np.float32(0.0)
    for t in range(data.shape[1]):
        diff = data[p, t] - data[q, t]
        s += diff * diff
    return s


@_jit_fast
def _sqdist(data: np.ndarray, p: int, q: int) -> float:
    """One squared distance, rounded exactly as :func:`_sqdists` rounds it for data of this width."""
    if data.shape[1] >= BLOCKED_DIMS:
        return _sqdist4(data, p, q, q, q, q)[0]
    return _sqdist1(data, p, q)


@_jit_fast
def _sqdists(data: np.ndarray, p: int, qs: np.ndarray, count: int, out: np.ndarray) -> None:
    """``out[j] = d(p, qs[j])`` for ``j < count``: four at a time (:func:`_sqdist4`; the lanes past
    ``count`` repeat the last point and are dropped) from :data:`BLOCKED_DIMS` dimensions on, else
    one by one."""
    if data.shape[1] < BLOCKED_DIMS:
        for j in range(count):
            out[j] = _sqdist1(data, p, qs[j])
        return
    last = count - 1
    for j in range(0, count, 4):
        d0, d1, d2, d3 = _sqdist4(data, p, qs[j], qs[min(j + 1, last)], qs[min(j + 2, last)],
                                  qs[min(j + 3, last)])
        out[j] = d0
        if j + 1 <= last:
            out[j + 1] = d1
        if j + 2 <= last:
            out[j + 2] = d2
        if j + 3 <= last:
            out[j + 3] = d3


@_jit
def _mix(x: np.uint64) -> np.uint64:
    """splitmix64's finalizer: a good 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@_jit
def _hash(seed: int, a: int, b: int, c: int) -> np.uint64:
    h = _mix(np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15))
    h = _mix(h ^ np.uint64(a))
    h = _mix(h ^ np.uint64(b))
    return _mix(h ^ np.uint64(c))


#: An empty slot of a candidate list (:func:`_push_candidate`); no entry equals it (ids are below 2**32 - 1).
EMPTY_CANDIDATE = np.uint64(0xFFFFFFFFFFFFFFFF)
_HIGH32 = np.uint64(0xFFFFFFFF00000000)
_LOW32 = np.uint64(0xFFFFFFFF)


@_jit
def _round_key(seed: int, rnd: int) -> np.uint64:
    """The key of a round's sampling priorities: every executor derives the same from (seed, round)."""
    return _hash(seed, rnd, 0x5A3F, 0)


@_jit
def _pair_high(key: np.uint64, i: int, j: int) -> np.uint64:
    """The sampling priority of the unordered pair ``{i, j}`` in the round of ``key``, as a candidate
    list holds it: the high 32 bits of splitmix64's finalizer of the pair's index (ids are below 2**24,
    so ``lo << 32 | hi`` is unique) mixed with the key. A list entry is ``_pair_high(key, i, j) | cand``,
    so one integer order sorts by priority (ties, about one pair in 2**32, by id) and one comparison
    finds a duplicate (the same pair offers the same candidate). One mix instead of the four of
    :func:`_hash`, and integers compared instead of floats: sampling took 7-8% less time at 2**19
    points (10-d blobs, an eighth of them or all owned; best of 5, alternating)."""
    lo, hi = min(i, j), max(i, j)
    return _mix(key ^ ((np.uint64(lo) << np.uint64(32)) | np.uint64(hi))) & _HIGH32


@numba.njit(cache=True, nogil=True, inline="always")  # see the module docstring
def _push_candidate(row: np.ndarray, mc: int, v: np.uint64) -> None:
    """Keep the ``mc`` smallest candidates (entries as :func:`_pair_high` says) in ``row``, sorted, each once.

    Priority and id share one integer, so a list is one row of ``mc`` words instead of two (ids and
    priorities): sampling touches half the cache lines, and was 14-26% faster (2**18 10-d points and
    Fashion-MNIST, the first three rounds) with the same candidates. The place is a count (no
    data-dependent exit), and a duplicate is the equal value just there."""
    if v >= row[mc - 1]:
        return
    at = 0
    for t in range(mc - 1):
        at += row[t] < v
    if row[at] == v:
        return
    for t in range(mc - 1, at, -1):
        row[t] = row[t - 1]
    row[at] = v


# ----------------------------------------------------------------------------------------------------
# one executor's work
# ----------------------------------------------------------------------------------------------------


@_jit
def own_index(n: int, owned: np.ndarray) -> np.ndarray:
    """``pos``: for each of the ``n`` points its index in ``owned``, or -1."""
    pos = np.full(n, -1, np.int64)
    for a in range(owned.shape[0]):
        pos[owned[a]] = a
    return pos


@_jit
def bookkeeping(n: int, owned: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What an executor's first lists or round keeps beside the lists: ``(pos, touched, counts)``,
    the owned points' index (:func:`own_index`), a flag per point whose list changed, and the
    :data:`COUNTERS`."""
    return own_index(n, owned), np.zeros(n, np.uint8), np.zeros(len(COUNTERS), np.int64)


@_jit
def sample_candidates(G: np.ndarray, k: int, pos: np.ndarray, m: int, mc: int, seed: int, rnd: int,
                      touched: np.ndarray, blocks: np.ndarray | None = None, block: int = 0
                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """The join candidates of the ``m`` owned points, and the marks of the new ones sampled.

    As pynndescent's ``new_candidate_neighbors``: every edge ``i -> j`` of the graph ``G`` gets a
    priority (a hash of seed, round, i, j, so every executor computes the same) and offers ``j`` to
    ``i``'s candidates and ``i`` to ``j``'s (the reverse neighbours), new or old by the edge's flag;
    each point keeps the ``mc`` of smallest priority of each kind. Only owned points (``pos >= 0``)
    keep candidates. The rows scanned are the whole graph, or the graph blocks ``blocks`` (of ``block``
    points): for the same candidates they must hold the owned points and every point with an edge to
    one (a job's executor reads only those, apps/nndescent.py); the other rows are never read. A new
    edge ``i -> j`` whose ``j`` made it into ``i``'s new candidates is marked old in ``G`` (it is joined now).
    Returns ``(new, old, marked)``: candidate ids ``(m, mc)`` int64 (-1 padded) and the marks made
    (flag :data:`FLAG_MARKED`, sent as old); a point with marks is flagged in ``touched``.

    Two passes: the new candidates first, then the old ones only for points that have a new one.
    The join pairs a point's new candidates with each other and with its old ones, never two old
    ones, so a point without new candidates joins nothing and its old list would go unread. Late
    in a run most points are in that case: on the last round's graph of 2**19 blobs (one point in
    eight with a new candidate), sampling half the points took 0.15 s instead of 0.51 s; it had
    cost as much as in the first round, whatever the updates. The lists the join reads are the
    same as with one pass (the priorities do not depend on the order).
    """
    if blocks is None:  # the whole graph: one block
        blocks, block = np.zeros(1, np.int64), max(1, G.shape[0])
    return sample_candidates_into(G, k, pos, seed, rnd, touched, blocks, block, np.empty((m, mc), np.uint64),
                                  np.empty((m, mc), np.uint64))


@_jit
def sample_candidates_into(G: np.ndarray, k: int, pos: np.ndarray, seed: int, rnd: int, touched: np.ndarray,
                           blocks: np.ndarray, block: int, new: np.ndarray, old: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`sample_candidates` into the caller's ``(m, mc)`` uint64 arrays ``new`` and ``old`` (their
    contents do not matter), which come back as the candidate ids (int64 views of them). A job's
    executors pass a buffer of their process (apps/nndescent.py): two fresh arrays cost the first
    touch of their pages every round (31 MB each at 2**19 points, half of them owned)."""
    new[:] = EMPTY_CANDIDATE
    old[:] = EMPTY_CANDIDATE
    wants = np.empty(G.shape[0], np.bool_)
    marked = _sample_into(G, k, pos, seed, rnd, touched, new, old, wants, blocks, block)
    return _candidate_ids(new), _candidate_ids(old), marked


@_jit
def _candidate_ids(packed: np.ndarray) -> np.ndarray:
    """The ids of candidate lists (entries as :func:`_pair_high` says), -1 for an empty slot, in place:
    ``packed`` becomes the int64 array returned. (A second array cost its first touch: two of 31 MB
    per round at 2**19 points, half of them owned.)"""
    out = packed.view(np.int64)
    for a in range(packed.shape[0]):
        for c in range(packed.shape[1]):
            v = packed[a, c]
            out[a, c] = -1 if v == EMPTY_CANDIDATE else np.int64(v & _LOW32)
    return out


@_jit_bare
def _sample_into(G: np.ndarray, k: int, pos: np.ndarray, seed: int, rnd: int, touched: np.ndarray, new: np.ndarray,
                 old: np.ndarray, wants: np.ndarray, blocks: np.ndarray, block: int) -> int:
    """:func:`sample_candidates` into its candidate lists (entries as :func:`_pair_high` says,
    :data:`EMPTY_CANDIDATE` on entry); returns the number of marks. Compiled without Numba's reference
    counting (``_jit_bare``): each push takes a row view, whose count costs an atomic increment and
    decrement per edge offered, most offers returning at once (sampling a quarter of 2**18 10-d
    points: 310 against 323 ms, the same candidates).

    ``wants`` (bool, one per point, scratch) says which points are owned and got a new candidate,
    once the first pass is done. The second pass asks that of both ends of every old edge of the
    graph. Each answer used to take two reads at random in memory (the owner index, then the
    candidate list); now it is one read of a dense byte vector that stays in cache. Sampling an
    eighth of 2**19 10-d blobs (the graphs a run had at the start of each of its 5 rounds, median
    of 4, the same candidates; two runs): 24-32% less time in rounds 4-5 (0.073 -> 0.050 s in
    round 5), 9-14% in rounds 2-3, the same in round 1 (few old edges yet)."""
    n = G.shape[0]
    mc = new.shape[1]
    key = _round_key(seed, rnd)
    for t in range(blocks.shape[0]):
        for i in range(blocks[t] * block, min(n, (blocks[t] + 1) * block)):
            pi = pos[i]
            for s in range(k):
                j = int(G[i, s])
                if j < 0:
                    break
                if G[i, 2 * k + s] <= 0:
                    continue
                pj = pos[j]
                if pi < 0 and pj < 0:
                    continue
                hi = _pair_high(key, i, j)  # one priority per pair, for both candidates
                if pi >= 0:
                    _push_candidate(new[pi], mc, hi | np.uint64(j))
                if pj >= 0:
                    _push_candidate(new[pj], mc, hi | np.uint64(i))
    some = False
    for i in range(n):
        pi = pos[i]
        wants[i] = pi >= 0 and new[pi, 0] != EMPTY_CANDIDATE
        some |= wants[i]
    for t in range(blocks.shape[0]):
        for i in range(blocks[t] * block, min(n if some else 0, (blocks[t] + 1) * block)):
            wants_i = wants[i]
            for s in range(k):
                j = int(G[i, s])
                if j < 0:
                    break
                if G[i, 2 * k + s] > 0:
                    continue
                wants_j = wants[j]
                if not (wants_i or wants_j):
                    continue
                hi = _pair_high(key, i, j)
                if wants_i:
                    _push_candidate(old[pos[i]], mc, hi | np.uint64(j))
                if wants_j:
                    _push_candidate(old[pos[j]], mc, hi | np.uint64(i))
    # mark the new edges i -> j whose j made it into i's new candidates: the first pass offered each of
    # them to i's list, which kept the mc smallest offers, so j is there iff its entry is at most the
    # list's last (EMPTY_CANDIDATE, above every entry, while the list is not full). One hash per edge
    # instead of a search of the list: 2-2.5x faster in the first rounds at 2**19 points.
    marked = 0
    for t in range(blocks.shape[0]):
        for i in range(blocks[t] * block, min(n, (blocks[t] + 1) * block)):
            pi = pos[i]
            if pi < 0:
                continue
            last = new[pi, mc - 1]
            for s in range(k):
                j = int(G[i, s])
                if j < 0:
                    break
                if G[i, 2 * k + s] > 0 and (_pair_high(key, i, j) | np.uint64(j)) <= last:
                    G[i, 2 * k + s] = FLAG_MARKED
                    marked += 1
                    touched[i] = 1
    return marked


@_jit
def edge_marks(lists: np.ndarray, blocks: np.ndarray, bounds: np.ndarray, k: int, block: int, width: int,
               new_only: bool) -> np.ndarray:
    """The blocks that each executor must read for the edges in ``lists`` (rows ``(len(blocks), block,
    3k)`` of graph blocks ``blocks``): ``(executors, width)`` bool (``width`` at least the blocks), executor ``e``
    owning points ``bounds[e] .. bounds[e + 1] - 1``. An edge ``i -> j`` marks ``j``'s block for
    ``i``'s owner (its neighbour's list, for the join) and ``i``'s block for ``j``'s owner (the list
    pointing at its point, for the reverse candidates). With ``new_only``, only the edges flagged new
    (in an update: the offers; its old entries are marks of edges that were marked when made)."""
    out = np.zeros((bounds.shape[0] - 1, width), np.bool_)
    n = bounds[-1]
    for t in range(blocks.shape[0]):
        for r in range(block):
            i = blocks[t] * block + r
            if i >= n:
                break
            ei = np.searchsorted(bounds, i, side="right") - 1
            for s in range(k):
                j = int(lists[t, r, s])
                if j < 0:
                    break
                if new_only and lists[t, r, 2 * k + s] <= 0:
                    continue
                out[ei, j // block] = True
                out[np.searchsorted(bounds, j, side="right") - 1, i // block] = True
    return out


@_jit
def list_blocks(rows: np.ndarray, blocks: np.ndarray, lo: int, hi: int, k: int, block: int, nb: int) -> np.ndarray:
    """One flag per graph block: whether the list of a point of ``[lo, hi)`` in ``rows`` (lists of graph
    blocks ``blocks``, ``(len(blocks), block, 3k)``) holds one of its points."""
    out = np.zeros(nb, np.bool_)
    for t in range(blocks.shape[0]):
        for r in range(block):
            i = blocks[t] * block + r
            if i < lo or i >= hi:
                continue
            for s in range(k):
                j = int(rows[t, r, s])
                if j < 0:
                    break
                out[j // block] = True
    return out


@_jit
def _partners(new: np.ndarray, old: np.ndarray, a: int, x: int, qs: np.ndarray, ys: np.ndarray) -> int:
    """The points that ``p = new[a, x]`` is compared with, in the order of the offers: the new
    candidates after it, then the old ones (never itself). Writes their ids to ``qs`` and their
    places (``y``: ``< mc`` new, else old) to ``ys``; returns how many."""
    mc = new.shape[1]
    p = new[a, x]
    m = 0
    for y in range(x + 1, 2 * mc):
        q = new[a, y] if y < mc else old[a, y - mc]
        if q < 0:
            if y < mc:
                continue
            break
        if q == p:
            continue
        qs[m] = q
        ys[m] = y
        m += 1
    return m


@_jit_fast
def _partner_distances(data: np.ndarray, dists: np.ndarray, a: int, x: int, p: int, qs: np.ndarray, ys: np.ndarray,
                       m: int, out: np.ndarray) -> None:
    """``d(p, qs[j])`` for the ``m`` partners of pair row ``(a, x)``: from ``dists[a, x, ys[j]]`` when a
    device computed the round's distances (:mod:`apps.nndescent_cuda`), else here, four at a time.
    They do not depend on the lists, so they can all be computed before the first offer."""
    if dists.shape[0] > 0:
        for j in range(m):
            out[j] = dists[a, x, ys[j]]
    else:
        _sqdists(data, p, qs, m, out)


@_jit
def _offer(G: np.ndarray, dmax: np.ndarray, box: np.ndarray, k: int, pos: np.ndarray, use_filter: bool,
           touched: np.ndarray, counts: np.ndarray, p: int, q: int, d: float) -> None:
    """Offer each point of the pair ``(p, q)``, at squared distance ``d``, to the other's list."""
    counts[0] += 1
    counts[1] += 2
    _offer_one(G, dmax, box, k, pos, use_filter, touched, counts, p, q, d)
    _offer_one(G, dmax, box, k, pos, use_filter, touched, counts, q, p, d)


@_jit
def _offer_one(G: np.ndarray, dmax: np.ndarray, box: np.ndarray, k: int, pos: np.ndarray, use_filter: bool,
               touched: np.ndarray, counts: np.ndarray, a: int, b: int, d: float) -> None:
    """Offer ``b`` at squared distance ``d`` to ``a``'s list.

    ``dmax`` mirrors column ``2k - 1`` of ``G`` (d_max): most offers fail this test, and a dense
    ``n``-vector stays in cache where the ``3k``-float rows of ``G`` do not.
    """
    # d_max(a): the k-th distance as read at the round's start, then tighter. Not strict: an offer at
    # exactly d_max with a smaller id than the k-th enters the list (ties go by id, see _push); a
    # strict test dropped it, so filtered and unfiltered runs differed in such rare ties
    if d <= dmax[a]:
        if _push(G[a], k, b, d, FLAG_PROPOSED):
            counts[3] += 1
            touched[a] = 1
        dmax[a] = G[a, 2 * k - 1]
    if not use_filter and pos[a] < 0:  # without d_max: keep the k nearest offers, whatever a's list holds
        if _push(box[a], k, b, d, FLAG_PROPOSED):
            touched[a] = 1


@_jit_fast
def local_join(data: np.ndarray, G: np.ndarray, box: np.ndarray, k: int, pos: np.ndarray, owned: np.ndarray,
               new: np.ndarray, old: np.ndarray, use_filter: bool, touched: np.ndarray, counts: np.ndarray,
               dists: np.ndarray) -> None:
    """For each owned point, compare its new candidates with each other and with its old ones.

    Pairs of two old candidates were compared in an earlier round, which is what makes NN-Descent
    cheaper than comparing every pair. Accepted offers are merged into ``G`` (the executor's copy of
    the graph) with flag 2, so later offers in this call face the tightened ``d_max``.

    Pair ``(x, y)`` of owned point ``a`` is ``new[a, x]`` with ``new[a, y]`` for ``y < mc`` and with
    ``old[a, y - mc]`` after. ``dists`` holds their distances when a device computed them
    (``(m, mc, 2 mc)``, see :func:`_partner_distances`), else it is empty and they are computed here.
    Either way the offers are made in the same order, so the lists come out the same.
    """
    mc = new.shape[1]
    dmax = G[:, 2 * k - 1].copy()  # d_max as a dense vector: most offers fail it, and it stays in cache
    qs = np.empty(2 * mc, np.int64)  # p's partners in the order of the offers, their places, distances
    ys = np.empty(2 * mc, np.int64)
    ds = np.empty(2 * mc, np.float32)
    if use_filter:  # two direct calls: a dispatcher held in a variable is an experimental Numba type
        if dists.shape[0] > 0:
            _join_filtered_precomputed(data, G, k, owned, new, old, touched, counts, dists, dmax, qs, ys, ds)
        else:
            _join_filtered(data, G, k, owned, new, old, touched, counts, dists, dmax, qs, ys, ds)
        return
    for a in range(owned.shape[0]):
        for x in range(mc):
            p = new[a, x]
            if p < 0:
                break
            m = _partners(new, old, a, x, qs, ys)
            _partner_distances(data, dists, a, x, p, qs, ys, m, ds)
            for j in range(m):
                _offer(G, dmax, box, k, pos, use_filter, touched, counts, p, qs[j], ds[j])


def _filtered_join(precomputed: bool) -> Callable[..., None]:
    """:func:`local_join` with the d_max filter, the common case, kept lean: the same pairs in the
    same order with the same offers as the general loop, but counters in locals and no unfiltered
    side list (three times faster at 2**18 points).

    Two compiled copies, with the distances computed here or read from ``dists``: ``precomputed`` is a
    constant of each copy, so neither tests it in the loop (a test there cost 17% on Fashion-MNIST,
    as it kept LLVM from treating the distance loop as before)."""

    @_jit_fast_bare
    def join(data: np.ndarray, G: np.ndarray, k: int, owned: np.ndarray, new: np.ndarray, old: np.ndarray,
             touched: np.ndarray, counts: np.ndarray, dists: np.ndarray, dmax: np.ndarray, qs: np.ndarray,
             ys: np.ndarray, ds: np.ndarray) -> None:
        # dmax, qs, ys, ds: the scratch local_join allocates (this copy counts no references)
        mc = new.shape[1]
        n_dist = 0
        n_upd = 0
        for a in range(owned.shape[0]):
            for x in range(mc):
                p = new[a, x]
                if p < 0:
                    break
                m = _partners(new, old, a, x, qs, ys)
                if m == 0:
                    continue
                if not precomputed:  # all of p's distances first, four at a time: they do not depend on G
                    _sqdists(data, p, qs, m, ds)
                n_dist += m
                for j in range(m):
                    q = qs[j]
                    d = dists[a, x, ys[j]] if precomputed else ds[j]
                    if d <= dmax[p]:
                        if _push(G[p], k, q, d, FLAG_PROPOSED):
                            n_upd += 1
                            touched[p] = 1
                        dmax[p] = G[p, 2 * k - 1]
                    if d <= dmax[q]:
                        if _push(G[q], k, p, d, FLAG_PROPOSED):
                            n_upd += 1
                            touched[q] = 1
                        dmax[q] = G[q, 2 * k - 1]
        counts[0] += n_dist
        counts[1] += 2 * n_dist
        counts[3] += n_upd

    return join


_join_filtered = _filtered_join(False)
_join_filtered_precomputed = _filtered_join(True)


@_jit
def pack_updates(G: np.ndarray, box: np.ndarray, k: int, pos: np.ndarray, use_filter: bool, touched: np.ndarray,
                 block: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The parameter-server update of this call: ``(blocks int64, deltas (nb, block, 3k) float32)``.

    A block row is sent if one of its points was touched, and a point sends only what changed: the
    offers this executor accepted for it (flag 2: with the filter, those that beat its list as read,
    kept in ``G``; without, for a point owned elsewhere, the ``k`` nearest offers found, ``box``) as
    new, and its owner's marks (flag -1) as old. Untouched points of a sent block send an empty list.

    Why not an owned point's whole list: the rest of it is what the servers already merged (the
    list was read from them, and a merge only ever keeps the ``k`` nearest of all it was sent), so
    merging it again changes nothing, yet it cost a search of the list per entry on the servers
    and in the update logs, every round, for every point, however few entries changed.
    """
    n = G.shape[0]
    nblocks = (n + block - 1) // block
    send = np.zeros(nblocks, np.bool_)
    for i in range(n):
        if touched[i]:
            send[i // block] = True
    blocks = np.flatnonzero(send).astype(np.int64)
    deltas = np.zeros((blocks.shape[0], block, 3 * k), np.float32)
    for b in range(blocks.shape[0]):
        out = deltas[b]
        out[:, :k] = -1.0
        out[:, k:2 * k] = np.inf
        base = blocks[b] * block
        for r in range(block):
            i = base + r
            if i >= n or not touched[i]:
                continue
            src = G[i] if (pos[i] >= 0 or use_filter) else box[i]
            c = 0
            for s in range(k):
                if src[s] < 0:
                    break
                f = src[2 * k + s]
                if f == FLAG_PROPOSED:
                    f = FLAG_NEW
                    counts[2] += 1
                elif f == FLAG_MARKED:
                    f = FLAG_OLD
                else:
                    continue
                out[r, c] = src[s]
                out[r, k + c] = src[k + s]
                out[r, 2 * k + c] = f
                c += 1
    counts[4] += blocks.shape[0]
    return blocks, deltas


@_jit
def nnd_sample(G: np.ndarray, owned: np.ndarray, k: int, mc: int, seed: int, rnd: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step 2 of a round (:func:`sample_candidates`) on the executor's copy ``G`` (marks made in place).

    Returns ``(pos, touched, new, old, counts)``: what the join and the packing take (see
    :func:`nnd_round`), with ``counts`` (:data:`COUNTERS`) holding the marks so far.
    """
    pos, touched, counts = bookkeeping(G.shape[0], owned)
    new, old, marked = sample_candidates(G, k, pos, owned.shape[0], mc, seed, rnd, touched)
    counts[5] = marked
    return pos, touched, new, old, counts


#: ``dists`` of a join that computes its distances itself.
NO_DISTANCES = np.zeros((0, 0, 0), np.float32)


def nnd_round(data: np.ndarray, G: np.ndarray, owned: np.ndarray, k: int, mc: int, seed: int, rnd: int,
              use_filter: bool, block: int, distances: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
              | None = None, chunk_bytes: int = 64 << 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One NN-Descent round of one executor on its copy ``G`` (n, 3k) of the whole graph (modified in
    place), in one process: sample (:func:`nnd_sample`), join and pack (:func:`nnd_join`). A job's
    executors do the same from the lists around their points only (apps/nndescent.py); this is their
    reference. Returns ``(blocks, deltas, counts)``; ``counts`` follows :data:`COUNTERS`.
    """
    pos, touched, new, old, counts = nnd_sample(G, owned, k, mc, seed, rnd)
    blocks, deltas = nnd_join(data, G, owned, pos, touched, new, old, counts, k, use_filter, block, distances,
                              chunk_bytes)
    return blocks, deltas, counts


def nnd_join(data: np.ndarray, G: np.ndarray, owned: np.ndarray, pos: np.ndarray, touched: np.ndarray,
             new: np.ndarray, old: np.ndarray, counts: np.ndarray, k: int, use_filter: bool, block: int,
             distances: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None,
             chunk_bytes: int = 64 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Join the owned points' candidates (:func:`local_join`) on ``G``, which must hold the lists of the
    owned points and of every candidate (other rows are never read), and pack the update
    (:func:`pack_updates`): ``(blocks, deltas)``, ``counts`` added to.

    ``distances(data, new, old)``, if given, computes the join pairs' distances of a run of owned
    points at once (a GPU: :func:`apps.nndescent_cuda.join_distances`); the lists come out as
    without it, up to the rounding of the distances. It is called on runs of owned points whose
    distances fit in ``chunk_bytes`` (``8 mc^2`` bytes a point: 115 KB at ``mc`` = 120, HDBSCAN's
    k = 60), joined in order, so the offers are the same as in one call.
    """
    data = read_only(data)
    mc = new.shape[1]
    box = empty_lists(1 if use_filter else G.shape[0], k)
    if distances is None:
        local_join(data, G, box, k, pos, owned, new, old, use_filter, touched, counts, NO_DISTANCES)
    else:
        run = max(1, int(chunk_bytes) // (8 * mc * mc))
        for lo in range(0, len(owned), run):
            part = slice(lo, lo + run)
            local_join(data, G, box, k, pos, owned[part], new[part], old[part], use_filter, touched, counts,
                       distances(data, new[part], old[part]))
    return pack_updates(G, box, k, pos, use_filter, touched, block, counts)


@_jit_fast
def _sides(data: np.ndarray, order: np.ndarray, lo: int, hi: int, normal: np.ndarray, off: float,
           side: np.ndarray) -> tuple[int, bool]:
    """Which side of the hyperplane ``normal . x + off = 0`` each point ``order[lo:hi]`` is on: ``side`` 1
    (left, below), 0 (right) or 2 (on it); returns ``(points on the left, any on it)``.

    Four points at a time: one point's projection is a chain of ``dim`` dependent additions, so four
    chains side by side keep the CPU's adders busy (the eight trees of 2**19 10-d blobs in 0.41-0.46 s
    instead of 0.51-0.62 s, with the branch-free partition; identical trees). A point's lane follows
    from its place in the node, which is the same in a pruned tree as in the whole one, so pruning
    changes no side."""
    dim = data.shape[1]
    left = 0
    plane = 0
    r = lo
    while r + 4 <= hi:
        i0, i1, i2, i3 = order[r], order[r + 1], order[r + 2], order[r + 3]
        m0 = off
        m1 = off
        m2 = off
        m3 = off
        for t in range(dim):
            c = normal[t]
            m0 += c * data[i0, t]
            m1 += c * data[i1, t]
            m2 += c * data[i2, t]
            m3 += c * data[i3, t]
        s0 = np.uint8(m0 < 0) + np.uint8(2) * np.uint8(m0 == 0)
        s1 = np.uint8(m1 < 0) + np.uint8(2) * np.uint8(m1 == 0)
        s2 = np.uint8(m2 < 0) + np.uint8(2) * np.uint8(m2 == 0)
        s3 = np.uint8(m3 < 0) + np.uint8(2) * np.uint8(m3 == 0)
        side[r], side[r + 1], side[r + 2], side[r + 3] = s0, s1, s2, s3
        left += (s0 & 1) + (s1 & 1) + (s2 & 1) + (s3 & 1)
        plane += (s0 | s1 | s2 | s3) >> 1
        r += 4
    for rest in range(r, hi):
        i = order[rest]
        m = off
        for t in range(dim):
            m += normal[t] * data[i, t]
        s = np.uint8(m < 0) + np.uint8(2) * np.uint8(m == 0)
        side[rest] = s
        left += s & 1
        plane += s >> 1
    return left, plane > 0


@_jit_fast
def _rp_leaves(data: np.ndarray, points: np.ndarray, seed: int, tree: int, leaf_size: int, keep: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """A random-projection tree over ``points`` (ids into ``data``): ``(order, bounds)``, leaf ``l`` is
    ``order[bounds[l]:bounds[l + 1]]``. Each node splits by the hyperplane halfway between two of
    its points drawn at random (pynndescent's Euclidean trees); a degenerate split halves at random.
    Leaves come out depth first, so ``order`` is also a space-filling order (:func:`locality_order`).

    ``keep`` (one flag per id of ``data``, or empty for the whole tree): only the leaves holding a
    flagged point, and ``order`` holds only their points. Why: an executor offers a leaf's pairs to
    its own points only, so it needs only the leaves of its own points, and a branch without them is
    never split (at 2**19 blobs and a twelfth of the points owned, the eight trees of the first lists
    cost half the whole ones). The draws hash each node's place (range and depth), not the
    count of nodes split before it, so a kept leaf is exactly the leaf of the whole tree.
    """
    dim = data.shape[1]
    n = points.shape[0]
    prune = keep.shape[0] > 0
    order = points.astype(np.int64)
    side = np.empty(n, np.uint8)  # 1 left, 0 right; 2 on the hyperplane (until its draw)
    scratch = np.empty(n, np.int64)  # one buffer for every node's partition (copies per node: 15% slower)
    leaves = [(0, 0)]
    leaves.pop()
    stack = [(0, n, 0)]
    normal = np.empty(dim, np.float32)
    while len(stack):
        lo, hi, depth = stack.pop()
        if hi - lo <= leaf_size:
            leaves.append((lo, hi))  # depth first, left to right: the stack pops the left child first
            continue
        node = (lo * (n + 1) + hi) * 64 + depth  # unique: a child's range differs from its parent's or is deeper
        a = order[lo + int(_hash(seed, tree, node, 1) % np.uint64(hi - lo))]
        b = order[lo + int(_hash(seed, tree, node, 2) % np.uint64(hi - lo))]
        off = np.float32(0.0)
        for t in range(dim):
            normal[t] = data[a, t] - data[b, t]
            off -= normal[t] * (data[a, t] + data[b, t]) * np.float32(0.5)
        left, on_plane = _sides(data, order, lo, hi, normal, off, side)
        if on_plane:  # a point on the hyperplane goes where its hash says
            for r in range(lo, hi):
                if side[r] == 2:
                    side[r] = np.uint8(_hash(seed, tree, order[r], 3) & np.uint64(1) == 0)
                    left += side[r]
        if left == 0 or left == hi - lo:
            left = 0
            for r in range(lo, hi):
                side[r] = np.uint8(_hash(seed, tree + 7919, order[r], node) & np.uint64(1) == 0)
                left += side[r]
        # a stable partition, without a branch on the side (half the points go either way at random): every
        # point is written to both places, and only its side's place advances; the left side moves down in
        # place (w <= r: every place below r was read already), the right side via scratch
        w = lo
        v = 0
        kept_left = 0
        kept_right = 0
        for r in range(lo, hi):
            i = order[r]
            s = side[r]
            order[w] = i
            scratch[v] = i
            w += s
            v += 1 - s
            if prune:  # flagged points on each side (counted where the points are read anyway)
                kept_left += keep[i] & s
                kept_right += keep[i] & (1 - s)
        for r in range(v):
            order[w + r] = scratch[r]
        if not prune or kept_right > 0:
            stack.append((lo + left, hi, depth + 1))
        if not prune or kept_left > 0:
            stack.append((lo, lo + left, depth + 1))
    bounds = np.empty(len(leaves) + 1, np.int64)
    bounds[0] = 0
    if not prune:  # the leaves tile ``order``
        for lf in range(len(leaves)):
            bounds[lf + 1] = leaves[lf][1]
        return order, bounds
    size = 0
    for lf in range(len(leaves)):
        size += leaves[lf][1] - leaves[lf][0]
        bounds[lf + 1] = size
    out = np.empty(size, np.int64)
    for lf in range(len(leaves)):
        lo, hi = leaves[lf]
        out[bounds[lf]:bounds[lf + 1]] = order[lo:hi]
    return out, bounds


@_points_read_only
@_jit
def locality_order(data: np.ndarray, seed: int, leaf_size: int) -> np.ndarray:
    """A permutation of the points that keeps near points near in the order: the leaves of one
    random-projection tree, depth first (apps/nndescent.py, "Locality")."""
    return _rp_leaves(data, np.arange(data.shape[0]), seed, 0x0DE5, leaf_size, np.empty(0, np.uint8))[0]


@_jit
def init_lists(n: int, owned: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Empty lists and bookkeeping for the first lists: ``(G, pos, touched, counts)`` for
    :func:`leaf_offers`, :func:`fill_random` and :func:`pack_updates`."""
    return (empty_lists(n, k), *bookkeeping(n, owned))


@_points_read_only
@_jit_fast
def fill_random(data: np.ndarray, G: np.ndarray, owned: np.ndarray, k: int, seed: int, touched: np.ndarray,
                counts: np.ndarray) -> None:
    """Complete each owned point's list with distinct random other points (all new), as pynndescent
    does after its trees: with leaves of at least ``k + 1`` points no list is short, so this costs
    nothing then. The draws hash (seed, point, attempt): a list does not depend on the partition."""
    n = data.shape[0]
    n_dist = 0
    n_got = 0
    for a in range(owned.shape[0]):
        i = owned[a]
        r = G[i]
        got = 0
        while got < k and r[got] >= 0:
            got += 1
        attempt = 0
        while got < k and got < n - 1:
            j = int(_hash(seed, 0x1A17, i, attempt) % np.uint64(n))
            attempt += 1
            if j == i:
                continue
            d = _sqdist(data, i, j)
            n_dist += 1
            if _push(r, k, j, d, FLAG_PROPOSED):
                got += 1
                n_got += 1
                touched[i] = 1
    counts[0] += n_dist
    counts[3] += n_got


@_points_read_only
@_jit_fast
def leaf_offers(data: np.ndarray, G: np.ndarray, order: np.ndarray, bounds: np.ndarray, k: int, pos: np.ndarray,
                touched: np.ndarray, counts: np.ndarray) -> None:
    """Offer every pair of points sharing a leaf of a random-projection tree to each other's lists,
    owned points' lists only (pairs of two others are not even measured)."""
    widest = 1
    for lf in range(bounds.shape[0] - 1):
        widest = max(widest, bounds[lf + 1] - bounds[lf])
    _leaf_offers(data, G, order, bounds, k, pos, touched, counts, np.empty(widest, np.int64),
                 np.empty(widest, np.float32), np.empty((widest, widest), np.float32), np.empty(widest, np.float32),
                 np.empty(widest, np.int64), np.empty(3 * k, np.float32))


@_jit_fast_bare
def _leaf_offers(data: np.ndarray, G: np.ndarray, order: np.ndarray, bounds: np.ndarray, k: int, pos: np.ndarray,
                 touched: np.ndarray, counts: np.ndarray, qs: np.ndarray, ds: np.ndarray, D: np.ndarray,
                 cd: np.ndarray, cq: np.ndarray, out: np.ndarray) -> None:
    """:func:`leaf_offers` with its scratch: ``qs``, ``ds``, ``cd`` and ``cq`` hold a point's partners in its
    leaf, their distances and its sorted candidates (the widest leaf's size each), ``D`` the leaf's
    distances, ``out`` a merged list.

    Each pair with an owned end is measured once, into ``D``; then each owned point takes its leaf
    mates that can enter its list, sorted by (distance, id), and merges them with its list in one
    pass (:func:`_merge_sorted`). That is the list that offering the pairs one by one (:func:`_push`)
    makes: both keep the ``k`` smallest (distance, id) of the ids offered, each once (an id met again
    comes with the same distance, :func:`_sqdist4`). Why: into the first tree's empty lists nearly
    every offer was an insertion with its shifts, and an offer also touched the other point's list,
    elsewhere in memory; the first tree took 0.47 s of the eight trees' 1.64-1.69 s, sorted merges
    0.18 s, all eight 1.19-1.45 s (2**19 10-d blobs, half the points owned, one process)."""
    n_dist = 0
    for lf in range(bounds.shape[0] - 1):
        lo, hi = bounds[lf], bounds[lf + 1]
        mine = False
        for x in range(lo, hi):
            if pos[order[x]] >= 0:
                mine = True
                break
        if not mine:
            continue
        for x in range(lo, hi):  # the owned points' lists are read below: fetch them while the distances run
            p = order[x]
            if pos[p] >= 0:
                prefetch(G[p], 0)
                prefetch(G[p], k)
                prefetch(G[p], 2 * k)
                prefetch(G[p], 3 * k - 1)
        for x in range(lo, hi):
            p = order[x]
            mp = pos[p] >= 0
            m = 0
            for y in range(x + 1, hi):
                q = order[y]
                if mp or pos[q] >= 0:
                    qs[m] = y - lo
                    cq[m] = q
                    m += 1
            if m == 0:
                continue
            _sqdists(data, p, cq, m, ds)  # four at a time
            n_dist += m
            for j in range(m):
                D[x - lo, qs[j]] = ds[j]
                D[qs[j], x - lo] = ds[j]
        for x in range(lo, hi):
            p = order[x]
            if pos[p] < 0:
                continue
            worst = G[p, 2 * k - 1]
            m = 0
            for y in range(lo, hi):
                d = D[x - lo, y - lo]
                if y == x or d > worst:
                    continue
                insert_sorted(cd, cq, m, d, order[y])  # a leaf holds few
                m += 1
            if m and _merge_sorted(G[p], k, cd, cq, m, out):
                touched[p] = 1
    counts[0] += n_dist  # counters in locals: array writes in the loop cost as much as the distances
    counts[1] += 2 * n_dist


@_jit
def _merge_sorted(r: np.ndarray, k: int, cd: np.ndarray, cq: np.ndarray, m: int, out: np.ndarray) -> int:
    """Merge the ``m`` offers ``(cd, cq)``, sorted by (distance, id), into the list ``r`` as new entries
    (:data:`FLAG_PROPOSED`); 1 if one entered. An id already listed keeps its entry: it comes with the
    same distance, and the offer's flag is the highest, so :func:`_push` would keep the entry too."""
    a = 0
    b = 0
    got = 0
    for t in range(k):
        if b < m:
            db = cd[b]
            qb = cq[b]
            ra = r[a]
            da = r[k + a]
            if db < da or (db == da and (ra < 0 or qb < ra)):
                out[t] = qb
                out[k + t] = db
                out[2 * k + t] = FLAG_PROPOSED
                b += 1
                got = 1
                continue
            if db == da and qb == ra:
                b += 1
        out[t] = r[a]
        out[k + t] = r[k + a]
        out[2 * k + t] = r[2 * k + a]
        a += 1
    if got:
        for t in range(3 * k):
            r[t] = out[t]
    return got


@_points_read_only
@_jit_fast
def rp_tree(data: np.ndarray, seed: int, tree: int, leaf_size: int, keep: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Random-projection tree ``tree`` over all points: ``(order, bounds)``; with ``keep`` (a uint8 flag
    per point), only the leaves holding a flagged point (see :func:`_rp_leaves`)."""
    return _rp_leaves(data, np.arange(data.shape[0]), seed, tree, leaf_size,
                      np.empty(0, np.uint8) if keep is None else keep)


# ----------------------------------------------------------------------------------------------------
# the exact neighbours of a sample (recall)
# ----------------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, parallel=True)
def smallest_per_row(values: np.ndarray, m: int) -> np.ndarray:
    """The column ids of the ``m`` smallest values of every row (unordered), ``(rows, m)`` int64.

    What ``np.argpartition(values, m, axis=1)[:, :m]`` gives, in one pass per row that compares most
    values once with the current m-th smallest, threads over rows. At 2^18 points the partition was
    most of the recall check's 6.5 s: it streams each row through memory several times."""
    rows, n = values.shape
    out = np.empty((rows, m), np.int64)
    for r in numba.prange(rows):
        row = values[r]
        best = np.empty(m, values.dtype)
        ids = out[r]
        for j in range(m):
            best[j] = row[j]
            ids[j] = j
        worst = 0
        for j in range(1, m):
            if best[j] > best[worst]:
                worst = j
        for c in range(m, n):
            v = row[c]
            if v < best[worst]:
                best[worst] = v
                ids[worst] = c
                worst = 0
                for j in range(1, m):
                    if best[j] > best[worst]:
                        worst = j
    return out
