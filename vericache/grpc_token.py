"""The client half of the internal token (see `services.common.auth` for the server half):
`with_token(channel, token)` wraps a gRPC channel so every call carries
`authorization: Bearer <token>`. Used by every client of VeriCache's own services (the
kvstore's `GrpcStore`, `vericache.engine.remote.RemoteBackends`)."""

from __future__ import annotations

import grpc

INTERNAL_TOKEN_ENV = "VERICACHE_INTERNAL_TOKEN"
HEADER = "authorization"


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor,
                              grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to the metadata of every call."""

    def __init__(self, token: str):
        self._pair = (HEADER, f"Bearer {token}")

    def _details(self, d):
        meta = [m for m in (d.metadata or ()) if m[0] != HEADER] + [self._pair]
        return d._replace(metadata=meta) if hasattr(d, "_replace") else _Details(
            d.method, d.timeout, meta, d.credentials, getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` sending the internal token on every call (the channel itself when no token)."""
    return grpc.intercept_channel(channel, _TokenClientInterceptor(token)) if token else channel
