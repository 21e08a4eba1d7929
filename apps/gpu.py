"""Where an app's kernels run: the ``--device {cpu,cuda,auto}`` option, shared by the apps with GPU kernels.

Two toolkits write those kernels. **Numba-CUDA** (``numba.cuda``, which imports without a GPU) for
kernels of our own: MLR's SGD block, LDA's sweep and NN-Descent's join distances. **CuPy** where the work is
library calls (cuSPARSE products, batched cuSOLVER solves): MF's ALS half-steps. Without a GPU, or
where a toolkit is missing or does not work (:func:`why_unavailable`), ``--device cuda`` is refused
before the job starts (:func:`check_device`), and ``auto`` uses the CPU.

The tests run the Numba kernels in Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``: real thread
blocks, shared memory and barriers, executed in Python), which checks the kernels' logic, not their
speed. CuPy has no simulator; ``LITZ_CUPY_STANDIN=numpy`` runs the CuPy code with NumPy and SciPy in
its place (:func:`cupy_standin`), the same calls on the CPU, so the tests check that code's logic
(and the app's device path) on every CI run.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import numpy as np

import litz

DEVICES = ("cpu", "cuda", "auto")
TOOLKITS = ("numba", "cupy")
CUPY_STANDIN = "LITZ_CUPY_STANDIN"


_cuda_import_error = "ImportError"  # why ``numba.cuda`` did not import (cuda_module), when it did not


@functools.cache
def cuda_module() -> Any:
    """``numba.cuda``, or None if this numba build has none. Imported on first use, not with the apps:
    it costs about 60 ms, which every worker process would pay for nothing on the CPU. It imports
    without a GPU or a CUDA toolkit."""
    global _cuda_import_error
    try:
        from numba import cuda
    except Exception as exc:  # pragma: no cover - depends on the numba build (not only ImportError: an
        # AttributeError of a numba-cuda that does not fit this NumPy, say; --device auto then takes
        # the CPU and --device cuda is refused, saying why, instead of either raising it)
        _cuda_import_error = f"{type(exc).__name__}: {exc}"
        return None
    _restore_numpy_names()
    return cuda


def _restore_numpy_names() -> None:
    """Give NumPy back the ``row_stack`` that NumPy 2.5 removed, when it lacks it.

    numba-cuda 0.68 (current in late 2026, and what a CUDA image ships with NumPy 2.5) calls
    ``np.row_stack`` while it compiles every kernel, so without the name each kernel fails with
    ``AttributeError: module 'numpy' has no attribute 'row_stack'`` and a GPU that works is unusable.
    ``row_stack`` was always an alias of ``vstack``: adding it back changes nothing that NumPy does,
    and a NumPy that has it keeps its own."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for a GPU (tests without hardware)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def cupy_standin() -> bool:
    """Whether NumPy and SciPy stand in for CuPy (``LITZ_CUPY_STANDIN=numpy``; tests without a GPU)."""
    return os.environ.get(CUPY_STANDIN) == "numpy"


def available(toolkit: str = "numba") -> bool:
    """Whether this process can run the kernels written with ``toolkit`` (a GPU and its driver, or a
    stand-in: the simulator for Numba, NumPy for CuPy)."""
    return why_unavailable(toolkit) is None


@functools.cache
def why_unavailable(toolkit: str = "numba") -> str | None:
    """Why this process cannot run the apps' GPU kernels written with ``toolkit``, or None if it can.
    Asked once per process and toolkit.

    A visible GPU is not enough: a numba-cuda that does not match the installed NumPy imports,
    sees the GPU, and then fails on every kernel it compiles (seen on an H100 image: numba-cuda
    with NumPy 2.5, ``module 'numpy' has no attribute 'row_stack'``, which
    :func:`_restore_numpy_names` now mends). So a one-thread kernel is
    compiled and launched here (for CuPy, one small computation runs); if that fails, ``--device
    auto`` uses the CPU and ``--device cuda`` is refused with the error, instead of every task
    failing with it."""
    if toolkit == "cupy":
        return _why_no_cupy()
    if toolkit != "numba":
        raise ValueError(f"unknown GPU toolkit {toolkit!r} (choose from {', '.join(TOOLKITS)})")
    cuda = cuda_module()
    if cuda is None:
        return f"this numba has no CUDA support (numba.cuda does not import: {_cuda_import_error})"
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


def _why_no_cupy() -> str | None:
    """Why CuPy cannot compute here (not installed, built for another CUDA, no GPU), or None."""
    if cupy_standin():
        return None
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc}; pip install -e \".[gpu]\" adds it)"
    except Exception as exc:  # a CuPy built for another CUDA fails on import
        return f"CuPy failed to import ({type(exc).__name__}: {exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU is visible to this process (CuPy counts none)"
        if int((cupy.arange(4, dtype=cupy.float64) * 2).sum()) != 12:
            raise RuntimeError("a small computation gave a wrong result")
        # what MF's kernels call beyond that: a sparse product (cuSPARSE) and a batched solve
        # (cuSOLVER), libraries a CUDA install may lack where the driver and NVRTC are there
        import cupyx.scipy.sparse

        a = cupyx.scipy.sparse.csr_matrix(cupy.eye(2, dtype=cupy.float64))
        x = cupy.linalg.solve(cupy.stack([cupy.eye(2) * 2] * 2), (a @ cupy.ones((2, 1)))[None].repeat(2, 0))
        if not bool(cupy.allclose(x, 0.5)):
            raise RuntimeError("a small sparse product and solve gave a wrong result")
    except Exception as exc:  # no driver, or a driver older than CuPy's CUDA
        return f"CuPy cannot compute on a GPU here ({type(exc).__name__}: {exc})"
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


def resolve(device: str, toolkit: str = "numba") -> str:
    """``cpu`` or ``cuda`` for an option value; ``cuda`` where this process cannot run the kernels of
    ``toolkit`` raises a ``ValueError`` that says why (:func:`why_unavailable`)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "auto":
        return "cuda" if available(toolkit) else "cpu"
    if device == "cuda" and not available(toolkit):
        raise ValueError(f"--device cuda: {why_unavailable(toolkit)}; use --device cpu or auto")
    return device


@functools.cache
def process_device(option: str, toolkit: str = "numba") -> str:
    """:func:`resolve`, once per process: where this worker process runs the kernels (``auto`` asks
    once; ``cuda`` without a GPU raises, and the task that asked reports why)."""
    return resolve(option, toolkit)


def add_device_option(p: argparse.ArgumentParser, what: str, module: str, toolkit: str = "numba") -> None:
    """``--device``: where ``what`` is computed (the GPU kernels live in ``module``)."""
    name = {"numba": "Numba-CUDA", "cupy": "CuPy"}[toolkit]
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help=f"compute {what} on the CPU, on an NVIDIA GPU with {name} (cuda; see {module} for "
                        f"what it gains), or on a GPU where the worker process sees one (auto)")


def check_device(option: str, toolkit: str = "numba") -> None:
    """Refuse ``--device cuda`` before the job starts when this host cannot run the kernels (the
    workers of a local cluster run here; a joined host without a GPU fails its first task with the
    same reason)."""
    if option == "cuda":
        try:
            resolve(option, toolkit)
        except ValueError as exc:
            raise litz.ConfigError(str(exc)) from None
