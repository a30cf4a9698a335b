"""What a remote store link shares with its server: pieces of at most 1 MiB and a bandwidth cap.

Values cross a gRPC link in pieces of `PIECE_BYTES`; both ends accept messages up to
`MAX_MESSAGE_BYTES` (a piece plus its key and framing). `TokenBucket` caps a link's rate so a
benchmark can say "1 Gbit/s network" on a loopback socket: each piece takes its bytes from the
bucket, and a sender that runs ahead sleeps off its debt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

PIECE_BYTES = 1 << 20
MAX_MESSAGE_BYTES = PIECE_BYTES + (64 << 10)


def pieces(data: bytes | bytearray | memoryview, size: int = PIECE_BYTES) -> Iterator[memoryview]:
    """`data` in consecutive slices of at most `size` bytes (at least one, maybe empty)."""
    mv = memoryview(data).cast("B")
    yield mv[:size]
    for start in range(size, len(mv), size):
        yield mv[start:start + size]


class TokenBucket:
    """A rate limit in bytes per second with a small burst; thread-safe.

    `take(n)` returns at once while the bucket holds tokens and otherwise sleeps until the
    tokens taken are paid back, so a steady sender moves `rate` bytes per second.
    """

    def __init__(self, bytes_per_s: float, burst_bytes: float | None = None):
        if bytes_per_s <= 0:
            raise ValueError(f"rate must be positive, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self.burst = float(burst_bytes if burst_bytes is not None else 64 << 10)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.waited_s = 0.0

    @classmethod
    def gbps(cls, gbit_per_s: float) -> "TokenBucket":
        """A bucket for a link of `gbit_per_s` gigabits (1e9 bits) per second."""
        return cls(gbit_per_s * 1e9 / 8)

    def take(self, nbytes: int) -> float:
        """Spend `nbytes`; sleep off any debt. Returns the seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited_s += wait
        if wait:
            time.sleep(wait)
        return wait
