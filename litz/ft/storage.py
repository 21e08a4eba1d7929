"""Checkpoint files on shared storage, through pyarrow's filesystem layer (DESIGN.md §5).

A checkpoint is a directory ``<root>/ckpt-<seq>`` holding one Arrow IPC file of shard rows
per server, one of executor states per worker, the driver's pickled state, and
``MANIFEST.json``. A partial (SCAR) checkpoint names its full base (``partial_of``) and holds
only the rows it saved: shard rows per server and rows of executor state per worker
(``executor_rows_files``, for executors that define ``state_rows``). The manifest is written
last, under a temporary name and then moved into place, so a checkpoint exists only once it
is complete: a directory without a manifest (a crash while writing) is never used.

``root`` is a local path or any URI pyarrow understands (``file://``, ``s3://``, ``hdfs://``;
a move on S3 is a copy, so there the manifest's atomicity is that of a single PUT).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import queue
import re
import threading
import urllib.parse
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from litz.api import StateRows
from litz.errors import LitzError

MANIFEST = "MANIFEST.json"
#: In a checkpoint root: which of its checkpoints the run that last started (or rolled back) there
#: goes on from, for ``--resume auto`` (:func:`write_timeline`).
TIMELINE = "TIMELINE.json"
FORMAT = 1
_CKPT = re.compile(r"^ckpt-(\d{6,})$")
log = logging.getLogger(__name__)

SHARD_SCHEMA = pa.schema([("table", pa.string()), ("shard", pa.int32()), ("ikey", pa.int64()),
                          ("skey", pa.string()), ("row", pa.large_binary())])
EXECUTOR_SCHEMA = pa.schema([("executor", pa.int32()), ("state", pa.large_binary())])
# rows of executor state saved by a partial checkpoint (``Executor.state_rows``)
EXECUTOR_ROWS_SCHEMA = pa.schema([("executor", pa.int32()), ("row", pa.int64()), ("dtype", pa.string()),
                                  ("values", pa.large_binary())])


class CheckpointError(LitzError):
    """A checkpoint that cannot be written or used (missing manifest, mismatching job, storage
    that cannot be read, ...)."""


class NoCheckpoint(CheckpointError):
    """No complete checkpoint where one was looked for: a job without one starts afresh. Kept
    apart from storage that cannot be read, which must never be taken for an empty one (a full
    recovery would go back to the job's beginning)."""


class DamagedCheckpoint(CheckpointError):
    """A manifest that was read but cannot be used (not JSON, another format, keys missing): that
    checkpoint is skipped, the ones before it are as good as they were."""


def filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of a checkpoint root (a local path or a URI)."""
    try:
        if "://" in root:
            return pafs.FileSystem.from_uri(root)
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(root))
    except (pa.ArrowInvalid, OSError) as exc:
        raise CheckpointError(redact(f"cannot open checkpoint storage {root!r}: {exc}")) from exc


#: A URI's user part, as ``urllib.parse.urlsplit`` and pyarrow read one: after ``scheme://``, up to
#: the last ``@`` before the path, query or fragment (``KEY:SECRET@``). Else, one that holds a
#: ``/`` left unescaped (AWS secret keys often do; pyarrow then refuses the URI, quoting it):
#: ``user:`` (not a port) up to the last ``@`` before the query. Never past a space or a quote,
#: so that it applies to a message naming URIs too.
# (an authority that starts with ``[`` is an IPv6 host, ``[::1]:8020``, not a user part)
_USER_PART = re.compile(r"""(?<=://)(?:[^/?#\s'"]*@|(?!\[)[^/?#@\s'"]*:(?!\d*(?:[/?#\s'"]|$))[^?#\s'"]*@)""")


def redact(text: str) -> str:
    """``text`` (a checkpoint location, local path or URI, or a message that names some) as it may
    be shown: each URI's user part (``s3://KEY:SECRET@bucket/...``) left out, the rest as given.
    Every message, log line and reply that names a location goes through it: the URI travels in
    command lines and job options, but what Litz prints must not spread credentials (README:
    "Litz leaves a URI's user part out of what it prints"). A text, not a parse: it never raises,
    even on a URI that pyarrow refuses (whose error quotes it)."""
    return _USER_PART.sub("", text) if "://" in text else text


@functools.lru_cache(maxsize=32)
def _uri_root(location: str) -> str:
    """The filesystem path of a URI's root, once per URI: the master names checkpoints on its loop,
    and making an S3 filesystem may ask the network for the bucket's region."""
    return filesystem(location)[1]


def display(location: str, path: str) -> str:
    """How to name the checkpoint directory ``path`` (a path of ``location``'s filesystem) to a user:
    what ``--resume`` takes. A local path as it is; under a URI, the same scheme, host and query
    around it (``s3://bucket/ckpt/ckpt-000004?endpoint_override=...``): the bare ``bucket/ckpt/...``
    would be read as a local path. A user part (``s3://KEY:SECRET@...``) is left out, never echoed
    into logs and replies; credentials belong in the environment, where pyarrow reads them."""
    if "://" not in location:
        return path
    parts = urllib.parse.urlsplit(redact(location))
    try:
        root = _uri_root(location)
    except CheckpointError:
        return path
    if not path.startswith(root):  # not under this root: name the filesystem, not a made-up place
        return f"{parts.scheme}://{path}"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path[len(root.rstrip("/")):],
                                    parts.query, ""))


