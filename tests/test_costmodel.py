"""The cost model: it learns round costs from observations and picks the k with the best
expected goodput, including k = 0 (a plain decode step) when drafting does not pay."""

import numpy as np
import pytest

from vericache.spec.costmodel import EXPLORE, AcceptanceProfile, CostModel, LinearFit


def test_linear_fit_recovers_a_linear_cost():
    import numpy as np

    f = LinearFit(3)
    for b in range(1, 9):
        for c in (1.0, 2.0, 4.0):
            x = np.array([1.0, b, c])
            f.observe(x, 0.01 + 0.002 * b + 0.003 * c, b, bucket=(b, c))
    assert f.ready()
    assert f.predict(np.array([1.0, 16, 8.0])) == pytest.approx(0.01 + 0.032 + 0.024, rel=1e-3)


def test_a_seen_shape_is_priced_by_its_own_times_not_the_line():
    """Pass times that are not linear in their rows (flat up to 64 rows, then per row, as a
    CPU's): a shape the fit has seen is predicted near its own measured time, where the best
    line through all of them misses it by far; an unseen shape between two seen ones is
    priced between their times, nearer the truth than the line."""
    import numpy as np

    def seconds(rows):  # 16 sequences, k = 0..32: rows 16 (a plain step) to 528
        return 0.25 + 0.004 * max(0, rows - 64)

    f = LinearFit(2)
    for _ in range(8):
        for k in (0, 1, 2, 4, 8, 16, 32):
            rows = 16 * (k + 1)
            f.observe(np.array([1.0, rows]), seconds(rows), rows)
    line = lambda rows: float(np.array([1.0, rows]) @ f.theta)  # noqa: E731
    assert abs(line(16) - seconds(16)) / seconds(16) > 0.3  # the line alone is far off
    for rows in (16, 32, 80, 528):
        assert f.predict(np.array([1.0, rows]), rows) == pytest.approx(seconds(rows), rel=0.05)
    unseen = f.predict(np.array([1.0, 40]), 40)  # between 32 and 48, both 0.25
    assert abs(unseen - seconds(40)) < 0.5 * abs(line(40) - seconds(40))
    assert f.predict(np.array([1.0, 40])) == pytest.approx(line(40))  # no bucket: the line


def test_long_runs_of_one_shape_keep_the_other_shapes_priced():
    """A server on plain steps for hundreds of rounds, its context growing, must still price a
    multi-row verify pass from what exploration saw (recursive least squares with forgetting
    priced a 9-row pass at a tenth of its time here, and drafting looked cheap)."""
    import numpy as np

    from vericache.spec.costmodel import _verify_x

    def seconds(tokens, ctx_sum, work):  # a machine: a one-row pass is cheap, rows cost extra
        return 0.05 + 0.004 * tokens + 0.08 * (tokens > 1) + 0.02 * ctx_sum / 1e4 + 0.001 * work / 1e5

    rng = np.random.default_rng(1)
    for trial in range(3):
        costs, ctx = CostModel(), 18800
        for k in EXPLORE:
            ctx += 8 * (k + 1)
            costs.observe_verify(8 * (k + 1), ctx, (k + 1) * ctx,
                                 seconds(8 * (k + 1), ctx, (k + 1) * ctx) * rng.uniform(0.8, 1.2))
        for _ in range(600):  # 8 requests on plain steps, times noisy by +-30%
            ctx += 8
            costs.observe_verify(8, ctx, ctx, seconds(8, ctx, ctx) * rng.uniform(0.7, 1.3))
        for k in (1, 3, 8):
            truth = seconds(8 * (k + 1), ctx, (k + 1) * ctx)
            predicted = costs.verify.predict(_verify_x(8 * (k + 1), ctx, (k + 1) * ctx))
            assert 0.75 < predicted / truth < 1.33, (trial, k, predicted / truth)


def test_expected_tokens_follow_the_profile():
    p = AcceptanceProfile(4)
    assert p.expected_tokens(0.5) == pytest.approx([1, 1.5, 1.75, 1.875, 1.9375])
    for _ in range(200):  # every draft accepted, always
        p.update(4, 4)
    e = p.expected_tokens(0.5)
    assert e[4] > 4.8 and e == sorted(e)
    q = AcceptanceProfile(4)
    for _ in range(200):  # the first draft always rejected
        q.update(4, 0)
    assert q.expected_tokens(0.5)[4] < 1.05


