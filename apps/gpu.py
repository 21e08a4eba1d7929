"""Where an app's kernels run: the ``--device {cpu,cuda,auto}`` option, shared by the apps with GPU kernels.

GPU kernels are written with Numba-CUDA (``numba.cuda``, which imports without a GPU). Without a
GPU, or where a kernel does not compile (:func:`why_unavailable`), ``--device cuda`` is refused
before the job starts (:func:`check_device`), and ``auto`` uses the CPU. The tests run the kernels
in Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): real thread blocks, shared memory and
barriers, executed in Python, which checks the kernels' logic, not their speed.
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
    return why_unavailable() is None


@functools.cache
def why_unavailable() -> str | None:
    """Why this process cannot run the apps' CUDA kernels, or None if it can. Asked once per process.

    A visible GPU is not enough: a numba-cuda that does not match the installed NumPy imports,
    sees the GPU, and then fails on every kernel it compiles (seen on an H100 image: numba-cuda
    with NumPy 2.5, ``module 'numpy' has no attribute 'row_stack'``). So a one-thread kernel is
    compiled and launched here; if that fails, ``--device auto`` uses the CPU and ``--device
    cuda`` is refused with the error, instead of every task failing with it."""
    cuda = cuda_module()
    if cuda is None:
        return "this numba has no CUDA support"
    try:
        if not cuda.is_available():
            return ("no CUDA GPU is visible to this process (numba.cuda.is_available() is False; "
                    "numba.cuda.detect() says why)")
    except Exception as exc:  # a broken driver installation
        return f"the CUDA driver failed ({type(exc).__name__}: {exc})"
    try:
        _probe(cuda)
    except Exception as exc:
        return f"numba-cuda cannot compile or run a kernel here ({type(exc).__name__}: {exc})"
    return None


def _probe(cuda: Any) -> None:
    """Compile and launch a one-thread kernel and check what it wrote."""
    import warnings

    import numpy as np

    @cuda.jit
    def write_one(out: Any) -> None:  # pragma: no cover - runs on the GPU (or the simulator)
        out[0] = 1

    out = cuda.to_device(np.zeros(1, np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba-cuda warns that one block leaves the GPU idle
        write_one[1, 1](out)
    if int(out.copy_to_host()[0]) != 1:
        raise RuntimeError("a one-thread kernel did not write its result")


def resolve(device: str) -> str:
    """``cpu`` or ``cuda`` for an option value; ``cuda`` where this process cannot run CUDA kernels
    raises a ``ValueError`` that says why (:func:`why_unavailable`)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "auto":
        return "cuda" if available() else "cpu"
    if device == "cuda" and not available():
        raise ValueError(f"--device cuda: {why_unavailable()}; use --device cpu or auto")
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
