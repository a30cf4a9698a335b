"""Selection policies: the drafter's kept set moves where the verifier says, slot for slot,
and the output stays full greedy decoding for every policy."""

import pytest
import torch

from vericache.compress import make_compressor
from vericache.engine.drafter import Drafter
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends
from vericache.engine.verifier import Verifier
from vericache.errors import InvalidArgument, UnknownName
from vericache.select import SelectionDelta, SelectionState, make_selection, selection_names
from vericache.select.base import SINKS, _take, move_towards, pooled, target_mask, upgrade_towards
from vericache.store.codec import decode_deltas, encode_deltas
from vericache.store.memory import MemoryStore


def _state(L=2, H=3, n=40, m=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.stack([torch.stack([torch.randperm(n, generator=g)[:m] for _ in range(H)])
                       for _ in range(L)])
    return SelectionState(pos, n)


def _full(L=2, H=3, n=40, D=8):
    k = torch.arange(L * H * n * D, dtype=torch.float32).view(L, H, n, D)
    return k, -k


def test_registry_names_and_errors():
    assert selection_names() == ["question", "static", "verify"]
    assert make_selection("verify:every=8,tokens=64").spec == \
        "verify:decay=0.8,every=8,pool=5,tokens=64,window=32"
    with pytest.raises(UnknownName, match="valid: question, static, verify"):
        make_selection("oracle")
    with pytest.raises(InvalidArgument):
        make_selection("verify:every=0")


def test_move_keeps_the_budget_and_reaches_the_target():
    st = _state()
    before = st.positions.clone()
    score = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(1))
    k, v = _full()
    delta = move_towards(st, score, 1, None, k, v)
    want = target_mask(score, 10, 1)
    assert torch.equal(st.held_mask(), want)  # all the way: the set is the target
    assert (st.held_mask().sum(-1) == 10).all()  # same budget, no duplicates
    assert want[..., :SINKS].all()  # sinks always in
    # the delta names exactly the slots whose position changed, with the entering K/V
    changed = st.positions != before
    assert int(changed.sum()) == delta.moved
    valid = delta.slots >= 0
    li, hi, _ = valid.nonzero(as_tuple=True)
    assert torch.equal(st.positions[li, hi, delta.slots[valid]], delta.positions[valid])
    assert torch.equal(delta.k[valid], k[li, hi, delta.positions[valid]])


def test_bounded_move_takes_the_best_first():
    st = _state(m=12)
    score = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(2))
    k, v = _full()
    delta = move_towards(st, score, 1, 2, k, v)
    assert delta.slots.shape[-1] <= 2
    assert int((delta.slots >= 0).sum(-1).max()) <= 2
    assert (st.held_mask().sum(-1) == 12).all()
    # repeated bounded moves converge to the unbounded target
    for _ in range(20):
        if move_towards(st, score, 1, 2, k, v) is None:
            break
    assert torch.equal(st.held_mask(), target_mask(score, 12, 1))


def test_salient_set_grows_best_first_to_its_budget_and_never_shrinks():
    """A salient set (KIVI) starts empty; each move writes the best-scored positions not yet
    held over their own slots (slot = position), within `fill`, `limit` and the budget."""
    st = SelectionState.empty_salient(2, 3, 10, 40)
    assert not st.held_mask().any()
    score = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(4))
    k, v = _full()
    d = upgrade_towards(st, score, 1, None, k, v, fill=5)
    assert (st.held_mask().sum(-1) == 5).all()
    assert torch.equal(d.slots, d.positions)  # over their own slots
    assert torch.equal(d.k, torch.gather(k, 2, d.positions[..., None].expand(-1, -1, -1, 8)))
    first = st.held_mask().clone()
    assert first[..., :SINKS].all()  # sinks first
    d = upgrade_towards(st, score, 1, 2, k, v)  # at most 2 a row
    assert int((d.slots >= 0).sum(-1).max()) == 2 and (st.held_mask().sum(-1) == 7).all()
    assert (st.held_mask() & first).sum() == first.sum()  # nothing leaves
    assert not st.full
    while upgrade_towards(st, score, 1, 2, k, v) is not None:
        pass
    assert st.full and not _state().full  # (a kept set is never "full": it swaps)
    assert torch.equal(st.held_mask(), target_mask(score, 10, 1))  # the budget's best
    assert upgrade_towards(st, torch.rand(2, 3, 40), 1, None, k, v) is None  # full: nothing moves


