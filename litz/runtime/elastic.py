"""Scale commands: the master's side of scale-out and scale-in while the job runs (DESIGN.md §4).

A command is a key ``commands/scale`` in the job's etcd prefix (written by ``litz scale``):
``{"id": ..., "workers": N}``. The master answers under ``commands/result/<id>`` with
``{"ok": bool, "reason": str}`` once the command is accepted or refused.

- Scale-out: the master asks the host's node agent (key ``agents/<agent>/spawn``) for new
  worker processes, initialises each as it registers, then rebalances executors onto them,
  shipping input from memory so the new processes start fast.
- Scale-in: the master picks the workers to retire, moves their executors to the others
  without their input (the destination reloads it from shared storage, so the leaving
  process is freed at once), then tells the retired workers to leave. Scale-in is complete
  when they have exited; its latency is measured from the command to their goodbye.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from litz.runtime.master import Master

log = logging.getLogger(__name__)

COMMANDS = "commands/"
SCALE_KEY = "commands/scale"
RESULTS = "commands/result/"
AGENTS = "agents/"


@dataclass
class ScaleOp:
    """One accepted scale command in progress."""

    cid: str
    started: float
    joining: set[str] = field(default_factory=set)
    retiring: set[str] = field(default_factory=set)


class Elasticity:
    """Turns scale commands into process starts, executor migrations and retirements."""

    def __init__(self, master: Master) -> None:
        self.m = master
        self.op: ScaleOp | None = None
        self.history: list[dict[str, Any]] = []
        self._next_worker = 0

    # -- commands ----------------------------------------------------------------------------------
    def reply(self, cid: str, ok: bool, reason: str = "") -> None:
        self.m.membership.put(f"{RESULTS}{cid}", {"ok": ok, "reason": reason, "time": time.time()})

    def on_command(self, cmd: dict[str, Any]) -> None:
        cid = str(cmd.get("id", ""))
        st = self.m.state
        if st is None:
            self.reply(cid, False, "the job is still starting")
            return
        if self.op is not None:
            self.reply(cid, False, f"scale command {self.op.cid} is still in progress")
            return
        unknown = set(cmd) - {"id", "workers", "time"}
        if unknown:
            self.reply(cid, False, f"unsupported scale option(s) {sorted(unknown)} (this release scales workers)")
            return
        want = cmd.get("workers")
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            self.reply(cid, False, f"workers must be an integer >= 1, got {want!r}")
            return
        if want > st.num_executors:
            self.reply(cid, False, f"{want} workers for {st.num_executors} executors would leave workers idle")
            return
        have = list(st.workers)
        self.op = op = ScaleOp(cid, time.monotonic())
        if want > len(have):
            agent = self.m.local_agent()
            if agent is None:
                self.op = None
                self.reply(cid, False, "no node agent is registered to start processes")
                return
            self._next_worker = max(self._next_worker, *(int(w[1:]) + 1 for w in have if w[1:].isdigit()))
            ids = [f"w{self._next_worker + i}" for i in range(want - len(have))]
            self._next_worker += len(ids)
            op.joining = set(ids)
            self.m.membership.put(f"{AGENTS}{agent}/spawn", {"workers": ids, "command": cid})
        elif want < len(have):
            op.retiring = set(have[want:])
            self.m.rebalance(have[:want], ship_input=False)
        self.reply(cid, True, f"scaling from {len(have)} to {want} workers")
        log.info("scale %s: %d -> %d workers", cid, len(have), want)
        self.tick()

    # -- progress ----------------------------------------------------------------------------------
    def on_ready(self, ident: str, error: str | None) -> None:
        """A joining worker finished initialising."""
        op = self.op
        if op is None or ident not in op.joining:
            return
        if error:
            log.error("worker %s failed to join: %s", ident, error)
        else:
            assert self.m.state is not None
            self.m.state.workers.append(ident)
        op.joining.discard(ident)
        if not op.joining:
            self.m.rebalance(ship_input=True)
            self.tick()

    def on_registered(self, ident: str) -> None:
        """A process registered in etcd: initialise it if it is a worker we are waiting for."""
        if self.op is not None and ident in self.op.joining:
            self.m.init_worker(ident)

    def tick(self) -> None:
        """Retire workers left without executors; close the operation when nothing is pending."""
        op, st = self.op, self.m.state
        if op is None or st is None:
            return
        if op.retiring and not op.joining:
            # executors that were in flight to a retiring worker when the command came move on now
            keep = [w for w in st.workers if w not in op.retiring]
            if any(st.moving_dest(e) in op.retiring for e in st.placement if e not in st.moving):
                self.m.rebalance(keep, ship_input=False)
        for w in sorted(op.retiring):
            if w in st.workers and not any(st.moving_dest(e) == w or st.placement[e] == w for e in st.placement):
                st.workers.remove(w)
                self.m.retire(w)
        if op.joining or st.moving or any(not self.m.said_goodbye(w) for w in op.retiring):
            return
        self.history.append({"command": op.cid, "seconds": time.monotonic() - op.started,
                             "workers": sorted(st.workers), "retired": sorted(op.retiring)})
        self.op = None
