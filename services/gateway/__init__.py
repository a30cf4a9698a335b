"""The OpenAI-compatible HTTP gateway: protocol (wire models), serving (request -> engine ->
response, error mapping), metrics (Prometheus text), app (routes, uvicorn)."""

from services.gateway.app import create_app, serve

__all__ = ["create_app", "serve"]
