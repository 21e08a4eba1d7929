"""Cluster security: the job secret, ZeroMQ CURVE keys derived from it, and the ZAP authenticator.

Executors run code they receive, so a cluster must never accept a message from a process that
is not part of the job. The rule (see ``transport.check_bind_host``): nothing listens beyond
loopback unless a job secret is configured, and with a secret every socket speaks CURVE
(authenticated, encrypted).

* The **job secret** is a file only its owner can read (``chmod 600``), the same file on
  every host. ``generate_secret_file`` makes one (``how_to_create`` says how from a shell).
* From the secret every process derives, deterministically, **one CURVE key pair shared by
  the whole job**: the secret key is HMAC-SHA256(secret, ``litz-curve-v1``). No key
  distribution is needed, and a process without the secret can neither complete a handshake
  with a job's ROUTER (it lacks the server key) nor pass the authenticator (it lacks the
  client key: the handshake proves possession of the secret key).
* The **authenticator** (one thread per ``zmq.Context``) answers ZAP requests, accepting only
  the job's public key, and watches each secured ROUTER's handshake events, so that every
  refused handshake is counted (``auth_refused``) and logged at WARNING with the peer's
  address where it can be known. It is started by the first secured ``Endpoint`` and stopped
  when the last one closes; it must outlive every secured ROUTER, because libzmq lets any
  CURVE client in when no ZAP handler is bound (we fail closed: a dead handler stalls
  handshakes, it never admits them).

Without a secret, a job's processes do not listen on loopback TCP, which every user of the
machine reaches: each binds a **private socket**, a Unix-domain socket in a directory that only
its user may enter (``socket_dir``, mode 700), and connects only to sockets in that directory.
Other users can then neither send a job's processes a message (which they would decode, and
may unpickle) nor register an address of their own in an open etcd and be connected to.

The process-wide **settings** (secret and bind host) exist because the master's endpoint is
created deep inside the runtime: ``configure`` (or ``configured``) sets them once, and every
``Endpoint`` created without explicit arguments uses them.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import itertools
import json
import logging
import os
import queue
import secrets
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from litz.errors import ConfigError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
KDF_LABEL = b"litz-curve-v1"
MIN_SECRET_BYTES = 16  # a short secret could be guessed offline from a recorded handshake
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC (27/ZAP)
LOG_EVERY_S = 10.0  # a peer that keeps reconnecting is logged once per interval, with a count


def how_to_create(path: str | os.PathLike[str] = "PATH") -> str:
    """The shell command that writes a new secret file, for error messages and help texts."""
    return f"litz secret {path}"


def _has_curve() -> bool:
    return bool(zmq.has("curve"))


class JobSecret:
    """A job's shared secret and the CURVE key pair derived from it (the same in every process).

    The raw secret is not kept; ``repr`` shows only the source and a fingerprint of the
    public key, so a secret never reaches a log by accident.
    """

    __slots__ = ("secret_key", "public_key", "source")

    def __init__(self, material: bytes, source: str = "<memory>") -> None:
        material = material.strip()
        if len(material) < MIN_SECRET_BYTES:
            raise ConfigError(f"the job secret from {source} is too short ({len(material)} bytes; at least "
                              f"{MIN_SECRET_BYTES} are needed); create a new one with: {how_to_create()}")
        if not _has_curve():
            raise ConfigError("this pyzmq/libzmq has no CURVE support (zmq.has('curve') is False); "
                              "install a pyzmq built with libsodium")
        seed = hmac.new(material, KDF_LABEL, hashlib.sha256).digest()
        self.secret_key: bytes = zmq.utils.z85.encode(seed)  # z85, 40 characters
        self.public_key: bytes = zmq.curve_public(self.secret_key)
        self.source = source

    @classmethod
    def from_curve_key(cls, secret_key: bytes, source: str) -> JobSecret:
        """The job secret as its derived CURVE secret key (z85, 40 characters): how a launcher hands
        its processes the secret it loaded, through a pipe, rather than the path of a file whose
        content may have changed since (a new secret there would lock its new processes out)."""
        secret_key = secret_key.strip()
        try:
            if len(secret_key) != 40:
                raise ValueError(f"{len(secret_key)} characters, not 40")
            public = zmq.curve_public(secret_key)
        except (ValueError, zmq.ZMQError) as exc:
            raise ConfigError(f"the job's key from {source} is not a CURVE secret key: {exc}") from None
        obj = cls.__new__(cls)
        obj.secret_key, obj.public_key, obj.source = secret_key, public, source
        return obj

    @property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte public key, as ZAP requests carry it."""
        return zmq.utils.z85.decode(self.public_key)

    @property
    def fingerprint(self) -> str:
        """A short, loggable name of the key (a hash of the public key, not the key)."""
        return hashlib.sha256(self.public_key).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobSecret) and hmac.compare_digest(self.public_key, other.public_key)

    def __hash__(self) -> int:
        return hash(self.public_key)

    def __repr__(self) -> str:
        return f"JobSecret(from {self.source}, key {self.fingerprint})"


