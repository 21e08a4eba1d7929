"""NN-Descent's GPU join (apps/nndescent_cuda.py): checked in Numba's CUDA simulator here, on a GPU
where there is one, and the ``--device`` option's refusals and fallback."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import litz
from apps import gpu, nndescent_cuda
from apps import nndescent as nd
from apps import nndescent_kernels as nk
from tests.conftest import run_in_cuda_simulator

ON_GPU = gpu.available() and not gpu.simulated()

# Runs in a process of its own (run_in_cuda_simulator). Integer-valued points make every distance exact
# in any order of summation, so the simulated kernel's lists must equal the CPU join's bit for bit.
SIMULATED_CHECK = textwrap.dedent("""
    import numpy as np
    from apps import gpu, nndescent_kernels as nk
    from apps.nndescent_cuda import join_distances
    assert gpu.simulated() and gpu.available() and gpu.resolve("auto") == "cuda"
    rng = np.random.default_rng(4)
    n, dim, k = 80, 5, 4
    x = rng.integers(0, 6, (n, dim)).astype(np.float32)
    everyone = np.arange(n, dtype=np.int64)
    G, pos, touched, counts = nk.init_lists(n, everyone, k)
    nk.fill_random(x, G, everyone, k, 3, touched, counts)
    flags = G[:, 2 * k:]
    flags[flags == nk.FLAG_PROPOSED] = nk.FLAG_NEW
    owned = np.arange(30, 46, dtype=np.int64)
    # the kernel's distances, where the join reads them, are the exact ones
    _, _, new, old, _ = nk.nnd_sample(G.copy(), owned, k, k, 9, 0)
    dists = join_distances(x, new, old, threads=4)  # a tree of 2 levels; the rounds below use 1
    checked = 0
    for a in range(len(owned)):
        for i in range(k):
            for j in range(i + 1, 2 * k):
                p, q = new[a, i], (new[a, j] if j < k else old[a, j - k])
                if p >= 0 and q >= 0 and p != q:
                    assert dists[a, i, j] == ((x[p] - x[q]) ** 2).sum(), (a, i, j)
                    checked += 1
    assert checked > 60, checked
    for use_filter, chunk in ((True, 64 << 20), (False, 64 << 20), (True, 5 * 8 * k * k)):  # last: runs of 5
        cpu_G, gpu_G = G.copy(), G.copy()
        cpu_out = nk.nnd_round(x, cpu_G, owned, k, k, 9, 0, use_filter, 8)
        gpu_out = nk.nnd_round(x, gpu_G, owned, k, k, 9, 0, use_filter, 8,
                               lambda d, a, b: join_distances(d, a, b, threads=2), chunk_bytes=chunk)
        assert np.array_equal(cpu_G, gpu_G), use_filter
        for c, g in zip(cpu_out, gpu_out):
            assert np.array_equal(c, g), use_filter
        assert cpu_out[2][3] > 0  # offers entered lists: the comparison compared something
    # the data goes to the device once for the executor's points, though each task hands the join a
    # fresh read-only view of them; another array (a new job's) goes again
    from apps import nndescent_cuda as nc
    from apps.kernel_util import read_only
    uploads = []
    to_device = nc.cuda.to_device
    nc.cuda.to_device = lambda a: (uploads.append(a.shape) if a.dtype == np.float32 else None, to_device(a))[1]
    points = x.copy()
    for _ in range(3):
        join_distances(read_only(points), new, old, threads=4)
    assert len(uploads) == 1, uploads
    other = points.copy()  # (an executor that arrived by a migration brings its own copy of the points)
    join_distances(read_only(other), new, old, threads=4)
    join_distances(read_only(points[:, 1:]), new, old, threads=4)  # (the same memory, other columns)
    assert len(uploads) == 3, uploads
    for _ in range(2):  # executors of both copies taking turns: no upload
        join_distances(read_only(points), new, old, threads=4)
        join_distances(read_only(other), new, old, threads=4)
    assert len(uploads) == 3, uploads
    print("simulated join ok", checked)
