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

import sys
from typing import Any

from bench_scar import ScarClock, loss_main, run_with_failures

import litz
from apps import mf

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
             recovery: str = "partial", target: float | None = None, **options: Any) -> dict[str, Any]:
    app = mf.make_app(["--iterations", str(iterations), "--quiet"])
    app.driver = ScarMFDriver
    return run_with_failures(app, every, fail_at=fail_at, victims=victims, recovery=recovery, target=target,
                             workers=PROCESSES, servers=PROCESSES, executors=8, **options)


if __name__ == "__main__":
    sys.exit(loss_main(__doc__, run_once, "mf", 40, 10, "SCAR on Litz: MF (ALS)"))
