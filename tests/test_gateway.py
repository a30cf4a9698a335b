"""The OpenAI-compatible gateway end to end: `vericache serve` as a real OS process, the
official `openai` client and raw HTTP against it, every greedy answer compared token for
token with in-process full-KV decoding of the same prompt ids."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import check_chat_top_logprobs
from service_process import ServiceProcess, start_serve

from services.gateway.ready import NotReady
from services.gateway.serving import ModelNotFound, error_response
from vericache.model.tokenize import apply_chat, encode_text
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.errors import (ContextTooLong, InvalidArgument, ResourceExhausted, Unavailable,
                              UnknownName)

MODEL = "smollm2-135m-instruct"
N = 32
CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]
# One torch thread in the server and for the references: on a small shared CPU, OpenMP
# threads that wait on each other make decoding many times slower.
THREADS = 1
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""


@pytest.fixture(scope="session")
def gateway() -> Iterator[ServiceProcess]:
    """`vericache serve` on a free port, up once /health answers; SIGTERM at the end."""
    service = start_serve([], env={"OMP_NUM_THREADS": str(THREADS)})
    yield service
    assert service.stop() == 0, service.log()
    service.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def base(gateway) -> str:
    return f"http://{gateway.address}"


@pytest.fixture(scope="session")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)


def reference(lm, ids: list[int]):
    """In-process full-KV greedy decoding: what every greedy answer must equal. One torch
    thread, as in the server (see THREADS)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return generate(lm, ids, GenParams(mode="full", max_tokens=N))
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chat_ref(lm):
    return reference(lm, apply_chat(lm.tokenizer, CHAT))


@pytest.fixture(scope="session")
def prompt_ref(lm):
    return reference(lm, encode_text(lm.tokenizer, PROMPT))


def extra(usage, name: str):
    """A VeriCache usage field (the openai client keeps unknown fields as extras)."""
    return (usage.model_extra or {})[name]


