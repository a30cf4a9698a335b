"""`lmcache://?remote_url=redis://HOST:PORT&capacity_mb=..&name=..`: LMCache's storage engine.

Wraps LMCache v1's `StorageManager` (tested with lmcache 0.5.6): its `LocalCPUBackend` holds
values in a pre-allocated CPU pool of `capacity_mb` (default 1024) with LRU eviction, and,
with `remote_url`, its `RemoteBackend` writes every value through to that server (LMCache's
RedisConnector; a put returns once the remote has it). Reads that miss the CPU pool are served
from the remote and cached back.
A value is one uint8 memory object of shape [1, n] (format EC_TD, the pool's 2-D format);
a key becomes a `CacheEngineKey` of model `name` (default "vericache") whose chunk hash is
the SHA-256 of the key. LMCache has no TTL.

Where LMCache falls short, and what this wrapper does:
- a put of a key already in the CPU pool is ignored by LMCache: the old entry is removed first;
  a put the remote refuses raises `Unavailable` and leaves nothing behind; empty values are
  refused (`InvalidArgument`); LMCache turns a remote read failure into a miss;
- its RedisConnector cannot remove keys (`remove_sync` is not implemented): `delete` removes
  LMCache's two Redis entries (`<key>kv_bytes`, `<key>metadata`) with redis-py;
- its RedisConnector's close deadlocks its own event loop: `close` never calls it; it stops
  the connector's workers and connection on the loop, then the loop, each step bounded by
  `close_timeout_s` (default 5).
Hit/miss/traffic counters are this wrapper's; entries and bytes_stored count the CPU pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # no telemetry; must precede the lmcache imports
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # its eviction path warns on every miss

import redis  # noqa: E402
import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from vericache.errors import InvalidArgument, ResourceExhausted, Unavailable  # noqa: E402
from vericache.store.base import ChunkStore, Counters, Value, check_key, url_params  # noqa: E402

_LOCAL = "LocalCPUBackend"


class LMCacheStore(ChunkStore):
    def __init__(self, capacity_mb: float = 1024, remote_url: str | None = None,
                 name: str = "vericache", close_timeout_s: float = 5.0):
        if capacity_mb <= 0:
            raise InvalidArgument("capacity_mb must be positive", param="capacity_mb")
        if remote_url is not None and not remote_url.startswith("redis://"):
            raise InvalidArgument(f"remote_url must be redis://HOST:PORT, got {remote_url!r}",
                                  param="remote_url")
        self.name, self.remote_url, self.close_timeout_s = name, remote_url, close_timeout_s
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=True, max_local_cpu_size=capacity_mb / 1024,
            remote_url=remote_url, remote_serde="naive" if remote_url else None)
        metadata = LMCacheMetadata(model_name=name, world_size=1, local_world_size=1,
                                   worker_id=0, local_worker_id=0, kv_dtype=torch.uint8,
                                   kv_shape=(1, 1, 1, 1, 1))
        try:
            self._sm = StorageManager(config, metadata, EventManager())
        except (OSError, redis.RedisError) as e:
            raise Unavailable(f"lmcache could not start: {e}") from e
        self._redis = redis.Redis.from_url(remote_url) if remote_url else None
        self._remote = self._sm.storage_backends.get("RemoteBackend")
        self._lock = threading.Lock()  # LMCache's put (remove + put) is not atomic
        self._counters = Counters()
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> "LMCacheStore":
        p = url_params(url, remote_url=str, capacity_mb=float, name=str, close_timeout_s=float)
        return cls(**p)

    def _key(self, key: str) -> CacheEngineKey:
        digest = int(hashlib.sha256(check_key(key).encode()).hexdigest(), 16)
        return CacheEngineKey(self.name, 1, 0, digest, torch.uint8)

    def put(self, key: str, value: Value) -> None:
        data = torch.frombuffer(bytearray(value), dtype=torch.uint8) if len(value) else None
        if data is None:
            raise InvalidArgument("lmcache cannot hold an empty value", param="value")
        ck = self._key(key)
        with self._lock:
            obj = self._sm.allocate(torch.Size([1, data.numel()]), torch.uint8,
                                    fmt=MemoryFormat.EC_TD, eviction=True, busy_loop=False)
            if obj is None:
                raise ResourceExhausted(f"lmcache CPU pool cannot hold {data.numel()} bytes")
            try:
                obj.tensor.view(-1).copy_(data)
                self._sm.remove(ck, locations=[_LOCAL])  # LMCache ignores puts of present keys
                self._sm.storage_backends[_LOCAL].submit_put_task(ck, obj)
                if self._remote is not None:
                    try:
                        self._write_through(ck, obj)
                    except Unavailable:
                        self._sm.remove(ck, locations=[_LOCAL])  # all or nothing
                        raise
            finally:
                obj.ref_count_down()  # the pool keeps its own reference
        self._counters.put(data.numel())

    def _write_through(self, ck: CacheEngineKey, obj) -> None:
        if self._remote.connection is None:  # LMCache would skip the write silently
            raise Unavailable(f"lmcache remote {self.remote_url} is not connected")
        future = self._remote.submit_put_task(ck, obj)
        try:
            future.result(self.close_timeout_s)
        except Exception as e:  # noqa: BLE001 -- LMCache raises whatever its client raised
            raise Unavailable(f"lmcache remote {self.remote_url}: put failed: {e}") from e

    def get(self, key: str) -> bytes | None:
        obj = self._sm.get(self._key(key))
        value = None
        if obj is not None:
            value = obj.tensor.numpy().tobytes()
            obj.ref_count_down()
        self._counters.got(value)
        return value

    def contains(self, key: str) -> bool:
        return self._sm.contains(self._key(key)) is not None

    def longest_prefix(self, keys) -> int:
        return self._sm.batched_contains([self._key(k) for k in keys])[0] if keys else 0

    def delete(self, key: str) -> bool:
        ck = self._key(key)
        with self._lock:
            present = self._sm.contains(ck) is not None
            self._sm.remove(ck, locations=[_LOCAL])
            if self._redis is not None:
                name = ck.to_string()
                try:
                    self._redis.delete(name + "kv_bytes", name + "metadata")
                except redis.ConnectionError as e:
                    raise Unavailable(f"lmcache remote {self.remote_url} unreachable: {e}") from e
        return present

    def stats(self) -> dict[str, int | float | str]:
        local = self._sm.storage_backends[_LOCAL]
        with local.cpu_lock:
            sizes = [obj.get_size() for obj in local.hot_cache.values()]
        return {**self._counters.as_dict(), "entries": len(sizes), "bytes_stored": sum(sizes)}

    def close(self) -> None:
        """Stop LMCache within `close_timeout_s` (see the module docstring)."""
        if self._closed:
            return
        self._closed = True
        worker = threading.Thread(target=self._shutdown, name="lmcache-close", daemon=True)
        worker.start()
        worker.join(3 * self.close_timeout_s)
        if self._redis is not None:
            self._redis.close()

    def _shutdown(self) -> None:
        sm, t = self._sm, self.close_timeout_s
        for name, backend in sm.storage_backends.items():
            connector = getattr(getattr(backend, "connection", None), "_connector", None)
            if name == _LOCAL or connector is None:
                backend.close()
                continue
            executor = getattr(connector, "pq_executor", None)
            client = getattr(connector, "connection", None)
            steps = [executor.shutdown_async(wait=False)] if executor is not None else []
            steps += [client.aclose()] if hasattr(client, "aclose") else []
            for step in steps:
                try:
                    asyncio.run_coroutine_threadsafe(step, sm.loop).result(t)
                except Exception:  # noqa: BLE001 -- best effort: the loop stops below anyway
                    pass
        sm.loop.call_soon_threadsafe(sm.loop.stop)
        sm.thread.join(t)
