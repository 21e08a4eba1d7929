"""Start worker and server processes by forking a process that has already imported them.

Why: a fresh interpreter that imports a worker or a server (NumPy, ZeroMQ, gRPC and etcd, Numba,
Litz) spends 0.6-1.1 s of CPU before it does anything, and a job starts several of them at once:
on a small machine that was most of a short job's start, and a new worker of a scale-out took that
CPU from the running training. Each launcher process keeps one *zygote* (per import environment,
below), which imports all of it once and then forks each process asked for, as
``multiprocessing``'s forkserver does. A forked worker is running within milliseconds, and the
jobs a process runs one after another (a notebook, a test suite, ``litz.run`` in a loop) pay for
the imports once.

What a forked process gets is what ``python -m litz.runtime.worker ARGS`` would have: the
launcher's environment and working directory at the time of the request, its own session, its
standard streams (passed over the socket), that command line (written over the zygote's, which
leaves room for it), the name ``litz-<id>``, and ``die_with_parent``: the zygote dies with the
launcher process, a child with the zygote.

What is read at import time (``NUMBA_*`` settings, ``sys.path``, the interpreter) is frozen in a
zygote, so a launcher whose import environment changed gets a new one (``shared``).

When the launcher has Numba loaded (its application has kernels), or the master's spawn request
says its application has (a joined host's agent never loads the application), the zygote also
initialises Numba's compiler once (``_warm_numba``): a process's first compilation or cache load
costs 0.6 s of CPU whatever the kernels, and a forked worker inherits it, so it loads its kernels
in milliseconds.

The zygote is fork-safe because it does nothing but import (and compile one trivial function): no
ZeroMQ context, no gRPC channel, no logging handler, no thread of its own (NumPy's and SciPy's BLAS
may have started one each; they handle forks).
It talks to the launcher over a private socket pair: JSON requests with three file descriptors
(or none: ``prepare``, answered once the imports are done), JSON answers (``started``, and
``exited`` with the exit code when it reaps a child). It leaves once
the launcher closed its end and its last child exited, or when the launcher process dies: it is
started from a thread that lives as long as it does, since Linux's parent-death signal follows the
thread that forked, and the launcher's own threads come and go with its jobs.

``LITZ_SPAWN=exec`` turns it off: every process is then a fresh interpreter, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Any

SPAWN_ENV = "LITZ_SPAWN"
#: environment variables read at import time: a zygote imported with other values cannot serve
_IMPORT_ENV = ("NUMBA_", "PYTHON", "OPENBLAS_", "OMP_", "MKL_", "CUDA_", "NUMPY_", "LD_", "LITZ_CUPY_")
#: bytes of the zygote's command line left for each child's own (``_set_command_line``)
_ROOM = 4096
#: what a forked child runs: the entry point of ``python -m MODULE``
ENTRY_POINTS = {"litz.runtime.worker": ("litz.runtime.worker", "Worker"),
                "litz.ps.server": ("litz.ps.server", "ServerNode")}
_MAX_MESSAGE = 1 << 20


def enabled() -> bool:
    """Whether processes are forked from a zygote (the default) rather than started afresh."""
    mode = os.environ.get(SPAWN_ENV, "fork").strip().lower()
    if mode not in ("fork", "exec"):
        from litz.errors import ConfigError

        raise ConfigError(f"{SPAWN_ENV} must be 'fork' or 'exec', not {mode!r}")
    return mode == "fork" and sys.platform.startswith("linux")


class SpawnFailed(RuntimeError):
    """The zygote could not start a process (or is gone)."""


class ForkedProcess:
    """A child of the zygote, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, spawner: Spawner, pid: int, args: list[str], numba_ready: bool = False) -> None:
        self.spawner = spawner
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.numba_ready = numba_ready  # forked with Numba initialised (the zygote's answer)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.spawner.receive(0.0)
            self.returncode = self.spawner.exit_codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.spawner.receive(0.2 if left is None else min(left, 0.2))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may belong to someone else by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SHARED: dict[tuple[str, ...], Spawner] = {}
_SHARED_LOCK = threading.Lock()


def _import_environment() -> tuple[str, ...]:
    """What a zygote's imports depended on: the interpreter, ``sys.path`` and ``_IMPORT_ENV``."""
    path = os.pathsep.join(p for p in sys.path if p)
    return (sys.executable, path, *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(_IMPORT_ENV)))


def numba_loaded() -> bool:
    """Whether this process has Numba loaded: its application imported kernels, so the workers it
    starts, or asks a node agent for (``litz.runtime.elastic``), will use Numba too."""
    return "numba" in sys.modules


