"""Consistent checkpoints: when to take one and the steps of a round (DESIGN.md §5); no sockets.

A round, driven by the master:

1. **pause**: new tasks are held at the master; tasks already dispatched run to completion
   (their updates are acknowledged before their completion is reported, DESIGN.md §2), and no
   migration or scale operation may be in progress. Then nothing runs and every update sent
   has been applied: the driver, the executors and the shards form a consistent cut.
2. **snapshot**: every worker and server copies its state in memory and says so; the master
   pickles the driver with the held tasks. As soon as all copies are taken, the held tasks
   are released and training goes on.
3. **write**: each process writes its copy to shared storage in the background and reports
   its files; when all are written the master writes the manifest, and only then does the
   checkpoint exist (``litz.ft.storage``). A round with a failed write gets no manifest.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from litz.api import StateRows
from litz.errors import ConfigError

log = logging.getLogger(__name__)

POLICIES = ("full", "priority", "round-robin", "random")
# seconds a round may wait for one of its steps (its directory, the scores, snapshots and parts of the
# processes, its manifest) before it fails: far longer than writing a shard takes on any working store
DEFAULT_TIMEOUT = 300.0
# the partial policies take a full checkpoint again once the partial ones since the last hold this
# many full checkpoints' worth of rows (1/r rounds each): a recovery restores the base and then
# every partial checkpoint after it, and ``--checkpoint-keep`` removes only what a newer full one
# supersedes, so without a new base both grew for as long as the job ran. It writes 1/8 more bytes
# per iteration than SCAR's budget and pauses training once per 8 periods (a full round's pause)
REBASE_PERIODS = 8
# the records of finished rounds the master keeps (``litz status``, the job's stats): the newest
# this many. A job with a priority checkpoint every two seconds finishes 300,000 rounds a week,
# and kept every record, hundreds of bytes each, for as long as it ran
HISTORY = 1000


def select_top(scores: dict[str, np.ndarray], fraction: float) -> dict[str, list[int]]:
    """The global top ``fraction`` of rows by score, across all servers (SCAR's coordinator).

    ``scores[server][i]`` is row i's score on that server. Returns, per server, the positions
    of its rows that are chosen: exactly ``ceil(fraction * total)`` rows in all; ties are
    broken by server name, then position, so the choice is deterministic.
    """
    servers = sorted(scores)
    total = sum(len(scores[s]) for s in servers)
    k = min(total, math.ceil(fraction * total))
    out: dict[str, list[int]] = {s: [] for s in servers}
    if k == 0:
        return out
    flat = np.concatenate([np.asarray(scores[s], dtype=np.float64) for s in servers])
    # the k highest; at the k-th value, ties go by server, then position: by index in ``flat``
    kth = np.partition(flat, total - k)[total - k]
    above = np.flatnonzero(flat > kth)
    chosen = np.sort(np.concatenate([above, np.flatnonzero(flat == kth)[:k - len(above)]]))
    starts = np.cumsum([0, *(len(scores[s]) for s in servers)])
    cut = np.searchsorted(chosen, starts)
    for i, s in enumerate(servers):
        out[s] = (chosen[cut[i]:cut[i + 1]] - starts[i]).tolist()
    return out


class RoundOutcomes:
    """How the latest rounds ended, as the master said (``checkpoint_done``), for a process that
    receives a migrating executor or shard with the undo entries of a round still open at its
    source: the item and the round's end come from different senders, so either may come first.
    A round that ended is applied at once (undone if it failed, kept if it completed); no sockets."""

    KEEP = 64  # rounds remembered; an older one counts as ended and kept (its undo is dropped)

    def __init__(self) -> None:
        self._ended: dict[int, bool] = {}
        self._newest = -1

    def record(self, cid: int, ok: bool) -> None:
        self._ended[cid] = ok
        self._newest = max(self._newest, cid)
        while len(self._ended) > self.KEEP:
            del self._ended[next(iter(self._ended))]

    def ended(self, cid: int) -> bool | None:
        """True: round ``cid`` completed (or is too old to remember); False: it failed; None: it
        has not ended here yet (the master runs one round at a time, numbered in order)."""
        if cid in self._ended:
            return self._ended[cid]
        return True if cid <= self._newest else None


class RowSaves:
    """What the running checkpoint holds of one executor's state rows (``Executor.state_rows``):
    the copy of each row as last saved and the round (a checkpoint's cid) it was saved in, so
    that the next partial round can score the rows (DESIGN.md §5), as servers do for table rows.
    It travels with the executor when it migrates; no sockets here.
    """

    def __init__(self, rows: StateRows, saved_in: int | None) -> None:
        """Every row is as saved in round ``saved_in`` (a full checkpoint, or a restore: 0, the
        oldest), or, with None, no row is (a row never saved comes first)."""
        self.saved = StateRows(rows.values.copy(), rows.ptr.copy())
        self.saved_round = np.full(rows.num_rows, -1 if saved_in is None else saved_in, np.int64)
        # the last round that scored these rows: an executor scored on one worker that migrates
        # before the round reaches its new host is not scored (and saved) twice in that round
        self.scored_in: int | None = None

    def matches(self, rows: StateRows) -> bool:
        return np.array_equal(rows.ptr, self.saved.ptr)

    def scores(self, rows: StateRows, policy: str, round_: int, seed: Any,
               distances: Callable[[StateRows, StateRows], np.ndarray]) -> np.ndarray:
        """Each row's claim to be saved in round ``round_``: ``priority``, ``distances(rows, saved)``;
        ``round-robin``, the rounds since it was saved; ``random``, a draw. A row never saved
        comes first under the first two."""
        n = rows.num_rows
        self.scored_in = round_
        if policy == "random":
            return np.random.default_rng(seed).random(n)
        if policy == "priority":
            out = np.asarray(distances(rows, self.saved), dtype=np.float64)
            if out.shape != (n,) or not np.all(out >= 0):  # NaN fails too
                raise ValueError(f"row_distances returned {out.shape} values (some negative or NaN?), "
                                 f"expected {n} numbers >= 0")
            out = out.copy()
        else:
            out = (round_ - self.saved_round).astype(np.float64)
        out[self.saved_round < 0] = np.inf
        return out

    def remember(self, rows: StateRows, chosen: np.ndarray, round_: int) -> tuple[np.ndarray, ...]:
        """The rows ``chosen`` (positions) were saved in round ``round_`` as they are in ``rows``;
        returns what they replaced, for ``forget`` should the round fail."""
        mask, chosen = rows.values_of(chosen), np.asarray(chosen, np.int64)
        replaced = (mask, self.saved.values[mask].copy(), chosen, self.saved_round[chosen].copy())
        self.saved.values[mask] = rows.values[mask]
        self.saved_round[chosen] = round_
        return replaced

    def forget(self, replaced: tuple[np.ndarray, ...]) -> None:
        """Put back what ``remember`` replaced: that round saved nothing after all."""
        mask, values, chosen, rounds = replaced
        self.saved.values[mask] = values
        self.saved_round[chosen] = rounds


@dataclass
class _RowRound:
    master: str
    policy: str
    waiting: set[int]
    scored: dict[int, tuple[StateRows, np.ndarray]] = field(default_factory=dict)
    error: str | None = None


class RowScoring:
    """A worker's partial rounds in progress over its executors' state rows (no sockets).

    A round asks for every executor that keeps rows; an executor is scored only between two of
    its tasks (its state may be half-updated while a task is suspended in a read), so a round
    waits for the running ones. It is answered once every executor is scored, or at the first
    failure, which loses the round.
    """

    def __init__(self) -> None:
        self.rounds: dict[int, _RowRound] = {}

    def request(self, cid: int, master: str, policy: str, executors: set[int]) -> None:
        self.rounds[cid] = _RowRound(master, policy, set(executors))

    def ready(self, busy: Callable[[int], bool | None],
              score: Callable[[int, int, str], tuple[StateRows, np.ndarray]]
              ) -> list[tuple[int, str, list[tuple[int, StateRows]], np.ndarray, str | None]]:
        """Score the executors rounds wait for that run no task now (``busy(eid)``: True while one
        runs, None once the executor is gone); returns the rounds answered, as ``(cid, master,
        [(executor, rows)], concatenated scores, error)`` with executors in order."""
        done = []
        for cid, rr in list(self.rounds.items()):
            for eid in sorted(e for e in rr.waiting if not busy(e)):
                rr.waiting.discard(eid)
                if busy(eid) is None or rr.error is not None:
                    continue
                try:
                    rr.scored[eid] = score(cid, eid, rr.policy)
                except Exception as exc:  # e.g. the application's row_distances raised: this round is lost
                    rr.error = f"executor {eid}: {type(exc).__name__}: {exc}"
            if rr.waiting and rr.error is None:
                continue
            del self.rounds[cid]
            order = sorted(rr.scored)
            scores = np.concatenate([rr.scored[e][1] for e in order]) if order and rr.error is None else np.empty(0)
            done.append((cid, rr.master, [(e, rr.scored[e][0]) for e in order], scores, rr.error))
        return done

    def clear(self) -> None:
        self.rounds.clear()


def parse_every(text: str | float | int | None) -> tuple[float | None, int | None]:
    """``"30s"`` -> every 30 seconds; ``"5"`` -> every 5 iterations of the driver. None: never."""
    if text is None or text == "":
        return None, None
    raw = str(text).strip()
    try:
        if raw.endswith("s"):
            seconds = float(raw[:-1])
            if seconds > 0:
                return seconds, None
        else:
            iterations = int(raw)
            if iterations > 0:
                return None, iterations
    except ValueError:
        pass
    raise ConfigError(f"--checkpoint-every takes a positive number of iterations (5) or seconds (30s), got {text!r}")


@dataclass
class CheckpointRound:
    """One checkpoint in progress."""

    cid: int
    reason: str
    started: float
    kind: str = "full"  # full (consistent) or partial (SCAR: the top fraction of rows)
    # full: preparing -> pausing -> snapshot -> writing -> manifest; partial: scoring -> snapshot ->
    # writing -> manifest. A full round pauses (holds new tasks) only once its directory is made: a
    # store that answers slowly, or not at all, must not hold training
    phase: str = "preparing"
    since: float = 0.0  # when the round entered its phase (``enter``), for ``CheckpointCoordinator.overdue``
    # the round's directory, made off the master's loop while the round pauses or scores (storage
    # may be a network away): None until made (a round whose directory cannot be made fails)
    dir_path: str | None = None
    pause_started: float = 0.0  # full: when it began to hold new tasks (``directory_made``)
    chosen: dict[str, list[int]] | None = None  # partial: the rows each process saves, once scored
    asked: set[str] = field(default_factory=set)  # partial: the servers and workers asked for scores
    scores: dict[str, Any] = field(default_factory=dict)  # partial: process -> scores of its rows
    path: str | None = None
    servers: list[str] = field(default_factory=list)  # the processes that copied their shards
    workers: list[str] = field(default_factory=list)  # and their executors (``snapshotting``)
    waiting_snapshot: set[str] = field(default_factory=set)
    waiting_written: set[str] = field(default_factory=set)
    files: dict[str, list[str]] = field(default_factory=dict)  # process -> its files
    errors: list[str] = field(default_factory=list)
    paused_for: float = 0.0  # seconds training was held (pause + snapshot; none in a partial round)
    version: int = 0  # the master's version at the snapshot
    commands: list[str] = field(default_factory=list)  # `litz checkpoint` / `litz stop` ids it answers

    def enter(self, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()

    def waits_for(self) -> str | None:
        """What the round waits for in its phase, which the processes or the storage owe it (None:
        the tasks running at a full round's start, which are the application's, not a step of the
        round's; they may take long)."""
        def parts(who: set[str] | list[str], what: str) -> str:
            names = sorted("the driver's file" if p == "master" else f"{p}'s {what}" for p in who)
            return ", ".join(names)

        if self.phase in ("preparing", "scoring") and self.dir_path is None:
            return "its directory"
        if self.phase == "scoring" and self.chosen is None:
            return parts(self.asked - set(self.scores), "scores")
        if self.phase == "snapshot":
            return parts(self.waiting_snapshot, "snapshot")
        if self.phase == "writing":
            return parts(self.waiting_written, "part")
        if self.phase == "manifest":
            return "its manifest"
        return None


def checked_timeout(timeout: Any) -> float:
    """``--checkpoint-timeout`` as seconds: a positive real number (inf: no limit); ConfigError else.
    The launcher asks before a resume reads the storage, the coordinator for a job's checkpoints."""
    try:
        ok = not isinstance(timeout, bool) and float(timeout) > 0
    except (TypeError, ValueError, OverflowError):  # (a string, None, an int beyond a float)
        ok = False
    if not ok:
        raise ConfigError(f"--checkpoint-timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class CheckpointCoordinator:
    """Decides when a checkpoint is due and tracks the round in progress."""

    def __init__(self, location: str, every: str | float | int | None = None, policy: str = "full",
                 fraction: float = 1.0, timeout: float = DEFAULT_TIMEOUT, keep: int | None = None) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"--checkpoint takes one of {', '.join(POLICIES)}, got {policy!r}")
        if not 0 < fraction <= 1:
            raise ConfigError(f"--checkpoint-fraction must be in (0, 1], got {fraction!r}")
        if policy == "full" and fraction != 1:
            raise ConfigError(f"--checkpoint-fraction {fraction:g} applies to the partial policies "
                              f"(priority, round-robin, random); --checkpoint full saves everything")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"--checkpoint-keep takes a number of full checkpoints, at least 1, got {keep!r}")
        self.location = location
        self.timeout = checked_timeout(timeout)
        self.keep = keep  # the newest full checkpoints kept (older directories are removed); None: all
        self.policy = policy
        self.fraction = fraction
        self.every_seconds, self.every_iterations = parse_every(every)
        self.round: CheckpointRound | None = None
        self.completed: deque[dict[str, Any]] = deque(maxlen=HISTORY)  # the newest finished rounds, last last
        self._last_ok: dict[str, Any] | None = None  # the newest round written whole
        self._failing = 0  # rounds failed since then
        self._next_cid = 0
        self._last_time = time.monotonic()
        self._last_iteration = 0
        # the last full checkpoint written since the last rollback (partial rounds build on it; rounds
        # before a rollback belong to an abandoned timeline), and the partial ones written since:
        # kept as rounds end, not searched for on every tick of the master's loop
        self._base: dict[str, Any] | None = None
        self._partials_since_base = 0
        self.last_dir: str | None = None  # the checkpoint directory created last
        # The checkpoints a recovery may go back to: those of the directories numbered from
        # ``own_from`` on (the first one this run created since it started, or since its last
        # rollback), else ``anchor``, ``(location, path, manifest)`` of the full checkpoint it
        # resumed from or rolled back to. The directory may hold others, newer ones among them,
        # of another timeline: a run that went on after the checkpoint this one resumed from (or
        # after one it skipped as damaged), the rounds of a timeline a rollback abandoned, or
        # another job that used the directory before. Restoring from those would put rows, or
        # the whole job, at a point this run never reached.
        self.anchor: tuple[str, str, dict[str, Any]] | None = None
        self.own_from: int | None = None

    def due(self, iteration: int | None) -> bool:
        """Whether the policy asks for a checkpoint now (none while one is in progress)."""
        if self.round is not None:
            return False
        # SCAR: a fraction r of the parameters every r*C, once a full base exists
        scale = self.fraction if self.partial_next() else 1.0
        if self.every_seconds is not None:
            return time.monotonic() - self._last_time >= self.every_seconds * scale
        if self.every_iterations is not None and iteration is not None:
            return iteration - self._last_iteration >= max(1, round(self.every_iterations * scale))
        return False

    def last_complete(self) -> dict[str, Any] | None:
        """The newest round that was written whole (any kind), for ``litz status``."""
        return self._last_ok

    def failed_in_a_row(self) -> int:
        """How many rounds failed since the last complete one (all of them, if none is)."""
        return self._failing

    def add_record(self, record: dict[str, Any]) -> None:
        """Keep a finished round's record: in ``completed`` (the newest ``HISTORY``) and in what
        ``litz status`` shows of the rounds, which may reach further back."""
        self.completed.append(record)
        if record["ok"]:
            self._last_ok, self._failing = record, 0
        else:
            self._failing += 1

    def base(self) -> str | None:
        """The full checkpoint partial rounds now build on: the last one written since the last
        rollback (None: there is none, the next round is full)."""
        return self._base["path"] if self._base else None

    def partial_next(self) -> bool:
        """Whether the next policy round saves only a fraction of the rows: a full base exists,
        taken since the last rollback (partial rows of an abandoned timeline build on nothing),
        and fewer than ``REBASE_PERIODS`` periods' worth of partial rounds were written since."""
        if self.policy == "full" or self._base is None:
            return False
        return self._partials_since_base < math.ceil(REBASE_PERIODS / self.fraction)

    def rolled_back(self, anchor: tuple[str, str, dict[str, Any]] | None = None) -> None:
        """The job went back to its last full checkpoint, ``anchor`` (None: to its beginning):
        the next round is a full one, due a whole period from now, and what the abandoned
        timeline wrote after ``anchor`` is never gone back to."""
        self._base, self._partials_since_base = None, 0
        self._last_time = time.monotonic()
        self.anchored(anchor)

    def restarted(self, iteration: int | None) -> None:
        """The job (re)started from a checkpoint (a resume, a full rollback) at driver ``iteration``:
        the next policy round is a whole period from here, in iterations as in seconds. Before, a
        resumed job checkpointed at once the state it had just read, and after a rollback the
        period counted from the round before the loss, iterations the job had gone back over."""
        self._last_time = time.monotonic()
        if iteration is not None:
            self._last_iteration = iteration

    def anchored(self, anchor: tuple[str, str, dict[str, Any]] | None) -> None:
        """This run's timeline starts at ``anchor`` (a resumed or rolled-back-to full checkpoint,
        as ``(location, path, manifest)``; None: at the beginning)."""
        self.anchor, self.own_from = anchor, None

    def record_timeline(self) -> None:
        """Write down where this run's timeline starts (``anchor``, and the directories it will
        create) in the checkpoint directory, for a later ``--resume auto`` (``storage.write_timeline``);
        called as the run starts and after a rollback. Storage that fails is named in a warning:
        the job goes on, and such a restart would take the directory's newest checkpoint."""
        from litz.ft import storage

        try:
            storage.write_timeline(self.location, self.anchor[:2] if self.anchor else None)
        except storage.CheckpointError as exc:
            log.warning("%s: a restart with --resume auto may take a checkpoint of another run in %s",
                        exc, storage.redact(self.location))

    def made_dir(self, path: str) -> None:
        """The current round created directory ``path``: it and those numbered after it are this
        run's (a number is never reused)."""
        from litz.ft import storage

        if self.own_from is None and storage.checkpoint_seq(path) >= 0:
            self.own_from = storage.checkpoint_seq(path)

    def last_full(self) -> tuple[str, str, dict[str, Any]]:
        """``(location, path, manifest)`` of the full checkpoint a full recovery goes back to: the
        newest complete one this run wrote, else its anchor. Raises ``NoCheckpoint`` if there is
        neither, ``CheckpointError`` if the storage does not answer."""
        from litz.ft import storage

        if self.own_from is not None:
            try:
                _, path, manifest = storage.find_checkpoint(self.location, self.own_from)
                return self.location, path, manifest
            except storage.NoCheckpoint:
                pass
        if self.anchor is not None:
            return self.anchor
        raise storage.NoCheckpoint(f"no complete checkpoint of this run in {storage.redact(self.location)} yet")

    def running(self, kind: str) -> tuple[str, str, dict[str, Any], list[tuple[str, list[str]]]] | None:
        """What a partial recovery restores ``kind`` (``shards`` or ``executors``) from: ``(location,
        base path, base manifest, [(partial path, its files)])`` of the newest complete full
        checkpoint this run wrote and the partial ones after it, else its anchor alone; None if
        neither. ``CheckpointError`` if the storage does not answer."""
        from litz.ft import storage

        if self.own_from is not None:
            found = storage.running_checkpoint(self.location, kind, self.own_from)
            if found is not None:
                return (self.location, *found)
        if self.anchor is not None:
            return (*self.anchor, [])
        return None

    def begin(self, reason: str, iteration: int | None = None, kind: str = "full") -> CheckpointRound | None:
        """Start a round, ``full`` (consistent, everything) or ``partial`` (a fraction of the rows,
        no pause); None if one is already running."""
        if self.round is not None:
            return None
        self._next_cid += 1
        self._last_time = time.monotonic()
        if iteration is not None:
            self._last_iteration = iteration
        now = time.monotonic()
        self.round = CheckpointRound(self._next_cid, reason, now, kind=kind,
                                     phase="preparing" if kind == "full" else "scoring", since=now)
        return self.round

    def directory_made(self, path: str) -> bool:
        """The round's directory exists; True if training must pause now (a full round: it holds
        new tasks from here until the snapshot, while the running ones finish)."""
        r = self.round
        assert r is not None and r.dir_path is None
        r.dir_path = path
        self.made_dir(path)
        if r.phase != "preparing":
            return False
        r.enter("pausing")
        r.pause_started = r.since
        return True

    def overdue(self) -> str | None:
        """What the round has waited for longer than ``timeout`` (None: nothing). A store that
        hangs (an NFS server gone, a bucket without a request timeout) would otherwise hold the
        round open for ever: no later checkpoint, no answer to ``litz checkpoint`` or ``litz stop
        --checkpoint``, and, while a full round waits for its directory, training paused."""
        r = self.round
        if r is None or time.monotonic() - r.since <= self.timeout:
            return None
        return r.waits_for()

    def snapshotting(self, path: str, servers: list[str], workers: list[str]) -> None:
        """The round's processes copy their state now: ``servers`` their shards, ``workers`` their
        executors. The manifest lists the files of exactly these: one that leaves the job (a
        scale-in) after its copy still wrote what it held then, which no one else saved."""
        assert self.round is not None and self.round.phase in ("pausing", "scoring") and self.round.dir_path == path
        self.round.enter("snapshot")
        self.round.path = path
        self.round.servers, self.round.workers = sorted(servers), sorted(workers)
        self.round.waiting_snapshot = set(servers) | set(workers)
        self.round.waiting_written = set(servers) | set(workers)

    def snapshot_taken(self, cid: int, sender: str) -> bool:
        """A process copied its state; True when the last one did (training may resume)."""
        r = self.round
        if r is None or r.cid != cid or r.phase != "snapshot":
            return False
        r.waiting_snapshot.discard(sender)
        if r.waiting_snapshot:
            return False
        r.enter("writing")
        if r.kind == "full":  # a partial round holds no task
            r.paused_for = time.monotonic() - r.pause_started
        return True

    def written(self, cid: int, sender: str, files: list[str], error: str | None) -> bool:
        """A process wrote its part; True when the last one did (time for the manifest)."""
        r = self.round
        if r is None or r.cid != cid:
            return False
        r.files[sender] = list(files)
        if error:
            r.errors.append(error)
        r.waiting_written.discard(sender)
        return not r.waiting_written and not r.waiting_snapshot

    def drop(self) -> CheckpointRound:
        """Forget the round in progress, unrecorded: the job ended before it saved anything."""
        r = self.round
        assert r is not None
        self.round = None
        return r

    def finish(self) -> dict[str, Any]:
        """Close the round; returns its record (``ok`` False if a part failed to write)."""
        r = self.round
        assert r is not None
        self.round = None
        record = {"cid": r.cid, "kind": r.kind, "reason": r.reason, "path": r.path, "ok": not r.errors,
                  "errors": r.errors,
                  "seconds": time.monotonic() - r.started, "paused_seconds": r.paused_for}
        self.add_record(record)
        if record["ok"] and r.kind == "full":
            self._base, self._partials_since_base = record, 0
        elif record["ok"] and self._base is not None:
            self._partials_since_base += 1
        return record
