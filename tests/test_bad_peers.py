"""Socket-free tests of what a buggy (but authenticated) peer of a job may send: every refusal names
what is wrong and loses nothing (tables, executors and tasks stay as they were; nothing dies, and
nothing waits for ever)."""

from __future__ import annotations

from typing import Any

import cloudpickle
import numpy as np

import litz
from litz.ps.server import ServerNode, ShardStore
from litz.ps.tables import Table, table_index
from litz.runtime.protocol import MESSAGES, Message
from litz.runtime.worker import DEFAULT_OPTIONS, Worker

Sent = list[tuple[str, str, dict[str, Any]]]


def _recording(node: Any) -> Sent:
    """What ``node`` sends, as ``(to, kind, fields)``, instead of sending it."""
    sent: Sent = []
    node.endpoint.send = lambda peer, kind, **fields: sent.append((peer, kind, fields))
    return sent


class _Counter(litz.Executor):
    def init_state(self) -> int:
        return 0

    def run_task(self, args: Any) -> int:
        self.state += 1
        return self.state


def _init_server(sender: str = "master", master: str = "master", shards: tuple[int, ...] = (0, 1, 2, 3)
                 ) -> Message:
    return Message("init_server", {"tables": cloudpickle.dumps([Table("t", (2,))]), "shards": list(shards),
                                   "num_shards": 4, "master": master}, sender=sender)


def _init_worker(sender: str = "master", master: str = "master") -> Message:
    return Message("init_worker", {"app": cloudpickle.dumps({"executor": _Counter, "config": {}}),
                                   "tables": cloudpickle.dumps([Table("t", (2,))]), "executors": [0],
                                   "num_executors": 1, "num_shards": 4, "shard_map": ["s0"] * 4, "peers": {},
                                   "options": dict(DEFAULT_OPTIONS), "master": master}, sender=sender)


def test_master_only_messages_are_declared() -> None:
    from litz.runtime.protocol import FROM_MASTER

    assert FROM_MASTER <= MESSAGES.keys()
    assert "tasks" not in FROM_MASTER and "stats_request" not in FROM_MASTER  # forwarded / harmless


def test_only_the_master_commands_a_server_and_only_once_initialises_it(caplog) -> None:  # noqa: ANN001
    """A second ``init_server`` (from a stray peer, or the master again) emptied every shard; any peer's
    ``migrate_shards``, ``reload_shards``, ``rollback``, ``routes``, ``server_lost``, ``checkpoint`` or
    ``ckpt_save`` was obeyed. Now they are refused, logged with their type and sender."""
    srv = ServerNode("s0", "job", "127.0.0.1:1")
    sent = _recording(srv)
    try:
        srv.dispatch(_init_server())
        assert sent == [("master", "ready", {"role": "server"})] and srv.master == "master"
        srv.dispatch(Message("update", {"rid": 1, "items": [["t", [0, 1], np.ones((2, 2))]], "low": 1}, sender="w0"))
        assert sent[-1] == ("w0", "update_ack", {"rid": 1, "errors": [None]})
        del sent[:]
        caplog.clear()
        for msg in [_init_server("stray", "stray"), _init_server(), _init_server(shards=())]:
            srv.dispatch(msg)
        stray = {"mid": 1, "shards": [0], "dest": "w0", "round": 1, "lost": ["s0"], "rid": 9, "gone": ["s0"],
                 "shard_map": ["w0"] * 4, "server": "s0", "cid": 1, "location": "/tmp", "path": "x", "rows": [0],
                 "reason": "x", "ident": "master"}
        for kind in ["migrate_shards", "reload_shards", "rollback", "routes", "server_lost", "checkpoint",
                     "ckpt_save", "fence", "shutdown", "restore_shards", "settle"]:
            fields = {f.rstrip("?"): stray[f.rstrip("?")] for f in MESSAGES[kind].fields if f.rstrip("?") in stray}
            srv.dispatch(Message(kind, fields, sender="w0"))
        assert sent == [] and not srv.stopping and srv.fenced == set()
        assert srv.store is not None and sorted(srv.store.shards) == [0, 1, 2, 3] and not srv.store.forward
        np.testing.assert_array_equal(srv.store.get("t", [0, 1]), np.ones((2, 2)))
        assert "refused 'init_server' from stray" in caplog.text and "initialised already, by master" in caplog.text
        assert "refused 'migrate_shards' from w0: only its master, master, sends them" in caplog.text
        assert "refused 'rollback' from w0" in caplog.text and "refused 'ckpt_save' from w0" in caplog.text
    finally:
        srv.endpoint.close()


def test_before_its_init_a_process_takes_it_only_from_the_registered_master() -> None:
    """Before any init the node knows the job's master from its registration: another process's
    init is refused, as is one whose ``master`` is not its sender, and any other command."""
    srv = ServerNode("s0", "job", "127.0.0.1:1")
    sent = _recording(srv)
    try:
        srv.master_presence.put({"id": "master", "addr": "x", "pid": 1, "started": 1.0})
        srv.dispatch(Message("rollback", {"lost": [], "round": 1}, sender="master"))
        srv.dispatch(_init_server("tester", "tester"))
        srv.dispatch(_init_server("master", "w0"))
        assert sent == [] and srv.store is None and srv.master is None
        srv.dispatch(_init_server())
        assert sent == [("master", "ready", {"role": "server"})]
    finally:
        srv.endpoint.close()