def test_question_first_move_bounded_by_first():
    """`question:first=N` moves at most N tokens per layer and KV head after prefill, the
    best-scored of the unbounded move's; the default moves all the way, and keeps its spec."""
    L, H, n, D, w = 2, 3, 40, 8, 4
    g = torch.Generator().manual_seed(4)
    votes = torch.softmax(torch.randn(L, H, 2 * w, n, generator=g), -1).sum(2)
    k, v = torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g)
    full_pol, bounded = make_selection("question:pool=1"), make_selection("question:pool=1,first=2")
    assert full_pol.spec == "question:pool=1,window=32" and bounded.spec.startswith("question:first=2,")
    with pytest.raises(InvalidArgument):
        make_selection("question:first=-1")
    st_full, st_b = _state(m=12), _state(m=12)
    d_full = full_pol.after_prefill(st_full, votes, w, k, v)
    d_b = bounded.after_prefill(st_b, votes, w, k, v)
    assert int((d_full.slots >= 0).sum(-1).max()) > 2  # the unbounded move is larger
    per_row = (d_b.slots >= 0).sum(-1)
    assert int(per_row.max()) == 2 and d_b.moved < d_full.moved
    # what entered is among what the unbounded move brought in, and the budget holds
    entered = st_b.held_mask() & ~_state(m=12).held_mask()
    assert not (entered & ~st_full.held_mask()).any()
    assert (st_b.held_mask().sum(-1) == 12).all()


def test_entering_tokens_are_taken_from_any_cache_view():
    """A move's entering K/V (`_take`) are the tokens a gather picks, from a cache's view
    ([:, :, :n] of room for more), a pool's slot (layers strided over the slots) and a view
    whose tokens are not rows of the storage (the gather then)."""
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(4, 3, 2, 50, 8, generator=g)  # [L, slots, H, cap, D]
    plain = torch.randn(4, 2, 50, 8, generator=g)
    for t in (pool[:, 1, :, :37], plain[:, :, :37], plain[:, :, :8, :6].transpose(2, 3)):
        pos = torch.randint(0, t.shape[2], (4, 2, 9), generator=g)
        want = torch.gather(t, 2, pos.unsqueeze(-1).expand(4, 2, 9, t.shape[3]))
        assert torch.equal(_take(t, pos), want)


@pytest.mark.parametrize("n", [300, 270, 356])
def test_prefill_gives_the_question_windows_votes(lm, prompts, n):
    """The prefill passes give the question score: each prompt token's attention mass from
    the prompt's last 32 queries, summed over them and a KV group's query heads (a float64
    softmax over the queries a pass over the whole prompt captures, to float32 rounding),
    and asking for them leaves the cache and the logits bit for bit a plain prefill's. The
    window sits in a last chunk of 44 rows (the native kernel's votes), spans two chunks (the
    first one's 256 rows on the explicit-score path), or sits in a last chunk of 100 rows."""
    from vericache.engine.prefill import prefill

    r = lm.runner
    ids = prompts["long"][:n]
    got, plain = prefill(r, ids, 4, 256, question_window=32), prefill(r, ids, 4, 256)
    assert torch.equal(got.logits, plain.logits)
    for a, b in zip(got.cache.view(), plain.cache.view()):
        assert torch.equal(a, b)
    assert got.window_rows == 32 and got.window_votes.shape == (r.num_layers, r.num_kv_heads, n)
    c = r.new_cache(n)
    _, item = r.step(ids, 0, c, logits="none", capture_q=torch.arange(n - 32, n))
    k = c.view()[0].double()  # [L, Hkv, n, D]
    q = item.captured.double().view(r.num_layers, r.num_kv_heads, r.group, 32, -1)
    s = torch.einsum("lhgwd,lhnd->lhgwn", q, k) * r.scale
    future = torch.arange(n)[None, :] > torch.arange(n - 32, n)[:, None]
    want = torch.softmax(s.masked_fill(future, float("-inf")), -1).sum((2, 3))
    assert float((got.window_votes.double() - want).abs().max()) < 1e-4
    assert torch.allclose(got.window_votes.sum(-1), torch.full_like(got.window_votes[..., 0], 32.0 * r.group))


