"""The scripts in examples/ run as documented and compute what they say they compute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import litz
from litz.cli import load_app_module

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_sum_adds_every_partition_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    module = load_app_module(str(EXAMPLES / "sum.py"))
    res = litz.run(module.app, workers=2, servers=1)
    assert res.value.tolist() == [499500.0]  # every update counted once, none lost
    assert res.tasks_completed == 8
    assert capsys.readouterr().out.strip().splitlines()[-1] == "sum 499500"


@pytest.mark.parametrize("staleness", [0, 3])
def test_ssp_regression_recovers_the_true_weights(staleness: int) -> None:
    module = load_app_module(str(EXAMPLES / "ssp_regression.py"))
    app = module.make_app(["--iterations", "60", "--staleness", str(staleness), "--quiet"])
    res = litz.run(app, workers=2, servers=1, num_executors=4)
    truth = module.true_weights(app.config)
    assert res.tasks_completed == 60 * 4
    # noise 0.1 over 40,000 rows: least squares itself is about 0.001 away; untrained weights are 1.0 away
    assert res.value["error"] < 0.01, res.value["error"]
    np.testing.assert_allclose(res.value["weights"], truth, atol=0.02)


@pytest.mark.parametrize("workers, argv", [
    (2, ["--points", "3000", "--queries", "30", "--k", "6"]),
    (1, ["--points", "12", "--queries", "4", "--k", "5"]),  # fewer points per executor than k
])
def test_nearest_merges_partial_answers_into_the_exact_neighbours(workers: int, argv: list[str]) -> None:
    module = load_app_module(str(EXAMPLES / "nearest.py"))
    app = module.make_app([*argv, "--quiet"])
    res = litz.run(app, workers=workers, servers=2)
    assert res.value["agree"] == app.config["queries"]


def test_the_combiner_keeps_the_k_nearest_distinct_ids_in_any_order() -> None:
    module = load_app_module(str(EXAMPLES / "nearest.py"))
    k = 3
    empty = module.empty_row(None, (2 * k,), np.float64)
    a = np.array([1.0, 4.0, np.inf, 7, 9, -1])
    b = np.array([1.0, 2.0, 3.0, 7, 8, 5])  # offers 7 again, at the same distance
    ab, ba = module.keep_k_nearest(a, b), module.keep_k_nearest(b, a)
    np.testing.assert_array_equal(ab, [1.0, 2.0, 3.0, 7, 8, 5])
    np.testing.assert_array_equal(ab, ba)
    np.testing.assert_array_equal(module.keep_k_nearest(ab, ab), ab)  # idempotent
    np.testing.assert_array_equal(module.keep_k_nearest(empty, a), a)  # the empty row is the identity


def _litz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "litz.cli", *args], capture_output=True, text=True, timeout=120)


def test_examples_run_from_the_command_line_with_litz_options_before_or_after_the_file() -> None:
    script = str(EXAMPLES / "ssp_regression.py")
    for argv in (["launch", script, "--workers", "1", "--iterations", "4"],
                 ["launch", "--workers", "1", "--executors", "3", script, "--iterations", "4", "--servers", "2"]):
        out = _litz(*argv)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1].startswith("weight error")
        assert f"{4 * (3 if '--executors' in argv else 8)} micro-tasks" in out.stderr  # litz options were applied
    wrong = _litz("launch", "--iterations", "4", script)  # the app's options go after its file
    assert wrong.returncode == 2 and "unknown option(s) before" in wrong.stderr and "--iterations 4" in wrong.stderr
    bare = _litz("launch", "--workers", "1")
    assert bare.returncode == 2 and "name the application file" in bare.stderr


@pytest.mark.parametrize("recovery", ["partial", "full"])
def test_survive_kills_a_server_and_the_job_recovers_by_itself(tmp_path: Path, recovery: str) -> None:
    survive = load_app_module(str(EXAMPLES / "survive.py"))
    regression = load_app_module(str(EXAMPLES / "ssp_regression.py"))
    app = regression.make_app(["--iterations", "1000", "--quiet"])
    run = survive.run_with_a_kill(app, recovery, 20, str(tmp_path / "ckpt"))
    assert run["victim"] is not None, "the job ended before its first checkpoint"
    [rec] = run["recoveries"]
    assert (rec["lost"], rec["role"], rec["strategy"]) == (run["victim"]["id"], "server", recovery)
    if recovery == "partial":
        assert rec["restored"] == len(run["victim"]["shards"]) and rec["onto"] != [rec["lost"]]
    assert run["error"] < 0.01  # as good as without the failure (about 0.001)


def test_a_litz_option_value_that_starts_with_a_dash_is_its_value() -> None:
    """``--checkpoint-every -5s`` gives -5s to the option (which Litz then refuses with its own
    message: ``litz launch`` exits 1 naming the value), not "expected one argument" from argparse;
    an option followed by another option is still refused, and the app's own options are its own."""
    from litz.cli import _split_launch_args

    parsed = _split_launch_args(["app.py", "--checkpoint-every", "-5s", "--seed", "-1"])
    assert not isinstance(parsed, str)
    path, opts, app_argv = parsed
    assert (path, opts.checkpoint_every, app_argv) == ("app.py", "-5s", ["--seed", "-1"])
    with pytest.raises(SystemExit):
        _split_launch_args(["--job", "--workers", "2", "app.py"])
    with pytest.raises(SystemExit):  # an app's option name is not taken for a missing value either
        _split_launch_args(["app.py", "--job", "--epochs", "3"])
    parsed = _split_launch_args(["app.py", "--", "--job", "-x"])  # after --, all of it the app's, untouched
    assert not isinstance(parsed, str) and parsed[1].job is None and parsed[2] == ["--", "--job", "-x"]