def _simulate(costs: CostModel, draft_step: float, verify_base: float, per_token: float,
              profile: AcceptanceProfile, rounds: int = 60, ctx: int = 1000) -> list[int]:
    """Feed the model a synthetic machine; returns the k it chose per round."""
    chosen = []
    for _ in range(rounds):
        k = costs.plan([16], [ctx], [profile], [False]).ks[0]
        chosen.append(k)
        if k:
            costs.observe_draft(k, 1, ctx, k * draft_step)
        costs.observe_verify(k + 1, ctx, (k + 1) * ctx, verify_base + per_token * (k + 1))
    return chosen


def _profile(rate: float) -> AcceptanceProfile:
    p = AcceptanceProfile(16)
    accepted = 0
    for i in range(400):  # a deterministic stream of rounds at about `rate` per draft
        a = 0
        while a < 16 and ((i * 7 + a * 13) % 100) < rate * 100:
            a += 1
        p.update(16, a)
        accepted += a
    return p


def test_explores_first_then_drafts_where_drafting_pays():
    costs = CostModel()
    prof = _profile(0.9)
    ks = _simulate(costs, draft_step=0.002, verify_base=0.02, per_token=0.0005, profile=prof)
    assert ks[:len(EXPLORE)] == [min(k, 16) for k in EXPLORE]
    # once fitted, the k of the best true goodput (cheap drafts, high acceptance: long drafts)
    e = prof.expected_tokens(costs.prior_rate)
    true = [e[k] / (0.002 * k + 0.02 + 0.0005 * (k + 1)) for k in range(17)]
    best = max(range(17), key=true.__getitem__)
    assert best >= 4 and set(ks[len(EXPLORE) + 2:]) == {best}
    snap = costs.snapshot()
    assert snap["fitted"] and snap["plain_share"] < 0.1


def test_drafting_must_beat_plain_steps_by_the_margin():
    """Verify passes cost the same at any k here, so a round of k = 1 gains E(1) t_v /
    (t_d + t_v) over a plain step: a predicted gain under DRAFT_MARGIN takes plain steps (a
    few percent is within the model's error), one above it drafts."""
    from vericache.spec.costmodel import DRAFT_MARGIN

    assert 1.03 < DRAFT_MARGIN < 1.15
    prof = _profile(0.6)
    for draft_step, drafts in ((0.002, True), (0.008, True), (0.011, False), (0.013, False)):
        costs = CostModel()
        ks = _simulate(costs, draft_step=draft_step, verify_base=0.02, per_token=0.0, profile=prof)
        e = prof.expected_tokens(costs.prior_rate)
        gain = max(e[k] * 0.02 / (k * draft_step + 0.02) for k in range(17))  # 1.87 .. 1.0
        assert (set(ks[-20:]) != {0}) == drafts == (gain >= DRAFT_MARGIN), (draft_step, gain, ks[-20:])


def test_plain_steps_where_drafting_does_not_pay():
    costs = CostModel()
    # a draft step costs as much as a full step and drafts are rarely accepted
    ks = _simulate(costs, draft_step=0.02, verify_base=0.02, per_token=0.004, profile=_profile(0.2))
    assert ks[-20:] == [0] * 20
    assert costs.snapshot()["plain_share"] > 0.5


def test_plain_steps_where_a_multi_row_pass_costs_a_jump():
    """The CPU case at 7k, batch 1: one row is a matrix-vector product (0.1 s), and any pass
    of more rows pays a jump (+0.08 s) before its per-row cost. Drafts are accepted at 0.82
    and a draft step costs 0.08 s: a k = 2 round (0.16 + 0.19 s for ~2.5 tokens) loses to
    plain steps (0.1 s a token), and the model must see it."""
    costs = CostModel()

    def verify_s(t):
        return 0.1 + (0.08 + 0.005 * t if t > 1 else 0.0)
    chosen = []
    prof = _profile(0.82)
    for _ in range(60):
        k = costs.plan([16], [7000], [prof], [False]).ks[0]
        chosen.append(k)
        if k:
            costs.observe_draft(k, 1, 7000, k * 0.08)
        costs.observe_verify(k + 1, 7000, (k + 1) * 7000, verify_s(k + 1))
    assert chosen[-30:] == [0] * 30
    assert costs.predicted_tps == pytest.approx(10.0, rel=0.1)


