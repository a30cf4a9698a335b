"""`grpc://HOST:PORT?gbps=..&timeout_s=..`: a client of the kvstore service, as a `ChunkStore`.

Drafter and verifier use a remote store through the same interface as a local one. Values go
in pieces of at most 1 MiB (client-streaming Put, server-streaming Get). `gbps` caps this
client's link in both directions with a token bucket (Gbit/s; default: uncapped), so a loopback
socket can stand in for a 1 Gbit/s network. `stats()` returns the server's counters plus this
link's: link_bytes_sent, link_bytes_received, link_seconds (time inside transfers),
link_wait_seconds (of it, time the bandwidth cap slept), link_pieces_sent/received and
link_max_piece_bytes. gRPC status codes map back to the core's typed errors here, once.
`token` (the services' internal token, never part of the URL) goes with every call.

Every call has a deadline (`timeout_s`, default 60). Every KVStore call is idempotent (a key
names its value: a Put of a key writes the same bytes again, a Delete of a gone key is a
no-op), so a call that fails UNAVAILABLE — the connection was reset, or the kvstore had just
restarted — is tried once more with a fresh deadline; DEADLINE_EXCEEDED is not retried (the
time is spent), so a link that does not answer holds a caller at most `timeout_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import grpc

from vericache._proto import load
from vericache.grpc_token import with_token
from vericache.errors import (DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted,
                              Unavailable, VeriCacheError)
from vericache.store.base import ChunkStore, Value, check_key, url_params
from vericache.store.link import MAX_MESSAGE_BYTES, PIECE_BYTES, TokenBucket, pieces

STATUS_ERRORS: dict[grpc.StatusCode, type[VeriCacheError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
# a restarted kvstore is found again within 5 s (gRPC's default backoff grows to 120 s)
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500),
                     ("grpc.max_reconnect_backoff_ms", 5000)]
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *RECONNECT_OPTIONS]


def typed_error(e: grpc.RpcError, target: str) -> VeriCacheError:
    """The core error a gRPC status stands for (`VeriCacheError` for codes without one)."""
    cls = STATUS_ERRORS.get(e.code(), VeriCacheError)
    return cls(f"kvstore {target}: {e.code().name}: {e.details()}")


class GrpcStore(ChunkStore):
    def __init__(self, target: str, gbps: float | None = None, timeout_s: float = 60.0,
                 token: str | None = None):
        self.target = target
        self.timeout_s = timeout_s
        self.bucket = TokenBucket.gbps(gbps) if gbps else None
        self._pb, pb_grpc = load("kvstore")
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(with_token(self._channel, token))
        self._lock = threading.Lock()
        self._link = {"link_bytes_sent": 0, "link_bytes_received": 0, "link_seconds": 0.0,
                      "link_pieces_sent": 0, "link_pieces_received": 0, "link_max_piece_bytes": 0}

    @classmethod
    def from_url(cls, url: str, token: str | None = None) -> "GrpcStore":
        p = url_params(url, gbps=float, timeout_s=float)
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise InvalidArgument(f"grpc store URL needs HOST:PORT, got {url!r}", param="url")
        if p.get("gbps", 1) <= 0:
            raise InvalidArgument("gbps must be positive", param="gbps")
        return cls(f"{parts.hostname}:{parts.port}", gbps=p.get("gbps"),
                   timeout_s=p.get("timeout_s", 60.0), token=token)

    def _call(self, method, request, make_request=None):
        """`method(request)` under the deadline, once more on UNAVAILABLE (`make_request`
        builds the request again where it is an iterator)."""
        for attempt in (0, 1):
            try:
                return method(request, timeout=self.timeout_s)
            except grpc.RpcError as e:
                if attempt or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise typed_error(e, self.target) from None
                if make_request is not None:
                    request = make_request()

    def _piece(self, nbytes: int, sent: bool) -> None:
        if self.bucket is not None:
            self.bucket.take(nbytes)
        with self._lock:
            side = "sent" if sent else "received"
            self._link[f"link_bytes_{side}"] += nbytes
            self._link[f"link_pieces_{side}"] += 1
            self._link["link_max_piece_bytes"] = max(self._link["link_max_piece_bytes"], nbytes)

    def _spent(self, t0: float) -> None:
        with self._lock:
            self._link["link_seconds"] += time.perf_counter() - t0

    def put(self, key: str, value: Value) -> None:
        check_key(key)
        total = len(memoryview(value).cast("B"))

        def requests() -> Iterator:
            for i, piece in enumerate(pieces(value, PIECE_BYTES)):
                self._piece(len(piece), sent=True)
                yield (self._pb.PutRequest(key=key, total_bytes=total, data=bytes(piece)) if i == 0
                       else self._pb.PutRequest(data=bytes(piece)))

        t0 = time.perf_counter()
        try:
            self._call(self._stub.Put, requests(), requests)
        finally:
            self._spent(t0)

    def get(self, key: str) -> bytes | None:
        check_key(key)
        t0 = time.perf_counter()
        try:
            for attempt in (0, 1):
                try:
                    parts = []
                    for reply in self._stub.Get(self._pb.GetRequest(key=key), timeout=self.timeout_s):
                        self._piece(len(reply.data), sent=False)
                        parts.append(reply.data)
                    return parts[0] if len(parts) == 1 else b"".join(parts)  # one copy, not two
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        return None
                    if attempt or e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise typed_error(e, self.target) from None
        finally:
            self._spent(t0)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        reply = self._call(self._stub.Contains, self._pb.ContainsRequest(keys=list(keys)))
        return list(reply.present)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return self._call(self._stub.LongestPrefix,
                          self._pb.LongestPrefixRequest(keys=list(keys))).count

    def delete(self, key: str) -> bool:
        return self._call(self._stub.Delete, self._pb.DeleteRequest(key=key)).deleted

    def stats(self) -> dict[str, int | float | str]:
        r = self._call(self._stub.Stats, self._pb.StatsRequest())
        with self._lock:
            link = dict(self._link)
        if self.bucket is not None:
            link["link_wait_seconds"] = self.bucket.waited_s
        return {"hits": r.hits, "misses": r.misses, "bytes_in": r.bytes_in,
                "bytes_out": r.bytes_out, "entries": r.entries, "bytes_stored": r.bytes_stored,
                **dict(r.extra), **link}

    def health(self) -> tuple[bool, str]:
        """Whether the service serves, and why not."""
        r = self._call(self._stub.Health, self._pb.HealthRequest())
        return r.status == self._pb.HealthResponse.STATUS_SERVING, r.detail

    def close(self) -> None:
        self._channel.close()