def test_pooling_by_max_or_mean():
    """`pooled` takes the max (default) or, with avg, the mean over the `pool` neighbours a
    position has (fewer at the edges); `question:avg=1` ranks its move by the mean."""
    g = torch.Generator().manual_seed(5)
    score = torch.rand(2, 3, 23, generator=g)
    pad = torch.nn.functional.pad(score, (2, 2), value=float("nan"))
    windows = pad.unfold(-1, 5, 1)  # [L, H, n, 5]: each position's neighbours, nan off the edge
    assert torch.allclose(pooled(score, 5, avg=True), windows.nanmean(-1))
    assert torch.equal(pooled(score, 5), windows.nan_to_num(float("-inf")).amax(-1))
    assert torch.equal(pooled(score, 1, avg=True), score)
    pol, by_max = make_selection("question"), make_selection("question:avg=0,pool=7")
    assert pol.spec == "question:pool=5,window=32" and by_max.spec == "question:avg=0,pool=7,window=32"
    assert torch.equal(pol.pooled(score), pooled(score, 5, avg=True))
    assert torch.equal(by_max.pooled(score), pooled(score, 7))
    with pytest.raises(InvalidArgument):
        make_selection("question:avg=2")


def test_delta_compact_and_codec_round_trip():
    st = _state()
    k, v = _full()
    delta = move_towards(st, torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(3)),
                         1, 3, k, v)
    back = decode_deltas(encode_deltas([delta, delta]))
    assert len(back) == 2
    for d in back:
        valid = delta.slots >= 0
        assert torch.equal(d.slots >= 0, valid)
        assert torch.equal(d.slots[valid], delta.slots[valid])
        assert torch.equal(d.positions[valid], delta.positions[valid])
        assert torch.equal(d.k[valid], delta.k[valid]) and torch.equal(d.v[valid], delta.v[valid])
    assert delta.nbytes() == delta.moved * (2 * 8 * 4 + 12)


def test_8bit_delta_values_survive_the_codec_and_cost_a_quarter():
    """bits=8: the entering K/V are int8 times a power-of-two scale per entry, within 1/127 of
    each entry's largest value; encoding them again loses nothing, so a drafter behind a link
    writes the same values as one in the same process; the bytes are 2D + 2 a token, not 8D."""
    from vericache.select.base import as_8bit, from_8bit, to_8bit

    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None]
    y = from_8bit(*to_8bit(x))
    assert not torch.equal(x, y)
    assert ((x - y).abs().amax(-1) <= x.abs().amax(-1) / 127).all()
    assert torch.equal(from_8bit(*to_8bit(y)), y)  # values already 8-bit pass unchanged
    # rounded half to even, as torch.round: ties included (x.5 times the row's scale)
    q, e = to_8bit(x)
    scaled = x * torch.exp2(-e.float())[:, None]
    assert torch.equal(q, torch.round(scaled).clamp(-127, 127).to(torch.int8))
    ties = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0]]) * 2.0 ** -3
    assert to_8bit(ties)[0].tolist() == [[0, 2, 2, 0, -2, -2, 126, 127]]
    assert torch.equal(as_8bit(x), y) and torch.equal(as_8bit(x.double()), y.double())
    L, H, n, D = 2, 3, 40, 8
    k, v = torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g)
    score = torch.rand(L, H, n, generator=g)
    d32 = move_towards(_state(), score, 1, None, k, v)
    d8 = move_towards(_state(), score, 1, None, k, v, bits=8)
    assert torch.equal(d8.slots, d32.slots) and d8.bits == 8
    valid = d8.slots >= 0
    assert not torch.equal(d8.k[valid], d32.k[valid])
    assert torch.equal(d8.k[valid], from_8bit(*to_8bit(d32.k[valid])))
    back = decode_deltas(encode_deltas([d8]))[0]
    assert back.bits == 8
    assert torch.equal(back.k[valid], d8.k[valid]) and torch.equal(back.v[valid], d8.v[valid])
    assert d8.nbytes() == d8.moved * (2 * D + 2 + 12) < d32.nbytes()
    assert len(encode_deltas([d8])) < len(encode_deltas([d32]))
    with pytest.raises(InvalidArgument):
        make_selection("question:bits=4")
    # 8 is the policies' default (not in the spec); 32 moves the full KV's own values
    assert make_selection("question").bits == make_selection("verify").bits == 8
    assert make_selection("verify:bits=8").spec == make_selection("verify").spec == \
        "verify:decay=0.8,every=4,pool=5,tokens=32,window=32"
    assert make_selection("question:bits=32").spec == "question:bits=32,pool=5,window=32"


