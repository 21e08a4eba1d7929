"""Socket-free tests of what a buggy (but authenticated) peer of a job may send: every refusal names
what is wrong and loses nothing (tables, executors and tasks stay as they were; nothing dies, and
nothing waits for ever)."""

from __future__ import annotations

from typing import Any

import cloudpickle
import numpy as np

import litz
from litz.ps.server import ServerNode
from litz.ps.tables import Table
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
