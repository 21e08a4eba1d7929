"""Priority scheduling (Litz §4.5.2, scaled down): elastic scale-in against kill-and-restart.

A low-priority MLR job L runs on 4 workers. At ~30% of its training a high-priority job H
needs one worker's worth of resources until it finishes. Two ways to make room, in one run:

* **elastic**: ``litz scale --workers 3`` on L, H runs (1 worker), then ``litz scale --workers 4``;
  L never stops.
* **kill and restart**: L (a ``litz launch`` process) is stopped, H runs, and the same command
  starts L again on 4 workers, from scratch.
* **preempt and resume**: L (``litz launch --checkpoint-dir D --resume auto``) gets SIGTERM, as a
  scheduler sends before it takes the machines: it stops after a consistent checkpoint (exit 75),
  H runs, and the same command line resumes L from that checkpoint.

Reported: L's completion time from its start, and H's run time, for each way. The elastic run
learns the switch epoch from its driver (a byte on a pipe, ``bench_scale.TriggeredMLRDriver``):
polling the job's status every 10 ms from the master's process slowed L before the switch. The
other two poll the status of a job in another process every 50 ms.

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
from typing import Any

from bench_scale import triggered, wait_for_epoch

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
    out: dict[str, Any] = {}
    app = mlr.make_app(["--epochs", str(epochs), "--quiet"])
    trigger, fired = triggered(app, at)
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.update(res=litz.run(app, workers=4, num_executors=8, job=job)))
    t.start()
    wait_for_epoch(trigger, t, at)
    assert scale(["--job", job, "--workers", "3", "--wait", "--timeout", "60"]) == 0
    h = _run_h(h_epochs)
    if t.is_alive():
        assert scale(["--job", job, "--workers", "4"]) == 0, "L finished before H: give L more epochs"
    t.join()
    os.close(fired)
    return {"total": time.monotonic() - t0, "h": h}


def _launch_l(job: str, epochs: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "litz.cli", "launch", str(ROOT / "apps" / "mlr.py"), "--workers", "4",
            "--executors", "8", "--job", job, "--epochs", str(epochs), "--quiet", *extra]


def _until_epoch(job: str, at: int, proc: subprocess.Popen[bytes]) -> None:
    while _epoch(job) < at:
        if proc.poll() is not None:
            raise RuntimeError(f"L exited with {proc.returncode} before epoch {at}")
        time.sleep(0.05)


def kill_restart(epochs: int, at: int, h_epochs: int) -> dict[str, float]:
    job = f"bench-prio-kill-{time.time_ns()}"
    t0 = time.monotonic()
    proc = subprocess.Popen(_launch_l(job, epochs), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _until_epoch(job, at, proc)
    killed_at = time.monotonic() - t0
    proc.send_signal(signal.SIGINT)  # the launcher stops its processes and its etcd
    proc.wait(30)
    h = _run_h(h_epochs)
    subprocess.run(_launch_l(job, epochs), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600, check=True)  # started again as a scheduler would: the same command
    return {"total": time.monotonic() - t0, "h": h, "killed_at": killed_at}


def preempt_resume(epochs: int, at: int, h_epochs: int) -> dict[str, float]:
    """SIGTERM to L's launcher (it stops after a checkpoint, exit 75), H, then L's same command line,
    which resumes from that checkpoint (``--resume auto``)."""
    job = f"bench-prio-ckpt-{time.time_ns()}"
    cmd = _launch_l(job, epochs, "--checkpoint-dir", tempfile.mkdtemp(prefix="litz-prio-ckpt-"), "--resume", "auto")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _until_epoch(job, at, proc)
    preempted_at = time.monotonic() - t0
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 75:
        raise RuntimeError(f"L exited with {proc.returncode} on SIGTERM, not 75 (stopped after a checkpoint): "
                           f"{err.decode(errors='replace')[-2000:]}")
    stopped = time.monotonic() - t0 - preempted_at
    h = _run_h(h_epochs)
    again = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    if again.returncode != 0:
        raise RuntimeError(f"L's resumed run exited with {again.returncode}: "
                           f"{again.stderr.decode(errors='replace')[-2000:]}")
    return {"total": time.monotonic() - t0, "h": h, "preempted_at": preempted_at, "stop_seconds": stopped}


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
    pr = preempt_resume(args.epochs, at, args.h_epochs)
    print(f"L: MLR {args.epochs} epochs on 4 workers, alone: {base:.2f} s (with start-up); "
          f"H: MLR {args.h_epochs} epochs on 1 worker, arriving at L's epoch {at}")
    print(f"elastic (4 -> 3 -> 4): L done after {el['total']:.2f} s, H took {el['h']:.2f} s")
    print(f"kill and restart from scratch: L done after {kr['total']:.2f} s, H took {kr['h']:.2f} s; "
          f"elastic / kill-restart = {el['total'] / kr['total']:.2f}")
    print(f"preempt (SIGTERM: checkpoint, stop) and resume: L done after {pr['total']:.2f} s, H took "
          f"{pr['h']:.2f} s, the stop {pr['stop_seconds']:.2f} s; elastic / preempt-resume = "
          f"{el['total'] / pr['total']:.2f}")


if __name__ == "__main__":
    main()
