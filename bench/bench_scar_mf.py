"""The SCAR experiment A on matrix factorization (issue 4), with real killed processes.

MF by ALS (apps/mf.py, MovieLens 100k, rank 10): 4 workers, 1 server, 8 executors. Executors own
the items, with their ratings and their factor rows (executor state); the parameter server holds
only the users' normal-equation sums of the current iteration (see apps/mf.py). So the model's
persistent parameters, the item factors, live in executor state, and losing a *worker* loses them:
killing 1, 2 or 3 of the 4 workers loses 1/4, 1/2 or 3/4 of the item factors. A full checkpoint
is taken every C iterations; at a failure iteration drawn at random between 1.25 C and 55% of the
training the driver sends SIGKILL to the victims, and the master recovers by itself:

* **full** recovery (Litz) rolls the whole job back to the last checkpoint;
* **partial** recovery (SCAR) restores only the lost executors from the checkpoint, on the
  surviving workers, and dispatches their tasks again; nothing else rolls back.

**Rework**: iterations executed (redone ones included) until the training RMSE reaches the
failure-free run's value at 75% of the training, minus the failure-free count. ALS is
deterministic here (up to the order of float additions), so one failure-free run sets the target.

Why partial recovery costs next to nothing on ALS: an item's factors are recomputed in every
iteration from the users' sums and the item's ratings alone, so the stale rows a restored executor
brings back are read once, to evaluate the previous model (that iteration's reported RMSE is off),
and then overwritten. The priority/round-robin/random experiment (B) does not apply to this app:
its parameter-server tables hold no persistent parameters to select from.

Run: ``python bench/bench_scar_mf.py [--reps 10] [--iterations 40] [--every 10]``
(about 10 s per run on 2 cores; the default makes 62 runs). Results: ``bench/results/scar_mf.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_scar import ScarClock, first_reaching, interval, plot

import litz
from apps import mf

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4


class ScarMFDriver(ScarClock, mf.MFDriver):
    """MF's driver with the experiment's clock: round ``t`` evaluates iteration ``t - 1``'s model, so
    the training RMSE of iteration ``t`` is recorded at the end of round ``t``."""

    transient = ScarClock.scar_transient

    def dispatch_initial_tasks(self) -> None:
        self._scar_start()
        super().dispatch_initial_tasks()

    def on_iteration_end(self, iteration: int, results: list[litz.TaskResult]) -> None:
        super().on_iteration_end(iteration, results)
        if iteration > 0:
            self._scar_clock(iteration, self.train_rmse, 1)

    def result(self) -> dict[str, Any]:
        out = super().result()
        out.update(trace=self.trace, executed=self.executed)
        return out


def run_once(iterations: int, every: int, *, fail_at: int | None = None, victims: tuple[str, ...] = (),
             recovery: str = "partial", target: float | None = None) -> dict[str, Any]:
    app = mf.make_app(["--iterations", str(iterations), "--quiet"])
    app.driver = ScarMFDriver
    app.config.update(fail_at=fail_at, victims=list(victims), target=target)
    with tempfile.TemporaryDirectory(prefix="litz-scar-mf-") as ckpt:
        res = litz.run(app, workers=WORKERS, servers=1, num_executors=8, checkpoint_dir=ckpt,
                       checkpoint_every=str(every), recovery=recovery)
    value = res.value
    value["recoveries"] = res.stats["master"]["recoveries"]
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10, help="repetitions per configuration")
    p.add_argument("--iterations", type=int, default=40, help="ALS iterations of the failure-free run")
    p.add_argument("--every", type=int, default=10, help="C: iterations between full checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scar_mf"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    t0 = time.monotonic()

    run_once(3, args.every)  # loads and caches MovieLens, compiles the kernels: not part of any result
    baseline = run_once(args.iterations, args.every)
    at = round(0.75 * args.iterations)
    target = dict((it, o) for _, it, o in baseline["trace"])[at]
    base = first_reaching(baseline["trace"], target, 1)
    assert base is not None
    print(f"target training RMSE {target:.5f} (the failure-free run's at iteration {at} of {args.iterations}); "
          f"{time.monotonic() - t0:.0f} s", flush=True)

    window = (round(1.25 * args.every), round(0.55 * args.iterations))
    results: dict[str, Any] = {"target": target, "baseline_iterations": base, "every": args.every,
                               "iterations": args.iterations, "failure_window": window, "configs": {}}
    for k in (1, 2, 3):
        for recovery in ("full", "partial"):
            name = f"{recovery} recovery, {k}/4 lost"
            reworks, fails, seconds = [], [], []
            for _ in range(args.reps):
                fail_at = rng.randint(*window)
                out = run_once(3 * args.iterations, args.every, fail_at=fail_at, target=target,
                               victims=tuple(f"w{i}" for i in range(1, k + 1)), recovery=recovery)
                got = first_reaching(out["trace"], target, 1)
                if got is None:
                    raise SystemExit(f"{name}: the run never reached the target")
                reworks.append(got - base)
                fails.append(fail_at)
                seconds.append(sum(r["seconds"] for r in out["recoveries"]))
            mean, half = interval(reworks)
            results["configs"][name] = {"rework": reworks, "fail_at": fails, "recovery_seconds": seconds,
                                        "mean": mean, "ci95": half}
            print(f"{name:<28} rework {mean:6.2f} ± {half:5.2f} iterations   recovery "
                  f"{statistics.fmean(seconds):.2f} s  ({time.monotonic() - t0:.0f} s)", flush=True)
    cf = results["configs"]
    cut = 1 - cf["partial recovery, 2/4 lost"]["mean"] / cf["full recovery, 2/4 lost"]["mean"]
    results["partial_cut_half_lost"] = cut
    print(f"partial vs full recovery, 1/2 of the item factors lost: {100 * cut:.0f}% less rework")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"),
         f"SCAR on Litz: MF (ALS), {WORKERS} workers, full checkpoint every {args.every} iterations", "iterations")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
