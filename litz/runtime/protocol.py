"""Every message Litz processes exchange, declared once, and their wire encoding.

A message travels as ZeroMQ frames: frame 0 is a msgpack header ``[type, {field: value}]``;
every numpy array inside the fields is replaced in the header by a small msgpack extension
(dtype, shape, frame index) and its bytes travel as a frame of their own, sent and received
without a copy. Nothing on the hot path is pickled; only values that are neither msgpack
types nor arrays (rare: a user's odd task argument) fall back to cloudpickle.

``decode`` validates the type and the fields, so a malformed or unknown message raises
``ProtocolError`` with a reason, which receivers log and drop; they never die of it. A pickled
value that does not load where it arrives (its class is not importable there, say) would drop
the whole message that way, and with it every task or completion it carried: in the messages
that carry a user's task arguments and results (``TOLERANT``) it becomes an :class:`Undecodable`
instead, which the receiver reports as that one task's failure.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import msgpack
import numpy as np

from litz.errors import ProtocolError

_EXT_ARRAY = 1
_EXT_PICKLE = 2
_EXT_TUPLE = 3
#: Any Python ``str`` travels as it is, lone surrogates included (``os.fsdecode`` makes those of
#: file names that are not UTF-8): strict UTF-8 raised in the sender, naming nothing.
_TEXT_ERRORS = "surrogatepass"

# A field's expected kind: a tuple of accepted Python types ("any" accepts anything).
_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "bytes": (bytes,),
    "list": (list, tuple),
    "dict": (dict,),
    "array": (np.ndarray,),
    "bool": (bool,),
    "float": (float, int),
    "any": (object,),
}


@dataclass(frozen=True)
class MessageType:
    """A message type: its name and its fields (name -> kind); fields ending in '?' are optional."""

    name: str
    fields: dict[str, str]

    def required(self) -> list[str]:
        return [f for f in self.fields if not f.endswith("?")]


@dataclass
class Message:
    """A decoded message: its type name, its fields, and the id of the peer that sent it
    (``undecodable``: why values in it did not load, each now an :class:`Undecodable`)."""

    type: str
    fields: dict[str, Any]
    sender: str = ""
    undecodable: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def _declare(*types: MessageType) -> dict[str, MessageType]:
    return {t.name: t for t in types}


#: The protocol. Adding a message means adding it here, and nowhere else.
MESSAGES: dict[str, MessageType] = _declare(
    # master -> server: the tables and the logical shards it hosts
    # ("restore": {"location", "path"} of a checkpoint to load the shards' rows from; "checkpoints":
    # the job takes some, "partial": partial ones, which score rows against what each row last saved)
    MessageType("init_server", {"tables": "bytes", "shards": "list", "num_shards": "int", "master": "str",
                                "restore?": "dict", "checkpoints?": "bool", "partial?": "bool"}),
    # master -> worker: the application, the executors it hosts, the shard map and its peers
    MessageType(
        "init_worker",
        {
            "app": "bytes",
            "tables": "bytes",
            "executors": "list",
            "num_executors": "int",
            "num_shards": "int",
            "shard_map": "list",
            "peers": "dict",
            "options": "dict",
            "master": "str",
            "restore?": "dict",  # a checkpoint to load the executors' states from
        },
    ),
    # any process -> master: initialised (or failed to with "error")
    MessageType("ready", {"role": "str", "error?": "str"}),
    # master -> worker: micro-tasks, each [task_id, executor_id, version, args]
    MessageType("tasks", {"tasks": "list"}),
    # worker -> master: finished tasks [task_id, result] and failed ones [task_id, traceback];
    # "busy": [[executor, seconds its tasks have run here in all, how many ran], ...] (straggler relief)
    MessageType("done", {"completed": "list", "failed": "list", "busy?": "list"}),
    # worker/master -> server: read rows; items are [table, keys]
    MessageType("get", {"rid": "int", "items": "list"}),
    # server -> requester: one stacked array per item, or an error per item
    MessageType("get_reply", {"rid": "int", "values": "list", "errors": "list", "moved?": "dict"}),
    # worker -> server: apply updates; items are [table, keys, stacked deltas]; "low": the lowest
    # rid of the worker's updates still unanswered. Forwarded by a server, or sent again after a
    # server died, with "origin": [worker, its rid, its low], so that none is applied twice
    MessageType("update", {"rid": "int", "items": "list", "low?": "int", "origin?": "list"}),
    # server -> worker: updates applied (errors name the item that was refused)
    MessageType("update_ack", {"rid": "int", "errors": "list", "moved?": "dict"}),
    # a receiver could not process a message: the reason, and the request id if it had one
    MessageType("error", {"reason": "str", "rid?": "int", "about?": "str"}),
    # master -> any: finish; reply "bye" with counters
    MessageType("shutdown", {"reason": "str", "settle?": "bool"}),
    MessageType("bye", {"stats": "dict"}),
    # master -> any: send your counters now (benchmarks)
    MessageType("stats_request", {"rid": "int"}),
    MessageType("stats", {"rid": "int", "stats": "dict"}),
    # -- executor migration (DESIGN.md §4) --
    # master -> source worker: finish these executors' running tasks, then ship them to dest
    MessageType("migrate_out", {"mid": "int", "executors": "list", "dest": "str", "ship_input": "bool",
                                "dest_addr?": "str"}),
    # source worker -> master: the executors of migration mid are idle and every completion they
    # ran here was reported before this message (same connection, so the master has them all
    # once it handles this one in order); these queued tasks will leave with them
    MessageType("ship_ready", {"mid": "int", "tasks": "list"}),
    # master -> source worker: ship them now (the master handled every completion reported before)
    MessageType("ship", {"mid": "int"}),
    # source -> dest worker: [executor_id, state, input or None, queued tasks, saved rows or None]
    # per executor; state, input and saved rows are [pickle bytes, out-of-band buffers]
    MessageType("executor_state", {"mid": "int", "executors": "list", "source": "str"}),
    # dest worker -> master: the executors of migration mid run here now
    MessageType("migrated", {"mid": "int", "executors": "list"}),
    # -- shard migration with forwarding --
    # master -> source server: send these shards to dest, then forward their requests there
    MessageType("migrate_shards", {"mid": "int", "shards": "list", "dest": "str", "dest_addr?": "str"}),
    # source -> dest server: [table, shard, keys, stacked rows] per non-empty table of the shards;
    # "saved": [table, keys, stacked copies, rounds] of the rows' copies as last saved (partial
    # checkpoints score rows against them); "staged": undo entries of rounds still open;
    # "scored": [shard, round] of the shards a partial round already scored on the source;
    # "once": [worker, rid, table, shard, keys] of forwarded or resent updates applied (AppliedOnce)
    MessageType("shard_data", {"mid": "int", "shards": "list", "data": "list", "source": "str", "saved?": "list",
                               "staged?": "list", "scored?": "list", "once?": "list"}),
    # dest server -> master: the shards of migration mid are served here now
    MessageType("shards_moved", {"mid": "int", "shards": "list"}),
    # master -> workers and servers: the servers in "gone" hold no shard any more; route by
    # shard_map instead of them, ignore hints naming them, and answer once nothing is pending there
    MessageType("routes", {"rid": "int", "shard_map": "list", "gone": "list"}),
    MessageType("routes_ack", {"rid": "int"}),
    # -- SCAR partial recovery (DESIGN.md §5) --
    # master -> the surviving end of a migration whose other end died (sent after the fence, so
    # the answer is final): do you hold its items? A destination holds them if they arrived; a
    # source if it had not shipped them yet, and it then keeps them (the migration is cancelled)
    MessageType("settle", {"mid": "int", "kind": "str", "items": "list"}),
    MessageType("settled", {"mid": "int", "holds": "bool"}),
    # master -> every live worker and server: this process was declared lost (it may only have
    # stalled past its lease); never accept another message from it
    MessageType("fence", {"ident": "str"}),
    # master -> surviving server: host these shards of a dead server, rows from the checkpoint
    MessageType("restore_shards", {"shards": "list", "restore?": "dict", "round?": "int"}),
    # (answered with "error", and nothing hosted, when the checkpoint storage failed to answer:
    # the master asks again until --checkpoint-timeout)
    MessageType("shards_restored", {"shards": "list", "round?": "int", "error?": "str"}),
    # master -> workers and servers, once its shards are restored: route around the dead
    # server and send again every request it never answered
    MessageType("server_lost", {"server": "str", "shard_map": "list"}),
    # master -> surviving worker: host these executors of a dead worker, their states from
    # the checkpoint (fresh ones if there is none); input is reloaded
    MessageType("restore_executors", {"executors": "list", "restore?": "dict", "round?": "int"}),
    MessageType("executors_restored", {"executors": "list", "round?": "int", "error?": "str"}),
    # -- full recovery: everything rolls back to the last consistent checkpoint (DESIGN.md §5) --
    # master -> surviving workers: stop every task, drop executors, queued tasks, update log and
    # cache; answer rolled_back once every update already sent to a live server was acknowledged
    # (so no update of the abandoned timeline can reach a server after it reloads)
    # ("abandoned": migrations up to this id are abandoned; what still arrives of them is dropped)
    # master -> surviving servers (no answer): parts of requests forwarded to the lost servers,
    # and any forwarded there from now on, count as answered (the timeline is abandoned)
    MessageType("rollback", {"lost": "list", "round": "int", "abandoned?": "int"}),
    MessageType("rolled_back", {"round": "int"}),
    # master -> servers: serve exactly these shards, rows from the checkpoint (fresh without one)
    MessageType("reload_shards", {"shards": "list", "round": "int", "restore?": "dict", "abandoned?": "int"}),
    # master -> workers: host exactly these executors, states from the checkpoint, route by shard_map
    MessageType("reload_executors", {"executors": "list", "shard_map": "list", "lost": "list", "round": "int",
                                       "restore?": "dict"}),
    # answers carry the round: a later loss restarts it ("error": the checkpoint storage failed to
    # answer; the master asks again until --checkpoint-timeout)
    MessageType("reloaded", {"round": "int", "error?": "str"}),
    # master -> every worker after a full recovery: route by exactly this map (the servers reloaded
    # their shards and dropped the forwards that an older map, one a joining worker got at its
    # start, relied on)
    MessageType("shard_map", {"shard_map": "list"}),
    # -- checkpoints (DESIGN.md §5) --
    # master -> workers and servers (all tasks completed, none running): copy your state in
    # memory, answer checkpoint_snapshot at once, then write it under path and answer
    # checkpoint_written with the files (or the error)
    MessageType("checkpoint", {"cid": "int", "location": "str", "path": "str"}),
    MessageType("checkpoint_snapshot", {"cid": "int"}),
    MessageType("checkpoint_written", {"cid": "int", "files": "list", "error?": "str"}),
    # SCAR partial checkpoints: master -> servers, score your rows, and -> workers, score your
    # executors' state rows (each between two of the executor's tasks); the master picks the top
    # fraction of the servers' rows and of the workers' rows, and asks each process to save its
    # chosen rows (positions in its scored list)
    MessageType("ckpt_scores", {"cid": "int", "policy": "str"}),
    MessageType("ckpt_scores_reply", {"cid": "int", "scores": "array", "error?": "str"}),
    MessageType("ckpt_save", {"cid": "int", "location": "str", "path": "str", "rows": "list"}),
    # master -> workers and servers, as a round ends: complete or failed. What a process copied for
    # it counts as saved (partial rounds score rows against it) only once the round is complete
    MessageType("checkpoint_done", {"cid": "int", "ok": "bool"}),
)


#: Message types only the job's master sends to a worker or server: commands that set up, move,
#: recover, checkpoint or end what a process holds. ``Node`` refuses one from anyone else (logged,
#: naming the type and the sender), and an init once it has been initialised: a second
#: ``init_server`` emptied a server's shards, a second ``init_worker`` made its executors afresh.
#: (Not ``tasks``: a worker forwards the late tasks of an executor that left it; nor
#: ``stats_request``, which only reads counters.)
INITS = frozenset({"init_server", "init_worker"})
FROM_MASTER = INITS | frozenset({
    "shutdown", "fence", "migrate_out", "ship", "migrate_shards", "routes", "settle", "restore_shards",
    "server_lost", "restore_executors", "rollback", "reload_shards", "reload_executors", "shard_map",
    "checkpoint", "ckpt_scores", "ckpt_save", "checkpoint_done",
})


def pack_object(obj: Any) -> list[Any]:
    """Pickle an object (executor state or input) with its large buffers out of band.

    Returns ``[pickle_bytes, [uint8 arrays]]``: numpy arrays inside ``obj`` travel as frames of
    their own, without being copied into the pickle.
    """
    buffers: list[Any] = []
    data = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [data, [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]]


def unpack_object(packed: list[Any]) -> Any:
    """Inverse of ``pack_object``; arrays come back writable (received frames are read-only: copied once)."""
    data, buffers = packed
    return cloudpickle.loads(data, buffers=[b if b.flags.writeable else b.copy() for b in buffers])


class _Pickled:
    """An object pickled already (by :func:`snapshot`): sent as the pickle it was then."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def snapshot(value: Any, *, pickle: bool = True) -> Any:
    """``value`` as it is now, for a message sent later: arrays copied, lists, tuples and dicts
    rebuilt, any other object pickled now (or, not ``pickle``, deep-copied), so that it raises now
    if it cannot be sent. A task's result waits for its updates' acknowledgement before it leaves,
    and meanwhile the executor's next task may change what it returned (its own state, say); a
    driver may reuse the arguments it dispatched (which it gets back with the result, so those
    stay objects: deep copies)."""
    if isinstance(value, (str, bytes, int, float, bool, type(None), np.generic)):
        return value
    if isinstance(value, np.ndarray):
        return value.copy()
    if type(value) is list:
        return [snapshot(v, pickle=pickle) for v in value]
    if type(value) is tuple:
        return tuple(snapshot(v, pickle=pickle) for v in value)
    if type(value) is dict:
        return {k: snapshot(v, pickle=pickle) for k, v in value.items()}
    return _Pickled(cloudpickle.dumps(value)) if pickle else copy.deepcopy(value)


