"""`python -m services.drafter`: run the drafter service until SIGTERM."""

from __future__ import annotations

import argparse
import sys

from services.common import build_server, serve_until_signal
from services.common.modelsvc import MODEL_MESSAGE_BYTES, ModelService, add_args
from vericache.errors import VeriCacheError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.drafter",
        description="Serve the VeriCache drafter over gRPC (proto/vericache/v1/drafter.proto).")
    add_args(p, "drafter", 50053)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        from services.drafter.server import DrafterServicer, pb_grpc

        svc = ModelService.from_args(a)
        servicer = DrafterServicer(svc)
        svc.start_reaper(servicer.core.release)
        server, port = build_server(lambda s: pb_grpc.add_DrafterServicer_to_server(servicer, s),
                                    host=a.host, port=a.port, max_workers=a.workers,
                                    max_message_bytes=MODEL_MESSAGE_BYTES,
                                    internal_token=a.internal_token)
        print(f"drafter: serving on {a.host}:{port} model={svc.lm.model_id}", flush=True)
        serve_until_signal(server, on_stop=svc.store.close)
    except (VeriCacheError, OSError) as e:
        print(f"drafter: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
