"""The MLR application end to end: multi-process training converges; the CLI runs it cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import litz
from apps import mlr
from tests.conftest import processes_mentioning

ROOT = Path(__file__).resolve().parent.parent
HAVE_DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists() or bool(
    os.environ.get("LITZ_FASHION_MNIST"))
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="Fashion-MNIST not installed (Debian dataset-fashion-mnist)")


@needs_data
def test_mlr_converges_on_a_slice_across_processes(etcd) -> None:
    app = mlr.make_app(["--train-rows", "12000", "--epochs", "3", "--quiet"])
    res = litz.run(app, workers=2, servers=2, num_executors=6, etcd=etcd.url)
    acc = res.value["test_accuracy"]
    assert acc >= 0.79, acc
    hist = res.value["history"]
    assert len(hist) == 3 and hist[-1]["train_loss"] < hist[0]["train_loss"]
    # the update log merged the executors' deltas before they left each worker
    assert res.total("update_rows_sent", "worker") < res.total("updates_logged", "worker")


def _litz(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "litz.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@needs_data
def test_litz_launch_main_example_reaches_accuracy_and_leaves_nothing() -> None:
    job = f"cli-mlr-{time.time_ns()}"
    proc = _litz("launch", "apps/mlr.py", "--workers", "2", "--job", job)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("epoch   1/") and "samples/s" in line for line in lines)
    last = lines[-1]
    assert last.startswith("test accuracy ")
    assert float(last.split()[-1]) >= 0.84
    assert processes_mentioning(job) == []


def test_litz_launch_app_help_and_bad_etcd() -> None:
    proc = _litz("launch", "apps/mlr.py", "--help")
    assert proc.returncode == 0 and "--staleness" in proc.stdout
    proc = _litz("launch", "apps/mlr.py", "--etcd", "http://127.0.0.1:9", "--epochs", "1", timeout=60)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot reach etcd" in err[0] and "127.0.0.1:9" in err[0], proc.stderr


@pytest.mark.parametrize(("app", "env", "package"), [("mlr", "LITZ_FASHION_MNIST", "dataset-fashion-mnist"),
                                                    ("lda --corpus wordnet", "LITZ_WORDNET", "wordnet-base"),
                                                    ("lda", "LITZ_FORTUNES", "fortunes")])
def test_a_missing_data_set_is_refused_in_one_line_before_the_job_starts(monkeypatch, app: str, env: str,
                                                                          package: str) -> None:
    """Which package to install, in one line, and nothing started. Before, MLR's job started its
    etcd and processes, and each worker failed to initialise its executors with a traceback; LDA
    printed make_app's traceback around the same sentence."""
    monkeypatch.setenv(env, "/nonexistent-data")
    name, *argv = app.split()
    started = time.monotonic()
    proc = _litz("launch", f"apps/{name}.py", *argv, timeout=60)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "/nonexistent-data" in err[0] and "apt-get install" in err[0] \
        and package in err[0], proc.stderr
    assert "initialisation failed" not in err[0] and time.monotonic() - started < 20


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--epochs", "-2"], "--epochs must be a positive integer, got -2"),
    (["--staleness", "-1"], "--staleness must be at least 0, got -1"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),  # diverged to a division by zero in a task
    (["--l2", "-0.1"], "--l2 must be a number >= 0, got -0.1"),
    (["--lr-decay", "nan"], "--lr-decay must be a number >= 0, got nan"),
    (["--blocks", "786"], "--blocks must not exceed the 785 weight rows"),
    (["--train-rows", "80", "--tasks-per-epoch", "2000"], "--tasks-per-epoch (2000) must not exceed --train-rows (80)"),
    (["--precondition-rank", "900"], "--precondition-rank must be below 784, got 900"),
])
def test_bad_options_are_refused_before_the_job_starts(argv: list[str], message: str) -> None:
    """Checked in make_app (no data is loaded): before, a batch size of 0 failed every task with a
    traceback, a negative learning rate trained to 6% accuracy, a rank of 900 failed the workers."""
    with pytest.raises(litz.ConfigError, match=re.escape(message)):
        mlr.make_app(argv)


def test_rows_per_task_sets_the_clocks_from_the_rows_there_are() -> None:
    """``--rows-per-task`` makes ``--tasks-per-epoch`` irrelevant (its default of 20 refused 16 training
    rows), and counts only the training rows there are (100,000 asked for: 1,000 tasks of 60 rows)."""
    for rows, per_task, clocks in (("16", "2", 1), ("100000", "100", 75), ("60000", "100", 75)):
        app = mlr.make_app(["--train-rows", rows, "--rows-per-task", per_task, "--epochs", "1"])
        driver = app.driver()
        driver._bind(None, 8, app.config)  # type: ignore[arg-type]
        driver.dispatch_task = lambda *a, **k: None  # type: ignore[method-assign]
        driver.dispatch_initial_tasks()
        assert driver.T == clocks, (rows, driver.T)


def test_quiet_leaves_out_progress_but_not_the_result_line(capsys) -> None:
    """``--quiet`` dropped the ``test accuracy`` line too (every app's result line): now only progress."""
    app = mlr.make_app(["--quiet", "--epochs", "1"])
    driver = app.driver()
    driver._bind(None, 8, app.config)  # type: ignore[arg-type]
    driver.test_accuracy, driver.history, driver._start, driver.devices = 0.875, [], time.perf_counter(), set()
    driver.result()
    assert capsys.readouterr().out == "test accuracy 0.8750\n"
