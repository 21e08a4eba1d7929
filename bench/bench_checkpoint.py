"""Cost of checkpoints (issue 4): the time per iteration with checkpoints against none.

* ``--app mlr`` (default): MLR, 2 workers, 1 server, 8 executors; a full checkpoint every
  epoch, and SCAR priority checkpoints of 1/8 of the rows every 2 clocks after a first full one
  (C = 20 clocks, one epoch), against none.
* ``--app lda``: LDA on fortunes (K = 20), 4 workers, 4 servers, 4 executors, the setting of
  ``bench_scar_lda.py``; a full checkpoint every 16 iterations, and SCAR priority checkpoints of
  1/8 of the rows (server rows and the executors' documents) every 2 iterations after a first
  full one, against none.

Runs alternate in one process (none, then each checkpoint setting, again and again) after a
warm-up run, and report the median time per epoch or iteration of each and its ratio to none;
for full checkpoints, how long training was held per checkpoint (pause until nothing runs +
in-memory copy) and how long a checkpoint took until its manifest was written (background
writes included). Partial rounds hold no task: a worker scores an executor's rows between two
of its tasks, which delays that executor's next task by the scoring.

``--storage s3`` checkpoints to a bucket on an S3 server started on a loopback port (moto's, as
the tests use: tests/s3_server.py) instead of a local temporary directory. That server is Python
and runs on the same cores as the job, so it measures what the job does while a store answers
slowly, not what a cloud bucket costs.

Run: ``python bench/bench_checkpoint.py [--app mlr|lda] [--repeats 3] [--storage local|s3]``
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # apps/ and tests/ from a checkout

import litz  # noqa: E402
from apps import lda, mlr  # noqa: E402

SETTINGS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "mlr": [("a full checkpoint every epoch", {"checkpoint_every": "20"}),  # 20 clocks = 1 epoch
            ("priority 1/8 every 2 clocks", {"checkpoint_every": "20", "checkpoint_policy": "priority",
                                              "checkpoint_fraction": 0.125})],
    "lda": [("a full checkpoint every 16 iterations", {"checkpoint_every": "16"}),
            ("priority 1/8 every 2 iterations", {"checkpoint_every": "16", "checkpoint_policy": "priority",
                                                 "checkpoint_fraction": 0.125})],
}


def one(app_name: str, length: int, options: dict[str, Any] | None,
        roots: Callable[[], contextlib.AbstractContextManager[str]] = tempfile.TemporaryDirectory) -> dict[str, float]:
    """One run: its median seconds per epoch (MLR) or iteration (LDA, after the 10th), its checkpoints
    (under a fresh root from ``roots``)."""
    kw: dict[str, Any] = {}
    with roots() as d:
        if options is not None:
            kw = {"checkpoint_dir": d, **options}
        if app_name == "mlr":
            res = litz.run(mlr.make_app(["--epochs", str(length), "--quiet"]), workers=2, servers=1, num_executors=8,
                           **kw)
            per = statistics.median(h["seconds"] for h in res.value["history"])
            quality = res.value["test_accuracy"]
        else:
            app = lda.make_app(["--corpus", "fortunes", "--topics", "20", "--iterations", str(length), "--quiet",
                                "--ll-every", "1"])
            res = litz.run(app, workers=4, servers=4, num_executors=4, **kw)
            h = res.value["history"]
            per = (h[-1]["elapsed"] - h[9]["elapsed"]) / (h[-1]["iteration"] - h[9]["iteration"])
            quality = res.value["loglik"]
    ckpts = [c for c in res.stats["master"]["checkpoints"] if c["ok"]]
    full = [c for c in ckpts if c["kind"] == "full"]
    partial = [c for c in ckpts if c["kind"] == "partial"]
    return {"per": per, "full": len(full), "partial": len(partial), "quality": quality,
            "paused": statistics.median(c["paused_seconds"] for c in full) if full else 0.0,
            "total": statistics.median(c["seconds"] for c in full) if full else 0.0,
            "partial_total": statistics.median(c["seconds"] for c in partial) if partial else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", choices=sorted(SETTINGS), default="mlr")
    ap.add_argument("--length", type=int, default=None, help="epochs (MLR, 16) or iterations (LDA, 100)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--storage", choices=["local", "s3"], default="local",
                    help="checkpoint to a local temporary directory or to an S3 server on a loopback port")
    args = ap.parse_args()
    roots: Callable[[], contextlib.AbstractContextManager[str]] = tempfile.TemporaryDirectory
    with contextlib.ExitStack() as stack:
        if args.storage == "s3":
            from tests import s3_server

            why = s3_server.unusable()
            if why:
                raise SystemExit(why)
            bucket = stack.enter_context(s3_server.s3_bucket("litz-bench"))
            runs = itertools.count()

            @contextlib.contextmanager
            def s3_root() -> Iterator[str]:
                yield s3_server.location(bucket, f"run-{next(runs)}")

            roots = s3_root
        measure(args, roots)


def measure(args: argparse.Namespace, roots: Callable[[], contextlib.AbstractContextManager[str]]) -> None:
    length = args.length or (16 if args.app == "mlr" else 100)
    unit = "epoch" if args.app == "mlr" else "iteration"
    one(args.app, 2 if args.app == "mlr" else 12, None, roots)  # warm-up: Numba cache, dataset cache
    runs: dict[str, list[dict[str, float]]] = {"none": []}
    for _ in range(args.repeats):
        runs["none"].append(one(args.app, length, None, roots))
        for name, options in SETTINGS[args.app]:
            runs.setdefault(name, []).append(one(args.app, length, options, roots))
    base = statistics.median(r["per"] for r in runs["none"])
    print(f"{args.app.upper()}, {length} {unit}s, {args.repeats} runs each, alternating; checkpoints on "
          f"{'an S3 server (moto, loopback)' if args.storage == 's3' else 'local disk'}")
    print(f"no checkpoints: {base:.4f} s/{unit} (quality {statistics.median(r['quality'] for r in runs['none']):.4f})")
    for name, _ in SETTINGS[args.app]:
        rs = runs[name]
        per = statistics.median(r["per"] for r in rs)
        med = {k: statistics.median(r[k] for r in rs) for k in ("full", "partial", "paused", "total",
                                                                  "partial_total", "quality")}
        print(f"{name}: {per:.4f} s/{unit}, ratio {per / base:.3f}; {med['full']:.0f} full checkpoints "
              f"(training held {med['paused'] * 1e3:.1f} ms each, manifest after {med['total'] * 1e3:.1f} ms)"
              + (f", {med['partial']:.0f} partial ones ({med['partial_total'] * 1e3:.1f} ms each, "
                 f"no task held)" if med["partial"] else "")
              + f"; quality {med['quality']:.4f}")


if __name__ == "__main__":
    main()
