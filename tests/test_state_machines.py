"""Socket-free tests of the protocol, tables, cache, update log, shard store, master and schedulers."""

from __future__ import annotations

import copy
import random
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from litz.api import TaskFailure, TaskResult
from litz.errors import ConfigError, EtcdUnreachable, LitzError, ProtocolError, TableError
from litz.ps.cache import ProcessCache
from litz.ps.server import ShardStore
from litz.ps.tables import Combiner, Table, shard_of, table_index
from litz.ps.update_log import UpdateLog
from litz.runtime import protocol
from litz.runtime.master import MasterState
from litz.schedulers import BlockRotation, SSPDriver

# -- protocol -------------------------------------------------------------------------------------


def test_protocol_round_trip_with_zero_copy_arrays() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int64)[::2]  # not contiguous: sent as a copy
    frames = protocol.encode("update", rid=7, items=[["W", [1, "k"], a], ["V", (1, 2), b]])
    assert len(frames) == 3 and frames[1] is a  # the array itself is a frame: no copy
    msg = protocol.decode([bytes(memoryview(f)) for f in frames], sender="w0")
    assert msg.type == "update" and msg.sender == "w0" and msg["rid"] == 7
    (t1, k1, v1), (t2, k2, v2) = msg["items"]
    assert (t1, k1, t2, k2) == ("W", [1, "k"], "V", (1, 2))
    np.testing.assert_array_equal(v1, a)
    np.testing.assert_array_equal(v2, [0, 2, 4])
    assert v1.dtype == np.float32 and v2.dtype == np.int64


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([b"\xc1garbage"], "undecodable header"),
        ([msgpack.packb(["nope", {}])], "unknown message type 'nope'"),
        ([msgpack.packb(["get", {"rid": 1}])], "lacks field 'items'"),
        ([msgpack.packb(["get", {"rid": "x", "items": []}])], "field 'rid' should be int"),
        ([msgpack.packb([1, 2, 3])], "header is not [type, fields]"),
        ([], "empty message"),
        ([msgpack.packb(["get", {"rid": 1, "items": msgpack.ExtType(1, msgpack.packb(["<f4", [2], 5]))}])],
         "missing frame"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        protocol.decode(frames)


class _MakesADirectory:
    """Unpickled, it makes a directory: a stand-in for code a message could carry."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        import os
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("layout", ["fixstr", "str8", "array16"])
def test_a_message_of_an_unknown_type_is_refused_before_any_field_is_unpickled(tmp_path, layout: str) -> None:
    """Fields may hold pickles (task arguments, states): a message no process ever takes is refused
    from its header's first bytes, and nothing in it runs. Before, its fields were decoded, pickles
    included, and only then was the type looked up. A header laid out otherwise than ``encode``
    makes it (here as a msgpack array16) is refused as malformed, also without running anything."""
    import cloudpickle

    path = tmp_path / "ran"
    payload = msgpack.ExtType(protocol._EXT_PICKLE, cloudpickle.dumps(_MakesADirectory(str(path))))
    if layout == "fixstr":
        header = msgpack.packb(["no_such_type", {"x": payload}])
    elif layout == "str8":
        header = msgpack.packb(["n" * 40, {"x": payload}])  # a name of 32 bytes or more: str8
    else:
        header = b"\xdc\x00\x02" + msgpack.packb("update") + msgpack.packb({"rid": 1, "items": payload})
    with pytest.raises(ProtocolError, match="unknown message type|not laid out as Litz encodes one"):
        protocol.decode([header])
    assert not path.exists()
    ok = msgpack.packb(["update", {"rid": 1, "items": [payload]}])  # a declared type: decoded as before
    protocol.decode([ok])
    assert path.exists()


def test_encoding_checks_declared_fields() -> None:
    with pytest.raises(ProtocolError, match="unknown message type"):
        protocol.encode("no_such_message")
    with pytest.raises(ProtocolError, match="lacks field"):
        protocol.encode("get", rid=1)


def test_every_python_value_travels_or_fails_alone() -> None:
    """Object and structured arrays are pickled (a raw frame of pointers did not load anywhere, and
    a structured array lost its fields); any ``str`` travels, lone surrogates too; a pickled value
    that does not load here becomes an ``Undecodable`` in ``tasks`` and ``done`` messages, whose
    receiver fails that one task, and makes any other message malformed. Before, each of these
    dropped the whole message (every task or completion in it)."""
    import cloudpickle

    objects = np.array([{"a": 1}, None], dtype=object)
    records = np.array([(1, 2.5)], dtype=[("i", "i4"), ("x", "f8")])
    msg = protocol.decode(protocol.encode("done", completed=[[1, objects], [2, records], [3, "x\udcff"]], failed=[]))
    (_, o), (_, r), (_, t) = msg["completed"]
    assert o.tolist() == [{"a": 1}, None] and r.dtype.names == ("i", "x") and t == "x\udcff"

    class LoadsNowhere:
        def __reduce__(self) -> tuple:
            return int, ("n/a",)

    frames = protocol.encode("done", completed=[[1, 5], [2, [LoadsNowhere()]]], failed=[])
    msg = protocol.decode(frames)
    assert msg["completed"][0] == [1, 5] and "ValueError" in msg.undecodable[0]
    bad = protocol.undecodable_in(msg["completed"][1][1])
    assert isinstance(bad, protocol.Undecodable) and "invalid literal" in bad.error
    assert protocol.undecodable_in({"k": (1, [2, {"v": bad}])}) is bad and protocol.undecodable_in([1, "a"]) is None
    with pytest.raises(ProtocolError, match="a pickled value of a 'stats' message does not load here"):
        protocol.decode(protocol.encode("stats", rid=1, stats={"x": LoadsNowhere()}))
    assert cloudpickle.loads(cloudpickle.dumps(bad)).error == bad.error  # forwarded on, still itself


def test_values_arrive_with_their_types() -> None:
    """A namedtuple arrived as a plain tuple, a tuple in a tuple as a list, a masked array without
    its mask, and a datetime64 or complex scalar failed the whole message (msgpack refused their
    ``item()``): all arrive as sent now. Plain arrays still travel as raw frames, and NumPy scalars
    as plain Python numbers."""
    import collections

    Point = collections.namedtuple("Point", "x y")
    masked = np.ma.masked_array([1.0, 2.0], mask=[True, False])
    values = [Point(1, 2), masked, np.datetime64("2020-01-02"), np.complex128(1 + 2j), np.float32(0.5),
              np.int64(7), (1, (2, 3)), np.arange(3)]
    frames = protocol.encode("done", completed=[[i, v] for i, v in enumerate(values)], failed=[])
    assert len(frames) == 2  # the header and the plain array's raw frame; the masked array is pickled
    got = [v for _, v in protocol.decode(frames)["completed"]]
    assert type(got[0]) is Point and got[0] == (1, 2)
    assert isinstance(got[1], np.ma.MaskedArray) and got[1].mask.tolist() == [True, False]
    assert got[2] == np.datetime64("2020-01-02") and got[3] == 1 + 2j
    assert type(got[4]) is float and type(got[5]) is int and got[6] == (1, (2, 3))
    assert type(got[7]) is np.ndarray and got[7].tolist() == [0, 1, 2]


@pytest.mark.parametrize("kind,reply", [("get", "get_reply"), ("update", "update_ack")])
def test_a_reply_with_a_hint_is_used_when_etcd_cannot_name_the_new_owner(kind: str, reply: str) -> None:
    """Worker w0 fetches key 1 through s0; shard 1 moved to s1, which w0 does not know yet. s0
    forwards, s1 answers, s0 replies with moved={1: s1}. Resolving s1's address in etcd fails
    (an etcd outage): before, the whole reply was discarded (the error escaped ``_learn_moves``
    before the values were used) and nothing sent the request again, so its task waited for ever.
    Now the hint is skipped: the route stays through s0, which forwards."""
    from litz.ps.server import ServerNode
    from litz.ps.tables import table_index
    from litz.runtime.protocol import Message, decode
    from litz.runtime.worker import Worker
    from tests.conftest import wire_without_sockets

    tables = [Table("t", (2,))]
    s0, s1 = ServerNode("s0", "job", "127.0.0.1:1"), ServerNode("s1", "job", "127.0.0.1:1")
    w0 = Worker("w0", "job", "127.0.0.1:1")
    nodes = {n.ident: n for n in (s0, s1, w0)}
    sent = wire_without_sockets(nodes.values())

    def deliver(kind: str, to: str) -> None:
        k = next(k for k, (_, peer, kind_, _) in enumerate(sent) if kind_ == kind and peer == to)
        who, _, _, frames = sent.pop(k)
        nodes[to].dispatch(decode(frames, sender=who))

    def etcd_down(key: str) -> None:
        raise EtcdUnreachable("etcd did not answer within 5 s")

    try:
        s0.store = ShardStore(table_index(tables), [0, 1], 2, keeps_saved=False)
        s1.store = ShardStore(table_index(tables), [], 2, keeps_saved=False)
        s0.dispatch(Message("migrate_shards", {"mid": 1, "shards": [1], "dest": "s1"}, sender="master"))
        deliver("shard_data", "s1")
        w0.tables, w0.num_shards, w0.shard_map = table_index(tables), 2, ["s0", "s0"]
        w0.membership.get = etcd_down
        if kind == "get":
            w0._queue_fetches("t", [1], 0)
            w0._send_fetches()
        else:
            w0._send_updates({"t": ([1], [np.ones(2)])})
        deliver(kind, "s0")
        deliver(kind, "s1")
        deliver(reply, "s0")
        deliver(reply, "w0")
        assert not w0._fetching and not w0._unacked, \
            f"{reply} discarded; fetching={list(w0._fetching)} unacked={w0._unacked} wait for ever"
        assert w0.shard_map == ["s0", "s0"]  # no address for s1: sending there would fail
    finally:
        for n in nodes.values():
            n.endpoint.close()


def test_a_hint_naming_an_unknown_server_is_looked_up_off_the_loop_and_once() -> None:
    """A reply's hint names a server the worker does not know yet: its registration is read on a
    thread, not on the loop (an etcd read held the loop, and every task, up to 5 s during an
    outage), the route stays through the old server meanwhile, and a server not found is not
    asked for again at every hint. Once found, the next hint is followed."""
    import threading
    import time

    from litz.runtime.protocol import Message
    from litz.runtime.transport import Endpoint
    from litz.runtime.worker import Worker

    w0 = Worker("w0", "job", "127.0.0.1:1")
    s9 = Endpoint("s9", secret=None)
    asked: list[str] = []
    registered: dict[str, dict] = {}
    slow = threading.Event()

    def get(key: str) -> dict | None:
        asked.append(key)
        slow.wait(2.0)  # an etcd that does not answer at once
        return registered.get(key)

    w0.membership.get = get  # type: ignore[method-assign]

    def hint(rid: int) -> None:
        w0._sent_to[rid] = "s0"
        started = time.monotonic()
        w0._learn_moves(Message("get_reply", {"rid": rid, "values": [], "errors": [], "moved": {"1": "s9"}},
                                sender="s0"))
        assert time.monotonic() - started < 0.5, "the look-up held the loop"

    def settle() -> None:
        deadline = time.monotonic() + 5
        while w0._server_lookups:
            assert time.monotonic() < deadline, "the look-up never ended"
            w0.poll(20)

    try:
        w0.shard_map = ["s0", "s0"]
        hint(1)
        hint(2)  # under way: not asked again
        assert asked == ["procs/server/s9"] and w0.shard_map == ["s0", "s0"]  # the old route forwards
        slow.set()
        settle()
        hint(3)  # not found a moment ago: not asked again yet
        assert asked == ["procs/server/s9"] and w0.shard_map == ["s0", "s0"]
        registered["procs/server/s9"] = {"id": "s9", "addr": s9.address, "role": "server"}
        w0._unknown_servers.clear()  # (as UNKNOWN_SERVER_WAIT later)
        hint(4)
        settle()
        assert "s9" in w0.endpoint.peers
        hint(5)
        assert w0.shard_map == ["s0", "s9"] and len(asked) == 2
    finally:
        w0.endpoint.close()
        s9.close()


def test_a_peer_that_left_leaves_no_socket_behind(monkeypatch) -> None:  # noqa: ANN001
    """Every endpoint kept a DEALER (a file descriptor, and reconnection attempts every 100 ms) for
    every peer that ever left; a long job that scaled in and out grew them without bound. A node
    now closes it once ``DEPARTED_GRACE`` has passed since the peer's registration was deleted.
    Within it, a message to the peer (a lease that ended while its process lives) goes through the
    same socket, after those queued: a new socket of the same identity lost them (refused by the
    peer's ROUTER, or, with an identity handover, the old connection's queue dropped)."""
    from litz.runtime import transport
    from litz.runtime.membership import Event
    from litz.runtime.node import proc_key
    from litz.runtime.transport import Endpoint
    from litz.runtime.worker import Worker

    w0 = Worker("w0", "job", "127.0.0.1:1")
    peers = [Endpoint(f"s{i}", secret=None) for i in range(20)]
    try:
        for p in peers:
            w0.endpoint.connect(p.ident, p.address)
            w0.endpoint.send(p.ident, "stats_request", rid=1)
            assert p.recv() is not None
        for rid in range(2, 2002):  # queued, not yet read by s5
            w0.endpoint.send("s5", "stats_request", rid=rid)
        for p in peers[1:]:
            w0.on_event(Event("delete", proc_key("server", p.ident), None))
        assert list(w0.endpoint._dealers) == ["s0"] and len(w0.endpoint._departed) == 19
        w0.endpoint.send("s5", "stats_request", rid=2002)  # back within the grace
        assert [peers[5].recv()["rid"] for _ in range(2001)] == list(range(2, 2003))
        monkeypatch.setattr(transport, "DEPARTED_GRACE", 0.0)
        w0.on_event(Event("delete", proc_key("server", "s5"), None))
        assert list(w0.endpoint._dealers) == ["s0"] and not w0.endpoint._departed  # all closed
        w0.endpoint.send("s7", "stats_request", rid=9)  # a new socket, long after the old one closed
        assert peers[7].recv()["rid"] == 9
        monkeypatch.setattr(transport, "DEPARTED_GRACE", 3600.0)
        w0.on_event(Event("delete", proc_key("server", "s7"), None))
        w0.endpoint.forget("s0")
        assert sorted(w0.endpoint._departed) == ["s0", "s7"] and not w0.endpoint._dealers
        monkeypatch.setattr(transport, "DEPARTED_GRACE", 0.0)
        w0.poll(0)  # a process that sends nothing more closes them at its next poll
        assert not w0.endpoint._departed
    finally:
        w0.endpoint.close()
        for p in peers:
            p.close()


def test_litz_errors_survive_pickling() -> None:
    """A job run in a process pool hands its exception back pickled: ``TaskError``, ``StartupTimeout``
    and ``KeyHeld`` did not load, ``JobStopped`` came back with a garbled message, ``ProcessLost``
    without its ``ident`` (``LitzError.__reduce__`` rebuilds any subclass without its ``__init__``)."""
    import pickle

    from litz.errors import JobStopped, ProcessLost, TaskError
    from litz.runtime.master import StartupTimeout
    from litz.runtime.membership import KeyHeld

    for exc in (TaskError(3, {"a": 1}, "Traceback ...", "w1"), ProcessLost("s1 died", "s1"),
                JobStopped("j", "/ckpt/ckpt-000002", "SIGTERM"), StartupTimeout("w1 never answered", ["w1"]),
                KeyHeld("agents/h1", {"pid": 7})):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and vars(back) == vars(exc)


# -- tables ---------------------------------------------------------------------------------------


def test_table_checks_keys_shapes_and_dtypes() -> None:
    t = Table("W", (2, 3), "float32", num_rows=4)
    assert t.check_keys(range(4)) == [0, 1, 2, 3]
    with pytest.raises(TableError, match="key 4 out of range"):
        t.check_key(4)
    with pytest.raises(TableError, match="bad key 'a'"):
        t.check_key("a")
    with pytest.raises(TableError, match=r"shape \(3, 2\), expected \(2, 3\)"):
        t.check_delta(np.zeros((3, 2)))
    with pytest.raises(TableError, match="dtype complex128"):
        t.check_delta(np.zeros((2, 3), complex))
    assert t.check_delta(np.ones((2, 3))).dtype == np.float32  # float64 -> float32 is the same kind
    with pytest.raises(TableError, match="declared twice"):
        table_index([t, Table("W", (1,))])


@pytest.mark.parametrize("keys, error", [
    ([3, 0, 2], None), (np.array([1, 3]), None), ([np.int64(2), 1], None), ([], None),
    ([0, 4, 1], "key 4 out of range"), ([1, -1], "key -1 out of range"),
    (np.array([0, 9]), "key 9 out of range"), ([0, True], "key True is a bool"),
    ([1, "a"], "bad key 'a'"), ([1, 2.0], "bad key 2.0"),
])
def test_check_keys_of_many_keys_is_check_key_of_each(keys: object, error: str | None) -> None:
    # lists of plain ints take a one-test path; every other list, and a bad one, goes key by key
    t = Table("W", (2,), num_rows=4)
    if error is None:
        got = t.check_keys(keys)
        assert got == [t.check_key(k) for k in keys] and all(type(k) is int for k in got)
        assert got is not keys  # a new list: the caller's may change later
    else:
        with pytest.raises(TableError, match=error):
            t.check_keys(keys)
    free = Table("F", (2,))  # no num_rows: any int, and strings
    assert free.check_keys([5, -3, 10**12]) == [5, -3, 10**12] and free.check_keys(["x", 1]) == ["x", 1]


def test_int_keys_must_fit_the_int64_a_checkpoint_stores_them_in(tmp_path) -> None:  # noqa: ANN001
    """Without ``num_rows`` any int was accepted, and the first checkpoint after an update of a key
    beyond int64 failed (OverflowError writing its shard file), and every one after it: such a key
    is refused where the others are, naming table and key."""
    from litz.ft import storage

    free = Table("F", (2,))
    edge = [-(2**63), 2**63 - 1]
    assert free.check_keys(edge) == edge and [free.check_key(k) for k in edge] == edge
    fs, root = storage.filesystem(str(tmp_path))  # what is accepted can be checkpointed
    storage.write_shards(fs, f"{root}/s.arrow", [("F", 0, k, np.zeros(2)) for k in edge])
    for bad in (2**63, -(2**63) - 1, np.uint64(2**63 + 5), 10**30):
        with pytest.raises(TableError, match=rf"table 'F': key {int(bad)} does not fit int64"):
            free.check_key(bad)
        with pytest.raises(TableError, match=rf"table 'F': key {int(bad)} does not fit int64"):
            free.check_keys([1, bad])  # the one-test path of plain ints too
    with pytest.raises(TableError, match=r"table 'F': key 9223372036854775808 does not fit int64"):
        free.check_keys(np.array([1, 2**63], np.uint64))
    with pytest.raises(TableError, match=r"table 'N': num_rows 9223372036854775809 is over 2\*\*63"):
        Table("N", (1,), num_rows=2**63 + 1)
    assert Table("N", (1,), num_rows=2**63).check_key(2**63 - 1) == 2**63 - 1


def test_initializers_are_pure_functions_of_the_key() -> None:
    t = Table("E", (5,), init=("normal", 0.1), seed=3)
    np.testing.assert_array_equal(t.initial_row(7), t.initial_row(7))
    assert not np.array_equal(t.initial_row(7), t.initial_row(8))
    assert Table("F", (2,), init=("full", 2.5)).initial_row("x").tolist() == [2.5, 2.5]


def test_shards_are_stable() -> None:
    assert shard_of(130, 64) == 2
    assert shard_of("word", 64) == shard_of("word", 64)


# -- cache ----------------------------------------------------------------------------------------


def test_cache_uses_entries_only_for_versions_it_covers() -> None:
    c = ProcessCache()
    assert c.lookup("t", 1, version=3) is None
    assert c.request("t", 1, 3, "task-a") is True  # first need: fetch
    assert c.request("t", 1, 2, "task-b") is False  # covered by the fetch in flight: coalesced
    assert c.request("t", 1, 5, "task-c") is True  # a newer version needs its own fetch
    woken = c.fill("t", 1, np.array([1.0]), version=3)
    assert sorted(tok for tok, _ in woken) == ["task-a", "task-b"]  # not task-c (needs version 5)
    assert c.lookup("t", 1, 3) is not None and c.lookup("t", 1, 4) is None
    assert [tok for tok, _ in c.fill("t", 1, np.array([2.0]), version=5)] == ["task-c"]
    assert c.lookup("t", 1, 5)[0] == 2.0
    # a late reply of an older fetch never replaces a newer entry
    c.fill("t", 1, np.array([0.0]), version=4)
    assert c.lookup("t", 1, 5)[0] == 2.0
    assert c.fetches == 2 and c.coalesced == 1


def test_disabled_cache_fetches_every_time() -> None:
    c = ProcessCache(enabled=False)
    assert c.request("t", 1, 0, "a") and c.request("t", 1, 0, "b")
    assert [tok for tok, _ in c.fill("t", 1, np.zeros(1), 0)] == ["a"]  # each reply serves one request
    assert [tok for tok, _ in c.fill("t", 1, np.ones(1), 0)] == ["b"]
    assert c.lookup("t", 1, 0) is None
    # replies in another order than their fetches (one forwarded by a shard's old owner, one straight
    # from the new): each serves its own requester. Before, the version-7 reply woke the version-3
    # task, and the version-3 reply then found no task to wake and raised: the other task hung
    assert c.request("t", 2, 3, "v3") and c.request("t", 2, 7, "v7")
    assert [tok for tok, _ in c.fill("t", 2, np.ones(1), 7)] == ["v7"]
    assert [tok for tok, _ in c.fill("t", 2, np.zeros(1), 3)] == ["v3"]


def test_cache_fail_wakes_all_waiters() -> None:
    c = ProcessCache()
    c.request("t", 1, 0, "a")
    c.request("t", 1, 0, "b")
    assert c.fail("t", 1) == ["a", "b"]
    assert c.request("t", 1, 0, "c") is True  # the failed fetch is forgotten


# -- update log -----------------------------------------------------------------------------------


def test_update_log_merges_exactly_with_each_combiner() -> None:
    add = Table("a", (2,), "int64")
    mn = Table("m", (2,), "float64", combiner="min")
    top = Table("k", (3,), "float64", combiner=Combiner.of(lambda a, b: np.sort(np.concatenate([a, b]))[:3]))
    log = UpdateLog()
    rng = np.random.default_rng(0)
    truth = np.zeros((5, 2), np.int64)
    for _ in range(200):
        k = int(rng.integers(5))
        d = rng.integers(-9, 9, 2)
        truth[k] += d
        log.add(add, k, d)
    log.add(mn, "x", np.array([3.0, 1.0]))
    log.add(mn, "x", np.array([2.0, 5.0]))
    log.add(top, 0, np.array([5.0, 6.0, 7.0]))
    log.add(top, 0, np.array([1.0, 6.5, 9.0]))
    assert log.updates_in == 204
    out = log.drain()
    assert not log and log.nbytes == 0
    keys, rows = out["a"]
    got = np.zeros((5, 2), np.int64)
    for k, r in zip(keys, rows, strict=True):
        got[k] = r
    np.testing.assert_array_equal(got, truth)
    assert out["m"][1][0].tolist() == [2.0, 1.0]
    assert out["k"][1][0].tolist() == [1.0, 5.0, 6.0]


def test_update_log_add_many_equals_one_add_at_a_time() -> None:
    # keys repeat within one call and across calls; "assign" makes the order visible
    rng = np.random.default_rng(3)
    for combiner in ("add", "assign", "min"):
        t = Table("t", (3,), "float64", combiner=combiner)
        one, many = UpdateLog(), UpdateLog()
        for _ in range(20):
            keys = rng.integers(0, 6, 7).tolist()
            deltas = rng.normal(size=(7, 3))
            for key, d in zip(keys, deltas, strict=True):
                one.add(t, key, d)
            many.add_many(t, keys, deltas)
        a, b = one.drain()["t"], many.drain()["t"]
        assert dict(zip(*a, strict=True)).keys() == dict(zip(*b, strict=True)).keys()
        for key, row in zip(*a, strict=True):
            np.testing.assert_array_equal(dict(zip(*b, strict=True))[key], row)
        assert one.updates_in == many.updates_in == 140


def test_update_log_add_many_of_new_keys_then_merges() -> None:
    # calls whose keys are all new and distinct, then merges into some of those rows: each merge
    # changes its own row alone, the byte count follows, and the caller's array never changes
    rng = np.random.default_rng(5)
    for combiner in ("add", "assign", "max"):
        t = Table("t", (2, 3), "float32", combiner=combiner)
        one, many = UpdateLog(), UpdateLog()
        for step in range(12):
            n = 10 if step % 3 == 0 else 4
            keys = rng.permutation(16)[:n].tolist()  # distinct; new ones only right after a drain
            deltas = rng.normal(size=(n, 2, 3))
            before = deltas.copy()
            for key, d in zip(keys, deltas, strict=True):
                one.add(t, key, d)
            many.add_many(t, keys, deltas)
            np.testing.assert_array_equal(deltas, before)
            assert one.nbytes == many.nbytes
            if step % 4 == 3:
                a, b = one.drain()["t"], many.drain()["t"]
                assert a[0] == b[0]
                np.testing.assert_array_equal(np.stack(a[1]), np.stack(b[1]))


def test_update_log_absorb_merges_a_tasks_log_exactly() -> None:
    """A task's own log joins the process's: keys new to it are moved, shared keys merge with the
    combiner (in place for the built-ins, through copies for a custom one); counts follow."""
    add = Table("a", (2,), "int64")
    top = Table("k", (3,), "float64", combiner=Combiner.of(lambda a, b: np.sort(np.concatenate([a, b]))[:3]))
    fresh = Table("f", (1,), "float64")
    log, task = UpdateLog(), UpdateLog()
    log.add_many(add, [0, 1], np.array([[1, 2], [3, 4]]))
    log.add(top, 0, np.array([5.0, 6.0, 7.0]))
    task.add_many(add, [1, 2], np.array([[10, 20], [30, 40]]))
    task.add(top, 0, np.array([1.0, 6.5, 9.0]))
    task.add(top, 1, np.array([2.0, 3.0, 4.0]))
    task.add(fresh, "x", np.array([1.5]))
    log.absorb(task)
    assert not task and task.nbytes == 0 and task.updates_in == 0
    assert log.updates_in == 3 + 5 and log.nbytes == 3 * 16 + 2 * 24 + 8
    out = {name: dict(zip(keys, rows, strict=True)) for name, (keys, rows) in log.drain().items()}
    assert {k: v.tolist() for k, v in out["a"].items()} == {0: [1, 2], 1: [13, 24], 2: [30, 40]}
    assert {k: v.tolist() for k, v in out["k"].items()} == {0: [1.0, 5.0, 6.0], 1: [2.0, 3.0, 4.0]}
    assert out["f"]["x"].tolist() == [1.5]


def test_update_log_absorb_is_all_or_nothing_when_a_combiner_raises() -> None:
    """A custom combiner that raises on one shared row: the process's log is exactly as it was
    (no row of any table merged), and the error reaches the caller (the task then fails)."""
    def picky(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if b[0] < 0:
            raise ValueError("negative")
        return a + b

    add = Table("a", (1,), "float64")
    custom = Table("c", (1,), "float64", combiner=Combiner.of(picky))
    log, task = UpdateLog(), UpdateLog()
    log.add_many(add, [0], np.array([[1.0]]))
    log.add_many(custom, [0, 1, 2], np.array([[1.0], [2.0], [3.0]]))
    task.add_many(add, [0, 5], np.array([[10.0], [20.0]]))
    task.add_many(custom, [0, 1, 2, 9], np.array([[1.0], [-1.0], [1.0], [4.0]]))
    before, nbytes = log.nbytes, log.updates_in
    with pytest.raises(ValueError, match="negative"):
        log.absorb(task)
    assert (log.nbytes, log.updates_in) == (before, nbytes)
    out = {name: dict(zip(keys, rows, strict=True)) for name, (keys, rows) in log.drain().items()}
    assert {k: v.tolist() for k, v in out["a"].items()} == {0: [1.0]}
    assert {k: v.tolist() for k, v in out["c"].items()} == {0: [1.0], 1: [2.0], 2: [3.0]}


def test_update_log_absorb_is_all_or_nothing_when_an_atomic_combiner_raises() -> None:
    """An ``atomic`` combiner may raise (before it writes a row of its call): a table merged before
    it must not keep the task's rows. Before, built-in and atomic tables merged in place as they
    came, and a later table's refusal left the earlier ones merged (and sent)."""
    class Refusing(Combiner):
        name = "refusing"
        atomic = True

        def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
            raise AssertionError("merge_many is what the log calls")

        def merge_many(self, accs: list[np.ndarray], upds: np.ndarray) -> None:
            if (upds < 0).any():
                raise ValueError("negative")
            for acc, upd in zip(accs, upds, strict=True):
                acc += upd

    add = Table("a", (1,), "float64")
    z = Table("z", (1,), "float64", combiner=Refusing())
    log, task = UpdateLog(), UpdateLog()
    log.add_many(add, [0], np.array([[10.0]]))
    log.add_many(z, [0], np.array([[5.0]]))
    task.add_many(add, [0], np.array([[10.0]]))
    task.add_many(z, [0], np.array([[-1.0]]))
    with pytest.raises(ValueError, match="negative"):
        log.absorb(task)
    out = {name: dict(zip(keys, rows, strict=True)) for name, (keys, rows) in log.drain().items()}
    assert {name: {k: v.tolist() for k, v in rows.items()} for name, rows in out.items()} == \
        {"a": {0: [10.0]}, "z": {0: [5.0]}}


def test_update_log_copies_the_callers_array() -> None:
    t = Table("a", (2,))
    log = UpdateLog()
    d = np.ones(2, np.float32)
    log.add(t, 0, d)
    d[:] = 100
    log.add(t, 0, np.ones(2))
    assert log.drain()["a"][1][0].tolist() == [2.0, 2.0]


# -- shard store ----------------------------------------------------------------------------------


def test_shard_store_refuses_bad_items_and_keeps_the_rest() -> None:
    tables = table_index([Table("s", (2,), "float64")])
    store = ShardStore(tables, shards=[0, 1], num_shards=4)
    errors = store.handle_update([
        ["s", [0, 1], np.ones((2, 2))],
        ["nope", [0], np.ones((1, 2))],
        ["s", [0], np.ones((1, 3))],
        ["s", [2], np.ones((1, 2))],  # shard 2 lives elsewhere
        ["s", [4, 0], np.full((2, 2), 2.0)],  # an item applies whole: key 4 is shard 0 here
    ])
    assert errors[0] is None and errors[4] is None
    assert "unknown table 'nope'" in errors[1]
    assert "shape (1, 3), expected (1, 2)" in errors[2]
    assert "shard 2 is not on this server" in errors[3]
    values, errs = store.handle_get([["s", [0, 1, 4]], ["s", [3]]])
    assert errs[0] is None and values[0].tolist() == [[3, 3], [1, 1], [2, 2]]
    assert "shard 3" in errs[1]
    values, errs = store.handle_get([["s", [5, 9, 2]]])  # 5 and 9 are new here, 2 is elsewhere
    assert "key 2: shard 2 is not on this server" in errs[0]
    assert 5 not in store.shards[1]["s"] and 9 not in store.shards[1]["s"]  # a refused read creates no row
    # a new key listed twice in one update is created once and gets both deltas
    assert store.handle_update([["s", [8, 8, "k", "k"], np.array([[1.0, 2.0], [3.0, 4.0], [1.0, 1.0], [2.0, 2.0]])]]) \
        == [None]
    assert store.handle_get([["s", [8, "k"]]])[0][0].tolist() == [[4.0, 6.0], [3.0, 3.0]]


def test_an_update_item_is_applied_whole_or_not_at_all_whatever_its_combiner() -> None:
    """A custom combiner that raises part-way through an item (row 2 of 4 here) leaves every row
    as it was; before, rows 0 and 1 kept the update while the sender was told it was refused.
    Bad keys and ragged deltas are ``TableError``s naming the table."""

    def refuse_big(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if b[0] > 2:
            raise ValueError("too big")
        return a + b

    tables = table_index([Table("c", (1,), "float64", combiner=Combiner.of(refuse_big)), Table("t", (2,))])
    store = ShardStore(tables, shards=[0], num_shards=1)
    [error] = store.handle_update([["c", [0, 1, 2, 3, 1], np.array([[1.0], [2.0], [3.0], [1.0], [1.0]])]])
    assert "ValueError: too big" in error
    assert store.get("c", [0, 1, 2, 3]).ravel().tolist() == [0.0, 0.0, 0.0, 0.0]
    assert store.handle_update([["c", [1, 1], np.array([[1.0], [2.0]])]]) == [None]  # twice: both land
    assert store.get("c", [1]).ravel().tolist() == [3.0]
    lone = "x\udcff"  # a lone surrogate (os.fsdecode's for a byte that is not UTF-8)
    with pytest.raises(TableError, match=re.escape(f"table 't': key {lone!r} is not valid Unicode text")):
        tables["t"].check_key(lone)
    with pytest.raises(TableError, match=re.escape("table 't': update is not an array of shape (2, 2)")):
        tables["t"].check_delta([[1.0, 2.0], [3.0]], n=2)


# -- master bookkeeping ---------------------------------------------------------------------------


def test_master_state_versions_and_placement() -> None:
    st = MasterState(5, ["w0", "w1"], ["s0", "s1", "s2"], num_shards=6)
    assert st.executors_of("w0") == [0, 1, 2] and st.executors_of("w1") == [3, 4]
    assert st.shards_of("s1") == [1, 4]
    a = st.dispatch(0, "a")
    b = st.dispatch(4, "b")
    assert st.take_outbox() == {"w0": [[a, 0, 0, "a"]], "w1": [[b, 4, 0, "b"]]}
    st.complete(a)
    c = st.dispatch(1, "c")  # dispatched after a's completion: a higher version
    assert st.inflight[c].version == 1 > st.inflight[b].version
    with pytest.raises(LitzError, match="no executor 9"):
        st.dispatch(9, None)


# -- SSP driver -----------------------------------------------------------------------------------


class _FakeMaster:
    """What the scheduling drivers use of the master: ``dispatch`` (tasks queue per executor and run
    in order, as on a worker)."""

    def __init__(self) -> None:
        self.next_id = 0
        self.queues: dict[int, deque] = {}

    def dispatch(self, e: int, args: object) -> int:
        self.next_id += 1
        self.queues.setdefault(e, deque()).append((self.next_id, args))
        return self.next_id

    def run_one(self, driver: SSPDriver, e: int, fail: bool = False) -> None:
        tid, args = self.queues[e].popleft()
        if fail:
            driver.handle_task_failure(TaskFailure(e, args, "Traceback ...", tid, "w0"))
        else:
            driver.handle_task_completion(TaskResult(e, args, None, tid, 0))

    def drain(self, driver: SSPDriver) -> None:
        while not driver._finished and any(self.queues.values()):
            for e in sorted(self.queues):
                if self.queues[e] and not driver._finished:
                    self.run_one(driver, e)


class _Recording(SSPDriver):
    """Counts dispatches per iteration and any dispatch of ``i`` before ``i - s - 1`` ended."""

    def dispatch_initial_tasks(self) -> None:
        self.sent: dict[int, int] = {}
        self.ended: list[int] = []
        self.early: list[int] = []
        super().dispatch_initial_tasks()

    def _dispatch_iteration(self, iteration: int) -> None:
        self.sent[iteration] = self.sent.get(iteration, 0) + 1
        if any(j not in self.ended for j in range(iteration - self._stale)):
            self.early.append(iteration)
        super()._dispatch_iteration(iteration)

    def on_iteration_end(self, iteration: int, results: list[TaskResult]) -> None:
        self.ended.append(iteration)

    def handle_task_failure(self, failure: TaskFailure) -> None:
        self.retry(failure)


def _ssp(iterations: int, staleness: int, executors: int = 2) -> tuple[_Recording, _FakeMaster]:
    m, d = _FakeMaster(), _Recording()
    d._bind(m, executors, {"iterations": iterations, "staleness": staleness})  # type: ignore[arg-type]
    d.dispatch_initial_tasks()
    return d, m


def _resumed(d: _Recording, m: _FakeMaster, config: dict) -> _Recording:
    """What a resume does: the attributes come back, the config is the new launch's, and the
    tasks in flight are dispatched again with their ids (they stay queued)."""
    back = _Recording.__new__(_Recording)
    back.__dict__.update(copy.deepcopy({k: v for k, v in d.__dict__.items() if k not in ("_master", "config")}))
    back._bind(m, d.num_executors, config)  # type: ignore[arg-type]
    back.resumed()
    return back


def test_ssp_resumed_with_a_smaller_staleness_or_fewer_iterations_dispatches_nothing_twice_and_finishes() -> None:
    """Before, the tasks in flight at the checkpoint (staleness 3) each dispatched ``it + 0 + 1`` on
    completion: iterations went out twice, then more; and a count at or below the iterations done
    never finished (the job failed with nothing in flight)."""
    d, m = _ssp(10, 3)
    for _ in range(2):  # iterations 0 and 1 complete; 2..5 in flight
        for e in (0, 1):
            m.run_one(d, e)
    d = _resumed(d, m, {"iterations": 10, "staleness": 0})
    m.drain(d)
    assert d._finished and d.ended == list(range(10)) and set(d.sent.values()) == {1}, d.sent
    d, m = _ssp(10, 1)
    for _ in range(6):
        for e in (0, 1):
            m.run_one(d, e)
    d = _resumed(d, m, {"iterations": 6, "staleness": 1})
    assert d._finished and d.ended == list(range(6))


@pytest.mark.parametrize("staleness", [0, 1])
def test_ssp_a_retried_task_keeps_the_bound_and_the_order_and_the_job_waits_for_it(staleness: int) -> None:
    """``Driver.retry`` carries the failed task's iteration to its new id (with ``dispatch_task`` a
    KeyError ended the job). The retry runs behind its executor's next iteration: iterations end in
    order, nothing goes out before ``i - s - 1`` ended, and the job finishes only after all of them
    (before, the count jumped past the retried iteration and the job could end without it)."""
    d, m = _ssp(6, staleness)
    m.run_one(d, 0, fail=True)  # executor 0's iteration 0 fails; its retry queues behind its iteration 1
    m.drain(d)
    assert d._finished and d.ended == list(range(6)) and not d.early, (d.ended, d.early)
    assert set(d.sent.values()) == {1}


def test_block_rotation_a_retried_task_keeps_its_block_and_nothing_is_dispatched_after_finish() -> None:
    """``Driver.retry`` in a ``BlockRotationDriver`` (a KeyError ended the job before); and once
    ``finish`` is called, ``dispatch_task`` refuses (the task ran after the job's result was fixed)."""
    from litz.schedulers import BlockRotationDriver

    class Rotating(BlockRotationDriver):
        def handle_task_failure(self, failure: TaskFailure) -> None:
            self.retry(failure)

    m, d = _FakeMaster(), Rotating()
    d._bind(m, 2, {"rounds": 3, "num_blocks": 3})  # type: ignore[arg-type]
    d.dispatch_initial_tasks()
    m.run_one(d, 1, fail=True)
    m.drain(d)  # type: ignore[arg-type]
    assert d._finished and d._rotation.finished()
    with pytest.raises(LitzError, match=re.escape("dispatch_task(0, ...) after finish(): the job is over")):
        d.dispatch_task(0)


def test_a_checkpoint_period_in_iterations_starts_again_where_the_job_restarts(tmp_path) -> None:  # noqa: ANN001
    """After a full rollback to iteration 7 the next round is due at 12, not 15 (5 after the round
    before the loss); a job resumed at iteration 12 does not checkpoint at once what it just read."""
    from litz.ft.checkpoint import CheckpointCoordinator

    ck = CheckpointCoordinator(str(tmp_path), every="5")
    assert ck.begin("policy", 10) is not None
    ck.round = None  # that round fails: a worker died during it
    ck.rolled_back(None)
    ck.restarted(7)
    assert not ck.due(11) and ck.due(12)
    ck = CheckpointCoordinator(str(tmp_path), every="5")
    ck.restarted(12)
    assert not ck.due(12) and ck.due(17)


# -- block rotation -------------------------------------------------------------------------------


@pytest.mark.parametrize("E, B", [(4, 4), (3, 5), (1, 2), (6, 6)])
def test_block_rotation_never_shares_a_block_and_keeps_round_order(E: int, B: int) -> None:
    rounds = 7
    rot = BlockRotation(E, B, rounds)
    rng = np.random.default_rng(E * 10 + B)
    running = rot.start()
    visits: dict[int, list[int]] = {b: [] for b in range(B)}
    done = 0
    while running:
        held = [b for _, _, b in running]
        assert len(held) == len(set(held))  # one user per block at any moment
        e, r, b = running.pop(int(rng.integers(len(running))))
        visits[b].append(r)
        running += rot.complete(e, r)
        done += 1
    assert done == E * rounds and rot.finished()
    for b, rs in visits.items():
        assert rs == sorted(rs), (b, rs)  # each block visited in round order


@pytest.mark.parametrize("E, B, depth", [(2, 4, 2), (3, 5, 2), (2, 6, 3), (4, 4, 2)])
def test_block_rotation_with_depth_pipelines_and_keeps_every_rule(E: int, B: int, depth: int) -> None:
    # executors run their tasks in order (a FIFO queue each); the others complete at random
    rounds = 9
    rot = BlockRotation(E, B, rounds, depth)
    rng = np.random.default_rng(E * 100 + B * 10 + depth)
    queues: dict[int, deque[tuple[int, int, int]]] = {e: deque() for e in range(E)}
    handed = dict.fromkeys(range(E), 0)
    deepest = 0

    def take(assignments: list[tuple[int, int, int]]) -> None:
        for e, r, b in assignments:
            assert r == handed[e] and b == (e * B // E + r) % B  # each executor's rounds in order
            handed[e] += 1
            queues[e].append((e, r, b))

    take(rot.start())
    visits: dict[int, list[int]] = {b: [] for b in range(B)}
    while any(queues.values()):
        held = [b for q in queues.values() for _, _, b in q]
        assert len(held) == len(set(held))  # one user per block, queued tasks included
        deepest = max(deepest, *(len(q) for q in queues.values()))
        assert deepest <= depth
        e = int(rng.choice([e for e, q in queues.items() if q]))
        _, r, b = queues[e].popleft()
        visits[b].append(r)
        take(rot.complete(e, r))
    assert rot.finished() and all(n == rounds for n in handed.values())
    for b, rs in visits.items():
        assert rs == sorted(rs), (b, rs)
    if B > E:  # spare blocks: some executor had its next round while still on its current one
        assert deepest == depth


def test_block_rotation_needs_enough_blocks() -> None:
    with pytest.raises(ConfigError):
        BlockRotation(4, 3)
    with pytest.raises(ConfigError, match="depth"):
        BlockRotation(2, 4, depth=0)


def test_master_state_migration_holds_tasks_until_arrival() -> None:
    st = MasterState(4, ["w0", "w1"], ["s0"], num_shards=4)
    st.take_outbox()
    [(mid, source, eids)] = st.start_migration([0, 1, 3], "w1")  # 3 is already on w1
    assert (source, eids) == ("w0", [0, 1])
    assert st.start_migration([0], "w1") == []  # already moving
    t = st.dispatch(0, "during")  # held: not sent to the old worker
    assert st.take_outbox() == {}
    st.finish_migration(mid)
    assert st.placement[0] == "w1" and st.inflight[t].worker == "w1"
    assert st.take_outbox() == {"w1": [[t, 0, 0, "during"]]}
    with pytest.raises(LitzError, match="not a worker"):
        st.start_migration([0], "w9")


@pytest.mark.parametrize("n, workers, targets", [(12, ["a", "b"], ["a", "b", "c", "d"]), (10, ["a", "b", "c"], ["a"]),
                                                 (7, ["a", "b"], ["a", "b", "c"])])
def test_balance_is_even_with_few_moves(n: int, workers: list[str], targets: list[str]) -> None:
    st = MasterState(n, workers, ["s0"])
    for w in targets:
        if w not in st.workers:
            st.workers.append(w)
    before = dict(st.placement)
    moves = st.plan_balance(targets)
    after = dict(before)
    for dest, eids in moves.items():
        for e in eids:
            after[e] = dest
    counts = [sum(1 for w in after.values() if w == t) for t in targets]
    assert max(counts) - min(counts) <= 1 and sum(counts) == n
    assert set(after.values()) <= set(targets)
    moved = sum(len(e) for e in moves.values())
    # the fewest moves: only what must leave removed workers or exceed its quota
    must = sum(1 for w in before.values() if w not in targets)
    excess = sum(max(0, sum(1 for w in before.values() if w == t) - -(-n // len(targets))) for t in targets)
    assert moved <= must + excess + len(targets)


def test_shard_store_extract_forward_and_install() -> None:
    tables = table_index([Table("s", (2,), "float64")])
    a = ShardStore(tables, shards=[0, 1], num_shards=4)
    b = ShardStore(tables, shards=[2, 3], num_shards=4)
    a.update("s", [0, 1, 4], np.array([[1.0, 1], [2, 2], [3, 3]]))
    data = a.extract([0], dest="b")
    assert a.split([0, 1, 4, 5]) == ([1, 3], {"b": [0, 2]})  # shard 0 (keys 0 and 4) is forwarded
    b.install([0], data)
    assert b.get("s", [0, 4]).tolist() == [[1, 1], [3, 3]]
    b.update("s", [0], np.ones((1, 2)))  # installed rows are writable copies
    assert b.get("s", [0]).tolist() == [[2, 2]]
    with pytest.raises(TableError, match="shard 0 is not on this server"):
        a.get("s", [0])


def test_master_state_shard_migration() -> None:
    st = MasterState(2, ["w0"], ["s0", "s1"], num_shards=4)
    [(mid, source, shards)] = st.start_shard_migration([0, 2, 1], "s1")  # 1 is already on s1
    assert (source, shards) == ("s0", [0, 2]) and st.start_shard_migration([0], "s1") == []
    st.finish_shard_migration(mid)
    assert st.shard_map == ["s1", "s1", "s1", "s1"] and st.shards_of("s0") == []


def test_full_recovery_state_change_forgets_the_abandoned_timeline() -> None:
    from litz.ft.checkpoint import CheckpointCoordinator
    from litz.runtime.master import MasterState

    st = MasterState(6, ["w0", "w1", "w2"], ["s0", "s1"], num_shards=8)
    for e in range(6):
        st.dispatch(e, {"n": e})
    st.complete(1)
    st.paused = True
    st.dispatch(0, "held")
    assert st.executors_of("w1") == [2, 3]
    assign = st.roll_back("w1", "worker")
    assert assign == {"w0": [2], "w2": [3]}  # least loaded first, ties by name
    assert st.workers == ["w0", "w2"] and sorted(st.executors_of("w0") + st.executors_of("w2")) == list(range(6))
    assert not st.inflight and not st.outbox and not st.paused_items and not st.paused
    assert st.version == 0 and st.completed == 0
    st.restore_tasks([[3, 2, 1, "again"]], version=1, completed=1, next_id=3)
    assert st.version == 1 and st.outbox == {"w0": [[3, 2, 1, "again"]]}
    assert st.dispatch(4, None) == 8  # ids never reused: 7 were given before the rollback
    assert st.roll_back("s1", "server") == {"s0": [1, 3, 5, 7]} and set(st.shard_map) == {"s0"}

    ck = CheckpointCoordinator("/tmp/x", "2", policy="priority", fraction=0.5)
    ck.begin("policy", 2)
    ck.finish()
    assert ck.partial_next()
    ck.rolled_back()  # partial rows of the abandoned timeline must not build on the old base
    assert not ck.partial_next()


def test_a_second_loss_during_a_recovery_is_planned_again_without_doubles() -> None:
    from litz.runtime.master import MasterState

    st = MasterState(4, ["w0"], ["s0", "s1", "s2", "s3"], num_shards=8)  # s_i holds shards i and i + 4
    st.servers.remove("s1")
    first = st.plan_takeover(["s1"], "server")
    assert first == {"s0": [1], "s2": [5]}
    st.servers.remove("s2")  # dies before its part was restored: it had shards 2, 6 and took 5
    second = st.plan_takeover(["s2"], "server", prior=first)
    assert second == {"s0": [1, 5], "s3": [2, 6]}  # s0 keeps its part; nothing lands twice


def test_losses_planned_together_keep_the_part_a_dead_one_was_given() -> None:
    """Losses settled before planning are planned as one: s2 died before its part (shard 5, from
    s1's plan) was restored, and s3 died with it; s2's own shards and its part land once each,
    and a retiring server (avoid) takes nothing while another is left."""
    from litz.runtime.master import MasterState

    st = MasterState(4, ["w0"], ["s0", "s1", "s2", "s3", "s4"], num_shards=10)  # s_i: shards i, i + 5
    st.servers.remove("s1")
    first = st.plan_takeover(["s1"], "server")
    assert first == {"s0": [1], "s2": [6]}
    st.servers.remove("s2")
    st.servers.remove("s3")
    second = st.plan_takeover(["s2", "s3"], "server", prior=first, avoid={"s4"})
    assert second == {"s0": [1, 2, 3, 6, 7, 8]}
    assert st.plan_takeover(["s2"], "server", avoid={"s0", "s4"}) == {"s0": [2], "s4": [7]}  # none else left


def test_a_settled_migration_routes_every_task_of_its_executors_to_where_they_are() -> None:
    """Tasks queued for the source and not sent yet are held when a migration starts (so none
    is ever forwarded behind the executor). When it ends, held tasks go to the executors'
    worker. A task in flight completes where it is: the queued tasks the source ships (listed
    in its ``ship_ready``) on the destination, those it ran on the source, which reported them
    before ``ship_ready``; if the executors never arrived, every task is the source's. So a later
    loss dispatches again exactly the tasks that were on the dead worker."""
    from litz.runtime.master import MasterState

    for arrived, where in ((True, "w1"), (False, "w0")):
        st = MasterState(2, ["w0", "w1"], ["s0"])  # executor 0 on w0, 1 on w1
        ran, shipped = st.dispatch(0, "ran"), st.dispatch(0, "shipped")
        st.take_outbox()  # both reached w0: it runs the first, then ships the second along
        queued = st.dispatch(0, "queued")  # still in the outbox when the move starts
        [(mid, source, eids)] = st.start_migration([0], "w1")
        assert (source, eids) == ("w0", [0]) and st.take_outbox() == {}
        during = st.dispatch(0, "during")
        if arrived:
            st.tasks_moved([shipped], "w1")
        st.finish_migration(mid, arrived)
        assert st.placement[0] == where and 0 not in st.moving
        assert [item[0] for item in st.take_outbox()[where]] == [queued, during]
        assert {t.task_id: t.worker for t in st.inflight.values()} == {
            ran: "w0", shipped: where, queued: where, during: where}
    st = MasterState(2, ["w0", "w1"], ["s0"])  # a task held by a checkpoint's pause follows a move
    st.paused = True
    paused = st.dispatch(0, "paused")
    [(mid, _, _)] = st.start_migration([0], "w1")
    st.finish_migration(mid)
    st.release_paused()
    assert st.take_outbox() == {"w1": [[paused, 0, 0, "paused"]]} and st.inflight[paused].worker == "w1"
    st = MasterState(2, ["w0", "w1"], ["s0"])
    st.workers.remove("w0")  # dead: its executor is being restored, not moved
    assert st.start_migration([0], "w1") == [] and not st.moving


@pytest.mark.parametrize("settled_first", [False, True])
def test_a_source_ships_only_after_the_master_has_its_completions(settled_first: bool) -> None:
    """A leaving executor's completions are reported (``done``) before the source says
    ``ship_ready``, on the same connection, and it ships only when the master says ``ship``
    (sent once it has handled them): a source that dies right after shipping can take no
    report with it. A ``settle`` in between (the destination died) keeps the executor here,
    and a late ``ship`` then finds nothing to send."""
    import litz
    from litz.runtime.protocol import Message
    from litz.runtime.worker import Slot, Task, Worker

    w = Worker("w0", "job", "127.0.0.1:1")
    sent: list[tuple[str, str, dict]] = []
    w.endpoint.send = lambda peer, kind, **fields: sent.append((peer, kind, fields))  # type: ignore[method-assign]
    try:
        w.master = "master"
        ex = litz.Executor()
        ex.state, ex.input = {"count": 3}, None
        w.slots[0] = Slot(ex, deque([Task(7, 0, 0, "queued")]))
        w._record("completed", [5, "ran"], 0)  # ran here, its updates not yet acknowledged
        w.dispatch(Message("migrate_out", {"mid": 1, "executors": [0], "dest": "w1", "ship_input": False},
                           sender="master"))
        assert [k for _, k, _ in sent] == ["done"]  # reported first: no update was pending
        assert sent[0][2]["completed"] == [[5, "ran"]] and w._ship_due
        w._ship_ready()  # the loop's next turn
        assert sent[1] == ("master", "ship_ready", {"mid": 1, "tasks": [7]})
        w._ship_ready()  # asked once only
        assert len(sent) == 2
        if settled_first:
            w.dispatch(Message("settle", {"mid": 1, "kind": "executors", "items": [0]}, sender="master"))
            assert sent[2] == ("master", "settled", {"mid": 1, "holds": True})
            assert not w.slots[0].leaving and w.slots[0].running  # its queued task runs here
        w.dispatch(Message("ship", {"mid": 1}, sender="master"))
        if settled_first:
            assert len(sent) == 3 and 0 in w.slots
        else:
            [(peer, kind, fields)] = sent[2:]
            assert (peer, kind) == ("w1", "executor_state") and 0 not in w.slots
            [[eid, _, inp, queued, saves, undo]] = fields["executors"]
            assert (eid, inp, queued, saves, undo) == (0, None, [[7, 0, 0, "queued"]], None, [])
    finally:
        w.endpoint.close()


@pytest.mark.parametrize("ship", [True, False])
def test_an_executor_that_ships_no_input_is_sent_without_it(ship: bool) -> None:
    """``Executor.ship_input = False``: a move that would send the input from memory sends none,
    and the destination loads it (``load_input``); other executors' inputs still travel."""
    import litz
    from litz.runtime.protocol import Message, unpack_object
    from litz.runtime.worker import Slot, Worker

    class Ex(litz.Executor):
        ship_input = ship

    w = Worker("w0", "job", "127.0.0.1:1")
    sent: list[tuple[str, str, dict]] = []
    w.endpoint.send = lambda peer, kind, **fields: sent.append((peer, kind, fields))  # type: ignore[method-assign]
    try:
        w.master = "master"
        ex = Ex()
        ex.state, ex.input = {"count": 3}, np.arange(5)
        w.slots[0] = Slot(ex)
        w.dispatch(Message("migrate_out", {"mid": 1, "executors": [0], "dest": "w1", "ship_input": True},
                           sender="master"))
        w._ship_ready()
        w.dispatch(Message("ship", {"mid": 1}, sender="master"))
        [[eid, _, inp, *_]] = [f for _, k, f in sent if k == "executor_state"][0]["executors"]
        assert eid == 0
        if ship:
            np.testing.assert_array_equal(unpack_object(inp), np.arange(5))
        else:
            assert inp is None
    finally:
        w.endpoint.close()


def test_master_presence_counts_another_master_as_gone_even_without_a_delete() -> None:
    """The master's registration put back by its own keep-alive (same address, pid, start) ends a
    grace period; another master's record means the one served is gone, whether its put followed a
    delete or overwrote the key (a job name taken over by another launcher). Before, an overwrite
    was adopted silently and the node went on serving the other master."""
    from litz.runtime.node import MasterPresence

    ours = {"addr": "tcp://10.0.0.1:5000", "pid": 7, "started": 1.0, "lease_ttl": 2}
    theirs = {**ours, "pid": 8, "started": 2.0}
    p = MasterPresence()
    assert p.put(ours) is False and not p.gone(0.0)
    assert p.delete(10.0) == 3.0 and not p.gone(12.9) and p.gone(13.0)
    assert p.put(dict(ours)) is True and not p.gone(100.0)  # came back: the grace is over
    assert p.put(theirs) is False and p.gone(0.0)  # overwritten by another master: gone at once


class _SlowRegistry:
    """A node's membership whose reads of the registrations wait until released (an etcd that
    answers slowly), counting them and the threads reading at once."""

    started = True

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.lock = threading.Lock()
        self.reads = self.reading = self.most_at_once = 0
        self.registrations: dict[str, dict] = {}

    def get_prefix(self, prefix: str) -> dict[str, dict]:
        with self.lock:
            self.reads += 1
            self.reading += 1
            self.most_at_once = max(self.most_at_once, self.reading)
        self.release.wait(10)
        with self.lock:
            self.reading -= 1
        return dict(self.registrations)

    def poll_events(self) -> list:
        return []


def _node_with(registry: _SlowRegistry) -> Any:
    from litz.ps.server import ServerNode

    node = ServerNode("s0", "job", "127.0.0.1:1")
    node.membership = registry  # type: ignore[assignment]
    handled: list[tuple[str, int]] = []
    node._handle = lambda msg: handled.append((msg.sender, msg["n"]))  # type: ignore[method-assign]
    return node, handled


def _drain_background(node: Any, until: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not until():
        assert time.monotonic() < deadline
        node._membership_events()
        node._retry_lookups()
        time.sleep(0.005)


def test_unknown_senders_share_one_lookup_and_their_messages_keep_their_order(monkeypatch) -> None:
    """Messages of senders whose address is unknown wait for a read of the registrations made off
    the loop: one read at a time whatever the number of senders (before, a thread and a read each:
    200 senders, 200 threads), at most ``MAX_PARKED_SENDERS`` senders waiting (the others are
    handled at once), and past ``MAX_PARKED`` a sender's messages are dropped, never handled ahead of
    the ones that wait (before, the 1,001st overtook the first 1,000)."""
    from litz.runtime import node as node_mod
    from litz.runtime.protocol import Message

    monkeypatch.setattr(node_mod, "MAX_PARKED", 5)
    monkeypatch.setattr(node_mod, "MAX_PARKED_SENDERS", 40)
    registry = _SlowRegistry()
    node, handled = _node_with(registry)
    try:
        for i in range(50):
            for n in range(7 if i == 0 else 1):
                node.dispatch(Message("get", {"n": n}, sender=f"w{i}"))
        assert registry.reads == 1 and node.messages_dropped == 2  # w0's 6th and 7th
        assert handled == [(f"w{i}", 0) for i in range(40, 50)]  # past the cap: at once
        registry.release.set()
        _drain_background(node, lambda: not node._parked)
        # one read at a time; a second for the senders that came after the first began
        assert registry.most_at_once == 1 and registry.reads == 2
        assert handled[10:15] == [("w0", n) for n in range(5)]
        assert sorted(handled[15:]) == sorted((f"w{i}", 0) for i in range(1, 40))
    finally:
        node.endpoint.close()


def test_messages_waiting_for_an_address_are_released_when_it_comes_another_way() -> None:
    """A sender whose address the node learns otherwise (an init's peers, a migration's
    destination) while its look-up still waits on etcd: its messages are handled, in order, at
    the loop's next turn, not only when the read answers."""
    from litz.runtime.protocol import Message
    from litz.runtime.transport import Endpoint

    registry = _SlowRegistry()
    node, handled = _node_with(registry)
    peer = Endpoint("w7")
    try:
        for n in range(3):
            node.dispatch(Message("get", {"n": n}, sender="w7"))
        assert handled == []
        node.endpoint.connect("w7", peer.address)
        node._retry_lookups()
        assert handled == [("w7", 0), ("w7", 1), ("w7", 2)]
    finally:
        registry.release.set()
        peer.close()
        node.endpoint.close()


def test_tasks_run_on_reused_runners_and_a_rollback_kills_only_the_blocked_ones() -> None:
    """A worker runs an executor's tasks one after another on one parked runner greenlet, in
    order, each reported once. A rollback kills the runner of a task blocked in ``ps.get``
    (simulated: the task switches to the hub as ``ps_get`` does) and never a parked one, and
    a task of the new timeline then runs and completes."""
    import weakref

    import greenlet

    import litz
    from litz.runtime.protocol import Message
    from litz.runtime.worker import Slot, Task, Worker

    w = Worker("w0", "job", "127.0.0.1:1")
    sent: list[tuple[str, str, dict]] = []
    w.endpoint.send = lambda peer, kind, **fields: sent.append((peer, kind, fields))  # type: ignore[method-assign]
    ran: list[tuple[object, greenlet.greenlet]] = []

    class Ex(litz.Executor):
        def run_task(self, args: object) -> object:
            if not isinstance(args, str):
                return "held"
            ran.append((args, greenlet.getcurrent()))
            if args == "block":
                w.hub.switch()  # waits as a fetch does, until resumed or killed
            return args

    def queue(eid: int, *tasks: tuple[int, object]) -> None:
        slot = w.slots.setdefault(eid, Slot(Ex()))
        slot.queue.extend(Task(tid, eid, 0, args) for tid, args in tasks)
        w._start_next(slot)

    def reported() -> list[list[object]]:
        w._release()
        return [item for _, kind, fields in sent if kind == "done" for item in fields["completed"]]

    try:
        w.master = "master"
        queue(0, (1, "a"), (2, "b"), (3, "c"))
        w._run_runnable()
        assert [a for a, _ in ran] == ["a", "b", "c"] and len({id(g) for _, g in ran}) == 1
        assert reported() == [[1, "a"], [2, "b"], [3, "c"]]
        parked = ran[0][1]
        queue(1, (4, "block"))
        queue(0, (5, "d"))
        w._run_runnable()
        blocked, other = ran[3][1], ran[4][1]
        assert blocked is parked and other is not parked  # the parked runner took the first task
        assert w.slots[1].running and not w.slots[0].running
        w.on_rollback(Message("rollback", {"lost": [], "round": 1}, sender="master"))
        assert blocked.dead and not other.dead  # other was parked: nothing to kill
        queue(0, (6, "e"))
        w._run_runnable()
        assert ran[-1][0] == "e" and ran[-1][1] is not blocked
        # d completed on the abandoned timeline, unreported: the rollback dropped it with the rest
        assert reported() == [[1, "a"], [2, "b"], [3, "c"], [6, "e"]]
        held = np.ones(4)
        ref = weakref.ref(held)
        queue(0, (8, held))
        del held
        w._run_runnable()
        assert ref() is None  # a parked runner keeps nothing of the task it ran
    finally:
        w.endpoint.close()


def test_a_rollback_answers_what_a_server_forwarded_to_a_lost_server() -> None:
    """Full recovery: a worker may say it rolled back only once its updates are acknowledged,
    and a live server holds the acknowledgement of an update it forwarded (its shard had
    moved) until the new owner answers. If that owner died, the rollback tells the live
    server, which then answers at once, for the forwards already made and any made later."""
    from litz.ps.server import ServerNode
    from litz.runtime.protocol import Message

    srv = ServerNode("s0", "job", "127.0.0.1:1")
    sent: list[tuple[str, str, dict]] = []
    srv.endpoint.send = lambda peer, kind, **fields: sent.append((peer, kind, fields))  # type: ignore[method-assign]
    try:
        srv.master = "master"
        srv.store = ShardStore(table_index([Table("t", (2,))]), [0, 1], 2)
        srv.store.extract([1], "s1")  # shard 1 (odd keys) moved to s1
        one = np.ones((2, 2))
        srv.dispatch(Message("update", {"rid": 5, "items": [["t", [0, 1], one]]}, sender="w0"))
        assert [(p, k) for p, k, _ in sent] == [("s1", "update")]  # key 1 forwarded; no ack yet
        srv.dispatch(Message("rollback", {"lost": ["s1"], "round": 1}, sender="master"))
        assert sent[1:] == [("w0", "update_ack", {"rid": 5, "errors": [None], "moved": {1: "s1"}}),
                            ("master", "rolled_back", {"round": 1})]  # nothing forwarded is unanswered
        srv.dispatch(Message("update", {"rid": 6, "items": [["t", [3], one[:1]]]}, sender="w0"))
        srv.dispatch(Message("get", {"rid": 7, "items": [["t", [0, 3]]]}, sender="w0"))
        assert [(p, k) for p, k, _ in sent[3:]] == [("w0", "update_ack"), ("w0", "get_reply")]  # none to s1
        assert sent[3][2]["errors"] == [None] and "rolls back" in sent[4][2]["errors"][0]
        np.testing.assert_array_equal(srv.store.get("t", [0]), one[:1])  # the local part landed
    finally:
        srv.endpoint.close()


def test_the_master_says_ship_only_from_its_main_loop_and_never_towards_the_lost() -> None:
    """``ship_ready`` follows the source's completions on one connection, so the master must
    handle it in order: inside a driver's wait (``_handle_aside``) it is kept for the main
    loop, which has handled the earlier reports by then. The queued tasks are recorded on
    the destination when it says ``ship``; a migration whose destination was declared lost
    gets no ``ship`` (the settle decides where its executors are)."""
    from litz.runtime.master import Master
    from litz.runtime.protocol import Message
    from tests import testapps

    m = Master(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), "j", None,  # type: ignore[arg-type]
               workers=2, servers=1, num_executors=2)
    sent: list[tuple[str, str, dict]] = []
    m.endpoint.send = lambda peer, kind, **fields: sent.append((peer, kind, fields))  # type: ignore[method-assign]
    try:
        st = m.state = MasterState(2, ["w0", "w1"], ["s0"])  # executor 0 on w0, 1 on w1
        queued = st.dispatch(0, "queued")
        st.take_outbox()
        [(mid, _, _)] = st.start_migration([0], "w1")
        ready = Message("ship_ready", {"mid": mid, "tasks": [queued]}, sender="w0")
        m._handle_aside(ready)
        assert m._deferred == [ready] and sent == [] and st.inflight[queued].worker == "w0"
        m.on_ship_ready(ready)
        assert sent == [("w0", "ship", {"mid": mid})] and st.inflight[queued].worker == "w1"
        [(mid2, _, _)] = st.start_migration([1], "w0")
        m.lost.add("w0")
        m.on_ship_ready(Message("ship_ready", {"mid": mid2, "tasks": []}, sender="w1"))
        m.on_ship_ready(Message("ship_ready", {"mid": 99, "tasks": []}, sender="w1"))  # none such
        assert len(sent) == 1
    finally:
        m.endpoint.close()


def test_driver_checkpoints_keep_helpers_bound_to_the_live_driver() -> None:
    """A driver's helper that holds the driver (NN-Descent's phase in HDBSCAN, a bound method as a
    callback) must checkpoint without the master, and come back bound to the live driver: pickled
    as a copy, the checkpoint failed on the master's lock, and a restored copy would dispatch
    through a dead driver."""
    import threading

    import litz
    from litz.ft.driver_state import dump_driver, load_driver

    class Helper:
        def __init__(self, driver: litz.Driver) -> None:
            self.driver, self.report, self.rounds = driver, driver.progress, 3

    class D(litz.Driver):
        transient = ("scratch",)

    d = D()
    d._master = threading.Lock()  # stands for the master: nothing of it may be saved
    d.helper, d.scratch, d.values = Helper(d), threading.Lock(), np.arange(4)
    blob = dump_driver(d, version=7)
    live = D()
    saved = load_driver(blob, live)
    assert saved["version"] == 7 and set(saved["driver"]) == {"helper", "values"}
    helper = saved["driver"]["helper"]
    assert helper.driver is live and helper.report.__self__ is live and helper.rounds == 3
    np.testing.assert_array_equal(saved["driver"]["values"], np.arange(4))


def test_lost_processes_are_reported_in_id_order() -> None:
    """Several processes lost at once are listed by id, whatever order their losses were noticed in
    (a test compared 's2, s1' with 's1, s2' and failed in CI); numbers compare as numbers."""
    from litz.runtime.master import _id_order

    assert sorted(["s10", "w1", "s2", "s1"], key=_id_order) == ["s1", "s2", "s10", "w1"]


def test_an_unreachable_etcd_is_reported_once_per_outage_by_the_status_publisher(caplog) -> None:
    """The master publishes its status every few hundred ms. While etcd is down that write fails each
    time: the first failure is a warning, the next ones are not repeated, and the first write that
    succeeds again says so (and the status it wrote is the current one). The writes go in the
    background: one due while the last is still under way is skipped, not queued behind it."""
    import concurrent.futures
    import logging

    from litz.errors import EtcdUnreachable
    from litz.runtime.master import STATUS_KEY, Master
    from tests import testapps

    class Flaky:
        timeout = 5.0

        def __init__(self) -> None:
            self.down = False
            self.slow = False  # writes stay under way until finish()
            self.puts: list[dict] = []
            self.held: list[concurrent.futures.Future[None]] = []

        def put_soon(self, key: str, value: dict) -> concurrent.futures.Future[None]:
            assert key == STATUS_KEY
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            if self.slow:
                self.held.append(fut)
                self.puts.append(value)
            elif self.down:
                fut.set_exception(EtcdUnreachable("cannot reach etcd at 127.0.0.1:1 (put status)"))
            else:
                self.puts.append(value)
                fut.set_result(None)
            return fut

    etcd = Flaky()
    m = Master(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), "j", etcd,  # type: ignore[arg-type]
               workers=1, servers=1, num_executors=2)
    try:
        with caplog.at_level(logging.WARNING, logger="litz.runtime.master"):
            m.publish_status("running")
            etcd.down = True
            for _ in range(5):
                m.publish_status("running")
            etcd.down = False
            m.publish_status("finishing")
            etcd.down = True
            m.publish_status("finishing")  # a second outage is reported again
            etcd.down, etcd.slow = False, True
            m.publish_status("running")
            m.publish_status("running")  # the one before is under way: skipped
            etcd.held[0].set_result(None)
            etcd.slow = False
            m.publish_status("stopping")
        said = [r.getMessage() for r in caplog.records]
        assert said == ["could not publish the job status: cannot reach etcd at 127.0.0.1:1 (put status)",
                        "the job status is published again",
                        "could not publish the job status: cannot reach etcd at 127.0.0.1:1 (put status)",
                        "the job status is published again"]
        assert [p["phase"] for p in etcd.puts] == ["running", "finishing", "running", "stopping"]
    finally:
        m.endpoint.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"shape": (0,)}, "shape must be positive ints"),
    ({"shape": (3, 0)}, "shape must be positive ints"),
    ({"shape": (-2,)}, "shape must be positive ints"),
    ({"shape": (2.7,)}, "shape must be positive ints"),
    ({"shape": (2,), "dtype": object}, "dtype object is not numeric"),
    ({"shape": (2,), "dtype": "datetime64[s]"}, "is not numeric"),
    ({"shape": (2,), "dtype": "nonsense"}, "data type 'nonsense' not understood"),
    ({"shape": (2,), "num_rows": 0}, "num_rows must be a positive int or None, got 0"),
    ({"shape": (2,), "num_rows": 2.5}, "num_rows must be a positive int or None, got 2.5"),
])
def test_a_table_that_cannot_hold_or_send_rows_is_refused_when_declared(kwargs: dict, message: str) -> None:
    """Such tables used to be accepted and then hang (object rows are never decoded on arrival),
    crash a worker (zero-size rows) or fail at the first fetch."""
    with pytest.raises(TableError, match=message):
        Table("t", **kwargs)
    with pytest.raises(TableError, match="name must be a non-empty string, got 5"):
        Table(5, (2,))  # type: ignore[arg-type]
    with pytest.raises(TableError, match="tables must be litz.Table instances, got str"):
        table_index([Table("ok", (2,)), "t"])  # type: ignore[list-item]
    assert Table("scalar", ()).shape == () and Table("n", np.int64(3), num_rows=np.int64(4)).shape == (3,)


def test_a_function_combiner_must_return_a_row() -> None:
    """A forgotten ``return`` (None) or a scalar was broadcast over the row: NaNs or a wrong sum, silently."""
    for fn, got in ((lambda a, b: None, "NoneType"), (lambda a, b: float((a + b).sum()), "float"),
                    (lambda a, b: np.ones(4), "shape (4,)")):
        with pytest.raises(TypeError, match=f"combiner 'f' returned {re.escape(got)}, expected an array of the "
                                            r"row's shape \(2,\)"):
            Combiner.of(fn, "f").merge_into(np.zeros(2), np.ones(2))
    row = np.zeros(2)
    assert Combiner.of(lambda a, b: a + b, "f").merge_into(row, np.ones(2)) is row and row.tolist() == [1.0, 1.0]
    scalar = np.zeros(())  # a scalar table's rows: a NumPy scalar is the right answer
    Combiner.of(lambda a, b: a + b, "f").merge_into(scalar, np.ones(()))
    assert scalar == 1.0


def test_a_snapshot_is_the_value_as_it_was_and_cannot_be_sent_fails_at_once() -> None:
    import threading

    state = {"w": np.zeros(3), "seen": [1, (2, 3)], "n": np.int64(4)}
    snap = protocol.snapshot(state)
    state["w"] += 1
    state["seen"][1] = "changed"
    header, *frames = protocol.encode("done", completed=[[7, snap]], failed=[])
    out = protocol.decode([header, *frames]).fields["completed"][0][1]
    assert out["w"].tolist() == [0.0, 0.0, 0.0] and out["seen"] == [1, (2, 3)] and out["n"] == 4

    class Box:
        def __init__(self) -> None:
            self.v = [1]

    box = Box()
    pickled, copied = protocol.snapshot({"b": box}), protocol.snapshot({"b": box}, pickle=False)
    box.v.append(2)
    header, *frames = protocol.encode("done", completed=[[7, pickled]], failed=[])
    assert protocol.decode([header, *frames]).fields["completed"][0][1]["b"].v == [1]
    assert copied["b"].v == [1] and isinstance(copied["b"], Box)
    for pickle in (True, False):
        with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
            protocol.snapshot({"lock": threading.Lock()}, pickle=pickle)


def test_dispatch_takes_numpy_ids_refuses_bools_and_unsendable_arguments() -> None:
    import threading

    st = MasterState(2, ["w0"], ["s0"])
    args = {"x": [1]}
    tid = st.dispatch(np.int64(1), args)
    args["x"].append(2)  # the driver reuses its arguments: the task keeps what was dispatched
    [[sent_id, eid, _, sent]] = st.outbox["w0"]
    assert (sent_id, eid, sent) == (tid, 1, {"x": [1]}) and type(eid) is int and st.inflight[tid].args == {"x": [1]}
    for bad in (True, np.bool_(False), 2, "0", 1.0):
        with pytest.raises(LitzError, match=r"dispatch_task: no executor .* \(executors are 0..1\)"):
            st.dispatch(bad, None)  # type: ignore[arg-type]
    with pytest.raises(LitzError, match="dispatch_task: the arguments of a task for executor 0 cannot be sent "
                                        r"\(TypeError: cannot pickle '_thread.lock' object\)"):
        st.dispatch(0, {"lock": threading.Lock()})
    assert list(st.inflight) == [tid]  # nothing of the refused tasks stays


def test_keys_and_deltas_that_are_not_what_they_seem_are_refused_naming_the_table() -> None:
    t = Table("t", (2,), num_rows=8)
    for keys, why in (("abc", "got the string 'abc'"), (5, "got int 5"), (None, "got NoneType None")):
        with pytest.raises(TableError, match=f"table 't': keys must be a list .*{re.escape(why)}"):
            t.check_keys(keys)
    assert t.check_keys(iter([1, 2])) == [1, 2] and t.check_keys(np.arange(3)) == [0, 1, 2]
    with pytest.raises(TableError, match=r"table 't': update is None, expected an array of shape \(2,\)"):
        t.check_delta(None)
    with pytest.raises(TableError, match=r"table 't': update is None, expected an array of shape \(3, 2\)"):
        t.check_delta(None, n=3)


def test_straggler_relief_moves_one_executor_at_a_time_until_the_rounds_even_out() -> None:
    """Without sockets: workers report each executor's total task run time and count there; each
    decision (every interval, with enough tasks measured on every worker holding executors) moves
    one executor from the longest round (the sum of its executors' times per task) to where it
    keeps the round shortest, if the job's longest round gets shorter by the factor. Equal workers
    never trade executors; a worker not measured yet holds the decision back."""
    from litz.runtime.stragglers import StragglerRelief, from_options

    relief = StragglerRelief(factor=1.25, interval=1.0, min_tasks=5)
    per_task = {"w0": 0.008, "w1": 0.002, "w2": 0.002}
    held = {"w0": [0, 1, 2, 3], "w1": [4, 5, 6, 7], "w2": []}  # w2 joined: its speed is not known yet
    totals = {(w, e): [0.0, 0] for w in per_task for e in range(8)}

    def run(seconds: float, now: float) -> tuple[int, str, str] | None:
        for w, eids in held.items():  # each worker runs its executors' tasks one after another
            for e in eids:
                ran = int(seconds / per_task[w] / len(eids))
                totals[w, e][0] += ran * per_task[w]
                totals[w, e][1] += ran
                relief.observe(w, e, *totals[w, e])
        return relief.decide(now, {w: list(eids) for w, eids in held.items()})

    assert run(0.5, 0.0) is None  # the first call starts the measure
    assert run(0.5, 0.5) is None  # too soon
    moves = []
    for now in range(1, 8):
        move = run(1.0, float(now))
        if move is not None:
            moves.append(move)
            held[move[1]].remove(move[0])
            held[move[2]].append(move[0])
    assert moves == [(3, "w0", "w1"), (2, "w0", "w1")] and held == {"w0": [0, 1], "w1": [4, 5, 6, 7, 3, 2], "w2": []}

    even = StragglerRelief(factor=1.25, interval=1.0, min_tasks=5)
    for now in range(5):
        for w, eids in (("a", range(4)), ("b", range(4, 9))):
            for e in eids:
                even.observe(w, e, now * 1.0, now * 100)
        assert even.decide(float(now), {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7, 8]}) is None  # as long a round on a
    waiting = StragglerRelief(factor=1.25, interval=1.0, min_tasks=5)
    waiting.observe("a", 0, 0.0, 0)
    assert waiting.decide(0.0, {"a": [0], "b": [1]}) is None
    waiting.observe("a", 0, 1.0, 10)  # b holds executors but never reported: no decision
    assert waiting.decide(2.0, {"a": [0], "b": [1]}) is None
    assert from_options({}) is None and from_options({"straggler_relief": True}).factor == 1.25
    with pytest.raises(ValueError, match="factor must be > 1"):
        from_options({"straggler_relief": 1.0})
    import litz
    from tests import testapps

    with pytest.raises(litz.ConfigError, match="straggler relief: the straggler factor must be > 1"):
        litz.run(testapps.straggler_app(2, 1.0, 0.0, 0.0), options={"straggler_relief": 0.5})  # before any start