def test_drafter_applies_a_delta_to_its_region_only(lm):
    r = lm.runner
    L, H, D = r.num_layers, r.num_kv_heads, r.head_dim
    region, tail = 6, 3
    k = torch.randn(L, H, region + tail, D)
    d = Drafter(r, lm.eos_token_ids)
    d.attach("a", k, -k, [1], 20, 8, region=region)
    slots = torch.full((L, H, 1), -1, dtype=torch.long)
    slots[0, 1, 0] = 4
    new = torch.ones(L, H, 1, D)
    d.apply_delta("a", SelectionDelta(slots, torch.full((L, H, 1), 99), new, new))
    c = d.sessions["a"].cache
    assert torch.equal(c.k[0, 1, 4], torch.ones(D))
    # (the drafter's K/V dtype: bfloat16 for this float32 model on CPU)
    changed = (c.k[:, :, :region + tail] != k.to(r.draft_dtype)).any(-1)
    assert int(changed.sum()) == 1
    slots[0, 1, 0] = region  # the exact tail is never moved
    with pytest.raises(InvalidArgument, match="outside the prompt region"):
        d.apply_delta("a", SelectionDelta(slots, torch.full((L, H, 1), 99), new, new))


@pytest.mark.parametrize("spec", ["snapkv", "snapkv-kivi"])
def test_question_policy_moves_the_drafter_to_the_verifiers_set(lm, prompts, spec):
    """After prefill with `question`, slot i of the drafter's region holds the position the
    verifier's record says, with the full KV (re-quantized for KIVI) of that position; the set
    is the whole-prompt SnapKV top-k, and it reaches past the chunks' own choice (bits=32:
    the moved K/V are the full KV's own values)."""
    ids = prompts["long"][:1100]  # four compressed chunks, then the exact tail
    comp = make_compressor(spec, 4)
    store = MemoryStore()
    ver = Verifier(lm.runner, store, lm.model_id)
    pol = make_selection("question:bits=32")
    out = ver.prefill("q", ids, 8, 256, comp, save_tail=True, selection=pol)
    dr = Drafter(lm.runner, lm.eos_token_ids, store, lm.model_id)
    dr.attach_from_store("q", ids, comp, 256, out.tail_start, out.first_token, 8)
    rec = ver.selection("q")
    base = torch.cat([comp.kept_positions(c) for c in out.chunks], dim=2)
    assert rec.state.budget == base.shape[-1]
    assert rec.state.moved_tokens > 0 and not torch.equal(rec.state.positions, base)
    for delta in ver.take_deltas("q"):
        dr.apply_delta("q", delta)
    full, c = ver.cache("q"), dr.sessions["q"].cache
    m = rec.state.budget
    idx = rec.state.positions.unsqueeze(-1).expand(-1, -1, -1, full.k.shape[-1])
    want_k = torch.gather(full.k[:, :, :out.tail_start], 2, idx)
    if spec == "snapkv":  # the K/V at the recorded positions, in the drafter's dtype
        assert torch.equal(c.k[:, :, :m], want_k.to(c.k.dtype))
    else:  # KIVI-quantized: close, not equal
        err = (c.k[:, :, :m].float() - want_k).abs().mean() / want_k.abs().mean()
        assert 0 < err < 0.2
    # the top of the score as the policy pools it (mean over 5 by default)
    assert torch.equal(rec.state.held_mask(), target_mask(pol.pooled(rec.state.score), m, 1))
    ver.release("q")
    dr.release("q")


