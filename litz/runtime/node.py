"""What every worker and server process shares: its endpoint, its etcd registration, its loop.

A process registers ``procs/<role>/<id>`` under the job's etcd prefix with a kept-alive
lease, learns its peers' addresses from the same prefix, and leaves when the master's
registration disappears (so a dead master never leaves orphans). etcd events arrive on the
membership thread and wake the loop through a pipe; nothing here blocks on etcd.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from litz.errors import ConfigError, EtcdUnreachable, LitzError
from litz.runtime import security
from litz.runtime.membership import Event, KeyHeld, Membership, lease_ttl
from litz.runtime.protocol import FROM_MASTER, INITS, Message
from litz.runtime.transport import Endpoint, host_name

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow.fs as pafs

# ``litz.ft.storage`` (pyarrow: 35-60 ms to import) is imported where a checkpoint is read or
# written, here and in the worker and the server: a job without checkpoints never loads it, and
# every worker and server process of every job used to pay for it at start.

log = logging.getLogger(__name__)

T = TypeVar("T")

PROCS = "procs/"
LEAVE_TIMEOUT = 10.0  # seconds a retiring process waits to be owed nothing before it leaves anyway
MASTER_KEY = "procs/master/master"
#: seconds before a failed look-up of an unknown sender's address is tried again: the first wait,
#: doubled after each failure up to the last
LOOKUP_RETRY = (0.5, 8.0)
#: messages of one unknown sender held while its address is looked up; more are dropped (logged):
#: handled at once, they would overtake the held ones and their answers could not be sent
MAX_PARKED = 1000
#: unknown senders whose messages may wait at once; a message of any other is handled at once
#: (without an address its answer fails, as a stranger's does)
MAX_PARKED_SENDERS = 64
#: seconds beyond the master's lease time-to-live that its registration may stay away (see MasterPresence)
MASTER_GRACE_EXTRA = 1.0
# seconds a starting process keeps trying to reach etcd (an outage as a scale-out spawns it): as long
# as the master waits for a new process to become ready (elastic.JOIN_TIMEOUT)
START_WAIT = 30.0
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


#: the requests whose answer, an error included, carries their ``rid`` (``Node.reply_error``)
_REQUESTS = frozenset({"get", "update", "stats_request"})


def proc_key(role: str, ident: str) -> str:
    return f"{PROCS}{role}/{ident}"


class MasterPresence:
    """Whether the job's master is still there, as its etcd registration tells (no sockets).

    A deleted registration does not prove the master dead. Its lease also lapses when the master
    only stalled past the lease's time-to-live (a paused virtual machine, swapping) or lost etcd
    for that long (a partition): its keep-alive then grants a new lease and puts the same
    registration back within a third of the time-to-live of coming back. Before, every worker and
    server left at the delete (exit code 3) and the live master failed the job with ProcessLost.
    So a delete starts a grace period of the master's time-to-live (which it writes in its
    registration: a joined host may run with another ``--lease-ttl``) plus ``MASTER_GRACE_EXTRA``;
    the same master (address, pid and start time) registering again within it cancels it, and
    only its end means the master is gone. Another master under the key means the one we served
    is gone: at once.
    """

    def __init__(self, record: dict[str, Any] | None = None) -> None:
        self.record = record  # the master's registration, as last seen
        self.deadline: float | None = None  # when a missing registration counts as the master gone
        self.replaced = False  # another master registered under the key

    @staticmethod
    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Whether two registrations are one master process's (the keep-alive puts back the very value)."""
        return all(a.get(k) == b.get(k) for k in ("addr", "pid", "started"))

    def put(self, record: dict[str, Any]) -> bool:
        """The master's registration was put; True if it came back during a grace period."""
        back = self.deadline is not None
        if self.record is not None and not self.same(self.record, record):
            self.replaced = True  # (with or without a delete first: a put may overwrite the key)
            return False
        self.deadline = None
        self.record = record
        return back

    def delete(self, now: float) -> float:
        """The registration was deleted at ``now``; returns the grace period started (or running)."""
        grace = self.grace()
        if self.deadline is None:
            self.deadline = now + grace
        return grace

    def grace(self) -> float:
        """The master's lease time-to-live (from its registration, else this process's) plus the extra."""
        ttl = (self.record or {}).get("lease_ttl")
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl <= 0:
            ttl = lease_ttl()
        return float(ttl) + MASTER_GRACE_EXTRA

    def why_gone(self) -> str:
        """Why the master counts as gone, for the log."""
        if self.replaced:
            return "another master registered under its key"
        return f"its registration did not come back within {self.grace():.0f} s"

    def gone(self, now: float) -> bool:
        """Whether the master counts as gone: replaced, or away past its grace period."""
        return self.replaced or (self.deadline is not None and now >= self.deadline)


