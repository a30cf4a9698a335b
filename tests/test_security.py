"""Security with real processes: kvstore, verifier, drafter and gateway on loopback, all with an
internal token, the gateway with two API keys (one mapped to a named tenant).

Checked: internal gRPC calls without the token (or with a wrong one) are UNAUTHENTICATED, the
health probe still passes without it; RPC inputs over their limits are INVALID_ARGUMENT; /v1/*
needs a configured key (401 in the OpenAI shape otherwise), /health and /metrics stay open;
bodies over the limit are 413; tenants do not share prefix-cache entries; no pickle anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import httpx
import pytest
from service_process import REPO

from services.gateway.auth import AccessPolicy, tenant_namespace
from vericache._proto import load

pytestmark = pytest.mark.slow  # real-model work of minutes: scheduled first

TOKEN = "internal-secret-for-tests"
KEYS = ("key-alpha", "key-beta")
ENV = {"OMP_NUM_THREADS": "1", "LMCACHE_TRACK_USAGE": "false", "VERICACHE_INTERNAL_TOKEN": TOKEN}
AUTH = [("authorization", f"Bearer {TOKEN}")]
VPB, VPB_GRPC = load("verifier")
DPB, DPB_GRPC = load("drafter")
KPB, KPB_GRPC = load("kvstore")


def _stub(cls, address):
    return cls(grpc.insecure_channel(address))


def _kvstore_ready(port: int) -> bool:
    stub = _stub(KPB_GRPC.KVStoreStub, f"127.0.0.1:{port}")
    return stub.Health(KPB.HealthRequest(), timeout=2, metadata=AUTH).status == \
        KPB.HealthResponse.STATUS_SERVING


def _model_ready(stub_cls):
    return lambda port: _stub(stub_cls, f"127.0.0.1:{port}").Health(
        VPB.ServiceHealthRequest(), timeout=2, metadata=AUTH).ok


def _http_ready(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


@pytest.fixture(scope="module")
def stack(services):
    kv = services("services.kvstore", ["--backend", "memory://", "--max-value-mb", "64"],
                  _kvstore_ready, env=ENV)
    common = ["--kvstore", kv.address, "--session-ttl-s", "120"]
    ver = services("services.verifier", common, _model_ready(VPB_GRPC.VerifierStub),
                   timeout_s=120, env=ENV)
    dra = services("services.drafter", common, _model_ready(DPB_GRPC.DrafterStub),
                   timeout_s=120, env=ENV)
    gw = services("services.gateway", [
        "--drafter", dra.address, "--verifier", ver.address, "--kvstore", kv.address,
        "--max-tokens", "4", "--tenant", f"{KEYS[1]}=beta", "--max-body-bytes", "65536"],
        _http_ready, timeout_s=120, env={**ENV, "VERICACHE_API_KEY": ",".join(KEYS)})
    return {"kvstore": kv, "verifier": ver, "drafter": dra, "gateway": gw}


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=f"http://127.0.0.1:{stack['gateway'].port}", timeout=120) as c:
        yield c


def _calls(stack):
    """One cheap call per service, as (name, callable taking metadata)."""
    kv = _stub(KPB_GRPC.KVStoreStub, stack["kvstore"].address)
    ver = _stub(VPB_GRPC.VerifierStub, stack["verifier"].address)
    dra = _stub(DPB_GRPC.DrafterStub, stack["drafter"].address)
    return [("kvstore", lambda md: kv.Stats(KPB.StatsRequest(), timeout=5, metadata=md)),
            ("verifier", lambda md: ver.Release(VPB.ReleaseRequest(request_id="x"), timeout=5,
                                                metadata=md)),
            ("drafter", lambda md: dra.Health(VPB.ServiceHealthRequest(), timeout=5,
                                              metadata=md))]


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")],
                                      [("authorization", TOKEN)]], ids=["none", "wrong", "no-scheme"])
def test_internal_calls_need_the_token(stack, metadata):
    for name, call in _calls(stack):
        with pytest.raises(grpc.RpcError) as e:
            call(metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    for name, call in _calls(stack):
        call(AUTH)  # the right token passes


def test_health_probe_needs_no_token(stack):
    for name in ("kvstore", "verifier", "drafter"):
        r = subprocess.run([sys.executable, "-m", "services.common.healthcheck", "--grpc",
                            stack[name].address], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, (name, r.stdout, r.stderr)


def _invalid(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def test_rpc_inputs_over_their_limits(stack):
    kv = _stub(KPB_GRPC.KVStoreStub, stack["kvstore"].address)
    ver = _stub(VPB_GRPC.VerifierStub, stack["verifier"].address)
    dra = _stub(DPB_GRPC.DrafterStub, stack["drafter"].address)
    big_put = iter([KPB.PutRequest(key="k", total_bytes=65 << 20, data=b"x")])
    assert "limit" in _invalid(lambda: kv.Put(big_put, timeout=10, metadata=AUTH))
    _invalid(lambda: kv.LongestPrefix(KPB.LongestPrefixRequest(keys=["k"] * 70000), timeout=10,
                                      metadata=AUTH))
    _invalid(lambda: ver.Prefill(VPB.PrefillRequest(request_id="r" * 1000, token_ids=[1]),
                                 timeout=10, metadata=AUTH))
    _invalid(lambda: ver.Prefill(VPB.PrefillRequest(request_id="r", token_ids=[1] * 100_000),
                                 timeout=10, metadata=AUTH))
    _invalid(lambda: ver.Verify(VPB.VerifyRequest(items=[VPB.VerifyItem(
        request_id="r", draft_tokens=[1] * 1000)]), timeout=10, metadata=AUTH))
    _invalid(lambda: dra.Draft(DPB.DraftRequest(items=[DPB.DraftItem(request_id="r", k=10_000)]),
                               timeout=10, metadata=AUTH))
    _invalid(lambda: dra.Draft(DPB.DraftRequest(items=[DPB.DraftItem(request_id="r", k=1)] * 2000),
                               timeout=10, metadata=AUTH))


def _chat(http, key, content="Say hi.", **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra})


@pytest.mark.parametrize("key", [None, "nope", KEYS[0] + "x"])
def test_v1_needs_a_configured_key(http, key):
    r = _chat(http, key)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert http.get("/v1/models", headers=headers).status_code == 401


def test_every_configured_key_works_and_probes_stay_open(http):
    for key in KEYS:
        r = _chat(http, key)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_body_over_the_limit_is_413(http):
    r = _chat(http, KEYS[0], content="x" * 70_000)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"y" * 1024
        yield b'"}]}'

    r = http.post("/v1/chat/completions", content=chunks(), headers={
        "Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"})
    assert r.status_code in (400, 413) and "error" in r.json()


def _metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def _cached_after(http, key, prompt) -> float:
    """Send a request; once the engine has counted it as finished (its rounds land in the
    counters just after the response), the total of prompt tokens read from the cache."""
    rounds = _metric(http, "vericache_rounds_total")
    assert _chat(http, key, prompt).status_code == 200
    deadline = time.monotonic() + 10
    while _metric(http, "vericache_rounds_total") == rounds and time.monotonic() < deadline:
        time.sleep(0.05)
    return _metric(http, "vericache_cached_prompt_tokens_total")


def test_tenants_do_not_share_cached_prefixes(http):
    prompt = "Repeat after me: " + " ".join(f"word{i}" for i in range(400))
    first = _cached_after(http, KEYS[0], prompt)
    same_tenant = _cached_after(http, KEYS[0], prompt)
    assert same_tenant >= first + 256  # the same tenant reuses its cached chunks
    assert _cached_after(http, KEYS[1], prompt) == same_tenant  # another tenant recomputes


def test_namespaces_of_the_policy():
    p = AccessPolicy.from_flags("a, b", ["b=beta"], False, 1 << 20)
    assert p.authenticate(b"Bearer a") == tenant_namespace("a") != "a"
    assert p.authenticate(b"bearer b") == "beta"
    assert p.authenticate(b"Bearer c") is None and p.authenticate(None) is None
    assert p.authenticate(b"Basic a") is None
    shared = AccessPolicy.from_flags("a,b", [], True, 1 << 20)
    assert shared.authenticate(b"Bearer a") == shared.authenticate(b"Bearer b") == ""
    assert AccessPolicy().authenticate(None) == ""  # no keys: open, shared namespace
    with pytest.raises(ValueError):
        AccessPolicy.from_flags("a", ["zzz=x"], False, 1 << 20)


def test_no_pickle_anywhere():
    unsafe = r"import c?pickle|c?pickle\.(loads?|dumps?)|torch\.load\(|import (marshal|shelve|dill)"
    r = subprocess.run(["git", "grep", "-n", "-i", "-E", unsafe, "--", "*.py",
                        ":!tests/test_security.py"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "", r.stdout