def cpu_seconds() -> float:
    """CPU seconds spent so far by this process's running zygotes and by the processes they forked
    that exited: the launcher's ``RUSAGE_CHILDREN`` counts neither (a zygote until it is reaped, its
    children never, being the launcher's grandchildren)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    with _SHARED_LOCK:
        for spawner in _SHARED.values():
            total += spawner.children_cpu
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{spawner.process.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if spawner.process.returncode is None:
                    total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
    return total


def shared() -> Spawner:
    """This process's zygote for its current import environment, started on first use (and again
    if it died)."""
    key = _import_environment()
    with _SHARED_LOCK:
        spawner = _SHARED.get(key)
        if spawner is None or not spawner.alive():
            spawner = _SHARED[key] = Spawner()
        return spawner


class Spawner:
    """The launcher's end: starts the zygote, asks it for processes, learns their exit codes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the socket and what was read from it
        self._one_at_a_time = threading.Lock()  # a request and its answer (answers come in order)
        self.exit_codes: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._seq = 0  # numbers the requests: a late answer to one that timed out is told from the next's
        self._pids: set[int] = set()  # every child it started
        self.children_cpu = 0.0  # CPU seconds of its children that exited (they are not the launcher's)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd, name = tempfile.mkstemp(prefix="litz-spawner-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        atexit.register(self.log_path.unlink, missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["LITZ_PARENT_PID"] = str(os.getpid())  # the zygote dies with the launcher
        cmd = [sys.executable, "-m", "litz.runtime.spawner", "--fd", str(theirs.fileno()), "--room", " " * _ROOM]
        if numba_loaded():
            cmd.append("--numba")
        started: list[subprocess.Popen[bytes] | BaseException] = []
        ready = threading.Event()

        def keeper() -> None:
            """Start the zygote, then outlive it: its parent-death signal follows this thread."""
            try:
                with open(self.log_path, "wb") as errlog:
                    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=errlog,
                                            pass_fds=(theirs.fileno(),), start_new_session=True)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                started.append(exc)
                ready.set()
                return
            started.append(proc)
            ready.set()
            proc.wait()

        threading.Thread(target=keeper, name="litz-spawner", daemon=True).start()
        ready.wait()
        theirs.close()
        if isinstance(started[0], BaseException):
            raise started[0]
        self.process: subprocess.Popen[bytes] = started[0]

    def alive(self) -> bool:
        """Whether it can still fork (the zygote runs and its socket is open)."""
        return self.process.returncode is None and self._sock.fileno() >= 0

    def spawn(self, module: str, args: list[str], env: dict[str, str], stdout: int | None,
              stderr: IO[bytes], numba: bool = False, timeout: float = 60.0, stdin: int | None = None
              ) -> ForkedProcess:
        """Fork ``python -m module args`` with this environment and these streams (stdin: /dev/null
        unless given); the child's pid once it exists (the first request waits for the zygote's
        imports). Numba is initialised in the zygote first (once) if ``numba`` or if this process
        has it loaded (:func:`numba_loaded`)."""
        if module not in ENTRY_POINTS:
            raise ValueError(f"the zygote starts {sorted(ENTRY_POINTS)}, not {module!r}")
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd(), "numba": numba or numba_loaded()}
        with open(os.devnull, "rb") as devnull:
            fds = [devnull.fileno() if stdin is None else stdin, 1 if stdout is None else stdout,
                   stderr.fileno()]  # stdout None: the launcher's
            reply = self._ask(request, fds, f"start {module}", timeout)
        if "pid" not in reply:
            raise SpawnFailed(f"the process spawner could not start {module}: {reply.get('error')}")
        return ForkedProcess(self, reply["pid"], [module, *args], numba_ready=bool(reply.get("numba")))

    def prepare(self, numba: bool = False, timeout: float = 60.0) -> bool:
        """Wait until the zygote has done its imports (and initialised Numba, if ``numba``), so that
        the next :meth:`spawn` forks at once; whether Numba is initialised.

        Why: a joining host's agent offers its processes to a running job, whose master gives them
        ``join_timeout`` from its request to be ready. A zygote still importing spends seconds of that
        on a busy host (a CI run lost a join to it), so the agent offers only once this returns."""
        reply = self._ask({"prepare": True, "numba": numba}, [], "get ready", timeout)
        if not reply.get("prepared"):
            raise SpawnFailed(f"the process spawner could not get ready: {reply.get('error')}")
        return bool(reply.get("numba"))

    def _ask(self, request: dict[str, Any], fds: list[int], what: str, timeout: float = 60.0) -> dict[str, Any]:
        """Send one request with these descriptors and wait for its answer.

        Answers come in order, but a request that timed out is still answered later. Each request
        carries a number the zygote sends back, so such a late answer is never taken for the next
        request's (a shared zygote serves later jobs too); a process it reports was started for no
        one, and is killed."""
        with self._one_at_a_time:
            self._seq += 1
            seq = self._seq
            with self._lock:
                try:
                    socket.send_fds(self._sock, [json.dumps({**request, "seq": seq}).encode()], fds)
                except OSError as exc:
                    raise SpawnFailed(f"the process spawner is gone ({exc}); {self._log_tail()}") from exc
            deadline = time.monotonic() + timeout
            while True:  # the zygote answers every request, or its end of the socket closes
                while self._replies:
                    reply = self._replies.pop(0)
                    if reply.get("seq") == seq:
                        return reply
                    if "pid" in reply and reply["pid"] not in self.exit_codes:  # started for a request that gave up
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(reply["pid"], signal.SIGKILL)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SpawnFailed(f"the process spawner did not {what} within {timeout:.0f} s; {self._log_tail()}")
                self.receive(min(1.0, left))

    def receive(self, timeout: float) -> None:
        """Read what the zygote said (waiting up to ``timeout`` for a first message). End of file (the
        zygote died): its children died with it (SIGKILL)."""
        try:  # waits without the lock: another thread may poll meanwhile
            ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):  # closed (the zygote is gone, or close() ran)
            return
        with self._lock:
            while ready and self._sock.fileno() >= 0:
                try:
                    data = self._sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    self._sock.close()
                    self._zygote_gone()
                    return
                msg = json.loads(data)
                if msg["kind"] == "exited":
                    self.exit_codes[msg["pid"]] = msg["code"]
                    self.children_cpu += msg.get("cpu", 0.0)
                else:
                    if "pid" in msg:  # known before anything else is read: the zygote may die right after
                        self._pids.add(msg["pid"])
                    self._replies.append(msg)

    def _zygote_gone(self) -> None:
        """Its children got their parent-death signal (SIGKILL) with it: they count as killed, so the
        launcher sees them lost at once; a pending request fails."""
        code = self.process.poll()
        self._replies.append({"error": f"the spawner exited (code {code}); {self._log_tail()}"})
        for pid in self._pids - self.exit_codes.keys():
            self.exit_codes[pid] = -signal.SIGKILL

    def close(self, timeout: float = 5.0) -> None:
        """No more requests: the zygote leaves once its children have (call after they exited)."""
        with self._lock:
            if self._sock.fileno() >= 0:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with self._lock:
            self._sock.close()

    def _log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            text = []
        return "its log ends with:\n" + "\n".join(text[-15:]) if text else "its log is empty"