def test_a_request_that_does_not_pay_drops_out_of_the_group():
    costs = CostModel()
    good, bad = _profile(0.95), _profile(0.02)
    for _ in range(30):
        plan = costs.plan([16, 16], [1000, 1000], [good, bad], [False, False])
        ks = plan.ks
        steps = max(ks)
        if steps:
            costs.observe_draft(steps, sum(1 for k in ks if k), 2000, steps * 0.002)
        tokens = sum(k + 1 for k in ks)
        costs.observe_verify(tokens, 2000, tokens * 1000, 0.02 + 0.003 * tokens)
    assert plan.predicted_tps > 0
    assert ks[0] >= 4 and ks[1] == 0


def test_a_stale_request_probes_only_where_drafting_could_pay():
    # drafts cost little: a stale request with a poor profile tries again
    costs = CostModel()
    _simulate(costs, 0.002, 0.02, 0.004, _profile(0.05))
    assert costs.plan([16], [1000], [_profile(0.05)], [False]).ks == [0]
    assert costs.plan([16], [1000], [_profile(0.05)], [True]).ks[0] >= 1
    # a draft step costs a full step: even at a high acceptance drafting would not pay
    costs = CostModel()
    _simulate(costs, 0.02, 0.02, 0.004, _profile(0.2))
    assert costs.plan([16], [1000], [_profile(0.2)], [True]).ks == [0]


@pytest.mark.parametrize("link", ["store", "slow-drafter-link"])
def test_switching_between_plain_steps_and_drafting_stays_exact(lm, prompts, link):
    """The per-request switch is reversible: a request on plain steps (k = 0) resumes drafting
    (its drafter feeds every token verified meanwhile in one pass) and stays identical to
    full greedy whatever the sequence of k; its drafter attaches only when it first drafts.
    Over a slow drafter link (remote prefix) the load starts then, in the background, and
    nothing crosses that link before."""
    from conftest import rounds_by_hand

    from vericache.engine.generation import Generation, GenParams
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.store.memory import MemoryStore
    from vericache.store.node import LinkedStore, NodeCache

    ids = prompts["long"][:700]
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=40, ignore_eos=True))
    store = MemoryStore()
    far = NodeCache(LinkedStore(store, 1.0))
    b = (LocalBackends(lm, store) if link == "store"  # attached when it first drafts
         else LocalBackends(lm, store, drafter_store=far, async_attach=True))
    g = Generation(lm, ids, GenParams(mode="vericache", compressor="snapkv", draft_len=8,
                                      max_tokens=40, ignore_eos=True))

    def after(i: int) -> None:
        if i == 3:  # three plain steps: no draft KV yet, nothing read for it
            assert g.rid not in b.drafter.sessions and g.stats.draft_kv_bytes == 0
            assert far.inner.bytes_read == 0

    out = rounds_by_hand(b, g, [0, 0, 0, 8, 0, 3, 8, 0, 0, 1], after)
    b.close()
    assert g.stats.draft_kv_bytes > 0
    if link != "store":
        assert far.inner.bytes_read > 0
    assert out == ref.token_ids
    u = g.usage()
    assert u["plain_rounds"] == g.stats.k_hist[0] >= 5
    # (over the slow link the first drafting round only starts the load)
    assert sum(n for k, n in g.stats.k_hist.items() if k) >= (3 if link == "store" else 2)
    assert u["tokens_per_round"] > 1


def test_warmed_keeps_pooled_acceptance_and_times_but_resets_the_run_counters():
    """A benchmark's untimed warm-up traffic: the prior of new requests is what it pooled
    (a fresh model starts from PRIOR_RATE), the fits stay, the reported counters restart."""
    from vericache.spec.costmodel import PRIOR_RATE

    costs = CostModel()
    _simulate(costs, draft_step=0.002, verify_base=0.02, per_token=0.0005, profile=_profile(0.95))
    for _ in range(10):  # rounds of 16 drafts, 15 accepted
        costs.observe_round(16, 0.1, [(16, 15)])
    pooled, theta = costs.prior_rate, costs.verify.theta.copy()
    assert pooled > PRIOR_RATE + 0.2
    costs.warmed()
    snap = costs.snapshot()
    assert costs.prior_rate == pooled and np.array_equal(costs.verify.theta, theta)
    assert snap["rounds"] == 0 and snap["k_hist"] == {} and snap["fitted"]
    costs.calibrated({"seconds": 1.0})  # a calibration forgets traffic, pooled acceptance too
    assert costs.prior_rate == PRIOR_RATE



