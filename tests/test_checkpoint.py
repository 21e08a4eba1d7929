"""Consistent checkpoints and resume (issue 4): storage, the round's state machine, real jobs."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import litz
from litz.errors import ConfigError
from litz.ft import storage
from litz.ft.checkpoint import CheckpointCoordinator, RowSaves, parse_every
from tests import testapps
from tests.conftest import (
    ended_exact,
    processes_mentioning,
    run_in_thread,
    status_when,
    wait_running,
    wire_without_sockets,
)
from tests.s3_server import location as s3_location


def test_shard_rows_round_trip_exactly_with_int_and_string_keys(tmp_path: Path) -> None:
    fs, root = storage.filesystem(str(tmp_path))
    rows = [("w", 3, 7, np.array([1.5, -2.25, np.pi])), ("w", 5, 2**40, np.array([np.nan, 0.0, 1e-300])),
            ("names", 1, "alpha", np.array([[1, 2], [3, 4]], np.int32))]
    assert storage.write_shards(fs, f"{root}/s.arrow", rows) == 3
    back = storage.read_shards(fs, f"{root}/s.arrow")
    assert [(t, s, k) for t, s, k, _ in back] == [(t, s, k) for t, s, k, _ in rows]
    for (_, _, _, raw), (_, _, _, row) in zip(back, rows, strict=True):
        assert raw == row.tobytes()  # bit for bit, NaN included


def _run_until(tmp_path: Path, monkeypatch, cond: Callable[[list[dict]], bool], app: litz.App,  # noqa: ANN001
               **kw: object) -> litz.JobResult:
    """Run an open-ended ``app`` (testapps.TimedMigratingDriver: exact sums) until its checkpoint
    records in ``litz status`` (the last five) satisfy ``cond``, then stop it and return its result.
    A fixed number of tasks or seconds could end before the rounds a test needs on a slow machine."""
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    stop = tmp_path / "stop"
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=60.0, stop_file=str(stop))
    job = f"until-{time.time_ns()}"
    t, out = run_in_thread(app, job=job, **kw)
    try:
        status_when(job, lambda s: cond(s["master"].get("checkpoints", [])), timeout=60)
    finally:
        stop.touch()
        t.join(60)
    assert not t.is_alive() and "error" not in out, out.get("traceback")
    return out["res"]


def _full_manifest(**fields: object) -> dict:
    """What a full checkpoint's manifest holds (values that no job could resume from: storage tests only)."""
    return {"num_shards": 1, "shards_files": [], "version": 0, "num_executors": 1, "driver": "driver.pkl",
            "tables": [], "executors_files": [], **fields}


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_directory_without_manifest_is_never_used(tmp_path: Path, request: pytest.FixtureRequest,
                                                    store: str) -> None:
    """On S3 too, where a directory is a key prefix and a move is a copy."""
    location = str(tmp_path) if store == "local" else \
        s3_location(request.getfixturevalue("s3_bucket"), f"manifest-{time.time_ns()}")
    fs, root = storage.filesystem(location)
    with pytest.raises(storage.CheckpointError, match="no complete checkpoint"):
        storage.find_checkpoint(location)
    first = storage.new_checkpoint_dir(fs, root)
    storage.write_manifest(fs, first, _full_manifest())
    newer = storage.new_checkpoint_dir(fs, root)  # a crash while writing: files, no manifest
    storage.write_bytes(fs, f"{newer}/driver.pkl", b"partial")
    assert newer.endswith("ckpt-000001")
    _, chosen, manifest = storage.find_checkpoint(location)
    assert chosen == first and manifest["num_executors"] == 1
    with pytest.raises(storage.CheckpointError):
        storage.find_checkpoint(newer + "/nope")
    # numbers are never reused, even those of incomplete checkpoints
    assert storage.new_checkpoint_dir(fs, root).endswith("ckpt-000002")


