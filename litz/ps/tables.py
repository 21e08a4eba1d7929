"""Parameter tables: row shape, dtype, initializer and combiner, and the checks on keys and updates.

A ``Table`` is a declaration shared by the driver, the workers and the servers. Its combiner
says how two updates merge (in a worker's update log) and how an update applies to a value
(on a server). Built-ins: ``add`` (default), ``min``, ``max``, ``assign``; an application may
supply any associative function through ``Combiner``.

Rows are created on first touch by the initializer, which is a pure function of
(table, key), so that a row initialised on any server, at any time, has the same value.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from litz.errors import TableError

Key = Hashable


class Combiner:
    """How updates merge and apply. Subclass it, or wrap one associative function with ``Combiner.of``.

    ``merge_into(acc, upd)`` merges ``upd`` into ``acc`` (an array the caller owns) and returns
    the result (``acc`` itself when done in place). ``apply_into(value, upd)`` applies an update
    to a stored value the same way. For most combiners the two are the same operation.
    """

    name = "custom"
    #: Whether ``apply_many`` either raises before it changes any row or applies every one. A
    #: server applies an update of a combiner that is not so to copies of the rows first, so that
    #: one raising part-way through leaves the table as it was (an item is applied whole or not
    #: at all). The built-ins are (the table checked their inputs); a combiner whose ``apply_many``
    #: checks everything before it writes may say so and save the copies.
    atomic = False

    def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def apply_into(self, value: np.ndarray, upd: np.ndarray) -> np.ndarray:
        return self.merge_into(value, upd)

    def merge_many(self, accs: list[np.ndarray], upds: np.ndarray) -> None:
        """``merge_into(accs[i], upds[i])`` for every i, each ``accs[i]`` changed in place.

        The default loops; a combiner whose work is a compiled kernel should override it with
        one call over all rows (a server applies thousands of rows per message, and a Python
        call per row can cost more than the kernel)."""
        for acc, upd in zip(accs, upds, strict=True):
            out = self.merge_into(acc, upd)
            if out is not acc:
                acc[...] = out

    def apply_many(self, values: list[np.ndarray], upds: np.ndarray) -> None:
        """``apply_into`` for every row, in place (default: :meth:`merge_many`)."""
        self.merge_many(values, upds)

    def warm_up(self) -> None:
        """Prepare what the first merge would otherwise pay for (compile or load a kernel).

        Servers and workers call it when they receive the tables, while the workers still load
        their input, so the cost leaves the first round's path: a Numba kernel loaded from the
        disk cache at the first update held NN-Descent's first completions back by 0.3 s. Default: nothing.
        """

    @staticmethod
    def of(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], name: str = "custom", *,
           atomic: bool = False) -> Combiner:
        """A combiner from an associative function ``fn(a, b) -> combined`` (used to merge and to
        apply). ``atomic``: ``fn`` cannot raise on rows of the table's shape and dtype (see
        :attr:`atomic`; servers then skip the copies that undo a failure part-way)."""
        return _FunctionCombiner(fn, name, atomic)


class _FunctionCombiner(Combiner):
    def __init__(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray], name: str, atomic: bool = False) -> None:
        self.fn = fn
        self.name = name
        self.atomic = atomic

    def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
        out = self.fn(acc, upd)
        if out is not acc:
            # None (a forgotten return) or a scalar for a row would be broadcast over it: refused,
            # or the table would be silently corrupted (a NumPy scalar is right for a scalar table)
            if not isinstance(out, (np.ndarray, np.generic)) or np.shape(out) != acc.shape:
                got = f"shape {np.shape(out)}" if isinstance(out, (np.ndarray, np.generic)) else type(out).__name__
                raise TypeError(f"combiner {self.name!r} returned {got}, expected an array of the row's shape "
                                f"{acc.shape}")
            acc[...] = out
        return acc


class _Ufunc(Combiner):
    atomic = True

    def __init__(self, name: str, ufunc: np.ufunc) -> None:
        self.name = name
        self.ufunc = ufunc

    def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
        self.ufunc(acc, upd, out=acc, casting="same_kind")
        return acc


class _Assign(Combiner):
    name = "assign"
    atomic = True

    def merge_into(self, acc: np.ndarray, upd: np.ndarray) -> np.ndarray:
        acc[...] = upd
        return acc


COMBINERS: dict[str, Combiner] = {
    "add": _Ufunc("add", np.add),
    "min": _Ufunc("min", np.minimum),
    "max": _Ufunc("max", np.maximum),
    "assign": _Assign(),
}


def _changes(value: np.ndarray, saved: np.ndarray) -> np.ndarray:
    """``|value - saved|`` per entry, where an entry equal to its saved self is 0 even when it is
    infinite or NaN (``inf - inf`` is NaN: a table of neighbour lists, whose empty slots hold
    ``inf``, failed every priority checkpoint) and one that became or stopped being NaN is ``inf``."""
    a = value.astype(np.float64).ravel()
    b = np.asarray(saved, np.float64).ravel()
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    if not np.isnan(d).any():
        return d
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))


def _l2(value: np.ndarray, saved: np.ndarray) -> float:
    return float(np.linalg.norm(_changes(value, saved)))


def _l1(value: np.ndarray, saved: np.ndarray) -> float:
    return float(_changes(value, saved).sum())


def _scaled_total_variation(value: np.ndarray, saved: np.ndarray) -> float:
    """Length-scaled total variation, for rows of counts (topic counts of documents or words).

    The row's last axis holds one count vector per entry: each contributes ``|a|_1`` times the
    total variation between the distributions ``a/|a|_1`` and ``b/|b|_1`` (SCAR's distance for
    LDA). Scaling by the length makes a long document that changed its mix weigh more than a
    short one that changed as much; a vector that became empty, or was empty when saved, counts as fully changed.
    """
    a = value.astype(np.float64).reshape(-1, value.shape[-1] if value.ndim else 1)
    b = saved.astype(np.float64).reshape(a.shape)
    na = np.abs(a).sum(axis=1)
    nb = np.abs(b).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tv = 0.5 * np.abs(a / na[:, None] - b / nb[:, None]).sum(axis=1)
    tv = np.where((na == 0) | (nb == 0), np.where(na == nb, 0.0, 1.0), tv)
    return float((np.where(na > 0, na, nb) * tv).sum())


DISTANCES: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "l2": _l2,
    "l1": _l1,
    "tv": _scaled_total_variation,
}


def _key_seed(key: Key) -> int:
    if isinstance(key, (int, np.integer)):
        return int(key) & 0xFFFFFFFF
    return zlib.crc32(repr(key).encode())


#: The keys an int key may be: a checkpoint stores int keys in an int64 column (``storage.SHARD_SCHEMA``),
#: so a key outside it would be accepted by every update and then fail every checkpoint.
KEY_MIN, KEY_MAX = -(2**63), 2**63 - 1


def is_int(x: Any) -> bool:
    """A Python or NumPy integer, not a bool (which Python counts as one): a count, a size, an id."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass
