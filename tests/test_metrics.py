"""The gateway's metrics through prometheus_client, without a model: each app has its own
registry (two in one process do not collide), engine figures become families, and the lane
utilisation gauge is a busy share over a sliding window."""

from __future__ import annotations

import pytest

from services.gateway.metrics import GatewayMetrics, LaneUtilisation


class Figures:
    """An engine's cheap reads (the `Engine` methods /metrics calls), fixed figures."""

    queue_depth, active = 2, 1

    def metrics(self) -> dict:
        return {"counters": {"requests": 3, "tokens": 40, "store_s": 0.25, "draft_busy_s": 1.5,
                             "selection:question": 2},
                "tau_hist": {1: 2, 4: 3}, "k_hist": {0: 1, 4: 3},
                "kv_bytes": {"drafter": {"in_use": 10, "budget": None},
                             "verifier": {"in_use": 30, "budget": 100}},
                "costs": {"fitted": True}}

    def sessions(self) -> dict:
        return {}


def samples(m: GatewayMetrics) -> dict[str, float]:
    out = {}
    for line in m.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_two_apps_in_one_process_keep_their_own_registries():
    a, b = GatewayMetrics(Figures()), GatewayMetrics(Figures())
    a.observe_response("/v1/completions", 200)
    a.observe_request(ttft_s=0.5, tokens=11, decode_s=1.0, prefill_s=0.2)
    sa, sb = samples(a), samples(b)
    assert sa['vericache_http_responses_total{code="200",route="/v1/completions"}'] == 1
    assert not any(k.startswith("vericache_http_responses_total") for k in sb)
    assert sa["vericache_time_to_first_token_seconds_count"] == 1
    assert sa["vericache_time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert sa["vericache_queue_seconds_sum"] == pytest.approx(0.3)
    assert sa["vericache_time_per_output_token_seconds_sum"] == pytest.approx(0.1)
    assert sb["vericache_time_to_first_token_seconds_count"] == 0


def test_engine_figures_become_families():
    s = samples(GatewayMetrics(Figures()))
    assert s["vericache_requests_total"] == 3 and s["vericache_tokens_total"] == 40
    assert s["vericache_transfer_seconds_total"] == 0.25
    assert s["vericache_tokens_per_round_count"] == 5 and s["vericache_tokens_per_round_sum"] == 14
    assert s['vericache_tokens_per_round_bucket{le="1.0"}'] == 2
    assert s['vericache_tokens_per_round_bucket{le="+Inf"}'] == 5
    assert s['vericache_kv_bytes{side="verifier"}'] == 30
    assert s['vericache_kv_budget_bytes{side="verifier"}'] == 100
    assert 'vericache_kv_budget_bytes{side="drafter"}' not in s  # unbounded
    assert s['vericache_selection_requests_total{policy="question"}'] == 2
    assert s['vericache_draft_len_rounds_total{k="4"}'] == 3
    assert s["vericache_plain_round_share"] == 0.25 and s["vericache_cost_model_fitted"] == 1
    assert s["vericache_queue_depth"] == 2 and s["vericache_active_requests"] == 1


def test_lane_utilisation_is_the_busy_share_of_the_last_window():
    now = [0.0]
    util = LaneUtilisation(window_s=10, clock=lambda: now[0])
    now[0] = 5
    assert util({"draft": 1.0, "verify": 5.0}) == {"draft": 0.2, "verify": 1.0}  # since start
    now[0] = 15  # the reading at 5 s is 10 s old: the window starts there
    assert util({"draft": 3.0, "verify": 5.0}) == {"draft": 0.2, "verify": 0.0}
    now[0] = 26
    assert util({"draft": 3.0, "verify": 30.0}) == {"draft": 0.0, "verify": 1.0}  # clamped