def test_damaged_manifests_are_named_and_skipped_and_a_partial_checkpoint_is_no_resume_point(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fs, root = storage.filesystem(str(tmp_path))
    good = storage.new_checkpoint_dir(fs, root)
    storage.write_manifest(fs, good, _full_manifest(version=7))
    partial = storage.new_checkpoint_dir(fs, root)
    storage.write_manifest(fs, partial, {"partial_of": good, "shards_files": [], "executor_rows_files": []})
    damaged = {}
    for text in ('{"format": 1, "job"', "[1, 2]", '{"format": 1, "partial_of": "x"}', "\xff\xfe"):
        path = storage.new_checkpoint_dir(fs, root)  # newer than the good one, each damaged in its way
        storage.write_bytes(fs, f"{path}/{storage.MANIFEST}", text.encode())
        damaged[path] = text
    # the whole directory: the newest checkpoint that can be used, each damaged one named in a warning
    _, chosen, manifest = storage.find_checkpoint(str(tmp_path))
    assert chosen == good and manifest["version"] == 7
    for path in damaged:
        assert any(f"{path}/{storage.MANIFEST} is damaged" in r.getMessage() for r in caplog.records), path
    base, _, partials = storage.running_checkpoint(str(tmp_path))
    assert base == good and [p for p, _ in partials] == [partial]
    # one named directly: refused, with the file and what is wrong with it
    for path, why in zip(damaged, ("damaged: Expecting ':' delimiter", "a JSON list, not an object",
                                   "it lacks shards_files", "damaged: "), strict=True):
        with pytest.raises(storage.CheckpointError, match=re.escape(f"{path}/{storage.MANIFEST} is ") + ".*"
                           + re.escape(why.split(": ")[-1])):
            storage.find_checkpoint(path)
    with pytest.raises(storage.CheckpointError, match=f"{partial} is a partial checkpoint .* its base {good}"):
        storage.find_checkpoint(partial)


def test_the_running_checkpoint_reads_only_the_manifests_since_the_newest_full_one(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """A job with priority checkpoints every few clocks has hundreds of them; a recovery (on the
    master's loop) and a resume read the newest full one and the partial ones after it, not every
    manifest in the directory (each a request on a network store)."""
    fs, root = storage.filesystem(str(tmp_path))
    made = []
    for i in range(9):  # full, 5 partial, full, 2 partial
        path = storage.new_checkpoint_dir(fs, root)
        base = next((p for p, full in reversed(made) if full), None)
        full = i in (0, 6)
        storage.write_manifest(fs, path, _full_manifest(version=i) if full else
                               {"partial_of": base, "shards_files": [f"s{i}.arrow"], "executor_rows_files": []})
        made.append((path, full))
    read: list[str] = []
    read_manifest = storage.read_manifest
    monkeypatch.setattr(storage, "read_manifest", lambda fs_, path: read.append(path) or read_manifest(fs_, path))
    base, manifest, partials = storage.running_checkpoint(str(tmp_path))
    assert base == made[6][0] and manifest["version"] == 6
    assert partials == [(made[7][0], ["s7.arrow"]), (made[8][0], ["s8.arrow"])]
    assert read == [made[8][0], made[7][0], made[6][0]]
    read.clear()
    assert storage.find_checkpoint(str(tmp_path))[1] == made[6][0] and len(read) == 3


def test_pruning_keeps_the_newest_full_checkpoints_and_what_builds_on_them(tmp_path: Path) -> None:
    fs, root = storage.filesystem(str(tmp_path))
    layout = ["full", "partial", "failed", "full", "partial", "full", "partial", "writing"]
    made = []
    for kind in layout:
        path = storage.new_checkpoint_dir(fs, root)
        storage.write_bytes(fs, f"{path}/shards-s0.arrow", b"rows")
        base = next((p for p, k in reversed(made) if k == "full"), None)
        if kind == "full":
            storage.write_manifest(fs, path, _full_manifest())
        elif kind == "partial":
            storage.write_manifest(fs, path, {"partial_of": base, "shards_files": ["shards-s0.arrow"]})
        made.append((path, kind))
    running = storage.running_checkpoint(str(tmp_path))

    def left() -> list[str]:
        return [p for _, p in storage.checkpoint_dirs(fs, root)]

    assert storage.prune_checkpoints(fs, root, keep=4) == [] and len(left()) == 8  # fewer than 4 full ones
    assert storage.prune_checkpoints(fs, root, keep=2, limit=2) == [made[0][0], made[1][0]]  # at most 2 a call
    assert storage.prune_checkpoints(fs, root, keep=2) == [made[2][0]]  # the failed round's directory too
    assert left() == [p for p, _ in made[3:]]
    assert storage.prune_checkpoints(fs, root, keep=1) == [made[3][0], made[4][0]]
    assert left() == [p for p, _ in made[5:]]  # the running checkpoint and the round being written stay
    assert storage.running_checkpoint(str(tmp_path)) == running
    assert storage.find_checkpoint(str(tmp_path))[1] == made[5][0]
    with pytest.raises(ConfigError, match="--checkpoint-keep"):
        CheckpointCoordinator(str(tmp_path), keep=0)


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_job_keeps_only_the_newest_full_checkpoints(tmp_path: Path, monkeypatch, request: pytest.FixtureRequest,
                                                      store: str) -> None:
    """On S3 too, where a directory is a key prefix and removing it deletes its keys."""
    where = str(tmp_path) if store == "local" else \
        s3_location(request.getfixturevalue("s3_bucket"), f"keep-{time.time_ns()}")
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    res = _run_until(tmp_path, monkeypatch, lambda cs: sum(c["ok"] and c["kind"] == "full" for c in cs) >= 3, app,
                     workers=2, servers=1, checkpoint_dir=where, checkpoint_every="0.1s", checkpoint_keep=2)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    records = [c for c in res.stats["master"]["checkpoints"] if c["ok"]]
    fulls = [c["path"] for c in records if c["kind"] == "full"]
    assert len(fulls) >= 3, records
    fs, root = storage.filesystem(where)
    dirs = [p for _, p in storage.checkpoint_dirs(fs, root)]
    complete_fulls = [p for p in dirs if storage.has_manifest(fs, p)
                      and not storage.read_manifest(fs, p).get("partial_of")]
    assert complete_fulls == fulls[-2:], (complete_fulls, fulls)
    assert all(storage.checkpoint_seq(p) >= storage.checkpoint_seq(fulls[-2]) for p in dirs), dirs
    assert storage.running_checkpoint(where)[0] == fulls[-1]
    with pytest.raises(ConfigError, match="--checkpoint-keep needs --checkpoint-dir"):
        litz.run(app, checkpoint_keep=3)


def test_recoveries_go_back_only_to_checkpoints_of_their_own_run(tmp_path: Path) -> None:
    """A checkpoint directory may hold checkpoints of another timeline: the run that went on after
    the checkpoint this one resumed from (``--resume`` of an older one, or ``--resume auto`` past a
    damaged newer one), the rounds a rollback abandoned, another job before. A recovery goes back
    to the newest checkpoint this run wrote, else to the one it resumed from or rolled back to:
    before, it took the directory's newest, so a full recovery put the whole job, and a partial one
    the lost rows, at a point of another run. Pruning counts this run's full checkpoints only."""
    loc = str(tmp_path)
    fs, root = storage.filesystem(loc)

    def made(partial_of: str | None = None, version: int = 0) -> str:
        path = storage.new_checkpoint_dir(fs, root)
        manifest = {"format": storage.FORMAT, "partial_of": partial_of, "shards_files": []} if partial_of else \
            {**_full_manifest(version=version), "format": storage.FORMAT}
        storage.write_manifest(fs, path, manifest)
        return path

    old0 = made(version=1)
    made(partial_of=old0)
    old2 = made(version=3)  # the other run went on (or this one is damaged: --resume auto skipped it)
    made(partial_of=old2)
    assert storage.find_checkpoint(loc)[1] == old2  # what recoveries took before
    fresh = CheckpointCoordinator(loc)  # a new job in that directory: nothing of its own yet
    with pytest.raises(storage.NoCheckpoint):
        fresh.last_full()
    assert fresh.running("shards") is None
    ck = CheckpointCoordinator(loc)
    anchor = (loc, old0, storage.read_manifest(fs, old0))
    ck.anchored(anchor)
    assert ck.last_full() == anchor and ck.running("shards") == (*anchor, [])
    mine = storage.new_checkpoint_dir(fs, root)  # this run's first round: no manifest yet
    ck.made_dir(mine)
    assert ck.last_full() == anchor
    storage.write_manifest(fs, mine, {**_full_manifest(version=5), "format": storage.FORMAT})
    assert ck.last_full()[:2] == (loc, mine)
    assert storage.prune_checkpoints(fs, root, keep=2, since=ck.own_from) == []  # one of this run's
    partial = made(partial_of=mine)
    location, base, _, partials = ck.running("shards")  # type: ignore[misc]
    assert (location, base, [p for p, _ in partials]) == (loc, mine, [partial])
    ck.rolled_back((loc, mine, storage.read_manifest(fs, mine)))  # the partial one is of the abandoned timeline
    assert ck.running("shards")[1:] == (mine, storage.read_manifest(fs, mine), [])  # type: ignore[index]
    after = storage.new_checkpoint_dir(fs, root)
    ck.made_dir(after)
    storage.write_manifest(fs, after, {**_full_manifest(version=6), "format": storage.FORMAT})
    assert ck.last_full()[1] == after
    older = [p for _, p in storage.checkpoint_dirs(fs, root)][:-1]
    assert storage.prune_checkpoints(fs, root, keep=1, since=ck.own_from) == older


def test_resume_auto_goes_on_from_the_run_recorded_in_the_directory(tmp_path: Path, caplog, monkeypatch) -> None:
    """Without sockets: ``TIMELINE.json``, written as a run starts or rolls back, names what that
    run goes on from; ``--resume auto`` takes the run's own checkpoints (numbered after every
    directory there then), else that one, wherever it is, never a newer one of another timeline
    (before: the directory's newest). Without a record, or with a damaged one, every checkpoint
    there, newest first, as before; a recorded checkpoint that is gone is named."""
    from litz.runtime.master import Resume

    loc, other = str(tmp_path / "d"), str(tmp_path / "o")

    def made(where: str, version: int) -> str:
        fs, root = storage.filesystem(where)
        path = storage.new_checkpoint_dir(fs, root)
        storage.write_manifest(fs, path, {**_full_manifest(version=version), "format": storage.FORMAT})
        return path

    def chosen() -> list[tuple[str, str, bool]]:
        return [(where, path, manifest is None) for where, _, path, manifest in Resume._timeline(loc)]

    a0, a1 = made(loc, 1), made(loc, 2)
    assert storage.read_timeline(loc) is None
    assert chosen() == [(loc, a1, False), (loc, a0, False)]
    storage.write_timeline(loc, (loc, a0))  # a run resumed from a0, a1 there
    assert storage.read_timeline(loc) == (storage.checkpoint_seq(a1), (loc, a0))
    assert chosen() == [(loc, a0, True)]
    a2 = made(loc, 3)  # that run's own
    assert chosen() == [(loc, a2, False), (loc, a0, True)]
    o0 = made(other, 4)
    storage.write_timeline(loc, (other, o0))  # a run resumed from another directory: named as --resume takes it
    assert chosen() == [(o0, o0, True)]
    monkeypatch.chdir(other)  # given relative, recorded absolute (a restart may start elsewhere; its mode is checked)
    storage.write_timeline(loc, (".", o0))
    assert json.loads(Path(loc, storage.TIMELINE).read_text())["anchor"] == {"location": o0}
    storage.write_timeline(loc, (loc, a0))  # one of this directory's, by its name (read with the reader's credentials)
    assert json.loads(Path(loc, storage.TIMELINE).read_text())["anchor"] == {"name": Path(a0).name}
    storage.write_timeline(loc, None)  # a fresh run
    assert chosen() == []
    Path(loc, storage.TIMELINE).write_text('{"format": 1, "after"')
    assert chosen() == [(loc, a2, False), (loc, a1, False), (loc, a0, False)]
    assert any(f"{storage.TIMELINE} is damaged" in r.getMessage() for r in caplog.records)
    fs, _ = storage.filesystem(other)
    fs.delete_dir_contents(o0)
    storage.write_timeline(loc, (other, o0))
    app = testapps.migrating_app(tasks=10, executors=4, move_prob=0.0)
    with pytest.raises(storage.DamagedCheckpoint, match=f"the checkpoint the last run in {loc} went on from, {o0}, "
                                                        f"has no {storage.MANIFEST} any more"):
        Resume.newest_usable(loc, app, None, 64, app.driver())


def test_a_job_resumed_from_an_older_checkpoint_rolls_back_to_it_not_to_a_newer_one(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """A job resumed from the older of two full checkpoints in its checkpoint directory loses a
    server before it wrote a checkpoint of its own: the full recovery goes back to the checkpoint
    the job resumed from (before, to the directory's newest, the first run's later state), and the
    job ends with exact sums."""
    ckpt = str(tmp_path / "ckpt")
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    first = _run_until(tmp_path, monkeypatch, lambda cs: sum(c["ok"] and c["kind"] == "full" for c in cs) >= 2,
                       app, workers=2, servers=2, checkpoint_dir=ckpt, checkpoint_every="0.2s")
    older = [c["path"] for c in first.stats["master"]["checkpoints"] if c["ok"]][0]
    stop = tmp_path / "stop2"
    app.config.update(stop_file=str(stop))
    job = f"resumed-{time.time_ns()}"
    t, out = run_in_thread(app, job=job, workers=2, servers=2, checkpoint_dir=ckpt, checkpoint_every="60s",
                           resume=older, recovery="full")
    try:
        st = wait_running(job)
        victim = next(p for p in st["processes"] if p["id"] == "s1")
        os.kill(victim["pid"], signal.SIGKILL)
        st = status_when(job, lambda s: s["master"].get("recoveries"), timeout=60)
    finally:
        stop.touch()
        t.join(60)
    assert not t.is_alive() and "error" not in out, out.get("traceback")
    [rec] = out["res"].stats["master"]["recoveries"]
    assert rec["strategy"] == "full" and rec["restored_from"].rstrip("/").endswith(older.rsplit("/", 1)[-1]), rec
    np.testing.assert_array_equal(out["res"].value["final"], out["res"].value["truth"])
    # and a restart with --resume auto goes on from that run too, not from the first run's newer ones
    # (its own TIMELINE.json record; before, it took the directory's newest)
    from litz.runtime.master import Resume

    chosen = Resume.newest_usable(ckpt, app, None, 64, app.driver())
    assert chosen is not None and chosen.path.rstrip("/").endswith(older.rsplit("/", 1)[-1]), chosen.path


def test_a_full_round_takes_its_snapshot_only_once_a_partial_recovery_has_restored_everything(tmp_path: Path) -> None:
    """Without sockets: a full round pauses (a long task still runs on w2), w1 dies and its
    executor 2 is restored on a survivor from the running checkpoint, and w2's task ends. The
    snapshot waits for the restore: taken before, the survivor copied only what it hosted
    before, and the checkpoint, complete to every check, held no state for executor 2 (a resume
    from it failed; a lost server's rows would have come back as initial values)."""
    from litz.runtime.master import Master, MasterState
    from litz.runtime.protocol import Message

    class Idle(litz.Driver):
        def dispatch_initial_tasks(self) -> None:
            pass

        def handle_task_completion(self, result: litz.TaskResult) -> None:
            pass

    app = testapps.migrating_app(tasks=10, executors=4, move_prob=0.0)
    m = Master(app, "j", None, workers=3, servers=1, num_executors=4,  # type: ignore[arg-type]
               options={"checkpoint_dir": str(tmp_path), "recovery": "partial"})
    sent: list[tuple[str, str, dict]] = []
    m.endpoint.send = lambda peer, kind, **f: sent.append((peer, kind, f))  # type: ignore[method-assign]
    st = m.state = MasterState(4, ["w0", "w1", "w2"], ["s0"])  # executors 0, 1 on w0; 2 on w1; 3 on w2
    driver = Idle()
    driver._bind(m, 4, app.config)
    m.driver = driver

    def until(cond, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, what
            m._background_done()
            m._running_read()
            time.sleep(0.01)

    try:
        long_task = st.dispatch(3, {"seq": 0, "seed": 0})
        st.take_outbox()
        assert m.checkpoint("test")
        until(lambda: m.checkpoints.round.phase == "pausing", "the round's directory")
        m._recover("w1", "worker")
        until(lambda: any(kind == "restore_executors" for _, kind, _ in sent), "the restore plan")
        [(dest, fields)] = [(peer, f) for peer, kind, f in sent if kind == "restore_executors"]
        m._on_done(driver, Message("done", {"completed": [[long_task, None]], "failed": []}, sender="w2"))
        m._checkpoint_tick()
        assert not [peer for peer, kind, _ in sent if kind == "checkpoint"]  # the restore is not done
        m._restored(dest, fields["round"])
        m._checkpoint_tick()
        assert sorted(peer for peer, kind, _ in sent if kind == "checkpoint") == ["s0", "w0", "w2"]
        assert st.placement[2] == dest  # what the snapshot copies includes executor 2
    finally:
        m.endpoint.close()


def test_storage_that_does_not_answer_is_an_error_never_an_older_checkpoint_or_none(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """A manifest the store fails to read (the network, a dead NFS server) is not a damaged one:
    skipping it would pass an older checkpoint, or none, for the newest (a full recovery then went
    back to the job's beginning). It raises; only "nothing there" is :class:`NoCheckpoint`."""
    fs, root = storage.filesystem(str(tmp_path))
    with pytest.raises(storage.NoCheckpoint):
        storage.find_checkpoint(str(tmp_path))
    old = storage.new_checkpoint_dir(fs, root)
    storage.write_manifest(fs, old, _full_manifest(version=3))
    new = storage.new_checkpoint_dir(fs, root)
    storage.write_manifest(fs, new, _full_manifest(version=9))
    read_bytes = storage.read_bytes

    def failing(fs_, path: str) -> bytes:
        if path.startswith(new):  # as read_bytes reports an OSError of the store
            raise storage.CheckpointError(f"cannot read checkpoint file {path}: AWS Error NETWORK_CONNECTION")
        return read_bytes(fs_, path)

    monkeypatch.setattr(storage, "read_bytes", failing)
    for look in (storage.find_checkpoint, storage.running_checkpoint, storage.has_complete_checkpoint):
        with pytest.raises(storage.CheckpointError, match="NETWORK_CONNECTION") as caught:
            look(str(tmp_path))
        assert not isinstance(caught.value, storage.NoCheckpoint | storage.DamagedCheckpoint)

    class Unanswering:
        def get_file_info(self, path: str) -> None:
            raise OSError("Connection refused")

    with pytest.raises(storage.CheckpointError, match=f"cannot read checkpoint storage at {new}: Connection refused"):
        storage.has_manifest(Unanswering(), new)  # type: ignore[arg-type]


def test_checkpoint_timeouts_are_checked_and_an_infinite_one_waits(tmp_path: Path) -> None:
    """``answered_within`` gave an infinite (or huge) timeout to a queue whose clock overflowed: any
    job with ``--checkpoint-timeout inf`` failed with OverflowError; a negative one with ``--resume``
    was used before it was checked (a bare ValueError). Now: no limit, and a ConfigError."""
    assert storage.answered_within(lambda: 5, float("inf"), "x") == 5
    assert storage.answered_within(lambda: 6, 1e12, "x") == 6
    for bad in (-1.0, 0, float("nan"), True, "soon", 10**400):
        with pytest.raises(ConfigError, match="--checkpoint-timeout must be a positive number"):
            litz.run(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), workers=1, servers=1,
                     resume=str(tmp_path), checkpoint_timeout=bad)


def test_no_directory_made_for_checkpoints_is_writable_by_every_user(tmp_path: Path) -> None:
    """Under a umask of 0 the parents ``prepare_root`` made were 0777: anyone could rename the root
    away and put theirs (with their pickles) in its place, and the checks passed it."""
    old = os.umask(0)
    try:
        storage.prepare_root(str(tmp_path / "a" / "b" / "ckpts"))
        fs, root = storage.filesystem(str(tmp_path / "a" / "b" / "ckpts"))
        made = storage.new_checkpoint_dir(fs, root)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "ckpts", Path(made)):
        assert not d.stat().st_mode & 0o002, (d, oct(d.stat().st_mode))


def test_a_store_that_never_answers_fails_the_launch_after_the_checkpoint_timeout(monkeypatch) -> None:
    """An S3 endpoint that accepts connections and never answers held ``litz.run`` / ``litz launch``
    for ever, before any process started (pyarrow has no request timeout): now each look at the
    storage before the start gives up after ``--checkpoint-timeout``, naming what it was doing."""
    import socket
    import threading

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []
    def accept() -> None:  # and never answer
        try:
            while True:
                held.append(silent.accept()[0])
        except OSError:  # closed at the end
            pass

    threading.Thread(target=accept, daemon=True).start()
    where = f"s3://bucket/ck?endpoint_override=127.0.0.1:{silent.getsockname()[1]}&scheme=http"
    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    job = f"silent-store-{time.time_ns()}"
    try:
        for kw, doing in (({"checkpoint_dir": where}, "checking the checkpoint directory s3://bucket/ck"),
                          ({"checkpoint_dir": where, "resume": "auto"}, "looking for the checkpoint to resume"),
                          ({"resume": where}, "reading the checkpoint s3://bucket/ck")):
            started = time.monotonic()
            with pytest.raises(storage.CheckpointError, match=f"did not answer within 1.5 s .*while {doing}"):
                litz.run(app, workers=1, servers=1, job=job, checkpoint_timeout=1.5, **kw)
            assert time.monotonic() - started < 10
    finally:
        silent.close()
        for c in held:
            c.close()
    assert processes_mentioning(job) == []


def test_an_unusable_checkpoint_directory_is_refused_before_the_job_starts(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for where, why in ((afile, "is a file"), (afile / "sub", "cannot use checkpoint directory")):
        with pytest.raises(storage.CheckpointError, match=why):
            storage.prepare_root(str(where))
        started = time.monotonic()
        with pytest.raises(storage.CheckpointError, match=why):  # before any process starts
            litz.run(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), workers=1, servers=1,
                     checkpoint_dir=str(where))
        assert time.monotonic() - started < 2.0
    storage.prepare_root(str(tmp_path / "new" / "ckpt"))  # a missing one is made
    public = tmp_path / "public"  # writable by every user: anyone could plant a checkpoint's pickles
    public.mkdir()
    public.chmod(0o1777)
    for kw in ({"checkpoint_dir": str(public)}, {"resume": str(public)},
               {"checkpoint_dir": str(public), "resume": "auto"}):
        with pytest.raises(storage.CheckpointError, match="writable by every user .mode 1777.*chmod o-w"):
            litz.run(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), workers=1, servers=1, **kw)
    assert (tmp_path / "new" / "ckpt").is_dir() and list((tmp_path / "new" / "ckpt").iterdir()) == []
    fs, _ = storage.filesystem(str(tmp_path))
    with pytest.raises(storage.CheckpointError, match="cannot create checkpoint directory .*afile/ckpt-000001"):
        storage.new_checkpoint_dir(fs, str(afile), f"{afile}/ckpt-000000")  # as the master makes its next one
    # the partial policies' options mean nothing without a directory, and the fraction nothing under full
    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    for kwargs, why in (({"checkpoint_policy": "priority"}, "--checkpoint needs --checkpoint-dir"),
                        ({"checkpoint_fraction": 0.5}, "--checkpoint-fraction needs --checkpoint-dir"),
                        ({"checkpoint_dir": str(tmp_path / "c"), "checkpoint_fraction": 0.5},
                         "applies to the partial policies")):
        with pytest.raises(ConfigError, match=why):
            litz.run(app, workers=1, servers=1, **kwargs)


def test_checkpoint_files_and_directories_are_never_made_writable_by_every_user(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """Under a umask of 0, a ``ckpt-*`` directory and the files written in it are created without
    ``o+w`` in the first place, not made so and chmodded after (``_not_public``, disabled here to
    see what creation alone gives): in that window anyone could open a file for writing, and the
    descriptor stays writable after the chmod, or add entries to the directory."""
    monkeypatch.setattr(storage, "_not_public", lambda fs, path: None)
    root = tmp_path / "ckpt"
    old = os.umask(0)
    try:
        storage.prepare_root(str(root))
        fs, path = storage.filesystem(str(root))
        ck = storage.new_checkpoint_dir(fs, path)
        storage.write_bytes(fs, f"{ck}/driver.pkl", b"(pickle)")
        storage.write_shards(fs, f"{ck}/shards-0.arrow", [("t", 0, 1, np.zeros(1))])
        storage.write_manifest(fs, ck, _full_manifest(shards_files=["shards-0.arrow"]))
    finally:
        os.umask(old)
    made = [Path(ck), *Path(ck).rglob("*")]
    assert len(made) >= 4 and {p.name: oct(p.stat().st_mode & 0o777) for p in made if p.stat().st_mode & 0o002} == {}


def test_resume_refuses_a_checkpoint_whose_directory_or_files_every_user_may_write(tmp_path: Path) -> None:
    """Only the root given was checked for ``o+w``: a ``ckpt-*`` directory, or its driver.pkl, that
    every user may write (made under a umask of 0) was resumed from, though anyone could have
    replaced its pickles. Such a checkpoint is refused (not skipped for an older one), naming
    it; and what a job writes is never ``o+w``, whatever the umask."""
    from litz.runtime.master import Resume

    root = tmp_path / "ckpt"
    old = os.umask(0)
    try:  # a job run under umask 0: nothing it makes may be changed by every user
        storage.prepare_root(str(root))
        storage.write_timeline(str(root), None)  # a fresh run: both checkpoints below are its own
        fs, path = storage.filesystem(str(root))
        older = storage.new_checkpoint_dir(fs, path)
        storage.write_bytes(fs, f"{older}/driver.pkl", b"(pickle)")
        storage.write_manifest(fs, older, _full_manifest())
        newer = storage.new_checkpoint_dir(fs, path)
        storage.write_shards(fs, f"{newer}/shards-0.arrow", [("t", 0, 1, np.zeros(1))])
        storage.write_bytes(fs, f"{newer}/driver.pkl", b"(pickle)")
        storage.write_manifest(fs, newer, _full_manifest(shards_files=["shards-0.arrow"]))
    finally:
        os.umask(old)
    made = [root, *root.rglob("*")]
    assert len(made) == 9 and [p for p in made if p.stat().st_mode & 0o002] == []
    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    for public in (Path(newer), Path(newer, "driver.pkl"), Path(newer, storage.MANIFEST),
                   Path(newer, "shards-0.arrow")):
        mode = public.stat().st_mode & 0o7777
        public.chmod(mode | 0o002)
        what = "directory" if public.is_dir() else "file"
        why = f"checkpoint {what} {public} is writable by every user .mode {mode | 0o002:o}.*chmod -R go-w {newer}"
        with pytest.raises(storage.CheckpointError, match=why):
            Resume.find(str(root), app, None, 64)
        with pytest.raises(storage.CheckpointError, match=why):  # not skipped: an older one is no answer
            Resume.newest_usable(str(root), app, None, 64, app.driver())
        public.chmod(mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give files to another user (chown)")
def test_resume_refuses_a_checkpoint_another_user_owns_or_its_group_may_write(tmp_path: Path) -> None:
    """A checkpoint root another user made first (under ``/tmp``, say) with their own ``driver.pkl``
    in a ``ckpt-*``, all ``755``/``644``: ``--resume auto`` loaded it and ran their code as this
    user, because only ``o+w`` was refused. Now the root, the chosen ``ckpt-*`` and every file the
    job loads must be this user's (or root's); the ``ckpt-*`` and its files not writable by their
    group either. What a job writes is its owner's alone (``0700``/``0600``): the model is not
    readable by other users."""
    from litz.runtime.master import Resume

    root = tmp_path / "ckpt"
    storage.prepare_root(str(root))
    storage.write_timeline(str(root), None)
    fs, path = storage.filesystem(str(root))
    ck = storage.new_checkpoint_dir(fs, path)
    storage.write_bytes(fs, f"{ck}/driver.pkl", b"(pickle)")
    storage.write_manifest(fs, ck, _full_manifest())
    modes = {p.name: p.stat().st_mode & 0o777 for p in (root, Path(ck), *Path(ck).iterdir())}
    assert modes == {"ckpt": 0o700, Path(ck).name: 0o700, "driver.pkl": 0o600, storage.MANIFEST: 0o600}, modes
    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    nobody = 65534
    for theirs, why in ((root, f"checkpoint directory {root} belongs to .*uid {nobody}.*, not to you.*its owner could "
                               "make the job run their code"),
                        (Path(ck), f"checkpoint directory {ck} belongs to .*uid {nobody}"),
                        (Path(ck, "driver.pkl"), f"checkpoint file {ck}/driver.pkl belongs to .*uid {nobody}.*"
                                                 "resume only from checkpoints your own jobs wrote")):
        os.chown(theirs, nobody, -1)
        for find in (lambda: Resume.find(str(root), app, None, 64),
                     lambda: Resume.newest_usable(str(root), app, None, 64, app.driver())):
            with pytest.raises(storage.CheckpointError, match=why):
                find()
        os.chown(theirs, 0, -1)
    Path(ck, "driver.pkl").chmod(0o620)
    with pytest.raises(storage.CheckpointError, match=f"checkpoint file {ck}/driver.pkl is writable by its group "
                                                      f".mode 620.*chmod -R go-w {ck}"):
        Resume.find(str(root), app, None, 64)
    Path(ck, "driver.pkl").chmod(0o600)
    root.chmod(0o770)  # the root's group may write it: its ckpt-* and their files are still checked
    storage.refuse_public(str(root))
    storage.refuse_checkpoint_public(fs, ck, storage.read_manifest(fs, ck))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give files to another user (chown)")
def test_a_store_that_gives_this_users_files_another_owner_is_trusted_for_them(tmp_path: Path,
                                                                             monkeypatch) -> None:
    """On NFS with ``root_squash`` every file root makes is nobody's: the owner check refused every
    such checkpoint directory, a first run's included. The owner the store gives a file this
    process makes in the root (a probe) is trusted there too, and only there."""
    from types import SimpleNamespace

    nobody = 65534
    root = tmp_path / "squashed"
    root.mkdir(mode=0o700)
    os.chown(root, nobody, -1)  # as such a store shows what root made
    with pytest.raises(storage.CheckpointError, match="belongs to .*uid 65534"):
        storage.prepare_root(str(root))
    fstat = os.fstat

    def squashed(fd: int) -> object:
        st = fstat(fd)
        if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/.litz-owner-"):
            return SimpleNamespace(st_uid=nobody, st_mode=st.st_mode)
        return st

    monkeypatch.setattr(storage.os, "fstat", squashed)
    storage.prepare_root(str(root))  # the probe in it is nobody's: so are this user's files there
    assert list(root.iterdir()) == []  # (the probes are gone)
    elsewhere = tmp_path / "planted"  # another directory of nobody's, where this process's files are its own
    elsewhere.mkdir(mode=0o755)
    os.chown(elsewhere, nobody, -1)
    monkeypatch.undo()
    with pytest.raises(storage.CheckpointError, match="belongs to .*uid 65534"):
        storage.refuse_public(str(elsewhere))


class _StorageVanishingDriver(testapps.MigratingDriver):
    """Takes a checkpoint; once it is written turns the checkpoint directory into a file and asks
    for another (which cannot make its directory); once that failed puts the directory back and
    asks for a third."""

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self.stage = getattr(self, "stage", 0)
        done = len(self._master.checkpoints.completed)  # test-only access
        root = Path(self.config["root"])
        if self.stage == 0 and self.checkpoint():
            self.stage = 1
        elif self.stage == 1 and done == 1:
            root.rename(root.with_name("moved"))
            root.write_text("the storage is gone")
            self.stage = 2
        elif self.stage == 2 and self.checkpoint():
            self.stage = 3
        elif self.stage == 3 and done == 2:
            root.unlink()
            root.with_name("moved").rename(root)
            self.stage = 4
        elif self.stage == 4 and self.checkpoint():
            self.stage = 5
        super().handle_task_completion(result)

    def finish(self, result: object = None) -> None:
        if isinstance(result, dict):
            result = {**result, "checkpoints": list(self._master.checkpoints.completed)}  # test-only access
        super().finish(result)


def test_a_checkpoint_that_cannot_make_its_directory_fails_and_the_job_goes_on(tmp_path: Path) -> None:
    app = testapps.migrating_app(tasks=1000, executors=4, move_prob=0.1)
    app.driver = _StorageVanishingDriver
    app.config["root"] = str(tmp_path / "ckpt")
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=app.config["root"]).value
    np.testing.assert_array_equal(res["final"], res["truth"])  # every update, exactly once
    for seqs in res["done_seq"]:
        assert sorted(seqs) == list(range(len(seqs)))
    first, failed, third = res["checkpoints"]
    assert first["ok"] and third["ok"] and not failed["ok"]
    assert failed["path"] is None and "cannot create checkpoint directory" in failed["errors"][0]
    assert third["path"].endswith("ckpt-000001")  # the failed round took no number
    _, chosen, _ = storage.find_checkpoint(app.config["root"])
    assert chosen == third["path"]


def test_policy_and_round_state_machine() -> None:
    assert parse_every("30s") == (30.0, None) and parse_every("5") == (None, 5) and parse_every(None) == (None, None)
    for bad in ("0", "-3s", "soon", "1.5"):
        with pytest.raises(ConfigError):
            parse_every(bad)
    ck = CheckpointCoordinator("/tmp/x", "3")
    assert not ck.due(2) and ck.due(3)
    r = ck.begin("policy", 3)
    assert r is not None and ck.begin("again") is None and not ck.due(100)
    assert r.phase == "preparing"  # training goes on until the round's directory exists
    assert ck.directory_made("/tmp/x/ckpt-000000") and r.phase == "pausing"  # then it holds new tasks
    ck.snapshotting("/tmp/x/ckpt-000000", ["s0"], ["w0"])
    assert not ck.snapshot_taken(r.cid + 1, "s0")  # another round's answer is ignored
    assert not ck.snapshot_taken(r.cid, "s0") and ck.snapshot_taken(r.cid, "w0")
    assert not ck.written(r.cid, "w0", ["executors-w0.arrow"], None)
    assert ck.written(r.cid, "s0", [], "s0: OSError: disk full")
    record = ck.finish()
    assert record["ok"] is False and "disk full" in record["errors"][0] and ck.round is None
    assert not ck.due(5) and ck.due(6)
    # a process's "written" may be handled before its "snapshot" (nested polling): the master
    # counts the snapshot first, so the round still completes
    r = ck.begin("policy", 6)
    assert r is not None and ck.directory_made("/tmp/x/ckpt-000001")
    ck.snapshotting("/tmp/x/ckpt-000001", ["s0"], [])
    assert ck.snapshot_taken(r.cid, "s0")  # what the master does on "written" first
    assert ck.written(r.cid, "s0", ["shards-s0.arrow"], None)
    assert not ck.snapshot_taken(r.cid, "s0")  # the late snapshot message changes nothing
    assert ck.finish()["ok"]


def test_partial_policies_take_a_full_checkpoint_again_after_eight_periods_of_partial_ones() -> None:
    """A recovery restores the base and every partial checkpoint after it: without a new base now
    and then, that chain (and the directory) grew for as long as the job ran."""
    from litz.ft.checkpoint import REBASE_PERIODS

    ck = CheckpointCoordinator("/tmp/x", "8", policy="priority", fraction=0.25)
    kinds = []
    for it in range(0, 8 * 80, 2):  # a round every 2 iterations: r·C with r = 1/4, C = 8
        if ck.due(it):
            r = ck.begin("policy", it, kind="partial" if ck.partial_next() else "full")
            assert r is not None
            kinds.append(r.kind)
            ck.finish()
    run = REBASE_PERIODS * 4  # partial rounds between two full ones: 8 periods of 1/r rounds
    assert kinds[:run + 3] == ["full"] + ["partial"] * run + ["full", "partial"], kinds
    assert kinds.count("full") >= 2
    r = ck.begin("policy", 10**6, kind="partial")
    assert r is not None
    r.errors.append("s0: disk full")
    ck.finish()  # a failed partial round does not count towards the next base
    ck.rolled_back()
    assert not ck.partial_next() and ck.base() is None  # after a rollback: a full round first


def test_a_round_names_the_step_it_has_waited_for_too_long() -> None:
    """``overdue``: what a round waited for past ``timeout``, phase by phase (the master fails the
    round with it); nothing while a full round waits for the application's running tasks."""
    ck = CheckpointCoordinator("/tmp/x", "3", timeout=10.0)

    def late(r) -> str | None:
        r.since -= 11.0
        return ck.overdue()

    r = ck.begin("policy", 3)
    assert r is not None and ck.overdue() is None and late(r) == "its directory"
    assert ck.directory_made("/tmp/x/ckpt-000000") and ck.overdue() is None
    assert late(r) is None  # the running tasks drain: not a step of the round's
    ck.snapshotting(r.dir_path, ["server-1", "server-0"], ["worker-0"])
    assert ck.overdue() is None and late(r) == "server-0's snapshot, server-1's snapshot, worker-0's snapshot"
    for p in ("server-0", "server-1", "worker-0"):
        ck.snapshot_taken(r.cid, p)
    r.waiting_written.add("master")
    ck.written(r.cid, "server-1", ["shards-server-1.arrow"], None)
    assert ck.overdue() is None and late(r) == "server-0's part, the driver's file, worker-0's part"
    r.enter("manifest")
    assert ck.overdue() is None and late(r) == "its manifest"
    ck.finish()
    r = ck.begin("policy", 6, kind="partial")
    assert r is not None
    r.asked, r.scores = {"server-0", "worker-0"}, {"worker-0": np.zeros(2)}
    assert late(r) == "its directory"
    assert not ck.directory_made("/tmp/x/ckpt-000001")  # a partial round never pauses
    assert late(r) == "server-0's scores"
    with pytest.raises(ConfigError, match="--checkpoint-timeout"):
        CheckpointCoordinator("/tmp/x", "3", timeout=-1)


@pytest.mark.parametrize("store", ["local", "s3"])
def test_checkpoint_then_resume_restores_tables_executors_and_driver(tmp_path: Path, request: pytest.FixtureRequest,
                                                                     store: str) -> None:
    """Also on S3 (a real S3 server, through pyarrow's S3 client): the storage the issue names."""
    ckpt = str(tmp_path / "ckpt") if store == "local" else \
        s3_location(request.getfixturevalue("s3_bucket"), f"resume-{time.time_ns()}")
    app = testapps.migrating_app(tasks=1200, executors=6, move_prob=0.1)
    app.driver = testapps.CheckpointingDriver
    app.config.update(checkpoint_at=300, stop_at=700)
    first = litz.run(app, workers=2, servers=2, checkpoint_dir=ckpt)
    assert first.value == {"stopped_early": True}
    _, path, manifest = storage.find_checkpoint(ckpt)
    named = storage.display(ckpt, path)  # how logs and replies name it: what --resume takes
    assert named.startswith("s3://" if store == "s3" else "/") and storage.find_checkpoint(named)[1] == path
    assert named in [c["name"] for c in first.stats["master"]["checkpoints"] if c["ok"]]  # and litz status
    assert manifest["num_executors"] == 6 and len(manifest["shards_files"]) == 2
    assert len(manifest["executors_files"]) == 2
    fs, _ = storage.filesystem(ckpt)
    saved = np.zeros((16, 3))
    for name in manifest["shards_files"]:
        for table, _, key, raw in storage.read_shards(fs, f"{path}/{name}"):
            assert table == "s"
            saved[key] = np.frombuffer(raw)
    assert saved.any()
    # resume with another layout (3 workers, 1 server): same tables, states and driver
    app.config.update(checkpoint_at=None, stop_at=None)
    second = litz.run(app, workers=3, servers=1, resume=ckpt)
    res = second.value
    np.testing.assert_array_equal(res["at_resume"], saved)  # the tables exactly as checkpointed
    assert 300 <= res["resumed_at"] < 700
    np.testing.assert_array_equal(res["final"], res["truth"])  # and the job went on exactly
    for seqs in res["done_seq"]:  # executors' counters resumed where the driver's records stop
        assert sorted(seqs) == list(range(len(seqs)))
    assert sum(len(s) for s in res["done_seq"]) == 1200
    assert processes_mentioning(first.job) == [] and processes_mentioning(second.job) == []


def test_resume_auto_reads_a_timeline_record_of_the_earlier_layout(tmp_path: Path) -> None:
    """``TIMELINE.json`` as written before anchors were recorded by name (same format, 1) held the
    anchor's root and path: ``{"location": L, "path": P}``. Its path was dropped, the root taken for
    the checkpoint: ``--resume auto`` then found no manifest there and refused the directory."""
    from litz.runtime.master import Resume

    loc, other = str(tmp_path / "d"), str(tmp_path / "o")

    def made(where: str) -> str:
        fs, root = storage.filesystem(where)
        path = storage.new_checkpoint_dir(fs, root)
        storage.write_manifest(fs, path, _full_manifest())
        return path

    a0, a1, o0 = made(loc), made(loc), made(other)
    for where, path in ((loc, a0), (other, o0)):
        Path(loc, storage.TIMELINE).write_text(json.dumps(
            {"format": 1, "after": storage.checkpoint_seq(a1), "anchor": {"location": where, "path": path}}))
        assert storage.read_timeline(loc) == (storage.checkpoint_seq(a1), (where, path))
        assert [(w, p, m is None) for w, _, p, m in Resume._timeline(loc)] == [(where, path, True)]
    Path(loc, storage.TIMELINE).write_text(json.dumps(
        {"format": 1, "after": 1, "anchor": {"location": loc, "path": 7}}))
    assert storage.read_timeline(loc) is None  # damaged: said, and the directory's newest is taken


def test_messages_leave_the_user_part_of_a_checkpoint_uri_out(s3_bucket: str, caplog) -> None:  # noqa: ANN001
    """README: "Litz leaves a URI's user part out of what it prints". The errors and warnings that
    name a checkpoint location (storage, the coordinator, ``--resume auto``, ``litz.run``) named it
    as given, ``s3://KEY:SECRET@bucket/...`` included; they name it as ``storage.redact`` does."""
    from litz.runtime.master import Resume

    secret = "litz-test-hush-hush"
    base, query = s3_bucket.split("?", 1)

    def uri(name: str, bucket: str = "litz-test", extra: str = "") -> str:
        return base.replace("s3://litz-test", f"s3://litz-test:{secret}@{bucket}") + f"/{name}?{query}{extra}"

    assert storage.redact(uri("ck")) == f"{base}/ck?{query}"
    assert storage.redact("/home/me@host/ck") == "/home/me@host/ck"  # a local path as it is
    assert storage.redact("hdfs://nn:8020/me@x/ck") == "hdfs://nn:8020/me@x/ck"  # an @ of the path stays
    assert storage.redact("hdfs://[::1]:8020/me@x/ck") == "hdfs://[::1]:8020/me@x/ck"  # an IPv6 host too
    assert storage.redact("s3://A[K:S/E@b/p") == "s3://b/p"  # (a bracket in a user part, a / in its secret)
    assert storage.redact("s3://K:S%2Fx@b/me@x/ck") == "s3://b/me@x/ck"
    caplog.set_level("WARNING")
    errors: list[str] = []

    def fails(call: Callable[[], object], kind: type[Exception], shown: str) -> None:
        with pytest.raises(kind) as info:
            call()
        assert shown in str(info.value)  # the location is still named, without its user part
        errors.append(str(info.value))

    fails(lambda: storage.filesystem(uri("ck", extra="&bogus=1")), storage.CheckpointError, "s3://litz-test/ck?")
    # a secret with a / left unescaped: pyarrow refuses the URI, quoting it whole in its error
    fails(lambda: storage.filesystem(uri("ck").replace(secret, f"{secret}/more")), storage.CheckpointError,
          "Cannot parse URI: 's3://litz-test/ck?")
    fails(lambda: storage.prepare_root(uri("ck", "no-such-bucket")), storage.CheckpointError,
          "s3://no-such-bucket/ck?")
    fails(lambda: storage.find_checkpoint(uri("empty")), storage.NoCheckpoint, "s3://litz-test/empty?")
    fails(lambda: CheckpointCoordinator(uri("empty")).last_full(), storage.NoCheckpoint, "s3://litz-test/empty?")
    CheckpointCoordinator(uri("ck", "no-such-bucket")).record_timeline()  # a warning: the job goes on
    assert any("another run in s3://no-such-bucket/ck?" in r.getMessage() for r in caplog.records)
    loc = uri("anchored")  # --resume auto, the run recorded there went on from a checkpoint now gone
    fs, root = storage.filesystem(loc)
    gone = storage.new_checkpoint_dir(fs, root)
    storage.write_bytes(fs, f"{gone}/driver.pkl", b"no manifest")
    storage.write_timeline(loc, (loc, gone))
    app = testapps.migrating_app(tasks=10, executors=4, move_prob=0.0)
    fails(lambda: Resume.newest_usable(loc, app, None, 64, app.driver()), storage.DamagedCheckpoint,
          "the checkpoint the last run in s3://litz-test/anchored?")
    # litz.run: none to resume, said in a warning (a bad policy then stops it before anything starts)
    fails(lambda: litz.run(app, checkpoint_dir=uri("fresh"), resume="auto", checkpoint_policy="nope"), ConfigError,
          "--checkpoint")
    assert any("no usable complete checkpoint in s3://litz-test/fresh?" in r.getMessage() for r in caplog.records)
    leaks = [m for m in [*errors, *(r.getMessage() for r in caplog.records)] if secret in m]
    assert leaks == []


def test_resume_refuses_a_checkpoint_of_another_shape(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    app = testapps.migrating_app(tasks=400, executors=4, move_prob=0.0)
    app.driver = testapps.CheckpointingDriver
    app.config.update(checkpoint_at=50, stop_at=200)
    litz.run(app, workers=1, servers=1, checkpoint_dir=str(ckpt))
    other = testapps.migrating_app(tasks=400, executors=4, move_prob=0.0)
    other.tables = [litz.Table("s", (4,), "float64", num_rows=16)]
    with pytest.raises(storage.CheckpointError, match="holds tables"):
        litz.run(other, workers=1, servers=1, resume=str(ckpt))
    other.tables = [litz.Table("s", (3,), "float64", num_rows=32)]  # same rows, not as many
    with pytest.raises(storage.CheckpointError, match="holds tables"):
        litz.run(other, workers=1, servers=1, resume=str(ckpt))
    # a damaged driver state is refused, with its file, before any process starts
    _, path, _ = storage.find_checkpoint(str(ckpt))
    blob = Path(path, "driver.pkl").read_bytes()
    Path(path, "driver.pkl").write_bytes(blob[: len(blob) // 2])
    started = time.monotonic()
    with pytest.raises(storage.CheckpointError, match=f"cannot load the driver's state from {path}/driver.pkl: "
                                                      "UnpicklingError"):
        litz.run(app, workers=1, servers=1, resume=str(ckpt))
    assert time.monotonic() - started < 2.0
    Path(path, "driver.pkl").write_bytes(blob)
    # a checkpoint whose manifest was removed is not a checkpoint
    _, path, _ = storage.find_checkpoint(str(ckpt))
    Path(path, storage.MANIFEST).unlink()
    with pytest.raises(storage.CheckpointError, match="no complete checkpoint"):
        litz.run(app, workers=1, servers=1, resume=str(ckpt))


def test_litz_checkpoint_command_on_a_running_job(tmp_path: Path, monkeypatch) -> None:
    import threading

    from litz.cli import checkpoint

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    stop = tmp_path / "stop"
    out: dict = {}
    jobs = {}
    for name, ckpt in (("with", str(tmp_path / "ckpt")), ("without", None)):
        app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
        app.driver = testapps.TimedMigratingDriver
        app.config.update(stop_after=60.0, stop_file=str(stop))
        job = jobs[name] = f"ckcmd-{name}-{time.time_ns()}"
        t = threading.Thread(target=lambda a=app, j=job, c=ckpt, n=name: out.update(
            {n: litz.run(a, workers=1, servers=1, job=j, checkpoint_dir=c)}), daemon=True)
        t.start()
        out[f"{name}-thread"] = t
    try:
        for job in jobs.values():
            wait_running(job)
        assert checkpoint(["--job", jobs["with"]]) == 0
        assert checkpoint(["--job", jobs["with"]]) == 0
        assert checkpoint(["--job", jobs["without"]]) == 1  # refused: no --checkpoint-dir
    finally:
        stop.touch()
        for name in ("with", "without"):
            out[f"{name}-thread"].join(60)
    fs, root = storage.filesystem(str(tmp_path / "ckpt"))
    dirs = storage.checkpoint_dirs(fs, root)
    assert len(dirs) == 2 and all(storage.has_manifest(fs, p) for _, p in dirs)
    res = out["with"].value
    np.testing.assert_array_equal(res["final"], res["truth"])  # checkpoints changed nothing


def test_an_etcd_outage_as_a_commanded_checkpoint_ends_delays_its_answer_and_stops_nothing(
        tmp_path: Path, monkeypatch) -> None:
    """etcd goes away just before the round a `litz checkpoint` asked for is finished, and comes back
    7 s later: the master answers the command once etcd is back, and the job trains on and ends with
    exact sums. Before, the master wrote the answer synchronously: the write raised EtcdUnreachable
    out of its loop and the job failed."""
    import threading

    from litz.runtime import master as master_module
    from litz.runtime.elastic import RESULTS
    from litz.runtime.etcd_server import LocalEtcd
    from litz.runtime.membership import Membership

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    stop = tmp_path / "stop"
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=60.0, stop_file=str(stop))
    job = f"ckcmd-outage-{time.time_ns()}"
    server = LocalEtcd()
    server.start()
    finish = master_module.Master._finish_checkpoint
    down = threading.Event()

    def finish_in_an_outage(self: master_module.Master) -> None:
        r = self.checkpoints.round if self.checkpoints is not None else None
        if r is not None and r.commands and not down.is_set():
            server._stop_process()  # etcd goes away as the round the command asked for is finished
            down.set()
        finish(self)

    monkeypatch.setattr(master_module.Master, "_finish_checkpoint", finish_in_an_outage)
    try:
        t, out = run_in_thread(app, workers=2, servers=2, job=job, etcd=server.url,
                               checkpoint_dir=str(tmp_path / "ckpt"))
        try:
            status_when(job, lambda s: s["master"].get("completed", 0) >= 100)
            with Membership(server.url, job) as m:
                m.put(master_module.CHECKPOINT_KEY, {"id": "c1", "time": time.time()})
                assert down.wait(60), "the commanded round never finished"
                time.sleep(7.0)  # longer than a call's deadline (5 s), which a synchronous write waited
                assert "error" not in out, out.get("traceback")
                # (started from this thread: etcd dies with the thread that started it)
                server._launch(15.0)
                deadline = time.monotonic() + 30
                while (answer := m.get(f"{RESULTS}c1")) is None:
                    assert time.monotonic() < deadline and "error" not in out, out.get("traceback", "no answer")
                    time.sleep(0.1)
            assert answer["ok"] is True, answer
            done = status_when(job, lambda s: True)["master"]["completed"]
            status_when(job, lambda s: s["master"].get("completed", 0) >= done + 100, timeout=30)
        finally:
            stop.touch()
            t.join(60)
        res = ended_exact(t, out)
        [ck] = [c for c in res.stats["master"]["checkpoints"] if c["reason"] == "command c1"]
        assert ck["ok"] and storage.has_manifest(*storage.filesystem(str(tmp_path / "ckpt"))[:1], ck["path"])
    finally:
        server.stop()
    assert processes_mentioning(job) == []


def test_processes_scaled_in_while_a_checkpoint_is_written_keep_their_files_in_it(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """A server and a worker leave (scale-in) after the snapshot, while the round still waits for a
    part (here the master's own, slowed down): the manifest must list their files, which hold rows
    and executors no one else saved. It listed the files of the processes in the job when the last
    part came in, so the shards of the server gone were missing: a rollback to that checkpoint
    lost their rows, and a resume failed for the executors (found with checkpoints on S3)."""
    import threading

    from litz.cli import checkpoint, scale

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    write_bytes = storage.write_bytes

    def slow_driver_file(fs, path: str, data: bytes) -> None:
        if path.endswith("/driver.pkl"):  # the master's part, written in this process
            time.sleep(3.0)
        write_bytes(fs, path, data)

    monkeypatch.setattr(storage, "write_bytes", slow_driver_file)
    stop = tmp_path / "stop"
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=60.0, stop_file=str(stop))
    job = f"ckscale-{time.time_ns()}"
    ckpt = str(tmp_path / "ckpt")
    t, out = run_in_thread(app, workers=2, servers=2, job=job, checkpoint_dir=ckpt)
    answered: dict[str, int] = {}
    try:
        wait_running(job)
        asked = threading.Thread(target=lambda: answered.update(rc=checkpoint(["--job", job])), daemon=True)
        asked.start()
        time.sleep(0.5)  # the snapshot is taken; the round waits for the driver's file
        assert scale(["--job", job, "--servers", "1", "--wait", "--timeout", "30"]) == 0
        assert scale(["--job", job, "--workers", "1", "--wait", "--timeout", "30"]) == 0
        asked.join(30)
        assert answered.get("rc") == 0
    finally:
        stop.touch()
        t.join(60)
    assert not t.is_alive() and "error" not in out, out.get("error")
    fs, path, manifest = storage.find_checkpoint(ckpt)
    assert len(manifest["shards_files"]) == 2 and len(manifest["executors_files"]) == 2, manifest
    rows = {key for name in manifest["shards_files"] for _, _, key, _ in storage.read_shards(fs, f"{path}/{name}")}
    assert rows == set(range(16))
    executors = {e for name in manifest["executors_files"] for e in storage.read_executors(fs, f"{path}/{name}")}
    assert executors == set(range(4))


def test_select_top_picks_exactly_the_global_top_fraction() -> None:
    import math

    from litz.ft.checkpoint import select_top

    rng = np.random.default_rng(7)
    for trial in range(50):
        scores = {f"s{i}": rng.integers(0, 5, size=rng.integers(0, 30)).astype(float) for i in range(3)}
        scores["s1"][:2] = np.inf if len(scores["s1"]) >= 2 else scores["s1"][:2]
        fraction = rng.choice([0.125, 0.25, 0.5, 1.0])
        chosen = select_top(scores, fraction)
        total = sum(len(v) for v in scores.values())
        k = math.ceil(fraction * total)
        assert sum(len(v) for v in chosen.values()) == k
        everything = sorted(((-v, srv, i) for srv, arr in scores.items() for i, v in enumerate(arr)))
        expect: dict[str, list[int]] = {srv: [] for srv in scores}
        for _, srv, i in everything[:k]:
            expect[srv].append(i)
        assert chosen == {srv: sorted(v) for srv, v in expect.items()}, trial


def test_server_scores_rows_by_distance_age_or_chance() -> None:
    from litz.ps.server import ShardStore

    table = litz.Table("w", (2,), "float64")
    store = ShardStore({"w": table}, shards=[0, 1], num_shards=2)
    store.update("w", [0, 1, 2], np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]]))
    entries, scores = store.scores("priority", 1)
    assert np.isinf(scores).all()  # never saved: first in line
    store.remember(store.rows_snapshot(), 1)
    store.update("w", [1, 2], np.array([[0.0, 1.0], [3.0, 4.0]]))
    entries, scores = store.scores("priority", 2)
    dist = dict(zip([k for _, _, k in entries], scores, strict=True))
    assert dist == {0: 0.0, 1: 1.0, 2: 5.0}
    store.remember([(n, s, k, store.shards[s][n][k].copy()) for n, s, k in entries if k == 2], 2)
    entries, scores = store.scores("round-robin", 3)  # rounds since saved, in the master's numbering
    assert dict(zip([k for _, _, k in entries], scores, strict=True)) == {0: 2, 1: 2, 2: 1}
    _, a = store.scores("random", 3)
    _, b = store.scores("random", 4)
    assert len(a) == 3 and not np.array_equal(a, b)


def test_priority_partial_checkpoints_save_the_top_fraction_after_a_full_base(tmp_path: Path, monkeypatch) -> None:
    import math

    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    ckpt = str(tmp_path / "ckpt")
    res = _run_until(tmp_path, monkeypatch, lambda cs: any(c["ok"] and c["kind"] == "partial" for c in cs), app,
                     workers=2, servers=2, checkpoint_dir=ckpt, checkpoint_every="0.2s",
                     checkpoint_policy="priority", checkpoint_fraction=0.25)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])  # no pause, nothing changed
    records = [c for c in res.stats["master"]["checkpoints"] if c["ok"]]
    assert records and records[0]["kind"] == "full"
    running = storage.running_checkpoint(ckpt)
    assert running is not None
    base, manifest, partials = running
    assert "partial_of" not in manifest
    assert partials, records  # stopped at the first partial round, long before the next full base (8 periods)
    fs, _ = storage.filesystem(ckpt)
    for path, files in partials:
        rows = [r for name in files for r in storage.read_shards(fs, f"{path}/{name}")]
        assert len(rows) == math.ceil(0.25 * 16)  # the table has 16 rows, all touched
    with pytest.raises(ConfigError):
        litz.run(app, checkpoint_dir=str(tmp_path), checkpoint_policy="best")
    with pytest.raises(ConfigError):
        litz.run(app, checkpoint_dir=str(tmp_path), checkpoint_policy="priority", checkpoint_fraction=1.5)


