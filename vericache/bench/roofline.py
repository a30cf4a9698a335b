"""This machine's roofline, and the ratios to the full-KV baselines it projects.

On a CPU a forward pass is bound by memory reads (weights + KV over the read bandwidth) or
by arithmetic (multiply-adds over the matrix-multiply rate), whichever is slower; unlike on a
GPU, verifying k+1 tokens over a long cache costs about k+1 decode steps of arithmetic. So
the ratio VeriCache projects against the full-resident baseline here is well below the
GPU's. It is a projection with every variant at its peak rates, not a cap: a measured ratio
exceeds it where the baseline runs further below its peak than VeriCache does. `measure()` reads the machine's read bandwidth and fp32 matmul rates (fat
products and skinny ≤16-row ones), and, as a profile figure, the rate at which a decode
step's attention (one SDPA call per layer, each KV head's group of query rows folded into
rows, against an 8k cache) reads the KV; `project_ratios()` puts the peaks in the same cost model as
`vericache.bench.project`, with arithmetic added, and the run's τ, k, compression, batch,
budget and link:

    step(rows, ctx, bytes)  = max(bytes / BW, rows · flops(ctx) / FLOPS(rows))
    flops(ctx)              = 2·P + 4·L·H·d·ctx          (weights; QKᵀ and PV per token)
    full resident (budget)  : B_res requests per step, B_res = caches the budget holds
    full offloaded          : B per step; the step also waits on B·F / BW_link
    vericache round         : k draft steps over ctx/r, then a verify pass of B·(k+1) rows
                              whose load B·F / BW_link overlaps its arithmetic;
                              lockstep adds them, staggered overlaps the load with drafting
"""

from __future__ import annotations

import time

import torch


def _best(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(threads: int | None = None) -> dict:
    """Read bandwidth (GB/s) and fp32 matmul rates (GFLOP/s) on this machine, now."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        big = torch.ones(256 << 20 >> 2)  # 256 MiB of fp32
        bw = big.numel() * 4 / _best(lambda: big.sum())
        a, w = torch.randn(512, 576), torch.randn(576, 1536)
        fat = 2 * 512 * 576 * 1536 / _best(lambda: a @ w)
        s, ws = torch.randn(16, 576), torch.randn(576, 1536 * 16)
        skinny = 2 * 16 * 576 * 1536 * 16 / _best(lambda: s @ ws)
        # a decode step's attention as the runner does it: one SDPA call per layer, the G = 3
        # query rows of each KV head folded into rows, against an 8k-token K and V (30 layers
        # x 3 KV heads)
        k, v, q = torch.randn(30, 1, 3, 8192, 64), torch.randn(30, 1, 3, 8192, 64), torch.randn(1, 3, 3, 64)

        def attend():
            for li in range(30):
                torch.nn.functional.scaled_dot_product_attention(q, k[li], v[li])
        attn = 2 * k.numel() * 4 / _best(attend, 3)
    finally:
        torch.set_num_threads(before)
    return {"read_gb_s": bw / 1e9, "matmul_gflop_s": fat / 1e9, "skinny_matmul_gflop_s": skinny / 1e9,
            "decode_attention_kv_gb_s": attn / 1e9, "threads": threads or before}


def flops_per_token(params: int, layers: int, heads: int, head_dim: int, ctx: float) -> float:
    return 2.0 * params + 4.0 * layers * heads * head_dim * ctx


def project_ratios(m: dict, model: dict, run: dict) -> dict:
    """Projected tokens/s of each variant on this machine and VeriCache's ratios.

    m: `measure()`; model: params, layers, heads, head_dim, weight_bytes, kv_per_token,
    draft_kv_per_token (the drafter's K/V dtype; default kv_per_token);
    run: ctx, batch, budget_caches, tau, k, compression, link_gbps, max_tokens."""
    bw, ff, fs = m["read_gb_s"] * 1e9, m["matmul_gflop_s"] * 1e9, m["skinny_matmul_gflop_s"] * 1e9
    W, kvt = model["weight_bytes"], model["kv_per_token"]
    ctx, B, tau, k, r = run["ctx"], run["batch"], run["tau"], run["k"], run["compression"]
    F = ctx * kvt
    link = run["link_gbps"] * 1e9 / 8 if run["link_gbps"] else bw / 2  # unpaced: a memcpy (read + write)
    b_res = max(1, min(B, int(run["budget_caches"] or B)))

    def fl(c):
        return flops_per_token(model["params"], model["layers"], model["heads"], model["head_dim"], c)

    def step(rows, c, nbytes):
        return max(nbytes / bw, rows * fl(c) / (fs if rows <= 16 else ff))

    t_res = step(b_res, ctx, W + b_res * F)
    full_resident = b_res / t_res
    full_offloaded = B / max(step(B, ctx, W + B * F), B * F / link)
    draft_share = model.get("draft_kv_per_token", kvt) / kvt  # a drafter's narrower K/V
    t_draft = step(B, ctx / r, W + B * F / r * draft_share)
    t_vcomp = step(B * (k + 1), ctx, W + B * F)
    t_load = B * F / link
    lock = k * t_draft + max(t_vcomp, t_load)
    stag = max(k * t_draft + t_vcomp, t_load)
    vc_lock, vc_stag = B * tau / lock, B * tau / stag
    return {"full_resident_tps": full_resident, "full_offloaded_tps": full_offloaded,
            "vericache_lockstep_tps": vc_lock, "vericache_staggered_tps": vc_stag,
            "ratio_vs_full_resident_lockstep": vc_lock / full_resident,
            "ratio_vs_full_resident_staggered": vc_stag / full_resident,
            "ratio_vs_full_offloaded_lockstep": vc_lock / full_offloaded,
            "ratio_vs_full_offloaded_staggered": vc_stag / full_offloaded,
            "times_s": {"full_resident_step": t_res, "draft_step": t_draft,
                        "verify_compute": t_vcomp, "verify_load": t_load},
            "inputs": {**m, **run, "full_kv_bytes": F, "resident_batch": b_res}}
