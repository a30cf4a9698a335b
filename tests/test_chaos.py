"""Reliability under faults, on one stack of the four services over a Redis of our own
(`maxmemory` 32 MB, allkeys-lru), each gRPC link through a `NetProxy` (gateway -> drafter,
gateway -> verifier, drafter and verifier -> kvstore). The contract everywhere: a stream
completes with the full-greedy tokens, or emits a prefix of them and then fails cleanly (an
OpenAI error, or an SSE error chunk then [DONE]); no token is unverified; no session is left.

- chaos: 4 streaming clients while the drafter is SIGKILLed and started again: every stream
  completes (the verifier decodes alone meanwhile), and the drafter down for good leaves the
  gateway ready and degraded (benchmarks/chaos.py is the long run: 16 clients, every service
  and Redis, repeatedly);
- degraded links: each link black-holed and reset mid-stream. Deadlines (short here, through
  the existing flags: the gateway's --rpc-timeout-s, the store URL's timeout_s) bound the
  longest hang: a stream fails (verifier link) or goes on in plain steps (drafter and kvstore
  links) within its deadlines plus MARGIN_S (a correctness bound: the time to fail the
  request and write its error chunk, on a loaded 2-core machine);
- store pressure: prompts whose prefix chunks do not fit the 32 MB Redis, plus keys deleted at
  random while they run: recomputation or a clean error, never a wrong token.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from chaos_stack import Stack, deleting_keys, references, stream_chat, wait_drained

pytestmark = pytest.mark.slow
N = 8
# an RPC deadline well above a 550-token prefill through the store (seconds here, many more
# on a loaded or slower machine), as short as the blackhole tests, which wait it out, allow
RPC_DEADLINE_S, STORE_DEADLINE_S = 20.0, 3.0
MARGIN_S = 5.0
SHORT = ["Write a haiku about the sea.", "List three uses of a hash map.",
         "Explain what a KV cache is in one sentence."]


def _source(name: str, chars: int) -> str:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return (lib / name).read_text()[:chars]


# about 550 tokens each: two full 256-token chunks (2 x 11.8 MB of fp32 KV) and their
# compressed forms; three of them are three times what the 32 MB Redis holds
LONG = [f"Here is a Python module:\n```python\n{_source(m, 1700)}\n```\nWhat does it do?"
        for m in ("json/decoder.py", "argparse.py", "textwrap.py")]


@pytest.fixture(scope="module")
def refs(lm):
    return references(lm, SHORT + LONG, N)


@pytest.fixture(scope="module")
def stack():
    st = Stack(max_tokens=N, redis_maxmemory_mb=32, proxies=True, rpc_timeout_s=RPC_DEADLINE_S,
               store_timeout_s=STORE_DEADLINE_S).start()
    yield st
    st.stop()


def _judge(o, ref) -> None:
    """The contract for one stream."""
    assert o.unverified() == 0, o.kinds
    assert o.wrong(ref) == 0, (o.ids, ref)
    assert o.completed or o.failed_clean, o
    if o.completed:
        assert o.ids == ref


def _until_success(stack, text, ref, within_s: float = 60.0) -> int:
    """Requests until one completes (each judged); how many it took."""
    deadline, n = time.monotonic() + within_s, 0
    while True:
        n += 1
        o = stream_chat(stack.gateway, text, N)
        _judge(o, ref)
        if o.completed:
            return n
        assert time.monotonic() < deadline, f"no success within {within_s} s: {o.errors}"
        time.sleep(0.5)


def test_chaos_drafter_killed_under_load(stack, refs):
    """The drafter SIGKILLed and started again under 4 streaming clients (the verifier's
    restart is tests/test_faults.py's; benchmarks/chaos.py kills every service, repeatedly)."""
    outcomes, stop = [], threading.Event()

    def client(i):
        n = i
        while not stop.is_set():
            text = SHORT[n % len(SHORT)]
            n += 1
            o = stream_chat(stack.gateway, text, N)
            outcomes.append((text, o))
            if not o.completed:
                time.sleep(0.3)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for victim in ("drafter",):
            time.sleep(1.0)
            stack.kill(victim)
            stack.restart(victim)
            _until_success(stack, SHORT[0], refs[SHORT[0]])
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    for text, o in outcomes:
        _judge(o, refs[text])
    left = wait_drained(stack)
    assert not any(left.values()), left
    done = sum(o.completed for _, o in outcomes)
    print(f"\nchaos: {len(outcomes)} requests, {done} completed, {len(outcomes) - done} failed "
          f"cleanly, 0 wrong, 0 unverified; sessions after: {left}")
    # the drafter is what VeriCache can lose: the streams it served went on in plain steps,
    # and the gateway kept admitting while it restarted
    assert done == len(outcomes), [o.errors for _, o in outcomes if not o.completed]


def test_without_its_drafter_the_gateway_serves_plain_steps_then_drafts_again(stack, refs):
    """The drafter down for good: /ready stays 200 and names it degraded; a request with a
    fixed k completes with the full-greedy tokens, every one a plain step. Started again, the
    drafter drafts for new requests."""
    text, ref = SHORT[2], refs[SHORT[2]]
    fixed_k = {"draft_len": 2, "adaptive": False}
    stack.kill("drafter")
    try:
        r = httpx.get(f"{stack.gateway}/ready", timeout=10)
        assert r.status_code == 200 and r.json()["degraded"] == ["drafter"], r.text
        o = stream_chat(stack.gateway, text, N, timeout=60, vericache=fixed_k)
        _judge(o, ref)
        assert o.completed and set(o.kinds[1:]) == {"plain"}, (o.kinds, o.errors)
    finally:
        stack.restart("drafter")
    deadline = time.monotonic() + 60
    while True:  # requests wait DRAFTER_RETRY_S after a failed attach before trying again
        o = stream_chat(stack.gateway, text, N, timeout=60, vericache=fixed_k)
        _judge(o, ref)
        if o.completed and "bonus" in o.kinds:
            break
        assert time.monotonic() < deadline, f"no drafting 60 s after the restart: {o.kinds}"
        time.sleep(1.0)
    assert httpx.get(f"{stack.gateway}/ready", timeout=10).json()["degraded"] == []
    left = wait_drained(stack)
    assert not any(left.values()), left


@pytest.mark.parametrize("link", ["verifier", "drafter", "kvstore"])
def test_link_blackholed_then_reset(stack, refs, link):
    proxy, text = stack.net[link], SHORT[1]
    ref = refs[text]
    deadline = STORE_DEADLINE_S if link == "kvstore" else RPC_DEADLINE_S
    _until_success(stack, text, ref)

    # black-holed: the stream in flight once its first token came (for the kvstore, which a
    # round need not touch: a new request, whose Prefill reads the store) ends within the
    # deadline of the call it waits on
    t0 = []

    def cut():
        proxy.blackhole()
        t0.append(time.monotonic())

    if link == "kvstore":
        cut()
    # k fixed: the request drafts every round (the cost model may keep a short one on plain
    # steps, which never touch the drafter: a black-holed drafter link would not show)
    fixed_k = {"draft_len": 2, "adaptive": False}
    try:
        o = stream_chat(stack.gateway, text, N, timeout=60, on_first=None if t0 else cut,
                        vericache=fixed_k)
    finally:
        hang = time.monotonic() - t0[0] if t0 else 0.0
        proxy.heal()
    assert t0, "the link was never cut"
    _judge(o, ref)
    cut_error = o.errors[0]["error"]["message"] if o.errors else ""
    if link == "verifier":  # nothing decodes without it: the request fails at its deadline
        assert not o.completed, "a black-holed link still answered"
        waits = 1
    else:
        # the drafter and the store are what VeriCache can lose: the request goes on in plain
        # full-KV steps after one deadline (the drafter's Draft), or after two (the store's
        # read at prefill, then the exact tail's write for the drafter)
        assert o.completed and "plain" in o.kinds, (o.kinds, o.errors)
        waits = 1 if link == "drafter" else 2
    assert hang <= waits * deadline + MARGIN_S, f"hung {hang:.1f} s past {waits} x {deadline} s deadlines"
    after_blackhole = _until_success(stack, text, ref)

    # reset mid-stream: the call in flight fails at once (or, on the kvstore link, is retried:
    # every KVStore call is idempotent); the stream completes or fails cleanly
    resets = []
    t = threading.Timer(0.3, lambda: resets.append(proxy.reset()))
    t.start()
    o = stream_chat(stack.gateway, LONG[0], N, timeout=60, vericache=fixed_k)
    t.join()
    _judge(o, refs[LONG[0]])
    after_reset = _until_success(stack, text, ref)
    left = wait_drained(stack)
    assert not any(left.values()), left
    print(f"\n{link}: black-holed, the request ended after {hang:.1f} s (deadline {deadline} s), "
          f"{'completed' if o.completed else repr(cut_error)}; success on attempt {after_blackhole} "
          f"after healing; reset {resets} connections: "
          f"{'completed' if o.completed else 'failed cleanly'}, success on attempt {after_reset}")


def test_slow_links_same_tokens(stack, refs):
    """10 ms a 64 KiB piece on every link, the kvstore's capped at 0.5 Gbit/s: slower, and
    still the reference (a short prompt: its exact tail moves in well under the deadline)."""
    for proxy in stack.net.values():
        proxy.latency_s = 0.01
    stack.net["kvstore"].gbps = 0.5
    try:
        o = stream_chat(stack.gateway, SHORT[2], N, timeout=120)
    finally:
        for proxy in stack.net.values():
            proxy.latency_s, proxy.gbps = 0.0, 0.0
    assert o.completed and o.ids == refs[SHORT[2]], o


def test_store_pressure_recomputes_never_wrong(stack, refs):
    r = stack.redis.client()
    before = stack.store_stats()
    attempts = []
    for _ in range(2):  # the second pass finds some chunks, the LRU evicted others
        for text in LONG:
            # each attempt judged; one past a deadline (a 550-token prefill that stores and
            # reads 12 MB chunks through a proxy, on a loaded machine) fails cleanly and the
            # next one completes identical
            attempts.append(_until_success(stack, text, refs[text], within_s=120.0))
    evicted = r.info("stats")["evicted_keys"]
    assert evicted > 0, "the store was never under pressure"
    assert r.info("memory")["used_memory"] <= 40 << 20

    outs = []
    with deleting_keys(r):  # keys vanish between longest_prefix and get, during an attach
        for text in LONG:
            outs.append((text, stream_chat(stack.gateway, text, N, timeout=120)))
    for text, o in outs:
        _judge(o, refs[text])
    after = stack.store_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    print(f"\nstore pressure: {evicted} keys evicted by the 32 MB LRU, hit rate "
          f"{hits / max(1, hits + misses):.2f} ({hits} hits, {misses} misses); under random "
          f"deletes {sum(o.completed for _, o in outs)} of {len(outs)} completed identical, "
          f"the rest failed cleanly; attempts to complete each before the deletes: {attempts}")
    left = wait_drained(stack)
    assert not any(left.values()), left