def test_question_policy_over_a_cached_prefix_reaching_into_the_tail(lm, prompts):
    """A prompt whose cached full chunks reach past its compressed region (into its exact
    tail): the base set is the stored compressed chunks before the tail, nothing past it."""
    long = prompts["long"]
    comp, store = make_compressor("snapkv", 4), MemoryStore()
    ver = Verifier(lm.runner, store, lm.model_id)
    ver.prefill("warm", long[:1400], 1, 256, comp)
    ver.release("warm")
    short = long[:1064]  # tail from 768 (1064 - 64); full chunks cached up to 1024
    out = ver.prefill("s", short, 8, 256, comp, save_tail=True, selection=make_selection("question"))
    assert out.cached_tokens == 1024 and out.tail_start == 768 and out.chunks == []
    rec = ver.selection("s")
    assert rec.state.region_end == 768 and int(rec.state.positions.max()) < 768
    assert rec.state.budget == 3 * 64 and rec.state.moved_tokens > 0
    ver.release("s")


def test_question_window_over_cached_chunks_recomputes_nothing(lm, prompts):
    """A prompt whose last 32 tokens (the question window) reach back into cached chunks: the
    whole cached prefix is loaded, as in `full` mode (before, one more chunk was recomputed
    for the window's queries), the verifier's cache is bit for bit `full` mode's, and the
    window's votes are those of a prefill of the whole prompt, up to fp32 noise."""
    from vericache.engine.prefill import prefill

    long = prompts["long"]
    comp, store = make_compressor("snapkv", 4), MemoryStore()
    ver = Verifier(lm.runner, store, lm.model_id)
    ver.prefill("warm", long[:1300], 1, 256, comp)
    ver.release("warm")
    ids = long[:1034]  # 10 tokens past the cached 1024: the window starts at 1002
    out = ver.prefill("q", ids, 8, 256, comp, save_tail=True, selection=make_selection("question"))
    full = ver.prefill("f", ids, 8, 256)  # full mode: no compressor, no selection
    assert out.cached_tokens == full.cached_tokens == 1024
    assert out.first_token == full.first_token
    a, b = ver.cache("q"), ver.cache("f")
    assert a.length == b.length and torch.equal(a.view()[0], b.view()[0])
    assert torch.equal(a.view()[1], b.view()[1])
    rec = ver.selection("q")
    assert rec.state.moved_tokens > 0
    fresh = prefill(lm.runner, ids, 8, 256, question_window=32)
    got = prefill(lm.runner, ids, 8, 256, cache=ver.cache("f").__class__.from_tensors(
        b.view(0, 1024)[0].clone(), b.view(0, 1024)[1].clone(), 18), question_window=32)
    assert got.window_rows == fresh.window_rows == 32
    assert got.window_votes.shape == fresh.window_votes.shape == (lm.runner.num_layers,
                                                                  lm.runner.num_kv_heads, 1034)
    assert float((got.window_votes - fresh.window_votes).abs().max()) < 1e-4
    for rid in ("q", "f"):
        ver.release(rid)


@pytest.mark.parametrize("spec", ["identity", "kivi:salient=0"])
def test_nothing_to_move_when_every_token_is_kept_as_it_is(lm, prompts, spec):
    ver = Verifier(lm.runner)
    ver.prefill("k", prompts["long"][:600], 8, 256, make_compressor(spec),
                selection=make_selection("verify"))
    assert ver.selection("k") is None and ver.take_deltas("k") == []


