"""Per-API-key quotas (services/gateway/quota.py): the rule on a fake clock, then a real
`vericache serve` with three keys — one floods, one must still be served, one spends its
tokens per minute — checked by counts (admitted, refused), never by times."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from service_process import start_serve

from services.gateway.quota import QuotaLimits, Quotas

KEYS = {"flood": "key-flood", "calm": "key-calm", "spend": "key-spend"}
MAX_CONCURRENT, TPM = 2, 400


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_rule_concurrency_and_tokens_per_minute():
    clock = Clock()
    q = Quotas(QuotaLimits(max_concurrent=2, tokens_per_minute=100), clock)
    assert q.admit("a") is None and q.admit("a") is None
    assert q.admit("a") == 1.0  # both slots taken
    assert q.admit("b") is None  # another key is not affected
    q.finish("a", 60)
    clock.t += 10
    assert q.admit("a") is None  # a slot freed; 60 < 100 spent
    q.finish("a", 30)
    q.finish("a", 20)  # 110 spent: at 1000, 1010, 1010
    retry = q.admit("a")
    assert retry == pytest.approx(50.0)  # the first 60 expire at 1060; then 50 < 100
    clock.t = 1060.0
    assert q.admit("a") is None
    snap = q.snapshot()
    assert snap["a"] == {"active": 1, "spent": 50, "admitted": 4, "refused": 2}
    assert snap["b"]["active"] == 1
    assert Quotas(QuotaLimits(), clock).admit("a") is None  # 0: unlimited
    with pytest.raises(ValueError):
        QuotaLimits(max_concurrent=-1)


@pytest.fixture(scope="module")
def server():
    service = start_serve(["--max-tokens", "8", "--max-concurrent-per-key", str(MAX_CONCURRENT),
                           "--tokens-per-minute-per-key", str(TPM)],
                          env={"OMP_NUM_THREADS": "1", "VERICACHE_API_KEY": ",".join(KEYS.values())})
    yield service
    service.stop()
    service.log_path.unlink(missing_ok=True)


def _body(text: str, n: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0,
            "stream": stream, "ignore_eos": True}


def _auth(who: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def _check_429(r: httpx.Response) -> int:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded"), err
    assert set(err) == {"message", "type", "param", "code"}
    return int(r.headers["retry-after"])


def _stream_text(r: httpx.Response) -> str:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            out.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(out)


def test_flooding_key_does_not_starve_another(server):
    url = f"http://{server.address}/v1/chat/completions"
    with httpx.Client(timeout=120) as client:
        # the flooder opens 8 long streams and holds them: MAX_CONCURRENT are admitted
        held, refused = [], []
        for _ in range(8):
            r = client.send(client.build_request("POST", url, json=_body("Count to 100.", 128, True),
                                                 headers=_auth("flood")), stream=True)
            if r.status_code == 200:
                held.append(r)
            else:
                r.read()
                refused.append(_check_429(r))
        assert len(held) == MAX_CONCURRENT and len(refused) == 8 - MAX_CONCURRENT
        assert all(s == 1 for s in refused)

        # meanwhile the other key's requests are all admitted and complete
        def calm(i: int) -> tuple[int, str]:
            with client.stream("POST", url, json=_body(f"Name a colour ({i}).", 4, True),
                               headers=_auth("calm")) as r:
                return r.status_code, _stream_text(r) if r.status_code == 200 else r.read()

        with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
            results = list(pool.map(calm, range(4)))
        assert [s for s, _ in results] == [200] * 4, results
        assert all(text for _, text in results)

        for r in held:  # hang up mid-answer: the slots free
            r.close()
        for attempt in range(50):
            r = client.post(url, json=_body("Hi", 2, False), headers=_auth("flood"))
            if r.status_code == 200:
                break
            _check_429(r)
            __import__("time").sleep(0.2)
        assert r.status_code == 200, r.text
        print(f"\nflood: {len(held)} admitted, {len(refused)} refused (Retry-After 1); calm: "
              f"4 of 4 admitted and complete; flood admitted again after {attempt} refusals")


def test_tokens_per_minute(server):
    url = f"http://{server.address}/v1/chat/completions"
    prompt = "Summarise: " + ", ".join(f"item {i}" for i in range(40))
    spent, n = 0, 0
    with httpx.Client(timeout=120) as client:
        while spent < TPM:
            r = client.post(url, json=_body(prompt, 4, False), headers=_auth("spend"))
            assert r.status_code == 200, r.text
            spent += r.json()["usage"]["total_tokens"]
            n += 1
        r = client.post(url, json=_body(prompt, 4, False), headers=_auth("spend"))
        retry = _check_429(r)
        assert 1 <= retry <= 60
        # another key is unaffected
        assert client.post(url, json=_body("Hi", 2, False), headers=_auth("calm")).status_code == 200
        # /health and /v1/models are not counted
        assert client.get(f"http://{server.address}/v1/models", headers=_auth("spend")).status_code == 200
    print(f"\ntokens per minute {TPM}: {n} requests ({spent} tokens) admitted, the next refused, "
          f"Retry-After {retry}")
