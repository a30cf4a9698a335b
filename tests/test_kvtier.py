"""The offloaded full-KV tier: outputs identical to resident decoding, every byte counted."""

import pytest
import torch

from vericache.engine.generation import GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends
from vericache.engine.verifier import Finish, Verifier
from vericache.spec.costmodel import CostModel

N = 24


@pytest.fixture(scope="module")
def ids(prompts):
    return prompts["long"][:700]


@pytest.fixture(scope="module")
def reference(lm, ids):
    return generate(lm, ids, GenParams(mode="full", max_tokens=N, ignore_eos=True))


@pytest.mark.parametrize("mode", ["full", "vericache"])
def test_offloaded_identical_to_resident(lm, ids, reference, mode):
    # a cost model that has seen loads cost far less than a plain step, as at 200 Gbit/s: on
    # the engine's own timings alone, one suite run priced a load above a plain step here
    # and held one (the assertion below rested on a machine's timing)
    costs = _priced(len(ids), 1e-4, 0.02)
    tier = make_tier("offloaded", link_gbps=200.0)
    try:
        res = generate(lm, ids, GenParams(mode=mode, max_tokens=N, ignore_eos=True, draft_len=6),
                       LocalBackends(lm, tier=tier), costs)
    finally:
        tier.close()
    assert res.token_ids == reference.token_ids
    st, per_tok = tier.stats, lm.runner.kv_bytes_per_token()
    rounds = res.stats.rounds
    assert st.loads == rounds - 1  # the first verification ran on the prefilled KV
    assert res.stats.held_steps == 0  # a load costs less than a plain step: nothing is held
    # every later verify pass loaded the whole KV so far: at least the prompt's
    assert st.bytes_loaded >= (rounds - 1) * len(ids) * per_tok
    # prefill stored the prompt; each round wrote back its kept tokens (emitted, but the last)
    assert st.bytes_stored == (len(ids) + N - 1) * per_tok
    assert 0 <= st.stall_s <= st.transfer_s + 1.0


def test_make_tier_rejects_bad_names_and_rates():
    assert make_tier("resident") is None
    with pytest.raises(ValueError, match="resident, offloaded"):
        make_tier("disk")
    with pytest.raises(ValueError):
        make_tier("offloaded", 0)


# --- a failed layer load ---------------------------------------------------------------

FAILING_LAYER = 3


def _fail_one_layer(monkeypatch, tier, on_load: int):
    """Make the copy of layer FAILING_LAYER raise in the tier's `on_load`-th verify load (0:
    the first), as a transfer (DMA, network) that fails would; every other copy is real."""
    real = tier._load_layer

    def load_layer(s, li):
        if li == FAILING_LAYER and tier.stats.loads == on_load:
            raise RuntimeError("simulated transfer failure")
        return real(s, li)

    monkeypatch.setattr(tier, "_load_layer", load_layer)


def test_failed_layer_load_fails_the_pass_and_emits_nothing(lm, ids, reference, monkeypatch):
    """The first load (the second verify pass's: the first runs on the prefilled KV) of one
    layer fails: that pass raises Unavailable (it never computes on the unfilled working
    copy), the request gets no token from it, and the next request on the same tier and
    backends is full greedy decoding again."""
    from vericache.engine.local import stream
    from vericache.errors import Unavailable

    tier = make_tier("offloaded")
    try:
        backends = LocalBackends(lm, tier=tier)
        _fail_one_layer(monkeypatch, tier, on_load=0)
        params = GenParams(mode="vericache", max_tokens=N, ignore_eos=True, draft_len=6)
        events = []
        with pytest.raises(Unavailable, match=f"layer {FAILING_LAYER} failed: RuntimeError: "
                                              "simulated transfer failure"):
            for ev in stream(lm, ids, params, backends):
                events.append(ev)
        assert tier.stats.loads == 1  # the failure came in the second pass, the first load
        # the prefill's token and the first round's: nothing from the failed pass
        assert len(events) == 2
        emitted = [t for ev in events for t in ev.token_ids]
        assert emitted == reference.token_ids[:len(emitted)] and len(emitted) < N
        assert not backends.verifier.sessions  # released

        monkeypatch.undo()  # the link works again
        res = generate(lm, ids, params, backends)
        assert res.token_ids == reference.token_ids
    finally:
        tier.close()


