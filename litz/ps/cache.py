"""The process cache: one per worker process, shared by all its executors (DESIGN.md §2).

An entry is ``(value, version)``: the value as fetched by a task of that version. A task of
version ``v`` may use an entry iff its version is ``>= v``; otherwise it needs a fetch, and
concurrent needs of one key are coalesced: a new fetch is sent only when no fetch in flight
was tagged with a version ``>= v``. Tasks waiting for a key are woken by the first reply whose
version covers theirs. This class holds no sockets; the worker sends what ``request`` says.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

CacheKey = tuple[str, Hashable]


class ProcessCache:
    """Version-tagged cache with coalesced fetches and waiters (tokens are opaque to the cache)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._entries: dict[CacheKey, tuple[np.ndarray, int]] = {}
        self._inflight: dict[CacheKey, int] = {}
        self._waiters: dict[CacheKey, list[tuple[int, Any]]] = {}
        self.hits = 0
        self.misses = 0
        self.fetches = 0
        self.coalesced = 0
        self.prefetches = 0

    def lookup(self, table: str, key: Hashable, version: int) -> np.ndarray | None:
        """The cached value if a task of ``version`` may use it, else None (a miss)."""
        if self.enabled:
            entry = self._entries.get((table, key))
            if entry is not None and entry[1] >= version:
                self.hits += 1
                return entry[0]
        self.misses += 1
        return None

    def covers(self, table: str, key: Hashable, version: int) -> bool:
        """Whether a task of ``version`` would find the key here or in flight (no fetch needed);
        counts nothing (for prefetching)."""
        ck = (table, key)
        entry = self._entries.get(ck)
        inflight = self._inflight.get(ck)
        return self.enabled and ((entry is not None and entry[1] >= version)
                                 or (inflight is not None and inflight >= version))

    def prefetch(self, table: str, key: Hashable, version: int) -> bool:
        """Mark a fetch of the key at ``version`` in flight with nobody waiting yet (a queued
        task's hint); True if it must be sent. Tasks that ask later coalesce with it."""
        if not self.enabled or self.covers(table, key, version):
            return False
        ck = (table, key)
        inflight = self._inflight.get(ck)
        if inflight is None or version > inflight:
            self._inflight[ck] = version
        self.fetches += 1
        self.prefetches += 1
        return True

    def request(self, table: str, key: Hashable, version: int, token: Any) -> bool:
        """Register ``token`` as waiting for the key at ``version``; True if a fetch must be sent."""
        ck = (table, key)
        self._waiters.setdefault(ck, []).append((version, token))
        inflight = self._inflight.get(ck)
        if self.enabled and inflight is not None and inflight >= version:
            self.coalesced += 1
            return False
        if inflight is None or version > inflight:
            self._inflight[ck] = version
        self.fetches += 1
        return True

    def fill(self, table: str, key: Hashable, value: np.ndarray, version: int) -> list[tuple[Any, np.ndarray]]:
        """A fetch tagged ``version`` returned ``value``: store it, return the (token, value) woken."""
        ck = (table, key)
        entry = self._entries.get(ck)
        if entry is None or version >= entry[1]:
            self._entries[ck] = (value, version)
        if self._inflight.get(ck, -1) <= version:
            self._inflight.pop(ck, None)
        waiting = self._waiters.get(ck)
        if not waiting:
            return []
        if self.enabled:
            woken = [(tok, value) for v, tok in waiting if v <= version]
            rest = [(v, tok) for v, tok in waiting if v > version]
        else:  # every request sent its own fetch, tagged with its task's version: a reply serves one
            # requester of exactly its version (replies may come in another order than their fetches
            # went, one forwarded by a shard's old owner, one straight from the new: taking the first
            # waiter of any older version, a newer reply left an older one nobody to wake, and raised)
            own = [i for i, (v, _) in enumerate(waiting) if v == version]
            if not own:
                return []
            woken = [(waiting[own[0]][1], value)]
            rest = waiting[:own[0]] + waiting[own[0] + 1:]
        if rest:
            self._waiters[ck] = rest
        else:
            del self._waiters[ck]
        return woken

    def fail(self, table: str, key: Hashable) -> list[Any]:
        """A fetch failed: forget it and return every token waiting for the key."""
        ck = (table, key)
        self._inflight.pop(ck, None)
        return [tok for _, tok in self._waiters.pop(ck, [])]

    def invalidate(self) -> None:
        """Drop every entry (waiters and in-flight fetches stay)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def counters(self) -> dict[str, int]:
        return {"cache_hits": self.hits, "cache_misses": self.misses, "fetches": self.fetches,
                "coalesced": self.coalesced, "prefetches": self.prefetches, "cache_entries": len(self._entries)}