# ----------------------------------------------------------------------------------------------------
# the zygote
# ----------------------------------------------------------------------------------------------------


def _preload() -> None:
    """Import what workers and servers import, once, before any fork."""
    import litz.ps.server  # noqa: F401
    import litz.runtime.worker  # noqa: F401

    with contextlib.suppress(ImportError):
        import numba  # noqa: F401 - the apps' kernels; 0.3 s of every worker's start otherwise


#: ``[True]`` once Numba is initialised here, ``[False]`` if that failed, empty before it was tried
_NUMBA_WARM: list[bool] = []


def _warm_numba() -> None:
    """Initialise Numba's CPU target in the zygote, once, by compiling a trivial function.

    Why: a process's first compilation *or cache load* builds Numba's typing and target contexts
    (its registries, LLVM, SciPy's BLAS bindings): 0.6-0.7 s of CPU here, against 25 ms for MLR's
    whole set of cached kernels after it. Every worker of an application with Numba kernels paid
    it, at the job's start and, in a scale-out, while the job trained on the same cores. Forked
    from a zygote that did it, they inherit it. It starts no thread of its own: the one new thread,
    SciPy's OpenBLAS server, handles forks as NumPy's does. Done only when the launcher has Numba
    loaded (``numba`` in its ``sys.modules``: its application imports kernels) or a request says the
    master's has, since a job without Numba would pay it for nothing. Tried once; a failure (in the
    zygote's log) leaves the children to do it themselves, as before.
    """
    if _NUMBA_WARM:
        return
    try:
        import numba

        @numba.njit(nogil=True)
        def one(x: int) -> int:
            return x + 1

        _NUMBA_WARM.append(one(1) == 2)
    except Exception:  # noqa: BLE001 - only an optimisation: the children compile as they would have
        traceback.print_exc()
        _NUMBA_WARM.append(False)
    gc.collect()
    gc.freeze()  # what it built stays shared with the children


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: nothing to tell
        sock.send(json.dumps(msg).encode())