def test_failed_load_fails_the_engine_requests_with_an_error_event(lm, ids, reference, monkeypatch):
    """Through the serving engine: the request whose first load of its KV fails (its second
    verify pass: the first runs on the prefilled KV) ends with an error event carrying no
    token (after the prefill's first token and the first round's), and a request after it on
    the same engine and tier completes identically to full decoding."""
    from vericache.engine.batch import BatchEngine

    tier = make_tier("offloaded")
    engine = BatchEngine(lm, backends=LocalBackends(lm, tier=tier))
    try:
        _fail_one_layer(monkeypatch, tier, on_load=0)
        params = GenParams(mode="vericache", max_tokens=N, ignore_eos=True, draft_len=6)
        events = list(engine.submit(ids, params))
        assert len(events) == 3 and events[0].token_ids == reference.token_ids[:1]
        assert events[1].token_ids == reference.token_ids[1: 1 + len(events[1].token_ids)]
        assert events[1].token_ids and events[2].token_ids == []
        err = events[-1]
        assert err.finish_reason is None
        assert err.error.startswith(f"Unavailable: KV tier: loading layer {FAILING_LAYER} failed")
        assert engine.metrics()["counters"]["errors"] == 1

        monkeypatch.undo()
        events = list(engine.submit(ids, params))
        assert all(ev.error is None for ev in events) and events[-1].finish_reason == "length"
        assert [t for ev in events for t in ev.token_ids] == reference.token_ids
    finally:
        engine.close()
        tier.close()


def test_a_closed_tier_refuses_to_open():
    """A load that can never run raises at once instead of leaving the pass waiting."""
    import torch

    from vericache.errors import Unavailable
    from vericache.model.kvcache import KVCache

    tier = make_tier("offloaded")
    host = tier.offload(KVCache(2, 1, 4, 8, torch.float32, "cpu"))
    tier.close()
    with pytest.raises(Unavailable, match="closed"):
        tier.open([host], [1])


# --- the link and the offload ----------------------------------------------------------

def test_link_directions_do_not_queue_behind_each_other():
    """A full-duplex link: a store holds only the store direction, a load only the load one;
    transfers on one direction queue, and each takes at least its bytes over the rate."""
    import time

    import torch

    from vericache.engine.kvtier import Link

    link = Link(gbps=0.8)  # 100 MB/s each way
    src, dst = torch.ones(2 << 20), torch.empty(2 << 20)  # 8 MB: 0.08 s
    n = src.numel() * 4
    t0 = time.perf_counter()
    assert link.copy(dst, src, "store") == n
    assert time.perf_counter() - t0 >= n / link.rate
    assert link._free["load"] == 0.0 and link._free["store"] >= t0 + n / link.rate
    t1 = time.perf_counter()
    link.copy(dst, src, "load")
    link.copy(dst, src, "load")
    assert time.perf_counter() - t1 >= 2 * n / link.rate
    assert link._free["load"] >= t1 + 2 * n / link.rate
    assert torch.equal(dst, src)


def test_offload_returns_at_once_and_readers_wait_for_it(monkeypatch):
    """`offload` hands back the host copy while the storer thread still copies; a verify
    load of it (and `landed`) wait until it has landed, and read the stored values."""
    import threading

    import torch

    from vericache.model.kvcache import KVCache

    tier = make_tier("offloaded")
    go = threading.Event()
    real = tier.link.copy

    def slow_store(dst, src, direction="load"):
        if direction == "store":
            go.wait()
        return real(dst, src, direction)

    monkeypatch.setattr(tier.link, "copy", slow_store)
    try:
        cache = KVCache(3, 2, 4, 8, torch.float32, "cpu")
        cache.k.normal_(), cache.v.normal_()
        cache.length = 5
        host = tier.offload(cache)
        assert host.length == 5 and tier.stats.bytes_stored == 0  # not landed yet
        [s] = tier.open([host], [2])
        waiter = threading.Thread(target=lambda: s.k[2])  # the pass's gate of the last layer
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # the load waits for the offload
        go.set()
        waiter.join(10)
        assert not waiter.is_alive()
        tier.landed(host)
        assert tier.stats.bytes_stored == 2 * 3 * 2 * 5 * 4 * 4
        k, v = s.view()
        assert torch.equal(k, cache.k[:, :, :5]) and torch.equal(v, cache.v[:, :, :5])
    finally:
        go.set()
        tier.close()