#: Label of the key that signs a secured job's commands in etcd (derived from the CURVE secret key,
#: which every process of the job has).
COMMAND_LABEL = b"litz-etcd-commands-v1"
#: Seconds a signed command stays valid: an older one (a replay of one seen in etcd) is refused.
#: Hosts' clocks must agree to well within this.
COMMAND_TTL = 300.0


def _command_mac(secret: JobSecret, key: str, value: dict[str, Any]) -> str:
    body = json.dumps([key, {k: v for k, v in value.items() if k != "sig"}], sort_keys=True,
                      separators=(",", ":"), default=str)
    signing = hmac.new(secret.secret_key, COMMAND_LABEL, hashlib.sha256).digest()
    return hmac.new(signing, body.encode(), hashlib.sha256).hexdigest()


def sign_command(secret: JobSecret | None, key: str, value: dict[str, Any]) -> dict[str, Any]:
    """``value``, to be written at etcd key ``key`` (relative to the job), with the time and, for a
    secured job, an HMAC of both under the job secret (``sig``).

    etcd is the job's command channel (``litz scale``, ``stop``, ``checkpoint``, a host's join
    offer and drain, the master's requests to node agents), and anyone who can reach a shared
    etcd can write it: a secured job acts only on commands signed with its secret
    (:func:`command_refusal`), as its sockets accept only peers that hold it."""
    value = {**value, "time": value.get("time", time.time())}
    return value if secret is None else {**value, "sig": _command_mac(secret, key, value)}


def command_refusal(secret: JobSecret | None, key: str, value: dict[str, Any],
                    now: float | None = None, since: float | None = None) -> str | None:
    """Why a secured job must not act on ``value`` found at etcd key ``key``, or None (also for
    any value when the job has no secret): not signed, signed with another secret or for another
    key, older than ``COMMAND_TTL`` s, or signed before ``since`` (when the reader started: a
    command of an earlier run of the job, such as the ``litz stop`` that ended it, replayed to the
    run resumed after it). The master also refuses a command id it has taken already."""
    if secret is None:
        return None
    sig = value.get("sig")
    if not isinstance(sig, str):
        return ("it is not signed with the job secret (this job is secured: pass --secret-file, or set "
                "$LITZ_SECRET_FILE)")
    if not hmac.compare_digest(sig, _command_mac(secret, key, value)):
        return "its signature is not the job secret's"
    when = value.get("time")
    now = time.time() if now is None else now
    if not isinstance(when, (int, float)) or isinstance(when, bool) or abs(now - when) > COMMAND_TTL:
        return f"it was signed more than {COMMAND_TTL:.0f} s from now (a replay, or clocks that disagree)"
    if since is not None and when < since:
        return "it was signed before this process started (a replay of an earlier run's, or clocks that disagree)"
    return None


