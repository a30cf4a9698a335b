"""End to end: kvstore (Redis behind it), verifier, drafter and gateway as four OS processes on
loopback, driven by the official openai client. Every greedy answer must be the in-process
full-KV greedy output, token for token."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import httpx
import openai  # a required test dependency: missing fails the module, never skips it
import pytest
import redis

from conftest import chat_ids, check_chat_top_logprobs, long_code_prompt
from vericache._proto import load
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.memory import IDLE_TRIM_S

pytestmark = pytest.mark.slow  # real-model work of minutes: scheduled first

N = 24
ONE_THREAD = {"OMP_NUM_THREADS": "1", "LMCACHE_TRACK_USAGE": "false"}


VPB, _ = load("verifier")  # the health messages live in verifier.proto
# each service's own KV budget (SmolLM2: 45 KiB of KV a token): room for this module's
# requests, and the gateway admits by them
BUDGET_MB = {"verifier": 300, "drafter": 100}


def _health(module: str, address: str):
    stub_cls = getattr(load(module)[1], f"{module.capitalize()}Stub")
    with grpc.insecure_channel(address) as ch:
        return stub_cls(ch).Health(VPB.ServiceHealthRequest(), timeout=2)


def _grpc_ready(module: str):
    return lambda port: _health(module, f"127.0.0.1:{port}").ok


def _kvstore_ready(port: int) -> bool:
    pb, pb_grpc = load("kvstore")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=2).status == \
            pb.HealthResponse.STATUS_SERVING


def _http_ready(port: int) -> bool:
    """The gateway is up (it may not serve yet: see `_gateway_ready`)."""
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


def _gateway_ready(port: int) -> bool:
    """The gateway serves: the backends answer and it has calibrated through them."""
    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200


@pytest.fixture(scope="module")
def stack(services):
    prefix = f"vericache-e2e-{uuid.uuid4().hex[:8]}:"
    kv = services("services.kvstore", ["--backend", f"redis://127.0.0.1:6379/0?prefix={prefix}"],
                  _kvstore_ready, env=ONE_THREAD)
    common = ["--kvstore", kv.address, "--session-ttl-s", "120"]
    ver = services("services.verifier", [*common, "--kv-budget-mb", str(BUDGET_MB["verifier"])],
                   _grpc_ready("verifier"), timeout_s=120, env=ONE_THREAD)
    dra = services("services.drafter", [*common, "--draft-kv-budget-mb", str(BUDGET_MB["drafter"])],
                   _grpc_ready("drafter"), timeout_s=120, env=ONE_THREAD)
    gw = services("services.gateway", ["--drafter", dra.address, "--verifier", ver.address,
                                       "--kvstore", kv.address, "--max-tokens", str(N),
                                       "--schedule", "staggered", "--calibrate", "on"],
                  _gateway_ready, timeout_s=360, env=ONE_THREAD)  # it calibrates first
    yield {"kvstore": kv, "verifier": ver, "drafter": dra, "gateway": gw}
    r = redis.Redis(host="127.0.0.1", port=6379, db=0)  # shared server: drop only our keys
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack['gateway'].port}/v1", api_key="x")


def _ref(lm, ids, n=N):
    return generate(lm, ids, GenParams(mode="full", max_tokens=n)).text


QUESTIONS = ["Write a Python function that reverses a list.", "What is a KV cache? One sentence.",
             "List three colors as JSON.", "Write a haiku about the sea.", "Say hello."]


def test_the_gateway_calibrated_through_the_services_before_it_was_ready(stack):
    """Before the first request: the cost model was fitted from timed rounds through the
    drafter and verifier services, whose calibration sessions are gone, and none of its
    synthetic rounds count as traffic."""
    text = httpx.get(f"http://127.0.0.1:{stack['gateway'].port}/metrics", timeout=10).text
    assert _metric(text, "vericache_cost_model_fitted") == 1
    assert _metric(text, "vericache_cost_model_calibration_seconds") > 0
    assert _metric(text, "vericache_requests_total") == 0
    assert _metric(text, "vericache_cost_model_measured_tokens_per_second") == 0
    for name in ("verifier", "drafter"):
        h = _health(name, stack[name].address)
        assert h.sessions == 0 and h.kv_in_use_bytes == 0, name


def test_chat_identical_to_full_greedy(lm, client):
    q = QUESTIONS[0]
    r = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=N, temperature=0,
                                       messages=[{"role": "user", "content": q}])
    assert r.choices[0].message.content == _ref(lm, chat_ids(lm, q))
    assert r.usage.completion_tokens <= N and r.usage.rounds >= 1


def test_chat_stream_identical(lm, client):
    q = QUESTIONS[1]
    chunks = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=N, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": q}])
    text, usage = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
        if c.usage:
            usage = c.usage
    assert text == _ref(lm, chat_ids(lm, q))
    assert usage is not None and usage.tokens_per_round >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_identical(lm, client, stream):
    prompt = "def fibonacci(n):"
    ids = lm.tokenizer(prompt)["input_ids"]
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="smollm2-135m-instruct", prompt=prompt, max_tokens=N, stream=True) if c.choices)
    else:
        text = client.completions.create(model="smollm2-135m-instruct", prompt=prompt,
                                         max_tokens=N).choices[0].text
    assert text == _ref(lm, ids)


def test_four_concurrent_requests_each_identical(lm, client):
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=N,
            messages=[{"role": "user", "content": QUESTIONS[i]}],
            extra_body={"vericache": {"compressor": ["snapkv", "streamingllm", "kivi", "snapkv"][i],
                                      "draft_len": [4, 8, 16, 32][i], "adaptive": False}})
        results[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert results[i] == _ref(lm, chat_ids(lm, QUESTIONS[i])), i
    # the gateway runs --schedule staggered: one half verified while the other drafted
    metrics = httpx.get(f"{client.base_url}".replace("/v1/", "/metrics"), timeout=10).text
    assert _metric(metrics, "vericache_overlapped_rounds_total") > 0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_long_prompt_goes_through_the_store_and_is_reused(lm, client, stack):
    """A ~1.1k-token prompt's KV (4 full chunks of 11.8 MB each) passes through the kvstore
    in 1 MiB pieces; a second request with the same prefix reuses the cached chunks."""
    ids = long_code_prompt(lm, 1100)
    url = f"http://127.0.0.1:{stack['gateway'].port}/metrics"
    before = httpx.get(url).text
    outs = []
    for _ in range(2):
        # k fixed: the request drafts, so the drafter attaches (reads its compressed chunks
        # through the kvstore); the cost model may keep an 8-token answer on plain steps,
        # which never attach
        r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=8,
                                      extra_body={"vericache": {"draft_len": 4, "adaptive": False}})
        outs.append(r.choices[0].text)
        # the question-aware set reached the drafter through the kvstore (select/<id>)
        u = r.usage.model_extra or {}
        assert u["selection"].startswith("question") and u["selection_moved_tokens"] > 0
    after = httpx.get(url).text
    assert outs[0] == outs[1] == _ref(lm, ids, 8)
    cached = _metric(after, "vericache_cached_prompt_tokens_total") - \
        _metric(before, "vericache_cached_prompt_tokens_total")
    assert cached >= 1024  # the second request reused 4 complete chunks
    assert _metric(after, "vericache_kvstore_hits_total") > _metric(before, "vericache_kvstore_hits_total")


@pytest.mark.parametrize("compressor", ["snapkv", "kivi:bits=2"])
def test_verify_selection_moves_the_drafters_set_between_rounds(lm, client, stack, compressor):
    """`verify`: the verifier's re-selections after verify passes reach the drafter through the
    kvstore on Commit; the answer stays full greedy. (Over KIVI the moves raise tokens to 8
    bits: its salient set, filled by half at attach and by the moves after.)"""
    ids = long_code_prompt(lm, 1100)
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=N,
                                  extra_body={"vericache": {"selection": "verify:every=1,tokens=8",
                                                            "compressor": compressor,
                                                            "draft_len": 4, "adaptive": False}})
    assert r.choices[0].text == _ref(lm, ids)
    u = r.usage.model_extra or {}
    assert u["selection"].startswith("verify") and u["rounds"] >= 3
    # the question's move at attach, then moves after verify passes
    assert u["selection_moves"] >= 2 and u["selection_moved_tokens"] > 0
    url = f"http://127.0.0.1:{stack['gateway'].port}/metrics"
    assert _metric(httpx.get(url).text, "vericache_selection_delta_bytes_total") > 0


def test_services_release_sessions(stack):
    deadline = time.monotonic() + 5  # the gateway releases off its engine's thread
    for name in ("verifier", "drafter"):
        while (h := _health(name, stack[name].address)).sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.sessions == 0 and h.kv_in_use_bytes == 0, name


def test_services_hold_their_own_kv_budgets_and_the_gateway_admits_by_them(stack):
    """--kv-budget-mb / --draft-kv-budget-mb bound each service's sessions; the gateway read
    them from the services' Health (it was given no budget flag); a session that would pass
    the verifier's budget is refused with RESOURCE_EXHAUSTED naming the flag, holding nothing."""
    text = httpx.get(f"http://127.0.0.1:{stack['gateway'].port}/metrics").text
    for side in ("verifier", "drafter"):
        h = _health(side, stack[side].address)
        assert h.kv_budget_bytes == BUDGET_MB[side] << 20, side
        assert _metric(text, f'vericache_kv_budget_bytes{{side="{side}"}}') == BUDGET_MB[side] << 20
    _, stub_mod = load("verifier")
    per_token = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32
    # the drafter holds bfloat16 K/V on this CPU and says so: the gateway charges it that
    assert _health("verifier", stack["verifier"].address).kv_bytes_per_token == per_token
    assert _health("drafter", stack["drafter"].address).kv_bytes_per_token == per_token // 2
    extra = (BUDGET_MB["verifier"] << 20) // per_token  # 200 prompt tokens + this: over budget
    with grpc.insecure_channel(stack["verifier"].address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            stub_mod.VerifierStub(ch).Prefill(VPB.PrefillRequest(
                request_id="over-budget", token_ids=list(range(1, 201)), extra_capacity=extra,
                chunk_size=256), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--kv-budget-mb" in e.value.details()
    h = _health("verifier", stack["verifier"].address)
    assert h.sessions == 0 and h.kv_in_use_bytes == 0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _abandon(base: str, waves: int) -> tuple[int, float]:
    """20 streaming clients a wave that hang up after their first token; returns
    (how many got a token first, seconds until every session and KV byte was freed)."""
    def abandon(i: int) -> bool:
        body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                "max_tokens": N, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if '"content"' in line and '"content":""' not in line.replace(" ", ""):
                    return True  # a token arrived: hang up now
        return False

    got = 0
    for wave in range(waves):
        out: list[bool] = []
        ts = [threading.Thread(target=lambda i=i: out.append(abandon(wave * 20 + i)))
              for i in range(20)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        got += sum(out)
    return got, time.monotonic()


def test_abandoned_streams_free_sessions_and_memory(stack, lm):
    """Clients that hang up mid-answer free their sessions on both services and their KV
    budget at once, and 100 of them do not grow the idle processes (40 before them set the
    allocators' high-water mark: 20 streams in flight; once idle, each process gives what
    it freed back, `vericache.memory`)."""
    base = f"http://127.0.0.1:{stack['gateway'].port}"
    names = ("verifier", "drafter", "gateway")
    rss = [{n: round(_rss_mb(stack[n].proc.pid)) for n in names}]
    freed = []
    for waves in (2, 5):
        got, t0 = _abandon(base, waves)
        assert got >= 18 * waves  # (a few may end before their first token is read: short answers)
        while time.monotonic() - t0 < 60:
            hs = [_health(n, stack[n].address) for n in ("verifier", "drafter")]
            active = httpx.get(f"{base}/health").json()["active"]
            if active == 0 and all(h.sessions == 0 and h.kv_in_use_bytes == 0 for h in hs):
                break
            time.sleep(0.1)
        freed.append(round(time.monotonic() - t0, 2))
        assert active == 0 and all(h.sessions == 0 and h.kv_in_use_bytes == 0 for h in hs), hs
        text = httpx.get(f"{base}/metrics").text
        for side in ("verifier", "drafter"):
            assert _metric(text, f'vericache_kv_bytes{{side="{side}"}}') == 0
        time.sleep(IDLE_TRIM_S + 1.5)  # idle: each process gives its freed memory back
        rss.append({n: round(_rss_mb(stack[n].proc.pid)) for n in names})
    print(f"40, then 100 abandoned streams: all freed {freed} s after the last hang-up; "
          f"RSS MB before, after the 40, after the 100: {rss}")
    # a leak of the 100's sessions would be ~100 x 70 tokens x 45 KiB = 300 MB
    assert all(rss[2][n] - rss[1][n] < 100 for n in names), rss
    ids = chat_ids(lm, QUESTIONS[0])  # and the stack still answers exactly
    out = httpx.post(f"{base}/v1/completions", json={"prompt": ids, "max_tokens": N},
                     timeout=120).json()
    assert out["choices"][0]["text"] == _ref(lm, ids)


def test_bad_request_is_400_and_service_keeps_serving(client, stack):
    r = httpx.post(f"http://127.0.0.1:{stack['gateway'].port}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                         "vericache": {"compressor": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "compressor"
    ok = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content


def test_idle_sessions_expire(services, stack, lm):
    """A lost gateway leaks nothing: a session idle past --session-ttl-s is freed."""
    ver = services("services.verifier", ["--kvstore", stack["kvstore"].address, "--session-ttl-s", "1"],
                   _grpc_ready("verifier"), timeout_s=120, env=ONE_THREAD)
    _, stub_mod = load("verifier")
    with grpc.insecure_channel(ver.address) as ch:
        stub = stub_mod.VerifierStub(ch)
        stub.Prefill(VPB.PrefillRequest(request_id="orphan", token_ids=chat_ids(lm, "hi"),
                                        chunk_size=256, extra_capacity=8), timeout=60)
        assert stub.Health(VPB.ServiceHealthRequest(), timeout=5).sessions == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and stub.Health(VPB.ServiceHealthRequest(), timeout=5).sessions:
            time.sleep(0.5)
        assert stub.Health(VPB.ServiceHealthRequest(), timeout=5).sessions == 0
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(VPB.VerifyRequest(items=[VPB.VerifyItem(request_id="orphan")]), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_penalties_and_logprobs_through_the_services(lm, client):
    """Penalties and logit_bias reach the drafter and the verifier, and logprobs come back
    in the verifier's Verify answers: the tokens are in-process full-KV greedy decoding with
    the same processing, the logprobs equal its within fp32 noise."""
    prompt = "def fibonacci(n):"
    ids = lm.tokenizer(prompt)["input_ids"]
    proc = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                logit_bias={"13": -3.0})
    r = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=N, temperature=0, logprobs=2,
        extra_body={**proc, "ignore_eos": True,
                    "vericache": {"compressor": "snapkv", "draft_len": 4, "adaptive": False}})
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=N, ignore_eos=True, logprobs=2,
                                      **{**proc, "logit_bias": {13: -3.0}}))
    plain = generate(lm, ids, GenParams(mode="full", max_tokens=N, ignore_eos=True)).text
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text != plain
    assert lp.tokens == [lm.tokenizer.decode([t]) for t in ref.token_ids]
    diff = max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs, ref.logprobs))
    print(f"services: logprob max diff {diff:.2e}")
    assert len(lp.token_logprobs) == N and diff < 1e-3
    assert (r.usage.model_extra or {})["tokens_per_round"] > 1
    # sampling with top_k = 1 over the services (the drafter's q cross with the drafts):
    # only the most likely processed token survives, so the answer is the greedy one
    s = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=N, temperature=1.0, seed=3,
        extra_body={**proc, "top_k": 1, "ignore_eos": True,
                    "vericache": {"compressor": "snapkv", "draft_len": 4, "adaptive": False}})
    assert s.choices[0].text == ref.text


