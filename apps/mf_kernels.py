"""Numba kernels for alternating least squares (ALS) with biases and L2 regularization.

The model predicts ``mu + b_u + c_i + w_u . v_i``. Every entity (user or item) has one float64
row of ``d = rank + 1`` numbers: its factor followed by its bias. Solving one side with the
other side fixed is one ridge regression per entity. With ``F`` the fixed side's rows, the
features of a rating ``(x, c, v)`` are ``y = [F[c, :rank], 1]`` and its target is
``v - F[c, rank]`` (the rating minus ``mu`` and the other side's bias). The entity's row ``x``
solves

    (sum y y^T + l2 * n * I) x = sum (v - F[c, rank]) y,        n = number of its ratings.

This is the count-weighted L2 of ALS-WR, the objective Spark MLlib's ALS uses too. An entity
with no rating gets the zero row, so a cold user or item is predicted by ``mu`` plus the known
side's bias.

On the parameter server, one side is kept as these normal equations, summed over executors
(see apps/mf.py). A packed row of ``1 + P`` float64 holds:

- ``[0]``: a tag, the iteration whose contributions it sums (see ``apps.mf.TAGGED_SUM``);
- ``[1 : 1 + T]``: the upper triangle of ``sum y y^T``, row-major, with ``T = d (d + 1) / 2``;
- ``[1 + T : 1 + T + d]``: ``sum target * y``.

The count ``n`` needs no slot of its own: the last feature is 1, so ``n`` is the last diagonal
entry of ``sum y y^T``. That entry is a sum of ones, exact in float64.

All kernels are ``cache=True`` (only the first process on a host compiles) and ``nogil=True``.
They avoid ``fastmath``, so their results stay within rounding of the NumPy reference ALS
(``apps.mf.numpy_als``). The public wrappers check dtypes and layouts: a float32 or
non-contiguous array would otherwise compile a second specialization, or read out of bounds.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

__all__ = ["StaleSums", "normal_equations", "packed_width", "solve_normal_equations", "solve_rows", "squared_error",
           "stale_sums_error", "warmup"]

_JIT = {"cache": True, "nogil": True}


def packed_width(d: int) -> int:
    """Length of a packed normal-equation row for ``d`` unknowns: tag + upper triangle + right-hand side."""
    return 1 + d * (d + 1) // 2 + d


@nb.njit(**_JIT)
def _cholesky_solve(A: np.ndarray, b: np.ndarray, x: np.ndarray) -> bool:
    """Solve ``A x = b`` for symmetric positive definite ``A``, of which only the upper triangle is read.

    The factor R (A = R^T R, R upper triangular) overwrites A's upper triangle, and b is
    overwritten by the intermediate solution. Returns False if A is not positive definite.
    """
    d = b.shape[0]
    for j in range(d):
        s = A[j, j]
        for p in range(j):
            s -= A[p, j] * A[p, j]
        if not s > 0.0:
            return False
        rjj = math.sqrt(s)
        A[j, j] = rjj
        for i in range(j + 1, d):
            s = A[j, i]
            for p in range(j):
                s -= A[p, j] * A[p, i]
            A[j, i] = s / rjj
    for i in range(d):  # R^T z = b
        s = b[i]
        for p in range(i):
            s -= A[p, i] * b[p]
        b[i] = s / A[i, i]
    for i in range(d - 1, -1, -1):  # R x = z
        s = b[i]
        for p in range(i + 1, d):
            s -= A[i, p] * x[p]
        x[i] = s / A[i, i]
    return True


@nb.njit(**_JIT)
def _packed_outer(X: np.ndarray) -> np.ndarray:
    """Per row x: the upper triangle of ``y y^T`` with ``y = [x[:rank], 1]``, packed row-major ``(n, T)``.

    Computed once per entity and then added per rating: the per-rating work becomes a
    contiguous, vectorizable sum of T numbers instead of T multiply-adds with strided reads.
    """
    n, d = X.shape
    k = d - 1
    out = np.empty((n, d * (d + 1) // 2))
    y = np.empty(d)
    for r in range(n):
        for a in range(k):
            y[a] = X[r, a]
        y[k] = 1.0
        q = 0
        for a in range(d):
            for c in range(a, d):
                out[r, q] = y[a] * y[c]
                q += 1
    return out


@nb.njit(**_JIT)
def _solve_rows(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, F: np.ndarray, l2: float,
                out: np.ndarray) -> int:
    d = F.shape[1]
    k = d - 1
    tri = d * (d + 1) // 2
    outer = _packed_outer(F)
    acc = np.empty(tri)
    A = np.empty((d, d))
    b = np.empty(d)
    bad = 0
    for r in range(indptr.shape[0] - 1):
        lo, hi = indptr[r], indptr[r + 1]
        if hi == lo:
            out[r, :] = 0.0
            continue
        acc[:] = 0.0
        b[:] = 0.0
        for p in range(lo, hi):
            c = cols[p]
            f = F[c]
            o = outer[c]
            for q in range(tri):
                acc[q] += o[q]
            t = vals[p] - f[k]
            for a in range(k):
                b[a] += t * f[a]
            b[k] += t
        q = 0
        for a in range(d):
            for c in range(a, d):
                A[a, c] = acc[q]
                q += 1
        n = A[k, k]
        for a in range(d):
            A[a, a] += l2 * n
        if not _cholesky_solve(A, b, out[r]):
            out[r, :] = 0.0
            bad += 1
    return bad


@nb.njit(**_JIT)
def _normal_equations(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, X: np.ndarray, tag: float,
                      out: np.ndarray) -> None:
    d = X.shape[1]
    k = d - 1
    tri = d * (d + 1) // 2
    out[:, :] = 0.0
    out[:, 0] = tag
    outer = _packed_outer(X)
    for r in range(indptr.shape[0] - 1):
        x = X[r]
        o = outer[r]
        bias = x[k]
        for p in range(indptr[r], indptr[r + 1]):
            row = out[cols[p]]
            for q in range(tri):
                row[1 + q] += o[q]
            t = vals[p] - bias
            for a in range(k):
                row[1 + tri + a] += t * x[a]
            row[1 + tri + k] += t


@nb.njit(**_JIT)
def _solve_normal_equations(ne: np.ndarray, tag: float, l2: float, out: np.ndarray) -> int:
    d = out.shape[1]
    tri = d * (d + 1) // 2
    A = np.empty((d, d))
    b = np.empty(d)
    wrong = 0
    for j in range(ne.shape[0]):
        row = ne[j]
        if row[0] != tag:
            out[j, :] = 0.0
            wrong += 1
            continue
        q = 1
        for a in range(d):
            for c in range(a, d):
                A[a, c] = row[q]
                q += 1
        for a in range(d):
            b[a] = row[1 + tri + a]
        n = A[d - 1, d - 1]
        if n == 0.0:
            out[j, :] = 0.0
            continue
        for a in range(d):
            A[a, a] += l2 * n
        if not _cholesky_solve(A, b, out[j]):
            out[j, :] = 0.0
            wrong += 1
    return wrong


@nb.njit(**_JIT)
def _squared_error(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, R: np.ndarray, C: np.ndarray) -> float:
    k = R.shape[1] - 1
    total = 0.0
    for r in range(indptr.shape[0] - 1):
        x = R[r]
        for p in range(indptr[r], indptr[r + 1]):
            c = C[cols[p]]
            pred = x[k] + c[k]
            for a in range(k):
                pred += x[a] * c[a]
            e = vals[p] - pred
            total += e * e
    return total


def _check_csr(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, num_cols: int) -> None:
    if indptr.dtype != np.int64 or cols.dtype != np.int64 or vals.dtype != np.float64:
        raise TypeError(f"CSR arrays must be int64, int64, float64; got {indptr.dtype}, {cols.dtype}, {vals.dtype}")
    if indptr.ndim != 1 or len(indptr) < 1 or cols.shape != vals.shape or indptr[-1] != len(cols):
        raise ValueError("inconsistent CSR arrays")
    if len(cols) and (cols.min() < 0 or cols.max() >= num_cols):
        raise ValueError(f"column index out of range [0, {num_cols})")


def _check_rows(name: str, a: np.ndarray, d: int | None = None) -> None:
    if a.dtype != np.float64 or a.ndim != 2 or not a.flags.c_contiguous or (d is not None and a.shape[1] != d):
        raise TypeError(f"{name} must be a C-contiguous float64 (n, {d or 'd'}) array, got {a.dtype} {a.shape}")


def solve_rows(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, F: np.ndarray, l2: float,
               out: np.ndarray | None = None) -> np.ndarray:
    """Solve every CSR row's entity given the fixed side ``F`` (see the module docstring)."""
    _check_csr(indptr, cols, vals, F.shape[0])
    _check_rows("F", F)
    if out is None:
        out = np.empty((len(indptr) - 1, F.shape[1]))
    _check_rows("out", out, F.shape[1])
    if _solve_rows(indptr, cols, vals, F, float(l2), out):
        raise FloatingPointError(f"a normal-equation matrix is not positive definite with l2 = {float(l2)!r}: "
                                 "l2 must be > 0, and large enough for the factors' scale (1e-6 is)")
    return out


