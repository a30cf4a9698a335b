"""Whether the gateway can serve: every backend service answers its Health.

`Readiness` asks `engine.health()` on a background thread every `interval_s` and keeps the
answer; the completions routes read it and answer 503 with Retry-After while a backend is
down or still loading (`NotReady`), instead of accepting requests that would fail
mid-flight; GET /ready shows it. `on_first_ready` runs once, the first time every backend
answers (the gateway learns the services' KV budgets there); until it has succeeded the
gateway is not ready. The embedded engine's backends always answer.

Once ready, only the verifier is needed: while the drafter does not answer, the gateway is
`degraded`, still ready, and serves every request in plain full-KV decode steps (the
verifier decides every token in any case, so the output is the same; see
`vericache.engine.remote`), and drafting resumes when the drafter answers again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vericache.errors import Unavailable

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2


class NotReady(Unavailable):
    """A backend service does not answer (down or still loading): try again later."""


class Readiness:
    def __init__(self, engine, interval_s: float = 1.0,
                 on_first_ready: Callable[[], None] | None = None):
        self.engine, self.interval_s = engine, interval_s
        self._on_first_ready = on_first_ready
        self._lock = threading.Lock()
        self.backends: dict[str, bool] = {}
        self.ready = False
        self.degraded: list[str] = []  # backends down while the gateway serves without them
        self._was_ready = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Ask the backends now; returns (and keeps) whether all answer."""
        backends = self.engine.health()
        ok = all(backends.values()) or (self._was_ready and backends.get("verifier", False))
        with self._lock:
            if ok and self._on_first_ready is not None:
                try:
                    self._on_first_ready()
                    self._on_first_ready = None
                except Exception as e:  # noqa: BLE001 -- retried at the next check
                    log.warning("backends answer, but their settings could not be read: %s", e)
                    ok = False
            if ok != self.ready:
                log.warning("gateway %s (backends: %s)", "ready" if ok else "not ready", backends)
            self.backends, self.ready = backends, ok
            self._was_ready = self._was_ready or ok
            self.degraded = [n for n, up in backends.items() if not up] if ok else []
        return ok

    def require(self) -> None:
        """Raise NotReady unless the last check found every backend answering."""
        if not self.ready:
            down = ", ".join(n for n, up in self.backends.items() if not up) or "backends"
            raise NotReady(f"not ready: {down} not answering yet; retry in {RETRY_AFTER_S} s")

    def start(self) -> None:
        """Check once now, then every `interval_s` on a daemon thread until `stop()`."""
        self.check()
        self._thread = threading.Thread(target=self._run, name="vericache-ready", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 -- health never raises; a bug must not stop this
                log.exception("readiness check failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
