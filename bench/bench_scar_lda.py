"""The SCAR experiment A on LDA (issue 4), with real killed processes.

LDA by collapsed Gibbs sampling (apps/lda.py, Debian fortunes, K = 20): 4 workers, 4 servers, 4
executors (one per worker, so 4 vocabulary blocks). The model is the topic of every token, which
lives in executor state with the documents' topic counts; the parameter-server tables (word-topic
counts, topic totals) are the histogram of those assignments. A full checkpoint is taken every C
iterations; at a failure iteration drawn at random (the same iterations for every configuration) the
driver sends SIGKILL to the victims, and the master recovers by itself:

* **full** recovery (Litz) rolls the whole job back to the last checkpoint;
* **partial** recovery (SCAR) restores only what the lost processes held from the checkpoint, on the
  survivors; nothing else rolls back. The driver then recounts the tables from the assignments
  (``LDADriver.recovered``), so they are exact again.

Experiment A: killing 1, 2 or 3 of the 4 **workers** loses 1/4, 1/2 or 3/4 of the documents'
assignments (their sampling since the checkpoint is redone); killing 1, 2 or 3 of the 4 **servers**
loses count rows only, which the recount rebuilds from the assignments, so partial recovery redoes
nothing (the rows restored from the checkpoint do not matter).

Experiment B (``--policies priority,round-robin,random``, with ``--only workers --lost 2``): partial
checkpoints of a fraction 1/d (d = 2, 4, 8) every C/d iterations after a first full one, 2 of 4
workers lost, partial recovery. The executors' documents are state rows (``LDAExecutor.state_rows``):
priority ranks them by the length-scaled total variation of their topic counts since they were
saved (SCAR's distance for LDA), round-robin by rounds since saved, random by chance; a restored
executor gets each document's newest copy. Results in ``scar_lda_workers_partial.*``.

**Rework**: iterations executed (redone ones included) until the log-likelihood per token, averaged
over 5 iterations, reaches the failure-free runs' mean at 60% of the training, minus the mean count
of the failure-free runs (failures strike between 1.25 C and 45% of the training). The target lies
earlier than MLR's and MF's 75%: later, the chain's log-likelihood rises so slowly that its own
fluctuations moved the failure-free runs' crossing by ±5 iterations. The sampler's random streams
are seeded per executor and round, but a failure-free run is still not deterministic: the topic
totals a task starts from are the driver's sum as of its dispatch, which depends on which other
tasks completed first. So several failure-free runs (``--baselines``) set the target, and their
spread is printed: the noise floor of a rework.

Run: ``python bench/bench_scar_lda.py [--reps 10] [--baselines 5] [--iterations 100] [--every 16]
[--only workers|servers] [--lost 1,2,3] [--policies ...]`` (5-10 s per run on 2 cores; the defaults
make 2 × 65 runs). Results: ``bench/results/scar_lda_{workers,servers}.json`` and ``.png``.
"""

from __future__ import annotations

import sys
from typing import Any

from bench_scar import ScarClock, loss_main, run_with_failures

from apps import lda

PROCESSES = 4  # workers and servers
WINDOW = 5  # iterations the log-likelihood is averaged over


class ScarLDADriver(ScarClock, lda.LDADriver):
    """LDA's driver with the experiment's clock: the objective is minus the log-likelihood per token
    reported after each iteration."""

    transient = ScarClock.scar_transient

    def dispatch_initial_tasks(self) -> None:
        self._scar_start()
        super().dispatch_initial_tasks()

    def _report(self, cycle: int, rep: dict[str, Any]) -> None:
        super()._report(cycle, rep)
        self._scar_clock(self.history[-1]["iteration"], -self.loglik, WINDOW)

    def result(self) -> dict[str, Any]:  # an early finish (ScarClock) at the target
        return {"loglik": self.loglik, "trace": self.trace, "executed": self.executed}

    def _finish(self) -> None:
        super()._finish()
        self._result.update(trace=self.trace, executed=self.executed)


def run_once(iterations: int, every: int, *, fail_at: int | None = None, victims: tuple[str, ...] = (),
             recovery: str = "partial", target: float | None = None, **options: Any) -> dict[str, Any]:
    app = lda.make_app(["--corpus", "fortunes", "--topics", "20", "--iterations", str(iterations), "--quiet"])
    app.driver = ScarLDADriver
    return run_with_failures(app, every, fail_at=fail_at, victims=victims, recovery=recovery, target=target,
                             workers=PROCESSES, servers=PROCESSES, executors=PROCESSES, **options)


if __name__ == "__main__":
    sys.exit(loss_main(__doc__, run_once, "lda", 100, 16, "SCAR on Litz: LDA (fortunes, K = 20)", window=WINDOW,
                       baselines=5, target_at=0.6, fail_by=0.45))
