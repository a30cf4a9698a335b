"""`python -m services.gateway`: the OpenAI-compatible gateway as a service.

Flags and $VERICACHE_* variables are those of `vericache serve` (a flag beats its variable,
which beats the default). Which engine runs the requests is decided in `build_engine`. Over
the services the gateway listens at once and answers 503 with Retry-After until the drafter
and the verifier answer their Health (`services.gateway.ready`); it then reads their KV tier
and budgets and calibrates the cost model through them (--calibrate) before it is ready.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.gateway.app import serve
from services.gateway.ready import Readiness
from vericache.cli.common import add_gen_args, add_model_args, env
from services.common.auth import add_token_arg
from vericache.cli.serve import (access_policy, add_server_args, calibrate, default_params,
                                 embedded_engine, quota_limits)
from vericache.engine.api import Engine
from vericache.errors import InvalidArgument, VeriCacheError

log = logging.getLogger("vericache.gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /ready, /metrics and the page at /. The decoding "
                    "flags set the server's "
                    "defaults; a request overrides them with its own fields and its "
                    "`vericache` object {mode, compressor, ratio, draft_len}.")
    add_server_args(p)
    add_model_args(p)
    add_gen_args(p)
    g = p.add_argument_group("services (all three, or none for the embedded engine)")
    g.add_argument("--drafter", default=env("DRAFTER", None),
                   help="drafter service HOST:PORT ($VERICACHE_DRAFTER)")
    g.add_argument("--verifier", default=env("VERIFIER", None),
                   help="verifier service HOST:PORT ($VERICACHE_VERIFIER)")
    g.add_argument("--kvstore", default=env("KVSTORE", None),
                   help="kvstore service HOST:PORT, for store metrics ($VERICACHE_KVSTORE)")
    g.add_argument("--rpc-timeout-s", type=float, default=float(env("RPC_TIMEOUT_S", 300)),
                   help="deadline of each drafter/verifier call, in seconds (Release and Health: at "
                        "most 10 and 2); only the idempotent Release and Health are retried, "
                        "once (default 300; $VERICACHE_RPC_TIMEOUT_S)")
    add_token_arg(g)
    p.add_argument("--log-level", default=env("LOG_LEVEL", "WARNING"),
                   help="logging level (default: WARNING; $VERICACHE_LOG_LEVEL)")
    return p


def build_engine(args) -> tuple[Engine, Readiness]:
    """The engine behind the gateway and its readiness: rounds over the drafter and verifier
    services when --drafter and --verifier are given (only the tokenizer loads here; the
    services' KV tier and budgets are read once they first answer), else the embedded engine
    with the model in this process."""
    if not (args.drafter or args.verifier):
        engine = embedded_engine(args)
        return engine, Readiness(engine)
    if not (args.drafter and args.verifier):
        raise InvalidArgument("give both --drafter and --verifier (or neither)", "drafter")
    from vericache.engine.remote import RemoteBackends
    from vericache.engine.batch import BatchEngine
    from vericache.model.loader import load_model_info

    from vericache.engine.budget import MB, request_cost

    info = load_model_info(args.model, args.dtype)
    backends = RemoteBackends(args.drafter, args.verifier, info.vocab_size, args.rpc_timeout_s,
                              token=args.internal_token)
    engine = BatchEngine(info, max_batch=args.max_batch, max_waiting=args.max_waiting,
                         backends=backends, schedule=args.schedule)

    def learn_budgets() -> None:
        """The verifier's tier and each service's own budget, unless a flag narrows it."""
        tier, draft, verify, draft_per_token = backends.budgets(wait_s=0)
        draft = int(args.draft_kv_budget_mb * MB) if args.draft_kv_budget_mb else draft
        verify = int(args.kv_budget_mb * MB) if args.kv_budget_mb else verify
        engine.set_budgets(request_cost(info.kv_bytes_per_token, tier, draft_per_token), draft,
                           verify)
        log.info("services answer: KV tier %s, budgets drafter %s, verifier %s", tier, draft,
                 verify)
        calibrate(engine, args)  # through the services, before the gateway reports ready

    return engine, Readiness(engine, on_first_ready=learn_budgets)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        defaults = default_params(args)
        policy = access_policy(args)
        quota = quota_limits(args)
        store = None
        if args.kvstore:
            from vericache.store.grpc_store import GrpcStore

            store = GrpcStore.from_url(f"grpc://{args.kvstore}", token=args.internal_token or None)
        engine, readiness = build_engine(args)
        serve(engine, args.host, args.port, args.served_model_name, defaults, args.log_level,
              store, policy, readiness, quota)
    except VeriCacheError as e:
        print(f"gateway: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
