"""Stores as a node sees them: behind a link of some bandwidth, with a local copy in front.

- `LinkedStore(inner, gbps)`: every byte read from or written to `inner` crosses a link of
  `gbps` Gbit/s (a `TokenBucket`), the in-process stand-in for a network between a node and
  the kvstore (`grpc://...?gbps=` is the same for a real kvstore service).
- `NodeCache(inner, capacity_bytes)`: values this node read keep a local copy (least
  recently used go first), and concurrent reads of the same key wait for one transfer
  ("single flight"). So requests that share a prefix load it over the link once.

Both are `ChunkStore`s; writes go through to `inner` (and are not kept locally).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from vericache.store.base import ChunkStore, Counters, Value
from vericache.store.link import TokenBucket


class LinkedStore(ChunkStore):
    def __init__(self, inner: ChunkStore, gbps: float | None):
        if gbps is not None and gbps <= 0:
            raise ValueError(f"link bandwidth must be > 0 Gbit/s (got {gbps})")
        self.inner, self.gbps = inner, gbps
        self.bucket = TokenBucket.gbps(gbps) if gbps else None
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()

    def _pace(self, n: int, write: bool) -> None:
        with self._lock:
            if write:
                self.bytes_written += n
            else:
                self.bytes_read += n
        if self.bucket is not None:
            self.bucket.take(n)

    def put(self, key: str, value: Value) -> None:
        self._pace(len(memoryview(value).cast("B")), True)
        self.inner.put(key, value)

    def get(self, key: str) -> bytes | None:
        value = self.inner.get(key)
        if value is not None:
            self._pace(len(value), False)
        return value

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return self.inner.longest_prefix(keys)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def stats(self) -> dict:
        return {**self.inner.stats(), "link_gbps": self.gbps or 0, "link_bytes_read": self.bytes_read,
                "link_bytes_written": self.bytes_written}


class NodeCache(ChunkStore):
    def __init__(self, inner: ChunkStore, capacity_bytes: int | None = None):
        self.inner, self.capacity_bytes = inner, capacity_bytes
        self._local: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._flights: dict[str, threading.Lock] = {}
        self._counters = Counters()

    def _keep(self, key: str, value: bytes) -> None:
        with self._lock:
            old = self._local.pop(key, None)
            self._bytes += len(value) - (len(old) if old is not None else 0)
            self._local[key] = value
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes and self._local:
                _, v = self._local.popitem(last=False)
                self._bytes -= len(v)

    def _hit(self, key: str) -> bytes | None:
        with self._lock:
            value = self._local.get(key)
            if value is not None:
                self._local.move_to_end(key)
            return value

    def put(self, key: str, value: Value) -> None:
        self.inner.put(key, value)  # written through; kept locally only once read

    def get(self, key: str) -> bytes | None:
        value = self._hit(key)
        if value is None:
            with self._lock:
                flight = self._flights.setdefault(key, threading.Lock())
            with flight:  # one transfer per key; the others wait for it and then hit
                value = self._hit(key)
                if value is None:
                    value = self.inner.get(key)
                    if value is not None:
                        self._keep(key, value)
            with self._lock:
                self._flights.pop(key, None)
        self._counters.got(value)
        return value

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._local:
                return True
        return self.inner.contains(key)

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._local.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
        return self.inner.delete(key) or old is not None

    def stats(self) -> dict:
        return {**self._counters.as_dict(), "entries": len(self._local), "bytes_stored": self._bytes}
