"""The kvstore servicer: translates KVStore RPCs (proto/vericache/v1/kvstore.proto) into
`ChunkStore` calls and back. No logic beyond assembling and splitting 1 MiB pieces; errors
are the core's typed errors, mapped to status codes by `services.common.ErrorInterceptor`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.common import build_server, serve_until_signal
from vericache._proto import load
from vericache.errors import InvalidArgument, NotFound, VeriCacheError
from vericache.store import ChunkStore, open_store
from vericache.store.base import check_key
from vericache.store.keys import chunk_key, full_key
from vericache.store.link import PIECE_BYTES, pieces
from vericache.store.memory import MemoryStore
from vericache.store.split import SplitStore

log = logging.getLogger(__name__)
pb, pb_grpc = load("kvstore")

_STAT_FIELDS = ("hits", "misses", "bytes_in", "bytes_out", "entries", "bytes_stored")
# chunk-shaped, so a SplitStore asks the backend (a per-request key would stay in memory)
_HEALTH_KEY = full_key(chunk_key("vericache-health-probe", "", []))
MAX_KEYS_PER_CALL = 1 << 16  # a 16M-token prompt in 256-token chunks


@dataclass
class KVStoreConfig:
    """How to run the service; `__main__` fills it from flags and environment."""

    backend: str = "memory://"
    host: str = "0.0.0.0"
    port: int = 50051
    workers: int = 16
    grace_s: float = 5.0
    internal_token: str = ""  # shared secret every call must carry (empty: no check)
    max_value_bytes: int = 256 << 20  # largest value one Put may store
    scratch_mb: float = 1024  # per-request values in this process (SplitStore); 0: backend
    scratch_ttl_s: float = 600  # ... dropped this long after their put if never deleted

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port {self.port} outside 0..65535", param="port")
        if self.workers < 1:
            raise InvalidArgument("workers must be at least 1", param="workers")
        if self.scratch_mb < 0 or self.scratch_ttl_s <= 0:
            raise InvalidArgument("scratch_mb must be >= 0 and scratch_ttl_s > 0",
                                  param="scratch_mb")


def _check_keys(keys) -> None:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise InvalidArgument(f"{len(keys)} keys in one call, more than {MAX_KEYS_PER_CALL}",
                              param="keys")


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: ChunkStore, backend: str, max_value_bytes: int = 256 << 20):
        self.store = store
        self.backend = backend
        self.max_value_bytes = max_value_bytes

    def Put(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.key:
            raise InvalidArgument("the first piece of a Put must carry the key", param="key")
        check_key(first.key)
        if first.total_bytes > self.max_value_bytes:
            raise InvalidArgument(f"value of {first.total_bytes} bytes exceeds the "
                                  f"{self.max_value_bytes}-byte limit", param="total_bytes")
        buf = bytearray()
        for req in itertools.chain([first], request_iterator):
            if len(req.data) > PIECE_BYTES:
                raise InvalidArgument(f"piece of {len(req.data)} bytes exceeds {PIECE_BYTES}",
                                      param="data")
            buf += req.data
            if len(buf) > first.total_bytes:
                raise InvalidArgument(f"more than the announced {first.total_bytes} bytes",
                                      param="total_bytes")
        if len(buf) != first.total_bytes:
            raise InvalidArgument(f"received {len(buf)} bytes, expected {first.total_bytes}",
                                  param="total_bytes")
        t0 = time.perf_counter()
        self.store.put(first.key, buf)
        return pb.PutResponse(bytes_stored=len(buf), backend_seconds=time.perf_counter() - t0)

    def Get(self, request, context):
        value = self.store.get(request.key)
        if value is None:
            raise NotFound(f"no value under key {request.key!r}")
        for i, piece in enumerate(pieces(value, PIECE_BYTES)):
            yield pb.GetResponse(total_bytes=len(value) if i == 0 else 0, data=bytes(piece))

    def Contains(self, request, context):
        _check_keys(request.keys)
        return pb.ContainsResponse(present=self.store.contains_many(list(request.keys)))

    def LongestPrefix(self, request, context):
        _check_keys(request.keys)
        return pb.LongestPrefixResponse(count=self.store.longest_prefix(list(request.keys)))

    def Delete(self, request, context):
        return pb.DeleteResponse(deleted=self.store.delete(request.key))

    def Stats(self, request, context):
        stats = self.store.stats()
        extra = {k: float(v) for k, v in stats.items()
                 if k not in _STAT_FIELDS and isinstance(v, (int, float))}
        return pb.StatsResponse(**{k: int(stats.get(k, 0)) for k in _STAT_FIELDS}, extra=extra)

    def Health(self, request, context):
        try:
            self.store.contains(_HEALTH_KEY)
        except VeriCacheError as e:
            return pb.HealthResponse(status=pb.HealthResponse.STATUS_NOT_SERVING,
                                     backend=self.backend, detail=str(e))
        return pb.HealthResponse(status=pb.HealthResponse.STATUS_SERVING, backend=self.backend)


def serve(config: KVStoreConfig) -> None:
    """Open the backend, serve until SIGTERM, close the backend (also when startup fails)."""
    store = open_store(config.backend)
    if config.scratch_mb:
        store = SplitStore(store, MemoryStore(int(config.scratch_mb * (1 << 20)),
                                              config.scratch_ttl_s))
    try:
        scheme = urlsplit(config.backend).scheme or config.backend
        servicer = KVStoreServicer(store, scheme, config.max_value_bytes)
        server, port = build_server(lambda s: pb_grpc.add_KVStoreServicer_to_server(servicer, s),
                                    host=config.host, port=config.port, max_workers=config.workers,
                                    internal_token=config.internal_token)
        log.info("kvstore serving on %s:%d, backend %s", config.host, port, scheme)
        print(f"kvstore: serving on {config.host}:{port} backend={scheme}", flush=True)
        serve_until_signal(server, grace_s=config.grace_s)
    finally:
        store.close()
