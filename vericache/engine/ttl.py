"""Session time-to-live: a service forgets a request nobody has touched for `ttl_s`, so a
lost gateway leaks no KV. Pure bookkeeping; the caller passes the clock and does the release."""

from __future__ import annotations

import threading


class SessionClock:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def touch(self, rid: str, now: float) -> None:
        with self._lock:
            self._last[rid] = now

    def forget(self, rid: str) -> None:
        with self._lock:
            self._last.pop(rid, None)

    def expired(self, now: float) -> list[str]:
        """Ids idle for longer than the TTL; they are forgotten here."""
        with self._lock:
            old = [rid for rid, t in self._last.items() if now - t > self.ttl_s]
            for rid in old:
                del self._last[rid]
        return old
