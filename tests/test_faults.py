"""Faults with the four services running as OS processes (kvstore on Redis, verifier, drafter,
gateway). The contract under faults: a client gets a correct completion, or a prefix of it
followed by an SSE error chunk and `data: [DONE]` — never a token that full-KV greedy decoding
would not produce (every emitted text is checked against the in-process reference).

- the verifier or the kvstore is killed (SIGKILL) while a request streams (the drafter:
  tests/test_chaos.py); while the kvstore is down, requests are answered without it (their
  prompts computed); restarted on the same port, new requests succeed without restarting
  the others (their channels reconnect);
- Redis loses the stack's keys (all of them, repeatedly, while requests run): answers stay
  identical, the prefix is recomputed.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
import redis
from conftest import chat_ids
from test_services_e2e import ONE_THREAD, _grpc_ready, _http_ready, _kvstore_ready

from vericache.engine.generation import GenParams
from vericache.engine.local import generate

pytestmark = pytest.mark.slow
N = 40
QUESTION = "Write a Python function that checks whether a number is prime, with a docstring."
LONG = "Summarise this list in one sentence: " + ", ".join(f"item {i}" for i in range(120))
PREFIX = f"vericache-faults-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def stack(services):
    kv_args = ["--backend", f"redis://127.0.0.1:6379/0?prefix={PREFIX}"]
    kv = services("services.kvstore", kv_args, _kvstore_ready, env=ONE_THREAD)
    common = ["--kvstore", kv.address, "--session-ttl-s", "120"]
    ver = services("services.verifier", common, _grpc_ready("verifier"), timeout_s=120, env=ONE_THREAD)
    dra = services("services.drafter", common, _grpc_ready("drafter"), timeout_s=120, env=ONE_THREAD)
    gw = services("services.gateway", ["--drafter", dra.address, "--verifier", ver.address,
                                       "--max-tokens", str(N)], _http_ready, timeout_s=120,
                  env=ONE_THREAD)
    yield {"kvstore": kv, "verifier": ver, "drafter": dra, "gateway": gw, "common": common,
           "services": services,
           "restart": {"verifier": (common, _grpc_ready("verifier")),
                       "drafter": (common, _grpc_ready("drafter")), "kvstore": (kv_args, _kvstore_ready)}}
    _drop_keys()


def _drop_keys() -> int:
    """Delete every Redis key of this stack (only its own prefix: the server is shared)."""
    r = redis.Redis(host="127.0.0.1", port=6379, db=0)
    keys = list(r.scan_iter(match=f"{PREFIX}*", count=1000))
    return r.delete(*keys) if keys else 0


def _ref(lm, text: str, n: int = N) -> str:
    return generate(lm, chat_ids(lm, text), GenParams(mode="full", max_tokens=n)).text


def stream(port: int, text: str, on_first=None, n: int = N) -> tuple[str, list[dict], bool]:
    """Stream a chat completion: (text emitted, error chunks, whether [DONE] came)."""
    out, errors, done = [], [], False
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                      timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return "", [r.json()], True
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk)
                continue
            piece = chunk["choices"][0]["delta"].get("content") or ""
            if piece and not "".join(out) and on_first is not None:
                on_first()
            out.append(piece)
    return "".join(out), errors, done


def _check(text: str, errors: list, done: bool, ref: str) -> None:
    """The contract: the reference, or a prefix of it ended by an error chunk and [DONE]."""
    assert done, "the stream did not end with [DONE]"
    assert ref.startswith(text), f"emitted {text!r}, not a prefix of the reference {ref!r}"
    if not errors:
        assert text == ref


def test_redis_flushed_answers_stay_identical(lm, stack):
    gw = stack["gateway"]
    ref = _ref(lm, LONG, 16)
    for _ in range(2):  # the second one reads the cached prefix
        assert stream(gw.port, LONG, n=16) == (ref, [], True)
    assert _drop_keys() > 0
    assert stream(gw.port, LONG, n=16) == (ref, [], True)  # recomputed

    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            _drop_keys()
            time.sleep(0.2)

    t = threading.Thread(target=flusher, daemon=True)
    t.start()
    try:
        for _ in range(2):  # keys vanish at any point of a request: correct, or an error
            _check(*stream(gw.port, LONG, n=16), ref)
    finally:
        stop.set()
        t.join()
    assert stream(gw.port, LONG, n=16) == (ref, [], True)


@pytest.mark.parametrize("victim", ["verifier", "kvstore"])  # the drafter: tests/test_chaos.py, under load
def test_service_killed_mid_stream_then_restarted(lm, stack, victim):
    gw, dead = stack["gateway"], stack[victim]
    ref = _ref(lm, QUESTION)
    killed = []
    text, errors, done = stream(gw.port, QUESTION, on_first=lambda: killed.append(dead.proc.kill()))
    assert killed, f"no token streamed before the kill: {text!r} {errors}"
    dead.proc.wait(10)
    if victim != "kvstore":
        # the stream was cut (so the partial path below really runs): the engine's next call
        # to the dead service failed UNAVAILABLE, and the gateway ended the stream with one
        # error chunk (GenerationFailed carrying the engine's "Unavailable: <service> <rpc>:
        # UNAVAILABLE: ..."), then [DONE]
        assert text != ref and len(errors) == 1, f"the stream was not cut: {text!r} {errors}"
        err = errors[0]["error"]
        assert err["type"] == "server_error", err
        assert err["message"].startswith(f"generation failed: Unavailable: {victim} "), err
        assert ": UNAVAILABLE: " in err["message"], err
    elif errors:  # the verifier writes verified KV through the kvstore: its Verify may fail
        assert len(errors) == 1 and "UNAVAILABLE: kvstore " in errors[0]["error"]["message"], errors
    _check(text, errors, done, ref)
    print(f"\n{victim} killed mid-stream: {len(text)} of {len(ref)} characters, then {errors}")

    # while it is down: without the verifier an error, never a wrong answer, and the gateway
    # is alive but not ready; without the kvstore (a cache) the answer, its prompt computed
    text, errors, done = stream(gw.port, QUESTION)
    _check(text, errors, done, ref)
    if victim == "kvstore":
        assert (text, errors, done) == (ref, [], True), errors
    else:
        assert errors
    base = f"http://127.0.0.1:{gw.port}"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    if victim != "kvstore":
        r = httpx.get(f"{base}/ready", timeout=10)
        assert r.status_code == 503 and r.json()["backends"][victim] is False

    args, ready = stack["restart"][victim]
    # started through the module's factory, so it is stopped with the rest of the stack
    stack[victim] = stack["services"](f"services.{victim}", args, ready, timeout_s=120,
                                      env=ONE_THREAD, port=dead.port)
    deadline, attempts = time.monotonic() + 30, 0
    while True:  # the gateway's channel reconnects within its 5 s backoff cap
        attempts += 1
        text, errors, done = stream(gw.port, QUESTION)
        _check(text, errors, done, ref)
        if not errors or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not errors, f"no success within 30 s of the restart: {errors}"
    print(f"after the restart: success on attempt {attempts}")
    assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
    q2 = "Write a haiku about the sea."
    text, errors, done = stream(gw.port, q2)
    assert (text, errors, done) == (_ref(lm, q2), [], True)
    others = [stack[n] for n in ("verifier", "drafter", "kvstore") if n != victim]
    assert all(o.proc.poll() is None for o in others) and gw.proc.poll() is None