def test_an_offloaded_pass_is_priced_at_the_longer_of_load_and_compute():
    """Over an offloaded tier a pass's load runs beside its compute. Fed the tier's stall and
    load seconds (as the engine's rounds do), the model learns the compute alone and the
    load per context token, and prices a pass of 8 x 4k at max(compute, load) at every k,
    from calibration-like rounds at 0.5k-2k; the summed times fitted as one line miss it."""
    load_per_token = 9e-5  # 46 KB a token over 0.5 GB/s

    def compute(tokens, ctx_sum, work):
        return 0.02 + 0.004 * tokens + 0.05 * (tokens > 1) + 0.01 * ctx_sum / 1e4 + 0.002 * work / 1e5

    def model(report_loads: bool) -> CostModel:
        costs = CostModel()
        for batch, ctx in ((1, 1024), (1, 2048), (4, 512)):
            for k in (0, 1, 2, 4, 8):
                tokens, ctx_sum = batch * (k + 1), batch * ctx
                c, load = compute(tokens, ctx_sum, tokens * ctx), load_per_token * ctx_sum
                total = max(c, load) + 0.002  # the pass waits for layers where the load is longer
                extra = {"stall_s": total - c, "load_s": load} if report_loads else {}
                costs.observe_verify(tokens, ctx_sum, tokens * ctx, total, **extra)
        return costs

    loaded, summed = model(True), model(False)
    assert loaded.snapshot()["load_s_per_token"] == pytest.approx(load_per_token)
    assert summed.snapshot()["load_s_per_token"] is None
    errors = []
    for k in (0, 4, 16, 30):
        tokens, work = 8 * (k + 1), 8 * (k + 1) * 4000
        truth = max(compute(tokens, 32000, work), load_per_token * 32000)
        assert loaded.verify_s(tokens, 32000, work) == pytest.approx(truth, rel=0.02), k
        errors.append(abs(summed.verify_s(tokens, 32000, work) / truth - 1))
    assert max(errors) > 0.04, errors


def test_new_requests_are_planned_from_the_pooled_profile_per_position():
    """Acceptance that is bimodal (a round fails in its first drafts or is accepted whole)
    and acceptance at one steady rate pool the same overall rate, 0.968 here. Priced with
    that one rate, a new request's long drafts look as unlikely in both; per position, the
    bimodal traffic's late drafts are accepted once reached, and the plan drafts to the cap
    there while it stops short at the steady rate. Positions no round reached take the rate of
    the last one reached."""
    import random

    def model(rounds):
        costs = CostModel()
        _simulate(costs, draft_step=0.002, verify_base=0.02, per_token=0.0015,
                  profile=_profile(0.6), rounds=30)
        for d, a in rounds:
            costs.observe_round(a + 1, 0.1, [(d, a)])
        return costs

    rng = random.Random(0)
    steady = []
    for _ in range(200):
        a = 0
        while a < 16 and rng.random() < 0.97:
            a += 1
        steady.append((16, a))
    bimodal, flat = model([(16, 16 if i % 3 else 1) for i in range(60)]), model(steady)
    assert bimodal.prior_rate == pytest.approx(flat.prior_rate, abs=0.01)
    rates = bimodal.pooled.rates(24)
    assert rates[1] < bimodal.prior_rate < rates[8] and rates[20] == rates[16]
    k_bimodal = bimodal.plan([24], [1000], [AcceptanceProfile(24)], [False]).ks[0]
    k_flat = flat.plan([24], [1000], [AcceptanceProfile(24)], [False]).ks[0]
    assert k_bimodal == 24 and 4 <= k_flat < 20, (k_bimodal, k_flat)