def load_secret(path: str | os.PathLike[str]) -> JobSecret:
    """Read a job secret from a file that exists, is not empty and only its owner can access.

    The mode is checked on the opened file (no race between check and read). A file that
    group or others can read is refused: anyone who reads it can join the job and run code.
    """
    p = Path(path).expanduser()
    try:  # non-blocking: opening a FIFO for reading would otherwise wait for a writer for ever
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"no secret file {p}; create one with: {how_to_create(p)}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the secret file {p}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # checked on the descriptor, before any read (a directory cannot be read)
        os.close(fd)
        raise ConfigError(f"the secret file {p} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_mode & 0o077:
            raise ConfigError(f"the secret file {p} is accessible by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); run `chmod 600 {p}`")
        data = f.read()
    if not data.strip():
        raise ConfigError(f"the secret file {p} is empty; create a new one with: {how_to_create(p)}")
    return JobSecret(data, source=str(p))


def generate_secret_file(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write a new job secret (32 random bytes as hex) to ``path`` with mode 600; return the path.

    The file is created with mode 600 from the start (never briefly readable by others), and an
    existing file is kept unless ``overwrite``: replacing a running job's secret locks it out.
    """
    p = Path(path).expanduser()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(p, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"the secret file {p} already exists (not overwritten)") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask may not widen it, but an overwritten file keeps its mode
        f.write(secrets.token_hex(32) + "\n")
    return p


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only reaches this machine.

    Anything not recognisably loopback (a wildcard, a host name, an interface name) counts as
    reachable from outside: the safe answer when in doubt.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- private sockets (no secret) ------------------------------------------------------------

SOCKET_DIR_ENV = "LITZ_SOCKET_DIR"
MAX_SOCKET_PATH = 100  # a Unix socket's path must fit sun_path (108 bytes on Linux, 104 on BSDs)
_SOCKET_SUFFIX = ".sock"
_NAME_ROOM = 36  # "/PID-SEQ-TAG.sock": pid up to 7 digits, a sequence number, a tag of up to 12
_socket_seq = itertools.count()
_swept: set[str] = set()


def socket_dir() -> Path:
    """This user's directory of private job sockets: made (mode 700) and checked on each call.

    ``$LITZ_SOCKET_DIR`` if set, else ``$XDG_RUNTIME_DIR/litz`` (a per-user directory the
    session manager made), else ``litz-UID`` in the temporary directory. Every process of a
    job inherits the same environment, so they all agree. The directory must be this user's,
    not a link, and closed to group and others: anyone who could enter it could send the
    job's processes messages, or replace their sockets.
    """
    chosen = os.environ.get(SOCKET_DIR_ENV)
    if chosen:
        path = Path(chosen)
        if not path.is_absolute():  # every process must find the same directory, whatever its cwd
            raise ConfigError(f"{SOCKET_DIR_ENV} must be an absolute path, not {chosen!r}")
    elif (runtime := Path(os.environ.get("XDG_RUNTIME_DIR") or "relative")).is_absolute() and runtime.is_dir():
        path = runtime / "litz"
    else:
        path = Path(tempfile.gettempdir()).absolute() / f"litz-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot make the socket directory {path}: {exc.strerror} "
                          f"(set {SOCKET_DIR_ENV} to a directory of yours)") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"the socket directory {path} is not a directory (a link or a file); "
                          f"set {SOCKET_DIR_ENV} to a directory of yours")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"the socket directory {path} belongs to uid {st.st_uid}, not to this user "
                          f"({os.geteuid()}): another user could send the job messages; remove it or set "
                          f"{SOCKET_DIR_ENV} to a directory of yours")
    if st.st_mode & 0o077:
        raise ConfigError(f"the socket directory {path} is open to group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): run chmod 700 {path}, or set {SOCKET_DIR_ENV}")
    if len(str(path)) + _NAME_ROOM > MAX_SOCKET_PATH:
        raise ConfigError(f"the socket directory {path} is too long a path for Unix sockets "
                          f"(at most {MAX_SOCKET_PATH - _NAME_ROOM} characters): set {SOCKET_DIR_ENV} to a shorter one")
    return path


def private_address(ident: str, directory: Path) -> str:
    """A fresh ``ipc://`` address in ``directory`` (``socket_dir()``) for a process's mailbox named ``ident``.

    The name starts with the process id, so that sockets left by killed processes (a socket
    file outlives a ``kill -9``) are recognised and removed: once per directory and process.
    """
    if str(directory) not in _swept:
        _swept.add(str(directory))
        _remove_stale_sockets(directory)
    tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in ident)[:12]
    return f"ipc://{directory}/{os.getpid()}-{next(_socket_seq)}-{tag}{_SOCKET_SUFFIX}"


def is_private_address(address: str, directory: Path) -> bool:
    """Whether ``address`` is a socket in ``directory`` (``socket_dir()``); a private endpoint
    connects to nothing else."""
    prefix = f"ipc://{directory}/"
    name = address[len(prefix):]
    return (address.startswith(prefix) and name.endswith(_SOCKET_SUFFIX) and "/" not in name
            and name not in (".", ".."))


def _remove_stale_sockets(directory: Path) -> None:
    """Remove the sockets of processes that no longer exist (their names start with the pid)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid_text = name.split("-", 1)[0]
        if not (name.endswith(_SOCKET_SUFFIX) and pid_text.isdigit()):
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            with suppress(OSError):
                os.unlink(directory / name)
        except OSError:  # it exists (another user's process, say): leave its socket alone
            pass


# -- process-wide settings ------------------------------------------------------------------

class Configured(enum.Enum):
    """The type of ``CONFIGURED`` (a sentinel distinct from ``None``, which means "no secret")."""

    CONFIGURED = "configured"


CONFIGURED = Configured.CONFIGURED
"""Default of ``Endpoint(secret=...)``: use the process-wide setting."""


@dataclass(frozen=True)
class Settings:
    """What a process's endpoints use unless told otherwise: its job secret and bind address."""

    secret: JobSecret | None = None
    host: str = LOOPBACK


_settings = Settings()


def settings() -> Settings:
    """The current process-wide settings."""
    return _settings


def configure(secret: JobSecret | str | os.PathLike[str] | None = None, host: str = LOOPBACK) -> Settings:
    """Set the process-wide secret (a ``JobSecret`` or a secret file's path) and bind host.

    Returns the previous settings so that a caller can restore them (see ``configured``).
    Endpoints created earlier keep what they were created with.
    """
    global _settings
    if secret is not None and not isinstance(secret, JobSecret):
        secret = load_secret(secret)
    previous = _settings
    _settings = Settings(secret, host)
    return previous


@contextmanager
def configured(secret: JobSecret | str | os.PathLike[str] | None = None,
               host: str = LOOPBACK) -> Iterator[Settings]:
    """``configure`` for the duration of a block, then restore (the launcher runs several jobs in one process)."""
    global _settings
    previous = configure(secret, host)
    try:
        yield _settings
    finally:
        _settings = previous


# -- CURVE on sockets -----------------------------------------------------------------------

def apply_curve(sock: zmq.Socket, secret: JobSecret, server: bool) -> None:
    """Make ``sock`` a CURVE server (binds) or client (connects) with the job's key pair."""
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret.secret_key)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, secret.public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, secret.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret.secret_key)