class Undecodable:
    """Stands for a pickled value that did not load where it arrived (``error`` says why), in a
    message of the ``TOLERANT`` types: the receiver fails that task, naming it, instead of the
    whole message being dropped (a job that then waits for ever)."""

    def __init__(self, error: str) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<undecodable value: {self.error}>"


#: Message types whose undecodable values are handed over as :class:`Undecodable` (a user's task
#: arguments and results travel in them); in any other, one makes the message malformed.
TOLERANT = frozenset({"tasks", "done"})


def undecodable_in(value: Any) -> Undecodable | None:
    """The first :class:`Undecodable` in ``value`` (through lists, tuples and dicts), else None."""
    if isinstance(value, Undecodable):
        return value
    if isinstance(value, (list, tuple)):
        items: Any = value
    elif isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    else:
        return None
    return next((u for u in map(undecodable_in, items) if u is not None), None)


class _Packer:
    """Collects the array frames of one message while msgpack walks its fields."""

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def default(self, obj: Any) -> Any:
        """msgpack's hook for what it does not pack itself (``strict_types``: subclasses of its types
        come here too). Only what arrives as exactly what was sent is packed natively: a plain or
        memory-mapped ndarray of numbers as a raw frame, a plain tuple, a NumPy scalar whose
        ``item()`` is a msgpack type. Everything else is pickled, so that it keeps its type: an
        object array (its frame would be pointers, meaningless in another process), a structured
        one (a raw frame dropped its fields), a masked array (its mask), a namedtuple (its class),
        a datetime64 or complex scalar (msgpack refused their ``item()``, failing the message)."""
        kind = type(obj)
        if (kind is np.ndarray or kind is np.memmap) and not obj.dtype.hasobject and obj.dtype.fields is None:
            arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            self.frames.append(arr)
            meta = msgpack.packb([arr.dtype.str, list(arr.shape), len(self.frames)])
            return msgpack.ExtType(_EXT_ARRAY, meta)
        if isinstance(obj, np.generic):
            value = obj.item()
            if type(value) in _NATIVE_SCALARS:
                return value
        elif kind is tuple:
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(list(obj), default=self.default, strict_types=True,
                                                             unicode_errors=_TEXT_ERRORS))  # (a tuple in it too)
        elif kind is _Pickled:
            return msgpack.ExtType(_EXT_PICKLE, obj.data)
        return msgpack.ExtType(_EXT_PICKLE, cloudpickle.dumps(obj))


