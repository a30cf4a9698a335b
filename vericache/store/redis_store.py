"""`redis://HOST:PORT/DB?ttl_s=..&capacity_mb=..&prefix=..`: chunks in a Redis server.

Every value is one binary Redis string under `{prefix}k:{key}` (prefix default "vericache:"),
written with `SET ... EX ttl_s` when a TTL is given (Redis expires it). For capacity-bounded
use, `{prefix}lru` (sorted set: key -> last use time) and `{prefix}size` (hash: key -> bytes)
index the entries; a put that brings the indexed bytes over `capacity_mb` evicts the least
recently used keys. The bound is approximate when several writers share one prefix. Without
`capacity_mb`, Redis's own `maxmemory` policy is the bound. Hits, misses and traffic count
this client's calls; entries and bytes_stored count the prefix's live entries.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import redis

from vericache.errors import InvalidArgument, ResourceExhausted, Unavailable
from vericache.store.base import ChunkStore, Counters, Value, check_key, mb_to_bytes, url_params


@contextmanager
def _reachable(url: str) -> Iterator[None]:
    """Map Redis connection failures to `Unavailable`."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise Unavailable(f"redis at {url} is unreachable: {e}") from e
    except redis.ResponseError as e:
        if "OOM" in str(e):
            raise ResourceExhausted(f"redis at {url} is out of memory: {e}") from e
        raise


class RedisStore(ChunkStore):
    def __init__(self, client: redis.Redis, prefix: str = "vericache:", ttl_s: float | None = None,
                 capacity_bytes: int | None = None, where: str = "redis"):
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidArgument("ttl_s must be positive", param="ttl_s")
        self._r = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self._where = where
        self._lru, self._size = f"{prefix}lru", f"{prefix}size"
        self._counters = Counters()

    @classmethod
    def from_url(cls, url: str) -> "RedisStore":
        p = url_params(url, ttl_s=float, capacity_mb=float, prefix=str, timeout_s=float)
        parts = urlsplit(url)
        timeout = p.get("timeout_s", 10.0)
        client = redis.Redis.from_url(urlunsplit(parts._replace(query="")),
                                      socket_timeout=timeout, socket_connect_timeout=timeout)
        where = f"{parts.hostname}:{parts.port or 6379}"  # no credentials in messages
        return cls(client, prefix=p.get("prefix", "vericache:"), ttl_s=p.get("ttl_s"),
                   capacity_bytes=mb_to_bytes(p.get("capacity_mb")), where=where)

    def _k(self, key: str) -> str:
        return f"{self.prefix}k:{check_key(key)}"

    def put(self, key: str, value: Value) -> None:
        data = bytes(value)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            raise ResourceExhausted(f"value of {len(data)} bytes exceeds the store capacity of "
                                    f"{self.capacity_bytes} bytes")
        px = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        with _reachable(self._where):
            pipe = self._r.pipeline(transaction=False)
            pipe.set(self._k(key), data, px=px)
            if self.capacity_bytes is not None:
                pipe.zadd(self._lru, {key: time.time()})
                pipe.hset(self._size, key, len(data))
            pipe.execute()
            if self.capacity_bytes is not None:
                self._evict(keep=key)
        self._counters.put(len(data))

    def get(self, key: str) -> bytes | None:
        with _reachable(self._where):
            value = self._r.get(self._k(key))
            if value is not None and self.capacity_bytes is not None:
                self._r.zadd(self._lru, {key: time.time()}, xx=True)
        self._counters.got(value)
        return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with _reachable(self._where):
            values = self._r.mget([self._k(k) for k in keys])
        for v in values:
            self._counters.got(v)
        return values

    def contains(self, key: str) -> bool:
        with _reachable(self._where):
            return bool(self._r.exists(self._k(key)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with _reachable(self._where):
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            return [bool(x) for x in pipe.execute()]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        present = self.contains_many(keys)
        return present.index(False) if False in present else len(present)

    def delete(self, key: str) -> bool:
        with _reachable(self._where):
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(self._k(key))
            pipe.zrem(self._lru, key)
            pipe.hdel(self._size, key)
            return bool(pipe.execute()[0])

    def stats(self) -> dict[str, int | float | str]:
        with _reachable(self._where):
            if self.capacity_bytes is not None:
                sizes = self._prune()
                entries, stored = len(sizes), sum(sizes.values())
            else:
                pipe = self._r.pipeline(transaction=False)
                for name in self._r.scan_iter(match=f"{self.prefix}k:*", count=1000):
                    pipe.strlen(name)
                lengths = pipe.execute()
                entries, stored = len(lengths), sum(lengths)
        return {**self._counters.as_dict(), "entries": entries, "bytes_stored": stored}

    def close(self) -> None:
        self._r.close()

    def _prune(self) -> dict[str, int]:
        """Drop index entries whose values expired; the live keys' sizes."""
        sizes = {k.decode(): int(v) for k, v in self._r.hgetall(self._size).items()}
        if not sizes:
            return sizes
        pipe = self._r.pipeline(transaction=False)
        for k in sizes:
            pipe.exists(self._k(k))
        gone = [k for k, alive in zip(list(sizes), pipe.execute()) if not alive]
        if gone:
            self._r.zrem(self._lru, *gone)
            self._r.hdel(self._size, *gone)
            for k in gone:
                del sizes[k]
        return sizes

    def _evict(self, keep: str) -> None:
        """Delete least recently used entries until the indexed bytes fit the capacity."""
        sizes = {k.decode(): int(v) for k, v in self._r.hgetall(self._size).items()}
        total = sum(sizes.values())
        if total <= self.capacity_bytes:
            return
        total = sum(self._prune().values())
        for name in self._r.zrange(self._lru, 0, -1):
            if total <= self.capacity_bytes:
                break
            k = name.decode()
            if k != keep:
                total -= sizes.get(k, 0)
                self.delete(k)