class Node:
    """Base of worker and server processes: endpoint + membership + a poll loop calling ``handle``."""

    role = "node"

    def __init__(self, ident: str, job: str, etcd: str, host: str = "127.0.0.1") -> None:
        self.ident = ident
        self.job = job
        self.host = host
        # the job secret comes from the process-wide settings (``main`` configures --secret-file)
        self.endpoint = Endpoint(ident, host, secret=security.settings().secret)
        self._wake_r, self._wake_w = os.pipe()
        self._leaving: tuple[str, float, bool] | None = None  # (who asked us to leave, deadline, settle)
        self._background: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # done: run on the loop
        self._jobs: queue.SimpleQueue[Any] | None = None  # for the background thread, started on first use
        self._jobs_pending = 0  # background jobs whose ``then`` has not run: a retiring process owes them
        self._writing: tuple[int, float] | None = None  # the checkpoint part being written: (cid, since)
        # bumped by a full recovery's rollback and reload: a partial recovery's read still under way
        # then belongs to an abandoned timeline, and what it read is dropped (``restore_on_thread``)
        self.restore_gen = 0
        self._restore_round = 0  # the newest recovery round asked of this process (``restore_on_thread``)
        os.set_blocking(self._wake_r, False)
        self.membership = Membership(etcd, job, on_event=self._wake)
        self.master: str | None = None
        self.master_presence = MasterPresence()  # the master's registration comes and goes (see there)
        self.fenced: set[str] = set()  # processes declared lost: their messages are dropped
        self._looked_up: set[str] = set()  # unknown senders already looked up in etcd (see dispatch)
        # messages from unknown senders whose addresses are being looked up, in order (see dispatch)
        self._parked: dict[str, list[Message]] = {}
        self._lookup_wanted: set[str] = set()  # senders waiting for a read of the registrations
        self._lookup_reading: set[str] | None = None  # the senders the read under way answers for
        self._lookup_retry: dict[str, tuple[float, float]] = {}  # failed look-ups: (when again, wait)
        self.messages_dropped = 0  # from unknown senders, past MAX_PARKED (see dispatch)
        # commands naming processes whose addresses are unknown here, in order, with those processes:
        # they wait for a read of the registrations (``awaits_peers``)
        self._awaiting: deque[tuple[Message, list[str]]] = deque()
        self._releasing: Message | None = None  # the waiting command being handled again
        self.stopping = False
        self.exit_code = 0
        self.poller = zmq.Poller()
        self.poller.register(self.endpoint.router, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def start(self) -> None:
        """Connect to etcd, learn the registered processes and register this one.

        Each step is tried again while etcd does not answer, up to ``START_WAIT`` s in all: a process
        a scale-out starts during an etcd outage (the node agent took the request just before)
        used to exit after one call's deadline (5 s), and the scale went on without it."""
        deadline = time.monotonic() + START_WAIT
        self._patiently("connect", self.membership.start, deadline)
        self._patiently("watch the registrations", lambda: self.membership.watch_prefix(PROCS), deadline)
        for key, value in self._patiently("read the registrations", lambda: self.membership.get_prefix(PROCS),
                                          deadline).items():
            self._learn(key, value)
        record = {"role": self.role, "id": self.ident, "host": host_name(self.endpoint.host),
                  "addr": self.endpoint.address, "pid": os.getpid(), "started": time.time(),
                  "lease_ttl": lease_ttl()}  # (how long a successor of the same id may have to wait)
        self._patiently("register", lambda: register_exclusively(self.membership, proc_key(self.role, self.ident),
                                                                 record), deadline)

    def _patiently(self, what: str, call: Callable[[], T], deadline: float) -> T:
        """``call()``, again every half second while etcd is unreachable, until ``deadline``."""
        warned = False
        while True:
            try:
                return call()
            except EtcdUnreachable as exc:
                if time.monotonic() + 0.5 >= deadline:
                    raise
                if not warned:
                    log.warning("%s: %s; trying again until %.0f s have passed", self.ident, exc, START_WAIT)
                    warned = True
            time.sleep(0.5)

    def _look_up_peers(self, sender: str) -> None:
        """Read every registration, off the loop: a message came from a process whose registration
        event has not reached us yet, and the answer needs its address.

        The master registers and then sends ``init_*``; a process that took its snapshot of the
        registrations before that learns the master from the watch, and ZeroMQ can deliver the
        init before etcd delivers the event. etcd's reads are linearizable, so a registration
        made before the message was sent is seen. Once per unknown sender: a stranger's
        messages do not cost a read each.

        On a thread of its own (not the background thread, which may be stuck in a checkpoint
        write), while the sender's messages wait (``dispatch``): the read used to block the loop,
        and every task of the process with it, for up to the call deadline (5 s) during an etcd
        outage; and the sender was marked looked up before the read, so after a failed one its
        message was handled without an address and could not be answered. A failed read is tried
        again (``LOOKUP_RETRY``); the sender's registration event, if it comes first, ends the wait."""
        self._lookup_wanted.add(sender)
        self._start_lookup()

    def _start_lookup(self) -> None:
        """Start one read for every sender whose look-up is due, unless one is under way (it then
        starts after it: a read begun before a sender's message arrived may miss its registration).
        One read and one thread at a time, whatever the number of unknown senders."""
        if self._lookup_reading is not None or not self._lookup_wanted:
            return
        now = time.monotonic()
        due = {s for s in self._lookup_wanted if self._lookup_retry.get(s, (0.0, 0.0))[0] <= now}
        if not due:
            return
        self._lookup_wanted -= due
        self._lookup_reading = due

        def then(found: dict[str, dict] | None, error: BaseException | None) -> None:
            covered, self._lookup_reading = self._lookup_reading or set(), None
            if error is not None:
                for sender in covered:
                    wait = self._lookup_retry.get(sender, (0.0, LOOKUP_RETRY[0] / 2))[1] * 2
                    wait = min(max(wait, LOOKUP_RETRY[0]), LOOKUP_RETRY[1])
                    self._lookup_retry[sender] = (time.monotonic() + wait, wait)
                    self._lookup_wanted.add(sender)
                log.warning("%s: cannot look up the address of %s (%s); their messages wait, trying again",
                            self.ident, ", ".join(sorted(covered)), error)
            else:
                for key, value in (found or {}).items():
                    self._learn(key, value)
                for sender in covered:
                    self._lookup_retry.pop(sender, None)
                    self._looked_up.add(sender)
                    self._release_parked(sender)  # (still unknown: a stranger; its answer fails and says so)
            self._start_lookup()

        self.on_thread(lambda: self.membership.get_prefix(PROCS), then, "lookup")

    def _retry_lookups(self) -> None:
        """From the loop: release the messages of senders whose address came another way (an init's
        peers, a migration's destination), forget look-ups no message waits for any more, and start
        the ones whose wait after a failure is over."""
        if not self._parked and not self._lookup_wanted and not self._awaiting:
            return
        for sender in [s for s in self._parked if s in self.endpoint.peers]:
            self._release_parked(sender)
        self._release_awaiting()
        awaited = {name for _, names in self._awaiting for name in names}
        for sender in [s for s in self._lookup_wanted if s not in self._parked and s not in awaited]:
            self._lookup_wanted.discard(sender)
            self._lookup_retry.pop(sender, None)
        self._start_lookup()

    def awaits_peers(self, msg: Message, names: Iterable[str]) -> bool:
        """Whether command ``msg``, which routes to the processes ``names``, must not be handled now: it
        waits (True) while a process it names has no known address here, or while an earlier
        command waits (commands that route are handled in order), or it is refused (True, logged
        and answered with an error) once a read of the registrations did not find one of them.

        A worker or server sent to a process it has no address for raised out of its loop and
        died (exit 70): a ``routes`` or ``server_lost`` naming an unknown server killed it at the
        next read. The master names only registered processes, but its etcd watch may be ahead of
        ours: the registrations are read off the loop first (``_look_up_peers``), as for a message
        from an unknown sender."""
        if self._awaiting and self._releasing is not msg:  # behind an earlier one, in order
            self._awaiting.append((msg, list(names)))
            return True
        unknown = sorted({n for n in names if n != self.ident and not self.endpoint.knows(n)})
        if not unknown:
            return False
        if not self.membership.started or all(n in self._looked_up for n in unknown):
            reason = (f"{self.ident} refused {msg.type!r} from {msg.sender}: it names {', '.join(map(repr, unknown))}, "
                      "which no registration of the job names")
            log.error("%s", reason)
            self.reply_error(msg, reason)
            return True
        if self._releasing is msg:  # (it names others than when it began to wait) at the front again
            self._awaiting.appendleft((msg, list(names)))
        else:
            self._awaiting.append((msg, list(names)))
        for name in unknown:
            if name not in self._looked_up:
                self._look_up_peers(name)
        return True

    def _release_awaiting(self) -> None:
        """Handle again, in order, the commands that waited for addresses and may go on now (each
        is handled, or refused, or waits again at the front)."""
        while self._awaiting:
            msg, names = self._awaiting[0]
            if any(n != self.ident and not self.endpoint.knows(n) and n not in self._looked_up for n in names):
                return  # its look-up is under way
            self._awaiting.popleft()
            self._releasing = msg
            try:
                self._handle(msg)
            finally:
                self._releasing = None

    def _release_parked(self, sender: str) -> None:
        """Handle, in order, the messages of ``sender`` that waited for its address."""
        for msg in self._parked.pop(sender, []):
            self._handle(msg)

    def _learn(self, key: str, value: dict | None) -> None:
        if value and key == MASTER_KEY and self.master_presence.put(value):
            log.warning("%s: the master registered again (its lease had lapsed: it stalled or lost etcd); "
                        "staying", self.ident)
        if value and "addr" in value and "id" in value:
            self.endpoint.connect(value["id"], value["addr"])  # (its waiting messages: _retry_lookups)

    def _membership_events(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        for ev in self.membership.poll_events():
            self.on_event(ev)
        while True:
            try:
                done = self._background.get_nowait()
            except queue.Empty:
                break
            done()

    def restore_failed(self, msg: Message, exc: Exception, answer: str) -> bool:
        """Whether ``exc``, raised restoring what ``msg`` asked for from the running checkpoint, is
        the checkpoint storage failing to answer; if so, say so in ``answer`` (the master asks
        again until ``--checkpoint-timeout``: a store's outage of a few seconds must not end the
        job). Anything else is the request's error, as before."""
        from litz.ft import storage  # imported already: the restore raised it

        if not storage.store_failed(exc):
            return False
        log.warning("%s: %s failed, the checkpoint storage does not answer: %s", self.ident, msg.type, exc)
        items = {"shards_restored": {"shards": []}, "executors_restored": {"executors": []}}.get(answer, {})
        self.endpoint.send(msg.sender, answer, round=msg.get("round", 0), error=f"{self.ident}: {exc}", **items)
        return True

    def restore_on_thread(self, msg: Message, read: Callable[[], Any], host: Callable[[Any], None],
                          answer: str) -> None:
        """Read what a partial recovery's ``msg`` asks for from the running checkpoint on a thread
        of its own, then ``host(what was read)`` on the loop. A large model on a network store
        takes a while to read, and the loop meanwhile serves what this process hosts already:
        before, the process, and every task that needed it, waited for the read. Not on the
        background thread, which may be stuck in a hung checkpoint write. A failure is answered
        as the handler's own was (``restore_failed``, else the request's error). What a full
        recovery or a later plan (another loss: its round is newer) overtook is dropped: hosted
        after the later plan's, it would replace items that may have been used since."""
        gen, round_ = self.restore_gen, msg.get("round", 0)
        self._restore_round = max(self._restore_round, round_)

        def then(value: Any, error: BaseException | None) -> None:
            if gen != self.restore_gen or round_ < self._restore_round:
                log.warning("%s: dropped what %s of round %d read: a later recovery overtook it", self.ident,
                            msg.type, round_)
                return
            if error is None:
                try:
                    host(value)
                    return
                except Exception as exc:  # answered below, as a failing handler's
                    error = exc
            if not (isinstance(error, Exception) and self.restore_failed(msg, error, answer)):
                log.error("%s: failed to handle %r from %s", self.ident, msg.type, msg.sender, exc_info=error)
                self.reply_error(msg, f"{type(error).__name__}: {error}")

        self.on_thread(read, then, "restore")

    def on_thread(self, work: Callable[[], Any], then: Callable[[Any, BaseException | None], None],
                  name: str) -> None:
        """Run ``work()`` on a thread of its own, then ``then(result, error)`` on the loop: for what may
        wait long on another service (a checkpoint store, etcd) while the loop goes on serving. Not on
        the background thread, which a hung checkpoint write may hold."""
        def run() -> None:
            try:
                value, error = work(), None
            except BaseException as exc:  # handed to ``then``
                value, error = None, exc
            self._to_loop(then, value, error)

        threading.Thread(target=run, daemon=True, name=f"{self.ident}-{name}").start()

    def part_refused(self, msg: Message) -> bool:
        """Whether this process cannot take part in checkpoint ``msg`` (a ``checkpoint`` or
        ``ckpt_save`` request), having answered so: its part of an earlier round is still being
        written. The store hangs (the master gave up on that round after ``--checkpoint-timeout``),
        and the new part would queue behind it, holding a copy of the state in memory, round after
        round, until the store answers. Called before the copy is taken; the round fails at once,
        saying why, and training goes on."""
        if self._writing is None:
            return False
        cid, since = self._writing
        self.endpoint.send(msg.sender, "checkpoint_snapshot", cid=msg["cid"])
        self.endpoint.send(msg.sender, "checkpoint_written", cid=msg["cid"], files=[],
                           error=f"{self.ident}: its part of round {cid} is still being written, "
                                 f"{time.monotonic() - since:.0f} s on: the store does not answer")
        return True

    def checkpoint_part(self, msg: Message, name: str, write: Callable[[pafs.FileSystem, str], None]) -> None:
        """Answer a checkpoint request whose in-memory copy is taken: training may go on; then
        ``write(fs, path)`` the file ``name`` in the background and report it (or the error)."""
        self.endpoint.send(msg.sender, "checkpoint_snapshot", cid=msg["cid"])
        self._writing = (msg["cid"], time.monotonic())

        def work() -> list[str]:
            from litz.ft import storage

            fs, _ = storage.filesystem(msg["location"])
            write(fs, f"{msg['path']}/{name}")
            return [name]

        def then(files: list[str] | None, error: BaseException | None) -> None:
            self._writing = None
            extra = {"error": f"{self.ident}: {type(error).__name__}: {error}"} if error else {}
            self.endpoint.send(msg.sender, "checkpoint_written", cid=msg["cid"], files=files or [], **extra)

        self.in_background(work, then)

    def in_background(self, work: Callable[[], Any], then: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``work`` on this process's background thread (slow I/O, e.g. writing a checkpoint),
        in order, and ``then(result, error)`` back on the loop's thread, which alone may touch the
        sockets. One long-lived thread, not one per job: starting a thread made the loop wait for
        the new thread to take the GIL, milliseconds per partial checkpoint round."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._run_jobs, args=(self._jobs,), daemon=True,
                             name=f"{self.ident}-background").start()
        self._jobs_pending += 1

        def then_on_loop(result: Any, error: BaseException | None) -> None:
            self._jobs_pending -= 1
            then(result, error)

        self._jobs.put((work, then_on_loop))

    def _run_jobs(self, jobs: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]]
                  ) -> None:
        while True:
            work, then = jobs.get()
            try:
                result, error = work(), None
            except BaseException as exc:  # handed to ``then``
                result, error = None, exc
            self._to_loop(then, result, error)

    def _to_loop(self, then: Callable[[Any, BaseException | None], None], result: Any,
                 error: BaseException | None) -> None:
        """From a thread: have the loop, which alone may touch the sockets, call ``then(result, error)``."""
        self._background.put(lambda: then(result, error))
        self._wake()

    def on_event(self, ev: Event) -> None:
        if ev.kind == "put":
            self._learn(ev.key, ev.value)
        elif ev.kind == "delete" and ev.key == MASTER_KEY:
            grace = self.master_presence.delete(time.monotonic())
            log.warning("%s: the master's registration is gone; leaving in %.0f s unless it comes back (a "
                        "master that stalled past its lease registers again)", self.ident, grace)
        elif ev.kind == "delete" and ev.key.startswith(PROCS):
            self.endpoint.forget(ev.key.rsplit("/", 1)[-1])

    def drain(self) -> None:
        """Handle every message waiting on the mailbox without blocking."""
        while True:
            try:
                msg = self.endpoint.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg is not None:
                self.dispatch(msg)

    def dispatch(self, msg: Message) -> None:
        """Handle ``msg``; one from a sender whose address is unknown waits, with the sender's later
        ones, until its look-up ends (``_look_up_peers``)."""
        if msg.sender in self.fenced:
            log.debug("%s: dropped %r from %s, which was declared lost", self.ident, msg.type, msg.sender)
            return
        parked = self._parked.get(msg.sender)
        if parked is not None and msg.sender in self.endpoint.peers:  # its address came another way
            self._release_parked(msg.sender)
            parked = None
        if parked is None and msg.sender not in self.endpoint.peers and msg.sender not in self._looked_up \
                and self.membership.started and len(self._parked) < MAX_PARKED_SENDERS:
            # (a node driven without etcd, by a test: nothing to ask)
            parked = self._parked[msg.sender] = []
            self._look_up_peers(msg.sender)
        if parked is not None:
            if len(parked) < MAX_PARKED:
                parked.append(msg)
            else:
                self.messages_dropped += 1
                if self.messages_dropped == 1 or self.messages_dropped % 1000 == 0:
                    log.error("%s: dropped %r from %s: %d messages of it already wait for its address "
                              "(%d dropped so far)", self.ident, msg.type, msg.sender, MAX_PARKED,
                              self.messages_dropped)
            return
        self._handle(msg)

    def _handle(self, msg: Message) -> None:
        """Call the handler of ``msg`` (an error is answered, never raised)."""
        if msg.sender in self.fenced:  # (fenced while it waited for its look-up)
            log.debug("%s: dropped %r from %s, which was declared lost", self.ident, msg.type, msg.sender)
            return
        if msg.type in FROM_MASTER and (why := self._not_from_master(msg)) is not None:
            log.warning("%s: refused %r from %s: %s", self.ident, msg.type, msg.sender, why)
            return
        if self._awaiting and self._releasing is not msg and msg.sender == self._awaiting[0][0].sender:
            # behind a command of its sender's that waits for an address (awaits_peers): in order, as
            # sent (tasks for the executors a waiting reload_executors brings were refused)
            self._awaiting.append((msg, []))
            return
        handler = getattr(self, f"on_{msg.type}", None)
        if handler is None:
            log.warning("%s: unexpected %r message from %s; ignored", self.ident, msg.type, msg.sender)
            self.reply_error(msg, f"{self.role} does not handle {msg.type!r} messages")
            return
        try:
            handler(msg)
        except Exception as exc:  # a bad request must never kill the process
            log.exception("%s: failed to handle %r from %s", self.ident, msg.type, msg.sender)
            self.reply_error(msg, f"{type(exc).__name__}: {exc}")

    def _not_from_master(self, msg: Message) -> str | None:
        """Why ``msg``, of a type only the master sends (``FROM_MASTER``), is refused; None if it is not.

        The master names itself in the init (``master``), which it sends first; before it, the
        job's master is the process registered under ``MASTER_KEY`` if this one has seen it (a
        test's stand-in registers elsewhere, and its init is taken). A process initialised
        once takes no other init: a second one wiped a server's shards, or made a worker's
        executors afresh, losing what they held. Before the init, only a ``shutdown`` is taken
        (the master ends a job whose processes it never initialised)."""
        registered = (self.master_presence.record or {}).get("id")
        if msg.type in INITS:
            if self.master is not None:
                return f"this process was initialised already, by {self.master}"
            if registered is not None and msg.sender != registered:
                return f"the job's master is {registered}"
            if msg.get("master") != msg.sender:
                return f"it names {msg.get('master')!r} as the master, not its sender"
            return None
        if self.master is None:
            if msg.type == "shutdown" and registered in (None, msg.sender):
                return None
            return "this process has no master yet (it was not initialised)"
        if msg.sender != self.master:
            return f"only its master, {self.master}, sends them"
        return None

    def on_fence(self, msg: Message) -> None:
        """The master declared a process lost and recovers its work elsewhere: if it only stalled
        and comes back, nothing it sends (updates, forwarded tasks) may count twice."""
        if msg.sender == self.master:
            self.fenced.add(msg["ident"])

    def reply_error(self, msg: Message, reason: str) -> None:
        """Tell the sender of ``msg`` why it failed. With its request id only if ``msg`` is a request
        answered by that id (``get``, ``update``, ``stats_request``): the rid of a ``routes`` is not
        one the master waits on (it dropped the error as an answer it never asked for, and did not
        see the refusal), and the rid of a reply is the answered process's own, not the sender's."""
        fields: dict[str, Any] = {"reason": reason, "about": msg.type}
        if msg.type in _REQUESTS and isinstance(msg.fields.get("rid"), int):
            fields["rid"] = msg.fields["rid"]
        try:
            self.endpoint.send(msg.sender, "error", **fields)
        except Exception:  # unknown sender: nothing to answer
            log.warning("%s: cannot answer %r", self.ident, msg.sender)

    def poll(self, timeout_ms: int) -> None:
        events = dict(self.poller.poll(timeout_ms))
        self.endpoint.close_departed()  # (a process that sends nothing more still closes them)
        if self._wake_r in events:
            self._membership_events()
        if self.endpoint.router in events:
            self.drain()
        self._retry_lookups()
        self._leave_if_master_gone()
        self._leave_if_replaced()

    def _leave_if_replaced(self) -> None:
        """Leave (exit code 3) if another process took this one's registration while its lease was
        gone (it stalled, or was cut off from etcd, past its TTL, and a newer job of the same name
        started a process of the same id meanwhile): the key is not taken back (``Membership``), and
        this process must not serve the other job's peers, which now reach its namesake."""
        if self.stopping or not self.membership.lost_any:
            return
        [(key, holder)] = list(self.membership.lost_keys.items())[:1]
        log.error("%s: its registration %s was taken by pid %s on %s while this process was cut off from etcd "
                  "longer than its lease; leaving", self.ident, key, holder.get("pid"), holder.get("host"))
        self.exit_code = 3
        self.stopping = True

    def _leave_if_master_gone(self) -> None:
        """Leave (exit code 3) once the master counts as gone (``MasterPresence``): a dead master must
        leave no orphans, but one whose lease only lapsed comes back and the job goes on."""
        if self.stopping or not self.master_presence.gone(time.monotonic()):
            return
        log.error("%s: the master is gone (%s); leaving", self.ident, self.master_presence.why_gone())
        self.exit_code = 3
        self.stopping = True

    def stats(self) -> dict[str, Any]:
        return {"id": self.ident, "role": self.role, **self.endpoint.counters()}

    def on_stats_request(self, msg: Message) -> None:
        self.endpoint.send(msg.sender, "stats", rid=msg["rid"], stats=self.stats())

    def on_shutdown(self, msg: Message) -> None:
        """Leave: at once at the job's end, or once nothing is owed when retiring (``settle``).

        A retiring process may still owe answers: a worker the completions that wait for the
        acknowledgement of its last updates, a server the replies to requests it forwarded.
        Leaving before would lose them and the driver would wait for ever. So with ``settle``
        the goodbye is sent only when ``owed()`` is 0, or after ``LEAVE_TIMEOUT`` seconds (a
        peer that died must not hold the process hostage). At the job's end nothing matters.
        """
        if self.master is not None and msg.sender != self.master:  # a stray peer must not end the process
            log.warning("%s: shutdown from %s, which is not the master; ignored", self.ident, msg.sender)
            return
        self.before_exit()
        settle = bool(msg.get("settle"))
        self._leaving = (msg.sender, time.monotonic() + (LEAVE_TIMEOUT if settle else 0.0), settle)
        self.leave_when_settled()

    def leave_when_settled(self) -> None:
        """Say goodbye and stop if a shutdown was asked for and nothing is owed (or time is up);
        once (the loop asks again after the message that asked for it)."""
        if self._leaving is None or self.stopping:
            return
        sender, deadline, settle = self._leaving
        owed = self.owed() + self._jobs_pending  # a checkpoint part being written is owed to the master
        if owed and time.monotonic() < deadline:
            return
        if owed and settle:
            log.error("%s: leaving while still owing %d answers", self.ident, owed)
        self.endpoint.send(sender, "bye", stats=self.stats())
        self.stopping = True

    def owed(self) -> int:
        """Hook: how many answers this process still owes others (0: it may leave)."""
        return 0

    def before_exit(self) -> None:
        """Hook: finish what must be finished before saying bye."""

    def loop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            self.membership.close()
        finally:
            self.endpoint.close()
            os.close(self._wake_r)
            os.close(self._wake_w)


