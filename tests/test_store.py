"""The KV chunk store: codec, keys, and every backend against the same contract (real Redis)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import time
import uuid

import pytest
import redis
import torch

from vericache import _proto
from vericache.compress import KVSpan, make_compressor
from vericache.errors import InvalidArgument, ResourceExhausted, UnknownName
from vericache.store import chunk_keys, compressed_key, full_key, open_store, store_schemes
from vericache.store.codec import (decode, decode_chunk, decode_full, encode, encode_chunk,
                                   encode_full)
from vericache.store.keys import chunk_key
from vericache.store.memory import MemoryStore

REDIS = "redis://127.0.0.1:6379/0"
HAS_LMCACHE = importlib.util.find_spec("lmcache") is not None
NO_LMCACHE = "lmcache is not installed (make install: pip install --no-deps lmcache==0.5.6)"
MB = 1 << 20


def redis_client() -> redis.Redis:
    r = redis.Redis.from_url(REDIS, socket_connect_timeout=2)
    try:
        r.ping()
    except redis.ConnectionError:
        pytest.fail("no Redis on 127.0.0.1:6379 (redis-server --daemonize yes --save '')")
    return r


def drop_prefix(r: redis.Redis, pattern: str) -> None:
    for name in r.scan_iter(match=pattern, count=1000):
        r.delete(name)


# ---- codec --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.uint8, torch.bool])
def test_codec_roundtrip_dtypes(dtype):
    t = (torch.randn(3, 5, 7) * 10).to(dtype)
    tensors = {"x": t, "scalar": torch.tensor(3, dtype=dtype),
               "empty": torch.zeros(0, 4, dtype=dtype), "strided": t.transpose(0, 2)}
    out, meta = decode(encode(tensors, {"kind": "test", "n": [1, 2]}))
    assert meta == {"kind": "test", "n": [1, 2]}
    for name, ref in tensors.items():
        assert out[name].dtype == ref.dtype and out[name].shape == ref.shape
        assert torch.equal(out[name], ref), name


def test_codec_is_json_header_plus_raw_bytes():
    data = encode({"a": torch.arange(4, dtype=torch.int32)}, {"kind": "x"})
    assert data[:4] == b"VCKV" and b"pickle" not in data and b'"dtype":"int32"' in data
    assert data.endswith(torch.arange(4, dtype=torch.int32).numpy().tobytes())


def test_codec_rejects_garbage_and_wrong_kind():
    with pytest.raises(InvalidArgument):
        decode(b"not a chunk at all")
    with pytest.raises(InvalidArgument):
        decode_chunk(encode_full(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)))
    with pytest.raises(InvalidArgument):
        encode_full(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4))
    with pytest.raises(InvalidArgument):
        encode({"a": torch.zeros(1)}, {"bad": object()})


def test_full_chunk_roundtrip_default_model_shape():
    k, v = torch.randn(30, 3, 256, 64), torch.randn(30, 3, 256, 64)  # one 256-token chunk
    data = encode_full(k, v, start=512)
    assert 2 * k.numel() * 4 <= len(data) < 2 * k.numel() * 4 + 4096
    span = decode_full(data)
    assert span.start == 512 and torch.equal(span.k, k) and torch.equal(span.v, v)
    span.k.add_(1.0)  # the default decode owns its memory
    assert decode_full(data).k.equal(k)
    # borrowed: read-only views of the stored bytes (a prefix load copies them once, into
    # its cache)
    lent = decode_full(data, borrow=True)
    assert lent.start == 512 and torch.equal(lent.k, k) and torch.equal(lent.v, v)
    at = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert at <= lent.k.data_ptr() < lent.v.data_ptr() < at + len(data)


@pytest.mark.parametrize("spec", ["kivi:bits=2", "streamingllm", "identity"])
def test_compressed_chunk_roundtrip(spec):
    comp = make_compressor(spec)
    span = KVSpan(k=torch.randn(2, 3, 256, 64), v=torch.randn(2, 3, 256, 64), start=256)
    chunk = comp.compress(span)
    back = decode_chunk(encode_chunk(chunk))
    assert (back.compressor, back.start, back.length) == (chunk.compressor, 256, 256)
    assert back.tensors.keys() == chunk.tensors.keys()
    for a, b in zip(comp.decompress(chunk), comp.decompress(back)):
        assert torch.equal(a, b)


# ---- keys ---------------------------------------------------------------------------------

def test_chunk_keys_chain_names_prefixes():
    ids = list(range(1000))
    keys = chunk_keys("m", ids, 256)
    assert len(keys) == 3  # 1000 tokens: three complete chunks, the tail gets no key
    assert keys == chunk_keys("m", ids[:800], 256) == chunk_keys("m", ids[:768], 256)
    changed = ids[:300] + [7] + ids[301:]
    other = chunk_keys("m", changed, 256)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    assert keys[1] == chunk_key("m", keys[0], ids[256:512])
    # same tokens under another parent, model or tenant: another key
    assert chunk_key("m", "", ids[256:512]) != keys[1]
    assert set(chunk_keys("m2", ids, 256)).isdisjoint(keys)
    assert set(chunk_keys("m", ids, 256, namespace="tenant-b")).isdisjoint(keys)
    assert chunk_keys("m", ids[:255], 256) == []
    with pytest.raises(InvalidArgument):
        chunk_keys("m", ids, 0)


def test_stored_key_carries_the_kind():
    k = chunk_keys("m", list(range(256)))[0]
    kinds = {full_key(k), compressed_key(k, "kivi:bits=2"), compressed_key(k, "kivi:bits=4")}
    assert len(kinds) == 3 and all(x.startswith(k) for x in kinds)
    assert compressed_key(k, "snapkv:ratio=4") == compressed_key(k, "snapkv:ratio=4")


# ---- memory backend -----------------------------------------------------------------------

def test_memory_lru_eviction():
    s = open_store("memory://?capacity_mb=3")
    for name in "abc":
        s.put(name, bytes(MB))
    assert s.get("a") is not None  # a is now the most recently used
    s.put("d", bytes(MB))
    assert [s.contains(x) for x in "abcd"] == [True, False, True, True]
    st = s.stats()
    assert st["entries"] == 3 and st["bytes_stored"] == 3 * MB and st["evictions"] == 1
    with pytest.raises(ResourceExhausted):
        s.put("huge", bytes(4 * MB))


def test_memory_ttl():
    now = [100.0]
    s = MemoryStore(ttl_s=10, clock=lambda: now[0])
    s.put("a", b"1")
    now[0] += 5
    s.put("b", b"2")
    now[0] += 6  # a is 11 s old, b 6 s
    assert s.get("a") is None and s.get("b") == b"2"
    assert s.stats()["entries"] == 1
    now[0] += 5
    assert not s.contains("b") and s.stats()["entries"] == 0


# ---- every backend, one contract ----------------------------------------------------------

@pytest.fixture(params=["memory", "redis", "lmcache", "lmcache+redis"])
def store(request):
    tag = f"vctest-{uuid.uuid4().hex[:12]}"
    if request.param == "memory":
        s = open_store("memory://")
        yield s
        s.close()
        return
    if request.param.startswith("lmcache") and not HAS_LMCACHE:
        pytest.fail(NO_LMCACHE)
    r = redis_client()
    url = {"redis": f"{REDIS}?prefix={tag}:",
           "lmcache": f"lmcache://?capacity_mb=64&name={tag}",
           "lmcache+redis": f"lmcache://?capacity_mb=64&name={tag}&remote_url={REDIS}",
           }[request.param]
    s = open_store(url)
    yield s
    s.close()
    drop_prefix(r, f"{tag}*")
    r.close()


def test_store_contract(store):
    keys = [full_key(k) for k in chunk_keys("m", list(range(256 * 6)))]
    values = [os.urandom(1000 + i) for i in range(len(keys))]
    assert store.get(keys[0]) is None and not store.contains(keys[0])
    for k, v in zip(keys[:4], values):
        store.put(k, v)
    assert store.get(keys[1]) == values[1]
    assert store.get_many(keys[:2]) == values[:2]
    assert store.contains_many(keys[3:5]) == [True, False]
    assert store.longest_prefix(keys) == 4 and store.longest_prefix([]) == 0
    store.put(keys[1], b"overwritten")
    assert store.get(keys[1]) == b"overwritten"
    assert store.delete(keys[2]) and not store.delete(keys[2])
    assert store.longest_prefix(keys) == 2
    st = store.stats()
    assert st["hits"] == 4 and st["misses"] == 1
    assert st["bytes_out"] == len(values[1]) * 2 + len(values[0]) + len(b"overwritten")
    assert st["entries"] == 3
    with pytest.raises(InvalidArgument):
        store.put("", b"x")


# ---- Redis and LMCache specifics ----------------------------------------------------------

def test_redis_ttl_and_capacity():
    r = redis_client()
    tag = f"vctest-{uuid.uuid4().hex[:12]}:"
    try:
        s = open_store(f"{REDIS}?prefix={tag}&ttl_s=0.3&capacity_mb=2")
        s.put("a", bytes(MB))
        s.put("b", bytes(MB))
        assert s.get("a") is not None  # b is now the least recently used
        s.put("c", bytes(MB))
        assert [s.contains(x) for x in "abc"] == [True, False, True]
        assert 0 < r.pttl(f"{tag}k:a") <= 300
        with pytest.raises(ResourceExhausted):
            s.put("huge", bytes(3 * MB))
        time.sleep(0.4)
        assert s.get("a") is None and s.stats()["entries"] == 0
        s.close()
    finally:
        drop_prefix(r, f"{tag}*")


def test_lmcache_remote_outlives_the_cpu_pool():
    if not HAS_LMCACHE:
        pytest.fail(NO_LMCACHE)
    r = redis_client()
    tag = f"vctest-{uuid.uuid4().hex[:12]}"
    url = f"lmcache://?capacity_mb=8&name={tag}&remote_url={REDIS}"
    try:
        with open_store(url) as a:
            for i in range(12):  # 12 MB through an 8 MB pool: the first ones are evicted
                a.put(f"k{i}", bytes([i]) * MB)
            assert a.stats()["bytes_stored"] <= 8 * MB
        with open_store(url) as b:  # a new process's view: only the remote has them
            assert b.stats()["entries"] == 0
            assert b.get("k0") == bytes([0]) * MB
            assert b.longest_prefix([f"k{i}" for i in range(12)]) == 12
    finally:
        drop_prefix(r, f"{tag}*")


# ---- registry and generated stubs ---------------------------------------------------------

def test_registry_names_the_valid_schemes():
    assert set(store_schemes()) >= {"memory", "redis", "lmcache", "grpc"}
    with pytest.raises(UnknownName, match="memory://.*redis://"):
        open_store("s3://bucket")
    with pytest.raises(InvalidArgument, match="capacity_mb"):
        open_store("memory://?capacity=3")


def test_generated_stubs_match_the_proto(tmp_path):
    _proto.ensure()
    fresh = tmp_path / "gen"
    _proto.generate(fresh)
    ours = {p.relative_to(_proto.GEN_DIR): p.read_text() for p in _proto.GEN_DIR.rglob("*.py")}
    theirs = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*.py")}
    assert ours == theirs, "vericache/_gen is stale: run `make proto`"
    assert not _proto.is_stale()


def test_changed_proto_regenerates(tmp_path):
    protos, out = tmp_path / "proto", tmp_path / "gen"
    shutil.copytree(_proto.PROTO_ROOT, protos)
    _proto.ensure(out, protos)
    assert not _proto.is_stale(out, protos)
    f = protos / "vericache/v1/kvstore.proto"
    f.write_text(f.read_text().replace("message StatsRequest {}",
                                       "message StatsRequest {\n  /// new\n  bool reset = 1;\n}"))
    assert _proto.is_stale(out, protos)
    _proto.ensure(out, protos)
    assert not _proto.is_stale(out, protos)
    assert "reset" in (out / "v1/kvstore_pb2.py").read_text()


def test_load_full_reuses_tail_chunks_that_need_no_compressed_form():
    """Full chunks past the compressed region (they lie in the exact tail) are reused; a
    missing compressed chunk inside the region stops reuse there."""
    from vericache.store.prefix import PrefixCache, TransferStats

    store, spec, cs = MemoryStore(), "snapkv:ratio=4", 4
    pc = PrefixCache(store, "m", cs)
    prompt = list(range(18))  # 4 full chunks before the last (partial) one
    keys = pc.keys(prompt)
    for i, key in enumerate(keys[:4]):
        store.put(full_key(key), encode_full(torch.zeros(2, 1, cs, 3), torch.zeros(2, 1, cs, 3), i * cs))
    for key in keys[:2]:
        store.put(compressed_key(key, spec), b"c")
    # the compressed region ends at token 8 (2 chunks); chunks 2 and 3 are tail: reused
    assert pc.load_full(prompt, spec, 8, 4, TransferStats()).length == 16
    store.delete(compressed_key(keys[1], spec))
    assert pc.load_full(prompt, spec, 8, 4, TransferStats()).length == 4
    assert pc.load_full(prompt, None, 8, 4, TransferStats()).length == 16