def test_a_second_init_worker_does_not_make_the_executors_afresh() -> None:
    w = Worker("w0", "job", "127.0.0.1:1")
    sent = _recording(w)
    try:
        w.dispatch(_init_worker())
        assert sent == [("master", "ready", {"role": "worker"})]
        ex = w.slots[0].executor
        ex.state = 5
        w.dispatch(_init_worker())
        w.dispatch(_init_worker("w1", "w1"))
        w.dispatch(Message("reload_executors", {"executors": [], "shard_map": ["w1"] * 4, "lost": [], "round": 1},
                           sender="w1"))
        assert len(sent) == 1 and w.slots[0].executor is ex and ex.state == 5 and w.shard_map == ["s0"] * 4
    finally:
        w.endpoint.close()


def _worker(shard_map: list[str], peers: tuple[str, ...] = ("s0", "s1")) -> tuple[Worker, Sent]:
    """A worker initialised by hand (no sockets): table ``t`` of rows (2,), 4 shards routed by ``shard_map``."""
    w = Worker("w0", "job", "127.0.0.1:1")
    sent = _recording(w)
    w.master, w.tables, w.num_shards, w.shard_map = "master", table_index([Table("t", (2,))]), 4, list(shard_map)
    w.endpoint.peers.update((peer, f"ipc:///nowhere/{peer}") for peer in ("master", *peers))  # (never sent to)
    return w, sent


def _waiting(w: Worker, table: str, key: Any, version: int = 0) -> Any:
    """A task blocked on ``key`` as ``ps_get`` leaves one, its fetch queued."""
    import greenlet

    from litz.runtime.worker import Task, _Wait

    wait = _Wait(greenlet.getcurrent(), Task(7, 0, version, None))
    wait.pending.add(key)
    if w.cache.request(table, key, version, wait):
        w._queue_fetches(table, [key], version)
    return wait


def test_routes_naming_a_server_without_an_address_are_refused_and_the_worker_lives() -> None:
    """``routes`` (or ``server_lost``) naming a server the worker has no address for was taken, and
    the next read raised out of the loop: the worker died (exit 70). Now the worker reads the
    registrations (not here: no etcd) and refuses it, changing nothing, saying so to the master."""
    w, sent = _worker(["s0", "s1", "s0", "s1"])
    try:
        w.dispatch(Message("routes", {"rid": 5, "shard_map": ["ghost"] * 4, "gone": ["s0"]}, sender="master"))
        w.dispatch(Message("server_lost", {"server": "s1", "shard_map": ["ghost"] * 4}, sender="master"))
        w.dispatch(Message("routes", {"rid": 6, "shard_map": ["s1"] * 3, "gone": ["s0"]}, sender="master"))
        w.dispatch(Message("shard_map", {"shard_map": ["s0", 3, "s0", "s0"]}, sender="master"))
        assert w.shard_map == ["s0", "s1", "s0", "s1"] and w._gone == set() and not w._route_acks
        assert [(to, kind, f.get("about")) for to, kind, f in sent] == [("master", "error", "routes"),
                                                                      ("master", "error", "server_lost"),
                                                                      ("master", "error", "routes"),
                                                                      ("master", "error", "shard_map")]
        assert "'ghost', which no registration of the job names" in sent[0][2]["reason"]
        assert "shard_map must name a server for each of the 4 shards" in sent[2][2]["reason"]
        w.dispatch(Message("routes", {"rid": 7, "shard_map": ["s1"] * 4, "gone": ["s0"]}, sender="master"))
        assert w.shard_map == ["s1"] * 4 and sent[-1] == ("master", "routes_ack", {"rid": 7})
    finally:
        w.endpoint.close()


def test_a_read_or_update_that_cannot_be_sent_fails_naming_its_server_and_the_rest_go_on() -> None:
    """A read or an update for a server without an address raised out of the worker's loop (exit 70).
    Now the tasks waiting for that server's keys fail, naming the server, the request, the table
    and the key; the other servers' reads go; an update is refused as a server refuses one (the
    master is told, before the completions it would release)."""
    w, sent = _worker(["s0", "ghost", "s0", "ghost"])
    sent_frames = []
    real = w.endpoint.send

    def send(peer: str, kind: str, **fields: Any) -> None:
        if peer not in w.endpoint.peers:
            from litz.errors import ProtocolError

            raise ProtocolError(f"w0: no address known for peer {peer!r}")
        sent_frames.append(peer)
        real(peer, kind, **fields)

    w.endpoint.send = send  # type: ignore[method-assign]
    try:
        stuck, fine = _waiting(w, "t", 1), _waiting(w, "t", 2)
        w._send_fetches()
        assert stuck.resumed and "fetch of table 't' key 1 from ghost (request" in stuck.error
        assert "no address known for peer 'ghost'" in stuck.error
        assert not fine.resumed and [(to, kind) for to, kind, _ in sent] == [("s0", "get")]
        assert list(w._sent_to.values()) == ["s0"] and len(w._fetching) == 1
        w._send_updates({"t": ([0, 1], [np.ones(2), np.ones(2)])})
        assert [(to, kind) for to, kind, _ in sent[1:]] == [("s0", "update"), ("master", "error")]
        assert sent[2][2]["about"] == "update" and "could not be sent to ghost" in sent[2][2]["reason"]
        assert "table 't' (1 keys from 1)" in sent[2][2]["reason"]
        assert len(w._unacked) == 1 and len(w._update_items) == 1  # s0's part waits for its ack
    finally:
        w.endpoint.close()


