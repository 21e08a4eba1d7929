"""Cluster security: job secrets, CURVE on every socket, refusal (and logging) of outsiders.

Real sockets on loopback; an outsider must never get a message delivered, whether it has no
secret, a different secret, or the job's server key but not its client key pair.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
import zmq

import litz
from litz.errors import ConfigError, ProtocolError
from litz.runtime import jobs, protocol, security
from litz.runtime.security import JobSecret, generate_secret_file, load_secret
from litz.runtime.transport import Endpoint, check_bind_host, make_socket
from tests import testapps
from tests.conftest import processes_mentioning, run_in_thread, wait_running

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

NOTHING_FOR = 1000  # ms an outsider's message is waited for (it must never arrive)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return generate_secret_file(tmp_path / "job.secret")


@pytest.fixture
def secured(secret_file: Path) -> Iterator[Endpoint]:
    # a label of its own: refusals are logged once per label and reason per interval
    ep = Endpoint(f"guarded-{time.time_ns()}", secret=load_secret(secret_file))
    try:
        yield ep
    finally:
        ep.close()


def wait_for(predicate, timeout: float = 5.0) -> bool:  # noqa: ANN001 - a test helper
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- secret files -----------------------------------------------------------------------------

def test_generated_secret_file_is_private_and_derives_the_same_keys(tmp_path: Path) -> None:
    path = generate_secret_file(tmp_path / "s")
    assert os.stat(path).st_mode & 0o777 == 0o600
    a, b = load_secret(path), load_secret(path)
    assert a == b and a.public_key == zmq.curve_public(a.secret_key)
    assert a != load_secret(generate_secret_file(tmp_path / "other"))
    assert a.secret_key.decode() not in repr(a) and path.read_text().strip() not in repr(a)
    with pytest.raises(ConfigError, match="already exists"):
        generate_secret_file(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_secret_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = generate_secret_file(tmp_path / "s")
    path.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(path)


def test_missing_empty_or_short_secret_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no secret file"):
        load_secret(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.write_bytes(b" \n")
    empty.chmod(0o600)
    with pytest.raises(ConfigError, match="empty"):
        load_secret(empty)
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="too short"):
        load_secret(short)
    # not a regular file: refused, at once (a FIFO with no writer must not block the read)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    (tmp_path / "dir").mkdir(mode=0o700)
    for other in (fifo, tmp_path / "dir", Path("/dev/null")):
        with pytest.raises(ConfigError, match=f"the secret file {other} is not a regular file"):
            load_secret(other)


# -- the binding rule -------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "*", "myhost.example"])
def test_non_loopback_without_secret_is_refused_before_binding(host: str) -> None:
    with pytest.raises(ConfigError, match="without a job secret"):
        check_bind_host(host, None)
    with pytest.raises(ConfigError, match="without a job secret"):
        Endpoint("x", host=host, secret=None)


def test_without_ipc_a_job_without_a_secret_is_refused_not_put_on_loopback_tcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A libzmq without ``ipc://`` (not Linux's) made an endpoint without a secret listen on plain
    loopback TCP, which every local user can reach unauthenticated. It is refused, saying why."""
    has = zmq.has
    monkeypatch.setattr(zmq, "has", lambda what: what != "ipc" and has(what))
    with pytest.raises(ConfigError, match="no ipc:// transport.*give the job a secret"):
        Endpoint("x", secret=None)


def test_cluster_without_secret_is_refused_and_a_secret_allows_it(secret_file: Path) -> None:
    with pytest.raises(ConfigError, match="requires a job secret"):
        Endpoint("x", cluster=True, secret=None)
    check_bind_host("10.1.2.3", load_secret(secret_file))  # allowed (not bound here)
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        check_bind_host(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", "::0", "0:0:0:0:0:0:0:0", "[0:0::0]", "0", " 0.0.0.0 ",
                                  "::ffff:0.0.0.0", "::ffff:0:0"])
def test_a_wildcard_host_is_refused_even_with_a_secret(secret_file: Path, host: str) -> None:
    """The address a process listens on is the one it registers for its peers: ``tcp://0.0.0.0:P``
    was registered, and a peer on another host connecting there reached its own machine."""
    with pytest.raises(ConfigError, match="a wildcard is none"):
        Endpoint("x", host=host, secret=load_secret(secret_file))


