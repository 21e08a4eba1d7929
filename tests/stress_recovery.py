"""Stress the recovery of lost processes while executors and shards move all the time.

Not part of the test suite (it runs until told to stop): each run starts a job whose driver
moves executors and shards at random after most completions, waits for a checkpoint, kills
a random worker, server or both with SIGKILL, lets the job recover and run on, then stops it
and checks that it finished, that every executor's counts have no gap (a task lost, or one
counted twice, would make one) and, under full recovery, that the final sums are exact. On a
hang it prints the master's bookkeeping. The tests in test_recovery.py pin down the cases
that runs of this script found.

With ``--scale`` a scale command (workers or servers in or out) starts just before the kill, so
the loss strikes before, during or after its migrations and new processes' start. With
``--cascade`` one more process is killed a moment after the first loss, so the second loss
strikes while the first is being recovered (or just after). With ``--etcd-restart`` the job
uses an etcd of its own that is restarted around the kill (just before, or while the loss is
noticed), so the loss must be detected and recovered while clients reconnect and leases are
re-established. ``--etcd-down S`` keeps that etcd down for ``S`` seconds (longer than a lease, say),
and the kill may land while it is down: the loss is noticed only once etcd is back.

With ``--s3`` the checkpoints go to an S3 server on a loopback port (tests/s3_server.py), with
``--priority`` they are SCAR priority checkpoints (half the rows, after a first full one).

Run: ``python -m tests.stress_recovery [--runs 10] [--recovery partial|full] [--seed 0] [--scale] [--cascade]
[--etcd-restart] [--etcd-down S] [--s3] [--priority]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from litz.cli import job_status, scale
from tests import s3_server, testapps
from tests.conftest import run_in_thread
from tests.conftest import status_when as _status_when

#: ``--s3``: the bucket the runs checkpoint to (each under its job's name); None: a local directory
S3_BUCKET: str | None = None
#: ``--priority``: the checkpoint policy's options
CHECKPOINTS: dict[str, Any] = {}


def _dump_master(thread_id: int | None) -> None:
    """Where the master waits and what it holds (for a run that hung)."""
    for ident, frame in sys._current_frames().items():
        if ident == thread_id:
            print("".join(traceback.format_stack(frame)))
    masters = [o for o in gc.get_objects() if type(o).__name__ == "Master"]
    if masters:
        m = masters[-1]
        st = m.state
        paused = {item[0] for item in st.paused_items}
        running = [(r.task_id, r.executor_id, r.worker) for r in st.inflight.values() if r.task_id not in paused]
        print("running:", running)
        print("paused:", sorted(paused), "migrations:", st.migrations, st.shard_migrations, "held:", st.held)
        print("placement:", st.placement, "workers:", st.workers, "servers:", st.servers, "lost:", m.lost)
        print("checkpoint round:", m.checkpoints.round, "restoring:", m._restoring)


def _scale_at_random(rng: random.Random, job: str, said: list[str]) -> threading.Thread:
    """Start a random scale-out or scale-in of the job's 3 workers or 3 servers (``--scale``), from
    a thread: the kill that follows lands before, during or after its migrations."""
    kind, want = rng.choice([("workers", 2), ("workers", 4), ("workers", 5), ("servers", 2), ("servers", 4)])

    def command() -> None:
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            code = scale(["--job", job, f"--{kind}", str(want), "--wait", "--timeout", "40"])
        # stderr also caught the log of the master (same process) meanwhile: that goes on to stderr
        refusal = [ln for ln in err.getvalue().splitlines() if ln.startswith("litz:")]
        sys.stderr.write("".join(f"{ln}\n" for ln in err.getvalue().splitlines() if not ln.startswith("litz:")))
        lines = buf.getvalue().strip().splitlines() + refusal or ["(nothing)"]
        said.append(f"{kind} {want}: {'done' if code == 0 else 'refused or unfinished'}: {lines[-1]}")

    th = threading.Thread(target=command, daemon=True)
    th.start()
    return th


def _kill_another(rng: random.Random, job: str, killed: list[str]) -> None:
    """``--cascade``: kill one more member, of a role that keeps at least one process afterwards."""
    procs = [p for p in job_status(job)["processes"] if p["role"] in ("worker", "server")
             and p.get("state", "member") == "member" and p["id"] not in killed]
    roles = [r for r in ("worker", "server") if sum(p["role"] == r for p in procs) >= 2]
    if not roles:
        return
    role = rng.choice(roles)
    _kill([rng.choice([p for p in procs if p["role"] == role])], killed)


def _kill(victims: list[dict], killed: list[str]) -> None:
    """SIGKILL these processes; ``killed`` gets the ids of those that were still there."""
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):  # one a scale-in retired meanwhile is not a loss
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim["id"])


def _all_recovered(status: dict, killed: list[str]) -> bool:
    """Whether every killed process is named by a completed recovery (losses noticed together
    are recovered together, so one recovery may name several)."""
    named = {ident for r in status["master"].get("recoveries", []) for ident in r["lost"].split(", ")}
    return set(killed) <= named


def one(seed: int, recovery: str, scaling: bool = False, cascade: bool = False, etcd_restart: bool = False,
        etcd_down: float = 0.0) -> bool:
    rng = random.Random(seed)
    if etcd_restart or etcd_down:
        from litz.runtime.etcd_server import LocalEtcd

        with LocalEtcd() as etcd:
            return _one(rng, seed, recovery, scaling, cascade, etcd, etcd_down)
    return _one(rng, seed, recovery, scaling, cascade, None)


def _one(rng: random.Random, seed: int, recovery: str, scaling: bool, cascade: bool, etcd: Any,
         etcd_down: float = 0.0) -> bool:
    tmp = Path(tempfile.mkdtemp(prefix="litz-stress-"))
    os.environ["LITZ_JOBS_DIR"] = str(tmp / "jobs")
    stop = tmp / "stop"
    app = testapps.migrating_app(tasks=10**7, executors=8, move_prob=0.3, shard_move_prob=0.15, seed=seed)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=60.0, stop_file=str(stop), driver_reads=rng.random() < 0.5)
    job = f"stress-{seed}-{time.time_ns()}"
    where = s3_server.location(S3_BUCKET, job) if S3_BUCKET else str(tmp / "ckpt")
    t, out = run_in_thread(app, workers=3, servers=3, job=job, checkpoint_dir=where, checkpoint_every="0.4s",
                           recovery=recovery, etcd=etcd.url if etcd else None, **CHECKPOINTS)
    killed: list[str] = []
    said: list[str] = []  # what the scale command reported (--scale)
    scaler: threading.Thread | None = None
    try:
        _status_when(job, lambda s: not t.is_alive() or any(c.get("ok") for c in s["master"].get("checkpoints", [])))
        if scaling:
            scaler = _scale_at_random(rng, job, said)
        time.sleep(rng.uniform(0.0, 0.6) if scaling else rng.uniform(0.1, 1.0))
        procs = [p for p in job_status(job)["processes"] if p["role"] in ("worker", "server")
                 and p.get("state", "member") == "member"]
        victims = [rng.choice([p for p in procs if p["id"].startswith(kind)])
                   for kind in rng.choice([["w"], ["s"], ["w", "s"]])]
        if etcd is None:
            _kill(victims, killed)
        else:  # the kill lands during the restart or a moment after it
            # etcd is restarted by this thread, which outlives it: Linux ties etcd's parent-death
            # signal to the thread that started it, so the kill comes from another one
            killer = threading.Timer(rng.uniform(0.0, 1.5 + etcd_down), _kill, (victims, killed))
            killer.start()
            etcd.restart(down=etcd_down)
            killer.join()
        if cascade:
            time.sleep(rng.uniform(0.0, 0.8))
            _kill_another(rng, job, killed)
        _status_when(job, lambda s: not t.is_alive() or _all_recovered(s, killed))
        if scaler is not None:
            scaler.join(45)
        time.sleep(1.0)
    except AssertionError as exc:  # no checkpoint or no recovery in time: where is the master?
        print(exc, flush=True)
        _dump_master(t.ident)
    finally:
        stop.touch()
        t.join(60)
    problem = ""
    if t.is_alive():
        problem = "hung"
        _dump_master(t.ident)
    elif "error" in out:
        problem = out.get("traceback", repr(out["error"]))
    else:
        res = out["res"].value
        for e, seqs in enumerate(res["done_seq"]):
            if seqs and set(seqs) != set(range(max(seqs) + 1)):
                problem = f"executor {e} never reported counts {sorted(set(range(max(seqs) + 1)) - set(seqs))}"
        if recovery == "full" and not np.array_equal(res["final"], res["truth"]):
            problem = "the final sums differ from the driver's"
    if scaling and not problem and not said:
        problem = "the scale command never returned"
    moves = out["res"].value["moves"] if "res" in out else "-"
    scaled = f", scale {said[0] if said else '-'}" if scaling else ""
    print(f"seed {seed} {recovery}: killed {', '.join(killed)}, {moves} moves{scaled}: {problem or 'ok'}", flush=True)
    return not problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--recovery", choices=("partial", "full"), default="partial")
    ap.add_argument("--seed", type=int, default=0, help="first seed (runs use seed, seed + 1, ...)")
    ap.add_argument("--scale", action="store_true",
                    help="also scale the workers or servers in or out as the process is killed")
    ap.add_argument("--cascade", action="store_true",
                    help="kill one more process a moment after the first loss, while it is recovered")
    ap.add_argument("--etcd-restart", action="store_true",
                    help="the job's own etcd is restarted around the kill")
    ap.add_argument("--etcd-down", type=float, default=0.0, metavar="S",
                    help="with --etcd-restart (implied): etcd stays down S seconds, and the kill may land meanwhile")
    ap.add_argument("--s3", action="store_true", help="checkpoint to an S3 server on a loopback port (moto's)")
    ap.add_argument("--priority", action="store_true",
                    help="SCAR priority checkpoints of half the rows after a first full one")
    args = ap.parse_args()
    global S3_BUCKET
    if args.priority:
        CHECKPOINTS.update(checkpoint_policy="priority", checkpoint_fraction=0.5)
    with contextlib.ExitStack() as stack:
        if args.s3:
            why = s3_server.unusable()
            if why:
                raise SystemExit(why)
            S3_BUCKET = stack.enter_context(s3_server.s3_bucket("litz-stress"))
        failed = sum(not one(s, args.recovery, args.scale, args.cascade, args.etcd_restart, args.etcd_down)
                     for s in range(args.seed, args.seed + args.runs))
    print(f"{failed} of {args.runs} runs failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
