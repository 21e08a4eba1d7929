"""MLR's GPU kernel (apps/mlr_cuda.py) against the CPU kernel, in Numba's CUDA simulator here and
on a GPU where there is one, and ``--device`` on the app."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import litz
from apps import gpu, mlr
from apps import mlr_kernels as mk
from tests.conftest import run_in_cuda_simulator

SIMULATED_CHECK = textwrap.dedent("""
    import numpy as np
    from apps import mlr_cuda, mlr_kernels as mk
    rng = np.random.default_rng(1)
    n, d, K = 40, 37, 3
    X = rng.standard_normal((n, d)).astype(np.float32) * 2
    y = rng.integers(0, K, n).astype(np.int64)
    W0 = (rng.standard_normal((d + 1, K)) * 0.5).astype(np.float32)
    rows = rng.permutation(n).astype(np.int64)[:29]  # batches of 7: the last one short
    data = mlr_cuda.DeviceRows(X, y)
    # more threads than a batch has rows (4 per row: partial sums), fewer, and 2 per row; fewer than features
    for threads in (32, 4, 20):  # 4 and 20 also reuse the device buffers of a call with more threads
        Wc, Wg = W0.copy(), W0.copy()
        loss_c, ok_c = mk.sgd_steps(Wc, X, y, rows, 7, 0.3, 0.01)
        loss_g, ok_g = mlr_cuda.sgd_steps(Wg, data, rows, 7, 0.3, 0.01, threads=threads)
        assert np.abs(Wc - W0).max() > 0.1  # the steps moved the weights
        np.testing.assert_allclose(Wg, Wc, rtol=1e-5, atol=1e-6)
        assert abs(loss_g - loss_c) <= 1e-5 * loss_c and ok_g == ok_c, (loss_g, loss_c, ok_g, ok_c)
    for bad, err in ((np.array([0, n], np.int64), IndexError), (rows.astype(np.int32), TypeError)):
        try:
            mlr_cuda.sgd_steps(W0.copy(), data, bad, 7, 0.3, 0.01, threads=4)
        except err:
            pass
        else:
            raise AssertionError(f"{bad!r} was not refused")
    try:
        mlr_cuda.sgd_steps(W0[:, :2].copy(), data, rows, 7, 0.3, 0.01, threads=4)  # label 2 with 2 classes
    except ValueError as exc:
        assert "label out of range" in str(exc)
    else:
        raise AssertionError("a label beyond the classes was not refused")
    print("simulated sgd ok")
""")


def test_the_gpu_sgd_kernel_in_the_cuda_simulator_equals_the_cpu_kernel() -> None:
    """The block's three phases per batch (logits, softmax, step) with their barriers, run as CUDA
    threads in the simulator: weights, summed loss and correct count equal the CPU kernel's up to
    float32 rounding, with a short last batch and with fewer and more threads than rows; rows
    and labels out of range are refused on the host (the kernel does not check its reads)."""
    run_in_cuda_simulator(SIMULATED_CHECK, "simulated sgd ok")


def test_device_cuda_is_refused_without_a_gpu_and_auto_trains_on_the_cpu(etcd) -> None:
    if not gpu.available():
        with pytest.raises(litz.ConfigError, match="--device cuda: no CUDA GPU"):
            mlr.make_app(["--device", "cuda"])
    app = mlr.make_app(["--device", "auto", "--epochs", "1", "--train-rows", "6000", "--quiet"])
    out = litz.run(app, workers=1, servers=1, num_executors=2, etcd=etcd.url).value
    assert out["devices"] == ["cuda" if gpu.available() else "cpu"]
    assert out["test_accuracy"] >= 0.7


def test_a_batch_too_big_for_the_gpu_kernel_is_refused_at_once_or_runs_on_the_cpu_with_auto() -> None:
    """The GPU kernel keeps a batch's logits and the weights in 48 KB of shared memory: batches of
    more than about 443 rows do not fit. ``--device cuda`` with one passed ``make_app`` and then
    every task failed; ``--device auto`` on a GPU worker failed the same. Now ``cuda`` is refused
    before the job starts (with or without a GPU here) and ``auto`` takes the CPU."""
    assert mk.gpu_batch_too_big(784, 10, 443) is None
    with pytest.raises(litz.ConfigError, match="shared memory: 51400 bytes .* batches of 500, more than 49152; "
                                               "use a smaller --batch-size or --device cpu"):
        mlr.make_app(["--device", "cuda", "--batch-size", "500"])
    assert mlr.make_app(["--device", "auto", "--batch-size", "500"]).config["device"] == "cpu"
    assert mlr.make_app(["--device", "auto", "--batch-size", "400"]).config["device"] == "auto"


def test_a_numba_cuda_that_fails_to_import_means_no_gpu_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """``numba.cuda`` may fail to import with more than an ImportError (an AttributeError of a
    numba-cuda that does not fit the installed NumPy): ``--device auto`` then raised it instead of
    taking the CPU, and ``--device cuda`` gave a traceback instead of the reason."""
    import builtins

    real = builtins.__import__

    def broken(name: str, *args: object, **kwargs: object) -> object:
        if name == "numba" and "cuda" in (args[2] if len(args) > 2 and args[2] else ()):
            raise AttributeError("module 'numpy' has no attribute 'row_stack'")
        return real(name, *args, **kwargs)

    for cached in (gpu.cuda_module, gpu.why_unavailable):
        cached.cache_clear()
    monkeypatch.setattr(builtins, "__import__", broken)
    try:
        assert gpu.cuda_module() is None and gpu.resolve("auto") == "cpu"
        with pytest.raises(litz.ConfigError, match="numba.cuda does not import: AttributeError: module 'numpy' has "
                                                   "no attribute 'row_stack'"):
            gpu.check_device("cuda")
    finally:
        monkeypatch.undo()
        for cached in (gpu.cuda_module, gpu.why_unavailable):
            cached.cache_clear()


@pytest.mark.skipif(not gpu.available() or gpu.simulated(), reason="needs an NVIDIA GPU (the simulator check runs "
                                                                    "everywhere)")
def test_on_a_gpu_the_steps_equal_the_cpu_kernels_on_fashion_mnist() -> None:
    from apps import mlr_cuda

    X, y = mlr.load_data(16)[:2]
    X, y = np.ascontiguousarray(X[:4096]), np.ascontiguousarray(y[:4096])
    rows = np.random.default_rng(0).permutation(4096).astype(np.int64)
    Wc = np.zeros((785, 10), np.float32)
    Wg = Wc.copy()
    loss_c, ok_c = mk.sgd_steps(Wc, X, y, rows, 32, 0.2, 1e-4)
    loss_g, ok_g = mlr_cuda.sgd_steps(Wg, mlr_cuda.DeviceRows(X, y), rows, 32, 0.2, 1e-4)
    np.testing.assert_allclose(Wg, Wc, rtol=1e-3, atol=1e-4)
    assert abs(loss_g - loss_c) <= 1e-3 * loss_c and abs(ok_g - ok_c) <= 5
