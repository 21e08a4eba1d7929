"""Start a job: an embedded local cluster (etcd, servers, workers) plus the master in this process.

``LocalCluster`` plays the node agent of this host: it starts the host's worker and server
processes, registers itself in etcd, watches its children, and stops them all (and the
private etcd it started) on the way out, whatever happened, so no process is left behind.

Security: a job binds to loopback unless given another ``host``, which requires a job secret
(``secret_file``, or ``$LITZ_SECRET_FILE``). With a secret, every process of the job, the
master included, uses ZeroMQ CURVE (see ``litz.runtime.security``). The secret is read once,
when the cluster starts; the processes it starts later (a scale-out, a recovery) get its key
through a pipe on their stdin, so a secret file replaced meanwhile does not lock them out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from litz.api import App, Driver, Executor, JobResult
from litz.errors import ConfigError, EtcdUnreachable, LitzError, ProcessLost
from litz.ft.checkpoint import DEFAULT_TIMEOUT, CheckpointCoordinator, checked_timeout
from litz.ps.tables import is_int, table_index
from litz.runtime import jobs, security, spawner, stragglers
from litz.runtime.elastic import AGENTS, JOINS, RESULTS, SCALE_KEY
from litz.runtime.etcd_server import LocalEtcd
from litz.runtime.master import STATUS_KEY, Master, Resume, StartupTimeout
from litz.runtime.membership import Event, KeyHeld, Membership, lease_ttl
from litz.runtime.node import MASTER_KEY, MasterPresence, proc_key
from litz.runtime.transport import check_bind_host, host_name

log = logging.getLogger(__name__)

LAUNCHER_KEY = "launcher"  # on a shared etcd, the job's name: held under its launcher's lease


def new_job_name() -> str:
    return f"litz-{os.getpid()}-{secrets.token_hex(3)}"


#: The most processes one spawn request may ask an agent for (a scale-out adds a few at a time), and
#: the most of the job's processes an agent keeps alive on its host at once (requests past it refused)
MAX_SPAWN = 256
_SPAWN_IDS = {"workers": re.compile(r"w[0-9]{1,9}"), "servers": re.compile(r"s[0-9]{1,9}")}


def _spawn_problem(request: Any) -> str | None:
    """What is wrong with a spawn request from etcd (``{"workers": [ids], "servers": [ids], ...}``),
    or None."""
    if not isinstance(request, dict):
        return f"not a JSON object: {str(request)[:200]!r}"
    total = 0
    for kind, pattern in _SPAWN_IDS.items():
        ids = request.get(kind, [])
        if not isinstance(ids, list):
            return f"{kind} is not a list: {str(ids)[:200]!r}"
        bad = [i for i in ids if not (isinstance(i, str) and pattern.fullmatch(i))]
        if bad:
            return f"{kind} ids must look like {pattern.pattern}, got {str(bad[:5])[:200]}"
        total += len(ids)
    if total > MAX_SPAWN:
        return f"{total} processes at once (at most {MAX_SPAWN})"
    return None


class LocalCluster:
    """This host's processes for one job, with a private etcd unless ``etcd`` names one."""

    def __init__(self, job: str, *, workers: int, servers: int, etcd: str | None = None,
                 host: str = "127.0.0.1", log_level: str | None = None,
                 secret_file: str | os.PathLike[str] | None = None, join: bool = False) -> None:
        if join:
            if etcd is None:
                raise ConfigError("joining a running job needs its etcd (--etcd URL)")
            if workers < 0 or servers < 0 or workers + servers == 0:
                raise ConfigError(f"a joining host offers at least one worker or server (got {workers} and {servers})")
        elif workers < 1 or servers < 1:
            raise ConfigError(f"a job needs at least one worker and one server (got {workers} and {servers})")
        # refuse a bad secret or an unsecured non-loopback host here, not in N children's logs
        self.secret = security.load_secret(secret_file) if secret_file is not None else None
        check_bind_host(host, self.secret)
        self.job = job
        self.workers = workers
        self.servers = servers
        self.host = host
        self.node = host_name(host)  # this agent's name, and its host's in the job
        self.join = join
        self.exit_requested = False  # the master drained this host (join mode: the agent leaves)
        self.job_ended = False  # join mode: the master is gone, the job is over
        self.etcd_url = etcd
        self.log_level = log_level or os.environ.get("LITZ_LOG_LEVEL", "WARNING")
        self._etcd: LocalEtcd | None = None
        self._agent: Membership | None = None
        self.children: dict[str, subprocess.Popen[bytes] | spawner.ForkedProcess] = {}
        self._spawner: spawner.Spawner | None = None  # the zygote forking this host's processes (shared)
        self._reported: set[str] = set()  # children whose failure was reported
        self.rundir = Path(tempfile.mkdtemp(prefix=f"{job}-"))
        self._stopping = False
        self._record: str | None = None  # the token of this job's record in the local jobs folder
        self._since = time.time()

    # -- start --------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop(timeout=0.0)  # nothing started to finish: the children are terminated at once
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.etcd_url is None:
            # Fresh interpreters (LITZ_SPAWN=exec) start while etcd comes up: they retry their first
            # connection for a few seconds, and their imports take about as long as etcd's start.
            self._etcd = LocalEtcd(private=True)  # Unix sockets only this user reaches, no port
            self._etcd.start(wait=False)
            self.etcd_url = self._etcd.url
        if not self.join:  # before any process starts: the name must be this job's alone
            self._record = jobs.claim(self.job, self.etcd_url)
            if self._etcd is None:  # a shared etcd: no other job of this name may run on it either
                self._hold(LAUNCHER_KEY, lambda held, since: (
                    f"a job named {self.job!r} is already running on etcd {self.etcd_url} (its launcher is "
                    f"pid {held.get('pid')} on {held.get('host')}, since {since}): pick another --job name, "
                    f"or stop that job first (litz stop --job {self.job} --etcd {self.etcd_url})"))
        else:  # one agent per host and job: two would both start the processes asked of the host
            self._hold(proc_key("agent", self.node), lambda held, since: (
                f"host {self.node} already takes part in job {self.job!r} (its agent is pid {held.get('pid')}, "
                f"since {since}): a host joins a job once. For more processes on the launcher's host, use "
                f"litz scale --job {self.job} --workers N; on a joined host, drain it (SIGTERM to its agent) "
                f"and join again with more"))
        if spawner.enabled():  # this process's zygote: imported once, forks each process (litz.runtime.spawner)
            self._spawner = spawner.shared()
        etcd_waits = self._etcd
        if self._spawner is not None and etcd_waits is not None:
            # A forked process starts at once, with nothing to overlap with etcd's start: had it to
            # retry its first connection, gRPC's reconnection back-off would cost it a second.
            # (A first job's zygote imports meanwhile.)
            etcd_waits.wait_ready()
            etcd_waits = None
        if not self.join:  # a joining host's agent must not overwrite the job's own record
            for i in range(self.servers):
                self._spawn("litz.ps.server", f"s{i}")
            for i in range(self.workers):
                self._spawn("litz.runtime.worker", f"w{i}")
        if etcd_waits is not None:
            etcd_waits.wait_ready()
        if self._agent is None:
            self._agent = self._connect()
        self._agent.watch_prefix(f"{AGENTS}{self.node}/")
        if self._agent.registered:  # under the lease of the job's name or of this host's place (_hold)
            self._agent.put(proc_key("agent", self.node), self._agent_record(), lease=True)
        else:
            self._agent.register(proc_key("agent", self.node), self._agent_record())

    def _agent_record(self) -> dict[str, Any]:
        """This agent's entry in etcd (``litz status`` lists it with the job's processes)."""
        return {"role": "agent", "id": f"agent-{self.node}", "host": self.node, "pid": os.getpid(),
                "since": self._since, "children": {k: p.pid for k, p in self.children.items()}}

    def _connect(self) -> Membership:
        agent = Membership(self.etcd_url or "", self.job)
        try:
            agent.start()
        except EtcdUnreachable as exc:
            if self._etcd is None:
                raise
            # our own etcd answered /health a moment ago: say what became of it
            raise EtcdUnreachable(f"{exc}\n{self._etcd.diagnosis()}") from exc
        return agent

    def _hold(self, key: str, refusal: Callable[[dict[str, Any], str], str]) -> None:
        """Connect this agent to etcd and register ``key`` (``LAUNCHER_KEY``: the job's name on a
        shared etcd; a joining agent's own key: its host's place in the job) if no one holds it, or
        ConfigError with ``refusal(holder's value, since when)``.

        Two jobs of one name would share their keys: the processes of the second would replace the
        first's, and the first job's processes would take the second's exit for their master's loss.
        Two agents of one host in a job would both start what the master asks of the host. A launcher
        killed with ``kill -9`` holds its key until its lease expires, so a taken key is tried again
        for a lease's time-to-live before it is refused (``--resume`` right after a kill)."""
        self._agent = self._connect()
        me = self._agent_record()
        deadline = time.monotonic() + lease_ttl() + 1.0
        while True:
            try:
                self._agent.register(key, me, exclusive=True)
                return
            except KeyHeld as exc:
                if time.monotonic() >= deadline:
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(exc.holder.get("since", 0)))
                    raise ConfigError(refusal(exc.holder, since)) from None
            time.sleep(0.25)

    def _spawn(self, module: str, ident: str, numba: bool = False) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["LITZ_PARENT_PID"] = str(os.getpid())  # the child dies with us (see node.die_with_parent)
        env.pop("LITZ_SECRET_FILE", None)  # the child uses exactly the secret this cluster was given
        args = ["--id", ident, "--job", self.job, "--etcd", str(self.etcd_url), "--host", self.host,
                "--log-level", self.log_level]
        if self.secret is not None:
            args.append("--secret-stdin")  # see _key_pipe
        # A session of its own: a signal to the launcher's process group (Ctrl-C, `timeout`, a batch
        # scheduler's SIGTERM to the job) reaches only the launcher, which stops the job in order;
        # the child still dies with it (PR_SET_PDEATHSIG, litz.runtime.node).
        with open(self.rundir / f"{ident}.log", "wb") as errlog:
            if self._spawner is not None:
                try:
                    with self._key_pipe() as stdin:
                        self.children[ident] = self._spawner.spawn(module, args, env, None, errlog, numba=numba,
                                                                   stdin=stdin)
                    return
                except spawner.SpawnFailed as exc:  # its children died with it and are recovered as lost
                    log.warning("%s; starting %s and the processes after it as fresh interpreters", exc, ident)
                    self._spawner = None  # a later cluster gets a new zygote (spawner.shared)
            # no preexec_fn: a plain fork while gRPC threads run in this process can crash the child
            with self._key_pipe() as stdin:
                self.children[ident] = subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                                        stdin=subprocess.DEVNULL if stdin is None else stdin,
                                                        stderr=errlog, start_new_session=True)

    @contextlib.contextmanager
    def _key_pipe(self) -> Iterator[int | None]:
        """A child's stdin holding the job's CURVE key (None without a secret), closed here after.

        The key this cluster loaded at its start, through a pipe only the child reads: not the
        secret file's path, whose content may have changed since (a new secret would lock the
        child out). A fresh pipe for each attempt to start a child: a failed one may have read it.
        """
        if self.secret is None:
            yield None
            return
        r, w = os.pipe()
        try:
            try:
                os.write(w, self.secret.secret_key + b"\n")  # 41 bytes: far below a pipe's buffer
            finally:
                os.close(w)
            yield r
        finally:
            os.close(r)

    def prepare(self, numba: bool = False) -> None:
        """Return once this host can start processes at once: its zygote has imported (and initialised
        Numba, if ``numba``). A joining host offers itself only then (see :meth:`Spawner.prepare`)."""
        if self._spawner is None:  # fresh interpreters: nothing to get ready ahead
            return
        try:
            self._spawner.prepare(numba)
        except spawner.SpawnFailed as exc:
            log.warning("%s; this host's processes start as fresh interpreters", exc)
            self._spawner = None

    def stacks(self, idents: list[str], settle: float = 0.5) -> str:
        """Have the running children among ``idents`` print every thread's stack into their logs
        (SIGUSR1; see node.main) and return the logs' ends: why processes that did not answer were stuck."""
        asked = [i for i in idents if i in self.children and self.children[i].poll() is None]
        for ident in asked:
            self.children[ident].send_signal(signal.SIGUSR1)
        if asked:
            time.sleep(settle)  # faulthandler writes from a signal handler: give it a moment
        return "\n".join(f"--- the log of {ident} ends with:\n{self.log_tail(ident, 60)}"
                         for ident in idents if ident in self.children)

    def kill(self, idents: Iterable[str], terminate: bool = False) -> None:
        """SIGKILL (or, ``terminate``, SIGTERM) the children among ``idents`` that still run
        (processes known to be stuck, or never part of the job)."""
        for ident in idents:
            proc = self.children.get(ident)
            if proc is None or proc.poll() is not None:
                continue
            if terminate:
                proc.terminate()
            else:
                proc.kill()

    def log_tail(self, ident: str, lines: int = 15) -> str:
        try:
            text = (self.rundir / f"{ident}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def check(self) -> None:
        """Act on the master's requests to this agent; raise ProcessLost if a child failed.

        Called from the master's loop. A child that exited with code 0 left on request
        (scale-in or the end of the job) and is not a failure.
        """
        if self._stopping:
            return
        self.check_held()
        if self._agent is not None:
            for ev in self._agent.poll_events():
                self.on_request(ev)
        self.check_children()

    def check_held(self) -> None:
        """LitzError if the key this agent holds exclusively (the job's name on a shared etcd, or a
        joined host's place in the job) was taken by another launcher while this one's lease was gone
        (it stalled past its TTL, or lost etcd that long): two jobs of one name, or two agents of one
        host, would share their keys, so this one gives way. Before, it silently took the key back."""
        lost = self._agent.lost_keys if self._agent is not None else {}
        for key, holder in lost.items():
            raise LitzError(f"this launcher's hold on etcd key {key} of job {self.job!r} was taken by another "
                            f"(pid {holder.get('pid')} on {holder.get('host')}) while this one was cut off "
                            "from etcd longer than its lease: it gives way and stops")

    def on_request(self, ev: Event) -> None:
        """A request of the master's to this agent, seen in etcd (``agents/HOST/spawn``: start
        processes; ``agents/HOST/exit``: the host was drained, leave). In a secured job only one
        signed with the job secret (``security.command_refusal``): anyone who can write a shared
        etcd could have written it (before, such a writer made agents start processes)."""
        kind = ev.key.rsplit("/", 1)[-1]
        if ev.kind != "put" or not ev.value or kind not in ("spawn", "exit"):
            return
        why = security.command_refusal(self.secret, ev.key, ev.value, since=self._since)
        if why is not None:
            log.warning("agent of job %s: ignored the %s request at %s: %s", self.job, kind, ev.key, why)
        elif kind == "spawn":
            self.handle_spawn(ev.value)
        else:
            self.exit_requested = True

    def handle_spawn(self, request: Any) -> None:
        """Start the processes the master asked this agent for (each id once). ``numba``: the master's
        application uses Numba, which a joined host's agent, without the application, cannot know:
        the spawner initialises it once for them (litz.runtime.spawner).

        The request comes through etcd, which anyone who can reach a shared etcd may write: only
        ids as the master makes them (``w12``, ``s3``; an id names the process's log file, and
        ``/home/x/app`` or ``../x`` would have truncated files elsewhere) and at most
        ``MAX_SPAWN`` at once are taken, and only while the host runs fewer than ``MAX_SPAWN`` of
        the job's processes in all (requests of fresh ids, each within the cap, forked without end
        before); anything else is refused with a warning."""
        problem = _spawn_problem(request)
        if problem is None:
            new = {i for kind in _SPAWN_IDS for i in request.get(kind, []) if i not in self.children}
            alive = sum(1 for proc in self.children.values() if proc.poll() is None)
            if alive + len(new) > MAX_SPAWN:
                problem = (f"{len(new)} more processes beside the {alive} this host runs for the job "
                           f"(at most {MAX_SPAWN} in all)")
        if problem is not None:
            log.warning("agent of job %s: ignored a spawn request: %s", self.job, problem)
            return
        for kind, module in (("workers", "litz.runtime.worker"), ("servers", "litz.ps.server")):
            for ident in request.get(kind, []):
                if ident not in self.children:
                    self._spawn(module, ident, numba=request.get("numba") is True)

    def check_children(self) -> None:
        """Raise ProcessLost if a child failed (exit code 0 means it left on request)."""
        for ident, proc in self.children.items():
            code = proc.poll()
            if code and ident not in self._reported:
                self._reported.add(ident)  # reported once: the master may recover and go on
                tail = self.log_tail(ident)
                raise ProcessLost(f"process {ident} (pid {proc.pid}) exited with code {code}"
                                  + (f"; its log ends with:\n{tail}" if tail else ""), ident)

    # -- stop ---------------------------------------------------------------------------------
    def stop_unjoined(self, status: dict[str, Any] | None) -> None:
        """Terminate this host's processes that the job's last ``status`` names as never joined:
        the master's goodbye never reaches them, so :meth:`stop` would wait its 5 s for each."""
        self.kill((status or {}).get("unjoined", ()), terminate=True)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every child (they should already be leaving), then the private etcd."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.children.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.children.values():
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._spawner = None  # the zygote stays for this process's next job
        if self._record is not None:
            jobs.forget(self.job, self._record)
            self._record = None
        if self._agent is not None:
            try:
                self._agent.close()
            except Exception:  # etcd may already be gone
                log.debug("agent membership close failed", exc_info=True)
            self._agent = None
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        if os.environ.get("LITZ_KEEP_LOGS"):  # developers: keep the processes' logs
            log.warning("logs of job %s kept in %s", self.job, self.rundir)
        else:
            shutil.rmtree(self.rundir, ignore_errors=True)


def _check_app(app: App) -> None:
    """Refuse, before anything starts, an ``App`` whose classes or executor count are not what a
    job needs (they failed after the processes had started, with an AttributeError or a
    TypeError naming nothing of the app; ``num_executors=0`` silently meant the default)."""
    for what, cls, base in (("driver", app.driver, Driver), ("executor", app.executor, Executor)):
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"App.{what} must be a subclass of litz.{base.__name__}, got {cls!r}")
    n = app.num_executors
    if n is not None and (not is_int(n) or n < 1):
        raise ConfigError(f"App.num_executors must be a positive int (None: 4 per worker), got {n!r}")