# the types a NumPy scalar's ``item()`` may give that msgpack packs as themselves
_NATIVE_SCALARS = (bool, int, float, str, bytes)


def encode(type_name: str, **fields: Any) -> list[Any]:
    """Encode a message into frames ready for ``send_multipart(copy=False)``."""
    mtype = MESSAGES.get(type_name)
    if mtype is None:
        raise ProtocolError(f"cannot send unknown message type {type_name!r}")
    missing = [f for f in mtype.required() if f not in fields]
    if missing:
        raise ProtocolError(f"message {type_name!r} lacks field(s) {missing}")
    packer = _Packer()
    header = msgpack.packb([type_name, fields], default=packer.default, strict_types=True,
                           unicode_errors=_TEXT_ERRORS)
    return [header, *packer.frames]


def _buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _declared_type(header: Any) -> None:
    """Refuse a header that does not name a declared message type, reading only its first bytes:
    fields may hold pickles, and none may be unpickled for a message no process ever takes.
    ``encode`` makes ``[type, fields]``, a msgpack array of two (0x92) whose first item is a short
    string; anything else is malformed, and is decoded only to say how, with nothing unpickled."""
    raw = memoryview(header)
    if len(raw) >= 2 and raw[0] == 0x92 and (0xA0 <= raw[1] <= 0xBF or raw[1] == 0xD9):
        start, size = (2, raw[1] & 0x1F) if raw[1] != 0xD9 else (3, raw[2] if len(raw) > 2 else 0)
        try:
            name: Any = bytes(raw[start:start + size]).decode()
        except UnicodeDecodeError:
            name = bytes(raw[start:start + size])
        if name not in MESSAGES:
            raise ProtocolError(f"unknown message type {name!r}")
        return
    try:
        decoded = msgpack.unpackb(raw, ext_hook=lambda code, data: None, strict_map_key=False,
                                  unicode_errors=_TEXT_ERRORS)
    except Exception as exc:  # msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable header ({type(exc).__name__}: {exc})") from None
    if not (isinstance(decoded, list) and len(decoded) == 2 and isinstance(decoded[1], dict)):
        raise ProtocolError("header is not [type, fields]")
    if isinstance(decoded[0], str) and decoded[0] in MESSAGES:
        raise ProtocolError(f"header of a {decoded[0]!r} message is not laid out as Litz encodes one")
    raise ProtocolError(f"unknown message type {decoded[0]!r}")