class Table:
    """A named parameter table.

    Args:
        name: the table's name, used in ``ps.get(name, key)``.
        shape: the shape of one row (``()`` for scalars).
        dtype: the rows' dtype; updates must be castable to it (same kind).
        init: ``"zeros"``, ``("full", v)``, ``("normal", std)``, ``("uniform", lo, hi)``, or
            ``fn(key, shape, dtype) -> array``: rows are created on first touch.
        combiner: ``"add"``, ``"min"``, ``"max"``, ``"assign"`` or a ``Combiner``.
        num_rows: if set, keys must be ints in ``[0, num_rows)``; otherwise ints (int64) or strings.
        seed: seeds the random initializers (per key, so any server makes the same row).
        distance: how far a row has moved from its checkpointed copy, for priority (SCAR)
            checkpoints: ``"l2"`` (default), ``"l1"``, ``"tv"`` (length-scaled total variation of
            count vectors along the last axis) or ``fn(value, saved) -> float``. Rows that moved
            most are saved first, so the application says what "moved" means for its model.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any = "float32"
    init: Any = "zeros"
    combiner: Any = "add"
    num_rows: int | None = None
    seed: int = 0
    distance: Any = "l2"
    _combiner: Combiner = field(init=False, repr=False)
    _distance: Callable[[np.ndarray, np.ndarray], float] = field(init=False, repr=False)
    _row_nbytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TableError(f"a table's name must be a non-empty string, got {self.name!r}")
        dims = self.shape if isinstance(self.shape, (tuple, list)) else (self.shape,)
        if not all(is_int(d) and d > 0 for d in dims):
            raise TableError(f"table {self.name!r}: shape must be positive ints (a row holds something), "
                             f"got {self.shape!r}")
        self.shape = tuple(int(d) for d in dims)
        try:
            self.dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise TableError(f"table {self.name!r}: {exc}") from None
        if self.dtype.kind not in "biufc":  # rows travel as raw bytes: objects, strings, dates do not
            raise TableError(f"table {self.name!r}: dtype {self.dtype} is not numeric (bool, int, float or complex)")
        if self.num_rows is not None and not (is_int(self.num_rows) and self.num_rows > 0):
            raise TableError(f"table {self.name!r}: num_rows must be a positive int or None, got {self.num_rows!r}")
        if self.num_rows is not None and self.num_rows > KEY_MAX + 1:
            raise TableError(f"table {self.name!r}: num_rows {self.num_rows} is over 2**63 (checkpoints store int "
                             f"keys as int64)")
        self._row_nbytes = math.prod(self.shape) * self.dtype.itemsize  # asked for every row logged or sent
        if isinstance(self.combiner, str):
            if self.combiner not in COMBINERS:
                raise TableError(f"table {self.name!r}: unknown combiner {self.combiner!r} "
                                 f"(choose from {sorted(COMBINERS)} or pass a Combiner)")
            self._combiner = COMBINERS[self.combiner]
        elif isinstance(self.combiner, Combiner):
            self._combiner = self.combiner
        else:
            raise TableError(f"table {self.name!r}: combiner must be a name or a Combiner")
        if isinstance(self.distance, str):
            if self.distance not in DISTANCES:
                raise TableError(f"table {self.name!r}: unknown distance {self.distance!r} "
                                 f"(choose from {sorted(DISTANCES)} or pass fn(value, saved) -> float)")
            self._distance = DISTANCES[self.distance]
        elif callable(self.distance):
            self._distance = self.distance
        else:
            raise TableError(f"table {self.name!r}: distance must be a name or a function")

    def distance_from_saved(self, value: np.ndarray, saved: np.ndarray) -> float:
        """The row's priority for the next partial checkpoint; a bad answer names the table."""
        try:
            d = float(self._distance(value, saved))
        except Exception as exc:
            raise TableError(f"table {self.name!r}: distance function failed: {type(exc).__name__}: {exc}") from exc
        if not d >= 0:  # NaN or negative would corrupt the global ranking
            raise TableError(f"table {self.name!r}: distance function returned {d!r}, expected a number >= 0")
        return d

    def warm_up(self) -> None:
        """The combiner's :meth:`Combiner.warm_up`; a failure names the table."""
        try:
            self._combiner.warm_up()
        except Exception as exc:
            raise TableError(f"table {self.name!r}: combiner {self._combiner.name!r} failed to warm up: "
                             f"{type(exc).__name__}: {exc}") from exc

    @property
    def comb(self) -> Combiner:
        return self._combiner

    @property
    def row_nbytes(self) -> int:
        return self._row_nbytes

    # -- keys -----------------------------------------------------------------
    def check_key(self, key: Any) -> Key:
        """Return the canonical key or raise TableError naming the table and the key."""
        if isinstance(key, (bool, np.bool_)):
            raise TableError(f"table {self.name!r}: key {key!r} is a bool; keys are ints or strings")
        if isinstance(key, (int, np.integer)):
            key = int(key)
            if self.num_rows is not None and not 0 <= key < self.num_rows:
                raise TableError(f"table {self.name!r}: key {key} out of range [0, {self.num_rows})")
            if not KEY_MIN <= key <= KEY_MAX:  # (checkpoints would fail on it, every one after the update)
                raise TableError(f"table {self.name!r}: key {key} does not fit int64 (ints in [-2**63, 2**63) "
                                 f"expected: checkpoints store int keys as int64)")
            return key
        if isinstance(key, str) and self.num_rows is None:
            try:  # a lone surrogate cannot be hashed to its shard (nor travel): refused here, named
                key.encode()
            except UnicodeEncodeError as exc:
                raise TableError(f"table {self.name!r}: key {key!r} is not valid Unicode text ({exc.reason})") from None
            return key
        raise TableError(f"table {self.name!r}: bad key {key!r} of type {type(key).__name__} "
                         f"({'ints in range' if self.num_rows is not None else 'ints or strings'} expected)")

    def check_keys(self, keys: Any) -> list[Key]:
        """``check_key`` for each key, as a new list.

        Lists of plain ints (what a message carries, and what ``tolist`` gives) are checked with
        one range test instead of a call per key. Anything else, or a key out of range, goes key
        by key, so the error names the first bad key."""
        if isinstance(keys, range) and self.num_rows is not None:
            if len(keys) and not (0 <= keys[0] < self.num_rows and 0 <= keys[-1] < self.num_rows):
                raise TableError(f"table {self.name!r}: keys {keys} out of range [0, {self.num_rows})")
            return list(keys)
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        elif isinstance(keys, (str, bytes)):  # list("abc") would silently read keys 'a', 'b', 'c'
            raise TableError(f"table {self.name!r}: keys must be a list (or any iterable) of keys, got the string "
                             f"{keys!r}; for one key use get or update")
        elif not isinstance(keys, list):
            try:
                keys = list(keys)
            except TypeError:
                raise TableError(f"table {self.name!r}: keys must be a list (or any iterable) of keys, got "
                                 f"{type(keys).__name__} {keys!r:.40}; for one key use get or update") from None
        if keys and set(map(type, keys)) == {int} and (
                (KEY_MIN <= min(keys) and max(keys) <= KEY_MAX) if self.num_rows is None
                else (min(keys) >= 0 and max(keys) < self.num_rows)):
            return list(keys)
        return [self.check_key(k) for k in keys]

    # -- values ---------------------------------------------------------------
    def check_delta(self, delta: Any, n: int | None = None, what: str = "update") -> np.ndarray:
        """Validate one row (n is None) or n stacked rows; return an array of the table's dtype."""
        if delta is None:  # np.asarray(None) is a 0-d object array: "shape ()" would say nothing useful
            raise TableError(f"table {self.name!r}: {what} is None, expected an array of shape "
                             f"{self.shape if n is None else (n, *self.shape)}")
        expected = self.shape if n is None else (n, *self.shape)
        try:
            arr = np.asarray(delta)
        except (ValueError, TypeError) as exc:  # ragged rows, say
            raise TableError(f"table {self.name!r}: {what} is not an array of shape {expected}: {exc}") from None
        if arr.shape != expected:
            raise TableError(f"table {self.name!r}: {what} has shape {arr.shape}, expected {expected}")
        if not np.can_cast(arr.dtype, self.dtype, casting="same_kind"):
            raise TableError(f"table {self.name!r}: {what} has dtype {arr.dtype}, "
                             f"which cannot be cast to the table's {self.dtype}")
        return arr if arr.dtype == self.dtype else arr.astype(self.dtype)

    def initial_row(self, key: Key) -> np.ndarray:
        """The row's initial value: a pure function of (table, key)."""
        init = self.init
        if callable(init):
            row = np.asarray(init(key, self.shape, self.dtype), dtype=self.dtype)
            if row.shape != self.shape:
                raise TableError(f"table {self.name!r}: initializer gave shape {row.shape} for key {key!r}")
            return np.array(row, copy=True)
        kind, *params = (init,) if isinstance(init, str) else tuple(init)
        if kind == "zeros":
            return np.zeros(self.shape, self.dtype)
        if kind == "full":
            return np.full(self.shape, params[0], self.dtype)
        rng = np.random.default_rng([self.seed, _key_seed(key), zlib.crc32(self.name.encode())])
        if kind == "normal":
            return (rng.standard_normal(self.shape) * (params[0] if params else 1.0)).astype(self.dtype)
        if kind == "uniform":
            lo, hi = params if params else (0.0, 1.0)
            return rng.uniform(lo, hi, self.shape).astype(self.dtype)
        raise TableError(f"table {self.name!r}: unknown initializer {init!r}")


def table_index(tables: list[Table]) -> dict[str, Table]:
    """Map names to tables, refusing duplicates."""
    out: dict[str, Table] = {}
    for t in tables:
        if not isinstance(t, Table):
            raise TableError(f"tables must be litz.Table instances, got {type(t).__name__} {t!r:.60}")
        if t.name in out:
            raise TableError(f"table {t.name!r} declared twice")
        out[t.name] = t
    return out


def shard_of(key: Key, num_shards: int) -> int:
    """The logical shard of a key: stable across processes and runs (never Python's salted hash)."""
    if isinstance(key, int):
        return key % num_shards
    return zlib.crc32(key.encode() if isinstance(key, str) else repr(key).encode()) % num_shards


def lookup(tables: dict[str, Table], name: Any) -> Table:
    """The table of that name, or a TableError that lists the known ones."""
    table = tables.get(name) if isinstance(name, str) else None
    if table is None:
        raise TableError(f"unknown table {name!r} (tables: {sorted(tables)})")
    return table