def test_a_request_that_rejects_more_than_the_pool_drafts_shorter():
    """A request's own rejections scale the pooled rejection rates at the positions it has
    not reached: one that rejected early in every round expects little of long drafts."""
    p = AcceptanceProfile(16)
    pooled = [0.95] * 16
    assert p.rates(pooled) == pytest.approx(pooled)  # no rounds yet: the pooled profile
    for _ in range(6):
        p.update(4, 1)
    assert p.rates(pooled)[8] < 0.85
    q = AcceptanceProfile(16)
    for _ in range(6):
        q.update(4, 4)
    assert q.rates(pooled)[8] > 0.95


def test_a_request_that_could_end_this_round_drafts_to_its_end_when_that_pays():
    """Near max_tokens the round's own goodput misses the pass a request's last few tokens
    would need: with its remaining tokens known, a request drafts to its end when the chance
    of ending (every draft accepted) times that pass pays for the extra drafts, and not when
    ending is unlikely."""
    costs = CostModel()
    _simulate(costs, draft_step=0.004, verify_base=0.02, per_token=0.002, profile=_profile(0.9),
              rounds=40)

    def ks(rate: float, remaining: int, told: bool) -> int:
        p = AcceptanceProfile(24)
        p.reached, p.accepted = [1000] * 24, [int(1000 * rate)] * 24
        cap = min(24, remaining - 1)
        return costs.plan([cap], [1000], [p], [False], [remaining] if told else None).ks[0]

    assert 0 < ks(0.9, 9, told=False) < 8 == ks(0.9, 9, told=True)
    assert ks(0.6, 9, told=True) == ks(0.6, 9, told=False) < 8
    assert ks(0.9, 40, told=True) == ks(0.9, 40, told=False)  # cannot end: no change


def test_a_drafter_starts_only_where_drafting_clearly_pays():
    """A request's first drafting round starts its drafter (its KV prepared and loaded), a
    cost no round's price carries: where drafting is predicted to gain less than
    START_MARGIN over plain steps, a request whose drafter has not started takes plain steps
    while one whose drafter runs drafts; above it both draft. A stale one still probes where
    drafting would pay by START_MARGIN at OPTIMISTIC_RATE."""
    from vericache.spec.costmodel import DRAFT_MARGIN, OPTIMISTIC_RATE, PROBE_K, START_MARGIN

    prof = _profile(0.6)
    for draft_step in (0.008, 0.002):
        costs = CostModel()
        _simulate(costs, draft_step=draft_step, verify_base=0.02, per_token=0.0, profile=prof)
        e = prof.expected_tokens(costs.prior_rate)
        gain = max(e[k] * 0.02 / (k * draft_step + 0.02) for k in range(17))
        plan = lambda started, probe=False: costs.plan(  # noqa: E731
            [16], [1000], [prof], [probe], started=[started]).ks[0]
        assert plan(True) > 0
        if gain < START_MARGIN:
            assert DRAFT_MARGIN < gain and plan(False) == 0, gain
            hopeful = sum(OPTIMISTIC_RATE ** j for j in range(PROBE_K + 1))
            probe_gain = hopeful * 0.02 / (PROBE_K * draft_step + 0.02)
            assert probe_gain > START_MARGIN and plan(False, probe=True) == PROBE_K, probe_gain
        else:
            assert plan(False) == plan(True), gain


def test_a_drafter_starts_only_where_the_time_saved_pays_for_its_start():
    """Above START_MARGIN, the start's measured price (per context token) must also be paid
    back by the time drafting saves over the group's next tokens (each request's remaining,
    at most START_HORIZON): a start that costs more than that keeps plain steps, and more
    tokens left pay for it."""
    from vericache.spec.costmodel import START_HORIZON

    prof = _profile(0.6)
    costs = CostModel()
    _simulate(costs, draft_step=0.002, verify_base=0.02, per_token=0.0, profile=prof)
    plan = lambda left: costs.plan([16], [1000], [prof], [False], [left], [False]).ks[0]  # noqa: E731
    assert plan(64) > 0  # nothing measured yet: the margin alone
    e = prof.expected_tokens(costs.prior_rate)
    k = max(range(1, 17), key=lambda k: e[k] / (0.002 * k + 0.02))
    saved_per_token = 0.02 - (0.002 * k + 0.02) / e[k]  # a plain step's time less a drafted token's
    costs.observe_start(1000, 64 * saved_per_token * 2)  # twice what 64 tokens save
    assert plan(64) == 0 and plan(200) > 0
    assert plan(10_000) == plan(START_HORIZON) > 0


