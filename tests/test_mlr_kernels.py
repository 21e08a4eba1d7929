"""Tests for the MLR numerical core (apps.mlr_kernels) and the dataset helpers (apps.datasets).

The kernel is checked against a straightforward NumPy implementation of the same mini-batch step,
because the tiled Numba code has many ragged-edge paths (batch not a multiple of 4, odd K, bias as
an implicit feature) that a convergence test alone would not catch.
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from apps import mlr_kernels as mk
from apps.datasets import (
    DEFAULT_FASHION_MNIST_ROOT,
    fit_spectral_preconditioner,
    load_fashion_mnist,
    parse_idx,
    partition_rows,
)
from tests.conftest import counts_references, machine_code

_FMNIST_ROOT = os.environ.get("LITZ_FASHION_MNIST") or DEFAULT_FASHION_MNIST_ROOT
_HAVE_FMNIST = all(
    (Path(_FMNIST_ROOT) / f"{p}-{kind}-ubyte.gz").is_file()
    for p in ("train", "t10k")
    for kind in ("images-idx3", "labels-idx1")
)
needs_fmnist = pytest.mark.skipif(
    not _HAVE_FMNIST,
    reason=f"Fashion-MNIST not found in {_FMNIST_ROOT} (apt-get install dataset-fashion-mnist)",
)


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    """Compile/load the kernels once so individual tests measure behaviour, not compilation."""
    mk.warmup()


def _np_softmax(Z: np.ndarray) -> np.ndarray:
    Z = Z - Z.max(axis=1, keepdims=True)
    E = np.exp(Z)
    return E / E.sum(axis=1, keepdims=True)


def _np_sgd_reference(
    W: np.ndarray, X: np.ndarray, y: np.ndarray, rows: np.ndarray, batch_size: int, lr: float, l2: float
) -> tuple[np.ndarray, float, int]:
    """Float64 NumPy reference of the documented update: per batch, loss/accuracy at the current W,
    then W[:-1] *= 1 - lr*l2 and W -= lr * mean gradient of the batch."""
    W = W.astype(np.float64)
    loss, correct = 0.0, 0
    for b0 in range(0, len(rows), batch_size):
        idx = rows[b0 : b0 + batch_size]
        Xb = np.hstack([X[idx].astype(np.float64), np.ones((len(idx), 1))])
        yb = y[idx]
        Z = Xb @ W
        P = _np_softmax(Z)
        loss += float(-np.log(P[np.arange(len(idx)), yb]).sum())
        correct += int((Z.argmax(axis=1) == yb).sum())
        P[np.arange(len(idx)), yb] -= 1.0
        W[:-1] *= 1.0 - lr * l2
        W -= lr * (Xb.T @ P) / len(idx)
    return W, loss, correct


@pytest.mark.parametrize(
    ("n", "d", "K", "batch_size", "l2"),
    [
        (13, 9, 3, 13, 0.0),
        (37, 20, 10, 8, 1e-2),
        (29, 33, 5, 6, 1e-3),
        (64, 17, 1, 16, 0.0),
        (50, 31, 2, 7, 0.1),
    ],
)
def test_sgd_steps_matches_numpy_reference(n: int, d: int, K: int, batch_size: int, l2: float) -> None:
    """Ragged batches (n % batch_size != 0, batch % 4 != 0), odd K and K=1 all hit the tiling edges."""
    rng = np.random.default_rng(n * 1000 + d)
    X = rng.random((n, d), dtype=np.float32)
    y = rng.integers(0, K, n).astype(np.int64)
    W0 = (rng.standard_normal((d + 1, K)) * 0.3).astype(np.float32)
    rows = rng.permutation(n).astype(np.int64)[: n - 2]  # not all rows, not in order
    lr = 0.3
    W = W0.copy()
    loss, correct = mk.sgd_steps(W, X, y, rows, batch_size, lr, l2)
    W_ref, loss_ref, correct_ref = _np_sgd_reference(W0, X, y, rows, batch_size, lr, l2)
    np.testing.assert_allclose(W, W_ref, rtol=1e-4, atol=1e-5)
    assert loss == pytest.approx(loss_ref, rel=1e-4)
    assert correct == correct_ref
    if K > 1:  # with one class the softmax is constant and the gradient (correctly) zero
        assert not np.array_equal(W, W0)


def test_single_step_loss_and_accuracy_exact_case() -> None:
    """Hand-checkable case: one batch, W=0 -> every row has loss log(K), argmax ties resolve to class 0."""
    X = np.eye(4, dtype=np.float32)
    y = np.array([0, 1, 2, 0], dtype=np.int64)
    W = np.zeros((5, 3), np.float32)
    loss, correct = mk.sgd_steps(W, X, y, np.arange(4, dtype=np.int64), 4, 1.0, 0.0)
    assert loss == pytest.approx(4 * np.log(3.0), rel=1e-6)
    assert correct == 2  # rows 0 and 3 have label 0 == argmax of all-equal logits
    # Bias gradient: mean over rows of (1/3 - onehot) = (1/3 - 2/4, 1/3 - 1/4, 1/3 - 1/4).
    np.testing.assert_allclose(W[-1], -np.array([1 / 3 - 0.5, 1 / 3 - 0.25, 1 / 3 - 0.25]), rtol=1e-5)


def test_evaluate_matches_numpy() -> None:
    rng = np.random.default_rng(3)
    n, d, K = 301, 19, 7  # n not a multiple of the evaluation block or of 4
    X = rng.random((n, d), dtype=np.float32)
    y = rng.integers(0, K, n).astype(np.int64)
    W = rng.standard_normal((d + 1, K)).astype(np.float32)
    Z = X.astype(np.float64) @ W[:-1] + W[-1]
    P = _np_softmax(Z)
    loss, acc = mk.evaluate(W, X, y)
    assert loss == pytest.approx(float(-np.log(P[np.arange(n), y]).mean()), rel=1e-5)
    assert acc == pytest.approx(float((Z.argmax(1) == y).mean()))


def test_input_validation() -> None:
    X = np.zeros((4, 3), np.float32)
    y = np.zeros(4, np.int64)
    W = np.zeros((4, 2), np.float32)
    rows = np.arange(4, dtype=np.int64)
    with pytest.raises(TypeError):
        mk.sgd_steps(W, X.astype(np.float64), y, rows, 2, 0.1, 0.0)
    with pytest.raises(ValueError):
        mk.sgd_steps(np.zeros((3, 2), np.float32), X, y, rows, 2, 0.1, 0.0)
    with pytest.raises(IndexError):
        mk.sgd_steps(W, X, y, np.array([0, 4], np.int64), 2, 0.1, 0.0)
    with pytest.raises(ValueError):
        mk.sgd_steps(W, X, np.array([0, 0, 2, 0], np.int64), rows, 2, 0.1, 0.0)
    assert mk.sgd_steps(W, X, y, np.empty(0, np.int64), 2, 0.1, 0.0) == (0.0, 0)


@pytest.mark.parametrize(("n", "parts"), [(0, 3), (10, 1), (10, 3), (60000, 7), (5, 8)])
def test_partition_rows_covers_every_row_once(n: int, parts: int) -> None:
    chunks = [partition_rows(n, parts, p, seed=5) for p in range(parts)]
    allrows = np.concatenate(chunks)
    assert allrows.dtype == np.int64
    assert np.array_equal(np.sort(allrows), np.arange(n))
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1
    assert np.array_equal(chunks[-1], partition_rows(n, parts, parts - 1, seed=5))  # deterministic
    if n >= 10 and parts > 1:
        assert not np.array_equal(chunks[0], np.arange(len(chunks[0])))  # actually shuffled
    with pytest.raises(ValueError):
        partition_rows(n, parts, parts)


def test_parse_idx_and_missing_files(tmp_path: Path) -> None:
    data = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = struct.pack(">BBBB3I", 0, 0, 0x08, 3, 2, 3, 4) + data.tobytes()
    np.testing.assert_array_equal(parse_idx(raw), data)
    with pytest.raises(ValueError):
        parse_idx(raw[:-1])
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as fh:
        fh.write(raw)
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist("test", root=str(tmp_path))


def _write_idx_gz(path: Path, arr: np.ndarray) -> None:
    header = struct.pack(f">BBBB{arr.ndim}I", 0, 0, 0x08, arr.ndim, *arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


def test_loader_decodes_caches_and_invalidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny fake dataset: values scaled to [0, 1], second load served from the mmap cache, and a
    rewritten source file (new size/mtime) is picked up instead of the stale cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (6, 3, 2))
    _write_idx_gz(tmp_path / "t10k-images-idx3-ubyte.gz", imgs)
    _write_idx_gz(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(6) % 3)
    X, y = load_fashion_mnist("test", root=str(tmp_path))
    np.testing.assert_allclose(X, imgs.reshape(6, 6) / 255.0, rtol=1e-6)
    assert X.dtype == np.float32 and y.dtype == np.int64 and list(y) == [0, 1, 2, 0, 1, 2]
    X2, _ = load_fashion_mnist("test", root=str(tmp_path))
    assert isinstance(X2, np.memmap) and not X2.flags.writeable
    imgs2 = rng.integers(0, 256, (7, 3, 2))
    _write_idx_gz(tmp_path / "t10k-images-idx3-ubyte.gz", imgs2)
    _write_idx_gz(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(7) % 3)
    os.utime(tmp_path / "t10k-images-idx3-ubyte.gz", ns=(1, 1))  # force a different mtime
    X3, y3 = load_fashion_mnist("test", root=str(tmp_path))
    np.testing.assert_allclose(X3, imgs2.reshape(7, 6) / 255.0, rtol=1e-6)
    assert len(list((tmp_path / "cache" / "litz").glob("*.npy"))) == 2  # stale cache removed
    np.testing.assert_array_equal(load_fashion_mnist("test", root=str(tmp_path), cache=False)[1], y3)


def test_spectral_preconditioner_is_an_exact_reparameterization() -> None:
    """Weights trained on transformed features must give identical logits on raw features after
    weights_to_raw (the driver evaluates/serves raw-pixel models), and the top of the spectrum must
    actually be flattened (that is the point of it)."""
    rng = np.random.default_rng(7)
    n, d, K, r = 500, 30, 4, 5
    X = (rng.random((n, d)) * np.linspace(3.0, 0.1, d)).astype(np.float32)  # anisotropic features
    pre = fit_spectral_preconditioner(X, rank=r)
    Xp = pre.transform(X)
    assert Xp.dtype == np.float32 and Xp.shape == X.shape
    ev_raw = np.linalg.eigvalsh(np.cov(X.T.astype(np.float64)))[::-1]
    ev_pre = np.linalg.eigvalsh(np.cov(Xp.T.astype(np.float64)))[::-1]
    assert ev_pre[0] == pytest.approx(ev_raw[r], rel=1e-3)  # top r shrunk to the r-th eigenvalue
    np.testing.assert_allclose(ev_pre[r + 1 :], ev_raw[r + 1 :], rtol=1e-3)  # the rest untouched
    assert abs(float(Xp.mean())) < 1e-5  # centred
    Wp = rng.standard_normal((d + 1, K)).astype(np.float32)
    W_raw = pre.weights_to_raw(Wp)
    np.testing.assert_allclose(X @ W_raw[:-1] + W_raw[-1], Xp @ Wp[:-1] + Wp[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pre.weights_from_raw(W_raw), Wp, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        fit_spectral_preconditioner(X, rank=d)


@needs_fmnist
def test_fashion_mnist_shapes() -> None:
    X, y = load_fashion_mnist("test")
    assert X.shape == (10000, 784) and X.dtype == np.float32
    assert y.shape == (10000,) and y.dtype == np.int64
    assert 0.0 <= float(X.min()) and float(X.max()) == 1.0
    assert np.array_equal(np.bincount(y), np.full(10, 1000))


@needs_fmnist
def test_sgd_learns_fashion_mnist_subset() -> None:
    """3 epochs over 10k training rows must reach >= 0.78 test accuracy (typically ~0.81)."""
    X, y = load_fashion_mnist("train")
    Xt, yt = load_fashion_mnist("test")
    rows = partition_rows(X.shape[0], 6, 0)
    rng = np.random.default_rng(0)
    W = np.zeros((X.shape[1] + 1, 10), np.float32)
    first_loss = None
    for epoch in range(3):
        loss, _ = mk.sgd_steps(W, X, y, rng.permutation(rows), 32, mk.lr_at(epoch, 0.1, 0.5), 1e-4)
        first_loss = loss / len(rows) if first_loss is None else first_loss
    test_loss, test_acc = mk.evaluate(W, Xt, yt)
    assert test_acc >= 0.78
    assert test_loss < first_loss


def test_the_batch_kernels_count_no_references() -> None:
    """The batch loop and its kernels take row views and pass arrays to an inlined helper; with Numba's
    reference counts each cost an atomic increment and decrement, 7% of an epoch's time in a profile.
    Without them an epoch of Fashion-MNIST took 94.4-97.1 against 101-102 ms (the same steps up to
    float32 rounding)."""
    mk.warmup()
    rng = np.random.default_rng(0)
    X = rng.random((9, 5), dtype=np.float32)
    WT = np.zeros((3, 6), np.float32)
    mk._sgd_batches(WT, np.zeros((7, 3), np.float32), X, rng.integers(0, 3, 9), np.arange(9), 4, 0.1, 0.0)
    for kernel in (mk._sgd_batches, mk._logits, mk._apply_grad, mk._softmax_row):
        asm = machine_code(kernel)
        assert not counts_references(asm), kernel.__name__


def test_diverged_weights_are_a_clear_error_not_a_division_by_zero() -> None:
    """A learning rate of 1e30 made the logits NaN, every probability 0, and the kernel divided by
    their sum: ZeroDivisionError inside the task, with nothing to say why."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((16, 4)).astype(np.float32)
    y = rng.integers(0, 3, 16).astype(np.int64)
    W = np.full((5, 3), np.nan, np.float32)
    with pytest.raises(FloatingPointError, match=r"SGD diverged: .* use a smaller --lr"):
        mk.sgd_steps(W, X, y, np.arange(16, dtype=np.int64), 4, 1e30, 0.0)
