"""The two-lane executor on the real model: every schedule, with and without draft-ahead,
under memory budgets and with an offloaded full KV, emits exactly full greedy's tokens."""

import dataclasses

import pytest

from vericache.engine.generation import Generation, GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.lanes import run_requests
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends

pytestmark = pytest.mark.slow  # real-model work of minutes: scheduled first

N = 28


@pytest.fixture(scope="module")
def cases(lm, prompts):
    ids = [prompts["code"], prompts["json"], prompts["long"][:600], prompts["long"][:900]]
    refs = [generate(lm, p, GenParams(mode="full", max_tokens=N, ignore_eos=True)).token_ids
            for p in ids]
    return ids, refs


def _gens(lm, ids, **kw):
    params = GenParams(**{"max_tokens": N, "ignore_eos": True, "compressor": "streamingllm",
                          "ratio": 4, "draft_len": 8, "chunk_size": 64, **kw})
    return [Generation(lm, p, params, request_id=f"r{i}") for i, p in enumerate(ids)]


@pytest.mark.parametrize("schedule,ahead,tier,budget", [
    ("lockstep", False, "resident", None),
    ("staggered", False, "offloaded", None),
    ("staggered", True, "resident", None),
    ("staggered", True, "offloaded", 2),  # the verifier's budget holds two requests' KV
])
def test_lanes_identical_to_full(lm, cases, schedule, ahead, tier, budget):
    ids, refs = cases
    t = make_tier(tier, 200.0)
    # offloaded: snapkv with `verify` selection, whose moves read the pass's working copy
    # (after the first round, on the prefilled KV); k fixed, so that every round drafts
    # whatever the cost model would make of a loaded machine's timings
    gens = _gens(lm, ids, **({"compressor": "snapkv", "selection": "verify:every=1,tokens=8",
                              "adaptive": False} if tier == "offloaded" else {}))
    per_tok = lm.runner.kv_bytes_per_token()
    cost = (lambda g: (0, 0, (len(g.prompt) + g.extra_capacity) * per_tok)) if budget else None
    limit = budget * (900 + N + 12) * per_tok if budget else None
    try:
        trace = run_requests(LocalBackends(lm, tier=t), gens, schedule, groups=2,
                             verify_budget=limit, cost=cost, draft_ahead=ahead)
    finally:
        if t is not None:
            t.close()
    assert [g.output_ids for g in gens] == refs
    assert all(g.finished for g in gens)
    if tier == "offloaded":
        assert sum(g.stats.select_moves for g in gens) > 2
    if ahead:
        assert trace.ahead_drafted > 0
    else:
        assert trace.ahead_drafted == 0


def _exact_drafter(lm, ids, n):
    """Request "a" admitted with the identity "compressor" (it drafts exactly): its drafter
    and full decoding's n tokens."""
    full = generate(lm, ids, GenParams(mode="full", max_tokens=n, ignore_eos=True)).token_ids
    b = LocalBackends(lm)
    g = Generation(lm, ids, GenParams(max_tokens=n, ignore_eos=True, compressor="identity",
                                      draft_len=4, adaptive=False), request_id="a")
    assert b.admit(g).bonus == full[0]
    return b.drafter, full


def test_draft_ahead_tokens_are_used_when_the_guess_holds(lm, prompts):
    """A drafter that drafts ahead, then is told every draft and the guessed bonus were
    right, hands the ahead tokens out as the next round's drafts, with no new step."""
    d, full = _exact_drafter(lm, prompts["code"], 12)
    first = d.draft([("a", 4)])[0].tokens
    assert first == full[1:5]  # the identity "compressor" drafts exactly
    assert d.draft_ahead([("a", 4)]) == 4
    s = d.sessions["a"]
    assert s.ahead == full[5:9]
    d.commit("a", 4, full[5])  # all accepted; bonus = the first ahead token
    assert s.carry == full[6:9] and s.ahead_used == 4
    again = d.draft([("a", 3)])[0].tokens
    assert again == full[6:9]
    d.draft_ahead([("a", 2)])
    d.commit("a", 1, full[7])  # a mismatch after one: ahead tokens are dropped
    assert s.ahead_wasted == 2 and not s.carry
    assert d.draft([("a", 3)])[0].tokens == full[8:11]


def test_a_plain_step_after_a_held_guess_drops_the_carried_drafts(lm, prompts):
    """A round without drafts (the cost model's plain step, or the services' queued
    `plain_tokens`) right after a held guess: the verified token takes carry[0]'s place, so
    the carried drafts and their KV go, and the next rounds draft and commit from the
    verified tokens (the services once cropped past the cache here: `crop(44) outside
    [0, 43]` under load)."""
    d, full = _exact_drafter(lm, prompts["code"], 20)
    assert d.draft([("a", 4)])[0].tokens == full[1:5]
    assert d.draft_ahead([("a", 4)]) == 4
    d.commit("a", 4, full[5])  # the guess held: full[6:9] carried
    s = d.sessions["a"]
    assert s.carry == full[6:9]
    d.commit("a", 0, full[6])  # a plain step
    assert not s.carry and s.pending == [full[6]] and s.ahead_wasted == 3
    for at in (7, 11):  # every draft accepted, twice: each commit crops within the cache
        assert d.draft([("a", 3)])[0].tokens == full[at:at + 3]
        d.commit("a", 3, full[at + 3])
    assert s.seq_len == len(prompts["code"]) + 15
    assert d.draft([("a", 4)])[0].tokens == full[15:19]


