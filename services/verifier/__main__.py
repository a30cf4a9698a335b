"""`python -m services.verifier`: run the verifier service until SIGTERM."""

from __future__ import annotations

import sys

from services.common.modelsvc import run_model_service


def main(argv: list[str] | None = None) -> int:
    from services.verifier.server import VerifierServicer, pb_grpc

    return run_model_service("verifier", 50052, VerifierServicer, pb_grpc.add_VerifierServicer_to_server, argv)


if __name__ == "__main__":
    sys.exit(main())
