"""The one place where core errors become gRPC status codes (server side).

`ErrorInterceptor` wraps every handler of a server: a `VeriCacheError` raised by a servicer
(or by the core below it) ends the call with the code of `status_for(error)` and the error's
message; any other exception is logged with its traceback and ends the call as INTERNAL.
Streaming handlers are covered too: an error in the middle of a response stream aborts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import grpc

from vericache.errors import (InvalidArgument, ModelLoadError, NotFound, ResourceExhausted,
                              Unavailable, VeriCacheError)

log = logging.getLogger(__name__)

# Most specific first: the first class the error is an instance of wins.
_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    (VeriCacheError, grpc.StatusCode.INTERNAL),
]


def status_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an error (INTERNAL for anything unexpected)."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, error: Exception, method: str):
    code = status_for(error)
    if not isinstance(error, VeriCacheError):
        log.exception("%s failed unexpectedly", method)
    elif code == grpc.StatusCode.INTERNAL:
        log.error("%s failed: %s", method, error)
    context.abort(code, str(error) or type(error).__name__)


def _wrap_unary(fn: Callable, method: str) -> Callable:
    def handler(request, context):
        try:
            return fn(request, context)
        except Exception as e:  # noqa: BLE001 -- mapped to a status, never swallowed
            if isinstance(e, grpc.RpcError) or context.code() is not None:
                raise
            _abort(context, e, method)
    return handler


def _wrap_stream(fn: Callable, method: str) -> Callable:
    def handler(request, context) -> Iterator:
        try:
            yield from fn(request, context)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, grpc.RpcError) or context.code() is not None:
                raise
            _abort(context, e, method)
    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps core errors to status codes for every RPC of the server it is installed on."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method))
        return handler
