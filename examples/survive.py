"""Kill a parameter server with SIGKILL in the middle of a job and watch the job recover by itself.

Runs ``ssp_regression.py`` (least squares by SSP SGD, in this folder) on the embedded local
cluster with 2 servers, a checkpoint every ``--every`` iterations under ``--checkpoint-dir``
(a temporary one by default) and ``--recovery partial`` (SCAR) or ``full`` (Litz). Once the
first checkpoint is complete, it kills one server with ``kill -9``: no goodbye, no flush. The
master notices the death (through the node agent, or the lease when the host is remote),
then

* ``partial``: restores only that server's shards, from the running checkpoint, onto the
  surviving server; every other weight keeps its live value and the driver goes on;
* ``full``: rolls the whole job back to the checkpoint and replays from there.

Either way the job finishes on its own. The script prints the recovery as ``litz status`` shows
it and the final weight error, next to that of the same job run without a failure.

    python examples/survive.py [--recovery partial|full] [--every 50] [--iterations 600]

The same from the shell, killing the server by hand (``litz status`` shows its pid):

    litz launch --job demo --servers 2 --checkpoint-dir /tmp/ckpt --checkpoint-every 50 \\
        --recovery partial examples/ssp_regression.py --iterations 5000 &
    litz status --job demo; kill -9 <a server's pid>; litz status --job demo
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import litz
from litz.cli import job_status, load_app_module

HERE = Path(__file__).resolve().parent


def run_with_a_kill(app: litz.App, recovery: str, every: int, checkpoint_dir: str) -> dict[str, Any]:
    """Run ``app`` on a thread, SIGKILL one of its servers after its first checkpoint, return what happened."""
    job = f"survive-{os.getpid()}"
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = litz.run(app, workers=2, servers=2, job=job, checkpoint_dir=checkpoint_dir,
                                     checkpoint_every=str(every), recovery=recovery)
        except BaseException as exc:  # shown by the caller
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    victim = None
    while thread.is_alive() and victim is None:  # wait for a complete checkpoint, then strike
        try:
            status = job_status(job)
        except litz.LitzError:  # not started yet
            status = None
        if status and any(c.get("ok") for c in status["master"].get("checkpoints", [])):
            servers = [p for p in status["processes"] if p["role"] == "server" and p.get("state") == "member"]
            victim = servers[0]
            os.kill(int(victim["pid"]), signal.SIGKILL)
            print(f"killed server {victim['id']} (pid {victim['pid']}, {len(victim['shards'])} shards) "
                  f"at {status['master'].get('progress', '?')}", flush=True)
        time.sleep(0.05)
    thread.join()
    if "error" in out:
        raise out["error"]
    res = out["result"]
    return {"victim": victim, "error": res.value["error"], "recoveries": res.stats["master"]["recoveries"]}


def main(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recovery", choices=["partial", "full"], default="partial")
    ap.add_argument("--every", type=int, default=50, help="iterations between checkpoints")
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory, removed at the end")
    args = ap.parse_args(argv)
    regression = load_app_module(str(HERE / "ssp_regression.py"))
    app_args = ["--iterations", str(args.iterations), "--quiet"]
    baseline = litz.run(regression.make_app(app_args), workers=2, servers=2).value["error"]
    with tempfile.TemporaryDirectory(prefix="litz-survive-") as tmp:
        run = run_with_a_kill(regression.make_app(app_args), args.recovery, args.every,
                              args.checkpoint_dir or tmp)
    if run["victim"] is None:
        print("the job finished before its first checkpoint: nothing was killed (try more --iterations)")
    for rec in run["recoveries"]:
        what = (f"{rec['restored']} shards restored from {rec['restored_from']} onto {', '.join(rec['onto'])}"
                if rec["strategy"] == "partial" else
                f"rolled back from version {rec['rolled_back_from_version']} to {rec['rolled_back_to_version']}")
        print(f"recovered ({rec['strategy']}) from the loss of {rec['lost']} in {rec['seconds']:.2f} s: {what}")
    print(f"weight error {run['error']:.4f} (without a failure: {baseline:.4f})", flush=True)
    return {**run, "baseline": baseline}


if __name__ == "__main__":
    main(sys.argv[1:])