def warm_up() -> None:
    """Initialise Arrow's IPC writer and reader (about 0.3 s the first time in a process).

    Processes of a job that checkpoints call it on a thread when they start, so that the first
    checkpoint does not pay it while training waits for the round to complete."""
    table = pa.table({"k": pa.array([0], pa.int64()), "v": pa.array([b""], pa.binary())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    pa.ipc.open_file(sink.getvalue()).read_all()


def _not_public(fs: pafs.FileSystem, path: str) -> None:
    """Take the group's and every user's write permission off the local file or directory ``path``
    just made, if it has them (one that existed before keeps its mode when it is opened):
    :func:`refuse_checkpoint_public` refuses to resume from such a checkpoint (others could replace
    its pickles). Other stores have their own access control."""
    if isinstance(fs, pafs.LocalFileSystem):
        mode = os.stat(path).st_mode
        if mode & 0o022:
            os.chmod(path, mode & 0o7755)


def _create_private(fs: pafs.FileSystem, path: str) -> None:
    """Create the local file ``path`` empty and readable and writable by its owner alone, whatever
    the umask, before pyarrow opens it (which keeps the mode of a file that exists). Made ``o+w``
    under a umask of 0 and only then chmodded (:func:`_not_public`), a file could be opened for
    writing by anyone in between, and such a descriptor stays writable after the chmod. Not
    readable by others either: a checkpoint holds the whole model and the driver's state."""
    if isinstance(fs, pafs.LocalFileSystem):
        with contextlib.suppress(FileExistsError):  # (one that exists keeps its mode: ours, or not a file)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _write_table(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    _create_private(fs, path)
    with fs.open_output_stream(path) as out, pa.ipc.new_file(out, table.schema) as writer:
        writer.write_table(table)
    _not_public(fs, path)


def _read_table(fs: pafs.FileSystem, path: str) -> pa.Table:
    try:
        with fs.open_input_file(path) as f:
            return pa.ipc.open_file(f).read_all()
    except pa.ArrowInvalid as exc:  # (before OSError: Arrow's errors may derive from it)
        raise DamagedCheckpoint(f"cannot read checkpoint file {path}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc


def store_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is checkpoint storage failing to answer (worth asking again: a network
    store's outage, a file a moment away), not a checkpoint that is missing or damaged."""
    return isinstance(exc, CheckpointError) and not isinstance(exc, NoCheckpoint | DamagedCheckpoint)


def write_shards(fs: pafs.FileSystem, path: str,
                 rows: Iterable[tuple[str, int, Hashable, np.ndarray]]) -> int:
    """Write ``(table, shard, key, row)`` tuples; rows keep their exact bytes. Returns the row count."""
    cols: dict[str, list[Any]] = {name: [] for name in SHARD_SCHEMA.names}
    for table, shard, key, row in rows:
        cols["table"].append(table)
        cols["shard"].append(shard)
        cols["ikey"].append(key if isinstance(key, int) else None)
        cols["skey"].append(None if isinstance(key, int) else str(key))
        cols["row"].append(np.ascontiguousarray(row).tobytes())
    _write_table(fs, path, pa.table(cols, schema=SHARD_SCHEMA))
    return len(cols["row"])


def read_shards(fs: pafs.FileSystem, path: str) -> list[tuple[str, int, Hashable, bytes]]:
    t = _read_table(fs, path).to_pydict()
    return [(name, shard, ikey if ikey is not None else skey, row)
            for name, shard, ikey, skey, row in zip(t["table"], t["shard"], t["ikey"], t["skey"], t["row"],
                                                    strict=True)]


def write_executors(fs: pafs.FileSystem, path: str, states: dict[int, bytes]) -> None:
    _write_table(fs, path, pa.table({"executor": list(states), "state": list(states.values())},
                                    schema=EXECUTOR_SCHEMA))


def read_executors(fs: pafs.FileSystem, path: str) -> dict[int, bytes]:
    t = _read_table(fs, path).to_pydict()
    return dict(zip(t["executor"], t["state"], strict=True))


def write_executor_rows(fs: pafs.FileSystem, path: str, parts: Iterable[tuple[int, np.ndarray, StateRows]]) -> int:
    """Write, per executor, the rows ``chosen`` of its ``StateRows`` (exact bytes): ``parts`` are
    ``(executor, chosen, rows)``. Built from the arrays without a loop over rows (a partial round
    saves thousands; the write runs beside training). Returns the row count."""
    tables = []
    for eid, chosen, rows in parts:
        chosen = np.unique(np.asarray(chosen, np.int64))  # sorted: the mask below keeps row order
        lengths = np.diff(rows.ptr)[chosen]
        data = np.ascontiguousarray(rows.values[rows.values_of(chosen)])
        offsets = np.concatenate([[0], np.cumsum(lengths * data.itemsize)]).astype(np.int64)
        values = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(chosen), [None, pa.py_buffer(offsets),
                                                                                   pa.py_buffer(data.view(np.uint8))])
        tables.append(pa.table({"executor": pa.array(np.full(len(chosen), eid, np.int32)), "row": pa.array(chosen),
                                "dtype": pa.repeat(pa.scalar(data.dtype.str), len(chosen)), "values": values},
                               schema=EXECUTOR_ROWS_SCHEMA))
    table = pa.concat_tables(tables) if tables else EXECUTOR_ROWS_SCHEMA.empty_table()
    _write_table(fs, path, table)
    return table.num_rows


def read_executor_rows(fs: pafs.FileSystem, path: str, executors: set[int]) -> dict[int, dict[int, np.ndarray]]:
    """The rows of ``executors`` in a file written by ``write_executor_rows``: executor -> row -> values."""
    t = _read_table(fs, path).to_pydict()
    out: dict[int, dict[int, np.ndarray]] = {}
    for eid, row, dtype, raw in zip(t["executor"], t["row"], t["dtype"], t["values"], strict=True):
        if eid in executors:
            out.setdefault(eid, {})[row] = np.frombuffer(raw, dtype=np.dtype(dtype)).copy()
    return out


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    _create_private(fs, path)
    with fs.open_output_stream(path) as out:
        out.write(data)
    _not_public(fs, path)


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc


def refuse_public(location: str) -> None:
    """Refuse a local checkpoint directory that another user owns, or that every user may write
    (``o+w``, sticky or not): its checkpoints hold pickles (the driver's state, executors' states)
    that ``--resume`` and a full recovery load, so its owner, or anyone, could plant a newer
    checkpoint, or replace a file, and have the job run their code (``--resume auto`` in a
    directory someone else made first under ``/tmp`` did). Root may own it (``/srv/ckpt`` made for
    the user). A missing directory is made later, the user's own and not ``o+w``
    (:func:`prepare_root`). Network stores (S3) have their own access control. The checkpoint
    chosen in it is checked as well (:func:`refuse_checkpoint_public`)."""
    fs, root = filesystem(location)
    if not isinstance(fs, pafs.LocalFileSystem):
        return
    shown = redact(location)
    why = _untrusted(root, group_may_write=True, owners=_owners_of_ours(root))
    if why is not None:
        raise CheckpointError(f"checkpoint directory {shown} {why}: its checkpoints hold pickles that --resume loads, "
                              f"so {'anyone' if 'every user' in why else 'its owner'} could make the job run their "
                              f"code; use a directory of yours"
                              + (f", or chmod o-w {shown}" if "every user" in why else ""))


def _owners_of_ours(root: str) -> frozenset[int]:
    """The owners a file of this user may have under the local ``root``: this user, root, and the
    owner the filesystem gives a file this process creates there, found by making one (NFS with
    ``root_squash`` makes root's files nobody's; a store mapping users elsewhere, another uid).
    Where this process may not create a file (a directory someone else made), only the first two:
    what another user planted there is theirs."""
    owners = {os.geteuid(), 0}
    probe = f"{root}/.litz-owner-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return frozenset(owners)
    try:
        owners.add(os.fstat(fd).st_uid)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return frozenset(owners)


def _untrusted(path: str, *, group_may_write: bool, owners: frozenset[int] | None = None) -> str | None:
    """Why the job must not load what the local ``path`` holds (a phrase: ``belongs to …``, ``is
    writable by …``), or None: it is missing (what is missing is reported by whoever needs it), or
    it belongs to one of ``owners`` (by default this user and root; :func:`_owners_of_ours`) and
    neither every user (nor, unless ``group_may_write``, its group) may write it. Symbolic links
    are followed: what counts is what would be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid not in (owners or (os.geteuid(), 0)):
        try:
            import pwd

            owner = f"user {pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
        except (ImportError, KeyError):
            owner = f"uid {st.st_uid}"
        return f"belongs to {owner}, not to you (uid {os.geteuid()})"
    if st.st_mode & 0o002:
        return f"is writable by every user (mode {st.st_mode & 0o7777:o})"
    if not group_may_write and st.st_mode & 0o020:
        return f"is writable by its group (mode {st.st_mode & 0o7777:o})"
    return None


def refuse_checkpoint_public(fs: pafs.FileSystem, path: str, manifest: dict[str, Any]) -> None:
    """Refuse the local checkpoint ``path`` chosen to resume from if its directory, or a file of it
    that the job will load (its manifest and every file the manifest lists), belongs to another
    user or may be written by others than its owner (its group included: a job makes them
    ``0700``/``0600``): :func:`refuse_public` checks only the directory given, and another user
    could have replaced the driver's or executors' pickles in a ``ckpt-*`` made ``o+w`` (a umask
    of 0) under a private root, or planted a ``ckpt-*`` of their own in a root their group may
    write. A file that is missing is left to :func:`verify_files`, which names it."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return
    names = [MANIFEST, *manifest.get("shards_files", []), *manifest.get("executors_files", []),
             *manifest.get("executor_rows_files", []), *([manifest["driver"]] if "driver" in manifest else [])]
    owners = _owners_of_ours(os.path.dirname(path))
    for where in [path, *(f"{path}/{name}" for name in names)]:
        why = _untrusted(where, group_may_write=False, owners=owners)
        if why is not None:
            what = "directory" if where == path else "file"
            fix = (f"check it, then chmod -R go-w {path} to resume from it" if "writable" in why else
                   "resume only from checkpoints your own jobs wrote")
            raise CheckpointError(f"checkpoint {what} {where} {why}: others could have replaced what the job "
                                  f"would load from it (pickles, which run code); {fix}")


def _make_local_dirs(path: str) -> None:
    """``os.makedirs`` with every directory it makes the user's alone (``0700``): under a umask of 0 (a
    container's default) the parents it made were ``o+w``, and anyone could have renamed the
    checkpoint root away and put theirs in its place (its pickles then loaded by ``--resume``);
    and the root made so was refused."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (made meanwhile by another process)
            os.mkdir(directory, 0o700)  # (the user's alone, whatever the umask: see _create_private)


def prepare_root(location: str) -> None:
    """Make the checkpoint root ``location`` if it is missing and check that a file can be written
    there, so that a job given an unusable one (a file, a read-only or full filesystem) is refused
    before it starts rather than failing its first checkpoint."""
    fs, root = filesystem(location)
    try:
        kind = fs.get_file_info(root).type
        if kind == pafs.FileType.File:
            raise CheckpointError(f"checkpoint directory {redact(location)} is a file")
        if kind == pafs.FileType.NotFound and isinstance(fs, pafs.LocalFileSystem):
            _make_local_dirs(root)
        else:
            fs.create_dir(root, recursive=True)
        refuse_public(location)
        probe = f"{root}/.litz-write-test-{os.getpid()}"
        with fs.open_output_stream(probe) as f:
            f.write(b"litz")
        fs.delete_file(probe)
    except OSError as exc:
        raise CheckpointError(redact(f"cannot use checkpoint directory {location}: {exc}")) from exc


def checkpoint_dirs(fs: pafs.FileSystem, root: str) -> list[tuple[int, str]]:
    """``(seq, path)`` of every ``ckpt-*`` directory under ``root``, complete or not, in order."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint storage {root}: {exc}") from exc
    out = []
    for info in infos:
        m = _CKPT.match(info.base_name)
        if m and info.type == pafs.FileType.Directory:
            out.append((int(m.group(1)), info.path))
    return sorted(out)


def checkpoint_seq(path: str | None) -> int:
    """The number of the ``ckpt-<seq>`` directory ``path`` (-1 for None or another name)."""
    m = _CKPT.match(path.rsplit("/", 1)[-1]) if path else None
    return int(m.group(1)) if m else -1


def has_manifest(fs: pafs.FileSystem, path: str) -> bool:
    try:
        return fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.File
    except OSError as exc:  # a missing file is no error: this is the store failing to answer
        raise CheckpointError(f"cannot read checkpoint storage at {path}: {exc}") from exc


def new_checkpoint_dir(fs: pafs.FileSystem, root: str, last: str | None = None) -> str:
    """Create the next ``ckpt-<seq>`` directory (numbers never reused, even of incomplete ones):
    the one after ``last``, the directory this process created before, without listing ``root``
    again (a job with partial checkpoints every few iterations has hundreds)."""
    if checkpoint_seq(last) >= 0:
        seq = checkpoint_seq(last) + 1
    else:
        seqs = [seq for seq, _ in checkpoint_dirs(fs, root)]
        seq = max(seqs) + 1 if seqs else 0
    path = f"{root}/ckpt-{seq:06d}"
    try:
        if isinstance(fs, pafs.LocalFileSystem):  # made never o+w, not chmodded after (see _create_private)
            _make_local_dirs(path)
        else:
            fs.create_dir(path, recursive=True)
        _not_public(fs, path)
    except OSError as exc:  # full, read-only or vanished storage; pyarrow raises OSError for them all
        raise CheckpointError(f"cannot create checkpoint directory {path}: {exc}") from exc
    return path


def remove_if_empty(fs: pafs.FileSystem, path: str) -> bool:
    """Remove the checkpoint directory ``path`` if nothing was written in it (a round dropped before
    it saved anything): numbers are never reused, so it would stay an empty ``ckpt-*`` for ever.
    Returns whether it was removed; one that holds a file is left alone."""
    try:
        if fs.get_file_info(path).type != pafs.FileType.Directory \
                or fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
            return False
        fs.delete_dir(path)
    except OSError as exc:
        raise CheckpointError(f"cannot remove the empty checkpoint directory {path}: {exc}") from exc
    return True


def _write_json(fs: pafs.FileSystem, path: str, body: dict[str, Any]) -> None:
    """Write ``body`` under a temporary name, then move it into place: a reader sees it whole or not."""
    write_bytes(fs, f"{path}.tmp", json.dumps({"format": FORMAT, **body}, indent=1).encode())
    fs.move(f"{path}.tmp", path)


def write_manifest(fs: pafs.FileSystem, path: str, manifest: dict[str, Any]) -> None:
    """Write the manifest last, whole (:func:`_write_json`): then the checkpoint exists."""
    _write_json(fs, f"{path}/{MANIFEST}", manifest)


def _store(location: str) -> tuple[str, ...]:
    """Which store ``location`` is on, credentials left out: the scheme, host and query of a URI."""
    if "://" not in location:
        return ("local",)
    parts = urllib.parse.urlsplit(redact(location))
    return parts.scheme, parts.netloc, parts.query


def write_timeline(location: str, anchor: tuple[str, str] | None) -> None:
    """Record in the checkpoint root ``location`` which checkpoints the run starting now (or rolling
    back now) goes on from: ``anchor``, ``(location, path)`` of the full checkpoint it resumed
    from or rolled back to (None: from the beginning), and the ones it will write, numbered after
    every directory there now. ``--resume auto`` then continues that run, as its own recoveries
    would (``CheckpointCoordinator.anchor``/``own_from``), rather than take the directory's newest,
    which may be of another timeline: a run that went on after an older checkpoint resumed with
    ``--resume``, or past a damaged newer one, or a round a rollback abandoned (its manifest may
    land after the rollback), or an earlier job's.

    An anchor in this directory is recorded by its name, read back through ``location`` (with
    the credentials the reader gives); one elsewhere as what ``--resume`` would take for it
    (:func:`display`: absolute, credentials left out, as in logs)."""
    fs, root = filesystem(location)
    dirs = checkpoint_dirs(fs, root)
    recorded: dict[str, str] | None = None
    if anchor is not None:
        where, path = anchor
        if _store(where) == _store(location) and path.rsplit("/", 1)[0] == root.rstrip("/"):
            recorded = {"name": path.rsplit("/", 1)[-1]}
        else:
            recorded = {"location": display(where, path)}
    try:
        _write_json(fs, f"{root}/{TIMELINE}", {"after": dirs[-1][0] if dirs else -1, "anchor": recorded})
    except OSError as exc:
        raise CheckpointError(f"cannot write {root}/{TIMELINE}: {exc}") from exc


def read_timeline(location: str) -> tuple[int, tuple[str, str] | None] | None:
    """What :func:`write_timeline` recorded at ``location``: ``(after, anchor)``, the anchor as
    ``(location, path)``, also from a record of before anchors were named by name or as
    ``--resume`` takes them (``{"location": its root as given, "path": its directory}``); None
    where there is no record (a directory of checkpoints from before session 44, or none) or a
    damaged one, said in a warning (the directory's newest is taken then, as before). Storage
    that does not answer raises."""
    fs, root = filesystem(location)
    where = f"{root}/{TIMELINE}"
    try:
        if fs.get_file_info(where).type != pafs.FileType.File:
            return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint storage at {where}: {exc}") from exc
    try:
        body = json.loads(read_bytes(fs, where))
        after, anchor = body["after"], body["anchor"]
        if body.get("format") != FORMAT or not isinstance(after, int) or not (
                anchor is None or isinstance(anchor.get("name"), str) and _CKPT.match(anchor["name"])
                or isinstance(anchor.get("location"), str) and isinstance(anchor.get("path", ""), str)):
            raise ValueError("unexpected fields")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("%s is damaged (%s): the newest checkpoint there is taken", where, exc)
        return None
    if anchor is None:
        return after, None
    if "name" in anchor:
        return after, (location, f"{root}/{anchor['name']}")
    if "path" in anchor:  # a record of before (format 1 still): the root as given, the checkpoint's path in it
        return after, (anchor["location"], anchor["path"])
    return after, (anchor["location"], filesystem(anchor["location"])[1])


#: What a manifest must hold to be used: a full checkpoint's (resume, full recovery) and a
#: partial one's (SCAR recovery, on top of its base).
_FULL_KEYS = ("num_shards", "shards_files", "version", "num_executors", "driver", "tables", "executors_files")
_PARTIAL_KEYS = ("partial_of", "shards_files")


def read_manifest(fs: pafs.FileSystem, path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked: a damaged one (not JSON, not an object,
    another format, keys missing) raises a :class:`DamagedCheckpoint` that names the file; one that
    cannot be read, a :class:`CheckpointError`."""
    where = f"{path}/{MANIFEST}"
    try:
        manifest = json.loads(read_bytes(fs, where))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise DamagedCheckpoint(f"checkpoint manifest {where} is damaged: {exc}") from exc
    if not isinstance(manifest, dict):
        raise DamagedCheckpoint(f"checkpoint manifest {where} is damaged: a JSON {type(manifest).__name__}, "
                                "not an object")
    if manifest.get("format") != FORMAT:
        raise DamagedCheckpoint(f"{where}: unsupported checkpoint format {manifest.get('format')!r}")
    missing = [k for k in (_PARTIAL_KEYS if manifest.get("partial_of") else _FULL_KEYS) if k not in manifest]
    tables = manifest.get("tables", [])
    if not missing and not (isinstance(tables, list)
                            and all(isinstance(t, dict) and {"name", "shape", "dtype"} <= t.keys() for t in tables)):
        missing = ["tables (name, shape, dtype of each)"]
    if missing:
        raise DamagedCheckpoint(f"checkpoint manifest {where} is damaged: it lacks {', '.join(missing)}")
    return manifest


def _newest_first(fs: pafs.FileSystem, root: str, dirs: list[tuple[int, str]] | None = None,
                  since: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The complete checkpoints under ``root`` (among ``dirs``, its listing, when the caller has it
    already) with their manifests, newest first, read as they
    are asked for: a caller stops at the newest full one, so a job with hundreds of partial
    checkpoints behind it reads only those since (each read is a request on a network store). A
    damaged manifest is skipped with a warning: the checkpoints before it are as good as they
    were. Storage that does not answer raises: skipping what it failed to read would pass an
    older checkpoint, or none, for the newest. ``since``: only directories numbered from it on
    (those of a job's own run, ``CheckpointCoordinator.own_from``)."""
    for seq, p in reversed(checkpoint_dirs(fs, root) if dirs is None else dirs):
        if since is not None and seq < since:
            break
        if has_manifest(fs, p):
            try:
                manifest = read_manifest(fs, p)
            except DamagedCheckpoint as exc:
                log.warning("%s; that checkpoint is skipped", exc)
                continue
            yield p, manifest


def running_checkpoint(location: str, kind: str = "shards", since: int | None = None
                       ) -> tuple[str, dict[str, Any], list[tuple[str, list[str]]]] | None:
    """The newest complete full checkpoint and the complete partial ones taken after it, oldest
    first, as ``(base path, base manifest, [(partial path, its files)])``; None if none. The
    files are those of ``kind``: ``shards`` (table rows) or ``executors`` (rows of executor state).
    ``since``: among the directories numbered from it on only.

    Restoring a row means: its value in the base, overwritten by each partial that saved it.
    """
    key = "shards_files" if kind == "shards" else "executor_rows_files"
    fs, root = filesystem(location)
    newer: list[tuple[str, dict[str, Any]]] = []  # partial checkpoints newer than the base, newest first
    for path, manifest in _newest_first(fs, root, since=since):
        if not manifest.get("partial_of"):
            name = path.rsplit("/", 1)[-1]  # the master names the base by the path it created, the listing by its own
            partials = [(p, m.get(key, [])) for p, m in reversed(newer)
                        if str(m.get("partial_of", "")).rsplit("/", 1)[-1] == name]
            return path, manifest, partials
        newer.append((path, manifest))
    return None


def prune_checkpoints(fs: pafs.FileSystem, root: str, keep: int, limit: int = 100,
                      since: int | None = None) -> list[str]:
    """Remove the ``ckpt-*`` directories older than the newest ``keep`` complete full checkpoints
    under ``root`` (``--checkpoint-keep``): older full ones, partial ones built on them, and
    directories of rounds that failed. Nothing at or after the oldest one kept is touched: the
    running checkpoint (the newest full one and the partial ones after it) and any round still
    being written. At most ``limit`` directories per call, so that a first call on a directory of
    thousands does not hold the round that made it; the rest go with later rounds. Each
    directory loses its manifest first: one half removed is never taken for a checkpoint. Returns
    the directories removed. ``since``: the full checkpoints counted are those numbered from it
    on (the job's own run: a newer full one of another timeline does not count as kept)."""
    dirs = checkpoint_dirs(fs, root)  # listed once (a request on a network store)
    fulls = 0
    cutoff = None
    for path, manifest in _newest_first(fs, root, dirs, since):
        if not manifest.get("partial_of"):
            fulls += 1
            if fulls == keep:
                cutoff = checkpoint_seq(path)
                break
    if cutoff is None:
        return []
    removed: list[str] = []
    for seq, path in dirs:
        if seq >= cutoff or len(removed) >= limit:
            break
        try:
            if has_manifest(fs, path):
                fs.delete_file(f"{path}/{MANIFEST}")
            fs.delete_dir(path)
        except OSError as exc:
            raise CheckpointError(f"cannot remove the old checkpoint {path}: {exc}") from exc
        removed.append(path)
    return removed


def full_checkpoints(location: str, since: int | None = None) -> Iterator[tuple[pafs.FileSystem, str, dict[str, Any]]]:
    """The complete full checkpoints at ``location`` (a checkpoint directory: its ``ckpt-*``,
    numbered ``since`` or later), newest first, with their manifests, read as they are asked for
    (``_newest_first``)."""
    fs, root = filesystem(location)
    for path, manifest in _newest_first(fs, root, since=since):
        if not manifest.get("partial_of"):
            yield fs, path, manifest


def verify_files(fs: pafs.FileSystem, path: str, manifest: dict[str, Any]) -> None:
    """Check that every file a full checkpoint's manifest lists is there, and that each Arrow
    file ends as one should (its footer reads), without reading the data: a missing or truncated
    file raises :class:`DamagedCheckpoint` naming it; storage that does not answer,
    :class:`CheckpointError`. (``--resume auto`` falls back past a damaged checkpoint.)"""
    names = [*manifest["shards_files"], *manifest["executors_files"], *manifest.get("executor_rows_files", [])]
    for name in [*names, manifest["driver"]]:
        where = f"{path}/{name}"
        try:
            if fs.get_file_info(where).type != pafs.FileType.File:
                raise DamagedCheckpoint(f"checkpoint file {where}, which its manifest lists, is missing")
            if name in names:
                with fs.open_input_file(where) as f:
                    pa.ipc.open_file(f)
        except pa.ArrowInvalid as exc:  # (before OSError: Arrow's errors may derive from it)
            raise DamagedCheckpoint(f"checkpoint file {where} is damaged: {exc}") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint file {where}: {exc}") from exc


_T = TypeVar("_T")


def answered_within(work: Callable[[], _T], timeout: float, what: str) -> _T:
    """``work()``, which asks the checkpoint storage, if it returns within ``timeout`` seconds; its
    exception if it raises. Else CheckpointError saying ``what`` went unanswered: pyarrow has no
    request timeout (its S3 URIs refuse one), so a store that accepts connections and never answers
    held ``litz launch`` for ever, before any process started, ``--checkpoint-timeout`` or not.
    ``work`` runs on a daemon thread, left to the store if it never answers."""
    box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def run() -> None:
        try:
            box.put((True, work()))
        except BaseException as exc:  # (handed over, raised below)
            box.put((False, exc))

    threading.Thread(target=run, daemon=True, name="checkpoint-storage").start()
    try:  # (inf and huge timeouts overflow the queue's clock: no limit then)
        ok, value = box.get(timeout=timeout if math.isfinite(timeout) and timeout < threading.TIMEOUT_MAX else None)
    except queue.Empty:
        raise CheckpointError(f"the checkpoint storage did not answer within {timeout:g} s (--checkpoint-timeout) "
                              f"while {what}") from None
    if not ok:
        raise value
    return value


def has_complete_checkpoint(location: str) -> bool:
    """Whether ``location`` holds a checkpoint to resume from (a missing directory holds none)."""
    fs, path = filesystem(location)
    return _newest_complete(fs, path) is not None


def _newest_complete(fs: pafs.FileSystem, path: str, since: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """``path`` itself if it holds a manifest, else its newest complete full ``ckpt-*`` (numbered
    ``since`` or later), else None; with its manifest (read once: a job with partial checkpoints
    has hundreds)."""
    if has_manifest(fs, path):
        return path, read_manifest(fs, path)
    return next(((p, manifest) for p, manifest in _newest_first(fs, path, since=since)
                 if not manifest.get("partial_of")), None)


def find_checkpoint(location: str, since: int | None = None) -> tuple[pafs.FileSystem, str, dict[str, Any]]:
    """The checkpoint to resume from: ``location`` itself if it holds a manifest, else the newest
    complete full ``ckpt-*`` under it (numbered ``since`` or later). Directories without a
    manifest are skipped, never used."""
    fs, path = filesystem(location)
    found = _newest_complete(fs, path, since)
    if found is None:
        raise NoCheckpoint(f"no complete checkpoint in {redact(location)} (a checkpoint is complete once its "
                              f"{MANIFEST} is written)")
    chosen, manifest = found
    if manifest.get("partial_of"):
        raise CheckpointError(f"{chosen} is a partial checkpoint (SCAR), which holds only some rows: resume from "
                              f"a full one, such as its base {manifest['partial_of']}, or from the checkpoint "
                              f"directory (its newest full checkpoint)")
    return fs, chosen, manifest