def test_ipv6_loopback_binds_and_carries_messages(secret_file: Path) -> None:
    """``::1`` counted as loopback, then failed to bind (ZMQError: No such device): IPv6 was off and
    the address unbracketed. (With a secret: TCP, as across hosts.)"""
    secret = load_secret(secret_file)
    a, b = Endpoint("a", host="::1", secret=secret), Endpoint("b", host="::1", secret=secret)
    try:
        assert b.address.startswith("tcp://[::1]:")
        a.connect("b", b.address)
        a.send("b", "stats_request", rid=7)
        assert b.recv()["rid"] == 7
    finally:
        a.close()
        b.close()


def test_run_refuses_a_public_host_without_secret_before_starting_anything() -> None:
    job = f"nosecret-{time.time_ns()}"
    with pytest.raises(ConfigError, match="without a job secret"):
        litz.run(testapps.sum_app(rows=4, tasks=4, executors=2), workers=1, servers=1, job=job, host="0.0.0.0")
    assert processes_mentioning(job) == []


def test_launch_refuses_a_public_host_without_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from litz.cli import main

    app_file = tmp_path / "tiny_app.py"
    app_file.write_text("import litz\nfrom tests.testapps import sum_app\napp = sum_app(rows=4, tasks=4)\n")
    assert main(["launch", str(app_file), "--host", "0.0.0.0"]) == 1
    assert "without a job secret" in capsys.readouterr().err


def test_configured_settings_reach_endpoints_made_without_arguments(secret_file: Path) -> None:
    secret = load_secret(secret_file)
    with security.configured(secret_file):
        ep = Endpoint("master-like")
        try:
            assert ep.secret == secret and ep.counters()["secured"] == 1
        finally:
            ep.close()
    ep = Endpoint("after")
    try:
        assert ep.secret is None and ep.counters()["secured"] == 0
    finally:
        ep.close()


# -- without a secret: private sockets ---------------------------------------------------------

def _socket_path(ep: Endpoint) -> str:
    assert ep.address.startswith("ipc://"), ep.address
    return ep.address[len("ipc://"):]


def test_without_a_secret_an_endpoint_is_a_private_socket_that_its_user_reaches() -> None:
    ep, peer = Endpoint("private"), Endpoint("peer")
    try:
        directory = security.socket_dir()
        assert os.path.dirname(_socket_path(ep)) == str(directory)
        st = os.lstat(directory)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert ep.private and not ep.counters()["secured"]
        assert peer.connect("private", ep.address)
        peer.send("private", "stats_request", rid=7)
        assert ep.router.poll(5000)
        msg = ep.recv()
        assert msg is not None and msg.sender == "peer" and msg["rid"] == 7
    finally:
        ep.close()
        peer.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_a_private_socket() -> None:
    # made with umask 0, the socket file itself is open to all (mode 777): only the directory,
    # which only its user may enter, keeps others out
    previous = os.umask(0)
    try:
        ep = Endpoint("private")
    finally:
        os.umask(previous)
    try:
        assert stat.S_IMODE(os.stat(_socket_path(ep)).st_mode) == 0o777
        path = _socket_path(ep)
        assert _as_nobody_connect(path) == 0, "another user could connect to a job's socket"
        assert not ep.router.poll(200)
    finally:
        ep.close()


