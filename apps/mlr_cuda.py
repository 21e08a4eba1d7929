"""MLR's mini-batch SGD on an NVIDIA GPU (Numba-CUDA), for ``litz launch apps/mlr.py --device cuda``.

The same math as :func:`apps.mlr_kernels.sgd_steps`: consecutive batches of the given rows, each
step ``W[:-1] *= 1 - lr * l2`` then ``W -= lr * mean gradient`` of the batch's cross-entropy, the
loss and accuracy of each row taken with the weights before its step. Results agree with the CPU
kernel up to float32 rounding (sums run in another order).

**Layout.** SGD is sequential from batch to batch, so one task is one launch of one thread block
that walks the batches; the executors of a worker process launch their own blocks. Per batch,
in three phases separated by barriers:

1. logits: each thread computes (row, class) dot products, ``X`` rows read once per class;
2. softmax: one thread per row, as ``apps.mlr_kernels._softmax_row`` does (max-shifted, the
   probabilities below e^-40 flushed to 0), leaving ``lr / count * (p - onehot)`` in ``G``;
3. the step: each thread owns weight rows (features); consecutive threads read consecutive
   features of a data row, which coalesces.

The executor's rows (``X``, ``y``) are copied to the GPU once, when the executor first runs a
task there; each task moves only the weights (31 KB for Fashion-MNIST) and its row indices.

**Status.** Checked in Numba's CUDA simulator against the CPU kernel (tests/test_mlr_cuda.py); not
yet run on GPU hardware, its speed not measured. On Fashion-MNIST a task's work is small (375 rows
with 8 executors and 20 clocks per epoch), so one block per task uses one of the GPU's
multiprocessors: what it gains over the CPU kernel is for a GPU session to measure.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from apps.gpu import cuda_module, simulated
from apps.mlr_kernels import _LOGIT_FLOOR, check_sgd_inputs

cuda = cuda_module()  # the apps import this module only where a GPU is wanted

#: Threads of the one block per task. A multiple of 32.
THREADS = 256
#: Classes at most (a thread keeps one accumulator per class).
MAX_CLASSES = 32

if cuda is not None:
    @cuda.jit(device=True)
    def _softmax_step(G: Any, i: int, K: int, label: int, step: float) -> tuple[float, int]:  # pragma: no cover
        """Row ``i`` of ``G``: logits in, ``step * (p - onehot(label))`` out; returns (loss, correct)."""
        m = G[i, 0]
        am = 0
        for k in range(1, K):
            if G[i, k] > m:
                m = G[i, k]
                am = k
        zl = G[i, label] - m
        se = numba.float32(0.0)
        for k in range(K):
            t = G[i, k] - m
            e = math.exp(t) if t > _LOGIT_FLOOR else numba.float32(0.0)
            G[i, k] = e
            se += e
        inv = numba.float32(1.0) / se
        for k in range(K):
            G[i, k] = G[i, k] * inv * step
        G[i, label] -= step
        return math.log(se) - zl, 1 if am == label else 0

    @cuda.jit(cache=not simulated())
    def _sgd_kernel(W: Any, X: Any, y: Any, rows: Any, batch_size: int, lr: float, l2: float, G: Any,
                    stats: Any) -> None:  # pragma: no cover - runs on the GPU (or the simulator)
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        d = X.shape[1]
        K = W.shape[1]
        n = rows.shape[0]
        decay = numba.float32(1.0 - lr * l2)
        loss = 0.0
        correct = 0
        acc = cuda.local.array(MAX_CLASSES, numba.float32)
        for b0 in range(0, n, batch_size):
            count = min(batch_size, n - b0)
            for pair in range(t, count * K, nt):  # 1. logits
                i = pair // K
                k = pair - i * K
                r = rows[b0 + i]
                z = W[d, k]
                for j in range(d):
                    z += X[r, j] * W[j, k]
                G[i, k] = z
            cuda.syncthreads()
            step = numba.float32(lr) / numba.float32(count)
            for i in range(t, count, nt):  # 2. softmax
                li, ok = _softmax_step(G, i, K, y[rows[b0 + i]], step)
                loss += li
                correct += ok
            cuda.syncthreads()
            for j in range(t, d + 1, nt):  # 3. the step, thread t owning features t, t + nt, ...
                for k in range(K):
                    acc[k] = 0.0
                for i in range(count):
                    x = X[rows[b0 + i], j] if j < d else numba.float32(1.0)
                    for k in range(K):
                        acc[k] += G[i, k] * x
                for k in range(K):
                    w = W[j, k] * decay if j < d else W[j, k]
                    W[j, k] = w - acc[k]
            cuda.syncthreads()
        stats[t, 0] = loss
        stats[t, 1] = correct


class DeviceRows:
    """An executor's training rows on the GPU, copied once (``X`` float32 (n, d), ``y`` int64 (n,)).

    The kernel reads without bounds checks, so the labels' range is taken here, once, and every
    call checks its row indices and the classes against it on the host."""

    def __init__(self, X: np.ndarray, y: np.ndarray) -> None:
        if cuda is None:
            raise RuntimeError("this numba has no CUDA support")
        if not (X.ndim == 2 and y.shape == (X.shape[0],)):
            raise ValueError(f"X must be (n, d) and y (n,), got {X.shape} and {y.shape}")
        self.n, self.d = X.shape
        self.labels = (int(y.min()), int(y.max())) if len(y) else (0, -1)
        self.X = cuda.to_device(np.ascontiguousarray(X, dtype=np.float32))
        self.y = cuda.to_device(np.ascontiguousarray(y, dtype=np.int64))


def sgd_steps(W: np.ndarray, data: DeviceRows, rows: np.ndarray, batch_size: int, lr: float, l2: float,
              threads: int = THREADS) -> tuple[float, int]:
    """:func:`apps.mlr_kernels.sgd_steps` on the GPU: ``W`` (host, (d+1, K) float32) is updated in
    place over ``data``'s ``rows``; returns ``(loss_sum, correct)``."""
    if cuda is None:
        raise RuntimeError("this numba has no CUDA support")
    check_sgd_inputs(W, data.d, data.n, rows, batch_size)
    K = W.shape[1]
    if K > MAX_CLASSES:
        raise ValueError(f"the GPU kernel handles at most {MAX_CLASSES} classes, got {K}")
    if not (threads >= 1 and threads % 32 == 0 or simulated()):
        raise ValueError(f"threads must be a multiple of 32, got {threads}")
    if rows.shape[0] == 0:
        return 0.0, 0
    if rows.min() < 0 or rows.max() >= data.n:
        raise IndexError("row index out of range")
    if data.labels[0] < 0 or data.labels[1] >= K:
        raise ValueError("label out of range [0, K)")
    d_W = cuda.to_device(W)
    stats = cuda.device_array((threads, 2), np.float64)
    G = cuda.device_array((int(batch_size), K), np.float32)
    _sgd_kernel[1, threads](d_W, data.X, data.y, cuda.to_device(np.ascontiguousarray(rows)), int(batch_size),
                            float(lr), float(l2), G, stats)
    d_W.copy_to_host(W)
    totals = stats.copy_to_host().sum(axis=0)
    return float(totals[0]), int(round(totals[1]))
