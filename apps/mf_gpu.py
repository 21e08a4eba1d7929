"""MF's ALS half-steps on an NVIDIA GPU with CuPy (``litz launch apps/mf.py --device cuda``).

An executor's task (apps/mf.py) does four things; on the GPU each is whole-array work of
``apps.mf_arrays.ArrayALS`` on CuPy:

1. solve the PS side from the sums read from the parameter server (one batched solve);
2. the squared errors of its train and test ratings (gathers and one reduction each);
3. solve its own rows with the PS side fixed (two cuSPARSE products and one batched solve);
4. its rows' contributions to the PS side's sums (the same products on the transposed ratings).

Why CuPy rather than a Numba-CUDA kernel: every step is a library call that NVIDIA has tuned
(sparse × dense products, batched small solves); a kernel of our own would redo them.

What stays on the GPU: the executor's ratings, copied once at its first task there (again after
a move to another worker process), and the PS side's rows between steps 1 and 4. What crosses the
bus per task: the sums read (``(m, packed_width)``), the executor's rows (its state stays on the
host, where checkpoints read it) and the contributions pushed.

Without a GPU, ``LITZ_CUPY_STANDIN=numpy`` runs this module with NumPy and SciPy in CuPy's place
(``apps.gpu.cupy_standin``): the tests check it on every CI run against the Numba kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from apps import gpu
from apps.mf import to_csr
from apps.mf_arrays import ArrayALS
from apps.mf_kernels import StaleSums, packed_width, stale_sums_error

__all__ = ["DeviceSteps", "array_modules"]


@functools.cache
def array_modules() -> tuple[Any, Any]:
    """``(cupy, cupyx.scipy.sparse)``, or ``(numpy, scipy.sparse)`` where NumPy stands in for CuPy."""
    if gpu.cupy_standin():
        import scipy.sparse

        return np, scipy.sparse
    import cupy
    import cupyx.scipy.sparse

    return cupy, cupyx.scipy.sparse


def to_host(a: Any) -> np.ndarray:
    """A device array copied to the host (a NumPy array as it is)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


class DeviceSteps:
    """One executor's ratings on the GPU and the four steps of its task (see the module docstring).

    ``train`` and ``test`` are host CSR arrays ``(indptr, cols, vals)`` of the executor's rows over
    ``num_cols`` local PS-side columns."""

    def __init__(self, d: int, train: tuple[np.ndarray, np.ndarray, np.ndarray],
                 test: tuple[np.ndarray, np.ndarray, np.ndarray], num_cols: int) -> None:
        xp, sparse = array_modules()
        self.xp, self.d = xp, d
        self.als = ArrayALS(xp, sparse, d)
        n = len(train[0]) - 1
        self.train = self.als.ratings(*train, num_cols)
        self.test = self.als.ratings(*test, num_cols)
        # the train ratings by column: the contributions to the PS side are this CSR's row sums
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(train[0]))
        self.by_col = self.als.ratings(*to_csr(train[1], rows, train[2], num_cols), n)

    def solve_sums(self, ne: np.ndarray, tag: float, l2: float) -> Any:
        """The PS side's rows (on the device) from its packed sums ``(m, packed_width(d))`` read from the
        parameter server. Rows of another iteration's tag raise ``StaleSums``, as on the CPU."""
        d = self.d
        if ne.ndim != 2 or ne.shape[1] != packed_width(d):
            raise ValueError(f"normal-equation rows must be (m, {packed_width(d)}), got {ne.shape}")
        wrong = np.flatnonzero(ne[:, 0] != tag)
        if len(wrong):
            raise StaleSums(stale_sums_error(ne, len(wrong), tag))
        sums = self.xp.asarray(ne)
        T = self.als.tri
        return self.als.solve(sums[:, 1:1 + T], sums[:, 1 + T:], l2)

    def put(self, rows: np.ndarray) -> Any:
        """Host rows on the device."""
        return self.xp.asarray(rows)

    def host(self, rows: Any) -> np.ndarray:
        """Device rows on the host."""
        return to_host(rows)

    def squared_errors(self, rows: np.ndarray, ps_rows: Any) -> tuple[float, float]:
        """Sum of squared errors of the train and of the test ratings for our ``rows`` (host) and the PS side."""
        X = self.xp.asarray(rows)
        return (self.als.squared_error(self.train, X, ps_rows), self.als.squared_error(self.test, X, ps_rows))

    def solve_rows(self, ps_rows: Any, l2: float) -> np.ndarray:
        """Our rows given the PS side, on the host (they are the executor's checkpointed state)."""
        return to_host(self.als.solve_rows(self.train, ps_rows, l2))

    def normal_equations(self, rows: np.ndarray, tag: float) -> np.ndarray:
        """Our rows' packed contributions ``(num_cols, packed_width(d))`` to the PS side's sums, on the host
        (``mf_kernels.normal_equations``)."""
        xp = self.xp
        tri, rhs = self.als.sums(self.by_col, xp.asarray(rows))
        out = xp.empty((tri.shape[0], packed_width(self.d)))
        out[:, 0] = tag
        out[:, 1:1 + self.als.tri] = tri
        out[:, 1 + self.als.tri:] = rhs
        return to_host(out)