def test_a_drafter_starts_on_an_unseen_plain_step_only_by_the_wider_margin():
    """Where the group's plain step is priced by the line alone (its shape not seen), a
    drafter starts only if drafting beats it by START_MARGIN_UNSEEN; once that plain step has
    been timed, START_MARGIN is enough. A drafter that runs drafts either way."""
    from vericache.spec.costmodel import START_MARGIN, START_MARGIN_UNSEEN

    prof = _profile(0.6)
    costs = CostModel()
    # fitted at 1000 tokens of context only; a pass costs the same at any context here, so the
    # line prices the unseen 3000-token plain step at its true time
    _simulate(costs, draft_step=0.004, verify_base=0.02, per_token=0.0, profile=prof)
    e = prof.expected_tokens(costs.prior_rate)
    gain = max(e[k] * 0.02 / (k * 0.004 + 0.02) for k in range(17))
    assert START_MARGIN < gain < START_MARGIN_UNSEEN, gain
    plan = lambda ctx, started: costs.plan([16], [ctx], [prof], [False],  # noqa: E731
                                           started=[started]).ks[0]
    assert plan(1000, False) > 0  # its plain step seen: the margin is START_MARGIN
    assert plan(3000, False) == 0 and plan(3000, True) > 0  # unseen: the wider margin
    costs.observe_verify(1, 3000, 3000, 0.02)  # the plain step at 3000 tokens, timed
    assert plan(3000, False) > 0


def test_the_engine_prices_a_drafters_start(lm, prompts):
    """A request whose drafter is loaded when it first drafts (a store: `draft_later`): that
    round's draft phase is not learned as steps, it prices the start."""
    from vericache.store.memory import MemoryStore

    costs, snaps = _engine_rounds(lm, prompts["long"][:600], (0, 2), MemoryStore())
    assert snaps[-1]["start_s_per_token"] > 0 and costs.draft.n == 0


def _engine_rounds(lm, ids, ks, store=None):
    """One adaptive-off vericache request through in-process rounds at `ks`: the cost model
    they fed, and its snapshot after each round."""
    from vericache.engine.generation import Generation, GenParams
    from vericache.engine.rounds import LocalBackends, run_round, start

    b = LocalBackends(lm, store)
    g = Generation(lm, ids, GenParams(mode="vericache", compressor="snapkv", draft_len=max(ks),
                                      max_tokens=20, ignore_eos=True, adaptive=False))
    costs, snaps = CostModel(), []
    try:
        start(b, g)
        for k in ks:
            g.draftlen.k = k
            run_round(b, [g], costs)
            snaps.append(costs.snapshot())
    finally:
        b.release(g)
    return costs, snaps


def test_a_group_that_could_end_this_round_drafts_to_its_end_together():
    """Eight requests with 17 tokens left each: one alone drafting to its end lengthens the
    group's draft phase for a single pass saved, all of them together save the group's next
    round; the plan tries both."""
    costs = CostModel()
    _simulate(costs, draft_step=0.02, verify_base=0.2, per_token=0.0005, profile=_profile(0.9),
              rounds=40)

    def ks(rate: float, told: bool) -> list[int]:
        profs = []
        for _ in range(8):
            p = AcceptanceProfile(24)
            p.reached, p.accepted = [1000] * 24, [int(1000 * rate)] * 24
            profs.append(p)
        return costs.plan([16] * 8, [1000] * 8, profs, [False] * 8, [17] * 8 if told else None).ks

    assert max(ks(0.97, told=False)) < 12 and ks(0.97, told=True) == [16] * 8
    assert ks(0.6, told=True) == ks(0.6, told=False)