def test_chat_top_logprobs_through_the_services(lm, client):
    """The official client's `logprobs=True, top_logprobs=5` in chat through the services
    (`conftest.check_chat_top_logprobs`)."""
    diff, top_diff = check_chat_top_logprobs(lm, client, QUESTIONS[1], N)
    print(f"services chat: logprob max diff vericache vs full {diff:.2e}, top-5 {top_diff:.2e}")


def test_structured_output_through_the_services(client):
    """The grammar (Sampling.grammar) reaches the drafter and the verifier: a json_schema
    answer validates and equals the services' constrained full greedy answer (asked at the
    same time). A required call's grammar travels the same way (the next test)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    def ask(mode: str):
        return client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=N, temperature=0,
            messages=[{"role": "user", "content": "Give a person's name and age as a JSON object."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
            extra_body={"vericache": {"mode": mode, "compressor": "snapkv", "draft_len": 4,
                                      "adaptive": False}})

    with ThreadPoolExecutor(2) as pool:
        r, full = pool.map(ask, ["vericache", "full"])
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), person)
    assert text == full.choices[0].message.content
    assert (r.usage.model_extra or {})["tokens_per_round"] > 1


def test_tools_required_and_auto_through_the_services(client):
    """The official client's `tools` through the four services: a required call (its grammar
    reaches the drafter and the verifier) parses and its arguments validate; auto answers
    text or a call that parses. Asked at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    from test_gateway import SCHEMAS, TOOLS, WEATHER_ASK, _call, check_auto_answer

    def ask(choice):
        return client.chat.completions.create(
            model="smollm2-135m-instruct", messages=WEATHER_ASK, temperature=0, tools=TOOLS,
            tool_choice=choice, max_tokens=8 if choice == "auto" else 40,
            extra_body={"vericache": {"compressor": "snapkv", "draft_len": 4, "adaptive": False}})

    with ThreadPoolExecutor(2) as pool:
        required, auto = pool.map(ask, ["required", "auto"])
    assert required.choices[0].finish_reason == "tool_calls"
    name, args = _call(required.choices[0].message)
    jsonschema.validate(args, SCHEMAS[name])
    assert (required.usage.model_extra or {})["tokens_per_round"] > 1
    check_auto_answer(auto.choices[0])


