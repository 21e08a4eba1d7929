"""Litz's view of etcd: who is in the job, registered under leases that vanish when a process dies.

Failure detection in Litz is lease expiry: every process registers a key under a short lease (2 s by
default) and keeps it alive; when a process dies or hangs, etcd deletes the key and every watcher sees a
``delete`` event.  This module is the only place that talks to etcd, so the client library (etcd3aio, an
asyncio gRPC client) can be swapped without touching the rest of Litz.

Threading model: the rest of a Litz process runs a greenlet/ZeroMQ hub loop that must never block on etcd,
and asyncio cannot share that loop.  So the etcd clients of a process run on one daemon thread with an
asyncio loop of its own (gRPC's asyncio layer binds to one loop per process); each ``Membership``'s lease
keep-alive and watches live there as tasks.  Watch events cross to the hub through a
thread-safe ``queue.Queue`` plus an ``on_event()`` wake-up callback (the hub's writes a byte to a pipe it
polls).  The synchronous methods submit a coroutine to that loop and wait for its result; they block the
caller for at most about the configured timeout, and ``poll_events()`` never blocks.

Everything is built to ride out a restart of etcd: unary calls retry transient gRPC errors until their
deadline, watches resume from the last revision they saw, and a lease that was lost is granted again and
its keys are put back (other members see the process leave and come back, and a warning is logged).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from etcd3aio import Etcd3Client, EtcdConnectionError, EtcdError, EtcdTransientError, WatchFilter, prefix_range_end
from etcd3aio.kv import Compare
from etcd3aio.watch import WatchCreateRequest, WatchRequest, WatchResponse, WatchService

from litz.errors import ConfigError, EtcdUnreachable, LitzError, ProtocolError

__all__ = ["LEASE_TTL_ENV", "Event", "Membership", "lease_ttl"]

LEASE_TTL_ENV = "LITZ_LEASE_TTL"
DEFAULT_LEASE_TTL = 5
#: Seconds ``close()`` tries to revoke a lease when the keep-alive already finds etcd unreachable.
CLOSE_TRY = 0.5


def lease_ttl() -> int:
    """Seconds a process's lease outlives its last keep-alive: ``$LITZ_LEASE_TTL``, default 5.

    The trade-off: a dead process is noticed after about this long (on another host; on the
    master's own host its exit is seen at once), but a live one that stalls longer (a long
    pause, swapping, a starved machine) is declared lost too, fenced and recovered from. The
    default was 2 s until a healthy job of the test suite lost its server and its master's own
    registration at once on this 2-core virtual machine: etcd answered no keep-alive for about
    2 s while the suite was running (likely the whole virtual machine paused: disk syncs measured
    11 ms at most under the same load).
    A job without recovery dies of such a false alarm, so 5 s; set less where hosts are quiet
    and a hung process must be noticed sooner.
    """
    raw = os.environ.get(LEASE_TTL_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE_TTL
    try:
        ttl = int(raw)
    except ValueError:
        ttl = 0
    if ttl < 1:
        raise ConfigError(f"{LEASE_TTL_ENV} must be a whole number of seconds >= 1, got {raw!r}")
    return ttl

_log = logging.getLogger(__name__)

T = TypeVar("T")

# mvccpb.Event.EventType values; spelled out so we need not import etcd3aio's generated protobuf modules.
_EVENT_PUT = 0
_EVENT_DELETE = 1

# gRPC codes that mean "etcd is not there right now" (restarting, not yet up, network blip): worth retrying.
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Errors that all mean "etcd did not answer in time"; converted to EtcdUnreachable at the API boundary.
_ETCD_ERRORS: tuple[type[BaseException], ...] = (
    EtcdError,
    grpc.RpcError,
    TimeoutError,
    asyncio.TimeoutError,
    concurrent.futures.TimeoutError,
)


@dataclass(frozen=True)
class Event:
    """One change under a watched prefix, as the hub sees it.

    ``key`` is relative to the job prefix (``/litz/<job>/``) so callers never deal with other jobs' keys;
    ``value`` is the decoded JSON for ``put`` and None for ``delete`` (etcd does not send the old value).
    """

    kind: str
    key: str
    value: dict | None


class _Transient(Exception):
    """Raised inside the etcd thread for conditions that should be retried like a dropped connection."""


def _parse_endpoints(etcd: str) -> list[str]:
    """Turn ``http://host:port`` / ``host:port`` (comma-separated for a cluster) into gRPC ``host:port``s,
    or ``unix:///path`` (a private local etcd's socket) into itself.

    TLS is not wired up yet, so ``https://`` is refused here with a clear message instead of failing later
    with an obscure handshake error.
    """
    if etcd.strip().startswith("unix://"):  # a private local etcd (LocalEtcd(private=True)): one socket
        path = etcd.strip()[len("unix://"):]
        if not path.startswith("/") or "," in path:
            raise ConfigError(f"etcd endpoint {etcd!r} is not of the form unix:///ABSOLUTE/PATH (one socket)")
        return [f"unix://{path}"]
    endpoints = []
    for part in etcd.split(","):
        part = part.strip().rstrip("/")
        if part.startswith("https://"):
            raise ConfigError(f"etcd endpoint {part!r}: TLS (https://) is not supported, use http://")
        if part.startswith("http://"):
            part = part[len("http://") :]
        host, _, port = part.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:PORT
        if not host or "/" in part or not port.isdigit() or not 0 < int(port) < 65536 or \
                not all(c.isalnum() or c in "-._:" for c in host):
            raise ConfigError(f"etcd endpoint {part!r} in {etcd!r} is not of the form http://HOST:PORT")
        endpoints.append(part)
    return endpoints


def _encode(value: dict) -> bytes:
    """JSON-encode a value compactly; raises TypeError in the caller's thread for unserialisable values."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")


