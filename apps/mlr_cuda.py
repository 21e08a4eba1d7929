"""MLR's mini-batch SGD on an NVIDIA GPU (Numba-CUDA), for ``litz launch apps/mlr.py --device cuda``.

The same math as :func:`apps.mlr_kernels.sgd_steps`: consecutive batches of the given rows, each
step ``W[:-1] *= 1 - lr * l2`` then ``W -= lr * mean gradient`` of the batch's cross-entropy, the
loss and accuracy of each row taken with the weights before its step. Results agree with the CPU
kernel up to float32 rounding (sums run in another order).

**Layout.** SGD is sequential from batch to batch, so one task is one launch of one thread block
that walks the batches; the executors of a worker process launch their own blocks. The weights
live in the block's shared memory for the whole launch (31 KB for Fashion-MNIST; the host refuses
weights that do not fit in 48 KB), so only the data rows are read from global memory. Per batch,
in phases separated by barriers:

1. logits: ``C = threads // batch`` threads per row, each summing every C-th feature of its row
   for all classes (consecutive threads read consecutive features, which coalesces); then one
   thread per (row, class) adds the C partial sums;
2. softmax: one thread per row, as ``apps.mlr_kernels._softmax_row`` does (max-shifted, the
   probabilities below e^-40 flushed to 0), leaving ``lr / count * (p - onehot)`` in shared memory;
3. the step: each thread owns weight rows (features); consecutive threads read consecutive
   features of a data row, which coalesces.

The executor's rows (``X``, ``y``) are copied to the GPU once, when the executor first runs a
task there; each task moves only its row indices and the weights up, in one copy, and the
weights and per-thread loss and count back, in one (see :class:`DeviceRows`).

**Measured** on an H100 (``bench/bench_gpu.py``, the README's performance section): one
Fashion-MNIST epoch (1,875 batches of 32) takes 76-77 ms against the CPU kernel's 63-70 ms in
the same runs (the first version of this kernel: 298 ms). The block runs on one of the GPU's 132
multiprocessors and is bound by the latency of its reads, so what counted was: the classes as a
compile-time constant, which puts a thread's accumulators in registers and reads each data value
once for all classes (298 -> 140 ms at 256 threads); four reads in flight at a time (-> 91 ms);
384 threads, as many as the partial sums leave shared memory for (-> 76 ms). Tried and slower:
eight reads at a time (97 ms), a loop over a run-time number of reads (215 ms), one thread per
(row, class) with the weights in global memory (364 ms). A task of 375 rows (8 executors, 20
clocks per epoch) takes 0.88 ms, of which about 0.3 ms is the host's copies and launch, so whole
jobs run at about 0.6 times the CPU's speed: on this model the GPU is not worth it;
``--device cuda`` is for models whose batches give a block more to do.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, NamedTuple

import numba
import numpy as np

from apps.gpu import cuda_module, simulated
from apps.mlr_kernels import _LOGIT_FLOOR, SHARED_BYTES, check_sgd_inputs, diverged, gpu_batch_too_big, shared_floats

cuda = cuda_module()  # the apps import this module only where a GPU is wanted

#: Threads of the one block per task (a multiple of 32); fewer when shared memory asks for it.
THREADS = 384
#: Classes at most (a thread keeps one accumulator per class, in registers).
MAX_CLASSES = 32


if cuda is not None:
    @cuda.jit(device=True)
    def _softmax_step(G: Any, o: int, K: int, label: int, step: float) -> tuple[float, int]:  # pragma: no cover
        """The row of ``K`` logits at ``G[o:]``: logits in, ``step * (p - onehot(label))`` out;
        returns (loss, correct)."""
        m = G[o]
        am = 0
        for k in range(1, K):
            if G[o + k] > m:
                m = G[o + k]
                am = k
        zl = G[o + label] - m
        se = numba.float32(0.0)
        for k in range(K):
            t = G[o + k] - m
            e = math.exp(t) if t > _LOGIT_FLOOR else numba.float32(0.0)
            G[o + k] = e
            se += e
        inv = numba.float32(1.0) / se
        for k in range(K):
            G[o + k] = G[o + k] * inv * step
        G[o + label] -= step
        return math.log(se) - zl, 1 if am == label else 0

def _make_kernel(K: int) -> Any:
    """The SGD kernel for ``K`` classes. ``K`` is a compile-time constant of it, so that a thread's
    ``K`` accumulators are registers and their loops unrolled; with ``K`` known only at run time
    they were an array in local memory, read and written at every multiply-add. A thread reads four
    data values at a time, so that their latencies from memory overlap."""

    @cuda.jit(cache=not simulated())
    def sgd_kernel(W: Any, X: Any, y: Any, rows: Any, batch_size: int, lr: float, l2: float,
                   stats: Any) -> None:  # pragma: no cover - runs on the GPU (or the simulator)
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        d = X.shape[1]
        n = rows.shape[0]
        B = batch_size
        C = max(1, nt // B)  # threads per row in the logits (chunks of its features)
        R = nt // C  # rows the block's threads cover at once
        sm = cuda.shared.array(0, numba.float32)
        G = sm[:B * K]
        Ws = sm[B * K:B * K + (d + 1) * K]
        P = sm[B * K + (d + 1) * K:]  # partial logits, (row, chunk, class), when C > 1
        for q in range(t, (d + 1) * K, nt):
            Ws[q] = W[q]
        cuda.syncthreads()
        decay = numba.float32(1.0 - lr * l2)
        loss = 0.0
        correct = 0
        acc = cuda.local.array(K, numba.float32)
        c = t % C
        for b0 in range(0, n, B):
            count = min(B, n - b0)
            for i in range(t // C, count, R):  # 1. logits: thread (row i, chunk c) sums features c, c + C, ...
                r = rows[b0 + i]
                for k in range(K):
                    acc[k] = Ws[d * K + k] if c == 0 else numba.float32(0.0)
                j = c  # consecutive threads read consecutive features: coalesced
                while j + 3 * C < d:  # four features at a time, their reads in flight together
                    x0, x1, x2, x3 = X[r, j], X[r, j + C], X[r, j + 2 * C], X[r, j + 3 * C]
                    for k in range(K):  # the same sums, in the same order, as one at a time
                        acc[k] = (acc[k] + x0 * Ws[j * K + k] + x1 * Ws[(j + C) * K + k]
                                  + x2 * Ws[(j + 2 * C) * K + k] + x3 * Ws[(j + 3 * C) * K + k])
                    j += 4 * C
                while j < d:
                    x = X[r, j]
                    for k in range(K):
                        acc[k] += x * Ws[j * K + k]
                    j += C
                for k in range(K):
                    if C == 1:
                        G[i * K + k] = acc[k]
                    else:
                        P[(i * C + c) * K + k] = acc[k]
            cuda.syncthreads()
            if C > 1:  # the same for every thread of the block: the barrier inside is safe
                for pair in range(t, count * K, nt):
                    i = pair // K
                    k = pair - i * K
                    z = numba.float32(0.0)
                    for cc in range(C):
                        z += P[(i * C + cc) * K + k]
                    G[pair] = z
                cuda.syncthreads()
            step = numba.float32(lr) / numba.float32(count)
            for i in range(t, count, nt):  # 2. softmax
                li, ok = _softmax_step(G, i * K, K, y[rows[b0 + i]], step)
                loss += li
                correct += ok
            cuda.syncthreads()
            for j in range(t, d + 1, nt):  # 3. the step, thread t owning features t, t + nt, ...
                for k in range(K):
                    acc[k] = 0.0
                if j == d:  # the bias: x = 1
                    for i in range(count):
                        for k in range(K):
                            acc[k] += G[i * K + k]
                i = 0
                while j < d and i + 3 < count:  # four rows at a time, their reads in flight together
                    x0, x1, x2, x3 = (X[rows[b0 + i], j], X[rows[b0 + i + 1], j], X[rows[b0 + i + 2], j],
                                      X[rows[b0 + i + 3], j])
                    for k in range(K):
                        acc[k] = (acc[k] + G[i * K + k] * x0 + G[(i + 1) * K + k] * x1
                                  + G[(i + 2) * K + k] * x2 + G[(i + 3) * K + k] * x3)
                    i += 4
                while j < d and i < count:
                    x = X[rows[b0 + i], j]
                    for k in range(K):
                        acc[k] += G[i * K + k] * x
                    i += 1
                for k in range(K):
                    w = Ws[j * K + k] * decay if j < d else Ws[j * K + k]
                    Ws[j * K + k] = w - acc[k]
            cuda.syncthreads()
        for q in range(t, (d + 1) * K, nt):
            W[q] = Ws[q]
        stats[t, 0] = loss
        stats[t, 1] = correct

    return sgd_kernel


#: The kernel for ``K`` classes, made once per process (and cached on disk by Numba).
_kernel = functools.cache(_make_kernel)


class DeviceRows:
    """An executor's training rows on the GPU, copied once (``X`` float32 (n, d), ``y`` int64 (n,)).

    The kernel reads without bounds checks, so the labels' range is taken here, once, and every
    call checks its row indices and the classes against it on the host.

    A call moves its row indices and weights to the GPU in one copy, and the weights and the
    per-thread loss and count back in one: the three live in one device buffer, staged through one
    pinned host buffer, both kept here with their views for the next call of the same sizes. On an
    H100 each copy, allocation or view of a device array cost 30-130 us of host time, more than a
    small task's kernel; a lock keeps two threads from sharing the buffers at once."""

    def __init__(self, X: np.ndarray, y: np.ndarray) -> None:
        if cuda is None:
            raise RuntimeError("this numba has no CUDA support")
        if not (X.ndim == 2 and y.shape == (X.shape[0],)):
            raise ValueError(f"X must be (n, d) and y (n,), got {X.shape} and {y.shape}")
        self.n, self.d = X.shape
        self.labels = (int(y.min()), int(y.max())) if len(y) else (0, -1)
        self.X = cuda.to_device(np.ascontiguousarray(X, dtype=np.float32))
        self.y = cuda.to_device(np.ascontiguousarray(y, dtype=np.int64))
        self.lock = threading.Lock()
        self._capacity = 0
        self._device: Any = None
        self._host: Any = None
        self._io: tuple[tuple[int, int, int], _CallIO] | None = None

    def io(self, weights: int, rows: int, threads: int) -> _CallIO:
        """The buffers of a call with ``weights`` float32 words, ``rows`` indices and ``threads``
        (hold :attr:`lock` while using them)."""
        key = (weights, rows, threads)
        if self._io is None or self._io[0] != key:
            layout = _CallIO.layout(*key)
            if layout[-1] > self._capacity:
                self._capacity = layout[-1]
                self._device = cuda.device_array(self._capacity, np.uint8)
                self._host = cuda.pinned_array(self._capacity, np.uint8)
            self._io = (key, _CallIO(self._device, self._host, *key))
        return self._io[1]


