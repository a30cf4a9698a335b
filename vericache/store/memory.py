"""`memory://?capacity_mb=..&ttl_s=..`: the embedded store, a dict in this process.

Least-recently-used entries are evicted when the values exceed `capacity_mb` (default:
unbounded); an entry older than `ttl_s` seconds since its put is gone (default: never).
A value larger than the whole capacity raises `ResourceExhausted`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from vericache.errors import InvalidArgument, ResourceExhausted
from vericache.store.base import ChunkStore, Counters, Value, check_key, mb_to_bytes, url_params


class MemoryStore(ChunkStore):
    def __init__(self, capacity_bytes: int | None = None, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise InvalidArgument("capacity must be positive", param="capacity_mb")
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidArgument("ttl_s must be positive", param="ttl_s")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # key -> (value, expiry time); least recently used first
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._evictions = 0
        self._lock = threading.Lock()
        self._counters = Counters()

    @classmethod
    def from_url(cls, url: str) -> "MemoryStore":
        p = url_params(url, capacity_mb=float, ttl_s=float)
        return cls(capacity_bytes=mb_to_bytes(p.get("capacity_mb")), ttl_s=p.get("ttl_s"))

    def put(self, key: str, value: Value) -> None:
        check_key(key)
        data = bytes(value)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            raise ResourceExhausted(f"value of {len(data)} bytes exceeds the store capacity of "
                                    f"{self.capacity_bytes} bytes")
        expiry = float("inf") if self.ttl_s is None else self._clock() + self.ttl_s
        with self._lock:
            self._drop(key)
            self._entries[key] = (data, expiry)
            self._bytes += len(data)
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self._evictions += 1
        self._counters.put(len(data))

    def keys(self) -> list[str]:
        """Every key held now (expired ones included until they are next touched)."""
        with self._lock:
            return list(self._entries)

    def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            value = self._live(key)
            if value is not None:
                self._entries.move_to_end(key)
        self._counters.got(value)
        return value

    def contains(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return self._live(key) is not None

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            present = self._live(key) is not None
            self._drop(key)
            return present

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            now = self._clock()
            for key in [k for k, (_, exp) in self._entries.items() if exp <= now]:
                self._drop(key)
            entries, stored, evictions = len(self._entries), self._bytes, self._evictions
        return {**self._counters.as_dict(), "entries": entries, "bytes_stored": stored,
                "evictions": evictions}

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _live(self, key: str) -> bytes | None:
        """The value if present and not expired (drops it if expired). Holds the lock."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            self._drop(key)
            return None
        return entry[0]

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[0])
