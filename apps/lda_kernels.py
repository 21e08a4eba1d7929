"""Numba kernels for collapsed Gibbs sampling of LDA: one sweep over the tokens of one vocabulary block.

The LDA app (apps/lda.py) calls :func:`sweep` once per micro-task, on the tokens an executor owns
whose words fall in the block it holds. The state the kernel works on:

* ``rows`` (Vb, K) int32: the block's word-topic counts ``n_wk``, fetched from the parameter server.
  The executor holding the block is the only writer while it holds it, so these are exact.
* ``totals`` (K,) int64: the topic totals ``n_k``, a local copy read at the task's start. Other
  executors change them meanwhile (on other blocks), so they are slightly stale (see apps/lda.py).
* the executor's tokens of the block, **sorted by word** (``tok_word``, and ``tok_off``: where the
  token's document keeps its counts) and their topics ``z``; and its document-topic counts as one
  sparse list of (topic, count) pairs per document in ``doc_list`` (see :func:`build_doc_lists`), each
  pair packed in one int32. A document has at most ``min(len, K)`` topics, so the lists take O(tokens)
  memory and a scan of one costs O(K_d), never O(K).

Two samplers draw from the same full conditional of a token (after removing it from the counts)::

    p(k) ∝ (n_dk + α) (n_wk + β) / (n_k + Vβ)

``exact`` evaluates it for all K topics (O(K) per token), kept as the reference. ``sparse`` splits it
into three buckets whose sum is the same distribution (a word-major variant of SparseLDA, Yao et
al. 2009)::

    doc bucket    n_dk (n_wk + β) / (n_k + Vβ)   over the K_d topics of the document, per token
    word bucket   α n_wk / (n_k + Vβ)            over the K_w topics of the word; its sum is kept
                                                  up to date incrementally while the word's tokens run
    smoothing     α β / (n_k + Vβ)               over all K topics; its sum is kept incrementally

Per token it pays O(K_d) for the doc bucket and draws a uniform; it walks the word bucket (O(K_w)) or
the smoothing bucket (O(K)) only when the draw lands there, which for the short documents and small
α, β of topic models is a minority of tokens (smoothing: a tiny fraction). Tokens run word by word,
so each word's topic list is built once per sweep (one O(K) scan of its row, amortized over its tokens).
``1 / (n_k + Vβ)`` and the current word's ``(n_wk + β) / (n_k + Vβ)`` are kept in arrays updated at
each count change, so the inner loops multiply only.

Log-likelihood (the collapsed joint ``log p(w, z)``, same formula as the ``lda`` package) is split so
that each part is computed where its counts live: documents by their executor (:func:`doc_loglik`),
word rows by the block's holder (:func:`block_loglik`, which also returns the block's topic sums), and
the topic-total term by the driver (:func:`topic_loglik`). ``lgamma`` of integer counts comes from
tables (:func:`lgamma_table`) because it is evaluated for every non-zero count at every report.

Kernels are ``cache=True`` (only the first process on a host compiles) and ``nogil=True``; inputs
are normalized by the wrappers to one dtype each, so :func:`warmup` compiles every specialization used.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from apps.kernel_util import NO_REFCOUNTS, prefetch

__all__ = ["AHEAD", "COUNT_DTYPES", "SAMPLERS", "block_loglik", "build_doc_lists", "conditional", "doc_loglik",
           "doc_offsets", "doc_pairs", "draw_topics", "lgamma_table", "sweep", "task_seed", "topic_bits",
           "topic_loglik", "warmup"]

SAMPLERS = {"exact": 0, "sparse": 1}
COUNT_DTYPES = (np.dtype(np.int16), np.dtype(np.int32))  # word-topic counts: int16 when every word is rarer than 2**15
_JIT = {"cache": True, "nogil": True}
# The sweep asks for the document list of the token this many places ahead (apps/kernel_util.py):
# they are scattered, and a miss costs more than a token's arithmetic. bench/bench_lda_sweep.py measures
# it against 0 (no prefetch): sweeps 1.07-1.12x faster on fortunes and 1.27-1.39x on wordnet (whose
# lists of 1.8 MB exceed the L2 cache) on a quiet machine, 1.2x and 1.6-2x while other work competed for
# memory; any distance from 2 to 24 did as well.
AHEAD = 8


# ----------------------------------------------------------------------------------------------------
# random numbers: xorshift64* inline (a third of the cost of np.random.random per draw, and the state
# is a local variable, so a task's draws depend only on its seed)
# ----------------------------------------------------------------------------------------------------

_U53 = 1.0 / 9007199254740992.0


@nb.njit(**_JIT)
def _seed_state(seed: int) -> np.uint64:
    """A non-zero xorshift state from any seed (one splitmix64 step)."""
    x = np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return x if x != np.uint64(0) else np.uint64(1)


@nb.njit(**_JIT)
def _next(x: np.uint64) -> tuple[np.uint64, float]:
    """One xorshift64* step: the new state and a uniform double in [0, 1) from the top 53 bits."""
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    return x, np.int64((x * np.uint64(0x2545F4914F6CDD1D)) >> np.uint64(11)) * _U53


# ----------------------------------------------------------------------------------------------------
# one draw from the full conditional
#
# A document's list lives in ``doc_list`` at its offset ``o``: ``doc_list[o]`` is its number of topics
# ``nnz``, then ``nnz`` pairs at ``o + 1 + j``, each one int32 ``count << tb | topic`` with ``tb =
# topic_bits(K)``; ``min(len, K)`` pairs are reserved. One token thus touches one cache line of document
# state (short documents) instead of three arrays. Packing halves the lists against (topic, count) as two
# int32s: the lists are the one structure a sweep reads at random (documents are scattered over the
# word-major token order), and at half the size more of them stay in cache. Sweeps measured 1.15-1.4x
# faster than with two int32s per pair (fortunes and wordnet, K = 20 and 100, one or two cores busy).
# ----------------------------------------------------------------------------------------------------


@nb.njit(**_JIT)
def _draw_exact(u: float, row: np.ndarray, inv: np.ndarray, dense: np.ndarray, doc_list: np.ndarray, off: int,
                k0: int, alpha: float, beta: float, cum: np.ndarray, tb: int) -> int:
    """O(K): every topic's weight, with the document's counts (less the token's own) scattered into
    ``dense`` (zeros on entry and exit)."""
    K = row.shape[0]
    nnz = doc_list[off]
    mask = (1 << tb) - 1
    for j in range(nnz):
        v = doc_list[off + 1 + j]
        dense[v & mask] = v >> tb
    dense[k0] -= 1.0
    acc = 0.0
    for k in range(K):
        acc += (dense[k] + alpha) * (row[k] + beta) * inv[k]
        cum[k] = acc
    for j in range(nnz):
        dense[doc_list[off + 1 + j] & mask] = 0.0
    u *= acc
    lo, hi = 0, K - 1
    while lo < hi:  # the first k with cum[k] > u
        mid = (lo + hi) >> 1
        if cum[mid] > u:
            hi = mid
        else:
            lo = mid + 1
    return lo


@nb.njit(**_JIT, inline="always")  # into the sweep: as a call (LLVM left it one) it cost 17% of a sweep
def _draw_sparse(u: float, row: np.ndarray, inv: np.ndarray, coef: np.ndarray, doc_list: np.ndarray, off: int,
                 k0: int, wnz: np.ndarray, nw: int, q: float, s_sum: float, alpha: float, beta: float,
                 cum: np.ndarray, tb: int) -> tuple[int, int]:
    """``(topic, index in the document's list or -1)``. Doc bucket computed here in O(K_d) (the token's
    own count removed); word bucket ``α q`` and smoothing ``s_sum`` are maintained by the caller.

    ``q`` is ``Σ_k n_wk / (n_k + Vβ)`` over the word's topics ``wnz[:nw]`` (an entry whose count fell to
    zero weighs nothing). Rounding can make a maintained sum a hair larger than the walk over its terms;
    the walk then ends on the last topic with weight, or moves on to the next bucket: a change of
    probabilities of the order of 1e-16.
    """
    nnz = doc_list[off]
    mask = (1 << tb) - 1
    r = 0.0
    for j in range(nnz):
        v = doc_list[off + 1 + j]
        k = v & mask
        c = v >> tb
        if k == k0:
            c -= 1
        r += c * coef[k]
        cum[j] = r
    aq = alpha * q if q > 0.0 else 0.0
    u *= r + aq + s_sum
    if u < r:
        j = 0
        for jj in range(nnz):  # the first j with u < cum[j], counted without a branch per entry
            j += cum[jj] <= u  # (draws are random: an early exit mispredicts; 3-6% faster sweeps)
        return doc_list[off + 1 + j] & mask, j  # j < nnz: u < r, and r is cum[nnz - 1]
    u = (u - r) / alpha
    K = inv.shape[0]
    if u < q:
        acc = 0.0
        for j in range(nw):  # without a branch on the count: zero-count entries add nothing, never chosen
            k = wnz[j]
            acc += row[k] * inv[k]
            if u < acc:
                return k, -1
        for j in range(nw - 1, -1, -1):  # rounding: the last topic with weight
            if row[wnz[j]] > 0:
                return wnz[j], -1
        total = 0.0  # q > 0 from rounding alone: draw from the smoothing bucket instead
        for k in range(K):
            total += inv[k]
        u = u / q * total
    else:
        u = (u - q) / beta
    acc = 0.0
    for k in range(K):
        acc += inv[k]
        if u < acc:
            return k, -1
    return K - 1, -1


# ----------------------------------------------------------------------------------------------------
# the sweep
# ----------------------------------------------------------------------------------------------------


@nb.njit(**_JIT)
def _inv_minus_one(total: int, vbeta: float) -> float:
    """``1 / (n_k - 1 + Vβ)``: the weight factor of topic k once a token of it is taken out."""
    return 1.0 / (total - 1 + vbeta) if total > 0 else 0.0


@nb.njit(**_JIT, **NO_REFCOUNTS)
def _sweep(rows: np.ndarray, totals: np.ndarray, tok_word: np.ndarray, tok_off: np.ndarray, z: np.ndarray,
           doc_list: np.ndarray, alpha: float, beta: float, vbeta: float, sparse: bool, seed: int, tb: int,
           ahead: int, scratch: np.ndarray, mark: np.ndarray, wnz: np.ndarray) -> int:
    """Resample each token: take it out, draw, put it back. When the draw returns the token's own topic
    (most tokens, once the chain mixes) nothing changes at all: the taken-out values are computed from
    cached ``1 / (n_k - 1 + Vβ)`` and the old ones restored, so such a token costs no division and
    leaves no rounding drift in the maintained sums.

    Compiled without Numba's reference counting (:data:`~apps.kernel_util.NO_REFCOUNTS`), so the
    scratch arrays come from the caller (``scratch`` (5, K) float64, ``mark`` (K,) int64, ``wnz``
    (K,) int32; any content). With it, every token paid five atomic increments and five decrements,
    one pair per array the inlined :func:`_draw_sparse` receives (Numba's pruning cannot pair them
    across the draw's branches): two thirds of the sweep's time in a profile, and sweeps ran 1.6x
    slower (7.6 against 12.4 M tokens/s on fortunes, the same draws)."""
    rng = _seed_state(seed)
    K = totals.shape[0]
    mask = (1 << tb) - 1
    one = np.int32(1 << tb)
    ab = alpha * beta
    inv = scratch[0]
    invm = scratch[1]
    s_sum = 0.0
    for k in range(K):
        inv[k] = 1.0 / (totals[k] + vbeta)
        invm[k] = _inv_minus_one(totals[k], vbeta)
        s_sum += ab * inv[k]
    mark[:] = -1  # mark[k] == w: topic k is in the current word's list
    cum = scratch[2]
    dense = scratch[3]
    dense[:] = 0.0
    coef = scratch[4]  # (n_wk + β) / (n_k + Vβ) of the current word
    n = tok_word.shape[0]
    changed = 0
    i = 0
    while i < n:
        w = tok_word[i]
        end = i + 1
        while end < n and tok_word[end] == w:
            end += 1
        row = rows[w]
        nw = 0
        q = 0.0
        if sparse:
            for k in range(K):
                c = row[k]
                coef[k] = (c + beta) * inv[k]
                if c > 0:
                    wnz[nw] = k
                    nw += 1
                    mark[k] = w
                    q += c * inv[k]
        for t in range(i, end):
            if ahead and t + ahead < n:
                prefetch(doc_list, tok_off[t + ahead])
            off = tok_off[t]
            k0 = z[t]
            # take the token out (tentatively)
            c0 = row[k0]
            i_old = inv[k0]
            i_rm = invm[k0]
            row[k0] = c0 - 1
            inv[k0] = i_rm
            rng, u = _next(rng)
            if sparse:
                coef_old = coef[k0]
                coef[k0] = (c0 - 1 + beta) * i_rm
                s_rm = s_sum + ab * (i_rm - i_old)
                q_rm = q + (c0 - 1) * i_rm - c0 * i_old
                k, jk = _draw_sparse(u, row, inv, coef, doc_list, off, k0, wnz, nw, q_rm, s_rm, alpha, beta, cum, tb)
            else:
                s_rm = 0.0
                q_rm = 0.0
                k = _draw_exact(u, row, inv, dense, doc_list, off, k0, alpha, beta, cum, tb)
                jk = -1
            if k == k0:  # unchanged: restore, the maintained sums never moved
                row[k0] = c0
                inv[k0] = i_old
                if sparse:
                    coef[k0] = coef_old
                continue
            changed += 1
            z[t] = k
            # the removal of k0 stands
            totals[k0] -= 1
            invm[k0] = _inv_minus_one(totals[k0], vbeta)
            # add the token to k
            c = row[k]
            i_prev = inv[k]
            row[k] = c + 1
            totals[k] += 1
            invm[k] = i_prev
            inv[k] = 1.0 / (totals[k] + vbeta)
            if sparse:
                coef[k] = (c + 1 + beta) * inv[k]
                s_sum = s_rm + ab * (inv[k] - i_prev)
                q = q_rm + (c + 1) * inv[k] - c * i_prev
                if mark[k] != w:
                    mark[k] = w
                    wnz[nw] = k
                    nw += 1
            # the document's list: count k0 down (swap-remove at zero), then k up (append if new; the
            # list has room: it holds at most min(len, K) topics, and k0's slot was freed if it emptied)
            nnz = doc_list[off]
            j0 = 0
            while doc_list[off + 1 + j0] & mask != k0:
                j0 += 1
            v = doc_list[off + 1 + j0] - one
            if v < one:
                nnz -= 1
                doc_list[off + 1 + j0] = doc_list[off + 1 + nnz]
                if jk == nnz:  # k was the last pair: it moved into k0's slot
                    jk = j0
            else:
                doc_list[off + 1 + j0] = v
            if jk < 0:
                jk = 0
                while jk < nnz and doc_list[off + 1 + jk] & mask != k:
                    jk += 1
            if jk == nnz:
                doc_list[off + 1 + nnz] = one | k
                nnz += 1
            else:
                doc_list[off + 1 + jk] += one
            doc_list[off] = nnz
        i = end
    return changed


def task_seed(seed: int, executor: int, rnd: int, sweep: int = 0) -> int:
    """A 64-bit seed per (job seed, executor, round, sweep): a task draws the same wherever it runs."""
    return int(np.random.SeedSequence([seed, executor, rnd, sweep]).generate_state(1, np.uint64)[0])


def sweep(rows: np.ndarray, totals: np.ndarray, tok_word: np.ndarray, tok_off: np.ndarray, z: np.ndarray,
          doc_list: np.ndarray, alpha: float, beta: float, vbeta: float, sampler: str = "sparse",
          seed: int = 0, ahead: int = AHEAD) -> int:
    """Resample every token once, in the given order (grouped by word); returns how many changed topic.

    Updates ``rows`` (Vb, K) int16 or int32, ``totals`` (K,) int64, ``z`` and ``doc_list`` in place.
    ``tok_word`` indexes ``rows``; ``tok_off`` is the offset of the token's document in ``doc_list``
    (see :func:`build_doc_lists`). ``vbeta`` is V·β with V the whole vocabulary (not the block's).
    ``ahead``: prefetch the document list of the token this many places ahead (0: none); it changes
    the speed only, never the draws.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {sorted(SAMPLERS)}")
    if rows.dtype not in COUNT_DTYPES or rows.ndim != 2 or totals.dtype != np.int64 or totals.shape != (rows.shape[1],):
        raise TypeError(f"rows must be (Vb, K) int16 or int32 and totals (K,) int64, got {rows.dtype}{rows.shape}, "
                        f"{totals.dtype}{totals.shape}")
    for name, a in (("tok_word", tok_word), ("tok_off", tok_off), ("z", z), ("doc_list", doc_list)):
        if a.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")
    if not len(tok_word) == len(tok_off) == len(z):
        raise ValueError("tok_word, tok_off and z differ in length")
    return int(_sweep(rows, totals, tok_word, tok_off, z, doc_list, float(alpha), float(beta), float(vbeta),
                      sampler == "sparse", np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF), topic_bits(rows.shape[1]),
                      max(0, int(ahead)), np.empty((5, rows.shape[1])), np.empty(rows.shape[1], np.int64),
                      np.empty(rows.shape[1], np.int32)))


def topic_bits(num_topics: int) -> int:
    """Bits of a packed pair that hold the topic; the count gets the other ``31 - topic_bits``."""
    return max(1, int(num_topics - 1).bit_length())


# ----------------------------------------------------------------------------------------------------
# document lists
# ----------------------------------------------------------------------------------------------------


def doc_offsets(doc_len: np.ndarray, num_topics: int) -> np.ndarray:
    """Offsets (D + 1,) int64 of the documents' lists in ``doc_list``: 1 + min(len, K) slots each.

    Raises ``ValueError`` for a document too long for its counts to share an int32 with a topic.
    """
    doc_len = np.asarray(doc_len, np.int64)
    longest = int(np.max(doc_len, initial=0))
    count_bits = 31 - topic_bits(num_topics)
    if longest >= 1 << count_bits:
        raise ValueError(f"a document of {longest} tokens is too long for {num_topics} topics: counts are packed "
                         f"in {count_bits} bits; split documents longer than {(1 << count_bits) - 1} tokens")
    size = 1 + np.minimum(doc_len, num_topics)
    off = np.zeros(len(size) + 1, np.int64)
    np.cumsum(size, out=off[1:])
    return off


@nb.njit(**_JIT)
def _build_doc_lists(tok_off: np.ndarray, z: np.ndarray, doc_list: np.ndarray, tb: int) -> None:
    mask = (1 << tb) - 1
    for t in range(tok_off.shape[0]):
        off = tok_off[t]
        k = z[t]
        nnz = doc_list[off]
        j = 0
        while j < nnz and doc_list[off + 1 + j] & mask != k:
            j += 1
        if j == nnz:
            doc_list[off + 1 + j] = (1 << tb) | k
            doc_list[off] = nnz + 1
        else:
            doc_list[off + 1 + j] += 1 << tb


def build_doc_lists(tok_off: np.ndarray, z: np.ndarray, size: int, num_topics: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """``doc_list`` (int32, ``size`` = ``doc_offsets(...)[-1]``) holding each document's (topic, count)
    pairs for the assignment ``z`` (topics below ``num_topics``) of tokens whose document lists start at
    ``tok_off``. Written into ``out`` when given (int32, ``size``), which keeps the array's identity."""
    if size >= 2**31:
        raise ValueError("document lists too large for int32 offsets; split the corpus over more executors")
    if out is None:
        doc_list = np.zeros(size, np.int32)
    elif out.dtype != np.int32 or out.shape != (size,):
        raise TypeError(f"out must be int32 ({size},), got {out.dtype}{out.shape}")
    else:
        doc_list = out
        doc_list[:] = 0
    _build_doc_lists(np.asarray(tok_off, np.int32), np.asarray(z, np.int32), doc_list, topic_bits(num_topics))
    return doc_list


def doc_pairs(doc_list: np.ndarray, off: int, num_topics: int) -> tuple[np.ndarray, np.ndarray]:
    """``(topics, counts)`` of the document whose list starts at ``off``, in the list's order."""
    tb = topic_bits(num_topics)
    packed = np.asarray(doc_list[off + 1: off + 1 + doc_list[off]], np.int64)
    return packed & ((1 << tb) - 1), packed >> tb


# ----------------------------------------------------------------------------------------------------
# log-likelihood log p(w, z)
# ----------------------------------------------------------------------------------------------------


@nb.njit(**_JIT)
def _lgamma_shifted(x: np.ndarray, shift: float) -> np.ndarray:
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        out[i] = math.lgamma(x[i] + shift)
    return out


def lgamma_table(prior: float, max_count: int) -> np.ndarray:
    """``t[c] = lgamma(c + prior) - lgamma(prior)`` for ``c = 0 .. max_count`` (float64)."""
    return _lgamma_shifted(np.arange(max_count + 1, dtype=np.float64), float(prior)) - math.lgamma(prior)


@nb.njit(**_JIT)
def _doc_loglik(doc_off: np.ndarray, doc_list: np.ndarray, table: np.ndarray, tb: int) -> float:
    ll = 0.0
    for d in range(doc_off.shape[0] - 1):
        off = doc_off[d]
        for j in range(doc_list[off]):
            ll += table[doc_list[off + 1 + j] >> tb]
    return ll


def doc_loglik(doc_off: np.ndarray, doc_list: np.ndarray, doc_len: np.ndarray, alpha: float, num_topics: int,
               table: np.ndarray | None = None) -> float:
    """``Σ_d [lgamma(Kα) - lgamma(N_d + Kα) + Σ_k (lgamma(n_dk + α) - lgamma(α))]`` over these documents.

    ``table`` is ``lgamma_table(alpha, max doc length)``, passed in so that it is built once per executor.
    """
    if table is None:
        table = lgamma_table(alpha, int(np.max(doc_len, initial=0)))
    ka = num_topics * alpha
    lens = np.asarray(doc_len, np.float64)
    const = len(lens) * math.lgamma(ka) - float(np.sum(_lgamma_shifted(lens, float(ka))))
    return const + float(_doc_loglik(np.asarray(doc_off, np.int64), doc_list, table, topic_bits(num_topics)))


@nb.njit(**_JIT)
def _block_loglik(rows: np.ndarray, table: np.ndarray, colsum: np.ndarray) -> float:
    ll = 0.0
    for w in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            c = rows[w, k]
            if c > 0:
                ll += table[c]
                colsum[k] += c
    return ll


def block_loglik(rows: np.ndarray, table: np.ndarray) -> tuple[float, np.ndarray]:
    """``(Σ_{w,k} lgamma(n_wk + β) - lgamma(β), Σ_w n_wk)`` over a block's rows ((Vb, K) int16 or int32).

    ``table`` is ``lgamma_table(beta, max word frequency)``: no count can exceed its word's frequency.
    """
    colsum = np.zeros(rows.shape[1], np.int64)
    ll = _block_loglik(rows, table, colsum)
    return float(ll), colsum


def topic_loglik(totals: np.ndarray, beta: float, num_words: int) -> float:
    """``Σ_k [lgamma(Vβ) - lgamma(n_k + Vβ)]``: the part of log p(w|z) held by the topic totals."""
    vb = num_words * beta
    return float(len(totals) * math.lgamma(vb) - np.sum(_lgamma_shifted(np.asarray(totals, np.float64), vb)))


# ----------------------------------------------------------------------------------------------------
# checking helpers: the exact conditional, and many draws of one token
# ----------------------------------------------------------------------------------------------------


def conditional(doc_topics: np.ndarray, doc_counts: np.ndarray, word_row: np.ndarray, totals: np.ndarray,
                alpha: float, beta: float, vbeta: float) -> np.ndarray:
    """The normalized full conditional ``p(k)`` of a token, from counts given **without** the token."""
    nd = np.zeros(len(totals))
    np.add.at(nd, np.asarray(doc_topics, np.int64), doc_counts)
    p = (nd + alpha) * (np.asarray(word_row, np.float64) + beta) / (np.asarray(totals, np.float64) + vbeta)
    return p / p.sum()


@nb.njit(**_JIT)
def _draw_many(sparse: bool, doc_list: np.ndarray, k0: int, row: np.ndarray, totals: np.ndarray,
               alpha: float, beta: float, vbeta: float, n: int, seed: int, tb: int) -> np.ndarray:
    """The sweep's code path for one token of topic ``k0`` (counts include it), drawn ``n`` times."""
    rng = _seed_state(seed)
    K = totals.shape[0]
    ab = alpha * beta
    inv = np.empty(K)
    s_sum = 0.0
    q = 0.0
    wnz = np.empty(K, np.int32)
    nw = 0
    for k in range(K):
        inv[k] = 1.0 / (totals[k] + vbeta)
        s_sum += ab * inv[k]
        if row[k] > 0:
            wnz[nw] = k
            nw += 1
            q += row[k] * inv[k]
    c0 = row[k0]
    i_old = inv[k0]
    i_rm = _inv_minus_one(totals[k0], vbeta)
    row[k0] = c0 - 1
    inv[k0] = i_rm
    s_rm = s_sum + ab * (i_rm - i_old)
    q_rm = q + (c0 - 1) * i_rm - c0 * i_old
    cum = np.empty(K)
    dense = np.zeros(K)
    coef = (row + beta) * inv
    out = np.zeros(K, np.int64)
    for _ in range(n):
        rng, u = _next(rng)
        if sparse:
            k, _j = _draw_sparse(u, row, inv, coef, doc_list, 0, k0, wnz, nw, q_rm, s_rm, alpha, beta, cum, tb)
        else:
            k = _draw_exact(u, row, inv, dense, doc_list, 0, k0, alpha, beta, cum, tb)
        out[k] += 1
    row[k0] = c0
    return out


def draw_topics(sampler: str, doc_topics: np.ndarray, doc_counts: np.ndarray, k0: int, word_row: np.ndarray,
                totals: np.ndarray, alpha: float, beta: float, vbeta: float, n: int, seed: int = 0) -> np.ndarray:
    """Histogram (K,) of ``n`` draws of the topic of one token, now of topic ``k0``, by ``sampler`` (for tests).

    The counts (the document's distinct ``doc_topics`` with ``doc_counts``, the word's row, the totals)
    **include** the token, as in a sweep; the draw takes it out first, exactly as the sweep does, and
    then leaves the counts as they were, so every draw is from the same conditional.
    """
    topics = np.asarray(doc_topics, np.int32)
    counts = np.asarray(doc_counts, np.int32)
    if len(set(topics.tolist())) != len(topics) or k0 not in topics.tolist():
        raise ValueError("doc_topics must be distinct and contain k0")
    tb = topic_bits(len(totals))
    doc_list = np.empty(1 + len(topics), np.int32)
    doc_list[0] = len(topics)
    doc_list[1:] = counts << tb | topics
    return _draw_many(sampler == "sparse", doc_list, int(k0), np.array(word_row, np.int32),
                      np.asarray(totals, np.int64), float(alpha), float(beta), float(vbeta), int(n),
                      np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF), tb)


def warmup() -> None:
    """Compile (first process on a host) or load from the Numba cache every kernel the app calls."""
    K, V = 3, 4
    tok_word = np.array([0, 0, 1, 3], np.int32)
    doc_len = np.array([2, 2], np.int64)
    doc_off = doc_offsets(doc_len, K)
    tok_off = doc_off[[0, 1, 0, 1]].astype(np.int32)
    z = np.array([0, 1, 2, 1], np.int32)
    doc_list = build_doc_lists(tok_off, z, int(doc_off[-1]), K)
    for dtype in COUNT_DTYPES:
        rows = np.zeros((V, K), dtype)
        np.add.at(rows, (tok_word, z), 1)
        totals = rows.sum(0).astype(np.int64)
        for sampler in SAMPLERS:
            sweep(rows, totals, tok_word, tok_off, z, doc_list, 0.1, 0.01, V * 0.01, sampler, 1)
            draw_topics(sampler, [0, 1], [1, 1], 0, [1, 0, 0], totals, 0.1, 0.01, V * 0.01, 2)
        block_loglik(rows, lgamma_table(0.01, 4))
    doc_loglik(doc_off, doc_list, doc_len, 0.1, K, lgamma_table(0.1, 2))
    topic_loglik(totals, 0.01, V)
