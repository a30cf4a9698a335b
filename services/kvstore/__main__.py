"""`python -m services.kvstore`: run the kvstore service until SIGTERM.

Flags and environment map onto `KVStoreConfig` here, in one place; a flag beats its
environment variable, which beats the default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from services.common.auth import add_token_arg
from services.kvstore.server import KVStoreConfig, serve
from vericache.errors import VeriCacheError


def parse_args(argv: list[str] | None = None) -> KVStoreConfig:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="python -m services.kvstore",
        description="Serve a VeriCache KV chunk store over gRPC "
                    "(proto/vericache/v1/kvstore.proto).")
    p.add_argument("--port", type=int, default=int(env.get("VERICACHE_KVSTORE_PORT", 50051)),
                   help="port to listen on; 0 picks a free one (env VERICACHE_KVSTORE_PORT, "
                        "default 50051)")
    p.add_argument("--host", default=env.get("VERICACHE_KVSTORE_HOST", "0.0.0.0"),
                   help="address to bind (env VERICACHE_KVSTORE_HOST, default 0.0.0.0)")
    p.add_argument("--backend", default=env.get("VERICACHE_KVSTORE_BACKEND", "memory://"),
                   help="store URL: memory://?capacity_mb=..&ttl_s=.., "
                        "redis://HOST:PORT/DB?ttl_s=..&capacity_mb=..&prefix=.., "
                        "lmcache://?remote_url=redis://HOST:PORT&capacity_mb=.. "
                        "(env VERICACHE_KVSTORE_BACKEND, default memory://)")
    p.add_argument("--workers", type=int, default=int(env.get("VERICACHE_KVSTORE_WORKERS", 16)),
                   help="threads serving calls (env VERICACHE_KVSTORE_WORKERS, default 16)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds calls in flight may finish after SIGTERM (default 5)")
    p.add_argument("--max-value-mb", type=float,
                   default=float(env.get("VERICACHE_KVSTORE_MAX_VALUE_MB", 256)),
                   help="largest value one Put may store, in MiB; larger Puts get "
                        "INVALID_ARGUMENT (env VERICACHE_KVSTORE_MAX_VALUE_MB, default 256)")
    p.add_argument("--scratch-mb", type=float,
                   default=float(env.get("VERICACHE_KVSTORE_SCRATCH_MB", 1024)),
                   help="keep per-request values (exact tails, refreshes, selection moves: "
                        "written by one service, read once by the other) in this process's "
                        "memory, up to this many MiB, instead of the backend; prefix chunks "
                        "always go to the backend; 0 = everything to the backend "
                        "(env VERICACHE_KVSTORE_SCRATCH_MB, default 1024)")
    p.add_argument("--scratch-ttl-s", type=float, default=600.0,
                   help="drop a per-request value this long after its put (default 600)")
    add_token_arg(p)
    p.add_argument("--log-level", default=env.get("VERICACHE_LOG_LEVEL", "INFO"),
                   help="logging level (env VERICACHE_LOG_LEVEL, default INFO)")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return KVStoreConfig(backend=a.backend, host=a.host, port=a.port, workers=a.workers,
                         grace_s=a.grace_s, internal_token=a.internal_token,
                         max_value_bytes=int(a.max_value_mb * (1 << 20)),
                         scratch_mb=a.scratch_mb, scratch_ttl_s=a.scratch_ttl_s)


def main(argv: list[str] | None = None) -> int:
    try:
        serve(parse_args(argv))
    except (VeriCacheError, OSError) as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