def test_a_failed_offload_fails_its_readers(monkeypatch):
    """An offload whose copy raises: `landed` and the next verify load of that KV raise
    Unavailable (the pass never reads the unfilled host copy)."""
    import torch

    from vericache.errors import Unavailable
    from vericache.model.kvcache import KVCache

    tier = make_tier("offloaded")

    real = tier.link.copy

    def broken(dst, src, direction="load"):
        if direction == "store":
            raise RuntimeError("simulated store failure")
        return real(dst, src, direction)

    monkeypatch.setattr(tier.link, "copy", broken)
    try:
        cache = KVCache(2, 1, 4, 8, torch.float32, "cpu")
        cache.length = 3
        host = tier.offload(cache)
        with pytest.raises(Unavailable, match="offloading the full KV failed: RuntimeError"):
            tier.landed(host)
        [s] = tier.open([host], [1])
        with pytest.raises(Unavailable, match="offloading the full KV failed"):
            s.k[0]
        monkeypatch.undo()  # the next offload is not held behind the failed one
        other = tier.offload(cache)
        tier.landed(other)
        assert other.length == 3
    finally:
        tier.close()


def test_a_cpu_cache_is_adopted_and_the_link_still_carries_it():
    """On a CPU runner the prefilled cache is already host memory: the tier keeps it as the
    host copy (no second copy of the KV), while the storer holds the link's store direction
    for its bytes' time and counts them."""
    import time

    import torch

    from vericache.model.kvcache import KVCache

    tier = make_tier("offloaded", link_gbps=0.8)  # 100 MB/s each way
    try:
        cache = KVCache(2, 2, 64, 4096, torch.float32, "cpu")
        cache.k.normal_(), cache.v.normal_()
        cache.length = 4000
        before = cache.k[:, :, :4000].clone()
        n = 2 * 2 * 2 * 4000 * 64 * 4  # k and v, 2 layers, 2 heads: 8.2 MB, 0.08 s
        t0 = time.perf_counter()
        host = tier.offload(cache)
        assert host is cache
        tier.landed(host)
        assert time.perf_counter() - t0 >= n / tier.link.rate
        assert tier.stats.bytes_stored == n
        assert torch.equal(host.k[:, :, :4000], before)
        [s] = tier.open([host], [1])
        s.k[1]  # the pass's gate of the last layer: every layer has landed
        assert torch.equal(s.view()[0], before)
    finally:
        tier.close()


def test_a_released_requests_host_memory_holds_the_next_ones_kv(lm, prompts, ids, reference):
    """The verifier hands a finished request's host copy back to the tier, and the next
    request's full KV is written into that memory: no fresh pages. What the first request
    left there changes nothing: both outputs are those of resident full decoding."""
    tier = make_tier("offloaded", link_gbps=200.0)
    backends = LocalBackends(lm, tier=tier)
    given: list[tuple[int, int]] = []  # (data_ptr, bytes free in the tier before) per cache
    take = tier.host_cache

    def spy(*a, **kw):
        before = tier.host_bytes_free
        c = take(*a, **kw)
        given.append((c.k.data_ptr(), before))
        return c

    tier.host_cache = spy
    # another, longer prompt first: its KV is what the second request's memory then holds
    other = prompts["long"][40:790]
    p = GenParams(mode="vericache", max_tokens=N, ignore_eos=True, draft_len=6)
    try:
        first = generate(lm, other, p, backends)
        held = tier.host_bytes_free
        second = generate(lm, ids, p, backends)
    finally:
        tier.close()
    assert first.token_ids == generate(lm, other, GenParams(mode="full", max_tokens=N,
                                                            ignore_eos=True)).token_ids
    assert second.token_ids == reference.token_ids
    per_tok = lm.runner.kv_bytes_per_token()
    assert len(given) == 2 and given[0][1] == 0  # the first request's cache was new
    assert held >= (len(other) + p.extra_capacity) * per_tok  # released into the tier
    assert given[1] == (given[0][0], held)  # the second request took that memory
    assert tier.host_bytes_free == held  # and gave it back


