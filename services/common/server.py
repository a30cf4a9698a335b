"""Building a gRPC server and running it until SIGTERM, the same way for every service.

`build_server` installs the error interceptor (and, given an internal token, the token check of
`services.common.auth` in front of it) and message limits that fit 1 MiB pieces and
binds the port (0 picks a free one). `serve_until_signal` blocks until SIGTERM or SIGINT, then
stops accepting calls, lets calls in flight finish for `grace_s` seconds, and runs `on_stop`
(close the store, release sessions).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

from services.common.auth import TokenAuthInterceptor
from services.common.errors import ErrorInterceptor
from vericache.store.link import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def build_server(add_servicers: Callable[[grpc.Server], None], host: str = "0.0.0.0",
                 port: int = 0, max_workers: int = 16,
                 max_message_bytes: int | None = None,
                 internal_token: str = "") -> tuple[grpc.Server, int]:
    """A server (not started yet) with the services `add_servicers` adds, and its port.
    `max_message_bytes` raises the message limit (the drafter's and verifier's sampled
    distributions); the kvstore keeps the 1 MiB-piece limit. A non-empty `internal_token`
    makes every call but the standard health service carry it (else UNAUTHENTICATED)."""
    options = SERVER_OPTIONS
    if max_message_bytes:
        options = [(k, max_message_bytes if "message_length" in k else v) for k, v in options]
    interceptors = [ErrorInterceptor()]
    if internal_token:
        interceptors.insert(0, TokenAuthInterceptor(internal_token))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="grpc"),
                         interceptors=interceptors, options=options)
    add_servicers(server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # newer grpcio raises where older ones returned 0
        raise OSError(f"cannot bind {host}:{port}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, bound


def serve_until_signal(server: grpc.Server, on_stop: Callable[[], None] = lambda: None,
                       grace_s: float = 5.0) -> None:
    """Start `server`, block until SIGTERM/SIGINT, then stop gracefully and call `on_stop`."""
    stop = threading.Event()

    def request_stop(signum, _frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        stop.wait()
    finally:
        server.stop(grace_s).wait()
        try:
            on_stop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    log.info("stopped")