class _Pair(NamedTuple):
    """The same bytes' view on the GPU and in the pinned host buffer."""

    device: Any
    host: np.ndarray


class _CallIO:
    """Typed views of one call's part of :class:`DeviceRows`' buffers, on the device and on the
    host: ``[rows int64 | weights float32 | stats float64 (threads, 2)]``, 8-byte aligned, so that
    the first two go up in one copy and the last two come back in one."""

    def __init__(self, device: Any, host: np.ndarray, weights: int, rows: int, threads: int) -> None:
        w0, s0, end = self.layout(weights, rows, threads)

        def pair(start: int, stop: int, dtype: type | None = None) -> _Pair:
            if dtype is None:
                return _Pair(device[start:stop], host[start:stop])
            return _Pair(device[start:stop].view(dtype), host[start:stop].view(dtype))

        self.up = pair(0, w0 + 4 * weights)
        self.down = pair(w0, end)
        self.rows = pair(0, w0, np.int64)
        self.W = pair(w0, w0 + 4 * weights, np.float32)
        stats = pair(s0, end, np.float64)
        self.stats = _Pair(stats.device.reshape((threads, 2)), stats.host.reshape((threads, 2)))

    @staticmethod
    def layout(weights: int, rows: int, threads: int) -> tuple[int, int, int]:
        """Byte offsets of the weights and the stats, and the end."""
        w0 = 8 * rows
        s0 = w0 + (4 * weights + 7) // 8 * 8
        return w0, s0, s0 + 16 * threads


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
    threads = int(threads)
    while threads > 32 and shared_floats(data.d, K, int(batch_size), threads) * 4 > SHARED_BYTES:
        threads = max(32, threads // 2 // 32 * 32)  # fewer threads need fewer partial sums
    need = shared_floats(data.d, K, int(batch_size), threads) * 4
    if need > SHARED_BYTES:
        raise ValueError(gpu_batch_too_big(data.d, K, int(batch_size)))  # (make_app refuses it first)
    with data.lock:
        io = data.io(W.size, rows.shape[0], threads)
        io.rows.host[:] = rows
        io.W.host[:] = W.reshape(-1)
        io.up.device.copy_to_device(io.up.host)
        _kernel(K)[1, threads, 0, need](io.W.device, data.X, data.y, io.rows.device, int(batch_size), float(lr),
                                     float(l2), io.stats.device)
        io.down.device.copy_to_host(io.down.host)
        totals = io.stats.host.sum(axis=0)
        if not (np.isfinite(totals[0]) and np.isfinite(io.W.host).all()):  # (as the CPU's steps: W unchanged)
            raise diverged(lr, l2)
        W.reshape(-1)[:] = io.W.host
    return float(totals[0]), int(round(totals[1]))
