"""The kvstore service as a real process (memory:// and redis:// behind it), reached through
the grpc:// store and through the raw stub: pieces, prefixes, counters, status codes, the
bandwidth cap, SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import grpc
import pytest
import redis
import torch

from service_process import REPO, free_port, start_service
from vericache._proto import load
from vericache.errors import InvalidArgument, ResourceExhausted, Unavailable
from vericache.store import chunk_keys, full_key, open_store
from vericache.store.keys import chunk_key, refresh_key, select_key
from vericache.store.codec import decode_full, encode_full
from vericache.store.link import PIECE_BYTES

pb, pb_grpc = load("kvstore")
REDIS = "redis://127.0.0.1:6379/0"
MODULE = "services.kvstore"


def health(port: int) -> str:
    """The service's health status name (raises while it does not answer)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=2)
    return pb.HealthResponse.Status.Name(r.status)


def start(backend: str):
    return start_service(MODULE, ["--backend", backend, "--log-level", "WARNING"],
                         ready=lambda port: bool(health(port)))


@pytest.fixture(scope="module", params=["memory", "redis"])
def service(request):
    tag = f"vctest-{uuid.uuid4().hex[:12]}:"
    if request.param == "redis":
        r = redis.Redis.from_url(REDIS, socket_connect_timeout=2)
        try:
            r.ping()
        except redis.ConnectionError:
            pytest.fail("no Redis on 127.0.0.1:6379 (redis-server --daemonize yes --save '')")
    svc = start("memory://" if request.param == "memory" else f"{REDIS}?prefix={tag}")
    yield svc
    assert svc.stop() == 0, svc.log()  # SIGTERM: a graceful exit
    svc.log_path.unlink(missing_ok=True)
    if request.param == "redis":
        for name in r.scan_iter(match=f"{tag}*"):
            r.delete(name)


@pytest.fixture
def client(service):
    with open_store(f"grpc://{service.address}") as store:
        yield store


@pytest.fixture
def stub(service):
    with grpc.insecure_channel(service.address) as ch:
        yield pb_grpc.KVStoreStub(ch)


def test_health(service):
    assert health(service.port) == "STATUS_SERVING"