def test_a_draft_step_that_feeds_unseen_tokens_is_not_learned_as_a_step(lm, prompts):
    """A request's first draft step after plain steps (or its first ever) also feeds the
    verified tokens its drafter has not seen, a pass of many rows: the draft-step fit learns
    only rounds whose drafter was at most one plain step behind."""
    from vericache.engine.generation import Generation, GenParams
    from vericache.engine.rounds import LocalBackends, run_round, start

    b = LocalBackends(lm)
    g = Generation(lm, prompts["long"][:300], GenParams(mode="vericache", compressor="snapkv",
                                                        draft_len=8, max_tokens=40, ignore_eos=True,
                                                        adaptive=False))
    costs, learned = CostModel(), []
    try:
        start(b, g)
        for k in (1, 1, 0, 0, 0, 2, 2, 0, 2):
            g.draftlen.k = k
            run_round(b, [g], costs)
            learned.append(costs.draft.n)
    finally:
        b.release(g)
    assert learned == [0, 1, 1, 1, 1, 1, 2, 2, 3]
    # the verify fit: not the first pass (it pooled the cache), every pass after it
    assert costs.verify.n == len(learned) - 1


def test_a_slow_first_pass_of_a_shape_does_not_price_it():
    """The first pass of a new shape is often slow (memory touched for the first time): its
    bucket's first times enter as their median, so one slow pass does not raise its price."""
    import numpy as np

    f = LinearFit(2)
    x = np.array([1.0, 8.0])
    for y in (0.3, 0.1, 0.1):
        f.observe(x, y, 8)
    assert f.predict(x, 8) == pytest.approx(0.1, rel=0.05)  # the mean would be 0.167
    f.observe(x, 0.2, 8)  # later times move it as a running mean
    assert 0.1 < f.predict(x, 8) < 0.2


def test_one_slow_pass_of_a_seen_shape_moves_its_price_by_at_most_the_outlier_bound():
    """A seen shape's later times enter at most OUTLIER times its estimate: one 18x pass (a
    batch pooled anew) moves the plain step's price a little, not past what drafting costs;
    a machine that stays slower still moves it all the way."""
    import numpy as np

    from vericache.spec.costmodel import OUTLIER

    f = LinearFit(2)
    x = np.array([1.0, 8.0])
    for _ in range(10):
        f.observe(x, 0.25, 8)
    f.observe(x, 4.5, 8)
    assert f.predict(x, 8) <= 0.25 * (1 + f.recency * (OUTLIER - 1)) + 1e-9
    for _ in range(40):
        f.observe(x, 1.0, 8)
    assert f.predict(x, 8) == pytest.approx(1.0, rel=0.02)


def test_committing_a_drafting_requests_outcome_is_priced_into_its_round():
    """A round that drafts also commits each drafting request's outcome to its drafter (an
    RPC per request behind the services): where drafting gains 40% without it, a commit that
    costs more than the gain keeps plain steps; the engine's rounds feed that price."""
    prof = _profile(0.6)

    def last(commit_s):
        costs = CostModel()
        if commit_s:
            costs.observe_commit(4, 4 * commit_s)
        return _simulate(costs, draft_step=0.004, verify_base=0.02, per_token=0.0, profile=prof)[-10:]

    assert set(last(0.0)) != {0}
    assert last(0.03) == [0] * 10


def test_the_engine_feeds_the_commit_price(lm, prompts):
    _, snaps = _engine_rounds(lm, prompts["long"][:300], (0, 4))
    assert snaps[0]["commit_s"] == 0.0  # a plain step commits nothing to price
    assert snaps[1]["commit_s"] > 0.0


def test_finishing_is_priced_by_the_held_steps_once_seen():
    """`finish_within`: 0 without a load (resident), then the load over a one-row pass's
    compute, then over the held steps' own price once MIN_FIT of them were seen (cheaper on a
    CPU, where a loaded pass computes beside its loader)."""
    from vericache.spec.costmodel import MIN_FIT

    m = CostModel()
    for _ in range(MIN_FIT):  # resident one-row 8k passes: nothing to hold
        m.observe_verify(1, 8000, 8000, 0.06)
    assert m.finish_within(8000) == 0
    m = CostModel()
    for _ in range(MIN_FIT):  # loaded: 0.8 s a load beside 0.16 s of compute
        m.observe_verify(1, 8000, 8000, 0.8, stall_s=0.64, load_s=0.8)
    assert m.finish_within(8000) == 5  # 0.8 / 0.16
    for i in range(MIN_FIT - 1):
        m.observe_held(2, 16000, 0.12)  # 0.06 s a request
    assert m.finish_within(8000) == 5
    m.observe_held(2, 16000, 0.12)
    assert m.finish_within(8000) == 13  # 0.8 / 0.06
