"""Routes of the OpenAI-compatible gateway, and running it under uvicorn.

`create_app(engine, served_model_name, defaults)` builds the FastAPI app:
POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /ready,
GET /metrics, and GET / (the page in services/gateway/static/, with its files under /static/).
While a backend service does not answer, the completions routes answer 503 with Retry-After
(`services.gateway.ready`).
Routes only parse and delegate to `OpenAIServing`; every error leaves in the OpenAI shape
(request validation errors, malformed JSON included, are 400s, not FastAPI's 422s).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.auth import AccessMiddleware, AccessPolicy
from services.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.quota import QuotaLimits, QuotaMiddleware, Quotas
from services.gateway.ready import RETRY_AFTER_S as READY_RETRY_AFTER_S
from services.gateway.ready import Readiness
from services.gateway.serving import OpenAIServing, error_json, error_response
from vericache.engine.api import Engine
from vericache.engine.generation import GenParams
from vericache.errors import VeriCacheError

STATIC = Path(__file__).resolve().parent / "static"


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

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.observe_response(getattr(route, "path", "other"), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine, served_model_name: str | None = None,
               defaults: GenParams | None = None, store=None,
               policy: AccessPolicy | None = None,
               readiness: Readiness | None = None,
               quota: QuotaLimits | None = None) -> FastAPI:
    """The gateway over `engine`; the engine itself is closed by whoever created it. With a
    `store` (the kvstore client), /metrics also shows the store's own counters. `policy`:
    API keys, tenant namespaces and the body limit (default: no keys, 2 MiB bodies).
    `readiness`: started with the app and stopped with it (default: one over `engine`).
    `quota`: per-API-key limits (`services.gateway.quota`; default: none)."""
    readiness = readiness or Readiness(engine)
    metrics = GatewayMetrics(engine, store)
    serving = OpenAIServing(engine, served_model_name, defaults, metrics, readiness)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(readiness.start)
        try:
            yield
        finally:
            await asyncio.to_thread(readiness.stop)

    app = FastAPI(title="VeriCache",
                  description="OpenAI-compatible API over lossless compressed-KV speculative "
                              "decoding", lifespan=lifespan)
    app.state.serving, app.state.metrics, app.state.readiness = serving, metrics, readiness
    app.state.quotas = Quotas(quota or QuotaLimits())
    if app.state.quotas.limits.enabled:  # inside the access check: the key is authenticated
        app.add_middleware(QuotaMiddleware, quotas=app.state.quotas)
    app.add_middleware(AccessMiddleware, policy=policy or AccessPolicy())
    app.add_middleware(_CountResponses, metrics=metrics)
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
        """Readiness: 200 when every backend service answers its Health (asked now), or,
        once it has been ready, when the verifier does (`degraded` lists a drafter that does
        not: requests are served in plain steps), else 503 with Retry-After naming the ones
        that do not (the embedded engine's always answer)."""
        ok = await asyncio.to_thread(readiness.check)
        headers = {} if ok else {"Retry-After": str(READY_RETRY_AFTER_S)}
        return JSONResponse({"status": "ready" if ok else "unavailable",
                             "backends": readiness.backends, "degraded": readiness.degraded},
                            status_code=200 if ok else 503, headers=headers)

    @app.get("/metrics")
    async def metrics_text():
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def page():
        """The page that watches the gateway work (services/gateway/static/)."""
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

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
          policy: AccessPolicy | None = None, readiness: Readiness | None = None,
          quota: QuotaLimits | None = None) -> None:
    """Run the gateway until SIGINT/SIGTERM, then close the engine."""
    app = create_app(engine, served_model_name, defaults, store, policy, readiness, quota)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=5)
    try:
        _Server(config).run()
    finally:
        engine.close()