#: when the test's job handled each completion (the master, hence the driver, runs in this process)
_COMPLETED_AT: list[float] = []


class _ClockedDriver(testapps.TimedMigratingDriver):
    def handle_task_completion(self, result: litz.TaskResult) -> None:
        _COMPLETED_AT.append(time.monotonic())
        super().handle_task_completion(result)


@pytest.mark.parametrize("policy", ["full", "priority"])
def test_slow_storage_does_not_hold_the_masters_loop(tmp_path: Path, monkeypatch, policy: str) -> None:
    """The master makes a round's directory and writes its manifest off its loop: on a network store
    (S3) each takes requests, and completions must go on being handled, and tasks dispatched,
    meanwhile. Here both take 0.3 s; tasks must complete during them (on the loop, none could;
    nor during a full round's directory while the round held new tasks from its start)."""
    spans: list[tuple[str, float, float]] = []

    def slow(fn):
        def wrapped(*args, **kwargs):
            start = time.monotonic()
            time.sleep(0.3)
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((fn.__name__, start, time.monotonic()))
        return wrapped

    monkeypatch.setattr(storage, "new_checkpoint_dir", slow(storage.new_checkpoint_dir))
    monkeypatch.setattr(storage, "write_manifest", slow(storage.write_manifest))
    _COMPLETED_AT.clear()
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    app.driver = _ClockedDriver
    app.config.update(stop_after=2.0)
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=str(tmp_path), checkpoint_every="0.1s",
                   checkpoint_policy=policy, checkpoint_fraction=0.5 if policy == "priority" else 1.0)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    records = [c for c in res.stats["master"]["checkpoints"] if c["ok"]]
    assert len(records) >= 2 and (policy == "full" or any(c["kind"] == "partial" for c in records))
    assert storage.find_checkpoint(str(tmp_path))[1] in [c["path"] for c in records]

    def completed_during(step: str, margin: float) -> int:
        return sum(a + margin < t < b - margin for name, a, b in spans if name == step for t in _COMPLETED_AT)

    assert completed_during("write_manifest", 0.05) >= 5, spans
    # a partial round never pauses; a full one only once its directory exists (before, it held new
    # tasks from its start: with a dead store, for the seconds each attempt took, round after round)
    assert completed_during("new_checkpoint_dir", 0.05) >= 5, spans


