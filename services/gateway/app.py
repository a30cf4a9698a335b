"""Routes of the OpenAI-compatible gateway, and running it under uvicorn.

`create_app(engine, served_model_name, defaults)` builds the FastAPI app:
POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Routes only parse and delegate to `OpenAIServing`; every error leaves in the OpenAI shape
(request validation errors, malformed JSON included, are 400s, not FastAPI's 422s).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.auth import AccessMiddleware, AccessPolicy
from services.gateway.metrics import (CONTENT_TYPE, HttpCounter, MetricsRegistry, engine_collector,
                                      store_collector)
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.serving import OpenAIServing, error_json, error_response
from vericache.engine.api import Engine
from vericache.engine.generation import GenParams
from vericache.errors import VeriCacheError


def _validation_error(exc: RequestValidationError):
    """FastAPI's validation error as an OpenAI 400 naming the top-level parameter."""
    err = (exc.errors() or [{}])[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return error_json(400, f"malformed JSON body: {err.get('msg', '')}", code="invalid_json")
    field = ".".join(str(p) for p in loc)
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    param = loc[0] if loc and isinstance(loc[0], str) else None
    return error_json(400, f"{field}: {msg}" if field else msg, param=param)


class _CountResponses:
    """ASGI middleware: counts responses by route template and status code."""

    def __init__(self, app, counter: HttpCounter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.counter.observe(getattr(route, "path", "other"), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine, served_model_name: str | None = None,
               defaults: GenParams | None = None, store=None,
               policy: AccessPolicy | None = None) -> FastAPI:
    """The gateway over `engine`; the engine itself is closed by whoever created it. With a
    `store` (the kvstore client), /metrics also shows the store's own counters. `policy`:
    API keys, tenant namespaces and the body limit (default: no keys, 2 MiB bodies)."""
    serving = OpenAIServing(engine, served_model_name, defaults)
    registry = MetricsRegistry()
    registry.register(engine_collector(engine))
    if store is not None:
        registry.register(store_collector(store))
    http_counter = HttpCounter()
    registry.register(http_counter)

    app = FastAPI(title="VeriCache",
                  description="OpenAI-compatible API over lossless compressed-KV speculative "
                              "decoding")
    app.state.serving, app.state.metrics = serving, registry
    app.add_middleware(AccessMiddleware, policy=policy or AccessPolicy())
    app.add_middleware(_CountResponses, counter=http_counter)
    app.add_exception_handler(RequestValidationError, lambda r, e: _validation_error(e))
    app.add_exception_handler(VeriCacheError, lambda r, e: error_response(e))
    app.add_exception_handler(StarletteHTTPException, lambda r, e: error_json(
        e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
        else "server_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serving.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serving.completion(req, request)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/health")
    async def health():
        """Liveness: the gateway answers (a lost drafter or verifier does not make a restart
        of the gateway useful; /ready says whether requests can be served)."""
        return {"status": "ok", "model": serving.model_name, "active": engine.active,
                "queue_depth": engine.queue_depth}

    @app.get("/ready")
    async def ready():
        """Readiness: 200 when every backend service answers its Health, else 503 naming the
        ones that do not (the embedded engine has none to ask)."""
        backends = await asyncio.to_thread(engine.health)
        ok = all(backends.values())
        return JSONResponse({"status": "ready" if ok else "unavailable", "backends": backends},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(registry.render(), media_type=CONTENT_TYPE)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, printing the gateway's URL once it is listening. SIGTERM/SIGINT
    stop it gracefully and `run` returns (uvicorn would re-raise the signal and kill the
    process before the engine is closed)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            host = self.config.host
            shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"VeriCache gateway ready at http://{shown}:{port}/v1 "
                  f"(model: {self.config.app.state.serving.model_name})", flush=True)


def serve(engine: Engine, host: str, port: int, served_model_name: str | None = None,
          defaults: GenParams | None = None, log_level: str = "warning", store=None,
          policy: AccessPolicy | None = None) -> None:
    """Run the gateway until SIGINT/SIGTERM, then close the engine."""
    app = create_app(engine, served_model_name, defaults, store, policy)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=5)
    try:
        _Server(config).run()
    finally:
        engine.close()