def test_full_chunk_moves_in_1mib_pieces(client):
    k, v = torch.randn(30, 3, 256, 64), torch.randn(30, 3, 256, 64)  # 256 tokens, default model
    data = encode_full(k, v, start=0)
    assert len(data) > 11_000_000
    key = full_key(chunk_keys("smollm2@float32", list(range(256)), namespace=uuid.uuid4().hex)[0])
    client.put(key, data)
    got = client.get(key)
    span = decode_full(got)
    assert torch.equal(span.k, k) and torch.equal(span.v, v)
    st = client.stats()
    pieces = -(-len(data) // PIECE_BYTES)
    assert st["link_pieces_sent"] == pieces and st["link_pieces_received"] == pieces
    assert st["link_max_piece_bytes"] == PIECE_BYTES
    assert st["link_bytes_sent"] == st["link_bytes_received"] == len(data)


def test_many_chunks_longest_prefix(client):
    ids = list(range(7168))  # a 7k-token prompt: 28 chunks
    keys = [full_key(k) for k in chunk_keys("m", ids, namespace=uuid.uuid4().hex)]
    assert len(keys) == 28
    for i, key in enumerate(keys):
        client.put(key, bytes([i]) * 65536)
    assert client.longest_prefix(keys) == 28
    assert client.delete(keys[10]) and not client.delete(keys[10])
    assert client.longest_prefix(keys) == 10
    assert client.contains_many(keys[9:12]) == [True, False, True]
    assert client.get(keys[27]) == bytes([27]) * 65536


def test_stats_count_hits_and_misses(client):
    before = client.stats()
    key, missing = (full_key(chunk_key("stats", uuid.uuid4().hex, [i])) for i in (1, 2))
    client.put(key, b"x" * 1000)
    assert client.get(key) == b"x" * 1000
    assert client.get(missing) is None
    after = client.stats()
    assert after["hits"] - before["hits"] == 1 and after["misses"] - before["misses"] == 1
    assert after["bytes_in"] - before["bytes_in"] == 1000
    assert after["bytes_out"] - before["bytes_out"] == 1000


def test_per_request_values_stay_in_the_kvstore_and_chunks_go_to_redis():
    """Prefix chunks reach the backend; a tail, refresh or selection move (read once by the
    other service) stays in the kvstore's scratch memory, never in Redis."""
    tag = f"vctest-{uuid.uuid4().hex[:12]}:"
    r = redis.Redis.from_url(REDIS)
    svc = start(f"{REDIS}?prefix={tag}")
    try:
        with open_store(f"grpc://{svc.address}") as store:
            chunk = full_key(chunk_key("m@float32", "", [1, 2, 3]))
            store.put(chunk, b"c" * 5000)
            for key in (refresh_key("req-1"), select_key("req-1"), "tail/ns/req-1"):
                store.put(key, b"t" * 7000)
                assert store.get(key) == b"t" * 7000
                assert store.delete(key) and store.get(key) is None
            assert store.get(chunk) == b"c" * 5000
            assert store.longest_prefix([chunk, full_key("0" * 64)]) == 1
            s = store.stats()
        names = [n.decode() for n in r.scan_iter(match=f"{tag}*")]
        assert names == [f"{tag}k:{chunk}"], names  # the chunk only
        assert s["scratch_bytes_in"] == 3 * 7000 and s["bytes_in"] == 5000
    finally:
        assert svc.stop() == 0
        svc.log_path.unlink(missing_ok=True)
        for name in r.scan_iter(match=f"{tag}*"):
            r.delete(name)


def test_status_codes(stub, client):
    def code(call):
        with pytest.raises(grpc.RpcError) as e:
            call()
        return e.value.code()

    get = lambda key: list(stub.Get(pb.GetRequest(key=key), timeout=10))  # noqa: E731
    put = lambda reqs: stub.Put(iter(reqs), timeout=10)  # noqa: E731
    assert code(lambda: get("missing-" + uuid.uuid4().hex)) == grpc.StatusCode.NOT_FOUND
    assert code(lambda: get("")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code(lambda: put([pb.PutRequest(data=b"x")])) == grpc.StatusCode.INVALID_ARGUMENT
    big = pb.PutRequest(key="k", total_bytes=PIECE_BYTES + 1, data=bytes(PIECE_BYTES + 1))
    assert code(lambda: put([big])) == grpc.StatusCode.INVALID_ARGUMENT
    short = pb.PutRequest(key="k", total_bytes=10, data=b"123")
    assert code(lambda: put([short])) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgument):  # the server's INVALID_ARGUMENT, mapped back
        client.delete("")


def test_bandwidth_cap(service):
    data = os.urandom(10_000_000)
    with open_store(f"grpc://{service.address}?gbps=0.1") as slow:
        t0 = time.perf_counter()
        slow.put("bw-" + uuid.uuid4().hex, data)
        seconds = time.perf_counter() - t0
        st = slow.stats()
    assert 0.7 < seconds < 1.6, seconds  # 8e7 bits at 1e8 bit/s = 0.8 s
    assert st["link_wait_seconds"] > 0.5 and st["link_seconds"] >= seconds * 0.99


def test_full_store_and_dead_backend_codes():
    small = start("memory://?capacity_mb=1")
    dead = start(f"redis://127.0.0.1:{free_port()}/0?timeout_s=1")
    try:
        fits, big = (full_key(chunk_key("m", "", [i])) for i in (1, 2))  # backend keys
        with open_store(f"grpc://{small.address}") as s:
            s.put(fits, bytes(500_000))
            with pytest.raises(ResourceExhausted):
                s.put(big, bytes(2_000_000))
        assert health(dead.port) == "STATUS_NOT_SERVING"
        with open_store(f"grpc://{dead.address}") as d:
            with pytest.raises(Unavailable):
                d.put(fits, b"x")
    finally:
        assert small.stop() == 0 and dead.stop() == 0
    with open_store(f"grpc://127.0.0.1:{free_port()}?timeout_s=2") as nobody:
        with pytest.raises(Unavailable):
            nobody.contains("k")


def test_help_names_flags_and_env():
    out = subprocess.run([sys.executable, "-m", MODULE, "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    for word in ("--port", "--backend", "VERICACHE_KVSTORE_PORT", "VERICACHE_KVSTORE_BACKEND",
                 "memory://", "redis://", "lmcache://"):
        assert word in out