def _pool_copies(monkeypatch) -> list[int]:
    """The slots of every cache copied into a pool from now on (`KVPool._adopt`; `KVPool.of`
    adopts too)."""
    from vericache.model.kvcache import KVPool

    copied: list[int] = []
    adopt = KVPool._adopt
    monkeypatch.setattr(KVPool, "_adopt", lambda self, c, s: copied.append(s) or adopt(self, c, s))
    return copied


@pytest.mark.parametrize("schedule", ["lockstep", "staggered"])
def test_batch_engine_schedules_identical_to_full(lm, cases, schedule, monkeypatch):
    """The serving engine (`vericache serve --schedule`): four requests at once. Each
    request's caches are made in a pool (`Runner.new_cache(arena=)`: with the native kernel,
    one a side, `rounds.arena`), so no pass copies a cache into a pool, staggered passes
    over both groups' requests included (with a pool per group, the staggered run copied a
    cache into another pool four times)."""
    from vericache.engine.batch import BatchEngine

    copied = _pool_copies(monkeypatch)
    ids, refs = cases
    engine = BatchEngine(lm, max_batch=8, schedule=schedule)
    try:
        streams = [engine.submit(p, GenParams(max_tokens=N, ignore_eos=True, compressor="snapkv",
                                              ratio=4, draft_len=8)) for p in ids]
        events = [list(rs) for rs in streams]
        assert all(ev.error is None for evs in events for ev in evs)
        outs = [[t for ev in evs for t in ev.token_ids] for evs in events]
    finally:
        engine.close()
    assert outs == refs
    assert copied == []
    overlapped = engine.metrics()["counters"]["overlapped_rounds"]
    assert (overlapped > 0) == (schedule == "staggered")
    with pytest.raises(ValueError, match="lockstep, staggered"):
        BatchEngine(lm, schedule="eager")


def test_a_plain_batch_of_both_groups_copies_no_cache(lm, cases, monkeypatch):
    """Staggered, requests that decode plainly (full mode here, as where the cost model
    chooses plain steps) belong to no group, so one verify pass takes both groups' requests.
    The verifier's caches share one pool whatever their group, and the pass reads only its
    rows' keys, so no cache is copied into a pool: with a pool per group, such a pass copied
    the other group's caches (an 8k request's in 0.84 s, against 0.07 s for the pass)."""
    from vericache.engine.batch import BatchEngine
    from vericache.engine.lanes import LaneRunner

    copied, mixed = _pool_copies(monkeypatch), []
    execute = LaneRunner._execute

    def spy(self, job, threads):
        if job.kind == "verify":  # whether the pass takes both groups' requests
            mixed.append(len({self.sched.group(rid) for rid in job.rids}) > 1)
        return execute(self, job, threads)

    monkeypatch.setattr(LaneRunner, "_execute", spy)
    ids, refs = cases
    engine = BatchEngine(lm, max_batch=8, schedule="staggered")
    try:
        streams = [engine.submit(p, GenParams(mode="full", max_tokens=N, ignore_eos=True))
                   for p in ids]
        outs = [[t for ev in rs for t in ev.token_ids] for rs in streams]
    finally:
        engine.close()
    assert outs == refs
    assert any(mixed)
    assert copied == []


def test_serving_and_the_scenario_benchmark_run_one_executor(lm, cases, monkeypatch):
    """`BatchEngine` (what `vericache serve` and the gateway run) and `run_requests` (what
    `vericache bench --scenario` runs) execute their jobs in the same `LaneRunner`: every
    job of both goes through it, outputs equal full greedy in both. The jobs running at once
    share the caller's threads: the first job of a closed run has all four, the one the
    drafter lane starts beside it half, and each lane computes on what it was given."""
    import torch

    from vericache.engine.batch import BatchEngine
    from vericache.engine.lanes import LaneRunner

    jobs: dict[bool, set[str]] = {True: set(), False: set()}  # detailed trace: closed run
    given: list[int] = []  # closed run: the threads each job was given, in start order
    computed_on: list[tuple[int, int]] = []  # (given, the lane's count when it ended)
    execute = LaneRunner._execute

    def spy(self, job, threads):
        jobs[self.trace.detailed].add(job.kind)
        if self.trace.detailed:
            given.append(threads)
        try:
            return execute(self, job, threads)
        finally:
            if self.trace.detailed:
                computed_on.append((threads, torch.get_num_threads()))

    monkeypatch.setattr(LaneRunner, "_execute", spy)
    ids, refs = cases
    engine = BatchEngine(lm, max_batch=8, schedule="staggered")
    try:
        streams = [engine.submit(p, GenParams(max_tokens=N, ignore_eos=True, compressor="snapkv",
                                              ratio=4, draft_len=8)) for p in ids]
        outs = [[t for ev in rs for t in ev.token_ids] for rs in streams]
        counters = engine.metrics()["counters"]
    finally:
        engine.close()
    assert outs == refs
    assert jobs[False] == {"prefill", "draft", "verify", "ahead"}
    assert counters["ahead_drafted"] > 0 and counters["overlapped_rounds"] > 0
    assert engine.sessions() == {"drafter": 0, "verifier": 0}  # every request released
    gens = _gens(lm, ids[:2])
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        run_requests(LocalBackends(lm), gens, "staggered", draft_ahead=True)
    finally:
        torch.set_num_threads(before)
    assert [g.output_ids for g in gens] == refs[:2]
    assert jobs[True] >= {"prefill", "draft", "verify"}
    # the two prefills start together: the admission lane's alone, the drafter lane's beside it
    assert sorted(given[:2]) == [2, 4]
    assert all(t == on for t, on in computed_on), computed_on


