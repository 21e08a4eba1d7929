"""Shared fixtures: a private etcd per module and a check that jobs leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from litz.runtime.etcd_server import LocalEtcd
from tests import s3_server


def _cmdline(pid: int | str) -> str | None:
    """The command line of process ``pid`` as one string, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (to find leftovers of a job)."""
    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and int(pid) != os.getpid() and text in (_cmdline(pid) or "")]


def descendants(root: int | None = None) -> dict[int, str]:
    """Live (not zombie) descendants of ``root`` (this process by default): pid -> command line."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        cmd = _cmdline(pid)
        if cmd is None:
            continue
        found[pid] = cmd
        todo.extend(children.get(pid, []))
    return found


#: this process's zygote (litz/runtime/spawner.py) stays for the next test's jobs, by design
SPAWNER = "-m litz.runtime.spawner"
#: and the S3 server of a module's tests (s3_bucket) stays for the module's other tests
S3_SERVER = s3_server.MARK


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Kill (by PID) whatever a test started and left running, so one failed test's job cannot
    load the machine or hold ports for the tests after it; warn, naming the processes.

    A test whose job stalls leaves the job's thread and processes behind (its assertion fails
    first); without this they would run on beside every later test. Module-scoped fixtures (the
    shared etcd) are set up before this fixture and are not touched, nor is this process's
    zygote, which the launcher keeps for its later jobs, nor a module's S3 server."""
    before = set(descendants())
    yield
    deadline = time.monotonic() + 10.0  # a job that just ended may still be stopping its children
    while (left := {p: c for p, c in descendants().items()
                    if p not in before and SPAWNER not in c and S3_SERVER not in c}) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    listing = "; ".join(f"{pid}: {cmd[:160]}" for pid, cmd in sorted(left.items()))
    warnings.warn(f"{request.node.nodeid} left {len(left)} process(es) running, killed: {listing}", stacklevel=1)


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    server = LocalEtcd()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """``s3://BUCKET?endpoint_override=...``: a bucket on a real S3 server of this module's own
    (tests/s3_server.py), with the AWS credentials the job's processes read from the environment
    set for the module."""
    why = s3_server.unusable()
    if why:
        pytest.skip(why)
    with s3_server.s3_bucket() as uri:
        yield uri



class JobOutcome(dict):
    """What :func:`run_in_thread` fills in: ``res`` (the JobResult) or ``error`` and ``traceback``.

    Reading ``res`` before it exists says why instead of a bare KeyError: the job failed (with
    its traceback), or it is still running after the test stopped waiting (with its last status),
    which is what a stalled recovery looks like on a slow machine."""

    def __init__(self, job: object) -> None:
        super().__init__()
        self.job = job
        self.thread: threading.Thread | None = None

    def __missing__(self, key: str) -> object:
        if key != "res":
            raise KeyError(key)
        if "error" in self:
            raise AssertionError(f"job {self.job} failed: {self['error']!r}\n{self.get('traceback', '')}")
        if self.thread is not None and self.thread.is_alive():
            from litz.cli import job_status

            try:
                seen: object = job_status(str(self.job))["master"] if self.job else "no job name"
            except Exception as exc:  # the status itself may be what is broken
                seen = exc
            raise AssertionError(f"job {self.job} is still running; its master reports {seen!r}")
        raise AssertionError(f"job {self.job} ended without a result or an error")


_OUTCOMES: dict[str, JobOutcome] = {}  # job name -> its run_in_thread outcome, for status_when