def decode(frames: list[Any], sender: str = "") -> Message:
    """Decode and validate frames (zmq Frames or bytes) into a Message; raise ProtocolError if bad.
    The type is checked before any field is decoded (``_declared_type``)."""
    if not frames:
        raise ProtocolError("empty message")
    buffers = [_buffer(f) for f in frames]
    _declared_type(buffers[0])
    problems: list[str] = []

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_ARRAY:
            dtype, shape, idx = msgpack.unpackb(data)
            if not (isinstance(idx, int) and 0 < idx < len(buffers)):
                raise ProtocolError(f"array refers to missing frame {idx!r}")
            arr = np.frombuffer(buffers[idx], dtype=np.dtype(dtype))
            return arr.reshape(shape)
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False,
                                         unicode_errors=_TEXT_ERRORS))
        if code == _EXT_PICKLE:
            try:
                return cloudpickle.loads(data)
            except Exception as exc:  # kept apart: which message may carry one is decided below
                problems.append(f"{type(exc).__name__}: {exc}")
                return Undecodable(problems[-1])
        raise ProtocolError(f"unknown extension type {code}")

    try:
        decoded = msgpack.unpackb(buffers[0], ext_hook=ext_hook, strict_map_key=False,
                                  unicode_errors=_TEXT_ERRORS)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable header ({type(exc).__name__}: {exc})") from None
    if not (isinstance(decoded, list) and len(decoded) == 2 and isinstance(decoded[1], dict)):
        raise ProtocolError("header is not [type, fields]")
    type_name, fields = decoded
    mtype = MESSAGES.get(type_name) if isinstance(type_name, str) else None
    if mtype is None:
        raise ProtocolError(f"unknown message type {type_name!r}")
    if problems and type_name not in TOLERANT:
        raise ProtocolError(f"a pickled value of a {type_name!r} message does not load here ({problems[0]})")
    for name, kind in mtype.fields.items():
        key = name.rstrip("?")
        if key not in fields:
            if not name.endswith("?"):
                raise ProtocolError(f"message {type_name!r} lacks field {key!r}")
            continue
        if not isinstance(fields[key], _KINDS[kind]) or (kind == "int" and isinstance(fields[key], bool)):
            raise ProtocolError(
                f"message {type_name!r} field {key!r} should be {kind}, got {type(fields[key]).__name__}"
            )
    return Message(type_name, fields, sender, problems)
