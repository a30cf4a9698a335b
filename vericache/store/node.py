"""Stores as a node sees them: behind a link of some bandwidth, with a local copy in front.

- `LinkedStore(inner, gbps)`: every byte read from or written to `inner` crosses a link of
  `gbps` Gbit/s (a `TokenBucket`), the in-process stand-in for a network between a node and
  the kvstore (`grpc://...?gbps=` is the same for a real kvstore service).
- `NodeCache(inner, capacity_bytes, keep_writes)`: the prefix chunks this node read (and,
  with `keep_writes`, wrote) keep a local copy (least recently used go first), and concurrent
  reads of the same key wait for one transfer ("single flight"). So requests that share a
  prefix load it over the link once. The drafter and verifier services put one in front of
  the kvstore (`--node-cache-mb`), as the benchmark's remote-prefix nodes do. Only chunk keys
  are kept (`keys.is_chunk_key`): they name their content (model, tokens), so a copy never
  goes stale, while the per-request keys (tails, refreshes, selection moves) are rewritten or
  deleted by another node. Presence (`contains`, `longest_prefix`) is always the inner store's.

Both are `ChunkStore`s; writes go through to `inner`; `close` closes `inner`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from vericache.store.base import ChunkStore, Counters, Value
from vericache.store.keys import is_chunk_key
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

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(keys)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict:
        return {**self.inner.stats(), "link_gbps": self.gbps or 0, "link_bytes_read": self.bytes_read,
                "link_bytes_written": self.bytes_written}


class NodeCache(ChunkStore):
    def __init__(self, inner: ChunkStore, capacity_bytes: int | None = None,
                 keep_writes: bool = False):
        self.inner, self.capacity_bytes, self.keep_writes = inner, capacity_bytes, keep_writes
        self._local: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._flights: dict[str, threading.Lock] = {}
        self._counters = Counters()

    def _keep(self, key: str, value: bytes) -> None:
        if not is_chunk_key(key):
            return  # a per-request key: another node rewrites or deletes it
        if self.capacity_bytes is not None and len(value) > self.capacity_bytes:
            return  # larger than the whole cache: not kept, and nothing evicted for it
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
        self.inner.put(key, value)  # written through; kept locally once read (or now)
        if self.keep_writes and is_chunk_key(key):
            self._keep(key, bytes(value))
        else:
            self._drop(key)  # a rewritten key's old copy must not be served

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

    # presence is the inner store's answer: what this node holds may be gone there, and a
    # key another node must read (a compressed chunk for a drafter) has to be there
    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(keys)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return self.inner.longest_prefix(keys)

    def _drop(self, key: str) -> bool:
        with self._lock:
            old = self._local.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
        return old is not None

    def delete(self, key: str) -> bool:
        dropped = self._drop(key)
        return self.inner.delete(key) or dropped

    def close(self) -> None:
        with self._lock:
            self._local.clear()
            self._bytes = 0
        self.inner.close()

    def stats(self) -> dict:
        return {**self._counters.as_dict(), "entries": len(self._local), "bytes_stored": self._bytes}
