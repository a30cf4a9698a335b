"""The `vericache` command: one module per subcommand, each with add_parser() and run()."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from vericache.errors import VeriCacheError

# subcommand -> module; each module defines add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "generate": "vericache.cli.generate",
    "bench": "vericache.cli.bench",
    "serve": "vericache.cli.serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vericache",
        description="Lossless LLM decoding: draft over a compressed KV cache, verify over the full KV.")
    parser.add_argument("--log-level", default=os.environ.get("VERICACHE_LOG_LEVEL", "WARNING"),
                        help="logging level (default: WARNING, or $VERICACHE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue  # subcommand not built in this version
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except VeriCacheError as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
