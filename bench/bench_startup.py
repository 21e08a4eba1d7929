"""How long a job takes to start and to end, phase by phase (``python bench/bench_startup.py``).

A job of 20 empty tasks on 2 workers and 1 server, run repeatedly, with its private etcd
(``litz launch`` without ``--etcd``) and with an etcd already running (``--etcd URL``). Each
phase is timed from the start of ``litz.run``:

- ``cluster``: the launcher spawned the processes (and, embedded, started etcd);
- ``registered``: every process registered in etcd (its Python imports are most of this);
- ``ready``: the servers and workers received the tables and the application;
- ``finished``: the driver finished;
- ``returned``: the processes exited and ``litz.run`` returned.

It also reports ``cpu``: the CPU seconds of the job's other processes (workers, servers, and the
private etcd when there is one, and the spawner: its imports are in the first job's),
from the start of ``litz.run`` to its return.

``--kernels`` has the executors load Numba kernels (MLR's, cached) before their first task, and the
measuring process import them, as an application with kernels does: the spawner then initialises Numba
once, and every forked worker inherits it.

``--compare PATH`` runs the same measurement with the Litz checkout at PATH, alternating with
this one in separate processes, and prints the ratio of the medians (this machine is shared:
only side-by-side numbers compare). ``--spawn`` alternates this checkout's two ways of starting
processes instead: forked from a process that imported Litz once (the default) and fresh
interpreters (``LITZ_SPAWN=exec``). The spawner stays for a process's later jobs, so the jobs after
the warm-up are forked without waiting for its imports; ``--first`` times each process's first
job instead (``--repeats`` processes), which is what ``litz launch`` pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(repeats: int, embedded: bool, first: bool = False, kernels: bool = False) -> dict[str, list[float]]:
    """Run the trivial job ``repeats`` times (after one warm-up run); each phase's times in seconds.
    ``first``: time only the first job of this process instead (what ``litz launch`` pays).
    ``kernels``: the executors load Numba kernels first (MLR's, cached), and this process imports Numba,
    as an application with kernels does."""
    import resource

    import litz
    from litz.runtime import launcher, master
    from litz.runtime.etcd_server import LocalEtcd
    from tests import testapps

    if kernels:
        import apps.mlr_kernels  # noqa: F401 - the launcher of such an app has them (and Numba) loaded
    marks: dict[str, float] = {}
    t0 = [0.0]

    def mark_after(cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        def timed(self: object, *args: object, **kwargs: object) -> object:
            try:
                return original(self, *args, **kwargs)
            finally:
                marks[label] = time.perf_counter() - t0[0]

        setattr(cls, name, timed)

    mark_after(launcher.LocalCluster, "start", "cluster")
    mark_after(master.Master, "_wait_for_processes", "registered")
    mark_after(master.Master, "_initialise", "ready")
    mark_after(master.Master, "run", "finished")
    phases: dict[str, list[float]] = {k: [] for k in ("cluster", "registered", "ready", "finished", "returned",
                                                       "cpu")}

    def children_cpu() -> float:  # forked ones are the spawner's children, which it reaps and counts
        use = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            from litz.runtime import spawner
        except ImportError:  # --compare with a checkout from before the spawner: every process is a child
            return use.ru_utime + use.ru_stime
        return use.ru_utime + use.ru_stime + spawner.cpu_seconds()

    etcd = None if embedded else LocalEtcd()
    try:
        if etcd is not None:
            etcd.start()
        kw = {} if etcd is None else {"etcd": etcd.url}
        for i in range(1 if first else repeats + 1):
            marks.clear()
            cpu0 = children_cpu()
            t0[0] = time.perf_counter()
            litz.run(testapps.sum_app(rows=4, tasks=20, executors=2, kernels=kernels), workers=2, servers=1, **kw)
            marks["returned"] = time.perf_counter() - t0[0]
            marks["cpu"] = children_cpu() - cpu0  # they were all reaped when litz.run returned
            if i or first:  # the first run warms the caches
                for k in phases:
                    phases[k].append(marks[k])
    finally:
        if etcd is not None:
            etcd.stop()
    return phases


def child(root: str, repeats: int, embedded: bool, spawn: str = "fork", first: bool = False,
          kernels: bool = False) -> dict[str, list[float]]:
    """``measure`` in a fresh Python process importing Litz from ``root`` (``spawn``: ``LITZ_SPAWN``);
    with ``first``, ``repeats`` such processes, each timing its first job."""
    env = {**os.environ, "PYTHONPATH": root, "LITZ_SPAWN": spawn}
    code = (f"import json, sys; sys.path.insert(0, {root!r}); sys.path.insert(1, {str(ROOT / 'bench')!r}); "
            f"import bench_startup; "
            f"print(json.dumps(bench_startup.measure({repeats}, {embedded}, {first}, {kernels})))")
    runs = []
    for _ in range(repeats if first else 1):
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: [v for run in runs for v in run[k]] for k in runs[0]}


def report(label: str, phases: dict[str, list[float]]) -> None:
    cells = "  ".join(f"{k} {statistics.median(v) * 1e3:4.0f}" for k, v in phases.items())  # cpu: ms too
    print(f"{label:<28} median ms: {cells}  (min returned {min(phases['returned']) * 1e3:.0f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="alternations with --compare")
    p.add_argument("--compare", metavar="PATH", help="another Litz checkout to run side by side")
    p.add_argument("--spawn", action="store_true", help="alternate forked processes with fresh interpreters")
    p.add_argument("--first", action="store_true",
                   help="time each process's first job (as litz launch runs), not its later ones")
    p.add_argument("--kernels", action="store_true",
                   help="executors load Numba kernels before their first task, as an application's do")
    args = p.parse_args()
    opts = {"first": args.first, "kernels": args.kernels}
    for embedded in (True, False):
        kind = ("private etcd" if embedded else "etcd already running") + (", first job" if args.first else "") \
            + (", kernels" if args.kernels else "")
        if args.spawn:
            for _ in range(args.rounds):
                forked = child(str(ROOT), args.repeats, embedded, "fork", **opts)
                fresh = child(str(ROOT), args.repeats, embedded, "exec", **opts)
                report(f"{kind}, forked", forked)
                report(f"{kind}, LITZ_SPAWN=exec", fresh)
                ratios = (f"{k} {statistics.median(fresh[k]) / statistics.median(forked[k]):.2f}"
                          for k in ("returned", "cpu"))
                print("  exec / fork: " + ", ".join(ratios))
            continue
        if not args.compare:
            report(kind, child(str(ROOT), args.repeats, embedded, **opts))
            continue
        for _ in range(args.rounds):
            this = child(str(ROOT), args.repeats, embedded, **opts)
            other = child(args.compare, args.repeats, embedded, **opts)
            report(f"{kind}, this", this)
            report(f"{kind}, {Path(args.compare).name}", other)
            ratio = statistics.median(other["returned"]) / statistics.median(this["returned"])
            print(f"  {Path(args.compare).name} / this = {ratio:.2f}")


if __name__ == "__main__":
    main()
