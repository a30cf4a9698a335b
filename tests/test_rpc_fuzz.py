"""Fuzzing the inside: every gRPC method of the kvstore, verifier and drafter services, real
processes on loopback with the internal token, the real model behind the verifier and drafter.

- Random messages built from each method's own descriptor (every field set or left out;
  integers at their edges, long and odd strings, random bytes, repeated fields short or
  long, nested messages), a fixed seed, `CASES` per method.
- Adversarial sequences: Verify before Prefill, Commit twice, Release then Draft, Attach of an
  unknown request, a probs blob of the wrong shape, calls with a wrong or absent token.
Every call either succeeds or ends with a typed status (never INTERNAL or UNKNOWN), and each
service keeps serving: afterwards a request through the gateway equals full greedy decoding.
"""

from __future__ import annotations

import random

import grpc
import httpx
import pytest

from vericache._proto import load

pytestmark = pytest.mark.slow  # real-model services: scheduled first

TOKEN = "fuzz-internal-token"
ENV = {"OMP_NUM_THREADS": "1", "LMCACHE_TRACK_USAGE": "false", "VERICACHE_INTERNAL_TOKEN": TOKEN}
AUTH = [("authorization", f"Bearer {TOKEN}")]
CASES = 24  # random messages per method
TYPED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAUTHENTICATED}
VPB, VPB_GRPC = load("verifier")
DPB, DPB_GRPC = load("drafter")
KPB, KPB_GRPC = load("kvstore")
F = VPB.DESCRIPTOR.message_types_by_name["PrefillRequest"].fields[0].__class__  # FieldDescriptor

INTS = [0, 1, -1, 2, 7, 255, 4096, 2 ** 31 - 1, -2 ** 31, 2 ** 62, 49152]
STRINGS = ["", "r", "fuzz-live", "x" * 300, "../../etc/passwd", "é\u2028\x00", "snapkv", "k" * 5000,
           "question", "tail/ns/fuzz-live", "none"]


def _value(field, rng: random.Random, depth: int):
    t = field.type
    if t == F.TYPE_MESSAGE:
        return _message(field.message_type._concrete_class, rng, depth + 1)
    if t == F.TYPE_STRING:
        return rng.choice(STRINGS)
    if t == F.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 3, 4, 17, 1024, 40_000]))
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice([0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), rng.random()])
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    v = rng.choice(INTS) if rng.random() < 0.7 else rng.randrange(-5, 50_000)
    if t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        v = abs(v)
    bits = 32 if t in (F.TYPE_INT32, F.TYPE_UINT32, F.TYPE_SINT32, F.TYPE_FIXED32,
                       F.TYPE_SFIXED32) else 64
    signed = t not in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    return min(max(v, lo), hi)


