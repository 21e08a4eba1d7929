"""Where a local job's etcd can be found from its name, so ``litz status --job NAME`` needs no URL.

``litz status`` without ``--job`` lists these records (:func:`local_jobs`).

The launcher writes ``<jobs dir>/<job>.json`` (etcd URL, launcher pid) when a job starts and
removes it when the job ends. The folder is ``$LITZ_JOBS_DIR`` or ``~/.cache/litz/jobs``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from litz.errors import ConfigError


def jobs_dir() -> Path:
    return Path(os.environ.get("LITZ_JOBS_DIR") or Path.home() / ".cache" / "litz" / "jobs")


def _path(job: str) -> Path:
    if not job or "/" in job or job.startswith("."):
        raise ConfigError(f"bad job name {job!r}")
    return jobs_dir() / f"{job}.json"


def record(job: str, etcd: str) -> None:
    """Remember that ``job`` runs on ``etcd`` (written atomically)."""
    path = _path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"job": job, "etcd": etcd, "pid": os.getpid()}))
    tmp.replace(path)


def forget(job: str) -> None:
    try:
        _path(job).unlink()
    except FileNotFoundError:
        pass


def local_jobs() -> list[dict[str, Any]]:
    """The records of the jobs launched on this host whose launcher still runs, by name.

    A launcher killed with ``kill -9`` cannot remove its record: a record whose pid is gone
    is stale, and is removed here."""
    out = []
    for path in sorted(jobs_dir().glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(int(rec.get("pid", 0))):
            out.append(rec)
        else:
            path.unlink(missing_ok=True)
    return out


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
    """The record of a local job, or ConfigError saying to pass --etcd."""
    try:
        return json.loads(_path(job).read_text())
    except FileNotFoundError:
        raise ConfigError(f"no local job named {job!r} is running here (pass --etcd URL for a remote one)") from None