def run_in_thread(app: object, **kw: object) -> tuple[threading.Thread, JobOutcome]:
    """Run ``litz.run(app, **kw)`` on a thread (while the test scales, kills, ...); the
    :class:`JobOutcome` gets ``res`` (the JobResult) or ``error`` (the exception)."""
    import litz

    out = JobOutcome(kw.get("job"))
    if isinstance(kw.get("job"), str):
        _OUTCOMES[str(kw["job"])] = out

    def body() -> None:
        try:
            out["res"] = litz.run(app, **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # reported by the test
            out["error"] = exc
            out["traceback"] = traceback.format_exc()

    out.thread = threading.Thread(target=body, daemon=True)  # a stalled job must not hold the interpreter at exit
    out.thread.start()
    return out.thread, out


def ended_exact(t: threading.Thread, out: JobOutcome) -> Any:
    """The result of an open-ended job of :func:`run_in_thread`, once told to stop and joined: it
    ended without an error, and the driver's truth equals the final table (every update once)."""
    import numpy as np

    assert not t.is_alive() and "error" not in out, out.get("traceback")
    res = out["res"]
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    return res


def status_when(job: str, cond: Callable[[dict], Any], timeout: float = 120.0, out: dict | None = None) -> dict:
    """Poll ``litz status`` of ``job`` until ``cond(status)`` holds; the status then.

    ``out`` is the dict of :func:`run_in_thread` (found by the job's name when not given): a job
    that already failed is reported at once with its traceback, and one that ended without
    meeting the condition at once too. A time-out says what was last seen (the phase, or the
    error of the last status read), so a job that never started is told from one that stalled."""
    from litz.cli import job_status
    from litz.errors import LitzError

    out = out if out is not None else _OUTCOMES.get(job)
    deadline = time.monotonic() + timeout
    last: object = "no status read yet"
    while time.monotonic() < deadline:
        if out is not None and "error" in out:
            raise AssertionError(f"job {job} failed: {out['error']!r}\n{out.get('traceback', '')}")
        if out is not None and "res" in out:
            raise AssertionError(f"job {job} ended (with a result) before the condition was met; "
                                 f"last seen: {last!r}")
        try:
            st = job_status(job)
            last = st["master"]
            if cond(st):
                return st
        except LitzError as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"job {job}: condition not met in {timeout} s; last seen: {last!r}")


def wait_running(job: str, out: dict | None = None, timeout: float = 60.0) -> dict:
    """Wait until the master of ``job`` reports the running phase; its status then."""
    return status_when(job, lambda s: s["master"].get("phase") == "running", timeout, out)


def wire_without_sockets(nodes: Any, peers: tuple[str, ...] = ()) -> list[tuple[str, str, str, list]]:
    """Record what ``nodes`` (workers and servers built but never started) send, encoded as on the
    wire, as ``(from, to, kind, frames)``; each knows the others and ``master`` (no etcd lookup; the
    commands that route to them take them as reachable) and has ``master`` as its master. A test
    delivers what it chooses, in the order it chooses. ``peers``: other processes they know (as a
    worker knows the servers its init named)."""
    from litz.runtime.protocol import encode

    sent: list[tuple[str, str, str, list]] = []
    idents = {node.ident for node in nodes} | {"master", *peers}
    for node in nodes:
        node.endpoint.send = (lambda peer, kind, who=node.ident, **fields:
                              sent.append((who, peer, kind, encode(kind, **fields))))
        node._looked_up.update(idents)
        node.endpoint.knows = idents.__contains__
        node.master = "master"
    return sent


def run_in_cuda_simulator(script: str, done: str, timeout: float = 300) -> str:
    """Run ``script`` in a Python process of its own under Numba's CUDA simulator and require that it
    prints ``done``; returns its output. A process of its own because ``NUMBA_ENABLE_CUDASIM`` must be
    set before ``numba.cuda`` is imported, and then replaces it for the whole process."""
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])  # keep where deps may be
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


def machine_code(dispatcher: Any) -> str:
    """The assembly of a Numba kernel's first compiled signature, from a fresh uncached copy (Numba
    does not show the code of cached kernels). Tests read it for what costs the hot loops most and
    what no compiler option shows: calls left out of line (every array passes as 7 fields, and the
    registers spill around them) and Numba's reference counting (``NRT_incref``/``NRT_decref``,
    atomic operations)."""
    import numba

    assert dispatcher.signatures, f"{dispatcher.__name__} has not been compiled yet"
    options = {k: v for k, v in dispatcher.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options)(dispatcher.py_func)
    sig = dispatcher.signatures[0]
    fresh.compile(sig)
    return fresh.inspect_asm(sig)


def calls_function(asm: str, name: str) -> bool:
    """Whether ``asm`` (see :func:`machine_code`) calls or takes the address of the Numba function
    ``name``, by its mangled name (``<length><name>B<version>...``)."""
    mangled = f"{len(name)}{name}B"
    return any(mangled in line for line in asm.splitlines() if "call" in line or "movabs" in line)


def counts_references(asm: str) -> bool:
    """Whether ``asm`` (see :func:`machine_code`) increments or decrements a reference count."""
    return "NRT_incref" in asm or "NRT_decref" in asm
