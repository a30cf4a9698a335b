"""The GPU cost model: its limits and projections on hand-made inputs."""

import pytest

from vericache.bench.project import (MACHINES, Machine, break_even_tau, draft_speedup_cap,
                                     link_ceiling_tps, machine, project)

M = Machine("toy", hbm_gb=100, hbm_gbps=1000, link_gbps=50, efficiency=1.0)
W, F = 16e9, 2e9  # 8B fp16 weights; a 2 GB full KV (long context)


def test_draft_speedup_cap():
    assert draft_speedup_cap(1.0, 8) == 1.0  # weights only: compression cannot help
    assert draft_speedup_cap(0.0, 8) == pytest.approx(8.0)
    assert draft_speedup_cap(0.5, 4) == pytest.approx(1 / (0.5 + 0.125))


def test_link_ceiling_and_break_even():
    assert link_ceiling_tps(3.0, 50e9, 2e9) == pytest.approx(75.0)
    assert break_even_tau(1000e9, 50e9) == pytest.approx(20.0)


def test_break_even_is_where_the_link_ceiling_meets_the_resident_kv_rate():
    tau = break_even_tau(M.bw_hbm, M.bw_link)
    assert link_ceiling_tps(tau, M.bw_link, F) == pytest.approx(M.bw_hbm / F)


def test_projection_never_passes_its_limits():
    p = project(M, tau=4.0, k=6, r=8, weight_bytes=W, full_kv_bytes=F, batch=16)
    assert p["full_resident_batch"] == 16  # 42 would fit: the whole batch is resident
    assert p["vericache_staggered_tps"] <= p["link_ceiling_tps"] + 1e-9
    assert p["vericache_staggered_tps"] >= p["vericache_lockstep_tps"]
    assert p["full_offloaded_tps"] == pytest.approx(M.bw_link / F)  # link-bound
    assert p["throughput_ratio_vs_full_offloaded"] > 1


def test_memory_budget_bounds_the_resident_baseline():
    p = project(M, tau=4.0, k=6, r=8, weight_bytes=W, full_kv_bytes=20e9, batch=16)
    assert p["full_resident_batch"] == 4  # (100 - 16) // 20


def test_machines():
    assert set(MACHINES) == {"h200-pcie5", "h100-pcie5", "gh200"}
    assert machine("gh200").bw_link > machine("h200-pcie5").bw_link
    with pytest.raises(ValueError, match="h200-pcie5"):
        machine("a100")


def test_remote_prefix_projection():
    from vericache.bench.project import project_remote_prefix

    # 2 GB prefix: 16 s over a 1 Gbit/s link, 0.08 s over 200 Gbit/s
    p = project_remote_prefix(M, tau=5.0, k=8, r=4, weight_bytes=W, prefix_kv_bytes=F, batch=4,
                              slow_gbps=1, fast_gbps=200, max_tokens=64)
    t_full = (W + 4 * F) / M.bw_hbm
    assert p["full_far_ttft_s"] == pytest.approx(16 + t_full)
    assert p["vericache_ttft_s"] == pytest.approx(0.08 + t_full)
    assert p["ttft_ratio_vs_full"] > 2
    # the verifier decodes alone until the compressed prefix (4 s) lands: 64 tokens take
    # 64 steps of 24 ms (1.5 s), done before then; so the far node's wait is the whole gap
    assert p["throughput_ratio_vs_full_far"] == pytest.approx((16 + 64 * t_full) / (0.08 + 64 * t_full))
    # a drafter that lands at once (fast slow link): rounds of k drafts + one verify pass
    q = project_remote_prefix(M, tau=5.0, k=8, r=4, weight_bytes=W, prefix_kv_bytes=F, batch=4,
                              slow_gbps=1e6, fast_gbps=1e6, max_tokens=64)
    t_draft = (W + 4 * F / 4) / M.bw_hbm
    far, vc = F / 125e12 + 64 * t_full, F / 125e12 + t_full + 63 / 5.0 * (8 * t_draft + t_full)
    assert q["throughput_ratio_vs_full_far"] == pytest.approx(far / vc)


def test_remote_prefix_projection_reports_decoding_next_to_the_store():
    """full_near: the prefix over the fast link, then plain steps; VeriCache's first token
    costs what its first token costs, and against it VeriCache only wins by drafting."""
    from vericache.bench.project import project_remote_prefix

    p = project_remote_prefix(M, tau=5.0, k=8, r=4, weight_bytes=W, prefix_kv_bytes=F, batch=4,
                              slow_gbps=1, fast_gbps=200, max_tokens=64)
    t_full = (W + 4 * F) / M.bw_hbm
    assert p["full_near_ttft_s"] == pytest.approx(0.08 + t_full) == p["vericache_ttft_s"]
    # the 64 tokens are done before the compressed prefix lands (4 s): VeriCache's verifier
    # decodes plainly, as the near node does
    assert p["throughput_ratio_vs_full_near"] == pytest.approx(1.0)
    assert p["throughput_ratio_vs_full_near"] < p["throughput_ratio_vs_full_far"]
    # drafts that land at once: VeriCache against near is its drafting speedup
    q = project_remote_prefix(M, tau=5.0, k=8, r=4, weight_bytes=W, prefix_kv_bytes=F, batch=4,
                              slow_gbps=1e6, fast_gbps=1e6, max_tokens=64)
    t_draft = (W + 4 * F / 4) / M.bw_hbm
    near, vc = F / 125e12 + 64 * t_full, F / 125e12 + t_full + 63 / 5.0 * (8 * t_draft + t_full)
    assert q["throughput_ratio_vs_full_near"] == pytest.approx(near / vc)