def test_the_serving_engine_admits_within_its_kv_budget(lm, cases):
    """A verifier budget of two requests' full KV: full mode admits two at a time, the others
    wait, nothing is lost; a request that could never fit is refused, naming the limit."""
    from vericache.engine.batch import BatchEngine
    from vericache.engine.budget import request_cost
    from vericache.errors import InvalidArgument

    ids, refs = cases
    per_tok = lm.runner.kv_bytes_per_token()
    cost = request_cost(per_tok)
    params = GenParams(mode="full", max_tokens=N, ignore_eos=True)
    need = [cost(Generation(lm, p, params))[1] for p in ids]
    budget = sorted(need)[-1] + sorted(need)[-2]  # the two largest fit together, not all four
    engine = BatchEngine(lm, max_batch=8, cost=cost, verify_budget=budget)
    try:
        streams = [engine.submit(p, params) for p in ids]
        outs = [[t for ev in rs for t in ev.token_ids] for rs in streams]
        with pytest.raises(InvalidArgument, match="verifier KV memory.*--kv-budget-mb"):
            engine.submit(ids[3] * 2, params)  # more than the two largest together
    finally:
        engine.close()
    kv = engine.metrics()["kv_bytes"]["verifier"]  # closed: every request has left
    assert outs == refs
    trace = engine.runner.trace
    assert 2 <= trace.max_active < len(ids) and trace.peak_kv[1] <= budget
    assert kv == {"in_use": 0, "budget": budget}


def test_the_engine_fails_only_the_requests_of_a_failed_job(lm, cases):
    """A verify pass that raises fails its own requests with an error event; requests in
    other jobs, and later requests, go on and equal full greedy; nothing stays held."""
    from vericache.engine.batch import BatchEngine
    from vericache.errors import Unavailable

    class Flaky(LocalBackends):
        fail_next = True

        def verify(self, batch, finish=None):
            if self.fail_next and any(g.params.namespace == "doomed" for g, _ in batch):
                self.fail_next = False
                raise Unavailable("verifier lost")
            return super().verify(batch, finish)

    ids, refs = cases
    b = Flaky(lm)
    engine = BatchEngine(lm, max_batch=1, backends=b)  # one request at a time: one per job
    try:
        params = GenParams(max_tokens=N, ignore_eos=True, compressor="snapkv", ratio=4, draft_len=8)
        doomed = engine.submit(ids[0], dataclasses.replace(params, namespace="doomed"))
        fine = engine.submit(ids[1], params)
        d_events, f_events = list(doomed), list(fine)
        after = [t for ev in engine.submit(ids[0], params) for t in ev.token_ids]
        counters = engine.metrics()["counters"]
    finally:
        engine.close()
    assert d_events[-1].error == "Unavailable: verifier lost"
    assert [t for ev in d_events for t in ev.token_ids] == refs[0][:len(
        [t for ev in d_events for t in ev.token_ids])]  # what it got before the failure is exact
    assert [t for ev in f_events for t in ev.token_ids] == refs[1] and f_events[-1].error is None
    assert after == refs[0]
    assert counters["errors"] == 1 and counters["finished"] == 3
    assert b.sessions() == {"drafter": 0, "verifier": 0}


def test_a_request_id_in_use_is_refused(lm, prompts):
    """Two gateways sharing a verifier must never share a session: a second prefill or attach
    under a live id is an error, not an overwrite of the first request's cache."""
    from vericache.errors import InvalidArgument

    b = LocalBackends(lm)
    g = Generation(lm, prompts["code"], GenParams(max_tokens=4, compressor="identity"), request_id="dup")
    b.admit(g)
    with pytest.raises(InvalidArgument, match="already has a verifier session"):
        b.verifier.prefill("dup", prompts["code"], 8, 256)
    k, v = b.verifier.cache("dup").view(0, 4)
    with pytest.raises(InvalidArgument, match="already has a drafter session"):
        b.drafter.attach("dup", k, v, [1], 5, 8)
    b.release(g)
    b.admit(g)  # free again once released
    b.release(g)
