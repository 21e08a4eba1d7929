"""The SCAR experiment A on matrix factorization (issue 4), with real killed processes.

MF by ALS (apps/mf.py, MovieLens 100k, rank 10): 4 workers, 4 servers, 8 executors. Executors own
the items, with their ratings and their factor rows (executor state); the parameter server holds
only the users' normal-equation sums of the current iteration (see apps/mf.py). A full checkpoint is
taken every C iterations; at a failure iteration drawn at random between 1.25 C and 55% of the
training (the same iterations for every configuration) the driver sends SIGKILL to the victims, and
the master recovers by itself:

* **full** recovery (Litz) rolls the whole job back to the last checkpoint;
* **partial** recovery (SCAR) restores only what the lost processes held from the checkpoint, on the
  survivors; nothing else rolls back.

Two experiments. Killing 1, 2 or 3 of the 4 **workers** loses 1/4, 1/2 or 3/4 of the item factors,
the model's persistent parameters. Killing 1, 2 or 3 of the 4 **servers** loses that share of the
current iteration's user sums; the driver then has every executor push its sums again and reruns the
round (``MFDriver.recovered``).

**Rework**: iterations executed (redone ones included) until the training RMSE reaches the
failure-free run's value at 75% of the training, minus the failure-free count. ALS is deterministic
here (up to the order of float additions), so one failure-free run sets the target.

Why partial recovery costs next to nothing on ALS: an item's factors are recomputed in every
iteration from the users' sums and the item's ratings alone, so the stale rows a restored executor
brings back are read once, to evaluate the previous model (that iteration's reported RMSE is off),
and then overwritten; and a server's sums are rebuilt from the executors' rows. The
priority/round-robin/random experiment (B) does not apply to this app: its parameter-server tables
hold no persistent parameters to select from.

Run: ``python bench/bench_scar_mf.py [--reps 10] [--iterations 40] [--every 10] [--only workers|servers]``
(about 10 s per run on 2 cores; the default makes 2 × 61 runs). Results:
``bench/results/scar_mf_{workers,servers}.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_scar import ScarClock, loss_experiment, save

import litz
from apps import mf

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 4  # workers and servers


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
        res = litz.run(app, workers=PROCESSES, servers=PROCESSES, num_executors=8, checkpoint_dir=ckpt,
                       checkpoint_every=str(every), recovery=recovery)
    value = res.value
    value["recoveries"] = res.stats["master"]["recoveries"]
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10, help="repetitions per configuration")
    p.add_argument("--iterations", type=int, default=40, help="ALS iterations of the failure-free run")
    p.add_argument("--every", type=int, default=10, help="C: iterations between full checkpoints")
    p.add_argument("--only", choices=["workers", "servers"], default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scar_mf"))
    args = p.parse_args()
    run_once(3, args.every)  # loads and caches MovieLens, compiles the kernels: not part of any result
    for what in ("workers", "servers"):
        if args.only in (None, what):
            results = loss_experiment(run_once, args.iterations, args.every, args.reps, args.seed, what[0], what)
            save(results, f"{args.out}_{what}", f"SCAR on Litz: MF (ALS), {PROCESSES} {what} of which some are "
                 f"lost,\nfull checkpoint every {args.every} iterations", "iterations")


if __name__ == "__main__":
    sys.exit(main())