def test_a_bad_straggler_setting_is_a_config_error_that_names_it() -> None:
    """Before: ``straggler_min_tasks`` inf raised a bare OverflowError from ``litz.run``, 2.9
    became 2, and a factor or interval of inf was taken (relief then never acted)."""
    import litz
    from litz.runtime.stragglers import from_options
    from tests import testapps

    inf = float("inf")
    for option, value, says in [("straggler_min_tasks", inf, "straggler_min_tasks must be a whole number >= 1"),
                                ("straggler_min_tasks", 2.9, "straggler_min_tasks must be a whole number >= 1"),
                                ("straggler_min_tasks", True, "straggler_min_tasks must be a whole number >= 1"),
                                ("straggler_interval", inf, "straggler_interval must be a finite number"),
                                ("straggler_interval", float("nan"), "straggler_interval must be a finite number"),
                                ("straggler_relief", inf, "straggler_relief=inf"),
                                ("straggler_relief", "2", "straggler_relief='2'")]:
        options = {"straggler_relief": True, option: value}
        with pytest.raises(litz.ConfigError, match=f"^straggler relief: .*{re.escape(says)}"):
            litz.run(testapps.straggler_app(2, 1.0, 0.0, 0.0), options=options)  # before any start
    relief = from_options({"straggler_relief": 2, "straggler_interval": 1, "straggler_min_tasks": 3.0})
    assert relief is not None and (relief.factor, relief.interval, relief.min_tasks) == (2.0, 1.0, 3)
    assert from_options({"straggler_relief": True, "straggler_min_tasks": 10**400}).min_tasks == 10**400


