"""Small Numba building blocks shared by the apps' kernels.

:func:`prefetch` asks the CPU to start loading an array element into cache without waiting for it.
Kernels whose loop reads one array at positions known a few iterations ahead (the LDA sweep's
document lists, in the order of its tokens) call it for a later iteration: the cache miss then
overlaps with the current iteration's arithmetic instead of stalling the next one. Out-of-order
execution alone does not get there, because each iteration ends in data-dependent branches (which
bucket the random draw falls in) whose mispredictions discard the loads issued after them.

:data:`NO_REFCOUNTS` are the ``njit`` options of a kernel compiled without Numba's reference counting.
Numba counts the references to arrays atomically: a row view (``G[p]``) or an array handed to a helper
inlined at the IR level (``inline="always"``) costs a ``lock`` increment and decrement, and its pruning
pass removes such pairs only within simple control flow. In the LDA sweep they took two thirds of the
time (README, "Reference counts in hot loops"). A kernel compiled with these options may not allocate
(Numba refuses to compile it if it does): its callers pass the scratch arrays.

:func:`read_only` is what the kernels' Python entry points pass their arrays through, so that one
compiled specialization of each kernel serves every caller.

:func:`insert_sorted` is one step of an insertion sort by (key, id), for the short rows that the
kernels sort (a leaf's candidates, a point's mutual-reachability edges).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.cpu import CPUTargetOptions
from numba.extending import intrinsic

__all__ = ["NO_REFCOUNTS", "insert_sorted", "prefetch", "read_only"]

#: ``njit`` options for a kernel without reference counts: ``_nrt`` is a private option of Numba's CPU
#: target, so a Numba without it gets the kernel with its counts (slower, still correct; the tests that
#: read the kernels' machine code then fail and say so).
NO_REFCOUNTS: dict[str, Any] = {"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {}


def read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a plain read-only ndarray: itself if it is one, else a read-only view (no copy).

    Numba compiles a kernel once per argument type, and a writeable array, a read-only one and a
    memory map are three types: passing every input through this means one specialization, the one
    the app's warm-up compiles (and the loaders' read-only memory maps hit it too). For NN-Descent's
    kernels, which had both, a fresh machine's compile went from 52.0 to 31.3 s."""
    if type(a) is np.ndarray and not a.flags.writeable:
        return a
    view = a.view(np.ndarray)
    view.flags.writeable = False
    return view


@numba.njit(cache=True, nogil=True)
def insert_sorted(keys: np.ndarray, ids: np.ndarray, m: int, key: Any, ident: Any) -> None:
    """Insert ``(key, ident)`` among the ``m`` entries of ``keys`` and ``ids`` (both of room for one
    more), which are sorted by key, then id; the entries after it move up one place."""
    t = m
    while t > 0 and (keys[t - 1] > key or (keys[t - 1] == key and ids[t - 1] > ident)):
        keys[t] = keys[t - 1]
        ids[t] = ids[t - 1]
        t -= 1
    keys[t] = key
    ids[t] = ident


# LLVM 15 made pointers opaque, which renamed the intrinsic's overload
_PREFETCH = "llvm.prefetch.p0" if llvm_binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@intrinsic
def prefetch(typingctx: Any, arr: types.Type, idx: types.Type) -> Any:
    """``prefetch(arr, i)`` inside a jitted function: a hint to cache ``arr[i]`` (1-d, no bounds check
    and no wraparound: an address out of range is harmless, the CPU drops the hint)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(idx, types.Integer)):
        return None
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            _PREFETCH)
        # read (0), keep in all cache levels (3), data cache (1)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