def test_a_server_refuses_routes_to_an_unknown_server_and_fails_only_what_it_cannot_forward() -> None:
    srv = ServerNode("s0", "job", "127.0.0.1:1")
    sent = _recording(srv)
    try:
        srv.master = "master"
        srv.store = ShardStore(table_index([Table("t", (2,))]), [0, 1, 2, 3], 4)
        srv.store.extract([1], "s1")  # shard 1 moved to s1, which is leaving
        srv.dispatch(Message("routes", {"rid": 3, "shard_map": ["s0", "ghost", "s0", "s0"], "gone": ["s1"]},
                             sender="master"))
        assert srv.store.forward == {1: "s1"} and [(to, kind, f.get("about")) for to, kind, f in sent] == [
            ("master", "error", "routes")]
        sent2: Sent = []

        def send(peer: str, kind: str, **fields: Any) -> None:
            if peer == "s1":
                raise RuntimeError("no address for s1")
            sent2.append((peer, kind, fields))

        srv.endpoint.send = send  # type: ignore[method-assign]
        srv.dispatch(Message("get", {"rid": 4, "items": [["t", [0, 1]]]}, sender="w0"))
        [(to, kind, fields)] = sent2
        assert (to, kind, fields["rid"]) == ("w0", "get_reply", 4) and not srv._subs
        assert fields["values"] == [None] and "forwarding to s1, where its shard moved, failed" in fields["errors"][0]
    finally:
        srv.endpoint.close()


class _Registry:
    """A membership whose read of the registrations waits until released (etcd answering late)."""

    started = True
    lost_any = False

    def __init__(self, registrations: dict[str, dict]) -> None:
        import threading

        self.release = threading.Event()
        self.registrations = registrations
        self.reads = 0

    def get_prefix(self, prefix: str) -> dict[str, dict]:
        self.reads += 1
        self.release.wait(10)
        return dict(self.registrations)

    def poll_events(self) -> list:
        return []


def test_routes_naming_a_server_not_known_yet_wait_for_its_registration_and_keep_their_order() -> None:
    """The master's etcd watch may be ahead of the worker's: a server it names is looked up off the
    loop, and the routes (and the routing commands after them, in order) wait for the read."""
    import time

    from litz.runtime.transport import Endpoint

    s9 = Endpoint("s9")
    w, sent = _worker(["s0", "s1", "s0", "s1"])
    w.membership = _Registry({"procs/server/s9": {"id": "s9", "addr": s9.address, "role": "server"}})
    try:
        w.dispatch(Message("routes", {"rid": 5, "shard_map": ["s0", "s9", "s0", "s9"], "gone": ["s1"]},
                           sender="master"))
        w.dispatch(Message("server_lost", {"server": "s9", "shard_map": ["s0"] * 4}, sender="master"))
        assert sent == [] and w.shard_map == ["s0", "s1", "s0", "s1"] and len(w._awaiting) == 2
        w.membership.release.set()
        deadline = time.monotonic() + 10
        while w._awaiting:
            assert time.monotonic() < deadline, "the routes never went on"
            w.poll(20)
        assert w.membership.reads == 1 and "s9" in w.endpoint.peers
        assert w.shard_map == ["s0"] * 4 and w._gone == {"s1", "s9"}  # the routes first, then the loss
        assert sent == [("master", "routes_ack", {"rid": 5})]
    finally:
        w.endpoint.close()
        s9.close()


def test_the_masters_later_messages_wait_behind_its_command_that_waits_for_an_address() -> None:
    """A ``reload_executors`` naming a server not known yet waits for the read of the registrations;
    the ``tasks`` the master sent after it, for the executors it brings, wait behind it, in order
    (they were handled at once and failed: "executor 0 is not hosted by worker w0")."""
    import time

    from litz.runtime.transport import Endpoint

    s9 = Endpoint("s9")
    w = Worker("w0", "job", "127.0.0.1:1")
    sent = _recording(w)
    w.endpoint.peers["master"] = "ipc:///nowhere/master"
    try:
        w.dispatch(_init_worker())
        w.membership = _Registry({"procs/server/s9": {"id": "s9", "addr": s9.address, "role": "server"}})
        w.dispatch(Message("rollback", {"lost": [], "round": 1}, sender="master"))
        w.dispatch(Message("reload_executors", {"executors": [0], "shard_map": ["s9"] * 4, "lost": [], "round": 1},
                           sender="master"))
        w.dispatch(Message("tasks", {"tasks": [[5, 0, 0, None]]}, sender="master"))
        assert len(w._awaiting) == 2 and w.tasks_failed == 0
        w.membership.release.set()
        deadline = time.monotonic() + 10
        while w._awaiting or not any(kind == "done" for _, kind, _ in sent):
            assert time.monotonic() < deadline, f"the reload and its task never went on: {sent}"
            w.poll(20)
            w._run_runnable()  # (what the worker's loop does between polls)
            w.flush()
        assert w.tasks_failed == 0 and w.slots[0].executor.state == 1
        [done] = [f for _, kind, f in sent if kind == "done"]
        assert [list(c) for c in done["completed"]] == [[5, 1]] and not done["failed"], done
    finally:
        w.endpoint.close()
        s9.close()


