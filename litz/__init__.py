"""Litz: an elastic parameter server for iterative-convergent machine learning.

The public API: an application defines a ``Driver`` and an ``Executor``, declares its
parameter ``Table``s, and runs with ``litz.run(App(...))`` or ``litz launch app.py``.
"""

from typing import TYPE_CHECKING

from litz.api import App, Driver, Executor, JobResult, ParameterServer, Recovery, StateRows, TaskFailure, TaskResult
from litz.errors import (
    ConfigError,
    EtcdUnreachable,
    JobStopped,
    LitzError,
    ProcessLost,
    ProtocolError,
    TableError,
    TaskError,
)
from litz.ps.tables import Combiner, Table
from litz.schedulers import BlockRotation, BlockRotationDriver, SSPDriver

__version__ = "0.1.0"


if TYPE_CHECKING:  # for type checkers and editors; at run time see __getattr__
    from litz.runtime.launcher import run


def __getattr__(name: str) -> object:
    """``litz.run`` is imported on first use: worker and server processes import ``litz`` (the
    applications' code does) but never start a job, and the launcher brings the master, the
    checkpoint coordinator and the local etcd with it."""
    if name == "run":
        from litz.runtime.launcher import run

        return run
    raise AttributeError(f"module 'litz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "run"})

__all__ = [
    "App", "BlockRotation", "BlockRotationDriver", "Combiner", "ConfigError", "Driver", "EtcdUnreachable",
    "Executor", "JobResult", "JobStopped", "LitzError", "ParameterServer", "ProcessLost", "ProtocolError", "Recovery",
    "SSPDriver", "StateRows",
    "Table", "TableError", "TaskError", "TaskFailure", "TaskResult", "run",
]
