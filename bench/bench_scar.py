"""The SCAR experiments (issue 4), with real killed processes: MLR on Fashion-MNIST.

Every run is a real job: 2 workers, 4 servers, 8 executors, the weight matrix in 64 row
blocks spread round-robin over the servers (a server holds every 4th block), checkpoints to
a temporary directory. At a failure clock drawn at random between 1.25 C (after the first
checkpoint) and 55% of the training (the same clocks for every configuration: paired), the
driver sends SIGKILL to 1, 2 or 3 servers (1/4, 1/2, 3/4 of the parameters); the master
notices and recovers by itself.

**Rework.** Each clock (SSP iteration) the driver evaluates the objective (cross-entropy on
5,000 training rows spread over all partitions) and counts the clocks it has *executed*,
redone ones included. The objective is averaged over the last 20 clocks (one epoch: it
oscillates within an epoch). Failure-free runs give the target: their mean averaged objective
at 75% of the training. Rework of a run = the clocks it executed until its averaged
objective reached the target (interpolated), minus the mean of the failure-free runs.
Full recovery reruns the clocks since the checkpoint; partial recovery keeps the
survivors' progress and pays only for the restored rows' staleness.

Experiments:

* **A, partial vs full recovery** with full checkpoints every C clocks, losing 1, 2, 3 of 4
  servers;
* **B, partial checkpoints**: priority, round-robin and random selection of a fraction r in
  {1/2, 1/4, 1/8} every r*C clocks (the same bytes per clock as a full checkpoint every C),
  losing 2 of 4 servers, partial recovery.

Reported: mean rework with a 95% interval (Student t) per configuration, the target check
(partial recovery with priority 1/8 against full recovery from full checkpoints, 1/2 lost:
SCAR reports 78-95% less rework), a JSON file and a plot.

Run: ``python bench/bench_scar.py [--reps 10] [--epochs 6] [--every 24] [--only A|B|key]``
(about 8 s per run on 2 cores; the default 10 repetitions make 150 runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import litz
from apps import mlr
from apps.mlr_kernels import evaluate

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVE_ROWS = 5000
SERVERS = 4
SMOOTHING = 20  # clocks (one epoch) the objective is averaged over


class ScarClock:
    """What the experiment adds to an app's driver (a mixin before it): the objective after every
    clock, the clocks executed (they survive a rollback: transient attributes are never
    restored), the kill at the failure clock and an early finish once the target is reached."""

    scar_transient = ("trace", "executed", "killed")

    def _scar_start(self) -> None:
        if not hasattr(self, "trace"):  # a rollback to the beginning dispatches the first tasks again
            self.trace: list[tuple[int, int, float]] = []
            self.executed = 0
            self.killed = False

    def _scar_clock(self, clock: int, objective: float, window: int) -> None:
        """Record clock ``clock`` (1-based) and its objective; finish once the objective averaged
        over ``window`` clocks reaches the target; kill the victims at the failure clock."""
        self.executed += 1
        self.trace.append((self.executed, clock, objective))
        cfg = self.config  # type: ignore[attr-defined]
        recent = [o for _, _, o in self.trace[-window:]]
        if cfg.get("target") is not None and len(recent) == window and sum(recent) / window <= cfg["target"]:
            self.finish(self.result())  # type: ignore[attr-defined]
            return
        if cfg.get("fail_at") and not self.killed and clock == cfg["fail_at"]:
            self.killed = True
            master = self._master  # type: ignore[attr-defined]  # the victims' pids are the master's
            assert master is not None
            for ident in cfg["victims"]:
                os.kill(master.procs[ident]["pid"], signal.SIGKILL)


class ScarDriver(ScarClock, mlr.MLRDriver):
    """MLR's driver with the experiment's clock (ScarClock) and, in failure-free runs, the weight
    rows every C clocks (for :func:`change_concentration`)."""

    transient = (*mlr.MLRDriver.transient, *ScarClock.scar_transient, "X_obj", "y_obj", "snapshots")

    def dispatch_initial_tasks(self) -> None:
        self._scar_start()
        if not hasattr(self, "snapshots"):
            self.snapshots: list[np.ndarray] = []
        self._load_objective()
        super().dispatch_initial_tasks()

    def resumed(self) -> None:
        self._load_objective()
        super().resumed()

    def _load_objective(self) -> None:
        # rows spread over every executor's partition: the objective has no periodic dip when
        # one executor's part of the epoch comes round (it had, with the first 5,000 rows)
        X, y = mlr.load_data(self.config["precondition_rank"])[:2]
        step = X.shape[0] // OBJECTIVE_ROWS
        self.X_obj = np.ascontiguousarray(X[::step][:OBJECTIVE_ROWS])
        self.y_obj = np.ascontiguousarray(y[::step][:OBJECTIVE_ROWS])

    def on_iteration_end(self, iteration: int, results: list[litz.TaskResult]) -> None:
        super().on_iteration_end(iteration, results)
        cfg = self.config
        if cfg.get("snapshot_every") and (iteration + 1) % cfg["snapshot_every"] == 0:
            self.snapshots.append(self.ps.get_many("W", range(cfg["blocks"])).copy())
        self._scar_clock(iteration + 1, evaluate(self.weights(), self.X_obj, self.y_obj)[0], SMOOTHING)

    def result(self) -> dict[str, Any]:
        out = super().result()
        out.update(trace=self.trace, executed=self.executed, snapshots=self.snapshots)
        return out


#: options of apps/mlr.py for every run (``--blocks`` and ``--mlr-args`` set them)
MLR_ARGS: list[str] = ["--blocks", "64"]


def run_once(epochs: int, every: int, *, fail_at: int | None = None, victims: tuple[str, ...] = (),
             recovery: str = "partial", target: float | None = None, **options: Any) -> dict[str, Any]:
    app = mlr.make_app(["--epochs", str(epochs), "--quiet", *MLR_ARGS])
    app.driver = ScarDriver
    app.config.update(snapshot_every=every if fail_at is None else 0)
    return run_with_failures(app, every, fail_at=fail_at, victims=victims, recovery=recovery, target=target,
                             workers=2, servers=SERVERS, executors=8, **options)


def run_with_failures(app: litz.App, every: int, *, fail_at: int | None, victims: tuple[str, ...], recovery: str,
                      target: float | None, workers: int, servers: int, executors: int,
                      **options: Any) -> dict[str, Any]:
    """Run ``app``, whose driver is a ScarClock, with checkpoints every ``every`` iterations in a
    temporary directory: its driver's value, with ``recoveries`` and ``wall`` (seconds)."""
    app.config.update(fail_at=fail_at, victims=list(victims), target=target)
    with tempfile.TemporaryDirectory(prefix=f"litz-scar-{app.name}-") as ckpt:
        res = litz.run(app, workers=workers, servers=servers, num_executors=executors, checkpoint_dir=ckpt,
                       checkpoint_every=str(every), recovery=recovery, **options)
    value = res.value
    value["recoveries"] = res.stats["master"]["recoveries"]
    value["checkpoints"] = [{k: c[k] for k in ("kind", "ok", "seconds", "paused_seconds")}
                            for c in res.stats["master"]["checkpoints"]]
    value["wall"] = res.elapsed
    return value