def normal_equations(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, X: np.ndarray, num_cols: int,
                     tag: float) -> np.ndarray:
    """Packed normal-equation contributions ``(num_cols, packed_width(d))`` of the CSR ratings to their columns.

    Row ``r`` of the CSR is solved entity ``X[r]``. It adds ``y y^T`` and ``(v - X[r, rank]) y``
    with ``y = [X[r, :rank], 1]`` to each column it rated. Every row gets the tag, also the
    rows that receive nothing.
    """
    _check_csr(indptr, cols, vals, num_cols)
    _check_rows("X", X)
    if X.shape[0] != len(indptr) - 1:
        raise ValueError(f"X has {X.shape[0]} rows for {len(indptr) - 1} CSR rows")
    out = np.empty((num_cols, packed_width(X.shape[1])))
    _normal_equations(indptr, cols, vals, X, float(tag), out)
    return out


class StaleSums(RuntimeError):
    """Normal-equation rows that are not those of the expected iteration (after a server's loss,
    its shards' rows come back from a checkpoint: apps/mf.py repairs them)."""


def solve_normal_equations(ne: np.ndarray, d: int, tag: float, l2: float) -> np.ndarray:
    """Solve packed normal equations ``(m, packed_width(d))``: the rows ``(m, d)`` of their entities.

    A row whose tag is not ``tag`` means that the sums are not the ones of the expected
    iteration. That would be a broken consistency promise, so it raises instead of training on
    stale numbers. An entity with no rating (count 0) gets the zero row.
    """
    _check_rows("ne", ne, packed_width(d))
    out = np.empty((ne.shape[0], d))
    wrong = _solve_normal_equations(ne, float(tag), float(l2), out)
    if wrong and np.all(ne[:, 0] == tag):  # every row is this iteration's: the systems are singular
        raise np.linalg.LinAlgError(f"{wrong} of {ne.shape[0]} normal-equation systems are not positive definite "
                                    f"(an --l2 of {l2} is too small for them)")
    if wrong:
        raise StaleSums(stale_sums_error(ne, wrong, tag) + " or not positive definite")
    return out


