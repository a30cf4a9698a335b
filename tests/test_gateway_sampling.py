"""Sampling parameters and logprobs through the gateway app, in process: FastAPI's test
client over the real app, the real `BatchEngine` and the real model."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from vericache.engine.batch import BatchEngine
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.model.tokenize import apply_chat, encode_text

N = 24
CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""
VERICACHE = {"mode": "vericache", "compressor": "snapkv", "draft_len": 4, "adaptive": False}
TOLERANCE = 1e-3  # fp32 noise between a verify pass of k + 1 tokens and single decode steps


@pytest.fixture(scope="module")
def client(lm):
    engine = BatchEngine(lm, max_batch=4)
    try:
        with TestClient(create_app(engine)) as c:
            yield c
    finally:
        engine.close()


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": N,
                                                  "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def completion(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N,
                                             "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


OUT_OF_RANGE = [  # path, field, value
    ("/v1/chat/completions", "top_p", 0),
    ("/v1/completions", "top_p", 1.5),
    ("/v1/chat/completions", "top_k", -2),
    ("/v1/chat/completions", "min_p", 1.5),
    ("/v1/completions", "min_p", -0.1),
    ("/v1/chat/completions", "presence_penalty", 2.5),
    ("/v1/completions", "frequency_penalty", -3),
    ("/v1/chat/completions", "repetition_penalty", 0),
    ("/v1/chat/completions", "logit_bias", {"13": 200}),
    ("/v1/completions", "logit_bias", {"99999999": 1}),  # not a token id of the model
    ("/v1/completions", "logit_bias", {"x": 1}),
    ("/v1/chat/completions", "top_logprobs", 21),
    ("/v1/completions", "logprobs", 21),
]


@pytest.mark.parametrize("path,field,value", OUT_OF_RANGE,
                         ids=[f"{f}={v}" for _, f, v in OUT_OF_RANGE])
def test_out_of_range_is_a_400_naming_the_field(client, path, field, value):
    body = {"max_tokens": 2, field: value}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    if field == "top_logprobs":
        body["logprobs"] = True
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_logprobs_need_the_full_kv(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 1,
                                             "vericache": {"mode": "lossy"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_each_parameter_is_accepted_and_honoured(lm, client):
    """Each field is a 200. The filters: sampling at temperature 1 with top_k=1, top_p tiny or
    min_p=1 keeps only the most likely token, so the answer is the greedy one. The penalties
    and logit_bias: the answer is in-process full-KV greedy decoding with the same
    processing, and differs from the plain answer."""
    greedy = chat(client, ignore_eos=True)["choices"][0]["message"]["content"]
    for filt in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        got = chat(client, temperature=1.0, seed=3, ignore_eos=True,
                   **filt)["choices"][0]["message"]["content"]
        assert got == greedy, filt
    assert chat(client, top_k=-1, top_p=1.0, min_p=0.0,
                ignore_eos=True)["choices"][0]["message"]["content"] == greedy
    ids = encode_text(lm.tokenizer, PROMPT)
    plain = completion(client, ignore_eos=True)["choices"][0]["text"]
    first = generate(lm, ids, GenParams(mode="full", max_tokens=1)).token_ids[0]
    for proc in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                 {"repetition_penalty": 1.3}, {"logit_bias": {str(first): -100}}):
        got = completion(client, vericache=VERICACHE, ignore_eos=True, **proc)["choices"][0]["text"]
        ref = generate(lm, ids, GenParams(mode="full", max_tokens=N, ignore_eos=True, **{
            k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
            for k, v in proc.items()}))
        assert got == ref.text != plain, proc


def _chat_lps(body: dict) -> list[dict]:
    return body["choices"][0]["logprobs"]["content"]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_chat_logprobs_full_equals_vericache(client):
    """Same tokens, logprobs (and top_logprobs) equal within fp32 noise, in the OpenAI
    shape; streamed equals not streamed."""
    full = chat(client, logprobs=True, top_logprobs=3, vericache={"mode": "full"})
    ver = chat(client, logprobs=True, top_logprobs=3, vericache=VERICACHE)
    assert full["choices"][0]["message"]["content"] == ver["choices"][0]["message"]["content"]
    f, v = _chat_lps(full), _chat_lps(ver)
    assert [e["token"] for e in f] == [e["token"] for e in v]
    assert len(f) == full["usage"]["completion_tokens"] and ver["usage"]["tokens_per_round"] > 1
    diff = _max_diff([e["logprob"] for e in f], [e["logprob"] for e in v])
    tops = [t["logprob"] for e in f for t in e["top_logprobs"]]
    top_diff = _max_diff(tops, [t["logprob"] for e in v for t in e["top_logprobs"]])
    print(f"chat: logprob max diff {diff:.2e}, top_logprobs max diff {top_diff:.2e}")
    assert diff < TOLERANCE and top_diff < TOLERANCE
    for e in f:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 3
        assert e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
    # greedy: the chosen token is the most likely (no processing here)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in f)
    chunks = sse(client, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": N, "temperature": 0, "stream": True, "logprobs": True,
        "top_logprobs": 3, "vericache": VERICACHE})
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in v]
    assert _max_diff([e["logprob"] for e in streamed], [e["logprob"] for e in v]) == 0


def test_completion_logprobs_full_equals_vericache(client):
    full = completion(client, logprobs=2, vericache={"mode": "full"})
    ver = completion(client, logprobs=2, vericache=VERICACHE)
    assert full["choices"][0]["text"] == ver["choices"][0]["text"]
    f, v = full["choices"][0]["logprobs"], ver["choices"][0]["logprobs"]
    assert f["tokens"] == v["tokens"] and len(f["tokens"]) == full["usage"]["completion_tokens"]
    diff = _max_diff(f["token_logprobs"], v["token_logprobs"])
    print(f"completions: logprob max diff {diff:.2e}")
    assert diff < TOLERANCE
    assert f["text_offset"][0] == 0
    assert [b - a for a, b in zip(f["text_offset"], f["text_offset"][1:])] == \
        [len(t) for t in f["tokens"][:-1]]
    assert "".join(f["tokens"]) == full["choices"][0]["text"]
    for tok, lp, top in zip(f["tokens"], f["token_logprobs"], f["top_logprobs"]):
        assert top[tok] == lp and 1 <= len(top) <= 3  # the 2 best and the chosen token
    chunks = sse(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                             "stream": True, "logprobs": 2,
                                             "vericache": VERICACHE})
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in parts), []) == v["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == v["text_offset"]
    assert sum((p["token_logprobs"] for p in parts), []) == v["token_logprobs"]


def test_sampled_logprobs_are_of_the_raw_distribution(lm):
    """With temperature, penalties and a filter the tokens are sampled from the processed
    distribution, but their logprobs are the raw model's (vLLM's default): log_softmax of
    one forward pass over prompt + output, with nothing processed."""
    from vericache.model.runner import SeqBatchItem

    ids = apply_chat(lm.tokenizer, CHAT)
    res = generate(lm, ids, GenParams(mode="vericache", compressor="snapkv", draft_len=4,
                                      max_tokens=N, ignore_eos=True, temperature=0.9, seed=5,
                                      presence_penalty=0.5, top_k=20, logprobs=2))
    seq = ids + res.token_ids
    logits = lm.runner.forward([SeqBatchItem(torch.tensor(seq), torch.arange(len(seq)),
                                             lm.runner.new_cache(len(seq)), logits="all")])[0]
    raw = torch.log_softmax(logits.float(), dim=-1)[len(ids) - 1:-1]  # [N, V]: row i -> token i
    want = raw.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0].tolist()
    diff = _max_diff([lp.logprob for lp in res.logprobs], want)
    top = torch.topk(raw, 2, dim=-1)
    assert [[t for t, _ in lp.top] for lp in res.logprobs] == top.indices.tolist()
    print(f"sampled: raw logprob max diff {diff:.2e}")
    assert diff < TOLERANCE
    # sampled, not greedy: some token is not the raw argmax
    assert any(lp.token != lp.top[0][0] for lp in res.logprobs)


def test_n_choices_are_n_seeded_requests(client):
    """n = 3 sampled choices: choice i is the single request with seed + i (the same tokens,
    so the same text and logprobs), indexed 0..2, usage summed; streamed choices carry their
    index and equal the non-streamed ones."""
    body = dict(temperature=1.0, seed=7, top_k=50, max_tokens=12, ignore_eos=True,
                vericache=VERICACHE)
    r = chat(client, n=3, logprobs=True, **body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in r["choices"]]
    assert len(set(texts)) > 1  # sampled: the seeds differ
    for i, c in enumerate(r["choices"]):
        one = chat(client, logprobs=True, **{**body, "seed": 7 + i})
        assert one["choices"][0]["message"]["content"] == c["message"]["content"]
        assert [e["token"] for e in _chat_lps(one)] == [e["token"] for e in c["logprobs"]["content"]]
    assert r["usage"]["completion_tokens"] == 3 * 12
    chunks = sse(client, "/v1/completions", {"prompt": PROMPT, "stream": True, "n": 2,
                                             "stream_options": {"include_usage": True}, **body})
    streamed = {0: "", 1: ""}
    for c in chunks[:-1]:
        streamed[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * 12
    whole = completion(client, n=2, **body)
    assert [streamed[0], streamed[1]] == [c["text"] for c in whole["choices"]]
