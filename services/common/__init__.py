"""What every gRPC service shares: the error interceptor and the server builder."""

from services.common.errors import ErrorInterceptor, status_for
from services.common.server import build_server, serve_until_signal

__all__ = ["ErrorInterceptor", "build_server", "serve_until_signal", "status_for"]
