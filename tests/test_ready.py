"""Ready before serving: a gateway started before its drafter and verifier answers 503 with
Retry-After on the completions routes (and on /ready) instead of accepting requests that would
fail mid-flight; once the services are up it serves. Real processes on loopback."""

from __future__ import annotations

import time

import httpx
import pytest

from service_process import free_port
from test_services_e2e import ONE_THREAD, _grpc_ready, _http_ready, _kvstore_ready

pytestmark = pytest.mark.slow  # two model-loading services: about a minute on a small CPU

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
        "temperature": 0}


def test_gateway_is_unavailable_until_its_backends_answer(services):
    kv = services("services.kvstore", ["--backend", "memory://"], _kvstore_ready, env=ONE_THREAD)
    ports = {"verifier": free_port(), "drafter": free_port()}
    gw = services("services.gateway", ["--drafter", f"127.0.0.1:{ports['drafter']}",
                                       "--verifier", f"127.0.0.1:{ports['verifier']}"],
                  _http_ready, timeout_s=120, env=ONE_THREAD)
    base = f"http://127.0.0.1:{gw.port}"
    # alive, listening, but not ready: nothing is accepted
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    r = httpx.get(f"{base}/ready", timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["backends"] == {"drafter": False, "verifier": False}
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                       ("/v1/chat/completions", {**CHAT, "stream": True})):
        r = httpx.post(base + path, json=body, timeout=10)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "service_unavailable" and "not ready" in err["message"], err
    # the services come up on the ports the gateway was given
    for name in ("verifier", "drafter"):
        services(f"services.{name}", ["--kvstore", kv.address], _grpc_ready(name),
                 timeout_s=180, env=ONE_THREAD, port=ports[name])
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not become ready"
        time.sleep(0.5)
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    # the budgets the services reported reached the gateway's admission
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'vericache_kv_budget_bytes{side="verifier"}' in metrics