def test_health_and_models(base, client):
    h = httpx.get(f"{base}/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_equals_full_kv_reference(client, chat_ref):
    ref = chat_ref
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    u = r.usage
    assert u.prompt_tokens == ref.usage["prompt_tokens"]
    assert u.completion_tokens == len(ref.token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert extra(u, "rounds") >= 1 and extra(u, "tokens_per_round") >= 1
    assert 0 <= extra(u, "acceptance_rate") <= 1


def test_chat_stream_with_usage_chunk(client, chat_ref):
    ref = chat_ref
    chunks = list(client.chat.completions.create(
        messages=CHAT, model=MODEL, max_completion_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == [ref.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert extra(last.usage, "rounds") >= 1 and extra(last.usage, "tokens_per_round") >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids(lm, client, prompt_ref):
    ids, ref = encode_text(lm.tokenizer, PROMPT), prompt_ref
    for prompt in (PROMPT, ids):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0)
        assert r.object == "text_completion"
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    # vLLM's ignore_eos: the answer runs to the limit, past an end of sequence; its start is
    # the greedy answer
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=N + 8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == N + 8 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith(ref.text)


def test_completions_stream(client, prompt_ref):
    ref = prompt_ref
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_four_concurrent_requests_each_equal_their_reference(lm, client):
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about the sea.", "Explain recursion in one sentence."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    refs = [reference(lm, apply_chat(lm.tokenizer, m)) for m in chats]

    def ask(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N,
                                              temperature=0).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, chats))
    assert answers == [r.text for r in refs]


@pytest.mark.parametrize("options", [
    {"mode": "full"},
    {"mode": "vericache", "compressor": "streamingllm", "ratio": 4, "draft_len": 4},
    {"mode": "vericache", "compressor": "snapkv", "draft_len": 4, "selection": "verify:every=1"},
    {"mode": "vericache", "draft_len": 4, "adaptive": False, "exact": "bitwise"},
])
def test_vericache_field_is_honoured(client, chat_ref, options):
    ref = chat_ref
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0,
                                       extra_body={"vericache": options})
    assert r.choices[0].message.content == ref.text
    u = r.usage
    assert extra(u, "exact") == options.get("exact", "fast")
    if options["mode"] == "full":
        # one token per forward step: the prefill gives the first, each round one more
        # (the round that meets EOS counts too, though EOS is not output)
        assert extra(u, "tokens_per_round") == 1.0 and extra(u, "acceptance_rate") == 0
        assert extra(u, "rounds") == u.completion_tokens - (ref.finish_reason == "length")
    else:
        assert 1 <= extra(u, "tokens_per_round") <= options["draft_len"] + 1
        assert extra(u, "rounds") < u.completion_tokens
        want = options.get("selection", "question").partition(":")[0]
        assert extra(u, "selection").partition(":")[0] == want  # the spec, parameters sorted


def test_metrics_exposition(base, client):
    text = httpx.get(f"{base}/metrics").text
    for name in ("vericache_requests_total", "vericache_tokens_total", "vericache_rounds_total",
                 "vericache_tokens_per_round_bucket", "vericache_tokens_per_round_count",
                 "vericache_draft_seconds_total", "vericache_verify_seconds_total",
                 "vericache_prefill_seconds_total", "vericache_queue_depth",
                 "vericache_active_requests", "vericache_http_responses_total",
                 "vericache_selection_moved_tokens_total", "vericache_selection_delta_bytes_total",
                 "vericache_selection_requests_total", "vericache_draft_len_rounds_total",
                 "vericache_plain_round_share", "vericache_cost_model_predicted_tokens_per_second",
                 "vericache_cost_model_measured_tokens_per_second", "vericache_cost_model_fitted",
                 "vericache_kv_bytes", "vericache_kv_budget_bytes",
                 "vericache_ahead_drafted_tokens_total", "vericache_verify_lane_busy_seconds_total",
                 "vericache_transfer_seconds_total", "vericache_lane_utilisation",
                 "vericache_time_to_first_token_seconds_bucket",
                 "vericache_time_per_output_token_seconds_bucket",
                 "vericache_queue_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert "# TYPE vericache_tokens_per_round histogram" in text
    assert "# TYPE vericache_time_to_first_token_seconds histogram" in text


# structured output (vericache.spec.grammar) and tools (services.gateway.tools)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_ASK = [{"role": "user", "content": "Give a person's name and age as a JSON object."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city now"}},
         {"type": "function", "function": {"name": "add", "parameters": ADD,
                                           "description": "Add two numbers"}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_response_format_json_schema(client):
    """The answer parses, validates, and is the constrained full greedy answer (the server's
    full mode, asked at the same time so the two share passes)."""
    def ask(mode: str):
        return client.chat.completions.create(
            model=MODEL, messages=PERSON_ASK, max_tokens=N, temperature=0,
            extra_body={"vericache": {"mode": mode, "draft_len": 4, "adaptive": False}},
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}})

    with ThreadPoolExecutor(2) as pool:
        r, full = pool.map(ask, ["vericache", "full"])
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert text == full.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert extra(r.usage, "tokens_per_round") > 1


def test_chat_top_logprobs_official_client(lm, client):
    """The official client's `logprobs=True, top_logprobs=5` in chat against `vericache
    serve`, streamed and not, vericache against full (`conftest.check_chat_top_logprobs`)."""
    diff, top_diff = check_chat_top_logprobs(lm, client, CHAT[0]["content"], N)
    print(f"serve chat: logprob max diff vericache vs full {diff:.2e}, top-5 {top_diff:.2e}")


def _call(message) -> tuple[str, dict]:
    assert message.content is None and len(message.tool_calls) == 1
    c = message.tool_calls[0]
    assert c.type == "function" and c.id.startswith("call_")
    return c.function.name, json.loads(c.function.arguments)


def test_a_forced_call_is_read_as_it_arrives():
    """`CallStream`: the name once it is complete, then the arguments' text up to the brace
    that closes them (braces inside strings, escaped quotes and nesting included), whatever
    the pieces; text that is no call yields nothing."""
    from services.gateway.tools import CallStream

    args = {"city": 'Pa"ris}', "x": [1, {"a": "{"}]}
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>'
    for step in (1, 2, 5, len(text)):
        c, out = CallStream(), []
        for i in range(0, len(text), step):
            out += c.feed(text[i:i + step])
        assert out[0] == ("name", "get_weather") and c.done, (step, out)
        assert {k for k, _ in out[1:]} == {"arguments"}
        assert json.loads("".join(p for _, p in out[1:])) == args
    c = CallStream()
    assert c.feed("The weather in Paris is") == [] and c.name is None


def test_tools_named_required_streamed_and_auto(client):
    """A named call and a required one (streamed as it is generated: a delta with id and
    name, then the arguments in pieces, which reassemble into one call) parse and their
    arguments validate; auto answers text or a call that parses. The three are asked at the
    same time (batched by the server)."""
    def ask(choice):
        stream = choice == "required"
        out = client.chat.completions.create(
            model=MODEL, messages=WEATHER_ASK, max_tokens=8 if choice == "auto" else 40,
            temperature=0, tools=TOOLS, tool_choice=choice, stream=stream,
            # the streamed call: at most 3 tokens a round, so its arguments span rounds
            extra_body={"vericache": {"draft_len": 2, "adaptive": False}} if stream else None)
        return list(out) if stream else out

    with ThreadPoolExecutor(3) as pool:
        named, chunks, auto = pool.map(ask, [{"type": "function", "function": {
            "name": "get_weather"}}, "required", "auto"])
    assert named.choices[0].finish_reason == "tool_calls"
    name, args = _call(named.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER)
    parts: dict[int, dict] = {}
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    for d in deltas:
        p = parts.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        p["id"] += d.id or ""
        p["name"] += d.function.name or ""
        p["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and list(parts) == [0]
    assert deltas[0].id and deltas[0].function.name and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) >= 3, deltas  # the header, then the arguments over several rounds
    call = parts[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    check_auto_answer(auto.choices[0])


def check_auto_answer(choice) -> None:
    """tool_choice auto: text, or a call that parses and whose arguments validate."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        name, args = _call(choice.message)
        jsonschema.validate(args, SCHEMAS[name])
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **kw}


BAD = [  # name, path, body (bytes are sent as they are), status, param, code
    ("malformed_json", "/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
    ("missing_messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("negative_max_tokens", "/v1/chat/completions", chat_body(max_tokens=-1), 400, "max_tokens",
     None),
    ("unknown_compressor", "/v1/chat/completions",
     chat_body(vericache={"compressor": "no-such"}), 400, "compressor", None),
    ("unknown_mode", "/v1/chat/completions", chat_body(vericache={"mode": "x"}), 400, "mode",
     None),
    ("unknown_selection", "/v1/chat/completions",
     chat_body(vericache={"selection": "oracle"}), 400, "selection", None),
    ("top_p", "/v1/chat/completions", chat_body(top_p=1.5), 400, "top_p", None),
    ("n_above_8", "/v1/chat/completions", chat_body(n=9), 400, "n", None),
    ("n_0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", chat_body(top_logprobs=2), 400,
     "top_logprobs", None),
    # not implemented yet: a 400 naming the field, never a 200 that ignored it
    ("functions", "/v1/chat/completions", chat_body(functions=[{"name": "f"}]), 400,
     "functions", None),
    ("tools_on_completions", "/v1/completions", {"prompt": "hi", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("best_of", "/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of", None),
    # structured output and tools asked for wrongly
    ("unsupported_schema", "/v1/chat/completions", chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     400, "response_format", None),
    ("unknown_format", "/v1/chat/completions", chat_body(response_format={"type": "xml"}), 400,
     "response_format", None),
    ("tool_choice_names_no_tool", "/v1/chat/completions", chat_body(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}}), 400, "tool_choice", None),
    ("required_without_tools", "/v1/chat/completions", chat_body(tool_choice="required"), 400,
     "tool_choice", None),
    ("required_and_response_format", "/v1/chat/completions", chat_body(
        tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), 400,
     "tool_choice", None),
    ("prompt_past_context", "/v1/chat/completions",
     chat_body(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages",
     "context_length_exceeded"),
    ("max_tokens_past_context", "/v1/completions",
     {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
    ("bad_token_id", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("unknown_model", "/v1/chat/completions", chat_body(model="gpt-4"), 404, "model",
     "model_not_found"),
]


def test_neutral_values_of_unsupported_fields_are_accepted(base):
    """What clients send with a feature off (logprobs false, zero penalties, text format,
    tool_choice none, an empty logit_bias) is a normal request with the same answer."""
    body = chat_body(max_tokens=4, temperature=0)
    plain = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    neutral = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        **body, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0,
        "response_format": {"type": "text"}, "tool_choice": "none", "logit_bias": {}})
    assert plain.status_code == neutral.status_code == 200, neutral.text
    assert (neutral.json()["choices"][0]["message"]["content"]
            == plain.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("name,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(base, name, path, body, status, param, code):
    if isinstance(body, bytes):
        r = httpx.post(base + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)


ERRORS = [  # core error -> status, type, param, code, Retry-After
    (InvalidArgument("bad", "max_tokens"), 400, "invalid_request_error", "max_tokens", None, None),
    (UnknownName("no such compressor", "compressor"), 400, "invalid_request_error",
     "compressor", None, None),
    (ContextTooLong("too long", "prompt"), 400, "invalid_request_error", "prompt",
     "context_length_exceeded", None),
    (ModelNotFound("no model"), 404, "invalid_request_error", "model", "model_not_found", None),
    (ResourceExhausted("queue full"), 429, "rate_limit_error", None, "rate_limit_exceeded", "1"),
    (Unavailable("store down"), 503, "server_error", None, "service_unavailable", None),
    (NotReady("not ready: verifier"), 503, "server_error", None, "service_unavailable", "2"),
    (RuntimeError("bug"), 500, "server_error", None, None, None),
]


@pytest.mark.parametrize("exc,status,kind,param,code,retry", ERRORS,
                         ids=[type(e[0]).__name__ for e in ERRORS])
def test_core_errors_map_once_to_http(exc, status, kind, param, code, retry):
    r = error_response(exc)
    body = json.loads(r.body)["error"]
    assert r.status_code == status and r.headers.get("retry-after") == retry
    assert body == {"message": str(exc), "type": kind, "param": param, "code": code}


def test_client_disconnect_cancels_the_request(base):
    body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True, "vericache": {"mode": "full"}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/health").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{base}/health").json()["active"] == 0


def test_server_still_answers_after_errors(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert r.choices[0].message.content and r.usage.completion_tokens == 4
