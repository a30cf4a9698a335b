"""`python -m services.gateway`: the OpenAI-compatible gateway as a service.

Flags and $VERICACHE_* variables are those of `vericache serve` (a flag beats its variable,
which beats the default). Which engine runs the requests is decided in `build_engine`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.gateway.app import serve
from vericache.cli.common import add_gen_args, add_model_args, env
from vericache.cli.serve import add_server_args, default_params, embedded_engine
from vericache.engine.api import Engine
from vericache.errors import VeriCacheError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics. The decoding flags set the server's "
                    "defaults; a request overrides them with its own fields and its "
                    "`vericache` object {mode, compressor, ratio, draft_len}.")
    add_server_args(p)
    add_model_args(p)
    add_gen_args(p)
    p.add_argument("--log-level", default=env("LOG_LEVEL", "WARNING"),
                   help="logging level (default: WARNING; $VERICACHE_LOG_LEVEL)")
    return p


def build_engine(args) -> Engine:
    """The engine behind the gateway: the embedded BatchEngine (model in this process)."""
    return embedded_engine(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        defaults = default_params(args)
        serve(build_engine(args), args.host, args.port, args.served_model_name, defaults,
              args.log_level)
    except VeriCacheError as e:
        print(f"gateway: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