@pytest.mark.parametrize("policy", ["full", "priority"])
def test_a_round_the_job_ends_before_it_saves_anything_leaves_no_directory(tmp_path: Path, monkeypatch,
                                                                          policy: str) -> None:
    """A round that had saved nothing when the job finished (its directory still being made, or
    made and training pausing, or rows being scored) is dropped. Its directory, empty and never
    to be reused, stayed under the root: one per job that checkpoints. Here making a directory
    takes 0.4 s and rounds follow each other, so the job ends inside one almost surely: every
    directory left must be a complete checkpoint."""
    made: list[str] = []
    make = storage.new_checkpoint_dir

    def slow_dir(fs, root, last=None):
        time.sleep(0.4)
        made.append(make(fs, root, last))
        return made[-1]

    monkeypatch.setattr(storage, "new_checkpoint_dir", slow_dir)
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=1.5)
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=str(tmp_path), checkpoint_every="0.05s",
                   checkpoint_policy=policy, checkpoint_fraction=0.5 if policy == "priority" else 1.0)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    time.sleep(0.6)  # a directory still being made when the job ended is made by now
    fs, root = storage.filesystem(str(tmp_path))
    dirs = [p for _, p in storage.checkpoint_dirs(fs, root)]
    records = [c["path"] for c in res.stats["master"]["checkpoints"] if c["ok"]]
    assert len(made) > len(records) >= 1, (made, records)  # a round was dropped at the end
    assert dirs == records, (dirs, records)
    assert all(storage.has_manifest(fs, p) for p in dirs)


