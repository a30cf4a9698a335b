"""API keys, tenants and the request body limit of the gateway: one ASGI middleware in front of
the routes.

- API keys (`--api-key K1,K2` or $VERICACHE_API_KEY): when any is set, every /v1/* request
  needs `Authorization: Bearer <key>`, else 401 in the OpenAI error shape (with
  `WWW-Authenticate: Bearer`). Keys are compared with `hmac.compare_digest`, against every
  configured key (no early exit on the first match). /health, /ready and /metrics stay open: probes
  and Prometheus scrape them, and they show only aggregate counters (no keys, no tenants).
- Tenants: each key maps to a namespace, `--tenant KEY=NAME` or else `t-` + the first 12 hex
  digits of sha256(key). The namespace goes into GenParams.namespace, so prefix-cache keys
  differ per tenant and one tenant's cached prefixes can neither be read nor probed by timing
  by another. `--shared-prefix-cache` puts every tenant in the shared namespace "" instead.
- Body limit (`--max-body-bytes`): a larger body is refused with 413 before it is parsed,
  when Content-Length announces it; a chunked body is cut off once past the limit (413, or
  400 when the JSON parser sees the cut first).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field

from services.gateway.protocol import ErrorInfo

DEFAULT_MAX_BODY_BYTES = 2 << 20


def tenant_namespace(key: str) -> str:
    """The default namespace of an API key: short, stable, and not the key itself."""
    return "t-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class AccessPolicy:
    """Which keys may call /v1/*, the namespace each one gets, and the body limit."""

    api_keys: list[str] = field(default_factory=list)
    tenants: dict[str, str] = field(default_factory=dict)  # key -> namespace
    shared_prefix_cache: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self):
        unknown = set(self.tenants) - set(self.api_keys)
        if unknown:
            raise ValueError(f"{len(unknown)} --tenant key(s) are not among the API keys")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")

    @classmethod
    def from_flags(cls, api_keys: str, tenants: list[str], shared: bool,
                   max_body_bytes: int) -> "AccessPolicy":
        """From `--api-key K1,K2` and repeated `--tenant KEY=NAME`."""
        keys = [k.strip() for k in (api_keys or "").split(",") if k.strip()]
        mapping = {}
        for t in tenants or []:
            key, sep, name = t.partition("=")
            if not sep or not key or not name:
                raise ValueError("--tenant takes KEY=NAME")
            mapping[key] = name
        return cls(keys, mapping, shared, max_body_bytes)

    def namespace(self, key: str) -> str:
        if self.shared_prefix_cache:
            return ""
        return self.tenants.get(key) or tenant_namespace(key)

    def authenticate(self, authorization: bytes | None) -> str | None:
        """The caller's namespace, or None when the header names no configured key."""
        if not self.api_keys:
            return ""
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        token = token.strip().encode()
        match = None
        for key in self.api_keys:
            if hmac.compare_digest(token, key.encode()) and scheme.lower() == "bearer":
                match = key
        return None if match is None else self.namespace(match)


class _BodyTooLarge(Exception):
    pass


def _error_body(message: str, kind: str, code: str) -> bytes:
    return json.dumps({"error": ErrorInfo(message=message, type=kind, param=None,
                                          code=code).model_dump()}).encode()


class AccessMiddleware:
    """ASGI middleware enforcing an `AccessPolicy`; sets `request.state.namespace`."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def _send_error(self, send, status: int, message: str, kind: str, code: str,
                          extra: list | None = None):
        body = _error_body(message, kind, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *(extra or [])]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        namespace = ""
        if scope["path"].startswith("/v1/"):
            namespace = self.policy.authenticate(headers.get(b"authorization"))
            if namespace is None:
                return await self._send_error(
                    send, 401, "Incorrect or missing API key: send 'Authorization: Bearer "
                    "<key>'", "invalid_request_error", "invalid_api_key",
                    [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["namespace"] = namespace
        limit = self.policy.max_body_bytes
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return await self._send_error(send, 400, "bad Content-Length header",
                                          "invalid_request_error", "invalid_request")
        if int(length) > limit:
            return await self._send_error(send, 413, f"request body over {limit} bytes",
                                          "invalid_request_error", "request_too_large")
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._send_error(send, 413, f"request body over {limit} bytes",
                                       "invalid_request_error", "request_too_large")