_FAILURES = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "it does not use CURVE (a process without the job secret)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "it does not have this job's key (no or a different job secret)",
}

_WATCHED_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(eq=False)
class Watch:
    """One secured ROUTER as the authenticator sees it: its ZAP domain, allowed key and refusals."""

    label: str
    domain: bytes
    allowed: bytes
    monitor_addr: str
    refused: int = 0  # written by the authenticator thread only
    peers: dict[int, tuple[str, str]] = field(default_factory=dict)  # accepted fd -> (host, host:port)
    failure: str | None = None  # a handshake failure waiting for its DISCONNECTED event
    error: str | None = None  # why the authenticator could not take this ROUTER


UNKNOWN_PEER = ("unknown", "an unknown peer")


def _peer_of(fd: int) -> tuple[str, str]:
    """(host, host:port) of a socket libzmq just accepted, if it is still open (best effort).

    libzmq's monitor reports the descriptor, not the address, and a fast-failing handshake
    may already have closed it; the descriptor is borrowed, never closed here.
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return UNKNOWN_PEER
    try:
        addr = sock.getpeername()
    except OSError:
        return UNKNOWN_PEER
    finally:
        sock.detach()
    if isinstance(addr, tuple):
        return str(addr[0]), f"{addr[0]}:{addr[1]}"
    return str(addr), str(addr)


class _LogLimiter:
    """Log refusals of one kind at most once per interval, counting the rest and naming their hosts.

    A refused DEALER reconnects every 100 ms; without this one stray process would fill the
    log of every process it tries.
    """

    def __init__(self, every: float = LOG_EVERY_S) -> None:
        self.every = every
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], tuple[int, set[str]]] = {}

    def warn(self, label: str, peer: tuple[str, str], reason: str) -> None:
        """``peer`` is (host, how to show it)."""
        key = (label, reason)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            count, hosts = self._suppressed.get(key, (0, set()))
            if peer is not UNKNOWN_PEER and len(hosts) < 8:
                hosts.add(peer[0])
            self._suppressed[key] = (count + 1, hosts)
            return
        more = ""
        count, hosts = self._suppressed.pop(key, (0, set()))
        if count:
            more = f" ({count} more such refusals in the last {now - last:.0f} s" if last is not None else " ("
            more += f", from {', '.join(sorted(hosts))})" if hosts else ")"
        log.warning("%s: refused a connection from %s: %s%s", label, peer[1], reason, more)
        self._last[key] = now


class Authenticator:
    """The ZAP handler and handshake watcher of one ``zmq.Context`` (a thread; see the module doc)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.users = 0
        self._commands: queue.SimpleQueue[tuple[str, Watch | None, threading.Event | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ready = threading.Event()
        self._error: str | None = None
        self._limiter = _LogLimiter()
        self._thread = threading.Thread(target=self._run, name="litz-authenticator", daemon=True)

    # -- called by endpoints (any thread) -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._close_pipe()
            raise ConfigError(self._error)

    def attach(self, router: zmq.Socket, secret: JobSecret, label: str, domain: bytes) -> Watch:
        """Register a secured ROUTER (before it binds): its ZAP domain and its handshake monitor."""
        watch = Watch(label, domain, secret.public_key_bytes, f"inproc://litz-monitor-{domain.decode()}")
        router.setsockopt(zmq.ZAP_DOMAIN, domain)
        router.monitor(watch.monitor_addr, _WATCHED_EVENTS)
        self._call("attach", watch, wait=True)  # the monitor is connected before any event can be lost
        if watch.error is not None:
            router.disable_monitor()  # nobody reads it: its events would block libzmq's I/O thread
            raise ConfigError(watch.error)
        return watch

    def detach(self, watch: Watch) -> None:
        """Forget a ROUTER that was closed (its domain is then refused, should anything still ask)."""
        self._call("detach", watch, wait=False)

    def stop(self) -> None:
        self._call("stop", None, wait=False)
        self._thread.join()
        self._close_pipe()

    def _call(self, op: str, watch: Watch | None, wait: bool) -> None:
        done = threading.Event() if wait else None
        self._commands.put((op, watch, done))
        os.write(self._wake_w, b"x")
        if done is not None:
            done.wait()

    def _close_pipe(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        zap = self.ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        for attempt in range(20):  # a just-closed handler may hold the address a moment longer
            try:
                zap.bind(ZAP_ENDPOINT)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or attempt == 19:
                    zap.close()
                    self._error = (f"cannot start the Litz authenticator: {ZAP_ENDPOINT} is taken ({exc}); "
                                   "another ZAP handler runs on this zmq.Context")
                    self._ready.set()
                    return
                time.sleep(0.05)
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        domains: dict[bytes, Watch] = {}
        monitors: dict[zmq.Socket, Watch] = {}
        self._ready.set()
        running = True
        while running:
            for sock, _ in poller.poll():
                try:
                    if sock is zap:
                        self._answer(zap, domains)
                    elif sock == self._wake_r:
                        running = self._commands_ready(poller, domains, monitors)
                    elif isinstance(sock, zmq.Socket) and sock in monitors:
                        self._monitor_event(sock, monitors)
                except Exception:  # never let one bad event stop authentication
                    log.exception("authenticator: failed to handle an event")
        for mon in monitors:
            mon.close(linger=0)
        zap.unbind(ZAP_ENDPOINT)  # synchronous for inproc, unlike close: a successor may bind at once
        zap.close(linger=0)

    def _commands_ready(self, poller: zmq.Poller, domains: dict[bytes, Watch],
                        monitors: dict[zmq.Socket, Watch]) -> bool:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                op, watch, done = self._commands.get_nowait()
            except queue.Empty:
                return True
            if op == "stop":
                return False
            assert watch is not None
            try:
                if op == "attach":
                    mon = self.ctx.socket(zmq.PAIR)
                    mon.setsockopt(zmq.LINGER, 0)
                    # no limit: libzmq's monitor send blocks its I/O thread when the pipe is full,
                    # so a flood of refused peers while this thread is slow must queue, not stall
                    mon.setsockopt(zmq.RCVHWM, 0)
                    mon.connect(watch.monitor_addr)
                    poller.register(mon, zmq.POLLIN)
                    monitors[mon] = watch
                    domains[watch.domain] = watch
                elif op == "detach":
                    domains.pop(watch.domain, None)
                    for mon, w in list(monitors.items()):
                        if w is watch:
                            self._flush(watch)
                            poller.unregister(mon)
                            del monitors[mon]
                            mon.close(linger=0)
            except zmq.ZMQError as exc:
                watch.error = f"the authenticator cannot watch {watch.label}: {exc}"
            finally:
                if done is not None:  # the caller waits: it must be woken whatever happened
                    done.set()

    def _answer(self, zap: zmq.Socket, domains: dict[bytes, Watch]) -> None:
        """Answer one ZAP request (RFC 27): 200 for the job's own key, 400 for anything else."""
        frames = zap.recv_multipart()
        if len(frames) < 6:
            log.warning("authenticator: malformed ZAP request (%d frames) refused", len(frames))
            zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"malformed", b"", b""])
            return
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        watch = domains.get(domain)
        ok = (version == b"1.0" and watch is not None and mechanism == b"CURVE" and len(credentials) == 1
              and hmac.compare_digest(credentials[0], watch.allowed))
        log.debug("ZAP request for %s from %s: %s", watch.label if watch else domain, address,
                  "accepted" if ok else "refused")
        if ok:
            zap.send_multipart([b"1.0", request_id, b"200", b"OK", b"litz", b""])
            return
        label = watch.label if watch is not None else f"domain {domain.decode(errors='replace')}"
        if watch is not None:
            watch.refused += 1
        reason = ("its CURVE key is not this job's (a process with a different job secret)"
                  if mechanism == b"CURVE" else f"mechanism {mechanism.decode(errors='replace')} is not allowed")
        host = address.decode(errors="replace")
        self._limiter.warn(label, (host, host) if host else UNKNOWN_PEER, reason)
        zap.send_multipart([b"1.0", request_id, b"400", b"not a member of this job", b"", b""])

    def _monitor_event(self, mon: zmq.Socket, monitors: dict[zmq.Socket, Watch]) -> None:
        """Count and log handshakes that fail before ZAP is asked (no key, or the wrong server key)."""
        watch = monitors[mon]
        event = parse_monitor_message(mon.recv_multipart())
        kind, value = event["event"], int(event["value"])
        log.debug("%s: handshake monitor: %s %s", watch.label, zmq.Event(kind).name, value)
        if kind == zmq.EVENT_ACCEPTED:
            watch.peers[value] = _peer_of(value)
        elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            self._flush(watch)
            watch.refused += 1
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # the value is a ZMTP protocol error code
                watch.failure = _FAILURES.get(value, f"its handshake failed (ZMTP protocol error {value:#x})")
            else:  # the value is an errno: the connection broke during the handshake
                watch.failure = f"its connection broke during the handshake ({os.strerror(value) or value})"
        elif kind == zmq.EVENT_DISCONNECTED:
            # libzmq reports a failed handshake, then at once the disconnection naming the fd
            self._flush(watch, watch.peers.pop(value, UNKNOWN_PEER))
        # HANDSHAKE_FAILED_AUTH: a ZAP refusal, already counted and logged by _answer

    def _flush(self, watch: Watch, peer: tuple[str, str] = UNKNOWN_PEER) -> None:
        if watch.failure is not None:
            self._limiter.warn(watch.label, peer, watch.failure)
            watch.failure = None


_lock = threading.Lock()
_authenticators: dict[zmq.Context, Authenticator] = {}
_domain_ids = itertools.count()


def guard(router: zmq.Socket, ctx: zmq.Context, secret: JobSecret, label: str) -> Watch:
    """Put a secured ROUTER (not yet bound) under its context's authenticator, starting it if needed."""
    with _lock:
        auth = _authenticators.get(ctx)
        if auth is None:
            auth = Authenticator(ctx)
            auth.start()
            _authenticators[ctx] = auth
        auth.users += 1
    try:
        return auth.attach(router, secret, label, f"litz-{os.getpid()}-{next(_domain_ids)}".encode())
    except BaseException:
        release(ctx, None)
        raise


def release(ctx: zmq.Context, watch: Watch | None) -> None:
    """Forget a closed ROUTER; the last one out stops its context's authenticator.

    Call only after the ROUTER is closed: a live CURVE ROUTER without a ZAP handler would
    admit any client that knows the server key.
    """
    with _lock:
        auth = _authenticators.get(ctx)
        if auth is None:
            return
        if watch is not None:
            auth.detach(watch)
        auth.users -= 1
        if auth.users > 0:
            return
        del _authenticators[ctx]
        auth.stop()  # under the lock: a new authenticator must not bind ZAP before this one let go
