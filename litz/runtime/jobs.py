"""Where a local job's etcd can be found from its name, so ``litz status --job NAME`` needs no URL.

``litz status`` without ``--job`` lists these records (:func:`local_jobs`).

The launcher writes ``<jobs dir>/<job>.json`` (etcd URL, launcher pid) when a job starts and
removes it when the job ends. The folder is ``$LITZ_JOBS_DIR`` or ``~/.cache/litz/jobs``.

A name is one job's at a time on a host: :func:`claim` refuses a name whose record belongs to a
launcher that still runs. Two jobs of one name would share the record, and the first to end would
take it away from the other (``litz status``, ``scale`` and ``stop`` could no longer find it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from litz.errors import ConfigError


def jobs_dir() -> Path:
    return Path(os.environ.get("LITZ_JOBS_DIR") or Path.home() / ".cache" / "litz" / "jobs")


#: The longest job name: it names files (its record, its processes' directory, with a suffix),
#: whose names may be 255 bytes (one of 260 failed the launch with "File name too long").
MAX_NAME = 200


def check_name(job: str) -> str:
    """``job``, if it can name a job: a file name of its own, a prefix in etcd, an argument of its
    processes' command lines (ConfigError if not: a name starting with '-' was taken for an option
    by every process, and the job failed after it started)."""
    if not job or "/" in job or "\0" in job or job.startswith((".", "-")):
        raise ConfigError(f"bad job name {job!r}: it must not be empty, start with '.' or '-', or hold '/'")
    if len(os.fsencode(job)) > MAX_NAME:
        raise ConfigError(f"bad job name {job[:40]!r}...: longer than {MAX_NAME} bytes")
    return job


def _path(job: str) -> Path:
    return jobs_dir() / f"{check_name(job)}.json"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The jobs folder to this process alone (an advisory lock), so that two launchers cannot both
    find a name free and both take it."""
    folder = jobs_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".lock", "a")  # noqa: SIM115 - held across the yield
    except OSError:  # a folder this user cannot write: nothing to guard (a claim fails on its write)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def claim(job: str, etcd: str | None) -> str:
    """Record that ``job`` runs on ``etcd``, for this process; the record's token (for :func:`forget`).
    ``etcd`` None: the job is starting (``litz launch`` loads its application, which may take a
    while); this process claims it again with its etcd once that runs.

    ConfigError if another launcher that still runs holds the name. A record left by one that is
    gone (``kill -9``) is stale and replaced."""
    path = _path(job)
    with _locked():
        held = _read(path)
        # (this process's own record of a launch that loads its application is taken over)
        if held is not None and _launcher_alive(held) and (held.get("pid") != os.getpid()
                                                            or held.get("etcd") is not None):
            raise ConfigError(f"a job named {job!r} is already running on this host (its launcher is pid "
                              f"{held.get('pid')}, etcd {held.get('etcd')}): pick another --job name, or stop "
                              f"that job first (litz stop --job {job})")
        token = secrets.token_hex(8)
        pid = os.getpid()
        tmp = path.with_suffix(f".tmp{pid}")
        try:
            tmp.write_text(json.dumps({"job": job, "etcd": etcd, "pid": pid, "started": _start_time(pid),
                                       "token": token}))
            tmp.replace(path)
        except OSError as exc:
            raise ConfigError(f"cannot write the record of job {job!r} in {path.parent} ({exc.strerror}): "
                              f"set LITZ_JOBS_DIR to a folder this user can write") from None
    return token


def forget(job: str, token: str | None = None) -> None:
    """Remove the record of ``job``: only the one :func:`claim` returned ``token`` for, if given
    (a launcher refused the name must not remove the record of the job that has it)."""
    path = _path(job)
    with _locked():
        if token is not None and (_read(path) or {}).get("token") != token:
            return
        path.unlink(missing_ok=True)


def local_jobs() -> list[dict[str, Any]]:
    """The records of the jobs launched on this host whose launcher still runs, by name.

    A launcher killed with ``kill -9`` cannot remove its record: a record whose pid is gone
    is stale, and is removed here."""
    out = []
    with _locked():  # a launcher claiming a stale record's name meanwhile must keep its new one
        for path in sorted(jobs_dir().glob("*.json")):
            rec = _read(path)
            if rec is None:
                continue
            if _launcher_alive(rec):
                out.append(rec)
            else:
                path.unlink(missing_ok=True)
    return out


def _launcher_alive(rec: dict[str, Any]) -> bool:
    """Whether the launcher that wrote ``rec`` still runs: its pid exists and, where the record says
    when that process started, it is the same process (pids are reused)."""
    pid = int(rec.get("pid", 0))
    if not pid_alive(pid):
        return False
    started = rec.get("started")
    return started is None or started == _start_time(pid)


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc``); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name before ")" may hold spaces


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (someone else's counts: it exists)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def lookup(job: str) -> dict[str, Any]:
    """The record of a local job, or ConfigError saying to pass --etcd. A record whose launcher is
    gone (``kill -9``) is removed and names no job: a command then said, after 5 s, that it could
    not reach the job's etcd, as if etcd had failed."""
    path = _path(job)
    with _locked():
        rec = _read(path)
        if rec is not None and not _launcher_alive(rec):
            path.unlink(missing_ok=True)
            raise ConfigError(f"no local job named {job!r} is running here: its launcher (pid {rec.get('pid')}) "
                              "is gone")
    if rec is None:
        raise ConfigError(f"no local job named {job!r} is running here (pass --etcd URL for a remote one)")
    return rec
