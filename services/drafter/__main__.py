"""`python -m services.drafter`: run the drafter service until SIGTERM."""

from __future__ import annotations

import sys

from services.common.modelsvc import run_model_service


def main(argv: list[str] | None = None) -> int:
    from services.drafter.server import DrafterServicer, pb_grpc

    return run_model_service("drafter", 50053, DrafterServicer, pb_grpc.add_DrafterServicer_to_server, argv)


if __name__ == "__main__":
    sys.exit(main())
