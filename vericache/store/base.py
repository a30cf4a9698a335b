"""The KV chunk store interface: bytes by key, with prefix lookup.

A value is one serialized chunk (see `vericache.store.codec`); a key is a stored key from
`vericache.store.keys` (a prefix's chained hash plus the kind: full or compressed). Methods,
when they are called and how often:
- `put(key, value)`: once per chunk a prefill computes (full and each compressed form).
  Overwrites. May evict other entries (capacity) and may raise `ResourceExhausted` when the
  value can never fit. Side effect: the entry exists until deleted, evicted or expired (TTL).
- `get(key) -> bytes | None`: once per chunk a drafter attaches or a verifier loads;
  None on a miss. Counts a hit (and bytes out) or a miss.
- `contains(key) -> bool`: cheap existence check; no data moves, no hit/miss counted.
- `longest_prefix(keys) -> int`: once per request before prefill: how many leading keys are
  present (keys name prefixes, so a present key after a missing one is useless).
- `delete(key) -> bool`: when a chunk is invalidated; True if it existed.
- `stats() -> dict`: for metrics: hits, misses, bytes_in, bytes_out, entries, bytes_stored
  (backends may add more, e.g. transfer seconds of a remote link).
- `close()`: once, at shutdown; idempotent.
Batched variants (`put_many`, `get_many`, `contains_many`) default to loops over the single
calls; backends override them when one round trip can serve many keys.

Every method may raise `Unavailable` (backend unreachable) and `InvalidArgument` (bad key).
Implementations are thread-safe: a gRPC server calls them from many threads.
A new backend subclasses `ChunkStore` and is registered by URL scheme in
`vericache/store/registry.py`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from vericache.errors import InvalidArgument

MAX_KEY_LEN = 512
Value = bytes | bytearray | memoryview


def check_key(key: str) -> str:
    """Raise `InvalidArgument` unless `key` is a non-empty printable string of bounded length."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN or not key.isprintable():
        raise InvalidArgument(f"bad key {key!r}: need 1..{MAX_KEY_LEN} printable characters",
                              param="key")
    return key


def url_params(url: str, **types: Callable[[str], Any]) -> dict[str, Any]:
    """The query parameters of a store URL, converted by `types`; unknown ones are an error."""
    params: dict[str, Any] = {}
    for name, raw in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name not in types:
            valid = ", ".join(sorted(types)) or "none"
            raise InvalidArgument(f"unknown parameter {name!r} in store URL; valid: {valid}",
                                  param="url")
        try:
            params[name] = types[name](raw)
        except ValueError as e:
            raise InvalidArgument(f"bad value {raw!r} for {name!r} in store URL: {e}",
                                  param="url") from e
    return params


def mb_to_bytes(mb: float | None) -> int | None:
    """A capacity in MiB (None: unbounded) as bytes."""
    return None if mb is None else int(mb * (1 << 20))


@dataclass
class Counters:
    """Hit/miss and traffic counters every backend keeps (thread-safe)."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def put(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in += nbytes

    def got(self, value: Value | None) -> None:
        with self._lock:
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self.bytes_out += len(value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "bytes_in": self.bytes_in,
                    "bytes_out": self.bytes_out}


class ChunkStore(ABC):
    """Serialized KV chunks by key. See the module docstring for the contract."""

    @abstractmethod
    def put(self, key: str, value: Value) -> None:
        """Store `value` under `key` (overwrites)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `key` is present (no hit or miss counted)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; True if it was present."""

    @abstractmethod
    def stats(self) -> dict[str, int | float | str]:
        """hits, misses, bytes_in, bytes_out, entries, bytes_stored (and backend extras)."""

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are present."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def put_many(self, items: Iterable[tuple[str, Value]]) -> None:
        for key, value in items:
            self.put(key, value)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def close(self) -> None:
        """Release connections and memory; idempotent."""

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
