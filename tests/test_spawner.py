"""Workers and servers forked from a zygote that imported them once (litz/runtime/spawner.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import litz
from litz.errors import ConfigError, ProcessLost
from litz.runtime import spawner
from litz.runtime.launcher import LocalCluster
from litz.runtime.node import kill_job_process
from tests import testapps
from tests.conftest import descendants

ROOT = Path(__file__).resolve().parent.parent


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def _exec_cmdline(pid: int, timeout: float = 10.0) -> str:
    """The command line of a child just started by ``subprocess.Popen``. Popen returns when the
    exec closes its error pipe, which the kernel does before the new image's argument pages are
    set up, so /proc/PID/cmdline can read empty for a moment (a CI run failed on that)."""
    deadline = time.monotonic() + timeout
    while not (cmd := descendants().get(pid)):
        assert time.monotonic() < deadline, f"process {pid} never showed a command line"
        time.sleep(0.005)
    return cmd


def _wait_for(cond, timeout: float = 10.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (init reaps orphans' corpses in its time)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:3]
    except (FileNotFoundError, IndexError):
        return False


def _started_cluster(name: str, etcd_url: str, workers: int) -> tuple[str, LocalCluster]:
    """A started cluster of ``workers`` workers and a server, with no master, forked by this process's
    zygote; the caller stops it."""
    job = f"{name}-{time.time_ns()}"
    cluster = LocalCluster(job, workers=workers, servers=1, etcd=etcd_url)
    cluster.start()
    assert cluster._spawner is not None
    return job, cluster


def test_processes_are_forked_from_one_zygote_as_the_launcher_would_start_them(etcd, tmp_path, monkeypatch) -> None:
    """Every worker and server is a child of this process's zygote, with the command line a fresh
    interpreter would have (fencing checks it), the launcher's working directory of the moment it
    was asked for, a session of its own and its name. A killed one is reported with its signal, as
    a child of the launcher was. The zygote outlives the cluster and serves the next one; a change
    of what its imports read (a ``NUMBA_`` setting) gets another zygote."""
    monkeypatch.chdir(tmp_path)
    job, cluster = _started_cluster("spawn", etcd.url, 2)
    try:
        assert cluster._spawner is not None
        zygote = cluster._spawner.process.pid
        assert set(cluster.children) == {"s0", "w0", "w1"}
        for ident, proc in cluster.children.items():
            _wait_for(lambda p=proc, i=ident: _comm(p.pid) == f"litz-{i}", what=f"{ident}'s name")
            assert _ppid(proc.pid) == zygote and os.getsid(proc.pid) == proc.pid
            module = "litz.ps.server" if ident == "s0" else "litz.runtime.worker"
            assert _argv(proc.pid)[:7] == [sys.executable, "-m", module, "--id", ident, "--job", job]
            assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
        other = tmp_path / "later"
        other.mkdir()
        monkeypatch.chdir(other)  # a scale-out's process starts where the launcher is now
        cluster.handle_spawn({"workers": ["w2"]})
        w2 = cluster.children["w2"].pid
        _wait_for(lambda: os.readlink(f"/proc/{w2}/cwd") == str(other), what="w2 to start in the new directory")
        # the master fences a stalled process by pid, once it checked that the pid is still that process
        assert not kill_job_process(cluster.children["w0"].pid, "w1", job)
        assert not kill_job_process(cluster.children["w0"].pid, "w0", "another-job")
        victim = cluster.children["w1"]
        assert kill_job_process(victim.pid, "w1", job)
        deadline = time.monotonic() + 10
        with pytest.raises(ProcessLost, match=rf"process w1 \(pid {victim.pid}\) exited with code -9"):
            while time.monotonic() < deadline:
                cluster.check_children()
                time.sleep(0.02)
        assert victim.returncode == -signal.SIGKILL
        assert cluster.children["w0"].poll() is None
    finally:
        cluster.stop(timeout=0.5)
    assert all(p.poll() is not None for p in cluster.children.values())
    assert zygote in descendants() and spawner.shared().process.pid == zygote  # kept for the next job
    monkeypatch.setenv("NUMBA_LITZ_TEST_SETTING", "1")
    assert spawner.shared().process.pid != zygote


def test_the_zygote_outlives_the_thread_that_started_it_and_dies_with_the_launcher(etcd) -> None:
    """Linux's parent-death signal follows the thread that forked: a job run in a thread that then ends
    must not take the zygote, and the next job's processes, with it. ``kill -9`` of the launcher
    process does: the zygote gets its parent-death signal, and its children theirs."""
    code = (f"import sys, threading, time; sys.path.insert(0, {str(ROOT)!r}); "
            "from litz.runtime.launcher import LocalCluster; "
            f"c = LocalCluster('orphans-{time.time_ns()}', workers=1, servers=1, etcd={etcd.url!r}); "
            "t = threading.Thread(target=c.start); t.start(); t.join(); time.sleep(1.0); "
            "print(c._spawner.process.pid, *[p.pid for p in c.children.values() if p.poll() is None], flush=True); "
            "time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in launcher.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 3, "the zygote or its children died with the thread that started the cluster"
        launcher.kill()
        launcher.wait()
        _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids), 10.0,
                  "the zygote and its children to die")
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_lost_zygote_takes_its_children_and_later_processes_start_afresh(etcd) -> None:
    """``kill -9`` of the zygote: its children die with it and the launcher reports them lost at once
    (not after their leases); a process asked for afterwards starts as a fresh interpreter, and the
    next cluster gets a new zygote."""
    _, cluster = _started_cluster("zygote-lost", etcd.url, 1)
    try:
        assert cluster._spawner is not None
        dead = cluster._spawner.process.pid
        pids = {ident: child.pid for ident, child in cluster.children.items()}
        os.kill(dead, signal.SIGKILL)  # (right after the forks: a child may not have run a line yet)
        deadline = time.monotonic() + 10
        lost: set[str] = set()
        while lost != {"s0", "w0"}:
            assert time.monotonic() < deadline, f"only {lost} reported lost"
            try:
                cluster.check_children()
            except ProcessLost as exc:
                assert "exited with code -9" in str(exc)
                lost.add(exc.ident)
            time.sleep(0.02)
        while alive := [i for i, pid in pids.items() if _running(pid)]:  # none outlives it (one did: see
            assert time.monotonic() < deadline, f"{alive} outlived the zygote"  # spawner._child's zygote)
            time.sleep(0.02)
        cluster.handle_spawn({"workers": ["w1"]})
        assert cluster._spawner is None
        w1 = cluster.children["w1"]
        assert isinstance(w1, subprocess.Popen) and w1.poll() is None
        assert "-m litz.runtime.worker --id w1" in _exec_cmdline(w1.pid)
    finally:
        cluster.stop(timeout=0.5)
    assert spawner.shared().process.pid != dead


def test_the_zygote_refuses_a_malformed_request_and_goes_on(tmp_path, monkeypatch) -> None:
    """A request for another module, or without its three descriptors, is answered with an error; the
    zygote keeps serving, and a child that fails its arguments exits with argparse's code."""
    monkeypatch.delenv("LITZ_SECRET_FILE", raising=False)
    sp = spawner.Spawner()
    try:
        with pytest.raises(ValueError, match="not 'os'"), open(os.devnull, "wb") as devnull:
            sp.spawn("os", [], dict(os.environ), None, devnull)  # refused before it is sent
        socket.send_fds(sp._sock, [json.dumps({"module": "os", "args": [], "env": {}, "cwd": "/"}).encode()],
                        [0, 1, 2])
        socket.send_fds(sp._sock, [json.dumps({"module": "litz.runtime.worker"}).encode()], [0])
        socket.send_fds(sp._sock, [b"[1, 2]"], [0, 1, 2])
        deadline = time.monotonic() + 30
        while len(sp._replies) < 3:
            assert time.monotonic() < deadline, "the zygote did not answer"
            sp.receive(0.1)
        first, second, third = sp._replies
        assert "'os' with 3 descriptors" in first["error"] and "with 1 descriptors" in second["error"]
        assert "'list' with 3 descriptors" in third["error"]
        sp._replies.clear()
        with open(tmp_path / "w.log", "wb") as log:
            child = sp.spawn("litz.runtime.worker", ["--bogus"], dict(os.environ), None, log)
        assert child.wait(30) == 2
        assert "litz-worker: error: the following arguments are required" in (tmp_path / "w.log").read_text()
        # each child runs with the environment of its request, not the zygote's: here a secret file
        # (read from the environment by the worker's options) that does not exist
        missing = tmp_path / "missing.key"
        with open(tmp_path / "w9.log", "wb") as log:
            child = sp.spawn("litz.runtime.worker", ["--id", "w9", "--job", "j", "--etcd", "127.0.0.1:9"],
                             {**os.environ, "LITZ_SECRET_FILE": str(missing)}, None, log)
        assert child.wait(30) == 2
        assert str(missing) in (tmp_path / "w9.log").read_text()
    finally:
        sp.close()
    assert sp.process.returncode == 0 and not sp.alive()