@pytest.mark.parametrize("policy,filled", [("question:bits=32", 1.0), ("verify:bits=32", 0.5)])
def test_kivi_policy_holds_its_best_scored_tokens_precisely(lm, prompts, policy, filled):
    """Over KIVI (every token kept, 2-bit) a policy moves precision: after prefill the
    drafter's slots of the salient positions hold the full KV's own values (bits=32), the
    rest KIVI's; question fills the budget (one region token in 8), verify half of it."""
    ids = prompts["long"][:1100]
    comp = make_compressor("kivi:bits=2")
    ver = Verifier(lm.runner)
    out = ver.prefill("s", ids, 8, 256, comp, selection=make_selection(policy))
    rec = ver.selection("s")
    ts = out.tail_start
    assert rec.state.salient and rec.state.budget == ts // 8
    held = rec.state.held_mask()
    assert (held.sum(-1) == int(rec.state.budget * filled)).all()
    assert torch.equal(held, target_mask(rec.policy.pooled(rec.state.score),
                                         int(rec.state.budget * filled), 1))
    k, v = comp.draft_kv(out.chunks, *ver.cache("s").view(ts, len(ids)))
    dr = Drafter(lm.runner, lm.eos_token_ids)
    dr.attach("s", k, v, [out.first_token], len(ids), 8, region=ts)
    for delta in ver.take_deltas("s"):
        dr.apply_delta("s", delta)
    full, c = ver.cache("s").k[:, :, :ts], dr.sessions["s"].cache.k[:, :, :ts]
    exact = (c.float() == full.to(c.dtype).float()).all(-1)
    assert exact[held].all()  # salient: the full KV's values (in the drafter's dtype)
    assert exact[~held].float().mean() < 0.05  # the rest: KIVI's 2-bit values
    if filled < 1:  # verify: passes fold votes into the score until the set is full, not after
        st = rec.state
        before = st.score.clone()
        ver.verify([("s", [out.first_token] * 3, None)])
        assert not torch.equal(st.score, before)
        full_kv = ver.cache("s").view(0, ts)
        while upgrade_towards(st, st.score, 1, None, *full_kv) is not None:
            pass
        assert st.full
        before = st.score.clone()
        ver.verify([("s", [out.first_token] * 3, None)])
        assert torch.equal(st.score, before)
    ver.release("s")
    dr.release("s")


N = 32


@pytest.fixture(scope="module")
def store():
    """One prefix cache for the grid: a compressor's later runs reuse its first prefill."""
    s = MemoryStore()
    yield s
    s.close()


@pytest.fixture(scope="module")
def long_reference(lm, prompts):
    return generate(lm, prompts["long"], GenParams(mode="full", max_tokens=N, ignore_eos=True))


VERIFY = "verify:every=2,tokens=16"


@pytest.mark.slow
@pytest.mark.parametrize("selection,spec,k", [
    ("static", "snapkv", 16), (VERIFY, "snapkv", 4), (VERIFY, "snapkv-kivi:bits=2", 16),
    (VERIFY, "streamingllm", 4), (VERIFY, "kivi:bits=2", 16)])
def test_every_policy_identical_to_full_on_the_long_prompt(lm, prompts, long_reference, store,
                                                           spec, k, selection):
    """(`question`, the default, runs in test_identity for every compressor, k and prompt.)
    k is fixed here, so τ says whether drafting works, not what the cost model chose."""
    res = generate(lm, prompts["long"], GenParams(mode="vericache", compressor=spec, draft_len=k,
                                                  selection=selection, max_tokens=N, ignore_eos=True,
                                                  adaptive=False), LocalBackends(lm, store))
    assert res.token_ids == long_reference.token_ids, (spec, k, selection)
    assert res.usage["tokens_per_round"] >= 1.5  # drafting works, not only identity
    moved = res.stats.select_moves
    if selection == "static" or spec == "streamingllm":  # streamingllm's region is its sinks
        assert moved == 0
    else:
        assert moved >= 1 and res.stats.select_delta_bytes > 0


@pytest.mark.slow
def test_bounded_8bit_question_move_crosses_a_link_and_stays_identical(lm, prompts, long_reference,
                                                                       store):
    """question:first=256,bits=8 through a drafter on its own link to the store (the moves are
    encoded, stored and decoded, as for a remote drafter): at most 256 tokens a layer and KV
    head, 2D + 2 + 12 bytes each, and the output is still full greedy decoding."""
    r = lm.runner
    res = generate(lm, prompts["long"], GenParams(mode="vericache", compressor="snapkv", draft_len=16,
                                                  selection="question:first=256,bits=8",
                                                  max_tokens=N, ignore_eos=True, adaptive=False),
                   LocalBackends(lm, store, drafter_store=store))
    assert res.token_ids == long_reference.token_ids
    assert res.usage["tokens_per_round"] >= 1.5
    s = res.stats
    assert s.select_moves == 1 and 0 < s.select_moved_tokens <= 256 * r.num_layers * r.num_kv_heads
    assert s.select_delta_bytes == s.select_moved_tokens * (2 * r.head_dim + 2 + 12)