def test_the_master_stops_the_job_when_a_process_refuses_its_routes() -> None:
    """A refused ``routes`` or ``server_lost`` leaves requests routed where they would wait for ever
    (and a scale-in waiting for the routes' acknowledgement): the job stops, saying why."""
    import pytest

    from litz.errors import LitzError
    from litz.runtime.master import Master, MasterState

    m = object.__new__(Master)
    m.state, m.errors = MasterState(1, ["w0"], ["s0"]), []
    with pytest.raises(LitzError, match="w0 refused the new routes \\(routes\\): it names 'ghost'"):
        m._report_error(Message("error", {"reason": "it names 'ghost'", "about": "routes", "rid": 5}, sender="w0"))


def _master(workers: int = 2, executors: int = 2) -> tuple[Any, Sent]:
    from litz.runtime.master import Master
    from tests import testapps

    m = Master(testapps.migrating_app(tasks=10, executors=executors, move_prob=0.0), "j", None,  # type: ignore[arg-type]
               workers=workers, servers=1, num_executors=executors)
    return m, _recording(m)


def test_only_the_source_of_a_migration_says_ship_ready_and_with_task_ids(caplog) -> None:  # noqa: ANN001
    """A ``ship_ready`` whose task ids were not ints (a list) raised out of the master's loop and
    failed the job; one from a process that is not the migration's source was obeyed. Both are
    dropped now, logged; the source's own is taken, moving only its executors' tasks."""
    from litz.runtime.master import MasterState

    m, sent = _master()
    try:
        st = m.state = MasterState(3, ["w0", "w1", "w2"], ["s0"])  # executor i on wi
        queued, other = st.dispatch(0, "queued"), st.dispatch(2, "other")
        st.take_outbox()
        [(mid, _, _)] = st.start_migration([0], "w1")
        m.on_ship_ready(Message("ship_ready", {"mid": mid, "tasks": [[1]]}, sender="w1"))
        m.on_ship_ready(Message("ship_ready", {"mid": mid, "tasks": [queued]}, sender="w1"))
        m.on_ship_ready(Message("ship_ready", {"mid": mid, "tasks": [[queued], "x"]}, sender="w0"))
        assert sent == [] and st.inflight[queued].worker == "w0"
        assert f"ship_ready for migration {mid} from w1, which is not its source w0; dropped" in caplog.text
        assert "names malformed task ids [[" in caplog.text
        m.on_ship_ready(Message("ship_ready", {"mid": mid, "tasks": [queued, other]}, sender="w0"))
        assert sent == [("w0", "ship", {"mid": mid})]
        assert st.inflight[queued].worker == "w1" and st.inflight[other].worker == "w2"
        assert f"names tasks [{other}], which are not of its executors [0]" in caplog.text
    finally:
        m.endpoint.close()


def test_only_the_destination_says_a_migration_arrived(caplog) -> None:  # noqa: ANN001
    """``migrated`` and ``shards_moved`` from a process that is not the migration's destination
    ended the migration: the master placed the executors (or routed the shards) where they were
    not yet. They are dropped now, logged; the destination's own ends it."""
    from litz.runtime.master import MasterState

    m, _ = _master()
    try:
        st = m.state = MasterState(3, ["w0", "w1", "w2"], ["s0", "s1"], num_shards=4)
        [(mid, _, _)] = st.start_migration([0], "w1")
        [(smid, _, _)] = st.start_shard_migration([0], "s1")
        for sender in ("w2", "w0"):
            m._handle_aside(Message("migrated", {"mid": mid, "executors": [0]}, sender=sender))
        m._handle_aside(Message("shards_moved", {"mid": smid, "shards": [0]}, sender="s0"))
        assert mid in st.migrations and smid in st.shard_migrations and st.placement[0] == "w0"
        assert f"migrated message for migration {mid} from w2, which is not its destination w1" in caplog.text
        assert f"shards_moved for migration {smid} from s0, which is not its destination s1" in caplog.text
        m._handle_aside(Message("migrated", {"mid": mid, "executors": [0]}, sender="w1"))
        m._handle_aside(Message("shards_moved", {"mid": smid, "shards": [0]}, sender="s1"))
        assert not st.migrations and not st.shard_migrations and st.placement[0] == "w1" and st.shard_map[0] == "s1"
    finally:
        m.endpoint.close()


def test_executors_come_only_from_the_source_they_name(caplog) -> None:  # noqa: ANN001
    """An ``executor_state`` whose sender is not the source it names is not the move: dropped,
    logged, nothing hosted (before, any peer's was hosted)."""
    w, sent = _worker(["s0"] * 4)
    try:
        w.dispatch(Message("executor_state", {"mid": 3, "executors": [], "source": "w1"}, sender="w5"))
        assert sent == [] and not w.slots and 3 not in w._mids_in
        assert "refused executors of migration 3 from w5, which names 'w1' as their source" in caplog.text
    finally:
        w.endpoint.close()


