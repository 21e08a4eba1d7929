"""ALS half-steps written once for any NumPy-like array module: NumPy with SciPy, or CuPy on a GPU.

The math is apps/mf_kernels.py's (read its docstring first): one ridge regression per entity,
``(sum y y^T + l2 n I) x = sum (v - F[c, rank]) y``. Here it is whole-array work instead of
loops, which is what a GPU wants:

* the upper triangles of ``y y^T`` are formed once per entity of the fixed side (``(m, T)``);
* one sparse × dense product with the rating pattern sums them per solved entity, and a second
  one, with the targets as the pattern's values, sums ``target * y`` (cuSPARSE SpMM on a GPU);
* one batched solve does every entity's ``d × d`` system (cuSOLVER/cuBLAS batched on a GPU).

The same class runs the single-process reference (``apps.mf.NumpyALS``, with NumPy and SciPy) and
the app's GPU path (``apps.mf_gpu``, with CuPy). It shares no code with the Numba kernels, so the
tests check each against the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ArrayALS", "SparseRatings"]


@dataclass(frozen=True)
class SparseRatings:
    """One CSR of ratings on an array module: the pattern matrix (ones), its columns and values, and
    each rating's row, all on that module's device."""

    pattern: Any  # (rows, num_cols) sparse matrix of ones
    cols: Any  # (nnz,) int
    vals: Any  # (nnz,) float64
    row_of: Any  # (nnz,) int: the row of each rating

    @property
    def num_rows(self) -> int:
        return int(self.pattern.shape[0])


class ArrayALS:
    """The half-steps for ``d = rank + 1`` unknowns with array module ``xp`` and its ``sparse`` module
    (``numpy`` and ``scipy.sparse``, or ``cupy`` and ``cupyx.scipy.sparse``)."""

    def __init__(self, xp: Any, sparse: Any, d: int) -> None:
        self.xp, self.sparse, self.d = xp, sparse, d
        iu = np.triu_indices(d)
        self.tri = len(iu[0])
        packed = np.empty((d, d), np.int64)
        packed[iu] = np.arange(self.tri)
        packed.T[iu] = packed[iu]
        self._iu = (xp.asarray(iu[0]), xp.asarray(iu[1]))
        self._full = xp.asarray(packed.reshape(-1))  # (a, b) -> index of (min, max) in the packed triangle

    def ratings(self, indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, num_cols: int) -> SparseRatings:
        """Host CSR arrays ``(indptr, cols, vals)`` moved to the module's device, once per data set.

        Columns are sorted within each row first: cuSPARSE's products expect it, and the sums do
        not depend on the order of a row's ratings beyond rounding."""
        xp = self.xp
        n = len(indptr) - 1
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
        order = np.lexsort((cols, rows))
        cols, vals = cols[order], vals[order]
        d_cols = xp.asarray(cols)
        pattern = self.sparse.csr_matrix((xp.ones(len(cols)), d_cols, xp.asarray(indptr)), shape=(n, num_cols))
        return SparseRatings(pattern, d_cols, xp.asarray(vals, dtype=xp.float64), xp.asarray(rows))

    def features(self, F: Any) -> tuple[Any, Any]:
        """``Y = [F[:, :rank], 1]`` and the packed upper triangles of ``y y^T``, one row per entity."""
        Y = F.copy()
        Y[:, self.d - 1] = 1.0
        return Y, Y[:, self._iu[0]] * Y[:, self._iu[1]]

    def sums(self, R: SparseRatings, F: Any) -> tuple[Any, Any]:
        """Per row of ``R``, over its ratings ``(c, v)``: ``sum y_c y_c^T`` packed ``(rows, T)`` and
        ``sum (v - F[c, rank]) y_c`` ``(rows, d)``."""
        Y, outer = self.features(F)
        if len(R.cols) == 0:  # no product on empty matrices: cuSPARSE refuses some of them
            return self.xp.zeros((R.num_rows, self.tri)), self.xp.zeros((R.num_rows, self.d))
        tri = R.pattern @ outer
        targets = self.sparse.csr_matrix((R.vals - F[R.cols, self.d - 1], R.pattern.indices, R.pattern.indptr),
                                         shape=R.pattern.shape)
        return tri, targets @ Y

    def solve(self, tri: Any, rhs: Any, l2: float) -> Any:
        """Every entity's row from its sums (``tri`` packed, ``rhs``); the zero row for a count of 0.

        The count is the last diagonal entry of ``sum y y^T`` (the last feature is 1). A system
        whose solution is not finite raises ``FloatingPointError`` (only a non-positive ``l2`` can
        make one singular)."""
        xp, d = self.xp, self.d
        counts = tri[:, self.tri - 1]
        rated = xp.flatnonzero(counts)
        out = xp.zeros((tri.shape[0], d))
        if len(rated) == 0:
            return out
        A = tri[rated][:, self._full]  # (n, d * d): one gather unpacks both triangles
        A[:, :: d + 1] += (l2 * counts[rated])[:, None]
        try:  # NumPy raises on a singular matrix; CuPy returns what the factorization gave
            x = xp.linalg.solve(A.reshape(-1, d, d), rhs[rated][..., None])[..., 0]
            finite = bool(xp.isfinite(x).all())
        except np.linalg.LinAlgError:
            finite = False
        if not finite:
            raise FloatingPointError("a normal-equation matrix is singular (l2 must be > 0)")
        out[rated] = x
        return out

    def solve_rows(self, R: SparseRatings, F: Any, l2: float) -> Any:
        """Every row entity of ``R`` given the fixed side ``F`` (``mf_kernels.solve_rows``)."""
        return self.solve(*self.sums(R, F), l2)

    def squared_error(self, R: SparseRatings, rows: Any, F: Any) -> float:
        """Sum of squared errors of ``R``'s ratings, rows' entities ``rows``, columns' ``F``."""
        k = self.d - 1
        a, b = rows[R.row_of], F[R.cols]
        err = R.vals - (a[:, k] + b[:, k] + (a[:, :k] * b[:, :k]).sum(axis=1))
        return float((err * err).sum())