def run(app: App, *, workers: int = 2, servers: int = 1, num_executors: int | None = None,
        job: str | None = None, etcd: str | None = None, options: dict[str, Any] | None = None,
        startup_timeout: float = 60.0, secret_file: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1", checkpoint_dir: str | None = None, checkpoint_every: str | None = None,
        resume: str | None = None, recovery: str | None = None, checkpoint_policy: str = "full",
        checkpoint_fraction: float = 1.0, checkpoint_timeout: float = DEFAULT_TIMEOUT,
        checkpoint_keep: int | None = None) -> JobResult:
    """Run a job to completion and return its result.

    With no ``etcd``, an embedded local cluster is started (private etcd on Unix sockets,
    ``servers`` server and ``workers`` worker processes) and stopped at the end.
    ``num_executors`` defaults to the app's, else 4 per worker. ``options`` tunes the runtime
    (``cache``, ``update_log``, ``flush_interval``, ``flush_bytes``, ``frame_bytes``, ``num_shards``).
    ``secret_file`` (default ``$LITZ_SECRET_FILE``) turns on CURVE authentication and
    encryption for every process; ``host``, the address every process binds to, must be
    loopback unless a secret is given (``ConfigError`` otherwise, before anything starts).

    ``checkpoint_dir`` (a path or a pyarrow filesystem URI) enables consistent checkpoints:
    on demand (``litz checkpoint``, ``Driver.checkpoint()``) and every ``checkpoint_every``
    (``"30s"``: seconds; ``"5"``: driver iterations). ``resume`` starts from the newest
    complete checkpoint there (or the one named): tables, executor states and the driver.
    ``checkpoint_policy`` ``priority``, ``round-robin`` or ``random`` (SCAR): after a first full
    checkpoint, save only the fraction ``checkpoint_fraction`` r of the rows, every r·C.
    A round that waits longer than ``checkpoint_timeout`` seconds for one of its steps (a store
    that hangs) fails, and training goes on; a recovery asks a store that fails to answer again
    for as long. ``checkpoint_keep`` N keeps the newest N full
    checkpoints (and the partial ones after the oldest of them) and removes older directories
    after each full checkpoint; None keeps everything.
    ``recovery="partial"`` (SCAR) survives the loss of a worker or server: only what it held is
    restored, from the running checkpoint, onto the survivors; nothing else rolls back.
    ``recovery="full"`` survives it by rolling the whole job back to its last full checkpoint
    (from the beginning if there is none yet). ``resume="auto"`` resumes from the newest
    complete checkpoint in ``checkpoint_dir`` if there is one, else starts afresh: one command
    line for the first start and every restart after ``litz stop`` or SIGTERM.
    """
    job = jobs.check_name(job or new_job_name())
    table_index(app.tables)  # tables declared twice, or not tables at all, are refused before anything starts
    _check_app(app)
    if num_executors is not None and (not is_int(num_executors) or num_executors < 1):  # 0: not the default
        raise ConfigError(f"a job needs at least one executor (--executors), got {num_executors!r}")
    options = dict(options or {})
    num_shards = int(options.pop("num_shards", 64))
    checkpoint_timeout = checked_timeout(checkpoint_timeout)  # (a resume uses it before the policy is made)
    try:  # a bad straggler setting is refused before anything starts
        stragglers.from_options(options)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"straggler relief: {exc}") from None
    if servers > num_shards:  # as ``litz scale`` refuses: a server holds whole shards
        raise ConfigError(f"{servers} servers for {num_shards} shards would leave servers idle (--servers "
                          f"{num_shards} at most)")
    driver = app.driver()
    resumed: Resume | None = None
    if resume == "auto":  # the same command line starts a job and restarts it after a stop
        if not checkpoint_dir:
            raise ConfigError("--resume auto looks for a checkpoint in --checkpoint-dir: give one")
        from litz.ft import storage  # pyarrow: only a job with checkpoints loads it

        resumed = storage.answered_within(
            lambda: Resume.newest_usable(checkpoint_dir, app, num_executors, num_shards, driver), checkpoint_timeout,
            f"looking for the checkpoint to resume from in {storage.redact(checkpoint_dir)}")
        if resumed is None:
            log.warning("no usable complete checkpoint in %s: starting from scratch", storage.redact(checkpoint_dir))
    elif resume:
        from litz.ft import storage

        def found() -> Resume:
            found = Resume.find(resume, app, num_executors, num_shards)
            found.read_driver(driver)  # a damaged driver.pkl is refused before any process starts
            return found

        resumed = storage.answered_within(found, checkpoint_timeout, f"reading the checkpoint {storage.redact(resume)}")
    if resumed is not None:
        num_executors = resumed.manifest["num_executors"]
    n_exec = num_executors or app.num_executors or 4 * workers
    if workers > n_exec:  # allowed (an app of one executor under litz.run's default 2 workers), but said
        log.warning("%d workers for %d executors: %d of them will hold none (--executors sets how many)",
                    workers, n_exec, workers - n_exec)
    if checkpoint_dir:  # a bad policy is refused before anything starts
        policy = CheckpointCoordinator(checkpoint_dir, checkpoint_every, checkpoint_policy, checkpoint_fraction,
                                       checkpoint_timeout, checkpoint_keep)
        try:
            counted = driver.iteration is not None
        except Exception:  # a driver whose count needs its job running: it says so itself
            counted = True
        if policy.every_iterations is not None and not counted:  # it never took one, without a word
            raise ConfigError(f"--checkpoint-every {checkpoint_every} counts the driver's iterations, and "
                              f"{type(driver).__name__} counts none (its iteration is None): give seconds "
                              f"('{checkpoint_every}s') or define the driver's iteration")
        from litz.ft import storage  # pyarrow: only a job with checkpoints loads it

        # an unusable directory is refused now, not at the first checkpoint
        storage.answered_within(lambda: storage.prepare_root(checkpoint_dir), checkpoint_timeout,
                                f"checking the checkpoint directory {storage.redact(checkpoint_dir)}")
        options.update(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                       checkpoint_policy=checkpoint_policy, checkpoint_fraction=checkpoint_fraction,
                       checkpoint_timeout=checkpoint_timeout, checkpoint_keep=checkpoint_keep)
    else:
        for given, what in ((checkpoint_every, "--checkpoint-every"), (checkpoint_policy != "full", "--checkpoint"),
                            (checkpoint_fraction != 1.0, "--checkpoint-fraction"),
                            (checkpoint_timeout != DEFAULT_TIMEOUT, "--checkpoint-timeout"),
                            (checkpoint_keep is not None, "--checkpoint-keep")):
            if given:
                raise ConfigError(f"{what} needs --checkpoint-dir")
    if recovery is not None:
        if recovery not in ("partial", "full"):
            raise ConfigError(f"--recovery takes partial or full, got {recovery!r}")
        if not checkpoint_dir:
            raise ConfigError(f"--recovery {recovery} restores what was lost from checkpoints: "
                              "it needs --checkpoint-dir")
        options["recovery"] = recovery
    if secret_file is None:
        secret_file = os.environ.get("LITZ_SECRET_FILE") or None
    lease_ttl()  # a bad $LITZ_LEASE_TTL is refused before anything starts (every process reads it)
    level = os.environ.get("LITZ_LOG_LEVEL")
    if level and not isinstance(logging.getLevelName(level.upper()), int):  # every process would exit on it
        raise ConfigError(f"$LITZ_LOG_LEVEL: unknown log level {level!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    early: list[int] = []  # SIGTERMs while the job starts: they stop it once its master runs
    with _on_sigterm(lambda: early.append(1)), LocalCluster(job, workers=workers, servers=servers, etcd=etcd,
                                                             host=host, secret_file=secret_file) as cluster:
        assert cluster.etcd_url is not None
        membership = Membership(cluster.etcd_url, job)
        membership.start()
        master: Master | None = None
        try:
            # the master's endpoint is made inside Master: it takes the secret and host from here
            with security.configured(cluster.secret, host=host):
                master = Master(app, job, membership, workers=workers, servers=servers, num_executors=n_exec,
                                options=options, health_check=cluster.check, startup_timeout=startup_timeout,
                                num_shards=num_shards, resume=resumed)
                # SIGTERM (what a cluster scheduler sends before it takes the machines back) stops
                # the job as `litz stop` does: after a checkpoint if it has a checkpoint directory
                with _on_sigterm(master.request_stop):
                    for _ in early:
                        master.request_stop()
                    return master.run(driver)
        except StartupTimeout as exc:  # what were they doing? their stacks, from their logs
            stacks = cluster.stacks(exc.silent)
            cluster.kill(exc.silent)  # stuck: waiting for them to leave would only add seconds
            raise StartupTimeout(f"{exc}\n{stacks}", exc.silent) from None
        finally:
            cluster._stopping = True
            if master is not None:  # in a task the job abandoned: waiting for them to leave would only add seconds
                cluster.kill(master.stuck)
            membership.close()


@contextlib.contextmanager
def _on_sigterm(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` at each SIGTERM while inside; it runs in a signal handler, so it must only
    count or set a flag for a loop to act on. Signal handlers belong to the main thread: from
    another thread (a test running ``litz.run`` in a thread) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: callback())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def join(job: str, etcd: str, *, workers: int = 1, servers: int = 0, host: str = "127.0.0.1",
         secret_file: str | os.PathLike[str] | None = None, timeout: float = 60.0) -> int:
    """Add this host's processes to a running job (``litz launch --join``); returns an exit code.

    Starts this host's node agent, offers the master ``workers`` and ``servers`` processes
    (key ``commands/join/<host>``), starts them when the master asks, and stays until the job
    ends or the master drains this host. Their executors and shards arrive by migration.

    SIGTERM (a scheduler taking the machine back) asks the master to drain this host, as
    ``litz scale --drain-host`` does: its executors and shards move to the other hosts, its
    processes exit, and so does this agent (exit code 0); the job trains on. While the master
    refuses (another scale under way, or this host holds the last server), the request is
    made again every 2 s. A second SIGTERM stops this host's processes at once (exit code 1).
    """
    if secret_file is None:
        secret_file = os.environ.get("LITZ_SECRET_FILE") or None
    lease_ttl()
    with LocalCluster(job, workers=workers, servers=servers, etcd=etcd, host=host, secret_file=secret_file,
                      join=True) as cluster:
        agent = cluster._agent
        assert agent is not None
        master = agent.get(MASTER_KEY)
        if not master:
            raise ConfigError(f"no running job {job!r} on etcd {etcd} (no master registered)")
        secured = master.get("secured")
        if secured is not None and bool(secured) != (cluster.secret is not None):
            raise ConfigError(f"job {job!r} authenticates every process with its job secret: join with "
                              "--secret-file PATH (a copy of the job's secret file)" if secured else
                              f"job {job!r} has no job secret: join without --secret-file")
        # The master gives the processes it asks for join_timeout to be ready: offer them only once
        # they can start at once, not while the zygote still imports on a host that may be busy.
        cluster.prepare(numba=master.get("numba") is True)
        cid = f"join-{cluster.node}-{secrets.token_hex(3)}"
        agent.watch_prefix(f"commands/result/{cid}")
        agent.watch_prefix(MASTER_KEY)
        offer = f"{JOINS}{cluster.node}"
        agent.put(offer, security.sign_command(cluster.secret, offer, {"id": cid, "agent": cluster.node,
                                                                       "workers": workers, "servers": servers}))
        deadline = time.monotonic() + timeout
        accepted = False
        drain = _HostDrain(agent, cluster.node, cluster.secret)
        presence = MasterPresence(master)
        sigterms: list[int] = []
        with _on_sigterm(lambda: sigterms.append(1)):
            while True:
                if len(sigterms) >= 2:
                    log.error("SIGTERM again: stopping this host's processes without waiting for the drain")
                    return 1
                if sigterms and accepted:
                    drain.ask()
                if _join_step(cluster, agent, cid, job, drain, presence):
                    accepted = True
                if cluster.exit_requested and all(p.poll() is not None for p in cluster.children.values()):
                    return 0
                if drain.holds_nothing:
                    # none of them is in the job, so the master will never tell them to leave:
                    # waiting for them would only cost the stop's 5 s
                    cluster.stop(timeout=0.0)
                    return 0
                if cluster.job_ended:
                    with contextlib.suppress(LitzError):  # etcd gone too: stop() waits for them as before
                        cluster.stop_unjoined(agent.get(STATUS_KEY))
                    return 0
                if not accepted and time.monotonic() > deadline:
                    raise ConfigError(f"the job's master did not answer this host's offer within {timeout:.0f} s")
                try:
                    cluster.check_held()
                except LitzError as exc:
                    log.error("%s", exc)
                    return 1
                try:
                    cluster.check_children()
                except ProcessLost as exc:  # the master recovers it (or ends the job); the others stay
                    log.error("%s", exc)  # (before, the agent left, and took this host's healthy ones along)
                time.sleep(0.1)


#: the job's last status says it ended (``Master.publish_status(final=True)``, written before it deregisters)
_ENDED_PHASES = ("finished", "stopped", "failed")


def _job_over(agent: Membership) -> bool:
    """Whether the job's last status says it ended: its master's registration then went for good, and
    no grace period is waited out (``MasterPresence``). False when etcd cannot tell."""
    try:
        status = agent.get(STATUS_KEY) or {}
    except LitzError:
        return False
    return status.get("phase") in _ENDED_PHASES


def _join_step(cluster: LocalCluster, agent: Membership, cid: str, job: str, drain: _HostDrain,
               presence: MasterPresence) -> bool:
    """Handle the agent's etcd events once; True when the master accepted this host's offer.

    The master's registration deleted ends the job for this host at once only if the job's status
    says it ended; otherwise its lease may only have lapsed (``MasterPresence``), and ``join``
    waits for it to come back until the grace period is over. Before, a joined host left a job
    whose master had only stalled past its lease."""
    accepted = False
    for ev in agent.poll_events():
        if drain.answered(ev):
            continue
        if ev.key == f"commands/result/{cid}" and ev.kind == "put" and ev.value:
            if not ev.value.get("ok"):
                raise ConfigError(f"the job refused this host: {ev.value.get('reason')}")
            accepted = True
            log.warning("joined job %s: %s", job, ev.value.get("reason"))
        elif ev.key == MASTER_KEY and ev.kind == "delete":
            if _job_over(agent):
                cluster.job_ended = True  # our processes leave on their own
            else:
                log.warning("the job's master registration is gone; waiting %.0f s for it to come back "
                            "(a master that stalled past its lease registers again)",
                            presence.delete(time.monotonic()))
        elif ev.key == MASTER_KEY and ev.kind == "put" and ev.value:
            if presence.put(ev.value):
                log.warning("the job's master registered again; this host stays in the job")
        elif ev.key.startswith(AGENTS):
            cluster.on_request(ev)
    if presence.gone(time.monotonic()) and not cluster.job_ended:
        log.error("the job's master is gone (%s)", presence.why_gone())
        cluster.job_ended = True  # our processes leave on their own
    return accepted


class _HostDrain:
    """A node agent's request that the master drain its host (what SIGTERM asks), made again
    every ``retry`` seconds while the master refuses it."""

    def __init__(self, agent: Membership, host: str, secret: security.JobSecret | None = None, retry: float = 2.0,
                 patience: float = 30.0) -> None:
        self.agent, self.host, self.secret, self.retry, self.patience = agent, host, secret, retry, patience
        self.cid: str | None = None
        self.accepted = False
        self.waiting = False  # asked, no answer yet (a request is answered within ``patience``)
        self.holds_nothing = False  # the master says none of this host's processes is in the job
        self._asked_at = -float("inf")
        self._refusal: str | None = None
        self._watched = False  # the answer to ``cid`` is watched
        self._unsent = False  # the request ``cid`` could not be written (etcd unreachable)

    def ask(self) -> None:
        """Ask (again): not while a request waits for its answer, and ``retry`` s after a refusal,
        or after a try that etcd did not answer (the same request then goes out again: an etcd blip
        as the host is told to leave must not end it, since ``join`` would stop its processes
        instead of draining them)."""
        since = time.monotonic() - self._asked_at
        if self.accepted or since < self.retry or (self.waiting and since < self.patience):
            return
        if self.cid is None:
            log.warning("SIGTERM: asking the master to drain this host (%s)", self.host)
        if self.cid is None or not self._unsent:
            self.cid = f"drain-{self.host}-{secrets.token_hex(3)}"
            self._watched = False
        self._asked_at = time.monotonic()
        try:
            if not self._watched:
                self.agent.watch_prefix(f"{RESULTS}{self.cid}")
                self._watched = True
            self.agent.put(SCALE_KEY, security.sign_command(self.secret, SCALE_KEY,
                                                            {"id": self.cid, "drain_host": self.host}))
        except EtcdUnreachable as exc:
            self._unsent = True
            log.warning("cannot ask the master to drain this host yet (%s); trying again in %.0f s", exc,
                        self.retry)
            return
        self._unsent = False
        self.waiting = True

    def answered(self, ev: Any) -> bool:
        """Take the master's answer to the latest request; True if ``ev`` was it."""
        if self.cid is None or ev.key != f"{RESULTS}{self.cid}" or ev.kind != "put" or not ev.value:
            return False
        self.waiting = False
        if ev.value.get("ok"):
            self.accepted = True
            log.warning("the master drains this host: %s", ev.value.get("reason"))
        elif ev.value.get("host_holds_nothing"):  # (its processes never joined): nothing to move, leave now
            self.holds_nothing = True
            log.warning("no process of this host is part of the job (%s): leaving", ev.value.get("reason"))
        elif ev.value.get("reason") != self._refusal:
            self._refusal = ev.value.get("reason")
            log.error("the master refused to drain this host (asking again every %.0f s; a second SIGTERM "
                      "stops its processes now): %s", self.retry, self._refusal)
        return True


