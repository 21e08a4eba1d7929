"""Scale commands: the master's side of scale-out and scale-in while the job runs (DESIGN.md §4).

A command is a key ``commands/scale`` in the job's etcd prefix (written by ``litz scale``):
``{"id": ..., "workers": N}`` or ``{"id": ..., "servers": M}``. The master answers under ``commands/result/<id>`` with
``{"ok": bool, "reason": str}`` once the command is accepted or refused.

- Scale-out: the master asks the host's node agent (key ``agents/<agent>/spawn``) for new
  worker processes, initialises each as it registers, then rebalances executors onto them,
  shipping input from memory so the new processes start fast.
- Scale-in: the master picks the workers to retire, moves their executors to the others
  without their input (the destination reloads it from shared storage, so the leaving
  process is freed at once), then tells the retired workers to leave. Scale-in is complete
  when they have exited; its latency is measured from the command to their goodbye.
- Servers scale out the same way, their shards arriving by migration (workers learn the new
  owners lazily). To scale servers in, the master moves every shard off the retiring
  servers, then tells all other processes to route around them (``routes``); only when each
  has answered, with nothing pending at the retiring servers, are these told to leave.
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
    routes: dict[str, int] = field(default_factory=dict)  # retiring server -> its routes request


class _Refused(Exception):
    """A scale command that cannot be met; the message says why."""


class Elasticity:
    """Turns scale commands into process starts, executor migrations and retirements."""

    def __init__(self, master: Master) -> None:
        self.m = master
        self.op: ScaleOp | None = None
        self.history: list[dict[str, Any]] = []
        self._next_id: dict[str, int] = {}

    # -- commands ----------------------------------------------------------------------------------
    def reply(self, cid: str, ok: bool, reason: str = "") -> None:
        self.m.membership.put(f"{RESULTS}{cid}", {"ok": ok, "reason": reason, "time": time.time()})

    def on_command(self, cmd: dict[str, Any]) -> None:
        cid = str(cmd.get("id", ""))
        try:
            text = self._start(cid, cmd)
        except _Refused as exc:
            self.reply(cid, False, str(exc))
            return
        self.reply(cid, True, text)
        log.info("scale %s: %s", cid, text)
        self.tick()

    def _start(self, cid: str, cmd: dict[str, Any]) -> str:
        st = self.m.state
        if st is None:
            raise _Refused("the job is still starting")
        if self.op is not None:
            raise _Refused(f"scale command {self.op.cid} is still in progress")
        unknown = set(cmd) - {"id", "workers", "servers", "time"}
        if unknown:
            raise _Refused(f"unsupported scale option(s) {sorted(unknown)}")
        kinds = [k for k in ("workers", "servers") if k in cmd]
        if len(kinds) != 1:
            raise _Refused("a scale command names either workers or servers")
        kind = kinds[0]
        want = cmd[kind]
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            raise _Refused(f"{kind} must be an integer >= 1, got {want!r}")
        have = list(st.workers if kind == "workers" else st.servers)
        if kind == "workers" and want > st.num_executors:
            raise _Refused(f"{want} workers for {st.num_executors} executors would leave workers idle")
        if kind == "servers" and want > st.num_shards:
            raise _Refused(f"{want} servers for {st.num_shards} shards would leave servers idle")
        op = ScaleOp(cid, time.monotonic())
        if want > len(have):
            agent = self.m.local_agent()
            if agent is None:
                raise _Refused("no node agent is registered to start processes")
            prefix = "w" if kind == "workers" else "s"
            taken = [int(p[1:]) + 1 for p in self.m.procs if p[:1] == prefix and p[1:].isdigit()]
            first = max([self._next_id.get(prefix, 0), *taken])
            ids = [f"{prefix}{first + i}" for i in range(want - len(have))]
            self._next_id[prefix] = first + len(ids)
            op.joining = set(ids)
            self.m.membership.put(f"{AGENTS}{agent}/spawn", {kind: ids, "command": cid})
        elif want < len(have):
            op.retiring = set(have[want:])
            if kind == "workers":
                self.m.rebalance(have[:want], ship_input=False)
            else:
                self.m.rebalance_shards(have[:want])
        self.op = op
        return f"scaling from {len(have)} to {want} {kind}"

    # -- progress ----------------------------------------------------------------------------------
    def on_ready(self, ident: str, error: str | None) -> None:
        """A joining worker finished initialising."""
        op = self.op
        if op is None or ident not in op.joining:
            return
        st = self.m.state
        assert st is not None
        if error:
            log.error("%s failed to join: %s", ident, error)
        else:
            (st.servers if self.m.procs[ident].get("role") == "server" else st.workers).append(ident)
        op.joining.discard(ident)
        if not op.joining:
            self.m.rebalance(ship_input=True)
            self.m.rebalance_shards()
            self.tick()

    def on_registered(self, ident: str) -> None:
        """A process registered in etcd: initialise it if it is a worker we are waiting for."""
        if self.op is not None and ident in self.op.joining:
            if self.m.procs[ident].get("role") == "server":
                self.m.init_server(ident)
            else:
                self.m.init_worker(ident)

    def tick(self) -> None:
        """Retire workers left without executors and servers left without shards (once everyone
        routes around them); close the operation when nothing is pending."""
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
            elif w in st.servers and not st.holds_shards(w):
                st.servers.remove(w)
                op.routes[w] = self.m.flush_routes([w])
            if w in op.routes and self.m.routes_settled(op.routes[w]):
                del op.routes[w]
                self.m.retire(w)
        busy = op.joining or st.moving or st.shards_moving
        if busy or any(not self.m.said_goodbye(w) for w in op.retiring):
            return
        self.history.append({"command": op.cid, "seconds": time.monotonic() - op.started,
                             "workers": sorted(st.workers), "servers": sorted(st.servers),
                             "retired": sorted(op.retiring)})
        self.op = None
