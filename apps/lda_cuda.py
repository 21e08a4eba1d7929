"""LDA's Gibbs sweep on an NVIDIA GPU (Numba-CUDA), for ``litz launch apps/lda.py --device cuda``.

A task resamples the executor's tokens of one vocabulary block (apps/lda.py). On the CPU they run one
after another (apps/lda_kernels.py). Here **one thread resamples one token, all of the block's tokens
at once**. Each thread:

1. takes its token out of the counts with atomic subtractions (its document's, its word's and the
   topic total);
2. evaluates the full conditional ``(n_dk + α)(n_wk + β)/(n_k + Vβ)`` over all K topics from the
   counts as they are at that moment, and draws from it;
3. puts the token back under the drawn topic with atomic additions.

This is the asynchronous parallel Gibbs sampler of GPU LDA (Yan et al. 2009, "Parallel inference
for latent Dirichlet allocation on graphics processing units"; CuLDA). The counts are exact
integers at every moment: each atomic change is one token's, so they never go negative, and at
the end they are exactly the histogram of the new topics. What a thread may miss is the moves of
tokens resampled at the same time: the same kind of staleness the executors already accept for
``n_k`` between blocks. To bound it, a sweep runs in ``WAVES`` waves (token i in wave i mod
WAVES, so each wave holds a share of every word's tokens), each seeing the counts the waves before
it left: one cooperative launch whose threads wait for the whole grid between waves, or, where a
GPU cannot run those, a launch per wave. The tests check exact counts after a sweep and the
conditional each draw comes from; ``bench/bench_gpu.py`` measures the log-likelihood reached against
the CPU's sequential sampler.

The sampler is the dense O(K) one (``--sampler`` chooses among the CPU's samplers only): a GPU thread
gains nothing from SparseLDA's buckets, whose point is to skip work that a warp runs anyway.

**What lives where.** The executor's tokens (word within the block, document) are copied to the GPU
once, with their topics and the documents' topic counts, dense ``(D, K)`` int32. The assignments stay
the executor's state on the host (checkpoints read them), so each task copies its block's topics
back. The app's packed document lists on the host are rebuilt from the topics only when something
reads them (a report, a checkpoint, a move), not after every task. Each task moves its block's
word-topic rows and the topic totals each way.

**Measured** on an H100 (``bench/bench_gpu.py --only lda``, the README's performance section): one
sweep over 1M synthetic tokens takes 3.4-4.5 ms with the copies, against 102-161 ms for the CPU's
sparse sampler on one thread (30-35x). Whole jobs (2 workers, 2 executors) sample 1.21-1.22x the
CPU's tokens per second on fortunes, whose tasks hold about 44,000 tokens, and 2.14-2.24x on
wordnet. They ran at 0.69-0.92x while a sweep was 16 launches (about 70 us of the host's time each)
and the host rebuilt its document lists after every task (about 45 ms for 1M tokens, 13 times the
sweep). After 60 sweeps of a 16,000-token corpus
the log-likelihood per token is about 0.6% below the sequential sampler's with 16 waves, 0.2% with
64, 3% with 4, and about 72% with a single wave, which is why the waves exist. On an H200 (session 33,
``bench/bench_gpu.py --lda-waves 16,32,64,128``): 0.78%, 0.32%, 0.24% and 0.21% below with 16, 32,
64 and 128 waves, and a sweep of 1M tokens took 3.8, 3.8, 4.7 and 6.4 ms at K = 50 (5.0, 6.0, 8.4
and 13.8 ms at K = 200): each wave adds a grid sync. 16 waves left the GPU test's job 1.01% below
the CPU's, over its 1% bound; 32 are the default, most of 64's gain at little of its cost.

Random numbers: each thread hashes (task seed, sweep, token index) with splitmix64, so a task's draws
depend only on its seed, as on the CPU (but not the same draws).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from apps.gpu import cuda_module, simulated

cuda = cuda_module()  # the apps import this module only where a GPU is wanted

#: Threads per block of the sweep kernel.
THREADS = 256
#: A sweep over a block's tokens runs in this many waves (token i in wave i mod WAVES), each wave
#: seeing the counts the waves before it left: a thread misses the moves of 1/WAVES of the tokens
#: instead of all of them. See the module docstring for what it costs and gains.
WAVES = 32
_U53 = 1.0 / 9007199254740992.0


@cuda.jit(device=True)
def _uniform(seed: np.uint64, index: np.int64) -> float:  # pragma: no cover - runs on the GPU (or the simulator)
    """A uniform double in [0, 1) from (seed, index): one splitmix64 step of their mix."""
    x = seed + np.uint64(index) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return float(x >> np.uint64(11)) * _U53


@cuda.jit(device=True)
def _walk(rows: Any, totals: Any, ndk: Any, w: int, d: int, u: float, alpha: float, beta: float,
          vbeta: float) -> tuple[int, float]:  # pragma: no cover - on the GPU
    """The topic where the running sum of the conditional's weights, as the counts stand, passes
    ``u``, and that sum; ``(-1, the whole sum)`` if it never does."""
    acc = 0.0
    for k in range(rows.shape[1]):
        acc += (ndk[d, k] + alpha) * (rows[w, k] + beta) / (totals[k] + vbeta)
        if u < acc:
            return k, acc
    return -1, acc


@cuda.jit(device=True)
def _resample(rows: Any, totals: Any, ndk: Any, tok_word: Any, tok_doc: Any, z: Any, t: int, alpha: float,
              beta: float, vbeta: float, seed: np.uint64, changed: Any) -> None:  # pragma: no cover - on the GPU
    """Token ``t``: out of the counts, a draw from its full conditional as the counts stand, back in."""
    w = tok_word[t]
    d = tok_doc[t]
    old = z[t]
    K = rows.shape[1]
    cuda.atomic.sub(ndk, (d, old), 1)
    cuda.atomic.sub(rows, (w, old), 1)
    cuda.atomic.sub(totals, old, 1)
    s = 0.0
    for k in range(K):
        s += (ndk[d, k] + alpha) * (rows[w, k] + beta) / (totals[k] + vbeta)
    r = _uniform(seed, t)
    new, seen = _walk(rows, totals, ndk, w, d, r * s, alpha, beta, vbeta)
    if new < 0:  # concurrent moves shrank the weights since they were summed: the same draw, scaled to
        new, seen = _walk(rows, totals, ndk, w, d, r * seen, alpha, beta, vbeta)  # the sum that walk saw
        if new < 0:  # (always ending on the last topic leaned the chain towards it)
            new = K - 1
    cuda.atomic.add(ndk, (d, new), 1)
    cuda.atomic.add(rows, (w, new), 1)
    cuda.atomic.add(totals, new, 1)
    z[t] = new
    if new != old:
        cuda.atomic.add(changed, 0, 1)


@cuda.jit(cache=not simulated())
def _sweep_kernel(rows: Any, totals: Any, ndk: Any, tok_word: Any, tok_doc: Any, z: Any, lo: int, n: int,
                  wave: int, waves: int, alpha: float, beta: float, vbeta: float, seed: np.uint64,
                  changed: Any) -> None:  # pragma: no cover - runs on the GPU (or the simulator)
    """One wave of a sweep: a thread per token of the wave."""
    i = wave + cuda.grid(1) * waves
    if i < n:
        _resample(rows, totals, ndk, tok_word, tok_doc, z, lo + i, alpha, beta, vbeta, seed, changed)


@cuda.jit(cache=not simulated())
def _waves_kernel(rows: Any, totals: Any, ndk: Any, tok_word: Any, tok_doc: Any, z: Any, lo: int, n: int,
                  waves: int, alpha: float, beta: float, vbeta: float, seed: np.uint64,
                  changed: Any) -> None:  # pragma: no cover - runs on the GPU (or the simulator)
    """A whole sweep in one cooperative launch: the threads walk each wave's tokens (grid-stride) and
    wait for the whole grid between waves, which orders the waves as separate launches would."""
    grid = cuda.cg.this_grid()
    stride = cuda.gridsize(1) * waves
    for wave in range(waves):
        i = wave + cuda.grid(1) * waves
        while i < n:
            _resample(rows, totals, ndk, tok_word, tok_doc, z, lo + i, alpha, beta, vbeta, seed, changed)
            i += stride
        grid.sync()


#: threads per block -> the most blocks a cooperative launch of ``_waves_kernel`` may have (0: none runs)
_COOPERATIVE: dict[int, int] = {}
#: why cooperative launches do not run here, if they do not (a sweep is then a launch per wave)
cooperative_unavailable: str | None = None


def cooperative_blocks(threads: int) -> int:
    """How many blocks of ``threads`` one cooperative launch of the sweep may have on this GPU, or 0
    where cooperative launches fail (they need the device runtime library, and the GPU's support).
    Found once per block size: a one-block launch compiles the kernel (or loads it from the cache),
    then the device says how many such blocks fit on it at once. The simulator runs a cooperative grid
    of one block only."""
    global cooperative_unavailable
    if threads not in _COOPERATIVE:
        ints, one = np.zeros(1, np.int32), np.ones((1, 1), np.int32)
        try:
            _waves_kernel[1, threads](cuda.to_device(one), cuda.to_device(np.ones(1, np.int64)),
                                      cuda.to_device(one), cuda.to_device(ints), cuda.to_device(ints),
                                      cuda.to_device(ints), 0, 1, 1, 0.1, 0.1, 0.1, np.uint64(0),
                                      cuda.to_device(np.zeros(1, np.int64)))
            cuda.synchronize()
            if simulated():
                blocks = 1
            else:
                blocks = min(k.max_cooperative_grid_blocks(threads) for k in _waves_kernel.overloads.values())
        except Exception as e:  # noqa: BLE001 - any failure means: launch per wave, and say why
            cooperative_unavailable = f"{type(e).__name__}: {e}"
            blocks = 0
        _COOPERATIVE[threads] = blocks
    return _COOPERATIVE[threads]


def launch_mode(threads: int = THREADS) -> str:
    """How a sweep runs on this GPU, in words, with the reason where it cannot be one cooperative launch
    (what a job reports: a GPU without them is slower on small tasks, not wrong)."""
    if cooperative_blocks(threads):
        return "one cooperative launch per sweep"
    return f"a launch per wave (cooperative launches fail here: {cooperative_unavailable})"


def _free_memory() -> int | None:
    """Bytes free on the current GPU, or None where it is not known (the simulator says infinity)."""
    try:
        free = cuda.current_context().get_memory_info()[0]
    except Exception:  # noqa: BLE001 - only a guard; the copy itself reports a real shortage
        return None
    return int(free) if math.isfinite(free) else None


class DeviceTokens:
    """An executor's tokens on the GPU: each one's word (an index into its block's rows), document and
    topic, and the documents' topic counts (dense ``(D, K)`` int32), built from the host's topics ``z``."""

    def __init__(self, tok_word: np.ndarray, tok_doc: np.ndarray, z: np.ndarray, num_docs: int,
                 num_topics: int) -> None:
        if not len(tok_word) == len(tok_doc) == len(z):
            raise ValueError("tok_word, tok_doc and z differ in length")
        if len(z) and (z.min() < 0 or z.max() >= num_topics or tok_doc.min() < 0 or tok_doc.max() >= num_docs):
            raise ValueError(f"a topic outside [0, {num_topics}) or a document outside [0, {num_docs})")
        need = 4 * (num_docs * num_topics + 3 * len(z))
        free = _free_memory()
        if free is not None and need > free:
            raise MemoryError(f"the GPU copy of this executor's tokens needs {need / 2**30:.2f} GiB (dense topic "
                              f"counts of {num_docs:,} documents x {num_topics} topics), and {free / 2**30:.2f} GiB "
                              "is free: split the corpus over more executors, or use the CPU")
        self.K = num_topics
        self.host_word = tok_word
        ndk = np.zeros((num_docs, num_topics), np.int32)
        np.add.at(ndk, (tok_doc, z), 1)
        self.ndk = cuda.to_device(ndk)
        self.tok_word = cuda.to_device(np.ascontiguousarray(tok_word, np.int32))
        self.tok_doc = cuda.to_device(np.ascontiguousarray(tok_doc, np.int32))
        self.z = cuda.to_device(np.ascontiguousarray(z, np.int32))

    def doc_counts(self) -> np.ndarray:
        """The documents' topic counts ``(D, K)`` as the GPU holds them (for tests)."""
        return self.ndk.copy_to_host()

    def sweep(self, rows: np.ndarray, totals: np.ndarray, lo: int, hi: int, z: np.ndarray, alpha: float,
              beta: float, vbeta: float, seed: int, sweeps: int = 1, threads: int = THREADS,
              waves: int = WAVES, cooperative: bool = True) -> int:
        """Resample tokens ``lo:hi`` (one block's) ``sweeps`` times, each in ``waves`` waves; returns
        how many draws changed a topic. A sweep is one cooperative launch where the GPU can run one
        (``cooperative_blocks``; each launch costs tens of microseconds of the host's time, as much as a
        wave of a small block takes on the GPU), else a launch per wave; the draws are the same.

        Updates the host's ``rows`` (Vb, K) int16 or int32, ``totals`` (K,) int64 and ``z[lo:hi]`` in place.
        ``vbeta`` is V·β with V the whole vocabulary."""
        if rows.ndim != 2 or rows.shape[1] != self.K or totals.dtype != np.int64 or totals.shape != (self.K,):
            raise TypeError(f"rows must be (Vb, {self.K}) and totals ({self.K},) int64, got {rows.dtype}{rows.shape}, "
                            f"{totals.dtype}{totals.shape}")
        if not 0 <= lo <= hi <= len(self.host_word):
            raise IndexError(f"tokens {lo}:{hi} outside the executor's {len(self.host_word)}")
        if hi > lo and int(self.host_word[lo:hi].max()) >= rows.shape[0]:
            raise IndexError(f"a token's word is outside the block's {rows.shape[0]} rows")
        d_rows = cuda.to_device(rows.astype(np.int32))
        d_totals = cuda.to_device(totals)
        changed = cuda.to_device(np.zeros(1, np.int64))
        n = hi - lo
        waves = max(1, min(int(waves), n))
        blocks = math.ceil(math.ceil(n / waves) / threads)
        most = cooperative_blocks(threads) if cooperative and n else 0
        for s in range(sweeps if n else 0):
            mixed = np.uint64((int(seed) * 0x100000001B3 + s) & 0xFFFFFFFFFFFFFFFF)
            if most:
                _waves_kernel[min(blocks, most), threads](d_rows, d_totals, self.ndk, self.tok_word, self.tok_doc,
                                                          self.z, lo, n, waves, float(alpha), float(beta),
                                                          float(vbeta), mixed, changed)
                continue
            for wave in range(waves):
                _sweep_kernel[blocks, threads](d_rows, d_totals, self.ndk, self.tok_word, self.tok_doc, self.z,
                                               lo, n, wave, waves, float(alpha), float(beta), float(vbeta), mixed,
                                               changed)
        rows[:] = d_rows.copy_to_host()
        totals[:] = d_totals.copy_to_host()
        z[lo:hi] = self.z[lo:hi].copy_to_host()
        return int(changed.copy_to_host()[0])


def warmup() -> None:
    """Compile the sweep kernels (or load them from the on-disk cache) before the first task."""
    z = np.zeros(2, np.int32)
    tokens = DeviceTokens(np.zeros(2, np.int32), np.zeros(2, np.int32), z, 1, 2)
    for cooperative in (True, False):
        tokens.sweep(np.array([[2, 0]], np.int32), np.array([2, 0], np.int64), 0, 2, z, 0.1, 0.1, 0.1, 0,
                     waves=1, cooperative=cooperative)
