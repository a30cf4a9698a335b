"""Every store backend, registered by URL scheme in this one file; classes load lazily.

    open_store("memory://?capacity_mb=512&ttl_s=600")
    open_store("redis://127.0.0.1:6379/0?ttl_s=3600&capacity_mb=4096")
    open_store("lmcache://?remote_url=redis://127.0.0.1:6379&capacity_mb=1024")
    open_store("grpc://127.0.0.1:50051?gbps=1.0")

A backend class has `from_url(url) -> ChunkStore` and validates its own query parameters.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from vericache.errors import UnknownName
from vericache.store.base import ChunkStore

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_store(scheme: str, module: str, cls: str) -> None:
    """Make `scheme://...` URLs open `module.cls` (imported on first use)."""
    if scheme in _REGISTRY:
        raise ValueError(f"store scheme {scheme!r} is already registered")
    _REGISTRY[scheme] = (module, cls)


def store_schemes() -> list[str]:
    return sorted(_REGISTRY)


def store_class(scheme: str) -> type[ChunkStore]:
    try:
        module, cls = _REGISTRY[scheme]
    except KeyError:
        valid = ", ".join(f"{s}://" for s in store_schemes())
        raise UnknownName(f"unknown store scheme {scheme!r}; valid: {valid}", param="url") from None
    return getattr(importlib.import_module(module), cls)


def open_store(url: str) -> ChunkStore:
    """The store a URL names: its scheme picks the backend, the rest configures it."""
    scheme = urlsplit(url).scheme if "://" in url else url
    return store_class(scheme).from_url(url)


register_store("memory", "vericache.store.memory", "MemoryStore")
register_store("redis", "vericache.store.redis_store", "RedisStore")
register_store("lmcache", "vericache.store.lmcache_store", "LMCacheStore")
register_store("grpc", "vericache.store.grpc_store", "GrpcStore")
