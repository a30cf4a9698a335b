"""The shared internal token between VeriCache's own processes (gateway, drafter, verifier,
kvstore), on both sides of a gRPC call.

Server side: `TokenAuthInterceptor(token)` ends every call whose `authorization` metadata is
not `Bearer <token>` with UNAUTHENTICATED before the servicer runs (compared with
`hmac.compare_digest`). The standard `grpc.health.v1.Health` service stays open, so exec probes
(`python -m services.common.healthcheck --grpc ...`) need no secret.
Client side: `vericache.grpc_token.with_token(channel, token)` (re-exported here) wraps a
channel so every call sends the header.

The token is read from `--internal-token` or `$VERICACHE_INTERNAL_TOKEN` (prefer the variable:
a flag shows in `ps`). An empty token turns the check off (the default, for loopback use).
"""

from __future__ import annotations

import hmac
import os

import grpc

from vericache.grpc_token import HEADER, INTERNAL_TOKEN_ENV, with_token

__all__ = ["TokenAuthInterceptor", "add_token_arg", "with_token"]

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def add_token_arg(p) -> None:
    """The `--internal-token` flag (default $VERICACHE_INTERNAL_TOKEN, else none)."""
    p.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV, ""),
                   help="shared secret of the internal gRPC calls: servers refuse calls without "
                        "it (UNAUTHENTICATED), clients send it (env VERICACHE_INTERNAL_TOKEN, "
                        "preferred over the flag, which shows in ps; default: none, no check)")


def _abort_unauthenticated(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that refuses the call."""
    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_abort_unauthenticated)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_abort_unauthenticated)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_abort_unauthenticated)
    return grpc.unary_unary_rpc_method_handler(_abort_unauthenticated)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (except the health service)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty internal token would let every call through")
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata) -> bool:
        got = next((v for k, v in metadata or () if k == HEADER), "")
        got = got.encode() if isinstance(got, str) else bytes(got)
        return hmac.compare_digest(got, self._expected)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_PREFIXES):
            return continuation(handler_call_details)
        if self.authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        return _deny(continuation(handler_call_details))
