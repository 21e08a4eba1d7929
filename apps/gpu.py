"""Where an app's kernels run: the ``--device {cpu,cuda,auto}`` option, shared by the apps with GPU kernels.

GPU kernels are written with Numba-CUDA (``numba.cuda``, which imports without a GPU). Without a
GPU, ``--device cuda`` is refused before the job starts (:func:`check_device`), and ``auto``
uses the CPU. The tests run the kernels in Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``):
real thread blocks, shared memory and barriers, executed in Python, which checks the kernels'
logic, not their speed.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import litz

DEVICES = ("cpu", "cuda", "auto")


@functools.cache
def cuda_module() -> Any:
    """``numba.cuda``, or None if this numba build has none. Imported on first use, not with the apps:
    it costs about 60 ms, which every worker process would pay for nothing on the CPU. It imports
    without a GPU or a CUDA toolkit."""
    try:
        from numba import cuda
    except ImportError:  # pragma: no cover - depends on the numba build
        return None
    return cuda


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for a GPU (tests without hardware)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def available() -> bool:
    """Whether this process can launch CUDA kernels (a GPU and its driver, or the simulator)."""
    cuda = cuda_module()
    if cuda is None:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver installation: no GPU for us
        return False


def resolve(device: str) -> str:
    """``cpu`` or ``cuda`` for an option value; ``cuda`` without a GPU raises a ``ValueError`` that says why."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "auto":
        return "cuda" if available() else "cpu"
    if device == "cuda" and not available():
        why = ("this numba has no CUDA support" if cuda_module() is None else
               "no CUDA GPU is visible to this process (numba.cuda.is_available() is False; "
               "numba.cuda.detect() says why)")
        raise ValueError(f"--device cuda: {why}; use --device cpu or auto")
    return device


@functools.cache
def process_device(option: str) -> str:
    """:func:`resolve`, once per process: where this worker process runs the kernels (``auto`` asks
    once; ``cuda`` without a GPU raises, and the task that asked reports why)."""
    return resolve(option)


def add_device_option(p: argparse.ArgumentParser, what: str, module: str) -> None:
    """``--device``: where ``what`` is computed (the GPU kernels live in ``module``)."""
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help=f"compute {what} on the CPU, on an NVIDIA GPU with Numba-CUDA (cuda; see {module} for "
                        f"what it gains), or on a GPU where the worker process sees one (auto)")


def check_device(option: str) -> None:
    """Refuse ``--device cuda`` before the job starts when this host has no GPU (the workers of a
    local cluster run here; a joined host without one fails its first task with the same reason)."""
    if option == "cuda":
        try:
            resolve(option)
        except ValueError as exc:
            raise litz.ConfigError(str(exc)) from None
