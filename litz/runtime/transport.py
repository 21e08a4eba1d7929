"""ZeroMQ endpoints: the only place where Litz creates sockets.

Each process owns one ``Endpoint``: a ROUTER socket bound to its address (its mailbox) and
one DEALER per peer it talks to, whose identity is the process id, so a receiver always
knows who sent a message. Because every socket is made by ``make_socket``, the security
settings of a cluster (loopback-only binding here; authentication later) apply to all.

The endpoint counts messages and bytes sent, which the benchmarks report.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from litz.errors import ConfigError, ProtocolError
from litz.runtime import protocol
from litz.runtime.protocol import Message

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def make_socket(ctx: zmq.Context, kind: int, identity: str | None = None) -> zmq.Socket:
    """Create a socket with the job's settings (linger, high-water marks, identity)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    # Never drop messages silently: updates and completions must not be lost.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def check_bind_host(host: str, cluster: bool) -> None:
    """Refuse to listen beyond loopback unless a cluster was configured."""
    if not cluster and not host.startswith("127.") and host not in ("localhost", "::1"):
        raise ConfigError(f"refusing to listen on {host}: only loopback is allowed without a cluster config")


class Endpoint:
    """A process's mailbox (ROUTER) plus outgoing DEALERs to peers, with traffic counters."""

    def __init__(self, ident: str, host: str = LOOPBACK, ctx: zmq.Context | None = None,
                 cluster: bool = False) -> None:
        check_bind_host(host, cluster)
        self.ident = ident
        self.ctx = ctx or zmq.Context.instance()
        self.router = make_socket(self.ctx, zmq.ROUTER)
        port = self.router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.peers: dict[str, str] = {}
        self._dealers: dict[str, zmq.Socket] = {}
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.bad_messages = 0

    def connect(self, peer: str, address: str) -> None:
        """Remember a peer's address; the DEALER is created on first send."""
        if self.peers.get(peer) == address:
            return
        old = self._dealers.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        self.peers[peer] = address

    def _dealer(self, peer: str) -> zmq.Socket:
        sock = self._dealers.get(peer)
        if sock is None:
            address = self.peers.get(peer)
            if address is None:
                raise ProtocolError(f"{self.ident}: no address known for peer {peer!r}")
            sock = make_socket(self.ctx, zmq.DEALER, identity=self.ident)
            sock.connect(address)
            self._dealers[peer] = sock
        return sock

    def send(self, peer: str, type_name: str, **fields: Any) -> None:
        """Encode and send one message to a peer (zero-copy for array frames)."""
        frames = protocol.encode(type_name, **fields)
        self._dealer(peer).send_multipart(frames, copy=False)
        self.messages_sent += 1
        self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)

    def recv(self, flags: int = 0) -> Message | None:
        """Receive one message; a malformed one is logged and dropped (returns None)."""
        frames = self.router.recv_multipart(flags=flags, copy=False)
        self.messages_received += 1
        sender = frames[0].bytes.decode(errors="replace")
        try:
            return protocol.decode(frames[1:], sender)
        except ProtocolError as exc:
            self.bad_messages += 1
            log.warning("%s: dropped a malformed message from %r: %s", self.ident, sender, exc)
            return None

    def counters(self) -> dict[str, int]:
        return {
            "messages_sent": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "messages_received": self.messages_received,
            "bad_messages": self.bad_messages,
        }

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=1000)
        self._dealers.clear()
        self.router.close(linger=0)