def _set_command_line(argv: list[str]) -> None:
    """Write ``argv`` over this process's command line (``/proc/self/cmdline``, what ``ps`` shows and
    what the master's fencing checks, ``node.kill_job_process``), within the room the zygote's own
    left (``--room``): it lies between ``arg_start`` and ``arg_end`` of ``/proc/self/stat``, in this
    process's own memory. Longer than the room, it is cut."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49; the list starts at field 3
    except (OSError, IndexError, ValueError):
        return
    data = b"\0".join(a.encode() for a in argv)[: end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _child(request: dict[str, Any], fds: list[int], closing: list[int], zygote: int) -> None:
    """In the forked child: become ``python -m module args``. Never returns. ``zygote``: its pid,
    read before the fork (``os.getppid()`` here would be init's, 1, if the zygote had died since,
    and the child then took init for the parent it must die with: a ``kill -9`` of the zygote
    right after a fork left a worker running without a job)."""
    code = 70
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = dict(request["env"])
        env["LITZ_PARENT_PID"] = str(zygote)  # die_with_parent: with the zygote, which dies with the launcher
        os.environ.clear()
        os.environ.update(env)
        with contextlib.suppress(OSError):
            os.chdir(request["cwd"])
        module, cls = ENTRY_POINTS[request["module"]]
        sys.argv = [module, *request["args"]]
        _set_command_line([sys.executable, "-m", module, *request["args"]])
        from litz.runtime.node import exit_process, main

        node_cls = getattr(sys.modules[module], cls)
        exit_process(main(node_cls, list(request["args"])))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the child's log, never back into the zygote's loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def serve(fd: int, numba: bool = False) -> int:
    """The zygote's loop: fork on request, report exits, leave when asked and childless. ``numba``:
    warm Numba up at once (:func:`_warm_numba`; a request can also ask for it)."""
    from litz.runtime.node import die_with_parent

    die_with_parent()
    _preload()
    gc.collect()
    gc.freeze()  # the imported objects stay shared with the children instead of being copied on write
    if numba:  # while the launcher waits for etcd: its first job needs it
        _warm_numba()
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks", category=DeprecationWarning)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through the pipe
    children: set[int] = set()
    accepting = True
    while accepting or children:
        ready, _, _ = select.select([sock, wake_r] if accepting else [wake_r], [], [], 1.0)
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 512)
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"kind": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status),
                         "cpu": usage.ru_utime + usage.ru_stime})
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            data, fds = b"", []
        if not data:  # the launcher closed its end: no more requests
            accepting = False
            continue
        request: Any = None
        try:
            request = json.loads(data)
            if isinstance(request, dict) and request.get("prepare") is True and not fds:
                # answered once the imports above are done (and Numba, if asked): the launcher is ready
                if request.get("numba") is True:
                    _warm_numba()
                _send(sock, {"kind": "reply", "seq": request.get("seq"), "prepared": True,
                             "numba": _NUMBA_WARM == [True]})
                continue
            if not isinstance(request, dict) or request.get("module") not in ENTRY_POINTS or len(fds) != 3:
                what = request.get("module") if isinstance(request, dict) else type(request).__name__
                raise ValueError(f"a malformed request: {what!r} with {len(fds)} descriptors")
            if request.get("numba") is True:
                _warm_numba()
            zygote = os.getpid()
            pid = os.fork()
        except (ValueError, OSError) as exc:
            for f in fds:
                os.close(f)
            seq = request.get("seq") if isinstance(request, dict) else None
            _send(sock, {"kind": "reply", "seq": seq, "error": f"{type(exc).__name__}: {exc}"})
            continue
        if pid == 0:
            _child(request, fds, [sock.fileno(), wake_r, wake_w], zygote)
        for f in fds:
            os.close(f)
        children.add(pid)
        _send(sock, {"kind": "reply", "seq": request.get("seq"), "pid": pid, "numba": _NUMBA_WARM == [True]})
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="litz-spawner")
    parser.add_argument("--fd", type=int, required=True, help="its end of the launcher's socket pair")
    parser.add_argument("--room", default="", help="blanks: room for its children's command lines")
    parser.add_argument("--numba", action="store_true", help="initialise Numba before the first fork")
    args = parser.parse_args(argv)
    return serve(args.fd, args.numba)


if __name__ == "__main__":
    sys.exit(main())