def test_a_private_endpoint_connects_only_to_its_users_sockets(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="litz.runtime.transport")
    ep = Endpoint("careful")
    try:
        directory = security.socket_dir()
        for address in ("tcp://127.0.0.1:9", "ipc:///tmp/elsewhere/1-0-x.sock", f"ipc://{directory}/../1-0-x.sock",
                        f"ipc://{directory}/sub/1-0-x.sock", f"ipc://{directory}/1-0-x.txt", f"ipc://{directory}x/1-0-x.sock"):
            assert not ep.connect("fake", address), address
        assert "careful: not connecting to 'fake' at tcp://127.0.0.1:9" in caplog.text
        with pytest.raises(ProtocolError, match="no address known for peer 'fake'"):
            ep.send("fake", "stats_request", rid=1)
        assert ep.connect("good", f"ipc://{directory}/1-0-x.sock")
    finally:
        ep.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (pytest's own may be too long for a socket directory)."""
    path = Path(tempfile.mkdtemp(prefix="lz-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_socket_directory_others_could_enter_is_refused(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = short_tmp
    good = tmp_path / "s"
    monkeypatch.setenv(security.SOCKET_DIR_ENV, str(good))
    assert security.socket_dir() == good and stat.S_IMODE(good.stat().st_mode) == 0o700  # made
    good.chmod(0o755)
    with pytest.raises(ConfigError, match=r"open to group or others \(mode 755\): run chmod 700"):
        Endpoint("x")
    link = tmp_path / "link"
    link.symlink_to(good)
    monkeypatch.setenv(security.SOCKET_DIR_ENV, str(link))
    with pytest.raises(ConfigError, match="is not a directory"):
        security.socket_dir()
    monkeypatch.setenv(security.SOCKET_DIR_ENV, "relative/dir")
    with pytest.raises(ConfigError, match="must be an absolute path, not 'relative/dir'"):
        security.socket_dir()
    monkeypatch.setenv(security.SOCKET_DIR_ENV, str(tmp_path / ("d" * 90)))
    with pytest.raises(ConfigError, match="too long a path for Unix sockets"):
        security.socket_dir()
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(0o700)
        os.chown(theirs, 65534, 65534)
        monkeypatch.setenv(security.SOCKET_DIR_ENV, str(theirs))
        with pytest.raises(ConfigError, match="belongs to uid 65534, not to this user"):
            security.socket_dir()


def test_sockets_of_dead_processes_are_removed_and_live_ones_kept(short_tmp: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    directory = short_tmp / "s"
    directory.mkdir(0o700)
    monkeypatch.setenv(security.SOCKET_DIR_ENV, str(directory))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live, other = (directory / f"{dead.pid}-0-w0.sock", directory / f"{os.getppid()}-3-m.sock",
                          directory / "notes.txt")
    for path in (stale, live, other):
        path.write_text("")
    ep = Endpoint("sweeper")
    try:
        assert not stale.exists() and live.exists() and other.exists()
        assert os.path.exists(_socket_path(ep))
    finally:
        ep.close()


def _tcp_listeners() -> set[str]:
    """Socket inodes of every TCP socket listening on this machine (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def _as_nobody_connect(path: str) -> int:
    """0 if user nobody is refused a connection to the Unix socket ``path``, 1 if connected.

    In a fresh interpreter (single-threaded: forking this one, with gRPC's and ZeroMQ's threads,
    can crash the child), which imports what it needs before it gives up root."""
    code = ("import os, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "os.setgid(65534)\nos.setuid(65534)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(0)\nsys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", code, path], timeout=30).returncode


def test_an_agent_takes_only_spawn_requests_of_ids_the_master_makes(caplog: pytest.LogCaptureFixture) -> None:
    """Spawn requests reach a host's agent through etcd, which anyone who can reach a shared etcd
    may write. An id names the new process's log file: ``/home/x/app`` or ``../x`` made the agent
    truncate or create files elsewhere as the job's user, and a list of thousands forked thousands
    of processes. Such a request is refused whole, with a warning; the master's are taken. So were
    requests of fresh ids without end, each within the cap: the host's live processes of the job
    are capped too (dead ones do not count)."""
    import shutil

    from litz.runtime.launcher import MAX_SPAWN, LocalCluster

    class Alive:
        code: int | None = None

        def poll(self) -> int | None:
            return self.code

    cluster = LocalCluster("spawn-check", workers=1, servers=1)
    started: list[tuple[str, str]] = []

    def spawn(module: str, ident: str, numba: bool = False) -> None:
        started.append((module, ident))
        cluster.children[ident] = Alive()  # type: ignore[assignment]

    cluster._spawn = spawn  # type: ignore[method-assign]
    try:
        for bad in ({"workers": ["/tmp/victim"]}, {"workers": ["../escaped"]}, {"servers": ["w1"]},
                    {"workers": "w1"}, ["w1"], {"workers": [1]},
                    {"workers": [f"w{i}" for i in range(MAX_SPAWN + 1)]}):
            with caplog.at_level("WARNING"):
                cluster.handle_spawn(bad)
        assert started == []
        assert caplog.text.count("ignored a spawn request") == 7, caplog.text
        cluster.handle_spawn({"workers": ["w3"], "servers": ["s2"], "numba": False, "command": 4})
        assert [ident for _, ident in started] == ["w3", "s2"]
        for first in range(10, 10 + MAX_SPAWN, 100):  # fresh ids, 100 a request: 2 + 254 taken, then no more
            cluster.handle_spawn({"workers": [f"w{i}" for i in range(first, first + 100)]})
        assert len(started) == 202 and "at most 256 in all" in caplog.text
        cluster.handle_spawn({"workers": [f"w{i}" for i in range(500, 554)]})  # 202 + 54 = 256: taken
        cluster.handle_spawn({"workers": ["w600"]})
        assert len(started) == 256
        cluster.children["w500"].code = 0  # one left: room for one more
        cluster.handle_spawn({"workers": ["w600", "w601"]})
        cluster.handle_spawn({"workers": ["w602"]})
        assert len(started) == 257 and started[-1][1] == "w602"
    finally:
        shutil.rmtree(cluster.rundir, ignore_errors=True)


def test_a_local_job_without_etcd_listens_on_no_tcp_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its etcd, workers and servers all use Unix sockets in directories only their user enters."""
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    job = f"private-{time.time_ns()}"
    runner, out = run_in_thread(testapps.slow_app(executors=2, stop_after=3.0), workers=1, servers=1, job=job)
    try:
        deadline = time.monotonic() + 20
        record: dict = {}
        while not (record and len(processes_mentioning(job)) >= 2):
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.1)
            with suppress(ConfigError):
                record = jobs.lookup(job)
        url = record["etcd"]
        assert url.startswith("unix:///"), url
        etcd_dir = os.path.dirname(url[len("unix://"):])
        st = os.lstat(etcd_dir)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        etcd_pids = processes_mentioning(f"--data-dir {etcd_dir}/data")
        procs = processes_mentioning(job)
        assert len(etcd_pids) == 1 and len(procs) >= 2
        listening = _tcp_listeners()
        for pid in etcd_pids + procs:
            assert not _socket_inodes(pid) & listening, f"process {pid} listens on TCP"
        if os.geteuid() == 0:
            assert _as_nobody_connect(url[len("unix://"):]) == 0, "another user could reach the job's etcd"
    finally:
        runner.join(60)
    assert out["res"].value == "done"


# -- outsiders are refused --------------------------------------------------------------------

def test_a_member_is_heard(secured: Endpoint, secret_file: Path) -> None:
    member = Endpoint("member", secret=load_secret(secret_file))
    try:
        member.connect("guarded", secured.address)
        member.send("guarded", "stats_request", rid=1)
        assert secured.router.poll(5000)
        msg = secured.recv()
        assert msg is not None and msg.sender == "member" and msg["rid"] == 1
        assert secured.counters()["auth_refused"] == 0
    finally:
        member.close()


def test_a_member_sends_frames_bigger_than_a_secured_socket_takes(secured: Endpoint, secret_file: Path) -> None:
    """A secured socket takes frames of at most ``MAX_FRAME`` bytes (``ZMQ_MAXMSGSIZE``: a stranger's
    handshake may not make it buffer gigabytes). A member's bigger frames (an array, a header with
    a pickle in it) go as pieces and arrive whole; small messages are sent as they are."""
    from litz.runtime.transport import MAX_FRAME

    member = Endpoint("member", secret=load_secret(secret_file))
    try:
        member.connect("guarded", secured.address)
        big = np.arange(MAX_FRAME // 8 * 3 + 5, dtype=np.float64)
        blob = os.urandom(MAX_FRAME + 1)
        member.send("guarded", "stats", rid=1, stats={"big": big, "blob": (blob,), "empty": np.zeros((0, 3)),
                                                      "small": np.ones(4, np.int16)})
        member.send("guarded", "stats", rid=2, stats={"small": np.ones(4, np.int16)})
        got = []
        while len(got) < 2:
            assert secured.router.poll(10_000), "nothing arrived"
            got.append(secured.recv())
        first, second = got
        assert first is not None and first["rid"] == 1 and second is not None and second["rid"] == 2
        np.testing.assert_array_equal(first["stats"]["big"], big)
        assert first["stats"]["blob"] == (blob,) and first["stats"]["empty"].shape == (0, 3)
        np.testing.assert_array_equal(first["stats"]["small"], np.ones(4, np.int16))
        assert secured.counters()["bad_messages"] == 0
    finally:
        member.close()


def test_a_stranger_declaring_a_huge_frame_in_its_handshake_is_cut_off(secured: Endpoint) -> None:
    """Before CURVE has checked anything, libzmq buffered a frame of whatever size the peer
    declared (a worker went from 68 MB to 2.1 GB for one connection declaring 8 GiB). A secured
    socket now drops such a connection at the frame's header, whatever is streamed after it."""
    import socket
    import struct

    host, port = secured.address.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    try:
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" * 32
        conn.sendall(greeting + b"\x06" + struct.pack(">Q", 8 << 30))  # a long command frame of 8 GiB
        sent, cut = 0, False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sent < 256 << 20:
            try:
                conn.sendall(b"\0" * (1 << 20))
                sent += 1 << 20
            except OSError:  # reset by the peer
                cut = True
                break
        if not cut:  # (all of it may fit in the kernel's buffers before the reset is seen)
            with suppress(OSError):
                cut = conn.recv(1 << 16, socket.MSG_PEEK) == b"" or conn.recv(1 << 16) == b""
        assert cut, f"the connection was still open after {sent >> 20} MiB of one frame"
    finally:
        conn.close()


@pytest.mark.parametrize("outsider", ["no secret", "different secret"])
def test_outsider_endpoint_cannot_deliver_and_is_logged(secured: Endpoint, outsider: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="litz.runtime.security")
    secret = None if outsider == "no secret" else JobSecret(os.urandom(32).hex().encode())
    # a plain socket: an Endpoint without a secret would not even connect to a TCP address
    intruder = make_socket(zmq.Context.instance(), zmq.DEALER, identity="intruder", secret=secret)
    try:
        intruder.connect(secured.address)
        intruder.send_multipart(protocol.encode("stats_request", rid=1), copy=False)
        assert not secured.router.poll(NOTHING_FOR), "an outsider delivered a message"
        assert wait_for(lambda: secured.counters()["auth_refused"] >= 1)
        assert wait_for(lambda: any(f"{secured.ident}: refused a connection from" in r.getMessage()
                                    for r in caplog.records))
        assert secured.counters()["messages_received"] == 0
    finally:
        intruder.close()


def test_right_server_key_but_foreign_key_pair_is_refused_by_zap(secured: Endpoint,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Whoever learnt the job's public key still cannot join: ZAP wants the job's own client key."""
    caplog.set_level(logging.WARNING, logger="litz.runtime.security")
    public, private = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, secured.secret.public_key)  # type: ignore[union-attr]
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, private)
    try:
        sock.connect(secured.address)
        sock.send_multipart([b"\x92\xadstats_request\x81\xa3rid\x01"])
        assert not secured.router.poll(NOTHING_FOR), "a foreign key pair delivered a message"
        assert wait_for(lambda: secured.counters()["auth_refused"] >= 1)
        assert wait_for(lambda: any(f"{secured.ident}: refused a connection from 127.0.0.1" in r.getMessage()
                                    and "CURVE key is not this job's" in r.getMessage() for r in caplog.records))
    finally:
        sock.close(linger=0)


def test_closing_secured_endpoints_with_live_connections_never_stalls(secret_file: Path) -> None:
    """Regression: monitor events sent after their reader left used to freeze libzmq's I/O thread."""
    secret = load_secret(secret_file)
    for i in range(60):
        server, client = Endpoint("server", secret=secret), Endpoint("client", secret=secret)
        try:
            client.connect("server", server.address)
            client.send("server", "stats_request", rid=i)
            assert server.router.poll(5000), f"round {i}: a member's message did not arrive"
            assert server.recv() is not None
        finally:
            server.close()  # while the client's connection is still up
            client.close()


def test_authenticator_stops_with_the_last_secured_endpoint(secret_file: Path) -> None:
    secret = load_secret(secret_file)
    ctx = zmq.Context()
    try:
        a, b = Endpoint("a", ctx=ctx, secret=secret), Endpoint("b", ctx=ctx, secret=secret)
        assert ctx in security._authenticators
        a.close()
        assert ctx in security._authenticators  # b's ROUTER still needs it
        b.close()
        assert ctx not in security._authenticators
        c = Endpoint("c", ctx=ctx, secret=secret)  # and a new one can start
        c.close()
    finally:
        ctx.term()


# -- whole jobs -------------------------------------------------------------------------------

def test_job_runs_with_curve_and_sums_are_exact(etcd, secret_file: Path) -> None:
    app = testapps.sum_app(rows=4, tasks=40, executors=2)
    res = litz.run(app, workers=2, servers=1, etcd=etcd.url, secret_file=secret_file)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    assert res.total("secured") == len(res.stats) == 4  # master, server and both workers
    assert res.total("auth_refused") == 0
    assert security.settings().secret is None  # the launcher restored the process-wide settings


def test_processes_started_later_get_the_secret_the_job_started_with(tmp_path: Path, secret_file: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher reads the secret file once and hands its processes the key through a pipe: a
    scale-out after the file was replaced (with another secret) still joins the job."""
    from litz.cli import job_status, scale

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    job = f"rotated-{time.time_ns()}"
    stop = tmp_path / "stop"
    runner, out = run_in_thread(testapps.slow_app(executors=4, stop_after=60.0, stop_file=str(stop)), workers=1,
                                servers=1, job=job, secret_file=secret_file)
    try:
        wait_running(job, out)
        kept = tmp_path / "job.secret.kept"  # (commands are signed with the job's own secret)
        shutil.copy(secret_file, kept)
        generate_secret_file(secret_file, overwrite=True)  # the file now holds another secret
        assert scale(["--job", job, "--workers", "2", "--wait", "--timeout", "30", "--secret-file", str(kept)]) == 0
        workers = [p for p in job_status(job)["processes"] if p["role"] == "worker"]
        assert len(workers) == 2 and all(p["executors"] for p in workers)
    finally:
        stop.touch()
        runner.join(60)
    assert out["res"].value == "done"
    assert out["res"].total("secured") == len(out["res"].stats) and out["res"].total("auth_refused") == 0


def test_a_secured_job_takes_only_commands_and_agent_requests_signed_with_its_secret(
        tmp_path: Path, secret_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """etcd is a job's command channel, and anyone who can reach a shared etcd can write it: before,
    such a writer could stop, scale or drain a secured job, and make its node agents start
    processes. Now a secured job's master takes only commands signed with the job secret, each
    once and only while fresh, and its agents only signed requests; the CLI signs with
    ``--secret-file`` and says what is missing without it."""
    from litz.cli import job_status, scale
    from litz.runtime.elastic import RESULTS, SCALE_KEY
    from litz.runtime.membership import Membership

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    monkeypatch.delenv("LITZ_SECRET_FILE", raising=False)
    job = f"signed-{time.time_ns()}"
    stop = tmp_path / "stop"
    secret = load_secret(secret_file)
    other = JobSecret(os.urandom(32).hex().encode())
    runner, out = run_in_thread(testapps.slow_app(executors=4, stop_after=60.0, stop_file=str(stop)), workers=1,
                                servers=1, job=job, secret_file=secret_file)

    def workers() -> list[str]:
        return sorted(p["id"] for p in job_status(job)["processes"] if p["role"] == "worker" and p["state"] == "member")

    try:
        wait_running(job, out)
        assert scale(["--job", job, "--workers", "2"]) == 1  # no secret: refused here, nothing written
        with Membership(jobs.lookup(job)["etcd"], job) as mem:
            def answer(cid: str) -> dict:
                deadline = time.monotonic() + 20
                while (got := mem.get(f"{RESULTS}{cid}")) is None:
                    assert time.monotonic() < deadline, f"no answer to {cid}"
                    time.sleep(0.05)
                return got

            forged = {"unsigned": security.sign_command(None, SCALE_KEY, {"id": "c1", "workers": 2}),
                      "other secret": security.sign_command(other, SCALE_KEY, {"id": "c2", "workers": 2}),
                      "stale": security.sign_command(secret, SCALE_KEY, {"id": "c3", "workers": 2,
                                                                         "time": time.time() - 1000}),
                      "earlier run's": security.sign_command(secret, SCALE_KEY, {"id": "c4", "workers": 2,
                                                                                 "time": time.time() - 200})}
            for (name, value), why in zip(forged.items(), ("not signed with the job secret", "not the job secret's",
                                                           "signed more than 300 s from now",
                                                           "signed before this process started"), strict=True):
                mem.put(SCALE_KEY, value)
                got = answer(value["id"])
                assert not got["ok"] and why in got["reason"], (name, got)
            agent = next(p["host"] for p in job_status(job)["processes"] if p["role"] == "agent")
            mem.put(f"agents/{agent}/spawn", {"workers": ["w7"], "time": time.time()})  # an agent request, forged
            assert scale(["--job", job, "--workers", "2", "--wait", "--timeout", "30",
                          "--secret-file", str(secret_file)]) == 0
            assert workers() == ["w0", "w1"]
            taken = mem.get(SCALE_KEY)  # the signed command, as anyone may read it back
            assert scale(["--job", job, "--workers", "1", "--wait", "--timeout", "30",
                          "--secret-file", str(secret_file)]) == 0
            with caplog.at_level(logging.WARNING):
                mem.put(SCALE_KEY, taken)  # replayed: refused, not answered (nor scaled out again)
                time.sleep(1.0)
            assert workers() == ["w0"] and "it was taken already (a replay)" in caplog.text
            assert "ignored the spawn request at agents/" in caplog.text and "w7" not in str(job_status(job))
    finally:
        stop.touch()
        runner.join(60)
    assert out["res"].value == "done"


def test_running_server_refuses_an_outsider_and_logs_it(etcd, secret_file: Path) -> None:
    from litz.runtime.launcher import LocalCluster
    from litz.runtime.membership import Membership
    from litz.runtime.node import proc_key

    job = f"secure-{time.time_ns()}"
    member = Endpoint("tester", secret=load_secret(secret_file))
    intruder = Endpoint("intruder", secret=JobSecret(os.urandom(32).hex().encode()))
    try:
        with LocalCluster(job, workers=1, servers=1, etcd=etcd.url, secret_file=secret_file) as cluster, \
                Membership(etcd.url, job) as mem:
            mem.register(proc_key("tester", "tester"), {"id": "tester", "addr": member.address, "role": "tester"})
            assert wait_for(lambda: {"procs/server/s0", "procs/worker/w0"} <= set(mem.get_prefix("procs/")), 20)
            addrs = {ident: mem.get(f"procs/{role}/{ident}")["addr"] for role, ident in
                     (("server", "s0"), ("worker", "w0"))}
            intruder.connect("s0", addrs["s0"])
            intruder.send("s0", "stats_request", rid=1)
            assert not intruder.router.poll(NOTHING_FOR), "the server answered an outsider"
            member.connect("s0", addrs["s0"])
            member.send("s0", "stats_request", rid=2)  # asked and answered over CURVE
            assert member.router.poll(10_000), "the server did not answer a member:\n" + cluster.log_tail("s0", 50)
            reply = member.recv()
            assert reply is not None and reply["rid"] == 2
            assert reply["stats"]["secured"] == 1 and reply["stats"]["auth_refused"] >= 1
            assert "s0: refused a connection from" in cluster.log_tail("s0", 50)
            for ident, addr in addrs.items():
                member.connect(ident, addr)
                member.send(ident, "shutdown", reason="test over")
            assert wait_for(lambda: all(p.poll() is not None for p in cluster.children.values()), 10)
    finally:
        intruder.close()
        member.close()
    assert processes_mentioning(job) == []
