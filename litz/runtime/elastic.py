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

from litz.runtime import spawner

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from litz.runtime.master import Master

log = logging.getLogger(__name__)

COMMANDS = "commands/"
SCALE_KEY = "commands/scale"
RESULTS = "commands/result/"
AGENTS = "agents/"
AGENT_PROCS = "procs/agent/"
JOINS = "commands/join/"
JOIN_TIMEOUT = 30.0  # seconds new processes have to become ready before a scale goes on without them
#: seconds a host's offer waits for its agent's registration to be seen (another watch stream: it
#: may come after the offer) before it is refused
AGENT_WAIT = 5.0


@dataclass
class ScaleOp:
    """One accepted scale command in progress."""

    cid: str
    started: float
    joining: set[str] = field(default_factory=set)
    retiring: set[str] = field(default_factory=set)
    routes: dict[str, int] = field(default_factory=dict)  # retiring server -> its routes request
    drain_host: str | None = None  # the host being drained, whose agents leave at the end
    lost: list[str] = field(default_factory=list)  # processes that died during the operation


class _Refused(Exception):
    """A scale command that cannot be met; the message says why. ``holds_nothing``: a drain of a
    host where none of the job's processes runs (its agent may leave: there is nothing to move)."""

    def __init__(self, reason: str, holds_nothing: bool = False) -> None:
        super().__init__(reason)
        self.holds_nothing = holds_nothing