def test_the_master_takes_a_tasks_report_only_from_the_worker_running_it(caplog) -> None:  # noqa: ANN001
    """Any process's ``done`` for a task in flight was taken (its driver counted a result the task
    never produced). Only the worker the task went to, or the one its executor is on now (a late
    task forwarded after its executor), may report it; others are logged and dropped."""
    from litz.api import Driver
    from litz.runtime.master import MasterState

    class _Keep(Driver):
        def __init__(self) -> None:
            self.done: list[tuple[int, Any]] = []
            self.failed: list[int] = []

        def handle_task_completion(self, result: Any) -> None:
            self.done.append((result.task_id, result.value))

        def handle_task_failure(self, failure: Any) -> None:
            self.failed.append(failure.task_id)

    m, _ = _master()
    try:
        st = m.state = MasterState(2, ["w0", "w1"], ["s0"])  # executor 0 on w0, 1 on w1
        a, b, c = st.dispatch(0, "a"), st.dispatch(1, "b"), st.dispatch(0, "c")
        d = _Keep()
        d._finished = False
        m._on_done(d, Message("done", {"completed": [[a, "forged"]], "failed": [[c, "forged"]]}, sender="w1"))
        m._on_done(d, Message("done", {"completed": [[b, "forged"]], "failed": []}, sender="stray"))
        assert d.done == [] and d.failed == [] and sorted(st.inflight) == [a, b, c]
        assert f"w1 reported completed task {a}, which runs on w0 (its executor 0 is on w0); dropped" in caplog.text
        assert f"stray reported completed task {b}, which runs on w1" in caplog.text
        m._on_done(d, Message("done", {"completed": [[a, 1], [b, 2]], "failed": []}, sender="w0"))
        assert d.done == [(a, 1)]
        st.placement[0] = "w1"  # executor 0 moved to w1, and task c, forwarded after it, ran there
        m._on_done(d, Message("done", {"completed": [[b, 2], [c, 3]], "failed": []}, sender="w1"))
        assert d.done == [(a, 1), (b, 2), (c, 3)] and not st.inflight
    finally:
        m.endpoint.close()


def test_moving_shards_is_all_or_nothing() -> None:
    """``extract([0, 3])`` with shard 3 not hosted took shard 0 out, then raised: its rows were lost.
    Every shard is checked first now, and a server refuses a move to a process it cannot reach."""
    import pytest

    from litz.errors import TableError

    store = ShardStore(table_index([Table("t", (2,))]), [0, 1], 4)
    store.update("t", [0, 4, 1], np.ones((3, 2)))
    for shards, why in [([0, 3], r"3\]? (is )?not on this server"), ([0, 0], "some named twice"),
                        ([0, "1"], r"\['1'\] not on this server")]:
        with pytest.raises(TableError, match=why):
            store.extract(shards, "s1")
        assert sorted(store.shards) == [0, 1] and not store.forward
        np.testing.assert_array_equal(store.get("t", [0, 4, 1]), np.ones((3, 2)))
    srv = ServerNode("s0", "job", "127.0.0.1:1")
    sent = _recording(srv)
    try:
        srv.master, srv.store = "master", store
        srv.dispatch(Message("migrate_shards", {"mid": 4, "shards": [0, 3], "dest": "s1"}, sender="master"))
        srv.endpoint.peers["s1"] = "ipc:///nowhere/s1"
        srv.dispatch(Message("migrate_shards", {"mid": 5, "shards": [0, 3], "dest": "s1"}, sender="master"))
        assert [(to, kind, f["about"]) for to, kind, f in sent] == [("master", "error", "migrate_shards")] * 2
        assert "migration 4 to 's1': no address known for it" in sent[0][2]["reason"]
        assert "[3] not on this server" in sent[1][2]["reason"]
        assert sorted(store.shards) == [0, 1] and not store.forward
        srv.dispatch(Message("migrate_shards", {"mid": 6, "shards": [0], "dest": "s1"}, sender="master"))
        assert sent[-1][:2] == ("s1", "shard_data") and sorted(store.shards) == [1] and store.forward == {0: "s1"}
    finally:
        srv.endpoint.close()


def test_a_malformed_task_fails_alone_and_the_rest_of_its_message_runs() -> None:
    """A malformed item in a ``tasks`` message raised and dropped the rest of the message, whose
    tasks then stayed in flight for ever. The good ones run now; a bad one is reported as its task's
    failure, naming it, or, without a readable task id, as an error naming the message."""
    w, sent = _worker(["s0"] * 4)
    w.app, w.num_executors = {"executor": _Counter, "config": {}}, 2
    try:
        from litz.runtime.worker import Slot

        for eid in (0, 1):
            w.slots[eid] = Slot(w._make_executor(eid))
        w.dispatch(Message("tasks", {"tasks": [[1, 0, 0, "a"], [2, 1, 0], "junk", [3, 1, "v", None],
                                               [4, 1, 0, "c"]]}, sender="master"))
        w._run_runnable()
        w.flush()
        done = [f for to, kind, f in sent if kind == "done"]
        assert [c[0] for f in done for c in f["completed"]] == [1, 4]
        failed = {t: why for f in done for t, why in f["failed"]}
        assert sorted(failed) == [2, 3] and "item 1 of a tasks message from master is not [task id" in failed[2]
        assert "task 3 cannot run on worker w0: item 3 " in failed[3]
        [error] = [f for to, kind, f in sent if kind == "error"]
        assert error["about"] == "tasks" and "item 2 of a tasks message from master" in error["reason"]
        assert "no task id can be read in it" in error["reason"]
    finally:
        w.endpoint.close()


