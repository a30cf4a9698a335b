"""Per-API-key quotas of the gateway: concurrent requests and tokens per minute.

Words, defined once:
- **key**: the caller's API key (the bearer token the access middleware accepted); without
  configured API keys every caller shares the one key "".
- **active**: the key's completion requests admitted and not yet ended (a stream ends when its
  last byte went out or the client went away).
- **spent**: the tokens the key's ended requests used in the last 60 s (a sliding window):
  `usage.total_tokens` (prompt + completion) of the response, or, for a stream without a usage
  chunk, the tokens its chunks carried (the `vericache.tokens` provenance extension).

The rule (`Quotas.admit`): a request is refused with 429 when `active >= max_concurrent` or
`spent >= tokens_per_minute`; 0 means unlimited for either, and both are 0 by default (off).
Tokens are charged when a request ends, so a key may overshoot its budget by what its
admitted requests use at most (`max_concurrent` x their max_tokens). Refusals carry
`Retry-After` in whole seconds: 1 for concurrency (a slot frees when any request ends), else
the time until enough of the window expires to bring `spent` under the limit.

Only POST /v1/chat/completions and /v1/completions are counted; every other route passes.
One tenant cannot starve another: a key over its limits is refused at once, before it queues
in the engine, so the other keys' requests find the queue as they would without it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.protocol import ErrorInfo

WINDOW_S = 60.0
QUOTA_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class QuotaLimits:
    """Each key's limits; 0 = unlimited."""

    max_concurrent: int = 0
    tokens_per_minute: int = 0

    def __post_init__(self):
        if self.max_concurrent < 0 or self.tokens_per_minute < 0:
            raise ValueError("quota limits must be >= 0 (0: unlimited)")

    @property
    def enabled(self) -> bool:
        return bool(self.max_concurrent or self.tokens_per_minute)


@dataclass
class _KeyState:
    active: int = 0
    spent: deque = field(default_factory=deque)  # (time ended, tokens), oldest first
    admitted: int = 0
    refused: int = 0


class Quotas:
    """The keys' quota state (thread-safe); `clock` is time.monotonic unless a test sets it."""

    def __init__(self, limits: QuotaLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._keys: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    def _state(self, key: str, now: float) -> _KeyState:
        st = self._keys.setdefault(key, _KeyState())
        while st.spent and st.spent[0][0] <= now - WINDOW_S:
            st.spent.popleft()
        return st

    def admit(self, key: str) -> float | None:
        """Admit one request of `key` (it is then active until `finish`), or refuse it: the
        seconds after which to retry."""
        lim = self.limits
        with self._lock:
            now = self.clock()
            st = self._state(key, now)
            retry = None
            if lim.max_concurrent and st.active >= lim.max_concurrent:
                retry = 1.0
            if lim.tokens_per_minute:
                total = sum(t for _, t in st.spent)
                for ended, tokens in st.spent:  # the oldest expire first
                    if total < lim.tokens_per_minute:
                        break
                    total -= tokens
                    retry = max(retry or 0.0, ended + WINDOW_S - now)
            if retry is not None:
                st.refused += 1
                return retry
            st.active += 1
            st.admitted += 1
            return None

    def finish(self, key: str, tokens: int) -> None:
        """An admitted request of `key` ended, having used `tokens`."""
        with self._lock:
            now = self.clock()
            st = self._state(key, now)
            st.active -= 1
            if tokens > 0:
                st.spent.append((now, tokens))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per key: active, spent (tokens in the window), admitted and refused so far."""
        with self._lock:
            now = self.clock()
            return {k: {"active": s.active, "spent": sum(t for _, t in self._state(k, now).spent),
                        "admitted": s.admitted, "refused": s.refused}
                    for k, s in list(self._keys.items())}


class _TokenCounter:
    """The tokens a response used, read from its body as it goes out (JSON or SSE)."""

    def __init__(self, sse: bool):
        self.sse, self.buf, self.streamed, self.usage = sse, b"", 0, None

    def feed(self, body: bytes) -> None:
        self.buf += body
        if not self.sse:
            return
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: {"):
                self._chunk(line[6:])

    def _chunk(self, raw: bytes) -> None:
        try:
            chunk = json.loads(raw)
        except ValueError:
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage.get("total_tokens")
        ext = chunk.get("vericache")
        if isinstance(ext, dict):
            self.streamed += len(ext.get("tokens") or ())

    def tokens(self) -> int:
        if not self.sse and self.buf:
            try:
                usage = json.loads(self.buf).get("usage") or {}
                self.usage = usage.get("total_tokens")
            except (ValueError, AttributeError):
                pass
        return int(self.usage) if isinstance(self.usage, int) else self.streamed


def _key(scope) -> str:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return value.decode("latin-1").partition(" ")[2].strip()
    return ""


class QuotaMiddleware:
    """ASGI middleware applying `Quotas` to the completions routes (inside the access
    middleware, so the key is already authenticated)."""

    def __init__(self, app, quotas: Quotas):
        self.app, self.quotas = app, quotas

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope["path"] not in QUOTA_PATHS):
            return await self.app(scope, receive, send)
        key = _key(scope)
        retry = self.quotas.admit(key)
        if retry is not None:
            return await _refuse(send, retry)
        counter: _TokenCounter | None = None

        async def counting_send(message):
            nonlocal counter
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or ()).get(b"content-type", b"")
                counter = _TokenCounter(ctype.startswith(b"text/event-stream"))
            elif message["type"] == "http.response.body" and counter is not None:
                counter.feed(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.quotas.finish(key, counter.tokens() if counter is not None else 0)


async def _refuse(send, retry_s: float) -> None:
    seconds = max(1, math.ceil(retry_s))
    body = json.dumps({"error": ErrorInfo(
        message=f"quota exceeded for this API key; retry after {seconds} s",
        type="rate_limit_error", param=None, code="rate_limit_exceeded").model_dump()}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(seconds).encode())]})
    await send({"type": "http.response.body", "body": body})
