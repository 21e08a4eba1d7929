"""MF's GPU path (apps/mf_gpu.py, CuPy) against the Numba kernels: with NumPy and SciPy standing in for
CuPy on every run (``LITZ_CUPY_STANDIN=numpy``), with CuPy on a GPU where there is one; and
``--device`` on the app."""

from __future__ import annotations

import numpy as np
import pytest

import litz
from apps import gpu, mf, mf_gpu
from apps.datasets import synthetic_ratings
from apps.mf_kernels import StaleSums

ON_GPU = gpu.why_unavailable("cupy") is None and not gpu.cupy_standin()
BACKENDS = ["standin", pytest.param("cupy", marks=pytest.mark.skipif(
    not ON_GPU, reason="needs CuPy and an NVIDIA GPU (the stand-in case runs everywhere)"))]


@pytest.fixture
def backend(request, monkeypatch) -> str:
    """The array modules DeviceSteps runs with in this test: NumPy's stand-in or CuPy."""
    if request.param == "standin":
        monkeypatch.setenv(gpu.CUPY_STANDIN, "numpy")
    else:
        monkeypatch.delenv(gpu.CUPY_STANDIN, raising=False)
    for cached in (mf_gpu.array_modules, gpu.why_unavailable, gpu.process_device):
        cached.cache_clear()
    yield request.param
    for cached in (mf_gpu.array_modules, gpu.why_unavailable, gpu.process_device):
        cached.cache_clear()


def _csr(rng: np.random.Generator, n_rows: int, n_cols: int, nnz: int) -> tuple[np.ndarray, ...]:
    """Ratings on distinct cells, in no particular order within a row; the last row and column get none."""
    cells = rng.choice((n_rows - 1) * (n_cols - 1), size=nnz, replace=False)
    rows, cols = np.divmod(cells, n_cols - 1)
    return mf.to_csr(rows, cols, rng.standard_normal(nnz) * 2, n_rows)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_device_steps_equal_the_numba_kernels(backend: str) -> None:
    """Each of a task's four steps, from the same inputs, equals the Numba kernels' result to float64
    rounding: solved rows (an entity without ratings gets the zero row), packed contributions (a
    column without ratings gets only the tag), the PS side solved from its sums, squared errors."""
    rng = np.random.default_rng(5)
    d, n, m, l2 = 7, 60, 45, 0.15
    train, test = _csr(rng, n, m, 900), _csr(rng, n, m, 150)
    F = rng.standard_normal((m, d))
    X = rng.standard_normal((n, d))
    cpu, dev = mf.KernelSteps(d, train, test, m), mf_gpu.DeviceSteps(d, train, test, m)
    rows = dev.solve_rows(dev.put(F), l2)
    assert isinstance(rows, np.ndarray)  # the executor's state stays on the host
    np.testing.assert_allclose(rows, cpu.solve_rows(F, l2), rtol=1e-9, atol=1e-12)
    assert not rows[-1].any() and np.abs(rows[:-1]).min(axis=1).max() > 0
    ne = dev.normal_equations(X, 5.0)
    np.testing.assert_allclose(ne, cpu.normal_equations(X, 5.0), rtol=1e-12, atol=1e-12)
    assert (ne[:, 0] == 5.0).all() and not ne[-1, 1:].any() and ne[:-1, 1:].any(axis=1).all()
    solved = dev.solve_sums(ne, 5.0, l2)
    np.testing.assert_allclose(dev.host(solved), cpu.solve_sums(ne, 5.0, l2), rtol=1e-9, atol=1e-12)
    for got, want in zip(dev.squared_errors(X, dev.put(F)), cpu.squared_errors(X, F), strict=True):
        assert got == pytest.approx(want, rel=1e-12) and want > 1.0
    with pytest.raises(StaleSums, match=r"45 of 45 normal-equation rows are not those of iteration tag 6\.0 "
                                        r"\(tags seen: \[5\.0\]\)"):
        dev.solve_sums(ne, 6.0, l2)
    with pytest.raises(ValueError, match=r"must be \(m, 36\)"):
        dev.solve_sums(ne[:, :-1], 5.0, l2)
    empty = (np.zeros(4, np.int64), np.zeros(0, np.int64), np.zeros(0))  # an executor without ratings
    none = mf_gpu.DeviceSteps(d, empty, empty, 0)
    assert none.solve_rows(none.put(np.zeros((0, d))), l2).shape == (3, d)
    assert none.normal_equations(np.ones((3, d)), 5.0).shape == (0, 36)
    assert none.squared_errors(np.ones((3, d)), none.put(np.zeros((0, d)))) == (0.0, 0.0)
    singular = np.zeros_like(ne)  # counts of 1 and no other sums: with l2 = 0, A = diag(0, ..., 0, 1)
    singular[:, 0], singular[:, 1 + dev.als.tri - 1] = 5.0, 1.0
    with pytest.raises(FloatingPointError, match="singular"):
        dev.solve_sums(singular, 5.0, 0.0)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_job_on_the_device_path_equals_single_process_numpy(etcd, backend: str) -> None:
    """``--device cuda`` through the whole app (workers, servers, the tagged sums): every iteration's test
    RMSE and the final factors equal the single-process reference, and the driver says where the
    steps ran."""
    users, items, n, rank, iterations = 120, 90, 2500, 4, 5
    app = mf.make_app(["--synthetic", f"{users},{items},{n}", "--rank", str(rank), "--iterations", str(iterations),
                       "--block-size", "16", "--return-factors", "--quiet", "--device", "cuda"])
    got = litz.run(app, workers=2, servers=2, num_executors=5, etcd=etcd.url).value
    ref = mf.NumpyALS(synthetic_ratings(users, items, n), rank, mf.DEFAULTS["l2"])
    history = []
    for _ in range(iterations):
        ref.iterate()
        history.append(ref.rmse())
    assert got["devices"] == ["cuda"]
    U, V = ref.factors()
    np.testing.assert_allclose(got["users"], U, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["items"], V, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose([h["test_rmse"] for h in got["history"]], history, rtol=1e-9)
    assert history[-1] < 0.6 < history[0]


def test_without_cupy_device_cuda_is_refused_and_auto_runs_on_the_cpu(etcd, monkeypatch) -> None:
    monkeypatch.delenv(gpu.CUPY_STANDIN, raising=False)
    gpu.why_unavailable.cache_clear()
    if not ON_GPU:
        with pytest.raises(litz.ConfigError, match="--device cuda: (CuPy|no CUDA GPU)"):
            mf.make_app(["--synthetic", "50,40,500", "--device", "cuda"])
    app = mf.make_app(["--synthetic", "120,90,2500", "--rank", "4", "--iterations", "3", "--quiet",
                       "--device", "auto"])
    out = litz.run(app, workers=1, servers=1, num_executors=2, etcd=etcd.url).value
    assert out["devices"] == ["cuda" if ON_GPU else "cpu"]
    assert out["test_rmse"] < 0.7
    with pytest.raises(ValueError, match="unknown GPU toolkit"):
        gpu.why_unavailable("opencl")