def test_a_task_sent_twice_runs_once_and_one_shipped_away_may_come_back(caplog) -> None:  # noqa: ANN001
    """The same task id sent twice (in one message, or again later) ran twice, its updates counted
    twice. It runs once now, the others logged. A task shipped away with its executor is forgotten:
    it may come back with it (or be forwarded back), and then runs here."""
    from litz.runtime.protocol import pack_object
    from litz.runtime.worker import Slot, Task

    w, sent = _worker(["s0"] * 4, peers=("s0", "w1"))
    w.app, w.num_executors = {"executor": _Counter, "config": {}}, 2
    try:
        w.slots[0] = Slot(w._make_executor(0))
        w.dispatch(Message("tasks", {"tasks": [[10, 0, 0, "x"], [10, 0, 0, "x"]]}, sender="master"))
        w.dispatch(Message("tasks", {"tasks": [[10, 0, 0, "x"]]}, sender="master"))
        w._run_runnable()
        w.dispatch(Message("tasks", {"tasks": [[10, 0, 0, "x"], [11, 0, 0, "y"]]}, sender="master"))
        w._run_runnable()
        w.flush()
        assert [c for _, kind, f in sent if kind == "done" for c in f["completed"]] == [[10, 1], [11, 2]]
        assert "refused task 10 for executor 0 from master: it is queued, running or ran here already" in caplog.text
        # executor 0 leaves with task 12 queued; the task may come back here (forwarded back, or with it)
        w.slots[0].queue.append(Task(12, 0, 0, "z"))
        w._new_task(12, 0, "master")
        w.dispatch(Message("migrate_out", {"mid": 1, "executors": [0], "dest": "w1", "ship_input": False},
                           sender="master"))
        w.dispatch(Message("ship", {"mid": 1}, sender="master"))
        [shipped] = [f for to, kind, f in sent if kind == "executor_state"]
        assert [t[0] for t in shipped["executors"][0][3]] == [12]
        w.dispatch(Message("executor_state", {"mid": 2, "source": "w1", "executors": [
            [0, pack_object(5), None, [[12, 0, 0, "z"]], None, []]]}, sender="w1"))
        w._run_runnable()
        w.flush()
        assert [c for _, kind, f in sent if kind == "done" for c in f["completed"]][-1] == [12, 6]
    finally:
        w.endpoint.close()


def test_executors_or_shards_that_arrive_twice_are_refused(caplog) -> None:  # noqa: ANN001
    """An ``executor_state`` naming an executor hosted here replaced it (state and queued tasks
    lost); a ``shard_data`` sent again put back rows updated since. Both are refused now: a
    migration that arrived already is logged, one bringing what is hosted here is told to the master."""
    from litz.runtime.protocol import pack_object
    from litz.runtime.worker import Slot

    w, sent = _worker(["s0"] * 4, peers=("s0", "w1"))
    w.app, w.num_executors = {"executor": _Counter, "config": {}}, 2
    try:
        w.slots[0] = Slot(ex := w._make_executor(0))
        ex.state = 3
        state = [1, pack_object(7), None, [], None, []]
        w.dispatch(Message("executor_state", {"mid": 1, "source": "w1", "executors": [state]}, sender="w1"))
        w.dispatch(Message("executor_state", {"mid": 1, "source": "w1", "executors": [state]}, sender="w1"))
        w.dispatch(Message("executor_state", {"mid": 2, "source": "w1", "executors": [[0, *state[1:]]]},
                           sender="w1"))
        assert [(to, kind) for to, kind, _ in sent] == [("master", "migrated"), ("master", "error")]
        assert sent[1][2]["about"] == "executor_state" and "executors [0] run here already" in sent[1][2]["reason"]
        assert w.slots[0].executor is ex and ex.state == 3 and w.slots[1].executor.state == 7
        assert "refused executors [1] of migration 1 from w1: it arrived already" in caplog.text
    finally:
        w.endpoint.close()
    srv = ServerNode("s1", "job", "127.0.0.1:1")
    sent = _recording(srv)
    try:
        srv.master, srv.store = "master", ShardStore(table_index([Table("t", (2,))]), [0], 4)
        data = {"mid": 4, "shards": [1], "data": [["t", 1, [1], np.full((1, 2), 10.0)]], "source": "s0"}
        srv.dispatch(Message("shard_data", data, sender="s0"))
        srv.dispatch(Message("update", {"rid": 1, "items": [["t", [1], np.ones((1, 2))]], "low": 1}, sender="w0"))
        srv.dispatch(Message("shard_data", data, sender="s0"))
        srv.dispatch(Message("shard_data", {**data, "mid": 5}, sender="s0"))
        np.testing.assert_array_equal(srv.store.get("t", [1]), np.full((1, 2), 11.0))
        assert [(to, kind) for to, kind, _ in sent] == [("master", "shards_moved"), ("w0", "update_ack"),
                                                        ("master", "error")]
        assert sent[2][2]["about"] == "shard_data"
        assert "migration 5 from s0: shards [1] are hosted" in sent[2][2]["reason"]
        assert "refused shards [1] of migration 4 from s0: they arrived already" in caplog.text
    finally:
        srv.endpoint.close()


