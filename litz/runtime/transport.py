"""ZeroMQ endpoints: the only place where Litz creates sockets.

Each process owns one ``Endpoint``: a ROUTER socket bound to its address (its mailbox) and
one DEALER per peer it talks to, whose identity is the process id, so a receiver always
knows who sent a message. Because every socket is made by ``make_socket``, the security
settings of a job apply to all of them: without a job secret an endpoint's ROUTER is a private
Unix-domain socket in a directory only its user may enter, and it connects to no other kind
of address (loopback TCP would let any local user in); with a secret, its ROUTER is a CURVE
server on TCP and its DEALERs CURVE clients with the job's key pair, and the process's
authenticator refuses (counts, logs) every other peer (see ``litz.runtime.security``).

The endpoint counts messages and bytes sent, which the benchmarks report.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import msgpack
import zmq

from litz.errors import ConfigError, ProtocolError
from litz.runtime import protocol, security
from litz.runtime.protocol import Message
from litz.runtime.security import CONFIGURED, LOOPBACK, JobSecret, Watch, is_loopback

log = logging.getLogger(__name__)

__all__ = ["LOOPBACK", "Endpoint", "check_bind_host", "make_socket"]


def make_socket(ctx: zmq.Context, kind: int, identity: str | None = None,
                secret: JobSecret | None = None) -> zmq.Socket:
    """Create a socket with the job's settings (linger, high-water marks, identity, CURVE).

    With a ``secret``, a ROUTER (which binds) is a CURVE server and any other socket a CURVE
    client of the job's key pair; CURVE must be set before bind/connect to take effect.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    # Never drop messages silently: updates and completions must not be lost.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer's new connection takes its identity over from an old one not yet torn down here (a
        # socket Endpoint.forget closed a moment ago): refused, what the new one carried was lost.
        # The old one's unread messages would be dropped, but forget closes only a socket idle for
        # DEPARTED_GRACE, so there are none.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if secret is not None:
        security.apply_curve(sock, secret, server=kind == zmq.ROUTER)
        if kind == zmq.ROUTER:
            # Anyone who reaches the port may start a handshake, and libzmq buffers a frame of
            # whatever size the peer declares before CURVE has checked anything: one connection
            # declaring 8 GiB took a worker from 68 MB to 2.1 GB. Frames are capped (peers of
            # the job split bigger ones, ``_chunked``), and so is the time a handshake may take.
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME + CURVE_OVERHEAD)
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    return sock


#: The largest frame a secured socket takes (``ZMQ_MAXMSGSIZE``); a bigger one goes as pieces.
MAX_FRAME = 1 << 20
#: Bytes CURVE adds to a frame on the wire (a MESSAGE command's name, flags, nonce and MAC: 33), which
#: the limit counts, with room to spare
CURVE_OVERHEAD = 256
#: Milliseconds a peer has to complete its handshake on a secured socket (libzmq's default: 30 s).
HANDSHAKE_MS = 10_000
#: First frame of a message whose frames were cut into pieces (a header starts with 0x92).
_CHUNKED = b"\x00litz-pieces"


def _nbytes(frame: Any) -> int:
    return len(frame) if isinstance(frame, bytes) else frame.nbytes


def _chunked(frames: list[Any]) -> list[Any]:
    """``frames`` as they may go to a secured socket: as they are if none is over ``MAX_FRAME``,
    else ``[_CHUNKED, [pieces of each frame], *pieces]``, each piece a view (no copy) of at most
    ``MAX_FRAME`` bytes. Only messages that big pay (``_unchunked`` joins them: one copy)."""
    if all(_nbytes(f) <= MAX_FRAME for f in frames):
        return frames
    counts: list[int] = []
    pieces: list[Any] = []
    for frame in frames:
        raw = memoryview(frame).cast("B") if isinstance(frame, bytes) else memoryview(frame.reshape(-1).view("u1"))
        cut = [raw[i:i + MAX_FRAME] for i in range(0, len(raw), MAX_FRAME)] or [raw]
        counts.append(len(cut))
        pieces.extend(cut)
    return [_CHUNKED, msgpack.packb(counts), *pieces]


def _unchunked(frames: list[Any]) -> list[Any]:
    """The frames ``_chunked`` cut, joined again (frames that were not cut: as they are)."""
    if len(frames) < 2 or bytes(frames[0].buffer[:1]) != b"\x00" or frames[0].bytes != _CHUNKED:
        return frames
    try:
        counts = msgpack.unpackb(frames[1].bytes)
    except Exception as exc:  # msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable piece counts ({type(exc).__name__}: {exc})") from None
    if not (isinstance(counts, list) and all(type(c) is int and c > 0 for c in counts)
            and sum(counts) == len(frames) - 2):
        raise ProtocolError(f"piece counts {str(counts)[:80]} do not match the {len(frames) - 2} pieces sent")
    out, at = [], 2
    for count in counts:
        out.append(b"".join(f.buffer for f in frames[at:at + count]))
        at += count
    return out