def test_working_copies_reuse_the_memory_of_dropped_ones(lm, prompts, ids, reference):
    """Each verification's working copy takes the memory a dropped one left (no fresh pages
    a round), one request after another: one request open at a time, so one copy's memory
    serves every verification of both; outputs are those of resident full decoding."""
    from vericache.engine.kvtier import COPY_ROUND

    tier = make_tier("offloaded", link_gbps=200.0)
    backends = LocalBackends(lm, tier=tier)
    ptrs: list[int] = []
    take = tier._copy_buffers

    def spy(host, tokens):
        k, v = take(host, tokens)
        assert k.shape[2] >= tokens and k.shape[2] % COPY_ROUND == 0
        ptrs.append(k.data_ptr())
        return k, v

    tier._copy_buffers = spy
    other = prompts["long"][40:760]  # longer: its copy's memory fits the second's
    p = GenParams(mode="vericache", max_tokens=N, ignore_eos=True, draft_len=6)
    try:
        first = generate(lm, other, p, backends)
        second = generate(lm, ids, p, backends)
        kept = tier.copy_bytes_kept
    finally:
        tier.close()
    assert first.token_ids == generate(lm, other, GenParams(mode="full", max_tokens=N,
                                                            ignore_eos=True)).token_ids
    assert second.token_ids == reference.token_ids
    assert len(ptrs) >= 4 and set(ptrs) == {ptrs[0]}
    cap = -(-(len(other) + p.extra_capacity) // COPY_ROUND) * COPY_ROUND
    assert kept == cap * lm.runner.kv_bytes_per_token()  # (K and V)


def test_a_working_copy_takes_the_smallest_kept_memory_that_fits():
    """Dropped copies' memory is handed out smallest fit first; a copy that fits none
    replaces the smallest kept one, so the tier holds no more than were open at once."""
    from vericache.engine.kvtier import COPY_ROUND
    from vericache.model.kvcache import KVCache

    tier = make_tier("offloaded")

    def host(n):
        c = KVCache(2, 2, 8, n + 8, torch.float32, "cpu")
        c.length = n
        return c

    def opened(*lengths):
        streams = tier.open([host(n) for n in lengths], [1] * len(lengths))
        tier._loader.submit(lambda: None).result()  # the load ended (and let go of them)
        return streams

    per_copy = lambda tokens: 2 * 2 * 2 * 8 * 4 * tokens  # noqa: E731
    try:
        a, b = opened(10, 3 * COPY_ROUND)
        small, big = a.k_buf.data_ptr(), b.k_buf.data_ptr()
        assert a.capacity == 11 and b.capacity == 3 * COPY_ROUND + 1
        del a, b
        assert tier.copy_bytes_kept == per_copy(COPY_ROUND + 4 * COPY_ROUND)
        (c,) = opened(2 * COPY_ROUND)  # the big one (kept second)
        assert c.k_buf.data_ptr() == big and tier.copy_bytes_kept == per_copy(COPY_ROUND)
        (d,) = opened(20)  # the small one
        assert d.k_buf.data_ptr() == small and tier.copy_bytes_kept == 0
        del c, d
        (e,) = opened(5 * COPY_ROUND)  # fits none: new memory, and the smaller kept one goes
        assert e.k_buf.data_ptr() not in (small, big)
        assert tier.copy_bytes_kept == per_copy(4 * COPY_ROUND)
        del e
        assert tier.copy_bytes_kept == per_copy(4 * COPY_ROUND + 6 * COPY_ROUND)
    finally:
        tier.close()


def test_preallocated_host_memory_is_handed_out_smallest_fit_first():
    tier = make_tier("offloaded")
    try:
        tier.preallocate(1, 64, 2, 2, 8, torch.float32)
        tier.preallocate(1, 32, 2, 2, 8, torch.float32)
        assert tier.host_bytes_free == 2 * 2 * 2 * 8 * 4 * (64 + 32)
        small = tier.host_cache(20, 2, 2, 8, torch.float32)
        assert small.capacity == 32 and small.length == 0
        assert tier.host_cache(40, 2, 2, 8, torch.float32).capacity == 64
        assert tier.host_cache(40, 2, 2, 8, torch.float32).capacity == 40  # none left: a new one
        assert tier.host_cache(8, 2, 2, 4, torch.float32).k.shape == (2, 2, 8, 4)  # other shape
        assert tier.host_bytes_free == 0
        small.length = 5
        tier.recycle(small)
        assert tier.host_cache(32, 2, 2, 8, torch.float32) is small and small.length == 0
        tier.recycle(small)
        big = tier.host_cache(100, 2, 2, 8, torch.float32)  # none fits: a new one replaces it
        assert big.capacity == 100 and tier.host_bytes_free == 0
    finally:
        tier.close()


def test_recycling_a_copy_in_flight_does_not_wait_for_it(monkeypatch):
    """A request released while its offload still copies: `recycle` returns at once, and
    the memory is kept for a later request only once the copy has landed; the memory of a
    copy that failed is not kept."""
    import threading

    from vericache.model.kvcache import KVCache

    tier = make_tier("offloaded")
    go, real = threading.Event(), tier.link.copy
    fail = {"stores": 0}  # how many of the next store copies raise

    def held_store(dst, src, direction="load"):
        if direction == "store":
            go.wait()
            if fail["stores"]:
                fail["stores"] -= 1
                raise RuntimeError("simulated store failure")
        return real(dst, src, direction)

    def cache() -> KVCache:
        c = KVCache(2, 1, 4, 8, torch.float32, "cpu")
        c.length = 3
        return c

    monkeypatch.setattr(tier.link, "copy", held_store)
    try:
        host = tier.offload(cache())
        done = threading.Event()
        threading.Thread(target=lambda: (tier.recycle(host), done.set())).start()
        assert done.wait(5) and tier.host_bytes_free == 0  # returned; the copy is still held
        go.set()
        tier.landed(tier.offload(cache()))  # the storer is serial: the first copy landed too
        assert tier.host_bytes_free == 2 * 2 * 1 * 8 * 4 * 4
        assert tier.host_cache(8, 2, 1, 4, torch.float32) is host and host.length == 0
        go.clear()
        fail["stores"] = 1
        broken = tier.offload(cache())
        tier.recycle(broken)
        go.set()
        tier.landed(tier.offload(cache()))
        assert fail["stores"] == 0 and tier.host_bytes_free == 0  # failed: not kept
    finally:
        go.set()
        tier.close()


def _priced(context: int, load_s: float, step_s: float) -> CostModel:
    """A cost model that has seen one-token passes of `context` tokens take `step_s`, their
    KV loaded beside the compute in `load_s` (MIN_FIT of them: its verify fit is ready)."""
    costs = CostModel()
    for _ in range(6):
        costs.observe_verify(1, context, context, step_s, load_s=load_s)
    return costs


def test_a_held_copy_takes_the_plain_steps_that_finish_a_request_without_a_load(lm, ids, reference):
    """Verifier level: a pass asked to finish (`Finish`) keeps its loaded working copy only
    when the tokens left are few enough; the plain passes on the held copy load nothing, and
    the tokens are full greedy's."""
    ref = reference.token_ids
    tier = make_tier("offloaded", link_gbps=200.0)
    ver = Verifier(lm.runner, tier=tier)
    try:
        first = ver.prefill("r", ids, N + 8, 256).first_token
        assert first == ref[0]
        # the first pass runs on the prefilled KV (no load); too many left (24 - 1 - 5 = 18 >
        # 10): it is not held, and the next pass loads
        v = ver.verify([("r", ref[1:5], None)], finish={"r": Finish(N - 1, 10)})[0]
        assert (v.accepted, v.bonus, v.held) == (4, ref[5], False)
        assert tier.stats.loads == 0
        v = ver.verify([("r", ref[6:8], None)], finish={"r": Finish(N - 6, 20)})[0]
        assert (v.accepted, v.bonus, v.held) == (2, ref[8], True)  # 15 left: held
        assert tier.stats.loads == 1
        out, left = [], N - 9
        while left:
            v = ver.verify([("r", [], None)], finish={"r": Finish(left, 20)} if left > 1 else None)[0]
            out.append(v.bonus)
            left -= 1
            assert v.held == (left > 0)
        assert out == ref[9:]
        assert tier.stats.loads == 1  # the 15 plain steps loaded nothing
        assert ver.sessions["r"].held is None
    finally:
        ver.release("r")
        tier.close()


@pytest.mark.parametrize("mode", ["full", "vericache"])
def test_requests_finish_on_the_loaded_copy_when_a_load_costs_more(lm, ids, reference, mode):
    """Engine level: where the cost model prices a load above the plain steps left, a
    request's verification holds its copy and the request ends on plain steps in the same
    verify job (`finish_held`), the offloaded full-KV baseline by the same rule: no load in
    all (the first verification and the steps after it run on the prefilled KV), and the
    output is full greedy's. (Where loads are cheap nothing is held:
    `test_offloaded_identical_to_resident`.)"""
    ctx = len(ids)
    tier = make_tier("offloaded", link_gbps=200.0)
    costs = _priced(ctx, 10.0, 0.02)
    try:
        res = generate(lm, ids, GenParams(mode=mode, max_tokens=N, ignore_eos=True, draft_len=6,
                                          adaptive=False), LocalBackends(lm, tier=tier), costs)
    finally:
        tier.close()
    assert res.token_ids == reference.token_ids
    s = res.stats
    assert 1 + sum(s.round_emitted) + s.held_steps == N  # the prefill's token, rounds, steps
    assert tier.stats.loads == 0 and s.rounds == 1
    assert s.held_steps == N - 1 - s.round_emitted[0] > 0
    assert res.usage["held_steps"] == s.held_steps
    assert costs.finish_within(ctx) > N