def test_a_request_attaches_to_the_drafter_only_when_it_drafts(lm, stack):
    """Rounds over the services (`RemoteBackends`) with k chosen by hand: plain steps (k = 0)
    never touch the drafter (no session, no draft KV read), the first round that drafts
    attaches it (its plain-step tokens go with that Draft order), plain steps again, and the
    answer is full greedy's."""
    from conftest import rounds_by_hand

    from vericache.engine.generation import Generation
    from vericache.engine.remote import RemoteBackends

    ids = long_code_prompt(lm, 600)
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=30, ignore_eos=True)).token_ids
    b = RemoteBackends(stack["drafter"].address, stack["verifier"].address, lm.runner.vocab_size)
    g = Generation(lm, ids, GenParams(mode="vericache", compressor="snapkv", draft_len=8,
                                      max_tokens=30, ignore_eos=True, namespace="lazy-attach"),
                   request_id=f"lazy-{uuid.uuid4().hex[:8]}")
    sessions = []

    def after(i: int) -> None:
        sessions.append(_health("drafter", stack["drafter"].address).sessions)
        if i == 6:
            assert g.stats.draft_kv_bytes == 0 and g.stats.draft_steps == 0

    try:
        out = rounds_by_hand(b, g, [0] * 6 + [4, 0, 0, 8], after)
    finally:
        b.close()
    assert out == ref
    assert sessions[:6] == [0] * 6 and all(n == 1 for n in sessions[6:]), sessions
    assert g.stats.draft_kv_bytes > 0 and g.stats.draft_steps > 0
