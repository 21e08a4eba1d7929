"""Exceptions that Litz raises to users: each names what failed and where."""

from __future__ import annotations


class LitzError(Exception):
    """Base class of every error Litz raises on purpose."""


class ConfigError(LitzError):
    """A job was configured wrongly (bad option, missing binary, bad table spec)."""


class EtcdUnreachable(LitzError):
    """The etcd server named for the job cannot be reached."""


class ProtocolError(LitzError):
    """A message was malformed or of an unknown type; the receiver keeps running."""


class TableError(LitzError):
    """An unknown table, or an update whose dtype or shape does not fit the table."""


class TaskError(LitzError):
    """A micro-task's ``run_task`` raised: names the executor, the task's arguments and the traceback."""

    def __init__(self, executor_id: int, args: object, traceback: str, worker: str = "?") -> None:
        self.executor_id = executor_id
        self.args_ = args
        self.traceback = traceback
        self.worker = worker
        super().__init__(
            f"run_task failed on executor {executor_id} (worker {worker}) with args {args!r}:\n{traceback}"
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:  # whole after pickling (a process pool's caller)
        return type(self), (self.executor_id, self.args_, self.traceback, self.worker)


class ProcessLost(LitzError):
    """A worker or server process of the job died or lost its etcd lease (``ident``: which)."""

    def __init__(self, message: str, ident: str | None = None) -> None:
        super().__init__(message)
        self.ident = ident

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (str(self), self.ident)


class JobStopped(LitzError):
    """The job was stopped on request (``litz stop``, or SIGTERM to ``litz launch``) before its driver finished.

    ``checkpoint`` is the directory of the consistent checkpoint taken just before it stopped
    (``litz stop --checkpoint``), from which ``litz launch --resume`` or ``litz.run(resume=...)``
    goes on; None when it stopped without one.
    """

    def __init__(self, job: str, checkpoint: str | None = None, how: str = "litz stop") -> None:
        self.job = job
        self.checkpoint = checkpoint
        self.how = how
        where = f"; its last checkpoint is {checkpoint} (resume with --resume {checkpoint})" if checkpoint else ""
        super().__init__(f"job {job} was stopped on request ({how}){where}")

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.job, self.checkpoint, self.how)