def loss_main(doc: str, run_once: Callable[..., dict[str, Any]], name: str, iterations: int, every: int,
              title: str, **experiment: Any) -> None:
    """The command line of an app's loss experiments (``loss_experiment``, workers then servers):
    ``--reps --iterations --every --only --seed --out``; results in ``bench/results/scar_NAME_*``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10, help="repetitions per configuration")
    p.add_argument("--iterations", type=int, default=iterations, help="iterations of a failure-free run")
    p.add_argument("--every", type=int, default=every, help="C: iterations between full checkpoints")
    p.add_argument("--only", choices=["workers", "servers"], default=None)
    p.add_argument("--lost", default="1,2,3", help="experiment A: how many of the 4 processes are lost")
    p.add_argument("--policies", default="",
                   help="experiment B: partial checkpoint policies (priority,round-robin,random) of 1/2, 1/4, 1/8, "
                        "2 of 4 lost; results in scar_NAME_WHAT_partial")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / f"scar_{name}"))
    if "baselines" in experiment:
        p.add_argument("--baselines", type=int, default=experiment.pop("baselines"),
                       help="failure-free runs that set the target")
    args = p.parse_args()
    run_once(3, args.every)  # loads and caches the data, compiles the kernels: not part of any result
    policies = tuple(p for p in args.policies.split(",") if p)
    for what in ("workers", "servers"):
        if args.only in (None, what):
            results = loss_experiment(run_once, args.iterations, args.every, args.reps, args.seed, what[0], what,
                                      baselines=getattr(args, "baselines", 1),
                                      lost=tuple(int(k) for k in args.lost.split(",") if k), policies=policies,
                                      **experiment)
            save(results, f"{args.out}_{what}{'_partial' if policies else ''}",
                 f"{title}, 4 {what} of which some are lost,\nfull checkpoint every {args.every} iterations"
                 f"{' (or a fraction 1/d every C/d)' if policies else ''}", "iterations")


def smoothed(trace: list[tuple[int, int, float]], window: int = SMOOTHING) -> list[tuple[int, float]]:
    """(clocks executed, objective averaged over the last ``window`` clocks). The objective
    oscillates within an epoch (20 clocks: each executor's data comes round in turn), which
    made the first crossing of a target jump by several clocks at a time."""
    obj = np.array([o for _, _, o in trace])
    if len(obj) < window:
        return []
    avg = np.convolve(obj, np.ones(window) / window, mode="valid")
    return [(trace[i + window - 1][0], float(avg[i])) for i in range(len(avg))]


def first_reaching(trace: list[tuple[int, int, float]], target: float, window: int = SMOOTHING) -> float | None:
    """Clocks executed until the smoothed objective reaches ``target`` (linear in between)."""
    prev = None
    for executed, obj in smoothed(trace, window):
        if obj <= target:
            if prev is None:
                return float(executed)
            (e0, o0) = prev
            return e0 + (executed - e0) * (o0 - target) / (o0 - obj)
        prev = (executed, obj)
    return None


def change_concentration(runs: list[list[np.ndarray]], fractions: tuple[float, ...] = (1 / 8, 1 / 2)
                         ) -> dict[str, float]:
    """Share of the squared change over C clocks held by the rows that changed most.

    Priority checkpoints pay off when a few rows carry most of the change (SCAR's premise): a
    fraction r of the rows saved r*C clocks apart then keeps the lost rows' distance small. If the
    change is spread evenly, every row is about as stale under any policy as under a full
    checkpoint, and only partial recovery itself can save work."""
    shares: dict[str, list[float]] = {f"top {f:g}": [] for f in fractions}
    for before, after in ((s[i - 1], s[i]) for s in runs for i in range(1, len(s))):
        d = np.sort(((after.astype(np.float64) - before) ** 2).reshape(len(after), -1).sum(1))[::-1]
        for f in fractions:
            shares[f"top {f:g}"].append(float(d[: max(1, round(f * len(d)))].sum() / d.sum()))
    return {k: statistics.fmean(v) for k, v in shares.items() if v}


def failure_free_target(runs: list[dict[str, Any]], at: int, window: int = SMOOTHING
                        ) -> tuple[float, list[float | None]]:
    """The target objective, the failure-free runs' mean at clock ``at`` (averaged over ``window``),
    and the clocks each run took to reach it (None: never)."""
    target = statistics.fmean(dict(smoothed(r["trace"], window))[at] for r in runs)
    return target, [first_reaching(r["trace"], target, window) for r in runs]


def interval(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (Student t)."""
    from scipy.stats import t

    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan
    return mean, float(t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10, help="repetitions per configuration")
    p.add_argument("--baselines", type=int, default=3, help="failure-free runs that set the target")
    p.add_argument("--epochs", type=int, default=6, help="epochs of the failure-free runs (20 clocks each)")
    p.add_argument("--every", type=int, default=24, help="C: clocks between full checkpoints")
    p.add_argument("--only", choices=["A", "B", "key", "staleness"], default=None,
                   help="A or B alone, key: only the two configurations of the target check, or staleness: "
                        "2 of 4 lost s clocks after a full checkpoint, full and partial recovery, per s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=64, help="row blocks of the weight table (785: one row per feature)")
    p.add_argument("--mlr-args", default="",
                   help="more options for apps/mlr.py, e.g. \"--batch-size 1024 --lr-decay 0\"")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scar"))
    args = p.parse_args()
    MLR_ARGS[:] = ["--blocks", str(args.blocks), *args.mlr_args.split()]
    rng = random.Random(args.seed)
    total = args.epochs * 20

    t0 = time.monotonic()
    baselines = [run_once(args.epochs, args.every) for _ in range(args.baselines)]
    at = round(0.75 * total)
    target, reach = failure_free_target(baselines, at)
    base = statistics.fmean(r for r in reach if r is not None)
    concentration = change_concentration([b["snapshots"] for b in baselines])
    print("share of the squared change over C clocks in the rows that changed most: "
          + ", ".join(f"{k} of the rows {100 * v:.0f}%" for k, v in concentration.items()), flush=True)
    print(f"target objective {target:.5f} (failure-free mean at clock {at} of {total}, averaged over 20 clocks); "
          f"failure-free runs reach it after {[round(r, 1) for r in reach if r]} clocks (mean {base:.1f}); "
          f"{time.monotonic() - t0:.0f} s",
          flush=True)

    if args.only == "staleness":
        staleness_experiment(args, target, base, t0)
        return
    configs: list[tuple[str, dict[str, Any]]] = []
    if args.only in (None, "A", "key"):
        for k in ((1, 2, 3) if args.only != "key" else (2,)):
            for recovery in (("full", "partial") if args.only != "key" else ("full",)):
                configs.append((f"A {recovery} recovery, {k}/4 lost",
                                {"victims": tuple(f"s{i}" for i in range(1, k + 1)), "recovery": recovery}))
    if args.only in (None, "B", "key"):
        configs += policy_configs(("s1", "s2"), ("priority", "round-robin", "random") if args.only != "key"
                                  else ("priority",), (2, 4, 8) if args.only != "key" else (8,), prefix="B ")
    # failures after the first checkpoint (before it, both strategies start from scratch)
    window = (round(1.25 * args.every), round(0.55 * total))
    # every configuration fails at the same clocks (paired): a failure early in training costs
    # more than a late one, and pairing keeps that from passing for a difference between them
    fail_clocks = [rng.randint(*window) for _ in range(args.reps)]
    results: dict[str, Any] = {"mlr_args": MLR_ARGS, "target": target, "baseline_clocks": reach, "epochs": args.epochs,
                               "baseline_traces": [[o for _, _, o in b["trace"]] for b in baselines],
                               "every": args.every, "failure_window": window, "fail_clocks": fail_clocks,
                               "change_concentration": concentration}
    results["configs"] = measure(run_once, configs, fail_clocks, 3 * args.epochs, args.every, target, base,
                                 SMOOTHING, "clocks", t0)
    key_cut(results, "A full recovery, 2/4 lost", "B priority 1/8, 2/4 lost")
    save(results, args.out, f"SCAR on Litz: MLR, 4 servers, full checkpoint every {results['every']} clocks\n"
                            f"(apps/mlr.py {' '.join(MLR_ARGS)})")


def staleness_experiment(args: argparse.Namespace, target: float, base: float, t0: float) -> None:
    """Rework against the age of the checkpoint: 2 of 4 servers lost s clocks after the second
    full checkpoint (clock 2C + s), full and partial recovery, ``--reps`` runs per s.

    Full recovery redoes the s clocks. If restored rows corrected themselves faster than the
    training moved them, partial recovery would cost less than s/2 (half the rows s clocks old);
    if they catch up only as fast as they moved, it costs s/2."""
    results: dict[str, Any] = {"mlr_args": MLR_ARGS, "target": target, "every": args.every, "configs": {}}
    for s in (3, 6, 12, 18):
        configs = [(f"s={s}, {recovery} recovery, 2/4 lost", {"victims": ("s1", "s2"), "recovery": recovery})
                   for recovery in ("full", "partial")]
        results["configs"].update(measure(run_once, configs, [2 * args.every + s] * args.reps, 3 * args.epochs,
                                          args.every, target, base, SMOOTHING, "clocks", t0))
    save(results, f"{args.out}_staleness", f"SCAR on Litz: MLR, 2 of 4 servers lost s clocks after a full "
                                           f"checkpoint (every {args.every})\n(apps/mlr.py {' '.join(MLR_ARGS)})")


def policy_configs(victims: tuple[str, ...], policies: tuple[str, ...], denominators: tuple[int, ...],
                   prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Experiment B's configurations: partial recovery from partial checkpoints of a fraction 1/d
    every C/d iterations (the same bytes per iteration as a full checkpoint every C), per policy."""
    lost = f"{len(victims)}/4 lost"
    return [(f"{prefix}{policy} 1/{d}, {lost}", {"victims": victims, "recovery": "partial",
                                                 "checkpoint_policy": policy, "checkpoint_fraction": 1 / d})
            for policy in policies for d in denominators]


def measure(run_once: Callable[..., dict[str, Any]], configs: list[tuple[str, dict[str, Any]]], fail_at: list[int],
            length: int, every: int, target: float, base: float, window: int, unit: str,
            t0: float) -> dict[str, Any]:
    """Run every configuration once per failure iteration (paired: the same ``fail_at`` for all)
    with ``run_once(length, every, fail_at=, target=, **config)``; per configuration, the rework of
    each run (iterations until the target minus the failure-free ``base``), its mean and 95%
    half-interval, the recovery seconds, the checkpoint rounds and the objective traces."""
    out: dict[str, Any] = {}
    for name, cfg in configs:
        reworks, seconds, traces, rounds = [], [], [], []
        for at_ in fail_at:
            res = run_once(length, every, fail_at=at_, target=target, **cfg)
            got = first_reaching(res["trace"], target, window)
            if got is None:
                raise SystemExit(f"{name}: the run never reached the target")
            reworks.append(got - base)
            seconds.append(sum(r["seconds"] for r in res["recoveries"]))
            traces.append([o for _, _, o in res["trace"]])
            rounds.append(res.get("checkpoints", []))
        mean, half = interval(reworks)
        out[name] = {"rework": reworks, "fail_at": list(fail_at), "recovery_seconds": seconds, "mean": mean,
                     "ci95": half, "objective_traces": traces, "checkpoints": rounds}
        print(f"{name:<38} rework {mean:7.2f} ± {half:5.2f} {unit}   recovery {statistics.fmean(seconds):.2f} s  "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    return out


def key_cut(results: dict[str, Any], full_key: str, prio_key: str) -> None:
    """The target check: partial recovery with priority 1/8 checkpoints against full recovery from
    full checkpoints, half lost (SCAR: 78-95% less rework; the issue asks >= 80%)."""
    cf = results["configs"]
    if full_key in cf and prio_key in cf:
        cut = 1 - cf[prio_key]["mean"] / cf[full_key]["mean"]
        results["priority_1_8_cut"] = cut
        print(f"partial recovery + priority 1/8 checkpoints vs full recovery + full checkpoints, 1/2 lost: "
              f"{100 * cut:.0f}% less rework (target >= 80%)")


def loss_experiment(run_once: Callable[..., dict[str, Any]], iterations: int, every: int, reps: int, seed: int,
                    prefix: str, what: str, window: int = 1, baselines: int = 1,
                    target_at: float = 0.75, fail_by: float = 0.55, lost: tuple[int, ...] = (1, 2, 3),
                    policies: tuple[str, ...] = ()) -> dict[str, Any]:
    """Experiments A and B for MF or LDA: ``baselines`` failure-free runs of ``iterations`` set the
    target, their mean objective (averaged over ``window`` iterations) at ``target_at`` of the
    training, and the failure-free count, the mean of the iterations they took to reach it (one is
    enough for a deterministic app, MF; LDA's chain is not: n_k as of a dispatch depends on which
    other tasks completed first); then, for each count in ``lost`` of 4 processes (``prefix`` 1..k:
    "w" for workers, "s" for servers), full and partial recovery from full checkpoints every
    ``every`` iterations and, with ``policies``, partial recovery from those policies' partial
    checkpoints of 1/2, 1/4 and 1/8 with 2 of 4 lost (experiment B), each at the same ``reps``
    failure iterations (paired, as in MLR's experiment), drawn between 1.25 C and ``fail_by`` of
    the training.

    ``run_once(iterations, every, fail_at=None, victims=(), recovery="partial", target=None,
    **options)`` runs one job and returns its driver's value with ``trace`` (see ScarClock),
    ``recoveries`` and ``checkpoints``. Prints one line per configuration; returns the results
    (``configs`` from :func:`measure`; ``partial_cut_half_lost``; ``priority_1_8_cut``)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    runs = [run_once(iterations, every) for _ in range(baselines)]
    at = round(target_at * iterations)
    target, reach = failure_free_target(runs, at, window)
    if None in reach:
        raise SystemExit("a failure-free run never reached the mean target: run them for longer")
    base = statistics.fmean(reach)
    noise = interval([r - base for r in reach])[1] if baselines > 1 else 0.0
    print(f"target objective {target:.5f} (the failure-free mean at iteration {at} of {iterations}"
          f"{f', averaged over {window}' if window > 1 else ''}); failure-free runs reach it after "
          f"{[round(r, 1) for r in reach]} iterations (±{noise:.2f}); {time.monotonic() - t0:.0f} s", flush=True)
    span = (round(1.25 * every), round(fail_by * iterations))
    fail_at = [rng.randint(*span) for _ in range(reps)]
    results: dict[str, Any] = {"target": target, "baseline_iterations": reach, "every": every,
                               "iterations": iterations, "failure_window": span, "fail_at": fail_at,
                               "window": window,
                               "baseline_checkpoints": [r.get("checkpoints", []) for r in runs]}
    configs = [(f"{recovery} recovery, {k}/4 {what} lost",
                {"victims": tuple(f"{prefix}{i}" for i in range(1, k + 1)), "recovery": recovery})
               for k in lost for recovery in ("full", "partial")]
    configs += policy_configs((f"{prefix}1", f"{prefix}2"), policies, (2, 4, 8))
    results["configs"] = measure(run_once, configs, fail_at, 3 * iterations, every, target, base, window,
                                 "iterations", t0)
    cf = results["configs"]
    full, partial = f"full recovery, 2/4 {what} lost", f"partial recovery, 2/4 {what} lost"
    if full in cf and partial in cf:
        results["partial_cut_half_lost"] = cut = 1 - cf[partial]["mean"] / cf[full]["mean"]
        print(f"partial vs full recovery, 2 of 4 {what} lost: {100 * cut:.0f}% less rework")
    key_cut(results, full, "priority 1/8, 2/4 lost")
    return results


def save(results: dict[str, Any], out: str, title: str, unit: str = "clocks") -> None:
    """Write the results as JSON and their plot as PNG next to it (``out`` without suffix)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, path.with_suffix(".png"), title, unit)
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.png')}")


def plot(results: dict[str, Any], path: Path, title: str, unit: str = "clocks") -> None:
    """Mean rework per configuration with its 95% interval; full recovery in blue, partial
    recovery from full checkpoints in orange, from partial checkpoints in green."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["configs"])
    means = [results["configs"][n]["mean"] for n in names]
    errs = [results["configs"][n]["ci95"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.5))
    ax.barh(range(len(names)), means, xerr=errs, color=["C0" if "full recovery" in n else
                                                        "C1" if "partial recovery" in n else "C2" for n in names])
    ax.set_yticks(range(len(names)), [n.removeprefix("A ").removeprefix("B ") for n in names])
    ax.invert_yaxis()
    ax.set_xlabel(f"rework ({unit} until the target objective, minus failure-free), mean and 95% interval")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