#: Seconds a departed peer's socket is kept (Endpoint.forget): long after any message to it is due.
DEPARTED_GRACE = 30.0


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, ``*``, and their other spellings:
    ``0``, ``::0``, ``[0:0::0]``, ``::ffff:0.0.0.0``)."""
    bare = host.strip().strip("[]")
    if bare == "*":
        return True
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        pass
    else:  # (::ffff:0.0.0.0, an IPv6 socket's every IPv4 interface, too)
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)
    try:
        return socket.inet_aton(bare) == bytes(4)  # (the short IPv4 forms: "0", "0.0")
    except OSError:
        return False


def check_bind_host(host: str, secret: JobSecret | None, cluster: bool = False) -> None:
    """Refuse to listen beyond loopback, or to form a cluster, without a job secret.

    Executors run code they receive, so anything reachable from another machine must
    authenticate its peers; only loopback (this machine's own processes) may go without.
    A wildcard (every interface) is refused too: the address a process listens on is the one
    it registers for the others to connect to, and ``0.0.0.0`` there reaches each peer's own
    machine (a job across hosts stalled).
    """
    if secret is not None:
        if is_wildcard(host):
            raise ConfigError(f"cannot listen on {host}: the address a process listens on is the one the others "
                              "connect to, and a wildcard is none; give this host's address on the network the "
                              "cluster uses (--host ADDRESS)")
        return
    if not is_loopback(host):
        raise ConfigError(f"refusing to listen on {host} without a job secret: outside loopback a cluster "
                          "must authenticate its processes (pass --secret-file PATH; create the file with: "
                          f"{security.how_to_create()})")
    if cluster:
        raise ConfigError("a cluster requires a job secret (pass --secret-file PATH; create the file with: "
                          f"{security.how_to_create()})")


def host_name(bind_host: str) -> str:
    """The name a process's host goes by in the job (``litz status``, ``litz scale --drain-host``).

    A process bound to a routable address is known by that address: two hosts may share a
    hostname (containers, network namespaces) but not an address. On loopback it is the
    machine's hostname.
    """
    if is_loopback(bind_host):
        return socket.gethostname()
    return bind_host


class Endpoint:
    """A process's mailbox (ROUTER) plus outgoing DEALERs to peers, with traffic counters.

    ``host`` and ``secret`` default to the process-wide settings (``security.configure``), so
    that endpoints created inside the runtime follow the job's configuration; pass
    ``secret=None`` for an endpoint without CURVE (private: reached by this user's processes only). ``cluster=True``
    demands a secret even on loopback.
    """

    def __init__(self, ident: str, host: str | None = None, ctx: zmq.Context | None = None,
                 cluster: bool = False, secret: JobSecret | None | security.Configured = CONFIGURED) -> None:
        config = security.settings()
        host = config.host if host is None else host
        if secret is CONFIGURED:
            secret = config.secret
        assert not isinstance(secret, security.Configured)
        check_bind_host(host, secret, cluster)
        self.ident = ident
        self.secret: JobSecret | None = secret
        self.ctx = ctx or zmq.Context.instance()
        self.router = make_socket(self.ctx, zmq.ROUTER, secret=secret)
        self._watch: Watch | None = None
        self.address = ""
        # without a secret, only this user's processes may reach (and be reached by) this one
        self._socket_dir: Path | None = None
        try:
            if secret is not None:  # the authenticator must be ready before the first peer can knock
                self._watch = security.guard(self.router, self.ctx, secret, label=ident)
            elif not zmq.has("ipc"):  # plain TCP on loopback would let every local user in
                raise ConfigError("this libzmq has no ipc:// transport, which a job without a secret needs "
                                  "(Unix sockets that only your user may reach): give the job a secret "
                                  "(--secret-file), so that its processes authenticate each other over TCP")
            if secret is None:
                self._socket_dir = security.socket_dir()
                address = security.private_address(ident, self._socket_dir)
                self.router.bind(address)
            else:
                where = host
                if ":" in host:  # IPv6 (::1 was taken as loopback, then failed to bind): IPv4 peers keep
                    self.router.setsockopt(zmq.IPV6, 1)  # their plain addresses in what is logged of them
                    where = host if host.startswith("[") else f"[{host}]"
                address = f"tcp://{where}:{self.router.bind_to_random_port(f'tcp://{where}')}"
        except BaseException:
            self._close_router()
            raise
        self.address = address
        self.host = host
        self.peers: dict[str, str] = {}
        self._dealers: dict[str, zmq.Socket] = {}
        self._departed: dict[str, tuple[float, zmq.Socket]] = {}  # forgotten peers' sockets, since when
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.bad_messages = 0

    @property
    def private(self) -> bool:
        """Whether this endpoint is a private socket (no secret): it reaches only its user's sockets."""
        return self._socket_dir is not None

    def connect(self, peer: str, address: str) -> bool:
        """Remember a peer's address; the DEALER is created on first send.

        A private endpoint (no secret) refuses, with a warning, any address that is not a
        socket in this user's directory, and returns False: addresses come from etcd too,
        where without authentication anyone may register one.
        """
        if self.private and not security.is_private_address(address, self._socket_dir):
            log.warning("%s: not connecting to %r at %s: without a job secret a job's processes are this "
                        "user's private sockets (in %s)", self.ident, peer, address, self._socket_dir)
            return False
        if self.peers.get(peer) == address:
            return True
        old = self._dealers.pop(peer, None) or self._departed.pop(peer, (0.0, None))[1]
        if old is not None:
            old.close(linger=0)
        self.peers[peer] = address
        return True

    def knows(self, peer: str) -> bool:
        """Whether a message can be addressed to ``peer`` (its address is known)."""
        return peer in self.peers

    def forget(self, peer: str) -> None:
        """A peer left the job (its etcd registration is gone): its socket closes once
        :data:`DEPARTED_GRACE` has passed (at a later ``forget``, ``send``, or a node's poll).

        Before, every endpoint kept a DEALER, a file descriptor and reconnection attempts (one
        every 100 ms) for every peer that ever left: a long job that scaled out and in, or
        replaced lost processes, grew them without bound. Not closed at once: a peer whose lease
        ended while its process lives may come back, and a message sent to it meanwhile goes
        through the same socket, after what was queued (a new socket of the same identity was
        refused by the peer's ROUTER while the old connection lived, or, handed over, dropped
        what the old one carried)."""
        sock = self._dealers.pop(peer, None)
        if sock is not None:
            self._departed[peer] = (time.monotonic(), sock)
        self.close_departed()

    def close_departed(self) -> None:
        """Close the sockets of peers forgotten at least :data:`DEPARTED_GRACE` ago (see :meth:`forget`)."""
        if not self._departed:  # (each poll of a node asks)
            return
        now = time.monotonic()
        for peer, (since, sock) in list(self._departed.items()):
            if now - since >= DEPARTED_GRACE:
                del self._departed[peer]
                sock.close(linger=0)

    def _dealer(self, peer: str) -> zmq.Socket:
        sock = self._dealers.get(peer)
        if sock is None and peer in self._departed:  # back within the grace: the same socket, in order
            sock = self._dealers[peer] = self._departed.pop(peer)[1]
        if sock is None:
            address = self.peers.get(peer)
            if address is None:
                raise ProtocolError(f"{self.ident}: no address known for peer {peer!r}")
            sock = make_socket(self.ctx, zmq.DEALER, identity=self.ident, secret=self.secret)
            if address.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
            self._dealers[peer] = sock
        return sock

    def send(self, peer: str, type_name: str, **fields: Any) -> None:
        """Encode and send one message to a peer (zero-copy for array frames)."""
        frames = protocol.encode(type_name, **fields)
        self.close_departed()
        self._dealer(peer).send_multipart(_chunked(frames) if self.secret is not None else frames, copy=False)
        self.messages_sent += 1
        self.bytes_sent += sum(_nbytes(f) for f in frames)

    def recv(self, flags: int = 0) -> Message | None:
        """Receive one message; a malformed one is logged and dropped (returns None)."""
        frames = self.router.recv_multipart(flags=flags, copy=False)
        self.messages_received += 1
        sender = frames[0].bytes.decode(errors="replace")
        try:
            return protocol.decode(_unchunked(frames[1:]) if self.secret is not None else frames[1:], sender)
        except ProtocolError as exc:
            self.bad_messages += 1
            log.warning("%s: dropped a malformed message from %r: %s", self.ident, sender, exc)
            return None

    def counters(self) -> dict[str, int]:
        """Traffic counters, plus ``secured`` (1 with CURVE) and ``auth_refused`` (handshakes refused)."""
        return {
            "messages_sent": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "messages_received": self.messages_received,
            "bad_messages": self.bad_messages,
            "secured": int(self.secret is not None),
            "auth_refused": self._watch.refused if self._watch is not None else 0,
        }

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=1000)
        for _, sock in self._departed.values():
            sock.close(linger=0)
        self._dealers.clear()
        self._departed.clear()
        self._close_router()

    def _close_router(self) -> None:
        if self.router.closed:
            return
        if self._watch is not None:
            # stop the handshake monitor while the authenticator still reads it: libzmq sends
            # monitor events blocking, so events with no reader would freeze its I/O thread
            self.router.disable_monitor()
        self.router.close(linger=0)
        if self.private and self.address:  # libzmq leaves an ipc socket's file behind
            with suppress(OSError):
                os.unlink(self.address[len("ipc://"):])
        if self._watch is not None:  # only now: a live CURVE ROUTER must never lack its ZAP handler
            security.release(self.ctx, self._watch)