def _describe(exc: BaseException) -> str:
    """One-line description of an etcd/gRPC failure (AioRpcError's own str() spans several lines)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details() or ''}".strip().rstrip(":")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return "timed out"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_transient(exc: BaseException) -> bool:
    """Whether an error means etcd is (for now) unreachable rather than that the request was wrong."""
    if isinstance(exc, (EtcdConnectionError, EtcdTransientError, _Transient)):
        return True
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _TRANSIENT_CODES


def _is_lease_not_found(exc: BaseException) -> bool:
    """A put with a lease that etcd has already expired fails with NOT_FOUND; we then grant a new lease."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.NOT_FOUND


class KeyHeld(LitzError):
    """``register(..., exclusive=True)`` found the key held by someone else (``holder``: its value)."""

    def __init__(self, key: str, holder: dict) -> None:
        super().__init__(f"etcd key {key} is held by {holder}")
        self.key = key
        self.holder = holder


class _Watch(WatchService):
    """One watch stream per call, which lets go of everything it holds when it ends.

    etcd3aio's own watch reconnects by itself, and every stream it gives up leaves gRPC's task that
    feeds the stream's requests waiting for ever on the request generator (gRPC cancels that task only
    for a call that has not failed yet). After an etcd restart those tasks are destroyed while pending,
    and the process prints "Task was destroyed but it is pending!" and "aclose(): asynchronous generator
    is already running" for each. Here the request generator ends with its stream, and reconnecting is
    left to :meth:`Membership._watch_loop`, which resumes at the next revision anyway."""

    async def watch(  # noqa: PLR0913 - etcd3aio's signature
        self,
        key: str | bytes,
        range_end: str | bytes | None = None,
        start_revision: int = 0,
        prev_kv: bool = False,
        *,
        filters: Sequence[WatchFilter] = (),
        progress_notify: bool = False,
    ) -> AsyncIterator[WatchResponse]:
        """The responses of one watch stream, until it ends or fails (the error is raised)."""
        create = WatchCreateRequest(key=self._to_bytes(key),
                                    range_end=b"" if range_end is None else self._to_bytes(range_end),
                                    start_revision=start_revision, prev_kv=prev_kv,
                                    filters=[int(f) for f in filters], progress_notify=progress_notify)
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[WatchRequest]:
            yield WatchRequest(create_request=create)
            await ended.wait()  # the stream stays open for responses until it ends

        call = self._stub.Watch(requests(), metadata=self._metadata or None)  # type: ignore[call-arg]
        try:
            async for response in call:
                yield response
        finally:
            ended.set()
            call.cancel()


class _Client(Etcd3Client):
    """etcd3aio's client with :class:`_Watch` as its watch service, a subchannel pool of its own and a
    reconnection back-off of at most a second.

    gRPC waits longer and longer between attempts to reach a server that is down (1 s, then 1.6
    times more each time, up to two minutes), and a call made meanwhile fails at once. After an
    etcd outage of 30 s our clients reached it again only 9 s after it was back: longer than a
    lease's TTL, so a process that had merely waited for etcd was declared lost. Trying every
    second at most costs a refused connection a second while etcd is down, and brings every
    client back within about a second of it.

    gRPC also shares connections (subchannels) between a process's channels to the same address,
    and with them that back-off. A client made for a new etcd on a port where an earlier etcd of
    this process had stopped (tests and local jobs pick ports at random) would wait out the
    back-off of a still-open client of the old one, and fail its connect timeout against a server
    that runs and answers. Its own pool connects at once.
    """

    def __init__(self, endpoints: Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        if endpoints[0].startswith("unix://"):  # etcd3aio only builds ipv4: targets; gRPC takes unix:///path
            self._manager.target = endpoints[0]
        self._manager.grpc_options.extend([
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # not grpc.min_reconnect_backoff_ms: that is how long one attempt may take to connect
            # (20 s by default), which a distant etcd may need
        ])

    async def connect(self) -> None:
        await super().connect()
        assert self._channel is not None
        self.watch = _Watch(self._channel, max_attempts=self._rpc_max_attempts)
        if self._token:
            self.watch.set_token(self._token)


_SHARED_LOCK = threading.Lock()
_SHARED: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None


def _shared_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """The process's one etcd thread and asyncio loop, started on first use and never closed.

    gRPC's asyncio layer attaches to one event loop per process; a second loop, or closing the
    first while another client lives, makes gRPC's poller fail ("Event loop is closed").
    """
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED[1].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_run_loop, args=(loop,), name="litz-etcd", daemon=True)
            thread.start()
            _SHARED = (loop, thread)
        return _SHARED


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


