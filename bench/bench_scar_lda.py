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

Two experiments: killing 1, 2 or 3 of the 4 **workers** loses 1/4, 1/2 or 3/4 of the documents'
assignments (their sampling since the checkpoint is redone); killing 1, 2 or 3 of the 4 **servers**
loses count rows only, which the recount rebuilds from the assignments, so partial recovery redoes
nothing (the rows restored from the checkpoint do not matter, which is also why priority checkpoints
of the word-topic rows, SCAR's experiment B, have nothing to gain on LDA here).

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
[--only workers|servers]`` (10-20 s per run on 2 cores; the defaults make 2 × 65 runs). Results:
``bench/results/scar_lda_{workers,servers}.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_scar import ScarClock, loss_experiment, save

import litz
from apps import lda

ROOT = Path(__file__).resolve().parents[1]
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
             recovery: str = "partial", target: float | None = None) -> dict[str, Any]:
    app = lda.make_app(["--corpus", "fortunes", "--topics", "20", "--iterations", str(iterations), "--quiet"])
    app.driver = ScarLDADriver
    app.config.update(fail_at=fail_at, victims=list(victims), target=target)
    with tempfile.TemporaryDirectory(prefix="litz-scar-lda-") as ckpt:
        res = litz.run(app, workers=PROCESSES, servers=PROCESSES, num_executors=PROCESSES, checkpoint_dir=ckpt,
                       checkpoint_every=str(every), recovery=recovery)
    value = res.value
    value["recoveries"] = res.stats["master"]["recoveries"]
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10, help="repetitions per configuration")
    p.add_argument("--iterations", type=int, default=100, help="iterations of the failure-free run")
    p.add_argument("--every", type=int, default=16, help="C: iterations between full checkpoints")
    p.add_argument("--baselines", type=int, default=5, help="failure-free runs that set the target")
    p.add_argument("--only", choices=["workers", "servers"], default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scar_lda"))
    args = p.parse_args()
    run_once(3, args.every)  # tokenizes and caches the corpus, compiles the kernels: not part of any result
    for what in ("workers", "servers"):
        if args.only in (None, what):
            results = loss_experiment(run_once, args.iterations, args.every, args.reps, args.seed, what[0], what,
                                      WINDOW, args.baselines, target_at=0.6, fail_by=0.45)
            save(results, f"{args.out}_{what}",
                 f"SCAR on Litz: LDA (fortunes, K = 20), {PROCESSES} {what} of which some are lost,\n"
                 f"full checkpoint every {args.every} iterations", "iterations")


if __name__ == "__main__":
    sys.exit(main())
