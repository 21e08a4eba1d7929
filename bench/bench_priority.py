"""Priority scheduling (Litz §4.5.2, scaled down): elastic scale-in against kill-and-restart.

A low-priority MLR job L runs on 4 workers. At ~30% of its training a high-priority job H
needs one worker's worth of resources until it finishes. Two ways to make room, in one run:

* **elastic**: ``litz scale --workers 3`` on L, H runs (1 worker), then ``litz scale --workers 4``;
  L never stops.
* **kill and restart**: L (a ``litz launch`` process) is stopped, H runs, L starts again on 4
  workers. Litz has no checkpoints yet (issue 4), so L starts over; the line "restart from a
  checkpoint taken at the kill" is computed, not measured: the time until the kill, plus H,
  plus a fresh start-up, plus static L's time for the remaining epochs.

Reported: L's completion time from its start, and H's run time, for each way.

Run: ``python bench/bench_priority.py [--epochs 100] [--h-epochs 15]``
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import litz
from apps import mlr
from litz.cli import job_status, scale

ROOT = Path(__file__).resolve().parents[1]


def _epoch(job: str) -> int:
    try:
        progress = job_status(job)["master"].get("progress", "")
    except litz.LitzError:
        return -1
    return int(progress.split()[1].split("/")[0]) if progress.startswith("epoch ") else -1


def _run_h(h_epochs: int) -> float:
    t0 = time.monotonic()
    litz.run(mlr.make_app(["--epochs", str(h_epochs), "--quiet"]), workers=1, num_executors=4)
    return time.monotonic() - t0


def static(epochs: int) -> float:
    t0 = time.monotonic()
    litz.run(mlr.make_app(["--epochs", str(epochs), "--quiet"]), workers=4, num_executors=8)
    return time.monotonic() - t0


def elastic(epochs: int, at: int, h_epochs: int) -> dict[str, float]:
    job = f"bench-prio-{time.time_ns()}"
    out: dict = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.update(res=litz.run(
        mlr.make_app(["--epochs", str(epochs), "--quiet"]), workers=4, num_executors=8, job=job)))
    t.start()
    while _epoch(job) < at:
        time.sleep(0.01)
    assert scale(["--job", job, "--workers", "3", "--wait", "--timeout", "60"]) == 0
    h = _run_h(h_epochs)
    if t.is_alive():
        assert scale(["--job", job, "--workers", "4"]) == 0, "L finished before H: give L more epochs"
    t.join()
    return {"total": time.monotonic() - t0, "h": h}


def kill_restart(epochs: int, at: int, h_epochs: int) -> dict[str, float]:
    job = f"bench-prio-kill-{time.time_ns()}"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "litz.cli", "launch", str(ROOT / "apps" / "mlr.py"), "--workers", "4",
           "--executors", "8", "--job", job, "--epochs", str(epochs), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while _epoch(job) < at:
        time.sleep(0.01)
    killed_at = time.monotonic() - t0
    proc.send_signal(signal.SIGINT)  # the launcher stops its processes and its etcd
    proc.wait(30)
    h = _run_h(h_epochs)
    static(epochs)
    return {"total": time.monotonic() - t0, "h": h, "killed_at": killed_at}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--h-epochs", type=int, default=15)
    args = ap.parse_args()
    os.environ.setdefault("LITZ_JOBS_DIR", tempfile.mkdtemp(prefix="litz-jobs-"))
    at = max(1, round(0.3 * args.epochs))
    base = static(args.epochs)
    el = elastic(args.epochs, at, args.h_epochs)
    kr = kill_restart(args.epochs, at, args.h_epochs)
    ckpt = kr["killed_at"] + kr["h"] + base * (args.epochs - at) / args.epochs
    print(f"L: MLR {args.epochs} epochs on 4 workers, alone: {base:.2f} s (with start-up); "
          f"H: MLR {args.h_epochs} epochs on 1 worker, arriving at L's epoch {at}")
    print(f"elastic (4 -> 3 -> 4): L done after {el['total']:.2f} s, H took {el['h']:.2f} s")
    print(f"kill and restart from scratch: L done after {kr['total']:.2f} s, H took {kr['h']:.2f} s; "
          f"elastic / kill-restart = {el['total'] / kr['total']:.2f}")
    print(f"restart from a checkpoint taken at the kill (computed): {ckpt:.2f} s; elastic / that = "
          f"{el['total'] / ckpt:.2f}")


if __name__ == "__main__":
    main()
