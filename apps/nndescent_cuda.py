"""NN-Descent's join distances on an NVIDIA GPU (Numba-CUDA), for ``--device cuda``.

A round's work on high-dimensional data is the local join's distances: on Fashion-MNIST (784-d)
each costs 46 ns with both rows in cache and 560-650 ns without (README, Performance), and an
executor computes millions per round. Everything else in a round (sampling the candidates,
merging offers into lists, packing the update) is branchy list work that stays on the CPU.

So the GPU computes the distance of every pair the join will look at, in one kernel launch per
run of owned points (as many as fit 64 MB of distances, :func:`apps.nndescent_kernels.nnd_round`),
and the CPU join (:func:`apps.nndescent_kernels.local_join`) then makes exactly the offers it
would have made, in the same order, reading the distances instead of computing them. The graph
is the same as on the CPU up to the rounding of the distances (the GPU sums in another order).

**The kernel.** One block per owned point ``a``; its threads split the dimensions of each pair
``(new[a, x], new[a, y] or old[a, y - mc])``, so a warp reads 32 consecutive floats of each row
(coalesced), and a tree in shared memory sums the partial sums. The pairs of ``a`` share at most
``2 mc`` distinct rows, which stay in the SM's cache. The default of one warp per block makes
each ``syncthreads`` a warp barrier; many blocks per SM hide the memory latency. The output is
dense, ``(m, mc, 2 mc)`` float32 (entries of invalid pairs are never read).

**Data on the device.** Every executor holds the whole data set (:class:`apps.nndescent.NNDInput`);
the executors of one worker process share one device copy, uploaded at the first task and kept
until a task brings another host array (a new job's, or another data set).

**Status.** The tests run the kernel in Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, real
thread-block semantics in Python) and require the same lists as the CPU join; on an H100 the lists
of a round agree with the CPU's up to near-ties, and one executor's round on a quarter of
Fashion-MNIST took 0.12-0.14 s against 0.22-0.26 s on the CPU (``bench/bench_gpu.py``; whole
jobs in the README). Without a GPU ``--device cuda`` is refused before the job starts, and
``--device auto`` uses the CPU.
"""

from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np

from apps.gpu import cuda_module, simulated

cuda = cuda_module()  # the apps import this module only where a GPU is wanted

#: Threads per block (one block per owned point): one warp. A power of two.
THREADS = 32
_MAX_THREADS = 1024


if cuda is not None:
    @cuda.jit(cache=not simulated())
    def _join_distances_kernel(data: Any, new: Any, old: Any, out: Any) -> None:  # pragma: no cover - GPU
        a = cuda.blockIdx.x
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        part = cuda.shared.array(_MAX_THREADS, numba.float32)
        mc = new.shape[1]
        dim = data.shape[1]
        # every test below reads only a's candidates, the same for all threads of the block, so each
        # syncthreads is reached by all of them or by none
        for x in range(mc):
            p = new[a, x]
            if p < 0:
                break
            for y in range(x + 1, 2 * mc):
                q = new[a, y] if y < mc else old[a, y - mc]
                if q < 0:
                    if y < mc:
                        continue
                    break
                if q == p:
                    continue
                s = numba.float32(0.0)
                for j in range(t, dim, nt):
                    diff = data[p, j] - data[q, j]
                    s += diff * diff
                part[t] = s
                cuda.syncthreads()
                half = nt // 2
                while half > 0:
                    if t < half:
                        part[t] += part[t + half]
                    cuda.syncthreads()
                    half //= 2
                if t == 0:
                    out[a, x, y] = part[0]
                cuda.syncthreads()  # part is reused by the next pair


class _DeviceData:
    """This process's device copies of the data, for the host arrays they were made from (the
    ``KEEP`` used last): the executors of one process usually share one array, but one that
    arrived by a migration brings its own copy, and executors taking turns re-uploaded theirs."""

    KEEP = 4

    def __init__(self) -> None:
        # (the array whose memory a copy was made from, kept alive; its view's layout; the copy)
        self.copies: list[tuple[np.ndarray, tuple[Any, ...], Any]] = []
        self.lock = threading.Lock()

    def get(self, data: np.ndarray) -> Any:
        """The device copy of ``data``, uploaded when none was made from that memory: a new job, or
        another data set. Not by the view's identity: the join gets a fresh read-only view of the
        executor's points at every task (``kernel_util.read_only``), and every task uploaded the
        whole data set again (219 MB on Fashion-MNIST)."""
        owner = data.base if isinstance(data.base, np.ndarray) else data
        layout = (data.__array_interface__["data"][0], data.shape, data.strides, data.dtype.str)
        with self.lock:
            for i, (host, seen, device) in enumerate(self.copies):
                if host is owner and seen == layout:
                    self.copies.append(self.copies.pop(i))  # (used last)
                    return device
            device = cuda.to_device(np.ascontiguousarray(data, dtype=np.float32))
            self.copies = [*self.copies[-(self.KEEP - 1):], (owner, layout, device)]
            return device


_DATA = _DeviceData()


def join_distances(data: np.ndarray, new: np.ndarray, old: np.ndarray, threads: int = THREADS) -> np.ndarray:
    """The squared distances of every join pair: ``(m, mc, 2 mc)`` float32, ``[a, x, y]`` for the pair
    ``new[a, x]``, ``new[a, y]`` (``y < mc``) or ``old[a, y - mc]``; entries of pairs the join skips
    (padding, ``y <= x``, a point with itself) are unspecified. ``new`` and ``old``: ``(m, mc)``
    int64 candidate ids, -1 padded (:func:`apps.nndescent_kernels.sample_candidates`)."""
    if cuda is None:
        raise RuntimeError("this numba has no CUDA support")
    if not (threads >= 1 and threads & (threads - 1) == 0 and threads <= _MAX_THREADS):
        raise ValueError(f"threads must be a power of two up to {_MAX_THREADS}, got {threads}")
    m, mc = new.shape
    if old.shape != (m, mc):
        raise ValueError(f"new and old candidates differ in shape: {new.shape} and {old.shape}")
    if m == 0 or mc == 0:
        return np.zeros((m, mc, 2 * mc), np.float32)
    d_data = _DATA.get(data)
    d_out = cuda.device_array((m, mc, 2 * mc), np.float32)
    _join_distances_kernel[m, threads](d_data, cuda.to_device(np.ascontiguousarray(new)),
                                       cuda.to_device(np.ascontiguousarray(old)), d_out)
    return d_out.copy_to_host()
