"""The cost model's start-up calibration (vericache/engine/calibrate.py): timed rounds of
synthetic requests through the engine's own backends fit the costs, leave nothing behind, and
let the first real round be planned (no exploring) from what was measured: on a slow
offloaded tier that is drafting, and the output stays full greedy."""

import pytest

from vericache.engine.calibrate import KS, SHAPES, calibrate
from vericache.engine.generation import Generation, GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.lanes import run_requests
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends
from vericache.spec.costmodel import PRIOR_RATE, CostModel
from vericache.store import open_store


def test_calibration_fits_the_costs_and_leaves_no_trace(lm, prompts):
    store = open_store("memory://?capacity_mb=256")
    backends, costs = LocalBackends(lm, store), CostModel()
    info = calibrate(backends, lm, costs, GenParams())
    snap = costs.snapshot()
    assert snap["fitted"] and snap["calibration"]["fitted"]
    assert info["rounds"] == len(SHAPES) * len(KS) and info["seconds"] > 0
    # only times are kept: the synthetic requests' acceptance, rounds and k are forgotten
    assert costs.prior_rate == pytest.approx(PRIOR_RATE)
    assert snap["rounds"] == 0 and snap["k_hist"] == {} and snap["measured_tps"] == 0
    # every calibration session is released; the store holds the synthetic prompt once (the
    # batch's requests and the shorter context share it): at most its 1024 tokens' full KV and
    # its compressed chunks, not one copy per request
    assert not backends.verifier.sessions and not backends.drafter.sessions
    longest = max(c for _, c in SHAPES)
    assert 0 < store.stats()["bytes_stored"] <= 1.5 * longest * lm.runner.kv_bytes_per_token()
    # the first real request is planned from the fits (no exploring round), and exact
    p = GenParams(max_tokens=12)
    out = generate(lm, prompts["code"], p, backends, costs)
    assert costs.snapshot()["explore_rounds"] == 0
    assert out.token_ids == generate(lm, prompts["code"], GenParams(mode="full", max_tokens=12)).token_ids
    backends.close()


def test_on_a_slow_offloaded_tier_the_first_round_drafts(lm, prompts):
    """Full KV behind a 1 Gbit/s link: a verify pass costs the link (a 1k-token cache is
    ~46 MB, ~0.37 s) and a draft step far less, so the model calibrated (at half the default
    shapes' contexts, which keeps the link's share of the test short) drafts from the first
    round even at the prior acceptance rate; exactly full greedy."""
    tier = make_tier("offloaded", 1.0, "cpu")
    backends, costs = LocalBackends(lm, None, tier), CostModel()
    calibrate(backends, lm, costs, GenParams(), shapes=[(b, c // 2) for b, c in SHAPES])
    assert tier.stats.bytes_loaded > 0  # the calibration's verify passes went through the link
    ids = prompts["long"][:1000]
    g = Generation(lm, ids, GenParams(max_tokens=16), request_id="slow-link")
    run_requests(backends, [g], costs=costs)
    backends.close()
    tier.close()
    assert costs.snapshot()["explore_rounds"] == 0
    # at most the last round is a plain step (k is capped by the one token left)
    assert g.stats.k_hist.get(0, 0) <= 1 and g.stats.drafted >= 4, g.stats.k_hist
    assert g.output_ids == generate(lm, ids, GenParams(mode="full", max_tokens=16)).token_ids


def test_a_short_context_model_calibrates_at_what_fits(lm):
    """Shapes longer than the model's context are cut to fit (a 2k shape on a 700-token
    model), and the fits still come out."""
    import dataclasses

    small = dataclasses.replace(lm, max_context=700)
    costs = CostModel()
    info = calibrate(LocalBackends(small), small, costs, GenParams())
    assert info["fitted"] and max(c for _, c in info["shapes"]) <= 700 - 64
