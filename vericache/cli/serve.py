"""`vericache serve`: the embedded gateway, an OpenAI-compatible HTTP server over a
`BatchEngine` in this process: drafter, verifier and a memory:// prefix-cache store in one
process (no services needed)."""

from __future__ import annotations

import argparse
import logging
import sys

from vericache.cli.common import (add_gen_args, add_memory_args, add_model_args, add_tier_args,
                                  env, gen_params)
from vericache.compress import make_compressor
from vericache.engine.generation import GenParams

log = logging.getLogger(__name__)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Flags of the HTTP server and the embedded engine (each with its $VERICACHE_* default)."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default=env("GATEWAY_HOST", "127.0.0.1"),
                   help="address to bind; 0.0.0.0 for every interface "
                        "(default: 127.0.0.1; $VERICACHE_GATEWAY_HOST)")
    g.add_argument("--port", type=int, default=int(env("GATEWAY_PORT", 8000)),
                   help="port to listen on (default: 8000; $VERICACHE_GATEWAY_PORT)")
    g.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME", None),
                   help="the model name clients send and /v1/models lists "
                        "(default: the model's own name; $VERICACHE_SERVED_MODEL_NAME)")
    g.add_argument("--max-batch", type=int, default=int(env("MAX_BATCH", 16)),
                   help="requests decoded together at most (default: 16; $VERICACHE_MAX_BATCH)")
    g.add_argument("--max-waiting", type=int, default=int(env("MAX_WAITING", 64)),
                   help="requests queued before new ones get 429 "
                        "(default: 64; $VERICACHE_MAX_WAITING)")
    g.add_argument("--schedule", choices=("lockstep", "staggered"),
                   default=env("SCHEDULE", "lockstep"),
                   help="lockstep: every request drafts, then every one verifies; staggered: "
                        "one half of the batch verifies while the other drafts, and new "
                        "requests are prefilled on a lane of their own "
                        "(default: lockstep; $VERICACHE_SCHEDULE)")
    g.add_argument("--calibrate", choices=("on", "off"), default=env("CALIBRATE", "on"),
                   help="on: before serving, time a few rounds of synthetic requests through "
                        "the backends (vericache/engine/calibrate.py; seconds on a CPU), so the "
                        "cost model chooses each round's k from measured costs from the first "
                        "request; off: it explores its first rounds instead "
                        "(default: on; $VERICACHE_CALIBRATE)")
    add_memory_args(g, ("verifier", "drafter"), admission=True)
    add_tier_args(g, services=True)
    g.add_argument("--store", default=env("STORE", "memory://?capacity_mb=2048"),
                   help="prefix-cache store of the embedded engine: memory://?capacity_mb=N, "
                        "redis://HOST:PORT/DB, lmcache://..., grpc://HOST:PORT, or none "
                        "(default: memory://?capacity_mb=2048; $VERICACHE_STORE)")
    a = p.add_argument_group("access (see services/gateway/auth.py)")
    a.add_argument("--api-key", default=env("API_KEY", ""),
                   help="API keys, comma-separated: /v1/* then needs 'Authorization: Bearer "
                        "KEY' (401 otherwise); /health and /metrics stay open "
                        "(default: none, open; $VERICACHE_API_KEY, preferred: flags show in ps)")
    a.add_argument("--tenant", action="append", metavar="KEY=NAME",
                   default=[t for t in env("TENANTS", "").split(",") if t],
                   help="prefix-cache namespace of an API key (repeatable; default for a key: "
                        "t- + 12 hex digits of its sha256; $VERICACHE_TENANTS, comma-separated)")
    a.add_argument("--shared-prefix-cache", action="store_true",
                   default=env("SHARED_PREFIX_CACHE", "") in ("1", "true", "yes"),
                   help="one prefix-cache namespace for all API keys, so tenants reuse each "
                        "other's cached prefixes (default: one namespace per key; "
                        "$VERICACHE_SHARED_PREFIX_CACHE=1)")
    a.add_argument("--max-body-bytes", type=int, default=int(env("MAX_BODY_BYTES", 2 << 20)),
                   help="largest HTTP request body; larger ones get 413 "
                        "(default: 2097152; $VERICACHE_MAX_BODY_BYTES)")
    q = p.add_argument_group("quotas per API key (see services/gateway/quota.py; 429 with "
                             "Retry-After past them; without API keys all callers share one)")
    q.add_argument("--max-concurrent-per-key", type=int,
                   default=int(env("MAX_CONCURRENT_PER_KEY", 0)),
                   help="completion requests one key may have in flight; 0 = unlimited "
                        "(default: 0; $VERICACHE_MAX_CONCURRENT_PER_KEY)")
    q.add_argument("--tokens-per-minute-per-key", type=int,
                   default=int(env("TOKENS_PER_MINUTE_PER_KEY", 0)),
                   help="prompt + completion tokens one key may use in any 60 s; 0 = unlimited "
                        "(default: 0; $VERICACHE_TOKENS_PER_MINUTE_PER_KEY)")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server (embedded engine)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                    "/metrics over an engine in this process. The decoding flags set the "
                    "server's defaults; a request overrides them with its own fields and its "
                    "`vericache` object {mode, compressor, ratio, draft_len}.")
    add_server_args(p)
    add_model_args(p)
    add_gen_args(p)
    p.set_defaults(run=run)


