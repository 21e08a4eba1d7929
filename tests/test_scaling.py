"""Scale-out and scale-in while a job trains, through etcd scale commands (``litz scale``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from litz.cli import job_status, scale
from tests import testapps
from tests.conftest import processes_mentioning, status_when, wait_running
from tests.conftest import run_in_thread as _run_in_thread
from tests.test_mlr_app import needs_data


def _workers(st: dict) -> dict[str, list[int]]:
    return {p["id"]: p["executors"] for p in st["processes"] if p["role"] == "worker"}


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def _wait_exit(pids: list[int], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{what} did not exit"
        time.sleep(0.05)


def _start_timed(tmp_path: Path, monkeypatch, name: str, tasks: int, executors: int,
                 **kw: object) -> tuple[str, Path, Any, Any]:
    """A migrating job (no random moves) that trains until the file ``stop`` exists, at most 60 s,
    started on a thread: its name, that file, the thread and its outcome."""
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    job = f"{name}-{time.time_ns()}"
    app = testapps.migrating_app(tasks=tasks, executors=executors, move_prob=0.0)
    app.driver = testapps.TimedMigratingDriver
    stop = tmp_path / "stop"
    app.config.update(stop_after=60.0, stop_file=str(stop))
    t, out = _run_in_thread(app, job=job, **kw)
    return job, stop, t, out


def test_scale_out_and_in_keeps_state_and_retired_processes_exit(tmp_path: Path, monkeypatch) -> None:
    # it trains until the checks are done
    job, stop, t, out = _start_timed(tmp_path, monkeypatch, "scale", 100_000, 8, workers=2, servers=1)
    try:
        wait_running(job, out)
        assert scale(["--job", job, "--workers", "4", "--wait", "--timeout", "30"]) == 0
        st = job_status(job)
        ws = _workers(st)
        assert len(ws) == 4 and sorted(e for v in ws.values() for e in v) == list(range(8))
        assert all(len(v) == 2 for v in ws.values())
        retired_pids = [p["pid"] for p in st["processes"] if p["id"] in ("w1", "w2", "w3")]
        assert scale(["--job", job, "--workers", "1", "--wait", "--timeout", "30"]) == 0, out
        ws = _workers(job_status(job))
        assert list(ws) == ["w0"] and sorted(ws["w0"]) == list(range(8))
        _wait_exit(retired_pids, "retired workers")
        # servers scale out: shards spread over the new ones while the job runs
        assert scale(["--job", job, "--servers", "3", "--wait", "--timeout", "30"]) == 0
        st = job_status(job)
        servers = {p["id"]: p["shards"] for p in st["processes"] if p["role"] == "server"}
        assert len(servers) == 3 and sorted(s for v in servers.values() for s in v) == list(range(64))
        assert sorted(len(v) for v in servers.values()) == [21, 21, 22]
        # servers scale in: the leaving ones' shards move, everyone routes around them, they exit
        server_pids = {p["id"]: p["pid"] for p in st["processes"] if p["role"] == "server"}
        assert scale(["--job", job, "--servers", "1", "--wait", "--timeout", "30"]) == 0
        servers = {p["id"]: p["shards"] for p in job_status(job)["processes"] if p["role"] == "server"}
        assert list(servers) == ["s0"] and servers["s0"] == list(range(64))
        _wait_exit([pid for ident, pid in server_pids.items() if ident != "s0"], "retired servers")
        assert scale(["--job", job, "--servers", "2", "--wait", "--timeout", "30"]) == 0
        # refused commands say why
        assert scale(["--job", job, "--workers", "0"]) == 1
        assert scale(["--job", job, "--workers", "9"]) == 1
        assert scale(["--job", job, "--servers", "0"]) == 1
        assert scale(["--job", job, "--servers", "65"]) == 1
    finally:
        stop.touch()
        t.join(60)
    assert "error" not in out, out.get("error")
    res = out["res"].value
    import numpy as np

    np.testing.assert_array_equal(res["final"], res["truth"])
    for seqs in res["done_seq"]:
        assert sorted(seqs) == list(range(len(seqs)))
    assert processes_mentioning(job) == []


@needs_data
def test_mlr_reaches_accuracy_while_scaling_2_4_1(tmp_path: Path, monkeypatch) -> None:
    from apps import mlr

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    job = f"mlr-scale-{time.time_ns()}"
    app = mlr.make_app(["--epochs", "80", "--quiet"])
    t, out = _run_in_thread(app, workers=2, servers=1, num_executors=8, job=job)
    try:
        wait_running(job, out)
        assert scale(["--job", job, "--workers", "4", "--wait"]) == 0
        assert scale(["--job", job, "--workers", "1", "--wait"]) == 0
    finally:
        t.join(120)
    assert "error" not in out, out.get("error")
    value = out["res"].value
    assert value["test_accuracy"] >= 0.84
    assert out["res"].total("migrations_in", "worker") >= 8  # 4 executors out, then 6 in




def test_a_worker_killed_as_it_joins_leaves_the_scale_out_which_completes(tmp_path: Path, monkeypatch) -> None:
    """The new worker of a scale-out dies as soon as it registers: still joining, it only
    leaves the operation; admitted already, its executors are recovered. Either way the
    scale-out completes without it, and the job goes on with every executor placed."""
    import os
    import signal

    import numpy as np

    job, stop, t, out = _start_timed(tmp_path, monkeypatch, "scale-kill", 10**7, 6, workers=2, servers=1,
                                     checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every="1s",
                                     recovery="partial")
    try:
        wait_running(job, out)
        assert scale(["--job", job, "--workers", "3"]) == 0
        deadline = time.monotonic() + 30
        while not (new := [p for p in job_status(job)["processes"] if p["id"] == "w2" and p.get("pid")]):
            assert time.monotonic() < deadline, "the new worker never registered"
            time.sleep(0.01)
        os.kill(new[0]["pid"], signal.SIGKILL)
        while not (st := job_status(job))["master"].get("scale_history"):
            assert time.monotonic() < deadline, "the scale-out never completed"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        stop.touch()
        t.join(60)
    assert "error" not in out, out.get("error")
    [done] = st["master"]["scale_history"]
    assert done["lost"] == ["w2"] and done["workers"] == ["w0", "w1"]
    assert sorted(e for v in _workers(st).values() for e in v) == list(range(6))
    res = out["res"].value
    recovered = out["res"].stats["master"]["recoveries"]
    for seqs in res["done_seq"]:
        assert set(seqs) == set(range(max(seqs) + 1)) and (recovered or len(seqs) == len(set(seqs)))
    if not recovered:  # it died before it held anything: nothing was redone, the sums are exact
        np.testing.assert_array_equal(res["final"], res["truth"])
    assert processes_mentioning(job) == []


@pytest.mark.parametrize("recovery", ["partial", "full"])
def test_a_server_lost_while_a_new_worker_joins_is_routed_around_by_it(tmp_path: Path, monkeypatch,
                                                                       recovery: str) -> None:
    """A scale-out's new worker was initialised with the shard map of its registration; a server
    dies before it is ready. Once ready it gets executors, whose reads must go to the servers that
    took the dead one's shards, not to the dead one (where they would wait for ever: a stress run
    with ``--scale`` found that hang). The worker's readiness is held back here until the
    recovery is over, which makes that order certain."""
    import os
    import signal

    import numpy as np

    from litz.runtime.elastic import Elasticity

    held: list[tuple[Elasticity, str, str | None]] = []
    on_ready, recovered = Elasticity.on_ready, Elasticity.recovered

    def hold_w2(self: Elasticity, ident: str, error: str | None) -> None:
        if ident == "w2" and not self.m.recoveries:
            held.append((self, ident, error))
        else:
            on_ready(self, ident, error)

    def then_release(self: Elasticity) -> None:
        recovered(self)
        while held:
            on_ready(*held.pop())

    monkeypatch.setattr(Elasticity, "on_ready", hold_w2)
    monkeypatch.setattr(Elasticity, "recovered", then_release)
    job, stop, t, out = _start_timed(tmp_path, monkeypatch, "scale-lost", 10**7, 6, workers=2, servers=2,
                                     checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every="0.5s",
                                     recovery=recovery)
    try:
        status_when(job, lambda s: any(c.get("ok") for c in s["master"].get("checkpoints", [])))
        assert scale(["--job", job, "--workers", "3"]) == 0
        deadline = time.monotonic() + 30
        while not held:
            assert time.monotonic() < deadline, "the new worker never finished initialising"
            time.sleep(0.01)
        [s1] = [p for p in job_status(job)["processes"] if p["id"] == "s1"]
        os.kill(s1["pid"], signal.SIGKILL)
        st = status_when(job, lambda s: s["master"].get("scale_history") and len(_workers(s).get("w2", [])) == 2)
        # w2's executors (moved there after the recovery) read and update; their tasks end, so
        # the job can stop (before the fix they waited for the dead server, and so did the job)
        status_when(job, lambda s: s["master"]["completed"] > st["master"]["completed"] + 60, timeout=20)
    finally:
        stop.touch()
        t.join(30)
    assert not t.is_alive(), "the job hung after the server's loss"
    assert "error" not in out, out.get("traceback")
    res = out["res"].value
    for seqs in res["done_seq"]:
        assert set(seqs) == set(range(max(seqs) + 1))
    if recovery == "full":
        np.testing.assert_array_equal(res["final"], res["truth"])
    assert processes_mentioning(job) == []


def test_a_servers_loss_reaches_the_processes_a_scale_operation_adds_or_removes() -> None:
    """Without sockets: when a partial recovery of a lost server completes, ``server_lost`` goes to
    the job's workers and servers, to a scale-out's new worker that registered but is not ready,
    and to a scale-in's server that is out of the job but has not said goodbye (it may have
    forwarded requests to the dead server); not to the dead, nor to a process that already left."""
    from litz.runtime.elastic import Elasticity, ScaleOp
    from litz.runtime.master import Master, MasterState, _Restoring

    sent: list[tuple[str, str, dict]] = []
    m = object.__new__(Master)  # the state machine alone: sends are recorded
    m.endpoint = type("E", (), {"send": lambda self, to, kind, **f: sent.append((to, kind, f))})()
    m.state = MasterState(4, ["w0", "w1"], ["s0", "s1"], num_shards=4)
    m.lost, m.retiring, m._byes = {"s1"}, {"s3"}, {"s4": {}}
    m.procs = {i: {"role": "worker" if i[0] == "w" else "server"} for i in ("w0", "w1", "w2", "s0", "s2", "s3", "s4")}
    m.recoveries, m._recovered, m._waiting_losses = [], [], []
    m.elastic = Elasticity(m)
    m.elastic.op = ScaleOp("c", 0.0, joining={"w2", "w3"}, retiring={"s2", "s4"})  # w3 not registered yet
    m._restoring = _Restoring("server", 0.0, losts=["s1"], assign={"s0": [1, 3]}, waiting={"s0"}, round=7)
    m._restored("s0", 7)
    told = sorted(to for to, kind, f in sent if kind == "server_lost" and f["server"] == "s1")
    assert told == ["s0", "s2", "s3", "w0", "w1", "w2"]
    assert all(f["shard_map"] == ["s0"] * 4 for _, _, f in sent)
    assert m._restoring is None and m.recoveries[-1]["lost"] == "s1"


def test_nothing_moves_to_or_from_a_process_declared_lost_whose_recovery_waits() -> None:
    """Without sockets: w0 and s0 were declared lost while the other role's recovery ran, so they
    are still in their groups (their own recovery waits) but gone from the processes; a worker w3
    and a server s2 join meanwhile. Spreading the work moves nothing to or from w0 or s0: w3 gets
    executors from w1 and w2 only, s2 shards from s1 only. Before, a stress run found the master
    moving executors to w0 (``KeyError: 'w0'``: it has no address any more), and moves off the
    dead would never have been answered."""
    from litz.runtime.master import Master, MasterState

    sent: list[tuple[str, str, dict]] = []
    m = object.__new__(Master)  # the state machine alone: sends are recorded
    m.endpoint = type("E", (), {"send": lambda self, to, kind, **f: sent.append((to, kind, f))})()
    m.state = st = MasterState(6, ["w0", "w1", "w2"], ["s0", "s1"], num_shards=8)
    m.lost = {"w0", "s0"}
    m.procs = {i: {"addr": f"ipc://{i}"} for i in ("w1", "w2", "w3", "s1", "s2")}
    st.placement = {0: "w0", 1: "w1", 2: "w1", 3: "w1", 4: "w1", 5: "w2"}  # w1 holds more than its share
    st.shard_map = ["s0"] + ["s1"] * 7
    st.workers.append("w3")
    st.servers.append("s2")
    assert m.rebalance() and m.rebalance_shards()
    moves = sorted((to, f["dest"]) for to, kind, f in sent)
    assert moves == [("s1", "s2"), ("w1", "w2"), ("w1", "w3")], moves  # w0's executor and s0's shard stay
    assert [mig[1] for mig in st.migrations.values()] == ["w1", "w1"]
    assert sorted(s for shards, _, _ in st.shard_migrations.values() for s in shards) != [] \
        and 0 not in st.shards_moving


def test_the_job_end_does_not_wait_for_processes_a_scale_is_still_waiting_for() -> None:
    """Without a job: a worker of a scale-out still joining (registered, not ready: a host
    without the job secret cannot hear the master, so it never is) is told to leave but not
    waited for; the goodbyes of the others are taken as before. Before, the master waited its
    whole shutdown timeout for it."""
    from litz.runtime.elastic import ScaleOp
    from litz.runtime.master import Master

    class Members:
        def deregister(self) -> None:
            pass

    m = Master(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), "j", Members(),  # type: ignore[arg-type]
               workers=1, servers=1, num_executors=2)
    m.procs = {"w0": {"role": "worker"}, "w9": {"role": "worker"}}
    m._byes["w0"] = {"role": "worker", "tasks_run": 3}
    m.elastic.op = ScaleOp("c", time.monotonic(), joining={"w9"})
    stats: dict[str, Any] = {}
    started = time.monotonic()
    m.shutdown(stats, timeout=3.0)
    assert time.monotonic() - started < 1.0
    assert stats == {"w0": {"role": "worker", "tasks_run": 3}}


@pytest.mark.parametrize("direction", ["out", "in"])
def test_an_etcd_outage_as_a_scale_starts_delays_it_and_stops_nothing(tmp_path: Path, monkeypatch,
                                                                      direction: str) -> None:
    """etcd goes away just as the master starts a scale operation and comes back 7 s later (longer
    than a call's 5 s deadline and than the processes' lease TTL). Scale-out: the node agent's spawn
    request waits for etcd, then the new worker starts, registers and takes executors. Scale-in: a
    server's shards move off it and it leaves, all through the job's own sockets, while etcd is
    down. Either way the operation completes, the master's answer reaches etcd once it is back, no
    process is declared lost, and the job trains on to exact sums."""
    import threading

    import numpy as np

    from litz.runtime.elastic import RESULTS, SCALE_KEY, Elasticity
    from litz.runtime.etcd_server import LocalEtcd
    from litz.runtime.membership import Membership

    server = LocalEtcd()
    server.start()
    down = threading.Event()
    starts = Elasticity._spawn if direction == "out" else Elasticity._retire

    def start_in_an_outage(self: Elasticity, *a: Any, **kw: Any) -> None:
        starts(self, *a, **kw)
        if not down.is_set():
            server._stop_process()  # etcd goes away as the operation starts
            down.set()

    monkeypatch.setattr(Elasticity, "_spawn" if direction == "out" else "_retire", start_in_an_outage)
    job, stop, t, out = _start_timed(tmp_path, monkeypatch, f"scale-outage-{direction}", 10**7, 6, workers=2,
                                     servers=2 if direction == "in" else 1, etcd=server.url)
    try:
        wait_running(job, out)
        with Membership(server.url, job) as m:
            cmd = {"workers": 3} if direction == "out" else {"servers": 1}
            m.put(SCALE_KEY, {"id": "c1", **cmd, "time": time.time()})
            assert down.wait(60), "the scale operation never started"
            time.sleep(7.0)
            assert "error" not in out, out.get("traceback")
            server._launch(15.0)  # (from this thread: etcd dies with the thread that started it)
            deadline = time.monotonic() + 40
            while (answer := m.get(f"{RESULTS}c1")) is None:
                assert time.monotonic() < deadline and "error" not in out, out.get("traceback", "no answer")
                time.sleep(0.1)
        assert answer["ok"] is True, answer
        st = status_when(job, lambda s: any(h.get("command") == "c1" for h in s["master"].get("scale_history", [])),
                         timeout=40, out=out)
        [done] = [h for h in st["master"]["scale_history"] if h["command"] == "c1"]
        assert not done.get("lost"), done
        if direction == "out":
            assert done["workers"] == ["w0", "w1", "w2"]
            assert sorted(len(v) for v in _workers(st).values()) == [2, 2, 2]
        else:
            assert done["servers"] == ["s0"]
            # s1's registration may outlive it until its lease ends (etcd was down as it left)
            servers = {p["id"]: (p["state"], p["shards"]) for p in st["processes"] if p["role"] == "server"}
            assert servers["s0"] == ("member", list(range(64))) and servers.get("s1", ("left", []))[0] == "left"
        status_when(job, lambda s: s["master"]["completed"] > st["master"]["completed"] + 100, timeout=30, out=out)
    finally:
        stop.touch()
        t.join(60)
        server.stop()
    assert "error" not in out, out.get("traceback")
    res = out["res"]
    assert not res.stats["master"].get("recoveries"), res.stats["master"]["recoveries"]
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    for seqs in res.value["done_seq"]:
        assert sorted(seqs) == list(range(len(seqs)))
    assert processes_mentioning(job) == []