def test_a_late_answer_to_a_request_that_timed_out_is_not_taken_for_the_next_ones(tmp_path) -> None:
    """A zygote too slow to answer in time (stopped here) still answers later. That answer must not be
    taken for the next request's: the next spawn gets the pid of its own child, and the child started
    for the request that gave up is killed, since no one will ever use it."""
    sp = spawner.Spawner()
    try:
        sp.prepare(timeout=60)  # imports done: what follows times only the stop
        args = ["--id", "w9", "--job", "j", "--etcd", "127.0.0.1:9"]
        os.kill(sp.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(spawner.SpawnFailed, match="did not start litz.runtime.worker within 0 s"), \
                    open(tmp_path / "late.log", "wb") as log:
                sp.spawn("litz.runtime.worker", args, dict(os.environ), None, log, timeout=0.3)
            with pytest.raises(spawner.SpawnFailed, match="did not get ready within 0 s"):
                sp.prepare(timeout=0.3)
        finally:
            os.kill(sp.process.pid, signal.SIGCONT)
        with open(tmp_path / "w.log", "wb") as log:  # answered after the two late answers
            child = sp.spawn("litz.runtime.worker", ["--bogus"], dict(os.environ), None, log)
        assert child.wait(30) == 2  # its own child: argparse's exit code, not the late one's
        assert "the following arguments are required" in (tmp_path / "w.log").read_text()
        late = [pid for pid in sp._pids if pid != child.pid]
        assert len(late) == 1
        _wait_for(lambda: sp.exit_codes.get(late[0]) is not None or sp.receive(0.1), what="the late child's end")
        assert sp.exit_codes[late[0]] == -signal.SIGKILL
    finally:
        sp.close()


def test_litz_spawn_exec_starts_fresh_interpreters_and_a_bad_value_is_refused(etcd, monkeypatch) -> None:
    monkeypatch.setenv("LITZ_SPAWN", "exec")
    seen: dict[str, tuple[int, str]] = {}
    original = LocalCluster._spawn

    def spawn(self: LocalCluster, module: str, ident: str) -> None:
        original(self, module, ident)
        pid = self.children[ident].pid
        seen[ident] = (_ppid(pid), _exec_cmdline(pid))

    monkeypatch.setattr(LocalCluster, "_spawn", spawn)
    res = litz.run(testapps.sum_app(rows=4, tasks=20, executors=2), workers=1, servers=1, etcd=etcd.url)
    assert res.tasks_completed > 0
    assert seen["w0"][0] == seen["s0"][0] == os.getpid()  # the launcher's own children
    assert "-m litz.runtime.worker --id w0" in seen["w0"][1] and "-m litz.ps.server --id s0" in seen["s0"][1]
    monkeypatch.setenv("LITZ_SPAWN", "clone")
    with pytest.raises(ConfigError, match="LITZ_SPAWN must be 'fork' or 'exec'"):
        litz.run(testapps.sum_app(rows=4, tasks=20, executors=2), workers=1, servers=1, etcd=etcd.url)


def test_jobs_run_one_after_another_share_the_zygote(etcd) -> None:
    """The imports are paid once per launcher process: two jobs, one zygote, and both jobs' processes
    were its children."""
    parents: list[set[int]] = []
    original = LocalCluster._spawn

    def spawn(self: LocalCluster, module: str, ident: str) -> None:
        original(self, module, ident)
        parents[-1].add(_ppid(self.children[ident].pid))

    for _ in range(2):
        parents.append(set())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LocalCluster, "_spawn", spawn)
            assert litz.run(testapps.sum_app(rows=4, tasks=20, executors=2), workers=2, servers=1,
                            etcd=etcd.url).tasks_completed > 0
    assert parents[0] == parents[1] == {spawner.shared().process.pid}