def _relieve(costs: list[float], speed: dict[str, Callable[[int], float]], rounds: int = 30
             ) -> tuple[list[tuple[int, str, str]], list[float], dict[int, str]]:
    """A bulk-synchronous job fed to straggler relief as the master feeds it: every round each
    executor runs one task, executor e's taking ``costs[e] * speed[w](round)`` on worker w; the
    executors start spread evenly, in order. The moves made, each round's longest worker time,
    and where the executors end."""
    from litz.runtime.stragglers import StragglerRelief

    workers = list(speed)
    place = {e: workers[e * len(workers) // len(costs)] for e in range(len(costs))}
    relief = StragglerRelief(factor=1.25, interval=1.0, min_tasks=1)
    totals: dict[tuple[str, int], list[float]] = {}
    relief.decide(0.0, {})
    moves, longest = [], []
    for r in range(rounds):
        took = {e: costs[e] * speed[w](r) for e, w in place.items()}
        longest.append(max(sum(t for e, t in took.items() if place[e] == w) for w in workers))
        for e, w in place.items():
            total = totals.setdefault((w, e), [0.0, 0])
            total[0] += took[e]
            total[1] += 1
            relief.observe(w, e, total[0], int(total[1]))
        move = relief.decide(r + 1.0, {w: [e for e, x in place.items() if x == w] for w in workers})
        if move is not None:
            moves.append(move)
            place[move[0]] = move[2]
            relief.restart(r + 1.0)
    return moves, longest, place


def test_straggler_relief_does_not_move_costly_executors_between_workers_of_one_speed() -> None:
    """Executors may differ in cost (a bigger partition). Relief judged a worker's speed by its
    mean time per task, so the worker holding a costly executor looked slow: with costs 1, 1, 1
    and 5 on three equal workers the costly executor moved at every decision (30 moves in 30),
    and with costs 1 and 5 on two it moved onto the other worker, whose round went from 1 to 6
    (the job's from 5 to 6), leaving a worker empty. Each executor's own time decides now."""
    def equal(_: int) -> float:
        return 1.0

    moves, longest, _ = _relieve([1, 1, 1, 5], {"w0": equal, "w1": equal, "w2": equal})
    assert moves == [] and max(longest) == 5
    moves, longest, place = _relieve([1, 5], {"w0": equal, "w1": equal})
    assert moves == [] and max(longest) == 5 and set(place.values()) == {"w0", "w1"}
    rng = random.Random(7)
    for _ in range(300):  # equal workers, executors of random costs: no executor moves twice, no round grows
        workers = rng.choice([2, 3, 4])
        costs = [rng.choice([1, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(workers, 10))]
        moves, longest, _ = _relieve(costs, dict.fromkeys((f"w{i}" for i in range(workers)), equal))
        assert len({e for e, _, _ in moves}) == len(moves) and max(longest[1:], default=0) <= longest[0], (costs, moves)


def test_straggler_relief_moves_the_executor_whose_move_shortens_the_longest_round() -> None:
    """Equal workers, costs 2, 2, 4 on w0 and 1, 1, 1 on w1 (rounds 8 and 3): moving executor 1
    gives 6 and 5; moving executor 2, the one the master used to take (the highest), would give 4
    and 7. Off a worker 4 times slower (costs all 1, rounds 12, 3 and 3) executors still move."""
    def equal(_: int) -> float:
        return 1.0

    moves, longest, _ = _relieve([2, 2, 4, 1, 1, 1], {"w0": equal, "w1": equal})
    assert moves == [(1, "w0", "w1")] and longest[-1] == 6
    moves, longest, place = _relieve([1] * 9, {"w0": lambda _: 4.0, "w1": equal, "w2": equal})
    assert [m[1] for m in moves] == ["w0"] and longest[0] == 12 and longest[-1] == 8


def test_straggler_relief_gives_a_worker_executors_back_once_it_is_fast_again() -> None:
    """w0 is 10 times slower for the first 5 rounds only (a host busy with another job for a
    while). Its executors moved off it while it was slow; relief emptied it and, measuring a
    worker only while it held executors, kept its slow time for good: it never took one back and
    w1 ran all four. Now w0 keeps its last executor, and takes one back once it is fast again."""
    moves, longest, place = _relieve([1, 1, 1, 1], {"w0": lambda r: 10.0 if r < 5 else 1.0, "w1": lambda _: 1.0})
    assert moves == [(1, "w0", "w1"), (3, "w1", "w0")], moves
    assert sorted(place.values()) == ["w0", "w0", "w1", "w1"] and longest[-1] == 2
