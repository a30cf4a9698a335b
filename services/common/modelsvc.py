"""What the drafter and verifier services share: flags, the model, the store client, the
TTL reaper and the lock that serialises model work (one runner, many gRPC threads)."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from services.common.auth import add_token_arg
from vericache.cli.common import BUDGET_FLAGS, add_memory_args, add_model_args, add_tier_args
from vericache.engine.budget import MB, Ledger, budget_bytes
from vericache.engine.remote import MODEL_MESSAGE_BYTES
from vericache.engine.rounds import ARENA_SLOTS
from vericache.engine.ttl import SessionClock
from vericache.errors import VeriCacheError
from vericache.memory import IdleTrim, resident_mb
from vericache.model import load_model
from vericache.store import open_store

log = logging.getLogger(__name__)



def add_args(p: argparse.ArgumentParser, name: str, port: int) -> None:
    env = os.environ
    up = name.upper()
    p.add_argument("--port", type=int, default=int(env.get(f"VERICACHE_{up}_PORT", port)),
                   help=f"port to listen on; 0 picks a free one (env VERICACHE_{up}_PORT, default {port})")
    p.add_argument("--host", default=env.get(f"VERICACHE_{up}_HOST", "0.0.0.0"),
                   help=f"address to bind (env VERICACHE_{up}_HOST, default 0.0.0.0)")
    p.add_argument("--kvstore", default=env.get("VERICACHE_KVSTORE", "127.0.0.1:50051"),
                   help="kvstore service HOST:PORT, or a store URL such as memory:// or "
                        "grpc://HOST:PORT?timeout_s=S (the deadline of each kvstore call, "
                        "default 60; idempotent, retried once on UNAVAILABLE) "
                        "(env VERICACHE_KVSTORE, default 127.0.0.1:50051)")
    p.add_argument("--link-gbps", type=float, default=float(env.get(f"VERICACHE_{up}_LINK_GBPS", 0)),
                   help=f"bandwidth of the link to the kvstore in Gbit/s, 0 = unlimited "
                        f"(env VERICACHE_{up}_LINK_GBPS)")
    p.add_argument("--node-cache-mb", type=float,
                   default=float(env.get(f"VERICACHE_{up}_NODE_CACHE_MB", 1024)),
                   help=f"keep up to this many MiB of the chunks read from or written to the "
                        f"kvstore service in this process, so requests that share a prefix "
                        f"fetch it once (the embedded server's memory:// store does the same); "
                        f"0 = none (env VERICACHE_{up}_NODE_CACHE_MB, default 1024)")
    g = p.add_argument_group("KV memory")
    if name == "verifier":
        add_tier_args(g)
    add_memory_args(g, (name,), admission=False)
    p.add_argument("--session-ttl-s", type=float,
                   default=float(env.get("VERICACHE_SESSION_TTL_S", 600)),
                   help="free a session idle this long (env VERICACHE_SESSION_TTL_S, default 600)")
    p.add_argument("--workers", type=int, default=16, help="threads serving calls (default 16)")
    add_token_arg(p)
    add_model_args(p)
    p.add_argument("--log-level", default=env.get("VERICACHE_LOG_LEVEL", "INFO"),
                   help="logging level (env VERICACHE_LOG_LEVEL, default INFO)")


def open_service_store(url: str, token: str = "", node_cache_bytes: int = 0):
    """The store a URL names; a kvstore service client (grpc://) sends the internal token and,
    with `node_cache_bytes`, keeps a local copy of what it moves (`NodeCache`)."""
    if url.startswith("grpc://"):
        from vericache.store.grpc_store import GrpcStore
        from vericache.store.node import NodeCache

        store = GrpcStore.from_url(url, token=token or None)
        return NodeCache(store, node_cache_bytes, keep_writes=True) if node_cache_bytes else store
    return open_store(url)


def store_url(kvstore: str, gbps: float) -> str:
    """HOST:PORT means the kvstore service (grpc://); anything with a scheme is a store URL."""
    url = kvstore if "://" in kvstore else f"grpc://{kvstore}"
    if gbps and url.startswith("grpc://"):
        url += ("&" if "?" in url else "?") + f"gbps={gbps}"
    return url


@dataclass
class ModelService:
    """The loaded model, the store and the session clock of one drafter or verifier."""

    lm: object
    store: object
    clock: SessionClock
    lock: threading.Lock
    tier: object = None  # the verifier's OffloadedTier, or None (resident)
    tier_name: str = ""
    ledger: Ledger = field(default_factory=lambda: Ledger(None, ""))  # this side's KV budget
    idle: IdleTrim = field(default_factory=IdleTrim)  # freed memory back once idle

    @classmethod
    def from_args(cls, a) -> "ModelService":
        logging.basicConfig(level=a.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from vericache.engine.kvtier import make_tier

        tier_name = getattr(a, "kv_tier", "")
        if tier_name:  # the verifier
            if a.tier_link_gbps < 0:
                raise VeriCacheError("--tier-link-gbps must be >= 0")
            if tier_name == "resident" and a.tier_link_gbps:
                raise VeriCacheError("--tier-link-gbps needs --kv-tier offloaded")
        lm = load_model(a.model, a.dtype, a.device)
        # this side's caches in shared pools (`Runner.new_cache(arena=)`): a batch's passes copy
        # no cache to pool it
        lm.runner.arena_slots = ARENA_SLOTS
        tier = make_tier(tier_name, a.tier_link_gbps or None, lm.runner.device) if tier_name else None
        mb = a.kv_budget_mb if tier_name else a.draft_kv_budget_mb
        side = "verifier" if tier_name else "drafter"
        if a.node_cache_mb < 0:
            raise VeriCacheError("--node-cache-mb must be >= 0")
        url = store_url(a.kvstore, a.link_gbps)
        node_cache = int(a.node_cache_mb * MB) if url.startswith("grpc://") else 0
        # on CPU the node cache takes host memory that the default KV budget must leave free
        reserved = node_cache if lm.runner.device.type == "cpu" else 0
        ledger = Ledger(budget_bytes(mb, side, lm.runner.device, reserved), BUDGET_FLAGS[side][0])
        store = open_service_store(url, a.internal_token, node_cache)
        return cls(lm, store, SessionClock(a.session_ttl_s), threading.Lock(), tier, tier_name,
                   ledger)

    def start_reaper(self, release, period_s: float = 5.0) -> threading.Thread:
        """Release sessions idle past the TTL, every `period_s`."""
        def loop():
            while True:
                time.sleep(period_s)
                for rid in self.clock.expired(time.monotonic()):
                    log.info("session %s expired", rid)
                    with self.lock:
                        release(rid)

        t = threading.Thread(target=loop, name="session-reaper", daemon=True)
        t.start()
        return t

    def start_idle_trim(self, sessions, period_s: float = 0.25) -> threading.Thread | None:
        """Give freed memory back once no session has been open for `idle.after_s`
        (`vericache.memory`): `sessions()` counts the open ones; the trim runs under the lock
        that serialises model work, so no pass runs while malloc trims, and the thread takes
        that lock only when no session is open."""
        if self.idle.after_s <= 0:
            return None

        def loop():
            while True:
                time.sleep(period_s)
                if sessions():  # busy: no need to wait for the lock a pass holds
                    self.idle.busy()
                    continue
                with self.lock:
                    if sessions():
                        self.idle.busy()
                        continue
                    before = resident_mb()
                    if self.idle.poll():
                        log.info("idle: freed memory given back, resident %.0f -> %.0f MB",
                                 before, resident_mb())

        t = threading.Thread(target=loop, name="idle-trim", daemon=True)
        t.start()
        return t


def run_model_service(name: str, port: int, servicer_cls, add_to_server, argv=None) -> int:
    """`python -m services.<name>`: flags, model, servicer, TTL reaper, serve until SIGTERM."""
    import sys

    from services.common import build_server, serve_until_signal
    from vericache.errors import VeriCacheError

    p = argparse.ArgumentParser(
        prog=f"python -m services.{name}",
        description=f"Serve the VeriCache {name} over gRPC (proto/vericache/v1/{name}.proto).")
    add_args(p, name, port)
    a = p.parse_args(argv)
    try:
        svc = ModelService.from_args(a)
        servicer = servicer_cls(svc)
        svc.start_reaper(servicer.core.release)
        svc.start_idle_trim(lambda: len(servicer.core.sessions))
        server, bound = build_server(lambda s: add_to_server(servicer, s), host=a.host, port=a.port,
                                     max_workers=a.workers, max_message_bytes=MODEL_MESSAGE_BYTES,
                                     internal_token=a.internal_token)
        print(f"{name}: serving on {a.host}:{bound} model={svc.lm.model_id}", flush=True)
        serve_until_signal(server, on_stop=svc.store.close)
    except (VeriCacheError, OSError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    return 0


class SessionServicer:
    """Release and Health, the same on the drafter and the verifier (`self.core` holds the
    sessions; their messages live in verifier.proto)."""

    drafts = False  # True on the drafter: its sessions' K/V are in the runner's draft_dtype

    def Release(self, req, context):
        from services.common.convert import request_id
        from vericache._proto import load

        vpb, _ = load("verifier")
        rid = request_id(req.request_id)
        with self.svc.lock:
            had = rid in self.core.sessions
            self.core.release(rid)
            self.svc.idle.busy()  # a session that began and ended between two polls counts
        self.svc.clock.forget(rid)
        self.drop_request_keys(rid)
        return vpb.ReleaseResponse(released=had)

    def drop_request_keys(self, rid: str) -> None:
        """Delete the per-request values the verifier leaves for the drafter (the exact KV
        of the last verified tokens, moves of the drafter's set): a request that ends between
        the put and the read would leave them in the kvstore until its scratch TTL. Both
        services do it on Release (either may be the one that answers last); never raises."""
        from vericache.store.keys import refresh_key, select_key

        for key in (refresh_key, select_key):
            try:
                self.svc.store.delete(key(rid))
            except Exception:  # noqa: BLE001 -- releasing never fails on the store
                pass

    def Health(self, req, context):
        from vericache._proto import load

        vpb, _ = load("verifier")
        ledger, runner = self.svc.ledger, self.svc.lm.runner
        per_token = (runner.draft_kv_bytes_per_token() if self.drafts
                     else runner.kv_bytes_per_token())
        return vpb.ServiceHealthResponse(ok=True, sessions=len(self.core.sessions),
                                         model_id=self.svc.lm.model_id, kv_tier=self.svc.tier_name,
                                         kv_budget_bytes=ledger.budget or 0,
                                         kv_in_use_bytes=ledger.in_use,
                                         kv_bytes_per_token=per_token)