def test_workers_inherit_numba_warmed_up_when_the_launcher_uses_it(etcd, monkeypatch) -> None:
    """A launcher with Numba loaded gets workers whose Numba target is initialised before their first
    task (the zygote did it once); without Numba, the zygote does not pay for it until a request asks;
    fresh interpreters (``LITZ_SPAWN=exec``) start cold."""
    import numba  # noqa: F401 - what an application with kernels has loaded

    def states() -> list[dict]:
        res = litz.run(testapps.numba_state_app(2), workers=2, servers=1, etcd=etcd.url)
        assert len({v["pid"] for v in res.value.values()}) == 2  # one executor in each worker
        return list(res.value.values())

    assert all(s["target_ready"] for s in states())  # the shared zygote
    monkeypatch.setattr(spawner, "numba_loaded", lambda: False)
    own = spawner.Spawner()
    try:
        monkeypatch.setattr(spawner, "shared", lambda: own)
        cold = states()
        assert all(s["numba_imported"] and not s["target_ready"] for s in cold)  # imported, not warmed
        monkeypatch.setattr(spawner, "numba_loaded", lambda: True)  # now a request asks for it
        assert all(s["target_ready"] for s in states())
    finally:
        own.close()
    monkeypatch.undo()
    monkeypatch.setenv("LITZ_SPAWN", "exec")
    assert not any(s["target_ready"] for s in states())