def test_an_update_sent_again_after_it_was_answered_is_refused_but_a_resend_with_origin_is_not() -> None:
    """An update that came again after its sender's ``low`` had passed its rid was applied again:
    ``AppliedOnce`` had pruned what it applied. It is refused now (answered with an error, so that
    nothing waits). Updates that carry an ``origin`` (sent again after a server's loss, or
    forwarded) are ``AppliedOnce``'s to judge, whatever their rid: never refused."""
    srv = ServerNode("s1", "job", "127.0.0.1:1")
    sent = _recording(srv)
    one = np.ones((1, 2))
    try:
        srv.master, srv.store = "master", ShardStore(table_index([Table("t", (2,))]), [0, 1, 2, 3], 4)
        srv.dispatch(Message("update", {"rid": 4, "items": [["t", [0], one]], "low": 4}, sender="w0"))
        srv.dispatch(Message("update", {"rid": 4, "items": [["t", [0], one]], "low": 4}, sender="w0"))  # at once:
        # skipped by AppliedOnce, which remembers (w0, 4) until a later low passes it (rid 7's, pruning it)
        srv.dispatch(Message("update", {"rid": 7, "items": [["t", [1], one]], "low": 5}, sender="w0"))
        srv.dispatch(Message("update", {"rid": 4, "items": [["t", [0], one]], "low": 4}, sender="w0"))
        assert sent[-1][1] == "error" and sent[-1][2]["rid"] == 4 and sent[-1][2]["about"] == "update"
        assert "refused update 4 from w0: it was answered already" in sent[-1][2]["reason"]
        # update 5 went to s0, which forwarded key 2 here and died; w0 sends it again (rid 8, origin 5)
        srv.dispatch(Message("update", {"rid": 9, "items": [["t", [2], one]], "origin": ["w0", 5, 5]}, sender="s0"))
        srv.dispatch(Message("update", {"rid": 8, "items": [["t", [2, 3], np.ones((2, 2))]], "origin": ["w0", 5, 5]},
                             sender="w0"))
        assert [kind for _, kind, _ in sent[-2:]] == ["update_ack", "update_ack"]
        np.testing.assert_array_equal(srv.store.get("t", [0, 1, 2, 3]), np.ones((4, 2)))
    finally:
        srv.endpoint.close()


def test_a_malformed_read_reply_fails_the_tasks_waiting_for_it_naming_what_is_wrong() -> None:
    """A worker's ``get_reply`` forgot its request, then raised part-way when it was short, held rows
    of the wrong shape or dtype, or a list, or a hint of a shard out of range: the tasks waiting
    for it blocked for ever. Checked first now: the waiting tasks fail, naming the server, the
    request, the table and the key; a bad hint alone is ignored."""
    w, sent = _worker(["s0"] * 4)
    try:
        cases = {1: dict(values=[], errors=[]), 2: dict(values=[np.ones((1, 7), np.float32)], errors=[None]),
                 3: dict(values=[np.ones((1, 2), np.int64)], errors=[None]), 4: dict(values=[[[1.0, 2.0]]],
                                                                                    errors=[None])}
        for key, fields in cases.items():
            wait = _waiting(w, "t", key)
            w._send_fetches()
            rid = sent[-1][2]["rid"]
            w.dispatch(Message("get_reply", {"rid": rid, **fields}, sender="s0"))
            assert wait.resumed and f"fetch of table 't' key {key} from s0 (request {rid}) failed" in wait.error
            assert not w._fetching and not w._sent_to
        assert "its reply gave list [[1.0, 2.0]] for 1 rows of shape (2,) and dtype float32" in wait.error
        wait = _waiting(w, "t", 5)
        w._send_fetches()
        rid = sent[-1][2]["rid"]
        w.dispatch(Message("get_reply", {"rid": rid, "values": [np.ones((1, 2), np.float32)], "errors": [None],
                                         "moved": {1000: "s0", 1: 7}}, sender="s0"))
        assert wait.resumed and wait.error is None and wait.values[5].tolist() == [1.0, 1.0]
        assert w.shard_map == ["s0"] * 4 and not w._fetching
    finally:
        w.endpoint.close()


