"""The driver's part of a checkpoint: its attributes, pickled so that they come back bound.

A driver's attributes are saved whole (less the master and the class's ``transient`` ones), and
an attribute may refer back to the driver: an app's helper object that holds it (NN-Descent's
phase in HDBSCAN), a bound method kept as a callback. Pickled as a copy, that reference drags in
the master (locks, sockets: the checkpoint fails), and once restored the helper would dispatch
through a dead copy. So it is saved as a persistent reference and bound to the live driver on
load: the same driver object after a full recovery, the new launch's after ``--resume``.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import cloudpickle

if TYPE_CHECKING:
    from litz.api import Driver

_DRIVER_REF = "litz-driver"


class _DriverPickler(cloudpickle.Pickler):
    """Pickles with every reference to ``driver`` saved as a persistent reference (module docstring)."""

    def __init__(self, file: io.BytesIO, driver: Driver) -> None:
        super().__init__(file)
        self._driver = driver

    def persistent_id(self, obj: Any) -> str | None:
        return _DRIVER_REF if obj is self._driver else None


class _DriverUnpickler(pickle.Unpickler):
    """Loads what :class:`_DriverPickler` wrote, binding its references to the live ``driver``."""

    def __init__(self, file: io.BytesIO, driver: Driver) -> None:
        super().__init__(file)
        self._driver = driver

    def persistent_load(self, pid: Any) -> Any:
        if pid != _DRIVER_REF:
            raise pickle.UnpicklingError(f"unknown persistent reference {pid!r} in a driver checkpoint")
        return self._driver


def dump_driver(driver: Driver, **extra: Any) -> bytes:
    """``{"driver": its checkpointed attributes, **extra}``, pickled: every attribute but the
    master and the class's ``transient`` ones."""
    skip = {"_master", *type(driver).transient}
    buf = io.BytesIO()
    _DriverPickler(buf, driver).dump({"driver": {k: v for k, v in driver.__dict__.items() if k not in skip},
                                      **extra})
    return buf.getvalue()


def load_driver(blob: bytes, driver: Driver) -> dict[str, Any]:
    """What :func:`dump_driver` saved, its references to the driver bound to ``driver``."""
    return _DriverUnpickler(io.BytesIO(blob), driver).load()