def stale_sums_error(ne: np.ndarray, wrong: int, tag: float) -> str:
    """What a reader of packed sums ``ne`` says when ``wrong`` rows do not carry the expected ``tag``."""
    tags = np.unique(ne[:, 0])
    return (f"{wrong} of {ne.shape[0]} normal-equation rows are not those of iteration tag {tag} "
            f"(tags seen: {tags[:8].tolist()})")


def squared_error(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, R: np.ndarray, C: np.ndarray) -> float:
    """Sum of squared errors of the CSR ratings (rows: entities of ``R``, columns: of ``C``)."""
    _check_csr(indptr, cols, vals, C.shape[0])
    _check_rows("R", R)
    _check_rows("C", C, R.shape[1])
    if R.shape[0] != len(indptr) - 1:
        raise ValueError(f"R has {R.shape[0]} rows for {len(indptr) - 1} CSR rows")
    return float(_squared_error(indptr, cols, vals, R, C))


def warmup(rank: int = 2) -> None:
    """Compile (or load from the on-disk cache) every kernel with the argument types the app uses."""
    d = rank + 1
    indptr = np.array([0, 2, 3], np.int64)
    cols = np.array([0, 1, 1], np.int64)
    vals = np.array([1.0, -0.5, 0.25])
    F = np.ones((2, d)) * 0.1
    X = solve_rows(indptr, cols, vals, F, 0.1)
    ne = normal_equations(indptr, cols, vals, X, 2, 1.0)
    C = solve_normal_equations(ne, d, 1.0, 0.1)
    squared_error(indptr, cols, vals, X, C)