class Elasticity:
    """Turns scale commands into process starts, executor migrations and retirements."""

    def __init__(self, master: Master) -> None:
        self.m = master
        self.op: ScaleOp | None = None
        self.history: list[dict[str, Any]] = []
        self._next_id: dict[str, int] = {}
        # join offers waiting for the current operation, with when they came
        self._joins: list[tuple[dict[str, Any], float]] = []
        # processes that registered but never joined (their join timed out, or failed): no message
        # of the master reaches them (a host without the job secret, say), so it waits for none
        self.unjoined: set[str] = set()

    # -- commands ----------------------------------------------------------------------------------
    def reply(self, cid: str, ok: bool, reason: str = "", **extra: Any) -> None:
        self.m.reply_command(cid, ok, reason, **extra)

    def on_command(self, cmd: dict[str, Any]) -> None:
        """A ``litz scale`` command: accepted (and started) or refused with a reason, at once."""
        self._answer("scale", cmd, self._start)

    def on_join(self, cmd: dict[str, Any]) -> None:
        """A node agent (``litz launch --join``) offers processes; queued while another scale runs."""
        self._joins.append((cmd, time.monotonic()))
        self._next_join()

    def offers_due(self) -> None:
        """From the loop: take up an offer that waits for its agent's registration (``_next_join``)."""
        if self._joins:
            self._next_join()

    def _next_join(self) -> None:
        """Start the next offer, if nothing else runs. An offer whose agent the master has not seen
        register yet waits for it up to ``AGENT_WAIT`` s: the agent registers before it offers, but the
        two reach the master on two watch streams, in either order. (Before, the agent was read from
        etcd on the loop, which an etcd outage made fail the job.)"""
        while self.op is None and self._joins and self.m.state is not None and not self.m.recovering:
            cmd, since = self._joins[0]
            if str(cmd.get("agent", "")) not in self.m.agents and time.monotonic() - since < AGENT_WAIT:
                return
            self._joins.pop(0)
            self._answer("join", cmd, self._start_join)

    def _answer(self, kind: str, cmd: dict[str, Any], start: Callable[[str, dict[str, Any]], str]) -> None:
        """Start a command or an offer and tell its sender, in one place so both kinds are answered
        alike: refused with the reason, or accepted with what was started (then driven at once)."""
        cid = str(cmd.get("id", ""))
        try:
            text = start(cid, cmd)
        except _Refused as exc:
            self.reply(cid, False, str(exc), **({"host_holds_nothing": True} if exc.holds_nothing else {}))
            return
        self.reply(cid, True, text)
        log.info("%s %s: %s", kind, cid, text)
        self.tick()

    def _start(self, cid: str, cmd: dict[str, Any]) -> str:
        st = self.m.state
        if st is None:
            raise _Refused("the job is still starting")
        if self.op is not None:
            raise _Refused(f"scale command {self.op.cid} is still in progress")
        if self.m.recovering:
            raise _Refused("the job is recovering from a lost process; try again once it has")
        unknown = set(cmd) - {"id", "workers", "servers", "drain_host", "time", "sig"}
        if unknown:
            raise _Refused(f"unsupported scale option(s) {sorted(unknown)}")
        kinds = [k for k in ("workers", "servers", "drain_host") if k in cmd]
        if len(kinds) != 1:
            raise _Refused("a scale command names one of workers, servers or drain_host")
        kind = kinds[0]
        if kind == "drain_host":
            return self._start_drain(cid, str(cmd[kind]))
        want = cmd[kind]
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            raise _Refused(f"{kind} must be an integer >= 1, got {want!r}")
        have = list(st.workers if kind == "workers" else st.servers)
        self._check_limits(len(st.workers) if kind == "servers" else want,
                           len(st.servers) if kind == "workers" else want)
        op = ScaleOp(cid, time.monotonic())
        if want > len(have):
            agent = self.m.local_agent()
            if agent is None:
                raise _Refused("no node agent is registered to start processes")
            self._spawn(op, agent, **{kind: want - len(have)})
        elif want < len(have):
            self._retire(op, have[want:])
        self.op = op
        return f"scaling from {len(have)} to {want} {kind}"

    def _check_limits(self, workers: int, servers: int) -> None:
        st = self.m.state
        assert st is not None
        if workers > st.num_executors:
            raise _Refused(f"{workers} workers for {st.num_executors} executors would leave workers idle")
        if servers > st.num_shards:
            raise _Refused(f"{servers} servers for {st.num_shards} shards would leave servers idle")

    def _start_join(self, cid: str, cmd: dict[str, Any]) -> str:
        st = self.m.state
        assert st is not None
        agent = str(cmd.get("agent", ""))
        if agent not in self.m.agents:
            raise _Refused(f"no node agent {agent!r} is registered")
        n_workers, n_servers = cmd.get("workers", 0), cmd.get("servers", 0)
        for name, n in (("workers", n_workers), ("servers", n_servers)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise _Refused(f"{name} must be an integer >= 0, got {n!r}")
        if n_workers + n_servers == 0:
            raise _Refused("a joining host must offer at least one worker or server")
        self._check_limits(len(st.workers) + n_workers, len(st.servers) + n_servers)
        op = ScaleOp(cid, time.monotonic())
        self._spawn(op, agent, workers=n_workers, servers=n_servers)
        self.op = op
        return f"host {agent} joins with {n_workers} workers and {n_servers} servers"

    def _start_drain(self, cid: str, host: str) -> str:
        st = self.m.state
        assert st is not None
        on_host = [p for p in st.workers + st.servers if self.m.procs.get(p, {}).get("host") == host]
        if not on_host:
            hosts = sorted({self.m.procs.get(p, {}).get("host", "?") for p in st.workers + st.servers})
            raise _Refused(f"no worker or server of this job runs on host {host!r} (hosts: {', '.join(hosts)})",
                           holds_nothing=True)
        if all(w in on_host for w in st.workers) or all(s in on_host for s in st.servers):
            raise _Refused(f"draining {host} would leave the job without "
                           f"{'workers' if all(w in on_host for w in st.workers) else 'servers'}")
        op = ScaleOp(cid, time.monotonic(), drain_host=host)
        self._retire(op, on_host)
        self.op = op
        return f"draining host {host}: {', '.join(sorted(on_host))} leave"

    def _spawn(self, op: ScaleOp, agent: str, workers: int = 0, servers: int = 0) -> None:
        """Ask a node agent for new processes, with fresh ids."""
        request: dict[str, Any] = {"command": op.cid, "numba": spawner.numba_loaded()}  # see handle_spawn
        for kind, prefix, n in (("workers", "w", workers), ("servers", "s", servers)):
            if n:
                known = (*self.m.procs, *self.m.lost)  # a lost id stays fenced: never given again
                taken = [int(p[1:]) + 1 for p in known if p[:1] == prefix and p[1:].isdigit()]
                first = max([self._next_id.get(prefix, 0), *taken])
                request[kind] = [f"{prefix}{first + i}" for i in range(n)]
                self._next_id[prefix] = first + n
                op.joining.update(request[kind])
        self.m.request_agent(agent, "spawn", request)  # (sent again until etcd takes it)

    def _retire(self, op: ScaleOp, leaving: list[str]) -> None:
        """Move everything off ``leaving``; ``tick`` retires each process once it is empty."""
        st = self.m.state
        assert st is not None
        op.retiring = set(leaving)
        if any(w in op.retiring for w in st.workers):
            self.m.rebalance([w for w in st.workers if w not in op.retiring], ship_input=False)
        if any(s in op.retiring for s in st.servers):
            self.m.rebalance_shards([s for s in st.servers if s not in op.retiring])

    # -- failures during an operation -------------------------------------------------------------
    def joining(self, ident: str) -> bool:
        return self.op is not None and ident in self.op.joining

    def retiring(self) -> set[str]:
        """Processes this operation retires: a recovery restores nothing onto them."""
        return set(self.op.retiring) if self.op is not None else set()

    def on_lost(self, ident: str) -> None:
        """A process died during the operation (the master recovers what it held). It no longer
        joins or leaves: the operation goes on with the others."""
        op = self.op
        if op is None:
            return
        op.lost.append(ident)
        op.routes.pop(ident, None)
        op.retiring.discard(ident)
        if ident in op.joining:
            op.joining.discard(ident)
            reason = f"scale {op.cid}: {ident} died before it joined; going on without it"
            log.error("%s", reason)
            self.m.errors.append(reason)
            if not op.joining:
                self._joined()

    def recovered(self) -> None:
        """A recovery ended: the survivors took the dead's items, perhaps unevenly. During an
        operation, once every new process has joined, spread them again over the processes that
        stay (moves off retiring ones included: a rollback abandons migrations in flight). Without
        one, spread them over all: a process that joined while the recovery ran was not a survivor
        when the recovery planned, so it took none of the dead's items (it sat idle, the others
        doubled up); after a plain loss the plan was even, and nothing moves."""
        op, st = self.op, self.m.state
        if op is None:
            self._next_join()  # a host that offered itself during the recovery joins now
            if self.op is None and st is not None:
                self.m.rebalance()
                self.m.rebalance_shards()
        if op is None or st is None or op.joining:
            return
        self.m.rebalance(self._staying(st.workers), ship_input=not op.retiring)
        self.m.rebalance_shards(self._staying(st.servers))
        self.tick()

    def _staying(self, group: list[str]) -> list[str]:
        """The processes of ``group`` that stay. If only retiring ones are left (the others
        died), those stay too: their retirement is called off."""
        op = self.op
        assert op is not None
        stay = [p for p in group if p not in op.retiring]
        if not stay:
            reason = f"scale {op.cid}: {', '.join(group)} stay (every other one of their kind died)"
            log.error("%s", reason)
            self.m.errors.append(reason)
            op.retiring -= set(group)
            stay = list(group)
        return stay

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
            self.unjoined.add(ident)
        else:
            (st.servers if self.m.procs[ident].get("role") == "server" else st.workers).append(ident)
        op.joining.discard(ident)
        if not op.joining:
            self._joined()

    def _joined(self) -> None:
        """Every new process is ready (or given up on): spread executors and shards onto them. Not
        during a full rollback (a joining process lost then): ``recovered`` spreads them at its end."""
        if self.m.rolling_back:
            return
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
        # Nothing while a full rollback runs (``recovered`` ticks at its end): the workers drop their
        # executors to reload them, so moves sent meanwhile (executors the rollback put back on a
        # retiring worker, say) failed the job, and the processes it holds back from joining are
        # ready, not late
        if op is None or st is None or self.m.rolling_back:
            return
        join_timeout = float(self.m.options.get("join_timeout", JOIN_TIMEOUT))
        if op.joining and time.monotonic() - op.started > join_timeout:
            # e.g. a host started without the job secret: its processes registered in etcd, but no
            # message reaches them (their refusals are in their own logs); go on without them
            reason = (f"scale {op.cid}: {', '.join(sorted(op.joining))} did not join within {join_timeout:.0f} s "
                      "(wrong or missing job secret, or unreachable address?); going on without them")
            log.error("%s", reason)
            self.m.errors.append(reason)
            self.unjoined |= op.joining
            op.joining.clear()
            self._joined()
            return
        if op.retiring and not op.joining:
            # executors that were in flight to a retiring worker when the command came move on now,
            # as do executors and shards put back on a retiring process by a recovery
            if any(st.moving_dest(e) in op.retiring for e in st.placement if e not in st.moving):
                self.m.rebalance(self._staying(st.workers), ship_input=False)
            if any(owner in op.retiring for s, owner in enumerate(st.shard_map) if s not in st.shards_moving):
                self.m.rebalance_shards(self._staying(st.servers))
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
                             "retired": sorted(op.retiring), "lost": op.lost})
        self.op = None
        if op.drain_host is not None:  # the drained host's agents have nothing left to run: they leave
            for name, agent in sorted(self.m.agents.items()):
                if agent.get("host") == op.drain_host:
                    self.m.request_agent(name, "exit", {"command": op.cid})
        self._next_join()