def test_a_node_agent_without_the_application_warms_numba_when_the_master_asks(etcd, monkeypatch) -> None:
    """A joined host's agent has not imported the application: the master's spawn requests say whether
    it uses Numba, and the agent's zygote initialises it before forking those workers (not before)."""
    from litz.runtime.elastic import Elasticity, ScaleOp

    monkeypatch.setattr(spawner, "numba_loaded", lambda: False)  # the agent's process
    own = spawner.Spawner()
    monkeypatch.setattr(spawner, "shared", lambda: own)
    job, cluster = _started_cluster("agent-numba", etcd.url, 1)
    try:
        assert not any(p.numba_ready for p in cluster.children.values())
        cluster.handle_spawn({"command": "c1", "workers": ["w1"]})
        assert not cluster.children["w1"].numba_ready
        cluster.handle_spawn({"command": "c2", "workers": ["w2"], "numba": True})
        assert cluster.children["w2"].numba_ready
        cluster.handle_spawn({"command": "c3", "servers": ["s1"]})  # the zygote stays warm
        assert cluster.children["s1"].numba_ready
    finally:
        cluster.stop(timeout=0.5)
        own.close()
    # the master's side: its requests carry whether its own process has Numba loaded
    put: list[tuple[str, dict]] = []
    master = type("M", (), {"procs": {"w0": {}}, "lost": set(),
                            "request_agent": lambda self, agent, kind, v: put.append((f"agents/{agent}/{kind}", v))})()
    for loaded in (False, True):
        monkeypatch.setattr(spawner, "numba_loaded", lambda loaded=loaded: loaded)
        Elasticity(master)._spawn(ScaleOp(cid="c", started=0.0), "host-b", workers=1)  # type: ignore[arg-type]
    assert [(k, v["numba"], v["workers"]) for k, v in put] == [("agents/host-b/spawn", False, ["w1"]),
                                                                ("agents/host-b/spawn", True, ["w1"])]


def test_a_joining_agent_gets_its_zygote_ready_before_it_offers(monkeypatch) -> None:
    """``prepare`` answers once the zygote has imported, and has initialised Numba only when asked; the
    workers forked after it inherit that. ``launch --join`` calls it with the master's record's word
    on Numba before it offers its processes (the master's clock for them starts at its request)."""
    monkeypatch.setattr(spawner, "numba_loaded", lambda: False)  # an agent without the application
    own = spawner.Spawner()
    try:
        assert own.prepare() is False
        socket.send_fds(own._sock, [json.dumps({"prepare": True}).encode()], [0])  # descriptors: refused
        deadline = time.monotonic() + 30
        while not own._replies:
            assert time.monotonic() < deadline, "the zygote did not answer"
            own.receive(0.1)
        assert "request: None with 1 descriptors" in own._replies.pop()["error"]
        assert own.prepare(numba=True) is True
        with open(os.devnull, "wb") as devnull:
            child = own.spawn("litz.runtime.worker", ["--bogus"], dict(os.environ), None, devnull)
        assert child.numba_ready and child.wait(30) == 2
    finally:
        own.close()
    assert own.process.returncode == 0
    # the master's record says whether its process has Numba loaded; the agent reads it before offering
    from litz.runtime import launcher

    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(LocalCluster, "prepare", lambda self, numba=False: seen.append(("prepare", numba)))
    monkeypatch.setattr(LocalCluster, "start", lambda self: setattr(self, "_agent", _OneKey({"numba": True}, seen)))
    monkeypatch.setattr(LocalCluster, "stop", lambda self, timeout=5.0: None)
    monkeypatch.setattr(launcher, "_join_step", lambda *a: (_ for _ in ()).throw(RuntimeError("offered")))
    with pytest.raises(RuntimeError, match="offered"):
        launcher.join("j", "127.0.0.1:9")
    assert seen[0] == ("prepare", True) and seen[1][0] == "put" and str(seen[1][1]).startswith("commands/join/")


class _OneKey:
    """An agent's etcd view holding only the master's record (for the join test above)."""

    def __init__(self, master: dict, seen: list[tuple[str, object]]) -> None:
        self.master = master
        self.seen = seen

    def get(self, key: str) -> dict:
        return self.master

    def watch_prefix(self, prefix: str) -> None:
        pass

    def put(self, key: str, value: dict) -> None:
        self.seen.append(("put", key))