def test_a_server_passes_on_a_malformed_or_stray_answer_to_a_forward_as_an_error() -> None:
    """A server waiting for the answer to a part it forwarded took the entry out, then raised on a
    short answer or rows of the wrong shape: the original requester was never answered. An answer
    from a process it did not ask was taken. Now a stray answer is dropped, and a malformed one
    fails its items, naming the server, the request, the table and the keys."""
    srv = ServerNode("s0", "job", "127.0.0.1:1")
    sent = _recording(srv)
    try:
        srv.master, srv.store = "master", ShardStore(table_index([Table("t", (2,))]), [0, 1, 2, 3], 4)
        srv.store.extract([1], "s1")
        for n, answer in enumerate([{"values": [], "errors": []},
                                    {"values": [np.ones((1, 7), np.float32)], "errors": [None]},
                                    {"values": [np.ones((2, 2), np.float64)], "errors": [None]}]):
            srv.dispatch(Message("get", {"rid": 100 + n, "items": [["t", [0, 1, 5]]]}, sender="w0"))
            to, kind, sub = sent[-1]
            assert (to, kind) == ("s1", "get")
            srv.dispatch(Message("get_reply", {"rid": sub["rid"], "values": [np.full((2, 2), 6.0, np.float32)],
                                               "errors": [None]}, sender="s2"))
            assert sent[-1][1] == "get" and sub["rid"] in srv._subs  # a stray answer: dropped
            srv.dispatch(Message("get_reply", {"rid": sub["rid"], **answer}, sender="s1"))
            to, kind, reply = sent[-1]
            assert (to, kind, reply["rid"]) == ("w0", "get_reply", 100 + n) and not srv._subs
            assert reply["values"] == [None] and f"table 't' keys [1, 5]: forwarded to s1 as request {sub['rid']}, " \
                "its reply was malformed" in reply["errors"][0]
        srv.dispatch(Message("update", {"rid": 200, "items": [["t", [1], np.ones((1, 2))]], "low": 200}, sender="w0"))
        srv.dispatch(Message("update_ack", {"rid": sent[-1][2]["rid"], "errors": []}, sender="s1"))
        assert sent[-1][:2] == ("w0", "update_ack") and "0 errors for 1 items" in sent[-1][2]["errors"][0]
    finally:
        srv.endpoint.close()


def test_shard_data_is_checked_whole_before_any_row_is_installed() -> None:
    """``shard_data`` installed rows unchecked (a (1,) int8 row in a (3,) float64 table) and part-way
    (a malformed second entry raised after the first was in). Every entry is checked first now,
    as an update's rows are; a bad one refuses the whole migration, telling the master its id."""
    def server() -> tuple[ServerNode, Sent]:
        srv = ServerNode("s1", "job", "127.0.0.1:1")
        sent = _recording(srv)
        srv.master, srv.store = "master", ShardStore(table_index([Table("s", (3,), "float64")]), [0], 4)
        return srv, sent

    bad = [
        ({"shards": [1], "data": [["s", 1, [1, 5], np.array([[7], [9]], np.int8)]]},
         "has shape (2, 1), expected (2, 3)"),
        ({"shards": [3], "data": [["s", 3, [3], np.full((1, 3), 5.0)], ["s", 3]]}, "a rows entry is not 4 fields"),
        ({"shards": [1], "data": [["s", 1, [2], np.ones((1, 3))]]}, "keys [2] are not of shard 1"),
        ({"shards": [1], "data": [["zz", 1, [1], np.ones((1, 3))]]}, "unknown table 'zz'"),
        ({"shards": [1], "data": [["s", 1, [1], np.ones((1, 3), complex)]]}, "cannot be cast to the table's float64"),
        ({"shards": [1, 1], "data": []}, "are not distinct shards"),
        ({"shards": [1], "data": [], "staged": [[1, "s", 2, 2, None, None]]},
         "an undo entry of table 's' is malformed"),
    ]
    for mid, (fields, why) in enumerate(bad, start=1):
        srv, sent = server()
        try:
            srv.dispatch(Message("shard_data", {"mid": mid, "source": "s0", **fields}, sender="s0"))
            [(to, kind, error)] = sent
            assert (to, kind, error["about"]) == ("master", "error", "shard_data"), sent
            assert f"refused the shards {fields['shards']!r} of migration {mid} from s0" in error["reason"]
            assert why in error["reason"], error["reason"]
            assert srv.store is not None and sorted(srv.store.shards) == [0] and srv.store.snapshot("s") == {}
        finally:
            srv.endpoint.close()
    srv, sent = server()
    try:
        srv.dispatch(Message("shard_data", {"mid": 9, "source": "s0", "shards": [1], "data": [
            ["s", 1, [1, 5], np.array([[1, 2, 3], [4, 5, 6]], np.int32)]]}, sender="s0"))
        assert sent == [("master", "shards_moved", {"mid": 9, "shards": [1]})]
        np.testing.assert_array_equal(srv.store.get("s", [1, 5]), [[1, 2, 3], [4, 5, 6]])
        assert srv.store.get("s", [1]).dtype == np.float64
    finally:
        srv.endpoint.close()


def test_recent_ids_refuse_what_came_already_and_forget_only_what_is_oldest() -> None:
    """``RecentIds`` (a worker's task ids, a worker's and a server's migrations): an id taken twice
    is refused; one forgotten (a task shipped away) may come again, and stays known until its
    newest taking is among the oldest. A set beside the order dropped it at its first taking's
    turn, while the task it came back as was still queued: a duplicate of it then ran."""
    from litz.runtime.node import RecentIds

    ids = RecentIds(3)
    assert ids.take(1) and not ids.take(1) and 1 in ids
    ids.forget(1)
    assert 1 not in ids and ids.take(1)  # shipped away, back again: known
    assert ids.take(2) and ids.take(3)  # the first taking of 1 is the oldest now, and goes
    assert 1 in ids and not ids.take(1)  # (its second taking is still among the last 3)
    assert ids.take(4) and ids.take(5)
    assert 1 not in ids and 2 not in ids and {3, 4, 5} <= {i for i in range(6) if i in ids}
    ids.clear()
    assert 5 not in ids and ids.take(5)