def test_a_checkpoint_step_that_hangs_fails_its_round_and_training_goes_on(tmp_path: Path, monkeypatch) -> None:
    """A store that hangs (an NFS server gone) must not hold a round open for ever. The first
    round's directory never comes back (until the test ends), then the second round's driver
    file, then the third round's manifest: after ``checkpoint_timeout`` each round fails, naming
    what it waited for, and later rounds are taken. Before, the first round stayed open: no
    checkpoint after it, and, its directory hanging, training stayed paused (the job never
    finished). Then a server's part hangs (round 4: its file is a FIFO no one reads, as a write to a
    dead NFS server blocks): the next round that asks that server fails at once, saying why (before,
    the part queued behind the hung one, holding a copy of the server's rows, round after round,
    until the store answered), and once the write comes back (round 6) rounds complete again."""
    import threading

    released = threading.Event()
    hung: list[str] = []

    def hang_first(fn, matches=lambda *args: True):
        def wrapped(*args, **kwargs):
            if matches(*args) and fn.__name__ not in hung:  # once each
                hung.append(fn.__name__)
                released.wait(60)
                raise OSError("the store is gone")
            return fn(*args, **kwargs)
        return wrapped

    dirs: list[str] = []
    hang_dir = hang_first(storage.new_checkpoint_dir)

    def new_dir(*args, **kwargs):
        path = hang_dir(*args, **kwargs)
        dirs.append(path)
        if len(dirs) == 3:  # the 4th round's (the 1st round's never came back)
            os.mkfifo(f"{path}/shards-s0.arrow")
        elif len(dirs) == 5:  # the write of round 4 comes back (broken pipe) before round 6 asks
            os.close(os.open(f"{dirs[2]}/shards-s0.arrow", os.O_RDONLY | os.O_NONBLOCK))
        return path

    monkeypatch.setattr(storage, "new_checkpoint_dir", new_dir)
    monkeypatch.setattr(storage, "write_bytes",
                        hang_first(storage.write_bytes, lambda fs, path, data: path.endswith("/driver.pkl")))
    monkeypatch.setattr(storage, "write_manifest", hang_first(storage.write_manifest))
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=7.0)
    t, out = run_in_thread(app, workers=2, servers=1, checkpoint_dir=str(tmp_path), checkpoint_every="0.2s",
                           checkpoint_timeout=1.0)
    try:
        t.join(60)
        assert not t.is_alive(), "the job stalled behind a hung checkpoint step"
    finally:
        released.set()
        t.join(30)
    assert "error" not in out, out.get("error")
    res = out["res"]
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    records = res.stats["master"]["checkpoints"]
    assert [c["ok"] for c in records[:5]] == [False] * 5 and any(c["ok"] for c in records[5:]), records
    errors = [c["errors"][0] for c in records[:5]]
    assert errors[0] == "timed out after 1 s waiting for its directory", errors
    # what else it names depends on the machine's load (a server's part may be late too)
    assert errors[1].startswith("timed out after 1 s waiting for ") and "the driver's file" in errors[1], errors
    assert errors[2] == ("timed out after 1 s waiting for its manifest (should the write still succeed, the "
                         "checkpoint is complete and usable)"), errors
    assert errors[3].startswith("timed out after 1 s waiting for ") and "s0's part" in errors[3], errors
    assert re.fullmatch(r"s0: its part of round 4 is still being written, \d+ s on: the store does not answer",
                        errors[4]), errors
    assert storage.find_checkpoint(str(tmp_path))[1] in [c["path"] for c in records if c["ok"]]
    with pytest.raises(ConfigError, match="--checkpoint-timeout"):
        litz.run(app, checkpoint_dir=str(tmp_path), checkpoint_timeout=0)


def test_tables_say_what_distance_ranks_their_rows() -> None:
    """Priority checkpoints rank rows by each table's own distance; a broken one names its table."""
    from litz.errors import TableError
    from litz.ps.server import ShardStore
    from litz.ps.tables import DISTANCES

    tv = DISTANCES["tv"]
    # the same mix at double the length has moved by its length times TV = 0 ...
    assert tv(np.array([2.0, 2.0]), np.array([1.0, 1.0])) == 0.0
    # ... a document of 10 tokens that moved all its mass: 10 * 1; one of 2 tokens, half: 2 * 0.5
    assert tv(np.array([[0.0, 10.0], [1.0, 1.0]]), np.array([[5.0, 0.0], [2.0, 0.0]])) == 10.0 + 1.0
    assert tv(np.array([0.0, 0.0]), np.array([3.0, 1.0])) == 4.0  # emptied: its old length, fully
    with pytest.raises(TableError, match="unknown distance 'cosine'"):
        litz.Table("w", (2,), distance="cosine")

    tables = {"c": litz.Table("c", (2,), "float64", distance="tv"),
              "w": litz.Table("w", (2,), "float64", distance=lambda v, s: float(abs(v[0] - s[0])))}
    store = ShardStore(tables, shards=[0], num_shards=1)
    store.update("c", [0, 1], np.array([[4.0, 4.0], [1.0, 3.0]]))
    store.update("w", [0], np.array([[1.0, 1.0]]))
    store.remember(store.rows_snapshot(), 1)
    store.update("c", [0, 1], np.array([[4.0, 4.0], [3.0, -1.0]]))  # c0 keeps its mix; c1 -> (4, 2)
    store.update("w", [0], np.array([[0.5, 100.0]]))  # only column 0 counts for w
    entries, scores = store.scores("priority", 0)
    got = {(name, key): s for (name, _, key), s in zip(entries, scores, strict=True)}
    assert got == pytest.approx({("c", 0): 0.0, ("c", 1): 6 * 0.5 * (abs(4 / 6 - 1 / 4) + abs(2 / 6 - 3 / 4)),
                                 ("w", 0): 0.5})

    broken = {"w": litz.Table("w", (2,), "float64", distance=lambda v, s: float("nan"))}
    store = ShardStore(broken, shards=[0], num_shards=1)
    store.update("w", [0], np.array([[1.0, 1.0]]))
    store.remember(store.rows_snapshot(), 1)
    with pytest.raises(TableError, match="table 'w': distance function returned nan"):
        store.scores("priority", 0)
    store.tables["w"] = litz.Table("w", (2,), "float64", distance=lambda v, s: 1 / 0)
    with pytest.raises(TableError, match="table 'w': distance function failed: ZeroDivisionError"):
        store.scores("priority", 0)


def test_built_in_distances_rank_rows_holding_infinities_and_nans() -> None:
    """Rows with infinite or NaN entries (the empty slots of neighbour lists hold inf, a min
    table starts at inf) are ranked, not refused: an entry equal to its saved self counts 0, one
    that became finite or NaN counts inf. Before, ``inf - inf`` made every such row's distance NaN,
    and every priority checkpoint of an NN-Descent job failed."""
    from litz.ps.server import ShardStore
    from litz.ps.tables import DISTANCES

    inf, nan = np.inf, np.nan
    for name in ("l2", "l1"):
        d = DISTANCES[name]
        assert d(np.array([1.0, inf, -inf]), np.array([1.0, inf, -inf])) == 0.0
        assert d(np.array([nan, 3.0]), np.array([nan, 3.0])) == 0.0
        assert d(np.array([2.0, inf]), np.array([inf, inf])) == inf
        assert d(np.array([nan, 0.0]), np.array([1.0, 0.0])) == inf
        assert d(np.array([4.0, inf]), np.array([1.0, inf])) == 3.0
    assert DISTANCES["l2"](np.array([4.0, inf, 5.0]), np.array([1.0, inf, 1.0])) == 5.0

    table = litz.Table("knn", (2, 3), "float32", init=lambda key, shape, dtype: np.full(shape, np.inf, dtype),
                       combiner="min")
    store = ShardStore({"knn": table}, shards=[0], num_shards=1)
    store.update("knn", [0, 1, 2], np.full((3, 2, 3), np.inf, np.float32))
    store.remember(store.rows_snapshot(), 1)
    store.update("knn", [0, 1], np.array([[[1, 2, inf], [inf] * 3], [[inf] * 3, [inf, inf, 7]]], np.float32))
    store.update("knn", [2], np.full((1, 2, 3), np.inf, np.float32))
    entries, scores = store.scores("priority", 0)
    got = {key: s for (_, _, key), s in zip(entries, scores, strict=True)}
    assert got == {0: inf, 1: inf, 2: 0.0}


def test_a_failing_distance_fails_its_partial_rounds_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0, distance=testapps.failing_distance)
    ckpt = str(tmp_path / "ckpt")
    res = _run_until(tmp_path, monkeypatch, lambda cs: any(not c["ok"] for c in cs), app,
                     workers=2, servers=2, checkpoint_dir=ckpt, checkpoint_every="0.2s",
                     checkpoint_policy="priority", checkpoint_fraction=0.25)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    records = res.stats["master"]["checkpoints"]
    assert records[0]["ok"] and records[0]["kind"] == "full"  # the base needs no distance
    failed = [c for c in records if not c["ok"]]
    assert failed and all(c["kind"] == "partial" for c in failed), records
    assert "table 's': distance function failed: RuntimeError: no distance today" in failed[0]["errors"][0]
    base, _, partials = storage.running_checkpoint(ckpt)  # type: ignore[misc]
    assert base == records[0]["path"] and partials == []


def test_litz_stop_after_a_checkpoint_then_resume_goes_on_exactly(tmp_path: Path, monkeypatch) -> None:
    import threading

    from litz.cli import stop

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    ckpt = str(tmp_path / "ckpt")
    done_file = tmp_path / "done"
    out: dict = {}

    def run(app: litz.App, job: str, **kw) -> None:
        try:
            out[job] = litz.run(app, workers=2, servers=1, job=job, **kw)
        except litz.JobStopped as exc:
            out[job] = exc

    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.05)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=60.0, stop_file=str(done_file))
    with_dir, without = f"stop-ck-{time.time_ns()}", f"stop-plain-{time.time_ns()}"
    runners = [threading.Thread(target=run, args=(app, with_dir), kwargs={"checkpoint_dir": ckpt}, daemon=True),
               threading.Thread(target=run, args=(app, without), daemon=True)]
    for t in runners:
        t.start()
    try:
        wait_running(with_dir)
        wait_running(without)
        time.sleep(0.5)  # some training to keep
        assert stop(["--job", without, "--checkpoint"]) == 1  # refused: no --checkpoint-dir; it trains on
        assert stop(["--job", with_dir, "--checkpoint"]) == 0
        runners[0].join(60)
        assert not runners[0].is_alive()
        assert runners[1].is_alive()  # the refused stop stopped nothing
        assert stop(["--job", without]) == 0
        runners[1].join(60)
    finally:
        done_file.touch()
        for t in runners:
            t.join(60)
    stopped, plain = out[with_dir], out[without]
    assert isinstance(stopped, litz.JobStopped) and isinstance(plain, litz.JobStopped)
    assert plain.checkpoint is None and "stopped on request" in str(plain)
    _, path, manifest = storage.find_checkpoint(ckpt)
    assert stopped.checkpoint == path and "stop" in manifest["reason"]  # the stop's own round
    assert processes_mentioning(with_dir) == [] and processes_mentioning(without) == []
    # resume from the stop's checkpoint: the job goes on and its tables match the driver's sums exactly
    done_file.unlink()
    app.config.update(stop_after=1.0)
    res = litz.run(app, workers=1, servers=2, resume=ckpt).value
    np.testing.assert_array_equal(res["final"], res["truth"])
    assert sum(len(s) for s in res["done_seq"]) > 0
    for seqs in res["done_seq"]:  # each executor's tasks counted on from where the checkpoint left them
        assert sorted(seqs) == list(range(len(seqs)))


