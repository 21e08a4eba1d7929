"""Exceptions that Litz raises to users: each names what failed and where."""

from __future__ import annotations


def _rebuilt(cls: type[LitzError], args: tuple[object, ...], state: dict[str, object]) -> LitzError:
    """An unpickled error: its message and attributes as they were, its ``__init__`` not run again."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class LitzError(Exception):
    """Base class of every error Litz raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Pickling calls ``cls(*self.args)`` by default, which fails or garbles the message for a
        # subclass whose ``__init__`` takes other arguments (TaskError, JobStopped, ...): a job run
        # in a process pool handed its caller a BrokenProcessPool instead of its error.
        return _rebuilt, (type(self), self.args, self.__dict__)


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


class ProcessLost(LitzError):
    """A worker or server process of the job died or lost its etcd lease (``ident``: which)."""

    def __init__(self, message: str, ident: str | None = None) -> None:
        super().__init__(message)
        self.ident = ident


class JobStopped(LitzError):
    """The job was stopped on request (``litz stop``, or SIGTERM to ``litz launch``) before its driver finished.

    ``checkpoint`` is the directory of the consistent checkpoint taken just before it stopped
    (``litz stop --checkpoint``), from which ``litz launch --resume`` or ``litz.run(resume=...)``
    goes on; None when it stopped without one.
    """

    def __init__(self, job: str, checkpoint: str | None = None, how: str = "litz stop") -> None:
        self.job = job
        self.checkpoint = checkpoint
        where = f"; its last checkpoint is {checkpoint} (resume with --resume {checkpoint})" if checkpoint else ""
        super().__init__(f"job {job} was stopped on request ({how}){where}")