def _message(cls, rng: random.Random, depth: int = 0):
    """A random instance of message class `cls` (fields set at random, nesting bounded)."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.3 or (field.type == F.TYPE_MESSAGE and depth >= 2):
            continue
        repeated = getattr(field, "is_repeated", None)
        repeated = field.label == F.LABEL_REPEATED if repeated is None else repeated
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # maps (stats extras): responses only
        if repeated:
            n = rng.choice([0, 1, 2, 5, 40] + ([3000] if field.type != F.TYPE_MESSAGE else []))
            items = [_value(field, rng, depth) for _ in range(n)]
            getattr(msg, field.name).extend(items)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(_value(field, rng, depth))
        else:
            setattr(msg, field.name, _value(field, rng, depth))
    return msg


def _kvstore_ready(port: int) -> bool:
    stub = KPB_GRPC.KVStoreStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return stub.Health(KPB.HealthRequest(), timeout=2, metadata=AUTH).status == \
        KPB.HealthResponse.STATUS_SERVING


def _model_ready(stub_cls):
    return lambda port: stub_cls(grpc.insecure_channel(f"127.0.0.1:{port}")).Health(
        VPB.ServiceHealthRequest(), timeout=2, metadata=AUTH).ok


@pytest.fixture(scope="module")
def stack(services):
    kv = services("services.kvstore", ["--backend", "memory://", "--max-value-mb", "64"],
                  _kvstore_ready, env=ENV)
    common = ["--kvstore", kv.address, "--session-ttl-s", "120"]
    ver = services("services.verifier", [*common, "--kv-budget-mb", "512"],
                   _model_ready(VPB_GRPC.VerifierStub), timeout_s=120, env=ENV)
    dra = services("services.drafter", [*common, "--draft-kv-budget-mb", "256"],
                   _model_ready(DPB_GRPC.DrafterStub), timeout_s=120, env=ENV)
    return {"kvstore": kv, "verifier": ver, "drafter": dra}


def _stubs(stack):
    ch = {n: grpc.insecure_channel(stack[n].address, options=[
        ("grpc.max_send_message_length", 64 << 20)]) for n in ("kvstore", "verifier", "drafter")}
    return {"kvstore": (KPB_GRPC.KVStoreStub(ch["kvstore"]), KPB, "KVStore"),
            "verifier": (VPB_GRPC.VerifierStub(ch["verifier"]), VPB, "Verifier"),
            "drafter": (DPB_GRPC.DrafterStub(ch["drafter"]), DPB, "Drafter")}


def _call(fn, request, streaming_in=False, streaming_out=False, metadata=AUTH):
    """The status code of one call (OK when it succeeded); a streamed reply is drained."""
    try:
        arg = iter(request) if streaming_in else request
        reply = fn(arg, timeout=60, metadata=metadata)
        if streaming_out:
            for _ in reply:
                pass
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _methods(stub, pb, service):
    desc = pb.DESCRIPTOR.services_by_name[service]
    for m in desc.methods:
        yield (m.name, getattr(stub, m.name), m.input_type._concrete_class,
               m.client_streaming, m.server_streaming)


@pytest.mark.parametrize("service", ["kvstore", "verifier", "drafter"])
def test_random_messages_get_typed_statuses(stack, service):
    stub, pb, name = _stubs(stack)[service]
    rng = random.Random(f"fuzz-{service}")
    seen: dict[str, dict[str, int]] = {}
    for method, fn, req_cls, cin, cout in _methods(stub, pb, name):
        counts = seen.setdefault(method, {})
        for _ in range(CASES):
            req = [_message(req_cls, rng) for _ in range(rng.choice([0, 1, 3]))] if cin \
                else _message(req_cls, rng)
            code = _call(fn, req, cin, cout)
            counts[code.name] = counts.get(code.name, 0) + 1
            assert code == grpc.StatusCode.OK or code in TYPED, \
                (method, code, req if not cin else "", stack[service].log()[-2000:])
    print(service, seen)
    assert sum(sum(c.values()) for c in seen.values()) == CASES * len(seen)
    assert _call(stub.Health, (KPB.HealthRequest if service == "kvstore"
                               else VPB.ServiceHealthRequest)()) == grpc.StatusCode.OK


def test_out_of_order_calls_get_typed_statuses(stack, lm):
    s = _stubs(stack)
    ver, dra = s["verifier"][0], s["drafter"][0]
    ids = lm.tokenizer("The capital of France is a city that")["input_ids"]
    code = grpc.StatusCode
    # Verify, Draft, Commit and Attach of a request never prefilled
    assert _call(ver.Verify, VPB.VerifyRequest(items=[VPB.VerifyItem(
        request_id="ghost", draft_tokens=[1, 2])])) == code.NOT_FOUND
    assert _call(dra.Draft, DPB.DraftRequest(items=[DPB.DraftItem(request_id="ghost", k=2)])) \
        == code.NOT_FOUND
    assert _call(dra.Commit, DPB.CommitRequest(request_id="ghost", accepted=1, bonus=3)) \
        == code.NOT_FOUND
    assert _call(dra.Attach, DPB.AttachRequest(  # no tail was saved for it
        request_id="ghost", token_ids=ids, first_token=1, compressor="snapkv:ratio=2", chunk_size=8,
        tail_start=0, extra_capacity=32)) == code.NOT_FOUND
    # a real session: prefill, attach, draft
    pre = ver.Prefill(VPB.PrefillRequest(request_id="live", token_ids=ids, compressor="snapkv:ratio=2",
                                         chunk_size=8, extra_capacity=32, save_tail=True),
                      timeout=120, metadata=AUTH)
    dra.Attach(DPB.AttachRequest(request_id="live", token_ids=ids, first_token=pre.first_token,
                                 compressor="snapkv:ratio=2", chunk_size=8, tail_start=pre.tail_start,
                                 extra_capacity=32), timeout=120, metadata=AUTH)
    assert _call(dra.Attach, DPB.AttachRequest(  # attached twice: its tail was used once
        request_id="live", token_ids=ids, first_token=pre.first_token, compressor="snapkv:ratio=2",
        chunk_size=8, tail_start=pre.tail_start, extra_capacity=32)) in TYPED
    d = dra.Draft(DPB.DraftRequest(items=[DPB.DraftItem(request_id="live", k=3)]),
                  timeout=60, metadata=AUTH).results[0]
    assert len(d.tokens) == 3
    # draft probs of the wrong size are refused, not read past their end
    assert _call(ver.Verify, VPB.VerifyRequest(items=[VPB.VerifyItem(
        request_id="live", draft_tokens=list(d.tokens), draft_probs=b"\x00" * 12)])) \
        == code.INVALID_ARGUMENT
    v = ver.Verify(VPB.VerifyRequest(items=[VPB.VerifyItem(
        request_id="live", draft_tokens=list(d.tokens))]), timeout=60, metadata=AUTH).results[0]
    assert _call(dra.Commit, DPB.CommitRequest(request_id="live", accepted=v.accepted,
                                               bonus=v.bonus)) == code.OK
    # the same round committed again: nothing is drafted any more, so nothing can be accepted
    assert _call(dra.Commit, DPB.CommitRequest(request_id="live", accepted=v.accepted + 5,
                                               bonus=v.bonus)) == code.INVALID_ARGUMENT
    assert _call(ver.Verify, VPB.VerifyRequest(items=[VPB.VerifyItem(  # past its capacity
        request_id="live", draft_tokens=[1] * 200)])) == code.INVALID_ARGUMENT
    for stub in (ver, dra):
        assert _call(stub.Release, VPB.ReleaseRequest(request_id="live")) == code.OK
    assert _call(dra.Draft, DPB.DraftRequest(items=[DPB.DraftItem(request_id="live", k=2)])) \
        == code.NOT_FOUND
    assert _call(ver.Verify, VPB.VerifyRequest(items=[VPB.VerifyItem(
        request_id="live", draft_tokens=[1])])) == code.NOT_FOUND
    for stub in (ver, dra):  # nothing leaked
        assert stub.Health(VPB.ServiceHealthRequest(), timeout=10, metadata=AUTH).sessions == 0


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer nope")]],
                         ids=["absent", "wrong"])
def test_every_method_needs_the_token(stack, metadata):
    for service, (stub, pb, name) in _stubs(stack).items():
        for method, fn, req_cls, cin, cout in _methods(stub, pb, name):
            if method == "Health":
                continue  # the probe stays open (tests/test_security.py)
            req = [req_cls()] if cin else req_cls()
            assert _call(fn, req, cin, cout, metadata=metadata) == \
                grpc.StatusCode.UNAUTHENTICATED, (service, method)


def test_services_still_serve_exactly_after_the_fuzz(stack, services, lm):
    """Last in the module: a gateway over the fuzzed services answers full greedy."""
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate

    gw = services("services.gateway", [
        "--drafter", stack["drafter"].address, "--verifier", stack["verifier"].address,
        "--kvstore", stack["kvstore"].address],
        lambda port: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200,
        timeout_s=120, env=ENV)
    ids = lm.tokenizer("def fibonacci(n):")["input_ids"]
    r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/completions", timeout=120, json={
        "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=12, ignore_eos=True))
    assert r.json()["choices"][0]["text"] == ref.text