ROOT = Path(__file__).resolve().parent.parent


def _mlr_command(job: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "litz.cli", "launch", "apps/mlr.py", "--job", job, "--train-rows", "6000", "--quiet",
            *extra]


def _launch_running_mlr(tmp_path: Path, job: str, *extra: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """``litz launch apps/mlr.py`` on a small slice as a subprocess (in a process group of its own,
    as a batch job is), once it is running."""
    env = dict(os.environ, LITZ_JOBS_DIR=str(tmp_path / "jobs"))
    proc = subprocess.Popen(_mlr_command(job, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        st = subprocess.run([sys.executable, "-m", "litz.cli", "status", "--job", job, "--json"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=30)
        if st.returncode == 0 and '"phase": "running"' in st.stdout:
            return proc, env
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"litz launch never reached the running phase: {st.stderr}")
        time.sleep(0.3)


def _launch_starting_mlr(tmp_path: Path, job: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """``litz launch apps/mlr.py`` as a subprocess, as soon as its job record names its etcd: the
    job is still starting (its master does not run yet; before the etcd is named, the launcher
    loads the application, test_cli_status tests that)."""
    env = dict(os.environ, LITZ_JOBS_DIR=str(tmp_path / "jobs"))
    proc = subprocess.Popen(_mlr_command(job, "--epochs", "500"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    record = tmp_path / "jobs" / f"{job}.json"

    def named() -> bool:
        try:
            return json.loads(record.read_text()).get("etcd") is not None
        except (OSError, ValueError):  # not there yet, or being replaced
            return False

    while not named():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"litz launch never recorded its job: {proc.communicate()[1]}")
        time.sleep(0.02)
    return proc, env


def test_litz_launch_exits_75_when_stopped_even_while_it_starts(tmp_path: Path) -> None:
    """The stop is sent as soon as the job's record exists, before its master watches for commands:
    the command waits for the master, so it is not written where nobody reads it."""
    job = f"stop-launch-{time.time_ns()}"
    proc, env = _launch_starting_mlr(tmp_path, job)
    try:
        cmd = subprocess.run([sys.executable, "-m", "litz.cli", "stop", "--job", job], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert cmd.returncode == 0 and "stopped (no checkpoint taken)" in cmd.stdout, cmd.stderr
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75 and f"job {job} was stopped on request" in err
    assert processes_mentioning(job) == []


def test_a_sigterm_while_the_job_starts_stops_it_once_it_runs(tmp_path: Path) -> None:
    """A scheduler may preempt a job it has just started: the signal is kept until the master runs
    (before, the launcher died of it with status 143 and left its job record behind)."""
    job = f"sigterm-start-{time.time_ns()}"
    proc, _ = _launch_starting_mlr(tmp_path, job)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75 and f"job {job} was stopped on request (SIGTERM)" in err, err
    assert not (tmp_path / "jobs" / f"{job}.json").exists() and processes_mentioning(job) == []


def test_sigterm_stops_litz_launch_after_a_checkpoint_and_the_same_command_resumes(tmp_path: Path) -> None:
    """What a batch scheduler does when it preempts a job: SIGTERM to the job's whole process
    group (as ``timeout`` or ``scancel`` do), and later the same command line again."""
    import signal

    job = f"sigterm-{time.time_ns()}"
    args = ("--epochs", "60", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "auto")
    proc, env = _launch_running_mlr(tmp_path, job, *args)
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher and, were they in its group, its children
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, path, manifest = storage.find_checkpoint(str(tmp_path / "ckpt"))
    assert proc.returncode == 75, err
    assert f"job {job} was stopped on request (SIGTERM)" in err and f"--resume {path}" in err
    assert "stop" in manifest["reason"]
    assert processes_mentioning(job) == []
    loud = [a for a in _mlr_command(job, *args) if a != "--quiet"]  # the same job, now with its progress lines
    again = subprocess.run(loud, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed job {job} from {path}" in again.stderr
    assert float(again.stdout.strip().splitlines()[-1].split()[-1]) > 0.78  # test accuracy after 60 epochs
    assert processes_mentioning(job) == []


def test_resume_auto_starts_afresh_then_resumes_from_the_newest(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    app = testapps.migrating_app(tasks=800, executors=4, move_prob=0.0)
    app.driver = testapps.CheckpointingDriver
    app.config.update(checkpoint_at=200, stop_at=500)
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        litz.run(app, workers=1, servers=1, resume="auto")
    first = litz.run(app, workers=1, servers=1, checkpoint_dir=ckpt, resume="auto")  # nothing there yet
    assert first.value == {"stopped_early": True} and storage.has_complete_checkpoint(ckpt)
    app.config.update(checkpoint_at=None, stop_at=None)
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=ckpt, resume="auto").value  # the same call again
    assert 200 <= res["resumed_at"] < 500
    np.testing.assert_array_equal(res["final"], res["truth"])
    assert sum(len(s) for s in res["done_seq"]) == 800
    assert not storage.has_complete_checkpoint(str(tmp_path / "nowhere"))


def test_resume_auto_falls_back_past_a_damaged_checkpoint(tmp_path: Path, caplog) -> None:
    """``--resume auto`` skips a newest checkpoint with a truncated data file or a damaged driver
    state (each named in a warning) and resumes from the one before, exactly; with only damaged
    ones it refuses, naming them, rather than start from scratch. Before, the first case stopped
    the job at its servers' start and the second at the driver's."""
    import shutil

    from litz.runtime.master import Resume

    ckpt = str(tmp_path / "ckpt")
    app = testapps.migrating_app(tasks=800, executors=4, move_prob=0.0)
    app.driver = testapps.CheckpointingDriver
    app.config.update(checkpoint_at=200, stop_at=500)
    litz.run(app, workers=1, servers=1, checkpoint_dir=ckpt)
    fs, root = storage.filesystem(ckpt)
    [(_, good)] = storage.checkpoint_dirs(fs, root)
    newer = storage.new_checkpoint_dir(fs, root)  # the same checkpoint, one newer: damaged below
    shutil.copytree(good, newer, dirs_exist_ok=True)
    shards = Path(newer, storage.read_manifest(fs, newer)["shards_files"][0])
    whole = shards.read_bytes()
    shards.write_bytes(whole[: len(whole) - 40])  # cut off its footer
    app.config.update(checkpoint_at=None, stop_at=None)
    res = litz.run(app, workers=1, servers=1, checkpoint_dir=ckpt, resume="auto").value
    assert any(f"checkpoint file {shards} is damaged" in r.getMessage() for r in caplog.records)
    assert 200 <= res["resumed_at"] < 500
    np.testing.assert_array_equal(res["final"], res["truth"])
    assert sum(len(s) for s in res["done_seq"]) == 800

    shards.write_bytes(whole)  # without sockets from here: which checkpoint is chosen
    # the newer one whole again is still not taken: the run that went on from the older one left
    # that in the directory's TIMELINE.json (before, --resume auto took the newest)
    chosen = Resume.newest_usable(ckpt, app, None, 64, app.driver())
    assert chosen is not None and chosen.path == good
    Path(root, storage.TIMELINE).unlink()  # a directory without that record (before session 44): the newest
    chosen = Resume.newest_usable(ckpt, app, None, 64, app.driver())
    assert chosen is not None and chosen.path == newer
    pkl = Path(newer, "driver.pkl")
    pkl.write_bytes(pkl.read_bytes()[:20])
    chosen = Resume.newest_usable(ckpt, app, None, 64, app.driver())
    assert chosen is not None and chosen.path == good
    blob = Path(good, "driver.pkl").read_bytes()
    Path(good, "driver.pkl").write_bytes(blob[:20])
    with pytest.raises(storage.DamagedCheckpoint, match=f"no usable checkpoint in {ckpt}: cannot load the "
                                                        f"driver's state from {newer}/driver.pkl.*{good}/driver.pkl"):
        litz.run(app, workers=1, servers=1, checkpoint_dir=ckpt, resume="auto")


class _Puts:
    """The part of Membership that the master's command handlers use: answers go to ``put_soon``
    (``EtcdWrites``), which lands them at once here."""

    lost_any = False  # (no registration of the master's was taken)

    def __init__(self) -> None:
        self.puts: dict[str, dict] = {}

    def put_soon(self, key: str, value: dict) -> concurrent.futures.Future[None]:
        self.puts[key] = value
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_etcd_events_after_a_loss_that_rolls_back_wait_for_the_next_pass() -> None:
    """A loss under full recovery raises (a rollback) out of the master's pass over its etcd
    events: the events after it in the same batch (here a `litz checkpoint` command) are handled
    on the next pass. Before, the rest of the batch was dropped with it (a second loss noticed
    in the same batch, or a command, was never handled)."""
    from litz.runtime.master import CHECKPOINT_KEY, Master, MasterState
    from litz.runtime.membership import Event

    class Events(_Puts):
        def __init__(self, batches: list[list[Event]]) -> None:
            super().__init__()
            self.batches = batches

        def poll_events(self) -> list[Event]:
            return self.batches.pop(0) if self.batches else []

    class Rollback(Exception):
        pass

    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    events = Events([[Event("delete", "procs/worker/w0", None), Event("put", CHECKPOINT_KEY, {"id": "c1"}),
                      Event("delete", "procs/worker/w1", None)]])
    m = Master(app, "j", events, workers=2, servers=1, num_executors=2)  # type: ignore[arg-type]
    try:
        m.state = MasterState(2, ["w0", "w1"], ["s0"])
        seen: list[str] = []

        def lost(ident: str, reason: str) -> None:
            seen.append(ident)
            raise Rollback(ident)

        m._process_lost = lost  # type: ignore[method-assign]
        m.on_checkpoint_command = lambda value: seen.append(value["id"])  # type: ignore[method-assign]
        with pytest.raises(Rollback):
            m._check_health()
        assert seen == ["w0"]
        with pytest.raises(Rollback):
            m._check_health()
        assert seen == ["w0", "c1", "w1"]
        m._check_health()
    finally:
        m.endpoint.close()


def test_stop_commands_and_sigterms_without_a_running_job(tmp_path: Path) -> None:
    from litz.runtime.elastic import RESULTS
    from litz.runtime.master import Master

    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    with_dir = Master(app, "j1", _Puts(), workers=1, servers=1, num_executors=2,  # type: ignore[arg-type]
                      options={"checkpoint_dir": str(tmp_path)})
    without = Master(app, "j2", _Puts(), workers=1, servers=1, num_executors=2)  # type: ignore[arg-type]
    other = Master(app, "j3", _Puts(), workers=1, servers=1, num_executors=2,  # type: ignore[arg-type]
                   options={"checkpoint_dir": str(tmp_path)})
    try:
        # SIGTERM with a checkpoint directory: stop after a checkpoint of its own, which no round has yet
        with_dir.request_stop()
        with_dir._signalled_stop()
        assert with_dir._stop == {"id": "sigterm", "checkpoint": True, "path": None}
        assert with_dir._ckpt_commands == ["sigterm"] and not with_dir._stop_ready()
        with_dir._signalled_stop()  # nothing new: nothing changes
        assert not with_dir._stop_ready()
        with_dir.on_stop_command({"id": "again", "checkpoint": True})  # a second one is refused, the first stands
        assert with_dir.membership.puts[f"{RESULTS}again"]["ok"] is False
        with_dir.request_stop()  # a second SIGTERM: stop without waiting for the checkpoint
        with_dir._signalled_stop()
        assert with_dir._stop_ready() and with_dir._stop["path"] is None
        # a plain `litz stop` does the same, answered when the job stops (before, it was refused: a
        # store that hangs held the job for --checkpoint-timeout)
        other.on_stop_command({"id": "first", "checkpoint": True})
        assert not other._stop_ready()
        other.on_stop_command({"id": "now"})
        assert other._stop_ready() and other._stop["also"] == ["now"] and f"{RESULTS}now" not in other.membership.puts
        # without one: `litz stop --checkpoint` is refused and changes nothing; a plain stop is ready
        without.on_stop_command({"id": "ck", "checkpoint": True})
        assert "no --checkpoint-dir" in without.membership.puts[f"{RESULTS}ck"]["reason"]
        assert without._stop is None and not without._stop_ready()
        without.request_stop()
        without._signalled_stop()
        assert without._stop == {"id": "sigterm", "checkpoint": False, "path": None} and without._stop_ready()
    finally:
        with_dir.endpoint.close()
        without.endpoint.close()
        other.endpoint.close()


def test_row_saves_score_each_policy_and_remember_what_was_saved() -> None:
    """The worker's bookkeeping of an executor's state rows (no sockets): priority scores by the
    executor's distance from the saved copy, round-robin by rounds since saved (the master's round
    numbers, so that executors compare), never-saved rows first; remember() copies exactly the
    chosen rows."""
    ptr = np.array([0, 2, 2, 5, 6])  # rows of 2, 0, 3 and 1 values
    saves = RowSaves(litz.StateRows(np.array([1.0, 1, 2, 2, 2, 3]), ptr), 4)
    now = litz.StateRows(np.array([1.0, 4, 2, 2, 2, 0]), ptr)  # row 0 moved by 3, row 3 by 3 too
    d = litz.Executor().row_distances
    np.testing.assert_array_equal(saves.scores(now, "priority", 5, 0, d), [3, 0, 0, 3])
    np.testing.assert_array_equal(saves.scores(now, "round-robin", 5, 0, d), [1, 1, 1, 1])
    saves.remember(now, np.array([3]), 5)
    np.testing.assert_array_equal(saves.saved.values, [1, 1, 2, 2, 2, 0])  # row 3 only
    np.testing.assert_array_equal(saves.scores(now, "priority", 6, 0, d), [3, 0, 0, 0])
    np.testing.assert_array_equal(saves.scores(now, "round-robin", 7, 0, d), [3, 3, 3, 2])
    other = RowSaves(now, 6)  # another executor, saved later: its rows are younger than these
    np.testing.assert_array_equal(other.scores(now, "round-robin", 7, 0, d), [1, 1, 1, 1])
    a, b = (saves.scores(now, "random", 7, s, d) for s in ([7, 0], [7, 1]))
    assert a.shape == (4,) and not np.array_equal(a, b)
    fresh = RowSaves(now, None)
    assert np.isinf(fresh.scores(now, "priority", 7, 0, d)).all()
    fresh.remember(now, np.array([0, 2]), 7)
    np.testing.assert_array_equal(fresh.scores(now, "round-robin", 8, 0, d), [1, np.inf, 1, np.inf])
    with pytest.raises(ValueError, match="expected 4 numbers >= 0"):
        saves.scores(now, "priority", 8, 0, lambda n, s: np.array([1.0, -1.0, 0.0, 0.0]))
    assert saves.matches(now) and not saves.matches(litz.StateRows(np.zeros(6), np.array([0, 3, 6])))


def _until_background(nodes: list, done, what: str, timeout: float = 10.0) -> None:
    """Run the nodes' finished background steps (as their loops would) until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for node in nodes:
            node._membership_events()
        time.sleep(0.01)


def test_a_failed_rounds_copies_are_not_left_as_the_saved_ones(tmp_path: Path) -> None:
    """A server's table rows and a worker's executor rows (handlers driven without sockets): what a
    partial round copied stays saved only if the master says the round completed; if it failed,
    the copies it replaced are put back. Before, a round that failed (a part the store refused, a
    time-out) still left its copies the saved ones: rows that had moved then ranked by their
    distance from values no checkpoint held, and were passed over while the running checkpoint
    kept them stale. A job without partial checkpoints keeps no saved copies at all (a second
    copy of every row, before)."""
    from litz.ps.server import ServerNode, ShardStore
    from litz.ps.tables import table_index
    from litz.runtime.protocol import Message
    from litz.runtime.worker import Slot, Worker

    srv = ServerNode("s0", "job", "127.0.0.1:1")
    w = Worker("w0", "job", "127.0.0.1:1")
    sent: list[tuple[str, str, dict]] = []
    for node in (srv, w):  # (who sent it, what, its fields); the master needs no looking up
        node.endpoint.send = lambda peer, kind, who=node.ident, **fields: sent.append((who, kind, fields))  # type: ignore
        node._looked_up.add("master")
    try:
        srv.master = w.master = "master"
        srv.store = ShardStore(table_index([litz.Table("t", (2,))]), [0], 1, keeps_saved=True)
        srv.store.update("t", [0, 1], np.array([[1.0, 0.0], [0.0, 2.0]]))
        w.options["checkpoint_policy"] = "priority"
        ex = testapps.RowsExecutor()
        ex.executor_id, ex.num_executors, ex.config = 0, 1, {"rows": 6, "sleep": 0.0}
        ex.state = ex.init_state()
        ex.run_task({})  # rows 0 and 3 (lengths 0 and 3) move
        w.slots = {0: Slot(ex)}

        def partial_round(cid: int, ok: bool) -> tuple[np.ndarray, np.ndarray]:
            """Score (returning the scores), save every row, write, then end the round ``ok``."""
            del sent[:]
            for node in (srv, w):
                node.dispatch(Message("ckpt_scores", {"cid": cid, "policy": "priority"}, sender="master"))
            scores = {p: f["scores"] for p, k, f in sent if k == "ckpt_scores_reply"}
            assert "error" not in str(sent) and set(scores) == {"s0", "w0"}, sent
            path = tmp_path / f"ckpt-{cid}"
            path.mkdir()
            for node, ident in ((srv, "s0"), (w, "w0")):
                node.dispatch(Message("ckpt_save", {"cid": cid, "location": str(tmp_path), "path": str(path),
                                                    "rows": list(range(len(scores[ident])))}, sender="master"))
            _until_background([srv, w], lambda: sum(k == "checkpoint_written" for _, k, _ in sent) == 2, "the parts")
            for node in (srv, w):
                node.dispatch(Message("checkpoint_done", {"cid": cid, "ok": ok}, sender="master"))
            return scores["s0"], scores["w0"]

        assert all(np.isinf(s).all() for s in partial_round(1, ok=False))  # never saved: first in line
        never = partial_round(2, ok=True)  # the failed round saved nothing: still never saved
        assert all(np.isinf(s).all() for s in never), never
        table_rows, executor_rows = partial_round(3, ok=False)  # round 2 completed: nothing moved since
        assert not table_rows.any() and not executor_rows.any(), (table_rows, executor_rows)
        srv.store.update("t", [1], np.array([[0.0, 1.0]]))
        ex.run_task({})  # rows 2 and 5 (lengths 2 and 1) move by 2 each
        table_rows, executor_rows = partial_round(4, ok=False)
        np.testing.assert_array_equal(table_rows, [0.0, 1.0])
        np.testing.assert_allclose(executor_rows, [0, 0, 2 * np.sqrt(2), 0, 0, 2])
        table_rows, executor_rows = partial_round(5, ok=True)  # round 4 failed: its copies are not the saved ones
        np.testing.assert_array_equal(table_rows, [0.0, 1.0])
        np.testing.assert_allclose(executor_rows, [0, 0, 2 * np.sqrt(2), 0, 0, 2])
        assert not any(scores.any() for scores in partial_round(6, ok=True))  # round 5 completed
        assert not srv.store.staged and not w._staged  # nothing kept of rounds that ended
        full = ShardStore(table_index([litz.Table("t", (2,))]), [0], 1, keeps_saved=False)
        full.update("t", [0], np.ones((1, 2)))
        full.stage(full.rows_snapshot(), 1)
        assert full.saved == {} and full.staged == {}
        full.settle(1, ok=True)
    finally:
        srv.endpoint.close()
        w.endpoint.close()


def test_a_shards_saved_copies_move_with_it() -> None:
    """Servers driven without sockets, the message through the protocol: the copies of a shard's
    rows as last saved travel with the shard, so on its new server an unchanged row scores 0 and a
    row's age is kept. Before, they stayed behind (for good) and the rows counted as never saved
    on the new server, first in line in every partial round until saved again: after a scale-out,
    rows that had not moved filled the rounds while the rows that had waited."""
    from litz.ps.server import ServerNode, ShardStore
    from litz.ps.tables import shard_of, table_index
    from litz.runtime.protocol import Message, decode, encode

    tables = [litz.Table("t", (2,))]
    a, b = ServerNode("s0", "job", "127.0.0.1:1"), ServerNode("s1", "job", "127.0.0.1:1")
    sent: list[tuple[str, list]] = []
    a.endpoint.send = lambda peer, kind, **fields: sent.append((peer, encode(kind, **fields)))  # type: ignore
    try:
        for srv, shards in ((a, [0, 1]), (b, [])):
            srv.master = "master"
            srv.store = ShardStore(table_index(tables), shards, 2, keeps_saved=True)
        a.store.update("t", [0, 1, 2, 3], np.arange(8.0).reshape(4, 2))
        a.store.stage(a.store.rows_snapshot(), 3)
        a.store.settle(3, ok=True)
        a.store.update("t", [1], np.array([[3.0, 4.0]]))  # row 1 moves by 5 after the checkpoint
        a._looked_up.add("master")
        a.endpoint.peers["s1"] = b.endpoint.address  # (as the master's dest_addr tells it)
        a.dispatch(Message("migrate_shards", {"mid": 1, "shards": [1], "dest": "s1"}, sender="master"))
        [(peer, frames)] = sent
        msg = decode(frames, sender="s0")
        b._looked_up.add("s0")
        b.dispatch(msg)
        moved = [k for k in range(4) if shard_of(k, 2) == 1]
        entries, scores = b.store.scores("priority", 4)
        assert peer == "s1" and sorted(k for _, _, k in entries) == moved
        assert dict(zip([k for _, _, k in entries], scores, strict=True)) == {1: 5.0, 3: 0.0}
        _, ages = b.store.scores("round-robin", 4)
        assert ages.tolist() == [1, 1]
        assert not any(k in moved for _, k in a.store.saved)  # nothing left behind
        b.store.update("t", [3], np.ones((1, 2)))  # (the moved rows are b's own copies)
        assert b.store.saved[("t", 3)].tolist() == [6.0, 7.0]
    finally:
        a.endpoint.close()
        b.endpoint.close()


@pytest.mark.parametrize(("ok", "done_first"), [(False, False), (False, True), (True, False)],
                         ids=["failed", "failed-end-arrives-first", "complete"])
def test_a_rounds_undo_moves_with_a_migrating_shard_and_executor(tmp_path: Path, ok: bool, done_first: bool) -> None:
    """A shard and an executor migrate while a partial round that copied their rows is still being
    written (processes driven without sockets, messages through the protocol): should the round
    fail, their new hosts put back the saved copies it replaced, whether the round's end reaches
    them before or after the item; should it complete, the copies stay. Before, the undo entries
    stayed on the source, where the items no longer were: the failed round's copies stayed the
    saved ones on the new hosts, and rows that had moved ranked as if the checkpoint held them."""
    from litz.ps.server import ServerNode, ShardStore
    from litz.ps.tables import shard_of, table_index
    from litz.runtime.protocol import Message, decode
    from litz.runtime.worker import Slot, Worker

    tables = [litz.Table("t", (2,))]
    a, b = ServerNode("s0", "job", "127.0.0.1:1"), ServerNode("s1", "job", "127.0.0.1:1")
    w0, w1 = Worker("w0", "job", "127.0.0.1:1"), Worker("w1", "job", "127.0.0.1:1")
    nodes = (a, b, w0, w1)
    sent = wire_without_sockets(nodes)  # (from, to, kind, frames)

    def deliver(kind: str, to: str) -> None:
        [(who, frames)] = [(who, f) for who, peer, k, f in sent if k == kind and peer == to]
        {"s1": b, "w1": w1}[to].dispatch(decode(frames, sender=who))

    def done(*to: ServerNode | Worker) -> None:
        for node in to:
            node.dispatch(Message("checkpoint_done", {"cid": 4, "ok": ok}, sender="master"))

    try:
        for srv, shards in ((a, [0, 1]), (b, [])):
            srv.store = ShardStore(table_index(tables), shards, 2, keeps_saved=True)
        a.store.update("t", [0, 1, 2, 3], np.arange(8.0).reshape(4, 2))
        a.store.stage(a.store.rows_snapshot(), 3)
        a.store.settle(3, ok=True)
        a.store.update("t", [1], np.array([[3.0, 4.0]]))  # row 1 moves by 5 after round 3
        config = {"rows": 6, "sleep": 0.0}
        w1.app, w1.num_executors = {"executor": testapps.RowsExecutor, "config": config}, 1
        for w in (w0, w1):
            w.options["checkpoint_policy"] = "priority"
        ex = testapps.RowsExecutor()
        ex.executor_id, ex.num_executors, ex.config = 0, 1, config
        ex.state = ex.init_state()
        ex.run_task({})
        w0.slots = {0: Slot(ex)}
        w0.row_saves[0] = RowSaves(ex.state_rows(), 3)  # as saved in round 3
        ex.run_task({})  # rows 2 and 5 move by 2 each after round 3

        # round 4 saves every row of s0 and of executor 0, and is being written...
        for node in (a, w0):
            node.dispatch(Message("ckpt_scores", {"cid": 4, "policy": "priority"}, sender="master"))
        scored = {who: decode(f, sender=who)["scores"] for who, _, k, f in sent if k == "ckpt_scores_reply"}
        path = tmp_path / "ckpt-4"
        path.mkdir()
        for node in (a, w0):
            node.dispatch(Message("ckpt_save", {"cid": 4, "location": str(tmp_path), "path": str(path),
                                                "rows": list(range(len(scored[node.ident])))}, sender="master"))
        _until_background([a, w0], lambda: sum(k == "checkpoint_written" for _, _, k, _ in sent) == 2, "the parts")
        # ... when shard 1 and executor 0 leave
        a.dispatch(Message("migrate_shards", {"mid": 1, "shards": [1], "dest": "s1"}, sender="master"))
        w0.dispatch(Message("migrate_out", {"mid": 2, "executors": [0], "dest": "w1", "ship_input": True},
                            sender="master"))
        w0.dispatch(Message("ship", {"mid": 2}, sender="master"))
        if done_first:
            done(a, b, w0, w1)
        deliver("shard_data", "s1")
        deliver("executor_state", "w1")
        if not done_first:
            done(a, b, w0, w1)
        assert not any(a.store.staged.values()) and not any(w0._staged.values())  # nothing left behind
        assert not b.store.staged and not w1._staged  # nothing kept of a round that ended

        entries, scores = b.store.scores("priority", 5)
        moved = [k for k in range(4) if shard_of(k, 2) == 1]
        assert sorted(k for _, _, k in entries) == moved == [1, 3]
        by_key = dict(zip([k for _, _, k in entries], scores, strict=True))
        _, ages = b.store.scores("round-robin", 5)
        del sent[:]
        w1.dispatch(Message("ckpt_scores", {"cid": 5, "policy": "priority"}, sender="master"))
        [rows_scores] = [decode(f, sender=who)["scores"] for who, _, k, f in sent if k == "ckpt_scores_reply"]
        if ok:  # round 4 holds the rows as they are: nothing moved since
            assert by_key == {1: 0.0, 3: 0.0} and ages.tolist() == [1, 1] and not rows_scores.any()
        else:  # back to round 3's copies: what moved since then scores its move
            assert by_key == {1: 5.0, 3: 0.0} and ages.tolist() == [2, 2], (by_key, ages)
            np.testing.assert_allclose(rows_scores, [0, 0, 2 * np.sqrt(2), 0, 0, 2])
    finally:
        for node in nodes:
            node.endpoint.close()


def test_what_a_round_scored_before_it_migrated_is_not_scored_again_in_that_round(tmp_path: Path) -> None:
    """Partial round 5 reaches w0 and s0, which score executor 0 and shard 1, ship them to w1
    and s1 (moves the master ordered before the round), and only then reaches w1 and s1 (their
    reads served the other peer first; no sockets here). They do not score them again: before,
    they did, the round chose among those rows twice, saved more than its fraction (50 rows of
    40 in a CI run) and wrote them into two files. s0 saves every row the round chose, those of
    shard 1 as they left (before, it left them out: the round saved less than it chose). The
    next round scores them on their new hosts."""
    from litz.ps.server import ServerNode, ShardStore
    from litz.ps.tables import table_index
    from litz.runtime.protocol import Message, decode
    from litz.runtime.worker import Slot, Worker

    w0, w1 = Worker("w0", "job", "127.0.0.1:1"), Worker("w1", "job", "127.0.0.1:1")
    s0, s1 = ServerNode("s0", "job", "127.0.0.1:1"), ServerNode("s1", "job", "127.0.0.1:1")
    nodes = (w0, w1, s0, s1)
    sent = wire_without_sockets(nodes)
    for w in (w0, w1):
        w.options["checkpoint_policy"] = "priority"

    def scores_of(node: Worker | ServerNode, cid: int) -> np.ndarray:
        del sent[:]
        node.dispatch(Message("ckpt_scores", {"cid": cid, "policy": "priority"}, sender="master"))
        [reply] = [decode(f, sender=who) for who, _, k, f in sent if k == "ckpt_scores_reply"]
        assert reply["cid"] == cid and reply.get("error") is None
        return reply["scores"]

    def deliver(kind: str, to: Worker | ServerNode) -> None:
        [(who, frames)] = [(who, f) for who, peer, k, f in sent if k == kind and peer == to.ident]
        to.dispatch(decode(frames, sender=who))

    try:
        tables = [litz.Table("t", (2,))]
        for srv, shards in ((s0, [0, 1]), (s1, [])):
            srv.store = ShardStore(table_index(tables), shards, 2, keeps_saved=True)
        s0.store.update("t", [0, 1, 2, 3], np.arange(8.0).reshape(4, 2))
        config = {"rows": 6, "sleep": 0.0}
        w1.app, w1.num_executors = {"executor": testapps.RowsExecutor, "config": config}, 1
        ex = testapps.RowsExecutor()
        ex.executor_id, ex.num_executors, ex.config = 0, 1, config
        ex.state = ex.init_state()
        ex.run_task({})
        w0.slots = {0: Slot(ex)}
        w0.row_saves[0] = RowSaves(ex.state_rows(), 3)
        ex.run_task({})
        assert len(scores_of(w0, 5)) == 6 and len(scores_of(s0, 5)) == 4
        w0.dispatch(Message("migrate_out", {"mid": 2, "executors": [0], "dest": "w1", "ship_input": True},
                            sender="master"))
        w0.dispatch(Message("ship", {"mid": 2}, sender="master"))
        s0.dispatch(Message("migrate_shards", {"mid": 3, "shards": [1], "dest": "s1"}, sender="master"))
        deliver("executor_state", w1)
        deliver("shard_data", s1)
        assert 0 in w1.slots and 1 in s1.store.shards
        assert len(scores_of(w1, 5)) == 0 and len(scores_of(s1, 5)) == 0  # scored where they were
        s1.store.update("t", [1], np.ones((1, 2)))  # after it left s0
        s0.dispatch(Message("ckpt_save", {"cid": 5, "location": str(tmp_path), "path": str(tmp_path),
                                          "rows": [0, 1, 2, 3]}, sender="master"))
        _until_background([s0], lambda: any(k == "checkpoint_written" for _, _, k, _ in sent), "the part")
        written = {key: np.frombuffer(row, np.float32) for _, _, key, row in storage.read_shards(*storage.filesystem(
            str(tmp_path / "shards-s0.arrow")))}
        assert sorted(written) == [0, 1, 2, 3] and written[1].tolist() == [2.0, 3.0]  # as it left
        assert sorted(k for _, k in s0.store.saved) == [0, 2]  # the copies of shard 1 are s1's
        assert len(scores_of(w1, 6)) == 6 and len(scores_of(s1, 6)) == 2
    finally:
        for node in nodes:
            node.endpoint.close()


def test_row_scoring_waits_for_running_executors_and_fails_at_the_first_error() -> None:
    """A worker's partial rounds (no sockets): an executor is scored only once it runs no task,
    the round is answered when all are scored (executors in order, one gone is skipped), and a
    failure answers the round at once with the executor named."""
    from litz.ft.checkpoint import RowScoring

    running = {0: False, 1: True, 2: False}
    busy = (lambda e: running.get(e))  # noqa: E731
    rows = {e: litz.StateRows(np.arange(e + 1.0), np.array([0, e + 1])) for e in range(4)}
    calls = []

    def score(cid: int, eid: int, policy: str) -> tuple[litz.StateRows, np.ndarray]:
        calls.append((cid, eid, policy))
        return rows[eid], np.array([10.0 * eid])

    sc = RowScoring()
    sc.request(7, "master", "priority", {0, 1, 2, 3})  # 3 has left (migrated away) meanwhile
    assert sc.ready(busy, score) == [] and calls == [(7, 0, "priority"), (7, 2, "priority")]
    running[1] = False  # its task ended
    [(cid, master, scored, scores, error)] = sc.ready(busy, score)
    assert (cid, master, error) == (7, "master", None) and [e for e, _ in scored] == [0, 1, 2]
    np.testing.assert_array_equal(scores, [0.0, 10.0, 20.0])
    assert sc.ready(busy, score) == [] and not sc.rounds

    def broken(cid: int, eid: int, policy: str) -> tuple[litz.StateRows, np.ndarray]:
        raise RuntimeError("no rows today")

    running[1] = True
    sc.request(8, "master", "priority", {0, 1})
    [(cid, _, scored, scores, error)] = sc.ready(busy, broken)  # not waiting for 1: the round is lost
    assert cid == 8 and error == "executor 0: RuntimeError: no rows today" and len(scores) == 0 and not sc.rounds


def test_executor_rows_round_trip_exactly(tmp_path: Path) -> None:
    fs, root = storage.filesystem(str(tmp_path))
    a = litz.StateRows(np.array([0.0, 1.5, np.nan, 2.0]), np.array([0, 1, 1, 1, 3, 4]))  # rows 1, 2 empty
    b = litz.StateRows(np.array([7, -1, 5], np.int16), np.array([0, 0, 2, 3]))
    assert storage.write_executor_rows(fs, f"{root}/r.arrow", [(0, np.array([3, 1]), a), (2, np.array([1, 0]), b),
                                                               (5, np.array([], np.int64), b)]) == 4
    back = storage.read_executor_rows(fs, f"{root}/r.arrow", {2})
    assert list(back) == [2] and sorted(back[2]) == [0, 1]
    assert back[2][1].dtype == np.int16 and back[2][1].tolist() == [7, -1] and back[2][0].dtype == np.int16
    assert len(back[2][0]) == 0
    mine = storage.read_executor_rows(fs, f"{root}/r.arrow", {0})[0]
    assert sorted(mine) == [1, 3] and mine[3].tobytes() == a.values[1:3].tobytes() and len(mine[1]) == 0
    assert storage.write_executor_rows(fs, f"{root}/e.arrow", []) == 0
    assert storage.read_executor_rows(fs, f"{root}/e.arrow", {0}) == {}


def test_checkpoint_parts_hold_values_of_2_gib_and_more_and_older_parts_still_read(tmp_path: Path) -> None:
    """A table row, an executor's state or a partial round's chosen rows of one executor of 2 GiB or
    more failed every checkpoint: Arrow's ``binary`` has 32-bit offsets (ArrowCapacityError, or
    negative offsets that wrapped). Parts are ``large_binary`` now (64-bit offsets; writing 2 GiB
    is too much for a test, so this checks the layout), and parts of the earlier layout still read."""
    import pyarrow as pa

    fs, root = storage.filesystem(str(tmp_path))
    storage.write_shards(fs, f"{root}/s.arrow", [("t", 0, 3, np.arange(2.0))])
    storage.write_executors(fs, f"{root}/x.arrow", {1: b"state"})
    rows = litz.StateRows(np.arange(3.0), np.array([0, 1, 3]))
    storage.write_executor_rows(fs, f"{root}/r.arrow", [(0, np.array([1]), rows)])
    for name, column in (("s", "row"), ("x", "state"), ("r", "values")):
        with fs.open_input_file(f"{root}/{name}.arrow") as f:
            assert pa.ipc.open_file(f).schema.field(column).type == pa.large_binary(), name
    old = {"s": pa.table({"table": ["t"], "shard": pa.array([0], pa.int32()), "ikey": pa.array([3], pa.int64()),
                          "skey": pa.array([None], pa.string()), "row": pa.array([np.arange(2.0).tobytes()])}),
           "x": pa.table({"executor": pa.array([1], pa.int32()), "state": pa.array([b"state"])}),
           "r": pa.table({"executor": pa.array([0], pa.int32()), "row": pa.array([1], pa.int64()),
                          "dtype": ["<f8"], "values": pa.array([np.arange(1.0, 3.0).tobytes()])})}
    for name, table in old.items():
        assert table.schema.field(-1).type == pa.binary()
        with fs.open_output_stream(f"{root}/old-{name}.arrow") as out, pa.ipc.new_file(out, table.schema) as w:
            w.write_table(table)
    for prefix in ("", "old-"):
        assert storage.read_shards(fs, f"{root}/{prefix}s.arrow") == [("t", 0, 3, np.arange(2.0).tobytes())]
        assert storage.read_executors(fs, f"{root}/{prefix}x.arrow") == {1: b"state"}
        assert storage.read_executor_rows(fs, f"{root}/{prefix}r.arrow", {0})[0][1].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("move_prob", [0.0, 0.05])
def test_priority_checkpoints_save_executor_rows_and_a_lost_worker_gets_them_back(
        tmp_path: Path, monkeypatch, move_prob: float) -> None:
    """SCAR priority checkpoints of executor state (``Executor.state_rows``), then ``kill -9`` of a
    worker under partial recovery. Every partial checkpoint saves exactly the top quarter of the
    executors' rows (of those scored: one in transit is not), never a row that did not move (empty
    rows never move: their saved copies travel with migrating executors, or they would count as
    never saved and come first), each a value the row really had. The lost executors come back as
    the last full checkpoint with every row replaced by its newest partial copy, exactly."""
    import math

    import cloudpickle

    tasks, n_rows, executors = 150, 40, 4
    # the moves end (iteration 10) before the kill; losses during a move: test_recovery.py
    app = testapps.rows_app(tasks=tasks, rows=n_rows, executors=executors, move_prob=move_prob, move_until=10)
    out = _kill_w1_after_partials(app, tmp_path, monkeypatch)
    assert "error" not in out, out.get("error")
    res = out["res"]
    assert res.value["done"] == [tasks] * executors
    assert res.value["moves"] > 0 if move_prob else res.value["moves"] == 0
    [rec] = res.stats["master"]["recoveries"]
    assert rec["role"] == "worker" and rec["strategy"] == "partial" and rec["restored_from"] and rec["partials"]

    fs, _ = storage.filesystem(str(tmp_path / "c"))
    truth = [testapps.rows_value(k, n_rows) for k in range(tasks + 1)]
    ptr = np.concatenate([[0], np.cumsum(np.arange(n_rows) % 4)])
    base = storage.read_manifest(fs, rec["restored_from"])
    states = {e: cloudpickle.loads(blob) for name in base["executors_files"]
              for e, blob in storage.read_executors(fs, f"{rec['restored_from']}/{name}").items()}
    expected = {e: states[e]["values"].copy() for e in res.value["after"]}
    restored_rows, counts = 0, []
    for path in rec["partials"]:
        manifest = storage.read_manifest(fs, path)
        assert manifest["partial_of"] == rec["restored_from"]
        saved = {}
        for name in manifest["executor_rows_files"]:
            saved.update(storage.read_executor_rows(fs, f"{path}/{name}", set(range(executors))))
        counts.append(sum(len(r) for r in saved.values()))
        for e, rows in saved.items():
            for i, values in rows.items():
                assert len(values) == ptr[i + 1] - ptr[i] > 0  # an empty row never moves
                assert any((values == tr[i]).all() for tr in truth)  # a value the row really had
                if e in expected:
                    expected[e][ptr[i]:ptr[i + 1]] = values
        restored_rows += sum(len(saved.get(e, {})) for e in expected)
    # the top quarter of the rows scored: all of them, but for an executor in transit while scored
    top = math.ceil(0.25 * executors * n_rows)
    assert max(counts) == top and (min(counts) == top or move_prob)
    assert expected and (len(expected) == executors // 2 or move_prob)  # w1's executors
    for e, values in expected.items():
        np.testing.assert_array_equal(res.value["after"][e], values)
    # the rows replaced per restored executor: those saved by any of the partials, counted once
    distinct = {(e, i) for path in rec["partials"] for name in storage.read_manifest(fs, path)["executor_rows_files"]
                for e, rows in storage.read_executor_rows(fs, f"{path}/{name}", set(expected)).items() for i in rows}
    assert res.total("rows_restored", "worker") == len(distinct) > 0 and restored_rows >= len(distinct)


def test_round_robin_checkpoints_go_round_every_executors_rows(tmp_path: Path) -> None:
    """Round-robin partial checkpoints of a quarter of the executors' rows: the first four after
    the full base save every row of every executor exactly once (rows' ages are counted in the
    master's rounds, so the executors of another worker are not starved)."""
    app = testapps.rows_app(tasks=60, sleep=0.005)
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=str(tmp_path), checkpoint_every="4",
                   checkpoint_policy="round-robin", checkpoint_fraction=0.25)
    records = res.stats["master"]["checkpoints"]
    assert all(c["ok"] for c in records) and records[0]["kind"] == "full"
    _, _, partials = storage.running_checkpoint(str(tmp_path), "executors")  # type: ignore[misc]
    assert len(partials) >= 4
    fs, _ = storage.filesystem(str(tmp_path))
    saved = [(e, i) for path, files in partials[:4] for name in files
             for e, rows in storage.read_executor_rows(fs, f"{path}/{name}", set(range(4))).items() for i in rows]
    assert sorted(saved) == [(e, i) for e in range(4) for i in range(40)]


def _kill_w1_after_partials(app: litz.App, tmp_path: Path, monkeypatch) -> dict:  # noqa: ANN001
    """Run a rows_app job (2 workers, priority checkpoints of a quarter every iteration, partial
    recovery), ``kill -9`` worker w1 after iteration 12 and 3 partial checkpoints; the job's outcome."""
    from tests.test_recovery import _status_when

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    job = f"rows-{time.time_ns()}"
    t, out = run_in_thread(app, workers=2, servers=1, job=job, checkpoint_dir=str(tmp_path / "c"),
                           checkpoint_every="4", checkpoint_policy="priority", checkpoint_fraction=0.25,
                           recovery="partial")
    try:
        st = _status_when(job, lambda s: _iteration(s) >= 12 and sum(
            c["ok"] and c["kind"] == "partial" for c in s["master"].get("checkpoints", [])) >= 3)
        assert _iteration(st) < app.config["tasks"] // 3 - 10, "the job must still run when the worker dies"
        os.kill(next(p["pid"] for p in st["processes"] if p["id"] == "w1"), signal.SIGKILL)
    finally:
        t.join(120)
    assert processes_mentioning(job) == []
    return out


def test_a_restore_that_fails_stops_the_job_and_says_where(tmp_path: Path, monkeypatch) -> None:
    """An executor whose restore_rows raises when its worker is lost: the recovery cannot complete,
    so the job stops (it used to wait forever) with the survivor, the executor and the cause."""
    app = testapps.rows_app()
    app.executor = testapps.UnrestorableRowsExecutor
    out = _kill_w1_after_partials(app, tmp_path, monkeypatch)
    assert isinstance(out.get("error"), litz.LitzError), out
    assert re.search(r"recovery failed on w0 \(restore_executors\): LitzError: executor [23]: restore_rows failed "
                     r"on \d+ rows from .*ckpt-000000's partial checkpoints: RuntimeError: no restore today",
                     str(out["error"])), out["error"]


def test_a_failing_row_distance_fails_its_partial_rounds_and_nothing_else(tmp_path: Path) -> None:
    """An executor whose row_distances raises: each partial round fails, naming the worker and the
    executor; the full base stays the running checkpoint and the job ends normally."""
    app = testapps.rows_app(tasks=60, sleep=0.005)
    app.executor = testapps.BrokenRowsExecutor
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=str(tmp_path), checkpoint_every="4",
                   checkpoint_policy="priority", checkpoint_fraction=0.25)
    assert res.value["done"] == [60] * 4
    records = res.stats["master"]["checkpoints"]
    assert records[0]["ok"] and records[0]["kind"] == "full"
    failed = [c for c in records if not c["ok"]]
    assert failed and all(c["kind"] == "partial" for c in failed)
    assert re.search(r"worker w[01]: executor \d: RuntimeError: no rows today", failed[0]["errors"][0])
    base, _, partials = storage.running_checkpoint(str(tmp_path), "executors")  # type: ignore[misc]
    assert base == records[0]["path"] and partials == []


def _iteration(st: dict) -> int:
    progress = st["master"].get("progress", "")
    return int(progress.split()[1]) if progress.startswith("iteration ") else -1


class _FinishWhileWritingDriver(testapps.MigratingDriver):
    """Asks for checkpoints until a task completes while one is being written, and finishes then."""

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        r = self._master.checkpoints.round  # test-only access
        if r is not None and r.phase == "writing":
            self.finish({"path": r.path})
            return
        if r is None:
            self.checkpoint()
        super().handle_task_completion(result)


def test_a_job_that_finishes_while_a_checkpoint_is_written_leaves_it_complete(tmp_path: Path) -> None:
    app = testapps.migrating_app(tasks=10**6, executors=4, move_prob=0.0)
    app.driver = _FinishWhileWritingDriver
    result = litz.run(app, workers=2, servers=1, checkpoint_dir=str(tmp_path / "ckpt"))
    path = result.value["path"]
    last = result.stats["master"]["checkpoints"][-1]
    assert last["path"] == path and last["ok"], last
    fs, _ = storage.filesystem(str(tmp_path))
    assert storage.has_manifest(fs, path)
    assert storage.find_checkpoint(str(tmp_path / "ckpt"))[1] == path
