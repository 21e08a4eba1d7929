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

import time
from dataclasses import dataclass, field
from typing import Any

from litz.errors import ConfigError


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
    phase: str = "pausing"  # pausing -> snapshot -> writing
    path: str | None = None
    waiting_snapshot: set[str] = field(default_factory=set)
    waiting_written: set[str] = field(default_factory=set)
    files: dict[str, list[str]] = field(default_factory=dict)  # process -> its files
    errors: list[str] = field(default_factory=list)
    paused_for: float = 0.0  # seconds training was held (pause + snapshot)
    version: int = 0  # the master's version at the snapshot


class CheckpointCoordinator:
    """Decides when a checkpoint is due and tracks the round in progress."""

    def __init__(self, location: str, every: str | float | int | None = None) -> None:
        self.location = location
        self.every_seconds, self.every_iterations = parse_every(every)
        self.round: CheckpointRound | None = None
        self.completed: list[dict[str, Any]] = []  # finished rounds, newest last
        self._next_cid = 0
        self._last_time = time.monotonic()
        self._last_iteration = 0

    def due(self, iteration: int | None) -> bool:
        """Whether the policy asks for a checkpoint now (none while one is in progress)."""
        if self.round is not None:
            return False
        if self.every_seconds is not None:
            return time.monotonic() - self._last_time >= self.every_seconds
        if self.every_iterations is not None and iteration is not None:
            return iteration - self._last_iteration >= self.every_iterations
        return False

    def begin(self, reason: str, iteration: int | None = None) -> CheckpointRound | None:
        """Start a round (None if one is already running)."""
        if self.round is not None:
            return None
        self._next_cid += 1
        self._last_time = time.monotonic()
        if iteration is not None:
            self._last_iteration = iteration
        self.round = CheckpointRound(self._next_cid, reason, time.monotonic())
        return self.round

    def snapshotting(self, path: str, processes: list[str]) -> None:
        assert self.round is not None and self.round.phase == "pausing"
        self.round.phase = "snapshot"
        self.round.path = path
        self.round.waiting_snapshot = set(processes)
        self.round.waiting_written = set(processes)

    def snapshot_taken(self, cid: int, sender: str) -> bool:
        """A process copied its state; True when the last one did (training may resume)."""
        r = self.round
        if r is None or r.cid != cid or r.phase != "snapshot":
            return False
        r.waiting_snapshot.discard(sender)
        if r.waiting_snapshot:
            return False
        r.phase = "writing"
        r.paused_for = time.monotonic() - r.started
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

    def finish(self) -> dict[str, Any]:
        """Close the round; returns its record (``ok`` False if a part failed to write)."""
        r = self.round
        assert r is not None
        self.round = None
        record = {"cid": r.cid, "reason": r.reason, "path": r.path, "ok": not r.errors, "errors": r.errors,
                  "seconds": time.monotonic() - r.started, "paused_seconds": r.paused_for}
        self.completed.append(record)
        return record