class RecentIds:
    """The last ``size`` ids a process took (tasks, migrations), to refuse one that comes again
    (a duplicated message ran a task twice, or installed a migration's rows over newer ones); an
    id ``forget`` drops may come again (a task shipped away with its executor may come back). An
    id taken again after ``forget`` stays known until its last taking is among the oldest: a set
    beside the order forgot it when its first taking was (a duplicate then ran)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: set[int] = set()
        self._order: deque[int] = deque()
        self._times: dict[int, int] = {}  # id -> how often it is in _order

    def __contains__(self, ident: object) -> bool:
        return ident in self._live

    def take(self, ident: int) -> bool:
        """Remember ``ident``; False (remembering nothing) if it is known already."""
        if ident in self._live:
            return False
        self._live.add(ident)
        self._order.append(ident)
        self._times[ident] = self._times.get(ident, 0) + 1
        if len(self._order) > self.size:
            old = self._order.popleft()
            if self._times[old] == 1:
                del self._times[old]
                self._live.discard(old)
            else:
                self._times[old] -= 1
        return True

    def forget(self, ident: int) -> None:
        self._live.discard(ident)

    def clear(self) -> None:
        self._live.clear()
        self._order.clear()
        self._times.clear()


def checked_shard_map(msg: Message, num_shards: int) -> list[str]:
    """The ``shard_map`` of ``msg`` (and its ``gone`` servers), checked: a server id for each of the
    ``num_shards`` shards. A LitzError names what is wrong: a short map raised part-way (an
    IndexError), leaving the routes half changed."""
    smap = msg["shard_map"]
    if len(smap) != num_shards or not all(isinstance(s, str) for s in smap):
        raise LitzError(f"{msg.type!r} from {msg.sender}: its shard_map must name a server for each of the "
                        f"{num_shards} shards, got {smap!r:.200}")
    if not all(isinstance(s, str) for s in msg.get("gone", ())):
        raise LitzError(f"{msg.type!r} from {msg.sender}: its gone servers must be ids, got {msg['gone']!r:.200}")
    return smap


def register_exclusively(membership: Membership, key: str, record: dict[str, Any]) -> None:
    """Register ``key`` only if no other process holds it (``exclusive``), waiting up to a lease's
    time-to-live for a holder to go: a process of the same id killed a moment ago (``--resume`` right
    after a ``kill -9``) holds its key until its lease ends. ``KeyHeld`` if it is still held then.
    Exclusive, so that a process cut off from etcd past its lease never takes its key back from a
    newer job of the same name (it leaves instead: ``Node._leave_if_replaced``)."""
    started = time.monotonic()
    deadline = started + lease_ttl() + 1.0
    while True:
        try:
            membership.register(key, record, exclusive=True)
            return
        except KeyHeld as exc:  # (a holder of a longer lease than ours, as its record says: its time)
            held_for = exc.holder.get("lease_ttl")
            if isinstance(held_for, (int, float)) and not isinstance(held_for, bool):
                deadline = max(deadline, started + min(float(held_for), 3600.0) + 1.0)
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.25)


def kill_job_process(pid: int, ident: str, job: str) -> bool:
    """SIGKILL process ``pid`` if it still is ``ident`` of ``job`` on this machine; whether it was.

    The master fences a process it declared lost this way. A pid can be reused once its
    process is gone, so the command line (``--id IDENT --job JOB``, as the launcher starts them,
    or as the spawner writes it over a forked one's) is checked first: a stranger with the same
    pid is never touched.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:  # gone already, or no /proc here
        return False
    pairs = set(zip(argv, argv[1:], strict=False))
    if (b"--id", ident.encode()) not in pairs or (b"--job", job.encode()) not in pairs:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def exit_process(code: int, flush_timeout: float = 2.0) -> None:
    """End a worker or server process that has closed its node, skipping the interpreter's teardown.

    Python's own exit took about 120 ms more per process (unloading gRPC, NumPy, Numba and
    friends), and the launcher waits for every process before a job returns. What that teardown
    did which matters is done here first: ZeroMQ delivers what is still queued (the context is
    terminated, bounded by the sockets' linger, and by ``flush_timeout`` should a socket have been
    left open), logging and the standard streams are flushed. The node already left etcd in
    ``close()``.
    """
    done = threading.Event()

    def term() -> None:
        zmq.Context.instance().term()
        done.set()

    threading.Thread(target=term, name="litz-zmq-term", daemon=True).start()
    done.wait(flush_timeout)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(code)


def process_name(ident: str) -> str:
    """What a worker or server process is called (``ps -o comm``, ``top``): ``litz-<id>``, at most
    the 15 bytes Linux keeps."""
    return f"litz-{ident}".encode()[:15].decode(errors="ignore")


def set_process_name(name: str) -> None:
    """Name this process's main thread (``top`` and ``ps -o comm`` show it)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def die_with_parent() -> None:
    """Ask Linux to kill this process when the launcher that started it dies (no orphans)."""
    parent = os.environ.get("LITZ_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(3)


#: glibc ``mallopt`` parameters (malloc.h) and the values a worker or server sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for the next allocation instead of giving it back to the kernel.

    Why: a task's rows travel as arrays of 100 KB to a few MB (a block of LDA's word-topic rows is
    146 KB) that are allocated and freed every round: the messages' buffers, the cache's rows, the
    update log's deltas, the kernels' outputs. By default glibc serves an allocation above 128 KB
    with its own ``mmap`` and returns it with ``munmap`` when it is freed, or trims the heap once
    128 KB lie free at its top, so the next array of the same size faults in every one of its pages
    again (a page fault and a zeroed page per 4 KB, and in a process with threads a TLB shootdown
    of the other cores when they are unmapped). Here, allocations below 16 MB come from the heap,
    and up to 64 MB freed at its top stay mapped. Setting only the mmap threshold, as an
    environment variable, measured worse: it keeps the trim threshold at 128 KB.
    Returns whether the settings took (glibc on Linux only; anything else keeps its allocator).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _read_all(fd: int) -> bytes:
    """Everything until end of file from ``fd`` (a pipe the launcher wrote and closed)."""
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def main(node_cls: type[Node], argv: list[str] | None = None) -> int:
    """Entry point of a worker or server process: ``--id --job --etcd [--host] [--secret-file | --secret-stdin]``.

    ``--secret-file`` (default: ``$LITZ_SECRET_FILE``) turns on CURVE for every socket of the
    process; a host outside loopback requires it. ``--secret-stdin`` reads the job's CURVE key
    from stdin instead: how a launcher starts its processes, with the secret it loaded at its
    start. A bad secret is a configuration error: exit code 2 with a one-line reason in the
    log, before anything listens.
    """
    import argparse

    parser = argparse.ArgumentParser(prog=f"litz-{node_cls.role}")
    parser.add_argument("--id", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--secret-file", default=os.environ.get("LITZ_SECRET_FILE") or None,
                        help="the job secret (CURVE); required outside loopback")
    parser.add_argument("--secret-stdin", action="store_true",
                        help="read the job's CURVE key from stdin (how a launcher passes the secret it loaded)")
    parser.add_argument("--log-level", default=os.environ.get("LITZ_LOG_LEVEL", "WARNING"))
    args = parser.parse_args(argv)
    die_with_parent()
    set_process_name(process_name(args.id))
    keep_freed_memory()
    # SIGUSR1 prints every thread's stack to stderr (the process's log): how the launcher shows
    # where a process that stopped answering is stuck
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {args.id} %(levelname)s %(name)s: %(message)s")
    try:
        if args.secret_stdin:
            secret: security.JobSecret | str | None = security.JobSecret.from_curve_key(
                _read_all(0), "the launcher (stdin)")
        else:
            secret = args.secret_file
        security.configure(secret, host=args.host)
        node = node_cls(args.id, args.job, args.etcd, args.host)
    except ConfigError as exc:
        log.error("%s: %s", args.id, exc)
        return 2
    profile_dir = os.environ.get("LITZ_PROFILE")  # developers: cProfile each process into this folder
    try:
        node.start()
        if profile_dir:
            import cProfile

            # thread CPU time, not wall time: a wall-clock profile charges a preempted call (on
            # a loaded host, a send that wakes another thread) with the time others ran
            prof = cProfile.Profile(time.thread_time)
            prof.runcall(node.loop)
            prof.dump_stats(f"{profile_dir}/{args.id}.prof")
        else:
            node.loop()
    except KeyboardInterrupt:
        node.exit_code = 130
    finally:
        node.close()
    return node.exit_code