def default_params(args) -> GenParams:
    """The server's default GenParams; bad flags fail here, before the model loads."""
    params = gen_params(args)
    if params.mode != "full":
        make_compressor(params.compressor, params.ratio)
    return params


def access_policy(args):
    """The gateway's AccessPolicy from the access flags (bad ones fail before the model loads)."""
    from services.gateway.auth import AccessPolicy
    from vericache.errors import InvalidArgument

    try:
        return AccessPolicy.from_flags(args.api_key, args.tenant, args.shared_prefix_cache,
                                       args.max_body_bytes)
    except ValueError as e:
        raise InvalidArgument(str(e), "api_key") from None


def quota_limits(args):
    """The gateway's per-key QuotaLimits from the quota flags (bad ones fail before the model
    loads)."""
    from services.gateway.quota import QuotaLimits
    from vericache.errors import InvalidArgument

    try:
        return QuotaLimits(args.max_concurrent_per_key, args.tokens_per_minute_per_key)
    except ValueError as e:
        raise InvalidArgument(str(e), "max_concurrent_per_key") from None


def embedded_engine(args):
    """Load the model and start a BatchEngine over it."""
    from vericache.engine.batch import BatchEngine
    from vericache.model import load_model

    print(f"loading model {args.model or 'smollm2-135m-instruct (default)'} ...",
          file=sys.stderr, flush=True)
    from vericache.engine.rounds import LocalBackends
    from vericache.store import open_store

    from vericache.engine.budget import budget_bytes, request_cost
    from vericache.engine.kvtier import make_tier

    lm = load_model(args.model, args.dtype, args.device)
    store = None if args.store in ("", "none") else open_store(args.store)
    tier = make_tier(args.kv_tier, args.tier_link_gbps or None, lm.runner.device)
    engine = BatchEngine(lm, max_batch=args.max_batch, max_waiting=args.max_waiting,
                         backends=LocalBackends(lm, store, tier), schedule=args.schedule,
                         cost=request_cost(lm.runner.kv_bytes_per_token(), args.kv_tier,
                                           lm.runner.draft_kv_bytes_per_token()),
                         draft_budget=budget_bytes(args.draft_kv_budget_mb, "drafter", args.device),
                         verify_budget=budget_bytes(args.kv_budget_mb, "verifier", args.device))
    calibrate(engine, args)
    return engine


def calibrate(engine, args) -> None:
    """The engine's start-up calibration, unless --calibrate off; a failure is logged and the
    cost model explores instead (serving never depends on it)."""
    if args.calibrate != "on":
        return
    print("calibrating the cost model ...", file=sys.stderr, flush=True)
    try:
        engine.calibrate(default_params(args))
    except Exception as e:  # noqa: BLE001 -- the engine still serves, exploring its first rounds
        log.warning("calibration failed (%s: %s); the cost model will explore its first rounds",
                    type(e).__name__, e)


def run(args) -> int:
    from services.gateway import serve

    defaults = default_params(args)
    policy = access_policy(args)
    quota = quota_limits(args)
    engine = embedded_engine(args)
    serve(engine, args.host, args.port, args.served_model_name, defaults, args.log_level,
          policy=policy, quota=quota)
    return 0