""")


def test_the_gpu_join_in_the_cuda_simulator_makes_the_cpu_joins_offers() -> None:
    """The kernel, run with real thread-block semantics (shared memory, barriers) in the simulator:
    every distance the join reads is exact, and a round with the GPU's distances ends with the same
    lists, update and counters as the CPU round, with and without the d_max filter."""
    run_in_cuda_simulator(SIMULATED_CHECK, "simulated join ok")


# A numba-cuda that sees a GPU but cannot compile (seen on a GPU image: numba-cuda with NumPy 2.5)
PROBE_CHECK = textwrap.dedent("""
    from apps import gpu
    assert gpu.why_unavailable() is None and gpu.resolve("auto") == "cuda"  # the probe kernel ran
    def broken(cuda):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")
    gpu._probe = broken
    gpu.why_unavailable.cache_clear()
    assert not gpu.available() and gpu.resolve("auto") == "cpu"
    try:
        gpu.resolve("cuda")
    except ValueError as exc:
        assert ("cannot compile or run a kernel here (AttributeError: module 'numpy' has no attribute "
                "'row_stack')") in str(exc), exc
    else:
        raise AssertionError("--device cuda was accepted where no kernel compiles")
    print("probe ok")
""")


def test_a_gpu_whose_kernels_do_not_compile_counts_as_no_gpu() -> None:
    """``auto`` falls back to the CPU and ``cuda`` is refused with the compiler's error, rather than
    every task failing with it."""
    run_in_cuda_simulator(PROBE_CHECK, "probe ok")


def test_numba_cuda_gets_back_the_row_stack_that_numpy_2_5_removed(monkeypatch) -> None:
    # numba-cuda 0.68 calls np.row_stack while compiling each kernel; on NumPy 2.5 (seen on the H200
    # image) every kernel failed with AttributeError until the apps gave the name back.
    monkeypatch.delattr(np, "row_stack", raising=False)
    gpu._restore_numpy_names()
    assert np.row_stack is np.vstack
    assert np.array_equal(np.row_stack(([1, 2], [3, 4])), [[1, 2], [3, 4]])
    mine = object()
    monkeypatch.setattr(np, "row_stack", mine)
    gpu._restore_numpy_names()
    assert np.row_stack is mine  # a NumPy that has the name keeps its own


def test_device_options_refuse_a_missing_gpu_and_auto_falls_back() -> None:
    assert gpu.resolve("cpu") == "cpu"
    assert gpu.resolve("auto") == ("cuda" if gpu.available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        gpu.resolve("tpu")
    with pytest.raises(ValueError, match="threads must be a power of two"):
        ids = np.zeros((1, 1), np.int64)
        nndescent_cuda.join_distances(np.zeros((4, 2), np.float32), ids, ids, threads=3)
    if not gpu.available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA GPU"):
            gpu.resolve("cuda")
        with pytest.raises(litz.ConfigError, match="--device cuda"):
            nd.make_app(["--data", "blobs", "--points", "500", "--device", "cuda"])


def test_auto_runs_where_the_worker_can_and_says_where(etcd) -> None:
    """``--device auto`` on this machine: the phase reports the device its executors used, and the graph
    is as good as ever (on CI, the CPU)."""
    app = nd.make_app(["--data", "blobs", "--points", "3000", "--dim", "8", "--device", "auto", "--quiet"])
    out = litz.run(app, workers=1, servers=1, num_executors=2, etcd=etcd.url).value
    assert out["stats"]["devices"] == ["cuda" if gpu.available() else "cpu"]
    assert out["recall"] >= 0.95


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (the simulator check above runs everywhere)")
def test_on_a_gpu_a_round_makes_the_same_lists_up_to_rounding() -> None:
    """On hardware the GPU sums in another order, so a few near-ties may go the other way; the lists
    must still agree almost everywhere, and the distances read must match the CPU's to rounding."""
    k = 15
    x = nd.blobs(20_000, 32, centers=10, seed=1)
    everyone = np.arange(len(x), dtype=np.int64)
    G, pos, touched, counts = nk.init_lists(len(x), everyone, k)
    nk.fill_random(x, G, everyone, k, 3, touched, counts)
    flags = G[:, 2 * k:]
    flags[flags == nk.FLAG_PROPOSED] = nk.FLAG_NEW
    owned = np.arange(5000, 10000, dtype=np.int64)
    _, _, new, old, _ = nk.nnd_sample(G.copy(), owned, k, k, 9, 0)
    dists = nndescent_cuda.join_distances(x, new, old)
    p, q = new[:, 0], new[:, 1]
    ok = (p >= 0) & (q >= 0)
    exact = ((x[p[ok]].astype(np.float64) - x[q[ok]]) ** 2).sum(1)
    np.testing.assert_allclose(dists[ok, 0, 1], exact, rtol=1e-4)
    cpu_G, gpu_G = G.copy(), G.copy()
    nk.nnd_round(x, cpu_G, owned, k, k, 9, 0, True, 64)
    nk.nnd_round(x, gpu_G, owned, k, k, 9, 0, True, 64, nndescent_cuda.join_distances)
    assert (cpu_G[:, :k] == gpu_G[:, :k]).mean() >= 0.99