class Membership:
    """Registration, key/value access and watches under ``/litz/<job>/``, driven from any thread.

    Use ``start()`` (or ``with Membership(...) as m:``) before anything else and ``close()`` at the end.
    A process registers at most one lease: ``register()`` grants it, ``put(..., lease=True)`` attaches more
    keys to it, and all of them are kept alive and restored together.

    To learn the current members without missing a change, call ``watch_prefix()`` first (it returns once
    the watch is established) and then ``get_prefix()``; applying the events afterwards may repeat a change
    already in the snapshot, which is harmless for put/delete state.
    """

    def __init__(
        self,
        etcd: str,
        job: str,
        *,
        on_event: Callable[[], None] | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        """Describe the connection; nothing is contacted until ``start()``.

        ``connect_timeout`` bounds ``start()`` and is also the deadline of each later call, long enough to
        ride out an etcd restart (about a second) without surfacing an error.
        """
        if not job or "/" in job:
            raise ConfigError(f"job name {job!r} must be non-empty and contain no '/'")
        self._url = etcd
        self._endpoints = _parse_endpoints(etcd)
        self._job = job
        self._prefix = f"/litz/{job}/"
        self._on_event = on_event
        self._timeout = connect_timeout
        self._events: queue.Queue[Event] = queue.Queue()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # The fields below are touched only on the etcd thread, so they need no lock.
        self._client: Etcd3Client | None = None
        self._registered = False
        self._ttl = 2
        self._lease_id: int | None = None
        self._leased: dict[str, bytes] = {}
        # leased keys taken with register(exclusive=True): put back only if no one else took them
        self._exclusive: set[str] = set()
        # exclusive keys another holder took while our lease was gone: key -> its holder's value
        self._lost: dict[str, dict] = {}
        self._restore_needed = False
        self._lease_lock: asyncio.Lock | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._watch_tasks: list[asyncio.Task[None]] = []
        # Set by the keep-alive while etcd does not answer it; read by close() on the caller's thread
        # (a bool: one atomic store or load).
        self._unreachable = False

    # -- properties -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The etcd address as given, for messages."""
        return self._url

    @property
    def timeout(self) -> float:
        """The deadline of each call, in seconds (``connect_timeout``)."""
        return self._timeout

    @property
    def prefix(self) -> str:
        """The job's key prefix in etcd, ``/litz/<job>/``."""
        return self._prefix

    @property
    def started(self) -> bool:
        """Whether ``start()`` succeeded and ``close()`` was not called: calls may be made."""
        return self._loop is not None and not self._closed

    @property
    def registered(self) -> bool:
        """Whether this process holds a registration (even while its lease is being re-granted)."""
        return self._registered

    @property
    def lost_any(self) -> bool:
        """Whether :attr:`lost_keys` has any (cheap: for a loop that asks on every pass)."""
        return bool(self._lost)

    @property
    def lost_keys(self) -> dict[str, dict]:
        """Keys registered with ``exclusive=True`` that someone else took while this process's lease
        was gone (it stalled past its TTL, or lost etcd that long), each with its new holder's value.
        They are no longer held, nor put back: its owner must act on the loss (a launcher whose job
        name another launcher took stops its job)."""
        return dict(self._lost)

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the etcd thread and check that etcd answers, within ``connect_timeout`` seconds.

        Raises EtcdUnreachable naming the URL (and cleans up the thread) if etcd does not answer in time,
        so a wrong ``--etcd`` is reported before any work is done.
        """
        if self._closed:
            raise LitzError("Membership.start() called after close()")
        if self._loop is not None:
            return
        self._loop, self._thread = _shared_loop()
        try:
            self._call("connect", self._connect())
        except BaseException:
            self._stop_thread()
            # Back to "not started", so later calls say so and a caller may retry start() (etcd coming up).
            self._loop = self._thread = None
            self._client = None
            raise

    def close(self) -> None:
        """Deregister if registered, stop watches and keep-alive, close the client, join the thread.

        Idempotent and safe after a failed ``start()``.  If etcd is unreachable the lease cannot be revoked;
        it then expires by itself after its TTL, which is logged rather than raised so shutdown completes.
        When the keep-alive already finds etcd gone, the revoke gets one short try (``CLOSE_TRY``) instead
        of the whole call deadline: a process leaving a job whose etcd died took 5 s more to exit.
        """
        if self._closed:
            return
        self._check_thread("close")
        self._closed = True
        if self._loop is None:
            return
        if self._registered:
            try:
                self._call("deregister", self._deregister(CLOSE_TRY if self._unreachable else None),
                           allow_closed=True)
            except EtcdUnreachable as exc:
                _log.warning("%s; its lease will expire by itself", exc)
        self._stop_thread()

    def __enter__(self) -> Membership:
        """Start, so ``with Membership(url, job) as m:`` gives a connected instance."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close whatever happened in the block, so the lease and thread never outlive it."""
        self.close()

    # -- public operations ------------------------------------------------------------------------------

    def register(self, key: str, value: dict, ttl: int | None = None, *, exclusive: bool = False) -> None:
        """Put ``key`` = ``value`` under a new lease of ``ttl`` seconds and keep that lease alive.

        With ``exclusive``, only if no one else holds ``key``: :class:`KeyHeld` (with the holder's
        value) otherwise, and nothing is registered. The check and the put are one etcd transaction.
        After a lost lease such a key is put back only if it is still free (or ours); if someone else
        took it meanwhile it is given up, logged as an error and listed in :attr:`lost_keys`, and no
        other key of the registration is put back (nor can be put with ``put(lease=True)``): the
        registration belongs to the newer holder's side of a split.

        The keep-alive runs every ``ttl/3`` s on the etcd thread.  If the lease is lost (etcd restarted
        with a lease gone, or this process stalled past the TTL) or the key disappears, the lease is granted
        again and the keys are put back, with a warning.  Registering again replaces the previous
        registration (its lease is revoked and keys attached with ``put(lease=True)`` go with it).
        ``ttl`` defaults to :func:`lease_ttl` (``$LITZ_LEASE_TTL``).
        """
        if ttl is None:
            ttl = lease_ttl()
        if ttl < 1:
            raise ValueError(f"ttl must be at least 1 s, got {ttl}")
        self._call(f"register {key}", self._register(key, _encode(value), int(ttl), exclusive))

    def deregister(self) -> None:
        """Revoke the lease so the registered keys disappear now rather than at expiry; no-op if none."""
        self._call("deregister", self._deregister())

    def put(self, key: str, value: dict, *, lease: bool = False) -> None:
        """Store ``value`` at ``key``; with ``lease=True`` it lives and dies with this process's registration.

        Leased keys are restored together with the registration after a lease loss.
        """
        self._call(f"put {key}", self._put(key, _encode(value), lease))

    def get(self, key: str) -> dict | None:
        """Return the value at ``key``, or None if there is none; ProtocolError if it is not JSON."""
        return self._call(f"get {key}", self._get(key))

    def get_prefix(self, prefix: str) -> dict[str, dict]:
        """Return every key under ``prefix`` (relative to the job prefix, as are the returned keys)."""
        return self._call(f"get prefix {prefix}", self._get_prefix(prefix))

    def delete(self, key: str) -> None:
        """Delete ``key``; if it was leased, it is also no longer restored after a lease loss."""
        self._call(f"delete {key}", self._delete(key))

    def watch_prefix(self, prefix: str) -> None:
        """Watch every key under ``prefix``: each change becomes an Event and then ``on_event()`` is called.

        Returns once etcd has confirmed the watch, so every change made after this call is delivered.  The
        watch resumes from the last revision it saw after a connection loss or an etcd restart.
        """
        self._call(f"watch {prefix}", self._watch(prefix))

    def poll_events(self) -> list[Event]:
        """Return the events queued so far, without blocking (what the hub calls after a wake-up)."""
        out: list[Event] = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def wait_events(self, timeout: float) -> list[Event]:
        """Block up to ``timeout`` s for at least one event and return all queued ones ([] on timeout)."""
        try:
            first = self._events.get(timeout=timeout)
        except queue.Empty:
            return []
        return [first, *self.poll_events()]

    # -- plumbing between the caller's thread and the etcd thread ---------------------------------------

    def _check_thread(self, what: str) -> None:
        """Refuse calls from the etcd thread (e.g. inside ``on_event``): they would wait on themselves."""
        if self._thread is not None and threading.current_thread() is self._thread:
            raise LitzError(f"Membership.{what}() must not be called on the etcd thread (from on_event)")

    def _error(self, what: str, exc: BaseException) -> EtcdUnreachable:
        """Build the EtcdUnreachable for a failed call, naming the URL and the operation.

        A request etcd answered but refused (e.g. a value over its size limit) gets a message that says so,
        rather than sending the user off to check whether etcd runs.
        """
        detail = f"{what}: {_describe(exc)}"
        if isinstance(exc, grpc.RpcError | EtcdError) and not _is_transient(exc):
            return EtcdUnreachable(f"etcd at {self._url} refused the request ({detail})")
        hint = "check that it runs / pass --etcd"
        return EtcdUnreachable(f"cannot reach etcd at {self._url} ({detail}): {hint}")

    def _call(self, what: str, coro: Coroutine[Any, Any, T], *, allow_closed: bool = False) -> T:
        """Run ``coro`` on the etcd thread and return its result, converting etcd errors to EtcdUnreachable.

        The whole coroutine runs under one deadline (``self._timeout``) on the loop; the extra second on
        this side only guards against a wedged loop, so the caller can never hang for ever.
        """
        fut = self._schedule(what.split()[0], coro, allow_closed=allow_closed)
        try:
            return fut.result(self._timeout + 1.0)
        except _ETCD_ERRORS as exc:
            fut.cancel()
            raise self._error(what, exc) from exc

    def _schedule(self, method: str, coro: Coroutine[Any, Any, T], *, allow_closed: bool = False
                  ) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the etcd thread under one deadline for the whole operation, however many
        RPCs it makes (register: grant + puts); LitzError, with ``coro`` closed, if this instance is
        not started, is closed, or ``method`` was called on the etcd thread."""
        if self._loop is None or (self._closed and not allow_closed):
            coro.close()
            when = "after close()" if self._closed else "before start()"
            raise LitzError(f"Membership.{method}() called {when}")
        try:
            self._check_thread(method)
        except LitzError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, self._timeout), self._loop)

    def put_soon(self, key: str, value: dict) -> concurrent.futures.Future[None]:
        """``put`` without waiting for etcd: the future ends as ``put`` would return or raise
        (EtcdUnreachable). For writes that a loop must not stall on while etcd is away: the
        master's status, written twice a second, held its loop for the whole call deadline (5 s)
        each time, and a job ran at 5% of its speed during an etcd outage."""
        data = _encode(value)  # a value that cannot be encoded fails here, in the caller's thread
        inner = self._schedule("put_soon", self._put(key, data, False))
        outer: concurrent.futures.Future[None] = concurrent.futures.Future()

        def settle(done: concurrent.futures.Future[None]) -> None:
            try:
                outer.set_result(done.result())
            except _ETCD_ERRORS as exc:
                outer.set_exception(self._error(f"put {key}", exc))
            except BaseException as exc:  # noqa: BLE001 (handed to whoever reads the future)
                outer.set_exception(exc)

        inner.add_done_callback(settle)
        return outer

    def _stop_thread(self) -> None:
        """Cancel this instance's tasks and close its gRPC channel (the shared loop keeps running)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            fut.result(5.0)
        except Exception as exc:  # shutdown must complete even if the channel misbehaves
            _log.warning("etcd client shutdown for %s failed: %s", self._url, _describe(exc))

    async def _shutdown(self) -> None:
        """Runs on the etcd thread: cancel our keep-alive and watches, then close the channel.

        Only this instance's tasks are cancelled: the loop is shared by every Membership of the
        process (gRPC's asyncio layer binds to one loop; closing loops under it breaks later clients).
        Closing the channel ends gRPC's own request-feeding tasks of our streams.
        """
        tasks = [t for t in (self._keepalive_task, *self._watch_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._keepalive_task = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        for _ in range(3):  # let the cancelled gRPC tasks finish
            await asyncio.sleep(0)

    # -- coroutines (etcd thread only) ------------------------------------------------------------------

    def _full(self, key: str) -> str:
        """Absolute etcd key for a job-relative key."""
        return self._prefix + key.lstrip("/")

    def _kv_client(self) -> Etcd3Client:
        """The connected client (tasks only run between connect and shutdown, so it is always set)."""
        assert self._client is not None
        return self._client

    async def _retry(self, fn: Callable[[float], Awaitable[T]], timeout: float | None = None) -> T:
        """Call ``fn(remaining_seconds)`` until it succeeds, retrying transient errors until the deadline.

        etcd3aio's own retry gives up after a few attempts within ~150 ms, far shorter than an etcd restart;
        retrying here for the whole call deadline is what lets callers not notice a restart.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeout if timeout is None else timeout)
        delay = 0.05
        while True:
            remaining = deadline - loop.time()
            try:
                return await asyncio.wait_for(fn(max(remaining, 0.01)), max(remaining, 0.01))
            except Exception as exc:
                if not _is_transient(exc) or loop.time() + delay >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _connect(self) -> None:
        """Create the client and make one read, retrying until ``connect_timeout`` (etcd may be starting)."""
        self._lease_lock = asyncio.Lock()
        # rpc_max_attempts=1: we retry ourselves (see _retry); watches too (_watch_loop).
        self._client = _Client(self._endpoints, rpc_max_attempts=1)
        await self._client.connect()
        kv = self._client.kv
        assert kv is not None
        await self._retry(lambda t: kv.get(self._prefix, count_only=True, timeout=t))

    async def _register(self, key: str, data: bytes, ttl: int, exclusive: bool = False) -> None:
        """Grant the lease, put the key, start the keep-alive task; on failure leave nothing registered."""
        if self._registered:
            await self._deregister()
        self._registered = True
        self._ttl = ttl
        self._leased = {} if exclusive else {key: data}
        self._exclusive = set()
        self._lost = {}
        try:
            await self._grant_and_put_all()
            if exclusive:
                await self._put_if_free(key, data)
                self._leased[key] = data
                self._exclusive.add(key)
        except BaseException:
            if self._lease_id is not None:  # a lease granted for nothing (exclusive: the key is held) goes now
                with contextlib.suppress(Exception):
                    await self._deregister()
            self._registered = False
            self._leased = {}
            self._exclusive = set()
            self._lease_id = None
            raise
        self._keepalive_task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"litz-lease-{self._job}"
        )

    async def _put_if_free(self, key: str, data: bytes, timeout: float | None = None) -> None:
        """Put ``key`` under this registration's lease in one transaction with the check that no one
        holds it; KeyHeld otherwise. A key already under this very lease (a retried transaction whose
        first try did succeed, or a new value for a key we hold) is put in a second transaction, with
        the check that it still is."""
        kv = self._kv_client().kv
        assert kv is not None and self._lease_id is not None
        full, lease_id = self._full(key), self._lease_id
        resp = await self._retry(lambda t: kv.txn([kv.txn_compare_create_revision(full, 0)],
                                                  [kv.txn_op_put(full, data, lease=lease_id)],
                                                  [kv.txn_op_get(full)], timeout=t), timeout)
        if resp.succeeded:
            return
        held = resp.responses[0].response_range.kvs
        if held and held[0].lease == lease_id:
            ours = Compare(result=Compare.EQUAL, target=Compare.LEASE, key=full.encode(), lease=lease_id)
            resp = await self._retry(lambda t: kv.txn([ours], [kv.txn_op_put(full, data, lease=lease_id)],
                                                      [kv.txn_op_get(full)], timeout=t), timeout)
            if resp.succeeded:
                return
            held = resp.responses[0].response_range.kvs
        raise KeyHeld(key, self._decode(held[0].key, held[0].value) if held else {})

    def _lose(self, key: str, holder: dict) -> None:
        """An exclusive key was taken by someone else while our lease was gone: give it up (never take
        it back: two holders of a job's name would share its keys) and say so."""
        self._leased.pop(key, None)
        self._exclusive.discard(key)
        self._lost[key] = holder
        _log.error("etcd %s: %s was taken by %s while this process's lease was gone (it stalled past its "
                   "TTL, or lost etcd that long); it is not taken back", self._url, key, holder)

    async def _put_leased(self, key: str, data: bytes, timeout: float | None = None) -> None:
        """Put one of our leased keys under the current lease: an exclusive one only if it is free or
        still ours (else it is lost, ``_lose``), any other one as it is. Without a lease (a put raced
        with its expiry) nothing: the keep-alive's next round grants one and puts every key."""
        if self._lease_id is None:
            return
        if key in self._exclusive:
            try:
                await self._put_if_free(key, data, timeout)
            except KeyHeld as exc:
                self._lose(key, exc.holder)
            return
        kv = self._kv_client().kv
        assert kv is not None
        lease_id = self._lease_id
        await self._retry(lambda t: kv.put(self._full(key), data, lease=lease_id, timeout=t), timeout)

    async def _grant_and_put_all(self, timeout: float | None = None) -> None:
        """Grant a fresh lease and put every leased key with it (first registration and after a loss)."""
        assert self._lease_lock is not None
        async with self._lease_lock:
            lease_svc = self._kv_client().lease
            kv = self._kv_client().kv
            assert lease_svc is not None and kv is not None
            grant = await self._retry(lambda t: lease_svc.grant(self._ttl, timeout=t), timeout)
            self._lease_id = grant.ID
            self._restore_needed = True
            # exclusive keys first, with the create-revision check: a plain put took back a job's name
            # that another launcher had taken while this one was away. Once one is lost the others
            # are not put back either: they belong to the job whose name it was (a launcher's host
            # record, say, which the newer job's launcher of that host has written)
            for key in sorted(self._leased, key=lambda k: k not in self._exclusive):
                if self._lost:
                    break
                if key in self._leased:
                    await self._put_leased(key, self._leased[key], timeout)
            self._restore_needed = False

    async def _deregister(self, timeout: float | None = None) -> None:
        """Stop the keep-alive and revoke the lease (retrying until ``timeout``, by default the call's
        deadline); local state is cleared even if etcd cannot be reached."""
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        lease_id = self._lease_id
        self._registered = False
        self._lease_id = None
        self._leased = {}
        self._exclusive = set()
        if lease_id is not None:
            lease_svc = self._kv_client().lease
            assert lease_svc is not None
            try:
                await self._retry(lambda t: lease_svc.revoke(lease_id, timeout=t), timeout)
            except Exception as exc:
                if not _is_lease_not_found(exc):  # already expired: the keys are gone, which is the goal
                    raise

    async def _keepalive_once(self, lease_id: int, timeout: float) -> int:
        """Send one LeaseKeepAlive and return the TTL etcd reports (<= 0: the lease no longer exists).

        etcd3aio's LeaseKeepalive sleeps ``max(1, ttl // 3)`` s, i.e. 1 s for a 2 s lease, which leaves too
        little slack; we drive single keep-alive streams at ``ttl/3`` ourselves instead.
        """
        lease_svc = self._kv_client().lease
        assert lease_svc is not None
        call = lease_svc.keep_alive(lease_id)

        async def first_response() -> Any:
            async for resp in call:
                return resp
            raise _Transient("keep-alive stream closed without an answer")

        try:
            resp = await asyncio.wait_for(first_response(), timeout)
        finally:
            call.cancel()
        return int(resp.TTL)

    async def _restore_missing_keys(self, timeout: float) -> None:
        """Put back leased keys that disappeared (deleted by someone, or lost with the data directory).

        An exclusive key found under another lease was taken by someone else (our lease was gone a
        while, and its keys with it): it is lost (``_lose``), not put back. It used to be checked
        only for existence: a key deleted by its new holder was then taken back."""
        kv = self._kv_client().kv
        assert kv is not None
        lease_id = self._lease_id
        if lease_id is None:
            return
        for key in sorted(self._leased, key=lambda k: k not in self._exclusive):  # (as _grant_and_put_all)
            if self._lost:
                break
            resp = await kv.get(self._full(key), timeout=timeout)
            if key not in self._leased:
                continue
            data = self._leased[key]
            if not resp.kvs:
                _log.warning("etcd %s: registered key %s disappeared; putting it back", self._url, key)
                await self._put_leased(key, data, timeout)
            elif key in self._exclusive and resp.kvs[0].lease != lease_id:
                self._lose(key, self._decode(resp.kvs[0].key, resp.kvs[0].value))

    async def _keepalive_loop(self) -> None:
        """Renew the lease every ttl/3 s; re-grant and re-put when it is lost; never gives up.

        Every third round it also checks that the leased keys still exist.  Outages are logged once when
        they start and once when they end, not on every failed attempt.
        """
        loop = asyncio.get_running_loop()
        interval = self._ttl / 3
        next_at = loop.time()
        rounds = 0
        failing_since: float | None = None
        while True:
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = max(next_at, loop.time() - interval)  # after a long stall, do not fire a burst
            try:
                if self._lease_id is None:
                    await self._grant_and_put_all(timeout=interval)
                else:
                    ttl_left = await self._keepalive_once(self._lease_id, interval)
                    if ttl_left <= 0:
                        _log.warning(
                            "etcd %s: lease for %s was lost (etcd restarted without it, or this process "
                            "stalled for over %d s); registering again, others may have seen it leave",
                            self._url, ", ".join(self._leased), self._ttl,
                        )  # fmt: skip
                        self._lease_id = None
                        await self._grant_and_put_all(timeout=interval)
                    else:
                        rounds += 1
                        if self._restore_needed or rounds % 3 == 0:
                            await self._restore_missing_keys(interval)
                            self._restore_needed = False
                self._unreachable = False
                if failing_since is not None:
                    down = time.monotonic() - failing_since
                    _log.warning("etcd %s reachable again after %.1f s; lease renewed", self._url, down)
                    failing_since = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _is_lease_not_found(exc):
                    self._lease_id = None  # a put raced with expiry; grant again next round
                else:
                    self._unreachable = _is_transient(exc)
                if failing_since is None and not _is_lease_not_found(exc):
                    failing_since = time.monotonic()
                    _log.warning(
                        "etcd %s: cannot renew lease (%s); retrying every %.2f s",
                        self._url, _describe(exc), interval,
                    )  # fmt: skip
                if not _is_transient(exc) and not _is_lease_not_found(exc):
                    _log.debug("keep-alive error", exc_info=True)

    async def _put(self, key: str, data: bytes, lease: bool) -> None:
        """Plain or leased put; a leased put whose lease just expired triggers a re-grant (which puts it)."""
        kv = self._kv_client().kv
        assert kv is not None
        if not lease:
            self._leased.pop(key, None)
            await self._retry(lambda t: kv.put(self._full(key), data, timeout=t))
            return
        if not self._registered:
            raise LitzError(f"put({key!r}, lease=True) needs register() first: there is no lease to use")
        if self._lost:  # an exclusive key taken by someone else: nothing more goes under our lease
            lost = key if key in self._lost else next(iter(self._lost))
            raise KeyHeld(lost, self._lost[lost])
        self._leased[key] = data
        lease_id = self._lease_id
        if lease_id is not None:
            try:
                await self._put_leased(key, data)
                if key in self._lost:  # (an exclusive key found taken)
                    raise KeyHeld(key, self._lost[key])
                return
            except Exception as exc:
                if not _is_lease_not_found(exc):
                    raise
            if self._lease_id == lease_id:
                self._lease_id = None
        await self._grant_and_put_all()

    async def _get(self, key: str) -> dict | None:
        """Read one key and decode it."""
        kv = self._kv_client().kv
        assert kv is not None
        resp = await self._retry(lambda t: kv.get(self._full(key), timeout=t))
        if not resp.kvs:
            return None
        return self._decode(resp.kvs[0].key, resp.kvs[0].value)

    async def _get_prefix(self, prefix: str) -> dict[str, dict]:
        """Read a range of keys and return them relative to the job prefix."""
        kv = self._kv_client().kv
        assert kv is not None
        full = self._full(prefix)
        resp = await self._retry(lambda t: kv.get(full, range_end=prefix_range_end(full), timeout=t))
        out: dict[str, dict] = {}
        for item in resp.kvs:
            try:
                out[self._relative(item.key)] = self._decode(item.key, item.value)
            except ProtocolError as exc:  # (as a watch event of it is: one bad value hides no other)
                _log.warning("%s; skipped", exc)
        return out

    async def _delete(self, key: str) -> None:
        """Delete a key and forget it as a leased key, so the keep-alive does not put it back."""
        kv = self._kv_client().kv
        assert kv is not None
        self._leased.pop(key, None)
        await self._retry(lambda t: kv.delete(self._full(key), timeout=t))

    async def _watch(self, prefix: str) -> None:
        """Start a watch task and wait until etcd confirms it (so no later change can be missed)."""
        created: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(
            self._watch_loop(self._full(prefix), created), name=f"litz-watch-{self._job}-{prefix}"
        )
        self._watch_tasks.append(task)
        try:
            await asyncio.wait_for(asyncio.shield(created), self._timeout)
        except BaseException:
            task.cancel()
            self._watch_tasks.remove(task)
            raise

    async def _watch_loop(self, full_prefix: str, created: asyncio.Future[None]) -> None:
        """Feed watch responses into the event queue for ever, re-creating the watch whenever it ends.

        A stream ends on UNAVAILABLE (what an etcd restart looks like), when etcd cancels it (e.g. after
        compaction), cleanly, or on any other error; each is closed at once and a new one resumes at the
        revision after the last event delivered, after a short back-off (0.1 s doubling to 1 s, so a
        watch resumes within about a second of etcd coming back). An outage is logged once, and again
        when the watch is back.
        """
        watch_svc = self._kv_client().watch
        assert watch_svc is not None
        range_end = prefix_range_end(full_prefix)
        next_rev = 0
        delay = 0.1
        failing = False
        while True:
            stream = watch_svc.watch(full_prefix, range_end=range_end, start_revision=next_rev)
            try:
                async for resp in stream:
                    if resp.created:
                        if failing:
                            _log.warning("etcd %s: watch on %s resumed at revision %d", self._url, full_prefix,
                                         max(next_rev, 1))
                            failing = False
                        if next_rev > resp.header.revision + 1:
                            # The store's revision went backwards: etcd came back with a fresh data
                            # directory.  Waiting for our old revision would hide every change for ages;
                            # replaying the new store's whole (short) history delivers what it holds.
                            _log.warning("etcd %s: revision went back from %d to %d (data lost?); "
                                         "replaying %s from revision 1", self._url, next_rev - 1,
                                         resp.header.revision, full_prefix)  # fmt: skip
                            next_rev = 1
                            break
                        if next_rev == 0:  # no history requested: nothing before header.revision is owed
                            next_rev = resp.header.revision + 1
                        if not created.done():
                            created.set_result(None)
                    if resp.canceled:
                        if resp.compact_revision > 0:
                            _log.warning(
                                "etcd %s: watch on %s fell behind compaction; lost changes before rev %d",
                                self._url, full_prefix, resp.compact_revision,
                            )  # fmt: skip
                            next_rev = resp.compact_revision
                        else:
                            _log.warning("etcd %s: watch on %s cancelled (%s); re-creating it",
                                         self._url, full_prefix, resp.cancel_reason)  # fmt: skip
                        break
                    events = []
                    for ev in resp.events:
                        next_rev = max(next_rev, ev.kv.mod_revision + 1)
                        event = self._to_event(ev)
                        if event is not None:
                            events.append(event)
                    if events:
                        for event in events:
                            self._events.put(event)
                        self._wake()
                    delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # said once per outage: the stream is re-created every second
                (_log.debug if failing else _log.warning)("etcd %s: watch on %s failed (%s); re-creating it",
                                                          self._url, full_prefix, _describe(exc))
                failing = True
            finally:  # closed now, not when collected: its gRPC call ends with it (_Watch)
                await stream.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _wake(self) -> None:
        """Tell the hub there are events; its callback failing must not kill the watch."""
        if self._on_event is None:
            return
        try:
            self._on_event()
        except Exception:
            _log.exception("on_event callback raised; events stay queued")

    def _to_event(self, ev: Any) -> Event | None:
        """Convert a protobuf watch event; a put whose value is not JSON is logged and skipped."""
        key = self._relative(ev.kv.key)
        if ev.type == _EVENT_DELETE:
            return Event("delete", key, None)
        if ev.type == _EVENT_PUT:
            try:
                return Event("put", key, self._decode(ev.kv.key, ev.kv.value))
            except ProtocolError as exc:
                _log.warning("%s; event skipped", exc)
        return None

    def _relative(self, raw_key: bytes) -> str:
        """Strip the job prefix from a raw etcd key."""
        return raw_key.decode("utf-8", errors="replace")[len(self._prefix) :]

    def _decode(self, raw_key: bytes, raw: bytes) -> dict:
        """Decode a JSON object; anything else under our prefix was not written by Litz (a JSON list or
        number put by hand made the master fail on ``value.get``: it is refused here, once for all)."""
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            key = raw_key.decode("utf-8", errors="replace")
            raise ProtocolError(f"etcd {self._url}: value of {key} is not UTF-8 JSON ({exc})") from exc
        if not isinstance(value, dict):
            key = raw_key.decode("utf-8", errors="replace")
            raise ProtocolError(f"etcd {self._url}: value of {key} is not a JSON object: {str(value)[:80]}")
        return value
