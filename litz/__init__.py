"""Litz: an elastic parameter server for iterative-convergent machine learning.

The public API: an application defines a ``Driver`` and an ``Executor``, declares its
parameter ``Table``s, and runs with ``litz.run(App(...))`` or ``litz launch app.py``.
"""

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
from litz.runtime.launcher import run
from litz.schedulers import BlockRotation, BlockRotationDriver, SSPDriver

__version__ = "0.1.0"

__all__ = [
    "App", "BlockRotation", "BlockRotationDriver", "Combiner", "ConfigError", "Driver", "EtcdUnreachable",
    "Executor", "JobResult", "JobStopped", "LitzError", "ParameterServer", "ProcessLost", "ProtocolError", "Recovery",
    "SSPDriver", "StateRows",
    "Table", "TableError", "TaskError", "TaskFailure", "TaskResult", "run",
]
